//! `--segments`: expandable segments change no number, `meta` predicts them to the byte, they reserve
//! less than fixed ones, and `auto` (the default under a budget) takes them only where fixed segments
//! do not fit. (On the emulated GPU: `tests/cuda.rs`.)

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-segments-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn memfit(args: &[&str]) -> Output {
    let cache = temp("costs");
    Command::new(env!("CARGO_BIN_EXE_memfit")).args(args).env("MEMFIT_CACHE_DIR", cache).output().expect("runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The report of a short resnet run.
fn resnet(segments: &str, device: &str) -> Value {
    let report = temp(&format!("resnet-{segments}-{}.json", device.replace(':', "-")));
    let out = memfit(&[
        "train",
        "--model",
        "resnet",
        "--max-steps",
        "2",
        "--batch-size",
        "16",
        "--no-eval",
        "--threads",
        "2",
        "--segments",
        segments,
        "--device",
        device,
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap()
}

#[test]
fn expandable_segments_change_no_number_reserve_less_and_meta_predicts_them() {
    let (fixed, grown, predicted) = (resnet("fixed", "cpu"), resnet("expandable", "cpu"), resnet("expandable", "meta"));
    assert_eq!(fixed["final_train_loss"], grown["final_train_loss"], "the same numbers");
    assert_eq!(grown["segments"], "expandable");
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "num_segments", "num_allocations"] {
        assert_eq!(grown[key], predicted[key], "{key}: meta predicts cpu to the byte");
    }
    let reserved = |r: &Value| r["peak_reserved_bytes"].as_u64().unwrap();
    assert!(reserved(&grown) < reserved(&fixed), "{} vs {}", reserved(&grown), reserved(&fixed));
    assert_eq!(grown["num_segments"], 2, "one per pool");
}

/// `plan --json`'s plan for the GPT at context 1024, batch 1, every block checkpointed, under `memory`.
fn plan(memory: &str, segments: &[&str]) -> Output {
    let mut args = vec![
        "plan",
        "--model",
        "gpt",
        "--context",
        "1024",
        "--batch-size",
        "1",
        "--checkpoint",
        "all",
        "--memory",
        memory,
        "--json",
    ];
    args.extend(segments);
    memfit(&args)
}

#[test]
fn auto_takes_expandable_segments_only_where_fixed_ones_do_not_fit() {
    let json = |o: &Output| -> Value {
        assert!(o.status.success(), "{}", text(o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    // Fixed segments reserve 74 MiB for this run, expandable ones 66 MiB.
    let roomy = json(&plan("100MiB", &[]));
    assert_eq!(roomy["segments"], "fixed", "{roomy}");
    let tight = json(&plan("70MiB", &[]));
    assert_eq!(tight["segments"], "expandable", "{tight}");
    assert!(tight["predicted_peak_reserved_bytes"].as_u64().unwrap() <= 70 << 20, "{tight}");
    // Pinned to fixed, the same budget is refused, and the doctor names expandable segments.
    let fixed = plan("70MiB", &["--segments", "fixed"]);
    assert_eq!(fixed.status.code(), Some(1), "{}", text(&fixed));
    assert!(text(&fixed).contains("--segments expandable"), "{}", text(&fixed));
}
