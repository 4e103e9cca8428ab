//! Replays a recording's events to learn what was live when: every allocation's lifetime, the peak of
//! the recorded window and the allocations live at it. Every output that needs "what was live" asks
//! this module, so the HTML page, the summary and the tests agree.
//!
//! Note [Replaying a recording]
//! Events say when a block was allocated and when it was freed; the blocks live at any moment follow
//! from replaying them in order, keyed by address (no two live blocks share one).
//! - A complete timeline (`dropped_events == 0`) starts from nothing.
//! - A truncated one starts from the blocks live just before `events[0]`, found by replaying the events
//!   backwards from the final snapshot (an Alloc takes its block away, a Free puts it back). The
//!   snapshot is complete, so the live set is exact everywhere in the window. PyTorch's viewer reads
//!   its own truncated ring buffer the same way (backwards from the snapshot's segments).
//! - Categories: `Allocator::set_category` re-tags a block without an event (autograd saves an op's
//!   output as an activation right after the op made it as a temporary). A lifetime therefore takes the
//!   category its block had last: its Free event's, or the final snapshot's while it is still live.
//!   The allocator's statistics (`MemoryStats::category_at_peak`) count the category of the moment; the
//!   summary's memory table reports those, the chart and the tables of live blocks the lifetime's, and
//!   the tables also say what a re-tagged block was allocated as ("temporary -> gradient": a gradient
//!   still pending at the peak was a temporary then), since the events cannot say when it changed.
//! - Inconsistent input never panics: a Free of an address not live is skipped, an Alloc at an address
//!   still live ends the earlier lifetime there.

use crate::Recording;
use memfit_memory::{Category, Event, EventKind, Phase};
use std::collections::{BTreeMap, HashMap};

/// One allocation from its Alloc event to its Free event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lifetime {
    pub address: u64,
    /// Block size (rounded), as the events count it.
    pub size: u64,
    /// The category its block had last (see the Note).
    pub category: Category,
    /// The category it was allocated as (its Alloc event's; `category` when that is unknown).
    pub allocated_as: Category,
    pub op: &'static str,
    pub phase: Phase,
    pub module: u32,
    /// Index of its Alloc event; None when it was live before the recorded window.
    pub start: Option<usize>,
    /// Index of its Free event; None when it is still live at the end.
    pub end: Option<usize>,
}

impl Lifetime {
    /// "gradient", or "temporary -> gradient" for a block allocated as another category.
    pub fn category_label(&self) -> String {
        if self.allocated_as == self.category {
            self.category.name().to_string()
        } else {
            format!("{} -> {}", self.allocated_as, self.category)
        }
    }

    /// Live right after event `index`.
    pub fn live_after(&self, index: usize) -> bool {
        !matches!(self.start, Some(start) if start > index) && !matches!(self.end, Some(end) if end <= index)
    }
}

/// The moment allocated bytes were highest in the recorded window (the last time, when reached
/// repeatedly, as `MemoryStats::category_at_peak` does).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peak {
    pub index: usize,
    /// The Alloc event that reached it: its op, module and phase "made the peak".
    pub event: Event,
    pub time_ns: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Analysis {
    pub lifetimes: Vec<Lifetime>,
    pub peak: Option<Peak>,
    /// Per event: the lifetime it started / ended, if any.
    started: Vec<Option<usize>>,
    ended: Vec<Option<usize>>,
}

impl Analysis {
    pub fn of(recording: &Recording) -> Analysis {
        let events = &recording.events;
        let mut analysis =
            Analysis { started: vec![None; events.len()], ended: vec![None; events.len()], ..Analysis::default() };
        let mut live: HashMap<u64, usize> = HashMap::new();
        if recording.dropped_events > 0 {
            for lifetime in live_before_window(recording) {
                live.insert(lifetime.address, analysis.lifetimes.len());
                analysis.lifetimes.push(lifetime);
            }
        }
        for (index, (event, _)) in events.iter().enumerate() {
            match event.kind {
                EventKind::Alloc => {
                    let id = analysis.lifetimes.len();
                    analysis.lifetimes.push(Lifetime {
                        address: event.address,
                        size: event.bytes,
                        category: event.category,
                        allocated_as: event.category,
                        op: event.op,
                        phase: event.phase,
                        module: event.module,
                        start: Some(index),
                        end: None,
                    });
                    analysis.started[index] = Some(id);
                    if let Some(earlier) = live.insert(event.address, id) {
                        analysis.lifetimes[earlier].end = Some(index);
                        analysis.ended[index] = Some(earlier);
                    }
                }
                EventKind::Free => {
                    if let Some(id) = live.remove(&event.address) {
                        let lifetime = &mut analysis.lifetimes[id];
                        lifetime.end = Some(index);
                        lifetime.category = event.category;
                        analysis.ended[index] = Some(id);
                    }
                }
                EventKind::SegmentAlloc | EventKind::SegmentFree | EventKind::Oom => {}
            }
        }
        // Blocks still live take their final category from the snapshot.
        let final_blocks: HashMap<u64, (u64, Category)> = recording
            .segments
            .iter()
            .flat_map(|segment| &segment.blocks)
            .filter(|block| block.allocated)
            .map(|block| (block.address, (block.size, block.owner.category)))
            .collect();
        for (address, id) in live {
            let lifetime = &mut analysis.lifetimes[id];
            if let Some(&(size, category)) = final_blocks.get(&address) {
                if size == lifetime.size {
                    lifetime.category = category;
                }
            }
        }

        // `max_by_key` keeps the last of equal maxima.
        analysis.peak = events
            .iter()
            .enumerate()
            .filter(|(_, (event, _))| event.allocated > 0)
            .max_by_key(|(_, (event, _))| event.allocated)
            .map(|(index, &(event, time_ns))| Peak { index, event, time_ns });
        analysis
    }

    /// The allocations live right after the peak event, largest first (ties: lower address first);
    /// empty when there is no peak.
    pub fn live_at_peak(&self) -> Vec<Lifetime> {
        let Some(peak) = self.peak else { return Vec::new() };
        let mut live: Vec<Lifetime> = self.lifetimes.iter().filter(|l| l.live_after(peak.index)).copied().collect();
        live.sort_by(|a, b| b.size.cmp(&a.size).then(a.address.cmp(&b.address)));
        live
    }

    /// Bytes the replay puts in another category than the allocator counted at the overall peak
    /// (`MemoryStats::category_at_peak`): blocks re-tagged without an event (see the Note). 0 when the
    /// window's peak is not the overall one (then there is nothing exact to compare with).
    pub fn category_mismatch_at_peak(&self, recording: &Recording) -> u64 {
        let Some(peak) = self.peak.filter(|p| p.event.allocated == recording.stats.allocated_bytes.peak) else {
            return 0;
        };
        let mut replayed = [0u64; Category::COUNT];
        for lifetime in self.lifetimes.iter().filter(|l| l.live_after(peak.index)) {
            let slot = &mut replayed[lifetime.category.index()];
            *slot = slot.saturating_add(lifetime.size);
        }
        let differences = replayed.iter().zip(&recording.stats.category_at_peak).map(|(a, b)| a.abs_diff(*b));
        crate::saturating_sum(differences) / 2
    }

    /// Allocated bytes per category (by `Category::index`) right after each event.
    pub fn category_series(&self) -> Vec<[u64; Category::COUNT]> {
        let mut current = [0u64; Category::COUNT];
        for lifetime in self.lifetimes.iter().filter(|l| l.start.is_none()) {
            let slot = &mut current[lifetime.category.index()];
            *slot = slot.saturating_add(lifetime.size);
        }
        self.started
            .iter()
            .zip(&self.ended)
            .map(|(started, ended)| {
                if let Some(lifetime) = ended.map(|id| &self.lifetimes[id]) {
                    let slot = &mut current[lifetime.category.index()];
                    *slot = slot.saturating_sub(lifetime.size);
                }
                if let Some(lifetime) = started.map(|id| &self.lifetimes[id]) {
                    let slot = &mut current[lifetime.category.index()];
                    *slot = slot.saturating_add(lifetime.size);
                }
                current
            })
            .collect()
    }
}

/// The blocks live just before `events[0]`: the final snapshot's allocated blocks with the window's
/// events undone, newest first (see Note [Replaying a recording]).
fn live_before_window(recording: &Recording) -> Vec<Lifetime> {
    let mut live: BTreeMap<u64, Lifetime> = recording
        .segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .filter(|block| block.allocated)
        .map(|block| {
            let owner = block.owner;
            let lifetime = Lifetime {
                address: block.address,
                size: block.size,
                category: owner.category,
                allocated_as: owner.category,
                op: owner.op,
                phase: owner.phase,
                module: owner.module,
                start: None,
                end: None,
            };
            (block.address, lifetime)
        })
        .collect();
    for (event, _) in recording.events.iter().rev() {
        match event.kind {
            EventKind::Alloc => {
                live.remove(&event.address);
            }
            EventKind::Free => {
                let lifetime = Lifetime {
                    address: event.address,
                    size: event.bytes,
                    category: event.category,
                    allocated_as: event.category,
                    op: event.op,
                    phase: event.phase,
                    module: event.module,
                    start: None,
                    end: None,
                };
                live.insert(event.address, lifetime);
            }
            EventKind::SegmentAlloc | EventKind::SegmentFree | EventKind::Oom => {}
        }
    }
    live.into_values().collect()
}
