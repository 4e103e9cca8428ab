//! CPU kernels of the losses (`ops/loss.rs`): cross_entropy's fused log-sum-exp forward and its
//! softmax-recomputing backward, nll_loss and mse_loss. Sums over rows are taken in fixed blocks and
//! added in block order, so results do not depend on the thread count. Targets are checked against
//! the class count here, where their values are read.

use crate::dtype::Float;
use crate::error::{first_out_of_range, Error, Result};
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

/// Sum of `f(block)` over `blocks` blocks, computed in parallel when there are several, added in
/// block order (deterministic).
fn block_sum(blocks: usize, f: impl Fn(usize) -> f64 + Sync + Send) -> f64 {
    if blocks <= 1 {
        return (0..blocks).map(f).sum();
    }
    let partial: Vec<f64> = (0..blocks).into_par_iter().map(f).collect();
    partial.iter().sum()
}

/// Rows per block so that a block holds about `PAR_CHUNK` elements.
fn rows_per_block(row_len: usize) -> usize {
    (PAR_CHUNK / row_len.max(1)).max(1)
}

/// Errors naming the first target outside `0..classes`.
fn validate_targets(op: &str, target: &[i64], classes: usize) -> Result<()> {
    match first_out_of_range(target, classes) {
        Some(i) => Err(Error::invalid(format!(
            "{op}: target {} (sample {i}) is out of range for {classes} classes",
            target[i]
        ))),
        None => Ok(()),
    }
}

/// (max, ln(sum(exp(x - max)))) of a row.
fn row_lse<T: Float>(row: &[T]) -> (T, T) {
    let m = row.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
    let s: T = row.iter().map(|&v| (v - m).exp()).sum();
    (m, s.ln())
}

pub fn cross_entropy(
    logits: View<'_>,
    target: View<'_>,
    label_smoothing: f64,
    out: View<'_>,
    _gpu_workspace: Option<View<'_>>,
) -> Result<()> {
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    let t = target.slice::<i64>()?;
    validate_targets("cross_entropy", t, c)?;
    with_float!(logits.dtype(), "cross_entropy", T => {
        let x = logits.slice::<T>()?;
        let e = label_smoothing;
        let rows = rows_per_block(c);
        let total = block_sum(n.div_ceil(rows), |b| {
            let (r0, r1) = (b * rows, ((b + 1) * rows).min(n));
            let mut acc = 0.0f64;
            for i in r0..r1 {
                let row = &x[i * c..(i + 1) * c];
                let (m, ls) = row_lse(row);
                let lse = (m + ls).f64();
                // -log p[t] = lse - x[t]; sum_c -log p[c] = C lse - sum_c x[c].
                let nll = lse - row[t[i] as usize].f64();
                let mut l = (1.0 - e) * nll;
                if e != 0.0 {
                    let sx: f64 = row.iter().map(|v| v.f64()).sum();
                    l += e * (lse - sx / c as f64);
                }
                acc += l;
            }
            acc
        });
        out.slice_mut::<T>()?[0] = T::of(total / n as f64);
    });
    Ok(())
}

/// [`cross_entropy`] then [`cross_entropy_backward`] (one call for a GPU, which fuses them), and
/// with `bias_grad` the gradient's column sums into it ([`crate::reduce::sum_dim`]).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_with_grad(
    logits: View<'_>,
    target: View<'_>,
    label_smoothing: f64,
    out: View<'_>,
    gpu_workspace: Option<View<'_>>,
    grad: View<'_>,
    gx: View<'_>,
    bias_grad: Option<View<'_>>,
    predicted: Option<View<'_>>,
) -> Result<()> {
    if let Some(predicted) = predicted {
        let (n, c) = (logits.shape()[0], logits.shape()[1]);
        crate::reduce::argmax_rows(logits, n, c, predicted)?;
    }
    cross_entropy(logits, target, label_smoothing, out, gpu_workspace)?;
    cross_entropy_backward(logits, target, label_smoothing, grad, gx)?;
    match bias_grad {
        Some(gb) => crate::reduce::sum_dim(gx, 1, logits.shape()[0], logits.shape()[1], false, gb),
        None => Ok(()),
    }
}

pub fn cross_entropy_backward(
    logits: View<'_>,
    target: View<'_>,
    label_smoothing: f64,
    grad: View<'_>,
    gx: View<'_>,
) -> Result<()> {
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    with_float!(grad.dtype(), "cross_entropy_backward", T => {
        let g = grad.scalar::<T>()? / T::of(n as f64);
        let e = label_smoothing;
        let (on, off) = (T::of(1.0 - e), T::of(e / c as f64));
        let (x, t) = (logits.slice::<T>()?, target.slice::<i64>()?);
        let dst = gx.slice_mut::<T>()?;
        let rows = rows_per_block(c);
        let run = |(b, d): (usize, &mut [T])| {
            for (r, drow) in d.chunks_mut(c).enumerate() {
                let i = b * rows + r;
                let row = &x[i * c..(i + 1) * c];
                let (m, ls) = row_lse(row);
                for (dv, &v) in drow.iter_mut().zip(row) {
                    *dv = ((v - m - ls).exp() - off) * g;
                }
                drow[t[i] as usize] -= on * g;
            }
        };
        if n * c >= 2 * PAR_CHUNK {
            dst.par_chunks_mut(rows * c).enumerate().for_each(run);
        } else {
            dst.chunks_mut(rows * c).enumerate().for_each(run);
        }
    });
    Ok(())
}

pub fn nll_loss(log_probs: View<'_>, target: View<'_>, out: View<'_>) -> Result<()> {
    let (n, c) = (log_probs.shape()[0], log_probs.shape()[1]);
    let t = target.slice::<i64>()?;
    validate_targets("nll_loss", t, c)?;
    with_float!(log_probs.dtype(), "nll_loss", T => {
        // Strided reads: the input need not be contiguous (only N elements are touched).
        let l = log_probs.layout();
        let (s0, s1) = (l.strides()[0], l.strides()[1]);
        let base = &log_probs.storage::<T>()?[l.offset()..];
        let sum: f64 = t.iter().enumerate().map(|(i, &ti)| base[i * s0 + ti as usize * s1].f64()).sum();
        out.slice_mut::<T>()?[0] = T::of(-sum / n as f64);
    });
    Ok(())
}

pub fn nll_loss_backward(target: View<'_>, grad: View<'_>, gx: View<'_>) -> Result<()> {
    let (n, c) = (gx.shape()[0], gx.shape()[1]);
    with_float!(grad.dtype(), "nll_loss_backward", T => {
        let g = grad.scalar::<T>()? / T::of(n as f64);
        let dst = gx.slice_mut::<T>()?;
        for (i, &t) in target.slice::<i64>()?.iter().enumerate() {
            dst[i * c + t as usize] = -g;
        }
    });
    Ok(())
}

pub fn mse_loss(input: View<'_>, target: View<'_>, out: View<'_>) -> Result<()> {
    with_float!(input.dtype(), "mse_loss", T => {
        let (x, y) = (input.slice::<T>()?, target.slice::<T>()?);
        let len = x.len();
        let total = block_sum(len.div_ceil(PAR_CHUNK), |k| {
            let r = k * PAR_CHUNK..((k + 1) * PAR_CHUNK).min(len);
            x[r.clone()].iter().zip(&y[r]).map(|(&p, &q)| { let d = (p - q).f64(); d * d }).sum()
        });
        // Mean of nothing is NaN, as in PyTorch.
        out.slice_mut::<T>()?[0] = T::of(total / len as f64);
    });
    Ok(())
}

pub fn mse_loss_backward(
    input: View<'_>,
    target: View<'_>,
    grad: View<'_>,
    ga: Option<View<'_>>,
    gb: Option<View<'_>>,
) -> Result<()> {
    with_float!(grad.dtype(), "mse_loss_backward", T => {
        let scale = grad.scalar::<T>()? * T::of(2.0 / input.numel() as f64);
        let (x, y) = (input.slice::<T>()?, target.slice::<T>()?);
        if let Some(ga) = ga {
            super::elementwise::par_zip(x, y, ga.slice_mut::<T>()?, |p, q| (p - q) * scale);
        }
        if let Some(gb) = gb {
            super::elementwise::par_zip(x, y, gb.slice_mut::<T>()?, |p, q| (q - p) * scale);
        }
    });
    Ok(())
}
