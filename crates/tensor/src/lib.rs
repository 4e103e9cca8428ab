//! memfit-tensor: tensors whose every byte comes from the memfit allocator, on a computing `cpu` device
//! or a planning `meta` device, with ops and reverse-mode autograd; the `cpu` device's kernels are the
//! crate `memfit-cpu`, reached through one seam (`backend`).
//!
//! Entry points: [`Device`] (owns the allocator, phase and grad mode), [`Tensor`] (a view over
//! [`Storage`] with an optional autograd node), [`autograd::backward`], and the op families in [`ops`].
//! Every op returns [`Result`], so running out of memory is a value, never a panic.

pub mod autograd;
mod backend;
mod device;
mod dtype;
mod error;
mod layout;
pub mod ops;
mod storage;
mod tensor;

pub use device::{
    Device, DeviceConfig, DeviceKind, GradModeGuard, ModuleGuard, OpGuard, PhaseGuard, RecomputeGuard, RehearsalGuard,
    ReplayGuard, Span, SpanKind, Target,
};
pub use dtype::{DType, Element, Float};
pub use error::{Error, Result};
pub use layout::Layout;
pub use memfit_cuda::graphs::VARIABLE as CUDA_GRAPHS_VARIABLE;
pub use memfit_cuda::Launches;
pub use memfit_kernels::gemm_bf16::{Bf16Level, Products};
pub use memfit_kernels::Isa;
pub use memfit_memory as memory;
pub use memfit_memory::{Category, MemoryStats, OutOfMemory, Phase};
pub use storage::Storage;
pub use tensor::Tensor;
