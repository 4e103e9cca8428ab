//! The backend seam: the one place that decides which code computes an op for a device.
//!
//! An op (`ops/*`) says what it means: it checks shapes and dtypes, allocates its outputs from the
//! device's allocator (identically on every device, so `meta` predicts `cpu` to the byte), records
//! autograd, and then asks its device's [`Backend`] to fill the outputs. The backends:
//!
//! - `cpu` (`backend/cpu/`): the CPU kernels. Each matches the dtype once (`with_float!`) and runs
//!   Rust code, calling `memfit-kernels` for what has a path per instruction set (GEMM, GELU, exp),
//!   chosen at run time there.
//! - `meta` (`backend/meta.rs`): computes nothing; every kernel is a no-op, so a meta run is the
//!   cpu run's allocation sequence and nothing else.
//!
//! Adding a device is adding one implementation of [`Backend`] (and a `SegmentBackend` for its
//! memory); adding a dtype (f16/bf16 storage) is adding arms to the CPU kernels' dtype match
//! (`with_float!`, `dtype.rs`) and the conversions in `memfit-kernels`. Ops never branch on the
//! device.
//!
//! The trait lists each kernel once ([`backends!`]); the meta backend is generated from the same
//! list, so a kernel cannot be added to one backend and forgotten in the other.

pub(crate) mod cpu;

use crate::device::DeviceKind;
use crate::error::Result;
use crate::tensor::Tensor;

pub(crate) use cpu::Cpu;

/// Declares [`Backend`] with one method per kernel, and [`Meta`] implementing each as a no-op.
macro_rules! backends {
    ($( $(#[$doc:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?); )*) => {
        /// The kernels a device runs. Each fills outputs the op has already allocated; none
        /// allocates a tensor of its own except through the op's tensors.
        pub(crate) trait Backend: Sync {
            $( $(#[$doc])* fn $name(&self $(, $arg: $ty)*) -> Result<()>; )*
        }

        /// The `meta` backend: allocation happens in the ops; nothing is computed.
        pub(crate) struct Meta;

        impl Backend for Meta {
            $( fn $name(&self $(, _: $ty)*) -> Result<()> { Ok(()) } )*
        }
    };
}

use crate::ops::{Binary, Unary};

backends! {
    // Data movement.
    /// Fills a tensor's bytes with zeros.
    fn fill_zeros(&self, t: &Tensor);
    /// Fills a float tensor with one value.
    fn fill(&self, t: &Tensor, value: f64);
    /// Copies host bytes (the tensor's dtype, row-major) into a fresh contiguous tensor.
    fn write_bytes(&self, t: &Tensor, bytes: &[u8]);
    /// Copies `src`'s elements, in row-major order, into `dst` (same shape and dtype).
    fn copy(&self, dst: &Tensor, src: &Tensor);

    // Element-wise.
    /// `out = op(x)` (x contiguous).
    fn unary(&self, op: Unary, x: &Tensor, out: &Tensor);
    /// `out = op'(saved) * grad` for op's saved value (its output or input, or none for `neg`);
    /// `out` may be `grad` itself (in place).
    fn unary_backward(&self, op: Unary, saved: Option<&Tensor>, grad: &Tensor, out: &Tensor);
    /// `out = x * scale + shift` (x contiguous).
    fn affine(&self, x: &Tensor, scale: f64, shift: f64, out: &Tensor);
    /// `out = op(a, b)` over the broadcast shape of `out`.
    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, out: &Tensor);
    /// `dst += src` in place (same shape).
    fn add_into(&self, dst: &Tensor, src: &Tensor);
}

/// The backend of a device kind.
pub(crate) fn of(kind: DeviceKind) -> &'static dyn Backend {
    match kind {
        DeviceKind::Cpu => &Cpu,
        DeviceKind::Meta => &Meta,
    }
}
