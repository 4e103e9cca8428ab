//! A GPU's memory as segments of memfit's caching allocator: each segment one `cuMemAlloc`,
//! zero-filled (as the host's are), given back with `cuMemFree` when the allocator releases it.
//! The allocator's policy (pools, rounding, splitting, caching) is the same as on every device, so
//! a `meta:cuda` device predicts this one's allocated and reserved bytes exactly.

use cudarc::driver::{sys, CudaContext};
use memfit_memory::SegmentBackend;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

/// Device memory of one GPU.
pub struct CudaSegments {
    context: Arc<CudaContext>,
    /// Every segment handed out and not yet taken back (base address -> bytes): `free_segment` is a
    /// safe method, so it frees only what it allocated, at the size it allocated.
    segments: BTreeMap<u64, usize>,
}

impl CudaSegments {
    pub fn new(context: Arc<CudaContext>) -> Self {
        CudaSegments { context, segments: BTreeMap::new() }
    }
}

impl SegmentBackend for CudaSegments {
    fn holds_data(&self) -> bool {
        true
    }

    fn alloc_segment(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        if bytes == 0 {
            return Err(());
        }
        // The allocator may be called from any worker thread: the context must be current on it.
        self.context.bind_to_thread().map_err(|_| ())?;
        // SAFETY: a plain allocation of `bytes` in the current context, filled with zeros before
        // anyone can read it; the address is device memory, never dereferenced on the host.
        let ptr = unsafe {
            let ptr = cudarc::driver::result::malloc_sync(bytes).map_err(|_| ())?;
            if sys::cuMemsetD8_v2(ptr, 0, bytes) != sys::CUresult::CUDA_SUCCESS {
                let _ = cudarc::driver::result::free_sync(ptr);
                return Err(());
            }
            ptr
        };
        self.segments.insert(ptr, bytes);
        // A device address is never 0 (cuMemAlloc does not return the null address).
        Ok(NonNull::new(ptr as usize as *mut u8))
    }

    fn free_segment(&mut self, ptr: Option<NonNull<u8>>, bytes: usize) {
        let Some(ptr) = ptr else { return };
        let address = ptr.as_ptr() as usize as u64;
        if self.segments.get(&address) != Some(&bytes) || self.context.bind_to_thread().is_err() {
            return;
        }
        self.segments.remove(&address);
        // SAFETY: the address is a live segment of this context, freed once (removed above). The
        // allocator frees a segment only when no block in it is allocated; the compute stream is
        // the only one that uses blocks, and cuMemFree waits for work using it to finish.
        unsafe {
            let _ = cudarc::driver::result::free_sync(address);
        }
    }
}

impl Drop for CudaSegments {
    fn drop(&mut self) {
        for (&address, &bytes) in &self.segments.clone() {
            self.free_segment(NonNull::new(address as usize as *mut u8), bytes);
        }
    }
}
