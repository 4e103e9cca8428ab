//! The `cuda` backend: opening a GPU through `memfit-cuda` (driver, cuBLAS and NVRTC found first,
//! each missing one named). Its kernels are not all written yet (issue 27), so a GPU that opens
//! is refused with what was found; `meta:cuda` predicts a GPU run meanwhile.

use crate::device::DeviceKind;
use crate::error::{Error, Result};
use memfit_memory::format_bytes;

/// Checks, in milliseconds, that GPU `ordinal` can be used: its libraries load and it exists.
pub(crate) fn probe(ordinal: u32) -> Result<()> {
    memfit_cuda::Gpu::check(ordinal).map_err(|e| refused(ordinal, e))
}

pub(crate) fn open(ordinal: u32) -> Result<super::Opened> {
    let gpu = memfit_cuda::Gpu::open(ordinal).map_err(|e| refused(ordinal, e))?;
    Err(Error::device(format!(
        "--device {}: found {} with {} free, but this memfit's CUDA kernels are not all written yet (issue 27): \
         --device meta:cuda predicts the run's memory on this GPU's policy meanwhile",
        DeviceKind::Cuda(ordinal),
        gpu.description,
        format_bytes(gpu.free_bytes)
    )))
}

fn refused(ordinal: u32, e: memfit_cuda::CudaError) -> Error {
    Error::device(format!("--device {}: {e}", DeviceKind::Cuda(ordinal)))
}
