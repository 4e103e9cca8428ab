//! memfit-profile turns a recording of the allocator into the files a user looks at:
//!
//! | output | module | for |
//! |---|---|---|
//! | a PyTorch memory snapshot (`.pickle`) | [`snapshot`](snapshot_pickle) | PyTorch's own viewer (`torch.cuda._memory_viz`, pytorch.org/memory_viz) |
//! | one self-contained HTML page | [`html`](html()) (chart drawn by `chart`) | a browser: memory over time by category, the peak and what was live then |
//! | a Chrome trace (`.json`) | [`trace`](chrome_trace) | Perfetto / chrome://tracing: spans of ops and modules, memory counters |
//! | a text and JSON summary | [`summary`](summary()) | the terminal and scripts |
//! | training curves (`.svg`) | [`curves`](curves_svg) | loss and memory per step of a run |
//!
//! The input is a [`Recording`]: the allocator's events with their times, its final snapshot and
//! statistics, the module table and the spans of work. `recording.rs` is not a separate file: the type
//! is the crate's contract and lives here. Everything that needs the allocations live at some moment
//! (the peak), or their categories over time, gets them from `analysis`, which replays the events
//! (allocations, frees and re-tags) once; see Note [Replaying a recording].
//!
//! Every function accepts any recording, an empty one included, without panicking: a recording whose
//! timeline dropped its oldest events is completed from the final snapshot, inconsistent input (a free or
//! re-tag of an address never allocated) is tolerated and skipped.

mod analysis;
mod chart;
mod curves;
mod html;
mod snapshot;
mod summary;
mod trace;

use memfit_memory::{Allocator, Event, MemoryState, MemoryStats, Phase, SegmentSnapshot};
use std::path::Path;

pub use curves::{curves_svg, write_curves, CurvePoint, Curves, CURVES_MARK};
pub use html::{html, write_html};
pub use snapshot::{snapshot_pickle, write_snapshot, MAX_TRACE_ENTRIES};
pub use summary::{summary, summary_json};
pub use trace::{chrome_trace, write_chrome_trace};

/// A span of work: an op (`kind = Op`) or a module's forward/backward (`kind = Module`), nested by time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub name: String,
    pub kind: SpanKind,
    pub phase: Phase,
    /// Index into [`Recording::modules`] (0 = none).
    pub module: u32,
    /// Nanoseconds since the device started (the clock of the events).
    pub start_ns: u64,
    pub end_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Op,
    Module,
}

impl SpanKind {
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Op => "op",
            SpanKind::Module => "module",
        }
    }
}

/// What the allocator saw during a run, as the device hands it over.
#[derive(Clone, Debug, Default)]
pub struct Recording {
    /// One line saying what ran, e.g. "simplecnn, batch 64 (micro 64), 3 steps on cpu".
    pub title: String,
    /// The device as reports name it: "cpu", "meta", "meta:cuda", "cuda (NVIDIA H100 80GB HBM3 (sm_90))".
    pub device: String,
    /// The GPU's ordinal (`cuda:N`), the snapshot's device index; 0 elsewhere.
    pub ordinal: u32,
    pub capacity: Option<u64>,
    /// Allocator events with their times (ns since the device started), oldest first: `timeline.timed_events()`.
    pub events: Vec<(Event, u64)>,
    /// Events the bounded timeline dropped before `events[0]` (0 when complete).
    pub dropped_events: u64,
    /// `Allocator::snapshot()` at the end of the recording.
    pub segments: Vec<SegmentSnapshot>,
    /// Module names by id (`modules[0]` is "" = no module), e.g. "blocks.2.attn", "conv1".
    pub modules: Vec<String>,
    pub spans: Vec<Span>,
    pub stats: MemoryStats,
}

impl Recording {
    /// Everything the allocator itself knows: capacity, timeline (with its dropped count), snapshot and
    /// statistics. The caller adds `modules` and `spans`, which belong to the device.
    pub fn from_allocator(title: impl Into<String>, device: impl Into<String>, allocator: &Allocator) -> Recording {
        Recording::from_state(title, device, allocator.state())
    }

    /// As [`Recording::from_allocator`], from a copy of its state (`Device::memory_state`).
    pub fn from_state(title: impl Into<String>, device: impl Into<String>, state: MemoryState) -> Recording {
        Recording {
            title: title.into(),
            device: device.into(),
            ordinal: 0,
            capacity: state.capacity,
            events: state.events,
            dropped_events: state.dropped_events,
            segments: state.segments,
            modules: vec![String::new()],
            spans: Vec::new(),
            stats: state.stats,
        }
    }

    /// The module's name, "" for none (id 0) or an id the table does not hold.
    pub fn module_name(&self, module: u32) -> &str {
        self.modules.get(module as usize).map_or("", String::as_str)
    }
}

/// A sum of byte counts that saturates instead of overflowing (inconsistent input can hold anything).
pub(crate) fn saturating_sum(values: impl IntoIterator<Item = u64>) -> u64 {
    values.into_iter().fold(0, u64::saturating_add)
}

/// Writes `contents` to `path` (shared by every `write_*`).
fn write_file(path: &Path, contents: impl AsRef<[u8]>) -> std::io::Result<()> {
    std::fs::write(path, contents)
}
