//! Views (reshape, permute, transpose, narrow, expand, squeeze/unsqueeze, flatten) and contiguous copies.
//! A view shares storage; its backward maps the gradient back to the input's shape. The copies and
//! accumulations are the backend's data-movement and element-wise kernels (`copy`, `add_into`).

use super::output_any;
use crate::autograd::{needs_grad, record, Backward};
use crate::error::{Error, Result};
use crate::layout::{checked_numel, contiguous_strides, resolve_dim, Layout};
use crate::tensor::Tensor;

impl Tensor {
    /// A row-major copy of any layout (no autograd; used by kernels and the engine).
    pub(crate) fn contiguous_copy(&self) -> Result<Tensor> {
        let out = output_any(self, self.shape(), self.dtype(), "contiguous")?;
        self.device().backend().copy(&out, self)?;
        Ok(out)
    }

    /// This tensor if contiguous, else a contiguous copy (differentiable).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = self.contiguous_copy()?;
        Ok(if needs_grad(&[self]) { record(out, "contiguous", &[self], Identity) } else { out })
    }

    /// [`Tensor::contiguous`] of a handle the caller gives up: a contiguous tensor comes back as the
    /// same handle (no clone), so [`Tensor::owns_storage`] still sees it unshared.
    pub(crate) fn into_contiguous(self) -> Result<Tensor> {
        if self.is_contiguous() {
            Ok(self)
        } else {
            self.contiguous()
        }
    }

    /// Same data, new shape (one dim may be -1). A view when contiguous, else a copy.
    pub fn reshape(&self, shape: &[isize]) -> Result<Tensor> {
        let numel = self.numel();
        let mut out_shape = Vec::with_capacity(shape.len());
        let mut infer = None;
        for (i, &d) in shape.iter().enumerate() {
            if d == -1 {
                if infer.replace(i).is_some() {
                    return Err(Error::shape("reshape: only one dim can be -1"));
                }
                out_shape.push(1);
            } else if d < 0 {
                return Err(Error::shape(format!("reshape: invalid dim {d}")));
            } else {
                out_shape.push(d as usize);
            }
        }
        let known = checked_numel(&out_shape)?;
        if let Some(i) = infer {
            if known == 0 || numel % known != 0 {
                return Err(Error::shape(format!("reshape: cannot reshape {:?} into {shape:?}", self.shape())));
            }
            out_shape[i] = numel / known;
        }
        if checked_numel(&out_shape)? != numel {
            return Err(Error::shape(format!("reshape: cannot reshape {:?} into {shape:?}", self.shape())));
        }
        let src = self.contiguous()?;
        let view =
            src.with_layout(Layout::new(out_shape.clone(), contiguous_strides(&out_shape), src.layout().offset()));
        Ok(if needs_grad(&[&src]) {
            record(view, "reshape", &[&src], ReshapeBack { shape: src.shape().to_vec() })
        } else {
            view
        })
    }

    /// Flattens dims `start..` into one (PyTorch's `flatten(start)`).
    pub fn flatten_from(&self, start: usize) -> Result<Tensor> {
        let mut shape: Vec<isize> = self.shape()[..start].iter().map(|&d| d as isize).collect();
        shape.push(-1);
        self.reshape(&shape)
    }

    /// Reorders dims.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if dims.len() != rank || dims.iter().any(|&d| d >= rank || std::mem::replace(&mut seen[d], true)) {
            return Err(Error::shape(format!("permute: {dims:?} is not a permutation of {rank} dims")));
        }
        let l = self.layout();
        let shape = dims.iter().map(|&d| l.shape()[d]).collect();
        let strides = dims.iter().map(|&d| l.strides()[d]).collect();
        let view = self.with_layout(Layout::new(shape, strides, l.offset()));
        if needs_grad(&[self]) {
            let mut inverse = vec![0; rank];
            for (i, &d) in dims.iter().enumerate() {
                inverse[d] = i;
            }
            Ok(record(view, "permute", &[self], PermuteBack { inverse }))
        } else {
            Ok(view)
        }
    }

    /// Swaps two dims.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let (a, b) = (resolve_dim(a, self.rank())?, resolve_dim(b, self.rank())?);
        let mut dims: Vec<usize> = (0..self.rank()).collect();
        dims.swap(a, b);
        self.permute(&dims)
    }

    /// Elements `start..start+len` of `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = resolve_dim(dim, self.rank())?;
        let size = self.shape()[d];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::shape(format!("narrow: {start} + {len} elements out of range for size {size}")));
        }
        let l = self.layout();
        let mut shape = l.shape().to_vec();
        shape[d] = len;
        let view = self.with_layout(Layout::new(shape, l.strides().to_vec(), l.offset() + start * l.strides()[d]));
        Ok(if needs_grad(&[self]) {
            record(view, "narrow", &[self], NarrowBack { shape: self.shape().to_vec(), dim: d, start })
        } else {
            view
        })
    }

    /// Broadcasts to `shape` without copying (size-1 dims get stride 0).
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let l = self.layout();
        if shape.len() < l.rank() {
            return Err(Error::shape(format!("expand: cannot expand {:?} to {shape:?}", l.shape())));
        }
        let lead = shape.len() - l.rank();
        let mut strides = vec![0; shape.len()];
        for (i, &target) in shape.iter().enumerate() {
            if i < lead {
                continue;
            }
            let (dim, stride) = (l.shape()[i - lead], l.strides()[i - lead]);
            if dim == target {
                strides[i] = stride;
            } else if dim != 1 {
                return Err(Error::shape(format!("expand: cannot expand {:?} to {shape:?}", l.shape())));
            }
        }
        if shape == l.shape() {
            return Ok(self.clone());
        }
        checked_numel(shape)?;
        let view = self.with_layout(Layout::new(shape.to_vec(), strides, l.offset()));
        Ok(if needs_grad(&[self]) {
            record(view, "expand", &[self], ExpandBack { shape: self.shape().to_vec() })
        } else {
            view
        })
    }

    /// Inserts a size-1 dim at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.rank() {
            return Err(Error::shape(format!("unsqueeze: dim {dim} out of range for rank {}", self.rank())));
        }
        let mut shape: Vec<isize> = self.shape().iter().map(|&d| d as isize).collect();
        shape.insert(dim, 1);
        self.reshape(&shape)
    }

    /// Removes a size-1 dim.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim(dim, self.rank())?;
        if self.shape()[d] != 1 {
            return Err(Error::shape(format!("squeeze: dim {d} has size {}", self.shape()[d])));
        }
        let mut shape: Vec<isize> = self.shape().iter().map(|&d| d as isize).collect();
        shape.remove(d);
        self.reshape(&shape)
    }
}

struct Identity;
impl Backward for Identity {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad)])
    }
}

struct ReshapeBack {
    shape: Vec<usize>,
}
impl Backward for ReshapeBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let shape: Vec<isize> = self.shape.iter().map(|&d| d as isize).collect();
        Ok(vec![Some(grad.reshape(&shape)?)])
    }
}

struct PermuteBack {
    inverse: Vec<usize>,
}
impl Backward for PermuteBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad.permute(&self.inverse)?)])
    }
}

struct NarrowBack {
    shape: Vec<usize>,
    dim: usize,
    start: usize,
}
impl Backward for NarrowBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let full = super::zeros_output(&grad, &self.shape, grad.dtype(), "narrow_backward")?;
        // A view of the zeros (no allocation, on any device) takes the gradient.
        let window = full.narrow(self.dim as isize, self.start, grad.shape()[self.dim])?;
        super::add_into(&window, &grad)?;
        Ok(vec![Some(full)])
    }
}

struct ExpandBack {
    shape: Vec<usize>,
}
impl Backward for ExpandBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(super::sum_to_shape(&grad, &self.shape)?)])
    }
}
