//! The typed out-of-memory error: the facts needed to act on it, and a message that reads like PyTorch's.
//!
//! Display: first sentence like PyTorch's:
//! "out of memory: tried to allocate 20.00 MiB for conv2d (forward, activation); capacity 64.00 MiB of
//! which 3.50 MiB is free; 40.00 MiB allocated, 20.50 MiB reserved but unallocated."
//! (capacity "unlimited" when None; "(injected fault)" appended when injected), then a line
//! "held by category: parameter 12.00 MiB, gradient ..., ..." (non-zero categories, largest first), then
//! "largest live allocations:" and up to 5 lines "  12.00 MiB parameter (linear)".

use crate::allocator::LiveAllocation;
use crate::bytes::format_bytes;
use crate::category::{Category, Phase};
use std::fmt;

#[derive(Clone, Debug)]
pub struct OutOfMemory {
    /// Rounded size of the failed request.
    pub requested: u64,
    /// Device capacity; None when unlimited (then the backend itself failed).
    pub capacity: Option<u64>,
    /// capacity - reserved (0 when unlimited).
    pub free: u64,
    pub allocated: u64,
    pub reserved_unallocated: u64,
    pub op: &'static str,
    pub phase: Phase,
    pub category: Category,
    /// Current allocated bytes per category (indexed by `Category::index`).
    pub by_category: [u64; Category::COUNT],
    /// The largest live allocations, largest first (at most 8).
    pub largest: Vec<LiveAllocation>,
    /// True when fault injection caused it.
    pub injected: bool,
    /// The allocator had expandable segments (which grow by pages instead of taking new segments).
    pub expandable: bool,
}

impl std::error::Error for OutOfMemory {}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory: tried to allocate {} for {} ({}, {}); ",
            format_bytes(self.requested),
            self.op,
            self.phase,
            self.category
        )?;
        match self.capacity {
            Some(capacity) => {
                write!(f, "capacity {} of which {} is free; ", format_bytes(capacity), format_bytes(self.free))?
            }
            None => f.write_str("capacity unlimited; ")?,
        }
        write!(
            f,
            "{} allocated, {} reserved but unallocated",
            format_bytes(self.allocated),
            format_bytes(self.reserved_unallocated)
        )?;
        f.write_str(if self.injected { ". (injected fault)" } else { "." })?;
        // When the request itself is smaller than what is free, say why it still failed: memory is
        // reserved in whole segments.
        if !self.injected && self.capacity.is_some() && self.expandable && self.requested <= self.free {
            f.write_str(
                " No free block fits, and the pages its pool's expandable segment lacks for it (2 MiB at a time, \
                 past the segment's free end) do not fit in what is free: free blocks inside a segment are not \
                 at its end.",
            )?;
        } else if let (false, Some(_), Some(segment)) =
            (self.injected, self.capacity, crate::allocator::segment_size_for(self.requested))
        {
            if self.requested <= self.free && segment > self.free {
                write!(
                    f,
                    " No cached block fits and a new {} segment does not fit in what is free \
                     (memory is reserved in segments of 2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB).",
                    format_bytes(segment)
                )?;
            }
        }

        // Non-zero categories, largest first; ties keep the category order.
        let mut held: Vec<(Category, u64)> =
            Category::ALL.iter().map(|&c| (c, self.by_category[c.index()])).filter(|&(_, b)| b > 0).collect();
        held.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
        f.write_str("\nheld by category: ")?;
        if held.is_empty() {
            f.write_str("nothing")?;
        }
        for (i, (category, bytes)) in held.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{category} {}", format_bytes(*bytes))?;
        }

        f.write_str("\nlargest live allocations:")?;
        if self.largest.is_empty() {
            f.write_str(" none")?;
        }
        for live in self.largest.iter().take(5) {
            write!(f, "\n  {} {} ({})", format_bytes(live.size), live.category, live.op)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn example() -> OutOfMemory {
        let mut by_category = [0; Category::COUNT];
        by_category[Category::Parameter.index()] = 12 * MIB;
        by_category[Category::Activation.index()] = 28 * MIB;
        let live =
            |size, category, op| LiveAllocation { size, category, op, phase: Phase::Forward, module: 0, address: 0 };
        OutOfMemory {
            requested: 20 * MIB,
            capacity: Some(64 * MIB),
            free: 3 * MIB + MIB / 2,
            allocated: 40 * MIB,
            reserved_unallocated: 20 * MIB + MIB / 2,
            op: "conv2d",
            phase: Phase::Forward,
            category: Category::Activation,
            by_category,
            largest: vec![
                live(16 * MIB, Category::Activation, "conv2d"),
                live(12 * MIB, Category::Parameter, "linear"),
                live(4 * MIB, Category::Activation, "relu"),
                live(4 * MIB, Category::Activation, "relu"),
                live(2 * MIB, Category::Activation, "relu"),
                live(2 * MIB, Category::Activation, "add"),
            ],
            injected: false,
            expandable: false,
        }
    }

    #[test]
    fn message_reads_like_pytorch() {
        let text = example().to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "out of memory: tried to allocate 20.00 MiB for conv2d (forward, activation); capacity 64.00 MiB \
             of which 3.50 MiB is free; 40.00 MiB allocated, 20.50 MiB reserved but unallocated."
        );
        assert_eq!(lines[1], "held by category: activation 28.00 MiB, parameter 12.00 MiB");
        assert_eq!(lines[2], "largest live allocations:");
        assert_eq!(lines[3], "  16.00 MiB activation (conv2d)");
        assert_eq!(lines[4], "  12.00 MiB parameter (linear)");
        assert_eq!(lines.len(), 3 + 5, "at most five allocations are listed");
    }

    #[test]
    fn unlimited_capacity_and_injected_fault() {
        let mut oom = example();
        oom.capacity = None;
        oom.free = 0;
        oom.injected = true;
        oom.by_category = [0; Category::COUNT];
        oom.largest.clear();
        let text = oom.to_string();
        assert!(text.contains("; capacity unlimited; 40.00 MiB allocated"), "{text}");
        assert!(text.contains("reserved but unallocated. (injected fault)\n"), "{text}");
        assert!(text.contains("held by category: nothing\n"), "{text}");
        assert!(text.ends_with("largest live allocations: none"), "{text}");
    }

    #[test]
    fn a_small_request_that_needs_a_whole_segment_says_so() {
        use crate::{Allocator, AllocatorConfig, MetaBackend, Request};
        let mut a =
            Allocator::new(Box::new(MetaBackend), AllocatorConfig { capacity: Some(MIB), ..Default::default() });
        let request = Request { category: Category::Parameter, op: "init", phase: Phase::Setup, module: 0 };
        let oom = a.allocate(1024, request).unwrap_err();
        let text = oom.to_string();
        assert!(text.contains("new 2.00 MiB segment does not fit"), "{text}");
        assert!(!example().to_string().contains("segment"), "not said when the request itself is too big");
    }

    #[test]
    fn with_expandable_segments_a_request_that_fits_what_is_free_says_why_it_failed_anyway() {
        let oom = OutOfMemory { requested: MIB, free: 3 * MIB, expandable: true, ..example() };
        let text = oom.to_string();
        assert!(text.contains("expandable segment lacks"), "{text}");
        assert!(!text.contains("new 2.00 MiB segment"), "no fixed-segment hint: {text}");
        let too_big = OutOfMemory { expandable: true, ..example() }.to_string();
        assert!(!too_big.contains("segment"), "not said when the request itself is too big: {too_big}");
    }

    /// Whether the "segment does not fit" hint is given for a request with `free` bytes free.
    fn hints(requested: u64, free: u64) -> bool {
        let mut oom = example();
        oom.requested = requested;
        oom.free = free;
        oom.to_string().contains("segment does not fit")
    }

    #[test]
    fn the_segment_hint_is_given_exactly_when_the_request_fits_and_its_segment_does_not() {
        // 1 MiB requests reserve 2 MiB segments.
        assert!(hints(MIB, MIB), "the request exactly fits what is free, its segment does not");
        assert!(hints(MIB, 2 * MIB - 512), "the segment is 512 B too big");
        assert!(!hints(MIB, 2 * MIB), "the segment exactly fits: not why it failed");
        assert!(!hints(MIB, MIB - 512), "the request itself does not fit");
        // 5 MiB requests reserve 20 MiB segments.
        assert!(hints(5 * MIB, 19 * MIB));
        assert!(!hints(5 * MIB, 20 * MIB));
        let text = {
            let mut oom = example();
            oom.requested = 5 * MIB;
            oom.free = 19 * MIB;
            oom.to_string()
        };
        assert!(text.contains("a new 20.00 MiB segment does not fit in what is free"), "{text}");
        // Neither for an injected fault nor without a capacity.
        let mut oom = example();
        oom.requested = MIB;
        oom.free = MIB;
        oom.injected = true;
        assert!(!oom.to_string().contains("segment"));
        oom.injected = false;
        oom.capacity = None;
        assert!(!oom.to_string().contains("segment"));
    }

    #[test]
    fn categories_are_listed_largest_first_with_ties_in_category_order() {
        let mut oom = example();
        oom.by_category = [0; Category::COUNT];
        oom.by_category[Category::Input.index()] = MIB;
        oom.by_category[Category::Gradient.index()] = MIB;
        oom.by_category[Category::Other.index()] = 2 * MIB;
        let text = oom.to_string();
        assert!(text.contains("\nheld by category: other 2.00 MiB, gradient 1.00 MiB, input 1.00 MiB\n"), "{text}");
    }
}
