//! CUDA graphs: a step's launches recorded once and replayed as whole graphs, so the driver is
//! called a few times a step instead of once a kernel ([`Graphed`], Note [CUDA graphs]).
//!
//! Note [CUDA graphs]: every call that queues work on the stream (a kernel launch, a product, a
//! device copy or zeroing: an [`Op`]) is recorded instead of queued, into a *chunk*. A chunk ends
//! where the host must see the stream's work in order (a copy to or from the host, an event mark,
//! freeing or unmapping memory, a new library workspace: the call then runs after the chunk is
//! queued), or when it holds [`Chunks::limit`] ops: 64 after such a boundary, four times as many at
//! each full chunk after, at most 1,024, so the GPU starts on a step's first ops while the host
//! still records the rest. The cuts are a function of the calls alone, so a step that repeats the
//! same calls repeats the same chunks.
//!
//! A chunk's *structure* is its ops with every argument that is not a plain number: kernel names,
//! launch shapes, device addresses and views, every field of a product, copy or zeroing. The first
//! time a structure is seen, its ops are queued one by one, as without graphs (its kernels' modules
//! load then, its products choose their algorithms). The second time, the ops are captured into a
//! graph (`Machine::capture_begin` .. `capture_end`: recorded by the driver, not run) that is then
//! launched; from then on the same structure launches that graph. The plain numbers of a kernel's
//! arguments (a step count in AdamW's bias corrections, a loss scale) may differ between launches:
//! each kernel node whose numbers changed is given the new ones before the launch
//! (`Machine::graph_set_kernel`, cuGraphExecKernelNodeSetParams), so a replay runs exactly the
//! launches the host asked for, every argument compared. A structure never seen twice (a new
//! shape, a recovery's smaller micro-batch, a different layout of memory) runs op by op, as
//! without graphs: nothing is replayed that was not asked for to the byte.
//!
//! memfit's allocator is deterministic, so a step that starts from the same layout of memory asks
//! for the same addresses, and its chunks repeat. The graphs' own memory is the driver's (a few
//! hundred bytes a node), outside memfit's allocator, as the CUDA context is. At most
//! [`MOST_GRAPHS`] are kept (the least recently launched goes first). A capture the driver refuses
//! turns graphs off for the rest of the run (the chunk then runs op by op, and
//! [`Launches::off`] says why). Kernel times (`MEMFIT_CUDA_KERNEL_TIMES`) time every launch alone,
//! so they turn graphs off. Errors of the work a chunk holds surface at the call that queues the
//! chunk (the next boundary), not at the launch that asked for it.
//!
//! Without `MEMFIT_CUDA_GRAPHS=1` every op is queued at once, as before, and only counted.

use crate::machine::{Arg, Gemm, GemmType, Launch, Machine};
use crate::CudaError;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

/// The variable that turns CUDA graphs on (`1`).
pub const VARIABLE: &str = "MEMFIT_CUDA_GRAPHS";

/// True when `MEMFIT_CUDA_GRAPHS=1`.
pub fn requested() -> bool {
    asks_for_graphs(std::env::var_os(VARIABLE).as_deref())
}

/// Whether a value of [`VARIABLE`] turns graphs on: `1` only.
fn asks_for_graphs(value: Option<&std::ffi::OsStr>) -> bool {
    value.is_some_and(|v| v == "1")
}

/// The most graphs kept at once.
pub const MOST_GRAPHS: usize = 64;
/// Structures remembered as seen once, before the memory of them is cleared.
const MOST_SIGHTINGS: usize = 4096;

/// One piece of work on the stream, as the backend asked for it.
#[derive(Clone, Debug)]
pub enum Op {
    Kernel { name: String, shape: Launch, args: Vec<Arg> },
    Gemm(Gemm),
    Copy { dst: u64, src: u64, bytes: usize },
    Zero { dst: u64, bytes: usize },
}

impl Op {
    /// Queues the op on `machine` (or records it there, while it captures).
    pub(crate) fn queue(&mut self, machine: &dyn Machine) -> Result<(), CudaError> {
        match self {
            Op::Kernel { name, shape, args } => machine.launch(name, *shape, args),
            Op::Gemm(g) => machine.gemm(g),
            Op::Copy { dst, src, bytes } => machine.copy(*dst, *src, *bytes),
            Op::Zero { dst, bytes } => machine.zero(*dst, *bytes),
        }
    }

    /// Feeds the op's structure (Note [CUDA graphs]) to `h`: everything but a kernel's plain numbers.
    fn hash_structure(&self, h: &mut impl Hasher) {
        match self {
            Op::Kernel { name, shape, args } => {
                0u8.hash(h);
                name.hash(h);
                (shape.grid, shape.block).hash(h);
                for a in args {
                    match a {
                        Arg::Ptr(p) => (1u8, p).hash(h),
                        Arg::View(v) => (2u8, v.rank, v.shape, v.stride, v.offset).hash(h),
                        Arg::Words(w) => (3u8, w.len()).hash(h),
                        Arg::I32(_) => 4u8.hash(h),
                        Arg::I64(_) => 5u8.hash(h),
                        Arg::U64(_) => 6u8.hash(h),
                        Arg::F32(_) => 7u8.hash(h),
                        Arg::F64(_) => 8u8.hash(h),
                    }
                }
            }
            Op::Gemm(g) => {
                1u8.hash(h);
                gemm_words(g).hash(h);
            }
            Op::Copy { dst, src, bytes } => (2u8, dst, src, bytes).hash(h),
            Op::Zero { dst, bytes } => (3u8, dst, bytes).hash(h),
        }
    }

    /// Whether `self` and `other` have the same structure (their plain numbers may differ).
    fn same_structure(&self, other: &Op) -> bool {
        match (self, other) {
            (Op::Kernel { name: n1, shape: s1, args: a1 }, Op::Kernel { name: n2, shape: s2, args: a2 }) => {
                n1 == n2
                    && s1 == s2
                    && a1.len() == a2.len()
                    && a1.iter().zip(a2).all(|(x, y)| match (x, y) {
                        (Arg::Ptr(p), Arg::Ptr(q)) => p == q,
                        (Arg::View(v), Arg::View(w)) => v == w,
                        (Arg::Words(v), Arg::Words(w)) => v.len() == w.len(),
                        _ => std::mem::discriminant(x) == std::mem::discriminant(y),
                    })
            }
            (Op::Gemm(g1), Op::Gemm(g2)) => gemm_words(g1) == gemm_words(g2),
            (Op::Copy { dst: d1, src: s1, bytes: b1 }, Op::Copy { dst: d2, src: s2, bytes: b2 }) => {
                (d1, s1, b1) == (d2, s2, b2)
            }
            (Op::Zero { dst: d1, bytes: b1 }, Op::Zero { dst: d2, bytes: b2 }) => (d1, b1) == (d2, b2),
            _ => false,
        }
    }
}

/// Every field of a product as words (its floats by their bits), to hash and compare.
fn gemm_words(g: &Gemm) -> [u64; 19] {
    let dtype = match g.dtype {
        GemmType::F32 => 0,
        GemmType::F32Bf16 => 1,
        GemmType::F32F16 => 2,
        GemmType::Bf16 => 3,
        GemmType::F16 => 4,
        GemmType::F64 => 5,
    };
    [
        dtype,
        u64::from(g.transa),
        u64::from(g.transb),
        g.m as u64,
        g.n as u64,
        g.k as u64,
        g.alpha.to_bits(),
        g.a,
        g.lda as u64,
        g.stride_a as u64,
        g.b,
        g.ldb as u64,
        g.stride_b as u64,
        g.beta.to_bits(),
        g.c,
        g.ldc as u64,
        g.stride_c as u64,
        g.batch as u64,
        g.bias,
    ]
}

/// Whether two kernel arguments hold the same bits.
fn same_bits(a: &Arg, b: &Arg) -> bool {
    match (a, b) {
        (Arg::I32(x), Arg::I32(y)) => x == y,
        (Arg::I64(x), Arg::I64(y)) => x == y,
        (Arg::U64(x), Arg::U64(y)) | (Arg::Ptr(x), Arg::Ptr(y)) => x == y,
        (Arg::F32(x), Arg::F32(y)) => x.to_bits() == y.to_bits(),
        (Arg::F64(x), Arg::F64(y)) => x.to_bits() == y.to_bits(),
        (Arg::View(x), Arg::View(y)) => x == y,
        (Arg::Words(x), Arg::Words(y)) => x == y,
        _ => false,
    }
}

/// What a device's work came to so far (counted with graphs on or off).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launches {
    /// Work the backend asked for: kernel launches, products, device copies and zeroings.
    pub asked: u64,
    /// Calls that queued work on the GPU: each op queued alone, and each graph launch.
    pub queued: u64,
    /// Graph launches (each counted in `queued` too).
    pub graph_launches: u64,
    /// Ops that ran inside a graph launch.
    pub replayed: u64,
    /// Graphs captured.
    pub captured: u64,
    /// Kernel nodes given new numbers before a launch.
    pub updated: u64,
    /// Whether graphs were asked for (`MEMFIT_CUDA_GRAPHS=1`).
    pub on: bool,
    /// Why graphs are off although asked for (kernel times asked for too, or a capture the driver
    /// refused), if they are.
    pub off: Option<String>,
}

/// How many ops a chunk takes (Note [CUDA graphs]).
struct Chunks {
    limit: usize,
}

impl Chunks {
    const FIRST: usize = 64;
    const MOST: usize = 1024;
}

/// A captured chunk: its graph, the ops it was last launched with, and each kernel op's node.
struct Captured {
    graph: u64,
    ops: Vec<Op>,
    nodes: Vec<Option<u64>>,
    last_launch: u64,
}

struct State {
    pending: Vec<Op>,
    chunks: Chunks,
    /// Structures seen once, by hash (a count of sightings).
    sightings: HashMap<u64, u32>,
    /// Captured structures, by hash.
    graphs: HashMap<u64, Captured>,
    /// Chunks queued so far (the graphs' clock for eviction).
    clock: u64,
    counts: Launches,
    /// An error of recorded work queued by a call that cannot return one (freeing memory):
    /// returned by the next call that can.
    failed: Option<CudaError>,
    /// [`Machine::fuses_bias`]'s answers, asked once a type (its first ask may run a check).
    fuses: HashMap<GemmType, bool>,
}

/// A [`Machine`] whose stream work goes through chunks and graphs (Note [CUDA graphs]); with
/// graphs off, a pass-through that counts.
pub struct Graphed {
    inner: Arc<dyn Machine>,
    state: Mutex<State>,
}

impl Graphed {
    /// `inner`, with graphs on when asked for (`MEMFIT_CUDA_GRAPHS=1`), unless kernel times are too
    /// (then [`Launches::off`] says so).
    pub fn new(inner: Arc<dyn Machine>) -> Graphed {
        let graphed = Graphed::with(inner, requested());
        if requested() && crate::timing::requested().is_some() {
            graphed.state().counts.off =
                Some(format!("{} times every launch alone, so graphs are off", crate::timing::VARIABLE));
        }
        graphed
    }

    /// `inner`, with graphs on or off.
    pub fn with(inner: Arc<dyn Machine>, on: bool) -> Graphed {
        let counts = Launches { on, ..Launches::default() };
        Graphed {
            inner,
            state: Mutex::new(State {
                pending: Vec::new(),
                chunks: Chunks { limit: Chunks::FIRST },
                sightings: HashMap::new(),
                graphs: HashMap::new(),
                clock: 0,
                counts,
                failed: None,
                fuses: HashMap::new(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `op` (graphs on) or queues it (off).
    fn ask(&self, mut op: Op) -> Result<(), CudaError> {
        let mut st = self.state();
        if let Some(e) = st.failed.take() {
            return Err(e);
        }
        st.counts.asked += 1;
        if !st.counts.on || st.counts.off.is_some() {
            st.counts.queued += 1;
            drop(st);
            return op.queue(&*self.inner);
        }
        st.pending.push(op);
        if st.pending.len() >= st.chunks.limit {
            st.chunks.limit = (st.chunks.limit * 4).min(Chunks::MOST);
            self.queue_chunk(&mut st)?;
        }
        Ok(())
    }

    /// Queues what is recorded before a call that must follow it (a boundary: the next chunk is
    /// a first one again).
    fn boundary(&self) -> Result<(), CudaError> {
        let mut st = self.state();
        if let Some(e) = st.failed.take() {
            return Err(e);
        }
        st.chunks.limit = Chunks::FIRST;
        self.queue_chunk(&mut st)
    }

    /// [`Graphed::boundary`] before a call that cannot return an error: one is kept for the next
    /// call that can.
    fn boundary_keeping_errors(&self) {
        if let Err(e) = self.boundary() {
            self.state().failed.get_or_insert(e);
        }
    }

    /// Queues the recorded chunk: as its graph, captured now if its structure is seen the second
    /// time, else op by op.
    fn queue_chunk(&self, st: &mut State) -> Result<(), CudaError> {
        let mut ops = std::mem::take(&mut st.pending);
        if ops.is_empty() {
            return Ok(());
        }
        st.clock += 1;
        let clock = st.clock;
        let mut hasher = DefaultHasher::new();
        for op in &ops {
            op.hash_structure(&mut hasher);
        }
        let key = hasher.finish();
        let matching =
            |c: &Captured| c.ops.len() == ops.len() && c.ops.iter().zip(&ops).all(|(a, b)| a.same_structure(b));
        let hit = st.graphs.get(&key).is_some_and(matching);
        if let Some(captured) = st.graphs.get_mut(&key).filter(|_| hit) {
            let mut updated = 0;
            for ((old, new), node) in captured.ops.iter_mut().zip(&mut ops).zip(&captured.nodes) {
                if let (Op::Kernel { args: was, .. }, Op::Kernel { name, shape, args }, Some(node)) =
                    (&*old, &mut *new, node)
                {
                    if !was.iter().zip(args.iter()).all(|(a, b)| same_bits(a, b)) {
                        self.inner.graph_set_kernel(captured.graph, *node, name, *shape, args)?;
                        *old = new.clone();
                        updated += 1;
                    }
                }
            }
            captured.last_launch = clock;
            self.inner.graph_launch(captured.graph)?;
            st.counts.updated += updated;
            st.counts.graph_launches += 1;
            st.counts.queued += 1;
            st.counts.replayed += ops.len() as u64;
            return Ok(());
        }
        let seen = {
            if st.sightings.len() >= MOST_SIGHTINGS {
                st.sightings.clear();
            }
            let n = st.sightings.entry(key).or_insert(0);
            *n += 1;
            *n
        };
        if seen >= 2 && st.counts.off.is_none() {
            match self.capture(&mut ops) {
                Ok((graph, nodes)) => {
                    st.sightings.remove(&key);
                    self.inner.graph_launch(graph)?;
                    st.counts.captured += 1;
                    st.counts.graph_launches += 1;
                    st.counts.queued += 1;
                    st.counts.replayed += ops.len() as u64;
                    if let Some(old) = st.graphs.insert(key, Captured { graph, ops, nodes, last_launch: clock }) {
                        self.inner.graph_destroy(old.graph);
                    }
                    if st.graphs.len() > MOST_GRAPHS {
                        let oldest = st.graphs.iter().min_by_key(|(_, c)| c.last_launch).map(|(&k, _)| k);
                        if let Some(old) = oldest.and_then(|k| st.graphs.remove(&k)) {
                            self.inner.graph_destroy(old.graph);
                        }
                    }
                    return Ok(());
                }
                Err(e) => st.counts.off = Some(format!("a graph's capture failed, so graphs are off: {e}")),
            }
        }
        st.counts.queued += ops.len() as u64;
        for op in &mut ops {
            op.queue(&*self.inner)?;
        }
        Ok(())
    }

    /// Captures `ops` into a graph: its handle and each kernel op's node. The capture is always
    /// ended, so a failure leaves the stream as it was, with nothing of `ops` run.
    fn capture(&self, ops: &mut [Op]) -> Result<(u64, Vec<Option<u64>>), CudaError> {
        self.inner.capture_begin()?;
        let mut nodes = Vec::with_capacity(ops.len());
        let recorded = ops.iter_mut().try_for_each(|op| {
            op.queue(&*self.inner)?;
            nodes.push(match op {
                Op::Kernel { .. } => Some(self.inner.captured_node()?),
                _ => None,
            });
            Ok(())
        });
        let graph = self.inner.capture_end();
        match (recorded, graph) {
            (Ok(()), Ok(graph)) => Ok((graph, nodes)),
            (Err(e), Ok(graph)) => {
                self.inner.graph_destroy(graph);
                Err(e)
            }
            (Err(e), Err(_)) | (Ok(()), Err(e)) => Err(e),
        }
    }

    /// The work counted so far (Note [CUDA graphs]).
    pub fn launches(&self) -> Launches {
        self.state().counts.clone()
    }
}

impl Drop for Graphed {
    fn drop(&mut self) {
        let _ = self.boundary();
        let graphs: Vec<u64> = self.state().graphs.drain().map(|(_, c)| c.graph).collect();
        for graph in graphs {
            self.inner.graph_destroy(graph);
        }
    }
}

impl Machine for Graphed {
    fn description(&self) -> String {
        self.inner.description()
    }
    fn fuses_bias(&self, dtype: GemmType) -> bool {
        if let Some(&known) = self.state().fuses.get(&dtype) {
            return known;
        }
        // The first ask may run a check on the stream: after what is recorded.
        self.boundary_keeping_errors();
        let known = self.inner.fuses_bias(dtype);
        self.state().fuses.insert(dtype, known);
        known
    }
    fn max_blocks(&self) -> u32 {
        self.inner.max_blocks()
    }
    fn max_grid(&self) -> u32 {
        self.inner.max_grid()
    }
    fn free_bytes(&self) -> Result<u64, CudaError> {
        self.inner.free_bytes()
    }
    fn alloc(&self, bytes: usize) -> Result<u64, CudaError> {
        // New memory: nothing recorded uses it.
        self.inner.alloc(bytes)
    }
    fn free(&self, address: u64) {
        // Recorded work may use it: queued first.
        self.boundary_keeping_errors();
        self.inner.free(address)
    }
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.boundary()?;
        self.inner.upload(dst, src)
    }
    fn pinned_alloc(&self, bytes: usize) -> Result<u64, CudaError> {
        self.inner.pinned_alloc(bytes)
    }
    fn pinned_free(&self, host: u64) {
        self.boundary_keeping_errors();
        self.inner.pinned_free(host)
    }
    fn upload_async(&self, dst: u64, host: u64, bytes: usize) -> Result<(), CudaError> {
        self.boundary()?;
        self.inner.upload_async(dst, host, bytes)
    }
    fn event_create(&self) -> Result<u64, CudaError> {
        self.inner.event_create()
    }
    fn event_record(&self, event: u64) -> Result<(), CudaError> {
        self.boundary()?;
        self.inner.event_record(event)
    }
    fn event_done(&self, event: u64) -> Result<bool, CudaError> {
        // A mark is made at a boundary: the work before it is queued already.
        self.inner.event_done(event)
    }
    fn event_wait(&self, event: u64) -> Result<(), CudaError> {
        self.inner.event_wait(event)
    }
    fn event_destroy(&self, event: u64) {
        self.inner.event_destroy(event)
    }
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.boundary()?;
        self.inner.download(src, dst)
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        self.ask(Op::Copy { dst, src, bytes })
    }
    fn zero(&self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        self.ask(Op::Zero { dst, bytes })
    }
    fn launch(&self, name: &str, shape: Launch, args: &mut [Arg]) -> Result<(), CudaError> {
        if shape.grid == 0 {
            // Nothing to run: the machine checks the name and returns.
            return self.inner.launch(name, shape, args);
        }
        self.ask(Op::Kernel { name: name.to_string(), shape, args: args.to_vec() })
    }
    fn set_library_workspace(&self, address: u64, bytes: usize) -> Result<(), CudaError> {
        self.boundary()?;
        self.inner.set_library_workspace(address, bytes)
    }
    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        self.ask(Op::Gemm(*g))
    }
    fn reserve(&self, bytes: usize) -> Result<u64, CudaError> {
        self.inner.reserve(bytes)
    }
    fn map(&self, address: u64, bytes: usize) -> Result<(), CudaError> {
        self.inner.map(address, bytes)
    }
    fn unmap(&self, address: u64, bytes: usize) {
        self.boundary_keeping_errors();
        self.inner.unmap(address, bytes)
    }
    fn release(&self, address: u64, bytes: usize) {
        self.boundary_keeping_errors();
        self.inner.release(address, bytes)
    }
    fn launches(&self) -> Option<Launches> {
        Some(Graphed::launches(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::Strided;

    /// A machine that logs every call (and runs nothing): `launch NAME ARGS`, `gemm`, `graph N`
    /// for a graph launch, `set N NODE NAME ARGS`, `download`, `free`..., and captures by keeping
    /// the calls made between `capture_begin` and `capture_end` as the graph's.
    #[derive(Default)]
    struct Log {
        calls: Mutex<Vec<String>>,
        capturing: Mutex<Option<Vec<String>>>,
        graphs: Mutex<Vec<Vec<String>>>,
        destroyed: Mutex<Vec<u64>>,
        refuse_capture: bool,
        captures: std::sync::atomic::AtomicUsize,
    }

    impl Log {
        fn call(&self, c: String) {
            match self.capturing.lock().unwrap().as_mut() {
                Some(captured) => captured.push(c),
                None => self.calls.lock().unwrap().push(c),
            }
        }
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.calls.lock().unwrap())
        }
    }

    fn words(args: &[Arg]) -> String {
        args.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>().join(",")
    }

    impl Machine for Log {
        fn description(&self) -> String {
            "log".into()
        }
        fn max_blocks(&self) -> u32 {
            3
        }
        fn max_grid(&self) -> u32 {
            5
        }
        fn free_bytes(&self) -> Result<u64, CudaError> {
            Ok(7)
        }
        fn fuses_bias(&self, dtype: GemmType) -> bool {
            self.call(format!("fuses {dtype:?}"));
            dtype == GemmType::F32
        }
        fn alloc(&self, _: usize) -> Result<u64, CudaError> {
            self.call("alloc".into());
            Ok(4096)
        }
        fn free(&self, _: u64) {
            self.call("free".into())
        }
        fn upload(&self, _: u64, _: &[u8]) -> Result<(), CudaError> {
            self.call("upload".into());
            Ok(())
        }
        fn pinned_alloc(&self, _: usize) -> Result<u64, CudaError> {
            Ok(8192)
        }
        fn pinned_free(&self, _: u64) {
            self.call("pinned_free".into())
        }
        fn upload_async(&self, _: u64, _: u64, _: usize) -> Result<(), CudaError> {
            self.call("upload_async".into());
            Ok(())
        }
        fn event_create(&self) -> Result<u64, CudaError> {
            Ok(11)
        }
        fn event_record(&self, _: u64) -> Result<(), CudaError> {
            self.call("event".into());
            Ok(())
        }
        fn event_done(&self, _: u64) -> Result<bool, CudaError> {
            self.call("event_done".into());
            Ok(false)
        }
        fn event_wait(&self, _: u64) -> Result<(), CudaError> {
            self.call("event_wait".into());
            Ok(())
        }
        fn event_destroy(&self, _: u64) {
            self.call("event_destroy".into())
        }
        fn reserve(&self, _: usize) -> Result<u64, CudaError> {
            Ok(13)
        }
        fn map(&self, _: u64, _: usize) -> Result<(), CudaError> {
            self.call("map".into());
            Ok(())
        }
        fn download(&self, _: u64, _: &mut [u8]) -> Result<(), CudaError> {
            self.call("download".into());
            Ok(())
        }
        fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
            self.call(format!("copy {dst} {src} {bytes}"));
            Ok(())
        }
        fn zero(&self, dst: u64, bytes: usize) -> Result<(), CudaError> {
            self.call(format!("zero {dst} {bytes}"));
            Ok(())
        }
        fn launch(&self, name: &str, _: Launch, args: &mut [Arg]) -> Result<(), CudaError> {
            if name == "broken" {
                return Err(crate::call_error("launching broken", "refused"));
            }
            self.call(format!("launch {name} {}", words(args)));
            Ok(())
        }
        fn set_library_workspace(&self, _: u64, _: usize) -> Result<(), CudaError> {
            self.call("workspace".into());
            Ok(())
        }
        fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
            self.call(format!("gemm {}", g.m));
            Ok(())
        }
        fn unmap(&self, _: u64, _: usize) {
            self.call("unmap".into())
        }
        fn release(&self, _: u64, _: usize) {
            self.call("release".into())
        }
        fn capture_begin(&self) -> Result<(), CudaError> {
            self.captures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            *self.capturing.lock().unwrap() = Some(Vec::new());
            Ok(())
        }
        fn captured_node(&self) -> Result<u64, CudaError> {
            Ok(self.capturing.lock().unwrap().as_ref().map_or(0, |c| c.len() as u64 - 1))
        }
        fn capture_end(&self) -> Result<u64, CudaError> {
            let captured = self.capturing.lock().unwrap().take().unwrap_or_default();
            if self.refuse_capture {
                return Err(crate::call_error("cuStreamEndCapture", "refused"));
            }
            let mut graphs = self.graphs.lock().unwrap();
            graphs.push(captured);
            Ok(graphs.len() as u64 - 1)
        }
        fn graph_launch(&self, graph: u64) -> Result<(), CudaError> {
            self.call(format!("graph {graph}"));
            Ok(())
        }
        fn graph_set_kernel(
            &self,
            graph: u64,
            node: u64,
            name: &str,
            _: Launch,
            args: &mut [Arg],
        ) -> Result<(), CudaError> {
            self.call(format!("set {graph} {node} {name} {}", words(args)));
            Ok(())
        }
        fn graph_destroy(&self, graph: u64) {
            self.destroyed.lock().unwrap().push(graph);
        }
    }

    const SHAPE: Launch = Launch { grid: 2, block: 32 };

    /// A small f32 product, as a step asks for.
    fn product() -> Gemm {
        Gemm {
            dtype: GemmType::F32,
            transa: false,
            transb: false,
            m: 8,
            n: 8,
            k: 8,
            alpha: 1.0,
            a: 1,
            lda: 8,
            stride_a: 0,
            b: 2,
            ldb: 8,
            stride_b: 0,
            beta: 0.0,
            c: 3,
            ldc: 8,
            stride_c: 0,
            batch: 1,
            bias: 0,
        }
    }

    /// A step: a product, a launch with a pointer and a step count, a copy, then a download.
    fn step(m: &Graphed, count: i64, pointer: u64) {
        m.gemm(&product()).unwrap();
        m.launch("adam", SHAPE, &mut [Arg::Ptr(pointer), Arg::I64(count)]).unwrap();
        m.copy(10, 20, 4).unwrap();
        m.download(0, &mut [0u8; 4]).unwrap();
    }

    fn graphed(on: bool, log: Log) -> (Arc<Log>, Graphed) {
        let log = Arc::new(log);
        let graphed = Graphed::with(log.clone(), on);
        (log, graphed)
    }

    #[test]
    fn off_every_op_is_queued_at_once_and_counted() {
        let (log, m) = graphed(false, Log::default());
        step(&m, 1, 100);
        assert_eq!(log.take(), ["gemm 8", "launch adam Ptr(100),I64(1)", "copy 10 20 4", "download"]);
        let counts = m.launches();
        assert_eq!((counts.asked, counts.queued, counts.graph_launches, counts.on), (3, 3, 0, false));
    }

    #[test]
    fn a_chunk_runs_alone_first_is_captured_the_second_time_and_replayed_with_new_numbers() {
        let (log, m) = graphed(true, Log::default());
        step(&m, 1, 100);
        // Seen once: queued op by op, before the download that ends the chunk.
        assert_eq!(log.take(), ["gemm 8", "launch adam Ptr(100),I64(1)", "copy 10 20 4", "download"]);
        step(&m, 2, 100);
        // The second time: captured (nothing runs op by op) and launched.
        assert_eq!(log.take(), ["graph 0", "download"]);
        assert_eq!(log.graphs.lock().unwrap()[0], ["gemm 8", "launch adam Ptr(100),I64(2)", "copy 10 20 4"]);
        step(&m, 2, 100);
        // The same numbers: launched as it is.
        assert_eq!(log.take(), ["graph 0", "download"]);
        step(&m, 3, 100);
        // A new step count: its node (the launch, node 1) gets it before the launch.
        assert_eq!(log.take(), ["set 0 1 adam Ptr(100),I64(3)", "graph 0", "download"]);
        let c = m.launches();
        assert_eq!((c.asked, c.queued, c.graph_launches, c.replayed, c.captured, c.updated), (12, 6, 3, 9, 1, 1));
        // Another address is another structure: seen once, so op by op again.
        step(&m, 4, 200);
        assert_eq!(log.take(), ["gemm 8", "launch adam Ptr(200),I64(4)", "copy 10 20 4", "download"]);
    }

    #[test]
    fn a_call_that_must_follow_the_recorded_work_queues_it_first() {
        let (log, m) = graphed(true, Log::default());
        for boundary in 0..7 {
            // Each time another view: a structure seen once, queued op by op.
            let view = Strided::new(&[2 + boundary], &[1], 0).unwrap();
            m.launch("k", SHAPE, &mut [Arg::View(view)]).unwrap();
            match boundary {
                0 => m.free(1),
                1 => m.upload(0, &[1]).unwrap(),
                2 => m.upload_async(0, 0, 1).unwrap(),
                3 => m.event_record(1).unwrap(),
                4 => m.set_library_workspace(0, 1).unwrap(),
                5 => m.unmap(0, 1),
                _ => m.release(0, 1),
            }
            let calls = log.take();
            assert_eq!(calls.len(), 2, "{boundary}: {calls:?}");
            assert!(calls[0].starts_with("launch k"), "{boundary}: {calls:?}");
        }
        // Memory new to the GPU and a mark's state need no recorded work queued.
        m.launch("k", SHAPE, &mut []).unwrap();
        m.alloc(1).unwrap();
        m.event_done(1).unwrap();
        m.map(0, 1).unwrap();
        assert_eq!(log.take(), ["alloc", "event_done", "map"]);
        // A launch of no blocks runs nothing: passed straight on, not recorded.
        m.launch("empty", Launch { grid: 0, block: 32 }, &mut []).unwrap();
        assert_eq!(log.take(), ["launch empty "]);
    }

    #[test]
    fn chunks_grow_from_64_to_1024_ops_and_start_small_after_a_boundary() {
        let (log, m) = graphed(true, Log::default());
        let mut sizes = Vec::new();
        let mut run = 0;
        for i in 0..3000 {
            m.zero(i, 4).unwrap();
            run += 1;
            let queued = log.take().len();
            if queued > 0 {
                assert_eq!(queued, run, "a chunk is queued whole");
                sizes.push(run);
                run = 0;
            }
        }
        assert_eq!(sizes, [64, 256, 1024, 1024]);
        m.download(0, &mut []).unwrap();
        assert_eq!(log.take().len(), 3000 - 64 - 256 - 2048 + 1);
        for i in 0..64 {
            m.zero(10_000 + i, 4).unwrap();
        }
        assert_eq!(log.take().len(), 64, "after a boundary the first chunk is 64 ops again");
    }

    #[test]
    fn a_refused_capture_turns_graphs_off_and_runs_the_chunk_op_by_op() {
        let (log, m) = graphed(true, Log { refuse_capture: true, ..Log::default() });
        step(&m, 1, 100);
        log.take();
        step(&m, 2, 100);
        assert_eq!(log.take(), ["gemm 8", "launch adam Ptr(100),I64(2)", "copy 10 20 4", "download"]);
        let off = m.launches().off.unwrap_or_default();
        assert!(off.contains("capture failed") && off.contains("refused"), "{off}");
        step(&m, 3, 100);
        assert_eq!(log.take(), ["gemm 8", "launch adam Ptr(100),I64(3)", "copy 10 20 4", "download"]);
        assert_eq!(log.captures.load(std::sync::atomic::Ordering::Relaxed), 1, "off for the rest of the run");
        // Off, an op is queued at once, not recorded until a boundary.
        m.zero(1, 4).unwrap();
        assert_eq!(log.take(), ["zero 1 4"]);
        let c = m.launches();
        assert_eq!((c.asked, c.queued, c.graph_launches, c.captured), (10, 10, 0, 0));
    }

    #[test]
    fn the_least_recently_launched_graph_goes_beyond_the_most_kept() {
        let (log, m) = graphed(true, Log::default());
        for round in 0..2 {
            for i in 0..=MOST_GRAPHS as u64 {
                m.zero(i, 4).unwrap();
                m.download(0, &mut []).unwrap();
            }
            assert!(log.destroyed.lock().unwrap().is_empty() || round == 1);
        }
        assert_eq!(*log.destroyed.lock().unwrap(), [0], "the first captured goes when one too many is");
        assert_eq!(m.launches().captured, MOST_GRAPHS as u64 + 1);
    }

    #[test]
    fn only_one_turns_graphs_on() {
        use std::ffi::OsStr;
        assert!(asks_for_graphs(Some(OsStr::new("1"))));
        for value in [None, Some("0"), Some(""), Some("yes"), Some("11")] {
            assert!(!asks_for_graphs(value.map(OsStr::new)), "{value:?}");
        }
    }

    #[test]
    fn a_structure_is_everything_but_a_kernels_plain_numbers() {
        let view = |n: usize| Arg::View(Strided::new(&[n], &[1], 0).unwrap());
        let kernel = |name: &str, grid: u32, args: Vec<Arg>| Op::Kernel {
            name: name.into(),
            shape: Launch { grid, block: 32 },
            args,
        };
        let base = kernel("k", 2, vec![Arg::Ptr(1), view(4), Arg::Words(vec![1, 2]), Arg::I32(1), Arg::F32(1.0)]);
        let numbers = kernel("k", 2, vec![Arg::Ptr(1), view(4), Arg::Words(vec![3, 4]), Arg::I32(2), Arg::F32(2.0)]);
        assert!(base.same_structure(&numbers), "plain numbers (and words) may differ");
        let hash = |op: &Op| {
            let mut h = DefaultHasher::new();
            op.hash_structure(&mut h);
            h.finish()
        };
        assert_eq!(hash(&base), hash(&numbers));
        let others = [
            kernel("j", 2, vec![Arg::Ptr(1), view(4), Arg::Words(vec![1, 2]), Arg::I32(1), Arg::F32(1.0)]),
            kernel("k", 3, vec![Arg::Ptr(1), view(4), Arg::Words(vec![1, 2]), Arg::I32(1), Arg::F32(1.0)]),
            kernel("k", 2, vec![Arg::Ptr(2), view(4), Arg::Words(vec![1, 2]), Arg::I32(1), Arg::F32(1.0)]),
            kernel("k", 2, vec![Arg::Ptr(1), view(5), Arg::Words(vec![1, 2]), Arg::I32(1), Arg::F32(1.0)]),
            kernel("k", 2, vec![Arg::Ptr(1), view(4), Arg::Words(vec![1]), Arg::I32(1), Arg::F32(1.0)]),
            kernel("k", 2, vec![Arg::Ptr(1), view(4), Arg::Words(vec![1, 2]), Arg::I64(1), Arg::F32(1.0)]),
            kernel("k", 2, vec![Arg::Ptr(1), view(4), Arg::Words(vec![1, 2]), Arg::I32(1)]),
            Op::Zero { dst: 1, bytes: 4 },
        ];
        for other in &others {
            assert!(!base.same_structure(other) && !other.same_structure(&base), "{other:?}");
            assert_ne!(hash(&base), hash(other), "{other:?}");
        }
        let zero = Op::Zero { dst: 1, bytes: 4 };
        assert!(zero.same_structure(&Op::Zero { dst: 1, bytes: 4 }));
        assert!(
            !zero.same_structure(&Op::Zero { dst: 1, bytes: 8 })
                && !zero.same_structure(&Op::Zero { dst: 2, bytes: 4 })
        );
        let copy = Op::Copy { dst: 1, src: 2, bytes: 4 };
        assert!(copy.same_structure(&Op::Copy { dst: 1, src: 2, bytes: 4 }));
        assert!(!copy.same_structure(&Op::Copy { dst: 1, src: 3, bytes: 4 }) && !copy.same_structure(&zero));
        // A product is all structure: any field differing (a scale, an address, a size).
        let g = Gemm { transb: true, ..product() };
        assert!(Op::Gemm(g).same_structure(&Op::Gemm(g)));
        for other in
            [Gemm { alpha: 2.0, ..g }, Gemm { c: 4, ..g }, Gemm { k: 9, ..g }, Gemm { dtype: GemmType::Bf16, ..g }]
        {
            assert!(!Op::Gemm(g).same_structure(&Op::Gemm(other)), "{other:?}");
            assert_ne!(hash(&Op::Gemm(g)), hash(&Op::Gemm(other)));
        }
    }

    #[test]
    fn plain_numbers_compare_by_their_bits() {
        let view = Arg::View(Strided::new(&[2], &[1], 0).unwrap());
        let pairs = [
            (Arg::I32(1), Arg::I32(2)),
            (Arg::I64(1), Arg::I64(2)),
            (Arg::U64(1), Arg::U64(2)),
            (Arg::Ptr(1), Arg::Ptr(2)),
            (Arg::F32(0.0), Arg::F32(-0.0)),
            (Arg::F64(0.0), Arg::F64(-0.0)),
            (view.clone(), Arg::View(Strided::new(&[3], &[1], 0).unwrap())),
            (Arg::Words(vec![1]), Arg::Words(vec![2])),
        ];
        for (a, b) in &pairs {
            assert!(same_bits(a, a) && !same_bits(a, b), "{a:?} {b:?}");
        }
        assert!(same_bits(&Arg::F32(f32::NAN), &Arg::F32(f32::NAN)), "a NaN is its own bits");
        assert!(!same_bits(&Arg::I32(1), &Arg::I64(1)));
    }

    #[test]
    fn every_other_call_is_the_machines_own() {
        let (log, m) = graphed(true, Log::default());
        assert_eq!((m.description(), m.max_blocks(), m.max_grid(), m.free_bytes().unwrap()), ("log".into(), 3, 5, 7));
        assert_eq!((m.pinned_alloc(1).unwrap(), m.event_create().unwrap(), m.reserve(1).unwrap()), (8192, 11, 13));
        assert!(!m.event_done(11).unwrap());
        m.event_wait(11).unwrap();
        m.event_destroy(11);
        m.pinned_free(8192);
        assert_eq!(log.take(), ["event_done", "event_wait", "event_destroy", "pinned_free"]);
        assert!(m.launches().on);
        assert_eq!(Machine::launches(&m), Some(m.launches()));
        // Whether products take a bias: the machine's answer, asked once a type, after what is recorded.
        m.zero(1, 4).unwrap();
        assert!(m.fuses_bias(GemmType::F32) && !m.fuses_bias(GemmType::Bf16) && m.fuses_bias(GemmType::F32));
        assert_eq!(log.take(), ["zero 1 4", "fuses F32", "fuses Bf16"]);
    }

    #[test]
    fn dropped_it_queues_what_is_recorded_and_destroys_its_graphs() {
        let (log, m) = graphed(true, Log::default());
        step(&m, 1, 100);
        step(&m, 2, 100);
        m.zero(1, 4).unwrap();
        log.take();
        drop(m);
        assert_eq!(log.take(), ["zero 1 4"]);
        assert_eq!(*log.destroyed.lock().unwrap(), [0]);
    }

    #[test]
    fn an_error_of_recorded_work_queued_by_free_is_returned_by_the_next_call() {
        let (_log, m) = graphed(true, Log::default());
        m.launch("broken", SHAPE, &mut []).unwrap();
        m.free(1);
        let e = m.download(0, &mut []).unwrap_err();
        assert!(e.to_string().contains("launching broken"), "{e}");
        m.download(0, &mut []).unwrap();
    }
}
