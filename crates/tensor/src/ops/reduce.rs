//! Reductions: sum, mean and max over one dim or all elements, and `sum_to_shape` (the gradient of
//! broadcasting): shapes, outputs and autograd. The kernels are the backend's
//! (`memfit-cpu`'s `reduce.rs`).

use super::{output, zeros_output};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::resolve_dim;
use crate::tensor::Tensor;

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
    x.device().backend().sum_to_shape(x, &out)?;
    Ok(out)
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

    /// How many elements equal `other`'s (int64 tensors of one shape; no graph): an int64 0-d tensor,
    /// counted on the device, so a GPU's predictions are scored without reading them back.
    pub fn count_equal(&self, other: &Tensor) -> Result<Tensor> {
        let _op = self.device().op_scope("count_equal");
        super::check_same("count_equal", &[self, other])?;
        if self.dtype() != DType::I64 || self.shape() != other.shape() {
            return Err(Error::shape(format!(
                "count_equal needs int64 tensors of one shape, not {:?} {} and {:?} {}",
                self.shape(),
                self.dtype(),
                other.shape(),
                other.dtype()
            )));
        }
        let (a, b) = (self.contiguous()?, other.contiguous()?);
        let out = super::output_any(&a, &[], DType::I64, "count_equal")?;
        a.device().backend().count_equal(&a, &b, &out)?;
        Ok(out)
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
        let indices = super::output_any(&x, &shape, DType::I64, "max")?;
        x.device().backend().max_dim(&x, outer, size, inner, &values, &indices)?;
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
        x.device().backend().max_all(&x, &out)?;
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
    x.device().backend().sum_dim(&x, outer, size, inner, mean, &out)?;
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
        grad.device().backend().sum_backward(&g, self.scale, &full)?;
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
        let (outer, size, inner) = split_at_dim(&self.shape, self.dim);
        grad.device().backend().max_dim_backward(&grad, &self.indices, outer, size, inner, &out)?;
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
        grad.device().backend().max_all_backward(&self.input, &self.out, &grad, &out)?;
        Ok(vec![Some(out)])
    }
}
