//! CPU kernels of the reductions (`ops/reduce.rs`): sum/mean over one dim (rows and blocks of
//! columns in parallel for large inputs), max over one dim or all elements, their backwards, and
//! `sum_to_shape`.

use crate::dtype::Float;
use crate::error::Result;
use crate::layout::{broadcast_layout, for_each_offset_pair};
use crate::view::View;
use crate::with_float;
use memfit_kernels::{multiversion, Isa};
use rayon::prelude::*;

/// `out += x` summed down to `out`'s shape (which `x`'s is a broadcast of); `out` is zeroed.
pub fn sum_to_shape(x: View<'_>, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), "sum_to_shape", T => {
        let src = x.storage::<T>()?;
        let dst = out.slice_mut::<T>()?;
        let target = broadcast_layout(out.layout(), x.shape());
        for_each_offset_pair(x.layout(), &target, |os, od| dst[od] += src[os]);
    });
    Ok(())
}

fn sum_dim_kernel<T: Float>(src: &[T], dst: &mut [T], outer: usize, size: usize, inner: usize, scale: T) {
    if inner == 0 {
        return;
    }
    let isa = Isa::active();
    // Each output row in blocks of columns, each column summed in k order whatever the split.
    let row = |(o, d): (usize, &mut [T])| {
        let block = |(c, d): (usize, &mut [T])| {
            let from = o * size * inner + c * SUM_COLS;
            let span = if size == 0 { 0 } else { (size - 1) * inner + d.len() };
            column_sums(isa, d, &src[from..from + span], size, inner, scale)
        };
        if size * inner >= 1 << 16 {
            d.par_chunks_mut(SUM_COLS).enumerate().for_each(block);
        } else {
            d.chunks_mut(SUM_COLS).enumerate().for_each(block);
        }
    };
    if outer * size * inner >= 1 << 16 {
        dst.par_chunks_mut(inner).enumerate().for_each(row);
    } else {
        dst.chunks_mut(inner).enumerate().for_each(row);
    }
}

/// Columns per task of [`sum_dim_kernel`]: a bias gradient (one output row, `size` = the batch's
/// rows) still splits over the threads.
const SUM_COLS: usize = 64;

multiversion! {
    /// `d[i] = scale * sum_k src[k * stride + i]` over `k` in `0..size`, in k order.
    fn column_sums<T: Float>(d: &mut [T], src: &[T], size: usize, stride: usize, scale: T) {
        d.fill(T::zero());
        for k in 0..size {
            let s = &src[k * stride..k * stride + d.len()];
            d.iter_mut().zip(s).for_each(|(d, &s)| *d += s);
        }
        d.iter_mut().for_each(|d| *d *= scale);
    }
}

/// `out[o, i] = scale * sum_k x[o, k, i]` for x contiguous `[outer, size, inner]`; the scale is
/// `1/size` for a mean, else 1.
pub fn sum_dim(x: View<'_>, outer: usize, size: usize, inner: usize, mean: bool, out: View<'_>) -> Result<()> {
    let name = if mean { "mean" } else { "sum" };
    let scale = if mean { 1.0 / size as f64 } else { 1.0 };
    with_float!(x.dtype(), name, T => sum_dim_kernel(x.slice::<T>()?, out.slice_mut::<T>()?, outer, size, inner, T::of(scale)));
    Ok(())
}

/// `out = grad * scale` where `grad` is the upstream gradient expanded to `out`'s shape.
pub fn sum_backward(grad: View<'_>, scale: f64, out: View<'_>) -> Result<()> {
    grad.copy_into_bytes(out.bytes_mut()?)?;
    if scale != 1.0 {
        with_float!(out.dtype(), "sum_backward", T => {
            let s = T::of(scale);
            out.slice_mut::<T>()?.iter_mut().for_each(|v| *v *= s);
        });
    }
    Ok(())
}

/// Max over the middle dim of x contiguous `[outer, size, inner]`: `values` and int64 `indices`
/// (first index among ties; a NaN wins and stays).
pub fn max_dim(
    x: View<'_>,
    outer: usize,
    size: usize,
    inner: usize,
    values: View<'_>,
    indices: View<'_>,
) -> Result<()> {
    // Nothing to take a max of (the op refuses an empty dim; a head of no classes asks for none).
    if size == 0 {
        return Ok(());
    }
    with_float!(x.dtype(), "max", T => {
        let src = x.slice::<T>()?;
        let (v, ix) = (values.slice_mut::<T>()?, indices.slice_mut::<i64>()?);
        for o in 0..outer {
            for i in 0..inner {
                let (best_v, best) = largest((0..size).map(|k| src[(o * size + k) * inner + i]));
                v[o * inner + i] = best_v;
                ix[o * inner + i] = best as i64;
            }
        }
    });
    Ok(())
}

/// The largest of `values` (at least one: the callers return before an empty dim) and its first
/// index; NaN propagates like PyTorch: a NaN wins and stays.
fn largest<T: num_traits::Float>(mut values: impl Iterator<Item = T>) -> (T, usize) {
    let mut best_v = values.next().expect("a value");
    let mut best = 0;
    for (k, val) in values.enumerate() {
        if val > best_v || (val.is_nan() && !best_v.is_nan()) {
            best = k + 1;
            best_v = val;
        }
    }
    (best_v, best)
}

/// Each row's index of [`max_dim`] over the `cols` values of contiguous `[rows, cols]` x, into
/// the int64 `indices` (cross-entropy's head reads its classes so, beside its loss).
pub fn argmax_rows(x: View<'_>, rows: usize, cols: usize, indices: View<'_>) -> Result<()> {
    if cols == 0 {
        return Ok(());
    }
    with_float!(x.dtype(), "max", T => {
        let src = x.slice::<T>()?;
        let ix = indices.slice_mut::<i64>()?;
        for (r, out) in ix.iter_mut().enumerate().take(rows) {
            *out = largest(src[r * cols..(r + 1) * cols].iter().copied()).1 as i64;
        }
    });
    Ok(())
}

/// `out[o, indices[o, i], i] += grad[o, i]` into the zeroed `out` `[outer, size, inner]`.
pub fn max_dim_backward(
    grad: View<'_>,
    indices: View<'_>,
    outer: usize,
    size: usize,
    inner: usize,
    out: View<'_>,
) -> Result<()> {
    with_float!(grad.dtype(), "max_backward", T => {
        let (g, ix, dst) = (grad.slice::<T>()?, indices.slice::<i64>()?, out.slice_mut::<T>()?);
        for o in 0..outer {
            for i in 0..inner {
                let k = ix[o * inner + i] as usize;
                dst[(o * size + k) * inner + i] += g[o * inner + i];
            }
        }
    });
    Ok(())
}

/// `out[0]` = the max of all elements of x (contiguous, not empty); a NaN wins.
pub fn max_all(x: View<'_>, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), "max", T => {
        let m = x.slice::<T>()?.iter().copied().fold(<T as num_traits::Float>::neg_infinity(), |a, b| if b > a || b.is_nan() { b } else { a });
        out.slice_mut::<T>()?[0] = m;
    });
    Ok(())
}

/// The gradient of `max_all`: the 0-d `grad` split evenly among the elements of `x` equal to the
/// maximum `max`, into the zeroed `out`.
pub fn max_all_backward(x: View<'_>, max: View<'_>, grad: View<'_>, out: View<'_>) -> Result<()> {
    with_float!(grad.dtype(), "max_backward", T => {
        let (x, m, g) = (x.slice::<T>()?, max.slice::<T>()?[0], grad.scalar::<T>()?);
        let ties = x.iter().filter(|&&v| v == m).count().max(1);
        let share = g / T::of(ties as f64);
        for (d, &v) in out.slice_mut::<T>()?.iter_mut().zip(x) {
            if v == m {
                *d = share;
            }
        }
    });
    Ok(())
}

/// How many elements of the int64 `a` and `b` are equal, into the int64 0-d `out`.
pub fn count_equal(a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
    let equal = a.slice::<i64>()?.iter().zip(b.slice::<i64>()?).filter(|(a, b)| a == b).count();
    out.slice_mut::<i64>()?[0] = equal as i64;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums over the middle dim equal the plain k-order sum bit for bit, however the rows and columns
    /// are shared out (a bias gradient's one long row split into column blocks, several rows, small
    /// inputs run serially, an empty middle dim), and every level's column sums equal the portable
    /// one's.
    #[test]
    fn sums_over_a_dim_are_the_k_order_sums_on_every_split_and_level() {
        for (outer, size, inner) in [(1, 4096, 200), (3, 70, 300), (2, 5, 7), (2, 0, 5), (4, 3, 0), (1, 1, 130)] {
            let src: Vec<f32> = (0..outer * size * inner).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
            for scale in [1.0f32, 0.25] {
                let mut dst = vec![f32::NAN; outer * inner];
                sum_dim_kernel(&src, &mut dst, outer, size, inner, scale);
                for o in 0..outer {
                    for i in 0..inner {
                        let mut want = 0.0f32;
                        for k in 0..size {
                            want += src[(o * size + k) * inner + i];
                        }
                        assert_eq!(
                            dst[o * inner + i].to_bits(),
                            (want * scale).to_bits(),
                            "{outer}x{size}x{inner} [{o}, {i}]"
                        );
                    }
                }
            }
        }
        let src: Vec<f64> = (0..37 * 101).map(|i| (i as f64).sin()).collect();
        let run = |isa: Isa| {
            let mut d = vec![0.0f64; 101 - 3];
            column_sums(isa, &mut d, &src[3..], 37, 101, 0.5);
            d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let want = run(Isa::Portable);
        for isa in Isa::supported() {
            assert_eq!(run(isa), want, "{isa}");
        }
    }
}
