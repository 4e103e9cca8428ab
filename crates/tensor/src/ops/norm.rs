//! Normalization: layer_norm over the trailing dims, batch_norm (training with running-statistics
//! update, and eval), and layer_norm_linear (a layer norm over the last dim fused with the linear
//! layer after it).
//!
//! All are fused kernels. layer_norm saves the input, the weight and per-row mean and rstd;
//! batch_norm saves the input, the weight and per-channel mean and rstd (the batch statistics in
//! training, the running statistics in eval); layer_norm_linear saves the input, per-row mean and
//! rstd and the weights, but not the normalized tensor, which its backward recomputes block by block.
//! Statistics are accumulated in f64 with two passes.

use super::matmul::{check_linear, fill_rows_with_bias, weight_mat};
use crate::backend::cpu::gemm::{gemm_into, Mat, SendPtr};
use super::{check_same, output, PAR_CHUNK};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::with_float;
use memfit_memory::Category;
use rayon::prelude::*;

/// Calls `f(first_row, rows)` for consecutive groups of rows of `row_len` elements, in parallel when
/// the data is big enough; groups hold about `PAR_CHUNK` elements.
fn for_row_groups(rows: usize, row_len: usize, f: impl Fn(usize, usize) + Sync + Send) {
    let per = (PAR_CHUNK / row_len.max(1)).max(1);
    let groups = rows.div_ceil(per);
    let run = |k: usize| f(k * per, per.min(rows - k * per));
    if rows * row_len >= 2 * PAR_CHUNK && groups > 1 {
        (0..groups).into_par_iter().for_each(run);
    } else {
        (0..groups).for_each(run);
    }
}

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

fn opt_slice<T: Float + crate::tensor::Element>(t: Option<&Tensor>) -> Result<Option<&[T]>> {
    t.map(|t| t.slice::<T>()).transpose()
}

/// Normalizes one row into `yr` (f64 two-pass statistics, biased variance, eps inside the sqrt, then
/// the affine); returns (mean, rstd) as kept for backward. `layer_norm` and `layer_norm_linear` share
/// it, so they produce the same bits.
#[inline]
fn normalize_row<T: Float>(xr: &[T], yr: &mut [T], w: Option<&[T]>, b: Option<&[T]>, eps: f64) -> (T, T) {
    let d = xr.len();
    let mean = xr.iter().map(|v| v.f64()).sum::<f64>() / d as f64;
    let var = xr
        .iter()
        .map(|v| {
            let c = v.f64() - mean;
            c * c
        })
        .sum::<f64>()
        / d as f64;
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
    let (mut s1, mut s2) = (0.0f64, 0.0f64);
    for j in 0..d {
        let dxh = match w {
            Some(w) => gr[j] * w[j],
            None => gr[j],
        };
        s1 += dxh.f64();
        s2 += (dxh * (xr[j] - m) * rs).f64();
    }
    (T::of(s1 / d as f64), T::of(s2 / d as f64))
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

/// `F.layer_norm(x, normalized_shape, weight, bias, eps)`: biased variance, eps inside the sqrt.
pub fn layer_norm(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let _op = x.device().op_scope("layer_norm");
    let mut all = vec![x];
    all.extend(weight);
    all.extend(bias);
    check_same("layer_norm", &all)?;
    let k = normalized_shape.len();
    if k == 0 || x.rank() < k || &x.shape()[x.rank() - k..] != normalized_shape {
        return Err(Error::shape(format!(
            "layer_norm: normalized_shape {normalized_shape:?} does not match the trailing dims of input {:?}",
            x.shape()
        )));
    }
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            if t.shape() != normalized_shape {
                return Err(Error::shape(format!(
                    "layer_norm: {name} {:?} should have shape normalized_shape {normalized_shape:?}",
                    t.shape()
                )));
            }
        }
    }
    let x = x.contiguous()?;
    let weight = weight.map(|w| w.contiguous()).transpose()?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let d: usize = normalized_shape.iter().product();
    let rows = x.numel().checked_div(d).unwrap_or(0);
    let stats_shape = &x.shape()[..x.rank() - k];

    let mut inputs = vec![&x];
    inputs.extend(weight.as_ref());
    inputs.extend(bias.as_ref());
    let grad = needs_grad(&inputs);

    let out = output(&x, x.shape(), x.dtype(), "layer_norm")?;
    let stats = if grad {
        Some((output(&x, stats_shape, x.dtype(), "layer_norm")?, output(&x, stats_shape, x.dtype(), "layer_norm")?))
    } else {
        None
    };
    if x.device().computes() && rows > 0 {
        with_float!(x.dtype(), "layer_norm", T => {
            let src = x.slice::<T>()?;
            let (w, b) = (opt_slice::<T>(weight.as_ref())?, opt_slice::<T>(bias.as_ref())?);
            let dst = SendPtr(out.slice_mut::<T>()?.as_mut_ptr());
            let st = match &stats {
                Some((m, r)) => Some((SendPtr(m.slice_mut::<T>()?.as_mut_ptr()), SendPtr(r.slice_mut::<T>()?.as_mut_ptr()))),
                None => None,
            };
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
    }
    let Some((mean, rstd)) = stats else { return Ok(out) };
    let back = LayerNormBack {
        x: save(&x),
        weight: weight.as_ref().map(save),
        mean: save(&mean),
        rstd: save(&rstd),
        has_bias: bias.is_some(),
        d,
    };
    Ok(record(out, "layer_norm", &inputs, back))
}

struct LayerNormBack {
    x: Tensor,
    weight: Option<Tensor>,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    d: usize,
}

impl Backward for LayerNormBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let d = self.d;
        let rows = self.mean.numel();
        let has_w = self.weight.is_some();
        let need_x = needs[0];
        let need_w = has_w && needs[1];
        let need_b = self.has_bias && needs[if has_w { 2 } else { 1 }];
        let shape = self.x.shape().to_vec();
        // The normalized dims are the trailing dims after the (per-row) statistics' dims.
        let nshape = &self.x.shape()[self.mean.rank()..];
        let gx = if need_x { Some(output(&grad, &shape, grad.dtype(), "layer_norm_backward")?) } else { None };
        let gw = if need_w { Some(output(&grad, nshape, grad.dtype(), "layer_norm_backward")?) } else { None };
        let gb = if need_b { Some(output(&grad, nshape, grad.dtype(), "layer_norm_backward")?) } else { None };
        if grad.device().computes() && d > 0 {
            with_float!(grad.dtype(), "layer_norm_backward", T => {
                let (x, g) = (self.x.slice::<T>()?, grad.slice::<T>()?);
                let (mean, rstd) = (self.mean.slice::<T>()?, self.rstd.slice::<T>()?);
                let w = opt_slice::<T>(self.weight.as_ref())?;
                if let Some(gx) = &gx {
                    let dst = SendPtr(gx.slice_mut::<T>()?.as_mut_ptr());
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
                    let pw = match &gw { Some(t) => Some(SendPtr(t.slice_mut::<T>()?.as_mut_ptr())), None => None };
                    let pb = match &gb { Some(t) => Some(SendPtr(t.slice_mut::<T>()?.as_mut_ptr())), None => None };
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
        }
        let mut grads = vec![gx];
        if has_w {
            grads.push(gw);
        }
        if self.has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

/// Rows [`layer_norm_linear`] runs per block (its scratch holds LN_ROWS normalized rows).
const LN_ROWS: usize = 512;

/// `linear(layer_norm(x, [in], ln_weight, ln_bias, eps), weight, bias)` fused (a pre-norm
/// transformer's normalization and the projection after it): x [..., in], ln_weight and ln_bias [in],
/// weight [out, in], bias [out].
///
/// Unfused, autograd keeps both the normalization's input (for its backward) and its output (for the
/// linear's); this op saves only `x`, the per-row mean and rstd and the weights, and recomputes the
/// normalized rows in backward. Forward and backward work in blocks of `LN_ROWS` rows through one
/// allocator scratch of LN_ROWS x in, so the normalized tensor never exists whole; the column sums of
/// the layer-norm weight and bias gradients are kept in an f64 [2, in] allocator tensor. Backward
/// writes the input gradient over the saved `x` when nobody else can see it (Note [Gradient
/// ownership] in `autograd.rs`), else into a new tensor. Normalized values and layer-norm gradients are
/// computed exactly as [`layer_norm`] computes them; only the sum over rows of the linear weight
/// gradient is split by row blocks.
pub fn layer_norm_linear(
    x: &Tensor,
    ln_weight: &Tensor,
    ln_bias: &Tensor,
    eps: f64,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let _op = x.device().op_scope("layer_norm_linear");
    const NAME: &str = "layer_norm_linear";
    let (out_f, in_f) = check_linear(NAME, x, weight, bias)?;
    check_same(NAME, &[x, ln_weight, ln_bias])?;
    if in_f == 0 {
        return Err(Error::shape(format!("{NAME}: needs at least one feature, got input {:?}", x.shape())));
    }
    for (name, t) in [("ln_weight", ln_weight), ("ln_bias", ln_bias)] {
        if t.shape() != [in_f] {
            return Err(Error::shape(format!("{NAME}: {name} {:?} should be [{in_f}]", t.shape())));
        }
    }
    let x = x.contiguous()?;
    let (ln_w, ln_b) = (ln_weight.contiguous()?, ln_bias.contiguous()?);
    let rows = x.numel() / in_f;
    let mut inputs = vec![&x, &ln_w, &ln_b, weight];
    inputs.extend(bias);
    let grad = needs_grad(&inputs);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), NAME)?;
    let stats_shape = &x.shape()[..x.rank() - 1];
    let stats = if grad {
        Some((output(&x, stats_shape, x.dtype(), NAME)?, output(&x, stats_shape, x.dtype(), NAME)?))
    } else {
        None
    };
    let scratch = output(&x, &[rows.min(LN_ROWS), in_f], x.dtype(), NAME)?;
    if x.device().computes() {
        with_float!(x.dtype(), NAME, T => {
            let dst = out.slice_mut::<T>()?;
            fill_rows_with_bias::<T>(dst, bias, out_f)?;
            let (xs, w, b) = (x.slice::<T>()?, ln_w.slice::<T>()?, ln_b.slice::<T>()?);
            let st = match &stats {
                Some((m, r)) => Some((SendPtr(m.slice_mut::<T>()?.as_mut_ptr()), SendPtr(r.slice_mut::<T>()?.as_mut_ptr()))),
                None => None,
            };
            let sc = SendPtr(scratch.slice_mut::<T>()?.as_mut_ptr());
            let wt = weight_mat::<T>(weight, true)?;
            for r0 in (0..rows).step_by(LN_ROWS) {
                let n = LN_ROWS.min(rows - r0);
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
                let a = Mat { ptr: sc.0 as *const T, rs: in_f as isize, cs: 1 };
                // SAFETY: rows r0..r0+n of the fresh output; the scratch is a separate tensor.
                unsafe {
                    gemm_into::<T>(n, out_f, in_f, dst.as_mut_ptr().add(r0 * out_f), out_f as isize, bias.is_some(),
                        a, wt, rayon::current_num_threads())
                };
            }
        });
    }
    drop(scratch);
    let Some((mean, rstd)) = stats else { return Ok(out) };
    let back = LayerNormLinearBack {
        x: save(&x),
        ln_weight: save(&ln_w),
        ln_bias: save(&ln_b),
        weight: save(weight),
        mean: save(&mean),
        rstd: save(&rstd),
        has_bias: bias.is_some(),
    };
    Ok(record(out, NAME, &inputs, back))
}

struct LayerNormLinearBack {
    /// The normalization's input; overwritten with its gradient in backward when exclusively owned.
    x: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
}

impl Backward for LayerNormLinearBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        const NAME: &str = "layer_norm_linear_backward";
        let LayerNormLinearBack { x, ln_weight, ln_bias, weight, mean, rstd, has_bias } = *self;
        let (out_f, d) = (weight.shape()[0], weight.shape()[1]);
        let g2 = grad.contiguous()?.reshape(&[-1, out_f as isize])?;
        let rows = g2.shape()[0];
        let (need_x, need_lw, need_lb, need_w) = (needs[0], needs[1], needs[2], needs[3]);
        let need_gy = need_x || need_lw || need_lb;
        // Decided from who holds what, never from data, so meta allocates as cpu does.
        let in_place = need_x && x.owns_storage();
        let gx = if need_x && !in_place { Some(output(&grad, x.shape(), grad.dtype(), NAME)?) } else { None };
        let glw = if need_lw { Some(output(&grad, &[d], grad.dtype(), NAME)?) } else { None };
        let glb = if need_lb { Some(output(&grad, &[d], grad.dtype(), NAME)?) } else { None };
        let gw = if need_w { Some(output(&grad, &[out_f, d], grad.dtype(), NAME)?) } else { None };
        let gb = if has_bias && needs[4] { Some(g2.sum_dim(0, false)?) } else { None };
        // Everything is allocated before x may be overwritten.
        let scratch = output(&grad, &[rows.min(LN_ROWS), d], grad.dtype(), NAME)?;
        let sums = if need_lw || need_lb { Some(output(&grad, &[2, d], DType::F64, NAME)?) } else { None };
        if grad.device().computes() {
            with_float!(grad.dtype(), NAME, T => {
                let gs = g2.slice::<T>()?;
                let (mean, rstd) = (mean.slice::<T>()?, rstd.slice::<T>()?);
                let (lw, lb) = (ln_weight.slice::<T>()?, ln_bias.slice::<T>()?);
                // In place, the input gradient is x itself: every read of a block of x comes before
                // the block is overwritten, and each row is read before it is written.
                let xp = SendPtr(x.slice_mut::<T>()?.as_mut_ptr());
                let gxp = match &gx {
                    Some(t) => Some(SendPtr(t.slice_mut::<T>()?.as_mut_ptr())),
                    None if in_place => Some(xp),
                    None => None,
                };
                let mut gw_values = gw.as_ref().map(|t| t.slice_mut::<T>()).transpose()?;
                if let (0, Some(g)) = (rows, &mut gw_values) {
                    g.fill(T::of(0.0));
                }
                let gwp = gw_values.map(|s| s.as_mut_ptr());
                // Column sums of the layer-norm weight and bias gradients over all rows, in f64.
                let mut acc = sums.as_ref().map(|t| t.slice_mut::<f64>()).transpose()?;
                if let Some(a) = &mut acc {
                    a.fill(0.0);
                }
                let sc = scratch.slice_mut::<T>()?;
                let w_mat = weight_mat::<T>(&weight, false)?;
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
                    if let Some(t) = &glw {
                        t.slice_mut::<T>()?.iter_mut().zip(&acc[..d]).for_each(|(g, &a)| *g = T::of(a));
                    }
                    if let Some(t) = &glb {
                        t.slice_mut::<T>()?.iter_mut().zip(&acc[d..]).for_each(|(g, &a)| *g = T::of(a));
                    }
                }
            });
        }
        drop((scratch, sums));
        let gx = if in_place {
            // x now holds its gradient: a temporary again, no longer an activation.
            x.storage().set_category(Category::Temporary);
            Some(x)
        } else {
            gx
        };
        let mut grads = vec![gx, glw, glb, gw];
        if has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

/// `F.batch_norm` over channel dim 1 of x [N, C, ...]. Training: normalizes with the biased batch
/// variance and updates the running statistics in place (`rm = (1-m) rm + m mean`,
/// `rv = (1-m) rv + m var * n/(n-1)`); gradients flow through the batch statistics. Eval: uses the
/// running statistics as constants.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let _op = x.device().op_scope("batch_norm");
    let mut all = vec![x];
    all.extend(running_mean);
    all.extend(running_var);
    all.extend(weight);
    all.extend(bias);
    check_same("batch_norm", &all)?;
    if x.rank() < 2 {
        return Err(Error::shape(format!("batch_norm: input must be [N, C, ...], got {:?}", x.shape())));
    }
    let (nb, c) = (x.shape()[0], x.shape()[1]);
    let s: usize = x.shape()[2..].iter().product();
    let n = nb * s;
    for (name, t) in [("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)]
    {
        if let Some(t) = t {
            if t.shape() != [c] {
                return Err(Error::shape(format!(
                    "batch_norm: {name} {:?} should be [{c}] for input {:?}",
                    t.shape(),
                    x.shape()
                )));
            }
        }
    }
    let running = match (running_mean, running_var) {
        (Some(m), Some(v)) => Some((m, v)),
        (None, None) => None,
        _ => return Err(Error::invalid("batch_norm: give both running_mean and running_var, or neither")),
    };
    if !training && running.is_none() {
        return Err(Error::invalid("batch_norm: eval mode needs running_mean and running_var"));
    }
    if let Some((m, v)) = running {
        if !m.is_contiguous() || !v.is_contiguous() {
            return Err(Error::invalid("batch_norm: running statistics must be contiguous buffers"));
        }
    }
    if training && n <= 1 {
        return Err(Error::invalid(format!(
            "batch_norm: expected more than 1 value per channel when training, got input {:?}",
            x.shape()
        )));
    }
    let x = x.contiguous()?;
    let weight = weight.map(|w| w.contiguous()).transpose()?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let mut inputs = vec![&x];
    inputs.extend(weight.as_ref());
    inputs.extend(bias.as_ref());
    let grad = needs_grad(&inputs);

    let out = output(&x, x.shape(), x.dtype(), "batch_norm")?;
    let stats = if grad {
        Some((output(&x, &[c], x.dtype(), "batch_norm")?, output(&x, &[c], x.dtype(), "batch_norm")?))
    } else {
        None
    };
    if x.device().computes() && x.numel() > 0 {
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
            let (w, b) = (opt_slice::<T>(weight.as_ref())?, opt_slice::<T>(bias.as_ref())?);
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
            if let Some((sm, sr)) = &stats {
                let (sm, sr) = (sm.slice_mut::<T>()?, sr.slice_mut::<T>()?);
                for (ch, &(m, r)) in ms.iter().enumerate() {
                    sm[ch] = T::of(m);
                    sr[ch] = T::of(r);
                }
            }
        });
    }
    let Some((mean, rstd)) = stats else { return Ok(out) };
    let back = BatchNormBack {
        x: save(&x),
        weight: weight.as_ref().map(save),
        mean: save(&mean),
        rstd: save(&rstd),
        has_bias: bias.is_some(),
        training,
    };
    Ok(record(out, "batch_norm", &inputs, back))
}

struct BatchNormBack {
    x: Tensor,
    weight: Option<Tensor>,
    /// Per-channel statistics used to normalize: the batch's in training, the running ones in eval.
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    training: bool,
}

impl Backward for BatchNormBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let shape = self.x.shape().to_vec();
        let (nb, c) = (shape[0], shape[1]);
        let s: usize = shape[2..].iter().product();
        let n = nb * s;
        let has_w = self.weight.is_some();
        let need_x = needs[0];
        let need_w = has_w && needs[1];
        let need_b = self.has_bias && needs[if has_w { 2 } else { 1 }];
        let gx = if need_x { Some(output(&grad, &shape, grad.dtype(), "batch_norm_backward")?) } else { None };
        let gw = if need_w { Some(output(&grad, &[c], grad.dtype(), "batch_norm_backward")?) } else { None };
        let gb = if need_b { Some(output(&grad, &[c], grad.dtype(), "batch_norm_backward")?) } else { None };
        if grad.device().computes() {
            with_float!(grad.dtype(), "batch_norm_backward", T => {
                let (x, g) = (self.x.slice::<T>()?, grad.slice::<T>()?);
                let (mean, rstd) = (self.mean.slice::<T>()?, self.rstd.slice::<T>()?);
                let w = opt_slice::<T>(self.weight.as_ref())?;
                // Per channel: (sum g, sum g * xhat).
                let sums_needed = gw.is_some() || gb.is_some() || (gx.is_some() && self.training);
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
                if let Some(gx) = &gx {
                    let training = self.training;
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
                if let Some(gw) = &gw {
                    gw.slice_mut::<T>()?.iter_mut().zip(&sums).for_each(|(d, &(_, sgx))| *d = T::of(sgx));
                }
                if let Some(gb) = &gb {
                    gb.slice_mut::<T>()?.iter_mut().zip(&sums).for_each(|(d, &(sg, _))| *d = T::of(sg));
                }
            });
        }
        let mut grads = vec![gx];
        if has_w {
            grads.push(gw);
        }
        if self.has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{backward, backward_with};
    use crate::ops::softmax::test_support::*;
    use crate::{Category, DType, Device};

    #[test]
    fn layer_norm_hand_checked() {
        let dev = Device::cpu();
        // Row [1, 2, 3, 4]: mean 2.5, biased var 1.25.
        let x = t64(&dev, &[1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0], &[2, 4]);
        let w = t64(&dev, &[1.0, 2.0, 1.0, 1.0], &[4]);
        let b = t64(&dev, &[0.0, 0.0, 0.0, 1.0], &[4]);
        let eps = 1e-5;
        let y = layer_norm(&x, &[4], Some(&w), Some(&b), eps).unwrap().to_f64_vec().unwrap();
        let r = 1.0 / (1.25f64 + eps).sqrt();
        let want = [-1.5 * r, -0.5 * r * 2.0, 0.5 * r, 1.5 * r + 1.0, 0.0, 0.0, 0.0, 1.0];
        assert_close(&y, &want, 1e-14, "layer_norm");
        // Normalizing over both dims of a [2, 2] block.
        let y2 = layer_norm(&x.reshape(&[2, 2, 2]).unwrap(), &[2, 2], None, None, eps).unwrap();
        assert_close(&y2.to_f64_vec().unwrap()[..4], &[-1.5 * r, -0.5 * r, 0.5 * r, 1.5 * r], 1e-14, "2-d");
        assert!(layer_norm(&x, &[3], None, None, eps).is_err());
        assert!(layer_norm(&x, &[4], Some(&b.reshape(&[2, 2]).unwrap()), None, eps).is_err());
    }

    #[test]
    fn batch_norm_hand_checked_and_running_stats() {
        let dev = Device::cpu();
        // x [2, 2] (N=2, C=2): channel 0 = [1, 3] (mean 2, var 1), channel 1 = [2, 2] (mean 2, var 0).
        let x = t64(&dev, &[1.0, 2.0, 3.0, 2.0], &[2, 2]);
        let rm = Tensor::from_slice(&dev, &[0.0f64, 1.0], &[2], Category::Other).unwrap();
        let rv = Tensor::from_slice(&dev, &[1.0f64, 1.0], &[2], Category::Other).unwrap();
        let eps = 1e-5;
        let y = batch_norm(&x, Some(&rm), Some(&rv), None, None, true, 0.1, eps).unwrap();
        let r = 1.0 / (1.0f64 + eps).sqrt();
        assert_close(&y.to_f64_vec().unwrap(), &[-r, 0.0, r, 0.0], 1e-14, "train");
        // rm = 0.9 rm + 0.1 mean; rv = 0.9 rv + 0.1 * var * n/(n-1) (n = 2).
        assert_close(&rm.to_f64_vec().unwrap(), &[0.2, 1.1], 1e-15, "running_mean");
        assert_close(&rv.to_f64_vec().unwrap(), &[0.9 + 0.2, 0.9], 1e-15, "running_var");
        // Eval uses the running stats, weight and bias.
        let w = t64(&dev, &[2.0, 1.0], &[2]);
        let b = t64(&dev, &[0.5, 0.0], &[2]);
        let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), false, 0.1, eps).unwrap();
        let (r0, r1) = (1.0 / (1.1f64 + eps).sqrt(), 1.0 / (0.9f64 + eps).sqrt());
        let want = [(1.0 - 0.2) * r0 * 2.0 + 0.5, (2.0 - 1.1) * r1, (3.0 - 0.2) * r0 * 2.0 + 0.5, (2.0 - 1.1) * r1];
        assert_close(&y.to_f64_vec().unwrap(), &want, 1e-14, "eval");
        assert_close(&rm.to_f64_vec().unwrap(), &[0.2, 1.1], 0.0, "eval leaves running stats");
        // Errors.
        let one = t64(&dev, &[1.0, 2.0], &[1, 2]);
        assert!(batch_norm(&one, None, None, None, None, true, 0.1, eps)
            .unwrap_err()
            .to_string()
            .contains("more than 1"));
        assert!(batch_norm(&x, None, None, None, None, false, 0.1, eps).is_err());
        assert!(batch_norm(&x, Some(&rm), None, None, None, true, 0.1, eps).is_err());
        assert!(batch_norm(&x, None, None, Some(&t64(&dev, &[1.0; 3], &[3])), None, true, 0.1, eps).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        let x = values(24, 3).iter().map(|v| v * 2.0).collect::<Vec<_>>();
        let (w, b) = (values(4, 4).iter().map(|v| v + 1.5).collect::<Vec<_>>(), values(4, 5));
        gradcheck(&[(x.clone(), vec![2, 3, 4]), (w.clone(), vec![4]), (b.clone(), vec![4])], |t| {
            layer_norm(&t[0], &[4], Some(&t[1]), Some(&t[2]), 1e-5)
        });
        gradcheck(&[(x.clone(), vec![2, 3, 4])], |t| layer_norm(&t[0], &[3, 4], None, None, 1e-5));
        gradcheck(&[(x.clone(), vec![2, 3, 4]), (b.clone(), vec![4])], |t| {
            layer_norm(&t[0], &[4], None, Some(&t[1]), 1e-5)
        });
        // batch_norm over C = 3 with a trailing dim of 4, and the 2-D [N, C] form.
        let (w3, b3) = (vec![1.5, 0.7, -1.2], vec![0.1, -0.2, 0.3]);
        for training in [true, false] {
            let f = |t: &[Tensor]| {
                let dev = t[0].device();
                let rm = Tensor::from_slice(dev, &[0.1f64, -0.2, 0.3], &[3], Category::Other)?;
                let rv = Tensor::from_slice(dev, &[0.5f64, 1.5, 2.0], &[3], Category::Other)?;
                batch_norm(&t[0], Some(&rm), Some(&rv), Some(&t[1]), Some(&t[2]), training, 0.1, 1e-5)
            };
            gradcheck(&[(x.clone(), vec![2, 3, 4]), (w3.clone(), vec![3]), (b3.clone(), vec![3])], f);
            gradcheck(&[(x[..12].to_vec(), vec![4, 3]), (w3.clone(), vec![3]), (b3.clone(), vec![3])], f);
        }
        gradcheck(&[(x.clone(), vec![2, 3, 2, 2])], |t| batch_norm(&t[0], None, None, None, None, true, 0.1, 1e-5));
    }

    #[test]
    fn big_inputs_take_parallel_paths() {
        // Compare the parallel kernels with an f64 reference computed here.
        let dev = Device::cpu();
        let (rows, d) = (300, 257);
        let data = values(rows * d, 6);
        let x = t64(&dev, &data, &[rows, d]).set_requires_grad(true);
        let w = t64(&dev, &values(d, 7), &[d]).set_requires_grad(true);
        let y = layer_norm(&x, &[d], Some(&w), None, 1e-5).unwrap();
        let yv = y.to_f64_vec().unwrap();
        for r in [0, 123, rows - 1] {
            let row = &data[r * d..(r + 1) * d];
            let m = row.iter().sum::<f64>() / d as f64;
            let v = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / d as f64;
            let j = 100;
            let want = (row[j] - m) / (v + 1e-5).sqrt() * values(d, 7)[j];
            assert_close(&[yv[r * d + j]], &[want], 1e-12, "layer_norm row");
        }
        backward(&y.sum_all().unwrap()).unwrap();
        // With a sum loss and no bias: dw_j = sum_r xhat_rj; and dx rows sum to ~0.
        let gx = x.grad().unwrap().to_f64_vec().unwrap();
        assert!(gx[..d].iter().sum::<f64>().abs() < 1e-10);
        assert!(w.grad().is_some());

        let (n, c, s) = (8, 5, 1000);
        let xb = t64(&dev, &values(n * c * s, 8), &[n, c, s]);
        let y = batch_norm(&xb, None, None, None, None, true, 0.1, 0.0).unwrap().to_f64_vec().unwrap();
        for ch in 0..c {
            let vals: Vec<f64> = (0..n).flat_map(|i| y[(i * c + ch) * s..(i * c + ch + 1) * s].to_vec()).collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let v = vals.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / vals.len() as f64;
            assert!(m.abs() < 1e-12 && (v - 1.0).abs() < 1e-10, "channel {ch}: mean {m} var {v}");
        }
    }

    #[test]
    fn golden_layer_norm_and_batch_norm() {
        let g = Golden::open("norm.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            let sfx = suffix(dtype);
            let name = format!("layer_norm_{sfx}");
            let k = |s: &str| format!("{name}/{s}");
            let (x, w, b) = (g.leaf(&dev, &k("input")), g.leaf(&dev, &k("weight")), g.leaf(&dev, &k("bias")));
            let y = layer_norm(&x, &[8], Some(&w), Some(&b), 1e-5).unwrap();
            assert_golden(&y, &g.f64s(&k("output")), dtype, &name);
            backward_with(&y, g.tensor(&dev, &k("grad_out"))).unwrap();
            assert_golden(&x.grad().unwrap(), &g.f64s(&k("grad_input")), dtype, &name);
            assert_golden(&w.grad().unwrap(), &g.f64s(&k("grad_weight")), dtype, &name);
            assert_golden(&b.grad().unwrap(), &g.f64s(&k("grad_bias")), dtype, &name);

            for case in ["batch_norm_train", "batch_norm_train_2d", "batch_norm_eval"] {
                let name = format!("{case}_{sfx}");
                let k = |s: &str| format!("{name}/{s}");
                let training = case != "batch_norm_eval";
                let (x, w, b) = (g.leaf(&dev, &k("input")), g.leaf(&dev, &k("weight")), g.leaf(&dev, &k("bias")));
                let (rm, rv) = (g.tensor(&dev, &k("running_mean")), g.tensor(&dev, &k("running_var")));
                let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), training, 0.1, 1e-5).unwrap();
                assert_golden(&y, &g.f64s(&k("output")), dtype, &name);
                if training {
                    assert_golden(&rm, &g.f64s(&k("running_mean_after")), dtype, &name);
                    assert_golden(&rv, &g.f64s(&k("running_var_after")), dtype, &name);
                }
                backward_with(&y, g.tensor(&dev, &k("grad_out"))).unwrap();
                assert_golden(&x.grad().unwrap(), &g.f64s(&k("grad_input")), dtype, &name);
                assert_golden(&w.grad().unwrap(), &g.f64s(&k("grad_weight")), dtype, &name);
                assert_golden(&b.grad().unwrap(), &g.f64s(&k("grad_bias")), dtype, &name);
            }
        }
    }

    /// layer_norm_linear against `linear(layer_norm(x))`: output and every gradient, with the input a
    /// leaf (a new gradient tensor) or produced by an op (its gradient written over the saved input).
    #[test]
    fn layer_norm_linear_matches_composed_ops() {
        let dev = Device::cpu();
        // Several blocks of rows, the last one partial; 70 features: two column blocks.
        let (rows, i, o) = (2 * LN_ROWS + 105, 70, 12);
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
            let leaf = |n, salt, scale: f64, shift: f64, shape: &[usize]| {
                let v: Vec<f64> = values(n, salt).iter().map(|v| v * scale + shift).collect();
                t64(&dev, &v, shape).to_dtype(dtype).unwrap().set_requires_grad(true)
            };
            let x = leaf(rows * i, 1, 3.0, 0.5, &[rows, i]);
            let (lw, lb) = (leaf(i, 2, 0.5, 1.0, &[i]), leaf(i, 3, 1.0, 0.0, &[i]));
            let (w, b) = (leaf(o * i, 4, 1.0, 0.0, &[o, i]), leaf(o, 5, 1.0, 0.0, &[o]));
            let g = t64(&dev, &values(rows * o, 6), &[rows, o]).to_dtype(dtype).unwrap();
            let leaves = [&x, &lw, &lb, &w, &b];
            for produced in [false, true] {
                let input = if produced { x.mul_scalar(1.0).unwrap() } else { x.clone() };
                let y = layer_norm_linear(&input, &lw, &lb, 1e-5, &w, Some(&b)).unwrap();
                drop(input);
                backward_with(&y, g.clone()).unwrap();
                let got: Vec<Vec<f64>> = leaves.iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                let h = layer_norm(&x, &[i], Some(&lw), Some(&lb), 1e-5).unwrap();
                let r = crate::ops::linear(&h, &w, Some(&b)).unwrap();
                assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), tol, "output");
                backward_with(&r, g.clone()).unwrap();
                for (k, t) in leaves.iter().enumerate() {
                    assert_close(&got[k], &t.take_grad().unwrap().to_f64_vec().unwrap(), tol, "gradient");
                }
            }
        }
        let x = t64(&dev, &[1.0; 6], &[2, 3]);
        let p = |n| t64(&dev, &vec![1.0; n], &[n]);
        let w = t64(&dev, &[1.0; 6], &[2, 3]);
        assert!(layer_norm_linear(&x, &p(3), &p(3), 1e-5, &w, Some(&p(2))).is_ok());
        assert!(layer_norm_linear(&x, &p(2), &p(3), 1e-5, &w, None).is_err(), "ln weight of the wrong size");
        assert!(layer_norm_linear(&x, &p(3), &p(3), 1e-5, &w, Some(&p(3))).is_err(), "bias of the wrong size");
    }

    #[test]
    fn layer_norm_linear_saves_its_input_and_statistics_only() {
        let dev = Device::cpu();
        let (rows, i, o) = (300, 64, 8);
        let leaf = |n, salt, shape: &[usize]| {
            Tensor::from_slice(&dev, &values(n, salt), shape, Category::Input).unwrap().set_requires_grad(true)
        };
        let (x, lw, lb, w) =
            (leaf(rows * i, 1, &[rows, i]), leaf(i, 2, &[i]), leaf(i, 3, &[i]), leaf(o * i, 4, &[o, i]));
        let h = x.mul_scalar(1.0).unwrap(); // a temporary of 300 x 64 f64 = 150 KiB
        let activation = || dev.stats().category(Category::Activation).current;
        let y = layer_norm_linear(&h, &lw, &lb, 1e-5, &w, None).unwrap();
        drop(h);
        assert_eq!(activation(), (rows * i * 8 + 2 * 2560) as u64, "x, mean and rstd [300] (in 512 B blocks)");
        let g = t64(&dev, &values(rows * o, 5), &[rows, o]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let allocs: Vec<(u64, &str)> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| (e.bytes, e.op))
            .collect();
        // ln weight and bias gradients, the weight gradient, a scratch of one block of rows and the f64
        // column sums; dx overwrites the saved input; then the affine's backward.
        let name = "layer_norm_linear_backward";
        let block = (rows.min(LN_ROWS) * i * 8) as u64;
        assert_eq!(allocs[..5], [(512, name), (512, name), (4096, name), (block, name), (1024, name)]);
        assert_eq!(allocs.len(), 6, "{allocs:?}");
        assert_eq!(a.stats().category(Category::Activation).current, 0);
    }

    #[test]
    fn layer_norm_linear_meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.1, DType::F32, Category::Input)?.set_requires_grad(true))
            };
            let (x, lw, lb, w, b) = (t(&[3, 100, 8])?, t(&[8])?, t(&[8])?, t(&[5, 8])?, t(&[5])?);
            // Leaf input (new gradient) and an intermediate one (gradient in place).
            let y = layer_norm_linear(&x, &lw, &lb, 1e-5, &w, Some(&b))?;
            backward(&y.sum_all()?)?;
            let y = layer_norm_linear(&x.mul_scalar(2.0)?, &lw, &lb, 1e-5, &w, None)?;
            backward(&y.sum_all()?)
        });
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let p = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.5, DType::F32, Category::Parameter)?.set_requires_grad(true))
            };
            let x = Tensor::full(dev, &[4, 3, 2, 2], 1.0, DType::F32, Category::Input)?;
            let rm = Tensor::zeros(dev, &[3], DType::F32, Category::Other)?;
            let rv = Tensor::full(dev, &[3], 1.0, DType::F32, Category::Other)?;
            let (w, b) = (p(&[3])?, p(&[3])?);
            let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), true, 0.1, 1e-5)?;
            let (lw, lb) = (p(&[2])?, p(&[2])?);
            let z = layer_norm(&y, &[2], Some(&lw), Some(&lb), 1e-5)?;
            backward(&z.sum_all()?)
        });
    }
}
