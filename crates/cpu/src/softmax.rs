//! CPU kernels of softmax and log_softmax (`ops/softmax.rs`): the per-block max, exp and sum passes
//! over [outer, size, inner] and their backward, in parallel blocks for big tensors.

use crate::dtype::Float;
use crate::error::Result;
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

/// (outer, size, inner) of `shape` around `dim`; a 0-d tensor is one element.
pub fn split_dim(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    if shape.is_empty() {
        return (1, 1, 1);
    }
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

/// Runs `f(src_block, dst_block)` over consecutive blocks of `block` elements, several
/// blocks per rayon task when the tensor is big enough to be worth threads.
fn for_blocks<T: Float>(src: &[T], dst: &mut [T], block: usize, f: impl Fn(&[T], &mut [T]) + Sync) {
    if block == 0 || dst.is_empty() {
        return;
    }
    if dst.len() >= 2 * PAR_CHUNK && dst.len() > block {
        let per_task = block * (PAR_CHUNK / block).max(1);
        dst.par_chunks_mut(per_task).zip(src.par_chunks(per_task)).for_each(|(d, s)| {
            d.chunks_mut(block).zip(s.chunks(block)).for_each(|(d, s)| f(s, d));
        });
    } else {
        dst.chunks_mut(block).zip(src.chunks(block)).for_each(|(d, s)| f(s, d));
    }
}

/// Softmax (or log-softmax) of each lane `i` of a block laid out [size, inner].
pub fn softmax_block<T: Float>(s: &[T], d: &mut [T], size: usize, inner: usize, log: bool) {
    if inner == 1 {
        // The common case (last dim): plain slice passes.
        let m = s.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
        if log {
            let ls = s.iter().map(|&v| (v - m).exp()).sum::<T>().ln();
            d.iter_mut().zip(s).for_each(|(d, &v)| *d = v - m - ls);
        } else {
            let mut sum = T::zero();
            for (d, &v) in d.iter_mut().zip(s) {
                *d = (v - m).exp();
                sum += *d;
            }
            d.iter_mut().for_each(|d| *d = *d / sum);
        }
        return;
    }
    for i in 0..inner {
        let mut m = T::neg_infinity();
        for k in 0..size {
            m = m.max(s[k * inner + i]);
        }
        let mut sum = T::zero();
        for k in 0..size {
            let e = (s[k * inner + i] - m).exp();
            if !log {
                d[k * inner + i] = e;
            }
            sum += e;
        }
        if log {
            let ls = sum.ln();
            for k in 0..size {
                d[k * inner + i] = s[k * inner + i] - m - ls;
            }
        } else {
            for k in 0..size {
                d[k * inner + i] = d[k * inner + i] / sum;
            }
        }
    }
}

/// Input gradient of a block from the saved output `y` and the upstream gradient `g`.
fn softmax_backward_block<T: Float>(y: &[T], g: &[T], d: &mut [T], size: usize, inner: usize, log: bool) {
    for i in 0..inner {
        if log {
            // d x = g - exp(y) * sum(g)
            let mut sg = T::zero();
            for k in 0..size {
                sg += g[k * inner + i];
            }
            for k in 0..size {
                let j = k * inner + i;
                d[j] = g[j] - y[j].exp() * sg;
            }
        } else {
            // d x = y * (g - sum(g * y))
            let mut dot = T::zero();
            for k in 0..size {
                dot += g[k * inner + i] * y[k * inner + i];
            }
            for k in 0..size {
                let j = k * inner + i;
                d[j] = y[j] * (g[j] - dot);
            }
        }
    }
}

fn name(log: bool) -> &'static str {
    if log {
        "log_softmax"
    } else {
        "softmax"
    }
}

pub fn softmax(x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
    let (_, size, inner) = split_dim(x.shape(), dim);
    with_float!(x.dtype(), name(log), T => {
        let src = x.slice::<T>()?;
        for_blocks(src, out.slice_mut::<T>()?, size * inner, |s, o| softmax_block(s, o, size, inner, log));
    });
    Ok(())
}

pub fn softmax_backward(out: View<'_>, grad: View<'_>, dim: usize, log: bool, gx: View<'_>) -> Result<()> {
    let name = if log { "log_softmax_backward" } else { "softmax_backward" };
    let (_, size, inner) = split_dim(out.shape(), dim);
    let block = size * inner;
    with_float!(grad.dtype(), name, T => {
        let (y, g) = (out.slice::<T>()?, grad.slice::<T>()?);
        let dst = gx.slice_mut::<T>()?;
        if block > 0 && !dst.is_empty() {
            let run = |(d, (y, g)): (&mut [T], (&[T], &[T]))| {
                d.chunks_mut(block).zip(y.chunks(block).zip(g.chunks(block)))
                    .for_each(|(d, (y, g))| softmax_backward_block(y, g, d, size, inner, log));
            };
            let per_task = block * (PAR_CHUNK / block).max(1);
            if dst.len() >= 2 * PAR_CHUNK && dst.len() > block {
                dst.par_chunks_mut(per_task).zip(y.par_chunks(per_task).zip(g.par_chunks(per_task))).for_each(run);
            } else {
                run((dst, (y, g)));
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::layout::Layout;

    /// A dtype the kernels do not compute in is refused naming the op, softmax or log-softmax.
    #[test]
    fn an_integer_tensor_is_refused_by_name() {
        let layout = Layout::contiguous(&[2, 3]);
        let (mut x, mut out) = ([0i64; 6], [0i64; 6]);
        // SAFETY: each array outlives its view, is aligned for i64 and holds the layout's elements.
        let (x, out) = unsafe {
            (
                View::new(x.as_mut_ptr() as *mut u8, 48, DType::I64, &layout),
                View::new(out.as_mut_ptr() as *mut u8, 48, DType::I64, &layout),
            )
        };
        for (log, name) in [(false, "softmax supports"), (true, "log_softmax supports")] {
            match softmax(x, 1, log, out) {
                Err(crate::Error::DType(m)) => assert!(m.starts_with(name) && m.contains("i64"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}
