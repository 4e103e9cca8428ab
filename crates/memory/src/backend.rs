//! Where segment memory physically comes from: real host memory ([`HostBackend`]) or none at all
//! ([`MetaBackend`]).
//!
//! Contract:
//! - `alloc_segment(bytes)` returns `Ok(Some(ptr))` with real memory aligned to [`SEGMENT_ALIGN`]
//!   (HostBackend: an anonymous memory map of its own, zero-filled by the operating system and handed
//!   back to it by `free_segment`, so memory the cache releases leaves the process; on Linux a
//!   segment of at least [`HUGE_PAGE_BYTES`] is advised for transparent huge pages; a failed map is
//!   `Err(())`, never an abort),
//!   or `Ok(None)` for a backend that keeps no data (MetaBackend). `Err(())` means the backend itself
//!   could not provide the memory; the allocator treats it like a capacity failure (release cache, retry,
//!   then OutOfMemory).
//! - `free_segment(ptr, bytes)` returns a segment obtained from `alloc_segment` with the same size.
//! - Expandable segments (`AllocatorConfig::expandable`): `reserve(bytes)` takes address space that
//!   holds nothing yet (HostBackend: a map without access, which costs no memory), `map(base, offset,
//!   bytes)` commits zero-filled pages inside it, `unmap` gives them back to the system, and
//!   `release` returns the reservation. Offsets and sizes are multiples of [`PAGE_BYTES`]. A backend
//!   without them (the default methods) refuses `reserve`, and the allocator then fails the request as
//!   it fails a refused segment.

use memmap2::MmapMut;
use std::collections::BTreeMap;
use std::ptr::NonNull;

/// Alignment of every segment base; block offsets are multiples of 512, so every block is aligned too.
pub const SEGMENT_ALIGN: usize = 512;

/// Segments of at least this many bytes (x86-64's huge page) are advised for transparent huge
/// pages (Linux `madvise(MADV_HUGEPAGE)`; systems whose setting is `madvise`, the common default,
/// otherwise give them 4 KiB pages). The kernels read large activations and weights in place, rows
/// kilobytes apart, so with 4 KiB pages nearly every row is a page of its own and a TLB miss; with
/// 2 MiB pages the GPT step's ops took 468 instead of 497 ms (`memfit profile --model gpt`, AVX2
/// path, the two builds alternating: faster in 14 of 17 pairs) and 459 instead of 474 on AVX-512
/// (medians of 3 pairs). The advice changes no byte that is counted: a
/// segment still maps exactly the bytes the allocator asked for, and a page is still filled only
/// when touched. Where huge pages are disabled (`never`) or unsupported, the advice does nothing.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// The unit an expandable segment grows and shrinks by (a huge page; a GPU's mapping granularity).
pub const PAGE_BYTES: u64 = 2 << 20;

// `Err(())` carries no detail on purpose: every backend failure is handled the same way.
#[allow(clippy::result_unit_err)]
pub trait SegmentBackend: Send {
    /// True when memory is real (data can be read and written).
    fn holds_data(&self) -> bool;
    fn alloc_segment(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()>;
    fn free_segment(&mut self, ptr: Option<NonNull<u8>>, bytes: usize);

    /// Reserves `bytes` of address space for an expandable segment, nothing mapped in it.
    fn reserve(&mut self, _bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        Err(())
    }
    /// Maps `bytes` of zero-filled memory at `offset` of a reservation.
    fn map(&mut self, _base: Option<NonNull<u8>>, _offset: usize, _bytes: usize) -> Result<(), ()> {
        Err(())
    }
    /// Gives back the pages at `offset` of a reservation (mapped by `map`).
    fn unmap(&mut self, _base: Option<NonNull<u8>>, _offset: usize, _bytes: usize) {}
    /// Returns a reservation of `bytes` (nothing mapped in it any more).
    fn release(&mut self, _base: Option<NonNull<u8>>, _bytes: usize) {}
}

/// Real host memory: the `cpu` device. Each segment is an anonymous memory map, zero-filled by the
/// operating system (no byte a tensor can read is ever uninitialized) and unmapped when freed (the
/// process's resident memory shrinks with the allocator's cache, instead of staying in the C heap);
/// large ones in huge pages where the system allows ([`HUGE_PAGE_BYTES`]).
#[derive(Debug, Default)]
pub struct HostBackend {
    /// Every segment handed out and not yet taken back, by base address. `free_segment` is a safe
    /// method, so it must not trust its arguments: it unmaps only a map it made, of the size given.
    /// Segments are few and large, so the lookup costs nothing that matters.
    segments: BTreeMap<usize, MmapMut>,
    /// Reservations of expandable segments (base address -> bytes), checked likewise.
    reservations: BTreeMap<usize, usize>,
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        for (&base, &bytes) in &self.reservations {
            // SAFETY: our own reservations; the allocator that used them is gone.
            #[cfg(unix)]
            unsafe {
                libc::munmap(base as *mut libc::c_void, bytes);
            }
        }
    }
}

impl HostBackend {
    /// The reservation `base` if it holds `offset..offset + bytes`, as its address.
    fn reserved_range(&self, base: Option<NonNull<u8>>, offset: usize, bytes: usize) -> Option<usize> {
        let base = base?.as_ptr() as usize;
        let size = *self.reservations.get(&base)?;
        (offset.checked_add(bytes)? <= size).then_some(base)
    }
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
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE_BYTES {
            // Only advice: a kernel without transparent huge pages refuses it, and the segment is
            // as usable with small pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
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

    #[cfg(unix)]
    fn reserve(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        if bytes == 0 || bytes > isize::MAX as usize {
            return Err(());
        }
        // SAFETY: an anonymous private map at an address of the system's choosing, without access:
        // it touches no existing memory, and nothing reads it until `map` gives pages access.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(())?;
        self.reservations.insert(ptr.as_ptr() as usize, bytes);
        Ok(Some(ptr))
    }

    #[cfg(unix)]
    fn map(&mut self, base: Option<NonNull<u8>>, offset: usize, bytes: usize) -> Result<(), ()> {
        let address = self.reserved_range(base, offset, bytes).ok_or(())? + offset;
        // SAFETY: the range lies inside a reservation of ours (checked above) that holds no live data
        // (the allocator maps a range only past the segment's end); its pages were never touched or
        // were discarded by `unmap`, so they read as zeros.
        let ok =
            unsafe { libc::mprotect(address as *mut libc::c_void, bytes, libc::PROT_READ | libc::PROT_WRITE) } == 0;
        #[cfg(target_os = "linux")]
        if ok && bytes >= HUGE_PAGE_BYTES {
            // SAFETY: advice on pages of our own reservation; refusal is harmless (see HUGE_PAGE_BYTES).
            let _ = unsafe { libc::madvise(address as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
        }
        if ok {
            Ok(())
        } else {
            Err(())
        }
    }

    #[cfg(unix)]
    fn unmap(&mut self, base: Option<NonNull<u8>>, offset: usize, bytes: usize) {
        let Some(base) = self.reserved_range(base, offset, bytes) else {
            panic!("memfit-memory: HostBackend asked to unmap pages outside its reservations");
        };
        let address = (base + offset) as *mut libc::c_void;
        // SAFETY: pages of our own reservation that hold no live block (the allocator unmaps only
        // free pages at a segment's end). MADV_DONTNEED drops them (the next touch reads zeros) and
        // PROT_NONE makes any stray access fault instead of reading stale memory.
        unsafe {
            libc::madvise(address, bytes, libc::MADV_DONTNEED);
            libc::mprotect(address, bytes, libc::PROT_NONE);
        }
    }

    #[cfg(unix)]
    fn release(&mut self, base: Option<NonNull<u8>>, bytes: usize) {
        let Some(base) = base.map(|b| b.as_ptr() as usize) else { return };
        if self.reservations.get(&base) != Some(&bytes) {
            panic!("memfit-memory: HostBackend asked to release a reservation it did not make");
        }
        self.reservations.remove(&base);
        // SAFETY: a reservation of ours, of this size, with no live block left in it.
        unsafe {
            libc::munmap(base as *mut libc::c_void, bytes);
        }
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

    fn reserve(&mut self, _bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        Ok(None)
    }

    fn map(&mut self, _base: Option<NonNull<u8>>, _offset: usize, _bytes: usize) -> Result<(), ()> {
        Ok(())
    }
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

    /// The `VmFlags` of the mapping of this process that holds `addr`, from `/proc/self/smaps`.
    #[cfg(target_os = "linux")]
    fn mapping_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((lo, hi)) =
                range.and_then(|(a, b)| Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?)))
            {
                inside = (lo..hi).contains(&addr);
            } else if let (true, Some(flags)) = (inside, line.strip_prefix("VmFlags:")) {
                return flags.split_whitespace().map(str::to_string).collect();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    /// Segments of a huge page or more are advised for huge pages (the mapping's `hg` flag), smaller
    /// ones are not; where the kernel has no transparent huge pages, neither is (the advice fails
    /// quietly) and both segments still work.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_host_segments_are_advised_for_huge_pages() {
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists();
        let mut backend = HostBackend::default();
        for (bytes, advised) in
            [(HUGE_PAGE_BYTES, thp), (3 * HUGE_PAGE_BYTES + 4096, thp), (HUGE_PAGE_BYTES - 4096, false)]
        {
            let ptr = backend.alloc_segment(bytes).unwrap().unwrap();
            let flags = mapping_flags(ptr.as_ptr() as usize);
            assert_eq!(flags.iter().any(|f| f == "hg"), advised, "{bytes} bytes: flags {flags:?}");
            // SAFETY: the segment is `bytes` bytes of fresh memory owned by this test.
            unsafe {
                ptr.as_ptr().write_bytes(0x5A, bytes);
                assert_eq!(*ptr.as_ptr().add(bytes - 1), 0x5A);
            }
            backend.free_segment(Some(ptr), bytes);
        }
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
