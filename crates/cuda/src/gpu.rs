//! An open GPU: its context (the primary context of device `cuda:N`), what it is, how much memory
//! the context (and cuBLAS's handle) took, and the [`Machine`] it is: memory, copies and launches on
//! one stream (the context's default stream), kernels loaded on first use as machine code NVRTC
//! assembled (or the cache kept), products by cuBLAS, uploads from pinned host memory with events.
//! CUDA graphs (Note [CUDA graphs] in `graphs.rs`) are captured on a stream of their own (the
//! default stream cannot be captured; cuBLAS's handle follows it during a capture) and launched on
//! the default stream, in order with all other work.

use crate::kernels::{assemble_cached, forget_cached, source_of};
use crate::libraries::{probe, Library};
use crate::lt::Lt;
use crate::machine::{Arg, Gemm, GemmType, Launch, Machine};
use crate::timing::{self, KernelTimes};
use crate::{call_error, nvml, CudaError};
use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The library workspace's first bytes, where cuBLASLt's check puts its operands (`Gpu::checked_lt`);
/// products with a bias get the rest as their workspace.
const LT_CHECK_BYTES: usize = 4096;

/// One GPU with its context made current on the opening thread.
pub struct Gpu {
    /// cuBLASLt for products with a bias (`lt.rs`): opened and checked on the first ask, None
    /// where it is missing or its check failed. First, so its handle goes before the context.
    lt: std::sync::OnceLock<Option<Lt>>,
    /// Whether cuBLASLt's bias epilogue passed its check (`lt_check`) on bf16 and on fp16 operands.
    lt16: [std::sync::OnceLock<bool>; 2],
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    ordinal: i32,
    /// Expandable segments' pages: address -> the physical allocation mapped there (one per page,
    /// so any run of pages can be unmapped alone).
    pages: Mutex<std::collections::BTreeMap<u64, sys::CUmemGenericAllocationHandle>>,
    /// Blocks that fill every multiprocessor several times over (read once at open).
    max_blocks: u32,
    /// `name (sm_XY)`, as reports print it.
    pub description: String,
    /// Compute capability, `(major, minor)`.
    pub capability: (i32, i32),
    /// Device memory free once the context exists.
    pub free_bytes: u64,
    pub total_bytes: u64,
    /// Memory the context and cuBLAS's handle took: free memory before the context was created
    /// (NVML) less free memory after. None where NVML (`libnvidia-ml.so.1`) is not there to ask.
    pub context_bytes: Option<u64>,
    /// Kernel times asked for (`MEMFIT_CUDA_KERNEL_TIMES`, `timing.rs`), written when the GPU closes.
    timer: Option<KernelTimes>,
    /// The library workspace (address, bytes), once the device set it.
    workspace: Mutex<(u64, usize)>,
    /// The stream graphs are captured on (Note [CUDA graphs]), made at the first capture: captures
    /// need a stream of their own (the context's default stream cannot be captured); the graphs
    /// are launched on the default stream, in order with everything else.
    capture_stream: Mutex<Option<Arc<CudaStream>>>,
    /// Whether a capture is under way: then work is queued on `capture_stream` (recorded).
    capturing: std::sync::atomic::AtomicBool,
    /// Captured graphs by their executable's handle: the graph itself too, whose nodes
    /// `graph_set_kernel` names.
    graphs: Mutex<HashMap<u64, u64>>,
}

impl Gpu {
    /// Opens GPU `ordinal`: checks that the driver, cuBLAS and NVRTC can be loaded first (naming
    /// the one that cannot), then that the device exists, then creates its context and a cuBLAS
    /// handle on its stream.
    pub fn open(ordinal: u32) -> Result<Gpu, CudaError> {
        Gpu::check(ordinal)?;
        // The device's identity first, without a context, to ask NVML what is free before it.
        let device = result::device::get(ordinal as i32).map_err(|e| call_error("cuDeviceGet", e))?;
        let uuid = result::device::get_uuid(device).map_err(|e| call_error("cuDeviceGetUuid", e))?;
        let uuid_bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
        let free_before = nvml::free_bytes(&uuid_bytes);
        let context = CudaContext::new(ordinal as usize).map_err(|e| call_error("creating the CUDA context", e))?;
        let stream = context.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| call_error("creating the cuBLAS handle", e))?;
        let (free, total) = context.mem_get_info().map_err(|e| call_error("cuMemGetInfo", e))?;
        let capability = context.compute_capability().map_err(|e| call_error("cuDeviceGetAttribute", e))?;
        let name = context.name().map_err(|e| call_error("cuDeviceGetName", e))?;
        let sms = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| call_error("cuDeviceGetAttribute", e))?;
        Ok(Gpu {
            max_blocks: (sms.max(1) as u32) * 16,
            description: format!("{name} (sm_{}{})", capability.0, capability.1),
            capability,
            free_bytes: free as u64,
            total_bytes: total as u64,
            context_bytes: free_before.map(|before| before.saturating_sub(free as u64)),
            context,
            stream,
            blas: Mutex::new(blas),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            ordinal: ordinal as i32,
            pages: Mutex::new(std::collections::BTreeMap::new()),
            timer: timing::requested().map(|path| KernelTimes {
                path,
                marks: Mutex::new(Vec::new()),
                last_end: Mutex::new(None),
                read: Mutex::new(timing::Totals::default()),
            }),
            workspace: Mutex::new((0, 0)),
            lt: std::sync::OnceLock::new(),
            lt16: [std::sync::OnceLock::new(), std::sync::OnceLock::new()],
            capture_stream: Mutex::new(None),
            capturing: std::sync::atomic::AtomicBool::new(false),
            graphs: Mutex::new(HashMap::new()),
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

    /// The stream work is queued on: the default stream, or the capture's while one is under way.
    fn queue(&self) -> sys::CUstream {
        if self.capturing.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(stream) = self.capture_stream.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                return stream.cu_stream();
            }
        }
        self.stream.cu_stream()
    }

    /// Points cuBLAS's handle at `stream` (its products are queued there), and gives it the library
    /// workspace again: setting a stream resets cuBLAS's workspace to its own pool (cuBLAS's
    /// documentation), which would allocate outside memfit's allocator (and inside a capture).
    fn blas_stream(&self, stream: sys::CUstream) -> Result<(), CudaError> {
        let blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle is live; the stream is this context's.
        let status = unsafe { blas_sys::cublasSetStream_v2(*blas.handle(), stream as _) };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(call_error("cublasSetStream", status));
        }
        let (address, bytes) = *self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        if bytes > 0 {
            // SAFETY: as `set_library_workspace`: memory of this context held while the device is open.
            let status = unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), address as *mut _, bytes) };
            if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(call_error("cublasSetWorkspace", status));
            }
        }
        Ok(())
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.context.bind_to_thread().map_err(|e| call_error("making the CUDA context current", e))
    }

    /// Kernel `name`, its module loaded (assembled, or from the cache of machine code) on first use.
    fn function(&self, name: &str) -> Result<CudaFunction, CudaError> {
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let source = source_of(name).ok_or_else(|| CudaError::Call {
            what: format!("launching {name}"),
            detail: "no kernel of that name in memfit's sources".into(),
        })?;
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match modules.get(source.name) {
                Some(m) => m.clone(),
                None => {
                    let load = |cubin: Vec<u8>| {
                        self.context
                            .load_module(Ptx::from_binary(cubin))
                            .map_err(|e| call_error(&format!("loading the kernels of {}.cu", source.name), e))
                    };
                    // Machine code the driver refuses (a cache file damaged, or written by a
                    // different NVRTC of the same version) is assembled again, once; a failed
                    // assembly is not repeated.
                    let module = match load(assemble_cached(source, self.capability)?) {
                        Ok(module) => module,
                        Err(_) => {
                            forget_cached(source, self.capability);
                            load(assemble_cached(source, self.capability)?)?
                        }
                    };
                    modules.insert(source.name, module.clone());
                    module
                }
            }
        };
        let f = module.load_function(name).map_err(|e| call_error(&format!("finding kernel {name}"), e))?;
        functions.insert(name.to_string(), f.clone());
        Ok(f)
    }
}

impl Gpu {
    /// Runs `work` (work queued on the stream), between two events when kernel times are asked for.
    fn timed(
        &self,
        name: impl FnOnce() -> String,
        work: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let Some(timer) = &self.timer else { return work() };
        // Events that keep time (`event_create`'s do not: they only say when work is done).
        let timing_event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map(|e| e as u64)
                .map_err(|e| call_error("cuEventCreate", e))
        };
        self.bind()?;
        let (start, end) = (timing_event()?, timing_event()?);
        self.event_record(start)?;
        let called = std::time::Instant::now();
        let done = work();
        let host_ms = called.elapsed().as_secs_f64() * 1e3;
        self.event_record(end)?;
        let pending = {
            let mut marks = timer.marks.lock().unwrap_or_else(|e| e.into_inner());
            marks.push(timing::Mark { name: name(), start, end, host_ms });
            marks.len()
        };
        if pending >= timing::PENDING_MARKS {
            self.read_kernel_times(timer);
        }
        done
    }

    /// Waits for the stream, then reads the pending launches' times and destroys their events (all
    /// but the last end event, kept for the idle time before the next launch).
    fn read_kernel_times(&self, timer: &KernelTimes) {
        let _ = self.stream.synchronize();
        let marks = std::mem::take(&mut *timer.marks.lock().unwrap_or_else(|e| e.into_inner()));
        let mut read = timer.read.lock().unwrap_or_else(|e| e.into_inner());
        let mut last_end = timer.last_end.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: events of `timed`, recorded in order on the stream, whose work is done (the
        // stream was waited for); each destroyed once, after its last reading.
        let elapsed = |a: u64, b: u64| unsafe { result::event::elapsed(a as sys::CUevent, b as sys::CUevent) };
        for m in marks {
            let ms = elapsed(m.start, m.end).map(f64::from).unwrap_or(0.0);
            let idle_ms = last_end.map_or(0.0, |e| elapsed(e, m.start).map(f64::from).unwrap_or(0.0).max(0.0));
            read.add(m.name, timing::Launched { ms, host_ms: m.host_ms, idle_ms });
            self.event_destroy(m.start);
            if let Some(previous) = last_end.replace(m.end) {
                self.event_destroy(previous);
            }
        }
    }

    /// Writes the kernel times asked for (after the work is done).
    fn write_kernel_times(&self) {
        let Some(timer) = &self.timer else { return };
        self.read_kernel_times(timer);
        if let Some(last) = timer.last_end.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.event_destroy(last);
        }
        let text = timing::table(&timer.read.lock().unwrap_or_else(|e| e.into_inner()).sorted());
        if let Err(e) = std::fs::write(&timer.path, text) {
            eprintln!("warning: {}: cannot write {}: {e}", timing::VARIABLE, timer.path.display());
        }
    }

    /// Device memory of this GPU, as CUDA's virtual memory calls describe it.
    fn page_properties(&self) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all zeros is valid (no handle types, no flags).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.ordinal;
        prop
    }
}

impl Machine for Gpu {
    fn reserve(&self, bytes: usize) -> Result<u64, CudaError> {
        self.bind()?;
        let prop = self.page_properties();
        let mut granularity = 0usize;
        // SAFETY: out-pointer to a local; the properties describe this device.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(|e| call_error("cuMemGetAllocationGranularity", e))?;
        if granularity == 0 || crate::machine::PAGE % granularity != 0 {
            return Err(call_error("expandable segments", format!("the GPU maps memory in units of {granularity} B")));
        }
        let mut address = 0;
        // SAFETY: out-pointer to a local; reserving touches no memory.
        unsafe { sys::cuMemAddressReserve(&mut address, bytes, 0, 0, 0) }
            .result()
            .map_err(|e| call_error("cuMemAddressReserve", e))?;
        Ok(address)
    }

    fn map(&self, address: u64, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        let prop = self.page_properties();
        let page = crate::machine::PAGE;
        let mut mapped = Vec::new();
        let result = (|| {
            for at in (address..address + bytes as u64).step_by(page) {
                let mut handle = 0;
                // SAFETY: out-pointer to a local; then the page is mapped into our reservation at
                // an address nothing is mapped at (the allocator maps only past a segment's end).
                unsafe { sys::cuMemCreate(&mut handle, page, &prop, 0) }
                    .result()
                    .map_err(|e| call_error("cuMemCreate", e))?;
                if let Err(e) = unsafe { sys::cuMemMap(at, page, 0, handle, 0) }.result() {
                    // SAFETY: the handle just created, never mapped.
                    let _ = unsafe { sys::cuMemRelease(handle) };
                    return Err(call_error("cuMemMap", e));
                }
                mapped.push((at, handle));
            }
            // SAFETY: a plain C struct for which all zeros is valid; its fields are set next.
            let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            access.location = prop.location;
            access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: the range is mapped (above); one descriptor.
            unsafe { sys::cuMemSetAccess(address, bytes, &access, 1) }
                .result()
                .map_err(|e| call_error("cuMemSetAccess", e))?;
            // SAFETY: the range is mapped and accessible; zero-filled as every segment is.
            unsafe { result::memset_d8_sync(address, 0, bytes) }.map_err(|e| call_error("cuMemsetD8", e))
        })();
        match result {
            Ok(()) => {
                self.pages.lock().unwrap_or_else(|e| e.into_inner()).extend(mapped);
                Ok(())
            }
            Err(e) => {
                for (at, handle) in mapped {
                    // SAFETY: pages this call mapped, unused.
                    unsafe {
                        let _ = sys::cuMemUnmap(at, page);
                        let _ = sys::cuMemRelease(handle);
                    }
                }
                Err(e)
            }
        }
    }

    fn unmap(&self, address: u64, bytes: usize) {
        if self.bind().is_err() {
            return;
        }
        // The pages' last users are kernels in flight on the stream: wait for them first.
        let _ = self.stream.synchronize();
        let mut pages = self.pages.lock().unwrap_or_else(|e| e.into_inner());
        let gone: Vec<u64> = pages.range(address..address + bytes as u64).map(|(&a, _)| a).collect();
        for at in gone {
            if let Some(handle) = pages.remove(&at) {
                // SAFETY: a page `map` mapped and nothing uses any more (the stream is idle).
                unsafe {
                    let _ = sys::cuMemUnmap(at, crate::machine::PAGE);
                    let _ = sys::cuMemRelease(handle);
                }
            }
        }
    }

    fn release(&self, address: u64, bytes: usize) {
        if self.bind().is_ok() {
            // SAFETY: a reservation of `reserve` with nothing mapped in it any more.
            let _ = unsafe { sys::cuMemAddressFree(address, bytes) };
        }
    }

    fn description(&self) -> String {
        self.description.clone()
    }

    fn max_blocks(&self) -> u32 {
        // Grid-stride loops do the rest.
        self.max_blocks
    }

    fn max_grid(&self) -> u32 {
        // CUDA's limit on a grid's x dimension.
        i32::MAX as u32
    }

    fn free_bytes(&self) -> Result<u64, CudaError> {
        self.bind()?;
        let (free, _) = self.context.mem_get_info().map_err(|e| call_error("cuMemGetInfo", e))?;
        Ok(free as u64)
    }

    fn alloc(&self, bytes: usize) -> Result<u64, CudaError> {
        self.bind()?;
        // SAFETY: a plain allocation in the current context, zero-filled before anyone reads it.
        unsafe {
            let ptr = result::malloc_sync(bytes).map_err(|e| call_error("cuMemAlloc", e))?;
            if let Err(e) = result::memset_d8_sync(ptr, 0, bytes) {
                let _ = result::free_sync(ptr);
                return Err(call_error("cuMemsetD8", e));
            }
            Ok(ptr)
        }
    }

    fn free(&self, address: u64) {
        if self.bind().is_ok() {
            // SAFETY: the caller gives back an address from `alloc` once; cuMemFree waits for the
            // work using it (one stream).
            unsafe {
                let _ = result::free_sync(address);
            }
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `dst` is device memory of at least `src.len()` bytes (the caller's contract).
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| call_error("cuMemcpyHtoD", e))
    }

    fn pinned_alloc(&self, bytes: usize) -> Result<u64, CudaError> {
        self.bind()?;
        // SAFETY: a plain page-locked host allocation; its bytes are written before any copy reads them.
        unsafe { result::malloc_host(bytes, 0) }.map(|p| p as u64).map_err(|e| call_error("cuMemHostAlloc", e))
    }

    fn pinned_free(&self, host: u64) {
        if self.bind().is_ok() {
            // SAFETY: an address of `pinned_alloc`, freed once, with no copy from it pending (the
            // caller's contract).
            let _ = unsafe { result::free_host(host as *mut std::ffi::c_void) };
        }
    }

    fn upload_async(&self, dst: u64, host: u64, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `host` is pinned memory of at least `bytes` that the caller leaves untouched until
        // an event recorded after this copy is done; `dst` is device memory of at least `bytes`.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, host as *const std::ffi::c_void, bytes, self.stream.cu_stream()) }
            .result()
            .map_err(|e| call_error("cuMemcpyHtoDAsync", e))
    }

    fn event_create(&self) -> Result<u64, CudaError> {
        self.bind()?;
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(|e| e as u64)
            .map_err(|e| call_error("cuEventCreate", e))
    }

    fn event_record(&self, event: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: an event of `event_create`, not destroyed (the caller's contract).
        unsafe { result::event::record(event as sys::CUevent, self.stream.cu_stream()) }
            .map_err(|e| call_error("cuEventRecord", e))
    }

    fn event_done(&self, event: u64) -> Result<bool, CudaError> {
        self.bind()?;
        // SAFETY: as `event_record`.
        match unsafe { result::event::query(event as sys::CUevent) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(call_error("cuEventQuery", e)),
        }
    }

    fn event_wait(&self, event: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: as `event_record`.
        unsafe { result::event::synchronize(event as sys::CUevent) }.map_err(|e| call_error("cuEventSynchronize", e))
    }

    fn event_destroy(&self, event: u64) {
        if self.bind().is_ok() {
            // SAFETY: as `event_record`; destroyed once.
            let _ = unsafe { result::event::destroy(event as sys::CUevent) };
        }
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `src` is device memory of at least `dst.len()` bytes; the copy on the default
        // stream waits for the kernels before it.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(|e| call_error("cuMemcpyDtoH", e))
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: both ranges are device memory of at least `bytes` (the caller's contract).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.queue()) }.map_err(|e| call_error("cuMemcpyDtoD", e))
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: as `copy`.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.queue()) }.map_err(|e| call_error("cuMemsetD8", e))
    }

    fn launch(&self, name: &str, shape: Launch, args: &mut [Arg]) -> Result<(), CudaError> {
        if shape.grid == 0 {
            return Ok(());
        }
        let f = self.function(name)?;
        self.bind()?;
        let mut params: Vec<*mut std::ffi::c_void> = args.iter_mut().map(Arg::address).collect();
        self.timed(
            || name.to_string(),
            || {
                // SAFETY: the kernel's parameters are `args` in order (each launcher passes exactly
                // the kernel's signature), each pointing at a value that lives through the call (the
                // driver copies them at launch); addresses in them are live device memory.
                unsafe {
                    result::launch_kernel(
                        f.cu_function(),
                        (shape.grid, 1, 1),
                        (shape.block, 1, 1),
                        0,
                        self.queue(),
                        &mut params,
                    )
                }
                .map_err(|e| call_error(&format!("launching {name}"), e))
            },
        )
    }

    fn set_library_workspace(&self, address: u64, bytes: usize) -> Result<(), CudaError> {
        self.bind()?;
        let blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle is live; the workspace is device memory of this context that the
        // caller keeps allocated for the handle's life (the device frees it only when it closes).
        let status = unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), address as *mut _, bytes) };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(call_error("cublasSetWorkspace", status));
        }
        *self.workspace.lock().unwrap_or_else(|e| e.into_inner()) = (address, bytes);
        Ok(())
    }

    fn fuses_bias(&self, dtype: GemmType) -> bool {
        let Some(lt) = self.lt.get_or_init(|| self.checked_lt()) else { return false };
        match dtype {
            GemmType::F32 => true,
            GemmType::F32Bf16 => *self.lt16[0].get_or_init(|| self.lt_check(lt, GemmType::Bf16)),
            GemmType::F32F16 => *self.lt16[1].get_or_init(|| self.lt_check(lt, GemmType::F16)),
            _ => false,
        }
    }

    fn capture_begin(&self) -> Result<(), CudaError> {
        self.bind()?;
        let stream = {
            let mut made = self.capture_stream.lock().unwrap_or_else(|e| e.into_inner());
            match made.as_ref() {
                Some(stream) => stream.clone(),
                None => {
                    let stream = self.context.new_stream().map_err(|e| call_error("creating the capture stream", e))?;
                    made.insert(stream).clone()
                }
            }
        };
        self.blas_stream(stream.cu_stream())?;
        // SAFETY: a stream of this context, not capturing; only this thread's calls are checked
        // against the capture (thread-local mode), and they all go to this stream until it ends.
        let begun = unsafe {
            sys::cuStreamBeginCapture_v2(
                stream.cu_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .result();
        if let Err(e) = begun {
            let _ = self.blas_stream(self.stream.cu_stream());
            return Err(call_error("cuStreamBeginCapture", e));
        }
        self.capturing.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn captured_node(&self) -> Result<u64, CudaError> {
        let stream = self.capturing_stream("cuStreamGetCaptureInfo")?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut id, mut graph, mut count) = (0u64, std::ptr::null_mut(), 0usize);
        let (mut nodes, mut edges): (*const sys::CUgraphNode, *const sys::CUgraphEdgeData) =
            (std::ptr::null(), std::ptr::null());
        // SAFETY: a capturing stream of this context; the outputs are plain values and the driver's
        // own arrays, read before the next call on the stream.
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(stream, &mut status, &mut id, &mut graph, &mut nodes, &mut edges, &mut count)
        }
        .result()
        .map_err(|e| call_error("cuStreamGetCaptureInfo", e))?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || count != 1 || nodes.is_null() {
            return Err(call_error("cuStreamGetCaptureInfo", format!("{status:?} with {count} nodes at the end")));
        }
        // SAFETY: `nodes` holds `count` (1) nodes.
        Ok(unsafe { *nodes } as u64)
    }

    fn capture_end(&self) -> Result<u64, CudaError> {
        let stream = self.capturing_stream("cuStreamEndCapture")?;
        self.capturing.store(false, std::sync::atomic::Ordering::Relaxed);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (begun by `capture_begin`); ending it returns the graph
        // (null when the capture was invalidated).
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) }.result();
        let restored = self.blas_stream(self.stream.cu_stream());
        if let Err(e) = ended {
            if !graph.is_null() {
                // SAFETY: a graph the capture made, used by nothing.
                let _ = unsafe { sys::cuGraphDestroy(graph) };
            }
            return Err(call_error("cuStreamEndCapture", e));
        }
        restored?;
        if graph.is_null() {
            return Err(call_error("cuStreamEndCapture", "the capture was invalidated"));
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph of this context; flags 0 (launched on a stream, from the host).
        if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
            // SAFETY: as above.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            return Err(call_error("cuGraphInstantiate", e));
        }
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).insert(exec as u64, graph as u64);
        Ok(exec as u64)
    }

    fn graph_launch(&self, graph: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: an executable graph of `capture_end`, not destroyed; launched on the default
        // stream, after the work queued before it.
        unsafe { sys::cuGraphLaunch(graph as sys::CUgraphExec, self.stream.cu_stream()) }
            .result()
            .map_err(|e| call_error("cuGraphLaunch", e))
    }

    fn graph_set_kernel(
        &self,
        graph: u64,
        node: u64,
        name: &str,
        shape: Launch,
        args: &mut [Arg],
    ) -> Result<(), CudaError> {
        let f = self.function(name)?;
        self.bind()?;
        let mut params: Vec<*mut std::ffi::c_void> = args.iter_mut().map(Arg::address).collect();
        // SAFETY: a plain C struct for which all zeros is valid; its fields are set next.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        p.func = f.cu_function();
        (p.gridDimX, p.gridDimY, p.gridDimZ) = (shape.grid, 1, 1);
        (p.blockDimX, p.blockDimY, p.blockDimZ) = (shape.block, 1, 1);
        p.kernelParams = params.as_mut_ptr();
        // SAFETY: `node` is the graph's launch of `name` (the caller's contract), `params` its
        // arguments in order, each pointing at a live value (the driver copies them here).
        unsafe { sys::cuGraphExecKernelNodeSetParams_v2(graph as sys::CUgraphExec, node as sys::CUgraphNode, &p) }
            .result()
            .map_err(|e| call_error(&format!("changing a graph's launch of {name}"), e))
    }

    fn graph_destroy(&self, graph: u64) {
        let made = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).remove(&graph);
        if self.bind().is_err() {
            return;
        }
        // SAFETY: an executable graph of `capture_end` and the graph it came from, destroyed once
        // (removed above); a launch in flight completes first (the driver's rule).
        unsafe {
            let _ = sys::cuGraphExecDestroy(graph as sys::CUgraphExec);
            if let Some(made) = made {
                let _ = sys::cuGraphDestroy(made as sys::CUgraph);
            }
        }
    }

    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        let name = || {
            let batch = if g.batch > 1 { format!(" x{}", g.batch) } else { String::new() };
            let bias = if g.bias != 0 { " +bias (cublasLt)" } else { "" };
            format!("cublas {:?} gemm m{} n{} k{}{batch}{bias}", g.dtype, g.m, g.n, g.k)
        };
        if g.bias != 0 {
            return self.timed(name, || self.gemm_with_bias(g));
        }
        if matches!(g.dtype, GemmType::Bf16 | GemmType::F16) && lt_products() {
            if let Some(lt) = self.lt.get_or_init(|| self.checked_lt()) {
                return self.timed(name, || self.gemm_lt(lt, g));
            }
        }
        self.timed(name, || self.gemm_now(g))
    }
}

impl Gpu {
    /// The capture's stream, while one is under way.
    fn capturing_stream(&self, what: &str) -> Result<sys::CUstream, CudaError> {
        let stream = self.capture_stream.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| s.cu_stream());
        match stream {
            Some(stream) if self.capturing.load(std::sync::atomic::Ordering::Relaxed) => Ok(stream),
            _ => Err(call_error(what, "no capture is under way")),
        }
    }

    /// `g` through cuBLASLt (with its bias, or under `MEMFIT_CUDA_LT_PRODUCTS=1`: each shape's
    /// algorithm found once), queued on the library workspace past the bias check's bytes.
    fn gemm_lt(&self, lt: &Lt, g: &Gemm) -> Result<(), CudaError> {
        self.bind()?;
        let (address, bytes) = *self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        // Serialised with cuBLAS's calls: both use the workspace, on the one stream.
        let _blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the operands (and bias) are device memory of this context as `g` describes (the
        // caller's contract); the workspace is the library's, held while the device is open.
        unsafe {
            lt.matmul(
                g,
                address + LT_CHECK_BYTES as u64,
                bytes.saturating_sub(LT_CHECK_BYTES),
                self.queue() as *mut std::ffi::c_void,
            )
        }
    }

    /// `g` with its bias: cuBLASLt's product, queued on the workspace's bytes past the check's; should
    /// cuBLASLt refuse this shape (said once), the bias broadcast into C and cuBLAS's product added
    /// onto it, as the backend does without the epilogue.
    fn gemm_with_bias(&self, g: &Gemm) -> Result<(), CudaError> {
        let Some(Some(lt)) = self.lt.get() else {
            return Err(call_error("cuBLASLt", "a product with a bias on a GPU whose fuses_bias is false"));
        };
        // A bias not 16-byte aligned (a block of a product cut in blocks may start anywhere) is
        // broadcast: cuBLASLt's heuristic is told how A, B and C are aligned, not the bias.
        if g.bias.is_multiple_of(16) {
            let Err(refused) = self.gemm_lt(lt, g) else { return Ok(()) };
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!("memfit: warning: cuBLASLt refused a product with a bias ({refused}); such products broadcast the bias first");
            });
        }
        // C (m x n column-major, columns ldc apart: a block of a larger C where a rounded product
        // is cut in blocks) = the bias in every column (data.cu's repeat_row: C's n columns are its
        // rows).
        if g.batch != 1 {
            return Err(call_error("cuBLAS", "a product with a bias takes a batch of one"));
        }
        let blocks = g.n.clamp(1, self.max_blocks as usize) as u32;
        self.launch(
            "repeat_row_b4",
            Launch { grid: blocks, block: 256 },
            &mut [
                Arg::Ptr(g.c),
                Arg::Ptr(g.bias),
                Arg::I64(1),
                Arg::I64(g.n as i64),
                Arg::I64(g.m as i64),
                Arg::I64(g.ldc as i64),
            ],
        )?;
        self.gemm_now(&Gemm { bias: 0, beta: 1.0, ..*g })
    }

    /// cuBLASLt opened and checked (`lt::check_values`, both ways A is stored: the product with its
    /// bias, read back, equal to the host's); None, said on stderr when the check ran and failed,
    /// where it is missing, the workspace is not set, or the check fails.
    fn checked_lt(&self) -> Option<Lt> {
        let lt = Lt::open().ok()?;
        self.lt_check(&lt, GemmType::F32).then_some(lt)
    }

    /// cuBLASLt's product with a bias on `dtype` operands (`lt::check_values` as `dtype` stores them),
    /// both ways A is stored, read back and compared with the host's; false (said on stderr) where
    /// the workspace is not set or it differs.
    fn lt_check(&self, lt: &Lt, dtype: GemmType) -> bool {
        let (address, bytes) = *self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        if address == 0 || bytes < 2 * LT_CHECK_BYTES {
            return false;
        }
        let run = |transa: bool| -> Result<Option<String>, CudaError> {
            let [a, b, bias, want] = crate::lt::check_values(transa);
            let (pa, pb, pbias, pc) = (address, address + 1024, address + 1536, address + 2048);
            self.upload(pa, &crate::lt::check_operand_bytes(dtype, &a))?;
            self.upload(pb, &crate::lt::check_operand_bytes(dtype, &b))?;
            self.upload(pbias, &crate::lt::check_operand_bytes(GemmType::F32, &bias))?;
            let g = crate::lt::check_gemm(dtype, transa, pa, pb, pbias, pc);
            self.bind()?;
            // SAFETY: the check's operands lie in the workspace's first LT_CHECK_BYTES, the
            // product's workspace after them.
            unsafe {
                lt.matmul(
                    &g,
                    address + LT_CHECK_BYTES as u64,
                    bytes - LT_CHECK_BYTES,
                    self.stream.cu_stream() as *mut _,
                )
            }?;
            let mut got = vec![0u8; 4 * want.len()];
            self.download(pc, &mut got)?;
            let got: Vec<f32> =
                got.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
            Ok(got
                .iter()
                .zip(&want)
                .position(|(g, w)| g != w)
                .map(|i| format!("element {i} of a product with transa {transa} is {}, not {}", got[i], want[i])))
        };
        for transa in [true, false] {
            let why = match run(transa) {
                Ok(None) => continue,
                Ok(Some(wrong)) => wrong,
                Err(e) => e.to_string(),
            };
            eprintln!(
                "memfit: warning: cuda:{}: cuBLASLt's bias epilogue on {dtype:?} operands failed its check ({why}); those biases are added as before",
                self.ordinal
            );
            return false;
        }
        true
    }

    /// cuBLAS's strided batched product of `g`, queued.
    fn gemm_now(&self, g: &Gemm) -> Result<(), CudaError> {
        self.bind()?;
        let blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let int = |v: usize| i32::try_from(v).map_err(|_| call_error("cuBLAS", format!("dimension {v} too large")));
        let (m, n, k, lda, ldb, ldc, batch) =
            (int(g.m)?, int(g.n)?, int(g.k)?, int(g.lda)?, int(g.ldb)?, int(g.ldc)?, int(g.batch)?);
        let (sa, sb, sc) = (g.stride_a as i64, g.stride_b as i64, g.stride_c as i64);
        // SAFETY: the operands are device memory holding the matrices the strides and leading
        // dimensions describe (the launcher's contract); alpha and beta are host values.
        let status = unsafe {
            match g.dtype {
                // An experiment for the next GPU session (issue 32): GPT-2's QKV product (m 2304,
                // n 4096, k 768, beta 1) ran at 9.5 TFLOP/s through the strided-batched entry with a
                // batch of 1, the MLP's at 45; PyTorch calls cublasSgemm. `tools/gpu-check-run`
                // times both; the default stays the measured one until then.
                GemmType::F32 if batch == 1 && plain_sgemm() => {
                    let (alpha, beta) = (g.alpha as f32, g.beta as f32);
                    cudarc::cublas::result::sgemm(
                        *blas.handle(),
                        op(g.transa),
                        op(g.transb),
                        m,
                        n,
                        k,
                        &alpha,
                        g.a as *const f32,
                        lda,
                        g.b as *const f32,
                        ldb,
                        &beta,
                        g.c as *mut f32,
                        ldc,
                    )
                }
                GemmType::F32 => {
                    let (alpha, beta) = (g.alpha as f32, g.beta as f32);
                    cudarc::cublas::result::sgemm_strided_batched(
                        *blas.handle(),
                        op(g.transa),
                        op(g.transb),
                        m,
                        n,
                        k,
                        &alpha,
                        g.a as *const f32,
                        lda,
                        sa,
                        g.b as *const f32,
                        ldb,
                        sb,
                        &beta,
                        g.c as *mut f32,
                        ldc,
                        sc,
                        batch,
                    )
                }
                // Operands rounded already (crate::rounded): 16-bit A and B, f32 C, f32 accumulation,
                // which cuBLAS runs on the tensor cores.
                GemmType::Bf16 | GemmType::F16 => {
                    let (alpha, beta) = (g.alpha as f32, g.beta as f32);
                    let f32_type = blas_sys::cudaDataType::CUDA_R_32F;
                    let operand_type = if g.dtype == GemmType::Bf16 {
                        blas_sys::cudaDataType::CUDA_R_16BF
                    } else {
                        blas_sys::cudaDataType::CUDA_R_16F
                    };
                    cudarc::cublas::result::gemm_strided_batched_ex(
                        *blas.handle(),
                        op(g.transa),
                        op(g.transb),
                        m,
                        n,
                        k,
                        (&alpha as *const f32).cast(),
                        g.a as *const std::ffi::c_void,
                        operand_type,
                        lda,
                        sa,
                        g.b as *const std::ffi::c_void,
                        operand_type,
                        ldb,
                        sb,
                        (&beta as *const f32).cast(),
                        g.c as *mut std::ffi::c_void,
                        f32_type,
                        ldc,
                        sc,
                        batch,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                GemmType::F32Bf16 | GemmType::F32F16 => {
                    return Err(call_error("cuBLAS", "an f32 product with rounded operands goes through the backend's rounding workspace (memfit_cuda::rounded)"));
                }
                GemmType::F64 => {
                    let (alpha, beta) = (g.alpha, g.beta);
                    cudarc::cublas::result::dgemm_strided_batched(
                        *blas.handle(),
                        op(g.transa),
                        op(g.transb),
                        m,
                        n,
                        k,
                        &alpha,
                        g.a as *const f64,
                        lda,
                        sa,
                        g.b as *const f64,
                        ldb,
                        sb,
                        &beta,
                        g.c as *mut f64,
                        ldc,
                        sc,
                        batch,
                    )
                }
            }
        };
        status.map_err(|e| call_error("cublasGemmStridedBatched", e))
    }
}

/// `MEMFIT_CUBLAS_SGEMM=1`: single f32 products through cublasSgemm instead of the strided-batched
/// entry (read once).
fn plain_sgemm() -> bool {
    static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PLAIN.get_or_init(|| std::env::var_os("MEMFIT_CUBLAS_SGEMM").is_some_and(|v| v == "1"))
}

/// `MEMFIT_CUDA_LT_PRODUCTS=1`: products of rounded 16-bit operands through cuBLASLt, each shape's
/// algorithm found once, instead of cuBLAS's strided-batched entry (an experiment: `crate::lt`).
fn lt_products() -> bool {
    static LT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LT.get_or_init(|| std::env::var_os("MEMFIT_CUDA_LT_PRODUCTS").is_some_and(|v| v == "1"))
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.write_kernel_times();
    }
}
