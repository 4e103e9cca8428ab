//! [`Tensor`]: a typed, shaped view over [`Storage`], with an optional autograd node.
//!
//! Note [Storage aliasing]: kernels read inputs through `&[T]` and write outputs through `&mut [T]`
//! obtained from raw storage pointers. The engine upholds the aliasing rules by construction: an op
//! writes only to storage it has just allocated (nobody else holds it yet), and the few in-place
//! updates (optimizer steps, gradient accumulation, parameter loading) write to parameter, gradient
//! and state storages while no slice of them is borrowed. Tensor handles may be shared across threads,
//! but ops on one device are issued from one thread at a time (kernels parallelize internally).

use crate::autograd::Node;
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::storage::Storage;
use memfit_cpu::View;
use memfit_memory::Category;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) struct TensorImpl {
    storage: Arc<Storage>,
    layout: Layout,
    dtype: DType,
    requires_grad: bool,
    grad_fn: Option<Arc<Node>>,
    grad: Mutex<Option<Tensor>>,
}

/// A handle to a tensor; clones share the same tensor (and its `.grad`).
#[derive(Clone)]
pub struct Tensor(Arc<TensorImpl>);

impl Tensor {
    pub(crate) fn from_parts(storage: Arc<Storage>, layout: Layout, dtype: DType) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage,
            layout,
            dtype,
            requires_grad: false,
            grad_fn: None,
            grad: Mutex::new(None),
        }))
    }

    /// A new tensor sharing this one's storage with another layout (a view). No autograd.
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), layout, self.0.dtype)
    }

    /// The same data with an autograd node attached.
    pub(crate) fn with_grad_fn(&self, node: Arc<Node>) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            requires_grad: true,
            grad_fn: Some(node),
            grad: Mutex::new(None),
        }))
    }

    /// Uninitialized (arbitrary contents) tensor, except that a bool tensor starts all false (any other
    /// byte than 0 or 1 is not a bool, so reading arbitrary bytes as bools would be undefined).
    pub fn empty(
        device: &Device,
        shape: &[usize],
        dtype: DType,
        category: Category,
        op: &'static str,
    ) -> Result<Tensor> {
        let numel = crate::layout::checked_numel(shape)?;
        let bytes = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::shape(format!("shape {shape:?} has more bytes than fit in memory")))?;
        let storage = device.allocate(bytes, category, op)?;
        let t = Tensor::from_parts(Arc::new(storage), Layout::contiguous(shape), dtype);
        if dtype == DType::Bool {
            device.backend().fill_zeros(&t)?;
        }
        Ok(t)
    }

    pub fn zeros(device: &Device, shape: &[usize], dtype: DType, category: Category) -> Result<Tensor> {
        let t = Tensor::empty(device, shape, dtype, category, "zeros")?;
        device.backend().fill_zeros(&t)?;
        Ok(t)
    }

    /// A tensor filled with `value` (float dtypes).
    pub fn full(device: &Device, shape: &[usize], value: f64, dtype: DType, category: Category) -> Result<Tensor> {
        crate::ops::check_computable("full", dtype)?;
        let t = Tensor::empty(device, shape, dtype, category, "full")?;
        device.backend().fill(&t, value)?;
        Ok(t)
    }

    /// Copies host data into a new tensor. On meta only the allocation happens.
    pub fn from_slice<T: Element>(device: &Device, data: &[T], shape: &[usize], category: Category) -> Result<Tensor> {
        if crate::layout::checked_numel(shape)? != data.len() {
            return Err(Error::shape(format!("{} values do not fill shape {shape:?}", data.len())));
        }
        let t = Tensor::empty(device, shape, T::DTYPE, category, "from_slice")?;
        device.backend().write_bytes(&t, element_bytes(data))?;
        Ok(t)
    }

    /// Refuses reading or writing this tensor's elements as `T` unless `T` is its dtype.
    fn check_dtype<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype(format!("a {} tensor's elements read as {}", self.dtype(), T::DTYPE)));
        }
        Ok(())
    }

    /// A 0-d tensor.
    pub fn scalar(device: &Device, value: f64, dtype: DType, category: Category) -> Result<Tensor> {
        Tensor::full(device, &[], value, dtype, category)
    }

    /// Sets every element to `value`, in place: a view writes into the tensor it views (PyTorch's
    /// `fill_`, as a model builds a constant mask). Not for a tensor autograd tracks.
    pub fn fill_(&self, value: f64) -> Result<()> {
        crate::ops::check_computable("fill_", self.dtype())?;
        if self.requires_grad() || self.grad_fn().is_some() {
            return Err(crate::Error::invalid("fill_: the tensor takes part in autograd; fill_ writes constants only"));
        }
        self.device().backend().fill(self, value)
    }

    pub fn device(&self) -> &Device {
        self.0.storage.device()
    }
    pub fn storage(&self) -> &Arc<Storage> {
        &self.0.storage
    }
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    pub fn size(&self, dim: isize) -> Result<usize> {
        Ok(self.shape()[crate::layout::resolve_dim(dim, self.rank())?])
    }

    /// True for leaves that want a gradient and for every tensor computed from one with grad enabled.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad
    }

    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }

    pub(crate) fn grad_fn(&self) -> Option<&Arc<Node>> {
        self.0.grad_fn.as_ref()
    }

    /// The same data as a new leaf that does (or does not) want a gradient.
    pub fn set_requires_grad(&self, requires_grad: bool) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            requires_grad,
            grad_fn: None,
            grad: Mutex::new(None),
        }))
    }

    /// The same data, cut from the graph.
    pub fn detach(&self) -> Tensor {
        self.set_requires_grad(false)
    }

    fn grad_slot(&self) -> MutexGuard<'_, Option<Tensor>> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The accumulated gradient of a leaf, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad_slot().clone()
    }

    /// Replaces the gradient (None frees it: PyTorch's `zero_grad(set_to_none=True)`).
    pub fn set_grad(&self, grad: Option<Tensor>) {
        *self.grad_slot() = grad;
    }

    /// Takes the gradient out, leaving None.
    pub fn take_grad(&self) -> Option<Tensor> {
        self.grad_slot().take()
    }

    /// True when both handles are the same tensor.
    pub fn same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// True when nobody but the caller can see this tensor's memory: this is the only handle on the
    /// tensor (clones share one tensor, see [`Tensor`]), the tensor is the only user of its storage
    /// (no view, no saved copy), and it covers all of the storage contiguously. Only then may it be
    /// updated in place (Note [Gradient ownership] in `autograd.rs`). Callers pass handles they own by
    /// value, so the count reflects everybody else.
    pub(crate) fn owns_storage(&self) -> bool {
        Arc::strong_count(&self.0) == 1
            && Arc::strong_count(&self.0.storage) == 1
            && self.is_contiguous()
            && self.0.layout.offset() == 0
            && self.numel() * self.dtype().size() == self.0.storage.requested_bytes()
    }

    /// What a host kernel sees of this tensor: its storage, dtype and layout. Errors on a device
    /// whose memory the host cannot read (meta, a GPU).
    pub(crate) fn view(&self) -> Result<View<'_>> {
        if !self.device().host_readable() {
            return Err(Error::device(format!(
                "the {} device's memory is not readable from the host in place (copy it with to_vec)",
                self.device().kind()
            )));
        }
        let ptr = self.0.storage.ptr()?;
        // SAFETY: the storage holds `requested_bytes` initialised bytes, is aligned to 512 B, lives
        // as long as `self`, and every element of the layout lies inside it (it was allocated for
        // this layout or a larger one); Note [Storage aliasing] is the rule its slices follow.
        Ok(unsafe { View::new(ptr.as_ptr(), self.0.storage.requested_bytes(), self.0.dtype, &self.0.layout) })
    }

    /// The elements of a contiguous tensor. Errors on meta.
    pub(crate) fn slice<T: Element>(&self) -> Result<&[T]> {
        Ok(self.view()?.slice::<T>()?)
    }

    /// The elements of a contiguous tensor, for writing (Note [Storage aliasing]). Errors on meta.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn slice_mut<T: Element>(&self) -> Result<&mut [T]> {
        Ok(self.view()?.slice_mut::<T>()?)
    }

    /// Reads a contiguous tensor's elements in place through `read` (no copy), for transports such as
    /// a collective operation's send buffer. None on a device that holds no data.
    /// On a device the host cannot read in place (a GPU), `read` sees a host copy.
    pub fn read_with<T: Element, R>(&self, read: impl FnOnce(&[T]) -> R) -> Result<Option<R>> {
        if !self.device().computes() {
            return Ok(None);
        }
        if !self.device().host_readable() {
            self.check_dtype::<T>()?;
            return Ok(Some(read(&self.to_vec::<T>()?)));
        }
        Ok(Some(read(self.slice::<T>()?)))
    }

    /// Fills a contiguous tensor from the host through `fill` (no staging copy): a fresh tensor, or a
    /// buffer a collective operation receives into while nobody else reads it (Note [Storage
    /// aliasing]). Does nothing on a device that holds no data.
    /// On a device the host cannot write in place (a GPU), `fill` updates a host copy of the
    /// tensor's values, which is then copied back.
    pub fn write_with<T: Element>(&self, fill: impl FnOnce(&mut [T])) -> Result<()> {
        if !self.device().computes() {
            return Ok(());
        }
        if !self.device().host_readable() {
            if !self.is_contiguous() {
                return Err(Error::shape(format!("write_with needs a contiguous tensor, not {:?}", self.layout())));
            }
            let mut values = self.to_vec::<T>()?;
            fill(&mut values);
            return self.device().backend().write_bytes(self, element_bytes(&values));
        }
        fill(self.slice_mut::<T>()?);
        Ok(())
    }

    /// Overwrites every element of a contiguous tensor with what `fill` writes (it must write all of
    /// them: on a GPU the slice it gets holds leftovers, not the tensor's values), without reading
    /// the tensor back first (unlike [`Tensor::write_with`]). For values made once (initial
    /// weights, a loaded checkpoint): on a GPU the copy is from ordinary memory and waits. Does
    /// nothing on a device that holds no data.
    pub fn overwrite_with<T: Element>(&self, fill: impl FnOnce(&mut [T])) -> Result<()> {
        self.overwrite(fill, false)
    }

    /// [`Tensor::overwrite_with`] for data that changes every step (a batch, positions): on a GPU
    /// the values go through one of the device's pinned buffers and are copied in stream order, so
    /// the host does not wait for the device.
    pub fn overwrite_async_with<T: Element>(&self, fill: impl FnOnce(&mut [T])) -> Result<()> {
        self.overwrite(fill, true)
    }

    fn overwrite<T: Element>(&self, fill: impl FnOnce(&mut [T]), staged: bool) -> Result<()> {
        if !self.device().computes() {
            return Ok(());
        }
        if self.device().host_readable() {
            fill(self.slice_mut::<T>()?);
            return Ok(());
        }
        self.check_dtype::<T>()?;
        if !self.is_contiguous() {
            return Err(Error::shape(format!("overwrite_with needs a contiguous tensor, not {:?}", self.layout())));
        }
        let mut fill = Some(fill);
        let mut misaligned = false;
        let mut write = |bytes: &mut [u8]| {
            if T::DTYPE == DType::Bool {
                // A pinned buffer's leftovers may be any bytes, and only 0 and 1 are bools.
                bytes.fill(0);
            }
            // SAFETY: `T` is a plain number type (no padding) for which every byte pattern in the
            // buffer is a valid value (bool's were zeroed above), and `align_to_mut` only yields
            // whole, aligned elements.
            let (head, values, tail) = unsafe { bytes.align_to_mut::<T>() };
            match fill.take() {
                Some(f) if head.is_empty() && tail.is_empty() => f(values),
                _ => misaligned = true,
            }
        };
        self.device().backend().upload_with(self, &mut write, staged)?;
        if misaligned {
            return Err(Error::device("internal error: an upload buffer is not aligned for its elements".to_string()));
        }
        Ok(())
    }

    /// Copies the elements out in row-major order (any layout). Errors on meta.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.device().computes() && !self.device().host_readable() {
            self.check_dtype::<T>()?;
            let mut bytes = vec![0u8; self.numel() * self.dtype().size()];
            self.device().backend().read_bytes(self, &mut bytes)?;
            // SAFETY: `T` is the tensor's element type (checked), a plain `Copy` value of
            // `dtype().size()` bytes, and every value the device wrote is a valid `T` (a bool is 0
            // or 1: kernels write nothing else); the read is unaligned because a byte vector's
            // start need not be aligned for `T`.
            return Ok((0..self.numel())
                .map(|i| unsafe { bytes.as_ptr().add(i * std::mem::size_of::<T>()).cast::<T>().read_unaligned() })
                .collect());
        }
        let view = self.view()?;
        if view.is_contiguous() {
            return Ok(view.slice::<T>()?.to_vec());
        }
        let storage = view.storage::<T>()?;
        let mut out = Vec::with_capacity(self.numel());
        self.0.layout.for_each_offset(|o| out.push(storage[o]));
        Ok(out)
    }

    /// Values of a float tensor (f32, f64, f16, bf16) as f64. Errors on meta.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        Ok(match self.dtype() {
            DType::F32 => self.to_vec::<f32>()?.into_iter().map(f64::from).collect(),
            DType::F64 => self.to_vec::<f64>()?,
            DType::F16 => self.to_vec::<half::f16>()?.into_iter().map(f64::from).collect(),
            DType::BF16 => self.to_vec::<half::bf16>()?.into_iter().map(f64::from).collect(),
            DType::I64 => self.to_vec::<i64>()?.into_iter().map(|v| v as f64).collect(),
            DType::U8 => self.to_vec::<u8>()?.into_iter().map(f64::from).collect(),
            DType::Bool => self.to_vec::<bool>()?.into_iter().map(|v| if v { 1.0 } else { 0.0 }).collect(),
        })
    }

    /// The value of a one-element tensor. Errors on meta.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::shape(format!("item() needs one element, the tensor has shape {:?}", self.shape())));
        }
        Ok(self.to_f64_vec()?[0])
    }

    /// Adds 1 to every element of a contiguous int64 tensor in place, on its device (a counter such
    /// as batch norm's `num_batches_tracked`: a GPU's is not read back to be counted); never
    /// recorded by autograd. Does nothing on meta.
    pub fn count_up(&self) -> Result<()> {
        if self.dtype() != DType::I64 || !self.is_contiguous() {
            return Err(Error::dtype(format!(
                "count_up needs a contiguous int64 tensor, not {:?} {}",
                self.shape(),
                self.dtype()
            )));
        }
        self.device().backend().count_up(self)
    }

    /// Overwrites this tensor's elements in place with `src`'s (same shape and dtype). For loading
    /// checkpoints and optimizer-style updates; never recorded by autograd.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if self.shape() != src.shape() || self.dtype() != src.dtype() {
            return Err(Error::shape(format!(
                "copy_from: destination {:?} {} and source {:?} {} differ",
                self.shape(),
                self.dtype(),
                src.shape(),
                src.dtype()
            )));
        }
        self.device().backend().copy(self, src)
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {}, {}", self.shape(), self.dtype(), self.device().kind())?;
        if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bool tensor is zeroed when made, whatever its block held before: bytes other than 0 and 1
    /// are not bools at all, so this reads the bytes, not the bools.
    #[test]
    fn a_fresh_bool_tensor_is_zero_bytes_even_in_a_dirty_block() {
        let device = Device::cpu();
        let dirty = Tensor::full(&device, &[1024], 3.0, DType::F32, Category::Activation).unwrap();
        drop(dirty);
        let mask = Tensor::empty(&device, &[64, 64], DType::Bool, Category::Activation, "mask").unwrap();
        let bytes = mask.view().unwrap().storage_bytes();
        assert_eq!(bytes.len(), 4096);
        assert!(bytes.iter().all(|&b| b == 0));
    }
}

/// The bytes of a slice of elements.
fn element_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: elements are plain numbers (no padding); the byte view covers exactly the slice and
    // lives no longer than it.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
}
