//! The `cuda` backend: every kernel of [`super::Backend`] as launches on a [`Machine`] — a GPU
//! opened through `memfit-cuda` (driver, cuBLAS and NVRTC found first, each missing one named), or,
//! with `MEMFIT_CUDA_EMULATOR=1`, the emulator that runs the same kernel sources on the host (how
//! CI tests this file).
//!
//! Each method lowers its tensors to device addresses (the storage's block plus the layout's
//! offset), checks the layouts the kernels assume, and launches. Matrix products go to cuBLAS
//! (column-major: a row-major `C = A B` is computed as `C^T = B^T A^T`, see [`Operand`]).
//! Data-dependent errors (an embedding index, a loss target out of range) are flagged by the
//! kernels in a status word at the end of the library workspace and reported at the next copy to
//! the host, the step's synchronisation.

use super::Backend;
use crate::device::DeviceKind;
use crate::error::{Error, Result};
use crate::ops::{
    attention_bits, bits_in_place, embedding_workspace_len, AdamStep, AttnProblem, Avg, Binary, Compare, ConvGeom,
    PoolGeom, SgdStep, Unary, EMBEDDING_SORT_TILE,
};
use crate::tensor::Tensor;
use crate::{DType, Products};
use memfit_cuda::{Arg, CudaSegments, Emulator, Gemm, GemmType, Gpu, Launch, Machine, Staging, Strided};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Threads a block for element-wise kernels and one-block-per-row kernels (their shared arrays
/// hold 256 values); reductions over a whole tensor in one block use [`WHOLE_BLOCK`].
const BLOCK: u32 = 256;
const WHOLE_BLOCK: u32 = 1024;
/// optim.cu's ADAM_LIST: the tensors of one `adam_list_f32` or `unscale_list_f32` launch.
const ADAM_LIST: usize = 48;
/// Warps of a block of the two-pass column sums (common.cuh's `COLUMN_WARPS`).
const COLUMN_WARPS: u32 = 8;
/// The two-pass column sums' row splits: at most this many, of at least [`COLUMN_SPLIT_ROWS`] rows.
const COLUMN_SPLITS: usize = 32;
const COLUMN_SPLIT_ROWS: usize = 128;

/// How [`Cuda::column_split`] splits a column sum: `splits` row ranges of `per` rows, partials at
/// `scratch`, the first pass's launch.
struct ColumnSplit {
    splits: usize,
    per: usize,
    scratch: u64,
    launch: Launch,
}
/// Threads of a block of the tiled kernels (attention.cu's `TILE_THREADS`).
const TILE_THREADS: u32 = 128;
/// Bytes at the end of the library workspace kept for the status word (cuBLAS gets the rest).
const STATUS_BYTES: u64 = 512;

/// Checks, in milliseconds, that GPU `ordinal` can be used: its libraries load and it exists.
pub(crate) fn probe(ordinal: u32) -> Result<()> {
    if memfit_cuda::emulator::requested() {
        return Ok(());
    }
    memfit_cuda::Gpu::check(ordinal).map_err(|e| refused(ordinal, e))
}

pub(crate) fn open(ordinal: u32) -> Result<super::Opened> {
    let (machine, context_bytes, free): (Arc<dyn Machine>, Option<u64>, u64) = if memfit_cuda::emulator::requested() {
        let emulator = Emulator::open().map_err(|e| refused(ordinal, e))?;
        let free = emulator.free_bytes().map_err(|e| refused(ordinal, e))?;
        (Arc::new(emulator), None, free)
    } else {
        let gpu = Gpu::open(ordinal).map_err(|e| refused(ordinal, e))?;
        let (context, free) = (gpu.context_bytes, gpu.free_bytes);
        (Arc::new(gpu), context, free)
    };
    // Every call on the machine goes through its graphs (Note [CUDA graphs] in memfit-cuda): on
    // with `MEMFIT_CUDA_GRAPHS=1`, else a pass-through that counts the work.
    let machine: Arc<dyn Machine> = Arc::new(memfit_cuda::Graphed::new(machine));
    Ok(super::Opened {
        description: Some(machine.description()),
        segments: Box::new(CudaSegments::new(machine.clone())),
        kernels: Box::new(Cuda {
            staging: Staging::new(machine.clone()),
            machine,
            status: AtomicU64::new(0),
            workspace: AtomicU64::new(0),
            rounding: Default::default(),
            tensor_cores: Default::default(),
            used: Default::default(),
            ordinal,
        }),
        context_bytes,
        free_bytes: Some(free),
    })
}

fn refused(ordinal: u32, e: memfit_cuda::CudaError) -> Error {
    Error::device(format!("--device {}: {e}", DeviceKind::Cuda(ordinal)))
}

/// The cuda kernels of one device.
pub(crate) struct Cuda {
    machine: Arc<dyn Machine>,
    /// Device address of the status word (set when the device gives the library its workspace):
    /// `[0]` an embedding position + 1 whose index was out of range, `[1]` a loss row + 1 whose
    /// target was, `[2]` (as i32) unscale's found-inf flag.
    status: AtomicU64,
    /// Device address of the library workspace's first byte (set with `status`).
    workspace: AtomicU64,
    /// The workspace rounded products round their operands into (`memfit_cuda::rounded`): address
    /// and bytes, while the device's products are rounded (`Backend::use_rounding_workspace`).
    rounding: std::sync::Mutex<Option<(u64, usize)>>,
    /// The tensor cores' check for bf16 (0) and fp16 (1) operands: run once, before the first
    /// attention on them; true when the GPU's `mma` gave the product (attention.cu's `mma_check`).
    tensor_cores: [OnceLock<bool>; 2],
    /// The alternative kernels run so far (`Backend::kernels_used`).
    used: std::sync::Mutex<std::collections::BTreeSet<&'static str>>,
    ordinal: u32,
    /// Pinned host buffers batches are uploaded through.
    staging: Staging,
}

/// The dtype suffix of a float kernel (`f32` or `f64`), or an error naming the op.
fn float(op: &str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        other => Err(Error::dtype(format!("{op} on cuda supports f32 and f64, not {other}"))),
    }
}

/// A float kernel argument in the tensor's dtype.
fn scalar(dtype: DType, v: f64) -> Arg {
    match dtype {
        DType::F32 => Arg::F32(v as f32),
        _ => Arg::F64(v),
    }
}

/// The device address of a tensor's first element.
fn addr(t: &Tensor) -> Result<u64> {
    let base = t.storage().ptr()?.as_ptr() as usize as u64;
    Ok(base + (t.layout().offset() * t.dtype().size()) as u64)
}

/// The address of a tensor the kernel reads or writes densely in row-major order.
fn dense(t: &Tensor, what: &str) -> Result<u64> {
    if !t.is_contiguous() {
        return Err(Error::invalid(format!("{what} on cuda needs a contiguous tensor, got {:?}", t.layout())));
    }
    addr(t)
}

fn dense_opt(t: Option<&Tensor>, what: &str) -> Result<u64> {
    t.map_or(Ok(0), |t| dense(t, what))
}

/// The address of a tensor's storage start and its view (element offsets from it).
fn strided(t: &Tensor, shape: &[usize], strides: &[usize]) -> Result<(u64, Strided)> {
    let base = t.storage().ptr()?.as_ptr() as usize as u64;
    let view = Strided::new(shape, strides, t.layout().offset())
        .ok_or_else(|| Error::invalid(format!("cuda kernels take tensors of at most 8 dims, not {:?}", shape)))?;
    Ok((base, view))
}

/// `shape` and each operand's `strides` over it with fewer dims and the same offsets element by
/// element (row-major order): dims of size 1 dropped, and each dim merged into the one before it
/// where they follow one another in every operand (`stride[d] == stride[d + 1] * shape[d + 1]`).
/// Two dense operands of one shape become one dim of stride 1, which the kernels' `strided_offset`
/// reads without dividing (its 64-bit division a dim and an element, three dims, made GPT-2's
/// residual additions run at 1 TB/s on an H200, 150 us each). A shape with no elements is kept.
fn coalesced<const N: usize>(shape: &[usize], strides: [&[usize]; N]) -> (Vec<usize>, [Vec<usize>; N]) {
    if shape.contains(&0) {
        return (shape.to_vec(), strides.map(<[usize]>::to_vec));
    }
    let mut dims: Vec<usize> = Vec::with_capacity(shape.len());
    let mut merged: [Vec<usize>; N] = std::array::from_fn(|_| Vec::with_capacity(shape.len()));
    for (d, &n) in shape.iter().enumerate().filter(|&(_, &n)| n != 1) {
        let follows = !dims.is_empty() && (0..N).all(|i| merged[i].last() == Some(&(strides[i][d] * n)));
        if follows {
            *dims.last_mut().expect("a dim before") *= n;
            for (m, s) in merged.iter_mut().zip(&strides) {
                *m.last_mut().expect("a dim before") = s[d];
            }
        } else {
            dims.push(n);
            for (m, s) in merged.iter_mut().zip(&strides) {
                m.push(s[d]);
            }
        }
    }
    (dims, merged)
}

/// `t`'s strides as seen through broadcasting to `shape` (leading dims added, size-1 dims stride 0).
fn broadcast_strides(t: &Tensor, shape: &[usize]) -> Vec<usize> {
    let (rank, lead) = (shape.len(), shape.len() - t.rank());
    (0..rank).map(|d| if d < lead || t.shape()[d - lead] == 1 { 0 } else { t.layout().strides()[d - lead] }).collect()
}

/// One operand of a row-major product `[rows, cols]` with element strides `(row, col)`, as cuBLAS
/// sees it: column-major storage read transposed or not, with its leading dimension.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Operand {
    address: u64,
    trans: bool,
    ld: usize,
}

impl Operand {
    /// The row-major matrix `[rows, cols]` at `address` with strides `(rs, cs)`, which the
    /// column-major product uses as its transpose: unit column stride reads it as is (`N`, ld = rs),
    /// unit row stride reads it transposed (`T`, ld = cs). None for any other layout.
    fn of(address: u64, rows: usize, cols: usize, rs: usize, cs: usize) -> Option<Operand> {
        // A dim of size 1 has any stride; give it the one that makes the layout dense.
        let cs = if cols == 1 { 1 } else { cs };
        let rs = if rows == 1 { cols.max(1) } else { rs };
        if cs == 1 && rs >= cols {
            Some(Operand { address, trans: false, ld: rs.max(1) })
        } else if rs == 1 {
            let cs = if cols == 1 { rows.max(1) } else { cs };
            (cs >= rows).then_some(Operand { address, trans: true, ld: cs.max(1) })
        } else {
            None
        }
    }
}

/// The suffix of the kernels that write a product's rounded operand bits (`unary_operands_bf16`,
/// `layer_norm_operands_f16`, ...) for activations of `sfx`'s dtype that only a product under
/// `products` reads: where that product rounds f32 operands; None where it reads them as they are.
fn operand_bits(sfx: &str, products: Products) -> Option<&'static str> {
    match (sfx, products) {
        ("f32", Products::Bf16) => Some("bf16"),
        ("f32", Products::F16) => Some("f16"),
        _ => None,
    }
}

/// The error for an input saved in 16 bits that reaches a fused op's backward without rounded
/// products (the op layer hands one over only with them: `ops::saved_in_operand_format`).
fn unrounded_saved_input(op: &str) -> Error {
    Error::invalid(format!("internal: {op}: an input saved in 16 bits without rounded products"))
}

/// The address of cross-entropy's per-row losses in its workspace (the op's `gpu_workspace`: one
/// value of the logits' dtype a row), checked.
fn loss_rows(ws: Option<&Tensor>, logits: &Tensor) -> Result<u64> {
    let n = logits.shape()[0];
    let ws = ws.ok_or_else(|| Error::device("cross_entropy: no workspace for the cuda kernels".to_string()))?;
    if ws.numel() < n || ws.dtype() != logits.dtype() {
        return Err(Error::device(format!("cross_entropy: a workspace of {} for {n} rows", ws.numel())));
    }
    dense(ws, "cross_entropy")
}

/// Whether an operand of `dtype` in a product of `other`'s dtype holds rounded operand bits already
/// (a 16-bit operand with an f32 one, under the products that round f32 to it: the chunked head's
/// gradient on a GPU); an error for any other mix of dtypes.
fn operand_dtype(dtype: DType, other: DType, products: Products, op: &str) -> Result<bool> {
    match (dtype, other, products) {
        (d, o, _) if d == o => Ok(false),
        (DType::BF16, DType::F32, Products::Bf16) | (DType::F16, DType::F32, Products::F16) => Ok(true),
        (d, o, p) => {
            Err(Error::dtype(format!("{op} on cuda: {} with {} under {} products", d.name(), o.name(), p.name())))
        }
    }
}

/// `c[m, n] = a[m, k] b[k, n]` (row-major, `c` dense with row stride `n`), `batch` times with the
/// given element strides between matrices, `beta` times what `c` holds added.
#[allow(clippy::too_many_arguments)]
fn product(
    dtype: GemmType,
    (m, n, k): (usize, usize, usize),
    a: Operand,
    b: Operand,
    c: u64,
    (stride_a, stride_b, stride_c, batch): (usize, usize, usize, usize),
    beta: f64,
) -> Gemm {
    Gemm {
        dtype,
        transa: b.trans,
        transb: a.trans,
        m: n,
        n: m,
        k,
        alpha: 1.0,
        a: b.address,
        lda: b.ld,
        stride_a: stride_b,
        b: a.address,
        ldb: a.ld,
        stride_b: stride_a,
        beta,
        c,
        ldc: n.max(1),
        stride_c,
        batch,
        bias: 0,
    }
}

/// How cuBLAS multiplies `dtype` for a device computing `products` (bf16 and fp16 products of f32
/// only, as on the cpu).
fn gemm_type(op: &str, dtype: DType, products: Products) -> Result<GemmType> {
    match dtype {
        DType::F32 if products == Products::Bf16 => Ok(GemmType::F32Bf16),
        DType::F32 if products == Products::F16 => Ok(GemmType::F32F16),
        DType::F32 => Ok(GemmType::F32),
        DType::F64 => Ok(GemmType::F64),
        other => Err(Error::dtype(format!("{op} on cuda supports f32 and f64, not {other}"))),
    }
}

fn operand(t: &Tensor, address: u64, rows: usize, cols: usize, rs: usize, cs: usize, op: &str) -> Result<Operand> {
    Operand::of(address, rows, cols, rs, cs).ok_or_else(|| {
        Error::invalid(format!(
            "{op} on cuda: an operand of shape {:?} with strides {:?} has no unit stride (make it contiguous first)",
            t.shape(),
            t.layout().strides()
        ))
    })
}

// Note [Held operands]
// ~~~~~~~~~~~~~~~~~~~~
// A rounded product rounds its f32 operands into the rounding workspace first (`memfit_cuda::rounded`).
// An op whose products share an operand rounds it once instead: the fused ops' weight, read by
// every block of rows; a block's output gradient, read by its weight gradient and its input
// gradient. `Cuda::hold` rounds it into the workspace's top, 256-byte aligned, and the products
// read the copy as an operand rounded already while their own roundings use the rest (at least half
// the workspace, less the under 128 elements that align the copies where its size is not a multiple
// of 128: an operand that would leave less is not held, and its products round it as before).
// Which ran is recorded (`kernels_used`: `products: shared operands rounded once`, and `bias: summed
// as its gradient is rounded` where `Cuda::hold_summing` takes a bias gradient's column sums from
// the same reading). The copy holds the bits the product's own rounding would have made, so the numbers do
// not change; nothing is allocated, so neither do the peaks. A copy stays valid while the op's
// launches run in stream order, each later rounding written elsewhere.

/// What an op holds at the rounding workspace's top (Note [Held operands]): its 16-bit elements,
/// a multiple of [`HELD_ALIGN`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    taken: usize,
}

/// Elements (256 bytes) each held copy starts at a multiple of from the workspace's start.
const HELD_ALIGN: usize = 128;

impl Held {
    /// The workspace's elements below the held copies, for the products' own roundings: all of
    /// `capacity` while nothing is held. The last copy held starts there.
    fn room(self, capacity: usize) -> usize {
        if self.taken == 0 {
            capacity
        } else {
            (capacity / HELD_ALIGN * HELD_ALIGN).saturating_sub(self.taken)
        }
    }

    /// What is held with a copy of `len` more elements in a workspace of `capacity`, or None where
    /// that would leave the products less than half of it.
    fn with(self, len: usize, capacity: usize) -> Option<Held> {
        let taken = (self.taken + len).next_multiple_of(HELD_ALIGN);
        (taken <= capacity / 2).then_some(Held { taken })
    }
}

/// A weight `[out_f, in_f]` as an op's products read it: the tensor, or its rounded copy held in the
/// rounding workspace (dense, Note [Held operands]).
#[derive(Clone, Copy)]
struct Weight<'a> {
    tensor: &'a Tensor,
    copy: Option<u64>,
}

impl Weight<'_> {
    /// `(out_f, in_f)`.
    fn shape(&self) -> (usize, usize) {
        (self.tensor.shape()[0], self.tensor.shape()[1])
    }

    /// Where its elements are, and its element strides.
    fn at(&self) -> Result<(u64, [usize; 2])> {
        match self.copy {
            Some(copy) => Ok((copy, [self.shape().1, 1])),
            None => {
                let ws = self.tensor.layout().strides();
                Ok((addr(self.tensor)?, [ws[0], ws[1]]))
            }
        }
    }
}

/// An operand of a product where it lies, and whether it holds the product's rounded operand bits
/// already ([`Cuda::gemm_with`]).
#[derive(Clone, Copy)]
struct Bits {
    address: u64,
    rounded: bool,
}

impl From<(u64, bool)> for Bits {
    fn from((address, rounded): (u64, bool)) -> Bits {
        Bits { address, rounded }
    }
}

impl From<Bits> for (u64, bool) {
    fn from(b: Bits) -> (u64, bool) {
        (b.address, b.rounded)
    }
}

impl Cuda {
    fn err(&self, e: memfit_cuda::CudaError) -> Error {
        refused(self.ordinal, e)
    }

    /// `n` elements' worth of blocks of `block` threads, at most the machine's useful grid.
    fn grid(&self, n: usize, block: u32) -> Launch {
        let blocks = n.div_ceil(block as usize).clamp(1, self.machine.max_blocks() as usize);
        Launch { grid: blocks as u32, block }
    }

    /// An Adam kernel over dense (param, grad, exp_avg, exp_avg_sq), one thread per element.
    fn adam_dense(&self, kernel: &str, tensors: [&Tensor; 4], step: AdamStep) -> Result<()> {
        let n = tensors[0].numel();
        let mut args = tensors.iter().map(|t| Ok(Arg::Ptr(dense(t, "adam_update")?))).collect::<Result<Vec<_>>>()?;
        args.extend([adam_args(step), Arg::I64(n as i64)]);
        self.launch(kernel, self.grid(n, BLOCK), &mut args)
    }

    /// One block of [`WHOLE_BLOCK`] threads per tile of 32 columns of a column sum (`tiles` of them).
    fn column_tiles(&self, tiles: usize) -> Launch {
        Launch { grid: tiles.clamp(1, self.machine.max_blocks() as usize) as u32, block: WHOLE_BLOCK }
    }

    /// One block of [`TILE_THREADS`] per tile of `rows` rows of each of `matrices` matrices (blocks
    /// beyond the machine's `max_grid` walk the rest).
    fn tiles(&self, matrices: usize, n: usize, rows: usize) -> Launch {
        let blocks = (matrices * n.div_ceil(rows)).clamp(1, self.machine.max_grid() as usize);
        Launch { grid: blocks as u32, block: TILE_THREADS }
    }

    fn launch(&self, name: &str, shape: Launch, args: &mut [Arg]) -> Result<()> {
        self.machine.launch(name, shape, args).map_err(|e| self.err(e))
    }

    /// `kernel(code, a, b, out)` element by element over `out`'s shape, `a` and `b` read through
    /// broadcasting strided views (the binary arithmetic and comparison kernels).
    fn broadcast_pair(&self, kernel: &str, code: i32, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        let (shape, [sa, sb]) =
            coalesced(out.shape(), [&broadcast_strides(a, out.shape()), &broadcast_strides(b, out.shape())]);
        let (pa, va) = strided(a, &shape, &sa)?;
        let (pb, vb) = strided(b, &shape, &sb)?;
        let n = out.numel();
        self.launch(
            kernel,
            self.grid(n, BLOCK),
            &mut [
                Arg::I32(code),
                Arg::Ptr(pa),
                Arg::View(va),
                Arg::Ptr(pb),
                Arg::View(vb),
                Arg::Ptr(dense(out, kernel)?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn gemm(&self, g: Gemm) -> Result<()> {
        self.gemm_with(g, [false; 2], Held::default())
    }

    /// [`Cuda::gemm`] of a rounded product whose operands `rounded` (`g.a`, `g.b`) hold their 16-bit
    /// bits already ([`Cuda::rounded_gemm`]), its own roundings below what `held` takes of the
    /// rounding workspace.
    fn gemm_with(&self, g: Gemm, rounded: [bool; 2], held: Held) -> Result<()> {
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(());
        }
        if g.k == 0 {
            // cuBLAS leaves C to beta * C; a product over nothing is zero.
            return if g.beta == 0.0 {
                let size = g.dtype.size();
                for i in 0..g.batch {
                    let c = g.c + (i * g.stride_c * size) as u64;
                    for col in 0..g.n {
                        self.machine.zero(c + (col * g.ldc * size) as u64, g.m * size).map_err(|e| self.err(e))?;
                    }
                }
                Ok(())
            } else {
                Ok(())
            };
        }
        if matches!(g.dtype, GemmType::F32Bf16 | GemmType::F32F16) {
            return self.rounded_gemm(&g, rounded, held);
        }
        if rounded.contains(&true) {
            return Err(Error::invalid(format!("internal: a {:?} product of operands rounded already", g.dtype)));
        }
        self.machine.gemm(&g).map_err(|e| self.err(e))
    }

    /// A bf16 or fp16 product of f32 operands: `memfit_cuda::rounded`'s steps, its operands rounded
    /// by `round_operands_*` into the rounding workspace (but those `rounded` already: `g.a`, `g.b`
    /// holding their 16-bit bits), then multiplied by the machine as 16-bit operands with f32
    /// accumulation. The roundings use the workspace below what `held` takes of it.
    fn rounded_gemm(&self, g: &Gemm, rounded: [bool; 2], held: Held) -> Result<()> {
        let (address, capacity) = self.rounding_workspace(g.dtype)?;
        let room = held.room(capacity);
        let steps = memfit_cuda::rounded::rounded_steps(g, rounded, address, room).ok_or_else(|| {
            Error::invalid(format!(
                "a {:?} product with a bias and a beta or a batch, or a rounding workspace of {room} elements",
                g.dtype
            ))
        })?;
        for launch in memfit_cuda::rounded::rounded_launches(steps) {
            match launch {
                memfit_cuda::rounded::RoundedLaunch::Round(a, b) => self.round(g.dtype, a, b)?,
                memfit_cuda::rounded::RoundedLaunch::Product(p) => self.machine.gemm(&p).map_err(|e| self.err(e))?,
            }
        }
        Ok(())
    }

    /// The rounding workspace of a `kind` product: its address and its capacity in 16-bit elements.
    fn rounding_workspace(&self, kind: GemmType) -> Result<(u64, usize)> {
        let workspace = *self.rounding.lock().unwrap_or_else(|e| e.into_inner());
        workspace.map(|(address, bytes)| (address, bytes / 2)).ok_or_else(|| {
            Error::invalid(format!(
                "a {kind:?} product on {} needs the rounding workspace the device allocates when its products \
                 become rounded (Device::set_products)",
                DeviceKind::Cuda(self.ordinal)
            ))
        })
    }

    /// One launch of data.cu's `round_operands_*` for a `kind` product: `a`, and `b` when given
    /// (its `struct Rounding`: a launch takes two where two come in a row, else one and a second of
    /// no columns).
    fn round(
        &self,
        kind: GemmType,
        a: memfit_cuda::rounded::RoundOperand,
        b: Option<memfit_cuda::rounded::RoundOperand>,
    ) -> Result<()> {
        let kernel = if kind == GemmType::F32Bf16 { "round_operands_bf16" } else { "round_operands_f16" };
        let words = |o: Option<memfit_cuda::rounded::RoundOperand>| {
            o.map_or(vec![0; 7], |o| {
                vec![o.src, o.rows as u64, o.cols as u64, o.ld as u64, o.stride as u64, o.batch as u64, o.dst]
            })
        };
        // A block per column, up to the machine's useful count.
        let columns = a.cols * a.batch + b.map_or(0, |b| b.cols * b.batch);
        self.launch(
            kernel,
            self.grid(columns * BLOCK as usize, BLOCK),
            &mut [Arg::Words(words(Some(a))), Arg::Words(words(b))],
        )
    }

    /// Rounds the `rows` dense rows of `width` f32 values at `src` once, for several of an op's `kind`
    /// products to read (Note [Held operands]): into the rounding workspace's top, below what `held`
    /// takes of it already, which then takes them too. The copy's address (dense, 16-bit), or None,
    /// rounding and holding nothing, where `kind` rounds nothing or the copy would leave the
    /// products less than half the workspace.
    fn hold(&self, kind: GemmType, src: u64, (rows, width): (usize, usize), held: &mut Held) -> Result<Option<u64>> {
        self.hold_summing(kind, src, (rows, width), held, None)
    }

    /// [`Cuda::hold`], and with `sums` (`Some((out, accumulate))`) the held rows' column sums
    /// written to `out` (added to it with `accumulate`) from the same reading: the rounding is
    /// `column_partials_rounding_*`, the partials' pass of the column sums (reduce.cu), then
    /// `column_finish_f32`. A held copy with sums only where [`Cuda::sums_as_held`] said so.
    fn hold_summing(
        &self,
        kind: GemmType,
        src: u64,
        (rows, width): (usize, usize),
        held: &mut Held,
        sums: Option<(u64, bool)>,
    ) -> Result<Option<u64>> {
        if !matches!(kind, GemmType::F32Bf16 | GemmType::F32F16) || rows == 0 || width == 0 {
            return Ok(None);
        }
        let (address, capacity) = self.rounding_workspace(kind)?;
        let Some(taken) = held.with(rows * width, capacity) else { return Ok(None) };
        let dst = address + 2 * taken.room(capacity) as u64;
        self.ran("products: shared operands rounded once");
        match sums {
            None => {
                let copy = memfit_cuda::rounded::RoundOperand {
                    src,
                    rows: width,
                    cols: rows,
                    ld: width,
                    stride: 0,
                    batch: 1,
                    dst,
                };
                self.round(kind, copy, None)?;
            }
            Some((out, accumulate)) => {
                let split = self.column_split_of(rows, width, "f32", 1, 1).ok_or_else(|| {
                    Error::invalid(format!("internal: no column split of {rows} x {width} for a held gradient's sums"))
                })?;
                let bits = if kind == GemmType::F32Bf16 { "bf16" } else { "f16" };
                self.column_partials(
                    &format!("column_partials_rounding_{bits}"),
                    src,
                    (rows, width),
                    &split,
                    Some(dst),
                )?;
                self.column_finish("f32", &split, width, split.scratch, out, accumulate)?;
                self.ran("bias: summed as its gradient is rounded");
            }
        }
        *held = taken;
        Ok(Some(dst))
    }

    /// Whether an op's blocks of at most `rows` rows of an f32 output gradient of `cols` columns,
    /// each held for its two `kind` products (below what `held` takes), can have their column sums
    /// (a bias gradient) taken as they are rounded ([`Cuda::hold_summing`]): the products round,
    /// the copy fits, and so do the partials.
    fn sums_as_held(&self, kind: GemmType, (rows, cols): (usize, usize), held: Held) -> Result<bool> {
        if !matches!(kind, GemmType::F32Bf16 | GemmType::F32F16) || rows == 0 || cols == 0 {
            return Ok(false);
        }
        let (_, capacity) = self.rounding_workspace(kind)?;
        Ok(held.with(rows * cols, capacity).is_some() && self.column_split_of(rows, cols, "f32", 1, 1).is_some())
    }

    /// Rounds attention's operands q, k, v (and the output's gradient `grad`, in backward) of a
    /// problem on `dtype` tensors into their copies in the op's `workspace` (`ops::attention_bits`),
    /// the tensor cores' kernels' `struct Bits` (attention.cu) of the copies' addresses and layouts.
    /// q, k and v may come as saved in the products' own 16-bit format (`ops::attention` under
    /// half-precision storage, Note [Attention's saved operands]): read in place where their rows
    /// allow (`ops::bits_in_place`), else copied as what restoring and rounding them would give.
    #[allow(clippy::too_many_arguments)]
    fn round_attention_operands(
        &self,
        dtype: DType,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        grad: Option<&Tensor>,
        pb: &AttnProblem,
        workspace: Option<&Tensor>,
    ) -> Result<Arg> {
        const NAME: &str = "scaled_dot_product_attention";
        let (operands, saved) = if pb.products == Products::F16 { ("f16", DType::F16) } else { ("bf16", DType::BF16) };
        // Backward's q, k and v saved in the products' own 16 bits (Note [Attention's saved
        // operands]) are read in place where their rows allow (`bits_in_place`; the op layer sized
        // the workspace so), else rounded into the workspace as the others are.
        let all_saved = [q, k, v].iter().all(|x| x.dtype() == saved);
        let in_place = all_saved && bits_in_place(pb);
        let layout = attention_bits(pb, dtype, grad.is_some(), in_place);
        if layout.len == 0 && !in_place {
            // No rows (or not the tensor cores' problem, which the caller never asks for).
            return Ok(Arg::Words(vec![0; 20]));
        }
        let base = match workspace.filter(|w| w.numel() >= layout.len) {
            _ if layout.len == 0 => 0,
            Some(ws) => dense(ws, NAME)?,
            None => {
                return Err(Error::device(format!(
                    "{NAME}: no workspace of {} rounded operands for the tensor cores",
                    layout.len
                )))
            }
        };
        if all_saved {
            self.ran("attention: operands read as saved in 16 bits");
        }
        if in_place {
            self.ran("attention: saved operands read in place");
        }
        let kernel = |x: &Tensor| match x.dtype() {
            t if t == dtype => Ok(format!("attention_round_{operands}")),
            t if t == saved => Ok(format!("attention_round_saved_{operands}")),
            t => Err(Error::dtype(format!("{NAME}: an operand of {t} for {operands} products of {dtype} tensors"))),
        };
        let d = pb.dims;
        // attention.cu's `struct Bits`: the four copies' addresses, then their layouts (elements).
        let (mut at, mut lays) = (Vec::with_capacity(4), Vec::with_capacity(16));
        let operands = [(Some(q), &pb.lay.q, d.tq, d.d, layout.q), (Some(k), &pb.lay.k, d.tk, d.d, layout.k)];
        let more = [(Some(v), &pb.lay.v, d.tk, d.dv, layout.v), (grad, &pb.lay.out, d.tq, d.dv, layout.g)];
        for (i, (x, lay, rows, width, offset)) in operands.into_iter().chain(more).enumerate() {
            let Some(x) = x else {
                at.push(0);
                lays.extend([0; 4]);
                continue;
            };
            if in_place && i < 3 {
                at.push(dense(x, NAME)?);
                lays.extend(addr_words(lay));
                continue;
            }
            // A copy [bh, rows, width rounded up to 8]: matrix b * heads + h at (b * heads + h) * rows * dp.
            let (dp, to) = (width.next_multiple_of(8), base + 2 * offset as u64);
            at.push(to);
            lays.extend([0, (d.heads * rows * dp) as u64, (rows * dp) as u64, dp as u64]);
            // A warp a row (attention.cu's round_rows).
            self.launch(
                &kernel(x)?,
                self.grid(d.bh * rows * 32, BLOCK),
                &mut [
                    Arg::Ptr(dense(x, NAME)?),
                    addr_arg(lay),
                    Arg::I64(d.bh as i64),
                    Arg::I64(d.heads as i64),
                    Arg::I64(rows as i64),
                    Arg::I64(width as i64),
                    Arg::Ptr(to),
                ],
            )?;
        }
        Ok(Arg::Words([at, lays].concat()))
    }

    fn status(&self) -> Result<u64> {
        match self.status.load(Ordering::Relaxed) {
            0 => Err(Error::device("the cuda device has no library workspace yet".to_string())),
            s => Ok(s),
        }
    }

    /// [`Cuda::attention_tiles`], and under `MEMFIT_REQUIRE_TENSOR_CORES=1` an error when a problem
    /// the tensor cores take (f32 tensors, bf16 or fp16 products, heads up to 128) would run on
    /// other kernels (which compute the same: only this says the tensor cores were left out).
    fn attention_kernels(&self, pb: &AttnProblem, dtype: DType) -> Result<Option<AttentionTiles>> {
        let chosen = self.attention_tiles(pb, dtype)?;
        if chosen.as_ref().is_some_and(|t| t.wide) {
            self.ran("attention: tensor cores, two tiles of rows a warp");
        }
        self.ran(match &chosen {
            Some(t) if t.kind == "mma" => "attention: tensor cores",
            Some(_) => "attention: CUDA cores, tiled",
            None => "attention: CUDA cores, a row per thread",
        });
        let theirs = attention_bits(pb, dtype, false, false).len > 0;
        if theirs && tensor_cores_required() && chosen.as_ref().is_none_or(|t| t.kind != "mma") {
            return Err(Error::device(format!(
                "--device {}: attention's {:?} products ran off the tensor cores and MEMFIT_REQUIRE_TENSOR_CORES=1",
                DeviceKind::Cuda(self.ordinal),
                pb.products
            )));
        }
        Ok(chosen)
    }

    /// The kernels for this attention problem: `tiled_head`'s, the tensor cores' only when their
    /// check passed on this device (else the CUDA cores' tiled kernels, which round the same
    /// operands) and `MEMFIT_CUDA_ATTENTION=cuda-cores` does not ask for the CUDA cores' (to time
    /// one against the other); `MEMFIT_CUDA_ATTENTION=wide`, the tensor cores' forward and dq
    /// with two tiles of rows a warp where the head is up to 64 (the same bits).
    fn attention_tiles(&self, pb: &AttnProblem, dtype: DType) -> Result<Option<AttentionTiles>> {
        let asked = attention_asked()?;
        let head = pb.dims.d.max(pb.dims.dv);
        let Some(tiles) = tiled_head(head, dtype, pb.products) else { return Ok(None) };
        if tiles.kind != "mma" {
            return Ok(Some(tiles));
        }
        if asked != Some(AttentionAsked::CudaCores) && self.tensor_cores_work(tiles.operands)? {
            return Ok(Some(if asked == Some(AttentionAsked::Wide) { tiles.wide() } else { tiles }));
        }
        Ok(tiled_head(head, dtype, Products::F32))
    }

    /// The error for attention whose q, k and v were kept in 16 bits (`saved`) for the tensor cores
    /// (Note [Attention's saved operands]), which failed their check on this GPU: only the tensor
    /// cores' kernels read them so.
    fn saved_off_tensor_cores(&self, saved: DType) -> Error {
        Error::device(format!(
            "--device {}: attention's inputs were kept in {saved} for the tensor cores, whose check failed on this \
             GPU; set MEMFIT_CUDA_ATTENTION=cuda-cores to train on the CUDA cores",
            DeviceKind::Cuda(self.ordinal)
        ))
    }

    /// Runs the tensor cores' check for `operands` ("bf16" or "f16") once (a warp's three products
    /// into the library workspace's first 1,536 bytes, read back) and says whether it passed; a failure is
    /// said once on stderr, or is an error with `MEMFIT_REQUIRE_TENSOR_CORES=1` (the tests' setting:
    /// a fallback would leave the tensor cores' kernels untested).
    fn tensor_cores_work(&self, operands: &str) -> Result<bool> {
        let cell = &self.tensor_cores[usize::from(operands == "f16")];
        if let Some(&works) = cell.get() {
            return Ok(works);
        }
        self.status()?;
        let out = self.workspace.load(Ordering::Relaxed);
        let kernel = format!("attention_mma_check_{operands}");
        self.launch(&kernel, Launch { grid: 1, block: 32 }, &mut [Arg::Ptr(out)])?;
        let mut bytes = [0u8; 4 * MMA_CHECK_VALUES];
        self.machine.download(out, &mut bytes).map_err(|e| self.err(e))?;
        let values: Vec<f32> =
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        let failure = mma_check_error(&values);
        if let Some(why) = failure.as_ref().filter(|_| tensor_cores_required()) {
            return Err(Error::device(format!(
                "--device {}: the tensor cores' check failed ({why}) and MEMFIT_REQUIRE_TENSOR_CORES=1",
                DeviceKind::Cuda(self.ordinal)
            )));
        }
        if let Some(why) = &failure {
            eprintln!(
                "memfit: warning: --device {}: the tensor cores' check failed ({why}); attention's {operands} products run on the CUDA cores instead",
                DeviceKind::Cuda(self.ordinal)
            );
        }
        Ok(*cell.get_or_init(|| failure.is_none()))
    }

    /// Reads and clears the status word; an error for an out-of-range index or target flagged
    /// since the last read.
    fn check_status(&self) -> Result<()> {
        let status = self.status()?;
        let mut bytes = [0u8; 16];
        self.machine.download(status, &mut bytes).map_err(|e| self.err(e))?;
        let word = |i: usize| i64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (index, target) = (word(0), word(1));
        if index == 0 && target == 0 {
            return Ok(());
        }
        self.machine.zero(status, 16).map_err(|e| self.err(e))?;
        if index != 0 {
            return Err(Error::invalid(format!(
                "embedding: the index at position {} is outside the table (indices must be in 0..rows)",
                index - 1
            )));
        }
        Err(Error::invalid(format!(
            "a loss target (row {}) is outside 0..classes: the labels do not match the model's outputs",
            target - 1
        )))
    }

    /// Copies `t` (any layout) into dense device memory at `dst`.
    fn gather(&self, t: &Tensor, dst: u64) -> Result<()> {
        let n = t.numel();
        if n == 0 {
            return Ok(());
        }
        let size = t.dtype().size();
        if t.is_contiguous() {
            return self.machine.copy(dst, addr(t)?, n * size).map_err(|e| self.err(e));
        }
        let (base, view) = strided(t, t.shape(), t.layout().strides())?;
        let name = format!("gather_b{size}");
        self.launch(
            &name,
            self.grid(n, BLOCK),
            &mut [Arg::Ptr(dst), Arg::Ptr(base), Arg::View(view), Arg::I64(n as i64)],
        )
    }

    /// How a product of `rows` rows into `out` gets `bias` (`cols` values): `(address, 0.0)` for the
    /// product's epilogue (an f32 contiguous bias, on a machine that fuses one into a product of
    /// `kind`, unless `MEMFIT_CUDA_BIAS_EPILOGUE=0`), else broadcast into `out` now and `(0, 1.0)`, the product
    /// adding onto it; `(0, 0.0)` without a bias. The same sum either way (the product plus the bias,
    /// rounded once).
    fn bias_for_product(
        &self,
        bias: Option<&Tensor>,
        kind: GemmType,
        rows: usize,
        cols: usize,
        out: u64,
    ) -> Result<(u64, f64)> {
        static BROADCAST: OnceLock<bool> = OnceLock::new();
        let broadcast =
            *BROADCAST.get_or_init(|| std::env::var_os("MEMFIT_CUDA_BIAS_EPILOGUE").is_some_and(|v| v == "0"));
        let Some(bias) = bias else { return Ok((0, 0.0)) };
        let fusable =
            bias.dtype() == DType::F32 && bias.layout().strides().first().is_none_or(|&s| s == 1 || cols <= 1);
        if fusable && !broadcast && self.machine.fuses_bias(kind) {
            self.ran("bias: in the product's epilogue (cuBLASLt)");
            return Ok((addr(bias)?, 0.0));
        }
        self.ran("bias: broadcast before the product");
        self.broadcast_rows(bias, rows, cols, out)?;
        Ok((0, 1.0))
    }

    /// Records that the alternative `what` ran (`Backend::kernels_used`).
    fn ran(&self, what: &'static str) {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).insert(what);
    }

    /// `out[r, :] = bias` for every row (before a product adds onto it).
    fn broadcast_rows(&self, bias: &Tensor, rows: usize, cols: usize, out: u64) -> Result<()> {
        let stride = bias.layout().strides().first().copied().unwrap_or(1);
        let name = format!("repeat_row_b{}", bias.dtype().size());
        self.launch(
            &name,
            self.grid(rows * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(out),
                Arg::Ptr(addr(bias)?),
                Arg::I64(stride as i64),
                Arg::I64(rows as i64),
                Arg::I64(cols as i64),
                Arg::I64(cols as i64),
            ],
        )
    }

    /// Column sums of dense `[rows, cols]` at `x` into `out` (`cols`), in the dtype's kernel.
    fn column_sums(&self, sfx: &str, x: u64, rows: usize, cols: usize, out: u64) -> Result<()> {
        self.sum_middle(sfx, x, (1, rows, cols), false, out)
    }

    /// The sums (or means) over the middle dim of dense `[outer, size, inner]` at `x` into `out`
    /// (`[outer, inner]`): a block per row of `size` values when inner is 1, else a block per 32
    /// columns.
    fn sum_middle(
        &self,
        sfx: &str,
        x: u64,
        (outer, size, inner): (usize, usize, usize),
        mean: bool,
        out: u64,
    ) -> Result<()> {
        let (outer_arg, size_arg, mean_arg) = (Arg::I64(outer as i64), Arg::I64(size as i64), Arg::I32(mean as i32));
        if inner == 1 {
            let shape = Launch { grid: outer.clamp(1, self.machine.max_blocks() as usize) as u32, block: BLOCK };
            return self.launch(
                &format!("sum_dim_rows_{sfx}"),
                shape,
                &mut [Arg::Ptr(x), outer_arg, size_arg, mean_arg, Arg::Ptr(out)],
            );
        }
        if let (1, false, Some(split)) = (outer, mean, self.column_split(size, inner, sfx, 1)) {
            self.column_partials(&format!("column_partials_{sfx}"), x, (size, inner), &split, None)?;
            return self.column_finish(sfx, &split, inner, split.scratch, out, false);
        }
        self.launch(
            &format!("sum_dim_cols_{sfx}"),
            self.column_tiles(outer * inner.div_ceil(32)),
            &mut [Arg::Ptr(x), outer_arg, size_arg, Arg::I64(inner as i64), mean_arg, Arg::Ptr(out)],
        )
    }

    /// The two-pass column sums' split (common.cuh's column_partials) of `rows` rows of `cols`
    /// columns into `arrays` partial arrays, in the library workspace (stream-ordered with cuBLAS,
    /// which uses it only inside its own launches); None where one pass serves (few rows) or the
    /// partials do not fit.
    fn column_split(&self, rows: usize, cols: usize, sfx: &str, arrays: usize) -> Option<ColumnSplit> {
        self.column_split_of(rows, cols, sfx, arrays, 2)
    }

    /// [`Cuda::column_split`] of at least `least` splits (1: the partials' pass even where one pass
    /// would serve, for a kernel that does more in it: `column_partials_rounding_*`).
    fn column_split_of(&self, rows: usize, cols: usize, sfx: &str, arrays: usize, least: usize) -> Option<ColumnSplit> {
        let size = if sfx == "f64" { 8 } else { 4 };
        let splits = rows.div_ceil(COLUMN_SPLIT_ROWS).min(COLUMN_SPLITS);
        let per = rows.div_ceil(splits.max(1));
        let splits = rows.div_ceil(per.max(1));
        let scratch = self.workspace.load(Ordering::Relaxed);
        let bytes = (arrays * splits * cols * size) as u64;
        if splits < least || scratch == 0 || bytes > memfit_cuda::LIBRARY_WORKSPACE_BYTES - STATUS_BYTES {
            return None;
        }
        let blocks = u32::try_from(cols.div_ceil(32) * splits).ok()?;
        let launch = Launch { grid: blocks, block: 32 * COLUMN_WARPS };
        Some(ColumnSplit { splits, per, scratch, launch })
    }

    /// The two-pass column sums' first pass by `kernel` over dense `[rows, cols]` at `x` into the
    /// split's partials: `column_partials_*`, or `column_partials_rounding_*`, which also writes x's
    /// operand bits to `copy`.
    fn column_partials(
        &self,
        kernel: &str,
        x: u64,
        (rows, cols): (usize, usize),
        split: &ColumnSplit,
        copy: Option<u64>,
    ) -> Result<()> {
        let mut args = vec![
            Arg::Ptr(x),
            Arg::I64(rows as i64),
            Arg::I64(cols as i64),
            Arg::I64(split.per as i64),
            Arg::Ptr(split.scratch),
        ];
        args.extend(copy.map(Arg::Ptr));
        self.launch(kernel, split.launch, &mut args)
    }

    /// The two-pass column sums' second pass: `out` (+= with `accumulate`) the partials at `part`.
    fn column_finish(
        &self,
        sfx: &str,
        split: &ColumnSplit,
        cols: usize,
        part: u64,
        out: u64,
        accumulate: bool,
    ) -> Result<()> {
        self.launch(
            &format!("column_finish_{sfx}"),
            self.grid(cols, BLOCK),
            &mut [
                Arg::Ptr(part),
                Arg::I64(split.splits as i64),
                Arg::I64(cols as i64),
                Arg::I32(accumulate as i32),
                Arg::Ptr(out),
            ],
        )
    }

    /// A layer norm's weight and bias gradients (each when its address is not 0) over `rows` rows of
    /// `d` from its input `x` (with `saved`, f32 saved in those 16 bits: [`Cuda::saved_input`]),
    /// statistics and output gradient `g`: in two passes where [`Cuda::column_split`] gives a
    /// split, else in one; added to the gradients with `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_wb(
        &self,
        (sfx, saved): (&str, Option<&str>),
        [x, mean, rstd, g]: [u64; 4],
        rows: usize,
        d: usize,
        [gw, gb]: [u64; 2],
        accumulate: bool,
    ) -> Result<()> {
        // Both kernels' first arguments.
        let inputs =
            [Arg::Ptr(x), Arg::Ptr(mean), Arg::Ptr(rstd), Arg::Ptr(g), Arg::I64(rows as i64), Arg::I64(d as i64)];
        if let Some(split) = self.column_split(rows, d, sfx, 2) {
            let size = if sfx == "f64" { 8 } else { 4 };
            let part_b = split.scratch + (split.splits * d * size) as u64;
            let parts = [if gw != 0 { split.scratch } else { 0 }, if gb != 0 { part_b } else { 0 }];
            let tail = [Arg::I64(split.per as i64), Arg::Ptr(parts[0]), Arg::Ptr(parts[1])];
            let kernel = saved
                .map_or(format!("layer_norm_wb_partials_{sfx}"), |bits| format!("layer_norm_wb_partials_saved_{bits}"));
            self.launch(&kernel, split.launch, &mut [&inputs[..], &tail].concat())?;
            // Both second passes in one launch (`column_finish_two_*`: each sum as `column_finish`'s).
            return self.launch(
                &format!("column_finish_two_{sfx}"),
                self.grid(2 * d, BLOCK),
                &mut [
                    Arg::Ptr(parts[0]),
                    Arg::Ptr(gw),
                    Arg::Ptr(parts[1]),
                    Arg::Ptr(gb),
                    Arg::I64(split.splits as i64),
                    Arg::I64(d as i64),
                    Arg::I32(accumulate as i32),
                ],
            );
        }
        let tail = [Arg::Ptr(gw), Arg::Ptr(gb), Arg::I32(accumulate as i32)];
        self.launch(
            &saved
                .map_or(format!("layer_norm_backward_wb_{sfx}"), |bits| format!("layer_norm_backward_wb_saved_{bits}")),
            self.column_tiles(d.div_ceil(32)),
            &mut [&inputs[..], &tail].concat(),
        )
    }

    /// `weight` as an op's `products` read it: held rounded for all of them (Note [Held operands])
    /// where it is dense, the products round it and `blocks` (of rows, a product each) > 1; else as
    /// it is.
    fn weight_for<'a>(
        &self,
        weight: &'a Tensor,
        products: Products,
        blocks: usize,
        held: &mut Held,
        op: &str,
    ) -> Result<Weight<'a>> {
        let kind = gemm_type(op, weight.dtype(), products)?;
        let copy = if blocks > 1 && weight.is_contiguous() {
            self.hold(kind, addr(weight)?, (weight.shape()[0], weight.shape()[1]), held)?
        } else {
            None
        };
        Ok(Weight { tensor: weight, copy })
    }

    /// `out[rows, out_f] (+)= x[rows, in_f] W^T` for a weight `[out_f, in_f]` of any unit-stride layout
    /// (`x_rounded`: x holds a rounded product's operand bits already, [`Cuda::gemm_with`]; `held`:
    /// what the op holds rounded, Note [Held operands]).
    #[allow(clippy::too_many_arguments)]
    fn times_weight_t(
        &self,
        (x, x_rounded): (u64, bool),
        rows: usize,
        weight: Weight,
        out: u64,
        (bias, beta): (u64, f64),
        (products, held): (Products, Held),
        op: &str,
    ) -> Result<()> {
        let (out_f, in_f) = weight.shape();
        let (address, ws) = weight.at()?;
        let a = Operand { address: x, trans: false, ld: in_f.max(1) };
        // W^T is [in_f, out_f] with strides (ws[1], ws[0]).
        let b = operand(weight.tensor, address, in_f, out_f, ws[1], ws[0], op)?;
        let kind = gemm_type(op, weight.tensor.dtype(), products)?;
        // cuBLAS's A is W, its B x ([`product`]).
        self.gemm_with(
            Gemm { bias, ..product(kind, (rows, out_f, in_f), a, b, out, (0, 0, 0, 1), beta) },
            [weight.copy.is_some(), x_rounded],
            held,
        )
    }

    /// The 16 bits ("bf16", "f16") that a fused op's backward input `x` is saved in, where the op
    /// layer hands it over as saved (`ops::saved_in_operand_format`: in the format its f32
    /// gradient's products round to; the kernels widen each element as restoring it would), said
    /// in `kernels_used` as `read`; None where x is in the gradient's dtype; an error for any other
    /// pairing.
    fn saved_input(
        &self,
        (op, read): (&str, &'static str),
        x: &Tensor,
        grad: DType,
        products: Products,
    ) -> Result<Option<&'static str>> {
        let bits = match (x.dtype(), grad, products) {
            (d, g, _) if d == g => return Ok(None),
            (DType::BF16, DType::F32, Products::Bf16) => "bf16",
            (DType::F16, DType::F32, Products::F16) => "f16",
            (d, g, p) => return Err(Error::dtype(format!("{op}: an input saved in {d} with {p:?} products of {g}"))),
        };
        self.ran(read);
        Ok(Some(bits))
    }

    /// GELU (erf) of `count` elements at `x` into `scratch`, for a product to read: as that product's
    /// rounded operand bits where `products` round f32 (`unary_operands_*`, two bytes an element: what
    /// the product would round the f32 values to, never written in f32), and then true; else in
    /// `sfx`'s dtype (`unary_*`). With `saved` ("bf16", "f16": the products' own), x is f32 saved
    /// in those 16 bits, read as restoring it would give it (`unary_operands_saved_*`).
    fn gelu_block(
        &self,
        sfx: &str,
        products: Products,
        (x, saved): (u64, Option<&str>),
        scratch: u64,
        count: usize,
    ) -> Result<bool> {
        let rounded = operand_bits(sfx, products);
        let kernel = match (rounded, saved) {
            (Some(bits), Some(_)) => format!("unary_operands_saved_{bits}"),
            (Some(bits), None) => format!("unary_operands_{bits}"),
            (None, None) => format!("unary_{sfx}"),
            (None, Some(_)) => return Err(unrounded_saved_input("gelu_linear_backward")),
        };
        let code = Arg::I32(unary_code(Unary::GeluErf));
        self.launch(
            &kernel,
            self.grid(count, BLOCK),
            &mut [code, Arg::Ptr(x), Arg::Ptr(scratch), Arg::I64(count as i64)],
        )?;
        Ok(rounded.is_some())
    }

    /// `out[rows, in_f] = g[rows, out_f] W` for a weight `[out_f, in_f]` (`g_rounded` and `held` as
    /// in [`Cuda::times_weight_t`]).
    fn times_weight(
        &self,
        (g, g_rounded): (u64, bool),
        rows: usize,
        weight: Weight,
        out: u64,
        (products, held): (Products, Held),
        op: &str,
    ) -> Result<()> {
        let (out_f, in_f) = weight.shape();
        let (address, ws) = weight.at()?;
        let a = Operand { address: g, trans: false, ld: out_f.max(1) };
        let b = operand(weight.tensor, address, out_f, in_f, ws[0], ws[1], op)?;
        let kind = gemm_type(op, weight.tensor.dtype(), products)?;
        let g = product(kind, (rows, in_f, out_f), a, b, out, (0, 0, 0, 1), 0.0);
        self.gemm_with(g, [weight.copy.is_some(), g_rounded], held)
    }

    /// A linear layer's output gradient and input as its weight gradient's product reads them, each
    /// marked where it holds the product's operand bits already (a 16-bit one of an f32 pair under
    /// the products that round f32 to it: the chunked head's gradient, an input saved in 16 bits).
    /// `gw` gives the pair's dtype (the parameter's).
    fn linear_operands(&self, op: &str, [grad, x, gw]: [&Tensor; 3], products: Products) -> Result<(Bits, Bits)> {
        let g = Bits { address: dense(grad, op)?, rounded: operand_dtype(grad.dtype(), gw.dtype(), products, op)? };
        let x = Bits { address: dense(x, op)?, rounded: operand_dtype(x.dtype(), gw.dtype(), products, op)? };
        if g.rounded && x.rounded {
            return Err(Error::invalid(format!("internal: {op}: both operands of a product rounded already")));
        }
        if x.rounded {
            self.ran("linear: input read as saved in 16 bits");
        }
        Ok((g, x))
    }

    /// `gw = g^T x` of `(rows, out_f, in_f)`, g read as `[held, given]` (its copy held rounded, else
    /// as given), and, when `gb` is given, the bias gradient (the given g's column sums, which need
    /// its f32 values).
    #[allow(clippy::too_many_arguments)]
    fn linear_weight_grad_of(
        &self,
        [g, given]: [Bits; 2],
        x: Bits,
        (rows, out_f, in_f): (usize, usize, usize),
        gw: &Tensor,
        gb: Option<&Tensor>,
        (products, held): (Products, Held),
    ) -> Result<()> {
        const NAME: &str = "linear_weight_grad";
        if given.rounded && gb.is_some() {
            return Err(Error::invalid(format!("internal: {NAME}: a bias gradient from a rounded gradient")));
        }
        // The f32 dtype of the pair (the gradient's: the parameter's).
        let dtype = gw.dtype();
        self.weight_grad(dtype, g.into(), x.into(), rows, out_f, in_f, dense(gw, NAME)?, 0.0, (products, held))?;
        if let Some(gb) = gb {
            self.column_sums(float(NAME, dtype)?, given.address, rows, out_f, dense(gb, NAME)?)?;
        }
        Ok(())
    }

    /// `gw[out_f, in_f] (+)= g[rows, out_f]^T x[rows, in_f]` (all dense, `dtype` x's; `g_rounded`,
    /// `x_rounded` and `held` as in [`Cuda::times_weight_t`]).
    #[allow(clippy::too_many_arguments)]
    fn weight_grad(
        &self,
        dtype: DType,
        (g, g_rounded): (u64, bool),
        (x, x_rounded): (u64, bool),
        rows: usize,
        out_f: usize,
        in_f: usize,
        gw: u64,
        beta: f64,
        (products, held): (Products, Held),
    ) -> Result<()> {
        let a = Operand { address: g, trans: true, ld: out_f.max(1) };
        let b = Operand { address: x, trans: false, ld: in_f.max(1) };
        let kind = gemm_type("a weight gradient", dtype, products)?;
        // cuBLAS's A is x, its B g ([`product`]).
        let g = product(kind, (out_f, in_f, rows), a, b, gw, (0, 0, 0, 1), beta);
        self.gemm_with(g, [x_rounded, g_rounded], held)
    }

    /// A block's output gradient `g` ([rows, out_f], dense) as its weight gradient and input gradient
    /// read it: held rounded for both (Note [Held operands]) where both are wanted and the products
    /// round it, with the address of its copy and true; else as it is.
    /// With `sums` (`Some((gb, accumulate))`, where [`Cuda::sums_as_held`] said so), the block's column
    /// sums go to the bias gradient `gb` as it is held.
    #[allow(clippy::too_many_arguments)]
    fn gradient_for(
        &self,
        g: u64,
        (rows, out_f): (usize, usize),
        both: bool,
        kind: GemmType,
        held: &mut Held,
        sums: Option<(u64, bool)>,
    ) -> Result<(u64, bool)> {
        let copy = if both { self.hold_summing(kind, g, (rows, out_f), held, sums)? } else { None };
        if sums.is_some() && copy.is_none() {
            return Err(Error::invalid("internal: a bias gradient to sum from a gradient not held"));
        }
        Ok(copy.map_or((g, false), |c| (c, true)))
    }

    /// A fused op's bias gradient `gb` from its output gradient `g` ([rows, cols]): the address to
    /// sum each block into as the block is held for its two products (`both`; blocks of at most
    /// `block` rows, [`Cuda::sums_as_held`]), or, where they are not held so, summed over all rows
    /// now and None.
    #[allow(clippy::too_many_arguments)]
    fn bias_sums(
        &self,
        sfx: &str,
        gb: Option<&Tensor>,
        g: u64,
        (rows, cols): (usize, usize),
        (both, block): (bool, usize),
        kind: GemmType,
        held: Held,
        op: &str,
    ) -> Result<Option<u64>> {
        let Some(gb) = gb else { return Ok(None) };
        if both && self.sums_as_held(kind, (block, cols), held)? {
            return Ok(Some(dense(gb, op)?));
        }
        self.column_sums(sfx, g, rows, cols, dense(gb, op)?)?;
        Ok(None)
    }
}

impl Backend for Cuda {
    fn launches(&self) -> Option<memfit_cuda::Launches> {
        self.machine.launches()
    }

    fn kernels_used(&self) -> Vec<String> {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|s| s.to_string()).collect()
    }

    fn use_rounding_workspace(&self, workspace: Option<(u64, u64)>) -> Result<()> {
        *self.rounding.lock().unwrap_or_else(|e| e.into_inner()) = workspace.map(|(a, b)| (a, b as usize));
        Ok(())
    }

    fn use_library_workspace(&self, address: u64, bytes: u64) -> Result<()> {
        let status = address + bytes - STATUS_BYTES;
        self.machine.set_library_workspace(address, (bytes - STATUS_BYTES) as usize).map_err(|e| self.err(e))?;
        self.machine.zero(status, STATUS_BYTES as usize).map_err(|e| self.err(e))?;
        self.status.store(status, Ordering::Relaxed);
        self.workspace.store(address, Ordering::Relaxed);
        Ok(())
    }

    fn fill_zeros(&self, t: &Tensor) -> Result<()> {
        self.machine.zero(dense(t, "fill_zeros")?, t.numel() * t.dtype().size()).map_err(|e| self.err(e))
    }

    fn fill(&self, t: &Tensor, value: f64) -> Result<()> {
        let sfx = float("full", t.dtype())?;
        let n = t.numel();
        if !t.is_contiguous() {
            let (base, view) = strided(t, t.shape(), t.layout().strides())?;
            return self.launch(
                &format!("fill_strided_{sfx}"),
                self.grid(n, BLOCK),
                &mut [Arg::Ptr(base), Arg::View(view), Arg::I64(n as i64), scalar(t.dtype(), value)],
            );
        }
        self.launch(
            &format!("fill_{sfx}"),
            self.grid(n, BLOCK),
            &mut [Arg::Ptr(dense(t, "full")?), Arg::I64(n as i64), scalar(t.dtype(), value)],
        )
    }

    fn count_up(&self, t: &Tensor) -> Result<()> {
        let n = t.numel();
        self.launch("count_up_i64", self.grid(n, BLOCK), &mut [Arg::Ptr(dense(t, "count_up")?), Arg::I64(n as i64)])
    }

    fn write_bytes(&self, t: &Tensor, bytes: &[u8]) -> Result<()> {
        self.machine.upload(dense(t, "a copy from the host")?, bytes).map_err(|e| self.err(e))
    }

    fn upload_with(&self, t: &Tensor, fill: &mut dyn FnMut(&mut [u8]), staged: bool) -> Result<()> {
        let dst = dense(t, "a copy from the host")?;
        let bytes = t.numel() * t.dtype().size();
        if !staged {
            return super::with_host_buffer(t, fill, |b| self.machine.upload(dst, b).map_err(|e| self.err(e)));
        }
        self.staging.upload(dst, bytes, fill).map_err(|e| self.err(e))
    }

    fn pinned_bytes(&self) -> (u64, u64) {
        self.staging.pinned_bytes()
    }

    fn read_bytes(&self, t: &Tensor, bytes: &mut [u8]) -> Result<()> {
        self.check_status()?;
        if t.is_contiguous() {
            return self.machine.download(addr(t)?, bytes).map_err(|e| self.err(e));
        }
        // A strided tensor: gathered on the device into host-bound order through a staging copy.
        let staging = self.machine.alloc(bytes.len().max(1)).map_err(|e| self.err(e))?;
        let result =
            self.gather(t, staging).and_then(|()| self.machine.download(staging, bytes).map_err(|e| self.err(e)));
        self.machine.free(staging);
        result
    }

    fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        self.gather(src, dense(dst, "copy")?)
    }

    fn unary(&self, op: Unary, x: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float(op.name(), x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("unary_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::I32(unary_code(op)),
                Arg::Ptr(dense(x, op.name())?),
                Arg::Ptr(dense(out, op.name())?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn unary_backward(&self, op: Unary, saved: Option<&Tensor>, grad: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float(op.name(), grad.dtype())?;
        let n = grad.numel();
        self.launch(
            &format!("unary_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::I32(unary_code(op)),
                Arg::Ptr(dense_opt(saved, op.name())?),
                Arg::Ptr(dense(grad, op.name())?),
                Arg::Ptr(dense(out, op.name())?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn affine(&self, x: &Tensor, scale: f64, shift: f64, out: &Tensor) -> Result<()> {
        let sfx = float("affine", x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("affine_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "affine")?),
                scalar(x.dtype(), scale),
                scalar(x.dtype(), shift),
                Arg::Ptr(dense(out, "affine")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        self.broadcast_pair(&format!("binary_{}", float(op.name(), a.dtype())?), binary_code(op), a, b, out)
    }

    fn compare(&self, op: Compare, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        self.broadcast_pair(&format!("compare_{}", float(op.name(), a.dtype())?), compare_code(op), a, b, out)
    }

    fn select(&self, cond: &Tensor, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("where", a.dtype())?;
        let shape = out.shape();
        let (pc, vc) = strided(cond, shape, &broadcast_strides(cond, shape))?;
        let (pa, va) = strided(a, shape, &broadcast_strides(a, shape))?;
        let (pb, vb) = strided(b, shape, &broadcast_strides(b, shape))?;
        let n = out.numel();
        self.launch(
            &format!("select_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(pc),
                Arg::View(vc),
                Arg::Ptr(pa),
                Arg::View(va),
                Arg::Ptr(pb),
                Arg::View(vb),
                Arg::Ptr(dense(out, "where")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn pow_scalar(&self, x: &Tensor, exponent: f64, out: &Tensor) -> Result<()> {
        let sfx = float("pow", x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("pow_scalar_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "pow")?),
                scalar(x.dtype(), exponent),
                Arg::Ptr(dense(out, "pow")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn pow_scalar_backward(&self, x: &Tensor, exponent: f64, grad: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("pow_backward", x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("pow_scalar_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "pow_backward")?),
                scalar(x.dtype(), exponent),
                Arg::Ptr(dense(grad, "pow_backward")?),
                Arg::Ptr(dense(out, "pow_backward")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn clamp(&self, x: &Tensor, lo: f64, hi: f64, out: &Tensor) -> Result<()> {
        let sfx = float("clamp", x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("clamp_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "clamp")?),
                scalar(x.dtype(), lo),
                scalar(x.dtype(), hi),
                Arg::Ptr(dense(out, "clamp")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn clamp_backward(&self, x: &Tensor, lo: f64, hi: f64, inclusive: bool, grad: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("clamp_backward", x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("clamp_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "clamp_backward")?),
                scalar(x.dtype(), lo),
                scalar(x.dtype(), hi),
                Arg::I32(inclusive as i32),
                Arg::Ptr(dense(grad, "clamp_backward")?),
                Arg::Ptr(dense(out, "clamp_backward")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn add_into(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let sfx = float("add_into", dst.dtype())?;
        let n = dst.numel();
        if src.is_contiguous() && dst.is_contiguous() {
            return self.launch(
                &format!("add_into_{sfx}"),
                self.grid(n, BLOCK),
                &mut [Arg::Ptr(dense(dst, "add_into")?), Arg::Ptr(addr(src)?), Arg::I64(n as i64)],
            );
        }
        if dst.is_contiguous() {
            // dst = dst + src through the broadcasting kernel (it reads each element before writing it).
            return self.binary(Binary::Add, dst, src, dst);
        }
        // A window of a larger tensor (a join's piece, a slice's gradient).
        let shape = dst.shape();
        let (pd, vd) = strided(dst, shape, dst.layout().strides())?;
        let (ps, vs) = strided(src, shape, src.layout().strides())?;
        self.launch(
            &format!("add_into_strided_{sfx}"),
            self.grid(n, BLOCK),
            &mut [Arg::Ptr(pd), Arg::View(vd), Arg::Ptr(ps), Arg::View(vs), Arg::I64(n as i64)],
        )
    }

    fn conv2d(
        &self,
        g: &ConvGeom,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
        workspace: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "conv2d";
        let sfx = float(NAME, x.dtype())?;
        let dtype = gemm_type(NAME, x.dtype(), g.products)?;
        let size = x.dtype().size() as u64;
        let (xp, wp, op) = (dense(x, NAME)?, dense(weight, NAME)?, dense(out, NAME)?);
        let (p, hw, og, kg, cg, groups) = (g.oh * g.ow, g.h * g.w, g.og(), g.kg(), g.cg(), g.groups);
        if let Some(bias) = bias {
            let (base, view) = strided(bias, &[g.n, g.o, p], &[0, bias.layout().strides()[0], 0])?;
            let n = g.n * g.o * p;
            let name = format!("gather_b{size}");
            self.launch(
                &name,
                self.grid(n, BLOCK),
                &mut [Arg::Ptr(op), Arg::Ptr(base), Arg::View(view), Arg::I64(n as i64)],
            )?;
        }
        let beta = if bias.is_some() { 1.0 } else { 0.0 };
        // Every group's weight rows [og, kg], one matrix a group.
        let w_g = Operand { address: wp, trans: false, ld: kg.max(1) };
        if g.direct {
            if groups == 1 {
                // Every sample in one product: out_n [o, p] = W [o, c] x_n [c, p].
                let x_all = Operand { address: xp, trans: false, ld: p.max(1) };
                return self.gemm(product(dtype, (og, p, kg), w_g, x_all, op, (0, g.c * hw, g.o * p, g.n), beta));
            }
            for n in 0..g.n {
                let x_g = Operand { address: xp + (n * g.c * hw) as u64 * size, trans: false, ld: p.max(1) };
                let out_n = op + (n * g.o * p) as u64 * size;
                self.gemm(product(dtype, (og, p, kg), w_g, x_g, out_n, (og * kg, cg * hw, og * p, groups), beta))?;
            }
            return Ok(());
        }
        let col = im2col_workspace(workspace)?;
        let per = g.per_lane.max(1);
        for LaneStep { j, lanes, r0, r1, tp, tile } in lane_steps(g) {
            let (x_j, out_j) = (xp + (j * g.c * hw) as u64 * size, op + (j * g.o * p) as u64 * size);
            self.launch(
                &format!("im2col_{sfx}"),
                self.grid(lanes * tile, BLOCK),
                &mut [Arg::Ptr(x_j), conv_words(g, r0, r1, lanes, per * g.c * hw, tile), Arg::Ptr(col)],
            )?;
            let c = out_j + (r0 * g.ow) as u64 * size;
            if groups == 1 {
                // The lanes' tiles in one product: out [o, tp] = W [o, kc] col_l [kc, tp].
                let col_all = Operand { address: col, trans: false, ld: tp.max(1) };
                let gemm = product(dtype, (og, tp, kg), w_g, col_all, c, (0, tile, per * g.o * p, lanes), beta);
                self.gemm(Gemm { ldc: p.max(1), ..gemm })?;
                continue;
            }
            for l in 0..lanes {
                let col_g = Operand { address: col + (l * tile) as u64 * size, trans: false, ld: tp.max(1) };
                let c_l = c + (l * per * g.o * p) as u64 * size;
                let gemm = product(dtype, (og, tp, kg), w_g, col_g, c_l, (og * kg, kg * tp, og * p, groups), beta);
                self.gemm(Gemm { ldc: p.max(1), ..gemm })?;
            }
        }
        Ok(())
    }

    fn conv2d_backward(
        &self,
        g: &ConvGeom,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        dx: Option<&Tensor>,
        dw: Option<&Tensor>,
        db: Option<&Tensor>,
        _partials: Option<&Tensor>,
        workspace: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "conv2d_backward";
        let sfx = float(NAME, grad.dtype())?;
        let dtype = gemm_type(NAME, grad.dtype(), g.products)?;
        let size = grad.dtype().size() as u64;
        let (xp, wp, gp) = (dense(x, NAME)?, dense(weight, NAME)?, dense(grad, NAME)?);
        let (dxp, dwp) = (dense_opt(dx, NAME)?, dense_opt(dw, NAME)?);
        let (p, hw, og, kg, cg, groups) = (g.oh * g.ow, g.h * g.w, g.og(), g.kg(), g.cg(), g.groups);
        if let Some(db) = db {
            // db[o] = the sum of grad over samples and pixels.
            let (base, kept) = strided(grad, &[g.o], &[p])?;
            let summed = Strided::new(&[g.n, p], &[g.o * p, 1], 0).expect("two dims");
            self.launch(
                &format!("sum_to_shape_{sfx}"),
                self.grid(g.o, BLOCK),
                &mut [
                    Arg::Ptr(base),
                    Arg::View(kept),
                    Arg::View(summed),
                    Arg::I64(g.o as i64),
                    Arg::I64((g.n * p) as i64),
                    Arg::Ptr(dense(db, NAME)?),
                ],
            )?;
        }
        if dxp != 0 && !g.direct {
            // col2im adds onto it.
            self.machine.zero(dxp, g.n * g.c * hw * size as usize).map_err(|e| self.err(e))?;
        }
        // W_g^T [kg, og] of every group (weight rows [og, kg]).
        let w_t = Operand { address: wp, trans: true, ld: kg.max(1) };
        // The weight gradient is written by its first product and added onto by the rest.
        let mut first = true;
        if g.direct {
            for n in 0..g.n {
                let (x_n, g_n) = (xp + (n * g.c * hw) as u64 * size, gp + (n * g.o * p) as u64 * size);
                if dwp != 0 {
                    // dw_g [og, kg] (+)= grad_g [og, p] x_g^T [p, kg].
                    let a = Operand { address: g_n, trans: false, ld: p.max(1) };
                    let b = Operand { address: x_n, trans: true, ld: p.max(1) };
                    let beta = if first { 0.0 } else { 1.0 };
                    self.gemm(product(dtype, (og, kg, p), a, b, dwp, (og * p, cg * hw, og * kg, groups), beta))?;
                    first = false;
                }
                if dxp != 0 && groups > 1 {
                    // dx_g [kg, p] = W_g^T [kg, og] grad_g [og, p].
                    let b = Operand { address: g_n, trans: false, ld: p.max(1) };
                    let c = dxp + (n * g.c * hw) as u64 * size;
                    self.gemm(product(dtype, (kg, p, og), w_t, b, c, (og * kg, og * p, cg * hw, groups), 0.0))?;
                }
            }
            if dxp != 0 && groups == 1 && g.n > 0 {
                // Every sample in one product: dx_n [c, p] = W^T [c, o] grad_n [o, p].
                let b = Operand { address: gp, trans: false, ld: p.max(1) };
                self.gemm(product(dtype, (kg, p, og), w_t, b, dxp, (0, g.o * p, g.c * hw, g.n), 0.0))?;
            }
        } else if dxp != 0 || dwp != 0 {
            let col = im2col_workspace(workspace)?;
            let per = g.per_lane.max(1);
            for LaneStep { j, lanes, r0, r1, tp, tile } in lane_steps(g) {
                let (x_j, g_j) = (xp + (j * g.c * hw) as u64 * size, gp + (j * g.o * p) as u64 * size);
                let words = conv_words(g, r0, r1, lanes, per * g.c * hw, tile);
                let g_tile = g_j + (r0 * g.ow) as u64 * size;
                let lane_grad = |l: usize| g_tile + (l * per * g.o * p) as u64 * size;
                if dwp != 0 {
                    self.launch(
                        &format!("im2col_{sfx}"),
                        self.grid(lanes * tile, BLOCK),
                        &mut [Arg::Ptr(x_j), words.clone(), Arg::Ptr(col)],
                    )?;
                    for l in 0..lanes {
                        // dw_g [og, kg] (+)= grad tile [og, tp] col_g^T [tp, kg].
                        let a = Operand { address: lane_grad(l), trans: false, ld: p.max(1) };
                        let b = Operand { address: col + (l * tile) as u64 * size, trans: true, ld: tp.max(1) };
                        let beta = if first { 0.0 } else { 1.0 };
                        let strides = (og * p, kg * tp, og * kg, groups);
                        self.gemm(product(dtype, (og, kg, tp), a, b, dwp, strides, beta))?;
                        first = false;
                    }
                }
                if dxp != 0 {
                    // col_g [kg, tp] = W_g^T [kg, og] grad tile [og, tp], then added onto dx.
                    if groups == 1 {
                        let b = Operand { address: g_tile, trans: false, ld: p.max(1) };
                        self.gemm(product(dtype, (kg, tp, og), w_t, b, col, (0, per * g.o * p, tile, lanes), 0.0))?;
                    } else {
                        for l in 0..lanes {
                            let b = Operand { address: lane_grad(l), trans: false, ld: p.max(1) };
                            let c = col + (l * tile) as u64 * size;
                            let strides = (og * kg, og * p, kg * tp, groups);
                            self.gemm(product(dtype, (kg, tp, og), w_t, b, c, strides, 0.0))?;
                        }
                    }
                    let dx_j = dxp + (j * g.c * hw) as u64 * size;
                    self.launch(
                        &format!("col2im_{sfx}"),
                        self.grid(lanes * g.c * hw, BLOCK),
                        &mut [Arg::Ptr(col), words, Arg::Ptr(dx_j)],
                    )?;
                }
            }
        }
        if dwp != 0 && g.n == 0 {
            self.machine.zero(dwp, g.o * kg * size as usize).map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    fn max_pool2d(
        &self,
        g: &PoolGeom,
        x: &Tensor,
        out: &Tensor,
        indices: Option<&Tensor>,
        positions: Option<&Tensor>,
        width: usize,
    ) -> Result<()> {
        const NAME: &str = "max_pool2d";
        let sfx = float(NAME, x.dtype())?;
        self.launch(
            &format!("max_pool2d_{sfx}"),
            self.grid(g.planes * g.oh * g.ow, BLOCK),
            &mut [
                Arg::Ptr(dense(x, NAME)?),
                pool_words(g),
                Arg::Ptr(dense(out, NAME)?),
                Arg::Ptr(dense_opt(indices, NAME)?),
                Arg::Ptr(dense_opt(positions, NAME)?),
                Arg::I32(width as i32),
            ],
        )
    }

    fn max_pool2d_backward(
        &self,
        g: &PoolGeom,
        width: usize,
        grad: &Tensor,
        positions: &Tensor,
        dx: &Tensor,
    ) -> Result<()> {
        const NAME: &str = "max_pool2d_backward";
        let sfx = float(NAME, grad.dtype())?;
        self.launch(
            &format!("max_pool2d_backward_{sfx}"),
            self.grid(g.planes * g.h * g.w, BLOCK),
            &mut [
                Arg::Ptr(dense(grad, NAME)?),
                Arg::Ptr(dense(positions, NAME)?),
                Arg::I32(width as i32),
                pool_words(g),
                Arg::Ptr(dense(dx, NAME)?),
            ],
        )
    }

    fn avg_pool2d(&self, g: &PoolGeom, kind: Avg, x: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float(kind.name(), x.dtype())?;
        self.launch(
            &format!("avg_pool2d_{sfx}"),
            self.grid(g.planes * g.oh * g.ow, BLOCK),
            &mut [
                Arg::Ptr(dense(x, kind.name())?),
                pool_words(g),
                Arg::I32(avg_code(kind)),
                Arg::Ptr(dense(out, kind.name())?),
            ],
        )
    }

    fn avg_pool2d_backward(&self, g: &PoolGeom, kind: Avg, grad: &Tensor, dx: &Tensor) -> Result<()> {
        let sfx = float(kind.name(), grad.dtype())?;
        self.launch(
            &format!("avg_pool2d_backward_{sfx}"),
            self.grid(g.planes * g.h * g.w, BLOCK),
            &mut [
                Arg::Ptr(dense(grad, kind.name())?),
                pool_words(g),
                Arg::I32(avg_code(kind)),
                Arg::Ptr(dense(dx, kind.name())?),
            ],
        )
    }

    fn dropout(&self, x: &Tensor, p: f64, seed: u64, out: &Tensor, mask: Option<&Tensor>) -> Result<()> {
        let sfx = float("dropout", x.dtype())?;
        let n = x.numel();
        self.launch(
            &format!("dropout_{sfx}"),
            self.grid(n.div_ceil(8), BLOCK),
            &mut [
                Arg::Ptr(dense(x, "dropout")?),
                Arg::F64(p),
                Arg::U64(memfit_cpu::dropout::mix(seed)),
                scalar(x.dtype(), 1.0 / (1.0 - p)),
                Arg::Ptr(dense(out, "dropout")?),
                Arg::Ptr(dense_opt(mask, "dropout")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn dropout_backward(&self, grad: &Tensor, mask: &Tensor, p: f64, gx: &Tensor) -> Result<()> {
        let sfx = float("dropout", grad.dtype())?;
        let n = grad.numel();
        self.launch(
            &format!("dropout_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(grad, "dropout")?),
                Arg::Ptr(dense(mask, "dropout")?),
                scalar(grad.dtype(), 1.0 / (1.0 - p)),
                Arg::Ptr(dense(gx, "dropout")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn embedding(&self, indices: &Tensor, weight: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("embedding", weight.dtype())?;
        let (rows, d) = (weight.shape()[0], weight.shape()[1]);
        let count = indices.numel();
        self.launch(
            &format!("embedding_{sfx}"),
            self.grid(count * d, BLOCK),
            &mut [
                Arg::Ptr(dense(indices, "embedding")?),
                Arg::I64(count as i64),
                Arg::Ptr(dense(weight, "embedding")?),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
                Arg::Ptr(dense(out, "embedding")?),
                Arg::Ptr(self.status()?),
            ],
        )
    }

    fn embedding_backward(&self, indices: &Tensor, grad: &Tensor, gw: &Tensor, ws: Option<&Tensor>) -> Result<()> {
        // Note [Embedding backward on a GPU] (embedding.cu): the positions sorted by row first.
        let sfx = float("embedding", grad.dtype())?;
        let (rows, d, count) = (gw.shape()[0], gw.shape()[1], indices.numel());
        let ws =
            ws.ok_or_else(|| Error::device("embedding_backward: no workspace for the cuda kernels".to_string()))?;
        if ws.numel() < embedding_workspace_len(rows, count) {
            return Err(Error::device(format!("embedding_backward: a workspace of {} for {rows} rows", ws.numel())));
        }
        let tiles = count.div_ceil(EMBEDDING_SORT_TILE);
        let tile_grid = u32::try_from(tiles)
            .map_err(|_| Error::device(format!("embedding_backward: {count} positions are too many to sort")))?;
        let (starts, idx) = (dense(ws, "embedding")?, dense(indices, "embedding")?);
        let slots = starts + 8 * (rows as u64 + 1);
        let spare = slots + 8 * count as u64;
        let hist = spare + 8 * count as u64;
        self.machine.zero(starts, 8 * (rows + 1)).map_err(|e| self.err(e))?;
        self.machine.zero(hist, 8).map_err(|e| self.err(e))?;
        let (count_arg, rows_arg) = (Arg::I64(count as i64), Arg::I64(rows as i64));
        self.launch(
            "embedding_count",
            self.grid(count, BLOCK),
            &mut [Arg::Ptr(idx), count_arg.clone(), rows_arg.clone(), Arg::Ptr(starts)],
        )?;
        self.launch(
            "embedding_scan",
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [Arg::Ptr(starts), Arg::I64(rows as i64 + 1)],
        )?;
        // A stable radix sort by row, 8 bits a pass, over keys up to `rows` (an index outside the
        // table sorts last); the passes alternate between the two buffers so the last one fills
        // `slots`. The first pass reads the positions in order (a null input).
        let passes = (u64::BITS - (rows as u64).leading_zeros()).div_ceil(8).max(1);
        let tile_launch = Launch { grid: tile_grid, block: EMBEDDING_SORT_TILE as u32 };
        let mut input = 0u64;
        for pass in 0..passes {
            let output = if (passes - 1 - pass) % 2 == 0 { slots } else { spare };
            let shift = Arg::I32(8 * pass as i32);
            let common = [Arg::Ptr(idx), count_arg.clone(), rows_arg.clone(), Arg::Ptr(input), shift];
            let mut digits = common.to_vec();
            digits.extend([Arg::I64(tiles as i64), Arg::Ptr(hist)]);
            self.launch("embedding_digits", tile_launch, &mut digits)?;
            self.launch(
                "embedding_scan",
                Launch { grid: 1, block: WHOLE_BLOCK },
                &mut [Arg::Ptr(hist), Arg::I64(1 + 256 * tiles as i64)],
            )?;
            let mut scatter = common.to_vec();
            scatter.extend([Arg::I64(tiles as i64), Arg::Ptr(hist), Arg::Ptr(output)]);
            self.launch("embedding_scatter", tile_launch, &mut scatter)?;
            input = output;
        }
        self.launch(
            &format!("embedding_backward_{sfx}"),
            self.grid(rows * d, BLOCK),
            &mut [
                Arg::Ptr(starts),
                Arg::Ptr(slots),
                Arg::Ptr(dense(grad, "embedding")?),
                rows_arg,
                Arg::I64(d as i64),
                Arg::Ptr(dense(gw, "embedding")?),
            ],
        )
    }

    fn cast(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let name = |d: DType| match d {
            DType::F32 => Some("f32"),
            DType::F64 => Some("f64"),
            DType::BF16 => Some("bf16"),
            DType::F16 => Some("f16"),
            _ => None,
        };
        let n = x.numel();
        if x.dtype() == out.dtype() {
            return self.gather(x, dense(out, "cast")?);
        }
        let (from, to) = (name(x.dtype()), name(out.dtype()));
        let kernel = match (from, to) {
            (Some(f), Some(t)) if f == "f32" || t == "f32" => format!("cast_{f}_{t}"),
            _ => {
                return Err(Error::dtype(format!("cast from {} to {} has no cuda kernel", x.dtype(), out.dtype())));
            }
        };
        self.launch(
            &kernel,
            self.grid(n, BLOCK),
            &mut [Arg::Ptr(dense(x, "cast")?), Arg::Ptr(dense(out, "cast")?), Arg::I64(n as i64)],
        )
    }

    fn sum_to_shape(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("sum_to_shape", x.dtype())?;
        let xs = x.shape();
        let lead = xs.len() - out.rank();
        let (mut kept_shape, mut kept_strides, mut summed_shape, mut summed_strides) = (vec![], vec![], vec![], vec![]);
        for (d, &n) in xs.iter().enumerate() {
            let o = if d < lead { 1 } else { out.shape()[d - lead] };
            let stride = x.layout().strides()[d];
            if o == 1 && n != 1 {
                summed_shape.push(n);
                summed_strides.push(stride);
            } else {
                kept_shape.push(n);
                kept_strides.push(stride);
            }
        }
        let (base, kept) = strided(x, &kept_shape, &kept_strides)?;
        let summed = Strided::new(&summed_shape, &summed_strides, 0)
            .ok_or_else(|| Error::invalid("sum_to_shape on cuda takes at most 8 dims".to_string()))?;
        let (n_out, n_sum) = (out.numel(), summed_shape.iter().product::<usize>());
        self.launch(
            &format!("sum_to_shape_{sfx}"),
            self.grid(n_out, BLOCK),
            &mut [
                Arg::Ptr(base),
                Arg::View(kept),
                Arg::View(summed),
                Arg::I64(n_out as i64),
                Arg::I64(n_sum as i64),
                Arg::Ptr(dense(out, "sum_to_shape")?),
            ],
        )
    }

    fn sum_dim(&self, x: &Tensor, outer: usize, size: usize, inner: usize, mean: bool, out: &Tensor) -> Result<()> {
        let sfx = float(if mean { "mean" } else { "sum" }, x.dtype())?;
        self.sum_middle(sfx, dense(x, "sum")?, (outer, size, inner), mean, dense(out, "sum")?)
    }

    fn sum_backward(&self, grad: &Tensor, scale: f64, out: &Tensor) -> Result<()> {
        let sfx = float("sum_backward", grad.dtype())?;
        let shape = out.shape();
        let (base, view) = strided(grad, shape, &broadcast_strides(grad, shape))?;
        let n = out.numel();
        self.launch(
            &format!("sum_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(base),
                Arg::View(view),
                scalar(grad.dtype(), scale),
                Arg::Ptr(dense(out, "sum_backward")?),
                Arg::I64(n as i64),
            ],
        )
    }

    fn max_dim(
        &self,
        x: &Tensor,
        outer: usize,
        size: usize,
        inner: usize,
        values: &Tensor,
        indices: &Tensor,
    ) -> Result<()> {
        let sfx = float("max", x.dtype())?;
        if size == 0 {
            return Ok(());
        }
        if inner == 1 {
            // A block per row: one thread walking a row of 50,304 logits took 8 ms on an H100.
            let shape = Launch { grid: outer.clamp(1, self.machine.max_blocks() as usize) as u32, block: BLOCK };
            return self.launch(
                &format!("max_dim_rows_{sfx}"),
                shape,
                &mut [
                    Arg::Ptr(dense(x, "max")?),
                    Arg::I64(outer as i64),
                    Arg::I64(size as i64),
                    Arg::Ptr(dense(values, "max")?),
                    Arg::Ptr(dense(indices, "max")?),
                ],
            );
        }
        self.launch(
            &format!("max_dim_{sfx}"),
            self.grid(outer * inner, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "max")?),
                Arg::I64(outer as i64),
                Arg::I64(size as i64),
                Arg::I64(inner as i64),
                Arg::Ptr(dense(values, "max")?),
                Arg::Ptr(dense(indices, "max")?),
            ],
        )
    }

    fn max_dim_backward(
        &self,
        grad: &Tensor,
        indices: &Tensor,
        outer: usize,
        size: usize,
        inner: usize,
        out: &Tensor,
    ) -> Result<()> {
        let sfx = float("max_backward", grad.dtype())?;
        self.launch(
            &format!("max_dim_backward_{sfx}"),
            self.grid(outer * inner, BLOCK),
            &mut [
                Arg::Ptr(dense(grad, "max_backward")?),
                Arg::Ptr(dense(indices, "max_backward")?),
                Arg::I64(outer as i64),
                Arg::I64(size as i64),
                Arg::I64(inner as i64),
                Arg::Ptr(dense(out, "max_backward")?),
            ],
        )
    }

    fn max_all(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("max", x.dtype())?;
        self.launch(
            &format!("max_all_{sfx}"),
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [Arg::Ptr(dense(x, "max")?), Arg::I64(x.numel() as i64), Arg::Ptr(dense(out, "max")?)],
        )
    }

    fn count_equal(&self, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        self.launch(
            "count_equal_i64",
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [
                Arg::Ptr(dense(a, "count_equal")?),
                Arg::Ptr(dense(b, "count_equal")?),
                Arg::I64(a.numel() as i64),
                Arg::Ptr(dense(out, "count_equal")?),
            ],
        )
    }

    fn max_all_backward(&self, x: &Tensor, max: &Tensor, grad: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("max_backward", x.dtype())?;
        self.launch(
            &format!("max_all_backward_{sfx}"),
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [
                Arg::Ptr(dense(x, "max_backward")?),
                Arg::Ptr(dense(max, "max_backward")?),
                Arg::Ptr(dense(grad, "max_backward")?),
                Arg::I64(x.numel() as i64),
                Arg::Ptr(dense(out, "max_backward")?),
            ],
        )
    }

    fn sgd_update(&self, param: &Tensor, grad: &Tensor, momentum_buffer: Option<&Tensor>, step: SgdStep) -> Result<()> {
        let dt = param.dtype();
        let sfx = float("sgd_update", dt)?;
        let n = param.numel();
        self.launch(
            &format!("sgd_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(param, "sgd_update")?),
                Arg::Ptr(dense(grad, "sgd_update")?),
                Arg::Ptr(dense_opt(momentum_buffer, "sgd_update")?),
                scalar(dt, step.weight_decay),
                Arg::I32((step.weight_decay != 0.0) as i32),
                scalar(dt, step.momentum),
                scalar(dt, 1.0 - step.dampening),
                Arg::I32(step.nesterov as i32),
                Arg::I32(step.first_step as i32),
                scalar(dt, -step.lr),
                Arg::I64(n as i64),
            ],
        )
    }

    fn adam_update_all(&self, group: &[[&Tensor; 4]], step: AdamStep) -> Result<()> {
        let (lists, singles): (Vec<&[&Tensor; 4]>, Vec<&[&Tensor; 4]>) =
            group.iter().partition(|tensors| tensors.iter().all(|t| t.dtype() == DType::F32));
        for [param, grad, exp_avg, exp_avg_sq] in singles {
            self.adam_update(param, grad, exp_avg, exp_avg_sq, step)?;
        }
        for list in lists.chunks(ADAM_LIST) {
            let list: Vec<[&Tensor; 4]> = list.iter().map(|&&t| t).collect();
            let (words, start) = tensor_list(&list, "adam_update")?;
            if start > 0 {
                self.launch(
                    "adam_list_f32",
                    self.grid(start as usize, BLOCK),
                    &mut [Arg::Words(words), adam_args(step)],
                )?;
            }
        }
        Ok(())
    }

    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        step: AdamStep,
    ) -> Result<()> {
        let sfx = float("adam_update", param.dtype())?;
        self.adam_dense(&format!("adam_{sfx}"), [param, grad, exp_avg, exp_avg_sq], step)
    }

    fn adam_update_bf16_state(
        &self,
        param: &Tensor,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        step: AdamStep,
    ) -> Result<()> {
        self.adam_dense("adam_bf16_state_f32", [param, grad, exp_avg, exp_avg_sq], step)
    }

    fn adam_update_8bit(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m_codes: &Tensor,
        m_absmax: &Tensor,
        v_codes: &Tensor,
        v_absmax: &Tensor,
        step: AdamStep,
    ) -> Result<()> {
        const NAME: &str = "adam_update_8bit";
        let n = param.numel();
        let blocks = n.div_ceil(memfit_cpu::optim::QUANT_BLOCK);
        // The kernels' `struct Maps`: the signed map, then the unsigned one, two f32 to a word.
        let (signed, unsigned) = memfit_cpu::optim::codebooks();
        let maps: Vec<u64> = [&signed.map, &unsigned.map]
            .iter()
            .flat_map(|m| {
                m.chunks(2).map(|w| u64::from(w[0].to_bits()) | (u64::from(w[1].to_bits()) << 32)).collect::<Vec<_>>()
            })
            .collect();
        self.launch(
            "adam_8bit_f32",
            Launch { grid: blocks.clamp(1, self.machine.max_blocks() as usize) as u32, block: 256 },
            &mut [
                Arg::Ptr(dense(param, NAME)?),
                Arg::Ptr(dense(grad, NAME)?),
                Arg::Ptr(dense(m_codes, NAME)?),
                Arg::Ptr(dense(m_absmax, NAME)?),
                Arg::Ptr(dense(v_codes, NAME)?),
                Arg::Ptr(dense(v_absmax, NAME)?),
                adam_args(step),
                Arg::Words(maps),
                Arg::I64(n as i64),
            ],
        )
    }

    fn unscale(&self, grad: &Tensor, inv_scale: f64, found_inf: &mut bool) -> Result<()> {
        self.unscale_all(&[grad], inv_scale, found_inf)
    }

    fn unscale_all(&self, grads: &[&Tensor], inv_scale: f64, found_inf: &mut bool) -> Result<()> {
        // One flag for every tensor, zeroed once and read back once.
        let flag = self.status()? + 16;
        self.machine.zero(flag, 4).map_err(|e| self.err(e))?;
        // f32 tensors ADAM_LIST to a launch (optim.cu's unscale_list_f32), the others one each.
        let (lists, singles): (Vec<[&Tensor; 1]>, Vec<[&Tensor; 1]>) =
            grads.iter().map(|&g| [g]).partition(|[g]| g.dtype() == DType::F32);
        for list in lists.chunks(ADAM_LIST) {
            let (words, start) = tensor_list(list, "unscale_")?;
            if start > 0 {
                self.launch(
                    "unscale_list_f32",
                    self.grid(start as usize, BLOCK),
                    &mut [Arg::Words(words), Arg::F32(inv_scale as f32), Arg::Ptr(flag)],
                )?;
            }
        }
        for [grad] in singles {
            let sfx = float("unscale_", grad.dtype())?;
            let n = grad.numel();
            self.launch(
                &format!("unscale_{sfx}"),
                self.grid(n, BLOCK),
                &mut [
                    Arg::Ptr(dense(grad, "unscale_")?),
                    scalar(grad.dtype(), inv_scale),
                    Arg::Ptr(flag),
                    Arg::I64(n as i64),
                ],
            )?;
        }
        let mut bytes = [0u8; 4];
        self.machine.download(flag, &mut bytes).map_err(|e| self.err(e))?;
        if i32::from_le_bytes(bytes) != 0 {
            *found_inf = true;
        }
        Ok(())
    }

    fn matmul(&self, a: &Tensor, b: &Tensor, out: &Tensor, products: Products) -> Result<()> {
        let (ra, rb, ro) = (a.rank(), b.rank(), out.rank());
        let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
        let batch_shape = &out.shape()[..ro - 2];
        // A 16-bit `a` with an f32 `b`: a rounded product's operand bits already (the chunked head's
        // gradient on a GPU); cuBLAS's B is a ([`product`]).
        let rounded = [false, operand_dtype(a.dtype(), b.dtype(), products, "matmul")?];
        let dtype = gemm_type("matmul", b.dtype(), products)?;
        let mut sa = batch_shape.to_vec();
        sa.extend([m, k]);
        let mut sb = batch_shape.to_vec();
        sb.extend([k, n]);
        let (la, lb) = (broadcast_strides(a, &sa), broadcast_strides(b, &sb));
        let pa = operand(a, addr(a)?, m, k, la[ro - 2], la[ro - 1], "matmul")?;
        let pb = operand(b, addr(b)?, k, n, lb[ro - 2], lb[ro - 1], "matmul")?;
        let c = dense(out, "matmul")?;
        let (size_a, size_b, size) = (a.dtype().size() as u64, b.dtype().size() as u64, out.dtype().size() as u64);
        // Batch offsets (elements) of each operand, in row-major order over the batch dims.
        let count: usize = batch_shape.iter().product();
        let offsets = |strides: &[usize]| -> Vec<usize> {
            (0..count)
                .map(|mut i| {
                    let mut off = 0;
                    for d in (0..batch_shape.len()).rev() {
                        off += (i % batch_shape[d]) * strides[d];
                        i /= batch_shape[d];
                    }
                    off
                })
                .collect()
        };
        let (oa, ob) = (offsets(&la), offsets(&lb));
        // One strided call when both walk their batch at a constant step, else one call a matrix.
        let step = |o: &[usize]| -> Option<usize> {
            let s = if o.len() > 1 { o[1] - o[0] } else { 0 };
            o.windows(2).all(|w| w[1] == w[0] + s).then_some(s)
        };
        if let (Some(step_a), Some(step_b)) = (step(&oa), step(&ob)) {
            return self.gemm_with(
                product(dtype, (m, n, k), pa, pb, c, (step_a, step_b, m * n, count), 0.0),
                rounded,
                Held::default(),
            );
        }
        for i in 0..count {
            let a_i = Operand { address: pa.address + oa[i] as u64 * size_a, ..pa };
            let b_i = Operand { address: pb.address + ob[i] as u64 * size_b, ..pb };
            let g = product(dtype, (m, n, k), a_i, b_i, c + (i * m * n) as u64 * size, (0, 0, 0, 1), 0.0);
            self.gemm_with(g, rounded, Held::default())?;
        }
        Ok(())
    }

    fn linear(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
        products: Products,
    ) -> Result<()> {
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let rows = x.numel() / in_f.max(1);
        let dst = dense(out, "linear")?;
        let bias = self.bias_for_product(bias, gemm_type("linear", weight.dtype(), products)?, rows, out_f, dst)?;
        let weight = Weight { tensor: weight, copy: None };
        self.times_weight_t(
            (dense(x, "linear")?, false),
            rows,
            weight,
            dst,
            bias,
            (products, Held::default()),
            "linear",
        )
    }

    fn linear_weight_grad(
        &self,
        grad: &Tensor,
        x: &Tensor,
        gw: &Tensor,
        gb: Option<&Tensor>,
        products: Products,
    ) -> Result<()> {
        let (out_f, in_f) = (gw.shape()[0], gw.shape()[1]);
        let rows = x.numel() / in_f.max(1);
        let (g, x) = self.linear_operands("linear_weight_grad", [grad, x, gw], products)?;
        self.linear_weight_grad_of([g, g], x, (rows, out_f, in_f), gw, gb, (products, Held::default()))
    }

    fn linear_backward(
        &self,
        grad: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        gx: &Tensor,
        gw: &Tensor,
        gb: Option<&Tensor>,
        products: Products,
    ) -> Result<()> {
        const NAME: &str = "linear_backward";
        let (out_f, in_f) = (gw.shape()[0], gw.shape()[1]);
        let rows = x.numel() / in_f.max(1);
        let (g, x) = self.linear_operands(NAME, [grad, x, gw], products)?;
        let kind = gemm_type(NAME, weight.dtype(), products)?;
        // The output gradient rounded once for both products (Note [Held operands]), the bias
        // gradient summed as it is where that fits.
        let mut held = Held::default();
        let given = g;
        let sums = match gb {
            Some(gb) if !g.rounded && self.sums_as_held(kind, (rows, out_f), held)? => Some((dense(gb, NAME)?, false)),
            _ => None,
        };
        let g = if g.rounded {
            g
        } else {
            self.gradient_for(g.address, (rows, out_f), true, kind, &mut held, sums)?.into()
        };
        let gb = gb.filter(|_| sums.is_none());
        self.linear_weight_grad_of([g, given], x, (rows, out_f, in_f), gw, gb, (products, held))?;
        let weight = Weight { tensor: weight, copy: None };
        self.times_weight(g.into(), rows, weight, dense(gx, NAME)?, (products, held), NAME)
    }

    fn gelu_linear(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        scratch: &Tensor,
        out: &Tensor,
        products: Products,
    ) -> Result<()> {
        const NAME: &str = "gelu_linear";
        let sfx = float(NAME, x.dtype())?;
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let rows = x.numel() / in_f.max(1);
        let size = x.dtype().size() as u64;
        let (xp, dst, sc) = (dense(x, NAME)?, dense(out, NAME)?, dense(scratch, NAME)?);
        let bias = self.bias_for_product(bias, gemm_type(NAME, weight.dtype(), products)?, rows, out_f, dst)?;
        let block = (scratch.numel() / in_f.max(1)).max(1);
        let mut held = Held::default();
        let weight = self.weight_for(weight, products, rows.div_ceil(block), &mut held, NAME)?;
        for r0 in (0..rows).step_by(block) {
            let n = block.min(rows - r0);
            let rounded = self.gelu_block(sfx, products, (xp + (r0 * in_f) as u64 * size, None), sc, n * in_f)?;
            let out = dst + (r0 * out_f) as u64 * size;
            self.times_weight_t((sc, rounded), n, weight, out, bias, (products, held), NAME)?;
        }
        Ok(())
    }

    fn gelu_linear_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
        scratch: &Tensor,
        products: Products,
    ) -> Result<()> {
        const NAME: &str = "gelu_linear_backward";
        let sfx = float(NAME, grad.dtype())?;
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let rows = grad.shape()[0];
        let size = grad.dtype().size() as u64;
        let saved =
            self.saved_input((NAME, "gelu_linear: input read as saved in 16 bits"), x, grad.dtype(), products)?;
        let x_size = x.dtype().size() as u64;
        let (xp, g, sc) = (dense(x, NAME)?, dense(grad, NAME)?, dense(scratch, NAME)?);
        let (gxp, gwp) = (dense_opt(gx, NAME)?, dense_opt(gw, NAME)?);
        let block = (scratch.numel() / in_f.max(1)).max(1);
        let kind = gemm_type(NAME, weight.dtype(), products)?;
        let mut held = Held::default();
        let blocks = if gxp != 0 { rows.div_ceil(block) } else { 0 };
        let weight = self.weight_for(weight, products, blocks, &mut held, NAME)?;
        let both = gwp != 0 && gxp != 0;
        let gb = self.bias_sums(sfx, gb, g, (rows, out_f), (both, block.min(rows)), kind, held, NAME)?;
        for (i, r0) in (0..rows).step_by(block).enumerate() {
            let n = block.min(rows - r0);
            let count = n * in_f;
            let x_block = xp + (r0 * in_f) as u64 * x_size;
            let mut held = held;
            let sums = gb.map(|gb| (gb, i > 0));
            let g_block = self.gradient_for(g + (r0 * out_f) as u64 * size, (n, out_f), both, kind, &mut held, sums)?;
            // The weight gradient first: it reads gelu(x) before a gradient written in place over x.
            if gwp != 0 {
                let rounded = self.gelu_block(sfx, products, (x_block, saved), sc, count)?;
                let beta = if i == 0 { 0.0 } else { 1.0 };
                let dtype = grad.dtype();
                self.weight_grad(dtype, g_block, (sc, rounded), n, out_f, in_f, gwp, beta, (products, held))?;
            }
            if gxp != 0 {
                self.times_weight(g_block, n, weight, sc, (products, held), NAME)?;
                let kernel =
                    saved.map_or(format!("unary_backward_{sfx}"), |bits| format!("unary_backward_saved_{bits}"));
                self.launch(
                    &kernel,
                    self.grid(count, BLOCK),
                    &mut [
                        Arg::I32(unary_code(Unary::GeluErf)),
                        Arg::Ptr(x_block),
                        Arg::Ptr(sc),
                        Arg::Ptr(gxp + (r0 * in_f) as u64 * size),
                        Arg::I64(count as i64),
                    ],
                )?;
            }
        }
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        d: usize,
        eps: f64,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "layer_norm";
        let sfx = float(NAME, x.dtype())?;
        let rows = x.numel() / d.max(1);
        self.layer_norm_rows(
            &format!("layer_norm_{sfx}"),
            x.dtype(),
            (dense(x, NAME)?, dense_opt(weight, NAME)?, dense_opt(bias, NAME)?),
            rows,
            d,
            eps,
            dense(out, NAME)?,
            (dense_opt(mean, NAME)?, dense_opt(rstd, NAME)?),
        )
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        d: usize,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "layer_norm_backward";
        let sfx = float(NAME, x.dtype())?;
        let rows = x.numel() / d.max(1);
        let (xp, mp, rp, g) = (dense(x, NAME)?, dense(mean, NAME)?, dense(rstd, NAME)?, dense(grad, NAME)?);
        if gw.is_some() || gb.is_some() {
            let grads = [dense_opt(gw, NAME)?, dense_opt(gb, NAME)?];
            self.layer_norm_wb((sfx, None), [xp, mp, rp, g], rows, d, grads, false)?;
        }
        if let Some(gx) = gx {
            self.launch(
                &format!("layer_norm_backward_x_{sfx}"),
                self.norm_rows(sfx, rows, d),
                &mut [
                    Arg::Ptr(xp),
                    Arg::Ptr(dense_opt(weight, NAME)?),
                    Arg::Ptr(mp),
                    Arg::Ptr(rp),
                    Arg::Ptr(g),
                    Arg::I64(rows as i64),
                    Arg::I64(d as i64),
                    Arg::Ptr(dense(gx, NAME)?),
                ],
            )?;
        }
        Ok(())
    }

    fn layer_norm_linear(
        &self,
        x: &Tensor,
        ln_weight: &Tensor,
        ln_bias: &Tensor,
        eps: f64,
        weight: &Tensor,
        bias: Option<&Tensor>,
        scratch: &Tensor,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
        products: Products,
    ) -> Result<()> {
        const NAME: &str = "layer_norm_linear";
        let sfx = float(NAME, x.dtype())?;
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let rows = x.numel() / in_f.max(1);
        let size = x.dtype().size() as u64;
        let (xp, dst, sc) = (dense(x, NAME)?, dense(out, NAME)?, dense(scratch, NAME)?);
        let (lw, lb) = (dense(ln_weight, NAME)?, dense(ln_bias, NAME)?);
        let (mp, rp) = (dense_opt(mean, NAME)?, dense_opt(rstd, NAME)?);
        let bias = self.bias_for_product(bias, gemm_type(NAME, weight.dtype(), products)?, rows, out_f, dst)?;
        let block = (scratch.numel() / in_f.max(1)).max(1);
        let at = |p: u64, r: usize| if p == 0 { 0 } else { p + r as u64 * size };
        // The normalized block goes straight to the product's operand bits where it rounds them.
        let rounded = operand_bits(sfx, products);
        let kernel = rounded.map_or(format!("layer_norm_{sfx}"), |bits| format!("layer_norm_operands_{bits}"));
        let mut held = Held::default();
        let weight = self.weight_for(weight, products, rows.div_ceil(block), &mut held, NAME)?;
        for r0 in (0..rows).step_by(block) {
            let n = block.min(rows - r0);
            self.layer_norm_rows(
                &kernel,
                x.dtype(),
                (xp + (r0 * in_f) as u64 * size, lw, lb),
                n,
                in_f,
                eps,
                sc,
                (at(mp, r0), at(rp, r0)),
            )?;
            let x_block = (sc, rounded.is_some());
            let out = dst + (r0 * out_f) as u64 * size;
            self.times_weight_t(x_block, n, weight, out, bias, (products, held), NAME)?;
        }
        Ok(())
    }

    fn layer_norm_linear_backward(
        &self,
        x: &Tensor,
        ln_weight: &Tensor,
        ln_bias: &Tensor,
        weight: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        grad: &Tensor,
        gx: Option<&Tensor>,
        glw: Option<&Tensor>,
        glb: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
        scratch: &Tensor,
        _sums: Option<&Tensor>,
        products: Products,
    ) -> Result<()> {
        const NAME: &str = "layer_norm_linear_backward";
        let sfx = float(NAME, grad.dtype())?;
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let rows = grad.shape()[0];
        let size = grad.dtype().size() as u64;
        let saved =
            self.saved_input((NAME, "layer_norm_linear: input read as saved in 16 bits"), x, grad.dtype(), products)?;
        let x_size = x.dtype().size() as u64;
        let (xp, g, sc) = (dense(x, NAME)?, dense(grad, NAME)?, dense(scratch, NAME)?);
        let (lw, lb, mp, rp) = (dense(ln_weight, NAME)?, dense(ln_bias, NAME)?, dense(mean, NAME)?, dense(rstd, NAME)?);
        let (gxp, glwp, glbp, gwp) =
            (dense_opt(gx, NAME)?, dense_opt(glw, NAME)?, dense_opt(glb, NAME)?, dense_opt(gw, NAME)?);
        let block = (scratch.numel() / in_f.max(1)).max(1);
        // The layer norm's output gradient (dy = grad W) is wanted for any of its input's.
        let dy_wanted = gxp != 0 || glwp != 0 || glbp != 0;
        let kind = gemm_type(NAME, weight.dtype(), products)?;
        let mut held = Held::default();
        let weight =
            self.weight_for(weight, products, if dy_wanted { rows.div_ceil(block) } else { 0 }, &mut held, NAME)?;
        let both = gwp != 0 && dy_wanted;
        let gb = self.bias_sums(sfx, gb, g, (rows, out_f), (both, block.min(rows)), kind, held, NAME)?;
        for (i, r0) in (0..rows).step_by(block).enumerate() {
            let n = block.min(rows - r0);
            let x_block = xp + (r0 * in_f) as u64 * x_size;
            let mut held = held;
            let sums = gb.map(|gb| (gb, i > 0));
            let g_block = self.gradient_for(g + (r0 * out_f) as u64 * size, (n, out_f), both, kind, &mut held, sums)?;
            let (m_block, r_block) = (mp + r0 as u64 * size, rp + r0 as u64 * size);
            // Everything that reads x before a gradient written in place over it.
            if gwp != 0 {
                let rounded = operand_bits(sfx, products);
                let kernel = match (rounded, saved) {
                    (Some(bits), Some(_)) => format!("layer_norm_apply_operands_saved_{bits}"),
                    (Some(bits), None) => format!("layer_norm_apply_operands_{bits}"),
                    (None, None) => format!("layer_norm_apply_{sfx}"),
                    (None, Some(_)) => return Err(unrounded_saved_input(NAME)),
                };
                self.launch(
                    &kernel,
                    if by_warps(sfx, in_f) { self.norm_rows(sfx, n, in_f) } else { self.grid(n * in_f, BLOCK) },
                    &mut [
                        Arg::Ptr(x_block),
                        Arg::Ptr(lw),
                        Arg::Ptr(lb),
                        Arg::Ptr(m_block),
                        Arg::Ptr(r_block),
                        Arg::I64(n as i64),
                        Arg::I64(in_f as i64),
                        Arg::Ptr(sc),
                    ],
                )?;
                let beta = if i == 0 { 0.0 } else { 1.0 };
                let x = (sc, rounded.is_some());
                self.weight_grad(grad.dtype(), g_block, x, n, out_f, in_f, gwp, beta, (products, held))?;
            }
            if !dy_wanted {
                continue;
            }
            // dy = grad W: the layer norm's output gradient.
            self.times_weight(g_block, n, weight, sc, (products, held), NAME)?;
            if glwp != 0 || glbp != 0 {
                self.layer_norm_wb((sfx, saved), [x_block, m_block, r_block, sc], n, in_f, [glwp, glbp], i > 0)?;
            }
            if gxp != 0 {
                self.launch(
                    &saved.map_or(format!("layer_norm_backward_x_{sfx}"), |bits| {
                        format!("layer_norm_backward_x_saved_{bits}")
                    }),
                    self.norm_rows(sfx, n, in_f),
                    &mut [
                        Arg::Ptr(x_block),
                        Arg::Ptr(lw),
                        Arg::Ptr(m_block),
                        Arg::Ptr(r_block),
                        Arg::Ptr(sc),
                        Arg::I64(n as i64),
                        Arg::I64(in_f as i64),
                        Arg::Ptr(gxp + (r0 * in_f) as u64 * size),
                    ],
                )?;
            }
        }
        Ok(())
    }

    fn batch_norm(
        &self,
        x: &Tensor,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "batch_norm";
        let sfx = float(NAME, x.dtype())?;
        if x.numel() == 0 {
            return Ok(());
        }
        let (nb, c) = (x.shape()[0], x.shape()[1]);
        let s: usize = x.shape()[2..].iter().product();
        if !training && (running_mean.is_none() || running_var.is_none()) {
            return Err(Error::invalid("batch_norm in eval needs the running statistics"));
        }
        self.launch(
            &format!("batch_norm_{sfx}"),
            self.grid(c * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(dense(x, NAME)?),
                Arg::I64(nb as i64),
                Arg::I64(c as i64),
                Arg::I64(s as i64),
                Arg::I32(training as i32),
                Arg::F64(momentum),
                Arg::F64(eps),
                Arg::Ptr(dense_opt(running_mean, NAME)?),
                Arg::Ptr(dense_opt(running_var, NAME)?),
                Arg::Ptr(dense_opt(weight, NAME)?),
                Arg::Ptr(dense_opt(bias, NAME)?),
                Arg::Ptr(dense(out, NAME)?),
                Arg::Ptr(dense_opt(mean, NAME)?),
                Arg::Ptr(dense_opt(rstd, NAME)?),
            ],
        )
    }

    fn batch_norm_backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        training: bool,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "batch_norm_backward";
        let sfx = float(NAME, grad.dtype())?;
        let (nb, c) = (x.shape()[0], x.shape()[1]);
        let s: usize = x.shape()[2..].iter().product();
        self.launch(
            &format!("batch_norm_backward_{sfx}"),
            self.grid(c * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(dense(x, NAME)?),
                Arg::Ptr(dense_opt(weight, NAME)?),
                Arg::Ptr(dense(mean, NAME)?),
                Arg::Ptr(dense(rstd, NAME)?),
                Arg::I32(training as i32),
                Arg::Ptr(dense(grad, NAME)?),
                Arg::I64(nb as i64),
                Arg::I64(c as i64),
                Arg::I64(s as i64),
                Arg::Ptr(dense_opt(gx, NAME)?),
                Arg::Ptr(dense_opt(gw, NAME)?),
                Arg::Ptr(dense_opt(gb, NAME)?),
            ],
        )
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        pb: &AttnProblem,
        out: &Tensor,
        lse: Option<&Tensor>,
        workspace: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "scaled_dot_product_attention";
        // q, k and v in the output's dtype, or saved in the products' own 16 bits (Note
        // [Attention's saved operands]: the tensor cores' kernels read them in place).
        let dtype = out.dtype();
        let sfx = float(NAME, dtype)?;
        if pb.dims.bh == 0 {
            return Ok(());
        }
        let problem = attention_problem(dtype, q, k, v, pb, NAME)?;
        let visible = visibility(mask, pb)?;
        let mut args = vec![problem, visible];
        let (name, shape) = match self.attention_kernels(pb, dtype)? {
            Some(t) if t.kind == "mma" => {
                args.push(self.round_attention_operands(dtype, q, k, v, None, pb, workspace)?);
                (t.kernel(""), self.tiles(pb.dims.bh, pb.dims.tq, t.forward_rows))
            }
            _ if q.dtype() != dtype => return Err(self.saved_off_tensor_cores(q.dtype())),
            Some(t) => (t.kernel(""), self.tiles(pb.dims.bh, pb.dims.tq, t.forward_rows)),
            None => (format!("attention_{sfx}"), self.grid(pb.dims.bh * pb.dims.tq, BLOCK)),
        };
        args.extend([Arg::Ptr(dense(out, NAME)?), addr_arg(&pb.lay.out), Arg::Ptr(dense_opt(lse, NAME)?)]);
        self.launch(&name, shape, &mut args)
    }

    fn attention_delta(&self, out: &Tensor, grad: &Tensor, pb: &AttnProblem, delta: &Tensor) -> Result<()> {
        const NAME: &str = "scaled_dot_product_attention_backward";
        let sfx = float(NAME, grad.dtype())?;
        // The output in the gradient's dtype, or saved in 16 bits (widened in the kernel).
        let kernel = match (out.dtype(), grad.dtype()) {
            (DType::BF16, DType::F32) => "attention_delta_saved_bf16".to_string(),
            (DType::F16, DType::F32) => "attention_delta_saved_f16".to_string(),
            (o, g) if o == g => format!("attention_delta_{sfx}"),
            (o, g) => return Err(Error::dtype(format!("{NAME}: an output in {o} with a gradient in {g}"))),
        };
        let d = pb.dims;
        if d.bh * d.tq == 0 {
            return Ok(());
        }
        // A warp a row.
        self.launch(
            &kernel,
            self.grid(d.bh * d.tq * 32, BLOCK),
            &mut [
                Arg::Ptr(dense(out, NAME)?),
                Arg::Ptr(dense(grad, NAME)?),
                addr_arg(&pb.lay.out),
                Arg::I64(d.bh as i64),
                Arg::I64(d.heads as i64),
                Arg::I64(d.tq as i64),
                Arg::I64(d.dv as i64),
                Arg::Ptr(dense(delta, NAME)?),
            ],
        )
    }

    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        lse: &Tensor,
        pb: &AttnProblem,
        grad: &Tensor,
        delta: Option<&Tensor>,
        gq: Option<&Tensor>,
        gk: Option<&Tensor>,
        gv: Option<&Tensor>,
        workspace: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "scaled_dot_product_attention_backward";
        let sfx = float(NAME, grad.dtype())?;
        if pb.dims.bh == 0 {
            return Ok(());
        }
        let problem = attention_problem(grad.dtype(), q, k, v, pb, NAME)?;
        let visible = visibility(mask, pb)?;
        let (g, l) = (dense(grad, NAME)?, dense(lse, NAME)?);
        let (gqp, gkp, gvp) = (dense_opt(gq, NAME)?, dense_opt(gk, NAME)?, dense_opt(gv, NAME)?);
        // The kernels read D (dk and dv's stage it with every query tile, whether dk is wanted or not).
        let Some(delta) = delta else {
            return Err(Error::invalid(format!("{NAME}: the kernels need each row's D")));
        };
        let deltap = dense(delta, NAME)?;
        // dk and dv, then dq, each reading the rows' D.
        let (head, kernels) = match self.attention_kernels(pb, grad.dtype())? {
            // The tensor cores' kernels read the operands' rounded copies (the output's gradient's
            // too) where the CUDA cores' tiled ones read the gradient and its layout.
            Some(t) if t.kind == "mma" => {
                let bits = self.round_attention_operands(grad.dtype(), q, k, v, Some(grad), pb, workspace)?;
                (vec![problem, visible, bits, Arg::Ptr(l), Arg::Ptr(deltap)], Some(t))
            }
            _ if q.dtype() != grad.dtype() => return Err(self.saved_off_tensor_cores(q.dtype())),
            tiled => (vec![problem, visible, Arg::Ptr(g), addr_arg(&pb.lay.out), Arg::Ptr(l), Arg::Ptr(deltap)], tiled),
        };
        let args = |extra: &[Arg]| [&head[..], extra].concat();
        let ((q_kernel, kv_kernel), q_rows, kv_rows) = match &kernels {
            Some(t) => (
                (t.kernel("backward_q_"), t.kernel("backward_kv_")),
                self.tiles(pb.dims.bh, pb.dims.tq, t.query_rows),
                self.tiles(pb.dims.bh, pb.dims.tk, t.key_rows),
            ),
            None => (
                (format!("attention_backward_q_{sfx}"), format!("attention_backward_kv_{sfx}")),
                self.grid(pb.dims.bh * pb.dims.tq, BLOCK),
                self.grid(pb.dims.bh * pb.dims.tk, BLOCK),
            ),
        };
        if gkp != 0 || gvp != 0 {
            self.launch(&kv_kernel, kv_rows, &mut args(&[Arg::Ptr(gkp), Arg::Ptr(gvp)]))?;
        }
        if gqp != 0 {
            self.launch(&q_kernel, q_rows, &mut args(&[Arg::Ptr(gqp)]))?;
        }
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: &Tensor,
        target: &Tensor,
        label_smoothing: f64,
        out: &Tensor,
        ws: Option<&Tensor>,
    ) -> Result<()> {
        let sfx = float("cross_entropy", logits.dtype())?;
        let (n, c) = (logits.shape()[0], logits.shape()[1]);
        let rows = loss_rows(ws, logits)?;
        self.launch(
            &format!("cross_entropy_rows_{sfx}"),
            self.grid(n * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(dense(logits, "cross_entropy")?),
                Arg::Ptr(dense(target, "cross_entropy")?),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                scalar(logits.dtype(), label_smoothing),
                Arg::Ptr(rows),
                Arg::Ptr(self.status()? + 8),
            ],
        )?;
        self.launch(
            &format!("cross_entropy_mean_{sfx}"),
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [Arg::Ptr(rows), Arg::I64(n as i64), Arg::Ptr(dense(out, "cross_entropy")?)],
        )
    }

    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        target: &Tensor,
        label_smoothing: f64,
        grad: &Tensor,
        gx: &Tensor,
    ) -> Result<()> {
        let sfx = float("cross_entropy", logits.dtype())?;
        let (n, c) = (logits.shape()[0], logits.shape()[1]);
        self.launch(
            &format!("cross_entropy_backward_{sfx}"),
            self.grid(n * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(dense(logits, "cross_entropy")?),
                Arg::Ptr(dense(target, "cross_entropy")?),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                scalar(logits.dtype(), label_smoothing),
                Arg::Ptr(dense(grad, "cross_entropy")?),
                Arg::Ptr(dense(gx, "cross_entropy")?),
            ],
        )
    }

    fn cross_entropy_with_grad(
        &self,
        logits: &Tensor,
        target: &Tensor,
        label_smoothing: f64,
        out: &Tensor,
        ws: Option<&Tensor>,
        grad: &Tensor,
        gx: &Tensor,
        bias_grad: Option<&Tensor>,
        predicted: Option<&Tensor>,
    ) -> Result<()> {
        const NAME: &str = "cross_entropy";
        let sfx = float(NAME, logits.dtype())?;
        let (n, c) = (logits.shape()[0], logits.shape()[1]);
        let rows = loss_rows(ws, logits)?;
        // loss.cu's cross_entropy_grad: a block of 256 (its shared arrays) per row; into a 16-bit gx,
        // the rounded operand bits of the products that alone read it (`ops::linear_cross_entropy`).
        // The f32 gradient the bias gradient is summed from: gx, or, beside operand bits, the logits
        // it is written over.
        let (kernel, full) = match (gx.dtype(), logits.dtype()) {
            (g, l) if g == l => (format!("cross_entropy_grad_{sfx}"), gx),
            (DType::BF16 | DType::F16, DType::F32) => {
                (format!("cross_entropy_grad_operands_{}", gx.dtype().name()), logits)
            }
            (g, l) => {
                return Err(Error::dtype(format!("{NAME} on cuda: a {} gradient of {} logits", g.name(), l.name())))
            }
        };
        let mut args = vec![
            Arg::Ptr(dense(logits, NAME)?),
            Arg::Ptr(dense(target, NAME)?),
            Arg::I64(n as i64),
            Arg::I64(c as i64),
            scalar(logits.dtype(), label_smoothing),
            Arg::Ptr(rows),
            Arg::Ptr(self.status()? + 8),
            Arg::Ptr(dense(grad, NAME)?),
            Arg::Ptr(dense(gx, NAME)?),
        ];
        if gx.dtype() != logits.dtype() {
            args.push(Arg::I32(bias_grad.is_some() as i32));
        }
        // Each row's class from the same reading (0: not asked).
        args.push(Arg::Ptr(predicted.map(|p| dense(p, NAME)).transpose()?.unwrap_or(0)));
        self.launch(&kernel, self.grid(n * BLOCK as usize, BLOCK), &mut args)?;
        self.launch(
            &format!("cross_entropy_mean_{sfx}"),
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [Arg::Ptr(rows), Arg::I64(n as i64), Arg::Ptr(dense(out, NAME)?)],
        )?;
        // The bias gradient as linear_weight_grad sums it (column_sums).
        match bias_grad {
            Some(gb) => self.column_sums(sfx, dense(full, NAME)?, n, c, dense(gb, NAME)?),
            None => Ok(()),
        }
    }

    fn nll_loss(&self, log_probs: &Tensor, target: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("nll_loss", log_probs.dtype())?;
        let (n, c) = (log_probs.shape()[0], log_probs.shape()[1]);
        let strides = log_probs.layout().strides();
        let (base, rows) = strided(log_probs, &[n], &[strides[0]])?;
        self.launch(
            &format!("nll_loss_{sfx}"),
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [
                Arg::Ptr(base),
                Arg::View(rows),
                Arg::I64(strides[1] as i64),
                Arg::Ptr(dense(target, "nll_loss")?),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                Arg::Ptr(dense(out, "nll_loss")?),
                Arg::Ptr(self.status()? + 8),
            ],
        )
    }

    fn nll_loss_backward(&self, target: &Tensor, grad: &Tensor, gx: &Tensor) -> Result<()> {
        let sfx = float("nll_loss", grad.dtype())?;
        let (n, c) = (gx.shape()[0], gx.shape()[1]);
        self.launch(
            &format!("nll_loss_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(target, "nll_loss")?),
                Arg::Ptr(dense(grad, "nll_loss")?),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                Arg::Ptr(dense(gx, "nll_loss")?),
            ],
        )
    }

    fn mse_loss(&self, input: &Tensor, target: &Tensor, out: &Tensor) -> Result<()> {
        let sfx = float("mse_loss", input.dtype())?;
        self.launch(
            &format!("mse_loss_{sfx}"),
            Launch { grid: 1, block: WHOLE_BLOCK },
            &mut [
                Arg::Ptr(dense(input, "mse_loss")?),
                Arg::Ptr(dense(target, "mse_loss")?),
                Arg::I64(input.numel() as i64),
                Arg::Ptr(dense(out, "mse_loss")?),
            ],
        )
    }

    fn mse_loss_backward(
        &self,
        input: &Tensor,
        target: &Tensor,
        grad: &Tensor,
        ga: Option<&Tensor>,
        gb: Option<&Tensor>,
    ) -> Result<()> {
        let sfx = float("mse_loss", input.dtype())?;
        let n = input.numel();
        self.launch(
            &format!("mse_loss_backward_{sfx}"),
            self.grid(n, BLOCK),
            &mut [
                Arg::Ptr(dense(input, "mse_loss")?),
                Arg::Ptr(dense(target, "mse_loss")?),
                Arg::Ptr(dense(grad, "mse_loss")?),
                Arg::I64(n as i64),
                Arg::Ptr(dense_opt(ga, "mse_loss")?),
                Arg::Ptr(dense_opt(gb, "mse_loss")?),
            ],
        )
    }

    fn softmax(&self, x: &Tensor, dim: usize, log: bool, out: &Tensor) -> Result<()> {
        let sfx = float("softmax", x.dtype())?;
        let (outer, d, inner) = split(x.shape(), dim);
        self.launch(
            &format!("softmax_{sfx}"),
            self.grid(outer * inner * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(dense(x, "softmax")?),
                Arg::I64(outer as i64),
                Arg::I64(d as i64),
                Arg::I64(inner as i64),
                Arg::I32(log as i32),
                Arg::Ptr(dense(out, "softmax")?),
            ],
        )
    }

    fn softmax_backward(&self, out: &Tensor, grad: &Tensor, dim: usize, log: bool, gx: &Tensor) -> Result<()> {
        let sfx = float("softmax", out.dtype())?;
        let (outer, d, inner) = split(out.shape(), dim);
        self.launch(
            &format!("softmax_backward_{sfx}"),
            self.grid(outer * inner * BLOCK as usize, BLOCK),
            &mut [
                Arg::Ptr(dense(out, "softmax")?),
                Arg::Ptr(dense(grad, "softmax")?),
                Arg::I64(outer as i64),
                Arg::I64(d as i64),
                Arg::I64(inner as i64),
                Arg::I32(log as i32),
                Arg::Ptr(dense(gx, "softmax")?),
            ],
        )
    }
}

impl Cuda {
    /// The launch of a layer norm kernel over `rows` rows of `d` (`sfx`'s dtype): a warp a row where
    /// norm.cu takes them so ([`by_warps`]), else a block a row.
    fn norm_rows(&self, sfx: &str, rows: usize, d: usize) -> Launch {
        let threads_a_row = if by_warps(sfx, d) { 32 } else { BLOCK as usize };
        self.grid(rows * threads_a_row, BLOCK)
    }

    /// Layer norm of `rows` dense rows of `d` by `kernel` (`layer_norm_*`, or `layer_norm_operands_*`
    /// writing the output as a product's operand bits), weight and bias optional (0), statistics
    /// written when their addresses are not 0.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_rows(
        &self,
        kernel: &str,
        dtype: DType,
        (x, w, b): (u64, u64, u64),
        rows: usize,
        d: usize,
        eps: f64,
        out: u64,
        (mean, rstd): (u64, u64),
    ) -> Result<()> {
        let sfx = if dtype == DType::F64 { "f64" } else { "f32" };
        self.launch(
            kernel,
            self.norm_rows(sfx, rows, d),
            &mut [
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(b),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
                scalar(dtype, eps),
                Arg::Ptr(out),
                Arg::Ptr(mean),
                Arg::Ptr(rstd),
            ],
        )
    }
}

/// Whether norm.cu's layer norm kernels take rows of `d` elements of `sfx`'s dtype a warp each
/// (its `warp_rows`, but for the alignment, which the kernels check and every allocator block has):
/// f32 rows of a multiple of 4 elements, at most 1,024.
fn by_warps(sfx: &str, d: usize) -> bool {
    sfx == "f32" && d.is_multiple_of(4) && d <= 1024
}

/// optim.cu's list structs (`AdamList`, `TensorList`) of up to [`ADAM_LIST`] entries of K tensors:
/// the count, the walk's starts (entry t's elements start[t] .. start[t + 1], by its first tensor),
/// then one array of [`ADAM_LIST`] addresses for each of the K; and the walk's length.
fn tensor_list<const K: usize>(list: &[[&Tensor; K]], op: &str) -> Result<(Vec<u64>, u64)> {
    let (mut words, mut start) = (vec![list.len() as u64, 0], 0u64);
    for tensors in list {
        start += tensors[0].numel() as u64;
        words.push(start);
    }
    words.resize(2 + ADAM_LIST, 0);
    for k in 0..K {
        for tensors in list {
            words.push(dense(tensors[k], op)?);
        }
        words.resize(2 + ADAM_LIST + (k + 1) * ADAM_LIST, 0);
    }
    Ok((words, start))
}

/// An attention operand's layout as the kernels' `struct Addr` (attention.cu).
fn addr_arg(a: &memfit_cpu::attention::AttnAddr) -> Arg {
    Arg::Words(addr_words(a).to_vec())
}

fn addr_words(a: &memfit_cpu::attention::AttnAddr) -> [u64; 4] {
    [a.offset as u64, a.batch_stride as u64, a.head_stride as u64, a.row_stride as u64]
}

/// optim.cu's `struct AdamArgs`: the step's hyper-parameters as the cpu kernel derives them (Note
/// [Optimizer arithmetic]: Python floats; the kernel casts each to the parameter's dtype).
fn adam_args(step: AdamStep) -> Arg {
    let AdamStep { step, lr, betas: (beta1, beta2), eps, weight_decay, decoupled } = step;
    let t = step as f64;
    let (bc1, bc2) = (1.0 - beta1.powf(t), 1.0 - beta2.powf(t));
    let decay = weight_decay != 0.0 && decoupled;
    let l2 = weight_decay != 0.0 && !decoupled;
    Arg::Words(vec![
        (1.0 - lr * weight_decay).to_bits(),
        u64::from(decay),
        weight_decay.to_bits(),
        u64::from(l2),
        (1.0 - beta1).to_bits(),
        beta2.to_bits(),
        (1.0 - beta2).to_bits(),
        bc2.powf(0.5).to_bits(),
        eps.to_bits(),
        (-(lr / bc1)).to_bits(),
    ])
}

/// The tile shape of attention.cu's tiled kernels for a head size (`ATTENTION_TILED`'s or
/// `ATTENTION_MMA`'s arguments).
struct AttentionTiles {
    /// The kernels: `tiled` (f32 products) or `mma` (the tensor cores').
    kind: &'static str,
    /// Head sizes up to this (the kernels' `D`).
    head: usize,
    /// The operands the products read: `f32`, `bf16` or `f16`.
    operands: &'static str,
    /// Query rows of a block of the forward (`FR`; 16 M MMA_WARPS for the tensor cores).
    forward_rows: usize,
    /// Query rows of a block of dq (`QR`; as the forward's).
    query_rows: usize,
    /// Key rows of a block of dk and dv (`KC`; 16 MMA_WARPS for the tensor cores).
    key_rows: usize,
    /// The forward and dq with two tiles of 16 rows a warp (`attention_mma_wide_*`).
    wide: bool,
}

impl AttentionTiles {
    /// The name of the kernel `step` ("", "backward_q_" or "backward_kv_").
    fn kernel(&self, step: &str) -> String {
        let kind = if self.wide && step != "backward_kv_" { "mma_wide" } else { self.kind };
        format!("attention_{kind}_{step}d{}_{}", self.head, self.operands)
    }

    /// These tensor cores' tiles with the forward and dq two tiles of 16 rows a warp
    /// (attention.cu's ATTENTION_MMA_WIDE: heads up to 64, blocks of twice the rows), where
    /// there are such kernels; else themselves.
    fn wide(self) -> AttentionTiles {
        if self.kind != "mma" || self.head != 64 {
            return self;
        }
        AttentionTiles { forward_rows: 2 * self.forward_rows, query_rows: 2 * self.query_rows, wide: true, ..self }
    }
}

/// The tiled kernels for heads of `head` values: f32 with head sizes up to 128, on the tensor cores
/// when `products` round their operands to bf16 or fp16; None for the per-row kernels.
fn tiled_head(head: usize, dtype: DType, products: Products) -> Option<AttentionTiles> {
    /// The rows of a block of attention.cu's tensor-core kernels with a tile of 16 rows a warp:
    /// 16 MMA_WARPS.
    const MMA_ROWS: usize = 64;
    let head = match head {
        0..=64 => 64,
        65..=128 => 128,
        _ => return None,
    };
    if dtype != DType::F32 {
        return None;
    }
    let mma = |operands| AttentionTiles {
        kind: "mma",
        head,
        operands,
        forward_rows: MMA_ROWS,
        query_rows: MMA_ROWS,
        key_rows: MMA_ROWS,
        wide: false,
    };
    Some(match (products, head) {
        (Products::Bf16, _) => mma("bf16"),
        (Products::F16, _) => mma("f16"),
        (Products::F32, 64) => AttentionTiles {
            kind: "tiled",
            head,
            operands: "f32",
            forward_rows: 64,
            query_rows: 32,
            key_rows: 32,
            wide: false,
        },
        (Products::F32, _) => AttentionTiles {
            kind: "tiled",
            head,
            operands: "f32",
            forward_rows: 32,
            query_rows: 16,
            key_rows: 16,
            wide: false,
        },
    })
}

/// `MEMFIT_CUDA_ATTENTION=cuda-cores`: attention on the CUDA cores' tiled kernels even where the
/// tensor cores would take it (to time one against the other). Read once; the op layer reads it
/// too (what attention's backward keeps in f32 depends on it, on `meta:cuda` as on a GPU).
pub(crate) fn cuda_cores_asked() -> bool {
    static CUDA_CORES: OnceLock<bool> = OnceLock::new();
    *CUDA_CORES.get_or_init(|| std::env::var_os("MEMFIT_CUDA_ATTENTION").is_some_and(|v| v == "cuda-cores"))
}

/// The attention kernels `MEMFIT_CUDA_ATTENTION` asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum AttentionAsked {
    /// `cuda-cores`: the CUDA cores' tiled kernels (`cuda_cores_asked`).
    CudaCores,
    /// `wide`: the tensor cores' forward and dq with two tiles of 16 rows a warp (`AttentionTiles::wide`).
    Wide,
}

/// `MEMFIT_CUDA_ATTENTION`, read at every launch (`wide` changes no byte of memory and no bit of a
/// result, so a process may time one kernel against the other), and an error naming the
/// variable for a value that asks for neither (a misspelt choice would else time the default;
/// checked too when a `cuda` or `meta:cuda` device opens). `cuda-cores` is as `cuda_cores_asked`
/// read it first.
pub(crate) fn attention_asked() -> Result<Option<AttentionAsked>> {
    if cuda_cores_asked() {
        return Ok(Some(AttentionAsked::CudaCores));
    }
    match std::env::var("MEMFIT_CUDA_ATTENTION").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("") => Ok(None),
        Ok("wide") => Ok(Some(AttentionAsked::Wide)),
        // Set after the op layer first read it (a test): as it was read then.
        Ok("cuda-cores") => Ok(None),
        Ok(other) => Err(Error::invalid(format!(
            "MEMFIT_CUDA_ATTENTION={other}: expected `cuda-cores` or `wide` (or unset, for the default kernels)"
        ))),
        Err(_) => {
            Err(Error::invalid("MEMFIT_CUDA_ATTENTION is not valid text: expected `cuda-cores` or `wide`".to_string()))
        }
    }
}

/// `MEMFIT_REQUIRE_TENSOR_CORES=1` (the tests' setting): attention that the tensor cores should
/// take and does not, for a failed check or any other reason, is an error.
fn tensor_cores_required() -> bool {
    std::env::var_os("MEMFIT_REQUIRE_TENSOR_CORES").is_some_and(|v| v == "1")
}

/// The values attention.cu's `mma_check` writes: 4 per lane of a warp, for each of its three
/// products (B's fragments built in registers, loaded by `ldmatrix`, loaded by its transpose).
const MMA_CHECK_VALUES: usize = 3 * 128;

/// What is wrong with `mma_check`'s values (product j's lane l's d[i] at 128 j + 4 l + i), or None
/// when each product is A B of its two integer matrices, each at the place the PTX ISA gives the
/// lane's accumulator elements: D(l / 4 + 8 (i >> 1), 2 (l % 4) + (i & 1)).
fn mma_check_error(values: &[f32]) -> Option<String> {
    let a = |r: i64, k: i64| ((3 * r + 5 * k) % 7 - 3) as f32;
    let b = |k: i64, n: i64| ((2 * k + 3 * n) % 5 - 2) as f32;
    if values.len() != MMA_CHECK_VALUES {
        return Some(format!("{} values, not {MMA_CHECK_VALUES}", values.len()));
    }
    let loads = ["B's fragments in registers", "B through ldmatrix", "B through ldmatrix's transpose"];
    values.iter().enumerate().find_map(|(at, &got)| {
        let (lane, i) = (((at % 128) / 4) as i64, at as i64 % 4);
        let (row, col) = (lane / 4 + 8 * (i >> 1), 2 * (lane % 4) + (i & 1));
        let want: f32 = (0..16).map(|k| a(row, k) * b(k, col)).sum();
        (got != want).then(|| format!("D({row}, {col}) = {got}, not {want}, with {}", loads[at / 128]))
    })
}

/// The kernels' `struct Problem<T>` of a problem on `dtype` tensors: q, k and v, their layouts, the
/// sizes, how the products round their operands, and the scale (q, k and v saved in 16 bits are
/// read only through their rounded copies).
fn attention_problem(dtype: DType, q: &Tensor, k: &Tensor, v: &Tensor, pb: &AttnProblem, op: &str) -> Result<Arg> {
    let d = pb.dims;
    let mut words = vec![dense(q, op)?, dense(k, op)?, dense(v, op)?];
    for a in [&pb.lay.q, &pb.lay.k, &pb.lay.v] {
        words.extend(addr_words(a));
    }
    words.extend([d.bh, d.heads, d.tq, d.tk, d.d, d.dv].map(|n| n as u64));
    words.push(match pb.products {
        _ if dtype != DType::F32 => 0,
        Products::F32 => 0,
        Products::Bf16 => 1,
        Products::F16 => 2,
    });
    words.push(match dtype {
        DType::F32 => u64::from((pb.scale as f32).to_bits()),
        _ => pb.scale.to_bits(),
    });
    Ok(Arg::Words(words))
}

/// The kernels' `struct Visible`: the causal flag and the mask (bytes, non-zero = hidden) seen as
/// `pb.full` ([batch..., Tq, Tk]).
fn visibility(mask: Option<&Tensor>, pb: &AttnProblem) -> Result<Arg> {
    let mut words = vec![u64::from(pb.causal)];
    match mask {
        None => {
            words.push(0);
            words.extend(Strided::new(&[], &[], 0).map(strided_words).unwrap_or_default());
            words.extend([0, 0]);
        }
        Some(m) => {
            if m.dtype().size() != 1 {
                return Err(Error::dtype(format!("an attention mask is bool or u8, not {}", m.dtype())));
            }
            let full = &pb.full;
            let r = full.len();
            let strides = broadcast_strides(m, full);
            let (base, view) = strided(m, &full[..r - 2], &strides[..r - 2])?;
            words.push(base);
            words.extend(strided_words(view));
            words.extend([strides[r - 2] as u64, strides[r - 1] as u64]);
        }
    }
    Ok(Arg::Words(words))
}

/// A [`Strided`] as the words of its C layout (rank in the low half of the first).
fn strided_words(s: Strided) -> Vec<u64> {
    let mut words = vec![s.rank as u32 as u64];
    words.extend(s.shape.iter().map(|&n| n as u64));
    words.extend(s.stride.iter().map(|&n| n as u64));
    words.push(s.offset as u64);
    words
}

/// The kernels' `struct Conv` (conv.cu) for output rows `r0..r1` of `lanes` samples, `x_lane`
/// elements apart, whose tiles are `col_lane` apart.
fn conv_words(g: &ConvGeom, r0: usize, r1: usize, lanes: usize, x_lane: usize, col_lane: usize) -> Arg {
    let words = [g.c, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.ow, r0, r1, lanes, x_lane, col_lane];
    Arg::Words(words.map(|v| v as u64).to_vec())
}

/// One step of the GPU's conv2d plan (Note [conv2d work plan]): sample `j` of the first `lanes`
/// lanes, output rows `r0..r1` (`tp` positions; `tile` im2col elements a lane).
struct LaneStep {
    j: usize,
    lanes: usize,
    r0: usize,
    r1: usize,
    tp: usize,
    tile: usize,
}

/// The plan's steps in order: each sample index of a lane, each tile of output rows.
fn lane_steps(g: &ConvGeom) -> impl Iterator<Item = LaneStep> + '_ {
    let rows = g.tile_rows.max(1);
    (0..g.per_lane.max(1).min(g.n)).flat_map(move |j| {
        (0..g.oh).step_by(rows).map(move |r0| {
            let r1 = (r0 + rows).min(g.oh);
            let tp = (r1 - r0) * g.ow;
            LaneStep { j, lanes: active_lanes(g, j), r0, r1, tp, tile: g.kc() * tp }
        })
    })
}

/// The im2col workspace's address (a GPU's conv2d always gets one).
fn im2col_workspace(workspace: Option<&Tensor>) -> Result<u64> {
    dense(workspace.ok_or_else(|| Error::invalid("conv2d on cuda needs its im2col workspace"))?, "conv2d")
}

/// The lanes whose sample `j` exists (lane l's is sample `l * per_lane + j`; only the last lane can
/// hold fewer), so step j of the GPU plan serves this many at once.
fn active_lanes(g: &ConvGeom, j: usize) -> usize {
    if j >= g.n {
        return 0;
    }
    (g.n - j).div_ceil(g.per_lane.max(1)).min(g.lanes.max(1))
}

/// The kernels' `struct Pool` (pool.cu).
fn pool_words(g: &PoolGeom) -> Arg {
    Arg::Words(
        [g.planes, g.h, g.w, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw].map(|v| v as u64).to_vec(),
    )
}

/// The kernels' code of an average pooling's windows (pool.cu).
fn avg_code(kind: Avg) -> i32 {
    match kind {
        Avg::Fixed { count_include_pad: true } => 0,
        Avg::Fixed { count_include_pad: false } => 1,
        Avg::Adaptive => 2,
    }
}

/// `shape` as `[outer, shape[dim], inner]`.
fn split(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

/// The kernels' code of a unary op (`elementwise.cu`).
fn unary_code(op: Unary) -> i32 {
    match op {
        Unary::Relu => 0,
        Unary::GeluErf => 1,
        Unary::GeluTanh => 2,
        Unary::Tanh => 3,
        Unary::Sigmoid => 4,
        Unary::Exp => 5,
        Unary::Log => 6,
        Unary::Neg => 7,
        Unary::Relu6 => 8,
        Unary::Hardsigmoid => 9,
        Unary::Hardswish => 10,
        Unary::Sqrt => 11,
        Unary::Rsqrt => 12,
        Unary::Cos => 13,
        Unary::Sin => 14,
        Unary::Abs => 15,
        Unary::Silu => 16,
    }
}

/// The kernels' code of a comparison (`elementwise.cu`).
fn compare_code(op: Compare) -> i32 {
    match op {
        Compare::Gt => 0,
        Compare::Lt => 1,
        Compare::Ge => 2,
        Compare::Le => 3,
        Compare::Eq => 4,
        Compare::Ne => 5,
    }
}

/// The kernels' code of a binary op (`elementwise.cu`).
fn binary_code(op: Binary) -> i32 {
    match op {
        Binary::Add => 0,
        Binary::Sub => 1,
        Binary::Mul => 2,
        Binary::Div => 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held copies (Note [Held operands]) lie inside the workspace, 256-byte aligned, apart from each
    /// other and above the products' room, and never take more than half of it.
    #[test]
    fn held_copies_stay_apart() {
        for capacity in [1000, 4096, 33_554_432, 33_554_432 - 77] {
            assert_eq!(Held::default().room(capacity), capacity, "nothing held: all of it");
            for lens in [vec![1, 1, 1], vec![200, 130, 7], vec![capacity / 8, capacity / 8, capacity / 8]] {
                let mut held = Held::default();
                // [start, end) of each copy held so far.
                let mut copies: Vec<(usize, usize)> = Vec::new();
                for len in lens {
                    let Some(next) = held.with(len, capacity) else {
                        let aligned = (held.taken + len).next_multiple_of(HELD_ALIGN);
                        assert!(aligned > capacity / 2, "{len} refused in {capacity} with {held:?}");
                        break;
                    };
                    assert!(next.taken <= capacity / 2);
                    let start = next.room(capacity);
                    assert_eq!(start % HELD_ALIGN, 0, "aligned");
                    assert!(start + len <= capacity, "inside the workspace");
                    for &(s, e) in &copies {
                        assert!(start + len <= s || start >= e, "[{start}, +{len}) overlaps [{s}, {e})");
                    }
                    copies.push((start, start + len));
                    held = next;
                    // The products' room ends where the lowest copy starts.
                    assert!(copies.iter().all(|&(s, _)| held.room(capacity) <= s));
                }
            }
        }
    }

    /// Coalescing keeps every element's offsets in row-major order, with fewer dims: a dense pair is
    /// one dim; a broadcast row, a transposed operand and a window keep the dims they need.
    #[test]
    fn coalescing_keeps_the_offsets() {
        let offsets = |shape: &[usize], strides: &[usize]| -> Vec<usize> {
            let n: usize = shape.iter().product();
            (0..n)
                .map(|mut k| {
                    let mut off = 0;
                    for d in (0..shape.len()).rev() {
                        off += (k % shape[d]) * strides[d];
                        k /= shape[d];
                    }
                    off
                })
                .collect()
        };
        let cases: [(&[usize], [&[usize]; 2], usize); 6] = [
            (&[16, 1024, 768], [&[786_432, 768, 1], &[786_432, 768, 1]], 1),
            (&[16, 1024, 768], [&[786_432, 768, 1], &[0, 0, 1]], 2),
            (&[4, 3, 5], [&[15, 5, 1], &[0, 1, 3]], 3),
            (&[2, 1, 3, 4], [&[12, 12, 4, 1], &[24, 7, 8, 1]], 2),
            (&[1, 1], [&[5, 1], &[0, 0]], 0),
            (&[3, 0, 2], [&[0, 2, 1], &[2, 2, 1]], 3),
        ];
        for (shape, strides, rank) in cases {
            let (dims, merged) = coalesced(shape, strides);
            assert_eq!(dims.len(), rank, "{shape:?} {strides:?} -> {dims:?}");
            for i in 0..2 {
                assert_eq!(offsets(&dims, &merged[i]), offsets(shape, strides[i]), "{shape:?} operand {i}");
            }
        }
    }

    #[test]
    fn the_tensor_cores_check_wants_the_product_at_the_ptx_places() {
        // The product of mma_check's matrices at the places the PTX ISA gives lane l's d[i].
        let product = |row: i64, col: i64| -> f32 {
            (0..16).map(|k| (((3 * row + 5 * k) % 7 - 3) * ((2 * k + 3 * col) % 5 - 2)) as f32).sum()
        };
        let place =
            |at: usize| ((at / 16) as i64 + 8 * ((at % 4) as i64 >> 1), 2 * ((at / 4) % 4) as i64 + (at % 2) as i64);
        let right: Vec<f32> = (0..MMA_CHECK_VALUES).map(|at| product(place(at % 128).0, place(at % 128).1)).collect();
        assert_eq!(mma_check_error(&right), None);
        // One value off, in each product: named with its place and the product's loads.
        for (j, loads) in
            ["B's fragments in registers", "B through ldmatrix", "B through ldmatrix's transpose"].iter().enumerate()
        {
            let mut one_off = right.clone();
            one_off[128 * j + 77] += 1.0;
            let why = mma_check_error(&one_off).unwrap();
            assert!(why.starts_with("D(4, 7) = ") && why.ends_with(&format!("with {loads}")), "{why}");
        }
        // The accumulator's rows and columns swapped (a layout this GPU does not have) fail.
        let swapped: Vec<f32> = (0..MMA_CHECK_VALUES).map(|at| product(place(at % 128).1, place(at % 128).0)).collect();
        assert!(mma_check_error(&swapped).is_some());
        assert_eq!(mma_check_error(&right[..4]), Some("4 values, not 384".into()));
    }

    #[test]
    fn operands_read_row_major_matrices_as_cublas_needs_them() {
        // Row-major [2, 3] (strides 3, 1): column-major 3 x 2, not transposed, ld 3.
        assert_eq!(Operand::of(8, 2, 3, 3, 1), Some(Operand { address: 8, trans: false, ld: 3 }));
        // Its transpose as a view [3, 2] (strides 1, 3): read transposed, ld 3.
        assert_eq!(Operand::of(8, 3, 2, 1, 3), Some(Operand { address: 8, trans: true, ld: 3 }));
        // A row inside a wider matrix keeps its row stride.
        assert_eq!(Operand::of(8, 2, 3, 5, 1), Some(Operand { address: 8, trans: false, ld: 5 }));
        // One row or one column: any stride.
        assert_eq!(Operand::of(8, 1, 3, 0, 1), Some(Operand { address: 8, trans: false, ld: 3 }));
        assert_eq!(Operand::of(8, 3, 1, 1, 7), Some(Operand { address: 8, trans: false, ld: 1 }));
        // Neither stride is 1: no operand.
        assert_eq!(Operand::of(8, 2, 3, 6, 2), None);
    }
}
