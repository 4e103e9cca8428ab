//! `--optimizer-state bf16|int8`: Adam's moments in fewer bytes, predicted to the byte by meta, and a
//! resumed run that ends as the uninterrupted one (the 8-bit codes and their blocks' maxima are saved
//! and restored exactly).

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-optimizer-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn memfit(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .env("MEMFIT_CACHE_DIR", temp("costs"))
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The report of `train --model mlp` with `extra`.
fn mlp(name: &str, extra: &[&str]) -> Value {
    let report = temp(&format!("{name}.json"));
    let mut args = vec!["train", "--model", "mlp", "--threads", "2", "--no-eval", "--report", report.to_str().unwrap()];
    args.extend(extra);
    memfit(&args);
    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap()
}

/// bf16: half the bytes (less what the allocator rounds); int8: a quarter and the blocks' maxima.
#[test]
fn compact_moments_take_their_share_of_bytes_and_meta_predicts_them() {
    let state = |r: &Value| r["peak_by_category"]["optimizer_state"].as_u64().unwrap();
    let fp32 = mlp("fp32", &["--max-steps", "3"]);
    for (format, share) in [("bf16", 0.6), ("int8", 0.27)] {
        let ran = mlp(&format!("{format}-cpu"), &["--max-steps", "3", "--optimizer-state", format]);
        let predicted =
            mlp(&format!("{format}-meta"), &["--max-steps", "3", "--optimizer-state", format, "--device", "meta"]);
        for key in ["peak_allocated_bytes", "peak_reserved_bytes", "num_allocations"] {
            assert_eq!(ran[key], predicted[key], "{format} {key}: meta predicts cpu to the byte");
        }
        assert!((state(&ran) as f64) < share * state(&fp32) as f64, "{format}: {} vs {}", state(&ran), state(&fp32));
        let (a, b) = (ran["final_train_loss"].as_f64().unwrap(), fp32["final_train_loss"].as_f64().unwrap());
        assert!(a != b && (a - b).abs() < 0.05 * b, "{format} changes the numbers, a little: {a} vs {b}");
    }
}

#[test]
fn a_resumed_int8_run_ends_as_the_uninterrupted_one() {
    let dir = temp("resume-int8");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let whole = mlp("int8-whole", &["--max-steps", "4", "--optimizer-state", "int8"]);
    mlp("int8-half", &["--max-steps", "2", "--optimizer-state", "int8", "--save-dir", d, "--save-every", "2"]);
    let report = temp("int8-resumed.json");
    memfit(&["train", "--resume", d, "--max-steps", "4", "--report", report.to_str().unwrap()]);
    let resumed: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(resumed["final_train_loss"], whole["final_train_loss"]);
    // A different --optimizer-state is a different run: refused by name.
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["train", "--resume", d, "--max-steps", "6", "--optimizer-state", "fp32"])
        .env("MEMFIT_CACHE_DIR", temp("costs"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("--optimizer-state"), "{text}");
}

#[test]
fn sgd_refuses_a_compact_state_it_does_not_have() {
    for command in ["train", "plan"] {
        let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
            .args([command, "--model", "mlp", "--optimizer", "sgd", "--optimizer-state", "int8"])
            .env("MEMFIT_CACHE_DIR", temp("costs"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {text}");
        assert!(text.contains("--optimizer adam or adamw"), "{command}: {text}");
    }
}
