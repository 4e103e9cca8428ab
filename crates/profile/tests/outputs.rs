//! Every output of memfit-profile on a recording of a real allocator (host and meta backends, complete
//! and truncated timelines, empty): the PyTorch snapshot reproduces the allocator's state and its trace
//! replays to the recorded peak; the HTML page shows the peak and what made it and fetches nothing; the
//! Chrome trace is valid; the summary names the peak. The files are written under the test target's
//! tmp directory (`target/tmp/memfit-profile/`) for a look.

mod common;

use common::MIB;
use common::{scripted_recording, scripted_run, Backend};
use memfit_memory::{format_bytes, Allocator, AllocatorConfig, Category, EventKind, MetaBackend, Phase, Request};
use memfit_profile::{
    chrome_trace, curves_svg, html, snapshot_pickle, summary, summary_json, write_chrome_trace, write_curves,
    write_html, write_snapshot, CurvePoint, Curves, Recording, CURVES_MARK,
};
use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

/// Where the tests leave their files.
fn out_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("memfit-profile");
    std::fs::create_dir_all(&dir).expect("tmp dir");
    dir
}

fn decode(bytes: &[u8]) -> Value {
    serde_pickle::value_from_slice(bytes, DeOptions::new()).expect("the snapshot unpickles")
}

fn get<'a>(value: &'a Value, key: &str) -> &'a Value {
    match value {
        Value::Dict(map) => map.get(&HashableValue::String(key.to_string())).unwrap_or_else(|| panic!("no key {key}")),
        other => panic!("not a dict: {other:?}"),
    }
}

fn int(value: &Value) -> u64 {
    match value {
        Value::I64(i) => u64::try_from(*i).expect("non-negative"),
        Value::Int(i) => i.to_string().parse().expect("fits u64"),
        other => panic!("not an int: {other:?}"),
    }
}

fn list(value: &Value) -> &[Value] {
    match value {
        Value::List(items) => items,
        other => panic!("not a list: {other:?}"),
    }
}

fn string(value: &Value) -> &str {
    match value {
        Value::String(s) => s,
        other => panic!("not a string: {other:?}"),
    }
}

/// Walks a pickle's opcodes and fails on any that PyTorch's JavaScript unpickler (the viewer at
/// pytorch.org/memory_viz, `torch/utils/viz/MemoryViz.js`) cannot read as plain numbers, strings and
/// containers: it knows only the opcodes below, and reads a LONG1 of more than 8 bytes as a BigInt.
fn assert_readable_by_pytorch_viewer(bytes: &[u8]) {
    let mut at = 0;
    let take = |at: &mut usize, n: usize| -> &[u8] {
        let arg = &bytes[*at..*at + n];
        *at += n;
        arg
    };
    assert_eq!(take(&mut at, 2), [0x80, 3], "protocol 3 (the viewer reads 2 to 4)");
    loop {
        let opcode = take(&mut at, 1)[0];
        match opcode {
            b'.' => break,
            b'}' | b']' | b')' | b'(' | b'u' | b's' | b'e' | b'a' | b't' | b'N' | 0x85..=0x89 => {}
            b'K' => at += 1,
            b'M' => at += 2,
            b'J' => at += 4,
            b'G' => at += 8,
            0x8a => {
                let n = take(&mut at, 1)[0] as usize;
                assert!(n <= 8, "a LONG1 of {n} bytes would be a BigInt in the viewer");
                at += n;
            }
            0x8c => {
                let n = take(&mut at, 1)[0] as usize;
                at += n;
            }
            b'X' => {
                let n = u32::from_le_bytes(take(&mut at, 4).try_into().unwrap()) as usize;
                at += n;
            }
            other => panic!("opcode {other:#x} at {} is unknown to the viewer's unpickler", at - 1),
        }
    }
    assert_eq!(at, bytes.len(), "nothing after STOP");
}

/// The allocations live at the last moment allocated bytes peaked, replayed here independently:
/// (size, op, module id), largest first.
fn live_at_peak(recording: &Recording) -> Vec<(u64, &'static str, u32)> {
    let mut live: HashMap<u64, (u64, &'static str, u32)> = HashMap::new();
    let mut best: (u64, Vec<(u64, &'static str, u32)>) = (0, Vec::new());
    for (event, _) in &recording.events {
        match event.kind {
            EventKind::Alloc => {
                live.insert(event.address, (event.bytes, event.op, event.module));
                if event.allocated >= best.0 {
                    let mut set: Vec<_> = live.values().copied().collect();
                    set.sort_by_key(|a| std::cmp::Reverse(a.0));
                    best = (event.allocated, set);
                }
            }
            EventKind::Free => {
                live.remove(&event.address);
            }
            _ => {}
        }
    }
    best.1
}

#[test]
fn the_snapshot_reproduces_the_allocator_state_exactly() {
    for backend in [Backend::Host, Backend::Meta] {
        let recording = scripted_recording(backend, 1 << 16);
        assert_eq!(recording.dropped_events, 0);
        let bytes = snapshot_pickle(&recording);
        assert_readable_by_pytorch_viewer(&bytes);
        let snapshot = decode(&bytes);
        let segments = list(get(&snapshot, "segments"));
        let stats = &recording.stats;
        assert_eq!(segments.len() as u64, stats.segment.current, "{backend:?}");
        assert_eq!(segments.len(), recording.segments.len());
        let (mut reserved, mut allocated, mut requested, mut live) = (0, 0, 0, 0);
        for (segment, expected) in segments.iter().zip(&recording.segments) {
            let address = int(get(segment, "address"));
            let total = int(get(segment, "total_size"));
            assert_eq!((address, total), (expected.address, expected.total_size));
            assert_eq!(string(get(segment, "segment_type")), expected.pool);
            assert_eq!(int(get(segment, "device")), 0);
            assert_eq!(int(get(segment, "stream")), 0);
            let blocks = list(get(segment, "blocks"));
            assert_eq!(blocks.len(), expected.blocks.len());
            let mut cursor = address;
            let mut segment_allocated = 0;
            for (block, expected) in blocks.iter().zip(&expected.blocks) {
                let size = int(get(block, "size"));
                assert_eq!(int(get(block, "address")), cursor, "blocks tile the segment by address");
                assert_eq!((cursor, size), (expected.address, expected.size));
                cursor += size;
                let state = string(get(block, "state"));
                assert_eq!(state == "active_allocated", expected.allocated);
                assert!(state == "active_allocated" || state == "inactive");
                if expected.allocated {
                    segment_allocated += size;
                    requested += int(get(block, "requested_size"));
                    live += 1;
                    let frames = list(get(block, "frames"));
                    let names: Vec<&str> = frames.iter().map(|f| string(get(f, "name"))).collect();
                    assert_eq!(names[0], expected.owner.op);
                    assert!(names.contains(&expected.owner.category.name()), "{names:?}");
                    assert!(names.contains(&expected.owner.phase.name()), "{names:?}");
                    let module = recording.module_name(expected.owner.module);
                    assert!(module.is_empty() || names.contains(&module), "{names:?}");
                }
            }
            assert_eq!(cursor, address + total, "block sizes sum to the segment's size");
            assert_eq!(int(get(segment, "allocated_size")), segment_allocated);
            reserved += total;
            allocated += segment_allocated;
        }
        assert_eq!(reserved, stats.reserved_bytes.current);
        assert_eq!(allocated, stats.allocated_bytes.current);
        assert_eq!(requested, stats.requested_bytes.current);
        assert_eq!(live, stats.allocation.current);
        assert!(live > 0 && segments.len() > 1, "the script leaves state behind");
    }
}

/// Replays a decoded `device_traces[0]` from `start` bytes: (peak allocated, allocated at the end,
/// peak reserved, reserved at the end, OOMs).
fn replay_trace(snapshot: &Value, start: (u64, u64)) -> (u64, u64, u64, u64, usize) {
    let traces = list(get(snapshot, "device_traces"));
    assert_eq!(traces.len(), 1, "one device");
    let (mut allocated, mut reserved) = start;
    let (mut peak_allocated, mut peak_reserved, mut ooms) = (allocated, reserved, 0);
    let mut pending_free = None;
    for entry in list(&traces[0]) {
        let action = string(get(entry, "action"));
        let size = int(get(entry, "size"));
        assert_eq!(int(get(entry, "stream")), 0);
        let _ = int(get(entry, "time_us"));
        assert!(!list(get(entry, "frames")).is_empty());
        if action != "oom" {
            let _ = int(get(entry, "addr"));
        }
        match action {
            "alloc" => allocated += size,
            "free_requested" => pending_free = Some(int(get(entry, "addr"))),
            "free_completed" => {
                assert_eq!(pending_free.take(), Some(int(get(entry, "addr"))), "completed right after requested");
                allocated -= size;
            }
            "segment_alloc" | "segment_map" => reserved += size,
            "segment_free" | "segment_unmap" => reserved -= size,
            "oom" => {
                ooms += 1;
                let _ = int(get(entry, "device_free"));
            }
            other => panic!("unexpected action {other}"),
        }
        peak_allocated = peak_allocated.max(allocated);
        peak_reserved = peak_reserved.max(reserved);
    }
    (peak_allocated, allocated, peak_reserved, reserved, ooms)
}

#[test]
fn replaying_the_trace_reaches_the_recorded_peak() {
    for backend in [Backend::Host, Backend::Meta] {
        let recording = scripted_recording(backend, 1 << 16);
        let stats = &recording.stats;
        let snapshot = decode(&snapshot_pickle(&recording));
        let (peak, end, peak_reserved, reserved, ooms) = replay_trace(&snapshot, (0, 0));
        assert_eq!(peak, stats.allocated_bytes.peak, "{backend:?}");
        assert_eq!(end, stats.allocated_bytes.current);
        assert_eq!(peak_reserved, stats.reserved_bytes.peak);
        assert_eq!(reserved, stats.reserved_bytes.current);
        assert_eq!(ooms as u64, stats.num_ooms);
        assert_eq!(ooms, 1, "the script runs out of memory once");
    }
}

#[test]
fn meta_and_host_give_the_same_snapshot_apart_from_times() {
    let host = scripted_recording(Backend::Host, 1 << 16);
    let meta = scripted_recording(Backend::Meta, 1 << 16);
    let untimed = |recording: &Recording| {
        let mut recording = recording.clone();
        recording.events.iter_mut().for_each(|(_, time)| *time = 0);
        recording.device.clear();
        snapshot_pickle(&recording)
    };
    assert_eq!(untimed(&host), untimed(&meta));
    write_html(&meta, &out_dir().join("memory-meta.html")).expect("write");
    let numbers = |recording: &Recording| {
        let mut json = summary_json(recording);
        json["device"] = serde_json::Value::Null;
        json["peak"]["time_ns"] = serde_json::Value::Null;
        json
    };
    assert_eq!(numbers(&host), numbers(&meta));
}

#[test]
fn a_truncated_timeline_still_gives_a_consistent_snapshot_and_the_same_live_set() {
    let full = scripted_recording(Backend::Meta, 1 << 16);
    let total = full.events.len();
    let truncated = scripted_recording(Backend::Meta, total / 3);
    assert_eq!(truncated.dropped_events as usize, total - total / 3);
    let events = |events: &[(memfit_memory::Event, u64)]| events.iter().map(|(e, _)| *e).collect::<Vec<_>>();
    assert_eq!(events(&truncated.events), events(&full.events[total - total / 3..]));

    // The trace starts mid-run: replayed from the state before the window (the final state with the
    // window undone), it ends at the final state and never goes negative.
    let bytes = snapshot_pickle(&truncated);
    assert_readable_by_pytorch_viewer(&bytes);
    let snapshot = decode(&bytes);
    let stats = &truncated.stats;
    let (mut before_allocated, mut before_reserved) = (stats.allocated_bytes.current, stats.reserved_bytes.current);
    for (event, _) in truncated.events.iter().rev() {
        match event.kind {
            EventKind::Alloc => before_allocated -= event.bytes,
            EventKind::Free => before_allocated += event.bytes,
            EventKind::SegmentAlloc | EventKind::SegmentMap => before_reserved -= event.bytes,
            EventKind::SegmentFree | EventKind::SegmentUnmap => before_reserved += event.bytes,
            EventKind::Oom | EventKind::Retag => {}
        }
    }
    let (peak, end, _, reserved, _) = replay_trace(&snapshot, (before_allocated, before_reserved));
    assert_eq!((end, reserved), (stats.allocated_bytes.current, stats.reserved_bytes.current));
    let window_peak = truncated.events.iter().map(|(e, _)| e.allocated).max().unwrap_or(0);
    assert_eq!(peak, window_peak.max(before_allocated));

    // The analysis completes the window from the snapshot: the live set at the peak is the full run's.
    let full_summary = summary_json(&full);
    let truncated_summary = summary_json(&truncated);
    let full_peak_seq = full.events[full_summary["peak"]["event_index"].as_u64().unwrap() as usize].0.seq;
    assert!(full_peak_seq >= truncated.dropped_events, "the script peaks in its last third");
    // The same blocks with the same categories at the peak; what a block live before the window was
    // allocated as is not in the window.
    let top = |summary: &serde_json::Value| {
        let mut rows = summary["top_allocations_at_peak"].as_array().unwrap().clone();
        rows.iter_mut().for_each(|row| row["allocated_as"] = serde_json::Value::Null);
        rows
    };
    assert_eq!(top(&full_summary), top(&truncated_summary));
    for (full_row, row) in full_summary["top_allocations_at_peak"]
        .as_array()
        .unwrap()
        .iter()
        .zip(truncated_summary["top_allocations_at_peak"].as_array().unwrap())
    {
        assert!(row["allocated_as"].is_null() || row["allocated_as"] == full_row["allocated_as"], "{row}");
        assert_eq!(row["category_known"], true, "{row}");
    }
    assert_eq!(full_summary["peak"]["by_category"], truncated_summary["peak"]["by_category"]);
    assert_eq!(full_summary["peak"]["op"], truncated_summary["peak"]["op"]);
    assert!(summary(&truncated).contains("dropped"));
    assert!(html(&truncated).contains("dropped"));
    write_snapshot(&truncated, &out_dir().join("truncated.pickle")).expect("write");
}

#[test]
fn the_page_shows_the_peak_and_what_made_it_and_fetches_nothing() {
    let recording = scripted_recording(Backend::Host, 1 << 16);
    let page = html(&recording);
    write_html(&recording, &out_dir().join("memory.html")).expect("write");

    let peak = format_bytes(recording.stats.allocated_bytes.peak);
    assert!(page.contains(&peak), "the page shows the peak {peak}");
    let live = live_at_peak(&recording);
    let (size, op, module) = live[0];
    assert!(page.contains(&format_bytes(size)));
    assert!(page.contains(op), "the largest allocation's op {op}");
    assert!(page.contains(recording.module_name(module)), "and module");
    assert_eq!(page.matches("<svg").count(), 1, "one chart");
    for category in ["parameter", "activation", "gradient", "optimizer_state", "temporary", "input"] {
        assert!(page.contains(category), "legend names {category}");
    }
    for phase in ["setup", "data", "forward", "backward", "optimizer", "eval"] {
        assert!(page.contains(&format!(">{phase}<")), "phase {phase} is labelled");
    }
    assert!(!page.contains("http"), "no URL at all: nothing is fetched");
    assert!(!page.contains("<script src") && !page.contains("<link") && !page.contains("@import"));
    assert!(page.starts_with("<!DOCTYPE html>") && page.trim_end().ends_with("</html>"));
}

#[test]
fn the_chrome_trace_is_valid_and_nests_spans_with_memory_counters() {
    let recording = scripted_recording(Backend::Host, 1 << 16);
    write_chrome_trace(&recording, &out_dir().join("trace.json")).expect("write");
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&recording)).expect("valid JSON");
    assert_eq!(trace["displayTimeUnit"], "ms");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let complete: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), recording.spans.len());
    for e in &complete {
        assert!(e["ts"].as_f64().is_some_and(|t| t >= 0.0), "{e}");
        assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{e}");
        assert!(e["args"]["phase"].is_string() && e["args"]["module"].is_string());
        assert_eq!((&e["pid"], &e["tid"]), (&serde_json::json!(1), &serde_json::json!(1)), "one thread: spans nest");
    }
    assert!(complete.iter().any(|e| e["cat"] == "module") && complete.iter().any(|e| e["cat"] == "op"));
    // Spans nest: on one thread, each span ends within any span that contains its start.
    let mut stack: Vec<(f64, f64)> = Vec::new();
    for e in &complete {
        let (ts, end) = (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap());
        while stack.last().is_some_and(|&(_, parent_end)| ts >= parent_end) {
            stack.pop();
        }
        if let Some(&(_, parent_end)) = stack.last() {
            assert!(end <= parent_end + 1e-3, "{e} ends inside its parent");
        }
        stack.push((ts, end));
    }
    let counter = |name: &str| -> Vec<u64> {
        events
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == name)
            .map(|e| e["args"]["bytes"].as_u64().unwrap())
            .collect()
    };
    let (allocated, reserved) = (counter("allocated"), counter("reserved"));
    assert_eq!(allocated.iter().max().copied(), Some(recording.stats.allocated_bytes.peak));
    assert_eq!(reserved.iter().max().copied(), Some(recording.stats.reserved_bytes.peak));
    assert_eq!(allocated.last().copied(), Some(recording.stats.allocated_bytes.current));
    assert_eq!(events.iter().filter(|e| e["ph"] == "i").count(), 1, "the OOM is marked");
}

#[test]
fn the_summary_names_the_peak_and_the_largest_live_allocations() {
    let recording = scripted_recording(Backend::Meta, 1 << 16);
    let text = summary(&recording);
    let json = summary_json(&recording);
    let stats = &recording.stats;
    assert!(text.contains(&format_bytes(stats.allocated_bytes.peak)), "{text}");
    assert_eq!(json["peak_allocated_bytes"], stats.allocated_bytes.peak);
    assert_eq!(json["peak_reserved_bytes"], stats.reserved_bytes.peak);
    assert_eq!(json["peak"]["is_overall_peak"], true);
    assert_eq!(json["num_ooms"], 1);
    let live = live_at_peak(&recording);
    let top = json["top_allocations_at_peak"].as_array().unwrap();
    assert_eq!(top.len(), live.len().min(10));
    for (row, &(size, op, module)) in top.iter().zip(&live) {
        assert_eq!(row["bytes"], size);
        assert!(row["op"] == op || live.iter().any(|l| l.0 == size && l.1 == row["op"]), "ties may swap");
        let _ = module;
    }
    let peak_event = recording.events[json["peak"]["event_index"].as_u64().unwrap() as usize].0;
    assert_eq!(peak_event.allocated, stats.allocated_bytes.peak);
    assert!(text.contains(&format!("peak made by {}", peak_event.op)), "{text}");
    let by_category: BTreeMap<String, u64> = json["by_category"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| (row["category"].as_str().unwrap().to_string(), row["at_peak_bytes"].as_u64().unwrap()))
        .collect();
    assert_eq!(by_category.values().sum::<u64>(), stats.allocated_bytes.peak, "the table adds up");
    assert_eq!(json["category_mismatch_at_peak_bytes"], 0, "every re-tag is an event");
    for category in Category::ALL {
        let replayed = json["peak"]["by_category"][category.name()].as_u64().unwrap();
        assert_eq!(replayed, stats.category_at_peak[category.index()], "{category}");
    }
}

/// Allocated bytes per category (by `Category::index`) right after each event, replayed here from the
/// events alone (Alloc, Free, Retag by address) for a complete timeline.
fn replayed_categories(recording: &Recording) -> Vec<[u64; Category::COUNT]> {
    assert_eq!(recording.dropped_events, 0);
    let mut live: HashMap<u64, (u64, Category)> = HashMap::new();
    let mut bytes = [0u64; Category::COUNT];
    let mut series = Vec::new();
    for (event, _) in &recording.events {
        match event.kind {
            EventKind::Alloc => {
                assert!(live.insert(event.address, (event.bytes, event.category)).is_none());
                bytes[event.category.index()] += event.bytes;
            }
            EventKind::Free => {
                let (size, category) = live.remove(&event.address).expect("freed blocks are live");
                assert_eq!((size, category), (event.bytes, event.category), "a Free names the latest category");
                bytes[category.index()] -= size;
            }
            EventKind::Retag => {
                let block = live.get_mut(&event.address).expect("re-tagged blocks are live");
                bytes[block.1.index()] -= block.0;
                bytes[event.category.index()] += block.0;
                block.1 = event.category;
            }
            EventKind::SegmentAlloc
            | EventKind::SegmentFree
            | EventKind::SegmentMap
            | EventKind::SegmentUnmap
            | EventKind::Oom => {}
        }
        assert_eq!(bytes.iter().sum::<u64>(), event.allocated);
        series.push(bytes);
    }
    series
}

/// The page's hover data: per drawn event, allocated bytes and bytes per category in stacking order.
fn hover_points(page: &str) -> (Vec<String>, Vec<(u64, Vec<u64>)>) {
    let start = page.find("id=\"chart-data\">").expect("hover data") + "id=\"chart-data\">".len();
    let end = start + page[start..].find("</script>").unwrap();
    let data: serde_json::Value = serde_json::from_str(&page[start..end].replace("<\\/", "</")).unwrap();
    let names = data["categories"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let points = data["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[1].as_u64().unwrap(), p[5].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect()))
        .collect();
    (names, points)
}

/// A run made by driving a real allocator the way autograd does: outputs made as temporaries and saved
/// (re-tagged activations), a backward that writes a gradient into a saved activation's memory
/// (re-tagged temporary) before the peak, and re-tags at the peak and after it.
fn re_tagging_run() -> Recording {
    let mut a = Allocator::new(Box::new(MetaBackend), AllocatorConfig::default());
    let at = |category, op, phase| Request { category, op, phase, module: 0 };
    let _weights = a.allocate(4 * MIB, at(Category::Parameter, "init", Phase::Setup)).unwrap();
    let mut saved = Vec::new();
    for _ in 0..3 {
        let out = a.allocate(16 * MIB, at(Category::Temporary, "linear", Phase::Forward)).unwrap();
        a.set_category(out.id, Category::Activation).unwrap();
        saved.push(out);
    }
    let loss = a.allocate(MIB, at(Category::Temporary, "loss", Phase::Forward)).unwrap();
    // Backward: the last activation's memory becomes a gradient, re-tagged; then the peak.
    a.set_category(saved[2].id, Category::Temporary).unwrap();
    a.free(loss.id).unwrap();
    let scratch = a.allocate(8 * MIB, at(Category::Temporary, "linear_backward", Phase::Backward)).unwrap();
    // At the peak but after it was reached: the mix of the peak stays.
    a.set_category(saved[1].id, Category::Temporary).unwrap();
    a.free(scratch.id).unwrap();
    let grad = a.allocate(4 * MIB, at(Category::Temporary, "linear_backward", Phase::Backward)).unwrap();
    a.set_category(grad.id, Category::Gradient).unwrap();
    a.free(saved[2].id).unwrap();
    a.free(saved[1].id).unwrap();
    let mut recording = Recording::from_allocator("re-tags", "meta", &a);
    recording.modules = vec![String::new()];
    recording
}

#[test]
fn replayed_categories_equal_the_allocators_at_every_event_and_at_the_peak() {
    let driven = re_tagging_run();
    let stats = &driven.stats;
    assert_eq!(stats.allocated_bytes.peak, 4 * MIB + 48 * MIB + 8 * MIB);
    let expected_at_peak = {
        let mut bytes = [0u64; Category::COUNT];
        bytes[Category::Parameter.index()] = 4 * MIB;
        bytes[Category::Activation.index()] = 32 * MIB;
        bytes[Category::Temporary.index()] = 24 * MIB;
        bytes
    };
    assert_eq!(stats.category_at_peak, expected_at_peak, "the allocator's own count");
    assert!(driven.events.iter().filter(|(e, _)| e.kind == EventKind::Retag).count() >= 5);

    for recording in [driven, scripted_recording(Backend::Host, 1 << 16), scripted_recording(Backend::Meta, 1 << 16)] {
        let stats = &recording.stats;
        let json = summary_json(&recording);
        // The summary's breakdown at the peak, from the replay, is the allocator's statistic exactly.
        for category in Category::ALL {
            let replayed = json["peak"]["by_category"][category.name()].as_u64().unwrap();
            assert_eq!(replayed, stats.category_at_peak[category.index()], "{category}");
        }
        assert_eq!(json["category_mismatch_at_peak_bytes"], 0);
        assert_eq!(json["category_unknown_at_peak_bytes"], 0);
        let page = html(&recording);
        assert!(!page.contains("approximate"), "a complete timeline is exact");
        assert!(!summary(&recording).contains('?'));

        // The chart stacks every block in the category of the moment: its data at each event is an
        // independent replay's, and at the peak the allocator's mix.
        let series = replayed_categories(&recording);
        let (names, points) = hover_points(&page);
        assert_eq!(points.len(), recording.events.len(), "short runs draw every event");
        for (i, ((allocated, drawn), expected)) in points.iter().zip(&series).enumerate() {
            assert_eq!(*allocated, recording.events[i].0.allocated);
            for (name, bytes) in names.iter().zip(drawn) {
                let category = Category::ALL.iter().find(|c| c.name() == name).unwrap();
                assert_eq!(*bytes, expected[category.index()], "event {i}, {name}");
            }
        }
        let peak = json["peak"]["event_index"].as_u64().unwrap() as usize;
        assert_eq!(series[peak], stats.category_at_peak);
        assert_eq!(recording.events[peak].0.kind, EventKind::Alloc, "the peak is made by an allocation");
    }
}

#[test]
fn the_tables_give_the_category_at_the_peak_and_what_a_block_was_allocated_as() {
    let recording = re_tagging_run();
    let json = summary_json(&recording);
    let top = json["top_allocations_at_peak"].as_array().unwrap();
    let rows: Vec<(u64, &str, &str)> = top
        .iter()
        .map(|r| (r["bytes"].as_u64().unwrap(), r["category"].as_str().unwrap(), r["allocated_as"].as_str().unwrap()))
        .collect();
    let mib = |n: u64| n * MIB;
    assert_eq!(
        rows,
        [
            (mib(16), "activation", "temporary"),
            (mib(16), "activation", "temporary"),
            (mib(16), "temporary", "temporary"),
            (mib(8), "temporary", "temporary"),
            (mib(4), "parameter", "parameter"),
        ],
        "by size, then address: saved[1] is re-tagged only after the peak, saved[2] before it"
    );
    assert!(top.iter().all(|r| r["category_known"] == true));
    let text = summary(&recording);
    assert!(text.contains("temporary -> activation"), "{text}");
    let page = html(&recording);
    assert!(page.contains("allocated as temporary, re-tagged activation before the peak\">activation"));
    assert!(page.contains("activation <span class=\"was\">(was temporary)</span>"));
    assert!(!page.contains("approximate"));
}

#[test]
fn the_snapshot_names_a_re_tagged_blocks_current_category_and_traces_no_re_tag() {
    let recording = re_tagging_run();
    let snapshot = decode(&snapshot_pickle(&recording));
    let blocks: Vec<&Value> =
        list(get(&snapshot, "segments")).iter().flat_map(|segment| list(get(segment, "blocks"))).collect();
    let grad = blocks
        .iter()
        .find(|b| {
            string(get(b, "state")) == "active_allocated" && int(get(b, "size")) == 4 * MIB && {
                let frames = list(get(b, "frames"));
                string(get(&frames[0], "name")) == "linear_backward"
            }
        })
        .expect("the re-tagged gradient is live at the end");
    let names: Vec<&str> = list(get(grad, "frames")).iter().map(|f| string(get(f, "name"))).collect();
    assert_eq!(names, ["linear_backward", "backward", "gradient"], "allocated as a temporary, now a gradient");
    let count = |kind| recording.events.iter().filter(|(e, _)| e.kind == kind).count();
    let entries = list(&list(get(&snapshot, "device_traces"))[0]).len();
    assert_eq!(entries, recording.events.len() + count(EventKind::Free) - count(EventKind::Retag));
    let (peak, end, ..) = replay_trace(&snapshot, (0, 0));
    assert_eq!((peak, end), (recording.stats.allocated_bytes.peak, recording.stats.allocated_bytes.current));
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&recording)).expect("valid JSON");
    assert!(trace["traceEvents"].as_array().unwrap().iter().all(|e| e["ph"] != "i"), "no instant for a re-tag");
}

#[test]
fn a_truncated_timeline_says_which_categories_it_cannot_know() {
    use memfit_memory::{Allocator, AllocatorConfig, Category, MetaBackend, Phase, Request};
    let config = AllocatorConfig { timeline_events: 6, ..AllocatorConfig::default() };
    let mut a = Allocator::new(Box::new(MetaBackend), config);
    let request = |category| Request { category, op: "matmul", phase: Phase::Backward, module: 0 };
    // Before the window: a saved activation (re-tagged there too) and a block never re-tagged.
    let saved = a.allocate(MIB, request(Category::Temporary)).unwrap();
    a.set_category(saved.id, Category::Activation).unwrap();
    let _kept = a.allocate(2 * MIB, request(Category::Parameter)).unwrap();
    let filler = a.allocate(512, request(Category::Other)).unwrap();
    a.free(filler.id).unwrap();
    // The window: the peak, then the saved activation re-tagged as a temporary (its category before
    // that re-tag is not in the window), freed.
    let scratch = a.allocate(3 * MIB, request(Category::Temporary)).unwrap();
    a.free(scratch.id).unwrap();
    a.set_category(saved.id, Category::Temporary).unwrap();
    let later = a.allocate(512, request(Category::Temporary)).unwrap();
    a.free(later.id).unwrap();
    a.free(saved.id).unwrap();
    let recording = Recording::from_allocator("truncated re-tag", "meta", &a);
    assert_eq!(recording.dropped_events, 7, "the window starts at the peak's allocation");

    let json = summary_json(&recording);
    assert_eq!(json["peak"]["allocated_bytes"], 6 * MIB);
    assert_eq!(json["category_unknown_at_peak_bytes"], MIB);
    let top = json["top_allocations_at_peak"].as_array().unwrap();
    let saved_row = top.iter().find(|r| r["bytes"] == MIB).unwrap();
    assert_eq!(saved_row["category_known"], false, "{saved_row}");
    assert_eq!(saved_row["category"], "temporary", "assumed: what it was re-tagged to");
    assert!(saved_row["allocated_as"].is_null());
    let kept_row = top.iter().find(|r| r["bytes"] == 2 * MIB).unwrap();
    assert_eq!((&kept_row["category"], &kept_row["category_known"]), (&"parameter".into(), &true.into()));
    assert!(summary(&recording).contains("temporary?"));
    let page = html(&recording);
    assert!(page.contains("Categories over time are approximate for 1.00 MiB"), "only for what is not known");
    assert!(page.contains("temporary? <span class=\"was\">(not recorded)</span>"));
}

#[test]
fn an_empty_recording_gives_every_output_without_panicking() {
    let empty = Recording::default();
    assert_readable_by_pytorch_viewer(&snapshot_pickle(&empty));
    let snapshot = decode(&snapshot_pickle(&empty));
    assert!(list(get(&snapshot, "segments")).is_empty());
    assert_eq!(replay_trace(&snapshot, (0, 0)), (0, 0, 0, 0, 0));
    let page = html(&empty);
    assert!(page.contains("no allocator events"));
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&empty)).expect("valid JSON");
    assert!(trace["traceEvents"].is_array());
    assert!(summary(&empty).contains("no allocation"));
    assert!(summary_json(&empty)["peak"].is_null());
    assert!(curves_svg(&Curves::of_points(Vec::new())).contains("<svg"));

    // Odd input: a free of an address never allocated, a module id beyond the table.
    let mut odd = scripted_recording(Backend::Meta, 1 << 16);
    odd.events.retain(|(e, _)| e.kind != EventKind::Alloc || e.seq % 7 != 0);
    odd.modules.truncate(2);
    odd.spans.iter_mut().for_each(|s| std::mem::swap(&mut s.start_ns, &mut s.end_ns));
    let _ = (html(&odd), summary(&odd), summary_json(&odd), snapshot_pickle(&odd));
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&odd)).expect("valid JSON");
    assert!(trace["traceEvents"].as_array().unwrap().iter().all(|e| e["dur"].as_f64().unwrap_or(0.0) >= 0.0));
}

#[test]
fn training_curves_draw_loss_and_memory() {
    let points: Vec<CurvePoint> = (0..50)
        .map(|step| CurvePoint {
            step,
            train_loss: Some(2.3 * (-(step as f64) / 20.0).exp() + 0.3),
            val_loss: (step % 10 == 9).then_some(2.0 * (-(step as f64) / 25.0).exp() + 0.4),
            allocated: 10 << 20,
            peak_allocated: (30 << 20) + (step as u64 % 3) * (1 << 20),
            reserved: 40 << 20,
        })
        .collect();
    let curves = Curves { points, peak_allocated: 33 << 20, peak_reserved: 40 << 20, capacity: Some(48 << 20) };
    let svg = curves_svg(&curves);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>") && svg.contains(CURVES_MARK));
    assert!(svg.contains("training loss") && svg.contains("validation loss") && svg.contains("peak allocated"));
    assert!(svg.contains("reserved at the end of the step") && svg.contains("budget (--memory)"));
    // The title gives the run's peaks (the report's), not the largest point.
    assert!(
        svg.contains("run&apos;s peak 33.00 MiB allocated, 40.00 MiB reserved of a budget of 48.00 MiB")
            || svg.contains("run's peak 33.00 MiB allocated, 40.00 MiB reserved of a budget of 48.00 MiB"),
        "{svg}"
    );
    write_curves(&curves, &out_dir().join("run.svg")).expect("write");
    // Three steps: one label each, no repeats.
    let short: Vec<CurvePoint> = (1..=3)
        .map(|step| CurvePoint {
            step,
            train_loss: Some(40.0),
            val_loss: None,
            allocated: 100 << 30,
            peak_allocated: 110 << 30,
            reserved: 120 << 30,
        })
        .collect();
    let svg = curves_svg(&Curves::of_points(short));
    for label in ["1", "2", "3"] {
        assert_eq!(
            svg.matches(&format!(">\n{label}\n</text>")).count(),
            2,
            "step {label} labels each of the two charts once"
        );
    }

    let odd = [
        CurvePoint {
            step: 3,
            train_loss: Some(f64::NAN),
            val_loss: None,
            allocated: 0,
            peak_allocated: 0,
            reserved: 0,
        },
        CurvePoint {
            step: 3,
            train_loss: Some(f64::INFINITY),
            val_loss: Some(-1.0),
            allocated: 1,
            peak_allocated: 1,
            reserved: 2,
        },
    ];
    assert!(curves_svg(&Curves::of_points(odd.to_vec())).contains("<svg"));
    assert!(curves_svg(&Curves::of_points(odd[..1].to_vec())).contains("<svg"));
}

#[test]
fn a_long_run_is_downsampled_and_keeps_its_peak() {
    let recording = scripted_run(Backend::Meta, 1 << 14, 300);
    assert!(recording.events.len() == 1 << 14 && recording.dropped_events > 0, "{}", recording.events.len());
    let page = html(&recording);
    write_html(&recording, &out_dir().join("long.html")).expect("write");
    assert!(page.len() < 1_500_000, "the page stays small: {} bytes", page.len());
    assert!(page.contains(&format!("peak {}", format_bytes(recording.stats.allocated_bytes.peak))));
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&recording)).expect("valid JSON");
    assert!(trace["traceEvents"].as_array().unwrap().len() > recording.spans.len());
}
