//! Where segment memory physically comes from: real host memory ([`HostBackend`]) or none at all
//! ([`MetaBackend`]).
//!
//! Contract:
//! - `alloc_segment(bytes)` returns `Ok(Some(ptr))` with real memory aligned to [`SEGMENT_ALIGN`]
//!   (HostBackend: an anonymous memory map of its own, zero-filled by the operating system and handed
//!   back to it by `free_segment`, so memory the cache releases leaves the process; a failed map is
//!   `Err(())`, never an abort),
//!   or `Ok(None)` for a backend that keeps no data (MetaBackend). `Err(())` means the backend itself
//!   could not provide the memory; the allocator treats it like a capacity failure (release cache, retry,
//!   then OutOfMemory).
//! - `free_segment(ptr, bytes)` returns a segment obtained from `alloc_segment` with the same size.

use memmap2::MmapMut;
use std::collections::BTreeMap;
use std::ptr::NonNull;

/// Alignment of every segment base; block offsets are multiples of 512, so every block is aligned too.
pub const SEGMENT_ALIGN: usize = 512;

pub trait SegmentBackend: Send {
    /// True when memory is real (data can be read and written).
    fn holds_data(&self) -> bool;
    // `Err(())` carries no detail on purpose: every backend failure is handled the same way.
    #[allow(clippy::result_unit_err)]
    fn alloc_segment(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()>;
    fn free_segment(&mut self, ptr: Option<NonNull<u8>>, bytes: usize);
}

/// Real host memory: the `cpu` device. Each segment is an anonymous memory map, zero-filled by the
/// operating system (no byte a tensor can read is ever uninitialized) and unmapped when freed (the
/// process's resident memory shrinks with the allocator's cache, instead of staying in the C heap).
#[derive(Debug, Default)]
pub struct HostBackend {
    /// Every segment handed out and not yet taken back, by base address. `free_segment` is a safe
    /// method, so it must not trust its arguments: it unmaps only a map it made, of the size given.
    /// Segments are few and large, so the lookup costs nothing that matters.
    segments: BTreeMap<usize, MmapMut>,
}

/// No memory at all: the `meta` device, for planning.
#[derive(Debug, Default)]
pub struct MetaBackend;

impl SegmentBackend for HostBackend {
    fn holds_data(&self) -> bool {
        true
    }

    fn alloc_segment(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        // The allocator never asks for zero bytes; a map of zero bytes is refused by the system anyway.
        if bytes == 0 || bytes > isize::MAX as usize {
            return Err(());
        }
        let mut map = MmapMut::map_anon(bytes).map_err(|_| ())?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or(())?;
        debug_assert_eq!(ptr.as_ptr() as usize % SEGMENT_ALIGN, 0, "maps are page aligned");
        self.segments.insert(ptr.as_ptr() as usize, map);
        Ok(Some(ptr))
    }

    fn free_segment(&mut self, ptr: Option<NonNull<u8>>, bytes: usize) {
        let Some(ptr) = ptr else {
            panic!("memfit-memory: HostBackend asked to free a segment without memory");
        };
        let map = self.segments.remove(&(ptr.as_ptr() as usize));
        assert_eq!(
            map.as_ref().map(|m| m.len()),
            Some(bytes),
            "memfit-memory: HostBackend asked to free a segment it did not hand out with this size"
        );
        // Dropping the map unmaps it: the pages go back to the operating system.
        drop(map);
    }
}

impl SegmentBackend for MetaBackend {
    fn holds_data(&self) -> bool {
        false
    }

    fn alloc_segment(&mut self, _bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        Ok(None)
    }

    fn free_segment(&mut self, _ptr: Option<NonNull<u8>>, _bytes: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_segments_are_aligned_writable_and_freed() {
        let mut backend = HostBackend::default();
        assert!(backend.holds_data());
        let ptr = backend.alloc_segment(4096).unwrap().unwrap();
        assert_eq!(ptr.as_ptr() as usize % SEGMENT_ALIGN, 0);
        // SAFETY: the segment is 4096 bytes of freshly allocated memory owned by this test.
        unsafe {
            ptr.as_ptr().write_bytes(0xAB, 4096);
            assert_eq!(*ptr.as_ptr().add(4095), 0xAB);
        }
        backend.free_segment(Some(ptr), 4096);
    }

    #[test]
    fn host_backend_reports_failure_instead_of_aborting() {
        let mut backend = HostBackend::default();
        assert_eq!(backend.alloc_segment(0), Err(()));
        assert_eq!(backend.alloc_segment(usize::MAX), Err(()));
        assert_eq!(backend.alloc_segment(isize::MAX as usize), Err(()));
    }

    #[test]
    #[should_panic(expected = "did not hand out")]
    fn host_backend_refuses_a_wrong_size() {
        let mut backend = HostBackend::default();
        let ptr = backend.alloc_segment(1024).unwrap();
        backend.free_segment(ptr, 2048);
    }

    #[test]
    fn meta_backend_holds_nothing() {
        let mut backend = MetaBackend;
        assert!(!backend.holds_data());
        assert_eq!(backend.alloc_segment(1 << 40), Ok(None));
        backend.free_segment(None, 1 << 40);
    }
}
