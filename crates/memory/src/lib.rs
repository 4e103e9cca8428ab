//! memfit-memory owns every byte memfit uses on a device: a caching allocator whose policy follows
//! PyTorch's CUDA caching allocator, with a capacity, statistics, accounting by category, a bounded
//! event timeline and a typed, explanatory out-of-memory error. It knows nothing about tensors.
//!
//! Where memory physically comes from is a [`SegmentBackend`]: [`HostBackend`] hands out real host
//! memory (the `cpu` device), [`MetaBackend`] hands out none (the `meta` device). The policy code is the
//! same for both, so a program run on either produces the same events and statistics byte for byte.

mod allocator;
mod backend;
mod bytes;
mod category;
mod oom;
pub mod process;
mod stats;
mod timeline;

pub use allocator::{
    Allocation, Allocator, AllocatorConfig, BlockId, BlockSnapshot, FaultInjection, InvalidBlock, LiveAllocation,
    MemoryState, Request, SegmentSnapshot,
};
pub use backend::{HostBackend, MetaBackend, SegmentBackend, PAGE_BYTES};
pub use bytes::{format_bytes, parse_bytes};
pub use category::{Category, Phase};
pub use oom::OutOfMemory;
pub use stats::{MemoryStats, Stat};
pub use timeline::{Event, EventKind, Timeline};
