//! CPU kernels of attention (`ops/attention.rs`): FlashAttention-style fused forward and backward,
//! one task per (batch, head) matrix, `DP_ROWS` query rows at a time, over operands addressed as the
//! op's [`AttnLayouts`] describe (plain [.., T, D] stacks or the packed [B, T, 3E] projection). The
//! only workspace is a per-task scratch outside the allocator: two `DP_ROWS x Tk` blocks of scores,
//! and the matrix's keys and values prepared once for all its blocks' products (packed where the
//! GEMM would pack them per product, at most `PREPARED_B_MAX_ELEMS` elements each); the
//! causal flag and the bool mask decide which keys each row sees (blocks skip keys past their last
//! visible one).

use super::elementwise::{exp_in_place, lane_dot, lane_sum, LANES};
use super::gemm::{gemm_into, prepare_b_in, prepared_b_len, prepared_part_into, Mat, Products, SendPtr};
use crate::dtype::Element;
use crate::dtype::Float;
use crate::error::{check_len, Error, Result};
use crate::layout::broadcast_layout;
use crate::view::View;
use crate::with_float;
use memfit_kernels::{multiversion, Isa};
use rayon::prelude::*;

/// Sizes of one attention problem.
#[derive(Clone, Copy)]
pub struct AttnDims {
    /// Number of (batch, head) matrices.
    pub bh: usize,
    /// Heads per batch element (for addressing; 1 when the operands are plain [bh, T, D] stacks).
    pub heads: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub dv: usize,
}

/// Where the (batch, head) matrices of an operand live, in elements: matrix `i = b * heads + h` starts
/// at `offset + b * batch_stride + h * head_stride`, its rows are `row_stride` apart and its columns
/// contiguous. A gradient has the same layout as its input.
#[derive(Clone, Copy)]
pub struct AttnAddr {
    pub offset: usize,
    pub batch_stride: usize,
    pub head_stride: usize,
    pub row_stride: usize,
}

impl AttnAddr {
    /// A contiguous stack of [rows, cols] matrices.
    pub fn stack(rows: usize, cols: usize) -> AttnAddr {
        AttnAddr { offset: 0, batch_stride: rows * cols, head_stride: 0, row_stride: cols }
    }

    pub fn start(&self, i: usize, heads: usize) -> usize {
        self.offset + (i / heads) * self.batch_stride + (i % heads) * self.head_stride
    }

    /// One past the furthest element that the rows of `bh` matrices of `rows x cols` reach (`heads`
    /// divides `bh`, so the last matrix starts furthest in), or 0 when there are no rows.
    fn extent(&self, bh: usize, heads: usize, rows: usize, cols: usize) -> usize {
        match (bh.checked_sub(1), rows.checked_sub(1)) {
            (Some(last), Some(last_row)) => self.start(last, heads) + last_row * self.row_stride + cols,
            _ => 0,
        }
    }
}

/// Layouts of q, k, v and the output (and of their gradients).
#[derive(Clone, Copy)]
pub struct AttnLayouts {
    pub q: AttnAddr,
    pub k: AttnAddr,
    pub v: AttnAddr,
    pub out: AttnAddr,
}

/// One attention call: sizes, operand layouts, scale and which keys are visible.
pub struct AttnProblem {
    pub dims: AttnDims,
    pub lay: AttnLayouts,
    pub scale: f64,
    pub causal: bool,
    /// The mask's broadcast target, [batch..., Tq, Tk].
    pub full: Vec<usize>,
    /// How the two products compute (the device's setting).
    pub products: Products,
}

impl AttnProblem {
    /// Refuses operands shorter than the matrices this problem addresses in them (`q`, `k`, `v` and
    /// `out` are their lengths in elements; gradients are laid out as their inputs), and the log-sum-exp
    /// shorter than one entry per query row, so that the kernels' raw-pointer walks stay in bounds.
    fn check_lengths(&self, name: &str, q: usize, k: usize, v: usize, out: usize, lse: Option<usize>) -> Result<()> {
        let AttnDims { bh, heads, tq, tk, d, dv } = self.dims;
        if heads == 0 || bh % heads != 0 {
            return Err(Error::invalid(format!(
                "{name}: {bh} matrices are not a whole number of batches of {heads} heads"
            )));
        }
        let lay = &self.lay;
        check_len(&format!("{name} q"), q, lay.q.extent(bh, heads, tq, d))?;
        check_len(&format!("{name} k"), k, lay.k.extent(bh, heads, tk, d))?;
        check_len(&format!("{name} v"), v, lay.v.extent(bh, heads, tk, dv))?;
        check_len(&format!("{name} output"), out, lay.out.extent(bh, heads, tq, dv))?;
        match lse {
            Some(n) => check_len(&format!("{name} log-sum-exp"), n, bh * tq),
            None => Ok(()),
        }
    }
}

/// Query rows per block, in forward and backward (their scores take 2 x DP_ROWS x Tk of the
/// per-task scratch). Smaller blocks skip more of the causal triangle, larger ones make larger
/// products, and a multiple of every micro-kernel's rows (6 and 12) leaves no partial tile: on the
/// GPT (T = 128, head size 64) 24 rows beat 32 (attention 43 vs 45 ms a step on AVX-512, 48 vs 50
/// on AVX2), which beat 36, 48, 16, 64 and 128; after the causal fast path, 24 still beats 16, 32
/// and 48 (38 vs 47, 41, 40 ms on AVX-512).
const DP_ROWS: usize = 24;

/// Runs `f(i, gemm_threads, scratch)` for every batch matrix: in parallel over matrices when there
/// are several, else one matrix with multi-threaded GEMMs. `scratch` is `scratch_len` elements,
/// allocated (and zeroed) once per rayon job and reused by the matrices the job runs: `f` may not
/// expect it zeroed.
fn for_each_matrix<T: Float>(bh: usize, scratch_len: usize, f: impl Fn(usize, usize, &mut [T]) + Sync + Send) {
    let new = || vec![T::zero(); scratch_len];
    if bh > 1 {
        (0..bh).into_par_iter().for_each_init(new, |scratch, i| f(i, 1, scratch));
    } else {
        let mut scratch = new();
        (0..bh).for_each(|i| f(i, rayon::current_num_threads(), &mut scratch));
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
    fn new(m: View<'a>, full: &[usize]) -> Result<Self> {
        let r = full.len();
        let l = broadcast_layout(m.layout(), full);
        Ok(MaskView {
            bytes: m.storage_bytes(),
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

impl<'a> Visibility<'a> {
    /// The causal flag and the mask, `tq x tk` per matrix. A mask that is the same for every matrix
    /// and hides exactly the keys after each query (a GPT's `triu(ones, 1)` buffer) becomes the
    /// causal flag, and one that hides nothing goes: the same keys seen, by the fast paths (whole
    /// visible prefixes, no byte per score).
    fn new(causal: bool, mask: Option<MaskView<'a>>, tq: usize, tk: usize) -> Self {
        let Some(m) = mask else { return Visibility { causal, mask: None } };
        if m.batch_strides.iter().any(|&s| s != 0) {
            return Visibility { causal, mask: Some(m) };
        }
        let base = m.base(0);
        let matches = |hides: &dyn Fn(usize, usize) -> bool| {
            (0..tq).all(|r| (0..tk).all(|j| m.masked(base, r, j) == hides(r, j)))
        };
        if matches(&|r, j| j > r) {
            Visibility { causal: true, mask: None }
        } else if matches(&|_, _| false) {
            Visibility { causal, mask: None }
        } else {
            Visibility { causal, mask: Some(m) }
        }
    }

    /// The mask's element offset for matrix i (0 without a mask).
    fn base(&self, i: usize) -> usize {
        self.mask.as_ref().map_or(0, |m| m.base(i))
    }

    fn hidden(&self, base: usize, r: usize, j: usize) -> bool {
        (self.causal && j > r) || self.mask.as_ref().is_some_and(|m| m.masked(base, r, j))
    }

    /// Hides the keys row `r` may not see in its `row` of scores (set to -inf) and scales the others;
    /// without a mask, the visible keys are a prefix, handled a slice at a time.
    fn scale_and_hide<T: Float>(&self, isa: Isa, base: usize, r: usize, row: &mut [T], scale: T) {
        if self.mask.is_none() {
            let visible = if self.causal { row.len().min(r + 1) } else { row.len() };
            return scale_prefix(isa, row, visible, scale);
        }
        for (j, v) in row.iter_mut().enumerate() {
            *v = if self.hidden(base, r, j) { T::neg_infinity() } else { *v * scale };
        }
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

// The softmax of a block of rows in three steps, so that the exponentials of the whole block are
// one call of the vectorised exp (not one per row): `shift_row` per row, `exp_in_place` over the
// block, `normalize_row` per row. A row's values and log-sum-exp do not depend on the grouping.

multiversion! {
    /// First step of the softmax of one row of scaled, masked scores (hidden keys -inf): subtracts
    /// the row's maximum and returns it; a fully masked row (maximum -inf) becomes all -inf (0
    /// once exponentiated), a row with a NaN score all NaN (the NaN is returned).
    fn shift_row<T: Float>(row: &mut [T]) -> T {
        // The maximum and whether any score is NaN, in lanes as `lane_sum` keeps its sums.
        let (mut lanes, mut nan) = ([T::neg_infinity(); LANES], [false; LANES]);
        let groups = row.chunks_exact(LANES);
        let mut m = groups.remainder().iter().fold(T::neg_infinity(), |m, &v| if v > m { v } else { m });
        let mut any_nan = groups.remainder().iter().any(|v| v.is_nan());
        for group in groups {
            for i in 0..LANES {
                let v = group[i];
                lanes[i] = if v > lanes[i] { v } else { lanes[i] };
                nan[i] |= v.is_nan();
            }
        }
        for (&v, &n) in lanes.iter().zip(&nan) {
            m = if v > m { v } else { m };
            any_nan |= n;
        }
        // NaN wins, so a NaN score is never mistaken for a fully masked row.
        if any_nan {
            m = T::nan();
        }
        if m == T::neg_infinity() {
            row.fill(T::neg_infinity());
        } else {
            row.iter_mut().for_each(|v| *v -= m);
        }
        m
    }
}

multiversion! {
    /// Last step of the softmax of one row: divides the exponentials by their sum and returns the
    /// log-sum-exp `m + ln(sum)` (-inf for a fully masked row, whose exponentials are all 0).
    fn normalize_row<T: Float>(row: &mut [T], m: T) -> T {
        if m == T::neg_infinity() {
            return m;
        }
        let sum = lane_sum(row, |v| v);
        row.iter_mut().for_each(|v| *v = *v / sum);
        m + sum.ln()
    }
}

multiversion! {
    /// Scales the first `visible` scores of a row and hides the rest (-inf).
    fn scale_prefix<T: Float>(row: &mut [T], visible: usize, scale: T) {
        let (seen, unseen) = row.split_at_mut(visible.min(row.len()));
        seen.iter_mut().for_each(|v| *v *= scale);
        unseen.fill(T::neg_infinity());
    }
}

multiversion! {
    /// Backward's probabilities from a row of scaled, masked scores and the row's log-sum-exp `l`,
    /// first step: `s - l` (-inf for a fully masked row, `l` = -inf), which the block's exp turns
    /// into forward's softmax (0 for the masked row).
    fn subtract_lse_row<T: Float>(row: &mut [T], l: T) {
        if l == T::neg_infinity() {
            row.fill(T::neg_infinity());
        } else {
            row.iter_mut().for_each(|v| *v -= l);
        }
    }
}

multiversion! {
    /// Softmax backward of one row, over the probabilities `p`: `dS = p * (dp - d) * scale`, `d` the
    /// row's D (`rowsum(dO * O)`, which is `rowsum(p * dp)`).
    fn softmax_grad_row<T: Float>(p: &mut [T], dp: &[T], d: T, scale: T) {
        p.iter_mut().zip(dp).for_each(|(p, &g)| *p = *p * (g - d) * scale);
    }
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
    /// Backward: each query row's D, [bh, tq] (null when no dS is wanted).
    delta: SendPtr<T>,
}

/// The pointer and length (in elements) of an operand the kernels read.
fn read_ptr<T: Element>(t: View<'_>) -> Result<(SendPtr<T>, usize)> {
    let s = t.slice::<T>()?;
    Ok((SendPtr(s.as_ptr() as *mut T), s.len()))
}

/// The pointer and length (in elements) of an operand the kernels write.
fn write_ptr<T: Element>(t: View<'_>) -> Result<(SendPtr<T>, usize)> {
    let s = t.slice_mut::<T>()?;
    Ok((SendPtr(s.as_mut_ptr()), s.len()))
}

/// Forward: writes the output and, when `p.lse` is non-null, the per-row log-sum-exp. The pointers
/// must cover every matrix of `dims` as laid out by `lay` (lse: [bh, tq] contiguous), and the output
/// and lse must not overlap the inputs (the callers pass fresh tensors).
fn forward_kernel<T: Float + Element>(
    p: Ptrs<T>,
    dims: AttnDims,
    lay: AttnLayouts,
    scale: f64,
    vis: &Visibility<'_>,
    products: Products,
) {
    let AttnDims { bh, heads, tq, tk, d, dv } = dims;
    let scale = T::of(scale);
    let isa = Isa::active();
    // Per task: a block of scores, then k^T and v prepared once for all the blocks (each uses
    // their first keys).
    let lens = [DP_ROWS.min(tq) * tk, prepared_b_len(d, tk), prepared_b_len(tk, dv)];
    for_each_matrix(bh, lens.iter().sum(), |i, threads, scratch: &mut [T]| {
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
            let (s, packs) = scratch.split_at_mut(lens[0]);
            let (kt_buf, v_buf) = packs.split_at_mut(lens[1]);
            let kt = Mat { ptr: ki, rs: 1, cs: lay.k.row_stride as isize };
            let kt = prepare_b_in(d, tk, kt, kt_buf, threads, products);
            let vm = Mat { ptr: vi, rs: lay.v.row_stride as isize, cs: 1 };
            let vm = prepare_b_in(tk, dv, vm, v_buf, threads, products);
            for r0 in (0..tq).step_by(DP_ROWS) {
                let rows = DP_ROWS.min(tq - r0);
                let kend = vis.key_end(base, r0, rows, tk);
                let qb = Mat { ptr: qi.add(r0 * lay.q.row_stride), rs: lay.q.row_stride as isize, cs: 1 };
                prepared_part_into(&kt, rows, kend, d, s.as_mut_ptr(), kend as isize, false, qb, threads);
                let mut maxima = [T::zero(); DP_ROWS];
                for (r, m) in maxima[..rows].iter_mut().enumerate() {
                    let row = &mut s[r * kend..(r + 1) * kend];
                    vis.scale_and_hide(isa, base, r0 + r, row, scale);
                    *m = shift_row(isa, row);
                }
                exp_in_place(&mut s[..rows * kend]);
                for (r, &m) in maxima[..rows].iter().enumerate() {
                    let lse = normalize_row(isa, &mut s[r * kend..(r + 1) * kend], m);
                    if !p.lse.0.is_null() {
                        *p.lse.0.add(i * tq + r0 + r) = lse;
                    }
                }
                let pm = Mat { ptr: s.as_ptr(), rs: kend as isize, cs: 1 };
                let dst = oi.add(r0 * lay.out.row_stride);
                prepared_part_into(&vm, rows, dv, kend, dst, lay.out.row_stride as isize, false, pm, threads);
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
    dims: AttnDims,
    lay: AttnLayouts,
    scale: f64,
    vis: &Visibility<'_>,
    products: Products,
) {
    let AttnDims { bh, heads, tq, tk, d, dv } = dims;
    let scale = T::of(scale);
    let isa = Isa::active();
    let [gq, gk, gv] = g;
    let need_ds = gq.is_some() || gk.is_some();
    // Per task: blocks of scores (and of their gradient), then k^T, v^T and k prepared once for all
    // the blocks (each uses their first keys).
    let block = DP_ROWS.min(tq) * tk;
    let lens = [
        block,
        if need_ds { block } else { 0 },
        prepared_b_len(d, tk),
        if need_ds { prepared_b_len(dv, tk) } else { 0 },
        if gq.is_some() { prepared_b_len(tk, d) } else { 0 },
    ];
    for_each_matrix(bh, lens.iter().sum(), |i, threads, scratch: &mut [T]| {
        let (p, gq, gk, gv) = (p, gq, gk, gv);
        // SAFETY: matrix i's regions are in bounds (caller); the gradients' matrix-i regions are
        // touched only by this task.
        unsafe {
            let qi = p.q.0.add(lay.q.start(i, heads)) as *const T;
            let ki = p.k.0.add(lay.k.start(i, heads)) as *const T;
            let vi = p.v.0.add(lay.v.start(i, heads)) as *const T;
            let goi = p.o.0.add(lay.out.start(i, heads)) as *const T;
            let lse = p.lse.0.add(i * tq) as *const T;
            let delta = p.delta.0.add(i * tq) as *const T;
            let gqi = gq.map(|g| g.0.add(lay.q.start(i, heads)));
            let gki = gk.map(|g| g.0.add(lay.k.start(i, heads)));
            let gvi = gv.map(|g| g.0.add(lay.v.start(i, heads)));
            // dK and dV accumulate over row blocks, and keys a block skips get nothing from it: the
            // first block to reach a key writes its rows, later ones add to them (`touched`: the
            // keys some block has reached), and keys no block reaches are zeroed at the end.
            let mut touched = 0;
            let (qrs, krs, vrs, ors) = (
                lay.q.row_stride as isize,
                lay.k.row_stride as isize,
                lay.v.row_stride as isize,
                lay.out.row_stride as isize,
            );
            let base = vis.base(i);
            let (s, rest) = scratch.split_at_mut(lens[0]);
            let (dp, rest) = rest.split_at_mut(lens[1]);
            let (kt_buf, rest) = rest.split_at_mut(lens[2]);
            let (vt_buf, k_buf) = rest.split_at_mut(lens[3]);
            let kt = prepare_b_in(d, tk, Mat { ptr: ki, rs: 1, cs: krs }, kt_buf, threads, products);
            let vt = prepare_b_in(dv, tk, Mat { ptr: vi, rs: 1, cs: vrs }, vt_buf, threads, products);
            let km = prepare_b_in(tk, d, Mat { ptr: ki, rs: krs, cs: 1 }, k_buf, threads, products);
            for r0 in (0..tq).step_by(DP_ROWS) {
                let rows = DP_ROWS.min(tq - r0);
                let kend = vis.key_end(base, r0, rows, tk);
                let qb = Mat { ptr: qi.add(r0 * lay.q.row_stride), rs: qrs, cs: 1 };
                let gob = Mat { ptr: goi.add(r0 * lay.out.row_stride), rs: ors, cs: 1 };
                // P = exp(S - lse), recomputed exactly as forward scaled and masked it.
                prepared_part_into(&kt, rows, kend, d, s.as_mut_ptr(), kend as isize, false, qb, threads);
                for r in 0..rows {
                    let l = *lse.add(r0 + r);
                    let row = &mut s[r * kend..(r + 1) * kend];
                    if l != T::neg_infinity() {
                        vis.scale_and_hide(isa, base, r0 + r, row, scale);
                    }
                    subtract_lse_row(isa, row, l);
                }
                exp_in_place(&mut s[..rows * kend]);
                let pm = Mat { ptr: s.as_ptr(), rs: kend as isize, cs: 1 };
                let pt = Mat { ptr: s.as_ptr(), rs: 1, cs: kend as isize };
                // `dst[:kend] (+)= a[:kend] @ b`: added to the keys reached before, written for the
                // others (a row of `a` per key, `dst`'s rows `rs` apart).
                let seen = touched.min(kend);
                let add_or_write = |dst: *mut T, rs: isize, a: Mat<T>, b: Mat<T>, cols: usize| {
                    if seen > 0 {
                        gemm_into::<T>(seen, cols, rows, dst, rs, true, a, b, threads, products);
                    }
                    if kend > seen {
                        let a = Mat { ptr: a.ptr.offset(seen as isize * a.rs), ..a };
                        gemm_into::<T>(
                            kend - seen,
                            cols,
                            rows,
                            dst.offset(seen as isize * rs),
                            rs,
                            false,
                            a,
                            b,
                            threads,
                            products,
                        );
                    }
                };
                touched = touched.max(kend);
                if let Some(gvi) = gvi {
                    // dV[:kend] += P^T dO
                    add_or_write(gvi, vrs, pt, gob, dv);
                }
                if !need_ds {
                    continue;
                }
                // dP = dO v^T; dS = P * (dP - D) * scale, over P.
                prepared_part_into(&vt, rows, kend, dv, dp.as_mut_ptr(), kend as isize, false, gob, threads);
                for r in 0..rows {
                    let prow = &mut s[r * kend..(r + 1) * kend];
                    let dprow = &dp[r * kend..(r + 1) * kend];
                    softmax_grad_row(isa, prow, dprow, *delta.add(r0 + r), scale);
                }
                if let Some(gqi) = gqi {
                    // dQ rows = dS k[:kend]
                    prepared_part_into(&km, rows, d, kend, gqi.add(r0 * lay.q.row_stride), qrs, false, pm, threads);
                }
                if let Some(gki) = gki {
                    // dK[:kend] += dS^T q rows
                    add_or_write(gki, krs, pt, qb, d);
                }
            }
            if let Some(gki) = gki {
                zero_rows(gki.add(touched * lay.k.row_stride), tk - touched, d, lay.k.row_stride);
            }
            if let Some(gvi) = gvi {
                zero_rows(gvi.add(touched * lay.v.row_stride), tk - touched, dv, lay.v.row_stride);
            }
        }
    });
}

/// The writable pointer of each gradient, one per tensor: a gradient given more than once (the
/// packed op's one [B, T, 3E] gradient for q, k and v) gets the same pointer each time. Each is
/// checked to hold what its input's layout addresses.
fn grad_ptrs<T: Element>(g: [Option<View<'_>>; 3], pb: &AttnProblem) -> Result<[Option<SendPtr<T>>; 3]> {
    let AttnDims { bh, heads, tq, tk, d, dv } = pb.dims;
    let lay = &pb.lay;
    let need = [lay.q.extent(bh, heads, tq, d), lay.k.extent(bh, heads, tk, d), lay.v.extent(bh, heads, tk, dv)];
    let mut out: [Option<(SendPtr<T>, usize)>; 3] = [None; 3];
    for i in 0..3 {
        let Some(t) = g[i] else { continue };
        let earlier = (0..i).find(|&j| g[j].is_some_and(|e| e.same(t))).and_then(|j| out[j]);
        let (p, len) = match earlier {
            Some(seen) => seen,
            None => write_ptr(t)?,
        };
        check_len(&format!("scaled_dot_product_attention_backward gradient of {}", ["q", "k", "v"][i]), len, need[i])?;
        out[i] = Some((p, len));
    }
    Ok(out.map(|o| o.map(|(p, _)| p)))
}

/// Forward into `out` and, when given, the per-row log-sum-exp `lse`.
pub fn attention(
    q: View<'_>,
    k: View<'_>,
    v: View<'_>,
    mask: Option<View<'_>>,
    pb: &AttnProblem,
    out: View<'_>,
    lse: Option<View<'_>>,
    _gpu_workspace: Option<View<'_>>,
) -> Result<()> {
    if pb.dims.bh == 0 {
        return Ok(());
    }
    let mask = mask.map(|m| MaskView::new(m, &pb.full)).transpose()?;
    let vis = Visibility::new(pb.causal, mask, pb.dims.tq, pb.dims.tk);
    with_float!(q.dtype(), "scaled_dot_product_attention", T => {
        let ((q, nq), (k, nk), (v, nv), (o, no)) = (read_ptr(q)?, read_ptr(k)?, read_ptr(v)?, write_ptr(out)?);
        let lse = lse.map(write_ptr).transpose()?;
        pb.check_lengths("scaled_dot_product_attention", nq, nk, nv, no, lse.map(|(_, n)| n))?;
        let lse = lse.map_or(SendPtr(std::ptr::null_mut()), |(p, _)| p);
        let p = Ptrs::<T> { q, k, v, o, lse, delta: SendPtr(std::ptr::null_mut()) };
        // The tensors are contiguous and hold what the layouts address (checked); out and lse are fresh.
        forward_kernel::<T>(p, pb.dims, pb.lay, pb.scale, &vis, pb.products)
    });
    Ok(())
}

/// D of every query row into `delta` ([bh, tq], contiguous): `rowsum(dO * O)`, the output `out`
/// and its gradient `grad` both laid out as the problem's output. The backward's dS is
/// `P * (dP - D)`, and `rowsum(P * dP)` is D (dP = dO v^T, O = P v), so D comes from a pass over
/// the output's rows rather than over every row's keys (Note [Attention's D] in the tensor crate).
/// `out` is in `grad`'s dtype, or (with an f32 `grad`) in bf16 or f16 as half-precision storage saved
/// it: each row widened to the f32 that restoring it gives, then the same dot product, so D has
/// the bits it has from the restored output, without the restored copy.
pub fn attention_delta(out: View<'_>, grad: View<'_>, pb: &AttnProblem, delta: View<'_>) -> Result<()> {
    use crate::dtype::DType;
    const NAME: &str = "scaled_dot_product_attention_backward";
    let isa = Isa::active();
    match (out.dtype(), grad.dtype()) {
        (DType::BF16, DType::F32) => {
            row_deltas(out, grad, pb, delta, |o, g, row| widened_dot(isa, o, g, row, half::bf16::to_f32))
        }
        (DType::F16, DType::F32) => {
            row_deltas(out, grad, pb, delta, |o, g, row| widened_dot(isa, o, g, row, half::f16::to_f32))
        }
        _ => {
            with_float!(grad.dtype(), NAME, T => row_deltas::<T, T>(out, grad, pb, delta, |o, g, _| row_dot(isa, o, g)))
        }
    }
}

/// The dot product of a row saved in 16 bits (`o`, each element widened by `widen` into `row`) and
/// an f32 row: [`row_dot`]'s on the restored row, bit for bit.
fn widened_dot<H: Copy>(isa: Isa, o: &[H], g: &[f32], row: &mut Vec<f32>, widen: fn(H) -> f32) -> f32 {
    row.clear();
    row.extend(o.iter().map(|&h| widen(h)));
    row_dot(isa, row, g)
}

/// [`attention_delta`]'s pass: each query row's D = `dot(output row, gradient row, scratch)`, the
/// output in `O`, its gradient and D in `T`; `scratch` is a row buffer of the task's own.
fn row_deltas<O: Element, T: Element>(
    out: View<'_>,
    grad: View<'_>,
    pb: &AttnProblem,
    delta: View<'_>,
    dot: impl Fn(&[O], &[T], &mut Vec<T>) -> T + Sync + Send,
) -> Result<()> {
    const NAME: &str = "scaled_dot_product_attention_backward";
    let AttnDims { bh, heads, tq, dv, .. } = pb.dims;
    if bh == 0 {
        return Ok(());
    }
    let ((o, no), (g, ng), (d, nd)) = (read_ptr::<O>(out)?, read_ptr::<T>(grad)?, write_ptr::<T>(delta)?);
    let need = pb.lay.out.extent(bh, heads, tq, dv);
    check_len(&format!("{NAME} output"), no, need)?;
    check_len(&format!("{NAME} output gradient"), ng, need)?;
    check_len(&format!("{NAME} D"), nd, bh * tq)?;
    let lay = pb.lay.out;
    (0..bh).into_par_iter().for_each(|i| {
        let (o, g, d) = (o, g, d);
        let mut scratch = Vec::new();
        for r in 0..tq {
            let at = lay.start(i, heads) + r * lay.row_stride;
            // SAFETY: the rows are inside the lengths checked above; task i alone writes D's row
            // block i.
            unsafe {
                let orow = std::slice::from_raw_parts(o.0.add(at) as *const O, dv);
                let grow = std::slice::from_raw_parts(g.0.add(at) as *const T, dv);
                *d.0.add(i * tq + r) = dot(orow, grow, &mut scratch);
            }
        }
    });
    Ok(())
}

multiversion! {
    /// The dot product of two rows, in lanes.
    fn row_dot<T: Float>(a: &[T], b: &[T]) -> T {
        lane_dot(a, b)
    }
}

/// Backward from the output's gradient `grad`: the gradients of q, k and v, each when given (the
/// packed op gives its one gradient three times), with each query row's D from
/// [`attention_delta`] (needed when the gradient of q or k is).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: View<'_>,
    k: View<'_>,
    v: View<'_>,
    mask: Option<View<'_>>,
    lse: View<'_>,
    pb: &AttnProblem,
    grad: View<'_>,
    delta: Option<View<'_>>,
    gq: Option<View<'_>>,
    gk: Option<View<'_>>,
    gv: Option<View<'_>>,
    _gpu_workspace: Option<View<'_>>,
) -> Result<()> {
    if pb.dims.bh == 0 {
        return Ok(());
    }
    let mask = mask.map(|m| MaskView::new(m, &pb.full)).transpose()?;
    let vis = Visibility::new(pb.causal, mask, pb.dims.tq, pb.dims.tk);
    const NAME: &str = "scaled_dot_product_attention_backward";
    with_float!(grad.dtype(), NAME, T => {
        let ((q, nq), (k, nk), (v, nv), (o, no)) = (read_ptr(q)?, read_ptr(k)?, read_ptr(v)?, read_ptr(grad)?);
        let (lse, nl) = read_ptr(lse)?;
        pb.check_lengths(NAME, nq, nk, nv, no, Some(nl))?;
        let delta = match delta.map(read_ptr::<T>).transpose()? {
            Some((d, nd)) => {
                check_len(&format!("{NAME} D"), nd, pb.dims.bh * pb.dims.tq)?;
                d
            }
            None if gq.is_some() || gk.is_some() => {
                return Err(Error::invalid(format!("{NAME}: the gradients of q and k need each row's D")))
            }
            None => SendPtr(std::ptr::null_mut()),
        };
        let p = Ptrs::<T> { q, k, v, o, lse, delta };
        let g = grad_ptrs::<T>([gq, gk, gv], pb)?;
        // The saved tensors and the gradients are contiguous and hold what the layouts address
        // (checked); the gradients are fresh, and the packed gradient's q, k and v parts are
        // disjoint column ranges.
        backward_kernel::<T>(p, g, pb.dims, pb.lay, pb.scale, &vis, pb.products)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores with a spread of magnitudes from a fixed seed, some hidden (-inf).
    fn scores(len: usize, seed: u64, hidden_every: usize) -> Vec<f32> {
        let hidden = |j: usize| hidden_every > 0 && j % hidden_every == 0;
        let values = crate::test_values::uniform(len, seed).enumerate();
        values.map(|(j, v)| if hidden(j) { f32::NEG_INFINITY } else { (v * 20.0) as f32 }).collect()
    }

    /// Which path a mask takes: shared causal → the causal flag; shared empty → no mask; per
    /// matrix, or one key off causal → read byte by byte.
    #[test]
    fn a_shared_causal_or_empty_mask_becomes_the_flag_or_nothing() {
        use crate::layout::Layout;
        let t = 5;
        let full = [2, t, t];
        let path = |pattern: &dyn Fn(usize, usize) -> bool, per_matrix: bool, causal: bool| {
            let one: Vec<u8> = (0..t * t).map(|i| pattern(i / t, i % t) as u8).collect();
            let mut bytes = if per_matrix { one.repeat(2) } else { one };
            let layout = Layout::contiguous(if per_matrix { &full[..] } else { &full[1..] });
            // SAFETY: `bytes` holds the layout's elements, one byte each, and outlives the view.
            let view = unsafe { View::new(bytes.as_mut_ptr(), bytes.len(), crate::dtype::DType::Bool, &layout) };
            let vis = Visibility::new(causal, Some(MaskView::new(view, &full).unwrap()), t, t);
            (vis.causal, vis.mask.is_some())
        };
        let later = |r: usize, j: usize| j > r;
        assert_eq!(path(&later, false, false), (true, false), "shared causal mask");
        assert_eq!(path(&later, true, false), (false, true), "causal mask per matrix");
        assert_eq!(path(&|_, _| false, false, false), (false, false), "shared empty mask");
        assert_eq!(path(&|_, _| false, false, true), (true, false), "shared empty mask, causal flag");
        assert_eq!(path(&|r, j| j > r || (r, j) == (3, 1), false, false), (false, true), "one key off causal");
        assert_eq!(path(&|r, j| j >= r, false, false), (false, true), "the diagonal hidden too");
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// The softmax of one row as the kernels take it, in its three steps; returns the log-sum-exp.
    fn softmax_row(isa: Isa, row: &mut [f32]) -> f32 {
        let m = shift_row(isa, row);
        exp_in_place(row);
        normalize_row(isa, row, m)
    }

    /// Backward writes every key's gradient whatever its buffer held: the first block to reach a
    /// key writes it, later ones add, and keys no query sees get 0. Three blocks of queries whose
    /// masks reach keys 0..20, then only 0..10, then 0..25 (out of 30), with random holes.
    #[test]
    fn key_gradients_are_written_whatever_the_buffers_held() {
        use crate::dtype::DType;
        use crate::layout::Layout;
        use crate::test_values::uniform;
        let (bh, tq, tk, d) = (2, 2 * DP_ROWS + 12, 30, 4);
        let reach = |r: usize| {
            if r < DP_ROWS {
                20
            } else if r < 2 * DP_ROWS {
                10
            } else {
                25
            }
        };
        let mut mask: Vec<u8> = uniform(bh * tq * tk, 9)
            .enumerate()
            .map(|(i, hole)| {
                let (r, j) = (i / tk % tq, i % tk);
                (j >= reach(r) || (j > 0 && hole < -0.3)) as u8
            })
            .collect();
        let f32_values = |n: usize, seed: u64| uniform(n, seed).map(|x| x as f32).collect::<Vec<f32>>();
        let (q, k, v, go) = (
            f32_values(bh * tq * d, 1),
            f32_values(bh * tk * d, 2),
            f32_values(bh * tk * d, 3),
            f32_values(bh * tq * d, 4),
        );
        let (mut out, mut lse) = (vec![0f32; bh * tq * d], vec![0f32; bh * tq]);
        let lay = AttnLayouts {
            q: AttnAddr::stack(tq, d),
            k: AttnAddr::stack(tk, d),
            v: AttnAddr::stack(tk, d),
            out: AttnAddr::stack(tq, d),
        };
        let dims = AttnDims { bh, heads: 1, tq, tk, d, dv: d };
        let pb = AttnProblem { dims, lay, scale: 0.5, causal: false, full: vec![bh, tq, tk], products: Products::F32 };
        let (lq, lk, lm, ll) = (
            Layout::contiguous(&[bh, tq, d]),
            Layout::contiguous(&[bh, tk, d]),
            Layout::contiguous(&[bh, tq, tk]),
            Layout::contiguous(&[bh, tq]),
        );
        /// A view of `v` as `l`.
        fn f32s<'a>(v: &mut [f32], l: &'a Layout) -> View<'a> {
            // SAFETY: every buffer holds its layout's elements and outlives its views (the test's
            // calls use them while the buffers live).
            unsafe { View::new(v.as_mut_ptr() as *mut u8, v.len() * 4, DType::F32, l) }
        }
        // SAFETY: as above, one byte per mask element.
        let m = unsafe { View::new(mask.as_mut_ptr(), mask.len(), DType::Bool, &lm) };
        let (mut q1, mut k1, mut v1) = (q.clone(), k.clone(), v.clone());
        let (qv, kv, vv) = (f32s(&mut q1, &lq), f32s(&mut k1, &lk), f32s(&mut v1, &lk));
        attention(qv, kv, vv, Some(m), &pb, f32s(&mut out, &lq), Some(f32s(&mut lse, &ll)), None).unwrap();
        let grads = |fill: f32| {
            let (mut gq, mut gk, mut gv) = (vec![fill; bh * tq * d], vec![fill; bh * tk * d], vec![fill; bh * tk * d]);
            let (mut lse, mut go) = (lse.clone(), go.clone());
            let (l, g) = (f32s(&mut lse, &ll), f32s(&mut go, &lq));
            let (dq, dk, dv) = (f32s(&mut gq, &lq), f32s(&mut gk, &lk), f32s(&mut gv, &lk));
            let (mut o, mut delta) = (out.clone(), vec![fill; bh * tq]);
            let dl = f32s(&mut delta, &ll);
            attention_delta(f32s(&mut o, &lq), g, &pb, dl).unwrap();
            attention_backward(qv, kv, vv, Some(m), l, &pb, g, Some(dl), Some(dq), Some(dk), Some(dv), None).unwrap();
            (gq, gk, gv)
        };
        let (zeroed, stale) = (grads(0.0), grads(f32::NAN));
        assert_eq!(bits(&stale.0), bits(&zeroed.0), "dq");
        assert_eq!(bits(&stale.1), bits(&zeroed.1), "dk");
        assert_eq!(bits(&stale.2), bits(&zeroed.2), "dv");
        for i in 0..bh {
            for g in [&stale.1, &stale.2] {
                let unseen = &g[(i * tk + 25) * d..(i + 1) * tk * d];
                assert!(unseen.iter().all(|&x| x.to_bits() == 0), "keys no query sees: {unseen:?}");
                let first_block_only = &g[(i * tk + 12) * d..(i * tk + 20) * d];
                assert!(first_block_only.iter().all(|x| x.is_finite()) && first_block_only.iter().any(|&x| x != 0.0));
            }
        }
    }

    /// D from an output saved in bf16 or f16 has the bits of D from that output restored to f32
    /// (each element widened the same way), on a layout with a row stride past the row (a packed
    /// output's heads) and a row length with a tail after the lanes.
    #[test]
    fn d_from_a_half_precision_output_is_d_from_it_restored() {
        use crate::dtype::DType;
        use crate::layout::Layout;
        use crate::test_values::uniform;
        let f32_values = |n: usize, seed: u64| uniform(n, seed).map(|x| x as f32).collect::<Vec<f32>>();
        let (bh, heads, tq, dv) = (4, 2, 5, 13);
        // [batch, tq, heads * dv]: a batch's heads side by side in each row.
        let lay = AttnAddr { offset: 0, batch_stride: tq * heads * dv, head_stride: dv, row_stride: heads * dv };
        let dims = AttnDims { bh, heads, tq, tk: tq, d: dv, dv };
        let layouts = AttnLayouts { q: lay, k: lay, v: lay, out: lay };
        let pb = AttnProblem {
            dims,
            lay: layouts,
            scale: 1.0,
            causal: false,
            full: vec![bh, tq, tq],
            products: Products::F32,
        };
        let n = lay.extent(bh, heads, tq, dv);
        let (out, mut grad) = (f32_values(n, 7), f32_values(n, 8));
        let (flat, rows) = (Layout::contiguous(&[n]), Layout::contiguous(&[bh * tq]));
        let delta_of = |o: View<'_>, grad: &mut [f32]| {
            let mut delta = vec![f32::NAN; bh * tq];
            // SAFETY: the buffers hold their layouts' elements and live through the call.
            let (g, d) = unsafe {
                (
                    View::new(grad.as_mut_ptr() as *mut u8, n * 4, DType::F32, &flat),
                    View::new(delta.as_mut_ptr() as *mut u8, bh * tq * 4, DType::F32, &rows),
                )
            };
            attention_delta(o, g, &pb, d).unwrap();
            delta
        };
        let mut halves: Vec<half::bf16> = out.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let mut restored: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        // SAFETY: as above (2 bytes an element).
        let (h, r) = unsafe {
            (
                View::new(halves.as_mut_ptr() as *mut u8, n * 2, DType::BF16, &flat),
                View::new(restored.as_mut_ptr() as *mut u8, n * 4, DType::F32, &flat),
            )
        };
        let (from_half, from_restored) = (delta_of(h, &mut grad), delta_of(r, &mut grad));
        assert!(from_half.iter().all(|d| d.is_finite()));
        assert_eq!(bits(&from_half), bits(&from_restored), "bf16");
        let mut halves: Vec<half::f16> = out.iter().map(|&x| half::f16::from_f32(x)).collect();
        let mut restored: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        // SAFETY: as above.
        let (h, r) = unsafe {
            (
                View::new(halves.as_mut_ptr() as *mut u8, n * 2, DType::F16, &flat),
                View::new(restored.as_mut_ptr() as *mut u8, n * 4, DType::F32, &flat),
            )
        };
        assert_eq!(bits(&delta_of(h, &mut grad)), bits(&delta_of(r, &mut grad)), "f16");
    }

    /// The softmax row kernels (and D's row dot product) give the portable copy's bits on every
    /// level, for rows with and without a tail after the last whole vector, hidden keys, a NaN, and
    /// all keys hidden.
    #[test]
    fn softmax_row_kernels_give_the_same_bits_on_every_level() {
        let run = |isa: Isa| {
            let mut out = Vec::new();
            for len in [1, 5, 8, 13, 64, 127] {
                for (hidden, nan) in [(0, false), (3, false), (1, false), (0, true)] {
                    let mut row = scores(len, len as u64, hidden);
                    if nan {
                        row[len / 2] = f32::NAN;
                    }
                    let mut scaled = row.clone();
                    scale_prefix(isa, &mut scaled, len / 2 + 1, 0.125);
                    out.extend(bits(&scaled));
                    let lse = softmax_row(isa, &mut row);
                    out.push(lse.to_bits());
                    out.extend(bits(&row));
                    let mut p = scaled.clone();
                    subtract_lse_row(isa, &mut p, lse);
                    exp_in_place(&mut p);
                    out.extend(bits(&p));
                    softmax_grad_row(isa, &mut p, &scores(len, 7, 0), 0.3, 0.125);
                    out.extend(bits(&p));
                    if !nan {
                        out.push(row_dot(isa, &p, &scores(len, 8, 0)).to_bits());
                    }
                }
            }
            out
        };
        let want = run(Isa::Portable);
        for isa in Isa::supported() {
            assert_eq!(run(isa), want, "{isa} vs portable");
        }
    }

    /// The softmax row by definition: probabilities summing to 1 with the log-sum-exp returned; a
    /// NaN score makes the row NaN; a fully hidden row is 0 with -inf returned.
    #[test]
    fn softmax_row_follows_the_definition() {
        let mut row = scores(37, 3, 4);
        let want: Vec<f64> = {
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.iter().map(|v| v / sum).collect()
        };
        let lse = softmax_row(Isa::active(), &mut row);
        for (p, w) in row.iter().zip(&want) {
            assert!((*p as f64 - w).abs() < 1e-6, "{p} vs {w}");
        }
        let lse_want = scores(37, 3, 4).iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        assert!((lse as f64 - lse_want).abs() < 1e-5, "{lse} vs {lse_want}");
        let mut row = scores(20, 3, 0);
        row[17] = f32::NAN;
        assert!(softmax_row(Isa::active(), &mut row).is_nan() && row.iter().all(|v| v.is_nan()));
        let mut row = vec![f32::NEG_INFINITY; 11];
        assert_eq!(softmax_row(Isa::active(), &mut row), f32::NEG_INFINITY);
        assert!(row.iter().all(|&v| v == 0.0));
    }
}
