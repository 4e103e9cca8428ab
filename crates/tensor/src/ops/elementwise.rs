//! Elementwise ops: unary activations and maths (relu, gelu, tanh, sigmoid, exp, log, neg, scalar
//! affine), binary arithmetic with broadcasting (add, sub, mul, div), and in-place accumulation.

use super::{check_same, output, PAR_CHUNK};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::layout::{broadcast_layout, broadcast_shapes, for_each_offset_pair};
use crate::tensor::Tensor;
use crate::with_float;
use memfit_kernels::{math, Isa};
use rayon::prelude::*;

// Slice kernels of GELU and exp: f32 runs `memfit-kernels`' vectorised math for the process's
// instruction set, f64 the scalar functions below. Every GELU of the crate goes through these, so
// fused and unfused ops compute the same values.

/// Elements per call into the vectorised math, and the stack buffer of the in-place variants.
const MATH_CHUNK: usize = 1024;

/// `f(src_chunk, dst_chunk)` over equal chunks of two slices, in parallel for large ones.
fn par_chunks2<T: Float>(src: &[T], dst: &mut [T], f: impl Fn(&[T], &mut [T]) + Sync) {
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK).zip(src.par_chunks(PAR_CHUNK)).for_each(|(d, s)| f(s, d));
    } else {
        f(src, dst);
    }
}

/// `f(a_chunk, b_chunk, dst_chunk)` over equal chunks of three slices, in parallel for large ones.
fn par_chunks3<T: Float>(a: &[T], b: &[T], dst: &mut [T], f: impl Fn(&[T], &[T], &mut [T]) + Sync) {
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK).zip(a.par_chunks(PAR_CHUNK).zip(b.par_chunks(PAR_CHUNK))).for_each(|(d, (a, b))| f(a, b, d));
    } else {
        f(a, b, dst);
    }
}

/// `dst = gelu(src)` (exact, erf).
pub(crate) fn gelu_slice<T: Float>(src: &[T], dst: &mut [T]) {
    par_chunks2(src, dst, |s, d| match (T::as_f32(s), T::as_f32_mut(d)) {
        (Some(s), Some(d)) => math::gelu(Isa::active(), s, d),
        _ => d.iter_mut().zip(s).for_each(|(d, &s)| *d = gelu_erf(s)),
    });
}

/// `y = gelu(x)` and `xd = gelu'(x)`, where `xd` holds `x` on entry.
pub(crate) fn gelu_with_derivative_slice<T: Float>(y: &mut [T], xd: &mut [T]) {
    let run = |y: &mut [T], xd: &mut [T]| match (T::as_f32_mut(y), T::as_f32_mut(xd)) {
        (Some(y), Some(xd)) => {
            let mut x = [0.0f32; MATH_CHUNK];
            for (y, xd) in y.chunks_mut(MATH_CHUNK).zip(xd.chunks_mut(MATH_CHUNK)) {
                let x = &mut x[..xd.len()];
                x.copy_from_slice(xd);
                math::gelu_with_derivative(Isa::active(), x, y, xd);
            }
        }
        _ => y.iter_mut().zip(xd.iter_mut()).for_each(|(y, xd)| (*y, *xd) = gelu_erf_with_derivative(*xd)),
    };
    if y.len() >= 2 * PAR_CHUNK {
        y.par_chunks_mut(PAR_CHUNK).zip(xd.par_chunks_mut(PAR_CHUNK)).for_each(|(y, xd)| run(y, xd));
    } else {
        run(y, xd);
    }
}

/// `dst = g * gelu'(x)`.
pub(crate) fn gelu_backward_slice<T: Float>(x: &[T], g: &[T], dst: &mut [T]) {
    par_chunks3(x, g, dst, |x, g, d| match (T::as_f32(x), T::as_f32(g), T::as_f32_mut(d)) {
        (Some(x), Some(g), Some(d)) => math::gelu_backward(Isa::active(), x, g, d),
        _ => d.iter_mut().zip(x.iter().zip(g)).for_each(|(d, (&x, &g))| *d = gelu_erf_backward(x, g)),
    });
}

/// `g = g * gelu'(x)`, over the gradient.
pub(crate) fn gelu_backward_over_grad<T: Float>(x: &[T], g: &mut [T]) {
    par_chunks2(x, g, |x, g| match (T::as_f32(x), T::as_f32_mut(g)) {
        (Some(x), Some(g)) => math::gelu_backward_inplace(Isa::active(), x, g),
        _ => g.iter_mut().zip(x).for_each(|(g, &x)| *g = gelu_erf_backward(x, *g)),
    });
}

/// `x = g * gelu'(x)`, over the input.
pub(crate) fn gelu_backward_over_input<T: Float>(g: &[T], x: &mut [T]) {
    par_chunks2(g, x, |g, xs| match (T::as_f32(g), T::as_f32_mut(xs)) {
        (Some(g), Some(xs)) => {
            let mut x = [0.0f32; MATH_CHUNK];
            for (g, xs) in g.chunks(MATH_CHUNK).zip(xs.chunks_mut(MATH_CHUNK)) {
                let x = &mut x[..xs.len()];
                x.copy_from_slice(xs);
                math::gelu_backward(Isa::active(), x, g, xs);
            }
        }
        _ => xs.iter_mut().zip(g).for_each(|(x, &g)| *x = gelu_erf_backward(*x, g)),
    });
}

/// `v = exp(v)` over a slice, on this thread.
pub(crate) fn exp_in_place<T: Float>(v: &mut [T]) {
    match T::as_f32_mut(v) {
        Some(v) => math::exp_inplace(Isa::active(), v),
        None => v.iter_mut().for_each(|v| *v = v.exp()),
    }
}

/// `dst[i] = f(src[i])`, in parallel for large tensors.
pub(crate) fn par_map<T: Float>(src: &[T], dst: &mut [T], f: impl Fn(T) -> T + Sync) {
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK)
            .zip(src.par_chunks(PAR_CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s)));
    } else {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f(s));
    }
}

/// `dst[i] = f(a[i], b[i])`, in parallel for large tensors.
pub(crate) fn par_zip<T: Float>(a: &[T], b: &[T], dst: &mut [T], f: impl Fn(T, T) -> T + Sync) {
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks(PAR_CHUNK).zip(b.par_chunks(PAR_CHUNK)))
            .for_each(|(d, (a, b))| d.iter_mut().zip(a.iter().zip(b)).for_each(|(d, (&a, &b))| *d = f(a, b)));
    } else {
        dst.iter_mut().zip(a.iter().zip(b)).for_each(|(d, (&a, &b))| *d = f(a, b));
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unary {
    Relu,
    GeluErf,
    GeluTanh,
    Tanh,
    Sigmoid,
    Exp,
    Log,
    Neg,
}

impl Unary {
    fn name(self) -> &'static str {
        match self {
            Unary::Relu => "relu",
            Unary::GeluErf => "gelu",
            Unary::GeluTanh => "gelu_tanh",
            Unary::Tanh => "tanh",
            Unary::Sigmoid => "sigmoid",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Neg => "neg",
        }
    }

    /// Whether backward needs the output (else the input, or nothing for neg).
    fn saves_output(self) -> bool {
        matches!(self, Unary::Relu | Unary::Tanh | Unary::Sigmoid | Unary::Exp)
    }
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044_715;

/// The exact (erf) GELU of one value, as [`Tensor::gelu`] computes it (fused ops share it).
#[inline(always)]
pub(crate) fn gelu_erf<T: Float>(x: T) -> T {
    T::of(0.5) * x * (T::one() + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

/// `g * gelu'(x)` for the exact GELU, as [`Tensor::gelu`]'s backward computes it.
#[inline(always)]
pub(crate) fn gelu_erf_backward<T: Float>(x: T, g: T) -> T {
    let half = T::of(0.5);
    let cdf = half * (T::one() + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf());
    let pdf = (-half * x * x).exp() * T::of(0.398_942_280_401_432_7);
    g * (cdf + x * pdf)
}

/// GELU and its derivative at `x` from one erf: `(gelu_erf(x), d)` with `g * d` equal to
/// `gelu_erf_backward(x, g)`, bit for bit.
#[inline(always)]
pub(crate) fn gelu_erf_with_derivative<T: Float>(x: T) -> (T, T) {
    let half = T::of(0.5);
    let e = (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf();
    let y = half * x * (T::one() + e);
    let cdf = half * (T::one() + e);
    let pdf = (-half * x * x).exp() * T::of(0.398_942_280_401_432_7);
    (y, cdf + x * pdf)
}

/// Runs the forward of `op` over `src` into `dst`. The match on the op is outside the element loop,
/// so each loop is specialized (and ReLU's vectorizes).
fn forward_kernel<T: Float>(op: Unary, src: &[T], dst: &mut [T]) {
    let half = T::of(0.5);
    let one = T::one();
    match op {
        Unary::Relu => par_map(src, dst, |x| if x > T::zero() { x } else { T::zero() }),
        Unary::GeluErf => gelu_slice(src, dst),
        Unary::GeluTanh => {
            par_map(src, dst, |x| half * x * (one + (T::of(SQRT_2_OVER_PI) * (x + T::of(GELU_C) * x * x * x)).tanh()))
        }
        Unary::Tanh => par_map(src, dst, |x| x.tanh()),
        Unary::Sigmoid => par_map(src, dst, |x| one / (one + (-x).exp())),
        Unary::Exp => par_chunks2(src, dst, |s, d| {
            d.copy_from_slice(s);
            exp_in_place(d)
        }),
        Unary::Log => par_map(src, dst, |x| x.ln()),
        Unary::Neg => par_map(src, dst, |x| -x),
    }
}

/// Runs `f(saved, grad)` elementwise: into `dst` from `grad`, or over `dst` (holding the gradient)
/// in place when `grad` is None.
fn apply_backward<T: Float>(s: &[T], grad: Option<&[T]>, dst: &mut [T], f: impl Fn(T, T) -> T + Sync) {
    match grad {
        Some(g) => par_zip(s, g, dst, f),
        None => par_update(s, dst, f),
    }
}

/// d(out)/d(in) * g for `op`, from the saved value (output or input, see `saves_output`). The match
/// on the op is outside the element loop.
fn backward_kernel<T: Float>(op: Unary, s: &[T], grad: Option<&[T]>, dst: &mut [T]) {
    let half = T::of(0.5);
    let one = T::one();
    match op {
        Unary::Relu => apply_backward(s, grad, dst, |s, g| if s > T::zero() { g } else { T::zero() }),
        Unary::GeluErf => match grad {
            Some(g) => gelu_backward_slice(s, g, dst),
            None => gelu_backward_over_grad(s, dst),
        },
        Unary::GeluTanh => apply_backward(s, grad, dst, |s, g| {
            let inner = T::of(SQRT_2_OVER_PI) * (s + T::of(GELU_C) * s * s * s);
            let t = inner.tanh();
            let dinner = T::of(SQRT_2_OVER_PI) * (one + T::of(3.0 * GELU_C) * s * s);
            g * (half * (one + t) + half * s * (one - t * t) * dinner)
        }),
        Unary::Tanh => apply_backward(s, grad, dst, |s, g| g * (one - s * s)),
        Unary::Sigmoid => apply_backward(s, grad, dst, |s, g| g * s * (one - s)),
        Unary::Exp => apply_backward(s, grad, dst, |s, g| g * s),
        Unary::Log => apply_backward(s, grad, dst, |s, g| g / s),
        Unary::Neg => apply_backward(s, grad, dst, |_, g| -g),
    }
}

fn unary(x: &Tensor, op: Unary) -> Result<Tensor> {
    let _op = x.device().op_scope(op.name());
    let x = x.contiguous()?;
    let out = output(&x, x.shape(), x.dtype(), op.name())?;
    if x.device().computes() {
        with_float!(x.dtype(), op.name(), T => forward_kernel::<T>(op, x.slice::<T>()?, out.slice_mut::<T>()?));
    }
    if !needs_grad(&[&x]) {
        return Ok(out);
    }
    let saved = match op {
        Unary::Neg => None,
        _ if op.saves_output() => Some(save(&out)),
        _ => Some(save(&x)),
    };
    Ok(record(out, op.name(), &[&x], UnaryBack { op, saved }))
}

struct UnaryBack {
    op: Unary,
    saved: Option<Tensor>,
}

impl Backward for UnaryBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.into_contiguous()?;
        // The incoming gradient is usually a temporary nobody else holds: write the result over it
        // instead of allocating another tensor of the same size (the same on meta: it depends only
        // on who holds the gradient, never on data). A gradient `add` handed to both of its inputs
        // is shared until one of them is done with it, and is never written over.
        let in_place = grad.owns_storage();
        let out = if in_place { grad.clone() } else { output(&grad, grad.shape(), grad.dtype(), "unary_backward")? };
        if grad.device().computes() {
            with_float!(grad.dtype(), self.op.name(), T => {
                let dst = out.slice_mut::<T>()?;
                match (&self.saved, in_place) {
                    (Some(s), true) => backward_kernel(self.op, s.slice::<T>()?, None, dst),
                    (Some(s), false) => backward_kernel(self.op, s.slice::<T>()?, Some(grad.slice::<T>()?), dst),
                    (None, true) => dst.iter_mut().for_each(|g| *g = -*g),
                    (None, false) => par_map(grad.slice::<T>()?, dst, |g| -g),
                }
            });
        }
        Ok(vec![Some(out)])
    }
}

/// `dst[i] = f(src[i], dst[i])`, in parallel for large tensors.
pub(crate) fn par_update<T: Float>(src: &[T], dst: &mut [T], f: impl Fn(T, T) -> T + Sync) {
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK)
            .zip(src.par_chunks(PAR_CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s, *d)));
    } else {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f(s, *d));
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
    pub fn exp(&self) -> Result<Tensor> {
        unary(self, Unary::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        unary(self, Unary::Log)
    }
    pub fn neg(&self) -> Result<Tensor> {
        unary(self, Unary::Neg)
    }

    /// `self * scale + shift` with plain numbers.
    pub fn affine(&self, scale: f64, shift: f64) -> Result<Tensor> {
        let _op = self.device().op_scope("affine");
        let x = self.contiguous()?;
        let out = output(&x, x.shape(), x.dtype(), "affine")?;
        if x.device().computes() {
            with_float!(x.dtype(), "affine", T => {
                let (a, b) = (T::of(scale), T::of(shift));
                par_map(x.slice::<T>()?, out.slice_mut::<T>()?, move |v| v * a + b)
            });
        }
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

struct ScaleBack {
    scale: f64,
}
impl Backward for ScaleBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad.affine(self.scale, 0.0)?)])
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

impl Binary {
    fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
        }
    }

    fn apply<T: Float>(self, a: T, b: T) -> T {
        match self {
            Binary::Add => a + b,
            Binary::Sub => a - b,
            Binary::Mul => a * b,
            Binary::Div => a / b,
        }
    }
}

/// Computes `op(a, b)` over the broadcast shape into a new tensor.
fn binary_kernel(a: &Tensor, b: &Tensor, op: Binary) -> Result<Tensor> {
    check_same(op.name(), &[a, b])?;
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let out = output(a, &shape, a.dtype(), op.name())?;
    if !a.device().computes() {
        return Ok(out);
    }
    with_float!(a.dtype(), op.name(), T => {
        let dst = out.slice_mut::<T>()?;
        if a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous() {
            par_zip(a.slice::<T>()?, b.slice::<T>()?, dst, move |x, y| op.apply(x, y));
        } else {
            let la = broadcast_layout(a.layout(), &shape);
            let lb = broadcast_layout(b.layout(), &shape);
            let (sa, sb) = (typed_storage::<T>(a)?, typed_storage::<T>(b)?);
            let mut i = 0;
            for_each_offset_pair(&la, &lb, |oa, ob| {
                dst[i] = op.apply(sa[oa], sb[ob]);
                i += 1;
            });
        }
    });
    Ok(out)
}

/// All elements of a tensor's storage as `T` (for strided reads through its layout).
pub(crate) fn typed_storage<T: Float>(t: &Tensor) -> Result<&[T]> {
    if t.dtype() != T::DTYPE {
        return Err(Error::dtype(format!("tensor is {}, asked as {}", t.dtype(), T::DTYPE)));
    }
    let bytes = t.storage_bytes()?;
    // SAFETY: the storage is 512-byte aligned and holds whole elements of T.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / std::mem::size_of::<T>()) })
}

fn binary(a: &Tensor, b: &Tensor, op: Binary) -> Result<Tensor> {
    let _op = a.device().op_scope(op.name());
    let out = binary_kernel(a, b, op)?;
    if !needs_grad(&[a, b]) {
        return Ok(out);
    }
    let (sa, sb) = match op {
        Binary::Add | Binary::Sub => (None, None),
        Binary::Mul => (Some(save(a)), Some(save(b))),
        Binary::Div => (None, Some(save(b))),
    };
    // div's grad for b needs the output: -g * out / b.
    let so = if op == Binary::Div && b.requires_grad() { Some(save(&out)) } else { None };
    let back = BinaryBack { op, a_shape: a.shape().to_vec(), b_shape: b.shape().to_vec(), a: sa, b: sb, out: so };
    Ok(record(out, op.name(), &[a, b], back))
}

struct BinaryBack {
    op: Binary,
    a_shape: Vec<usize>,
    b_shape: Vec<usize>,
    a: Option<Tensor>,
    b: Option<Tensor>,
    out: Option<Tensor>,
}

fn saved(t: &Option<Tensor>) -> Result<&Tensor> {
    t.as_ref().ok_or_else(|| Error::invalid("internal: missing saved tensor"))
}

impl Backward for BinaryBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let ga = if needs[0] {
            let g = match self.op {
                Binary::Add | Binary::Sub => grad.clone(),
                Binary::Mul => binary_kernel(&grad, saved(&self.b)?, Binary::Mul)?,
                Binary::Div => binary_kernel(&grad, saved(&self.b)?, Binary::Div)?,
            };
            Some(sum_to_shape(&g, &self.a_shape)?)
        } else {
            None
        };
        let gb = if needs[1] {
            let g = match self.op {
                Binary::Add => grad.clone(),
                Binary::Sub => grad.neg()?,
                Binary::Mul => binary_kernel(&grad, saved(&self.a)?, Binary::Mul)?,
                Binary::Div => {
                    let t = binary_kernel(&grad, saved(&self.out)?, Binary::Mul)?;
                    binary_kernel(&t, saved(&self.b)?, Binary::Div)?.neg()?
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

/// `dst += src` in place (same shape; any layouts). Not recorded by autograd.
pub fn add_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    check_same("add_into", &[dst, src])?;
    if dst.shape() != src.shape() {
        return Err(Error::shape(format!("add_into: {:?} and {:?} differ", dst.shape(), src.shape())));
    }
    if !dst.device().computes() {
        return Ok(());
    }
    with_float!(dst.dtype(), "add_into", T => {
        if dst.is_contiguous() && src.is_contiguous() {
            let s = src.slice::<T>()?;
            let d = dst.slice_mut::<T>()?;
            if d.len() >= 2 * PAR_CHUNK {
                d.par_chunks_mut(PAR_CHUNK).zip(s.par_chunks(PAR_CHUNK))
                    .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d += s));
            } else {
                d.iter_mut().zip(s).for_each(|(d, &s)| *d += s);
            }
        } else {
            let s = typed_storage::<T>(src)?;
            let base = dst.storage_ptr()? as *mut T;
            for_each_offset_pair(dst.layout(), src.layout(), |od, os| {
                // SAFETY: od is an in-bounds element offset of dst's storage, which nobody else is
                // reading (Note [Storage aliasing]).
                unsafe { *base.add(od) += s[os] };
            });
        }
    });
    Ok(())
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
