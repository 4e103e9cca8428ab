//! Views (reshape, permute, transpose, narrow and stepped slices, expand, squeeze/unsqueeze, flatten),
//! contiguous copies, concatenation, rolls and constant padding. A view shares storage; its backward maps the gradient back to
//! the input's shape. The copies and accumulations are the backend's data-movement and element-wise
//! kernels (`copy`, `add_into`).

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
        self.stepped(d, start, len, 1)
    }

    /// Elements `start, start + step, ...` below `end` of `dim` (PyTorch's `x[start:end:step]`; `end`
    /// past the size means to the end, as Python's slices do). A view.
    pub fn slice_step(&self, dim: isize, start: usize, end: usize, step: usize) -> Result<Tensor> {
        let d = resolve_dim(dim, self.rank())?;
        if step == 0 {
            return Err(Error::shape("slice: step must be positive"));
        }
        let (start, end) = (start.min(self.shape()[d]), end.min(self.shape()[d]));
        self.stepped(d, start, end.saturating_sub(start).div_ceil(step), step)
    }

    /// `len` elements of `dim` from `start`, `step` apart (checked by the callers to lie inside).
    fn stepped(&self, d: usize, start: usize, len: usize, step: usize) -> Result<Tensor> {
        let l = self.layout();
        let mut shape = l.shape().to_vec();
        shape[d] = len;
        let mut strides = l.strides().to_vec();
        strides[d] *= step;
        let view = self.with_layout(Layout::new(shape, strides, l.offset() + start * l.strides()[d]));
        Ok(if needs_grad(&[self]) {
            record(view, "narrow", &[self], NarrowBack { shape: self.shape().to_vec(), dim: d, start, step })
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
    step: usize,
}
impl Backward for NarrowBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let full = super::zeros_output(&grad, &self.shape, grad.dtype(), "narrow_backward")?;
        // A view of the zeros (no allocation, on any device) takes the gradient.
        let window = full.stepped(self.dim, self.start, grad.shape()[self.dim], self.step)?;
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

/// `tensors` joined along `dim` (PyTorch's `torch.cat`): the same shape but for `dim`, which adds up.
/// The output is zeroed and each piece added into its window (the backend's strided `add_into`); the
/// gradient of each piece is its window of the output's gradient, a view.
pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
    let [first, ..] = tensors else {
        return Err(Error::shape("cat: no tensors to join"));
    };
    let refs: Vec<&Tensor> = tensors.iter().collect();
    super::check_same("cat", &refs)?;
    let d = resolve_dim(dim, first.rank())?;
    let mut shape = first.shape().to_vec();
    shape[d] = 0;
    for t in tensors {
        let same_rest = t.rank() == first.rank()
            && t.shape().iter().zip(first.shape()).enumerate().all(|(i, (a, b))| i == d || a == b);
        if !same_rest {
            return Err(Error::shape(format!("cat: {:?} and {:?} differ outside dim {d}", first.shape(), t.shape())));
        }
        shape[d] += t.shape()[d];
    }
    checked_numel(&shape)?;
    let _op = first.device().op_scope("cat");
    let out = super::zeros_output(first, &shape, first.dtype(), "cat")?;
    let mut start = 0;
    for t in tensors {
        let len = t.shape()[d];
        super::add_into(&out.stepped(d, start, len, 1)?, t)?;
        start += len;
    }
    Ok(if needs_grad(&refs) {
        record(out, "cat", &refs, CatBack { dim: d, sizes: tensors.iter().map(|t| t.shape()[d]).collect() })
    } else {
        out
    })
}

/// `x` shifted cyclically by `shift` along `dim` (PyTorch's `torch.roll` of one dimension): the last
/// `shift` elements come first. A join of two windows, so its gradient is theirs.
pub fn roll(x: &Tensor, shift: i64, dim: isize) -> Result<Tensor> {
    let d = resolve_dim(dim, x.rank())?;
    let n = x.shape()[d];
    let s = if n == 0 { 0 } else { shift.rem_euclid(n as i64) as usize };
    if s == 0 {
        return Ok(x.clone());
    }
    cat(&[x.narrow(d as isize, n - s, s)?, x.narrow(d as isize, 0, n - s)?], d as isize)
}

/// `tensors` joined along a new dimension `dim` (PyTorch's `torch.stack`).
pub fn stack(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    let unsqueezed = tensors.iter().map(|t| t.unsqueeze(dim)).collect::<Result<Vec<_>>>()?;
    cat(&unsqueezed, dim as isize)
}

struct CatBack {
    dim: usize,
    sizes: Vec<usize>,
}
impl Backward for CatBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let mut start = 0;
        let mut grads = Vec::with_capacity(self.sizes.len());
        for (&len, &need) in self.sizes.iter().zip(needs) {
            grads.push(if need { Some(grad.stepped(self.dim, start, len, 1)?) } else { None });
            start += len;
        }
        Ok(grads)
    }
}

/// Constant padding (PyTorch's `F.pad(x, pad, value=value)`): `pad` lists, from the last dimension
/// backwards, the elements to add before and after; a negative number crops. The output is filled
/// with `value` and `x` lands in its window (exactly: `-value` is added there first, then `x`); the
/// gradient is the output gradient's window, a view.
pub fn pad(x: &Tensor, pad: &[i64], value: f64) -> Result<Tensor> {
    if pad.len() % 2 != 0 || pad.len() / 2 > x.rank() {
        return Err(Error::shape(format!("pad: {pad:?} is not pairs for at most {} dims", x.rank())));
    }
    let rank = x.rank();
    // Crops first (differentiable narrows), then the padding of what is left.
    let mut src = x.clone();
    let mut before = vec![0usize; rank];
    let mut shape = x.shape().to_vec();
    for (k, pair) in pad.chunks_exact(2).enumerate() {
        let d = rank - 1 - k;
        // In i128: no sum of two i64 overflows it.
        let (lo, hi) = (pair[0] as i128, pair[1] as i128);
        let size = src.shape()[d] as i128;
        let (cut_lo, cut_hi) = ((-lo).max(0), (-hi).max(0));
        if cut_lo + cut_hi > size {
            return Err(Error::shape(format!("pad: {pad:?} crops more than the {size} elements of dim {d}")));
        }
        if cut_lo + cut_hi > 0 {
            src = src.narrow(d as isize, cut_lo as usize, (size - cut_lo - cut_hi) as usize)?;
        }
        let padded = size - cut_lo - cut_hi + lo.max(0) + hi.max(0);
        let (Ok(start), Ok(padded)) = (usize::try_from(lo.max(0)), usize::try_from(padded)) else {
            return Err(Error::shape(format!("pad: {pad:?} makes dim {d} too large")));
        };
        before[d] = start;
        shape[d] = padded;
    }
    checked_numel(&shape)?;
    let _op = x.device().op_scope("pad");
    let out = super::output(&src, &shape, src.dtype(), "pad")?;
    out.device().backend().fill(&out, value)?;
    let mut window = out.clone();
    for (d, &start) in before.iter().enumerate() {
        window = window.stepped(d, start, src.shape()[d], 1)?;
    }
    if value != 0.0 {
        let cancel = super::output(&src, src.shape(), src.dtype(), "pad")?;
        out.device().backend().fill(&cancel, -value)?;
        super::add_into(&window, &cancel)?;
    }
    super::add_into(&window, &src)?;
    Ok(if needs_grad(&[&src]) {
        record(out, "pad", &[&src], PadBack { before, shape: src.shape().to_vec() })
    } else {
        out
    })
}

struct PadBack {
    before: Vec<usize>,
    shape: Vec<usize>,
}
impl Backward for PadBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let mut window = grad;
        for (d, (&start, &len)) in self.before.iter().zip(&self.shape).enumerate() {
            window = window.stepped(d, start, len, 1)?;
        }
        Ok(vec![Some(window)])
    }
}
