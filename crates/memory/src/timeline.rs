//! A bounded ring buffer of allocator events, cheap enough to leave on. Each event also gets the time
//! it happened (nanoseconds since the timeline started), kept beside it rather than in it, so that
//! event sequences of two runs (meta and cpu) compare equal.

use crate::category::{Category, Phase};
use std::collections::VecDeque;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Alloc,
    Free,
    SegmentAlloc,
    SegmentFree,
    Oom,
}

/// One event. `bytes` is the block size (rounded) for Alloc/Free, the segment size for segment events,
/// the rounded request for Oom. `address` is the block's or segment's virtual address (0 for Oom).
/// `module` indexes the device's module table (0 = none). `allocated`/`reserved` are the totals right
/// after the event.
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

    /// Events ever recorded, including those dropped from the buffer.
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn clear(&mut self) {
        self.events.clear();
        self.times.clear();
    }
}
