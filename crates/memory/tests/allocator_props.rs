//! Property tests of the caching allocator: random sequences of allocate / free / set_category /
//! empty_cache under a random capacity keep every invariant, on real host memory (blocks never
//! overlap, their contents survive) and on the meta backend, and both backends agree event for event.

use memfit_memory::{
    Allocation, Allocator, AllocatorConfig, Category, Event, FaultInjection, HostBackend, MemoryStats, MetaBackend,
    Phase, Request, SegmentBackend, Stat, PAGE_BYTES,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        bytes: u64,
        category: usize,
    },
    /// Frees the live block at `pick % live` (nothing when none is live).
    Free {
        pick: usize,
    },
    SetCategory {
        pick: usize,
        category: usize,
    },
    EmptyCache,
}

/// Sizes around every policy boundary: tiny, small pool, large pool, own segments.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..=4096,
        3 => 0u64..=MIB + 1024,
        2 => MIB..10 * MIB,
        1 => 10 * MIB - 1024..=30 * MIB,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (size(), 0..Category::COUNT).prop_map(|(bytes, category)| Op::Alloc { bytes, category }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0..Category::COUNT).prop_map(|(pick, category)| Op::SetCategory { pick, category }),
        1 => Just(Op::EmptyCache),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..150)
}

/// Bounded, so host runs stay within a few hundred MiB; 0 and sizes below one segment included.
fn capacity() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 1 => 0..4 * MIB, 4 => 0..=160 * MIB]
}

/// What happened to each `allocate` call: the block size, or whether the failure was injected.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Allocated(u64),
    Failed { injected: bool },
}

struct Run {
    events: Vec<Event>,
    stats: MemoryStats,
    outcomes: Vec<Outcome>,
}

struct Live {
    allocation: Allocation,
    category: Category,
    pattern: u8,
}

/// Writes `pattern` into the first byte of every 512-byte chunk of the block and into its last byte:
/// any two overlapping blocks share a whole chunk (blocks are 512-aligned), so overlap is caught.
fn fill(live: &Live) {
    let Some(ptr) = live.allocation.ptr else { return };
    for offset in (0..live.allocation.size).step_by(512).chain([live.allocation.size - 1]) {
        // SAFETY: offset < size, and the block's `size` bytes at `ptr` are owned by this live allocation.
        unsafe { ptr.as_ptr().add(offset as usize).write(live.pattern) };
    }
}

fn verify(live: &Live) -> Result<(), TestCaseError> {
    let Some(ptr) = live.allocation.ptr else { return Ok(()) };
    for offset in (0..live.allocation.size).step_by(512).chain([live.allocation.size - 1]) {
        // SAFETY: as in `fill`; the byte was written by `fill`, so it is initialized.
        let byte = unsafe { ptr.as_ptr().add(offset as usize).read() };
        prop_assert_eq!(byte, live.pattern, "block {:?} was overwritten at offset {}", live.allocation.id, offset);
    }
    Ok(())
}

fn stats_of(stats: &MemoryStats) -> Vec<(&'static str, Stat)> {
    let mut all = vec![
        ("allocated_bytes", stats.allocated_bytes),
        ("reserved_bytes", stats.reserved_bytes),
        ("active_bytes", stats.active_bytes),
        ("inactive_split_bytes", stats.inactive_split_bytes),
        ("requested_bytes", stats.requested_bytes),
        ("allocation", stats.allocation),
        ("segment", stats.segment),
    ];
    all.extend(Category::ALL.iter().map(|&c| (c.name(), *stats.category(c))));
    all
}

/// The snapshot is the allocator's state: segments tile their address ranges with blocks, never
/// overlap, hold exactly the live blocks, and replaying the timeline's events (alloc/free/retag,
/// segment alloc/free by address) reaches the same live blocks, with their current categories, and
/// segments; a Free names the category the replay gives its block, and the per-category totals of the
/// replay equal the allocator's at every event.
fn check_snapshot(allocator: &Allocator, live: &[Live]) -> Result<(), TestCaseError> {
    use memfit_memory::EventKind;
    let segments = allocator.snapshot();
    let stats = allocator.stats();
    prop_assert_eq!(segments.len() as u64, stats.segment.current);
    let mut end = 0;
    let mut allocated = std::collections::BTreeMap::new();
    for seg in &segments {
        prop_assert!(seg.address >= end, "segments overlap");
        let mut at = seg.address;
        for b in &seg.blocks {
            prop_assert_eq!(b.address, at, "blocks tile their segment");
            at += b.size;
            if b.allocated {
                allocated.insert(b.address, (b.size, b.owner.category));
            }
        }
        prop_assert_eq!(at - seg.address, seg.total_size);
        end = seg.address + seg.total_size;
    }
    prop_assert_eq!(allocated.values().map(|b| b.0).sum::<u64>(), stats.allocated_bytes.current);
    prop_assert_eq!(allocated.len(), live.len());
    let timeline = allocator.timeline();
    if timeline.total() == timeline.len() as u64 {
        let (mut blocks, mut segs) = (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
        let mut by_category = [0u64; Category::COUNT];
        for e in timeline.events() {
            match e.kind {
                EventKind::Alloc => {
                    prop_assert!(blocks.insert(e.address, (e.bytes, e.category)).is_none());
                    by_category[e.category.index()] += e.bytes;
                }
                EventKind::Free => {
                    prop_assert_eq!(blocks.remove(&e.address), Some((e.bytes, e.category)));
                    by_category[e.category.index()] -= e.bytes;
                }
                EventKind::Retag => {
                    let block = blocks.get_mut(&e.address);
                    prop_assert!(block.is_some(), "a re-tagged block is live");
                    let block = block.unwrap();
                    prop_assert_eq!(block.0, e.bytes);
                    prop_assert_ne!(block.1, e.category, "a Retag changes the category");
                    by_category[block.1.index()] -= e.bytes;
                    by_category[e.category.index()] += e.bytes;
                    block.1 = e.category;
                }
                EventKind::SegmentAlloc => prop_assert!(segs.insert(e.address, e.bytes).is_none()),
                EventKind::SegmentFree => prop_assert_eq!(segs.remove(&e.address), Some(e.bytes)),
                // An expandable segment grows and shrinks at its end; its first map creates it.
                EventKind::SegmentMap => match segs.iter_mut().find(|(&start, size)| start + **size == e.address) {
                    Some((_, size)) => *size += e.bytes,
                    None => prop_assert!(segs.insert(e.address, e.bytes).is_none()),
                },
                EventKind::SegmentUnmap => {
                    let end = e.address + e.bytes;
                    let start = segs.iter().find(|(&start, size)| start + **size == end).map(|(&start, _)| start);
                    prop_assert!(start.is_some(), "an unmap ends a segment");
                    let start = start.unwrap();
                    let size = segs[&start] - e.bytes;
                    if size == 0 {
                        segs.remove(&start);
                    } else {
                        segs.insert(start, size);
                    }
                }
                EventKind::Oom => {}
            }
            prop_assert_eq!(by_category.iter().sum::<u64>(), e.allocated);
        }
        prop_assert_eq!(&blocks, &allocated, "replayed events give the live blocks and their categories");
        let current: Vec<u64> = stats.by_category.iter().map(|s| s.current).collect();
        prop_assert_eq!(by_category.to_vec(), current, "and the allocator's bytes by category");
        let snapshot_segs: std::collections::BTreeMap<u64, u64> =
            segments.iter().map(|s| (s.address, s.total_size)).collect();
        prop_assert_eq!(segs, snapshot_segs, "replayed events give the segments");
    }
    Ok(())
}

fn check_invariants(allocator: &Allocator, live: &[Live], capacity: Option<u64>) -> Result<(), TestCaseError> {
    if let Err(message) = allocator.check_consistency() {
        return Err(TestCaseError::fail(message));
    }
    check_snapshot(allocator, live)?;
    let stats = allocator.stats();
    if let Some(capacity) = capacity {
        prop_assert!(stats.reserved_bytes.current <= capacity);
        prop_assert!(stats.reserved_bytes.peak <= capacity);
    }
    for (name, stat) in stats_of(stats) {
        prop_assert!(stat.current <= stat.peak, "{}: {:?}", name, stat);
        prop_assert_eq!(stat.allocated - stat.freed, stat.current, "{}", name);
    }
    prop_assert!(stats.reserved_bytes.current >= stats.allocated_bytes.current);
    prop_assert_eq!(stats.active_bytes.current, stats.allocated_bytes.current);
    let by_category: u64 = stats.by_category.iter().map(|s| s.current).sum();
    prop_assert_eq!(by_category, stats.allocated_bytes.current);
    let at_peak: u64 = stats.category_at_peak.iter().sum();
    prop_assert_eq!(at_peak, stats.allocated_bytes.peak);
    prop_assert_eq!(stats.allocation.current, live.len() as u64);
    prop_assert_eq!(stats.allocated_bytes.current, live.iter().map(|l| l.allocation.size).sum::<u64>());
    prop_assert_eq!(stats.requested_bytes.current, live.iter().map(|l| l.allocation.requested).sum::<u64>());
    for l in live {
        prop_assert_eq!(allocator.category_of(l.allocation.id).unwrap(), l.category);
    }
    let largest: Vec<u64> = allocator.live_allocations().iter().map(|l| l.size).collect();
    prop_assert!(largest.windows(2).all(|w| w[0] >= w[1]));
    prop_assert_eq!(largest.len(), live.len());

    // Address ranges of live blocks are disjoint.
    let mut ranges: Vec<(usize, usize)> = live
        .iter()
        .filter_map(|l| l.allocation.ptr.map(|p| (p.as_ptr() as usize, l.allocation.size as usize)))
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        prop_assert!(pair[0].0 + pair[0].1 <= pair[1].0, "blocks overlap: {:?}", pair);
    }
    Ok(())
}

/// The segment a new block of `rounded` bytes needs (the documented policy, restated).
fn segment_size(rounded: u64) -> u64 {
    if rounded <= MIB {
        2 * MIB
    } else if rounded < 10 * MIB {
        20 * MIB
    } else {
        rounded.next_multiple_of(2 * MIB)
    }
}

fn request(category: usize) -> Request {
    Request { category: Category::ALL[category], op: "prop", phase: Phase::Forward, module: 0 }
}

/// Runs `ops`, checking every invariant after every step, then frees everything and empties the cache.
fn run(
    backend: Box<dyn SegmentBackend>,
    capacity: Option<u64>,
    fault: Option<FaultInjection>,
    ops: &[Op],
) -> Result<Run, TestCaseError> {
    run_with(backend, capacity, fault, false, ops)
}

/// [`run`] with fixed or expandable segments.
fn run_with(
    backend: Box<dyn SegmentBackend>,
    capacity: Option<u64>,
    fault: Option<FaultInjection>,
    expandable: bool,
    ops: &[Op],
) -> Result<Run, TestCaseError> {
    let mut allocator = Allocator::new(backend, AllocatorConfig { capacity, fault, expandable, ..Default::default() });
    let mut live: Vec<Live> = Vec::new();
    let mut outcomes = Vec::new();
    let mut pattern = 0u8;
    for op in ops {
        match *op {
            Op::Alloc { bytes, category } => {
                let before = allocator.stats().clone();
                match allocator.allocate(bytes, request(category)) {
                    Ok(allocation) => {
                        prop_assert!(allocation.size >= bytes.max(1) && allocation.size % 512 == 0);
                        prop_assert_eq!(allocation.requested, bytes);
                        prop_assert_eq!(allocation.ptr.is_some(), allocator.holds_data());
                        pattern = pattern.wrapping_add(1);
                        let block = Live { allocation, category: Category::ALL[category], pattern };
                        fill(&block);
                        live.push(block);
                        outcomes.push(Outcome::Allocated(allocation.size));
                    }
                    Err(oom) => {
                        // Nothing handed out; only the cache (and the counters) may have changed.
                        let after = allocator.stats();
                        prop_assert_eq!(after.allocated_bytes, before.allocated_bytes);
                        prop_assert_eq!(after.num_ooms, before.num_ooms + 1);
                        prop_assert!(after.reserved_bytes.current <= before.reserved_bytes.current);
                        prop_assert_eq!(oom.allocated, after.allocated_bytes.current);
                        prop_assert_eq!(oom.capacity, capacity);
                        prop_assert!(oom.largest.len() <= 8);
                        if oom.injected {
                            let mut expected = before.clone();
                            expected.num_ooms += 1;
                            expected.num_injected_faults += 1;
                            prop_assert_eq!(after, &expected);
                        } else {
                            // A real failure only happens when a new segment cannot fit even after
                            // every fully free segment was released.
                            let reserved = after.reserved_bytes.current;
                            let cap = capacity.expect("host and meta runs only fail on the capacity");
                            // Fixed: a whole new segment; expandable: the pages past the free tail
                            // (less than a page of it is left after the release).
                            let segment =
                                if expandable { oom.requested + PAGE_BYTES } else { segment_size(oom.requested) };
                            prop_assert!(reserved + segment > cap, "{} + {} fits {}", reserved, segment, cap);
                            let cached_whole =
                                reserved - after.allocated_bytes.current - after.inactive_split_bytes.current;
                            prop_assert_eq!(cached_whole, 0, "fully free segments were released");
                        }
                        outcomes.push(Outcome::Failed { injected: oom.injected });
                    }
                }
            }
            Op::Free { pick } => {
                if !live.is_empty() {
                    let block = live.swap_remove(pick % live.len());
                    verify(&block)?;
                    allocator.free(block.allocation.id).unwrap();
                }
            }
            Op::SetCategory { pick, category } => {
                if !live.is_empty() {
                    let index = pick % live.len();
                    let changes = live[index].category != Category::ALL[category];
                    let events = allocator.timeline().total();
                    live[index].category = Category::ALL[category];
                    allocator.set_category(live[index].allocation.id, Category::ALL[category]).unwrap();
                    let recorded = allocator.timeline().total() - events;
                    prop_assert_eq!(recorded, u64::from(changes), "one Retag event exactly when the category changes");
                    if changes {
                        let retag = *allocator.timeline().events().last().expect("recorded");
                        prop_assert_eq!(retag.kind, memfit_memory::EventKind::Retag);
                        prop_assert_eq!(retag.bytes, live[index].allocation.size);
                        prop_assert_eq!(retag.category, Category::ALL[category]);
                        prop_assert_eq!(retag.allocated, allocator.stats().allocated_bytes.current);
                    }
                }
            }
            Op::EmptyCache => allocator.empty_cache(),
        }
        check_invariants(&allocator, &live, capacity)?;
    }

    for block in live.drain(..) {
        verify(&block)?;
        allocator.free(block.allocation.id).unwrap();
    }
    check_invariants(&allocator, &live, capacity)?;
    prop_assert_eq!(allocator.stats().allocated_bytes.current, 0);
    prop_assert_eq!(allocator.stats().requested_bytes.current, 0);
    prop_assert_eq!(allocator.stats().inactive_split_bytes.current, 0, "all free segments are whole blocks");
    allocator.empty_cache();
    check_invariants(&allocator, &live, capacity)?;
    prop_assert_eq!(allocator.stats().reserved_bytes.current, 0);
    prop_assert_eq!(allocator.stats().segment.current, 0);

    Ok(Run { events: allocator.timeline().events().copied().collect(), stats: allocator.stats().clone(), outcomes })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn host_random_sequences_keep_every_invariant(capacity in capacity(), ops in ops()) {
        run(Box::new(HostBackend::default()), Some(capacity), None, &ops)?;
    }

    #[test]
    fn meta_and_host_give_identical_timelines_and_stats(capacity in capacity(), ops in ops()) {
        let host = run(Box::new(HostBackend::default()), Some(capacity), None, &ops)?;
        let meta = run(Box::new(MetaBackend), Some(capacity), None, &ops)?;
        prop_assert_eq!(&host.outcomes, &meta.outcomes);
        prop_assert_eq!(&host.events, &meta.events);
        prop_assert_eq!(&host.stats, &meta.stats);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn expandable_host_random_sequences_keep_every_invariant(capacity in capacity(), ops in ops()) {
        run_with(Box::new(HostBackend::default()), Some(capacity), None, true, &ops)?;
    }

    #[test]
    fn expandable_meta_and_host_give_identical_timelines_and_stats(capacity in capacity(), ops in ops()) {
        let host = run_with(Box::new(HostBackend::default()), Some(capacity), None, true, &ops)?;
        let meta = run_with(Box::new(MetaBackend), Some(capacity), None, true, &ops)?;
        prop_assert_eq!(&host.outcomes, &meta.outcomes);
        prop_assert_eq!(&host.events, &meta.events);
        prop_assert_eq!(&host.stats, &meta.stats);
    }

    /// Never more reserved than fixed segments would reserve for the same requests, as long as
    /// nothing is freed (then neither has holes to reuse).
    #[test]
    fn expandable_reserves_at_most_what_fixed_does_while_nothing_is_freed(sizes in prop::collection::vec(size(), 1..40)) {
        let ops: Vec<Op> = sizes.iter().map(|&bytes| Op::Alloc { bytes, category: 0 }).collect();
        let fixed = run_with(Box::new(MetaBackend), None, None, false, &ops)?;
        let grown = run_with(Box::new(MetaBackend), None, None, true, &ops)?;
        prop_assert!(grown.stats.reserved_bytes.peak <= fixed.stats.reserved_bytes.peak);
        // Its blocks are never larger: any remainder is split off.
        prop_assert!(grown.stats.allocated_bytes.peak <= fixed.stats.allocated_bytes.peak);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn meta_random_sequences_keep_every_invariant(capacity in prop::option::of(capacity()), ops in ops()) {
        let result = run(Box::new(MetaBackend), capacity, None, &ops)?;
        if capacity.is_none() {
            prop_assert!(result.outcomes.iter().all(|o| matches!(o, Outcome::Allocated(_))));
        }
        let allocs = result.events.iter().filter(|e| e.kind == memfit_memory::EventKind::Alloc).count();
        let frees = result.events.iter().filter(|e| e.kind == memfit_memory::EventKind::Free).count();
        prop_assert_eq!(allocs, frees);
    }

    #[test]
    fn nth_fault_fails_only_that_request(n in 1u64..40, capacity in prop::option::of(capacity()), ops in ops()) {
        let result = run(Box::new(MetaBackend), capacity, Some(FaultInjection::Nth(n)), &ops)?;
        for (i, outcome) in result.outcomes.iter().enumerate() {
            let number = i as u64 + 1;
            if number == n {
                prop_assert_eq!(outcome, &Outcome::Failed { injected: true });
            } else {
                prop_assert_ne!(outcome, &Outcome::Failed { injected: true });
                if capacity.is_none() {
                    prop_assert!(matches!(outcome, Outcome::Allocated(_)), "request {} failed", number);
                }
            }
        }
        let expected = u64::from(result.outcomes.len() as u64 >= n);
        prop_assert_eq!(result.stats.num_injected_faults, expected);
    }

    #[test]
    fn every_nth_fault_fails_exactly_the_multiples(n in 1u64..8, ops in ops()) {
        let result = run(Box::new(MetaBackend), None, Some(FaultInjection::EveryNth(n)), &ops)?;
        for (i, outcome) in result.outcomes.iter().enumerate() {
            let number = i as u64 + 1;
            if number.checked_rem(n) == Some(0) {
                prop_assert_eq!(outcome, &Outcome::Failed { injected: true });
            } else {
                prop_assert!(matches!(outcome, Outcome::Allocated(_)), "request {} failed", number);
            }
        }
        prop_assert_eq!(result.stats.num_injected_faults, result.outcomes.len() as u64 / n);
        prop_assert_eq!(result.stats.num_ooms, result.stats.num_injected_faults);
    }

    #[test]
    fn host_faults_leave_a_working_allocator(n in 1u64..6, capacity in capacity(), ops in ops()) {
        let host = run(Box::new(HostBackend::default()), Some(capacity), Some(FaultInjection::EveryNth(n)), &ops)?;
        let meta = run(Box::new(MetaBackend), Some(capacity), Some(FaultInjection::EveryNth(n)), &ops)?;
        prop_assert_eq!(&host.events, &meta.events);
        prop_assert_eq!(&host.stats, &meta.stats);
    }
}
