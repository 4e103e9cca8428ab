//! CPU kernels of the normalizations (`ops/norm.rs`): layer_norm, batch_norm (batch statistics with
//! the running-statistics update, or the running statistics) and the fused layer_norm_linear, forward
//! and backward, with the row numerics they share (so fused and unfused produce the same normalized
//! rows and input gradients).
//! Statistics are accumulated in f64 with two passes.

use super::elementwise::{combine_lanes, for_row_groups, lane_sum, LANES};
use super::gemm::{
    gemm_row_blocks_into, gemm_summing_into, prepared_gemm_into, with_prepared_b, Mat, Prepared, Products, SendPtr,
};
use super::matmul::{bias_grad_ptr, bias_row, weight_mat};
use crate::dtype::Float;
use crate::error::{check_len, Result};
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use memfit_kernels::{multiversion, Isa};
use rayon::prelude::*;

/// Rows [`layer_norm_linear`] runs per block (its scratch holds LN_ROWS normalized rows).
pub const LN_ROWS: usize = 1024;

/// Calls `f(row, values)` for every `row_len`-element row of `buf` (row_len > 0), in parallel groups
/// of about `PAR_CHUNK` elements when the buffer is big enough.
fn for_rows_mut<T: Send>(buf: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    let per = (PAR_CHUNK / row_len).max(1);
    let run = |(k, group): (usize, &mut [T])| {
        group.chunks_mut(row_len).enumerate().for_each(|(i, row)| f(k * per + i, row));
    };
    if buf.len() >= 2 * PAR_CHUNK && buf.len() > per * row_len {
        buf.par_chunks_mut(per * row_len).enumerate().for_each(run);
    } else {
        buf.chunks_mut(per * row_len).enumerate().for_each(run);
    }
}

fn opt_slice<T: Float + crate::dtype::Element>(t: Option<View<'_>>) -> Result<Option<&[T]>> {
    t.map(|t| t.slice::<T>()).transpose()
}

/// The per-row statistics' writable pointers (mean, rstd), when both are wanted.
type StatPtrs<T> = Option<(SendPtr<T>, SendPtr<T>)>;

/// The writable pointers of the per-row statistics (mean, rstd), when both are wanted, each checked
/// to hold `rows` entries.
fn statistics_ptrs<T: Float + crate::dtype::Element>(
    name: &str,
    mean: Option<View<'_>>,
    rstd: Option<View<'_>>,
    rows: usize,
) -> Result<StatPtrs<T>> {
    let (Some(m), Some(r)) = (mean, rstd) else { return Ok(None) };
    let (m, r) = (m.slice_mut::<T>()?, r.slice_mut::<T>()?);
    check_len(&format!("{name} mean"), m.len(), rows)?;
    check_len(&format!("{name} rstd"), r.len(), rows)?;
    Ok(Some((SendPtr(m.as_mut_ptr()), SendPtr(r.as_mut_ptr()))))
}

/// The writable pointer of a per-column gradient (`d` entries), when it is wanted.
fn column_ptr<T: Float + crate::dtype::Element>(
    what: &str,
    t: Option<View<'_>>,
    d: usize,
) -> Result<Option<SendPtr<T>>> {
    let Some(t) = t else { return Ok(None) };
    let s = t.slice_mut::<T>()?;
    check_len(what, s.len(), d)?;
    Ok(Some(SendPtr(s.as_mut_ptr())))
}

multiversion! {
    /// Normalizes one row into `yr` (f64 two-pass statistics, biased variance, eps inside the sqrt,
    /// then the affine); returns (mean, rstd) as kept for backward. `layer_norm` and
    /// `layer_norm_linear` share it, so they produce the same bits.
    fn normalize_row<T: Float>(xr: &[T], yr: &mut [T], w: Option<&[T]>, b: Option<&[T]>, eps: f64) -> (T, T) {
        let d = xr.len();
        let mean = lane_sum(xr, |v| v.f64()) / d as f64;
        let var = lane_sum(xr, |v| {
            let c = v.f64() - mean;
            c * c
        }) / d as f64;
        let (m, rs) = (T::of(mean), T::of(1.0 / (var + eps).sqrt()));
        affine_row(xr, yr, m, rs, w, b);
        (m, rs)
    }
}

multiversion! {
    /// Recomputes one normalized row into `yr` from its saved statistics, as [`normalize_row`] made it.
    fn renormalize_row<T: Float>(xr: &[T], yr: &mut [T], m: T, rs: T, w: Option<&[T]>, b: Option<&[T]>) {
        affine_row(xr, yr, m, rs, w, b)
    }
}

/// `yr = (xr - m) * rs`, times `w` and plus `b` when given.
#[inline(always)]
fn affine_row<T: Float>(xr: &[T], yr: &mut [T], m: T, rs: T, w: Option<&[T]>, b: Option<&[T]>) {
    for (j, (y, &x)) in yr.iter_mut().zip(xr).enumerate() {
        let mut v = (x - m) * rs;
        if let Some(w) = w {
            v *= w[j];
        }
        if let Some(b) = b {
            v += b[j];
        }
        *y = v;
    }
}

/// Layer-norm backward's per-row means of `dxhat = g * w` and of `dxhat * xhat`, with `w` read only
/// when `W` (the caller passes any slice of the row's length otherwise). Whole slices and chunks, no
/// indexing, so the loops vectorise.
#[inline(always)]
fn row_grad_sums<T: Float, const W: bool>(xr: &[T], gr: &[T], wr: &[T], m: T, rs: T) -> (T, T) {
    let d = xr.len();
    let (s1, s2) = grad_lane_sums::<T, W>(xr, gr, wr, m, rs);
    (T::of(s1 / d as f64), T::of(s2 / d as f64))
}

/// The sums behind [`row_grad_sums`] (of `dxhat` and of `dxhat * xhat`), in f64, kept in partial
/// sums as [`lane_sum`] keeps them; batch norm's backward adds them over a channel's planes.
#[inline(always)]
fn grad_lane_sums<T: Float, const W: bool>(xr: &[T], gr: &[T], wr: &[T], m: T, rs: T) -> (f64, f64) {
    let d = xr.len();
    let (gr, wr) = (&gr[..d], &wr[..d]);
    let terms = |x: T, g: T, w: T| {
        let dxh = if W { g * w } else { g };
        (dxh.f64(), (dxh * (x - m) * rs).f64())
    };
    // Partial sums as in `lane_sum`, two at once.
    let (mut a1, mut a2) = ([0.0f64; LANES], [0.0f64; LANES]);
    let (xc, gc, wc) = (xr.chunks_exact(LANES), gr.chunks_exact(LANES), wr.chunks_exact(LANES));
    let (mut tail1, mut tail2) = (0.0f64, 0.0f64);
    for ((&x, &g), &w) in xc.remainder().iter().zip(gc.remainder()).zip(wc.remainder()) {
        let (t1, t2) = terms(x, g, w);
        tail1 += t1;
        tail2 += t2;
    }
    for ((x, g), w) in xc.zip(gc).zip(wc) {
        for i in 0..LANES {
            let (t1, t2) = terms(x[i], g[i], w[i]);
            a1[i] += t1;
            a2[i] += t2;
        }
    }
    (combine_lanes(&a1, tail1), combine_lanes(&a2, tail2))
}

/// Layer-norm backward for one element, given its row's [`row_grad_sums`] (a, b); `w` is used only
/// when `W`.
#[inline(always)]
fn row_dx<T: Float, const W: bool>(x: T, g: T, w: T, m: T, rs: T, a: T, b: T) -> T {
    let dxh = if W { g * w } else { g };
    let xh = (x - m) * rs;
    rs * (dxh - a - xh * b)
}

/// [`dx_row`] for a weight given (`W`) or not (`wr` is then any slice of the row's length).
#[inline(always)]
fn dx_row_with<T: Float, const W: bool>(x: Option<&[T]>, dx: &mut [T], g: &[T], wr: &[T], m: T, rs: T) {
    let d = dx.len();
    let (g, wr) = (&g[..d], &wr[..d]);
    let (a, b) = row_grad_sums::<T, W>(x.unwrap_or(dx), g, wr, m, rs);
    match x {
        Some(x) => {
            for (((dx, &x), &g), &w) in dx.iter_mut().zip(&x[..d]).zip(g).zip(wr) {
                *dx = row_dx::<T, W>(x, g, w, m, rs, a, b);
            }
        }
        None => {
            for ((dx, &g), &w) in dx.iter_mut().zip(g).zip(wr) {
                *dx = row_dx::<T, W>(*dx, g, w, m, rs, a, b);
            }
        }
    }
}

multiversion! {
    /// Layer-norm backward of one row: the input gradient into `dx` from the row's input (`x`, or
    /// `dx` itself when `x` is `None`: the gradient then overwrites the input), the gradient of the
    /// normalized row `g` and the row's statistics.
    fn dx_row<T: Float>(x: Option<&[T]>, dx: &mut [T], g: &[T], w: Option<&[T]>, m: T, rs: T) {
        match w {
            Some(w) => dx_row_with::<T, true>(x, dx, g, w, m, rs),
            None => dx_row_with::<T, false>(x, dx, g, g, m, rs),
        }
    }
}

multiversion! {
    /// Adds, for columns `j0..j0 + sw.len()` of rows of `d` elements, each row's `g` to `sb` and
    /// `g * (x - mean) * rstd` to `sw` (the layer-norm bias and weight gradients), in f64 and in
    /// row order (rows outer, columns inner: memory in order).
    fn add_column_sums<T: Float>(sw: &mut [f64], sb: &mut [f64], g: &[T], x: &[T], mean: &[T], rstd: &[T], d: usize, j0: usize) {
        let cols = sw.len();
        let sb = &mut sb[..cols];
        for (r, (&m, &rs)) in mean.iter().zip(rstd).enumerate() {
            let (gr, xr) = (&g[r * d + j0..r * d + j0 + cols], &x[r * d + j0..r * d + j0 + cols]);
            for c in 0..cols {
                let gv = gr[c];
                sb[c] += gv.f64();
                sw[c] += (gv * (xr[c] - m) * rs).f64();
            }
        }
    }
}

/// `out = layer_norm(x)` over rows of `d` elements, with the per-row mean and rstd into `mean` and
/// `rstd` when given.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    x: View<'_>,
    weight: Option<View<'_>>,
    bias: Option<View<'_>>,
    d: usize,
    eps: f64,
    out: View<'_>,
    mean: Option<View<'_>>,
    rstd: Option<View<'_>>,
) -> Result<()> {
    let rows = x.numel().checked_div(d).unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    with_float!(x.dtype(), "layer_norm", T => {
        let src = x.slice::<T>()?;
        let (w, b) = (opt_slice::<T>(weight)?, opt_slice::<T>(bias)?);
        let dst = out.slice_mut::<T>()?;
        check_len("layer_norm output", dst.len(), rows * d)?;
        let dst = SendPtr(dst.as_mut_ptr());
        let st = statistics_ptrs::<T>("layer_norm", mean, rstd, rows)?;
        let isa = Isa::active();
        for_row_groups(rows, d, |r0, n| {
            let (dst, st) = (dst, st);
            for r in r0..r0 + n {
                let xr = &src[r * d..(r + 1) * d];
                // SAFETY: row r of the fresh output is written by this task only.
                let yr = unsafe { std::slice::from_raw_parts_mut(dst.0.add(r * d), d) };
                let (m, rs) = normalize_row(isa, xr, yr, w, b, eps);
                if let Some((pm, pr)) = st {
                    // SAFETY: element r of the fresh statistics tensors belongs to this task.
                    unsafe { *pm.0.add(r) = m; *pr.0.add(r) = rs; }
                }
            }
        });
    });
    Ok(())
}

/// Layer-norm gradients (each when given) from the saved input, weight and per-row statistics, over
/// rows of `d` elements.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: View<'_>,
    weight: Option<View<'_>>,
    mean: View<'_>,
    rstd: View<'_>,
    d: usize,
    grad: View<'_>,
    gx: Option<View<'_>>,
    gw: Option<View<'_>>,
    gb: Option<View<'_>>,
) -> Result<()> {
    let rows = mean.numel();
    if d == 0 {
        return Ok(());
    }
    with_float!(grad.dtype(), "layer_norm_backward", T => {
        let (x, g) = (x.slice::<T>()?, grad.slice::<T>()?);
        let (mean, rstd) = (mean.slice::<T>()?, rstd.slice::<T>()?);
        check_len("layer_norm_backward input", x.len(), rows * d)?;
        check_len("layer_norm_backward output gradient", g.len(), rows * d)?;
        check_len("layer_norm_backward rstd", rstd.len(), rows)?;
        let w = opt_slice::<T>(weight)?;
        let isa = Isa::active();
        if let Some(gx) = gx {
            let dst = gx.slice_mut::<T>()?;
            check_len("layer_norm_backward input gradient", dst.len(), rows * d)?;
            let dst = SendPtr(dst.as_mut_ptr());
            for_row_groups(rows, d, |r0, n| {
                #[allow(clippy::redundant_locals)] // capture the Send wrapper, not its raw pointer field
                let dst = dst;
                for r in r0..r0 + n {
                    let (xr, gr) = (&x[r * d..(r + 1) * d], &g[r * d..(r + 1) * d]);
                    // SAFETY: row r of the fresh gradient is written by this task only.
                    let dr = unsafe { std::slice::from_raw_parts_mut(dst.0.add(r * d), d) };
                    dx_row(isa, Some(xr), dr, gr, w, mean[r], rstd[r]);
                }
            });
        }
        if gw.is_some() || gb.is_some() {
            let pw = column_ptr::<T>("layer_norm_backward weight gradient", gw, d)?;
            let pb = column_ptr::<T>("layer_norm_backward bias gradient", gb, d)?;
            // Column blocks: each task sums its columns over all rows (deterministic, no workspace).
            const COLS: usize = 64;
            let blocks = d.div_ceil(COLS);
            let run = |blk: usize| {
                let (pw, pb) = (pw, pb);
                let (j0, j1) = (blk * COLS, ((blk + 1) * COLS).min(d));
                let mut sw = [0.0f64; COLS];
                let mut sb = [0.0f64; COLS];
                add_column_sums(isa, &mut sw[..j1 - j0], &mut sb[..j1 - j0], g, x, &mean[..rows], &rstd[..rows], d, j0);
                for j in j0..j1 {
                    // SAFETY: columns j0..j1 of the fresh weight/bias gradients belong to this task.
                    unsafe {
                        if let Some(p) = pw { *p.0.add(j) = T::of(sw[j - j0]); }
                        if let Some(p) = pb { *p.0.add(j) = T::of(sb[j - j0]); }
                    }
                }
            };
            if rows * d >= 2 * PAR_CHUNK && blocks > 1 {
                (0..blocks).into_par_iter().for_each(run);
            } else {
                (0..blocks).for_each(run);
            }
        }
    });
    Ok(())
}

/// `out = linear(layer_norm(x))`, `LN_ROWS` normalized rows at a time through `scratch`, with the
/// per-row mean and rstd into `mean` and `rstd` when given.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_linear(
    x: View<'_>,
    ln_weight: View<'_>,
    ln_bias: View<'_>,
    eps: f64,
    weight: View<'_>,
    bias: Option<View<'_>>,
    scratch: View<'_>,
    out: View<'_>,
    mean: Option<View<'_>>,
    rstd: Option<View<'_>>,
    products: Products,
) -> Result<()> {
    const NAME: &str = "layer_norm_linear";
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    let rows = x.numel() / in_f;
    with_float!(x.dtype(), NAME, T => {
        let dst = out.slice_mut::<T>()?;
        check_len("layer_norm_linear output", dst.len(), rows * out_f)?;
        let bias = bias_row::<T>(bias, out_f)?;
        let (xs, w, b) = (x.slice::<T>()?, ln_weight.slice::<T>()?, ln_bias.slice::<T>()?);
        let st = statistics_ptrs::<T>(NAME, mean, rstd, rows)?;
        let sc = scratch.slice_mut::<T>()?;
        check_len("layer_norm_linear scratch", sc.len(), rows.min(LN_ROWS) * in_f)?;
        let sc = SendPtr(sc.as_mut_ptr());
        let wt = weight_mat::<T>(weight, true)?;
        let isa = Isa::active();
        let normalized_rows = |r0: usize, n: usize| {
            for_row_groups(n, in_f, |g0, gn| {
                let (sc, st) = (sc, st);
                for r in g0..g0 + gn {
                    // SAFETY: scratch row r and statistics entry r0 + r are written by this task only.
                    let yr = unsafe { std::slice::from_raw_parts_mut(sc.0.add(r * in_f), in_f) };
                    let (m, rs) = normalize_row(isa, &xs[(r0 + r) * in_f..(r0 + r + 1) * in_f], yr, Some(w), Some(b), eps);
                    if let Some((pm, pr)) = st {
                        // SAFETY: entry r0 + r of the fresh statistics belongs to this task.
                        unsafe { *pm.0.add(r0 + r) = m; *pr.0.add(r0 + r) = rs; }
                    }
                }
            });
            Mat { ptr: sc.0 as *const T, rs: in_f as isize, cs: 1 }
        };
        // SAFETY: the fresh output holds rows x out; the scratch, a separate tensor, holds a block.
        unsafe {
            gemm_row_blocks_into::<T>(rows, out_f, in_f, dst.as_mut_ptr(), out_f as isize, bias,
                LN_ROWS, normalized_rows, wt, products)
        };
    });
    Ok(())
}

/// Backward of [`layer_norm_linear`] from `grad` [rows, out], block by block through `scratch`: the
/// input gradient into `gx` (which is `x` itself when the op decided to write it in place), the
/// layer-norm weight and bias gradients (summed in f64 in `sums` [2, in]), the weight gradient and,
/// with it, the linear bias gradient `gb` (summed as the weight-gradient product reads `grad`), each
/// when given. Given the weight and bias gradients, the layer-norm gradients come from the
/// weight-gradient product ([`affine_after_product`]); otherwise from column sums over the rows.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_linear_backward(
    x: View<'_>,
    ln_weight: View<'_>,
    ln_bias: View<'_>,
    weight: View<'_>,
    mean: View<'_>,
    rstd: View<'_>,
    grad: View<'_>,
    gx: Option<View<'_>>,
    glw: Option<View<'_>>,
    glb: Option<View<'_>>,
    gw: Option<View<'_>>,
    gb: Option<View<'_>>,
    scratch: View<'_>,
    sums: Option<View<'_>>,
    products: Products,
) -> Result<()> {
    const NAME: &str = "layer_norm_linear_backward";
    let (out_f, d) = (weight.shape()[0], weight.shape()[1]);
    let rows = grad.shape()[0];
    let need_gy = gx.is_some() || glw.is_some() || glb.is_some();
    let in_place = gx.is_some_and(|g| g.same(x));
    with_float!(grad.dtype(), NAME, T => {
        let gs = grad.slice::<T>()?;
        check_len("layer_norm_linear_backward output gradient", gs.len(), rows * out_f)?;
        let (mean, rstd) = (mean.slice::<T>()?, rstd.slice::<T>()?);
        let (lw, lb) = (ln_weight.slice::<T>()?, ln_bias.slice::<T>()?);
        // In place, the input gradient is x itself: every read of a block of x comes before
        // the block is overwritten, and each row is read before it is written.
        let xs = x.slice_mut::<T>()?;
        check_len("layer_norm_linear_backward input", xs.len(), rows * d)?;
        let xp = SendPtr(xs.as_mut_ptr());
        let gxp = match gx {
            Some(_) if in_place => Some(xp),
            Some(t) => {
                let gxs = t.slice_mut::<T>()?;
                check_len("layer_norm_linear_backward input gradient", gxs.len(), rows * d)?;
                Some(SendPtr(gxs.as_mut_ptr()))
            }
            None => None,
        };
        let mut gw_values = gw.map(|t| t.slice_mut::<T>()).transpose()?;
        if let Some(g) = &gw_values {
            check_len("layer_norm_linear_backward weight gradient", g.len(), out_f * d)?;
        }
        if let (0, Some(g)) = (rows, &mut gw_values) {
            g.fill(T::of(0.0));
        }
        let gwp = gw_values.map(|s| s.as_mut_ptr());
        let gbp = bias_grad_ptr::<T>(NAME, gb, out_f, gwp.is_some())?;
        // The layer-norm weight and bias gradients, in f64: column sums over the rows, or, when the
        // weight-gradient product runs (with the row sums of g), sums over its rows (`from_product`).
        let mut acc = sums.map(|t| t.slice_mut::<f64>()).transpose()?;
        if let Some(a) = &mut acc {
            check_len("layer_norm_linear_backward column sums", a.len(), 2 * d)?;
            a.fill(0.0);
        }
        // Not for a rounded (bf16, fp16) product: its operand is the affine's output y, rounded, not xhat.
        let from_product = match (gwp, gbp) {
            (Some(gwp), Some(gbp)) if acc.is_some() && products == Products::F32 => Some((gwp, gbp)),
            _ => None,
        };
        let sc = scratch.slice_mut::<T>()?;
        check_len("layer_norm_linear_backward scratch", sc.len(), rows.min(LN_ROWS) * d)?;
        let w_mat = weight_mat::<T>(weight, false)?;
        let isa = Isa::active();
        let threads = rayon::current_num_threads();
        // The blocks, with W prepared once for all their gy products when they are wanted.
        let mut blocks = |w_prep: Option<&Prepared<T>>| {
            for r0 in (0..rows).step_by(LN_ROWS) {
                let n = LN_ROWS.min(rows - r0);
                let g_ptr = gs[r0 * out_f..].as_ptr();
                let g_block = Mat { ptr: g_ptr, rs: out_f as isize, cs: 1 };
                let block = &mut sc[..n * d];
                // SAFETY: rows r0..r0+n of x are in its storage; they are only read until the dx
                // step below, which no longer uses this slice.
                let xb = unsafe { std::slice::from_raw_parts(xp.0.add(r0 * d) as *const T, n * d) };
                if let Some(gwp) = gwp {
                    // Recompute the block's normalized rows (as forward did), then dW (+)= g^T y; or,
                    // when the affine comes after the product, dW (+)= g^T xhat.
                    let (aw, ab) = if from_product.is_some() { (None, None) } else { (Some(lw), Some(lb)) };
                    for_rows_mut(block, d, |r, yr| {
                        renormalize_row(isa, &xb[r * d..(r + 1) * d], yr, mean[r0 + r], rstd[r0 + r], aw, ab)
                    });
                    let g_t = Mat { ptr: g_ptr, rs: 1, cs: out_f as isize };
                    let y = Mat { ptr: block.as_ptr(), rs: d as isize, cs: 1 };
                    // SAFETY: the weight gradient is a fresh [out, d] tensor; operands are in bounds.
                    unsafe { gemm_summing_into::<T>(out_f, d, n, gwp, d as isize, r0 > 0, g_t, y, threads, gbp, products) };
                }
                let Some(w_prep) = w_prep else { continue };
                // gy = g W, the gradient of the normalized rows, over the scratch.
                // SAFETY: the scratch block is n x d and separate from the operands.
                unsafe { prepared_gemm_into::<T>(w_prep, n, block.as_mut_ptr(), d as isize, false, g_block, threads) };
                let gy: &[T] = block;
                if let (Some(acc), None) = (&mut acc, from_product) {
                    // Column blocks: each task sums its columns over the block's rows, in row order.
                    const COLS: usize = 64;
                    let (aw, ab) = acc.split_at_mut(d);
                    // Rows outer, columns inner: memory in order, each column still summed in
                    // row order.
                    let run = |(blk, (sw, sb)): (usize, (&mut [f64], &mut [f64]))| {
                        add_column_sums(isa, sw, sb, gy, xb, &mean[r0..r0 + n], &rstd[r0..r0 + n], d, blk * COLS)
                    };
                    if n * d >= 2 * PAR_CHUNK && d > COLS {
                        aw.par_chunks_mut(COLS).zip(ab.par_chunks_mut(COLS)).enumerate().for_each(run);
                    } else {
                        aw.chunks_mut(COLS).zip(ab.chunks_mut(COLS)).enumerate().for_each(run);
                    }
                }
                if let Some(gxp) = gxp {
                    #[allow(clippy::redundant_locals)] // capture the Send wrappers, not their raw pointers
                    for_row_groups(n, d, |g0, gn| {
                        let (xp, gxp) = (xp, gxp);
                        for r in g0..g0 + gn {
                            let (m, rs, gyr) = (mean[r0 + r], rstd[r0 + r], &gy[r * d..(r + 1) * d]);
                            // SAFETY: row r0 + r of x and of dx (the same row when in place) is
                            // touched by this task only, and x is not read elsewhere meanwhile.
                            unsafe {
                                let dst = std::slice::from_raw_parts_mut(gxp.0.add((r0 + r) * d), d);
                                if in_place {
                                    dx_row(isa, None, dst, gyr, Some(lw), m, rs);
                                } else {
                                    let src = std::slice::from_raw_parts(xp.0.add((r0 + r) * d), d);
                                    dx_row(isa, Some(src), dst, gyr, Some(lw), m, rs);
                                }
                            }
                        }
                    });
                }
            }
        };
        if need_gy {
            // SAFETY: W is a parameter, unchanged during this call.
            unsafe { with_prepared_b(out_f, d, w_mat, products, |w_prep| blocks(Some(w_prep))) };
        } else {
            blocks(None);
        }
        if let (Some(acc), Some((gwp, gbp))) = (&mut acc, from_product) {
            // SAFETY: gw holds out x d and gb out values (checked above), both fresh tensors
            // separate from W.
            unsafe { affine_after_product(acc, gwp, gbp, w_mat, lw, lb, out_f, d) };
        }
        if let Some(acc) = &acc {
            if let Some(t) = glw {
                t.slice_mut::<T>()?.iter_mut().zip(&acc[..d]).for_each(|(g, &a)| *g = T::of(a));
            }
            if let Some(t) = glb {
                t.slice_mut::<T>()?.iter_mut().zip(&acc[d..]).for_each(|(g, &a)| *g = T::of(a));
            }
        }
    });
    Ok(())
}

/// Layer-norm-linear backward's layer-norm weight and bias gradients from the weight-gradient
/// product, and that product's affine. With `y = xhat * lw + lb` and the output gradient `g`, the
/// normalized rows' gradient is `gy = g W`, so over all rows
/// `sum_r gy[r, c] xhat[r, c] = sum_o W[o, c] G[o, c]` with `G = g^T xhat`, and
/// `sum_r gy[r, c] = sum_o W[o, c] gb[o]` with `gb` the column sums of `g`: sums over the `out`
/// rows of W instead of over every row of the batch. The product ran on `xhat` and left `G` in
/// `gw`; the weight gradient `g^T y` is then `G[o, c] lw[c] + gb[o] lb[c]`. `acc` [2, d] receives
/// the two sums in f64, over `o` in order. In parallel over blocks of columns.
///
/// # Safety
/// `gw` must hold `out_f x d` and `gb` `out_f` elements, and `w` address an `out_f x d` matrix;
/// none may overlap.
#[allow(clippy::too_many_arguments)]
unsafe fn affine_after_product<T: Float>(
    acc: &mut [f64],
    gw: *mut T,
    gb: *mut T,
    w: Mat<T>,
    lw: &[T],
    lb: &[T],
    out_f: usize,
    d: usize,
) {
    const COLS: usize = 64;
    let (aw, ab) = acc.split_at_mut(d);
    let gb = std::slice::from_raw_parts(gb as *const T, out_f);
    let (gw, w_ptr) = (SendPtr(gw), SendPtr(w.ptr as *mut T));
    let isa = Isa::active();
    let run = |(blk, (sw, sb)): (usize, (&mut [f64], &mut [f64]))| {
        let (gw, w_ptr) = (gw, w_ptr);
        let (c0, cols) = (blk * COLS, sw.len());
        let (lw, lb) = (&lw[c0..c0 + cols], &lb[c0..c0 + cols]);
        // W's row segment: in place when contiguous, else gathered here.
        let mut gathered = [T::zero(); COLS];
        for (o, &b) in gb.iter().enumerate() {
            // SAFETY: row o of gw and of W are inside them (caller); this task alone touches
            // columns c0..c0 + cols of gw.
            let row = unsafe { gw.slice_mut(o * d + c0, cols) };
            let w_row = unsafe { w_ptr.0.offset(o as isize * w.rs + c0 as isize * w.cs) as *const T };
            let w_row: &[T] = if w.cs == 1 {
                // SAFETY: as above, `cols` contiguous elements of row o.
                unsafe { std::slice::from_raw_parts(w_row, cols) }
            } else {
                for (c, v) in gathered[..cols].iter_mut().enumerate() {
                    // SAFETY: as above, element c0 + c of row o.
                    *v = unsafe { *w_row.offset(c as isize * w.cs) };
                }
                &gathered[..cols]
            };
            affine_product_row(isa, row, w_row, sw, sb, lw, lb, b);
        }
    };
    if out_f * d >= 2 * PAR_CHUNK && d > COLS {
        aw.par_chunks_mut(COLS).zip(ab.par_chunks_mut(COLS)).enumerate().for_each(run);
    } else {
        aw.chunks_mut(COLS).zip(ab.chunks_mut(COLS)).enumerate().for_each(run);
    }
}

multiversion! {
    /// One row `o` of [`affine_after_product`] over a block of columns: `sw += W[o] * G[o]` and
    /// `sb += W[o] * gb[o]` in f64, then `G[o] = G[o] * lw + gb[o] * lb` (the weight gradient).
    /// Whole slices zipped, so the loop vectorises across the columns (each column's sums still
    /// taken over `o` in order: the same bits on every level).
    fn affine_product_row<T: Float>(g: &mut [T], w: &[T], sw: &mut [f64], sb: &mut [f64], lw: &[T], lb: &[T], b: T) {
        let bf = b.f64();
        let cols = g.iter_mut().zip(w).zip(sw.iter_mut().zip(sb.iter_mut())).zip(lw.iter().zip(lb));
        for (((g, &wv), (sw, sb)), (&lw, &lb)) in cols {
            let wv = wv.f64();
            *sw += wv * g.f64();
            *sb += wv * bf;
            *g = *g * lw + b * lb;
        }
    }
}

multiversion! {
    /// Batch norm's statistics of channel `ch` of `src` (`[N, C, S]`): the sum of its values, or with
    /// `mean` the sum of their squared deviations from it, in f64, each plane's kept in partial sums
    /// as [`lane_sum`] keeps them, the planes' added in order.
    fn channel_sum<T: Float>(src: &[T], c: usize, s: usize, ch: usize, mean: Option<f64>) -> f64 {
        if c * s == 0 {
            return 0.0;
        }
        // A plain loop, not an iterator's fold: a generic fold is compiled apart from this
        // function, without its instruction set.
        let mut sum = 0.0;
        for sample in src.chunks_exact(c * s) {
            let plane = &sample[ch * s..(ch + 1) * s];
            sum += match mean {
                None => lane_sum(plane, |v| v.f64()),
                Some(m) => lane_sum(plane, |v| {
                    let d = v.f64() - m;
                    d * d
                }),
            };
        }
        sum
    }
}

multiversion! {
    /// Batch norm's backward sums of channel `ch` (of `g` and of `g * xhat`, f64), each plane's as
    /// layer norm's row sums, the planes' added in order.
    fn channel_grad_sums<T: Float>(x: &[T], g: &[T], c: usize, s: usize, ch: usize, m: T, r: T) -> (f64, f64) {
        if c * s == 0 {
            return (0.0, 0.0);
        }
        // A plain loop, as in `channel_sum`.
        let (mut sg, mut sgx) = (0.0, 0.0);
        for (xs, gs) in x.chunks_exact(c * s).zip(g.chunks_exact(c * s)) {
            let (xp, gp) = (&xs[ch * s..(ch + 1) * s], &gs[ch * s..(ch + 1) * s]);
            let (a, b) = grad_lane_sums::<T, false>(xp, gp, gp, m, r);
            sg += a;
            sgx += b;
        }
        (sg, sgx)
    }
}

multiversion! {
    /// `d = v * alpha + beta` over a plane.
    fn scale_shift_plane<T: Float>(src: &[T], d: &mut [T], alpha: T, beta: T) {
        d.iter_mut().zip(src).for_each(|(d, &v)| *d = v * alpha + beta);
    }
}

multiversion! {
    /// Batch norm's input gradient over a plane in training: `k * (g - a - (x - m) * r * b)`.
    fn batch_norm_dx_plane<T: Float>(gp: &[T], xp: &[T], d: &mut [T], k: T, a: T, b: T, m: T, r: T) {
        d.iter_mut().zip(gp.iter().zip(xp)).for_each(|(d, (&g, &x))| *d = k * (g - a - (x - m) * r * b));
    }
}

/// `out = batch_norm(x)` over channel dim 1: with the batch statistics (updating the running ones in
/// place when given) in training, else with the running statistics; the per-channel mean and rstd
/// used go into `mean` and `rstd` when given.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: View<'_>,
    running_mean: Option<View<'_>>,
    running_var: Option<View<'_>>,
    weight: Option<View<'_>>,
    bias: Option<View<'_>>,
    training: bool,
    momentum: f64,
    eps: f64,
    out: View<'_>,
    mean: Option<View<'_>>,
    rstd: Option<View<'_>>,
) -> Result<()> {
    if x.numel() == 0 {
        return Ok(());
    }
    let (nb, c) = (x.shape()[0], x.shape()[1]);
    let s: usize = x.shape()[2..].iter().product();
    let n = nb * s;
    let running = running_mean.zip(running_var);
    with_float!(x.dtype(), "batch_norm", T => {
        let src = x.slice::<T>()?;
        // Per-channel (mean, rstd) as f64: C values.
        let ms: Vec<(f64, f64)> = if training {
            let isa = Isa::active();
            let channel = |ch: usize| {
                let mean = channel_sum(isa, src, c, s, ch, None) / n as f64;
                (mean, channel_sum(isa, src, c, s, ch, Some(mean)) / n as f64)
            };
            let mv: Vec<(f64, f64)> = if x.numel() >= 2 * PAR_CHUNK {
                (0..c).into_par_iter().map(channel).collect()
            } else {
                (0..c).map(channel).collect()
            };
            if let Some((rm, rv)) = running {
                // The running statistics are exclusively owned buffers, updated in place.
                let (rm, rv) = (rm.slice_mut::<T>()?, rv.slice_mut::<T>()?);
                let unbias = n as f64 / (n - 1) as f64;
                for (ch, &(mean, var)) in mv.iter().enumerate() {
                    rm[ch] = T::of((1.0 - momentum) * rm[ch].f64() + momentum * mean);
                    rv[ch] = T::of((1.0 - momentum) * rv[ch].f64() + momentum * var * unbias);
                }
            }
            mv.iter().map(|&(m, v)| (m, 1.0 / (v + eps).sqrt())).collect()
        } else {
            let (rm, rv) = running.expect("checked above");
            let (rm, rv) = (rm.slice::<T>()?, rv.slice::<T>()?);
            rm.iter().zip(rv).map(|(&m, &v)| (m.f64(), 1.0 / (v.f64() + eps).sqrt())).collect()
        };
        let (w, b) = (opt_slice::<T>(weight)?, opt_slice::<T>(bias)?);
        // y = x * alpha + beta with alpha = rstd * w, beta = b - mean * alpha (per channel).
        let ab: Vec<(T, T)> = ms.iter().enumerate().map(|(ch, &(m, r))| {
            let alpha = r * w.map_or(1.0, |w| w[ch].f64());
            (T::of(alpha), T::of(b.map_or(0.0, |b| b[ch].f64()) - m * alpha))
        }).collect();
        let dst = SendPtr(out.slice_mut::<T>()?.as_mut_ptr());
        let isa = Isa::active();
        for_row_groups(nb * c, s, |p0, np| {
            #[allow(clippy::redundant_locals)] // capture the Send wrapper, not its raw pointer field
            let dst = dst;
            for p in p0..p0 + np {
                let (alpha, beta) = ab[p % c];
                // SAFETY: plane p of the fresh output is written by this task only.
                let d = unsafe { std::slice::from_raw_parts_mut(dst.0.add(p * s), s) };
                scale_shift_plane(isa, &src[p * s..(p + 1) * s], d, alpha, beta);
            }
        });
        if let (Some(sm), Some(sr)) = (mean, rstd) {
            let (sm, sr) = (sm.slice_mut::<T>()?, sr.slice_mut::<T>()?);
            for (ch, &(m, r)) in ms.iter().enumerate() {
                sm[ch] = T::of(m);
                sr[ch] = T::of(r);
            }
        }
    });
    Ok(())
}

/// Batch-norm gradients (each when given) from the saved input, weight and per-channel statistics.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    x: View<'_>,
    weight: Option<View<'_>>,
    mean: View<'_>,
    rstd: View<'_>,
    training: bool,
    grad: View<'_>,
    gx: Option<View<'_>>,
    gw: Option<View<'_>>,
    gb: Option<View<'_>>,
) -> Result<()> {
    let shape = x.shape();
    let (nb, c) = (shape[0], shape[1]);
    let s: usize = shape[2..].iter().product();
    let n = nb * s;
    with_float!(grad.dtype(), "batch_norm_backward", T => {
        let (x, g) = (x.slice::<T>()?, grad.slice::<T>()?);
        let (mean, rstd) = (mean.slice::<T>()?, rstd.slice::<T>()?);
        let w = opt_slice::<T>(weight)?;
        // Per channel: (sum g, sum g * xhat).
        let sums_needed = gw.is_some() || gb.is_some() || (gx.is_some() && training);
        let sums: Vec<(f64, f64)> = if sums_needed {
            let isa = Isa::active();
            let channel = |ch: usize| channel_grad_sums(isa, x, g, c, s, ch, mean[ch], rstd[ch]);
            if n * c >= 2 * PAR_CHUNK {
                (0..c).into_par_iter().map(channel).collect()
            } else {
                (0..c).map(channel).collect()
            }
        } else {
            Vec::new()
        };
        if let Some(gx) = gx {
            let dst = SendPtr(gx.slice_mut::<T>()?.as_mut_ptr());
            let isa = Isa::active();
            for_row_groups(nb * c, s, |p0, np| {
                #[allow(clippy::redundant_locals)] // capture the Send wrapper, not its raw pointer field
                let dst = dst;
                for p in p0..p0 + np {
                    let ch = p % c;
                    let (m, r) = (mean[ch], rstd[ch]);
                    let k = T::of(r.f64() * w.map_or(1.0, |w| w[ch].f64()));
                    // SAFETY: plane p of the fresh gradient is written by this task only.
                    let d = unsafe { std::slice::from_raw_parts_mut(dst.0.add(p * s), s) };
                    let (gp, xp) = (&g[p * s..(p + 1) * s], &x[p * s..(p + 1) * s]);
                    if training {
                        let (sg, sgx) = sums[ch];
                        let (a, b) = (T::of(sg / n as f64), T::of(sgx / n as f64));
                        batch_norm_dx_plane(isa, gp, xp, d, k, a, b, m, r);
                    } else {
                        d.iter_mut().zip(gp).for_each(|(d, &gv)| *d = gv * k);
                    }
                }
            });
        }
        if let Some(gw) = gw {
            gw.slice_mut::<T>()?.iter_mut().zip(&sums).for_each(|(d, &(_, sgx))| *d = T::of(sgx));
        }
        if let Some(gb) = gb {
            gb.slice_mut::<T>()?.iter_mut().zip(&sums).for_each(|(d, &(sg, _))| *d = T::of(sg));
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values with every sign and a spread of magnitudes, from a fixed seed.
    fn values<T: Float>(len: usize, seed: u64) -> Vec<T> {
        crate::test_values::uniform(len, seed).map(|v| T::of(v * 8.0)).collect()
    }

    fn bits<T: Float>(v: &[T]) -> Vec<u64> {
        v.iter().map(|v| v.f64().to_bits()).collect()
    }

    /// Batch norm's channel sums and plane kernels give the portable copy's bits on every level,
    /// for planes with and without a tail after the last whole group of lanes.
    fn batch_norm_levels_match_portable<T: Float>() {
        for s in [1, 7, 8, 49, 256, 259] {
            let (n, c) = (3, 4);
            let (x, g) = (values::<T>(n * c * s, 11), values::<T>(n * c * s, 12));
            let run = |isa: Isa| {
                let mut out = Vec::new();
                for ch in 0..c {
                    let mean = channel_sum(isa, &x, c, s, ch, None) / (n * s) as f64;
                    let var = channel_sum(isa, &x, c, s, ch, Some(mean));
                    let (sg, sgx) = channel_grad_sums(isa, &x, &g, c, s, ch, T::of(mean), T::of(0.5));
                    out.extend([mean, var, sg, sgx].map(f64::to_bits));
                }
                let mut d = vec![T::of(0.0); s];
                scale_shift_plane(isa, &x[..s], &mut d, T::of(1.5), T::of(-0.25));
                out.extend(bits(&d));
                let [k, a, b, m, r] = [0.7, 0.1, -0.3, 0.2, 1.3].map(T::of);
                batch_norm_dx_plane(isa, &g[..s], &x[..s], &mut d, k, a, b, m, r);
                out.extend(bits(&d));
                out
            };
            let want = run(Isa::Portable);
            for isa in Isa::supported() {
                assert_eq!(run(isa), want, "batch norm: {isa} vs portable, s = {s}");
            }
        }
    }

    /// Every row kernel compiled per instruction set gives the portable copy's bits, for row lengths
    /// with and without a tail after the last whole vector, with and without the affine, in f32
    /// and f64.
    fn each_level_matches_portable<T: Float>() {
        for d in [1, 7, 8, 16, 33, 256, 259] {
            let (x, g, w, b) = (values::<T>(d, 1), values::<T>(d, 2), values::<T>(d, 3), values::<T>(d, 4));
            let rows = 5;
            let (xs, gs) = (values::<T>(rows * d, 5), values::<T>(rows * d, 6));
            let stats: Vec<T> = values::<T>(2 * rows, 7);
            let (mean, rstd) = stats.split_at(rows);
            let rstd: Vec<T> = rstd.iter().map(|v| T::of(v.f64().abs() + 0.5)).collect();
            let run = |isa: Isa| {
                let mut out = Vec::new();
                for (wo, bo) in [(Some(&w[..]), Some(&b[..])), (Some(&w[..]), None), (None, None)] {
                    let mut y = vec![T::of(0.0); d];
                    let (m, rs) = normalize_row(isa, &x, &mut y, wo, bo, 1e-5);
                    out.extend(bits(&y));
                    out.extend(bits(&[m, rs]));
                    renormalize_row(isa, &x, &mut y, m, rs, wo, bo);
                    out.extend(bits(&y));
                    let mut dx = vec![T::of(0.0); d];
                    dx_row(isa, Some(&x), &mut dx, &g, wo, m, rs);
                    out.extend(bits(&dx));
                    let mut io = x.clone();
                    dx_row(isa, None, &mut io, &g, wo, m, rs);
                    assert_eq!(bits(&io), bits(&dx), "{isa}: in place differs from out of place (d = {d})");
                }
                let (j0, cols) = (d / 3, d - d / 3);
                let (mut sw, mut sb) = (vec![0.25f64; cols], vec![-0.5f64; cols]);
                add_column_sums(isa, &mut sw, &mut sb, &gs, &xs, mean, &rstd, d, j0);
                out.extend(sw.iter().chain(&sb).map(|v| v.to_bits()));
                let (mut gw, mut sw, mut sb) = (g.clone(), vec![0.25f64; d], vec![-0.5f64; d]);
                affine_product_row(isa, &mut gw, &x, &mut sw, &mut sb, &w, &b, stats[0]);
                out.extend(bits(&gw).into_iter().chain(sw.iter().chain(&sb).map(|v| v.to_bits())));
                out
            };
            let want = run(Isa::Portable);
            for isa in Isa::supported() {
                assert_eq!(run(isa), want, "{isa} vs portable, d = {d}");
            }
        }
    }

    #[test]
    fn row_kernels_give_the_same_bits_on_every_level() {
        each_level_matches_portable::<f32>();
        each_level_matches_portable::<f64>();
        batch_norm_levels_match_portable::<f32>();
        batch_norm_levels_match_portable::<f64>();
    }

    /// One row of the affine after the weight-gradient product, by its definition: the f64 sums
    /// gain `W G` and `W gb`, and the row becomes `G lw + gb lb`.
    #[test]
    fn affine_product_row_follows_the_definition() {
        let (g, w, lw, lb) = (values::<f32>(37, 1), values::<f32>(37, 2), values::<f32>(37, 3), values::<f32>(37, 4));
        let (mut row, mut sw, mut sb) = (g.clone(), vec![1.5f64; 37], vec![-2.0f64; 37]);
        affine_product_row(Isa::active(), &mut row, &w, &mut sw, &mut sb, &lw, &lb, 0.75f32);
        for c in 0..37 {
            assert_eq!(sw[c], 1.5 + w[c] as f64 * g[c] as f64, "column {c}");
            assert_eq!(sb[c], -2.0 + w[c] as f64 * 0.75, "column {c}");
            assert_eq!(row[c], g[c] * lw[c] + 0.75 * lb[c], "column {c}");
        }
    }

    /// `affine_after_product` reads a weight stored transposed (columns contiguous: its rows
    /// gathered) as it reads the same weight stored row-major, in every column block, the sums and
    /// the rewritten weight gradient alike.
    #[test]
    fn affine_after_product_reads_a_strided_weight_as_a_contiguous_one() {
        let (out_f, d) = (9, 150); // three column blocks, the last partial
        let w = values::<f32>(out_f * d, 1);
        let wt: Vec<f32> = (0..d * out_f).map(|i| w[(i % out_f) * d + i / out_f]).collect();
        let (gw0, gb, lw, lb) =
            (values::<f32>(out_f * d, 2), values::<f32>(out_f, 3), values::<f32>(d, 4), values::<f32>(d, 5));
        let run = |w: Mat<f32>| {
            let (mut acc, mut gw) = (vec![0.0f64; 2 * d], gw0.clone());
            let mut gb = gb.clone();
            // SAFETY: gw holds out_f x d, gb out_f, and w addresses an out_f x d matrix; none overlap.
            unsafe { affine_after_product(&mut acc, gw.as_mut_ptr(), gb.as_mut_ptr(), w, &lw, &lb, out_f, d) };
            (acc, gw)
        };
        let rows = run(Mat { ptr: w.as_ptr(), rs: d as isize, cs: 1 });
        let strided = run(Mat { ptr: wt.as_ptr(), rs: 1, cs: out_f as isize });
        assert_eq!(strided, rows);
        assert!(rows.0.iter().any(|&v| v != 0.0), "the sums were taken");
    }

    /// The per-level copies are real: a row normalized by hand in f64 agrees with the kernel.
    #[test]
    fn normalize_row_matches_the_definition() {
        let x = values::<f64>(37, 9);
        let mut y = vec![0.0; 37];
        let (m, rs) = normalize_row(Isa::active(), &x, &mut y, None, None, 1e-5);
        let mean = x.iter().sum::<f64>() / 37.0;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 37.0;
        assert!((m - mean).abs() < 1e-12 && (rs - 1.0 / (var + 1e-5).sqrt()).abs() < 1e-12);
        for (yv, xv) in y.iter().zip(&x) {
            assert!((yv - (xv - mean) * rs).abs() < 1e-12);
        }
    }
}
