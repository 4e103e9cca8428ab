//! Where segment memory physically comes from: real host memory ([`HostBackend`]) or none at all
//! ([`MetaBackend`]).
//!
//! Contract:
//! - `alloc_segment(bytes)` returns `Ok(Some(ptr))` with real memory aligned to [`SEGMENT_ALIGN`]
//!   (HostBackend, via `std::alloc::alloc_zeroed` with a `Layout`; a null return is `Err(())`, never an abort),
//!   or `Ok(None)` for a backend that keeps no data (MetaBackend). `Err(())` means the backend itself
//!   could not provide the memory; the allocator treats it like a capacity failure (release cache, retry,
//!   then OutOfMemory).
//! - `free_segment(ptr, bytes)` returns a segment obtained from `alloc_segment` with the same size.

use std::alloc::{self, Layout};
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

/// Real host memory: the `cpu` device. Fresh segments are zero-filled, so no byte a tensor can read
/// is ever uninitialized.
#[derive(Debug, Default)]
pub struct HostBackend {
    /// Every segment handed out and not yet taken back: base address -> size. `free_segment` is a safe
    /// method, so it must not trust its arguments: deallocating with the wrong layout (or twice) would
    /// be undefined behaviour. Segments are few and large, so the lookup costs nothing that matters.
    segments: BTreeMap<usize, usize>,
}

/// No memory at all: the `meta` device, for planning.
#[derive(Debug, Default)]
pub struct MetaBackend;

impl SegmentBackend for HostBackend {
    fn holds_data(&self) -> bool {
        true
    }

    fn alloc_segment(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        // A zero-sized layout may not be passed to `alloc`; the allocator never asks for one anyway.
        if bytes == 0 {
            return Err(());
        }
        // Fails (rather than panics) when `bytes` rounded up to the alignment exceeds isize::MAX.
        let layout = Layout::from_size_align(bytes, SEGMENT_ALIGN).map_err(|_| ())?;
        // SAFETY: `layout` has a non-zero size (checked above) and a valid power-of-two alignment.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(())?;
        self.segments.insert(ptr.as_ptr() as usize, bytes);
        Ok(Some(ptr))
    }

    fn free_segment(&mut self, ptr: Option<NonNull<u8>>, bytes: usize) {
        let Some(ptr) = ptr else {
            panic!("memfit-memory: HostBackend asked to free a segment without memory");
        };
        let recorded = self.segments.remove(&(ptr.as_ptr() as usize));
        assert_eq!(
            recorded,
            Some(bytes),
            "memfit-memory: HostBackend asked to free a segment it did not hand out with this size"
        );
        let layout =
            Layout::from_size_align(bytes, SEGMENT_ALIGN).expect("a size that was allocated has a valid layout");
        // SAFETY: the segment map proves `ptr` came from `alloc::alloc_zeroed` in `alloc_segment` with exactly
        // this size and alignment (so the same layout), and removing the entry above guarantees it is
        // deallocated once.
        unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
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
