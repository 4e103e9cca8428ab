//! The caching allocator. Policy (PyTorch's CUDA caching allocator):
//! - request sizes round up to a multiple of 512 B (minimum 512);
//! - rounded sizes <= 1 MiB come from the small pool, served from 2 MiB segments;
//!   sizes in (1 MiB, 10 MiB) from the large pool with 20 MiB segments; sizes >= 10 MiB get their own
//!   segment rounded up to 2 MiB;
//! - a request takes the best-fitting free block of its pool (smallest size, then lowest segment id,
//!   then lowest offset); a block larger than needed is split when the remainder is >= 512 B (small
//!   pool) or > 1 MiB (large pool); otherwise the whole block is handed out (size = block size);
//! - a freed block coalesces with free neighbours in its segment; segments stay cached (reserved)
//!   until `empty_cache` or a failed segment allocation releases fully free segments;
//! - a new segment that would exceed the capacity, or that the backend cannot provide, triggers one
//!   release of all fully free cached segments and one retry (`num_alloc_retries`); if that fails too,
//!   the request is an `OutOfMemory` (`num_ooms`), and the allocator's state is as before the request
//!   (apart from the released cache). When nothing was cached there is nothing to retry with: the
//!   request fails at once and `num_alloc_retries` does not change;
//! - fault injection fails chosen requests before anything else happens (no retry, no release);
//! - with expandable segments (`AllocatorConfig::expandable`, PyTorch's `expandable_segments:True`)
//!   each pool is one segment in a reservation of address space that grows at its end: a request no
//!   free block holds maps just the pages it lacks past the segment's free tail ([`PAGE_BYTES`] at a
//!   time; a request of any size, 10 MiB and more too, joins the large pool's segment), and a release
//!   unmaps the whole free pages at the end (a segment left empty is removed). Reserved bytes then
//!   follow allocated bytes within a page per pool, where fixed segments keep each 20 MiB segment
//!   whole while any block in it lives. Rounding, pools and best fit are the same; any remainder of
//!   512 B or more is split off (a large block's remainder too: its pages were mapped for it);
//! - a request whose rounded size or segment does not fit in `isize::MAX` (the most any allocation can
//!   be) is an `OutOfMemory` without touching the cache; total reserved bytes are likewise kept at or
//!   below `isize::MAX` even when the capacity is unlimited, so no statistic can overflow.
//!
//! Events: every change is recorded in the [`Timeline`] (see [`EventKind`]): a block handed out or
//! freed (`Alloc`, `Free`), a segment obtained or released (`SegmentAlloc`, `SegmentFree`), a failed
//! request (`Oom`) and a live block moved to another category by `set_category` (`Retag`). Replaying
//! them gives the live blocks, their categories and the totals at every moment.
//!
//! Data structures: blocks live in an arena (a `BlockId` holds an index into it, checked against the
//! serial number of the allocation, because slots are reused), linked
//! to their neighbours in the segment; each pool keeps its free blocks in a `BTreeSet` ordered by
//! (size, segment id, offset), so the first entry at or above the request is the best fit. Segment ids
//! increase monotonically and are never reused, which keeps every choice deterministic: the same
//! sequence of calls gives the same events and statistics on every backend.

use crate::backend::{SegmentBackend, PAGE_BYTES};
use crate::category::{Category, Phase};
use crate::oom::OutOfMemory;
use crate::stats::{MemoryStats, Stat};
use crate::timeline::{Event, EventKind, Timeline};
use std::collections::{BTreeMap, BTreeSet};
use std::ptr::NonNull;

/// Every block size is a multiple of this (and so is every block offset).
const MIN_BLOCK_SIZE: u64 = 512;
/// Largest rounded request served by the small pool.
const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size of the large pool for requests below `MIN_LARGE_ALLOC`.
const LARGE_BUFFER: u64 = 20 << 20;
/// Requests at least this large get a segment of their own.
const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Granularity of those own segments.
const ROUND_LARGE: u64 = 2 << 20;
/// No allocation, and no total of reserved bytes, may exceed this.
const MAX_BYTES: u64 = isize::MAX as u64;
/// Virtual address of the first segment; later segments follow at 2 MiB-aligned addresses.
const FIRST_ADDRESS: u64 = 1 << 32;
/// Address space an expandable segment reserves when the capacity is unlimited (and at most).
const EXPANDABLE_SPAN: u64 = 1 << 40;

/// Opaque handle to a live block, valid until passed to `free`. It names its allocator and carries the
/// serial number of the allocation it was handed out for, so a stale handle (its block freed, the
/// record reused) or one from another allocator is refused with [`InvalidBlock`] instead of acting
/// on someone else's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    allocator: u32,
    index: u32,
    serial: u64,
}

/// A [`BlockId`] that does not name a live block of this allocator: already freed, or handed out by
/// another allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidBlock(pub BlockId);

impl std::fmt::Display for InvalidBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} is not a live block of this allocator (already freed, or from another allocator)", self.0)
    }
}

impl std::error::Error for InvalidBlock {}

/// Distinguishes allocators in their block handles.
static NEXT_ALLOCATOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Fault injection: make requests fail with `OutOfMemory { injected: true, .. }` for testing recovery.
/// Requests are counted from 1 over the allocator's life (only `allocate` calls count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultInjection {
    /// Only the N-th request fails.
    Nth(u64),
    /// Every N-th request fails (N, 2N, 3N, ...).
    EveryNth(u64),
}

#[derive(Clone, Debug)]
pub struct AllocatorConfig {
    /// Maximum reserved bytes; None = unlimited.
    pub capacity: Option<u64>,
    /// Events kept in the timeline (default 65,536).
    pub timeline_events: usize,
    pub fault: Option<FaultInjection>,
    /// One growing segment per pool instead of fixed segments (see the module docs).
    pub expandable: bool,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig { capacity: None, timeline_events: 1 << 16, fault: None, expandable: false }
    }
}

/// Who asks, for what: the provenance every block and event carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub category: Category,
    pub op: &'static str,
    pub phase: Phase,
    /// The module (layer) that asked, as an index into its device's module table; 0 = none.
    pub module: u32,
}

/// A block handed out. `ptr` is None on a backend that holds no data. `size` is the block size
/// (>= the rounded request); `requested` is the caller's byte count.
#[derive(Clone, Copy, Debug)]
pub struct Allocation {
    pub id: BlockId,
    pub ptr: Option<NonNull<u8>>,
    pub size: u64,
    pub requested: u64,
}

/// A live block as reported in OOM messages and snapshots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveAllocation {
    pub size: u64,
    pub category: Category,
    pub op: &'static str,
    pub phase: Phase,
    pub module: u32,
    /// Its address in the allocator's address space (see [`SegmentSnapshot`]).
    pub address: u64,
}

/// One segment as it is now, for memory snapshots: PyTorch's `segments` entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Virtual address of the segment's first byte: assigned in segment order, the same on every
    /// backend (meta included), so snapshots and traces of meta and cpu agree.
    pub address: u64,
    pub total_size: u64,
    /// `small` (2 MiB segments) or `large`.
    pub pool: &'static str,
    /// One growing segment of its pool (`AllocatorConfig::expandable`); `total_size` is what is mapped.
    pub expandable: bool,
    /// The blocks tiling the segment, by address.
    pub blocks: Vec<BlockSnapshot>,
}

/// One block of a segment: allocated (with its owner) or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    pub address: u64,
    pub size: u64,
    /// The caller's byte count (0 when free).
    pub requested: u64,
    pub allocated: bool,
    /// The owner (of the last allocation of this block's first byte, when free).
    pub owner: Request,
}

/// An owned copy of what an allocator knows at one moment, for profiles and tests that must not hold
/// the allocator (a device keeps it behind a lock that its own operations take).
#[derive(Clone, Debug, Default)]
pub struct MemoryState {
    pub capacity: Option<u64>,
    pub stats: MemoryStats,
    /// The timeline's events with their times (ns since the allocator started), oldest first.
    pub events: Vec<(Event, u64)>,
    /// Events the bounded timeline dropped before `events[0]` (0 when complete).
    pub dropped_events: u64,
    /// [`Allocator::snapshot`].
    pub segments: Vec<SegmentSnapshot>,
}

pub struct Allocator {
    backend: Box<dyn SegmentBackend>,
    holds_data: bool,
    config: AllocatorConfig,
    /// Block records; `None` marks a slot listed in `free_slots`.
    blocks: Vec<Option<Block>>,
    free_slots: Vec<u32>,
    small_free: BTreeSet<FreeKey>,
    large_free: BTreeSet<FreeKey>,
    segments: BTreeMap<u64, Segment>,
    next_segment_id: u64,
    /// Where the next segment's virtual address space starts.
    next_address: u64,
    stats: MemoryStats,
    timeline: Timeline,
    /// `allocate` calls so far (the fault-injection request number).
    requests: u64,
    /// This allocator's number in its block handles.
    id: u32,
    /// Allocations handed out so far (the serial of the last one).
    handed_out: u64,
    /// Requests are served from memory already held (see [`Allocator::set_held_only`]).
    held_only: bool,
    /// A request that needs new memory never releases the cache first (see
    /// [`Allocator::set_keep_cache`]).
    keep_cache: bool,
    /// Requests no free block held, so that they needed new memory (or failed), so far.
    new_memory_requests: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Small,
    Large,
}

/// A free block's key in its pool: (size, segment id, offset, block index). The order is the best-fit
/// order; the index makes keys unique and finds the record.
type FreeKey = (u64, u64, u64, u32);

/// A contiguous piece of a segment, allocated or free. Free blocks never neighbour each other
/// (they are coalesced), so a fully free segment is exactly one block.
#[derive(Clone, Debug)]
struct Block {
    segment: u64,
    offset: u64,
    size: u64,
    allocated: bool,
    prev: Option<u32>,
    next: Option<u32>,
    /// The owner (meaningful while allocated).
    owner: Request,
    /// The caller's byte count (while allocated).
    requested: u64,
    /// The serial number of the allocation holding the block (while allocated; see [`BlockId`]).
    serial: u64,
}

#[derive(Debug)]
struct Segment {
    base: Option<NonNull<u8>>,
    /// Virtual address (see [`SegmentSnapshot::address`]).
    address: u64,
    size: u64,
    pool: Pool,
    /// Sum of the sizes of the segment's free blocks.
    free_bytes: u64,
    /// The block at offset 0 (never merged away: merges keep the left block).
    first_block: u32,
    /// An expandable segment's reserved address space (its `size` is what is mapped); 0 for a fixed one.
    span: u64,
}

impl Segment {
    /// This segment's share of `inactive_split_bytes`: its free bytes, unless the whole segment is one
    /// free block (then it is releasable cache, not fragmentation).
    fn inactive_split(&self) -> u64 {
        if self.free_bytes == self.size {
            0
        } else {
            self.free_bytes
        }
    }
}

/// Rounded size, pool and the size of a new segment for a request; None when it cannot be served
/// by any allocation (rounding overflows or the result exceeds `isize::MAX`).
fn plan(bytes: u64) -> Option<(u64, Pool, u64)> {
    let rounded = bytes.max(1).checked_next_multiple_of(MIN_BLOCK_SIZE)?;
    let (pool, segment_size) = if rounded <= SMALL_SIZE {
        (Pool::Small, SMALL_BUFFER)
    } else if rounded < MIN_LARGE_ALLOC {
        (Pool::Large, LARGE_BUFFER)
    } else {
        (Pool::Large, rounded.checked_next_multiple_of(ROUND_LARGE)?)
    };
    (segment_size <= MAX_BYTES).then_some((rounded, pool, segment_size))
}

/// The size of the segment a request of `bytes` would reserve when no cached block fits.
pub(crate) fn segment_size_for(bytes: u64) -> Option<u64> {
    plan(bytes).map(|(_, _, segment)| segment)
}

/// Whether a free block with `remaining` bytes past the request is split (else handed out whole).
/// An expandable segment splits off any remainder: its pages were mapped for this request, and a
/// remainder handed out with it would be memory nobody asked for.
fn should_split(pool: Pool, expandable: bool, remaining: u64) -> bool {
    match pool {
        _ if expandable => remaining >= MIN_BLOCK_SIZE,
        Pool::Small => remaining >= MIN_BLOCK_SIZE,
        Pool::Large => remaining > SMALL_SIZE,
    }
}

// SAFETY: the only non-Send fields are the segment base pointers. They point to memory the allocator
// owns exclusively (obtained from its own backend, which is Send, and returned only to it); the
// allocator never reads or writes through them, it only hands out derived addresses. Moving the
// allocator to another thread therefore cannot create shared access it does not already allow.
unsafe impl Send for Allocator {}

impl Allocator {
    pub fn new(backend: Box<dyn SegmentBackend>, config: AllocatorConfig) -> Self {
        Allocator {
            holds_data: backend.holds_data(),
            backend,
            timeline: Timeline::new(config.timeline_events),
            config,
            blocks: Vec::new(),
            free_slots: Vec::new(),
            small_free: BTreeSet::new(),
            large_free: BTreeSet::new(),
            segments: BTreeMap::new(),
            next_segment_id: 0,
            next_address: FIRST_ADDRESS,
            stats: MemoryStats::default(),
            requests: 0,
            id: NEXT_ALLOCATOR.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            handed_out: 0,
            held_only: false,
            keep_cache: false,
            new_memory_requests: 0,
        }
    }

    pub fn holds_data(&self) -> bool {
        self.holds_data
    }

    pub fn capacity(&self) -> Option<u64> {
        self.config.capacity
    }

    /// Zero-byte requests are valid and take a 512 B block.
    // The error is large, but it is the cold path and its shape is part of the crate's contract.
    #[allow(clippy::result_large_err)]
    pub fn allocate(&mut self, bytes: u64, request: Request) -> Result<Allocation, OutOfMemory> {
        self.requests += 1;
        if !self.held_only && self.fault_fires() {
            let rounded = plan(bytes).map_or(bytes, |(rounded, _, _)| rounded);
            return Err(self.out_of_memory(rounded, request, true));
        }
        let Some((rounded, pool, segment_size)) = plan(bytes) else {
            // Nothing could ever hold it: fail without disturbing the cache.
            return Err(self.out_of_memory(bytes, request, false));
        };
        let index = match self.best_fit(pool, rounded) {
            Some(index) => index,
            None => {
                self.new_memory_requests += 1;
                let made = if self.config.expandable {
                    self.grow(pool, rounded, request)
                } else {
                    self.new_segment(pool, segment_size, request)
                };
                match made {
                    Ok(index) => index,
                    Err(()) => return Err(self.out_of_memory(rounded, request, false)),
                }
            }
        };
        Ok(self.hand_out(index, rounded, bytes, request))
    }

    /// Frees a live block. A handle that names no live block of this allocator (freed already, or
    /// another allocator's) is refused and changes nothing.
    pub fn free(&mut self, id: BlockId) -> Result<(), InvalidBlock> {
        let index = id.index;
        let block = self.live_block(id)?.clone();

        self.stats.allocated_bytes.decrease(block.size);
        self.stats.active_bytes.decrease(block.size);
        self.stats.requested_bytes.decrease(block.requested);
        self.stats.allocation.decrease(1);
        self.stats.by_category[block.owner.category.index()].decrease(block.size);

        let segment = &self.segments[&block.segment];
        let address = segment.address + block.offset;
        let (pool, inactive_before) = (segment.pool, segment.inactive_split());

        // Coalesce with free neighbours; the leftmost record survives.
        let mut start = index;
        let mut offset = block.offset;
        let mut size = block.size;
        let mut next = block.next;
        if let Some(n) = next.filter(|&n| !self.block(n).allocated) {
            let right = self.remove_free(pool, n);
            size += right.size;
            next = right.next;
        }
        if let Some(p) = block.prev.filter(|&p| !self.block(p).allocated) {
            let left = self.block(p).clone();
            self.free_set(pool).remove(&(left.size, left.segment, left.offset, p));
            self.release_slot(index);
            start = p;
            offset = left.offset;
            size += left.size;
        }
        if let Some(n) = next {
            self.block_mut(n).prev = Some(start);
        }
        let merged = self.block_mut(start);
        merged.allocated = false;
        merged.size = size;
        merged.next = next;
        merged.requested = 0;
        self.free_set(pool).insert((size, block.segment, offset, start));

        let segment = self.segments.get_mut(&block.segment).expect("block's segment exists");
        segment.free_bytes += block.size;
        let inactive_after = segment.inactive_split();
        self.adjust_inactive_split(inactive_before, inactive_after);

        self.record(EventKind::Free, block.size, address, block.owner);
        Ok(())
    }

    /// Re-tags a live block (moves its bytes between categories) and records a Retag event, unless the
    /// block already has that category (then nothing happens). Allocated bytes do not change, so
    /// neither does `category_at_peak`: it keeps the mix of the moment the peak was reached.
    pub fn set_category(&mut self, id: BlockId, category: Category) -> Result<(), InvalidBlock> {
        let block = self.live_block(id)?;
        let (old, size) = (block.owner.category, block.size);
        if old == category {
            return Ok(());
        }
        let address = self.segments[&block.segment].address + block.offset;
        self.stats.by_category[old.index()].decrease(size);
        self.stats.by_category[category.index()].increase(size);
        let owner = &mut self.block_mut(id.index).owner;
        owner.category = category;
        let owner = *owner;
        self.record(EventKind::Retag, size, address, owner);
        Ok(())
    }

    /// The category a live block is accounted under.
    pub fn category_of(&self, id: BlockId) -> Result<Category, InvalidBlock> {
        Ok(self.live_block(id)?.owner.category)
    }

    /// Declares that, until called again with false, every request is served from memory the
    /// allocator already holds (its caller proved it: Note [Step in backward] in the train crate).
    /// Such a request cannot be refused, so fault injection, which stands for a refusal, skips it.
    pub fn set_held_only(&mut self, on: bool) {
        self.held_only = on;
    }

    /// Until called again with false, a request that no free block holds fails when the capacity or
    /// the backend refuses new memory, without first releasing the cache and retrying: a rehearsal
    /// (Note [Step in backward] in the train crate) must not pass by re-making segments mid-pass,
    /// which the pass it proves could not afford after its first update.
    pub fn set_keep_cache(&mut self, on: bool) {
        self.keep_cache = on;
    }

    /// Requests so far that no free block held, so that they asked for new memory (granted or not).
    pub fn requests_for_new_memory(&self) -> u64 {
        self.new_memory_requests
    }

    /// A digest of everything a request's placement depends on: per pool, its segments in order
    /// (their sizes and reserved spans) and their blocks (offset, size, taken or free). Two equal
    /// digests mean the same sequence of requests is served in the same places with the same new
    /// memory (none, when a run of it left the digest unchanged). Segment ids and addresses are left
    /// out: only their order decides, and a segment re-made after a release gets a new id.
    pub fn layout_digest(&self) -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut mix = |v: u64| {
            for byte in v.to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        for pool in [Pool::Small, Pool::Large] {
            mix(pool as u64);
            for segment in self.segments.values().filter(|s| s.pool == pool) {
                mix(u64::MAX);
                mix(segment.size);
                mix(segment.span);
                let mut index = Some(segment.first_block);
                while let Some(i) = index {
                    let block = self.block(i);
                    mix(block.offset);
                    mix(block.size << 1 | u64::from(block.allocated));
                    index = block.next;
                }
            }
        }
        mix(self.config.capacity.unwrap_or(u64::MAX));
        hash
    }

    /// Releases every fully free cached segment back to the backend.
    pub fn empty_cache(&mut self) {
        let owner = Request { category: Category::Other, op: "empty_cache", phase: Phase::Setup, module: 0 };
        self.release_free_segments(owner);
    }

    pub fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    /// Sets every peak to its current value (and category_at_peak to the current mix).
    pub fn reset_peak_stats(&mut self) {
        let stats = &mut self.stats;
        for stat in [
            &mut stats.allocated_bytes,
            &mut stats.reserved_bytes,
            &mut stats.active_bytes,
            &mut stats.inactive_split_bytes,
            &mut stats.requested_bytes,
            &mut stats.allocation,
            &mut stats.segment,
        ] {
            stat.reset_peak();
        }
        stats.by_category.iter_mut().for_each(Stat::reset_peak);
        stats.category_at_peak = stats.by_category.map(|stat| stat.current);
    }

    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    pub fn set_fault_injection(&mut self, fault: Option<FaultInjection>) {
        self.config.fault = fault;
    }

    /// Live blocks, largest first (ties: lower id first).
    pub fn live_allocations(&self) -> Vec<LiveAllocation> {
        let mut live: Vec<(u64, usize, LiveAllocation)> = self
            .blocks
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| slot.as_ref().filter(|b| b.allocated).map(|b| (index, b)))
            .map(|(index, b)| {
                let address = self.segments[&b.segment].address + b.offset;
                let o = b.owner;
                let live = LiveAllocation {
                    size: b.size,
                    category: o.category,
                    op: o.op,
                    phase: o.phase,
                    module: o.module,
                    address,
                };
                (b.size, index, live)
            })
            .collect();
        live.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        live.into_iter().map(|(_, _, allocation)| allocation).collect()
    }

    /// Capacity, statistics, timeline and segments, copied.
    pub fn state(&self) -> MemoryState {
        let timeline = &self.timeline;
        MemoryState {
            capacity: self.capacity(),
            stats: self.stats.clone(),
            events: timeline.timed_events().map(|(event, time)| (*event, time)).collect(),
            dropped_events: timeline.total().saturating_sub(timeline.len() as u64),
            segments: self.snapshot(),
        }
    }

    /// Every segment and its blocks as they are now, by address (PyTorch's snapshot `segments`).
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        self.segments
            .values()
            .map(|segment| {
                let mut blocks = Vec::new();
                let mut cursor = Some(segment.first_block);
                while let Some(index) = cursor {
                    let b = self.block(index);
                    blocks.push(BlockSnapshot {
                        address: segment.address + b.offset,
                        size: b.size,
                        requested: b.requested,
                        allocated: b.allocated,
                        owner: b.owner,
                    });
                    cursor = b.next;
                }
                let pool = match segment.pool {
                    Pool::Small => "small",
                    Pool::Large => "large",
                };
                SegmentSnapshot {
                    address: segment.address,
                    total_size: segment.size,
                    pool,
                    expandable: segment.span > 0,
                    blocks,
                }
            })
            .collect()
    }

    /// Walks every internal structure and checks it against the statistics: blocks tile their
    /// segments, free blocks are coalesced and listed in their pool, and every byte count adds up.
    /// O(blocks); meant for tests and debugging.
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut allocated = 0;
        let mut requested = 0;
        let mut live = 0;
        let mut inactive = 0;
        let mut reserved = 0;
        let mut by_category = [0u64; Category::COUNT];
        let mut free_keys = (BTreeSet::new(), BTreeSet::new());
        let mut seen = 0usize;
        for (&id, segment) in &self.segments {
            reserved += segment.size;
            let (mut offset, mut free, mut prev) = (0, 0, None);
            let mut cursor = Some(segment.first_block);
            while let Some(index) = cursor {
                let block = self.blocks.get(index as usize).and_then(Option::as_ref);
                let block = block.ok_or(format!("segment {id}: dangling block {index}"))?;
                seen += 1;
                if block.segment != id || block.offset != offset || block.prev != prev {
                    return Err(format!("segment {id}: block {index} is out of place: {block:?}"));
                }
                if block.size == 0 || block.size % MIN_BLOCK_SIZE != 0 {
                    return Err(format!("segment {id}: block {index} has size {}", block.size));
                }
                if block.allocated {
                    allocated += block.size;
                    requested += block.requested;
                    live += 1;
                    by_category[block.owner.category.index()] += block.size;
                } else {
                    free += block.size;
                    let key = (block.size, id, offset, index);
                    match segment.pool {
                        Pool::Small => free_keys.0.insert(key),
                        Pool::Large => free_keys.1.insert(key),
                    };
                    let next_free =
                        block.next.is_some_and(|n| self.blocks[n as usize].as_ref().is_some_and(|b| !b.allocated));
                    if next_free {
                        return Err(format!("segment {id}: free block {index} was not coalesced"));
                    }
                }
                offset += block.size;
                prev = Some(index);
                cursor = block.next;
            }
            if offset != segment.size || free != segment.free_bytes {
                return Err(format!("segment {id}: blocks cover {offset} of {} bytes, {free} free", segment.size));
            }
            inactive += segment.inactive_split();
        }
        let occupied = self.blocks.iter().filter(|slot| slot.is_some()).count();
        if seen != occupied || occupied + self.free_slots.len() != self.blocks.len() {
            return Err(format!("{occupied} block records, {seen} in segments, {} free slots", self.free_slots.len()));
        }
        if free_keys.0 != self.small_free || free_keys.1 != self.large_free {
            return Err("the free pools do not match the free blocks".to_string());
        }
        let stats = &self.stats;
        let expected = [
            ("allocated_bytes", stats.allocated_bytes, allocated),
            ("active_bytes", stats.active_bytes, allocated),
            ("requested_bytes", stats.requested_bytes, requested),
            ("allocation", stats.allocation, live),
            ("reserved_bytes", stats.reserved_bytes, reserved),
            ("segment", stats.segment, self.segments.len() as u64),
            ("inactive_split_bytes", stats.inactive_split_bytes, inactive),
        ];
        for (name, stat, value) in expected {
            if stat.current != value || stat.peak < stat.current {
                return Err(format!("{name}: {stat:?}, expected current {value}"));
            }
        }
        if by_category != self.current_by_category() {
            return Err(format!("by_category {:?}, expected {by_category:?}", self.current_by_category()));
        }
        if let Some(capacity) = self.config.capacity {
            if reserved > capacity {
                return Err(format!("reserved {reserved} exceeds the capacity {capacity}"));
            }
        }
        Ok(())
    }

    // ----- internals -----

    fn fault_fires(&self) -> bool {
        match self.config.fault {
            Some(FaultInjection::Nth(n)) => self.requests == n,
            // EveryNth(0) never fires (checked_rem by zero is None).
            Some(FaultInjection::EveryNth(n)) => self.requests.checked_rem(n) == Some(0),
            None => false,
        }
    }

    fn block(&self, index: u32) -> &Block {
        self.blocks[index as usize].as_ref().expect("block index refers to a record")
    }

    fn block_mut(&mut self, index: u32) -> &mut Block {
        self.blocks[index as usize].as_mut().expect("block index refers to a record")
    }

    /// The record of the live block `id` was handed out for.
    fn live_block(&self, id: BlockId) -> Result<&Block, InvalidBlock> {
        match self.blocks.get(id.index as usize) {
            Some(Some(block)) if id.allocator == self.id && block.allocated && block.serial == id.serial => Ok(block),
            _ => Err(InvalidBlock(id)),
        }
    }

    fn insert_block(&mut self, block: Block) -> u32 {
        match self.free_slots.pop() {
            Some(index) => {
                self.blocks[index as usize] = Some(block);
                index
            }
            None => {
                let index = u32::try_from(self.blocks.len()).expect("fewer than 2^32 blocks");
                self.blocks.push(Some(block));
                index
            }
        }
    }

    fn release_slot(&mut self, index: u32) {
        self.blocks[index as usize] = None;
        self.free_slots.push(index);
    }

    fn free_set(&mut self, pool: Pool) -> &mut BTreeSet<FreeKey> {
        match pool {
            Pool::Small => &mut self.small_free,
            Pool::Large => &mut self.large_free,
        }
    }

    /// Takes a free block out of its pool and the arena, returning its record.
    fn remove_free(&mut self, pool: Pool, index: u32) -> Block {
        let block = self.blocks[index as usize].take().expect("free block has a record");
        self.free_slots.push(index);
        let removed = self.free_set(pool).remove(&(block.size, block.segment, block.offset, index));
        debug_assert!(removed, "free block was listed in its pool");
        block
    }

    /// The smallest free block of `pool` that holds `size` bytes (ties: lowest segment id, offset).
    fn best_fit(&self, pool: Pool, size: u64) -> Option<u32> {
        let set = match pool {
            Pool::Small => &self.small_free,
            Pool::Large => &self.large_free,
        };
        set.range((size, 0, 0, 0)..).next().map(|&(_, _, _, index)| index)
    }

    /// Obtains a segment of `size` bytes for `pool` and returns its single free block. When the
    /// capacity or the backend refuses, releases every fully free cached segment and, if that freed
    /// anything, tries once more.
    fn new_segment(&mut self, pool: Pool, size: u64, request: Request) -> Result<u32, ()> {
        let mut base = self.try_segment(size);
        if base.is_err() && !self.keep_cache && self.release_free_segments(request) > 0 {
            self.stats.num_alloc_retries += 1;
            base = self.try_segment(size);
        }
        let base = base?;
        Ok(self.add_segment(pool, base, size, 0, request))
    }

    /// Records a new segment of `size` bytes at `base` (an expandable one: `span` bytes of address
    /// space, `size` of them mapped) as one free block of `pool`, and returns that block.
    fn add_segment(&mut self, pool: Pool, base: Option<NonNull<u8>>, size: u64, span: u64, request: Request) -> u32 {
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        let index = self.insert_block(Block {
            segment: id,
            offset: 0,
            size,
            allocated: false,
            prev: None,
            next: None,
            owner: request,
            requested: 0,
            serial: 0,
        });
        let address = self.next_address;
        // Segments never overlap in the address space: the next one starts past this one (or its
        // reservation), 2 MiB aligned (sizes are bounded by isize::MAX, so this cannot overflow a u64
        // for 2^31 segments).
        self.next_address = address.saturating_add(size.max(span).next_multiple_of(SMALL_BUFFER));
        self.segments.insert(id, Segment { base, address, size, pool, free_bytes: size, first_block: index, span });
        self.free_set(pool).insert((size, id, 0, index));
        self.stats.reserved_bytes.increase(size);
        self.stats.segment.increase(1);
        let kind = if span > 0 { EventKind::SegmentMap } else { EventKind::SegmentAlloc };
        self.record(kind, size, address, request);
        index
    }

    /// Asks the backend for a segment if the capacity (and the `isize::MAX` total) allows it.
    fn try_segment(&mut self, size: u64) -> Result<Option<NonNull<u8>>, ()> {
        let limit = self.config.capacity.map_or(MAX_BYTES, |capacity| capacity.min(MAX_BYTES));
        let fits = self.stats.reserved_bytes.current.checked_add(size).is_some_and(|total| total <= limit);
        if !fits {
            return Err(());
        }
        let size = usize::try_from(size).map_err(|_| ())?;
        self.backend.alloc_segment(size)
    }

    /// Returns every segment that is entirely one free block to the backend, in segment id order,
    /// recording a SegmentFree event attributed to the given owner. Returns how many were released.
    fn release_free_segments(&mut self, owner: Request) -> usize {
        let expandable: Vec<u64> = self.segments.iter().filter(|(_, s)| s.span > 0).map(|(&id, _)| id).collect();
        let shrunk = expandable.into_iter().filter(|&id| self.shrink(id, owner)).count();
        let releasable: Vec<u64> =
            self.segments.iter().filter(|(_, s)| s.span == 0 && s.free_bytes == s.size).map(|(&id, _)| id).collect();
        for &id in &releasable {
            let segment = self.segments.remove(&id).expect("listed segment exists");
            let block = self.remove_free(segment.pool, segment.first_block);
            debug_assert!(block.size == segment.size && block.next.is_none());
            self.backend.free_segment(segment.base, segment.size as usize);
            self.stats.reserved_bytes.decrease(segment.size);
            self.stats.segment.decrease(1);
            self.record(EventKind::SegmentFree, segment.size, segment.address, owner);
        }
        releasable.len() + shrunk
    }

    /// The last block of segment `id`.
    fn last_block(&self, id: u64) -> u32 {
        let mut index = self.segments[&id].first_block;
        while let Some(next) = self.block(index).next {
            index = next;
        }
        index
    }

    /// Maps the pages `pool`'s expandable segment lacks for a free block of `size` bytes at its end
    /// (creating the segment on the first call), then returns the best fit, which that block now
    /// holds. When the capacity or the backend refuses, releases the free pages at the ends of the
    /// segments and, if that gave any back, tries once more.
    fn grow(&mut self, pool: Pool, size: u64, request: Request) -> Result<u32, ()> {
        let mut grown = self.try_grow(pool, size, request);
        if grown.is_err() && !self.keep_cache && self.release_free_segments(request) > 0 {
            self.stats.num_alloc_retries += 1;
            grown = self.try_grow(pool, size, request);
        }
        grown?;
        Ok(self.best_fit(pool, size).expect("the grown segment ends in a free block that holds the request"))
    }

    fn try_grow(&mut self, pool: Pool, size: u64, request: Request) -> Result<(), ()> {
        let existing = self.segments.iter().find(|(_, s)| s.pool == pool && s.span > 0).map(|(&id, _)| id);
        let tail = existing.map(|id| self.last_block(id));
        let tail_free = tail.map_or(0, |t| if self.block(t).allocated { 0 } else { self.block(t).size });
        let pages = size.saturating_sub(tail_free).checked_next_multiple_of(PAGE_BYTES).ok_or(())?;
        let limit = self.config.capacity.map_or(MAX_BYTES, |capacity| capacity.min(MAX_BYTES));
        if self.stats.reserved_bytes.current.checked_add(pages).is_none_or(|total| total > limit) {
            return Err(());
        }
        let Some(id) = existing else {
            return self.create_expandable(pool, pages, request);
        };
        let segment = &self.segments[&id];
        let (old_size, base, address, inactive_before) =
            (segment.size, segment.base, segment.address, segment.inactive_split());
        if old_size + pages > segment.span {
            return Err(());
        }
        self.backend.map(base, usize::try_from(old_size).map_err(|_| ())?, usize::try_from(pages).map_err(|_| ())?)?;
        let tail = tail.expect("an existing segment has blocks");
        if self.block(tail).allocated {
            let index = self.insert_block(Block {
                segment: id,
                offset: old_size,
                size: pages,
                allocated: false,
                prev: Some(tail),
                next: None,
                owner: request,
                requested: 0,
                serial: 0,
            });
            self.block_mut(tail).next = Some(index);
            self.free_set(pool).insert((pages, id, old_size, index));
        } else {
            let block = self.block(tail).clone();
            self.free_set(pool).remove(&(block.size, id, block.offset, tail));
            self.block_mut(tail).size += pages;
            self.free_set(pool).insert((block.size + pages, id, block.offset, tail));
        }
        let segment = self.segments.get_mut(&id).expect("segment exists");
        segment.size += pages;
        segment.free_bytes += pages;
        let inactive_after = segment.inactive_split();
        self.adjust_inactive_split(inactive_before, inactive_after);
        self.stats.reserved_bytes.increase(pages);
        self.record(EventKind::SegmentMap, pages, address + old_size, request);
        Ok(())
    }

    /// `pool`'s expandable segment, reserved and with its first `pages` mapped: one free block.
    fn create_expandable(&mut self, pool: Pool, pages: u64, request: Request) -> Result<(), ()> {
        let span =
            self.config.capacity.map_or(EXPANDABLE_SPAN, |c| c.min(EXPANDABLE_SPAN)).next_multiple_of(PAGE_BYTES);
        if pages > span {
            return Err(());
        }
        let span_bytes = usize::try_from(span).map_err(|_| ())?;
        let base = self.backend.reserve(span_bytes)?;
        if self.backend.map(base, 0, usize::try_from(pages).map_err(|_| ())?).is_err() {
            self.backend.release(base, span_bytes);
            return Err(());
        }
        self.add_segment(pool, base, pages, span, request);
        Ok(())
    }

    /// Unmaps the whole free pages at the end of expandable segment `id` (removing the segment when
    /// nothing is left mapped); true when any page went back.
    fn shrink(&mut self, id: u64, owner: Request) -> bool {
        let tail = self.last_block(id);
        let block = self.block(tail).clone();
        if block.allocated {
            return false;
        }
        let keep = block.offset.next_multiple_of(PAGE_BYTES) - block.offset;
        if keep >= block.size {
            return false;
        }
        let segment = &self.segments[&id];
        let (pool, base, address, size, span, inactive_before) =
            (segment.pool, segment.base, segment.address, segment.size, segment.span, segment.inactive_split());
        let cut_from = block.offset + keep;
        let cut = size - cut_from;
        self.backend.unmap(base, cut_from as usize, cut as usize);
        self.free_set(pool).remove(&(block.size, id, block.offset, tail));
        if keep == 0 {
            self.release_slot(tail);
            match block.prev {
                Some(prev) => self.block_mut(prev).next = None,
                None => {
                    // The segment held only this block: nothing is mapped any more.
                    self.segments.remove(&id);
                    self.backend.release(base, span as usize);
                    self.stats.reserved_bytes.decrease(cut);
                    self.stats.segment.decrease(1);
                    self.record(EventKind::SegmentUnmap, cut, address + cut_from, owner);
                    return true;
                }
            }
        } else {
            self.block_mut(tail).size = keep;
            self.free_set(pool).insert((keep, id, block.offset, tail));
        }
        let segment = self.segments.get_mut(&id).expect("segment exists");
        segment.size -= cut;
        segment.free_bytes -= cut;
        let inactive_after = segment.inactive_split();
        self.adjust_inactive_split(inactive_before, inactive_after);
        self.stats.reserved_bytes.decrease(cut);
        self.record(EventKind::SegmentUnmap, cut, address + cut_from, owner);
        true
    }

    /// Allocates `size` bytes from the free block `index` (splitting it when the policy says so)
    /// and does the accounting.
    fn hand_out(&mut self, index: u32, size: u64, requested: u64, request: Request) -> Allocation {
        let block = self.block(index).clone();
        let segment = &self.segments[&block.segment];
        let (pool, base, inactive_before) = (segment.pool, segment.base, segment.inactive_split());
        let (address, expandable) = (segment.address + block.offset, segment.span > 0);
        self.free_set(pool).remove(&(block.size, block.segment, block.offset, index));

        let remaining = block.size - size;
        let size = if should_split(pool, expandable, remaining) {
            let rest = self.insert_block(Block {
                offset: block.offset + size,
                size: remaining,
                prev: Some(index),
                ..block.clone()
            });
            if let Some(next) = block.next {
                self.block_mut(next).prev = Some(rest);
            }
            self.block_mut(index).next = Some(rest);
            self.free_set(pool).insert((remaining, block.segment, block.offset + size, rest));
            size
        } else {
            block.size
        };
        self.handed_out += 1;
        let serial = self.handed_out;
        let taken = self.block_mut(index);
        taken.size = size;
        taken.allocated = true;
        taken.owner = request;
        taken.requested = requested;
        taken.serial = serial;

        let segment = self.segments.get_mut(&block.segment).expect("block's segment exists");
        segment.free_bytes -= size;
        let inactive_after = segment.inactive_split();
        self.adjust_inactive_split(inactive_before, inactive_after);

        let stats = &mut self.stats;
        let previous_peak = stats.allocated_bytes.peak;
        stats.allocated_bytes.increase(size);
        stats.active_bytes.increase(size);
        stats.requested_bytes.increase(requested);
        stats.allocation.increase(1);
        stats.by_category[request.category.index()].increase(size);
        if stats.allocated_bytes.current >= previous_peak {
            stats.category_at_peak = stats.by_category.map(|stat| stat.current);
        }
        self.record(EventKind::Alloc, size, address, request);

        // In bounds: offset + size <= segment size, and the segment is one allocation.
        let ptr = base.map(|base| {
            NonNull::new(base.as_ptr().wrapping_add(block.offset as usize)).expect("in-bounds pointer is not null")
        });
        let id = BlockId { allocator: self.id, index, serial: self.handed_out };
        Allocation { id, ptr, size, requested }
    }

    fn adjust_inactive_split(&mut self, before: u64, after: u64) {
        let stat = &mut self.stats.inactive_split_bytes;
        if after > before {
            stat.increase(after - before);
        } else if before > after {
            stat.decrease(before - after);
        }
    }

    fn current_by_category(&self) -> [u64; Category::COUNT] {
        self.stats.by_category.map(|stat| stat.current)
    }

    fn record(&mut self, kind: EventKind, bytes: u64, address: u64, owner: Request) {
        self.timeline.record(Event {
            seq: 0, // assigned by the timeline
            kind,
            bytes,
            address,
            category: owner.category,
            op: owner.op,
            phase: owner.phase,
            module: owner.module,
            allocated: self.stats.allocated_bytes.current,
            reserved: self.stats.reserved_bytes.current,
        });
    }

    /// Counts and records a failed request and describes the state at the failure.
    fn out_of_memory(&mut self, requested: u64, request: Request, injected: bool) -> OutOfMemory {
        self.stats.num_ooms += 1;
        if injected {
            self.stats.num_injected_faults += 1;
        }
        self.record(EventKind::Oom, requested, 0, request);
        let allocated = self.stats.allocated_bytes.current;
        let reserved = self.stats.reserved_bytes.current;
        let mut largest = self.live_allocations();
        largest.truncate(8);
        OutOfMemory {
            requested,
            capacity: self.config.capacity,
            free: self.config.capacity.map_or(0, |capacity| capacity.saturating_sub(reserved)),
            allocated,
            reserved_unallocated: reserved - allocated,
            op: request.op,
            phase: request.phase,
            category: request.category,
            by_category: self.current_by_category(),
            largest,
            injected,
            expandable: self.config.expandable,
        }
    }
}

impl Drop for Allocator {
    /// Returns every segment to the backend, live blocks included: their owner is gone.
    fn drop(&mut self) {
        for (_, segment) in std::mem::take(&mut self.segments) {
            if segment.span > 0 {
                self.backend.unmap(segment.base, 0, segment.size as usize);
                self.backend.release(segment.base, segment.span as usize);
            } else {
                self.backend.free_segment(segment.base, segment.size as usize);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{HostBackend, MetaBackend};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    fn req(category: Category, op: &'static str) -> Request {
        Request { category, op, phase: Phase::Forward, module: 0 }
    }

    fn act() -> Request {
        req(Category::Activation, "test")
    }

    fn host(capacity: Option<u64>) -> Allocator {
        Allocator::new(Box::new(HostBackend::default()), AllocatorConfig { capacity, ..Default::default() })
    }

    fn meta(capacity: Option<u64>) -> Allocator {
        Allocator::new(Box::new(MetaBackend), AllocatorConfig { capacity, ..Default::default() })
    }

    fn expandable(capacity: Option<u64>, backend: Box<dyn SegmentBackend>) -> Allocator {
        Allocator::new(backend, AllocatorConfig { capacity, expandable: true, ..Default::default() })
    }

    #[test]
    fn an_expandable_segment_grows_by_the_pages_it_lacks_and_gives_back_its_free_tail() {
        let mut a = expandable(None, Box::new(MetaBackend));
        // 3 MiB: the large pool's segment is made with 4 MiB mapped; the 1 MiB rest is split off.
        let x = a.allocate(3 * MIB, act()).unwrap();
        assert_eq!((x.size, segment_sizes(&a)), (3 * MIB, vec![4 * MIB]));
        // 12 MiB (own segment under the fixed policy) joins it: 1 MiB free tail + 12 MiB more mapped.
        let y = a.allocate(12 * MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), vec![16 * MIB]);
        assert_eq!(place(&a, &y), (place(&a, &x).0, 3 * MIB));
        // A small request gets the small pool's own segment, a page.
        let z = a.allocate(100 * KIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), vec![16 * MIB, 2 * MIB]);
        ok(&a);
        a.free(y.id).unwrap();
        a.empty_cache();
        // The free tail from 3 MiB: the page from 2 to 4 MiB keeps its free part, the rest is unmapped.
        assert_eq!(segment_sizes(&a), vec![4 * MIB, 2 * MIB]);
        ok(&a);
        a.free(x.id).unwrap();
        a.free(z.id).unwrap();
        a.empty_cache();
        assert!(segment_sizes(&a).is_empty());
        assert_eq!((a.stats().reserved_bytes.current, a.stats().segment.current), (0, 0));
        let kinds: Vec<EventKind> =
            events(&a).iter().map(|e| e.0).filter(|k| *k != EventKind::Alloc && *k != EventKind::Free).collect();
        use EventKind::{SegmentMap as M, SegmentUnmap as U};
        assert_eq!(kinds, vec![M, M, M, U, U, U]);
        ok(&a);
    }

    #[test]
    fn an_expandable_growth_past_the_capacity_first_releases_the_other_pools_tail() {
        let mut a = expandable(Some(8 * MIB), Box::new(MetaBackend));
        let small = a.allocate(100 * KIB, act()).unwrap();
        a.free(small.id).unwrap();
        let big = a.allocate(5 * MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), vec![2 * MIB, 6 * MIB]);
        // 7 MiB needs 6 MiB of pages past the 1 MiB free tail: 14 MiB in all, over 8 even after the
        // small pool's free page went back (the one retry): refused.
        assert!(a.allocate(7 * MIB, act()).is_err());
        assert_eq!(segment_sizes(&a), vec![6 * MIB]);
        assert_eq!(a.stats().num_alloc_retries, 1);
        // 2 MiB fits now: the 1 MiB tail and one more page.
        let more = a.allocate(2 * MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), vec![8 * MIB]);
        for x in [big, more] {
            a.free(x.id).unwrap();
        }
        ok(&a);
    }

    #[test]
    fn expandable_host_memory_is_usable_and_reads_zero_after_it_was_given_back() {
        let mut a = expandable(None, Box::new(HostBackend::default()));
        let x = a.allocate(3 * MIB, act()).unwrap();
        let p = x.ptr.unwrap();
        // SAFETY: the block is 3 MiB of mapped memory owned by this test.
        unsafe { p.as_ptr().write_bytes(0xCD, (3 * MIB) as usize) };
        a.free(x.id).unwrap();
        a.empty_cache();
        let y = a.allocate(3 * MIB, act()).unwrap();
        assert_eq!(y.ptr, Some(p), "the same address, mapped again");
        // SAFETY: as above; freshly mapped pages.
        let bytes = unsafe { std::slice::from_raw_parts(y.ptr.unwrap().as_ptr(), (3 * MIB) as usize) };
        assert!(bytes.iter().all(|&b| b == 0), "pages given back come back zero-filled");
        a.free(y.id).unwrap();
        ok(&a);
    }

    fn segment_sizes(a: &Allocator) -> Vec<u64> {
        a.segments.values().map(|s| s.size).collect()
    }

    /// (segment id, offset) of a live block.
    fn place(a: &Allocator, allocation: &Allocation) -> (u64, u64) {
        let block = a.live_block(allocation.id).unwrap();
        (block.segment, block.offset)
    }

    fn events(a: &Allocator) -> Vec<(EventKind, u64)> {
        a.timeline().events().map(|e| (e.kind, e.bytes)).collect()
    }

    fn ok(a: &Allocator) {
        a.check_consistency().unwrap();
    }

    /// A backend without data that counts live segments and can be told to refuse.
    struct Counting {
        live: Arc<AtomicUsize>,
        refuse: Arc<AtomicBool>,
    }

    impl SegmentBackend for Counting {
        fn holds_data(&self) -> bool {
            false
        }
        fn alloc_segment(&mut self, _bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
            if self.refuse.load(Ordering::SeqCst) {
                return Err(());
            }
            self.live.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        }
        fn free_segment(&mut self, _ptr: Option<NonNull<u8>>, _bytes: usize) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Allocator, Arc<AtomicUsize>, Arc<AtomicBool>) {
        let live = Arc::new(AtomicUsize::new(0));
        let refuse = Arc::new(AtomicBool::new(false));
        let backend = Counting { live: live.clone(), refuse: refuse.clone() };
        (Allocator::new(Box::new(backend), AllocatorConfig::default()), live, refuse)
    }

    #[test]
    fn rounds_requests_to_512_bytes() {
        let mut a = host(None);
        for (bytes, size) in [(0, 512), (1, 512), (512, 512), (513, 1024), (1000, 1024), (MIB - 1, MIB)] {
            let allocation = a.allocate(bytes, act()).unwrap();
            assert_eq!((allocation.size, allocation.requested), (size, bytes), "request of {bytes} B");
            assert_eq!(allocation.ptr.unwrap().as_ptr() as usize % 512, 0);
        }
        assert_eq!(a.stats().requested_bytes.current, 1 + 512 + 513 + 1000 + MIB - 1);
        assert_eq!(a.stats().allocated_bytes.current, 512 * 3 + 1024 * 2 + MIB);
        ok(&a);
    }

    #[test]
    fn one_mib_request_makes_a_2_mib_small_segment() {
        let mut a = host(None);
        let first = a.allocate(MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), [2 * MIB]);
        assert_eq!(a.segments[&0].pool, Pool::Small);
        // The 1 MiB remainder serves the next request from the same segment.
        let second = a.allocate(MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), [2 * MIB]);
        assert_eq!(place(&a, &second), (0, MIB));
        assert_eq!(second.ptr.unwrap().as_ptr() as usize - first.ptr.unwrap().as_ptr() as usize, MIB as usize);
        // Just above 1 MiB is the large pool.
        a.allocate(MIB + 1, act()).unwrap();
        assert_eq!(segment_sizes(&a), [2 * MIB, 20 * MIB]);
        assert_eq!(a.segments[&1].pool, Pool::Large);
        ok(&a);
    }

    #[test]
    fn mid_size_requests_share_20_mib_large_segments() {
        let mut a = host(None);
        a.allocate(5 * MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), [20 * MIB]);
        a.allocate(9 * MIB + 512, act()).unwrap();
        assert_eq!(segment_sizes(&a), [20 * MIB]);
        assert_eq!(events(&a)[0], (EventKind::SegmentAlloc, 20 * MIB));
        ok(&a);
    }

    #[test]
    fn big_requests_get_their_own_segment_rounded_to_2_mib() {
        let mut a = meta(None);
        a.allocate(11 * MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), [12 * MIB]);
        a.allocate(10 * MIB, act()).unwrap();
        assert_eq!(segment_sizes(&a), [12 * MIB, 10 * MIB]);
        let odd = a.allocate(12 * MIB + 1, act()).unwrap();
        assert_eq!(odd.size, 12 * MIB + 512);
        assert_eq!(segment_sizes(&a), [12 * MIB, 10 * MIB, 14 * MIB]);
        // The 14 MiB segment's remainder (2 MiB - 512 B > 1 MiB) is split off and free.
        assert_eq!(a.stats().inactive_split_bytes.current, 2 * MIB - 512);
        ok(&a);
    }

    #[test]
    fn small_allocations_share_a_segment_and_coalesce() {
        let mut a = host(None);
        let x = a.allocate(1000, act()).unwrap();
        let y = a.allocate(1000, act()).unwrap();
        assert_eq!(segment_sizes(&a), [2 * MIB]);
        assert_eq!((place(&a, &x), place(&a, &y)), ((0, 0), (0, 1024)));
        assert_eq!(a.stats().inactive_split_bytes.current, 2 * MIB - 2048);
        a.free(x.id).unwrap();
        ok(&a);
        assert_eq!(a.small_free.len(), 2, "a hole at 0 and the tail");
        assert_eq!(a.stats().inactive_split_bytes.current, 2 * MIB - 1024);
        a.free(y.id).unwrap();
        ok(&a);
        // One free block spanning the segment, which still counts as reserved but not as split.
        assert_eq!(a.small_free.iter().map(|k| k.0).collect::<Vec<_>>(), [2 * MIB]);
        assert_eq!(a.stats().inactive_split_bytes.current, 0);
        assert_eq!(a.stats().reserved_bytes.current, 2 * MIB);
        assert_eq!(a.stats().allocated_bytes.current, 0);
        // The same slot is handed out again at offset 0.
        let z = a.allocate(4 * KIB, act()).unwrap();
        assert_eq!(place(&a, &z), (0, 0));
        assert_eq!(z.ptr, x.ptr);
    }

    #[test]
    fn free_coalesces_with_both_neighbours() {
        let mut a = meta(None);
        let blocks: Vec<Allocation> = (0..4).map(|_| a.allocate(512, act()).unwrap()).collect();
        a.free(blocks[0].id).unwrap();
        a.free(blocks[2].id).unwrap();
        assert_eq!(a.small_free.len(), 3);
        a.free(blocks[1].id).unwrap(); // merges 0, 1 and 2
        ok(&a);
        assert_eq!(a.small_free.iter().map(|k| (k.0, k.2)).collect::<Vec<_>>(), [(1536, 0), (2 * MIB - 2048, 2048)]);
        a.free(blocks[3].id).unwrap();
        ok(&a);
        assert_eq!(a.small_free.len(), 1);
        assert_eq!(a.blocks.iter().filter(|b| b.is_some()).count(), 1, "merged records are released");
    }

    #[test]
    fn best_fit_picks_the_smallest_fitting_block() {
        let mut a = meta(None);
        let hole_4k = a.allocate(4 * KIB, act()).unwrap();
        let _sep1 = a.allocate(512, act()).unwrap();
        let hole_2k = a.allocate(2 * KIB, act()).unwrap();
        let _sep2 = a.allocate(512, act()).unwrap();
        let hole_8k = a.allocate(8 * KIB, act()).unwrap();
        let _sep3 = a.allocate(512, act()).unwrap();
        let (p4, p2, p8) = (place(&a, &hole_4k), place(&a, &hole_2k), place(&a, &hole_8k));
        for hole in [hole_8k, hole_2k, hole_4k] {
            a.free(hole.id).unwrap();
        }
        let r = a.allocate(2 * KIB, act()).unwrap();
        assert_eq!(place(&a, &r), p2, "exact fit");
        let r = a.allocate(3 * KIB, act()).unwrap();
        assert_eq!(place(&a, &r), p4, "4 KiB is the smallest hole that holds 3 KiB");
        let r = a.allocate(5 * KIB, act()).unwrap();
        assert_eq!(place(&a, &r), p8);
        ok(&a);
    }

    #[test]
    fn best_fit_ties_go_to_the_lowest_segment_then_offset() {
        let mut a = meta(None);
        // Two full small segments, each with two 1 MiB blocks.
        let blocks: Vec<Allocation> = (0..4).map(|_| a.allocate(MIB, act()).unwrap()).collect();
        assert_eq!(segment_sizes(&a), [2 * MIB, 2 * MIB]);
        a.free(blocks[3].id).unwrap(); // segment 1, offset 1 MiB
        a.free(blocks[0].id).unwrap(); // segment 0, offset 0
        let r = a.allocate(MIB, act()).unwrap();
        assert_eq!(place(&a, &r), (0, 0));
        let r = a.allocate(MIB, act()).unwrap();
        assert_eq!(place(&a, &r), (1, MIB));
    }

    #[test]
    fn large_pool_splits_only_when_more_than_1_mib_remains() {
        let mut a = meta(None);
        // 20 MiB segment, 19 MiB request: the 1 MiB remainder is not split off.
        let whole = a.allocate(19 * MIB, act()).unwrap();
        assert_eq!((whole.size, whole.requested), (20 * MIB, 19 * MIB));
        assert_eq!(a.stats().allocated_bytes.current, 20 * MIB);
        assert_eq!(a.stats().inactive_split_bytes.current, 0);
        // 18.5 MiB leaves 1.5 MiB: split.
        let split = a.allocate(18 * MIB + 512 * KIB, act()).unwrap();
        assert_eq!(split.size, 18 * MIB + 512 * KIB);
        assert_eq!(segment_sizes(&a), [20 * MIB, 20 * MIB]);
        assert_eq!(a.stats().inactive_split_bytes.current, MIB + 512 * KIB);
        // The 1.5 MiB remainder serves a large request; a small one never comes from the large pool.
        let rest = a.allocate(MIB + 512, act()).unwrap();
        assert_eq!(place(&a, &rest), (1, 18 * MIB + 512 * KIB));
        assert_eq!(rest.size, MIB + 512 * KIB, "remainder of 511.5 KiB is not split off");
        a.allocate(512, act()).unwrap();
        assert_eq!(segment_sizes(&a), [20 * MIB, 20 * MIB, 2 * MIB]);
        ok(&a);
    }

    #[test]
    fn small_pool_splits_a_512_byte_remainder() {
        let mut a = meta(None);
        a.allocate(MIB, act()).unwrap();
        let b = a.allocate(MIB - 512, act()).unwrap();
        assert_eq!(b.size, MIB - 512);
        let c = a.allocate(512, act()).unwrap();
        assert_eq!(place(&a, &c), (0, 2 * MIB - 512));
        assert_eq!(segment_sizes(&a), [2 * MIB]);
        ok(&a);
    }

    #[test]
    fn empty_cache_releases_only_fully_free_segments() {
        let mut a = host(None);
        let a0 = a.allocate(MIB, act()).unwrap(); // segment 0 (small)
        let _a1 = a.allocate(MIB, act()).unwrap(); // segment 0, now full
        let b = a.allocate(MIB, act()).unwrap(); // segment 1 (small)
        let c = a.allocate(5 * MIB, act()).unwrap(); // segment 2 (large)
        assert_eq!(a.stats().reserved_bytes.current, 24 * MIB);
        a.free(a0.id).unwrap();
        a.free(b.id).unwrap();
        a.free(c.id).unwrap();
        a.empty_cache();
        ok(&a);
        assert_eq!(segment_sizes(&a), [2 * MIB], "segment 0 still holds a live block");
        assert_eq!(a.stats().reserved_bytes.current, 2 * MIB);
        assert_eq!(a.stats().segment.current, 1);
        let frees: Vec<Event> = a.timeline().events().filter(|e| e.kind == EventKind::SegmentFree).copied().collect();
        assert_eq!(frees.iter().map(|e| e.bytes).collect::<Vec<_>>(), [2 * MIB, 20 * MIB], "in segment id order");
        for e in &frees {
            assert_eq!((e.category, e.op, e.phase), (Category::Other, "empty_cache", Phase::Setup));
        }
        assert_eq!(frees[1].reserved, 2 * MIB);
        // Nothing left to release: a no-op.
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes.current, 2 * MIB);
    }

    #[test]
    fn capacity_failure_releases_the_cache_and_retries() {
        let mut a = host(Some(24 * MIB));
        let cached = a.allocate(10 * MIB, act()).unwrap();
        let small = a.allocate(KIB, act()).unwrap();
        a.free(cached.id).unwrap();
        a.free(small.id).unwrap();
        assert_eq!(a.stats().reserved_bytes.current, 12 * MIB);
        // 14 MiB fits no cached block and needs its own segment: 12 + 14 > 24, so both cached
        // segments go and then it fits.
        let request = req(Category::Parameter, "linear");
        let big = a.allocate(14 * MIB, request).unwrap();
        ok(&a);
        assert_eq!(big.size, 14 * MIB);
        assert_eq!(a.stats().num_alloc_retries, 1);
        assert_eq!(a.stats().num_ooms, 0);
        assert_eq!(a.stats().reserved_bytes.current, 14 * MIB);
        assert_eq!(segment_sizes(&a), [14 * MIB]);
        let tail: Vec<Event> = a.timeline().events().skip(6).copied().collect();
        let kinds: Vec<(EventKind, u64)> = tail.iter().map(|e| (e.kind, e.bytes)).collect();
        assert_eq!(
            kinds,
            [
                (EventKind::SegmentFree, 10 * MIB),
                (EventKind::SegmentFree, 2 * MIB),
                (EventKind::SegmentAlloc, 14 * MIB),
                (EventKind::Alloc, 14 * MIB)
            ]
        );
        for e in &tail {
            assert_eq!((e.category, e.op), (Category::Parameter, "linear"), "attributed to the request");
        }
        assert_eq!((tail[1].allocated, tail[1].reserved), (0, 0));
        assert_eq!((tail[3].allocated, tail[3].reserved), (14 * MIB, 14 * MIB));
    }

    #[test]
    fn capacity_oom_changes_nothing_but_the_oom_count() {
        let mut a = host(Some(24 * MIB));
        let params = req(Category::Parameter, "linear");
        let held = a.allocate(12 * MIB, params).unwrap();
        let before = a.stats().clone();
        let events_before = a.timeline().len();

        let err = a.allocate(16 * MIB, act()).unwrap_err();
        ok(&a);
        let mut expected = before.clone();
        expected.num_ooms = 1;
        assert_eq!(a.stats(), &expected);
        assert_eq!(a.timeline().len(), events_before + 1);
        let oom = a.timeline().events().last().copied().unwrap();
        assert_eq!((oom.kind, oom.bytes, oom.category), (EventKind::Oom, 16 * MIB, Category::Activation));

        assert_eq!(err.requested, 16 * MIB);
        assert_eq!(err.capacity, Some(24 * MIB));
        assert_eq!(err.free, 12 * MIB);
        assert_eq!((err.allocated, err.reserved_unallocated), (12 * MIB, 0));
        assert_eq!((err.op, err.phase, err.category), ("test", Phase::Forward, Category::Activation));
        assert_eq!(err.by_category[Category::Parameter.index()], 12 * MIB);
        assert_eq!(
            err.largest,
            [LiveAllocation {
                size: 12 * MIB,
                category: Category::Parameter,
                op: "linear",
                phase: Phase::Forward,
                module: 0,
                address: FIRST_ADDRESS
            }]
        );
        assert!(!err.injected);

        // The allocator still works, and the held block is intact.
        assert_eq!(a.category_of(held.id).unwrap(), Category::Parameter);
        let fits = a.allocate(10 * MIB, act()).unwrap();
        a.free(fits.id).unwrap();
        ok(&a);
    }

    #[test]
    fn oom_after_releasing_the_cache_counts_the_retry() {
        let mut a = meta(Some(24 * MIB));
        let _held = a.allocate(12 * MIB, act()).unwrap();
        let cached = a.allocate(KIB, act()).unwrap();
        a.free(cached.id).unwrap();
        let err = a.allocate(16 * MIB, act()).unwrap_err();
        ok(&a);
        assert_eq!(a.stats().num_alloc_retries, 1);
        assert_eq!(a.stats().num_ooms, 1);
        assert_eq!(a.stats().reserved_bytes.current, 12 * MIB, "the cache was released");
        assert_eq!((err.free, err.reserved_unallocated), (12 * MIB, 0));
    }

    #[test]
    fn oom_message_names_sizes_and_holders() {
        let mut a = meta(Some(64 * MIB));
        a.allocate(30 * MIB, req(Category::Parameter, "linear")).unwrap();
        a.allocate(20 * MIB, req(Category::OptimizerState, "adam")).unwrap();
        let err = a.allocate(40 * MIB, req(Category::Activation, "conv2d")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("tried to allocate 40.00 MiB for conv2d (forward, activation)"), "{text}");
        assert!(text.contains("capacity 64.00 MiB of which 14.00 MiB is free"), "{text}");
        assert!(text.contains("50.00 MiB allocated, 0 B reserved but unallocated"), "{text}");
        assert!(text.contains("held by category: parameter 30.00 MiB, optimizer_state 20.00 MiB"), "{text}");
        assert!(text.contains("  30.00 MiB parameter (linear)\n  20.00 MiB optimizer_state (adam)"), "{text}");
    }

    #[test]
    fn backend_failure_releases_the_cache_then_is_out_of_memory() {
        let (mut a, live, refuse) = counting();
        let small = a.allocate(KIB, act()).unwrap();
        let large = a.allocate(5 * MIB, act()).unwrap();
        a.free(small.id).unwrap();
        a.free(large.id).unwrap();
        refuse.store(true, Ordering::SeqCst);
        // Cached blocks still serve requests without asking the backend.
        let reused = a.allocate(KIB, act()).unwrap();
        a.free(reused.id).unwrap();
        // A new segment is refused: the cache goes back, the retry is refused too.
        let err = a.allocate(22 * MIB, act()).unwrap_err();
        assert_eq!(live.load(Ordering::SeqCst), 0);
        assert_eq!((err.capacity, err.free, err.requested), (None, 0, 22 * MIB));
        assert_eq!((a.stats().num_alloc_retries, a.stats().num_ooms), (1, 1));
        assert_eq!(a.stats().reserved_bytes.current, 0);
        ok(&a);
        refuse.store(false, Ordering::SeqCst);
        a.allocate(22 * MIB, act()).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 1);
        ok(&a);
    }

    #[test]
    fn oversized_requests_are_out_of_memory_not_panics() {
        for mut a in [meta(None), host(None), meta(Some(MIB))] {
            for bytes in [u64::MAX, u64::MAX - 511, isize::MAX as u64, isize::MAX as u64 - 2 * MIB + 2] {
                let err = a.allocate(bytes, act()).unwrap_err();
                assert!(!err.injected);
                assert!(err.to_string().contains("tried to allocate"));
            }
            assert_eq!(a.stats().num_ooms, 4);
            assert_eq!(a.stats().num_alloc_retries, 0);
            assert_eq!(a.stats().reserved_bytes.current, 0);
            ok(&a);
        }
    }

    #[test]
    fn meta_backend_plans_beyond_host_memory_up_to_isize_max() {
        let mut a = meta(None);
        let huge = a.allocate(1 << 62, act()).unwrap();
        assert!(huge.ptr.is_none());
        a.allocate(1 << 61, act()).unwrap();
        // Another 2^62 would take the total past isize::MAX.
        let err = a.allocate(1 << 62, act()).unwrap_err();
        assert_eq!(err.capacity, None);
        assert_eq!(err.free, 0);
        assert_eq!(a.stats().reserved_bytes.current, (1 << 62) + (1 << 61));
        ok(&a);
    }

    #[test]
    fn host_backend_failure_is_out_of_memory() {
        // No machine has 4 EiB: the backend refuses, the allocator reports instead of aborting.
        let mut a = host(None);
        let err = a.allocate(1 << 62, act()).unwrap_err();
        assert_eq!(err.capacity, None);
        assert_eq!(a.stats().num_ooms, 1);
        ok(&a);
    }

    #[test]
    fn set_category_moves_bytes_between_categories() {
        let mut a = meta(None);
        let x = a.allocate(3000, req(Category::Temporary, "matmul")).unwrap();
        assert_eq!(a.stats().category(Category::Temporary).current, 3072);
        a.set_category(x.id, Category::Activation).unwrap();
        assert_eq!(a.category_of(x.id).unwrap(), Category::Activation);
        assert_eq!(a.stats().category(Category::Temporary).current, 0);
        assert_eq!(a.stats().category(Category::Temporary).peak, 3072);
        assert_eq!(a.stats().category(Category::Activation).current, 3072);
        let retag = a.timeline().events().last().copied().unwrap();
        assert_eq!(
            (retag.kind, retag.bytes, retag.address, retag.category, retag.op, retag.phase),
            (EventKind::Retag, 3072, FIRST_ADDRESS, Category::Activation, "matmul", Phase::Forward),
            "the new category, the block's owner"
        );
        assert_eq!((retag.allocated, retag.reserved), (3072, 2 * MIB));
        let events = a.timeline().len();
        a.set_category(x.id, Category::Activation).unwrap();
        assert_eq!(a.stats().category(Category::Activation).allocated, 3072, "same category: no change");
        assert_eq!(a.timeline().len(), events, "and no event");
        ok(&a);
        a.free(x.id).unwrap();
        assert_eq!(a.stats().category(Category::Activation).current, 0);
        let free = a.timeline().events().last().copied().unwrap();
        assert_eq!((free.kind, free.category, free.op), (EventKind::Free, Category::Activation, "matmul"));
        ok(&a);
    }

    #[test]
    fn retag_events_name_the_block_and_keep_the_peak_mix() {
        let mut a = meta(None);
        let _first = a.allocate(KIB, req(Category::Parameter, "p")).unwrap();
        let mut owner = req(Category::Temporary, "linear");
        owner.module = 7;
        let x = a.allocate(3 * KIB, owner).unwrap();
        let at_peak = a.stats().category_at_peak;
        a.set_category(x.id, Category::Activation).unwrap();
        a.set_category(x.id, Category::Gradient).unwrap();
        // At the peak, but a re-tag reaches no peak: the mix of the moment the peak was reached stays.
        assert_eq!(a.stats().category_at_peak, at_peak);
        assert_eq!(a.stats().category(Category::Gradient).current, 3 * KIB);
        let retags: Vec<(u64, u64, Category, &str, u32, u64)> = a
            .timeline()
            .events()
            .filter(|e| e.kind == EventKind::Retag)
            .map(|e| (e.seq, e.address, e.category, e.op, e.module, e.allocated))
            .collect();
        let address = FIRST_ADDRESS + KIB;
        assert_eq!(
            retags,
            [
                (3, address, Category::Activation, "linear", 7, 4 * KIB),
                (4, address, Category::Gradient, "linear", 7, 4 * KIB)
            ]
        );
        ok(&a);
    }

    #[test]
    fn category_at_peak_keeps_the_latest_peak_mix() {
        let mut a = meta(None);
        let at_peak = |a: &Allocator, c: Category| a.stats().category_at_peak[c.index()];
        let _p = a.allocate(4 * KIB, req(Category::Parameter, "p")).unwrap();
        let t = a.allocate(4 * KIB, req(Category::Temporary, "t")).unwrap();
        assert_eq!((at_peak(&a, Category::Parameter), at_peak(&a, Category::Temporary)), (4 * KIB, 4 * KIB));
        a.free(t.id).unwrap();
        let g = a.allocate(2 * KIB, req(Category::Gradient, "g")).unwrap();
        assert_eq!(at_peak(&a, Category::Gradient), 0, "below the peak");
        a.set_category(g.id, Category::Activation).unwrap();
        let h = a.allocate(2 * KIB, req(Category::Gradient, "g")).unwrap();
        // Equal to the peak: the latest mix wins.
        assert_eq!(a.stats().allocated_bytes.peak, 8 * KIB);
        assert_eq!(at_peak(&a, Category::Temporary), 0);
        assert_eq!(at_peak(&a, Category::Activation), 2 * KIB);
        assert_eq!(at_peak(&a, Category::Gradient), 2 * KIB);
        a.free(h.id).unwrap();
        a.reset_peak_stats();
        assert_eq!(a.stats().allocated_bytes.peak, 6 * KIB);
        assert_eq!(a.stats().category(Category::Gradient).peak, 0);
        assert_eq!(at_peak(&a, Category::Gradient), 0);
        assert_eq!(at_peak(&a, Category::Parameter), 4 * KIB);
    }

    #[test]
    fn timeline_records_totals_after_each_event() {
        let mut a = meta(None);
        let x = a.allocate(100, req(Category::Input, "load")).unwrap();
        a.free(x.id).unwrap();
        a.empty_cache();
        let got: Vec<(EventKind, u64, u64, u64, u64)> =
            a.timeline().events().map(|e| (e.kind, e.seq, e.bytes, e.allocated, e.reserved)).collect();
        assert_eq!(
            got,
            [
                (EventKind::SegmentAlloc, 0, 2 * MIB, 0, 2 * MIB),
                (EventKind::Alloc, 1, 512, 512, 2 * MIB),
                (EventKind::Free, 2, 512, 0, 2 * MIB),
                (EventKind::SegmentFree, 3, 2 * MIB, 0, 0),
            ]
        );
    }

    #[test]
    fn held_only_requests_skip_injected_faults_and_new_memory_is_counted() {
        let mut a = meta(None);
        assert_eq!(a.requests_for_new_memory(), 0);
        let first = a.allocate(KIB, act()).unwrap();
        assert_eq!(a.requests_for_new_memory(), 1, "the first request makes a segment");
        a.free(first.id).unwrap();
        let again = a.allocate(KIB, act()).unwrap();
        assert_eq!(a.requests_for_new_memory(), 1, "a cached block is no new memory");
        // Request 3 would fail, but it is declared served from memory held.
        a.set_fault_injection(Some(FaultInjection::Nth(3)));
        a.set_held_only(true);
        let held = a.allocate(KIB, act()).unwrap();
        a.set_held_only(false);
        assert_eq!(a.stats().num_injected_faults, 0);
        // Requests still count while held: 4 fails when asked for.
        a.set_fault_injection(Some(FaultInjection::Nth(4)));
        assert!(a.allocate(KIB, act()).unwrap_err().injected);
        assert_eq!(a.requests_for_new_memory(), 1, "an injected fault asks for nothing");
        a.allocate(3 * MIB, act()).unwrap();
        assert_eq!(a.requests_for_new_memory(), 2, "a large block needs a segment of its own pool");
        for b in [again, held] {
            a.free(b.id).unwrap();
        }
        ok(&a);
    }

    #[test]
    fn an_expandable_segment_grows_to_the_capacity_exactly_and_retries_only_after_releasing() {
        let mut a = expandable(Some(4 * MIB), Box::new(MetaBackend));
        let first = a.allocate(2 * MIB, act()).unwrap();
        let full = a.allocate(2 * MIB, act()).unwrap();
        assert_eq!(a.stats().reserved_bytes.current, 4 * MIB, "grown to the capacity, not past it");
        assert!(!a.allocate(2 * MIB, act()).unwrap_err().injected);
        assert_eq!(a.stats().num_alloc_retries, 0, "nothing was free to release: no retry");
        a.free(full.id).unwrap();
        a.free(first.id).unwrap();
        ok(&a);
    }

    #[test]
    fn keeping_the_cache_fails_a_request_the_cache_could_have_made_room_for() {
        let mut a = meta(Some(22 * MIB));
        let big = a.allocate(2 * MIB, act()).unwrap();
        a.free(big.id).unwrap();
        // 20 MiB cached in a free segment; 21 MiB needs a segment of its own: 42 MiB > 22 MiB.
        a.set_keep_cache(true);
        let before = a.stats().clone();
        assert!(!a.allocate(21 * MIB, act()).unwrap_err().injected);
        assert_eq!(a.stats().reserved_bytes.current, before.reserved_bytes.current, "nothing released");
        assert_eq!(a.stats().num_alloc_retries, 0);
        a.set_keep_cache(false);
        a.allocate(21 * MIB, act()).unwrap();
        assert_eq!(a.stats().num_alloc_retries, 1, "released the cache, then fitted");
        ok(&a);
    }

    #[test]
    fn the_layout_digest_follows_placement_not_ids_or_addresses() {
        let mut a = meta(None);
        let empty = a.layout_digest();
        let kept = a.allocate(KIB, act()).unwrap();
        let one = a.layout_digest();
        assert_ne!(one, empty);
        let t = a.allocate(4 * KIB, act()).unwrap();
        assert_ne!(a.layout_digest(), one, "a block taken changes it");
        a.free(t.id).unwrap();
        assert_eq!(a.layout_digest(), one, "freed and coalesced: as before");
        let large = a.allocate(3 * MIB, act()).unwrap();
        a.free(large.id).unwrap();
        let cached = a.layout_digest();
        assert_ne!(cached, one, "a cached segment is part of the layout");
        a.empty_cache();
        assert_eq!(a.layout_digest(), one, "released: as before");
        let large = a.allocate(3 * MIB, act()).unwrap();
        a.free(large.id).unwrap();
        assert_eq!(a.layout_digest(), cached, "a segment made again under a new id: the same layout");
        // Only whether a block is taken: [taken][taken][free] against [free][taken][free].
        let (x, y) = (a.allocate(KIB, act()).unwrap(), a.allocate(KIB, act()).unwrap());
        let both = a.layout_digest();
        a.free(x.id).unwrap();
        assert_ne!(a.layout_digest(), both, "a block freed in place changes it");
        a.free(y.id).unwrap();
        // Every different layout a digest of its own: blocks of 64 sizes taken one by one.
        let mut seen = std::collections::HashSet::new();
        let mut taken = Vec::new();
        for i in 1..=64 {
            taken.push(a.allocate(i * 512, act()).unwrap());
            assert!(seen.insert(a.layout_digest()), "layout {i} collides");
        }
        for t in taken {
            a.free(t.id).unwrap();
        }
        let mut b = host(None);
        let kept_b = b.allocate(KIB, act()).unwrap();
        assert_eq!(b.layout_digest(), one, "the same calls on another backend: the same digest");
        for (x, id) in [(&mut a, kept.id), (&mut b, kept_b.id)] {
            x.free(id).unwrap();
            ok(x);
        }
    }

    #[test]
    fn injected_faults_fail_only_the_chosen_requests() {
        let mut a = meta(None);
        a.set_fault_injection(Some(FaultInjection::Nth(2)));
        let first = a.allocate(KIB, act()).unwrap();
        let before = a.stats().clone();
        let err = a.allocate(KIB, act()).unwrap_err();
        assert!(err.injected);
        assert_eq!(err.requested, KIB);
        assert!(err.to_string().contains("(injected fault)"));
        let mut expected = before;
        expected.num_ooms = 1;
        expected.num_injected_faults = 1;
        assert_eq!(a.stats(), &expected);
        assert_eq!(a.timeline().events().last().unwrap().kind, EventKind::Oom);
        a.allocate(KIB, act()).unwrap();
        a.free(first.id).unwrap();
        ok(&a);

        // Requests keep counting over the allocator's life: 3 so far, so 6 and 9 fail.
        a.set_fault_injection(Some(FaultInjection::EveryNth(3)));
        let mut failed = Vec::new();
        for request in 4..=10 {
            if let Err(err) = a.allocate(KIB, act()) {
                assert!(err.injected);
                failed.push(request);
            }
        }
        assert_eq!(failed, [6, 9]);
        assert_eq!(a.stats().num_injected_faults, 3);
        a.set_fault_injection(Some(FaultInjection::EveryNth(0)));
        a.allocate(KIB, act()).unwrap();
        ok(&a);
    }

    #[test]
    fn stale_and_foreign_handles_are_refused_and_change_nothing() {
        let mut a = meta(None);
        let x = a.allocate(KIB, act()).unwrap();
        let _y = a.allocate(KIB, act()).unwrap();
        a.free(x.id).unwrap();
        // The freed record's slot is reused by the next allocation: the old handle must not reach it.
        let z = a.allocate(KIB, act()).unwrap();
        let before = a.stats().clone();
        assert_eq!(a.free(x.id), Err(InvalidBlock(x.id)));
        assert_eq!(a.set_category(x.id, Category::Gradient), Err(InvalidBlock(x.id)));
        assert_eq!(a.category_of(x.id), Err(InvalidBlock(x.id)));
        assert_eq!(a.stats(), &before);
        assert_eq!(a.category_of(z.id), Ok(Category::Activation));
        let message = InvalidBlock(x.id).to_string();
        assert!(message.contains("not a live block"), "{message}");

        let mut other = meta(None);
        let w = other.allocate(KIB, act()).unwrap();
        assert_eq!(a.free(w.id), Err(InvalidBlock(w.id)), "another allocator's handle");
        other.free(w.id).unwrap();
        ok(&a);
    }

    #[test]
    fn a_double_free_is_refused_while_the_freed_record_still_exists() {
        let mut a = meta(None);
        let x = a.allocate(KIB, act()).unwrap();
        let _y = a.allocate(KIB, act()).unwrap();
        a.free(x.id).unwrap();
        // x's record stays (a free block at offset 0, its neighbour is live), with x's serial.
        assert!(a.blocks[x.id.index as usize].as_ref().is_some_and(|b| !b.allocated && b.serial == x.id.serial));
        let before = a.stats().clone();
        assert_eq!(a.free(x.id), Err(InvalidBlock(x.id)));
        assert_eq!(a.set_category(x.id, Category::Gradient), Err(InvalidBlock(x.id)));
        assert_eq!(a.category_of(x.id), Err(InvalidBlock(x.id)));
        assert_eq!(a.stats(), &before);
        ok(&a);
    }

    #[test]
    fn drop_returns_every_segment_live_blocks_included() {
        let (mut a, live, _) = counting();
        a.allocate(KIB, act()).unwrap();
        a.allocate(5 * MIB, act()).unwrap();
        let c = a.allocate(16 * MIB, act()).unwrap();
        a.free(c.id).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 3);
        drop(a);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    // ----- the consistency checker is the oracle of the property tests: each check must fire -----

    /// A meta allocator (capacity 64 MiB) holding, in small segment 0, a 1 KiB parameter at offset 0,
    /// a freed 1 KiB hole, a 2 KiB activation and the free tail; and a 5 MiB live block in large
    /// segment 1 with its free 15 MiB tail. Every kind of block and both pools are present.
    fn corruptible() -> (Allocator, Allocation) {
        let mut a = meta(Some(64 * MIB));
        let x = a.allocate(KIB, req(Category::Parameter, "p")).unwrap();
        let hole = a.allocate(KIB, act()).unwrap();
        a.allocate(2 * KIB, act()).unwrap();
        a.allocate(5 * MIB, act()).unwrap();
        a.free(hole.id).unwrap();
        ok(&a);
        (a, x)
    }

    /// Applies `corrupt` to a fresh `corruptible()` allocator and asserts the checker names the fault.
    fn assert_reports(what: &str, corrupt: impl FnOnce(&mut Allocator, BlockId)) {
        let (mut a, x) = corruptible();
        corrupt(&mut a, x.id);
        match a.check_consistency() {
            Ok(()) => panic!("check_consistency accepted a corrupted state: expected {what:?}"),
            Err(message) => assert!(message.contains(what), "expected {what:?}, got {message:?}"),
        }
    }

    /// The block index of the record at `offset` in segment `segment`.
    fn block_at(a: &Allocator, segment: u64, offset: u64) -> u32 {
        let mut cursor = Some(a.segments[&segment].first_block);
        while let Some(index) = cursor {
            if a.block(index).offset == offset {
                return index;
            }
            cursor = a.block(index).next;
        }
        panic!("no block at offset {offset} of segment {segment}")
    }

    #[test]
    fn segment_addresses_start_at_4_gib_and_never_overlap() {
        let mut a = meta(None);
        a.allocate(KIB, act()).unwrap();
        a.allocate(5 * MIB, act()).unwrap();
        a.allocate(16 * MIB, act()).unwrap();
        let addresses: Vec<(u64, u64)> = a.snapshot().iter().map(|s| (s.address, s.total_size)).collect();
        // Never 0 (the address of an Oom event), 2 MiB aligned, in segment order.
        let first = 0x1_0000_0000;
        assert_eq!(addresses, [(first, 2 * MIB), (first + 2 * MIB, 20 * MIB), (first + 22 * MIB, 16 * MIB)]);
    }

    #[test]
    fn blocks_past_the_start_of_a_segment_have_its_address_plus_their_offset() {
        let mut a = meta(None);
        let first = 0x1_0000_0000;
        let _x = a.allocate(KIB, req(Category::Parameter, "x")).unwrap();
        let y = a.allocate(2 * KIB, req(Category::Input, "y")).unwrap();
        let alloc = a.timeline().events().last().copied().unwrap();
        assert_eq!((alloc.kind, alloc.address), (EventKind::Alloc, first + KIB));
        let live: Vec<(u64, u64)> = a.live_allocations().iter().map(|l| (l.size, l.address)).collect();
        assert_eq!(live, [(2 * KIB, first + KIB), (KIB, first)], "largest first");
        let blocks: Vec<(u64, u64, bool)> =
            a.snapshot()[0].blocks.iter().map(|b| (b.address, b.size, b.allocated)).collect();
        assert_eq!(
            blocks,
            [(first, KIB, true), (first + KIB, 2 * KIB, true), (first + 3 * KIB, 2 * MIB - 3 * KIB, false)]
        );
        a.free(y.id).unwrap();
        let free = a.timeline().events().last().copied().unwrap();
        assert_eq!((free.kind, free.address, free.op), (EventKind::Free, first + KIB, "y"));
    }

    #[test]
    fn capacity_and_data_are_what_was_configured() {
        assert_eq!(meta(Some(3 * MIB)).capacity(), Some(3 * MIB));
        assert_eq!(host(None).capacity(), None);
        assert!(host(None).holds_data());
        assert!(!meta(None).holds_data());
        let (a, _, _) = counting();
        assert!(!a.holds_data());
        let state = meta(Some(5 * MIB)).state();
        assert_eq!(state.capacity, Some(5 * MIB));
    }

    #[test]
    fn consistency_check_accepts_the_corruptible_state_and_reserved_equal_to_capacity() {
        let (a, _) = corruptible();
        assert_eq!(a.stats().reserved_bytes.current, 22 * MIB);
        ok(&a);
        // Reserved exactly at the capacity is allowed.
        let mut full = meta(Some(2 * MIB));
        full.allocate(KIB, act()).unwrap();
        assert_eq!(full.stats().reserved_bytes.current, 2 * MIB);
        ok(&full);
    }

    #[test]
    fn consistency_check_reports_misplaced_blocks() {
        assert_reports("dangling block 99", |a, _| a.segments.get_mut(&0).unwrap().first_block = 99);
        assert_reports("out of place", |a, x| a.block_mut(x.index).segment = 1);
        assert_reports("out of place", |a, _| {
            let second = block_at(a, 0, KIB);
            a.block_mut(second).offset = 2 * KIB;
        });
        assert_reports("out of place", |a, _| {
            let second = block_at(a, 0, KIB);
            a.block_mut(second).prev = None;
        });
    }

    #[test]
    fn consistency_check_reports_bad_block_sizes() {
        // The tail stays where it is, so only the size is wrong.
        assert_reports("has size 0", |a, _| {
            let tail = block_at(a, 0, 4 * KIB);
            a.block_mut(tail).size = 0;
        });
        assert_reports("has size 1000", |a, x| a.block_mut(x.index).size = 1000);
    }

    #[test]
    fn consistency_check_reports_uncoalesced_free_blocks() {
        // The live 2 KiB block between the hole and the tail becomes free: two free neighbours.
        assert_reports("was not coalesced", |a, _| {
            let middle = block_at(a, 0, 2 * KIB);
            a.block_mut(middle).allocated = false;
        });
    }

    #[test]
    fn consistency_check_reports_segments_not_covered_or_miscounted() {
        assert_reports("blocks cover", |a, _| a.segments.get_mut(&0).unwrap().size += 512);
        assert_reports("blocks cover", |a, _| a.segments.get_mut(&1).unwrap().free_bytes -= 512);
    }

    #[test]
    fn consistency_check_reports_lost_or_extra_block_records() {
        // A record no segment links to.
        assert_reports("block records", |a, x| {
            let orphan = a.block(x.index).clone();
            a.blocks.push(Some(orphan));
        });
        // A free slot that is not listed (the records stay reachable).
        assert_reports("block records", |a, _| a.blocks.push(None));
        // A listed free slot too many.
        assert_reports("block records", |a, _| a.free_slots.push(0));
    }

    #[test]
    fn consistency_check_reports_free_pools_that_do_not_match() {
        assert_reports("free pools", |a, _| {
            let first = *a.small_free.iter().next().unwrap();
            a.small_free.remove(&first);
        });
        assert_reports("free pools", |a, _| {
            let first = *a.large_free.iter().next().unwrap();
            a.large_free.remove(&first);
        });
        // A free block listed in the other pool.
        assert_reports("free pools", |a, _| {
            let first = *a.small_free.iter().next().unwrap();
            a.small_free.remove(&first);
            a.large_free.insert(first);
        });
    }

    #[test]
    fn consistency_check_reports_every_statistic_that_disagrees() {
        type Pick = fn(&mut MemoryStats) -> &mut Stat;
        let stats: [(&str, Pick); 7] = [
            ("allocated_bytes", |s| &mut s.allocated_bytes),
            ("active_bytes", |s| &mut s.active_bytes),
            ("requested_bytes", |s| &mut s.requested_bytes),
            ("allocation", |s| &mut s.allocation),
            ("reserved_bytes", |s| &mut s.reserved_bytes),
            ("segment", |s| &mut s.segment),
            ("inactive_split_bytes", |s| &mut s.inactive_split_bytes),
        ];
        for (name, pick) in stats {
            // The current value is off (its peak keeps up, so only the value is wrong)...
            assert_reports(name, |a, _| {
                let stat = pick(&mut a.stats);
                stat.current += 1;
                stat.peak = stat.peak.max(stat.current);
            });
            assert_reports(name, |a, _| {
                let stat = pick(&mut a.stats);
                stat.current -= 1;
            });
            // ...or the value is right and its peak is below it.
            assert_reports(name, |a, _| {
                let stat = pick(&mut a.stats);
                stat.peak = stat.current - 1;
            });
        }
    }

    #[test]
    fn consistency_check_reports_category_totals_and_the_capacity() {
        assert_reports("by_category", |a, _| a.stats.by_category[Category::Parameter.index()].current += 512);
        assert_reports("by_category", |a, x| a.block_mut(x.index).owner.category = Category::Gradient);
        assert_reports("exceeds the capacity", |a, _| a.config.capacity = Some(22 * MIB - 512));
    }
}
