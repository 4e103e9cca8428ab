//! Replays a recording's events to learn what was live when: every allocation's lifetime, the peak of
//! the recorded window and the allocations live at it. Every output that needs "what was live" asks
//! this module, so the HTML page, the summary and the tests agree.
//!
//! Note [Replaying a recording]
//! Events say when a block was allocated, re-tagged and freed; the blocks live at any moment, and
//! their categories, follow from replaying them in order, keyed by address (no two live blocks share
//! one).
//! - A complete timeline (`dropped_events == 0`) starts from nothing.
//! - A truncated one starts from the blocks live just before `events[0]`, found by replaying the events
//!   backwards from the final snapshot (an Alloc takes its block away, a Free puts it back). The
//!   snapshot is complete, so the live set is exact everywhere in the window. PyTorch's viewer reads
//!   its own truncated ring buffer the same way (backwards from the snapshot's segments).
//! - Categories: `Allocator::set_category` records a Retag event (the block's address and size, its
//!   NEW category) whenever a live block changes category: autograd saves an op's output as an
//!   activation right after the op made it as a temporary, a backward reuses a saved activation's
//!   memory for a gradient and re-tags it temporary. A lifetime therefore keeps its initial category
//!   (its Alloc event's) and the list of its re-tags (event index, new category): its category at any
//!   event is known, the chart stacks each block in the category in force at each moment, and the
//!   tables of blocks live at the peak give their category at the peak (and what they were allocated
//!   as, when that differs). Replayed this way, the bytes per category right after the peak's Alloc
//!   event are exactly `MemoryStats::category_at_peak` (the allocator's mix of the moment it last
//!   reached its peak; a re-tag reaches no peak) for a complete timeline.
//! - What a truncated timeline cannot know: a block live before the window has its category at the
//!   window's start from the snapshot (or from its Free event, which carries the category of the
//!   moment), undone through the window's re-tags backwards; but a Retag names only the new category,
//!   so for a block re-tagged inside the window the category before its first re-tag there is not
//!   recorded. Such a lifetime counts as its first re-tag's category until that re-tag
//!   (`initial_known == false`); the page says how many bytes that concerns, and nothing else is
//!   approximate.
//! - Inconsistent input never panics: a Free or Retag of an address not live is skipped, an Alloc at an
//!   address still live ends the earlier lifetime there.

use crate::Recording;
use memfit_memory::{Category, Event, EventKind, Phase};
use std::collections::{BTreeMap, HashMap};

/// One allocation from its Alloc event to its Free event, with its category over time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lifetime {
    pub address: u64,
    /// Block size (rounded), as the events count it.
    pub size: u64,
    /// Its category from `start` (from the window's start for a block live before it) until its first
    /// re-tag: its Alloc event's. When `initial_known` is false, its first re-tag's (see the Note).
    pub initial: Category,
    /// False for a block live before the window and re-tagged in it: its category before that first
    /// re-tag is not recorded.
    pub initial_known: bool,
    /// Its re-tags in order: (index of the Retag event, the category from then on).
    pub retags: Vec<(usize, Category)>,
    pub op: &'static str,
    pub phase: Phase,
    pub module: u32,
    /// Index of its Alloc event; None when it was live before the recorded window.
    pub start: Option<usize>,
    /// Index of its Free event; None when it is still live at the end.
    pub end: Option<usize>,
}

/// How a block's category at some moment relates to its history, for the tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CategoryNote {
    /// Allocated (in the window) as this other category, re-tagged since.
    AllocatedAs(Category),
    /// Live before the window and re-tagged later in it: the category of that moment is not recorded
    /// (the one given is what it was re-tagged to).
    Unknown,
}

impl Lifetime {
    /// Its category right after event `index` (while live).
    pub fn category_at(&self, index: usize) -> Category {
        match self.retags.partition_point(|&(at, _)| at <= index) {
            0 => self.initial,
            n => self.retags[n - 1].1,
        }
    }

    /// Its latest category (at its Free, or at the end).
    pub fn last_category(&self) -> Category {
        self.retags.last().map_or(self.initial, |&(_, category)| category)
    }

    /// Whether `category_at(index)` is recorded rather than assumed (see the Note).
    pub fn known_at(&self, index: usize) -> bool {
        self.initial_known || self.retags.first().is_some_and(|&(at, _)| at <= index)
    }

    /// What the tables add to `category_at(index)`: what it was allocated as, or that it is not known.
    pub fn note_at(&self, index: usize) -> Option<CategoryNote> {
        let category = self.category_at(index);
        if !self.known_at(index) {
            Some(CategoryNote::Unknown)
        } else if self.start.is_some() && self.initial != category {
            Some(CategoryNote::AllocatedAs(self.initial))
        } else {
            None
        }
    }

    /// The category it was allocated as, when its Alloc event is in the window.
    pub fn allocated_as(&self) -> Option<Category> {
        self.start.map(|_| self.initial)
    }

    /// "gradient" right after event `index`; "temporary -> activation" for a block allocated as a
    /// temporary and an activation then; "activation?" when not recorded (see the Note).
    pub fn category_label(&self, index: usize) -> String {
        let category = self.category_at(index);
        match self.note_at(index) {
            None => category.name().to_string(),
            Some(CategoryNote::AllocatedAs(first)) => format!("{first} -> {category}"),
            Some(CategoryNote::Unknown) => format!("{category}?"),
        }
    }

    /// Live right after event `index`.
    pub fn live_after(&self, index: usize) -> bool {
        !matches!(self.start, Some(start) if start > index) && !matches!(self.end, Some(end) if end <= index)
    }
}

/// The moment allocated bytes were highest in the recorded window: the Alloc event that reached it
/// (the last one, when reached repeatedly, as `MemoryStats::category_at_peak` does).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peak {
    pub index: usize,
    /// The Alloc event that reached it: its op, module and phase "made the peak".
    pub event: Event,
    pub time_ns: u64,
}

/// What one event did to the lifetimes.
#[derive(Clone, Copy, Debug, Default)]
struct Step {
    /// The lifetime it started.
    started: Option<usize>,
    /// The lifetime it ended.
    ended: Option<usize>,
    /// The lifetime it re-tagged, from one category to another.
    retagged: Option<(usize, Category, Category)>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Analysis {
    pub lifetimes: Vec<Lifetime>,
    pub peak: Option<Peak>,
    /// Per event, what it did.
    steps: Vec<Step>,
}

impl Analysis {
    pub fn of(recording: &Recording) -> Analysis {
        let events = &recording.events;
        let mut analysis = Analysis { steps: vec![Step::default(); events.len()], ..Analysis::default() };
        let mut live: HashMap<u64, usize> = HashMap::new();
        if recording.dropped_events > 0 {
            for lifetime in live_before_window(recording) {
                live.insert(lifetime.address, analysis.lifetimes.len());
                analysis.lifetimes.push(lifetime);
            }
        }
        for (index, (event, _)) in events.iter().enumerate() {
            let step = &mut analysis.steps[index];
            match event.kind {
                EventKind::Alloc => {
                    let id = analysis.lifetimes.len();
                    analysis.lifetimes.push(Lifetime {
                        address: event.address,
                        size: event.bytes,
                        initial: event.category,
                        initial_known: true,
                        retags: Vec::new(),
                        op: event.op,
                        phase: event.phase,
                        module: event.module,
                        start: Some(index),
                        end: None,
                    });
                    step.started = Some(id);
                    if let Some(earlier) = live.insert(event.address, id) {
                        analysis.lifetimes[earlier].end = Some(index);
                        step.ended = Some(earlier);
                    }
                }
                EventKind::Free => {
                    if let Some(id) = live.remove(&event.address) {
                        analysis.lifetimes[id].end = Some(index);
                        step.ended = Some(id);
                    }
                }
                EventKind::Retag => {
                    if let Some(&id) = live.get(&event.address) {
                        let lifetime = &mut analysis.lifetimes[id];
                        let from = lifetime.last_category();
                        lifetime.retags.push((index, event.category));
                        step.retagged = Some((id, from, event.category));
                    }
                }
                EventKind::SegmentAlloc
                | EventKind::SegmentFree
                | EventKind::SegmentMap
                | EventKind::SegmentUnmap
                | EventKind::Oom => {}
            }
        }

        // `max_by_key` keeps the last of equal maxima.
        analysis.peak = events
            .iter()
            .enumerate()
            .filter(|(_, (event, _))| event.kind == EventKind::Alloc && event.allocated > 0)
            .max_by_key(|(_, (event, _))| event.allocated)
            .map(|(index, &(event, time_ns))| Peak { index, event, time_ns });
        analysis
    }

    /// The allocations live right after the peak event, largest first (ties: lower address first);
    /// empty when there is no peak.
    pub fn live_at_peak(&self) -> Vec<&Lifetime> {
        let Some(peak) = self.peak else { return Vec::new() };
        let mut live: Vec<&Lifetime> = self.lifetimes.iter().filter(|l| l.live_after(peak.index)).collect();
        live.sort_by(|a, b| b.size.cmp(&a.size).then(a.address.cmp(&b.address)));
        live
    }

    /// Allocated bytes per category (by `Category::index`) right after event `index`, as replayed. At the
    /// peak of a complete timeline whose window peak is the overall one: `MemoryStats::category_at_peak`.
    pub fn by_category_at(&self, index: usize) -> [u64; Category::COUNT] {
        let mut bytes = [0u64; Category::COUNT];
        for lifetime in self.lifetimes.iter().filter(|l| l.live_after(index)) {
            let slot = &mut bytes[lifetime.category_at(index).index()];
            *slot = slot.saturating_add(lifetime.size);
        }
        bytes
    }

    /// Bytes the replay puts in another category than the allocator counted at the overall peak
    /// (`MemoryStats::category_at_peak`). 0 for a complete timeline; for a truncated one, at most the
    /// bytes whose category at the peak is not recorded (`unknown_at_peak`). Also 0 when the window's
    /// peak is not the overall one (then there is nothing exact to compare with).
    pub fn category_mismatch_at_peak(&self, recording: &Recording) -> u64 {
        let Some(peak) = self.peak.filter(|p| p.event.allocated == recording.stats.allocated_bytes.peak) else {
            return 0;
        };
        let replayed = self.by_category_at(peak.index);
        let differences = replayed.iter().zip(&recording.stats.category_at_peak).map(|(a, b)| a.abs_diff(*b));
        crate::saturating_sum(differences) / 2
    }

    /// Bytes of the blocks live before the window and re-tagged in it, whose category before that
    /// re-tag is not recorded (see the Note). 0 for a complete timeline.
    pub fn unknown_category_bytes(&self) -> u64 {
        crate::saturating_sum(self.lifetimes.iter().filter(|l| !l.initial_known).map(|l| l.size))
    }

    /// Of those, the bytes live at the peak and re-tagged only after it: their category at the peak is
    /// not recorded.
    pub fn unknown_at_peak(&self) -> u64 {
        let Some(peak) = self.peak else { return 0 };
        let unknown = self.lifetimes.iter().filter(|l| l.live_after(peak.index) && !l.known_at(peak.index));
        crate::saturating_sum(unknown.map(|l| l.size))
    }

    /// Allocated bytes per category (by `Category::index`) right after each event, each block counted
    /// in the category in force then.
    pub fn category_series(&self) -> Vec<[u64; Category::COUNT]> {
        let mut current = [0u64; Category::COUNT];
        let add = |current: &mut [u64; Category::COUNT], category: Category, bytes: u64| {
            let slot = &mut current[category.index()];
            *slot = slot.saturating_add(bytes);
        };
        let sub = |current: &mut [u64; Category::COUNT], category: Category, bytes: u64| {
            let slot = &mut current[category.index()];
            *slot = slot.saturating_sub(bytes);
        };
        for lifetime in self.lifetimes.iter().filter(|l| l.start.is_none()) {
            add(&mut current, lifetime.initial, lifetime.size);
        }
        self.steps
            .iter()
            .enumerate()
            .map(|(index, step)| {
                if let Some(lifetime) = step.ended.map(|id| &self.lifetimes[id]) {
                    sub(&mut current, lifetime.category_at(index), lifetime.size);
                }
                if let Some((id, from, to)) = step.retagged {
                    let size = self.lifetimes[id].size;
                    sub(&mut current, from, size);
                    add(&mut current, to, size);
                }
                if let Some(lifetime) = step.started.map(|id| &self.lifetimes[id]) {
                    add(&mut current, lifetime.initial, lifetime.size);
                }
                current
            })
            .collect()
    }
}

/// The blocks live just before `events[0]`, with their category then: the final snapshot's allocated
/// blocks with the window's events undone, newest first (see Note [Replaying a recording]).
fn live_before_window(recording: &Recording) -> Vec<Lifetime> {
    let lifetime = |address, size, category, op, phase, module| Lifetime {
        address,
        size,
        initial: category,
        initial_known: true,
        retags: Vec::new(),
        op,
        phase,
        module,
        start: None,
        end: None,
    };
    let mut live: BTreeMap<u64, Lifetime> = recording
        .segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .filter(|block| block.allocated)
        .map(|block| {
            let o = block.owner;
            (block.address, lifetime(block.address, block.size, o.category, o.op, o.phase, o.module))
        })
        .collect();
    for (event, _) in recording.events.iter().rev() {
        match event.kind {
            EventKind::Alloc => {
                live.remove(&event.address);
            }
            EventKind::Free => {
                let e = event;
                live.insert(e.address, lifetime(e.address, e.bytes, e.category, e.op, e.phase, e.module));
            }
            EventKind::Retag => {
                // Before this re-tag it had another category, which the event does not name.
                if let Some(lifetime) = live.get_mut(&event.address) {
                    lifetime.initial = event.category;
                    lifetime.initial_known = false;
                }
            }
            EventKind::SegmentAlloc
            | EventKind::SegmentFree
            | EventKind::SegmentMap
            | EventKind::SegmentUnmap
            | EventKind::Oom => {}
        }
    }
    live.into_values().collect()
}
