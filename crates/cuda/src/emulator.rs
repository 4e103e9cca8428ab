//! The CUDA emulator: a [`Machine`] that runs memfit's kernel sources on the host, so the cuda
//! backend (every launcher, every kernel's indexing, cuBLAS's column-major contract) is tested on
//! machines without a GPU. It is chosen by `MEMFIT_CUDA_EMULATOR=1` for `--device cuda`; it is a
//! test device, never a fast one, and it proves nothing about the GPU's own behaviour (races,
//! the math library's rounding): `tools/gpu-check` does that on a GPU.
//!
//! The sources are compiled by the host's C++ compiler (`$CXX`, else `g++`) with
//! `emulator/emulator.h` in front (threads as fibers, barriers as switches), into one shared
//! library cached next to the machine code (`<cache>/emulator/<hash>.so`) and loaded with `libloading`.
//! Memory is host memory (an address is a host address); products are plain loops that follow
//! cuBLAS's column-major definition to the letter (a bf16 or fp16 product's operands rounded as
//! Notes [bf16 products] and [fp16 products] in `memfit-kernels` define).
//!
//! A capture (CUDA graphs, Note [CUDA graphs] in `graphs.rs`) records the ops asked for into a
//! list, and a graph's launch runs that list in order.
//!
//! `MEMFIT_CUDA_EMULATOR=host` is the same machine with no arithmetic: launches and products are
//! checked and return at once (only the tensor cores' check runs, so the backend takes the paths it
//! takes on a GPU), so a step's time is the host's own work for it (the op layer, the launchers,
//! the allocator): what a GPU step cannot go below, measured on a machine without one.

use crate::graphs::Op;
use crate::kernels::{cache_dir, fnv1a, source_of, SOURCES};
use crate::machine::{Arg, Gemm, GemmType, Launch, Machine};
use crate::CudaError;
use std::alloc::Layout;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

const HEADER: &str = include_str!("../emulator/emulator.h");

/// The memory the emulated GPU says it has.
pub const EMULATED_BYTES: u64 = 4 << 30;
/// What it says it has with no arithmetic ([`host_only`]): an H100's, for GPT-2-sized steps (pages
/// nothing writes are never touched).
pub const HOST_ONLY_BYTES: u64 = 80 << 30;

/// The variable that makes `--device cuda` use the emulator.
pub const EMULATOR_VARIABLE: &str = "MEMFIT_CUDA_EMULATOR";

/// True when `MEMFIT_CUDA_EMULATOR=1` (or `=host`: [`host_only`]).
pub fn requested() -> bool {
    std::env::var_os(EMULATOR_VARIABLE).is_some_and(|v| v == "1" || v == "host")
}

/// True when `MEMFIT_CUDA_EMULATOR=host`: kernels and products do nothing (the module's doc).
pub fn host_only() -> bool {
    std::env::var_os(EMULATOR_VARIABLE).is_some_and(|v| v == "host")
}

/// Entry point of one emulated kernel: `grid` blocks of `block` threads over `params`.
type Entry = unsafe extern "C" fn(u32, u32, *mut *mut std::ffi::c_void) -> i32;

pub struct Emulator {
    library: libloading::Library,
    entries: Mutex<HashMap<String, Entry>>,
    /// Live allocations: address -> layout (so `free` frees only what `alloc` made).
    blocks: Mutex<HashMap<u64, Layout>>,
    /// Live "pinned" host allocations, likewise.
    pinned: Mutex<HashMap<u64, Layout>>,
    /// Expandable segments' address space: host reservations (the host backend's, which checks every
    /// range against them), by base address and size.
    reserved: Mutex<(memfit_memory::HostBackend, std::collections::BTreeMap<u64, usize>)>,
    /// [`host_only`]: launches (but the tensor cores' check) and products do nothing.
    host_only: bool,
    /// The ops of the capture under way (Note [CUDA graphs]), if one is.
    capture: Mutex<Option<Vec<Op>>>,
    /// Captured graphs by handle (their ops, run in order at each launch), and the next handle.
    graphs: Mutex<(HashMap<u64, Vec<Op>>, u64)>,
}

impl Emulator {
    /// Compiles (or finds cached) and loads the emulated kernels.
    pub fn open() -> Result<Emulator, CudaError> {
        let library_file = build()?;
        // SAFETY: the library is ours, built from our sources; loading runs no initialiser of
        // consequence (thread-local storage only).
        let library = unsafe { libloading::Library::new(&library_file) }
            .map_err(|e| crate::call_error(&format!("loading the CUDA emulator {}", library_file.display()), e))?;
        Ok(Emulator {
            library,
            entries: Mutex::new(HashMap::new()),
            blocks: Mutex::new(HashMap::new()),
            pinned: Mutex::new(HashMap::new()),
            reserved: Mutex::new(Default::default()),
            host_only: host_only(),
            capture: Mutex::new(None),
            graphs: Mutex::new((HashMap::new(), 1)),
        })
    }

    fn entry(&self, name: &str) -> Result<Entry, CudaError> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&entry) = entries.get(name) {
            return Ok(entry);
        }
        if source_of(name).is_none() {
            return Err(unknown_kernel(name));
        }
        // SAFETY: every `memfit_emu_<kernel>` has the signature of `Entry` (emulator.h's macro).
        let entry: Entry = unsafe {
            *self.library.get::<Entry>(format!("memfit_emu_{name}\0").as_bytes()).map_err(|_| unknown_kernel(name))?
        };
        entries.insert(name.to_string(), entry);
        Ok(entry)
    }

    /// The memory it says it has.
    fn capacity(&self) -> u64 {
        if self.host_only {
            HOST_ONLY_BYTES
        } else {
            EMULATED_BYTES
        }
    }

    /// Records the op `make` gives into the capture under way, if one is: true when it did.
    fn captured(&self, make: impl FnOnce() -> Op) -> bool {
        match self.capture.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(ops) => {
                ops.push(make());
                true
            }
            None => false,
        }
    }

    fn allocated(&self) -> u64 {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner()).values().map(|l| l.size() as u64).sum()
    }
}

fn unknown_kernel(name: &str) -> CudaError {
    CudaError::Call { what: format!("launching {name}"), detail: "no kernel of that name in memfit's sources".into() }
}

/// The reservation holding `address` (base and the offset into it).
fn reservation_of(reservations: &std::collections::BTreeMap<u64, usize>, address: u64) -> Option<(u64, usize)> {
    let (&base, &size) = reservations.range(..=address).next_back()?;
    let offset = (address - base) as usize;
    (offset < size).then_some((base, offset))
}

/// Pinned memory's layout: page-aligned, as `cuMemHostAlloc`'s is.
fn pinned_layout(bytes: usize) -> Result<Layout, CudaError> {
    let refused =
        || CudaError::Call { what: format!("allocating {bytes} B of host memory"), detail: "invalid size".into() };
    if bytes == 0 {
        return Err(refused());
    }
    Layout::from_size_align(bytes, 4096).map_err(|_| refused())
}

fn host_pointer(address: u64) -> Option<std::ptr::NonNull<u8>> {
    std::ptr::NonNull::new(address as usize as *mut u8)
}

impl Machine for Emulator {
    fn reserve(&self, bytes: usize) -> Result<u64, CudaError> {
        use memfit_memory::SegmentBackend;
        let mut guard = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let (host, reservations) = &mut *guard;
        let base =
            host.reserve(bytes).ok().flatten().ok_or_else(|| crate::call_error("reserving address space", bytes))?;
        reservations.insert(base.as_ptr() as usize as u64, bytes);
        Ok(base.as_ptr() as usize as u64)
    }

    fn map(&self, address: u64, bytes: usize) -> Result<(), CudaError> {
        use memfit_memory::SegmentBackend;
        let mut guard = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let (host, reservations) = &mut *guard;
        let (base, offset) = reservation_of(reservations, address)
            .ok_or_else(|| crate::call_error("mapping memory", "outside every reservation"))?;
        host.map(host_pointer(base), offset, bytes).map_err(|_| crate::call_error("mapping memory", bytes))
    }

    fn unmap(&self, address: u64, bytes: usize) {
        use memfit_memory::SegmentBackend;
        let mut guard = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let (host, reservations) = &mut *guard;
        if let Some((base, offset)) = reservation_of(reservations, address) {
            host.unmap(host_pointer(base), offset, bytes);
        }
    }

    fn release(&self, address: u64, bytes: usize) {
        use memfit_memory::SegmentBackend;
        let mut guard = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let (host, reservations) = &mut *guard;
        if reservations.remove(&address).is_some() {
            host.release(host_pointer(address), bytes);
        }
    }

    fn description(&self) -> String {
        match self.host_only {
            true => "memfit's CUDA emulator, host only (kernels do nothing)".to_string(),
            false => "memfit's CUDA emulator (kernels run on the host)".to_string(),
        }
    }

    fn max_blocks(&self) -> u32 {
        4
    }

    fn free_bytes(&self) -> Result<u64, CudaError> {
        Ok(self.capacity().saturating_sub(self.allocated()))
    }

    fn alloc(&self, bytes: usize) -> Result<u64, CudaError> {
        let out_of_memory =
            || CudaError::Call { what: format!("allocating {bytes} B"), detail: "out of memory".into() };
        if bytes == 0 || self.allocated() + bytes as u64 > self.capacity() {
            return Err(out_of_memory());
        }
        let layout = Layout::from_size_align(bytes, 512).map_err(|_| out_of_memory())?;
        // SAFETY: a layout of non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(out_of_memory());
        }
        self.blocks.lock().unwrap_or_else(|e| e.into_inner()).insert(ptr as u64, layout);
        Ok(ptr as u64)
    }

    fn free(&self, address: u64) {
        if let Some(layout) = self.blocks.lock().unwrap_or_else(|e| e.into_inner()).remove(&address) {
            // SAFETY: allocated by `alloc` with this layout, freed once (removed above).
            unsafe { std::alloc::dealloc(address as *mut u8, layout) };
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        // SAFETY: `dst` is emulated device memory of at least `src.len()` bytes (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn pinned_alloc(&self, bytes: usize) -> Result<u64, CudaError> {
        let layout = pinned_layout(bytes)?;
        // SAFETY: a layout of non-zero size (`pinned_layout` refuses 0).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(CudaError::Call {
                what: format!("allocating {bytes} B of host memory"),
                detail: "out of memory".into(),
            });
        }
        self.pinned.lock().unwrap_or_else(|e| e.into_inner()).insert(ptr as u64, layout);
        Ok(ptr as u64)
    }

    fn pinned_free(&self, host: u64) {
        if let Some(layout) = self.pinned.lock().unwrap_or_else(|e| e.into_inner()).remove(&host) {
            // SAFETY: allocated by `pinned_alloc` with this layout, freed once (removed above).
            unsafe { std::alloc::dealloc(host as *mut u8, layout) };
        }
    }

    fn upload_async(&self, dst: u64, host: u64, bytes: usize) -> Result<(), CudaError> {
        // The emulator's work is done when it returns, so every copy is complete at once.
        // SAFETY: `host` is pinned memory of at least `bytes`, `dst` emulated device memory too.
        unsafe { std::ptr::copy_nonoverlapping(host as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn event_create(&self) -> Result<u64, CudaError> {
        Ok(1)
    }

    fn event_record(&self, _: u64) -> Result<(), CudaError> {
        Ok(())
    }

    fn event_done(&self, _: u64) -> Result<bool, CudaError> {
        Ok(true)
    }

    fn event_wait(&self, _: u64) -> Result<(), CudaError> {
        Ok(())
    }

    fn event_destroy(&self, _: u64) {}

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if self.captured(|| Op::Copy { dst, src, bytes }) {
            return Ok(());
        }
        // SAFETY: as `upload`; device copies may overlap only when equal.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        if self.captured(|| Op::Zero { dst, bytes }) {
            return Ok(());
        }
        // SAFETY: as `upload`.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }

    fn launch(&self, name: &str, shape: Launch, args: &mut [Arg]) -> Result<(), CudaError> {
        let entry = self.entry(name)?;
        if shape.grid > 0 && self.captured(|| Op::Kernel { name: name.to_string(), shape, args: args.to_vec() }) {
            return Ok(());
        }
        let mut params: Vec<*mut std::ffi::c_void> = args.iter_mut().map(Arg::address).collect();
        if shape.grid == 0 || (self.host_only && !name.starts_with("attention_mma_check")) {
            return Ok(());
        }
        // SAFETY: the kernel's parameters are `args` in order (the launcher's contract, as for
        // cuLaunchKernel), each pointing at a live value; addresses in them are emulated memory.
        let status = unsafe { entry(shape.grid, shape.block, params.as_mut_ptr()) };
        if status != 0 {
            return Err(CudaError::Call {
                what: format!("launching {name} with {} threads a block", shape.block),
                detail: "the emulator runs at most 1024 threads a block".into(),
            });
        }
        Ok(())
    }

    fn set_library_workspace(&self, _: u64, _: usize) -> Result<(), CudaError> {
        Ok(())
    }

    fn fuses_bias(&self, dtype: GemmType) -> bool {
        matches!(dtype, GemmType::F32 | GemmType::F32Bf16 | GemmType::F32F16)
    }

    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        let into_f32 = matches!(g.dtype, GemmType::F32 | GemmType::Bf16 | GemmType::F16);
        if g.bias != 0 && (g.beta != 0.0 || g.batch != 1 || !into_f32) {
            return Err(crate::call_error("emulated gemm", "a bias needs beta 0, one product and f32 results"));
        }
        if self.captured(|| Op::Gemm(*g)) {
            return Ok(());
        }
        if self.host_only {
            return Ok(());
        }
        match g.dtype {
            GemmType::F32 => gemm_host::<f32, f32>(g, |v| v),
            GemmType::Bf16 => gemm_host::<u16, f32>(g, memfit_kernels::gemm_bf16::from_bf16),
            GemmType::F16 => gemm_host::<u16, f32>(g, |bits| half::f16::from_bits(bits).to_f32()),
            GemmType::F32Bf16 | GemmType::F32F16 => {
                return Err(crate::call_error(
                    "emulated gemm",
                    "an f32 product with rounded operands goes through the backend's rounding workspace",
                ))
            }
            GemmType::F64 => gemm_host::<f64, f64>(g, |v| v),
        }
        Ok(())
    }

    fn capture_begin(&self) -> Result<(), CudaError> {
        let mut capture = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if capture.is_some() {
            return Err(crate::call_error("capturing a graph", "a capture is under way already"));
        }
        *capture = Some(Vec::new());
        Ok(())
    }

    fn captured_node(&self) -> Result<u64, CudaError> {
        match self.capture.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(ops) if matches!(ops.last(), Some(Op::Kernel { .. })) => Ok(ops.len() as u64 - 1),
            _ => Err(crate::call_error("capturing a graph", "no kernel was captured last")),
        }
    }

    fn capture_end(&self) -> Result<u64, CudaError> {
        let ops = self.capture.lock().unwrap_or_else(|e| e.into_inner()).take();
        let ops = ops.ok_or_else(|| crate::call_error("capturing a graph", "no capture is under way"))?;
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let handle = graphs.1;
        graphs.1 += 1;
        graphs.0.insert(handle, ops);
        Ok(handle)
    }

    fn graph_launch(&self, graph: u64) -> Result<(), CudaError> {
        let ops = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).0.get(&graph).cloned();
        let mut ops = ops.ok_or_else(|| crate::call_error("launching a graph", "no such graph"))?;
        ops.iter_mut().try_for_each(|op| op.queue(self))
    }

    fn graph_set_kernel(
        &self,
        graph: u64,
        node: u64,
        name: &str,
        shape: Launch,
        args: &mut [Arg],
    ) -> Result<(), CudaError> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let op = graphs.0.get_mut(&graph).and_then(|ops| ops.get_mut(node as usize));
        match op {
            Some(Op::Kernel { name: n, shape: s, args: a }) if n == name && *s == shape && a.len() == args.len() => {
                a.clone_from_slice(args);
                Ok(())
            }
            _ => Err(crate::call_error("changing a graph", format!("node {node} is no launch of {name} like this"))),
        }
    }

    fn graph_destroy(&self, graph: u64) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).0.remove(&graph);
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let addresses: Vec<u64> = self.blocks.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        for address in addresses {
            self.free(address);
        }
        let pinned: Vec<u64> = self.pinned.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        for host in pinned {
            self.pinned_free(host);
        }
    }
}

/// The float types of [`gemm_host`].
trait Float: Copy + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    const ZERO: Self;
    fn of(v: f64) -> Self;
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    fn of(v: f64) -> Self {
        v as f32
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    fn of(v: f64) -> Self {
        v
    }
}

/// cuBLAS's strided batched GEMM by its definition (column-major): operands stored as `A` (f32,
/// f64, or 16-bit bits), each element read as a `T` through `read`, C and the sums in `T`, added in
/// order.
fn gemm_host<A: Copy, T: Float>(g: &Gemm, read: impl Fn(A) -> T) {
    let (alpha, beta) = (T::of(g.alpha), T::of(g.beta));
    for batch in 0..g.batch {
        let a = (g.a as *const A).wrapping_add(batch * g.stride_a);
        let b = (g.b as *const A).wrapping_add(batch * g.stride_b);
        let c = (g.c as *mut T).wrapping_add(batch * g.stride_c);
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = T::ZERO;
                for l in 0..g.k {
                    let ai = if g.transa { l + i * g.lda } else { i + l * g.lda };
                    let bi = if g.transb { j + l * g.ldb } else { l + j * g.ldb };
                    // SAFETY: the product's operands lie inside emulated memory (the caller's contract).
                    acc = acc + unsafe { read(*a.add(ai)) * read(*b.add(bi)) };
                }
                // SAFETY: as above; a bias holds m values (the caller's contract).
                unsafe {
                    let out = c.add(i + j * g.ldc);
                    *out = if g.bias != 0 {
                        alpha * acc + *(g.bias as *const T).add(i)
                    } else if g.beta == 0.0 {
                        alpha * acc
                    } else {
                        alpha * acc + beta * *out
                    };
                }
            }
        }
    }
}

/// The shared library of emulated kernels, compiled when not cached.
fn build() -> Result<PathBuf, CudaError> {
    // One build at a time in a process (threads of a test binary open emulators at once).
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let programs: Vec<(String, String)> =
        SOURCES.iter().map(|s| (s.name.to_string(), format!("#include \"emulator.h\"\n{}", s.program()))).collect();
    let mut key = String::from(HEADER);
    for (_, text) in &programs {
        key.push_str(text);
    }
    let dir = cache_dir().unwrap_or_else(std::env::temp_dir).join("emulator");
    let file = dir.join(format!("kernels-{:016x}.so", fnv1a(key.as_bytes())));
    if file.exists() {
        return Ok(file);
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let work = dir.join(format!("build-{}-{nanos}", std::process::id()));
    let failed =
        |what: &str, e: &dyn std::fmt::Debug| crate::call_error(&format!("building the CUDA emulator: {what}"), e);
    std::fs::create_dir_all(&work).map_err(|e| failed("creating its folder", &e))?;
    std::fs::write(work.join("emulator.h"), HEADER).map_err(|e| failed("writing emulator.h", &e))?;
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    let mut units = Vec::new();
    for (name, text) in &programs {
        let plain = work.join(format!("{name}.plain.cpp"));
        std::fs::write(&plain, text).map_err(|e| failed("writing a source", &e))?;
        let preprocessed = run(Command::new(&compiler).args(["-std=c++17", "-E", "-P"]).arg(&plain), &compiler)?;
        let mut unit = text.clone();
        for kernel in kernel_names(&preprocessed) {
            unit.push_str(&format!("\nMEMFIT_EMULATED({kernel})"));
        }
        let path = work.join(format!("{name}.cpp"));
        std::fs::write(&path, unit).map_err(|e| failed("writing a source", &e))?;
        units.push(path);
    }
    let temporary = work.join("kernels.so");
    run(
        Command::new(&compiler)
            .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-o"])
            .arg(&temporary)
            .args(&units),
        &compiler,
    )?;
    std::fs::rename(&temporary, &file).map_err(|e| failed("storing the library", &e))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(file)
}

/// Runs the compiler, its standard output on success, its errors as a [`CudaError`].
fn run(command: &mut Command, compiler: &str) -> Result<String, CudaError> {
    let output = command.output().map_err(|e| CudaError::Call {
        what: "building the CUDA emulator".into(),
        detail: format!("the C++ compiler {compiler:?} could not be run ({e}); set CXX to one"),
    })?;
    if !output.status.success() {
        return Err(CudaError::Compile {
            kernel: "emulator".into(),
            log: String::from_utf8_lossy(&output.stderr).chars().take(4000).collect(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The names of the `extern "C"` kernels (`void` functions) in preprocessed source text.
fn kernel_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for part in text.split("extern \"C\"").skip(1) {
        let rest = part.trim_start();
        let Some(rest) = rest.strip_prefix("void") else { continue };
        if !rest.starts_with(char::is_whitespace) {
            continue;
        }
        let name: String = rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_the_extern_c_void_functions() {
        let text =
            "extern \"C\" void unary_f32(int op) {}\nextern \"C\"  void  add_f64 (x)\nextern \"C\" int memfit_emu_x(";
        assert_eq!(kernel_names(text), vec!["unary_f32", "add_f64"]);
    }
}
