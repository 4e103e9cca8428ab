//! The recording as a Chrome trace (the JSON object format Perfetto and chrome://tracing open):
//! - one complete (`X`) event per span, module and op spans on one thread so they nest, with
//!   `args {phase, module}`; at equal start times the longer span comes first (the parent);
//! - counter (`C`) tracks `allocated` and `reserved` (bytes), one sample per allocator event that
//!   changed them;
//! - an instant (`i`) event per out-of-memory, with what was asked for;
//! - nothing for a re-tag (Retag event): it changes neither counter, and a GPT step makes hundreds;
//! - metadata (`M`) naming the process after the recording's title and the thread after the device.
//!
//! Times are microseconds (`ts`, `dur`) from the device's clock, the one the events use.

use crate::Recording;
use memfit_memory::EventKind;
use serde_json::{json, Value};
use std::path::Path;

const PID: u32 = 1;
const TID: u32 = 1;

pub fn chrome_trace(recording: &Recording) -> String {
    let mut events = Vec::with_capacity(recording.spans.len() + 2 * recording.events.len() + 2);
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": PID, "tid": TID,
        "args": {"name": format!("memfit: {}", recording.title)},
    }));
    events.push(json!({
        "name": "thread_name", "ph": "M", "pid": PID, "tid": TID,
        "args": {"name": format!("{} device", recording.device)},
    }));

    let mut spans: Vec<&crate::Span> = recording.spans.iter().collect();
    // Parents before children: by start, then longest first, then modules before ops.
    spans.sort_by_key(|s| {
        (s.start_ns, std::cmp::Reverse(s.end_ns.saturating_sub(s.start_ns)), s.kind != crate::SpanKind::Module)
    });
    for span in spans {
        events.push(json!({
            "name": span.name,
            "cat": span.kind.name(),
            "ph": "X",
            "ts": micros(span.start_ns),
            "dur": micros(span.end_ns.saturating_sub(span.start_ns)),
            "pid": PID,
            "tid": TID,
            "args": {"phase": span.phase.name(), "module": recording.module_name(span.module)},
        }));
    }

    let (mut allocated, mut reserved) = (None, None);
    for &(event, time_ns) in &recording.events {
        for (name, value, last) in
            [("allocated", event.allocated, &mut allocated), ("reserved", event.reserved, &mut reserved)]
        {
            if *last != Some(value) {
                *last = Some(value);
                events.push(json!({
                    "name": name, "ph": "C", "ts": micros(time_ns), "pid": PID, "tid": TID,
                    "args": {"bytes": value},
                }));
            }
        }
        if event.kind == EventKind::Oom {
            events.push(json!({
                "name": "out of memory", "cat": "memory", "ph": "i", "s": "t",
                "ts": micros(time_ns), "pid": PID, "tid": TID,
                "args": {
                    "requested_bytes": event.bytes,
                    "op": event.op,
                    "module": recording.module_name(event.module),
                    "phase": event.phase.name(),
                    "category": event.category.name(),
                },
            }));
        }
    }

    let trace = json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    trace.to_string()
}

pub fn write_chrome_trace(recording: &Recording, path: &Path) -> std::io::Result<()> {
    crate::write_file(path, chrome_trace(recording))
}

/// Nanoseconds as the microseconds trace events count in (fractional, to the nanosecond).
fn micros(ns: u64) -> Value {
    json!(ns as f64 / 1000.0)
}
