//! Real MPI jobs (2 ranks, `mpirun --timeout`), against one process: data parallel and ZeRO-1 give
//! the single-process update, each rank's measured peak is the meta prediction of `plan --devices`,
//! out-of-memory recovery under ranks loses no sample, and a failing rank ends the job at once.
//! Needs an MPI library: `cargo test -p memfit --features mpi --test mpi` (what `.ci/run` does).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One job at a time: two ranks already use both cores.
static JOBS: Mutex<()> = Mutex::new(());

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-mpi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `mpirun` with the given arguments (bounded by its own `--timeout`), in `dir`.
fn mpirun(dir: &Path, args: &[&str]) -> Output {
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    Command::new("mpirun")
        .args(["--timeout", "240", "--oversubscribe", "--bind-to", "none"])
        .args(args)
        .current_dir(dir)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .expect("mpirun runs (install openmpi-bin)")
}

fn memfit_alone(dir: &Path, args: &[&str]) -> Output {
    let _one = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    Command::new(env!("CARGO_BIN_EXE_memfit")).args(args).current_dir(dir).output().unwrap()
}

fn ok(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "failed: {:?}\nstdout: {}\nstderr: {stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two ranks of `memfit args`.
fn ranks(dir: &Path, args: &[&str]) -> Output {
    let mut all = vec!["-np", "2", env!("CARGO_BIN_EXE_memfit")];
    all.extend_from_slice(args);
    mpirun(dir, &all)
}

fn weights(path: &Path) -> Vec<(String, Vec<f64>)> {
    let device = memfit_tensor::Device::cpu();
    let mut named = memfit_nn::checkpoint::load_named(path, &device, memfit_tensor::Category::Parameter).unwrap();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect()
}

/// The largest difference between two sets of weights, relative to the largest weight.
fn difference(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(a.iter().map(|(n, _)| n).collect::<Vec<_>>(), b.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let scale = a.iter().flat_map(|(_, v)| v).fold(0.0f64, |m, v| m.max(v.abs()));
    let diff =
        a.iter().zip(b).flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f64::max);
    diff / scale
}

fn report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// SGD with momentum: its update is linear in the gradient, so a sum in another order stays within
/// float rounding (Adam's normalisation magnifies the rounding of near-zero gradients).
#[rustfmt::skip]
const MLP: &[&str] = &[
    "train", "--data", "embedded", "--model", "mlp", "--batch-size", "64", "--max-steps", "12", "--threads", "1",
    "--seed", "4", "--optimizer", "sgd", "--lr", "0.05",
];

fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

#[test]
fn data_parallel_and_zero1_make_the_single_process_update() {
    let dir = scratch("update");
    let alone = ok(&memfit_alone(&dir, &with(MLP, &["--save", "one.safetensors", "--report", "one.json"])));
    assert!(alone.contains("trained mlp"), "{alone}");
    let data = ok(&ranks(&dir, &with(MLP, &["--parallel", "data", "--save", "dp.safetensors", "--report", "dp.json"])));
    assert!(data.contains("ranks (data parallel, 2 ranks)"), "{data}");
    ok(&ranks(&dir, &with(MLP, &["--parallel", "zero1", "--save", "z.safetensors", "--report", "z.json"])));
    let (one, dp, z) = (
        weights(&dir.join("one.safetensors")),
        weights(&dir.join("dp.safetensors")),
        weights(&dir.join("z.safetensors")),
    );
    // Gradients summed in another order: equal within float rounding, after 12 steps.
    let d = difference(&one, &dp);
    assert!(d > 0.0 && d < 1e-5, "data parallel vs one process: {d}");
    // ZeRO-1 applies the same update to the same gradients: identical bits.
    assert_eq!(dp, z, "ZeRO-1 and data parallel differ");
    let (one, dp, z) = (report(&dir.join("one.json")), report(&dir.join("dp.json")), report(&dir.join("z.json")));
    // The same global batches: the same samples, losses and sharded-then-summed validation.
    assert_eq!(one["samples_seen"], dp["samples_seen"]);
    let close = |a: &serde_json::Value, b: &serde_json::Value| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4;
    assert!(
        close(&one["final_train_loss"], &dp["final_train_loss"]),
        "{} vs {}",
        one["final_train_loss"],
        dp["final_train_loss"]
    );
    assert!(close(&one["val_loss"], &dp["val_loss"]), "{} vs {}", one["val_loss"], dp["val_loss"]);
    assert!(close(&one["val_accuracy"], &dp["val_accuracy"]));
    let state =
        |r: &serde_json::Value, rank: usize| r["parallel"]["per_rank"][rank]["optimizer_state_bytes"].as_u64().unwrap();
    let full = state(&dp, 0);
    assert_eq!(state(&dp, 1), full);
    // ZeRO-1: each rank keeps half the state, to an element (each slice's state rounded to 512-byte blocks).
    for rank in 0..2 {
        assert!(state(&z, rank) <= full / 2 + 2 * 512, "rank {rank} holds {} of {full}", state(&z, rank));
    }
    assert!(state(&z, 0) + state(&z, 1) >= full);
    assert_eq!(dp["parallel"]["per_rank"][0]["communication_bytes"], serde_json::json!(1 << 20));
}

#[test]
fn each_rank_peak_is_the_meta_prediction() {
    let dir = scratch("peaks");
    let gpt = with(SMALL_GPT, &["--batch-size", "12", "--memory", "24MiB"]);
    let plan = ok(&memfit_alone(&dir, &with(&["plan", "--json", "--devices", "2"], &gpt)));
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    for (i, mode) in ["data", "zero1"].iter().enumerate() {
        let predicted = &plan["devices"][i];
        assert_eq!(predicted["mode"], *mode);
        assert_eq!(predicted["fits"], true, "{predicted}");
        let file = format!("{mode}.json");
        let args = with(
            &[
                "train",
                "--data",
                "embedded",
                "--max-steps",
                "3",
                "--threads",
                "1",
                "--parallel",
                mode,
                "--report",
                &file,
            ],
            &gpt,
        );
        ok(&ranks(&dir, &args));
        let measured = report(&dir.join(&file));
        assert_eq!(measured["plan"]["micro_batch"], predicted["micro_batch"], "{mode}");
        for rank in 0..2 {
            let (m, p) = (&measured["parallel"]["per_rank"][rank], &predicted["per_rank"][rank]);
            assert_eq!(m["peak_allocated_bytes"], p["predicted_peak_allocated_bytes"], "{mode} rank {rank}");
            assert_eq!(m["peak_reserved_bytes"], p["predicted_peak_reserved_bytes"], "{mode} rank {rank}");
            assert_eq!(m["optimizer_state_bytes"], p["optimizer_state_bytes"], "{mode} rank {rank}");
        }
    }
}

#[test]
fn recovery_under_ranks_loses_no_sample() {
    let dir = scratch("recovery");
    let base = with(MLP, &["--parallel", "data", "--micro-batch", "16"]);
    ok(&ranks(&dir, &with(&base, &["--save", "plain.safetensors"])));
    let out =
        ok(&ranks(&dir, &with(&base, &["--inject-oom", "37", "--save", "faults.safetensors", "--report", "f.json"])));
    let r = report(&dir.join("f.json"));
    assert!(r["oom_recoveries"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(r["samples_seen"], serde_json::json!(12 * 64));
    let d = difference(&weights(&dir.join("plain.safetensors")), &weights(&dir.join("faults.safetensors")));
    assert!(d < 1e-4, "recovered run differs by {d}");
}

#[test]
fn a_failing_rank_ends_the_job_at_once() {
    let dir = scratch("abort");
    let start = Instant::now();
    // Rank 1 is given a data file that does not exist; rank 0 waits for it in its first collective.
    let good = with(MLP, &["--parallel", "data"]);
    let bad: Vec<&str> = good.iter().map(|&a| if a == "embedded" { "missing-data" } else { a }).collect();
    let mut args = vec!["-np", "1", env!("CARGO_BIN_EXE_memfit")];
    args.extend_from_slice(&good);
    args.extend_from_slice(&[":", "-np", "1", env!("CARGO_BIN_EXE_memfit")]);
    args.extend_from_slice(&bad);
    let out = mpirun(&dir, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("error (rank 1 of 2)") && stderr.contains("missing-data"), "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(60), "the job took {:?} to end", start.elapsed());
}

#[test]
fn ranks_without_parallel_are_refused() {
    let dir = scratch("refused");
    let out = ranks(&dir, &with(MLP, &["--save", "same.safetensors"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("one of 2 ranks started by mpirun, but --parallel is not given"), "{stderr}");
    assert!(!dir.join("same.safetensors").exists());
}

/// The sizes of a small GPT.
#[rustfmt::skip]
const SMALL_GPT: &[&str] = &["--model", "gpt", "--layers", "2", "--d-model", "64", "--heads", "2", "--context", "32"];

/// A small GPT trained with SGD (linear in the gradient, see [`MLP`]).
fn gpt() -> Vec<&'static str> {
    #[rustfmt::skip]
    let run = ["--batch-size", "8", "--micro-batch", "2", "--max-steps", "3", "--optimizer", "sgd", "--lr", "0.05",
        "--threads", "1"];
    with(&with(&["train", "--data", "embedded"], SMALL_GPT), &run)
}

#[test]
fn pipeline_makes_the_single_process_update_also_through_faults() {
    let dir = scratch("pipeline");
    ok(&memfit_alone(&dir, &with(&gpt(), &["--save", "one.safetensors", "--report", "one.json"])));
    let out =
        ok(&ranks(&dir, &with(&gpt(), &["--parallel", "pipeline", "--save", "pp.safetensors", "--report", "pp.json"])));
    assert!(out.contains("ranks (pipeline parallel, 2 ranks)"), "{out}");
    let one = weights(&dir.join("one.safetensors"));
    let d = difference(&one, &weights(&dir.join("pp.safetensors")));
    assert!(d < 1e-6, "pipeline vs one process: {d}");
    let (a, b) = (report(&dir.join("one.json")), report(&dir.join("pp.json")));
    let close = |x: &serde_json::Value, y: &serde_json::Value| (x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-6;
    assert!(close(&a["val_loss"], &b["val_loss"]), "{} vs {}", a["val_loss"], b["val_loss"]);
    assert!(close(&a["final_train_loss"], &b["final_train_loss"]));
    // Injected faults on both stages: every window is retried whole until it passes; no sample is
    // lost or counted twice.
    ok(&ranks(
        &dir,
        &with(
            &gpt(),
            &["--parallel", "pipeline", "--inject-oom", "300", "--save", "f.safetensors", "--report", "f.json"],
        ),
    ));
    let f = report(&dir.join("f.json"));
    assert!(f["oom_recoveries"].as_u64().unwrap() > 10, "{f}");
    assert_eq!(f["samples_seen"], a["samples_seen"]);
    let d = difference(&one, &weights(&dir.join("f.safetensors")));
    assert!(d < 1e-6, "pipeline through faults vs one process: {d}");
    assert!(close(&a["val_loss"], &f["val_loss"]));
}

#[test]
fn a_gpt_no_rank_can_hold_trains_with_the_pipeline_and_peaks_as_planned() {
    let dir = scratch("pipeline-fit");
    let gpt = ["--model", "gpt", "--batch-size", "16", "--memory", "40MiB"];
    let plan = ok(&memfit_alone(&dir, &with(&["plan", "--json", "--devices", "2"], &gpt)));
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(plan["fits_one_device"], false, "{plan}");
    let modes = plan["devices"].as_array().unwrap();
    let mode = |name: &str| modes.iter().find(|m| m["mode"] == name).unwrap().clone();
    assert_eq!(mode("data")["fits"], false);
    assert_eq!(mode("zero1")["fits"], false);
    let pipeline = mode("pipeline");
    assert_eq!(pipeline["fits"], true, "{pipeline}");
    let args = with(
        &[
            "train",
            "--data",
            "embedded",
            "--max-steps",
            "2",
            "--threads",
            "1",
            "--parallel",
            "pipeline",
            "--report",
            "p.json",
        ],
        &gpt,
    );
    let out = ok(&ranks(&dir, &args));
    assert!(out.contains("trained gpt for 2 steps"), "{out}");
    let measured = report(&dir.join("p.json"));
    assert_eq!(measured["plan"]["micro_batch"], pipeline["micro_batch"]);
    assert_eq!(measured["oom_recoveries"], 0);
    for rank in 0..2 {
        let (m, p) = (&measured["parallel"]["per_rank"][rank], &pipeline["per_rank"][rank]);
        assert_eq!(m["peak_allocated_bytes"], p["predicted_peak_allocated_bytes"], "rank {rank}");
        assert_eq!(m["peak_reserved_bytes"], p["predicted_peak_reserved_bytes"], "rank {rank}");
        assert!(m["peak_reserved_bytes"].as_u64().unwrap() <= 40 << 20);
        assert_eq!(m["stage"]["units"], pipeline["stages"][rank]);
    }
}

#[test]
fn a_data_parallel_run_resumes_exactly() {
    let dir = scratch("resume");
    let six: Vec<&str> = MLP.iter().map(|&a| if a == "12" { "6" } else { a }).collect();
    let run = with(&six, &["--parallel", "data", "--no-eval"]);
    ok(&ranks(
        &dir,
        &with(&run, &["--save-dir", "all", "--save-every", "3", "--keep", "5", "--save", "whole.safetensors"]),
    ));
    // Rank 0 wrote the checkpoints; resume from the one after step 3 as if the run had died there.
    std::fs::create_dir(dir.join("half")).unwrap();
    for entry in std::fs::read_dir(dir.join("all")).unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with("step-0000000003") {
            std::fs::copy(entry.path(), dir.join("half").join(entry.file_name())).unwrap();
        }
    }
    let out = ok(&ranks(&dir, &["train", "--resume", "half", "--parallel", "data", "--save", "resumed.safetensors"]));
    assert!(out.contains("trained mlp for 6 steps"), "{out}");
    assert_eq!(weights(&dir.join("whole.safetensors")), weights(&dir.join("resumed.safetensors")));
}
