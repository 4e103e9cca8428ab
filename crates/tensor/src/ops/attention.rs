//! Scaled dot-product attention: [`scaled_dot_product_attention`] over [..., T, D] tensors, and
//! [`packed_self_attention`], the core of `nn.MultiheadAttention`'s self-attention, which reads q, k and
//! v straight out of the packed in-projection output [B, T, 3E] and writes [B, T, E] with the heads
//! already merged (no split or merge copies). Both take the causal flag and/or a boolean mask.
//!
//! FlashAttention-style fused kernels, one task per (batch, head) matrix, `DP_ROWS` query rows at a
//! time: forward computes a block of scores `S = q k^T * scale + mask` into a scratch, softmaxes each
//! row (max, then exp and sum), multiplies by v into the output and keeps only the rows' log-sum-exp.
//! Backward saves q, k and v (or the packed qkv, one tensor), the mask and the per-row log-sum-exp
//! (`lse`, [..., Tq], in the inputs' dtype) and nothing of size [Tq, Tk]: per row block it recomputes
//! `P = exp(S - lse)`, then `dV += P^T dO`, `dP = dO v^T`, `D = rowsum(P * dP)`,
//! `dS = P * (dP - D) * scale`, `dQ = dS k` and `dK += dS^T q`. The only workspace is a per-task
//! scratch of two `DP_ROWS x Tk` blocks, bounded by a constant times Tk and independent of the batch
//! size and the thread count; outputs, the log-sum-exp and gradients come from the allocator.
//!
//! Keys hidden from every row of a block past its last visible key (a causal flag or a causal mask)
//! are skipped; their probabilities are exactly 0, so this changes nothing but the work.
//!
//! Fully masked rows (every key masked) give output 0 and gradient 0, like PyTorch's
//! `F.scaled_dot_product_attention` since 2.5 (its math backend applies `_safe_softmax`; the fused
//! CPU kernels agree). A plain `softmax` of such a row would be NaN. Their log-sum-exp is -inf.

use crate::backend::cpu::elementwise::exp_in_place;
use crate::backend::cpu::gemm::{gemm_into, Mat, SendPtr};
use super::{check_same, output};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::layout::broadcast_layout;
use crate::tensor::{Element, Tensor};
use crate::with_float;
use rayon::prelude::*;

/// Query rows per block, in forward and backward (the per-task scratch is 2 x DP_ROWS x Tk).
const DP_ROWS: usize = 64;

/// Sizes of one attention problem.
#[derive(Clone, Copy)]
struct Dims {
    /// Number of (batch, head) matrices.
    bh: usize,
    /// Heads per batch element (for addressing; 1 when the operands are plain [bh, T, D] stacks).
    heads: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

/// Where the (batch, head) matrices of an operand live, in elements: matrix `i = b * heads + h` starts
/// at `offset + b * batch_stride + h * head_stride`, its rows are `row_stride` apart and its columns
/// contiguous. A gradient has the same layout as its input.
#[derive(Clone, Copy)]
struct Addr {
    offset: usize,
    batch_stride: usize,
    head_stride: usize,
    row_stride: usize,
}

impl Addr {
    /// A contiguous stack of [rows, cols] matrices.
    fn stack(rows: usize, cols: usize) -> Addr {
        Addr { offset: 0, batch_stride: rows * cols, head_stride: 0, row_stride: cols }
    }

    fn start(&self, i: usize, heads: usize) -> usize {
        self.offset + (i / heads) * self.batch_stride + (i % heads) * self.head_stride
    }
}

/// Layouts of q, k, v and the output (and of their gradients).
#[derive(Clone, Copy)]
struct Layouts {
    q: Addr,
    k: Addr,
    v: Addr,
    out: Addr,
}

/// Runs `f(i, gemm_threads)` for every batch matrix: in parallel over matrices when there are
/// several, else one matrix with multi-threaded GEMMs.
fn for_each_matrix(bh: usize, f: impl Fn(usize, usize) + Sync + Send) {
    if bh > 1 {
        (0..bh).into_par_iter().for_each(|i| f(i, 1));
    } else {
        (0..bh).for_each(|i| f(i, rayon::current_num_threads()));
    }
}

/// The bool mask, broadcast to [batch..., Tq, Tk], read through its strides.
struct MaskView<'a> {
    bytes: &'a [u8],
    /// Shape and strides of the batch dims (broadcast; stride 0 where the mask has size 1).
    batch_shape: Vec<usize>,
    batch_strides: Vec<usize>,
    offset: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MaskView<'a> {
    /// `m` seen as `full` ([batch..., Tq, Tk]); `m` must broadcast to it.
    fn new(m: &'a Tensor, full: &[usize]) -> Result<Self> {
        let r = full.len();
        let l = broadcast_layout(m.layout(), full);
        Ok(MaskView {
            bytes: m.storage_bytes()?,
            batch_shape: l.shape()[..r - 2].to_vec(),
            batch_strides: l.strides()[..r - 2].to_vec(),
            offset: l.offset(),
            row_stride: l.strides()[r - 2],
            col_stride: l.strides()[r - 1],
        })
    }

    /// Element offset of (batch matrix i, row 0, col 0).
    fn base(&self, mut i: usize) -> usize {
        let mut o = self.offset;
        for (&n, &s) in self.batch_shape.iter().zip(&self.batch_strides).rev() {
            o += (i % n) * s;
            i /= n;
        }
        o
    }

    fn masked(&self, base: usize, r: usize, c: usize) -> bool {
        self.bytes[base + r * self.row_stride + c * self.col_stride] != 0
    }
}

/// Which keys each query may see: the causal flag and the mask combined.
struct Visibility<'a> {
    causal: bool,
    mask: Option<MaskView<'a>>,
}

impl Visibility<'_> {
    /// The mask's element offset for matrix i (0 without a mask).
    fn base(&self, i: usize) -> usize {
        self.mask.as_ref().map_or(0, |m| m.base(i))
    }

    fn hidden(&self, base: usize, r: usize, j: usize) -> bool {
        (self.causal && j > r) || self.mask.as_ref().is_some_and(|m| m.masked(base, r, j))
    }

    /// One past the last key any of rows `r0..r0 + rows` sees (0 when they see none): every key from
    /// there on has probability 0 for the whole block. Depends only on the mask, never on data.
    fn key_end(&self, base: usize, r0: usize, rows: usize, tk: usize) -> usize {
        let limit = if self.causal { tk.min(r0 + rows) } else { tk };
        if self.mask.is_none() {
            return limit;
        }
        let mut end = 0;
        for r in r0..r0 + rows {
            if let Some(j) = (end..limit).rev().find(|&j| !self.hidden(base, r, j)) {
                end = j + 1;
            }
        }
        end
    }
}

/// Scales, masks and softmaxes one score row in place; returns its log-sum-exp (of the scaled,
/// masked scores). A fully masked row becomes 0 and returns -inf.
fn softmax_row<T: Float>(row: &mut [T], scale: T, hidden: impl Fn(usize) -> bool) -> T {
    let mut m = T::neg_infinity();
    for (j, v) in row.iter_mut().enumerate() {
        *v = if hidden(j) { T::neg_infinity() } else { *v * scale };
        // NaN wins, so a NaN score is never mistaken for a fully masked row.
        if *v > m || v.is_nan() {
            m = *v;
        }
    }
    if m == T::neg_infinity() {
        row.iter_mut().for_each(|v| *v = T::of(0.0));
        return m;
    }
    row.iter_mut().for_each(|v| *v = *v - m);
    exp_in_place(row);
    let mut sum = T::of(0.0);
    for v in row.iter() {
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v = *v / sum);
    m + sum.ln()
}

/// Raw operand pointers (inputs read, outputs written) of one forward or backward call.
#[derive(Clone, Copy)]
struct Ptrs<T> {
    q: SendPtr<T>,
    k: SendPtr<T>,
    v: SendPtr<T>,
    /// The output (forward) or its gradient (backward).
    o: SendPtr<T>,
    lse: SendPtr<T>,
}

fn read_ptr<T: Element>(t: &Tensor) -> Result<SendPtr<T>> {
    Ok(SendPtr(t.slice::<T>()?.as_ptr() as *mut T))
}

fn write_ptr<T: Element>(t: &Tensor) -> Result<SendPtr<T>> {
    Ok(SendPtr(t.slice_mut::<T>()?.as_mut_ptr()))
}

/// Forward: writes the output and, when `p.lse` is non-null, the per-row log-sum-exp. The pointers
/// must cover every matrix of `dims` as laid out by `lay` (lse: [bh, tq] contiguous), and the output
/// and lse must not overlap the inputs (the callers pass fresh tensors).
fn forward_kernel<T: Float + Element>(p: Ptrs<T>, dims: Dims, lay: Layouts, scale: f64, vis: &Visibility<'_>) {
    let Dims { bh, heads, tq, tk, d, dv } = dims;
    let scale = T::of(scale);
    for_each_matrix(bh, |i, threads| {
        #[allow(clippy::redundant_locals)] // capture the Send wrappers, not their raw pointer fields
        let p = p;
        // SAFETY: matrix i's regions are in bounds (caller); its output rows and lse entries are
        // written by this task only.
        unsafe {
            let qi = p.q.0.add(lay.q.start(i, heads)) as *const T;
            let ki = p.k.0.add(lay.k.start(i, heads)) as *const T;
            let vi = p.v.0.add(lay.v.start(i, heads)) as *const T;
            let oi = p.o.0.add(lay.out.start(i, heads));
            let base = vis.base(i);
            let mut s = vec![T::zero(); DP_ROWS.min(tq) * tk];
            for r0 in (0..tq).step_by(DP_ROWS) {
                let rows = DP_ROWS.min(tq - r0);
                let kend = vis.key_end(base, r0, rows, tk);
                let qb = Mat { ptr: qi.add(r0 * lay.q.row_stride), rs: lay.q.row_stride as isize, cs: 1 };
                let kt = Mat { ptr: ki, rs: 1, cs: lay.k.row_stride as isize };
                gemm_into::<T>(rows, kend, d, s.as_mut_ptr(), kend as isize, false, qb, kt, threads);
                for r in 0..rows {
                    let row = &mut s[r * kend..(r + 1) * kend];
                    let lse = softmax_row(row, scale, |j| vis.hidden(base, r0 + r, j));
                    if !p.lse.0.is_null() {
                        *p.lse.0.add(i * tq + r0 + r) = lse;
                    }
                }
                let pm = Mat { ptr: s.as_ptr(), rs: kend as isize, cs: 1 };
                let vm = Mat { ptr: vi, rs: lay.v.row_stride as isize, cs: 1 };
                let dst = oi.add(r0 * lay.out.row_stride);
                gemm_into::<T>(rows, dv, kend, dst, lay.out.row_stride as isize, false, pm, vm, threads);
            }
        }
    });
}

/// Zeroes `rows` rows of `cols` elements, `row_stride` apart.
///
/// # Safety
/// The region must be valid for writes.
unsafe fn zero_rows<T: Float>(ptr: *mut T, rows: usize, cols: usize, row_stride: usize) {
    for r in 0..rows {
        std::slice::from_raw_parts_mut(ptr.add(r * row_stride), cols).fill(T::zero());
    }
}

/// Backward: `p.o` is the output's gradient (laid out like the output); `g` the gradients of q, k and
/// v (laid out like them), each written only when present. Requirements as for [`forward_kernel`];
/// the gradient regions must not overlap the inputs or each other.
fn backward_kernel<T: Float + Element>(
    p: Ptrs<T>,
    g: [Option<SendPtr<T>>; 3],
    dims: Dims,
    lay: Layouts,
    scale: f64,
    vis: &Visibility<'_>,
) {
    let Dims { bh, heads, tq, tk, d, dv } = dims;
    let scale = T::of(scale);
    let [gq, gk, gv] = g;
    let need_ds = gq.is_some() || gk.is_some();
    for_each_matrix(bh, |i, threads| {
        let (p, gq, gk, gv) = (p, gq, gk, gv);
        // SAFETY: matrix i's regions are in bounds (caller); the gradients' matrix-i regions are
        // touched only by this task.
        unsafe {
            let qi = p.q.0.add(lay.q.start(i, heads)) as *const T;
            let ki = p.k.0.add(lay.k.start(i, heads)) as *const T;
            let vi = p.v.0.add(lay.v.start(i, heads)) as *const T;
            let goi = p.o.0.add(lay.out.start(i, heads)) as *const T;
            let lse = p.lse.0.add(i * tq) as *const T;
            let gqi = gq.map(|g| g.0.add(lay.q.start(i, heads)));
            let gki = gk.map(|g| g.0.add(lay.k.start(i, heads)));
            let gvi = gv.map(|g| g.0.add(lay.v.start(i, heads)));
            // dK and dV accumulate over row blocks, and keys a block skips get nothing from it.
            if let Some(gki) = gki {
                zero_rows(gki, tk, d, lay.k.row_stride);
            }
            if let Some(gvi) = gvi {
                zero_rows(gvi, tk, dv, lay.v.row_stride);
            }
            let (qrs, krs, vrs, ors) = (
                lay.q.row_stride as isize,
                lay.k.row_stride as isize,
                lay.v.row_stride as isize,
                lay.out.row_stride as isize,
            );
            let base = vis.base(i);
            let block = DP_ROWS.min(tq) * tk;
            let mut s = vec![T::zero(); block];
            let mut dp = vec![T::zero(); if need_ds { block } else { 0 }];
            for r0 in (0..tq).step_by(DP_ROWS) {
                let rows = DP_ROWS.min(tq - r0);
                let kend = vis.key_end(base, r0, rows, tk);
                let qb = Mat { ptr: qi.add(r0 * lay.q.row_stride), rs: qrs, cs: 1 };
                let gob = Mat { ptr: goi.add(r0 * lay.out.row_stride), rs: ors, cs: 1 };
                // P = exp(S - lse), recomputed exactly as forward scaled and masked it.
                let kt = Mat { ptr: ki, rs: 1, cs: krs };
                gemm_into::<T>(rows, kend, d, s.as_mut_ptr(), kend as isize, false, qb, kt, threads);
                for r in 0..rows {
                    let l = *lse.add(r0 + r);
                    let row = &mut s[r * kend..(r + 1) * kend];
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = if l == T::neg_infinity() || vis.hidden(base, r0 + r, j) {
                            T::neg_infinity()
                        } else {
                            *v * scale - l
                        };
                    }
                    exp_in_place(row);
                }
                let pm = Mat { ptr: s.as_ptr(), rs: kend as isize, cs: 1 };
                let pt = Mat { ptr: s.as_ptr(), rs: 1, cs: kend as isize };
                if let Some(gvi) = gvi {
                    // dV[:kend] += P^T dO
                    gemm_into::<T>(kend, dv, rows, gvi, vrs, true, pt, gob, threads);
                }
                if !need_ds {
                    continue;
                }
                // dP = dO v^T; dS = P * (dP - rowsum(P * dP)) * scale, over P.
                let vt = Mat { ptr: vi, rs: 1, cs: vrs };
                gemm_into::<T>(rows, kend, dv, dp.as_mut_ptr(), kend as isize, false, gob, vt, threads);
                for r in 0..rows {
                    let prow = &mut s[r * kend..(r + 1) * kend];
                    let dprow = &dp[r * kend..(r + 1) * kend];
                    let dot = prow.iter().zip(dprow).fold(T::zero(), |a, (&p, &g)| a + p * g);
                    prow.iter_mut().zip(dprow).for_each(|(p, &g)| *p = *p * (g - dot) * scale);
                }
                if let Some(gqi) = gqi {
                    // dQ rows = dS k[:kend]
                    let km = Mat { ptr: ki, rs: krs, cs: 1 };
                    gemm_into::<T>(rows, d, kend, gqi.add(r0 * lay.q.row_stride), qrs, false, pm, km, threads);
                }
                if let Some(gki) = gki {
                    // dK[:kend] += dS^T q rows
                    gemm_into::<T>(kend, d, rows, gki, krs, true, pt, qb, threads);
                }
            }
        }
    });
}

/// Errors unless `m` is a bool mask on `like`'s device that broadcasts to `full`.
fn check_mask(op: &str, m: &Tensor, like: &Tensor, full: &[usize]) -> Result<()> {
    if !m.device().same(like.device()) {
        return Err(Error::device(format!("{op}: mask is on another device")));
    }
    if m.dtype() != DType::Bool {
        return Err(Error::dtype(format!("{op}: mask must be bool, got {}", m.dtype())));
    }
    let fits = m.rank() <= full.len() && m.shape().iter().rev().zip(full.iter().rev()).all(|(&a, &b)| a == b || a == 1);
    if !fits {
        return Err(Error::shape(format!("{op}: mask {:?} does not broadcast to {full:?}", m.shape())));
    }
    Ok(())
}

/// One attention call: sizes, operand layouts, scale and which keys are visible.
struct Problem {
    dims: Dims,
    lay: Layouts,
    scale: f64,
    causal: bool,
    /// The mask's broadcast target, [batch..., Tq, Tk].
    full: Vec<usize>,
}

/// Runs the forward kernel (on a computing device) into `out` and `lse`.
fn run_forward(
    pb: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    out: &Tensor,
    lse: Option<&Tensor>,
) -> Result<()> {
    if !q.device().computes() || pb.dims.bh == 0 {
        return Ok(());
    }
    let vis = Visibility { causal: pb.causal, mask: mask.map(|m| MaskView::new(m, &pb.full)).transpose()? };
    with_float!(q.dtype(), "scaled_dot_product_attention", T => {
        let p = Ptrs::<T> {
            q: read_ptr(q)?,
            k: read_ptr(k)?,
            v: read_ptr(v)?,
            o: write_ptr(out)?,
            lse: match lse { Some(l) => write_ptr(l)?, None => SendPtr(std::ptr::null_mut()) },
        };
        // The tensors are contiguous with the shapes the layouts describe; out and lse are fresh.
        forward_kernel::<T>(p, pb.dims, pb.lay, pb.scale, &vis)
    });
    Ok(())
}

/// `F.scaled_dot_product_attention(q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], is_causal)` with scale
/// 1/sqrt(D). `mask` (bool, broadcastable to [B,H,Tq,Tk]) is True where attention is NOT allowed (the
/// convention of nn.MultiheadAttention's bool attn_mask). Causal: query i sees keys j <= i.
///
/// Any number of leading batch dims works (q, k and v must agree on them). `causal` and `mask` may be
/// combined (a key is then hidden when either hides it). A query row with every key hidden yields 0
/// (and gradient 0), as PyTorch's sdpa does.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let _op = q.device().op_scope("scaled_dot_product_attention");
    const NAME: &str = "scaled_dot_product_attention";
    check_same(NAME, &[q, k, v])?;
    let r = q.rank();
    let bad = || {
        Error::shape(format!(
            "scaled_dot_product_attention: expected q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] with the \
             same leading dims, got {:?}, {:?}, {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        ))
    };
    if r < 2
        || k.rank() != r
        || v.rank() != r
        || q.shape()[..r - 2] != k.shape()[..r - 2]
        || q.shape()[..r - 2] != v.shape()[..r - 2]
    {
        return Err(bad());
    }
    let (tq, d, tk, dv) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
    if k.shape()[r - 1] != d || v.shape()[r - 2] != tk {
        return Err(bad());
    }
    if d == 0 {
        return Err(Error::shape("scaled_dot_product_attention: head dim D must be > 0"));
    }
    let batch = &q.shape()[..r - 2];
    let mut full = batch.to_vec();
    full.extend([tq, tk]);
    if let Some(m) = mask {
        check_mask(NAME, m, q, &full)?;
    }
    let dims = Dims { bh: batch.iter().product(), heads: 1, tq, tk, d, dv };
    let lay =
        Layouts { q: Addr::stack(tq, d), k: Addr::stack(tk, d), v: Addr::stack(tk, dv), out: Addr::stack(tq, dv) };
    let pb = Problem { dims, lay, scale: 1.0 / (d as f64).sqrt(), causal, full };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let mut out_shape = batch.to_vec();
    out_shape.extend([tq, dv]);
    let out = output(&q, &out_shape, q.dtype(), NAME)?;
    let grad = needs_grad(&[&q, &k, &v]);
    let lse = if grad { Some(output(&q, &pb.full[..r - 1], q.dtype(), NAME)?) } else { None };
    run_forward(&pb, &q, &k, &v, mask, &out, lse.as_ref())?;
    let Some(lse) = lse else { return Ok(out) };
    let back = AttentionBack {
        inputs: Saved::Separate([save(&q), save(&k), save(&v)]),
        lse: save(&lse),
        mask: mask.map(save),
        pb,
    };
    Ok(record(out, NAME, &[&q, &k, &v], back))
}

/// The self-attention core of `nn.MultiheadAttention` (batch_first, no dropout) on the packed
/// in-projection output `qkv` [B, T, 3E]: features [0, E) are the queries, [E, 2E) the keys and
/// [2E, 3E) the values, head h using features `h*E/heads .. (h+1)*E/heads` of each. Returns
/// [B, T, E] with head h in features `h*E/heads ..`: the same as splitting q, k, v into
/// [B, heads, T, E/heads], [`scaled_dot_product_attention`] and merging the heads back, without the
/// copies. q, k and v are read in place; backward saves `qkv` itself (plus the mask and the
/// log-sum-exp) and produces one [B, T, 3E] gradient.
///
/// `mask` (bool, True = not allowed) broadcasts to [B, heads, T, T]; scale 1/sqrt(E/heads).
pub fn packed_self_attention(qkv: &Tensor, heads: usize, causal: bool, mask: Option<&Tensor>) -> Result<Tensor> {
    let _op = qkv.device().op_scope("packed_self_attention");
    const NAME: &str = "packed_self_attention";
    if qkv.rank() != 3 || heads == 0 || !qkv.shape()[2].is_multiple_of(3 * heads) || qkv.shape()[2] == 0 {
        return Err(Error::shape(format!(
            "packed_self_attention: expected qkv [B, T, 3E] with E a positive multiple of heads = {heads}, got {:?}",
            qkv.shape()
        )));
    }
    if !qkv.dtype().is_float() {
        return Err(Error::dtype(format!("packed_self_attention supports f32 and f64, not {}", qkv.dtype())));
    }
    let (b, t, e) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let dh = e / heads;
    let full = vec![b, heads, t, t];
    if let Some(m) = mask {
        check_mask(NAME, m, qkv, &full)?;
    }
    let part = |i: usize| Addr { offset: i * e, batch_stride: t * 3 * e, head_stride: dh, row_stride: 3 * e };
    let lay = Layouts {
        q: part(0),
        k: part(1),
        v: part(2),
        out: Addr { offset: 0, batch_stride: t * e, head_stride: dh, row_stride: e },
    };
    let dims = Dims { bh: b * heads, heads, tq: t, tk: t, d: dh, dv: dh };
    let pb = Problem { dims, lay, scale: 1.0 / (dh as f64).sqrt(), causal, full };
    let qkv = qkv.contiguous()?;
    let out = output(&qkv, &[b, t, e], qkv.dtype(), NAME)?;
    let grad = needs_grad(&[&qkv]);
    let lse = if grad { Some(output(&qkv, &[b, heads, t], qkv.dtype(), NAME)?) } else { None };
    run_forward(&pb, &qkv, &qkv, &qkv, mask, &out, lse.as_ref())?;
    let Some(lse) = lse else { return Ok(out) };
    let back = AttentionBack { inputs: Saved::Packed(save(&qkv)), lse: save(&lse), mask: mask.map(save), pb };
    Ok(record(out, NAME, &[&qkv], back))
}

/// The saved inputs: separate q, k, v, or one packed qkv.
enum Saved {
    Separate([Tensor; 3]),
    Packed(Tensor),
}

/// What attention saves for backward (Note [Saved tensors]): the inputs, the mask and the per-row
/// log-sum-exp; never the probabilities.
struct AttentionBack {
    inputs: Saved,
    /// Per-row log-sum-exp of the scaled, masked scores, [bh, Tq] (-inf for a fully masked row).
    lse: Tensor,
    mask: Option<Tensor>,
    pb: Problem,
}

impl Backward for AttentionBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let go = grad.contiguous()?;
        let name = "scaled_dot_product_attention_backward";
        // Gradients (allocated first, in input order) and the tensors q, k, v are read from.
        let (grads, ins): (Vec<Option<Tensor>>, [&Tensor; 3]) = match &self.inputs {
            Saved::Separate(qkv) => {
                let mut grads = Vec::with_capacity(3);
                for (t, &need) in qkv.iter().zip(needs) {
                    grads.push(if need { Some(output(&go, t.shape(), go.dtype(), name)?) } else { None });
                }
                (grads, [&qkv[0], &qkv[1], &qkv[2]])
            }
            Saved::Packed(qkv) => (vec![Some(output(&go, qkv.shape(), go.dtype(), name)?)], [qkv, qkv, qkv]),
        };
        if go.device().computes() && self.pb.dims.bh > 0 {
            let vis = Visibility {
                causal: self.pb.causal,
                mask: self.mask.as_ref().map(|m| MaskView::new(m, &self.pb.full)).transpose()?,
            };
            with_float!(go.dtype(), name, T => {
                let p = Ptrs::<T> {
                    q: read_ptr(ins[0])?,
                    k: read_ptr(ins[1])?,
                    v: read_ptr(ins[2])?,
                    o: read_ptr(&go)?,
                    lse: read_ptr(&self.lse)?,
                };
                let g: [Option<SendPtr<T>>; 3] = match &self.inputs {
                    Saved::Separate(_) => [
                        grads[0].as_ref().map(write_ptr).transpose()?,
                        grads[1].as_ref().map(write_ptr).transpose()?,
                        grads[2].as_ref().map(write_ptr).transpose()?,
                    ],
                    Saved::Packed(_) => {
                        let g = grads[0].as_ref().map(write_ptr).transpose()?;
                        [g, g, g]
                    }
                };
                // The saved tensors and the gradients are contiguous with the shapes the layouts
                // describe; the gradients are fresh, and the packed gradient's q, k and v parts are
                // disjoint column ranges.
                backward_kernel::<T>(p, g, self.pb.dims, self.pb.lay, self.pb.scale, &vis)
            });
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{backward, backward_with};
    use crate::ops::softmax::test_support::*;
    use crate::ops::{softmax, sum_to_shape};
    use crate::{Category, Device};

    fn bools(dev: &Device, v: &[bool], shape: &[usize]) -> Tensor {
        Tensor::from_slice(dev, v, shape, Category::Input).unwrap()
    }

    /// sdpa composed of public ops (matmul, softmax), with mask as a large negative bias.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
        let d = q.shape()[q.rank() - 1] as f64;
        let s = q.matmul(&k.transpose(-2, -1).unwrap()).unwrap().mul_scalar(1.0 / d.sqrt()).unwrap();
        let s = if causal {
            let (tq, tk) = (s.shape()[s.rank() - 2], s.shape()[s.rank() - 1]);
            let bias: Vec<f64> = (0..tq * tk).map(|x| if x % tk > x / tk { -1e300 } else { 0.0 }).collect();
            let b = Tensor::from_slice(q.device(), &bias, &[tq, tk], Category::Input).unwrap();
            s.add(&b.to_dtype(q.dtype()).unwrap()).unwrap()
        } else {
            s
        };
        softmax(&s, -1).unwrap().matmul(v).unwrap()
    }

    #[test]
    fn hand_checked_uniform_attention() {
        let dev = Device::cpu();
        // q = k = 0: every allowed key gets the same weight.
        let q = t64(&dev, &[0.0; 6], &[1, 1, 3, 2]);
        let v = t64(&dev, &[1.0, 10.0, 2.0, 20.0, 6.0, 60.0], &[1, 1, 3, 2]);
        let y = scaled_dot_product_attention(&q, &q, &v, false, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[3.0, 30.0, 3.0, 30.0, 3.0, 30.0], 1e-15, "plain");
        let y = scaled_dot_product_attention(&q, &q, &v, true, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[1.0, 10.0, 1.5, 15.0, 3.0, 30.0], 1e-15, "causal");
        // A [Tq, Tk] mask broadcast over batch and heads; True hides the key.
        let m = bools(&dev, &[false, true, true, true, false, false, false, true, false], &[3, 3]);
        let y = scaled_dot_product_attention(&q, &q, &v, false, Some(&m)).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[1.0, 10.0, 4.0, 40.0, 3.5, 35.0], 1e-15, "mask");
        // The scale is 1/sqrt(D): one key with score 2*sqrt(2)*... check against the formula.
        let q1 = t64(&dev, &[1.0, 1.0], &[1, 1, 1, 2]);
        let k1 = t64(&dev, &[1.0, 1.0, 0.0, 0.0], &[1, 1, 2, 2]);
        let v1 = t64(&dev, &[1.0, 0.0], &[1, 1, 2, 1]);
        let y = scaled_dot_product_attention(&q1, &k1, &v1, false, None).unwrap().item().unwrap();
        let e = (2.0 / 2f64.sqrt()).exp();
        assert_close(&[y], &[e / (e + 1.0)], 1e-15, "scale");
    }

    #[test]
    fn fully_masked_rows_give_zero_not_nan() {
        let dev = Device::cpu();
        let q = t64(&dev, &values(8, 1), &[1, 2, 2, 2]).set_requires_grad(true);
        let k = t64(&dev, &values(8, 2), &[1, 2, 2, 2]).set_requires_grad(true);
        let v = t64(&dev, &values(8, 3), &[1, 2, 2, 2]).set_requires_grad(true);
        // Head 0 row 1 sees nothing; everything else sees key 0 only.
        let m = bools(&dev, &[false, true, true, true, false, true, false, true], &[1, 2, 2, 2]);
        let y = scaled_dot_product_attention(&q, &k, &v, false, Some(&m)).unwrap();
        let yv = y.to_f64_vec().unwrap();
        assert_eq!(&yv[2..4], &[0.0, 0.0]);
        let vv = values(8, 3);
        assert_close(&[yv[0], yv[1], yv[4], yv[6]], &[vv[0], vv[1], vv[4], vv[4]], 1e-15, "single key");
        backward(&y.sum_all().unwrap()).unwrap();
        let gq = q.grad().unwrap().to_f64_vec().unwrap();
        assert!(gq.iter().all(|g| g.is_finite()));
        assert_eq!(&gq[2..4], &[0.0, 0.0]);
        // Key 1 of head 0 is never visible: no gradient reaches it.
        assert_eq!(&k.grad().unwrap().to_f64_vec().unwrap()[2..4], &[0.0, 0.0]);
        // Tk = 0: every row is empty, the output is zeros.
        let e = t64(&dev, &[], &[1, 1, 0, 2]);
        let q0 = q.narrow(1, 0, 1).unwrap();
        let y = scaled_dot_product_attention(&q0, &e, &e, false, None).unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), vec![0.0; 4]);
        q.set_grad(None);
        backward(&y.sum_all().unwrap()).unwrap();
        assert_eq!(q.grad().unwrap().to_f64_vec().unwrap(), vec![0.0; 8]);
    }

    #[test]
    fn shape_errors() {
        let dev = Device::cpu();
        let q = t64(&dev, &[0.0; 24], &[1, 2, 3, 4]);
        let k5 = t64(&dev, &[0.0; 30], &[1, 2, 3, 5]);
        assert!(scaled_dot_product_attention(&q, &k5, &q, false, None).is_err());
        let q2 = t64(&dev, &[0.0; 24], &[2, 1, 3, 4]);
        assert!(scaled_dot_product_attention(&q, &q2, &q2, false, None).is_err());
        let bad_mask = bools(&dev, &[false; 4], &[2, 2]);
        assert!(scaled_dot_product_attention(&q, &q, &q, false, Some(&bad_mask)).is_err());
        let float_mask = t64(&dev, &[0.0; 9], &[3, 3]);
        assert!(scaled_dot_product_attention(&q, &q, &q, false, Some(&float_mask)).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (q, k, v) = (values(2 * 3 * 4, 1), values(2 * 5 * 4, 2), values(2 * 5 * 3, 3));
        let qs = (q.iter().map(|x| x * 2.0).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        let ks = (k.clone(), vec![1, 2, 5, 4]);
        let vs = (v.clone(), vec![1, 2, 5, 3]);
        let inputs = [qs, ks, vs];
        gradcheck(&inputs, |t| scaled_dot_product_attention(&t[0], &t[1], &t[2], false, None));
        gradcheck(&inputs, |t| scaled_dot_product_attention(&t[0], &t[1], &t[2], true, None));
        gradcheck(&inputs, |t| {
            let m: Vec<bool> = (0..15).map(|x| x % 4 == 1).collect();
            let m = bools(t[0].device(), &m, &[3, 5]);
            scaled_dot_product_attention(&t[0], &t[1], &t[2], false, Some(&m))
        });
    }

    #[test]
    fn matches_composed_ops_on_larger_inputs() {
        let dev = Device::cpu();
        // bh = 1 (threaded GEMMs) and bh = 6 (parallel over matrices); Tq != Tk, D != Dv.
        for (b, h) in [(1, 1), (2, 3)] {
            let (tq, tk, d, dv) = (70, 90, 16, 24);
            let q = t64(&dev, &values(b * h * tq * d, 4), &[b, h, tq, d]).set_requires_grad(true);
            let k = t64(&dev, &values(b * h * tk * d, 5), &[b, h, tk, d]).set_requires_grad(true);
            let v = t64(&dev, &values(b * h * tk * dv, 6), &[b, h, tk, dv]).set_requires_grad(true);
            for causal in [false, true] {
                let g = t64(&dev, &values(b * h * tq * dv, 7), &[b, h, tq, dv]);
                let y = scaled_dot_product_attention(&q, &k, &v, causal, None).unwrap();
                backward_with(&y, g.clone()).unwrap();
                let got: Vec<Vec<f64>> =
                    [&q, &k, &v].iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                let r = reference(&q, &k, &v, causal);
                assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 1e-12, "output");
                backward_with(&r, g).unwrap();
                for (i, t) in [&q, &k, &v].iter().enumerate() {
                    let want = sum_to_shape(&t.take_grad().unwrap(), t.shape()).unwrap().to_f64_vec().unwrap();
                    assert_close(&got[i], &want, 1e-11, "gradient");
                }
            }
        }
    }

    #[test]
    fn golden_sdpa() {
        let g = Golden::open("attention.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            for (case, causal) in [("sdpa", false), ("sdpa_causal", true), ("sdpa_cross", false)] {
                let name = format!("{case}_{}", suffix(dtype));
                let key = |s: &str| format!("{name}/{s}");
                let (q, k, v) = (g.leaf(&dev, &key("q")), g.leaf(&dev, &key("k")), g.leaf(&dev, &key("v")));
                let y = scaled_dot_product_attention(&q, &k, &v, causal, None).unwrap();
                assert_golden(&y, &g.f64s(&key("output")), dtype, &name);
                backward_with(&y, g.tensor(&dev, &key("grad_out"))).unwrap();
                assert_golden(&q.grad().unwrap(), &g.f64s(&key("grad_q")), dtype, &name);
                assert_golden(&k.grad().unwrap(), &g.f64s(&key("grad_k")), dtype, &name);
                assert_golden(&v.grad().unwrap(), &g.f64s(&key("grad_v")), dtype, &name);
            }
        }
    }

    #[test]
    fn saves_inputs_and_log_sum_exp_only() {
        // Backward keeps q, k, v and the per-row log-sum-exp, never the [Tq, Tk] probabilities, and
        // allocates only the three gradients (its scratch is a few rows, outside the allocator).
        let dev = Device::cpu();
        let (tq, d) = (64, 8);
        let t = |salt| {
            Tensor::from_slice(&dev, &values(2 * tq * d, salt), &[1, 2, tq, d], Category::Temporary)
                .unwrap()
                .set_requires_grad(true)
        };
        let (q, k, v) = (t(1), t(2), t(3));
        let activation = || dev.stats().category(Category::Activation).current;
        assert_eq!(activation(), 0);
        let y = scaled_dot_product_attention(&q, &k, &v, true, None).unwrap();
        let input_bytes = (2 * tq * d * 8) as u64;
        let lse_bytes = (2 * tq * 8) as u64;
        assert_eq!(activation(), 3 * input_bytes + lse_bytes, "q, k, v and lse [1, 2, Tq] are saved");
        let g = t64(&dev, &values(2 * tq * d, 4), &[1, 2, tq, d]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let ops: Vec<&str> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| e.op)
            .collect();
        assert_eq!(ops, vec!["scaled_dot_product_attention_backward"; 3]);
        drop(a);
        assert_eq!(activation(), 3 * input_bytes, "the log-sum-exp is freed by backward");
        // The packed op saves its one input and the log-sum-exp, and allocates one gradient.
        let qkv = Tensor::from_slice(&dev, &values(2 * 10 * 24, 5), &[2, 10, 24], Category::Temporary)
            .unwrap()
            .set_requires_grad(true);
        let before_act = activation();
        let y = packed_self_attention(&qkv, 2, true, None).unwrap();
        assert_eq!(activation() - before_act, 4096 + 512, "qkv [2, 10, 24] and lse [2, 2, 10], in 512 B blocks");
        let g = t64(&dev, &values(2 * 10 * 8, 6), &[2, 10, 8]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let allocs: Vec<&str> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| e.op)
            .collect();
        assert_eq!(allocs, ["scaled_dot_product_attention_backward"]);
    }

    /// The unfused multi-head path: split qkv [B, T, 3E] into heads, sdpa, merge the heads.
    fn split_sdpa_merge(qkv: &Tensor, heads: usize, causal: bool, mask: Option<&Tensor>) -> Tensor {
        let (b, t, e) = (qkv.shape()[0] as isize, qkv.shape()[1] as isize, qkv.shape()[2] as isize / 3);
        let h = heads as isize;
        let parts = qkv.reshape(&[b, t, 3, h, e / h]).unwrap().permute(&[2, 0, 3, 1, 4]).unwrap();
        let part = |i| parts.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
        let y = scaled_dot_product_attention(&part(0), &part(1), &part(2), causal, mask).unwrap();
        y.permute(&[0, 2, 1, 3]).unwrap().reshape(&[b, t, e]).unwrap()
    }

    #[test]
    fn packed_matches_split_heads_sdpa() {
        let dev = Device::cpu();
        let (b, t, e, heads) = (2, 70, 24, 3);
        let x = t64(&dev, &values(b * t * 3 * e, 8), &[b, t, 3 * e]).set_requires_grad(true);
        let g = t64(&dev, &values(b * t * e, 9), &[b, t, e]);
        // A causal [T, T] mask (GPT's), a [B, heads, T, T] mask with fully masked rows, the flag.
        let causal_mask: Vec<bool> = (0..t * t).map(|i| i % t > i / t).collect();
        let causal_mask = bools(&dev, &causal_mask, &[t, t]);
        let sparse: Vec<bool> = (0..b * heads * t * t).map(|i| (i / t) % 9 == 4 || (i * 7) % 5 == 0).collect();
        let sparse = bools(&dev, &sparse, &[b, heads, t, t]);
        for (causal, mask) in [(false, None), (true, None), (false, Some(&causal_mask)), (true, Some(&sparse))] {
            let y = packed_self_attention(&x, heads, causal, mask).unwrap();
            backward_with(&y, g.clone()).unwrap();
            let got = x.take_grad().unwrap().to_f64_vec().unwrap();
            let r = split_sdpa_merge(&x, heads, causal, mask);
            assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 1e-12, "output");
            backward_with(&r, g.clone()).unwrap();
            assert_close(&got, &x.take_grad().unwrap().to_f64_vec().unwrap(), 1e-12, "gradient");
        }
        let y = packed_self_attention(&x, heads, false, Some(&sparse)).unwrap().to_f64_vec().unwrap();
        assert!(y.iter().all(|v| v.is_finite()));
        // Errors: E not divisible into heads, a mask that does not broadcast, a non-packed input.
        assert!(packed_self_attention(&x, 5, false, None).is_err());
        assert!(packed_self_attention(&x, heads, false, Some(&bools(&dev, &[false; 4], &[2, 2]))).is_err());
        assert!(packed_self_attention(&x.reshape(&[-1]).unwrap(), heads, false, None).is_err());
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.1, DType::F32, Category::Input)?.set_requires_grad(true))
            };
            let (q, k, v) = (t(&[2, 2, 4, 8])?, t(&[2, 2, 5, 8])?, t(&[2, 2, 5, 3])?);
            let m = Tensor::from_slice(dev, &[false, true, false, false, true], &[5], Category::Input)?;
            let y = scaled_dot_product_attention(&q, &k, &v, true, Some(&m))?;
            backward(&y.sum_all()?)?;
            let qkv = Tensor::full(dev, &[2, 5, 12], 0.1, DType::F32, Category::Input)?.set_requires_grad(true);
            let y = packed_self_attention(&qkv, 2, false, Some(&m))?;
            backward(&y.sum_all()?)
        });
    }
}
