//! A bounded ring buffer of allocator events, cheap enough to leave on. Each event also gets the time
//! it happened (nanoseconds since the timeline started), kept beside it rather than in it, so that
//! event sequences of two runs (meta and cpu) compare equal.

use crate::category::{Category, Phase};
use std::collections::VecDeque;
use std::time::Instant;

/// What happened. Replaying Alloc, Free and Retag in order gives every live block and its category at
/// each moment; SegmentAlloc and SegmentFree give the segments, SegmentMap and SegmentUnmap the
/// growth of expandable ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A block was handed out (with its owner's category, op, phase and module).
    Alloc,
    /// A live block was freed (with its owner as it was then: its latest category).
    Free,
    /// A segment was obtained from the backend (attributed to the request that needed it).
    SegmentAlloc,
    /// A fully free segment went back to the backend (attributed to the request that released the
    /// cache, or to `empty_cache`).
    SegmentFree,
    /// Pages were mapped at the end of an expandable segment (`bytes` of them at `address`; the first
    /// map of a pool also creates its segment), attributed to the request that needed them.
    SegmentMap,
    /// Free pages at the end of an expandable segment were given back (`bytes` at `address`; the last
    /// ones also remove the segment), attributed as SegmentFree.
    SegmentUnmap,
    /// A request failed (injected faults included); nothing was handed out.
    Oom,
    /// `Allocator::set_category` moved a live block to another category (only when it changed): autograd
    /// saving an op's output as an `activation`, a backward reusing a saved activation's memory for a
    /// gradient (`temporary`). The totals do not change.
    Retag,
}

/// One event. `bytes` is the block size (rounded) for Alloc/Free/Retag, the segment size for segment
/// events, the rounded request for Oom. `address` is the block's or segment's virtual address (0 for
/// Oom). `category`, `op`, `phase` and `module` are the owner's: the request's for Alloc, segment events
/// and Oom; the block's (its latest category) for Free; for Retag, the NEW category with the op, phase
/// and module that allocated the block (not those of the moment, so a Retag, like a Free, does not say
/// which phase is running). `module` indexes the device's module table (0 = none).
/// `allocated`/`reserved` are the totals right after the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub kind: EventKind,
    pub bytes: u64,
    pub address: u64,
    pub category: Category,
    pub op: &'static str,
    pub phase: Phase,
    pub module: u32,
    pub allocated: u64,
    pub reserved: u64,
}

/// Keeps the newest `capacity` events; `total` counts all events ever recorded.
#[derive(Clone, Debug)]
pub struct Timeline {
    events: VecDeque<Event>,
    /// `times[i]`: when `events[i]` happened, in ns since `start`.
    times: VecDeque<u64>,
    start: Instant,
    capacity: usize,
    total: u64,
}

impl Timeline {
    pub fn new(capacity: usize) -> Self {
        Timeline {
            events: VecDeque::with_capacity(capacity.min(1 << 16)),
            times: VecDeque::with_capacity(capacity.min(1 << 16)),
            start: Instant::now(),
            capacity,
            total: 0,
        }
    }

    pub fn record(&mut self, mut event: Event) {
        event.seq = self.total;
        self.total += 1;
        if self.capacity == 0 {
            return;
        }
        if self.events.len() == self.capacity {
            self.events.pop_front();
            self.times.pop_front();
        }
        self.events.push_back(event);
        self.times.push_back(self.start.elapsed().as_nanos() as u64);
    }

    /// Nanoseconds since the timeline started (the clock of its event times).
    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// The events with their times (ns since the timeline started), oldest first.
    pub fn timed_events(&self) -> impl Iterator<Item = (&Event, u64)> {
        self.events.iter().zip(self.times.iter().copied())
    }

    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The most host memory the buffer can hold: `capacity` events and their times.
    pub fn max_bytes(&self) -> u64 {
        let per_event = std::mem::size_of::<Event>() + std::mem::size_of::<u64>();
        (self.capacity as u64).saturating_mul(per_event as u64)
    }

    /// Events ever recorded, including those dropped from the buffer.
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn clear(&mut self) {
        self.events.clear();
        self.times.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(bytes: u64) -> Event {
        Event {
            seq: 99,
            kind: EventKind::Alloc,
            bytes,
            address: 0,
            category: Category::Temporary,
            op: "op",
            phase: Phase::Forward,
            module: 0,
            allocated: bytes,
            reserved: bytes,
        }
    }

    #[test]
    fn keeps_the_newest_events_and_counts_them_all() {
        let mut timeline = Timeline::new(3);
        assert!(timeline.is_empty());
        for bytes in 1..=5 {
            timeline.record(event(bytes));
        }
        assert_eq!(timeline.len(), 3);
        assert!(!timeline.is_empty());
        assert_eq!(timeline.total(), 5, "dropped events are counted");
        let kept: Vec<(u64, u64)> = timeline.events().map(|e| (e.seq, e.bytes)).collect();
        assert_eq!(kept, [(2, 3), (3, 4), (4, 5)], "sequence numbers are the timeline's, oldest first");
        let times: Vec<u64> = timeline.timed_events().map(|(_, t)| t).collect();
        assert_eq!(times.len(), 3);
        assert!(times.windows(2).all(|w| w[0] <= w[1]) && times[2] <= timeline.now_ns(), "{times:?}");
        let per_event = (std::mem::size_of::<Event>() + 8) as u64;
        assert_eq!(timeline.max_bytes(), 3 * per_event);
    }

    #[test]
    fn clear_empties_the_buffer_but_keeps_counting() {
        let mut timeline = Timeline::new(4);
        timeline.record(event(1));
        timeline.record(event(2));
        timeline.clear();
        assert!(timeline.is_empty());
        assert_eq!(timeline.timed_events().count(), 0);
        assert_eq!(timeline.total(), 2);
        timeline.record(event(3));
        let kept: Vec<(u64, u64)> = timeline.timed_events().map(|(e, _)| (e.seq, e.bytes)).collect();
        assert_eq!(kept, [(2, 3)]);
    }

    #[test]
    fn a_zero_capacity_timeline_keeps_nothing_and_counts() {
        let mut timeline = Timeline::new(0);
        timeline.record(event(1));
        assert_eq!((timeline.len(), timeline.total(), timeline.max_bytes()), (0, 1, 0));
    }
}
