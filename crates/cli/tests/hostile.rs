//! Hostile inputs (issue 12): every absurd flag, path and file a user can give is refused with exit
//! code 1 and a message that names it and says what to do, within seconds and before any long work;
//! outputs never destroy what they did not name; and the interop details (input normalization in
//! checkpoints, `--data-seed`, `--max-steps` across epochs, empty validation, evaluation micro-batch,
//! shared defaults) hold.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A row finishes well within this (debug build, shared 2-core machine).
const QUICK: Duration = Duration::from_secs(5);

fn memfit(args: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_memfit")).args(args).output().expect("the memfit binary runs");
    (out, start.elapsed())
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A fresh directory of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// A successful run's JSON report.
fn report(args: &[&str], path: &Path) -> Value {
    let mut all: Vec<&str> = args.to_vec();
    let p = s(path);
    all.extend(["--report", &p]);
    let (out, _) = memfit(&all);
    assert!(out.status.success(), "memfit {all:?} failed:\n{}", text(&out));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The safetensors metadata of a checkpoint (8-byte little-endian header length, then JSON).
fn safetensors_metadata(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    header["__metadata__"].clone()
}

#[test]
fn every_absurd_input_is_refused_clearly_and_quickly() {
    let dir = scratch("table");
    let target = dir.join("precious.txt");
    std::fs::write(&target, "the user's file").unwrap();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let pt = dir.join("model.pt");
    std::fs::write(&pt, b"PK\x03\x04 a zip archive as torch.save writes it").unwrap();
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a checkpoint").unwrap();
    let same = dir.join("same.out");
    let run_svg = dir.join("run.svg");
    let missing_dir = dir.join("no-such-dir").join("model.safetensors");
    let saved = dir.join("diverged.safetensors");
    let (t, l, p, g, sm, svg, md, sv, d) =
        (s(&target), s(&link), s(&pt), s(&garbage), s(&same), s(&run_svg), s(&missing_dir), s(&saved), s(&dir));

    let train = ["train", "--data", "embedded"];
    // (arguments after `train --data embedded` or a whole command line, words the message must hold)
    let rows: Vec<(Vec<&str>, Vec<&str>)> = vec![
        // sizes and counts
        (
            [&train[..], &["--epochs", "9223372036854775808"]].concat(),
            vec!["--epochs", "9223372036854775808", "0..=1000000"],
        ),
        (
            [&train[..], &["--batch-size", "18446744073709551615"]].concat(),
            vec!["--batch-size", "18446744073709551615"],
        ),
        ([&train[..], &["--batch-size", "0"]].concat(), vec!["--batch-size", "'0'"]),
        ([&train[..], &["--micro-batch", "0"]].concat(), vec!["--micro-batch", "'0'"]),
        ([&train[..], &["--max-steps", "0"]].concat(), vec!["--max-steps", "'0'"]),
        ([&train[..], &["--max-steps", "-1"]].concat(), vec!["--max-steps", "-1"]),
        ([&train[..], &["--threads", "0"]].concat(), vec!["--threads", "'0'"]),
        ([&train[..], &["--threads", "100000"]].concat(), vec!["--threads", "100000"]),
        (vec!["bench", "--steps", "100000000"], vec!["--steps", "100000000", "1..=10000"]),
        (vec!["bench", "--warmup", "100000000"], vec!["--warmup", "100000000"]),
        (vec!["bench", "--rounds", "1000"], vec!["--rounds", "1000", "1..=100"]),
        (vec!["bench", "--threads", "0"], vec!["--threads", "'0'"]),
        (vec!["generate", "--load", &g, "--prompt", "a", "--threads", "100000"], vec!["--threads", "100000"]),
        (vec!["generate", "--load", &g, "--prompt", "a", "--tokens", "100000000"], vec!["--tokens", "100000000"]),
        // rates, fractions, capacities
        ([&train[..], &["--lr", "inf"]].concat(), vec!["--lr", "inf", "finite learning rate above 0"]),
        ([&train[..], &["--lr", "NaN"]].concat(), vec!["--lr", "NaN", "finite"]),
        ([&train[..], &["--lr", "0"]].concat(), vec!["--lr", "'0'", "above 0"]),
        ([&train[..], &["--lr", "-1e-3"]].concat(), vec!["--lr", "-1e-3"]),
        (vec!["plan", "--model", "mlp", "--memory", "64MiB", "--batch-size", "8", "--lr", "nan"], vec!["--lr", "nan"]),
        ([&train[..], &["--safety-margin", "2"]].concat(), vec!["--safety-margin", "'2'", "0 to 0.5"]),
        ([&train[..], &["--safety-margin", "nan"]].concat(), vec!["--safety-margin", "nan"]),
        ([&train[..], &["--memory", "2048TiB"]].concat(), vec!["--memory", "2048TiB", "1024TiB"]),
        ([&train[..], &["--memory", "99999999999999999999TiB"]].concat(), vec!["--memory", "99999999999999999999TiB"]),
        ([&train[..], &["--memory", "12XB"]].concat(), vec!["--memory", "12XB"]),
        ([&train[..], &["--inject-oom", "0"]].concat(), vec!["--inject-oom", "'0'"]),
        (
            vec!["generate", "--load", &g, "--prompt", "a", "--temperature", "inf"],
            vec!["--temperature", "inf", "0 (greedy) to 100"],
        ),
        (vec!["generate", "--load", &g, "--prompt", "a", "--temperature", "-1"], vec!["--temperature", "-1"]),
        (
            vec!["plan", "--model", "deepcnn", "--memory", "64MiB", "--batch-size", "8", "--input", "99999999x1x1"],
            vec!["--input", "99999999x1x1", "channels 1 to 4096"],
        ),
        (
            vec!["plan", "--model", "deepcnn", "--memory", "64MiB", "--batch-size", "8", "--input", "0x28x28"],
            vec!["--input", "0x28x28"],
        ),
        (vec!["train", "--model", "vgg"], vec!["--model", "vgg", "mlp, simplecnn, deepcnn, resnet, gpt"]),
        // inputs that are not regular files, or not safetensors
        (
            [&train[..], &["--load", "/dev/zero"]].concat(),
            vec!["--load", "/dev/zero", "a device", "not a regular file"],
        ),
        ([&train[..], &["--load", &d]].concat(), vec!["--load", &d, "a directory"]),
        (vec!["generate", "--load", "/dev/zero", "--prompt", "a"], vec!["--load", "/dev/zero", "a device"]),
        (vec!["train", "--model", "gpt", "--data", "/dev/zero"], vec!["--data", "/dev/zero", "a device"]),
        (
            vec!["plan", "--model", "gpt", "--data", "/dev/zero", "--memory", "64MiB", "--batch-size", "8"],
            vec!["--data", "/dev/zero", "a device"],
        ),
        (
            [&train[..], &["--epochs", "0", "--load", &p]].concat(),
            vec![&p, "PyTorch pickle", "memfit reads safetensors"],
        ),
        ([&train[..], &["--epochs", "0", "--load", &g]].concat(), vec![&g, "not a valid safetensors file"]),
        // outputs that would destroy something, or cannot be written
        ([&train[..], &["--save", "/dev/null"]].concat(), vec!["--save", "/dev/null", "a device", "regular files"]),
        ([&train[..], &["--save", &l]].concat(), vec!["--save", &l, "symbolic link"]),
        ([&train[..], &["--report", &l]].concat(), vec!["--report", &l, "symbolic link"]),
        ([&train[..], &["--save", &d]].concat(), vec!["--save", &d, "a directory"]),
        ([&train[..], &["--save", &md]].concat(), vec!["--save", &md, "does not exist"]),
        ([&train[..], &["--save", &sm, "--report", &sm]].concat(), vec!["--save", "--report", "the same file"]),
        ([&train[..], &["--report", &svg]].concat(), vec!["--report", "its curves", "the same file"]),
        ([&train[..], &["--save", &t, "--load", &t]].concat(), vec!["--save", "--load", "the same file"]),
        (
            [&train[..], &["--profile-on-oom", "/dev/null"]].concat(),
            vec!["--profile-on-oom", "/dev/null", "not a directory"],
        ),
        (vec!["profile", "--data", "embedded", "--out", "/dev/null"], vec!["--out", "/dev/null", "not a directory"]),
        // training that diverges: exit 1 naming the step, nothing saved
        ([&train[..], &["--lr", "1e30", "--max-steps", "3", "--no-eval"]].concat(), vec!["loss at step 2", "diverged"]),
        (
            [&train[..], &["--lr", "1e300", "--max-steps", "1", "--save", &sv]].concat(),
            vec!["after step 1", "NaN or infinity", "nothing is saved"],
        ),
        // ranks: an unknown mode, absurd device counts, and what each mode cannot do
        ([&train[..], &["--parallel", "ring"]].concat(), vec!["--parallel", "data, zero1 or pipeline"]),
        (
            vec!["plan", "--model", "mlp", "--memory", "64MiB", "--batch-size", "8", "--devices", "0"],
            vec!["--devices", "0"],
        ),
        (
            vec!["plan", "--model", "mlp", "--memory", "64MiB", "--batch-size", "8", "--devices", "5000"],
            vec!["--devices"],
        ),
        ([&train[..], &["--parallel", "zero1", "--save-dir", &d]].concat(), vec!["--save-dir", "--parallel zero1"]),
        ([&train[..], &["--parallel", "pipeline", "--save-dir", &d]].concat(), vec!["--parallel pipeline"]),
        (
            [&train[..], &["--parallel", "pipeline", "--checkpoint", "blocks.0"]].concat(),
            vec!["--checkpoint", "pipeline"],
        ),
        // an injected fault with no cap: no advice to set a cap
        (
            [&train[..], &["--inject-oom", "1", "--max-steps", "1"]].concat(),
            vec!["injected by --inject-oom", "not a shortage of memory"],
        ),
    ];
    let mut problems = Vec::new();
    for (args, words) in &rows {
        let (out, took) = memfit(args);
        let t = text(&out);
        if out.status.code() != Some(1) {
            problems.push(format!("memfit {args:?}: exit {:?}, expected 1:\n{t}", out.status.code()));
        }
        for w in words {
            if !t.contains(w) {
                problems.push(format!("memfit {args:?}: the message lacks {w:?}:\n{t}"));
            }
        }
        if took > QUICK {
            problems.push(format!("memfit {args:?} took {took:?}"));
        }
        for repeated in ["error: error", "cannot load checkpoint", "panicked", "--memory 2"] {
            if t.contains(repeated) {
                problems.push(format!("memfit {args:?}: the message holds {repeated:?}:\n{t}"));
            }
        }
        // A path named in a message is named once: no prefix repeated by each layer.
        for p in [&p, &g] {
            if t.matches(p.as_str()).count() > 1 {
                problems.push(format!("memfit {args:?}: {p} is named more than once:\n{t}"));
            }
        }
    }
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n\n"));

    // Nothing was destroyed: the symlink's target, the device, and no diverged weights were written.
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "the user's file");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    assert!(!saved.exists(), "diverged weights were saved");
    assert!(!same.exists() && !run_svg.exists());
}

#[test]
fn the_unknown_model_error_lists_only_models_every_command_takes() {
    let (out, _) = memfit(&["train", "--model", "vgg"]);
    let t = text(&out);
    let list = t.split("expected one of ").nth(1).unwrap().lines().next().unwrap();
    for model in list.split(", ") {
        for args in [
            vec!["train", "--model", model, "--data", "embedded", "--device", "meta", "--max-steps", "1", "--no-eval"],
            vec!["plan", "--model", model, "--memory", "1GiB", "--batch-size", "2", "--layers", "1", "--d-model", "16"],
            vec!["profile", "--model", model, "--device", "meta", "--steps", "1", "--out", "/dev/null"],
        ] {
            let (out, _) = memfit(&args);
            assert!(!text(&out).contains("unknown model"), "memfit {args:?}:\n{}", text(&out));
        }
    }
}

#[test]
fn a_huge_batch_plans_in_bounded_time_and_memory() {
    // The planner once walked 3 x batch samples: a billion was killed by the host's OOM killer.
    let (out, took) =
        memfit(&["plan", "--model", "simplecnn", "--memory", "64MiB", "--batch-size", "1000000000", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(took < QUICK, "planning a billion-sample batch took {took:?}");
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["effective_batch"], 1_000_000_000u64);
    assert!(p["predicted_peak_reserved_bytes"].as_u64().unwrap() <= 64 << 20);
    let args = ["train", "--data", "embedded", "--batch-size", "1000000000", "--memory", "64MiB", "--device", "meta"];
    let (out, took) = memfit(&[&args[..], &["--max-steps", "1"]].concat());
    assert!(out.status.success(), "{}", text(&out));
    assert!(took < QUICK, "a billion-sample batch on meta took {took:?}");
}

/// Four 28x28 training images and labels, and a validation split with none.
fn empty_validation_dir() -> PathBuf {
    let dir = scratch("empty-val");
    let images = |n: u32| {
        let mut b = [0x0803u32.to_be_bytes(), n.to_be_bytes(), 28u32.to_be_bytes(), 28u32.to_be_bytes()].concat();
        b.extend((0..n as usize * 784).map(|i| (i % 251) as u8));
        b
    };
    let labels = |n: u32| {
        let mut b = [0x0801u32.to_be_bytes(), n.to_be_bytes()].concat();
        b.extend((0..n as u8).map(|i| i % 10));
        b
    };
    std::fs::write(dir.join("train-images-idx3-ubyte"), images(4)).unwrap();
    std::fs::write(dir.join("train-labels-idx1-ubyte"), labels(4)).unwrap();
    std::fs::write(dir.join("t10k-images-idx3-ubyte"), images(0)).unwrap();
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), labels(0)).unwrap();
    dir
}

#[test]
fn an_empty_validation_set_is_no_validation_not_zero_accuracy() {
    let dir = empty_validation_dir();
    let path = dir.join("run.json");
    let r = report(&["train", "--model", "mlp", "--data", &s(&dir), "--batch-size", "2", "--max-steps", "1"], &path);
    assert!(r["val_accuracy"].is_null(), "{r}");
    assert!(r["val_loss"].is_null(), "{r}");
    let (out, _) = memfit(&["train", "--model", "mlp", "--data", &s(&dir), "--batch-size", "2", "--max-steps", "1"]);
    assert!(text(&out).contains("no validation"), "{}", text(&out));
}

#[test]
fn evaluation_honours_the_micro_batch() {
    let dir = scratch("eval-micro");
    let args = ["train", "--data", "embedded", "--batch-size", "32", "--micro-batch", "8", "--max-steps", "1"];
    let r = report(&[&args[..], &["--device", "meta"]].concat(), &dir.join("run.json"));
    assert_eq!(r["eval_micro_batch"], 8, "{r}");
    assert_eq!(r["plan"]["micro_batch"], 8);
}

#[test]
fn plan_and_train_share_the_learning_rate_default() {
    let dir = scratch("lr");
    for (model, extra) in [("simplecnn", vec![]), ("gpt", vec!["--layers", "1", "--d-model", "16", "--context", "8"])] {
        let mut plan = vec!["plan", "--model", model, "--memory", "1GiB", "--batch-size", "4", "--json"];
        plan.extend(&extra);
        let (out, _) = memfit(&plan);
        assert!(out.status.success(), "{}", text(&out));
        let p: Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut train = vec!["train", "--model", model, "--data", "embedded", "--device", "meta", "--max-steps", "1"];
        train.extend(&extra);
        let r = report(&train, &dir.join(format!("{model}.json")));
        assert!(p["lr"].is_f64(), "{p}");
        assert_eq!(p["lr"], r["lr"], "{model}: plan's lr default is train's");
    }
}

#[test]
fn the_data_seed_orders_the_data_and_the_seed_initializes() {
    let dir = scratch("seeds");
    let run = |extra: &[&str], name: &str| {
        let args =
            [&["train", "--model", "mlp", "--data", "embedded", "--max-steps", "2", "--no-eval"][..], extra].concat();
        report(&args, &dir.join(name))["final_train_loss"].as_f64().unwrap()
    };
    let default = run(&["--seed", "3"], "default.json");
    // The default data seed is the seed: existing runs are unchanged.
    assert_eq!(default, run(&["--seed", "3", "--data-seed", "3"], "same.json"));
    let other_data = run(&["--seed", "3", "--data-seed", "4"], "data.json");
    let other_init = run(&["--seed", "4", "--data-seed", "3"], "init.json");
    assert_ne!(default, other_data, "--data-seed changes the data order");
    assert_ne!(default, other_init, "--seed changes the initialization");
    assert_ne!(other_data, other_init);
}

#[test]
fn max_steps_runs_across_epochs() {
    // The embedded split has 8,000 training images: at batch 4,000 an epoch is two steps.
    let dir = scratch("max-steps");
    let args =
        ["train", "--model", "mlp", "--data", "embedded", "--batch-size", "4000", "--device", "meta", "--no-eval"];
    let r = report(&[&args[..], &["--max-steps", "5"]].concat(), &dir.join("five.json"));
    assert_eq!(r["steps"], 5, "{r}");
    assert_eq!(r["epochs"], 3);
    assert_eq!(r["samples_seen"], 5 * 4000);
    // With both, whichever ends first.
    let r = report(&[&args[..], &["--max-steps", "5", "--epochs", "1"]].concat(), &dir.join("one.json"));
    assert_eq!(r["steps"], 2, "{r}");
}

#[test]
fn checkpoints_record_the_input_normalization() {
    let dir = scratch("normalization");
    let ckpt = dir.join("model.safetensors");
    let (out, _) = memfit(&[
        "train",
        "--model",
        "mlp",
        "--data",
        "embedded",
        "--max-steps",
        "1",
        "--no-eval",
        "--save",
        &s(&ckpt),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let meta = safetensors_metadata(&ckpt);
    assert_eq!(meta["memfit.input.normalization"], "x = (pixel / 255 - mean) / std", "{meta}");
    // Fashion-MNIST's training-set statistics, as torchvision users normalize with.
    let mean: f64 = meta["memfit.input.mean"].as_str().unwrap().parse().unwrap();
    let std: f64 = meta["memfit.input.std"].as_str().unwrap().parse().unwrap();
    assert!((mean - 0.2860).abs() < 1e-6 && (std - 0.3530).abs() < 1e-6, "{meta}");
    // Saving again replaces the file (atomically), and leaves no temporary files behind.
    let (out, _) = memfit(&[
        "train",
        "--model",
        "mlp",
        "--data",
        "embedded",
        "--max-steps",
        "1",
        "--no-eval",
        "--save",
        &s(&ckpt),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["model.safetensors".to_string()]);
}
