//! An open GPU: its context (the primary context of device `cuda:N`), what it is, and how much
//! memory the context itself took.

use crate::libraries::{probe, Library};
use crate::{call_error, nvml, CudaError};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// One GPU with its context made current on the opening thread.
pub struct Gpu {
    context: Arc<CudaContext>,
    /// `name (sm_XY)`, as reports print it.
    pub description: String,
    /// Compute capability, `(major, minor)`.
    pub capability: (i32, i32),
    /// Device memory free once the context exists.
    pub free_bytes: u64,
    pub total_bytes: u64,
    /// Memory the context took: free memory before it was created (NVML) less free memory after.
    /// None where NVML (`libnvidia-ml.so.1`) is not there to ask before.
    pub context_bytes: Option<u64>,
}

impl Gpu {
    /// Opens GPU `ordinal`: checks that the driver, cuBLAS and NVRTC can be loaded first (naming
    /// the one that cannot), then that the device exists, then creates its context.
    pub fn open(ordinal: u32) -> Result<Gpu, CudaError> {
        Gpu::check(ordinal)?;
        // The device's identity first, without a context, to ask NVML what is free before it.
        let device = cudarc::driver::result::device::get(ordinal as i32).map_err(|e| call_error("cuDeviceGet", e))?;
        let uuid = cudarc::driver::result::device::get_uuid(device).map_err(|e| call_error("cuDeviceGetUuid", e))?;
        let uuid_bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
        let free_before = nvml::free_bytes(&uuid_bytes);
        let context = CudaContext::new(ordinal as usize).map_err(|e| call_error("creating the CUDA context", e))?;
        let (free, total) = context.mem_get_info().map_err(|e| call_error("cuMemGetInfo", e))?;
        let capability = context.compute_capability().map_err(|e| call_error("cuDeviceGetAttribute", e))?;
        let name = context.name().map_err(|e| call_error("cuDeviceGetName", e))?;
        Ok(Gpu {
            description: format!("{name} (sm_{}{})", capability.0, capability.1),
            capability,
            free_bytes: free as u64,
            total_bytes: total as u64,
            context_bytes: free_before.map(|before| before.saturating_sub(free as u64)),
            context,
        })
    }

    /// Checks, without creating a context (milliseconds), that GPU `ordinal` can be opened: the
    /// driver, cuBLAS and NVRTC load, and the driver sees that many GPUs.
    pub fn check(ordinal: u32) -> Result<(), CudaError> {
        probe(&Library::ALL)?;
        let count = CudaContext::device_count().map_err(|e| call_error("cuInit/cuDeviceGetCount", e))?;
        let count = u32::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        Ok(())
    }

    /// The context, for streams, modules and libraries.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }
}
