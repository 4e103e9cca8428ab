//! A GPU's memory as segments of memfit's caching allocator: each segment one allocation of the
//! [`Machine`] (`cuMemAlloc` on a GPU), zero-filled (as the host's are), given back when the
//! allocator releases it. The allocator's policy (pools, rounding, splitting, caching) is the same
//! as on every device, so a `meta:cuda` device predicts this one's allocated and reserved bytes
//! exactly.

use crate::machine::Machine;
use memfit_memory::SegmentBackend;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

/// Device memory of one GPU (or of the emulator).
pub struct CudaSegments {
    machine: Arc<dyn Machine>,
    /// Every segment handed out and not yet taken back (base address -> bytes): `free_segment` is a
    /// safe method, so it frees only what it allocated, at the size it allocated.
    segments: BTreeMap<u64, usize>,
}

impl CudaSegments {
    pub fn new(machine: Arc<dyn Machine>) -> Self {
        CudaSegments { machine, segments: BTreeMap::new() }
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
        let address = self.machine.alloc(bytes).map_err(|_| ())?;
        self.segments.insert(address, bytes);
        // A device address is never 0 (cuMemAlloc does not return the null address).
        Ok(NonNull::new(address as usize as *mut u8))
    }

    fn reserve(&mut self, bytes: usize) -> Result<Option<NonNull<u8>>, ()> {
        let address = self.machine.reserve(bytes).map_err(|_| ())?;
        Ok(NonNull::new(address as usize as *mut u8))
    }

    fn map(&mut self, base: Option<NonNull<u8>>, offset: usize, bytes: usize) -> Result<(), ()> {
        let base = Self::address(base).ok_or(())?;
        self.machine.map(base + offset as u64, bytes).map_err(|_| ())
    }

    fn unmap(&mut self, base: Option<NonNull<u8>>, offset: usize, bytes: usize) {
        if let Some(base) = Self::address(base) {
            self.machine.unmap(base + offset as u64, bytes);
        }
    }

    fn release(&mut self, base: Option<NonNull<u8>>, bytes: usize) {
        if let Some(base) = Self::address(base) {
            self.machine.release(base, bytes);
        }
    }

    fn free_segment(&mut self, ptr: Option<NonNull<u8>>, bytes: usize) {
        let Some(ptr) = ptr else { return };
        let address = ptr.as_ptr() as usize as u64;
        if self.segments.get(&address) != Some(&bytes) {
            return;
        }
        self.segments.remove(&address);
        // The allocator frees a segment only when no block in it is allocated; the one stream
        // orders the free after the work that used it.
        self.machine.free(address);
    }
}

/// Expandable segments: the machine's reservations and page mappings (addresses are device
/// addresses, carried in the allocator's pointers as the fixed segments' are).
impl CudaSegments {
    fn address(base: Option<NonNull<u8>>) -> Option<u64> {
        base.map(|b| b.as_ptr() as usize as u64)
    }
}

impl Drop for CudaSegments {
    fn drop(&mut self) {
        for (&address, &bytes) in &self.segments.clone() {
            self.free_segment(NonNull::new(address as usize as *mut u8), bytes);
        }
    }
}
