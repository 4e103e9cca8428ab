//! The recording in numbers, as text for the terminal (`summary`) and JSON for scripts
//! (`summary_json`): the memory table by category (own peak, at the overall peak, from the allocator's
//! statistics), peak allocated and reserved, fragmentation, the event that made the peak and the
//! largest allocations live at it with their category then (from `analysis`). The JSON also gives the
//! replayed bytes per category at the peak (`peak.by_category`): for a complete timeline, the table's
//! "at overall peak" column exactly.

use crate::analysis::{Analysis, Lifetime, Peak};
use crate::Recording;
use memfit_memory::{format_bytes, Category};
use serde_json::{json, Value};

/// Allocations listed as live at the peak.
const TOP: usize = 10;

pub fn summary(recording: &Recording) -> String {
    let analysis = Analysis::of(recording);
    let stats = &recording.stats;
    let mut s = String::new();
    let title = if recording.title.is_empty() { "memory profile" } else { &recording.title };
    let capacity = recording.capacity.map_or("unlimited".to_string(), format_bytes);
    s.push_str(&format!("{title}\n"));
    s.push_str(&format!(
        "  device {}, capacity {capacity}; {} events recorded{}\n",
        if recording.device.is_empty() { "?" } else { &recording.device },
        recording.events.len(),
        dropped_note(recording)
    ));
    s.push_str(&format!("  {:<16} {:>12} {:>16}\n", "category", "own peak", "at overall peak"));
    for (category, own, at_peak) in category_rows(recording) {
        s.push_str(&format!("  {:<16} {:>12} {:>16}\n", category.name(), format_bytes(own), format_bytes(at_peak)));
    }
    s.push_str(&format!(
        "  {:<16} {:>12}   reserved {}\n",
        "peak allocated",
        format_bytes(stats.allocated_bytes.peak),
        format_bytes(stats.reserved_bytes.peak)
    ));
    s.push_str(&format!(
        "  fragmentation {:.1}% (reserved peak not in use at once); at the end {} allocated, {} reserved; {} out-of-memory\n",
        fragmentation(recording) * 100.0,
        format_bytes(stats.allocated_bytes.current),
        format_bytes(stats.reserved_bytes.current),
        stats.num_ooms
    ));
    match analysis.peak {
        Some(peak) => {
            s.push_str(&format!("  peak made by {}\n", describe_peak(recording, &peak)));
            if peak.event.allocated != stats.allocated_bytes.peak {
                s.push_str(&format!(
                    "  (the highest point of the recorded events, {}: the overall peak is outside them)\n",
                    format_bytes(peak.event.allocated)
                ));
            }
            let unknown = analysis.unknown_at_peak();
            if unknown > 0 {
                s.push_str(&format!(
                    "  ({} live at the peak were allocated before the recorded events and re-tagged after the\n   \
                     peak: their category then is not recorded, marked ? below; the table above is exact)\n",
                    format_bytes(unknown)
                ));
            }
            let live = analysis.live_at_peak();
            s.push_str(&format!(
                "  largest of the {} allocations live at the peak (category then; a -> b: allocated as a):\n",
                live.len()
            ));
            s.push_str(&format!("    {:>12}  {:<28} {:<20} {:<24} {}\n", "size", "category", "op", "module", "phase"));
            for lifetime in live.iter().take(TOP) {
                s.push_str(&format!(
                    "    {:>12}  {:<28} {:<20} {:<24} {}\n",
                    format_bytes(lifetime.size),
                    lifetime.category_label(peak.index),
                    lifetime.op,
                    or_dash(recording.module_name(lifetime.module)),
                    lifetime.phase.name()
                ));
            }
        }
        None => s.push_str("  no allocation among the recorded events\n"),
    }
    s
}

pub fn summary_json(recording: &Recording) -> Value {
    let analysis = Analysis::of(recording);
    let stats = &recording.stats;
    let by_category: Vec<Value> = category_rows(recording)
        .into_iter()
        .map(|(category, own, at_peak)| {
            json!({"category": category.name(), "own_peak_bytes": own, "at_peak_bytes": at_peak})
        })
        .collect();
    let peak = analysis.peak.map(|peak| {
        let e = peak.event;
        let replayed = analysis.by_category_at(peak.index);
        let by_category: serde_json::Map<String, Value> =
            Category::ALL.iter().map(|&c| (c.name().to_string(), json!(replayed[c.index()]))).collect();
        json!({
            "allocated_bytes": e.allocated,
            "reserved_bytes": e.reserved,
            "is_overall_peak": e.allocated == stats.allocated_bytes.peak,
            "event_index": peak.index,
            "time_ns": peak.time_ns,
            "bytes": e.bytes,
            "op": e.op,
            "module": recording.module_name(e.module),
            "phase": e.phase.name(),
            "category": e.category.name(),
            "by_category": by_category,
        })
    });
    let top: Vec<Value> = match analysis.peak {
        Some(peak) => {
            analysis.live_at_peak().iter().take(TOP).map(|l| lifetime_json(recording, l, peak.index)).collect()
        }
        None => Vec::new(),
    };
    json!({
        "title": recording.title,
        "device": recording.device,
        "capacity_bytes": recording.capacity,
        "events": recording.events.len(),
        "dropped_events": recording.dropped_events,
        "peak_allocated_bytes": stats.allocated_bytes.peak,
        "peak_reserved_bytes": stats.reserved_bytes.peak,
        "fragmentation": fragmentation(recording),
        "allocated_bytes_at_end": stats.allocated_bytes.current,
        "reserved_bytes_at_end": stats.reserved_bytes.current,
        "num_ooms": stats.num_ooms,
        "by_category": by_category,
        "category_mismatch_at_peak_bytes": analysis.category_mismatch_at_peak(recording),
        "category_unknown_at_peak_bytes": analysis.unknown_at_peak(),
        "peak": peak,
        "top_allocations_at_peak": top,
    })
}

/// 1 - peak allocated / peak reserved: the share of the reserved peak never in use at once (0 when
/// nothing was reserved). The same definition as memfit's run report.
pub(crate) fn fragmentation(recording: &Recording) -> f64 {
    let stats = &recording.stats;
    if stats.reserved_bytes.peak == 0 {
        0.0
    } else {
        (1.0 - stats.allocated_bytes.peak as f64 / stats.reserved_bytes.peak as f64).max(0.0)
    }
}

/// Categories that held anything, largest at the overall peak first: (category, own peak, at peak).
pub(crate) fn category_rows(recording: &Recording) -> Vec<(Category, u64, u64)> {
    let stats = &recording.stats;
    let mut rows: Vec<(Category, u64, u64)> = Category::ALL
        .iter()
        .map(|&c| (c, stats.category(c).peak, stats.category_at_peak[c.index()]))
        .filter(|&(_, own, at_peak)| own > 0 || at_peak > 0)
        .collect();
    rows.sort_by_key(|&(c, own, at_peak)| (std::cmp::Reverse(at_peak), std::cmp::Reverse(own), c));
    rows
}

/// "matmul in blocks.2.attn (forward, activation): 4.00 MiB at 12.345 ms, allocator event 123".
pub(crate) fn describe_peak(recording: &Recording, peak: &Peak) -> String {
    let e = peak.event;
    let module = recording.module_name(e.module);
    let place = if module.is_empty() { String::new() } else { format!(" in {module}") };
    format!(
        "{}{place} ({}, {}): {} at {:.3} ms, allocator event {}",
        e.op,
        e.phase,
        e.category,
        format_bytes(e.bytes),
        peak.time_ns as f64 / 1e6,
        e.seq
    )
}

pub(crate) fn dropped_note(recording: &Recording) -> String {
    match recording.dropped_events {
        0 => String::new(),
        n => format!(" (the {n} before them were dropped)"),
    }
}

pub(crate) fn or_dash(text: &str) -> &str {
    if text.is_empty() {
        "-"
    } else {
        text
    }
}

/// A block live at event `index` (the peak): its category then (`category_known` false when not
/// recorded, see Note [Replaying a recording]), what it was allocated as (null when before the window).
fn lifetime_json(recording: &Recording, lifetime: &Lifetime, index: usize) -> Value {
    json!({
        "bytes": lifetime.size,
        "category": lifetime.category_at(index).name(),
        "category_known": lifetime.known_at(index),
        "allocated_as": lifetime.allocated_as().map(Category::name),
        "op": lifetime.op,
        "module": recording.module_name(lifetime.module),
        "phase": lifetime.phase.name(),
        "address": lifetime.address,
    })
}
