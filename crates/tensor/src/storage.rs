//! A block of device memory owned by tensors. It returns to the allocator when the last tensor
//! (or saved-for-backward handle) using it is dropped.

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use memfit_memory::{Allocation, Category};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, Weak};

/// A storage holds its block from `new` to `drop`, and nothing else frees it.
const LIVE: &str = "a storage's block is live until the storage drops";

pub struct Storage {
    device: Device,
    allocation: Allocation,
    /// The compact copy autograd last saved of a view of this storage (Note [Shared compact copies]
    /// in autograd.rs).
    compact: Mutex<Option<CompactCopy>>,
}

/// A compact copy of one view of a storage: the view's layout (`source`), and the copy's storage
/// (held weakly: the copy lives while some saved handle holds it), layout and dtype.
pub(crate) struct CompactCopy {
    pub source: Layout,
    pub copy: Weak<Storage>,
    pub layout: Layout,
    pub dtype: DType,
}

// SAFETY: the pointer is owned memory from the device's allocator, freed only in Drop; the engine
// never hands out overlapping mutable access to the same storage from two threads (see
// Note [Storage aliasing] in tensor.rs).
unsafe impl Send for Storage {}
// SAFETY: see above.
unsafe impl Sync for Storage {}

impl Storage {
    pub(crate) fn new(device: Device, allocation: Allocation) -> Self {
        Storage { device, allocation, compact: Mutex::new(None) }
    }

    /// The compact copy autograd last saved of a view of this storage, if any.
    pub(crate) fn compact_copy(&self) -> MutexGuard<'_, Option<CompactCopy>> {
        self.compact.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes the caller asked for (the block itself may be larger).
    pub fn requested_bytes(&self) -> usize {
        self.allocation.requested as usize
    }

    pub fn category(&self) -> Category {
        self.device.allocator().category_of(self.allocation.id).expect(LIVE)
    }

    pub fn set_category(&self, category: Category) {
        self.device.allocator().set_category(self.allocation.id, category).expect(LIVE);
    }

    pub(crate) fn ptr(&self) -> Result<NonNull<u8>> {
        self.allocation.ptr.ok_or_else(|| Error::device(format!("the {} device holds no data", self.device.kind())))
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.device.allocator().free(self.allocation.id).expect(LIVE);
    }
}
