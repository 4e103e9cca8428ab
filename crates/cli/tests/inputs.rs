//! What a new user types, and what memfit says back (issue 28, part 4): wrong inputs are named for
//! what they are, before any data loads; a user's files are never overwritten; progress figures are
//! exact; recoveries are announced as they happen; the names of a concept are the same everywhere.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn memfit(args: &[&str]) -> Output {
    let cache = scratch("costs");
    Command::new(env!("CARGO_BIN_EXE_memfit")).args(args).env("MEMFIT_CACHE_DIR", cache).output().expect("runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn refused(args: &[&str], says: &[&str]) -> String {
    let out = memfit(args);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}:\n{t}");
    for s in says {
        assert!(t.contains(s), "{args:?} should say {s:?}:\n{t}");
    }
    assert!(!t.contains("panicked"), "{t}");
    t
}

#[test]
fn wrong_files_are_named_for_what_they_are_before_the_data_loads() {
    let notes = scratch("notes.txt");
    std::fs::write(&notes, "call me ishmael").unwrap();
    let n = notes.to_str().unwrap();
    refused(&["train", "--model", "mlp", "--data", n], &["is a file, not a folder", "--model gpt"]);
    // A GPT's weights given to the default model: its metadata names the model.
    let gpt = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "8"];
    let weights = scratch("gpt.safetensors");
    let w = weights.to_str().unwrap();
    let save_dir = scratch("runs/gpt");
    let _ = std::fs::remove_dir_all(&save_dir);
    let d = save_dir.to_str().unwrap();
    let args = [&["train"][..], &gpt, &["--max-steps", "1", "--no-eval", "--save", w, "--save-dir", d]].concat();
    let out = memfit(&args);
    assert!(out.status.success(), "--save-dir with missing parents is created:\n{}", text(&out));
    let t = refused(&["train", "--load", w, "--max-steps", "1"], &["holds a gpt model", "add --model gpt"]);
    assert!(!t.contains("data: "), "checked before the data loads:\n{t}");
    // A training checkpoint's JSON given to --load.
    let json = std::fs::read_dir(&save_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "json"))
        .unwrap();
    let args = [&["train"][..], &gpt, &["--load", json.to_str().unwrap()]].concat();
    refused(&args, &["is JSON, not safetensors", "--resume DIR"]);
    // A folder given to --checkpoint (activation checkpointing), before the data loads.
    let t = refused(&["train", "--model", "gpt", "--checkpoint", d], &["--save-dir", "--resume"]);
    assert!(!t.contains("data: "), "{t}");
}

#[test]
fn a_report_replaces_only_a_report() {
    let notes = scratch("report-notes.txt");
    std::fs::write(&notes, "my notes").unwrap();
    let n = notes.to_str().unwrap();
    let run = ["train", "--model", "mlp", "--device", "meta", "--max-steps", "1", "--no-eval"];
    refused(&[&run[..], &["--report", n]].concat(), &["is not a report memfit wrote", "does not overwrite"]);
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes");
    // A memfit report (and its curves) is replaced.
    let report = scratch("run.json");
    let r = report.to_str().unwrap();
    for _ in 0..2 {
        let out = memfit(&[&run[..], &["--report", r]].concat());
        assert!(out.status.success(), "{}", text(&out));
    }
    // Curves beside a new report, drawn by someone else, are not replaced either.
    let other = scratch("other.svg");
    std::fs::write(&other, "<svg/>").unwrap();
    let o = scratch("other.json");
    refused(&[&run[..], &["--report", o.to_str().unwrap()]].concat(), &["other.svg", "training curves"]);
}

#[test]
fn progress_is_exact_and_recoveries_are_announced() {
    // 64 samples in micro-batches of 13: five, the last of 12.
    let out = memfit(&["plan", "--model", "mlp", "--micro-batch", "13", "--memory", "64MiB"]);
    assert!(text(&out).contains("micro-batch 13 x 5 accumulation steps, the last of 12, = effective batch 64"));
    // A forced micro-batch far above the budget: each recovery is said as it happens.
    let out = memfit(&["train", "--data", "embedded", "--micro-batch", "64", "--memory", "2MiB", "--max-steps", "2"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("step 1: out of memory") && t.contains("recovered: the same samples ran again"), "{t}");
    assert!(t.contains("with no sample lost; planned micro-batch 64 x 1, micro-batch"), "{t}");
    // A batch above the training set is the training set.
    let report = scratch("huge-batch.json");
    let args = ["train", "--data", "embedded", "--model", "mlp", "--device", "meta", "--batch-size", "1000000000"];
    let out = memfit(&[&args[..], &["--max-steps", "1", "--no-eval", "--report", report.to_str().unwrap()]].concat());
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("--batch-size 1000000000 is more than the 8000 training samples"), "{t}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["samples_seen"], 8000, "{r}");
}

#[test]
fn evaluation_stays_within_the_training_step_and_no_eval_predicts_no_evaluation() {
    let plan = |extra: &[&str]| -> Value {
        let out = memfit(&[&["plan", "--model", "gpt", "--memory", "1GiB", "--json"][..], extra].concat());
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let p = plan(&[]);
    assert_eq!(p["predicted_peak_reserved_bytes"], p["training_peak_reserved_bytes"], "{p}");
    assert!(p["eval_micro_batch"].as_u64().unwrap() >= 1);
    // A --no-eval run's prediction is its training steps', and it holds on meta.
    let report = scratch("no-eval.json");
    let out = memfit(&[
        "train",
        "--model",
        "gpt",
        "--memory",
        "1GiB",
        "--device",
        "meta",
        "--max-steps",
        "3",
        "--no-eval",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["predicted_peak_allocated_bytes"], r["peak_allocated_bytes"], "{r}");
    assert_eq!(r["predicted_peak_reserved_bytes"], r["peak_reserved_bytes"], "{r}");
}

#[test]
fn one_name_per_concept_with_the_old_ones_kept() {
    for args in [["profile", "--max-steps"], ["profile", "--steps"]] {
        let out_dir = scratch(&format!("profile{}", args[1]));
        let _ = std::fs::remove_dir_all(&out_dir);
        let out =
            memfit(&[args[0], "--model", "mlp", "--device", "meta", args[1], "1", "--out", out_dir.to_str().unwrap()]);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        assert!(text(&out).contains("profile of 1 step"), "{}", text(&out));
    }
    for args in [["--model", "MLP"], ["--case", "mlp-b256"]] {
        let out = memfit(&[&["bench", "--steps", "1", "--warmup", "0", "--json"][..], &args].concat());
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = r["cases"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["mlp-b256"], "{args:?}");
    }
}

/// `generate` and `bench` compute, so meta is refused with what to use; without a GPU, cuda is one
/// error naming the missing driver before any work (the tests' machines have none; with a GPU the
/// commands run, checked by tools/gpu-check).
#[test]
fn generate_and_bench_take_a_computing_device() {
    for cmd in [&["bench", "--model", "mlp"][..], &["generate", "--load", "x.safetensors", "--prompt", "a"][..]] {
        let mut args = cmd.to_vec();
        args.extend(["--device", "meta"]);
        refused(&args, &["meta computes nothing", "use cpu or cuda"]);
    }
    if memfit_tensor::Device::probe(memfit_tensor::DeviceKind::Cuda(0)).is_err() {
        refused(&["bench", "--model", "mlp", "--device", "cuda"], &["--device cuda"]);
    } else {
        println!("skipped: a GPU is present, so `bench --device cuda` runs instead of being refused");
    }
}
