//! Reductions: sum, mean and max over one dim or all elements, and `sum_to_shape` (the gradient of
//! broadcasting).

use super::{output, zeros_output};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::layout::{broadcast_layout, for_each_offset_pair, resolve_dim};
use crate::backend::cpu::elementwise::typed_storage;
use crate::tensor::Tensor;
use crate::with_float;
use rayon::prelude::*;

/// (outer, size, inner) of `shape` around `dim`.
fn split_at_dim(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

fn reduced_shape(shape: &[usize], dim: usize, keepdim: bool) -> Vec<usize> {
    let mut s = shape.to_vec();
    if keepdim {
        s[dim] = 1;
    } else {
        s.remove(dim);
    }
    s
}

/// Sums `x` down to `shape`, which `x`'s shape is a broadcast of.
pub fn sum_to_shape(x: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if x.shape() == shape {
        return Ok(x.clone());
    }
    let out = zeros_output(x, shape, x.dtype(), "sum_to_shape")?;
    if x.device().computes() {
        with_float!(x.dtype(), "sum_to_shape", T => {
            let src = typed_storage::<T>(x)?;
            let dst = out.slice_mut::<T>()?;
            let target = broadcast_layout(out.layout(), x.shape());
            for_each_offset_pair(x.layout(), &target, |os, od| dst[od] += src[os]);
        });
    }
    Ok(out)
}

fn sum_dim_kernel<T: Float>(src: &[T], dst: &mut [T], outer: usize, size: usize, inner: usize, scale: T) {
    let row = |(o, d): (usize, &mut [T])| {
        d.fill(T::zero());
        let base = o * size * inner;
        for k in 0..size {
            let s = &src[base + k * inner..base + (k + 1) * inner];
            d.iter_mut().zip(s).for_each(|(d, &s)| *d += s);
        }
        d.iter_mut().for_each(|d| *d *= scale);
    };
    if inner == 0 {
        return;
    }
    if outer * size * inner >= 1 << 16 {
        dst.par_chunks_mut(inner).enumerate().for_each(row);
    } else {
        dst.chunks_mut(inner).enumerate().for_each(row);
    }
}

impl Tensor {
    /// Sum over `dim`.
    pub fn sum_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let _op = self.device().op_scope("sum");
        reduce_dim(self, dim, keepdim, false)
    }

    /// Mean over `dim`.
    pub fn mean_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let _op = self.device().op_scope("mean");
        reduce_dim(self, dim, keepdim, true)
    }

    /// Sum of all elements (0-d).
    pub fn sum_all(&self) -> Result<Tensor> {
        self.reshape(&[-1])?.sum_dim(0, false)
    }

    /// Mean of all elements (0-d).
    pub fn mean_all(&self) -> Result<Tensor> {
        self.reshape(&[-1])?.mean_dim(0, false)
    }

    /// Max over `dim`: values and int64 indices (first index among ties; the gradient goes there only).
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let _op = self.device().op_scope("max");
        let x = self.contiguous()?;
        let d = resolve_dim(dim, x.rank())?;
        let (outer, size, inner) = split_at_dim(x.shape(), d);
        if size == 0 {
            return Err(Error::shape("max over an empty dim"));
        }
        let shape = reduced_shape(x.shape(), d, keepdim);
        let values = output(&x, &shape, x.dtype(), "max")?;
        let indices = output(&x, &shape, DType::I64, "max")?;
        if x.device().computes() {
            with_float!(x.dtype(), "max", T => {
                let src = x.slice::<T>()?;
                let (v, ix) = (values.slice_mut::<T>()?, indices.slice_mut::<i64>()?);
                for o in 0..outer {
                    for i in 0..inner {
                        let mut best = 0;
                        let mut best_v = src[o * size * inner + i];
                        for k in 1..size {
                            let val = src[(o * size + k) * inner + i];
                            // NaN propagates like PyTorch: a NaN wins and stays.
                            if val > best_v || (val.is_nan() && !best_v.is_nan()) {
                                best = k;
                                best_v = val;
                            }
                        }
                        v[o * inner + i] = best_v;
                        ix[o * inner + i] = best as i64;
                    }
                }
            });
        }
        let values = if needs_grad(&[&x]) {
            let back = MaxDimBack { shape: x.shape().to_vec(), dim: d, indices: save(&indices) };
            record(values, "max", &[&x], back)
        } else {
            values
        };
        Ok((values, indices))
    }

    /// Max of all elements (0-d); the gradient splits evenly among tied maxima.
    pub fn max_all(&self) -> Result<Tensor> {
        let x = self.contiguous()?;
        if x.numel() == 0 {
            return Err(Error::shape("max of an empty tensor"));
        }
        let out = output(&x, &[], x.dtype(), "max")?;
        if x.device().computes() {
            with_float!(x.dtype(), "max", T => {
                let m = x.slice::<T>()?.iter().copied().fold(<T as num_traits::Float>::neg_infinity(), |a, b| if b > a || b.is_nan() { b } else { a });
                out.slice_mut::<T>()?[0] = m;
            });
        }
        Ok(if needs_grad(&[&x]) {
            let back = MaxAllBack { input: save(&x), out: save(&out) };
            record(out, "max", &[&x], back)
        } else {
            out
        })
    }
}

fn reduce_dim(x: &Tensor, dim: isize, keepdim: bool, mean: bool) -> Result<Tensor> {
    let x = x.contiguous()?;
    let d = resolve_dim(dim, x.rank())?;
    let (outer, size, inner) = split_at_dim(x.shape(), d);
    let shape = reduced_shape(x.shape(), d, keepdim);
    let name = if mean { "mean" } else { "sum" };
    let out = output(&x, &shape, x.dtype(), name)?;
    let scale = if mean { 1.0 / size as f64 } else { 1.0 };
    if x.device().computes() {
        with_float!(x.dtype(), name, T => sum_dim_kernel(x.slice::<T>()?, out.slice_mut::<T>()?, outer, size, inner, T::of(scale)));
    }
    Ok(if needs_grad(&[&x]) {
        record(out, name, &[&x], SumBack { shape: x.shape().to_vec(), dim: d, scale })
    } else {
        out
    })
}

struct SumBack {
    shape: Vec<usize>,
    dim: usize,
    scale: f64,
}

impl Backward for SumBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let mut kept = self.shape.clone();
        kept[self.dim] = 1;
        let kept: Vec<isize> = kept.iter().map(|&d| d as isize).collect();
        let g = grad.reshape(&kept)?.expand(&self.shape)?;
        let full = output(&grad, &self.shape, grad.dtype(), "sum_backward")?;
        if grad.device().computes() {
            g.copy_into_bytes(full.bytes_mut()?)?;
            if self.scale != 1.0 {
                with_float!(full.dtype(), "sum_backward", T => {
                    let s = T::of(self.scale);
                    full.slice_mut::<T>()?.iter_mut().for_each(|v| *v *= s);
                });
            }
        }
        Ok(vec![Some(full)])
    }
}

struct MaxDimBack {
    shape: Vec<usize>,
    dim: usize,
    indices: Tensor,
}

impl Backward for MaxDimBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let out = zeros_output(&grad, &self.shape, grad.dtype(), "max_backward")?;
        if grad.device().computes() {
            let (outer, size, inner) = split_at_dim(&self.shape, self.dim);
            with_float!(grad.dtype(), "max_backward", T => {
                let (g, ix, dst) = (grad.slice::<T>()?, self.indices.slice::<i64>()?, out.slice_mut::<T>()?);
                for o in 0..outer {
                    for i in 0..inner {
                        let k = ix[o * inner + i] as usize;
                        dst[(o * size + k) * inner + i] += g[o * inner + i];
                    }
                }
            });
        }
        Ok(vec![Some(out)])
    }
}

struct MaxAllBack {
    input: Tensor,
    out: Tensor,
}

impl Backward for MaxAllBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let out = zeros_output(&grad, self.input.shape(), grad.dtype(), "max_backward")?;
        if grad.device().computes() {
            with_float!(grad.dtype(), "max_backward", T => {
                let (x, m, g) = (self.input.slice::<T>()?, self.out.slice::<T>()?[0], grad.to_vec::<T>()?[0]);
                let ties = x.iter().filter(|&&v| v == m).count().max(1);
                let share = g / T::of(ties as f64);
                for (d, &v) in out.slice_mut::<T>()?.iter_mut().zip(x) {
                    if v == m {
                        *d = share;
                    }
                }
            });
        }
        Ok(vec![Some(out)])
    }
}
