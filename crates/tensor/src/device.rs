//! A device owns one allocator and the execution context of the programs that run on it: the
//! current [`Phase`], the current module (layer) and whether autograd records. `cpu` computes; `meta`
//! allocates exactly what `cpu` would, through the same allocator code, but holds no data and runs no
//! kernel.
//!
//! Provenance: every allocation is tagged with the phase, op, category and module that made it (the
//! module by an id into the device's module table, see [`Device::module_names`]). When profiling is
//! on ([`Device::set_profiling`]), op and module scopes are also recorded as timed [`Span`]s on the
//! allocator timeline's clock; when it is off, a scope costs one atomic load.

use crate::error::{Error, Result};
use crate::storage::Storage;
use memfit_memory::{
    Allocation, Allocator, AllocatorConfig, Category, Event, FaultInjection, MemoryState, MemoryStats, Phase, Request,
};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The kind of machine whose memory a device follows: a `meta` device imitating a target allocates
/// exactly what a device of that target allocates (its workspaces sized as that target's kernels
/// need them), so a plan for a GPU is made on a machine without one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Cpu,
    Cuda,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

/// Which device: `cpu` and `cuda` (GPU `N`) compute; `meta` allocates as its [`Target`] would and
/// computes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Cuda(u32),
    Meta(Target),
}

impl DeviceKind {
    /// `meta` imitating `cpu` (what `--device meta` means).
    pub const META: DeviceKind = DeviceKind::Meta(Target::Cpu);
    /// The first GPU.
    pub const CUDA: DeviceKind = DeviceKind::Cuda(0);

    /// The device's name as `--device` takes it: `cpu`, `cuda`, `cuda:1`, `meta`, `meta:cuda`.
    pub fn name(self) -> String {
        self.to_string()
    }

    /// Parses `cpu`, `cuda`, `cuda:N`, `meta` (imitating cpu), `meta:cpu` or `meta:cuda`.
    pub fn parse(text: &str) -> Result<Self> {
        let expected = "expected cpu, cuda, cuda:N (a GPU's number), meta or meta:cuda";
        match text {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::CUDA),
            "meta" | "meta:cpu" => Ok(DeviceKind::META),
            "meta:cuda" => Ok(DeviceKind::Meta(Target::Cuda)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => match n.parse::<u32>() {
                    Ok(ordinal) if ordinal < MAX_CUDA_ORDINAL && !n.starts_with('+') => Ok(DeviceKind::Cuda(ordinal)),
                    _ => Err(Error::invalid(format!(
                        "unknown device {other:?}: a GPU's number is 0 to {} (cuda:0 is the first)",
                        MAX_CUDA_ORDINAL - 1
                    ))),
                },
                None => Err(Error::invalid(format!("unknown device {other:?}: {expected}"))),
            },
        }
    }

    /// The machine this device's allocations follow.
    pub fn target(self) -> Target {
        match self {
            DeviceKind::Cpu => Target::Cpu,
            DeviceKind::Cuda(_) => Target::Cuda,
            DeviceKind::Meta(target) => target,
        }
    }

    /// True when kernels run (and data exists) on this kind of device.
    pub fn computes(self) -> bool {
        !self.is_meta()
    }

    pub fn is_meta(self) -> bool {
        matches!(self, DeviceKind::Meta(_))
    }

    /// True when the host reads and writes the device's memory in place (`cpu`); a GPU's is copied.
    pub fn host_readable(self) -> bool {
        self == DeviceKind::Cpu
    }
}

/// GPUs a process addresses: `cuda:0` to `cuda:1023`.
const MAX_CUDA_ORDINAL: u32 = 1024;

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda(0) => f.write_str("cuda"),
            DeviceKind::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceKind::Meta(Target::Cpu) => f.write_str("meta"),
            DeviceKind::Meta(target) => write!(f, "meta:{}", target.name()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct DeviceConfig {
    pub kind: DeviceKind,
    /// The device's memory; None = unlimited.
    pub capacity: Option<u64>,
    pub fault: Option<FaultInjection>,
    pub timeline_events: usize,
    /// Expandable segments: one growing segment per pool (see `memfit_memory`'s allocator).
    pub expandable: bool,
}

impl DeviceConfig {
    pub fn new(kind: DeviceKind) -> Self {
        DeviceConfig {
            kind,
            capacity: None,
            fault: None,
            timeline_events: AllocatorConfig::default().timeline_events,
            expandable: false,
        }
    }

    pub fn expandable(mut self, expandable: bool) -> Self {
        self.expandable = expandable;
        self
    }

    pub fn capacity(mut self, bytes: Option<u64>) -> Self {
        self.capacity = bytes;
        self
    }

    pub fn fault(mut self, fault: Option<FaultInjection>) -> Self {
        self.fault = fault;
        self
    }
}

struct DeviceInner {
    kind: DeviceKind,
    backend: Box<dyn crate::backend::Backend>,
    /// What the device is, where there is more to say than its kind (a GPU's name).
    description: Option<String>,
    context_bytes: Option<u64>,
    /// A GPU's free memory once its context existed.
    free_at_open: Option<u64>,
    /// The math library's workspace on a GPU target (cuBLAS's, [`memfit_cuda::LIBRARY_WORKSPACE_BYTES`]):
    /// allocated when the device opens, freed when it closes, so it is counted like any block.
    library_workspace: Option<Allocation>,
    /// The workspace a GPU target's rounded products round their operands into (see
    /// [`Device::set_products`]): held while its products are bf16 or fp16.
    rounding_workspace: Mutex<Option<Allocation>>,
    allocator: Mutex<Allocator>,
    phase: Mutex<Phase>,
    grad_enabled: AtomicBool,
    /// Depth of checkpointed segments being re-run (see [`Device::recompute`]).
    recomputing: AtomicU64,
    /// Depth of micro-batches being replayed (see [`Device::replay`]).
    replaying: AtomicU64,
    /// Depth of rehearsals (see [`Device::rehearse`]).
    rehearsing: AtomicU64,
    /// The seed of the random draws of the pass in progress (see [`Device::set_random_seed`]).
    random_seed: AtomicU64,
    /// The dtype activations are saved in for backward (see [`Device::set_saved_dtype`]).
    /// 0: none, 1: bf16, 2: f16 (read by every save, so an atomic rather than a lock).
    saved_dtype: std::sync::atomic::AtomicU8,
    /// How matrix products compute, 0: f32, 1: bf16, 2: fp16 (see [`Device::set_products`]).
    products: std::sync::atomic::AtomicU8,
    next_id: AtomicU64,
    modules: Mutex<Modules>,
    profiling: AtomicBool,
    spans: Mutex<Vec<Span>>,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let rounding = self.rounding_workspace.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        let allocator = self.allocator.get_mut().unwrap_or_else(|e| e.into_inner());
        for block in [self.library_workspace.take(), rounding].into_iter().flatten() {
            // The blocks are this allocator's and freed only here; a failure cannot happen.
            let _ = allocator.free(block.id);
        }
    }
}

/// Interned module names and the one in force.
struct Modules {
    /// `names[0]` is "" (no module).
    names: Vec<String>,
    ids: HashMap<String, u32>,
    current: u32,
}

/// What a recorded span covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Op,
    Module,
}

/// A timed op or module scope (recorded while profiling), on the allocator timeline's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub name: &'static str,
    pub kind: SpanKind,
    pub phase: Phase,
    pub module: u32,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// A handle to a device; clones share it. Tensors of different devices never mix.
#[derive(Clone)]
pub struct Device(Arc<DeviceInner>);

impl Device {
    /// Opens the device: for `cuda`, its driver, context and libraries (an error names what is
    /// missing; nothing panics). The capacity is the config's, or for a GPU without one its free
    /// memory once the context exists.
    pub fn new(config: DeviceConfig) -> Result<Self> {
        if config.kind.target() == Target::Cuda {
            // A bad choice of attention kernels, said before anything opens, on `meta:cuda` too.
            crate::backend::cuda::attention_asked()?;
        }
        let opened = crate::backend::open(config.kind)?;
        let capacity = config.capacity.or(opened.free_bytes);
        let mut allocator = Allocator::new(
            opened.segments,
            AllocatorConfig {
                capacity,
                timeline_events: config.timeline_events,
                fault: config.fault,
                expandable: config.expandable,
            },
        );
        let library_workspace = match config.kind.target() {
            Target::Cpu => None,
            Target::Cuda => {
                let request =
                    Request { category: Category::Other, op: "cublas_workspace", phase: Phase::Setup, module: 0 };
                let block = allocator.allocate(memfit_cuda::LIBRARY_WORKSPACE_BYTES, request)?;
                if let Some(ptr) = block.ptr {
                    opened.kernels.use_library_workspace(ptr.as_ptr() as usize as u64, block.requested)?;
                }
                Some(block)
            }
        };
        Ok(Device(Arc::new(DeviceInner {
            kind: config.kind,
            backend: opened.kernels,
            description: opened.description,
            context_bytes: opened.context_bytes,
            free_at_open: opened.free_bytes,
            library_workspace,
            rounding_workspace: Mutex::new(None),
            allocator: Mutex::new(allocator),
            phase: Mutex::new(Phase::Setup),
            grad_enabled: AtomicBool::new(true),
            recomputing: AtomicU64::new(0),
            replaying: AtomicU64::new(0),
            rehearsing: AtomicU64::new(0),
            random_seed: AtomicU64::new(0),
            saved_dtype: std::sync::atomic::AtomicU8::new(0),
            products: std::sync::atomic::AtomicU8::new(0),
            next_id: AtomicU64::new(1),
            modules: Mutex::new(Modules { names: vec![String::new()], ids: HashMap::new(), current: 0 }),
            profiling: AtomicBool::new(false),
            spans: Mutex::new(Vec::new()),
        })))
    }

    /// Checks quickly (no context, no allocation) that a device of this kind can open: for a GPU,
    /// that its libraries load. For the checks made before any long work; [`Device::new`] checks
    /// everything again.
    pub fn probe(kind: DeviceKind) -> Result<()> {
        match kind {
            DeviceKind::Cuda(ordinal) => crate::backend::cuda::probe(ordinal),
            DeviceKind::Cpu | DeviceKind::Meta(_) => Ok(()),
        }
    }

    /// A `cpu` device with unlimited capacity.
    pub fn cpu() -> Self {
        Device::new(DeviceConfig::new(DeviceKind::Cpu)).expect("the cpu device always opens")
    }

    /// A `meta` device (imitating `cpu`) with unlimited capacity.
    pub fn meta() -> Self {
        Device::new(DeviceConfig::new(DeviceKind::META)).expect("the meta device always opens")
    }

    pub fn kind(&self) -> DeviceKind {
        self.0.kind
    }

    /// The kernels this device runs (`crate::backend`: the one place an op's code is chosen).
    /// Which of its alternative kernels the device ran so far (a GPU's attention on the tensor
    /// cores or the CUDA cores, its biases in a product's epilogue or broadcast first), as reports
    /// name them; empty for cpu and meta.
    pub fn kernels_used(&self) -> Vec<String> {
        self.backend().kernels_used()
    }

    /// The work a GPU was asked for so far (kernel launches, products, copies) and how it was
    /// queued (one by one, or in CUDA graphs: Note [CUDA graphs] in memfit-cuda); None for cpu
    /// and meta.
    pub fn launches(&self) -> Option<memfit_cuda::Launches> {
        self.0.backend.launches()
    }

    pub(crate) fn backend(&self) -> &dyn crate::backend::Backend {
        if self.rehearsing() {
            return &crate::backend::Meta;
        }
        self.0.backend.as_ref()
    }

    /// The machine whose allocations this device follows (ops size their workspaces for it).
    pub fn target(&self) -> Target {
        self.0.kind.target()
    }

    /// True when kernels run (and data exists) on this device.
    pub fn computes(&self) -> bool {
        self.0.kind.computes() && !self.rehearsing()
    }

    /// True when the host reads and writes this device's memory in place; a GPU's tensors are copied
    /// to and from the host ([`crate::Tensor::to_vec`], [`crate::Tensor::write_with`]).
    pub fn host_readable(&self) -> bool {
        self.0.kind.host_readable()
    }

    /// Device memory the driver's context holds outside the allocator (a GPU's context, measured as
    /// the free memory before and after it was created); None on `cpu` and `meta`. Not counted
    /// against the capacity: the capacity is what was free after it.
    pub fn context_bytes(&self) -> Option<u64> {
        self.0.context_bytes
    }

    /// Pinned host bytes a GPU holds for uploads now, and the most it held at once (0 elsewhere):
    /// host memory, outside the capacity.
    pub fn pinned_bytes(&self) -> (u64, u64) {
        self.backend().pinned_bytes()
    }

    /// A GPU's free memory when it opened (after its context was made); None on `cpu` and `meta`.
    pub fn free_at_open(&self) -> Option<u64> {
        self.0.free_at_open
    }

    /// The device as reports name it: `cpu`, `meta:cuda`, or `cuda:0 (NVIDIA H100 80GB HBM3 (sm_90))`.
    pub fn describe(&self) -> String {
        match &self.0.description {
            Some(d) => format!("{} ({d})", self.0.kind),
            None => self.0.kind.to_string(),
        }
    }

    pub fn same(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.0.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Locks the allocator. Crate-private: every public method below takes the lock for one call and
    /// returns owned values, so no caller can hold it across operations (which would deadlock them).
    pub(crate) fn allocator(&self) -> MutexGuard<'_, Allocator> {
        // A poisoned lock means a panic elsewhere already; the allocator's own state is consistent
        // between calls, so keep using it.
        self.0.allocator.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> MemoryStats {
        self.allocator().stats().clone()
    }

    pub fn capacity(&self) -> Option<u64> {
        self.allocator().capacity()
    }

    /// Starts the peak statistics afresh from the current values.
    pub fn reset_peak_stats(&self) {
        self.allocator().reset_peak_stats()
    }

    /// Returns every fully free cached segment to the system.
    pub fn empty_cache(&self) {
        self.allocator().empty_cache()
    }

    /// Runs what follows as `meta` would until the guard drops (nests): every allocation is made
    /// on this device's allocator, as the real run would make it, but no kernel runs, nothing is
    /// copied and [`Device::computes`] is false. A rehearsal finds, before anything irreversible
    /// happens, whether a pass's requests are all served from memory the allocator already holds
    /// (Note [Step in backward] in the train crate). Nothing a rehearsal computes may be read.
    pub fn rehearse(&self) -> RehearsalGuard {
        self.0.rehearsing.fetch_add(1, Ordering::Relaxed);
        RehearsalGuard { device: self.clone() }
    }

    /// True during a rehearsal ([`Device::rehearse`]).
    pub fn rehearsing(&self) -> bool {
        self.0.rehearsing.load(Ordering::Relaxed) > 0
    }

    /// A digest of the allocator's segments and blocks: what decides where requests go and whether
    /// they need new memory (`Allocator::layout_digest`).
    pub fn layout_digest(&self) -> u64 {
        self.allocator().layout_digest()
    }

    /// Serves every request from memory already held until called with false (the caller proved
    /// it; `Allocator::set_held_only`): injected faults skip such requests.
    pub fn set_held_only(&self, on: bool) {
        self.allocator().set_held_only(on)
    }

    /// Until called with false, a request that needs new memory the budget does not allow fails
    /// without releasing the cache first (`Allocator::set_keep_cache`).
    pub fn set_keep_cache(&self, on: bool) {
        self.allocator().set_keep_cache(on)
    }

    /// Requests so far that no free block held (`Allocator::requests_for_new_memory`).
    pub fn requests_for_new_memory(&self) -> u64 {
        self.allocator().requests_for_new_memory()
    }

    /// Makes chosen future allocations fail (for testing out-of-memory recovery); None stops it.
    pub fn set_fault_injection(&self, fault: Option<FaultInjection>) {
        self.allocator().set_fault_injection(fault)
    }

    /// The allocator's timeline events, oldest first (a copy).
    pub fn timeline_events(&self) -> Vec<Event> {
        self.allocator().timeline().events().copied().collect()
    }

    /// Host memory the allocator's timeline can take at most (it is bounded, outside the capacity).
    pub fn timeline_max_bytes(&self) -> u64 {
        self.allocator().timeline().max_bytes()
    }

    /// Capacity, statistics, timeline and segments, copied (for profiles).
    pub fn memory_state(&self) -> MemoryState {
        self.allocator().state()
    }

    /// Allocates storage for `bytes` bytes, tagged with `category`, on behalf of `op`.
    pub fn allocate(&self, bytes: usize, category: Category, op: &'static str) -> Result<Storage> {
        let request = Request { category, op, phase: self.phase(), module: self.module() };
        let allocation = self.allocator().allocate(bytes as u64, request)?;
        Ok(Storage::new(self.clone(), allocation))
    }

    /// The phase allocations are tagged with: the one entered, or [`Phase::Rehearsal`] during a
    /// rehearsal ([`Device::rehearse`]), so that a profile tells a rehearsed pass from the real one.
    pub fn phase(&self) -> Phase {
        if self.rehearsing() {
            return Phase::Rehearsal;
        }
        *self.0.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the phase until the guard drops (then restores the previous one).
    pub fn enter_phase(&self, phase: Phase) -> PhaseGuard {
        let mut current = self.0.phase.lock().unwrap_or_else(|e| e.into_inner());
        let previous = std::mem::replace(&mut *current, phase);
        PhaseGuard { device: self.clone(), previous }
    }

    pub fn grad_enabled(&self) -> bool {
        self.0.grad_enabled.load(Ordering::Relaxed)
    }

    /// Disables graph recording until the guard drops: no graph is kept and nothing is saved.
    pub fn no_grad(&self) -> GradModeGuard {
        let previous = self.0.grad_enabled.swap(false, Ordering::Relaxed);
        GradModeGuard { device: self.clone(), previous }
    }

    /// True while a checkpointed segment is being re-run in backward ([`crate::autograd::checkpoint`]):
    /// state a forward updates as a side effect (batch norm's running statistics) must not be updated
    /// again.
    pub fn recomputing(&self) -> bool {
        self.0.recomputing.load(Ordering::Relaxed) > 0
    }

    /// True while the model's buffers (batch norm's running statistics) must not move: a checkpointed
    /// segment's re-run ([`Device::recomputing`]) or a replay of micro-batches whose forward already
    /// moved them ([`Device::replay`]).
    pub fn buffers_frozen(&self) -> bool {
        self.recomputing() || self.0.replaying.load(Ordering::Relaxed) > 0
    }

    /// Half-precision storage: f32 activations saved for backward are kept in `dtype` (bf16 or f16)
    /// and converted back when backward uses them ([`crate::autograd::save_compact`]); arithmetic
    /// stays f32. None (the default) keeps them as they are.
    pub fn set_saved_dtype(&self, dtype: Option<crate::DType>) -> Result<()> {
        let code = match dtype {
            None => 0,
            Some(crate::DType::BF16) => 1,
            Some(crate::DType::F16) => 2,
            Some(d) => return Err(Error::dtype(format!("saved activations can be stored in bf16 or f16, not {d}"))),
        };
        self.0.saved_dtype.store(code, Ordering::Relaxed);
        Ok(())
    }

    /// The dtype activations are saved in (None: their own).
    pub fn saved_dtype(&self) -> Option<crate::DType> {
        match self.0.saved_dtype.load(Ordering::Relaxed) {
            1 => Some(crate::DType::BF16),
            2 => Some(crate::DType::F16),
            _ => None,
        }
    }

    /// How matrix products compute (linear, matmul, convolution, attention's two products, the fused
    /// ops' products): in f32, or as bf16 products of f32 operands (Note [bf16 products] in
    /// `memfit-kernels`' `gemm_bf16`), `--precision bf16`'s arithmetic. Element-wise ops, reductions,
    /// parameters, gradients and optimizer state stay f32 either way. Every device computes both
    /// (the cpu's kernels; on a GPU target, cuBLAS's tensor cores on operands rounded into a
    /// workspace of [`memfit_cuda::ROUNDING_WORKSPACE_BYTES`], allocated here while the products are
    /// rounded, on `meta:cuda` too, and given back when they are f32 again); an error when that
    /// workspace does not fit.
    pub fn set_products(&self, products: crate::Products) -> Result<()> {
        let code = match products {
            crate::Products::F32 => 0,
            crate::Products::Bf16 => 1,
            crate::Products::F16 => 2,
        };
        if self.0.kind.target() == Target::Cuda {
            let mut held = self.0.rounding_workspace.lock().unwrap_or_else(|e| e.into_inner());
            let rounded = products != crate::Products::F32;
            if rounded && held.is_none() {
                let request = Request {
                    category: Category::Other,
                    op: "rounding_workspace",
                    phase: self.phase(),
                    module: self.module(),
                };
                let block = self.allocator().allocate(memfit_cuda::ROUNDING_WORKSPACE_BYTES, request)?;
                if let Some(ptr) = block.ptr {
                    let taken =
                        self.0.backend.use_rounding_workspace(Some((ptr.as_ptr() as usize as u64, block.requested)));
                    if let Err(e) = taken {
                        let _ = self.allocator().free(block.id);
                        return Err(e);
                    }
                }
                *held = Some(block);
            } else if !rounded {
                if let Some(block) = held.take() {
                    self.0.backend.use_rounding_workspace(None)?;
                    // The block is this allocator's and freed only here; a failure cannot happen.
                    let _ = self.allocator().free(block.id);
                }
            }
        }
        self.0.products.store(code, Ordering::Relaxed);
        Ok(())
    }

    /// How matrix products compute on this device.
    pub fn products(&self) -> crate::Products {
        match self.0.products.load(Ordering::Relaxed) {
            1 => crate::Products::Bf16,
            2 => crate::Products::F16,
            _ => crate::Products::F32,
        }
    }

    /// Marks a re-run of a checkpointed segment until the guard drops (nests).
    pub fn recompute(&self) -> RecomputeGuard {
        self.0.recomputing.fetch_add(1, Ordering::Relaxed);
        RecomputeGuard { device: self.clone() }
    }

    /// Sets the seed a pass's random draws (dropout masks of an imported model) derive from: a trainer
    /// sets it from the micro-batch's samples, so running the same samples again (a retry, a replay, a
    /// checkpointed segment's re-run) draws the same masks, and meta and cpu draw alike.
    pub fn set_random_seed(&self, seed: u64) {
        self.0.random_seed.store(seed, Ordering::Relaxed);
    }

    /// The seed set by [`Device::set_random_seed`] (0 until set).
    pub fn random_seed(&self) -> u64 {
        self.0.random_seed.load(Ordering::Relaxed)
    }

    /// Marks a replay until the guard drops (nests): micro-batches run again exactly as the first time
    /// (to rebuild gradients a failed pass left partly updated, Note [Recovery] in the train crate),
    /// except that their forward already moved the model's buffers, which stay as they are
    /// ([`Device::buffers_frozen`]).
    pub fn replay(&self) -> ReplayGuard {
        self.0.replaying.fetch_add(1, Ordering::Relaxed);
        ReplayGuard { device: self.clone() }
    }

    /// Enables graph recording until the guard drops, also inside a no-grad region (a backward pass
    /// runs under no-grad; activation checkpointing re-runs its forward inside it with this).
    pub fn enable_grad(&self) -> GradModeGuard {
        let previous = self.0.grad_enabled.swap(true, Ordering::Relaxed);
        GradModeGuard { device: self.clone(), previous }
    }
}

impl Device {
    fn modules(&self) -> MutexGuard<'_, Modules> {
        self.0.modules.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of the module in force (0 = none).
    pub fn module(&self) -> u32 {
        self.modules().current
    }

    /// Module names by id (`[0]` is "", no module), for reports and profiles.
    pub fn module_names(&self) -> Vec<String> {
        self.modules().names.clone()
    }

    /// Makes `name` (a full `state_dict` prefix such as `blocks.2.attn`) the module in force until
    /// the guard drops. Layers call it around their forward; autograd restores it around each
    /// node's backward, so backward allocations name their module too.
    pub fn enter_module(&self, name: &str) -> ModuleGuard {
        let id = {
            let mut m = self.modules();
            match m.ids.get(name) {
                Some(&id) => id,
                None => {
                    let id = m.names.len() as u32;
                    m.names.push(name.to_string());
                    m.ids.insert(name.to_string(), id);
                    id
                }
            }
        };
        self.set_module(id, Some(SpanKind::Module))
    }

    /// Makes module `id` (from [`Device::module`]) the one in force until the guard drops.
    pub fn restore_module(&self, id: u32) -> ModuleGuard {
        self.set_module(id, None)
    }

    fn set_module(&self, id: u32, span: Option<SpanKind>) -> ModuleGuard {
        let previous = std::mem::replace(&mut self.modules().current, id);
        let name = if span.is_some() { "module" } else { "" };
        let span = span.and_then(|kind| self.start_span(name, kind));
        ModuleGuard { device: self.clone(), previous, span }
    }

    /// Records what `op` does until the guard drops, when profiling (else nothing).
    pub fn op_scope(&self, op: &'static str) -> OpGuard {
        OpGuard { device: self.clone(), span: self.start_span(op, SpanKind::Op) }
    }

    /// Turns span recording on or off (allocations are tagged either way).
    pub fn set_profiling(&self, on: bool) {
        self.0.profiling.store(on, Ordering::Relaxed);
    }

    /// Takes the spans recorded so far.
    pub fn take_spans(&self) -> Vec<Span> {
        std::mem::take(&mut *self.0.spans.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn start_span(&self, name: &'static str, kind: SpanKind) -> Option<Span> {
        if !self.0.profiling.load(Ordering::Relaxed) || self.rehearsing() {
            return None;
        }
        let start_ns = self.allocator().timeline().now_ns();
        Some(Span { name, kind, phase: self.phase(), module: self.module(), start_ns, end_ns: start_ns })
    }

    fn finish_span(&self, mut span: Span) {
        span.end_ns = self.allocator().timeline().now_ns();
        self.0.spans.lock().unwrap_or_else(|e| e.into_inner()).push(span);
    }
}

/// Restores the previous module on drop (and ends its span when profiling).
pub struct ModuleGuard {
    device: Device,
    previous: u32,
    span: Option<Span>,
}

impl Drop for ModuleGuard {
    fn drop(&mut self) {
        if let Some(span) = self.span.take() {
            self.device.finish_span(span);
        }
        self.device.modules().current = self.previous;
    }
}

/// Ends an op's span on drop (when profiling).
pub struct OpGuard {
    device: Device,
    span: Option<Span>,
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        if let Some(span) = self.span.take() {
            self.device.finish_span(span);
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.0.kind)
    }
}

/// Restores the previous phase on drop.
pub struct PhaseGuard {
    device: Device,
    previous: Phase,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        *self.device.0.phase.lock().unwrap_or_else(|e| e.into_inner()) = self.previous;
    }
}

/// Restores the previous grad mode on drop.
pub struct GradModeGuard {
    device: Device,
    previous: bool,
}

/// Ends a re-run of a checkpointed segment when dropped.
pub struct RecomputeGuard {
    device: Device,
}

impl Drop for RecomputeGuard {
    fn drop(&mut self) {
        self.device.0.recomputing.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Ends a replay when dropped.
pub struct ReplayGuard {
    device: Device,
}

/// Ends a rehearsal on drop (see [`Device::rehearse`]).
pub struct RehearsalGuard {
    device: Device,
}

impl Drop for RehearsalGuard {
    fn drop(&mut self) {
        self.device.0.rehearsing.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for ReplayGuard {
    fn drop(&mut self) {
        self.device.0.replaying.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        self.device.0.grad_enabled.store(self.previous, Ordering::Relaxed);
    }
}
