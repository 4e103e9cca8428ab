//! memfit-cuda: the `cuda` device's machine side: finding the driver and libraries at run time
//! (so every build has `--device cuda` and no build needs a CUDA installation), opening a GPU,
//! its memory as segments of memfit's allocator, and the CUDA C kernels compiled by NVRTC.
//!
//! Everything is loaded dynamically (`cudarc` with `dynamic-loading`). `cudarc`'s loader panics
//! when a library is missing, so [`probe`] looks for each library first and the caller gets a
//! [`CudaError`] that names what is missing; no function here calls into a library [`probe`] has
//! not found. Batches go up through pinned host buffers without the host waiting ([`Staging`]).
//!
//! A GPU is a [`Machine`] (memory, copies, launches by kernel name, cuBLAS products): the real one
//! ([`Gpu`]) or the [`Emulator`], which runs the same kernel sources on the host so CI tests every
//! launcher without a GPU (`MEMFIT_CUDA_EMULATOR=1`).
//!
//! Knows nothing about tensors: the tensor crate's `backend/cuda.rs` lowers tensors to device
//! addresses and calls in here, as `backend/cpu.rs` does with `memfit-cpu`.

pub mod emulator;
pub mod gpu;
pub mod graphs;
pub mod kernels;
pub mod libraries;
pub mod lt;
pub mod machine;
pub mod nvml;
pub mod rounded;
pub mod segments;
pub mod staging;
pub mod timing;

pub use emulator::Emulator;
pub use gpu::Gpu;
pub use graphs::{Graphed, Launches};
pub use libraries::{probe, Library};
pub use machine::{Arg, Gemm, GemmType, Launch, Machine, Strided};
pub use segments::CudaSegments;
pub use staging::Staging;

use std::fmt;

/// Bytes of the one workspace cuBLAS gets (`cublasSetWorkspace`), allocated by the device from
/// memfit's allocator when it opens and kept until it closes (as PyTorch keeps one per handle), so
/// it is counted, and `meta:cuda` allocates it too. PyTorch's default before Hopper is 8 MiB and a
/// bit; single-precision products do not need more.
pub const LIBRARY_WORKSPACE_BYTES: u64 = 8 << 20;

/// Bytes of the workspace bf16 and fp16 products round their operands into ([`rounded`]): allocated
/// by the device from memfit's allocator when its products become rounded (`Device::set_products`),
/// so it is counted, and `meta:cuda` allocates it too. 32 Mi two-byte elements: GPT-2's products
/// whole, its 50,304-word head's weight in two pieces.
pub const ROUNDING_WORKSPACE_BYTES: u64 = 64 << 20;

/// What stops a GPU from being used, in words a user can act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaError {
    /// A library is not on the system (or not on the loader's path).
    Missing(Library),
    /// The driver is there but has no such GPU.
    NoDevice { ordinal: u32, count: u32 },
    /// A driver, NVRTC or cuBLAS call failed.
    Call { what: String, detail: String },
    /// A kernel's source did not compile (NVRTC's log).
    Compile { kernel: String, log: String },
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::Missing(lib) => write!(f, "{}", lib.missing_message()),
            CudaError::NoDevice { ordinal, count: 0 } => {
                write!(f, "no GPU: the NVIDIA driver is installed but sees no device (cuda:{ordinal} asked for)")
            }
            CudaError::NoDevice { ordinal, count } => write!(
                f,
                "no GPU cuda:{ordinal}: this machine has {count} (cuda:0 to cuda:{}); CUDA_VISIBLE_DEVICES may hide others",
                count - 1
            ),
            CudaError::Call { what, detail } => write!(f, "{what} failed: {detail}"),
            CudaError::Compile { kernel, log } => write!(f, "the CUDA kernel {kernel} did not compile:\n{log}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// A failed library call as a [`CudaError`].
pub(crate) fn call_error(what: &str, detail: impl fmt::Debug) -> CudaError {
    CudaError::Call { what: what.to_string(), detail: format!("{detail:?}") }
}
