//! CPU kernels of the normalizations (`ops/norm.rs`): layer_norm, batch_norm (batch statistics with
//! the running-statistics update, or the running statistics) and the fused layer_norm_linear, forward
//! and backward, with the row numerics they share (so fused and unfused produce the same bits).
//! Statistics are accumulated in f64 with two passes.

use super::elementwise::{combine_lanes, for_row_groups, lane_sum, LANES};
use super::gemm::{gemm_into, gemm_row_blocks_into, Mat, SendPtr};
use super::matmul::{fill_rows_with_bias, weight_mat};
use crate::dtype::Float;
use crate::error::{check_len, Result};
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

/// Rows [`layer_norm_linear`] runs per block (its scratch holds LN_ROWS normalized rows).
pub const LN_ROWS: usize = 512;

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

/// Normalizes one row into `yr` (f64 two-pass statistics, biased variance, eps inside the sqrt, then
/// the affine); returns (mean, rstd) as kept for backward. `layer_norm` and `layer_norm_linear` share
/// it, so they produce the same bits.
#[inline]
fn normalize_row<T: Float>(xr: &[T], yr: &mut [T], w: Option<&[T]>, b: Option<&[T]>, eps: f64) -> (T, T) {
    let d = xr.len();
    let mean = lane_sum(xr, |v| v.f64()) / d as f64;
    let var = lane_sum(xr, |v| {
        let c = v.f64() - mean;
        c * c
    }) / d as f64;
    let (m, rs) = (T::of(mean), T::of(1.0 / (var + eps).sqrt()));
    for j in 0..d {
        let mut v = (xr[j] - m) * rs;
        if let Some(w) = w {
            v *= w[j];
        }
        if let Some(b) = b {
            v += b[j];
        }
        yr[j] = v;
    }
    (m, rs)
}

/// Layer-norm backward's per-row means of `dxhat = g * w` and of `dxhat * xhat`.
#[inline]
fn row_grad_sums<T: Float>(xr: &[T], gr: &[T], w: Option<&[T]>, m: T, rs: T) -> (T, T) {
    let d = xr.len();
    let terms = |j: usize| {
        let dxh = match w {
            Some(w) => gr[j] * w[j],
            None => gr[j],
        };
        (dxh.f64(), (dxh * (xr[j] - m) * rs).f64())
    };
    // Partial sums as in `lane_sum`, two at once.
    let (mut a1, mut a2) = ([0.0f64; LANES], [0.0f64; LANES]);
    let whole = d - d % LANES;
    for j0 in (0..whole).step_by(LANES) {
        for i in 0..LANES {
            let (t1, t2) = terms(j0 + i);
            a1[i] += t1;
            a2[i] += t2;
        }
    }
    let (mut tail1, mut tail2) = (0.0f64, 0.0f64);
    for j in whole..d {
        let (t1, t2) = terms(j);
        tail1 += t1;
        tail2 += t2;
    }
    (T::of(combine_lanes(&a1, tail1) / d as f64), T::of(combine_lanes(&a2, tail2) / d as f64))
}

/// Layer-norm backward for one element, given its row's [`row_grad_sums`] (a, b).
#[inline(always)]
fn row_dx<T: Float>(x: T, g: T, w: Option<T>, m: T, rs: T, a: T, b: T) -> T {
    let dxh = match w {
        Some(w) => g * w,
        None => g,
    };
    let xh = (x - m) * rs;
    rs * (dxh - a - xh * b)
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
        for_row_groups(rows, d, |r0, n| {
            let (dst, st) = (dst, st);
            for r in r0..r0 + n {
                let xr = &src[r * d..(r + 1) * d];
                // SAFETY: row r of the fresh output is written by this task only.
                let yr = unsafe { std::slice::from_raw_parts_mut(dst.0.add(r * d), d) };
                let (m, rs) = normalize_row(xr, yr, w, b, eps);
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
                    let (m, rs) = (mean[r], rstd[r]);
                    let (a, b) = row_grad_sums(xr, gr, w, m, rs);
                    for j in 0..d {
                        dr[j] = row_dx(xr[j], gr[j], w.map(|w| w[j]), m, rs, a, b);
                    }
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
                for r in 0..rows {
                    let (m, rs) = (mean[r], rstd[r]);
                    for j in j0..j1 {
                        let gv = g[r * d + j];
                        sb[j - j0] += gv.f64();
                        sw[j - j0] += (gv * (x[r * d + j] - m) * rs).f64();
                    }
                }
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
) -> Result<()> {
    const NAME: &str = "layer_norm_linear";
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    let rows = x.numel() / in_f;
    with_float!(x.dtype(), NAME, T => {
        let dst = out.slice_mut::<T>()?;
        check_len("layer_norm_linear output", dst.len(), rows * out_f)?;
        fill_rows_with_bias::<T>(dst, bias, out_f)?;
        let (xs, w, b) = (x.slice::<T>()?, ln_weight.slice::<T>()?, ln_bias.slice::<T>()?);
        let st = statistics_ptrs::<T>(NAME, mean, rstd, rows)?;
        let sc = scratch.slice_mut::<T>()?;
        check_len("layer_norm_linear scratch", sc.len(), rows.min(LN_ROWS) * in_f)?;
        let sc = SendPtr(sc.as_mut_ptr());
        let wt = weight_mat::<T>(weight, true)?;
        let normalized_rows = |r0: usize, n: usize| {
            for_row_groups(n, in_f, |g0, gn| {
                let (sc, st) = (sc, st);
                for r in g0..g0 + gn {
                    // SAFETY: scratch row r and statistics entry r0 + r are written by this task only.
                    let yr = unsafe { std::slice::from_raw_parts_mut(sc.0.add(r * in_f), in_f) };
                    let (m, rs) = normalize_row(&xs[(r0 + r) * in_f..(r0 + r + 1) * in_f], yr, Some(w), Some(b), eps);
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
            gemm_row_blocks_into::<T>(rows, out_f, in_f, dst.as_mut_ptr(), out_f as isize, bias.is_some(),
                LN_ROWS, normalized_rows, wt)
        };
    });
    Ok(())
}

/// Backward of [`layer_norm_linear`] from `grad` [rows, out], block by block through `scratch`: the
/// input gradient into `gx` (which is `x` itself when the op decided to write it in place), the
/// layer-norm weight and bias gradients (their f64 column sums in `sums` [2, in]) and the weight
/// gradient, each when given.
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
    scratch: View<'_>,
    sums: Option<View<'_>>,
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
        // Column sums of the layer-norm weight and bias gradients over all rows, in f64.
        let mut acc = sums.map(|t| t.slice_mut::<f64>()).transpose()?;
        if let Some(a) = &mut acc {
            a.fill(0.0);
        }
        let sc = scratch.slice_mut::<T>()?;
        let w_mat = weight_mat::<T>(weight, false)?;
        let threads = rayon::current_num_threads();
        for r0 in (0..rows).step_by(LN_ROWS) {
            let n = LN_ROWS.min(rows - r0);
            let g_ptr = gs[r0 * out_f..].as_ptr();
            let g_block = Mat { ptr: g_ptr, rs: out_f as isize, cs: 1 };
            let block = &mut sc[..n * d];
            // SAFETY: rows r0..r0+n of x are in its storage; they are only read until the dx
            // step below, which no longer uses this slice.
            let xb = unsafe { std::slice::from_raw_parts(xp.0.add(r0 * d) as *const T, n * d) };
            if let Some(gwp) = gwp {
                // Recompute the block's normalized rows (as forward did), then dW (+)= g^T y.
                for_rows_mut(block, d, |r, yr| {
                    let (xr, m, rs) = (&xb[r * d..(r + 1) * d], mean[r0 + r], rstd[r0 + r]);
                    for j in 0..d {
                        let mut v = (xr[j] - m) * rs;
                        v *= lw[j];
                        v += lb[j];
                        yr[j] = v;
                    }
                });
                let g_t = Mat { ptr: g_ptr, rs: 1, cs: out_f as isize };
                let y = Mat { ptr: block.as_ptr(), rs: d as isize, cs: 1 };
                // SAFETY: the weight gradient is a fresh [out, d] tensor; operands are in bounds.
                unsafe { gemm_into::<T>(out_f, d, n, gwp, d as isize, r0 > 0, g_t, y, threads) };
            }
            if !need_gy {
                continue;
            }
            // gy = g W, the gradient of the normalized rows, over the scratch.
            // SAFETY: the scratch block is n x d and separate from the operands.
            unsafe { gemm_into::<T>(n, d, out_f, block.as_mut_ptr(), d as isize, false, g_block, w_mat, threads) };
            let gy: &[T] = block;
            if let Some(acc) = &mut acc {
                // Column blocks: each task sums its columns over the block's rows, in row order.
                const COLS: usize = 64;
                let (aw, ab) = acc.split_at_mut(d);
                // Rows outer, columns inner: memory in order, each column still summed in
                // row order.
                let run = |(blk, (sw, sb)): (usize, (&mut [f64], &mut [f64]))| {
                    let j0 = blk * COLS;
                    for r in 0..n {
                        let (m, rs) = (mean[r0 + r], rstd[r0 + r]);
                        let (gr, xr) = (&gy[r * d + j0..r * d + j0 + sw.len()], &xb[r * d + j0..r * d + j0 + sw.len()]);
                        for (c, (sw, sb)) in sw.iter_mut().zip(sb.iter_mut()).enumerate() {
                            let gv = gr[c];
                            *sb += gv.f64();
                            *sw += (gv * (xr[c] - m) * rs).f64();
                        }
                    }
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
                        // touched by this task only; each x[j] is read before dx[j] is written.
                        unsafe {
                            let (src, dst) = (xp.0.add((r0 + r) * d), gxp.0.add((r0 + r) * d));
                            let (a, b) = row_grad_sums(std::slice::from_raw_parts(src, d), gyr, Some(lw), m, rs);
                            for j in 0..d {
                                *dst.add(j) = row_dx(*src.add(j), gyr[j], Some(lw[j]), m, rs, a, b);
                            }
                        }
                    }
                });
            }
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
            let channel = |ch: usize| {
                let planes = || (0..nb).map(move |i| &src[(i * c + ch) * s..(i * c + ch + 1) * s]);
                let mean = planes().map(|p| p.iter().map(|v| v.f64()).sum::<f64>()).sum::<f64>() / n as f64;
                let var = planes()
                    .map(|p| p.iter().map(|v| { let d = v.f64() - mean; d * d }).sum::<f64>())
                    .sum::<f64>() / n as f64;
                (mean, var)
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
        for_row_groups(nb * c, s, |p0, np| {
            #[allow(clippy::redundant_locals)] // capture the Send wrapper, not its raw pointer field
            let dst = dst;
            for p in p0..p0 + np {
                let (alpha, beta) = ab[p % c];
                // SAFETY: plane p of the fresh output is written by this task only.
                let d = unsafe { std::slice::from_raw_parts_mut(dst.0.add(p * s), s) };
                d.iter_mut().zip(&src[p * s..(p + 1) * s]).for_each(|(d, &v)| *d = v * alpha + beta);
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
            let channel = |ch: usize| {
                let (m, r) = (mean[ch], rstd[ch]);
                let (mut sg, mut sgx) = (0.0f64, 0.0f64);
                for i in 0..nb {
                    let o = (i * c + ch) * s;
                    for (&gv, &xv) in g[o..o + s].iter().zip(&x[o..o + s]) {
                        sg += gv.f64();
                        sgx += (gv * (xv - m) * r).f64();
                    }
                }
                (sg, sgx)
            };
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
                        for j in 0..s {
                            d[j] = k * (gp[j] - a - (xp[j] - m) * r * b);
                        }
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
