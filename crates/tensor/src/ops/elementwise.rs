//! Elementwise ops: unary activations and maths (relu, gelu, tanh, sigmoid, silu, exp, log, neg, sqrt,
//! rsqrt, cos, sin, abs, scalar affine, pow by a number, clamp), binary arithmetic with broadcasting (add, sub, mul, div),
//! comparisons and `where`, and in-place accumulation:
//! shapes, outputs and autograd. The kernels are the backend's (`memfit-cpu`'s `elementwise.rs`).

use super::{check_same, output};
use crate::autograd::{needs_grad, record, save_compact, Backward, Compact};
use crate::error::{Error, Result};
use crate::layout::broadcast_shapes;
use crate::tensor::Tensor;

fn unary(x: &Tensor, op: Unary) -> Result<Tensor> {
    let _op = x.device().op_scope(op.name());
    let x = x.contiguous()?;
    let out = output(&x, x.shape(), x.dtype(), op.name())?;
    x.device().backend().unary(op, &x, &out)?;
    if !needs_grad(&[&x]) {
        return Ok(out);
    }
    let saved = match op {
        Unary::Neg => None,
        _ if op.saves_output() => Some(save_compact(&out)?),
        _ => Some(save_compact(&x)?),
    };
    Ok(record(out, op.name(), &[&x], UnaryBack { op, saved }))
}

struct UnaryBack {
    op: Unary,
    saved: Option<Compact>,
}

impl Backward for UnaryBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.into_contiguous()?;
        let saved = self.saved.map(Compact::into_tensor).transpose()?;
        // The incoming gradient is usually a temporary nobody else holds: write the result over it
        // instead of allocating another tensor of the same size (the same on meta: it depends only
        // on who holds the gradient, never on data). A gradient `add` handed to both of its inputs
        // is shared until one of them is done with it, and is never written over.
        let in_place = grad.owns_storage();
        let out = if in_place { grad.clone() } else { output(&grad, grad.shape(), grad.dtype(), "unary_backward")? };
        grad.device().backend().unary_backward(self.op, saved.as_ref(), &grad, &out)?;
        Ok(vec![Some(out)])
    }
}

impl Tensor {
    pub fn relu(&self) -> Result<Tensor> {
        unary(self, Unary::Relu)
    }
    /// GELU, exact (erf) form: PyTorch's default.
    pub fn gelu(&self) -> Result<Tensor> {
        unary(self, Unary::GeluErf)
    }
    /// GELU, tanh approximation.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        unary(self, Unary::GeluTanh)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        unary(self, Unary::Tanh)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        unary(self, Unary::Sigmoid)
    }
    /// `x * sigmoid(x)`: PyTorch's `silu`; backward keeps the input alone.
    pub fn silu(&self) -> Result<Tensor> {
        unary(self, Unary::Silu)
    }
    pub fn exp(&self) -> Result<Tensor> {
        unary(self, Unary::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        unary(self, Unary::Log)
    }
    /// `min(max(x, 0), 6)`: PyTorch's `relu6`.
    pub fn relu6(&self) -> Result<Tensor> {
        unary(self, Unary::Relu6)
    }
    /// `min(max(x + 3, 0), 6) / 6`: PyTorch's `hardsigmoid`.
    pub fn hardsigmoid(&self) -> Result<Tensor> {
        unary(self, Unary::Hardsigmoid)
    }
    /// `x * min(max(x + 3, 0), 6) / 6`: PyTorch's `hardswish`.
    pub fn hardswish(&self) -> Result<Tensor> {
        unary(self, Unary::Hardswish)
    }
    pub fn neg(&self) -> Result<Tensor> {
        unary(self, Unary::Neg)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        unary(self, Unary::Sqrt)
    }
    /// `1 / sqrt(x)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        unary(self, Unary::Rsqrt)
    }
    pub fn cos(&self) -> Result<Tensor> {
        unary(self, Unary::Cos)
    }
    pub fn sin(&self) -> Result<Tensor> {
        unary(self, Unary::Sin)
    }
    pub fn abs(&self) -> Result<Tensor> {
        unary(self, Unary::Abs)
    }

    /// `x ^ exponent` (PyTorch's `pow(x, scalar)`: NaN for a negative base and a fractional
    /// exponent, as PyTorch gives).
    pub fn pow_scalar(&self, exponent: f64) -> Result<Tensor> {
        pow_scalar(self, exponent)
    }

    /// `min(max(x, lo), hi)` (PyTorch's `clamp`; a bound may be infinite). The gradient passes where
    /// `lo <= x <= hi`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        clamp(self, lo, hi, true)
    }
    /// The same values as [`Tensor::clamp`]; the gradient passes where `lo < x < hi` (PyTorch's
    /// `hardtanh`).
    pub fn hardtanh(&self, lo: f64, hi: f64) -> Result<Tensor> {
        clamp(self, lo, hi, false)
    }

    /// `op(self, other)` elementwise over the broadcast shape: a bool tensor (not differentiable).
    pub fn compare(&self, op: Compare, other: &Tensor) -> Result<Tensor> {
        check_same(op.name(), &[self, other])?;
        super::check_computable(op.name(), self.dtype())?;
        let _op = self.device().op_scope(op.name());
        let shape = broadcast_shapes(self.shape(), other.shape())?;
        let out = super::output_any(self, &shape, crate::DType::Bool, op.name())?;
        self.device().backend().compare(op, self, other, &out)?;
        Ok(out)
    }

    /// `self * scale + shift` with plain numbers.
    pub fn affine(&self, scale: f64, shift: f64) -> Result<Tensor> {
        let _op = self.device().op_scope("affine");
        let x = self.contiguous()?;
        let out = output(&x, x.shape(), x.dtype(), "affine")?;
        x.device().backend().affine(&x, scale, shift, &out)?;
        Ok(if needs_grad(&[&x]) { record(out, "affine", &[&x], ScaleBack { scale }) } else { out })
    }

    pub fn mul_scalar(&self, scale: f64) -> Result<Tensor> {
        self.affine(scale, 0.0)
    }

    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Add)
    }
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Sub)
    }
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Mul)
    }
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Div)
    }
}

/// `min(max(x, lo), hi)`; the gradient passes where `x` is inside [lo, hi] (`inclusive`, clamp's
/// rule) or strictly inside (hardtanh's), as PyTorch's.
fn clamp(x: &Tensor, lo: f64, hi: f64, inclusive: bool) -> Result<Tensor> {
    let name = if inclusive { "clamp" } else { "hardtanh" };
    let _op = x.device().op_scope(name);
    let x = x.contiguous()?;
    let out = output(&x, x.shape(), x.dtype(), name)?;
    x.device().backend().clamp(&x, lo, hi, &out)?;
    Ok(if needs_grad(&[&x]) {
        let saved = save_compact(&x)?;
        record(out, name, &[&x], ClampBack { lo, hi, inclusive, saved })
    } else {
        out
    })
}

/// `x ^ exponent` elementwise (PyTorch's `pow(x, scalar)`); the gradient `exponent * x ^ (exponent - 1)`.
fn pow_scalar(x: &Tensor, exponent: f64) -> Result<Tensor> {
    let _op = x.device().op_scope("pow");
    let x = x.contiguous()?;
    let out = output(&x, x.shape(), x.dtype(), "pow")?;
    x.device().backend().pow_scalar(&x, exponent, &out)?;
    Ok(if needs_grad(&[&x]) {
        let saved = save_compact(&x)?;
        record(out, "pow", &[&x], PowBack { exponent, saved })
    } else {
        out
    })
}

struct PowBack {
    exponent: f64,
    saved: Compact,
}
impl Backward for PowBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.into_contiguous()?;
        let x = self.saved.into_tensor()?;
        let out =
            if grad.owns_storage() { grad.clone() } else { output(&grad, grad.shape(), grad.dtype(), "pow_backward")? };
        grad.device().backend().pow_scalar_backward(&x, self.exponent, &grad, &out)?;
        Ok(vec![Some(out)])
    }
}

struct ClampBack {
    lo: f64,
    hi: f64,
    inclusive: bool,
    saved: Compact,
}
impl Backward for ClampBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.into_contiguous()?;
        let x = self.saved.into_tensor()?;
        // Over the incoming gradient when nobody else holds it, as a unary op's backward.
        let out = if grad.owns_storage() {
            grad.clone()
        } else {
            output(&grad, grad.shape(), grad.dtype(), "clamp_backward")?
        };
        grad.device().backend().clamp_backward(&x, self.lo, self.hi, self.inclusive, &grad, &out)?;
        Ok(vec![Some(out)])
    }
}

/// `cond ? a : b` elementwise over the broadcast shape of the three (PyTorch's `torch.where`);
/// `cond` is a bool tensor, `a` and `b` share a float dtype.
pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_same("where", &[a, b])?;
    if !cond.device().same(a.device()) || cond.dtype() != crate::DType::Bool {
        return Err(Error::dtype(format!(
            "where: the condition is {} (a bool tensor on the values' device)",
            cond.dtype()
        )));
    }
    let _op = a.device().op_scope("where");
    let shape = broadcast_shapes(&broadcast_shapes(cond.shape(), a.shape())?, b.shape())?;
    let out = output(a, &shape, a.dtype(), "where")?;
    a.device().backend().select(cond, a, b, &out)?;
    Ok(if needs_grad(&[a, b]) {
        let back = WhereBack { cond: cond.clone(), a_shape: a.shape().to_vec(), b_shape: b.shape().to_vec() };
        record(out, "where", &[a, b], back)
    } else {
        out
    })
}

struct WhereBack {
    cond: Tensor,
    a_shape: Vec<usize>,
    b_shape: Vec<usize>,
}
impl Backward for WhereBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let zero = Tensor::scalar(grad.device(), 0.0, grad.dtype(), crate::Category::Temporary)?;
        let mut grads = Vec::with_capacity(2);
        for (k, shape) in [(0, &self.a_shape), (1, &self.b_shape)] {
            grads.push(if needs[k] {
                let (a, b) = if k == 0 { (&grad, &zero) } else { (&zero, &grad) };
                let g = output(&grad, grad.shape(), grad.dtype(), "where_backward")?;
                grad.device().backend().select(&self.cond, a, b, &g)?;
                Some(sum_to_shape(&g, shape)?)
            } else {
                None
            });
        }
        Ok(grads)
    }
}

struct ScaleBack {
    scale: f64,
}
impl Backward for ScaleBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad.affine(self.scale, 0.0)?)])
    }
}

/// Computes `op(a, b)` over the broadcast shape into a new tensor.
fn binary_kernel(a: &Tensor, b: &Tensor, op: Binary) -> Result<Tensor> {
    check_same(op.name(), &[a, b])?;
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let out = output(a, &shape, a.dtype(), op.name())?;
    a.device().backend().binary(op, a, b, &out)?;
    Ok(out)
}

fn binary(a: &Tensor, b: &Tensor, op: Binary) -> Result<Tensor> {
    let _op = a.device().op_scope(op.name());
    let out = binary_kernel(a, b, op)?;
    if !needs_grad(&[a, b]) {
        return Ok(out);
    }
    let (sa, sb) = match op {
        Binary::Add | Binary::Sub => (None, None),
        Binary::Mul => (Some(save_compact(a)?), Some(save_compact(b)?)),
        Binary::Div => (None, Some(save_compact(b)?)),
    };
    // div's grad for b needs the output: -g * out / b.
    let so = if op == Binary::Div && b.requires_grad() { Some(save_compact(&out)?) } else { None };
    let back = BinaryBack { op, a_shape: a.shape().to_vec(), b_shape: b.shape().to_vec(), a: sa, b: sb, out: so };
    Ok(record(out, op.name(), &[a, b], back))
}

struct BinaryBack {
    op: Binary,
    a_shape: Vec<usize>,
    b_shape: Vec<usize>,
    a: Option<Compact>,
    b: Option<Compact>,
    out: Option<Compact>,
}

fn saved(t: &Option<Compact>) -> Result<Tensor> {
    t.as_ref().ok_or_else(|| Error::invalid("internal: missing saved tensor"))?.restore()
}

impl Backward for BinaryBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let ga = if needs[0] {
            let g = match self.op {
                Binary::Add | Binary::Sub => grad.clone(),
                Binary::Mul => binary_kernel(&grad, &saved(&self.b)?, Binary::Mul)?,
                Binary::Div => binary_kernel(&grad, &saved(&self.b)?, Binary::Div)?,
            };
            Some(sum_to_shape(&g, &self.a_shape)?)
        } else {
            None
        };
        let gb = if needs[1] {
            let g = match self.op {
                Binary::Add => grad.clone(),
                Binary::Sub => grad.neg()?,
                Binary::Mul => binary_kernel(&grad, &saved(&self.a)?, Binary::Mul)?,
                Binary::Div => {
                    let t = binary_kernel(&grad, &saved(&self.out)?, Binary::Mul)?;
                    binary_kernel(&t, &saved(&self.b)?, Binary::Div)?.neg()?
                }
            };
            Some(sum_to_shape(&g, &self.b_shape)?)
        } else {
            None
        };
        Ok(vec![ga, gb])
    }
}

use super::sum_to_shape;
pub use memfit_cpu::elementwise::Compare;
pub(crate) use memfit_cpu::elementwise::{Binary, Unary};

/// `dst += src` in place (same shape; any layouts). Not recorded by autograd.
pub fn add_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    check_same("add_into", &[dst, src])?;
    super::check_computable("add_into", dst.dtype())?;
    if dst.shape() != src.shape() {
        return Err(Error::shape(format!("add_into: {:?} and {:?} differ", dst.shape(), src.shape())));
    }
    dst.device().backend().add_into(dst, src)
}

/// `prev + g`, reusing `prev`'s memory when nobody else holds it. For gradient accumulation.
pub fn add_accumulate(prev: Tensor, g: &Tensor) -> Result<Tensor> {
    if prev.shape() == g.shape() && prev.dtype() == g.dtype() && prev.owns_storage() {
        add_into(&prev, g)?;
        Ok(prev)
    } else {
        binary_kernel(&prev, g, Binary::Add)
    }
}
