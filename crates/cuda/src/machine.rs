//! What the cuda backend asks of a GPU, as one trait ([`Machine`]): device memory, copies, kernel
//! launches by name and cuBLAS's strided batched products. Two implementations: the real GPU
//! ([`crate::GpuMachine`], cudarc) and the emulator ([`crate::Emulator`], the same kernel sources
//! compiled for the host), so every launcher the backend has runs in CI, where there is no GPU.
//!
//! Addresses are the device's (`u64`, as `CUdeviceptr`); on the emulator they are host addresses.
//! All work goes to one stream in order; a copy to the host waits for the work before it. Batches
//! reach the device without the host waiting: written into pinned host memory and copied in stream
//! order ([`Machine::upload_async`], see [`crate::Staging`]), with events telling the host when a
//! pinned buffer may be written again.

use crate::CudaError;
use std::ffi::c_void;

/// The most dims a [`Strided`] view has (the kernels' `Strided` struct in `common.cuh`).
pub const MAX_RANK: usize = 8;

/// A strided view, exactly as the kernels' `struct Strided` lays it out: element `k` of the
/// row-major walk over `shape` is at `offset + sum_d index_d(k) * stride[d]` (in elements).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub rank: i32,
    pub shape: [i64; MAX_RANK],
    pub stride: [i64; MAX_RANK],
    pub offset: i64,
}

impl Strided {
    /// A view of `shape` with `strides` and `offset` (elements). None beyond [`MAX_RANK`] dims.
    pub fn new(shape: &[usize], strides: &[usize], offset: usize) -> Option<Strided> {
        if shape.len() > MAX_RANK || strides.len() != shape.len() {
            return None;
        }
        let mut s =
            Strided { rank: shape.len() as i32, shape: [1; MAX_RANK], stride: [0; MAX_RANK], offset: offset as i64 };
        for (d, (&n, &st)) in shape.iter().zip(strides).enumerate() {
            s.shape[d] = n as i64;
            s.stride[d] = st as i64;
        }
        Some(s)
    }
}

/// One kernel argument, by value.
#[derive(Clone, Debug)]
pub enum Arg {
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    /// A device address (0 for a null pointer: an optional output not asked for).
    Ptr(u64),
    View(Strided),
    /// A C struct by value, as 8-byte words in its field order (a 4-byte field in the low half of
    /// its word, as x86-64's layout pads it).
    Words(Vec<u64>),
}

impl Arg {
    /// The address of the value, as `cuLaunchKernel`'s parameter array takes it.
    pub(crate) fn address(&mut self) -> *mut c_void {
        match self {
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::U64(v) | Arg::Ptr(v) => v as *mut u64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
            Arg::F64(v) => v as *mut f64 as *mut c_void,
            Arg::View(v) => v as *mut Strided as *mut c_void,
            Arg::Words(w) => w.as_mut_ptr() as *mut c_void,
        }
    }
}

/// A launch's shape: `grid` blocks of `block` threads (one dimension each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: u32,
    pub block: u32,
}

/// A float type cuBLAS multiplies, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmType {
    F32,
    /// f32 in memory, multiplied as a bf16 product (Note [bf16 products] in `memfit-kernels`):
    /// each operand element rounded to bfloat16, to nearest even, the products accumulated in f32.
    /// The backend computes it as [`crate::rounded`] says (its operands rounded into a workspace,
    /// then a [`GemmType::Bf16`] product); machines take only the latter.
    F32Bf16,
    /// f32 in memory, multiplied as an fp16 product (Note [fp16 products] in `memfit-kernels`): each
    /// operand element rounded to binary16, the products accumulated in f32. As `F32Bf16`, through
    /// [`GemmType::F16`].
    F32F16,
    /// A and B bfloat16 in memory (rounded already), C f32, the products accumulated in f32:
    /// cuBLAS's GemmEx with 16-bit operands and `CUBLAS_COMPUTE_32F`, on the tensor cores.
    Bf16,
    /// A and B binary16 in memory, C f32, as `Bf16`.
    F16,
    F64,
}

impl GemmType {
    /// Bytes of one element of C in memory.
    pub fn size(self) -> usize {
        match self {
            GemmType::F32 | GemmType::F32Bf16 | GemmType::F32F16 | GemmType::Bf16 | GemmType::F16 => 4,
            GemmType::F64 => 8,
        }
    }
}

/// `C = alpha op(A) op(B) + beta C` for `batch` matrices, column-major as cuBLAS's
/// `cublas<T>gemmStridedBatched`: `op(A)` is `m x k` (A stored `m x k`, or `k x m` when
/// `transa`), `op(B)` is `k x n`, `C` is `m x n` with leading dimension `ldc`; matrix `i` of each
/// starts `i * stride_*` elements after the first. With `beta == 0`, C is written, never read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub dtype: GemmType,
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f64,
    pub a: u64,
    pub lda: usize,
    pub stride_a: usize,
    pub b: u64,
    pub ldb: usize,
    pub stride_b: usize,
    pub beta: f64,
    pub c: u64,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
    /// 0, or the device address of `m` f32 values added to every column of C as the product writes
    /// it (`bias[i]` to row i; a linear layer's bias): only with beta 0 and a batch of 1, on a
    /// machine whose [`Machine::fuses_bias`] is true for the product's type (for a 16-bit product,
    /// the `F32Bf16` or `F32F16` type its operands were rounded from).
    pub bias: u64,
}

/// A GPU as the backend uses it (see the module's docs).
pub trait Machine: Send + Sync {
    /// `name (sm_XY)` or the emulator's name, for messages and reports.
    fn description(&self) -> String;
    /// Whether a product of this type takes a [`Gemm::bias`]: f32 products, and bf16 or fp16 products
    /// of f32 operands (`F32Bf16`, `F32F16`), whose operands memfit rounds first ([`crate::rounded`]:
    /// cuBLASLt's `COMPUTE_32F_FAST_16BF` on f32 operands is leave to convert, which an H100 did not
    /// take, every element of a bf16 linear off the definition by up to 0.2% of the largest) and
    /// whose 16-bit products then take the bias. On a GPU cuBLASLt's epilogue, checked there once
    /// against the host for each type; the emulator's definition. The library workspace must be set
    /// first.
    fn fuses_bias(&self, _dtype: GemmType) -> bool {
        false
    }
    /// The most blocks a launch needs to fill this machine (grid-stride kernels loop beyond).
    fn max_blocks(&self) -> u32;
    /// The most blocks a launch of tiles whose work differs (attention's, under a causal mask) may
    /// have: on a GPU one per tile, so that the block scheduler hands the next tile to whichever
    /// multiprocessor is free (a grid of `max_blocks` that loops would give each block a fixed share).
    fn max_grid(&self) -> u32 {
        self.max_blocks()
    }
    /// Device memory free now.
    fn free_bytes(&self) -> Result<u64, CudaError>;
    /// `bytes` of zero-filled device memory; `Err` when the device has none left.
    fn alloc(&self, bytes: usize) -> Result<u64, CudaError>;
    /// Gives back memory from [`Machine::alloc`] (after the work using it).
    fn free(&self, address: u64);
    /// Copies host bytes to the device (in stream order).
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), CudaError>;
    /// Page-locked host memory of `bytes` (the host address) that the device copies from without
    /// the host waiting (`cuMemHostAlloc`); `Err` when the system has none left.
    fn pinned_alloc(&self, bytes: usize) -> Result<u64, CudaError>;
    /// Gives back memory of [`Machine::pinned_alloc`] (no copy from it may be pending).
    fn pinned_free(&self, host: u64);
    /// Copies `bytes` of pinned host memory at `host` to `dst` in stream order and returns at once:
    /// the host memory must stay as it is until an event recorded after this call is done.
    fn upload_async(&self, dst: u64, host: u64, bytes: usize) -> Result<(), CudaError>;
    /// A new event (a mark in the stream, done once the work before it is).
    fn event_create(&self) -> Result<u64, CudaError>;
    /// Marks the stream's current end with `event`.
    fn event_record(&self, event: u64) -> Result<(), CudaError>;
    /// Whether the work before `event`'s mark is done (never waits).
    fn event_done(&self, event: u64) -> Result<bool, CudaError>;
    /// Waits on the host until the work before `event`'s mark is done.
    fn event_wait(&self, event: u64) -> Result<(), CudaError>;
    fn event_destroy(&self, event: u64);
    /// Copies device bytes to the host once all work before it is done.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), CudaError>;
    /// Copies `bytes` between device addresses (in stream order).
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError>;
    /// Sets `bytes` at `dst` to zero (in stream order).
    fn zero(&self, dst: u64, bytes: usize) -> Result<(), CudaError>;
    /// Launches the kernel `name` (of [`crate::kernels::SOURCES`]) with `args`.
    fn launch(&self, name: &str, shape: Launch, args: &mut [Arg]) -> Result<(), CudaError>;
    /// Gives the math library its workspace: `bytes` at `address`, memory of memfit's allocator
    /// that the caller keeps until the machine is dropped.
    fn set_library_workspace(&self, address: u64, bytes: usize) -> Result<(), CudaError>;
    /// A strided batched product (cuBLAS's, in the workspace given).
    fn gemm(&self, g: &Gemm) -> Result<(), CudaError>;

    // Expandable segments (`memfit_memory`'s allocator): address space reserved once, device memory
    // mapped into it and out again [`PAGE`] by [`PAGE`] (on a GPU, CUDA's virtual memory calls).
    /// Reserves `bytes` of device address space; nothing is mapped in it.
    fn reserve(&self, _bytes: usize) -> Result<u64, CudaError> {
        Err(CudaError::Call { what: "reserving address space".into(), detail: "not supported here".into() })
    }
    /// Maps `bytes` (whole pages) of zero-filled device memory at `address`, inside a reservation.
    fn map(&self, _address: u64, _bytes: usize) -> Result<(), CudaError> {
        Err(CudaError::Call { what: "mapping memory".into(), detail: "not supported here".into() })
    }
    /// Unmaps the pages at `address` (after the work using them) and gives their memory back.
    fn unmap(&self, _address: u64, _bytes: usize) {}
    /// Returns a reservation (nothing mapped in it any more).
    fn release(&self, _address: u64, _bytes: usize) {}

    // CUDA graphs (Note [CUDA graphs] in `graphs.rs`): the stream's work recorded, then run whole.
    /// Starts a capture: until [`Machine::capture_end`], the launches, products, copies and zeroings
    /// asked for are recorded into a graph, not run.
    fn capture_begin(&self) -> Result<(), CudaError> {
        Err(CudaError::Call { what: "capturing a graph".into(), detail: "not supported here".into() })
    }
    /// The graph node of the kernel launched last in the capture.
    fn captured_node(&self) -> Result<u64, CudaError> {
        Err(CudaError::Call { what: "capturing a graph".into(), detail: "not supported here".into() })
    }
    /// Ends the capture (always, also when it failed): the graph, ready to launch.
    fn capture_end(&self) -> Result<u64, CudaError> {
        Err(CudaError::Call { what: "capturing a graph".into(), detail: "not supported here".into() })
    }
    /// Queues a graph of [`Machine::capture_end`] in stream order.
    fn graph_launch(&self, _graph: u64) -> Result<(), CudaError> {
        Err(CudaError::Call { what: "launching a graph".into(), detail: "not supported here".into() })
    }
    /// Gives kernel node `node` of `graph` (a launch of `name` with `shape`, as captured) the
    /// arguments `args` for the graph's later launches.
    fn graph_set_kernel(
        &self,
        _graph: u64,
        _node: u64,
        _name: &str,
        _shape: Launch,
        _args: &mut [Arg],
    ) -> Result<(), CudaError> {
        Err(CudaError::Call { what: "changing a graph".into(), detail: "not supported here".into() })
    }
    /// Destroys a graph (a launch of it in flight completes first).
    fn graph_destroy(&self, _graph: u64) {}
    /// The work counted so far, by a machine that counts it ([`crate::graphs::Graphed`]).
    fn launches(&self) -> Option<crate::graphs::Launches> {
        None
    }
}

/// The unit expandable segments map (a GPU's usual mapping granularity, and the allocator's page).
pub const PAGE: usize = memfit_memory::PAGE_BYTES as usize;
