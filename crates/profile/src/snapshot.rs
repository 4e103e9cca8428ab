//! The recording as a PyTorch memory snapshot: the dictionary `torch.cuda.memory._snapshot()` returns,
//! pickled (protocol 3), so PyTorch's own tools read it: `python -m torch.cuda._memory_viz stats|trace|
//! trace_plot|segment_plot FILE` and the interactive viewer at pytorch.org/memory_viz.
//!
//! Layout (what PyTorch's C++ `_cuda_memorySnapshot` emits, for one device, the recording's
//! ordinal, and one stream):
//! - `segments`: one dict per segment (`address`, `total_size`, `allocated_size`, `active_size`,
//!   `requested_size`, `segment_type`, ..., `blocks` tiling it by address, each `active_allocated` or
//!   `inactive`);
//! - `device_traces`: `[[entry, ...]]`, the recorded events oldest first: `alloc`, `free_requested`
//!   immediately followed by `free_completed` (one free, as PyTorch records it without streams),
//!   `segment_alloc`, `segment_free`, `oom` (with `device_free` instead of `addr`). Re-tags (Retag
//!   events) have no entry: PyTorch has no such action, and they change no byte count;
//! - `allocator_settings` and `external_annotations`, which PyTorch adds and viewers may look for.
//!
//! Frames stand in for stack traces, innermost first: `op:0:<op>`, `module:0:<module>` (when the
//! request named one), `phase:0:<phase>`, `category:0:<category>`; the viewer prints them as
//! `filename:line:name`, and PyTorch's flamegraphs (`segments`, `memory`) group by them from the
//! category down. The category is the one of the moment: an `alloc` names what the block was allocated
//! as, a free what it was when freed, a block of `segments` what it is at the end (a free block, what
//! its last owner was when freed); op, module and phase are always those of the allocation.
//!
//! Sizes: a trace entry's `size` is the block size (rounded to 512 B), the quantity memfit's statistics
//! count, so replaying the trace reaches `peak allocated` exactly (PyTorch records the requested size
//! there; memfit's events do not carry it). Blocks keep both (`size`, `requested_size`).
//!
//! A truncated timeline (`dropped_events > 0`) gives a trace that starts mid-run, as PyTorch's ring
//! buffer does: its viewer replays the trace backwards from `segments`, and takes a free whose alloc is
//! missing for a block that was live before the trace started. The trace likewise keeps at most
//! [`MAX_TRACE_ENTRIES`] entries, the newest (the `max_entries` PyTorch's memory-profiling guide
//! records with): an entry pickles to about 400 bytes, so a long recording stays a file the viewer can
//! load.

use crate::{saturating_sum, Recording};
use memfit_memory::{Event, EventKind, Request};
use serde::Serialize;
use std::path::Path;

/// The snapshot pickled: protocol 3, only the opcodes PyTorch's JavaScript unpickler knows (dicts,
/// lists, tuples, strings, bools, floats, and ints of at most 8 bytes; see the note on `int`).
pub fn snapshot_pickle(recording: &Recording) -> Vec<u8> {
    // Plain structs of integers, strings, lists and bools always pickle; only the writer could fail,
    // and a Vec does not.
    serde_pickle::to_vec(&Snapshot::of(recording), serde_pickle::SerOptions::new())
        .expect("a snapshot of plain values always pickles")
}

/// Most trace entries written (as `torch.cuda.memory._record_memory_history(max_entries=100000)`).
pub const MAX_TRACE_ENTRIES: usize = 100_000;

pub fn write_snapshot(recording: &Recording, path: &Path) -> std::io::Result<()> {
    crate::write_file(path, snapshot_pickle(recording))
}

#[derive(Serialize)]
struct Snapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<TraceEntry>>,
    allocator_settings: AllocatorSettings,
    external_annotations: Vec<()>,
}

#[derive(Serialize)]
struct Segment {
    device: u32,
    address: i64,
    total_size: i64,
    allocated_size: i64,
    active_size: i64,
    requested_size: i64,
    stream: i64,
    segment_type: &'static str,
    segment_pool_id: (i64, i64),
    is_expandable: bool,
    frames: Vec<Frame>,
    blocks: Vec<Block>,
}

#[derive(Serialize)]
struct Block {
    address: i64,
    size: i64,
    requested_size: i64,
    state: &'static str,
    frames: Vec<Frame>,
}

#[derive(Serialize)]
struct TraceEntry {
    action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    addr: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<i64>,
    size: i64,
    stream: i64,
    time_us: i64,
    frames: Vec<Frame>,
}

#[derive(Clone, Serialize)]
struct Frame {
    filename: &'static str,
    line: u32,
    name: String,
}

/// PyTorch's allocator configuration, for the policy memfit follows (no expandable segments, no
/// split limit, no garbage collection, no power-of-two rounding divisions).
#[derive(Serialize)]
struct AllocatorSettings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    conf: &'static str,
    max_split_size: i64,
    garbage_collection_threshold: f64,
    expandable_segments: bool,
    roundup_power2_divisions: std::collections::BTreeMap<String, i64>,
}

impl Snapshot {
    fn of(recording: &Recording) -> Snapshot {
        let frames = |owner: Request| frames(recording, owner);
        let segments = recording
            .segments
            .iter()
            .map(|segment| {
                let allocated = segment.blocks.iter().filter(|b| b.allocated);
                let allocated_size = int(saturating_sum(allocated.clone().map(|b| b.size)));
                Segment {
                    device: recording.ordinal,
                    address: int(segment.address),
                    total_size: int(segment.total_size),
                    allocated_size,
                    active_size: allocated_size,
                    requested_size: int(saturating_sum(allocated.map(|b| b.requested))),
                    stream: 0,
                    segment_type: segment.pool,
                    segment_pool_id: (0, 0),
                    is_expandable: segment.expandable,
                    frames: Vec::new(),
                    blocks: segment
                        .blocks
                        .iter()
                        .map(|block| Block {
                            address: int(block.address),
                            size: int(block.size),
                            requested_size: if block.allocated { int(block.requested) } else { 0 },
                            state: if block.allocated { "active_allocated" } else { "inactive" },
                            // A free block keeps the owner of its last allocation, as PyTorch keeps
                            // the context of a freed block.
                            frames: frames(block.owner),
                        })
                        .collect(),
                }
            })
            .collect();

        let first = trace_start(&recording.events, MAX_TRACE_ENTRIES);
        let mut trace = Vec::new();
        for &(event, time_ns) in &recording.events[first..] {
            let owner = Request { category: event.category, op: event.op, phase: event.phase, module: event.module };
            let entry = |action| TraceEntry {
                action,
                addr: Some(int(event.address)),
                device_free: None,
                size: int(event.bytes),
                stream: 0,
                time_us: int(time_ns / 1000),
                frames: frames(owner),
            };
            match event.kind {
                EventKind::Alloc => trace.push(entry("alloc")),
                EventKind::Free => {
                    trace.push(entry("free_requested"));
                    trace.push(entry("free_completed"));
                }
                EventKind::SegmentAlloc => trace.push(entry("segment_alloc")),
                EventKind::SegmentFree => trace.push(entry("segment_free")),
                // PyTorch's actions for expandable segments.
                EventKind::SegmentMap => trace.push(entry("segment_map")),
                EventKind::SegmentUnmap => trace.push(entry("segment_unmap")),
                EventKind::Oom => {
                    // What the device could still give: the capacity not reserved (0 when unlimited:
                    // then the backend itself refused).
                    let free = recording.capacity.map_or(0, |capacity| capacity.saturating_sub(event.reserved));
                    trace.push(TraceEntry { addr: None, device_free: Some(int(free)), ..entry("oom") });
                }
                // PyTorch's trace has no re-tag action (see the module docs).
                EventKind::Retag => {}
            }
        }

        Snapshot {
            segments,
            device_traces: vec![trace],
            allocator_settings: AllocatorSettings {
                conf: "",
                max_split_size: -1,
                garbage_collection_threshold: 0.0,
                expandable_segments: false,
                roundup_power2_divisions: Default::default(),
            },
            external_annotations: Vec::new(),
        }
    }
}

/// Integers are pickled as Python's would be read by PyTorch's JavaScript unpickler: serde-pickle
/// writes a `u64` of 2^31 or more as a 9-byte LONG1, which that unpickler turns into a `BigInt` that
/// cannot be added to its numbers; an `i64` is at most 8 bytes and reads as a number. Every value here
/// is a byte count, address or time below `isize::MAX`; anything larger would saturate.
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The stand-in stack of a request, innermost first (see the module docs).
fn frames(recording: &Recording, owner: Request) -> Vec<Frame> {
    let frame = |filename, name: &str| Frame { filename, line: 0, name: name.to_string() };
    let mut frames = vec![frame("op", owner.op)];
    let module = recording.module_name(owner.module);
    if !module.is_empty() {
        frames.push(frame("module", module));
    }
    frames.push(frame("phase", owner.phase.name()));
    frames.push(frame("category", owner.category.name()));
    frames
}

/// The first of the newest events whose trace entries fit in `max` (a free makes two, a re-tag none).
fn trace_start(events: &[(Event, u64)], max: usize) -> usize {
    let entries = |event: &Event| match event.kind {
        EventKind::Free => 2,
        EventKind::Retag => 0,
        _ => 1,
    };
    let (mut first, mut kept) = (events.len(), 0);
    while first > 0 && kept + entries(&events[first - 1].0) <= max {
        first -= 1;
        kept += entries(&events[first].0);
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfit_memory::{Category, Phase};

    #[test]
    fn the_trace_keeps_the_newest_events_that_fit() {
        let event = |kind| {
            let e = Event {
                seq: 0,
                kind,
                bytes: 512,
                address: 0,
                category: Category::Other,
                op: "op",
                phase: Phase::Setup,
                module: 0,
                allocated: 0,
                reserved: 0,
            };
            (e, 0)
        };
        let events: Vec<(Event, u64)> =
            [EventKind::Alloc, EventKind::Free, EventKind::Alloc, EventKind::Free].into_iter().map(event).collect();
        assert_eq!(trace_start(&events, 100), 0);
        assert_eq!(trace_start(&events, 6), 0);
        assert_eq!(trace_start(&events, 5), 1, "a free's two entries are kept together");
        assert_eq!(trace_start(&events, 4), 2);
        assert_eq!(trace_start(&events, 2), 3);
        assert_eq!(trace_start(&events, 1), 4);
        assert_eq!(trace_start(&[], 1), 0);
        // A re-tag makes no entry: it never costs room.
        let events: Vec<(Event, u64)> =
            [EventKind::Alloc, EventKind::Retag, EventKind::Free].into_iter().map(event).collect();
        assert_eq!(trace_start(&events, 3), 0);
        assert_eq!(trace_start(&events, 2), 1);
    }
}
