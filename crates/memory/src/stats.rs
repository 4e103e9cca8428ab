//! Allocator statistics in one place. Every [`Stat`] changes only through `increase`/`decrease`,
//! which keep `peak >= current` and refuse to go negative.

use crate::category::Category;

/// One tracked quantity, as in PyTorch's `memory_stats`: current and peak values, and the running
/// totals of increases (`allocated`) and decreases (`freed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
    pub allocated: u64,
    pub freed: u64,
}

impl Stat {
    pub fn increase(&mut self, amount: u64) {
        self.current += amount;
        // The running totals only grow; on a meta device planning exabyte-scale runs they could in
        // principle pass u64::MAX, which must not panic (current values are bounded by isize::MAX).
        self.allocated = self.allocated.saturating_add(amount);
        self.peak = self.peak.max(self.current);
    }

    /// Panics (an internal invariant, not reachable from user input) if it would go negative.
    pub fn decrease(&mut self, amount: u64) {
        assert!(amount <= self.current, "memfit-memory: statistic would go negative");
        self.current -= amount;
        self.freed = self.freed.saturating_add(amount);
    }

    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A snapshot of everything the allocator counts. Names follow PyTorch's `memory_stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out (sizes rounded to 512 B).
    pub allocated_bytes: Stat,
    /// Bytes in segments obtained from the backend.
    pub reserved_bytes: Stat,
    /// Bytes in active blocks (equal to allocated here: there are no streams to wait for).
    pub active_bytes: Stat,
    /// Bytes in free blocks of segments that also hold other blocks (cannot be released).
    pub inactive_split_bytes: Stat,
    /// Bytes requested by callers before rounding.
    pub requested_bytes: Stat,
    /// Count of live allocations.
    pub allocation: Stat,
    /// Count of live segments.
    pub segment: Stat,
    /// Times a failed segment allocation released the cache and tried again.
    pub num_alloc_retries: u64,
    /// Requests that ended in OutOfMemory (injected faults included).
    pub num_ooms: u64,
    /// Of `num_ooms`, those caused by fault injection.
    pub num_injected_faults: u64,
    /// Allocated bytes per category (indexed by `Category::index`).
    pub by_category: [Stat; Category::COUNT],
    /// Allocated bytes per category at the moment `allocated_bytes.peak` was last reached.
    pub category_at_peak: [u64; Category::COUNT],
}

impl MemoryStats {
    pub fn category(&self, category: Category) -> &Stat {
        &self.by_category[category.index()]
    }

    /// Reserved bytes not allocated to any block: the fragmentation and cache overhead.
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved_bytes.current - self.allocated_bytes.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_current_peak_and_running_totals() {
        let mut stat = Stat::default();
        stat.increase(100);
        stat.increase(50);
        stat.decrease(120);
        assert_eq!(stat, Stat { current: 30, peak: 150, allocated: 150, freed: 120 });
        stat.reset_peak();
        assert_eq!(stat.peak, 30);
        stat.increase(u64::MAX - 30);
        stat.decrease(1);
        stat.increase(1);
        assert_eq!(stat.allocated, u64::MAX, "the running total saturates instead of overflowing");
    }

    #[test]
    #[should_panic(expected = "would go negative")]
    fn stat_refuses_to_go_negative() {
        let mut stat = Stat::default();
        stat.increase(1);
        stat.decrease(2);
    }

    #[test]
    fn reserved_unallocated_is_reserved_minus_allocated() {
        let mut stats = MemoryStats::default();
        stats.reserved_bytes.increase(20 << 20);
        stats.allocated_bytes.increase(12 << 20);
        assert_eq!(stats.reserved_unallocated(), 8 << 20);
        stats.by_category[Category::Gradient.index()].increase(7);
        assert_eq!(stats.category(Category::Gradient).current, 7);
        assert_eq!(stats.category(Category::Parameter).current, 0);
    }
}
