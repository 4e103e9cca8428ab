//! PyTorch's own memory viewer reads our snapshots: `python -m torch.cuda._memory_viz stats`, `trace`,
//! `trace_plot` and `segment_plot` run on the pickle of a scripted recording (complete and truncated),
//! and the numbers they print agree with the allocator's statistics. Needs a Python that can `import
//! torch`: `MEMFIT_TORCH_PYTHON` if set, else `/tmp/torch-venv/bin/python`, else `python3`; without
//! one the test prints a note and passes (skipped).

mod common;

use common::{scripted_recording, Backend};
use memfit_memory::EventKind;
use memfit_profile::{write_snapshot, Recording};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Python to run PyTorch with: `MEMFIT_TORCH_PYTHON` when set (and only it), else the first of
/// the usual places that can import torch.
fn torch_python() -> Option<PathBuf> {
    let candidates: Vec<PathBuf> = match std::env::var_os("MEMFIT_TORCH_PYTHON") {
        Some(python) => vec![PathBuf::from(python)],
        None => vec![PathBuf::from("/tmp/torch-venv/bin/python"), PathBuf::from("python3")],
    };
    candidates
        .into_iter()
        .find(|python| Command::new(python).args(["-c", "import torch"]).output().is_ok_and(|out| out.status.success()))
}

/// Runs `python -m torch.cuda._memory_viz ARGS`, returning stdout (panics with stderr on failure).
fn memory_viz(python: &Path, args: &[&str]) -> String {
    let out = Command::new(python)
        .args(["-W", "ignore", "-m", "torch.cuda._memory_viz"])
        .args(args)
        .output()
        .expect("python runs");
    assert!(out.status.success(), "_memory_viz {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// PyTorch's `_format_size`: "{num:3.1f}{unit}B".
fn torch_size(bytes: u64) -> String {
    let mut num = bytes as f64;
    for unit in ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi"] {
        if num.abs() < 1024.0 {
            return format!("{num:3.1}{unit}B");
        }
        num /= 1024.0;
    }
    format!("{num:.1}YiB")
}

fn line_value<'a>(output: &'a str, key: &str) -> &'a str {
    output
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key:?} line in:\n{output}"))
        .trim()
}

fn check(python: &Path, recording: &Recording, name: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("memfit-profile");
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let pickle = dir.join(format!("{name}.pickle"));
    write_snapshot(recording, &pickle).expect("write the snapshot");
    let file = pickle.to_str().expect("utf-8 path");
    let stats = &recording.stats;

    // `stats`: the segments as they are at the end. Its "allocated" is what callers requested.
    let out = memory_viz(python, &["stats", file]);
    println!("--- _memory_viz stats {name}.pickle\n{out}");
    assert_eq!(line_value(&out, "segments:"), stats.segment.current.to_string());
    assert_eq!(line_value(&out, "total_reserved:"), torch_size(stats.reserved_bytes.current));
    assert_eq!(line_value(&out, "total_allocated:"), torch_size(stats.requested_bytes.current));
    let free = stats.reserved_bytes.current - stats.requested_bytes.current;
    assert!(line_value(&out, "total_free:").starts_with(&torch_size(free)), "{out}");

    // `trace`: every event, a free as free_requested + free_completed, a re-tag not at all (PyTorch
    // has no such action).
    let out = memory_viz(python, &["trace", file]);
    let count = |kind: EventKind| recording.events.iter().filter(|(e, _)| e.kind == kind).count();
    let entries = recording.events.len() + count(EventKind::Free) - count(EventKind::Retag);
    println!("--- _memory_viz trace {name}.pickle (first lines)");
    out.lines().take(12).for_each(|line| println!("{line}"));
    if entries == 0 {
        assert!(out.trim().is_empty(), "an empty trace prints nothing: {out}");
    } else {
        assert!(
            out.starts_with(&format!("Device 0 ----------------\n{entries} entries\n")),
            "{}",
            &out[..200.min(out.len())]
        );
    }
    let lines = |prefix: &str| out.lines().filter(|line| line.starts_with(prefix)).count();
    assert_eq!(lines("raise OutOfMemoryError"), count(EventKind::Oom));
    assert_eq!(lines("del "), count(EventKind::Free));
    assert_eq!(lines("# free completed for "), count(EventKind::Free));
    assert_eq!(lines("cudaFree("), count(EventKind::SegmentFree));
    assert_eq!(out.lines().filter(|line| line.contains(" = cudaMalloc(")).count(), count(EventKind::SegmentAlloc));

    // The interactive pages are written (they embed the pickle for PyTorch's viewer script).
    if recording.events.is_empty() {
        return;
    }
    for (kind, out_name) in [("trace_plot", "trace_plot"), ("segment_plot", "segment_plot")] {
        let html = dir.join(format!("{name}.{out_name}.html"));
        memory_viz(python, &[kind, file, "-o", html.to_str().expect("utf-8 path")]);
        let page = std::fs::read_to_string(&html).expect("page written");
        assert!(page.contains("snapshot.pickle"), "{kind} embeds the snapshot");
    }

    // Python reads the same numbers: replaying the trace from the state before it reaches the
    // recorded peak and ends at the final state.
    let script = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], "rb"))
live = sum(b["size"] for s in d["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
trace = d["device_traces"][0]
for e in reversed(trace):
    if e["action"] == "alloc": live -= e["size"]
    elif e["action"] == "free_completed": live += e["size"]
peak = live
for e in trace:
    if e["action"] == "alloc": live += e["size"]
    elif e["action"] == "free_completed": live -= e["size"]
    peak = max(peak, live)
print(peak, live)
"#;
    let out = Command::new(python).args(["-c", script, file]).output().expect("python runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    let window_peak = recording.events.iter().map(|(e, _)| e.allocated).max().unwrap_or(0);
    let numbers: Vec<u64> = printed.split_whitespace().map(|n| n.parse().expect("two numbers")).collect();
    assert_eq!(numbers[1], stats.allocated_bytes.current);
    assert!(numbers[0] >= window_peak && numbers[0] <= stats.allocated_bytes.peak, "{printed}");
    if recording.dropped_events == 0 {
        assert_eq!(numbers[0], stats.allocated_bytes.peak);
    }
}

#[test]
fn pytorchs_memory_viz_reads_our_snapshots_and_agrees() {
    let Some(python) = torch_python() else {
        println!("SKIPPED: no Python with torch (set MEMFIT_TORCH_PYTHON to run PyTorch's memory viewer)");
        return;
    };
    let full = scripted_recording(Backend::Host, 1 << 16);
    assert!(full.events.iter().any(|(e, _)| e.kind == EventKind::Retag), "the script re-tags blocks");
    check(&python, &full, "viewer-complete");
    let truncated = scripted_recording(Backend::Meta, full.events.len() / 3);
    assert!(truncated.dropped_events > 0);
    check(&python, &truncated, "viewer-truncated");
    check(&python, &Recording::default(), "viewer-empty");
}
