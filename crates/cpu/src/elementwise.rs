//! CPU kernels of the element-wise ops (`ops/elementwise.rs`): unary activations and maths, affine,
//! clamping, broadcast binary arithmetic, comparisons and selection, and in-place accumulation, plus the slice helpers other CPU kernels
//! share (parallel maps, and GELU/exp through `memfit-kernels`' vectorised math for f32).

use crate::dtype::Float;
use crate::error::Result;
use crate::layout::{broadcast_layout, for_each_offset_pair, for_each_offset_triple, for_each_run_pair};
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use memfit_kernels::{math, Isa};
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    Relu,
    GeluErf,
    GeluTanh,
    Tanh,
    Sigmoid,
    Exp,
    Log,
    Neg,
    /// `min(max(x, 0), 6)` (PyTorch's `relu6`, `hardtanh(x, 0, 6)`).
    Relu6,
    /// `min(max(x + 3, 0), 6) / 6` (PyTorch's `hardsigmoid`).
    Hardsigmoid,
    /// `x * min(max(x + 3, 0), 6) / 6` (PyTorch's `hardswish`).
    Hardswish,
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    Cos,
    Sin,
    Abs,
    /// `x * sigmoid(x)` (PyTorch's `silu`, swish): backward from the input alone, so the sigmoid
    /// is never kept.
    Silu,
}

impl Unary {
    pub fn name(self) -> &'static str {
        match self {
            Unary::Relu => "relu",
            Unary::GeluErf => "gelu",
            Unary::GeluTanh => "gelu_tanh",
            Unary::Tanh => "tanh",
            Unary::Sigmoid => "sigmoid",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Neg => "neg",
            Unary::Relu6 => "relu6",
            Unary::Hardsigmoid => "hardsigmoid",
            Unary::Hardswish => "hardswish",
            Unary::Sqrt => "sqrt",
            Unary::Rsqrt => "rsqrt",
            Unary::Cos => "cos",
            Unary::Sin => "sin",
            Unary::Abs => "abs",
            Unary::Silu => "silu",
        }
    }

    /// Whether backward needs the output (else the input, or nothing for neg).
    pub fn saves_output(self) -> bool {
        matches!(
            self,
            Unary::Relu | Unary::Tanh | Unary::Sigmoid | Unary::Exp | Unary::Relu6 | Unary::Sqrt | Unary::Rsqrt
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

impl Binary {
    pub fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
        }
    }
}

// Slice kernels of GELU and exp: f32 runs `memfit-kernels`' vectorised math for the process's
// instruction set, f64 the scalar functions below. Every GELU of the crate goes through these, so
// fused and unfused ops compute the same values.

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
        dst.par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks(PAR_CHUNK).zip(b.par_chunks(PAR_CHUNK)))
            .for_each(|(d, (a, b))| f(a, b, d));
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
        (Some(y), Some(xd)) => math::gelu_with_derivative_over_input(Isa::active(), xd, y),
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
        (Some(g), Some(xs)) => math::gelu_backward_over_input(Isa::active(), g, xs),
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

/// Independent partial sums [`lane_sum`] keeps (one AVX-512 register of f64).
pub(crate) const LANES: usize = 8;

/// `sum(f(v))` over `xs`, kept in [`LANES`] partial sums of `A` (element `j` goes to sum `j % LANES`,
/// the tail after the last whole group to a sum of its own, all combined in one fixed order) so that
/// the additions vectorise instead of waiting on one another. The order depends only on the length:
/// the same values always give the same bits.
#[inline(always)]
pub(crate) fn lane_sum<T: Copy, A: num_traits::Float>(xs: &[T], f: impl Fn(T) -> A) -> A {
    let mut acc = [A::zero(); LANES];
    let groups = xs.chunks_exact(LANES);
    let tail = groups.remainder().iter().fold(A::zero(), |s, &v| s + f(v));
    for group in groups {
        for (a, &v) in acc.iter_mut().zip(group) {
            *a = *a + f(v);
        }
    }
    combine_lanes(&acc, tail)
}

/// `sum(a[j] * b[j])` over equal-length slices, kept in partial sums as [`lane_sum`] keeps them.
#[inline(always)]
pub(crate) fn lane_dot<T: Float>(a: &[T], b: &[T]) -> T {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [T::zero(); LANES];
    let (ga, gb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = ga.remainder().iter().zip(gb.remainder()).fold(T::zero(), |s, (&x, &y)| s + x * y);
    for (x, y) in ga.zip(gb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    combine_lanes(&acc, tail)
}

/// The total of [`LANES`] partial sums and a tail sum, added in one fixed order.
#[inline(always)]
pub(crate) fn combine_lanes<A: num_traits::Float>(acc: &[A; LANES], tail: A) -> A {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Calls `f(first_row, rows)` for consecutive groups of rows of `row_len` elements, in parallel when
/// the data is big enough; groups hold about `PAR_CHUNK` elements.
pub(crate) fn for_row_groups(rows: usize, row_len: usize, f: impl Fn(usize, usize) + Sync + Send) {
    let per = (PAR_CHUNK / row_len.max(1)).max(1);
    let groups = rows.div_ceil(per);
    let run = |k: usize| f(k * per, per.min(rows - k * per));
    if rows * row_len >= 2 * PAR_CHUNK && groups > 1 {
        (0..groups).into_par_iter().for_each(run);
    } else {
        (0..groups).for_each(run);
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

/// True when `full` has the output's shape, `part` the output's trailing dimensions (after any
/// leading ones of size 1) and both are contiguous: `part` then repeats along `full`'s rows of
/// `part.len()` elements (all of `full` is one row when the shapes are equal).
fn repeats_along_rows(full: &View<'_>, part: &View<'_>, shape: &[usize]) -> bool {
    let dims = part.shape();
    let dims = &dims[dims.iter().position(|&d| d != 1).unwrap_or(dims.len())..];
    full.shape() == shape
        && full.is_contiguous()
        && part.is_contiguous()
        && !dims.is_empty()
        && !dims.contains(&0)
        && shape.ends_with(dims)
}

/// `dst[r * n + j] = f(full[r * n + j], row[j])` with `n = row.len()`: whole rows per task, in
/// parallel for large tensors.
fn par_rows<T: Float>(full: &[T], row: &[T], dst: &mut [T], f: impl Fn(T, T) -> T + Sync) {
    let n = row.len();
    let each = |(d, a): (&mut [T], &[T])| {
        d.chunks_mut(n)
            .zip(a.chunks(n))
            .for_each(|(d, a)| d.iter_mut().zip(a.iter().zip(row)).for_each(|(d, (&a, &b))| *d = f(a, b)))
    };
    // Chunks of whole rows, about PAR_CHUNK elements each.
    let chunk = n * PAR_CHUNK.div_ceil(n);
    if dst.len() >= 2 * chunk {
        dst.par_chunks_mut(chunk).zip(full.par_chunks(chunk)).for_each(each);
    } else {
        each((dst, full));
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

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044_715;

/// The exact (erf) GELU of one value, as the tensor crate's `gelu` computes it (fused ops share it).
#[inline(always)]
pub(crate) fn gelu_erf<T: Float>(x: T) -> T {
    T::of(0.5) * x * (T::one() + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

/// `g * gelu'(x)` for the exact GELU, as the tensor crate's `gelu`'s backward computes it.
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

/// `t` clamped to [0, `six`] (NaN goes to 0, as memfit's relu sends it).
fn clamp_0_6<T: Float>(t: T, six: T) -> T {
    if t > T::zero() {
        if t < six {
            t
        } else {
            six
        }
    } else {
        T::zero()
    }
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
        Unary::Sigmoid => par_chunks2(src, dst, |s, d| {
            exp_of_negated(s, d);
            d.iter_mut().for_each(|d| *d = one / (one + *d));
        }),
        Unary::Exp => par_chunks2(src, dst, |s, d| {
            d.copy_from_slice(s);
            exp_in_place(d)
        }),
        Unary::Log => par_map(src, dst, |x| x.ln()),
        Unary::Neg => par_map(src, dst, |x| -x),
        Unary::Relu6 => {
            let six = T::of(6.0);
            par_map(src, dst, |x| {
                if x > T::zero() {
                    if x < six {
                        x
                    } else {
                        six
                    }
                } else {
                    T::zero()
                }
            })
        }
        // As PyTorch computes them: (x + 3) clamped to [0, 6], then / 6 (after the product for hardswish).
        Unary::Hardsigmoid => {
            let (three, six) = (T::of(3.0), T::of(6.0));
            par_map(src, dst, move |x| clamp_0_6(x + three, six) / six)
        }
        Unary::Hardswish => {
            let (three, six) = (T::of(3.0), T::of(6.0));
            par_map(src, dst, move |x| x * clamp_0_6(x + three, six) / six)
        }
        Unary::Sqrt => par_map(src, dst, |x| x.sqrt()),
        Unary::Rsqrt => par_map(src, dst, |x| one / x.sqrt()),
        Unary::Cos => par_map(src, dst, |x| x.cos()),
        Unary::Sin => par_map(src, dst, |x| x.sin()),
        Unary::Abs => par_map(src, dst, |x| x.abs()),
        // As PyTorch's: x / (1 + exp(-x)).
        Unary::Silu => par_chunks2(src, dst, |s, d| {
            exp_of_negated(s, d);
            d.iter_mut().zip(s).for_each(|(d, &x)| *d = x / (one + *d));
        }),
    }
}

/// `d = exp(-s)`, the exponential vectorised for f32 (`memfit-kernels`' `exp`).
fn exp_of_negated<T: Float>(s: &[T], d: &mut [T]) {
    d.iter_mut().zip(s).for_each(|(d, &x)| *d = -x);
    exp_in_place(d);
}

/// SiLU's backward from the input `x`, as PyTorch's `silu_backward`: `g * s * (1 + x * (1 - s))` with
/// `s = 1 / (1 + exp(-x))`, into `dst` from `grad`, or over `dst` holding the gradient. The
/// exponentials go through a block on the stack, [`SILU_BLOCK`] values at a time.
fn silu_backward<T: Float>(x: &[T], grad: Option<&[T]>, dst: &mut [T]) {
    let one = T::one();
    let block = |x: &[T], g: Option<&[T]>, d: &mut [T]| {
        let mut e = [T::zero(); SILU_BLOCK];
        for (k, (x, d)) in x.chunks(SILU_BLOCK).zip(d.chunks_mut(SILU_BLOCK)).enumerate() {
            let e = &mut e[..x.len()];
            exp_of_negated(x, e);
            for (i, (d, (&x, &e))) in d.iter_mut().zip(x.iter().zip(e.iter())).enumerate() {
                let s = one / (one + e);
                let g = g.map_or(*d, |g| g[k * SILU_BLOCK + i]);
                *d = g * s * (one + x * (one - s));
            }
        }
    };
    match grad {
        Some(g) => par_chunks3(x, g, dst, |x, g, d| block(x, Some(g), d)),
        None => par_chunks2(x, dst, |x, d| block(x, None, d)),
    }
}

/// Values of SiLU's backward whose exponentials are taken together.
const SILU_BLOCK: usize = 256;

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
        // From the output: it lies strictly between 0 and 6 exactly where the input does.
        Unary::Relu6 => {
            let six = T::of(6.0);
            apply_backward(s, grad, dst, |s, g| if s > T::zero() && s < six { g } else { T::zero() })
        }
        // From the input, as PyTorch's hardsigmoid_backward and hardswish_backward.
        Unary::Hardsigmoid => {
            let (three, six) = (T::of(3.0), T::of(6.0));
            apply_backward(s, grad, dst, move |x, g| if x > -three && x < three { g / six } else { T::zero() })
        }
        Unary::Hardswish => {
            let (three, half) = (T::of(3.0), T::of(0.5));
            apply_backward(s, grad, dst, move |x, g| {
                if x < -three {
                    T::zero()
                } else if x <= three {
                    g * (x / three + half)
                } else {
                    g
                }
            })
        }
        // As PyTorch's derivatives: sqrt and rsqrt from the output, the others from the input.
        Unary::Sqrt => apply_backward(s, grad, dst, |y, g| g / (T::of(2.0) * y)),
        Unary::Rsqrt => apply_backward(s, grad, dst, |y, g| T::of(-0.5) * g * (y * y * y)),
        Unary::Cos => apply_backward(s, grad, dst, |x, g| g * -x.sin()),
        Unary::Sin => apply_backward(s, grad, dst, |x, g| g * x.cos()),
        Unary::Silu => silu_backward(s, grad, dst),
        Unary::Abs => apply_backward(s, grad, dst, |x, g| {
            if x > T::zero() {
                g
            } else if x < T::zero() {
                -g
            } else {
                T::zero()
            }
        }),
    }
}

/// `op(a, b)` of one pair.
#[inline(always)]
fn apply<T: Float>(op: Binary, a: T, b: T) -> T {
    match op {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
    }
}

pub fn unary(op: Unary, x: View<'_>, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), op.name(), T => forward_kernel::<T>(op, x.slice::<T>()?, out.slice_mut::<T>()?));
    Ok(())
}

pub fn unary_backward(op: Unary, saved: Option<View<'_>>, grad: View<'_>, out: View<'_>) -> Result<()> {
    let in_place = out.same(grad);
    with_float!(grad.dtype(), op.name(), T => {
        let dst = out.slice_mut::<T>()?;
        match (saved, in_place) {
            (Some(s), true) => backward_kernel(op, s.slice::<T>()?, None, dst),
            (Some(s), false) => backward_kernel(op, s.slice::<T>()?, Some(grad.slice::<T>()?), dst),
            (None, true) => dst.iter_mut().for_each(|g| *g = -*g),
            (None, false) => par_map(grad.slice::<T>()?, dst, |g| -g),
        }
    });
    Ok(())
}

pub fn affine(x: View<'_>, scale: f64, shift: f64, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), "affine", T => {
        let (a, b) = (T::of(scale), T::of(shift));
        par_map(x.slice::<T>()?, out.slice_mut::<T>()?, move |v| v * a + b)
    });
    Ok(())
}

pub fn binary(op: Binary, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
    let shape = out.shape();
    with_float!(a.dtype(), op.name(), T => {
        let dst = out.slice_mut::<T>()?;
        if a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous() {
            par_zip(a.slice::<T>()?, b.slice::<T>()?, dst, move |x, y| apply(op, x, y));
        } else if repeats_along_rows(&a, &b, shape) {
            // b repeats over a's rows (a bias, a position embedding): row by row, in parallel.
            par_rows(a.slice::<T>()?, b.slice::<T>()?, dst, move |x, y| apply(op, x, y));
        } else if repeats_along_rows(&b, &a, shape) {
            par_rows(b.slice::<T>()?, a.slice::<T>()?, dst, move |y, x| apply(op, x, y));
        } else {
            let la = broadcast_layout(a.layout(), shape);
            let lb = broadcast_layout(b.layout(), shape);
            let (sa, sb) = (a.storage::<T>()?, b.storage::<T>()?);
            let mut i = 0;
            for_each_offset_pair(&la, &lb, |oa, ob| {
                dst[i] = apply(op, sa[oa], sb[ob]);
                i += 1;
            });
        }
    });
    Ok(())
}

/// A comparison of two numbers, giving a bool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compare {
    Gt,
    Lt,
    Ge,
    Le,
    Eq,
    Ne,
}

impl Compare {
    pub fn name(self) -> &'static str {
        match self {
            Compare::Gt => "gt",
            Compare::Lt => "lt",
            Compare::Ge => "ge",
            Compare::Le => "le",
            Compare::Eq => "eq",
            Compare::Ne => "ne",
        }
    }

    #[inline(always)]
    fn holds<T: Float>(self, a: T, b: T) -> bool {
        match self {
            Compare::Gt => a > b,
            Compare::Lt => a < b,
            Compare::Ge => a >= b,
            Compare::Le => a <= b,
            Compare::Eq => a == b,
            Compare::Ne => a != b,
        }
    }
}

/// `out = op(a, b)` as bools over the broadcast shape of the contiguous bool `out`.
pub fn compare(op: Compare, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
    let shape = out.shape();
    let (la, lb) = (broadcast_layout(a.layout(), shape), broadcast_layout(b.layout(), shape));
    let dst = out.slice_mut::<bool>()?;
    with_float!(a.dtype(), op.name(), T => {
        let (sa, sb) = (a.storage::<T>()?, b.storage::<T>()?);
        let mut i = 0;
        for_each_offset_pair(&la, &lb, |oa, ob| {
            dst[i] = op.holds(sa[oa], sb[ob]);
            i += 1;
        });
    });
    Ok(())
}

/// `out = cond ? a : b` (PyTorch's `where`) over the broadcast shape of the contiguous `out`.
pub fn select(cond: View<'_>, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
    let shape = out.shape();
    let lc = broadcast_layout(cond.layout(), shape);
    let (la, lb) = (broadcast_layout(a.layout(), shape), broadcast_layout(b.layout(), shape));
    let c = cond.storage::<bool>()?;
    with_float!(a.dtype(), "where", T => {
        let (sa, sb) = (a.storage::<T>()?, b.storage::<T>()?);
        let dst = out.slice_mut::<T>()?;
        let mut i = 0;
        for_each_offset_triple(&lc, &la, &lb, |oc, oa, ob| {
            dst[i] = if c[oc] { sa[oa] } else { sb[ob] };
            i += 1;
        });
    });
    Ok(())
}

/// `out = min(max(x, lo), hi)` (x contiguous; NaN stays NaN, as PyTorch's clamp).
pub fn clamp(x: View<'_>, lo: f64, hi: f64, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), "clamp", T => {
        let (lo, hi) = (T::of(lo), T::of(hi));
        par_map(x.slice::<T>()?, out.slice_mut::<T>()?, move |v| if v < lo { lo } else if v > hi { hi } else { v });
    });
    Ok(())
}

/// `out = grad` where `x` lies inside [lo, hi] (`inclusive`: clamp's rule) or strictly inside
/// (hardtanh's), else 0; `out` may be `grad` itself.
pub fn clamp_backward(x: View<'_>, lo: f64, hi: f64, inclusive: bool, grad: View<'_>, out: View<'_>) -> Result<()> {
    let in_place = out.same(grad);
    with_float!(x.dtype(), "clamp_backward", T => {
        let (lo, hi) = (T::of(lo), T::of(hi));
        let pass = move |v: T, g: T| {
            let inside = if inclusive { v >= lo && v <= hi } else { v > lo && v < hi };
            if inside { g } else { T::of(0.0) }
        };
        let dst = out.slice_mut::<T>()?;
        match in_place {
            true => apply_backward(x.slice::<T>()?, None, dst, pass),
            false => apply_backward(x.slice::<T>()?, Some(grad.slice::<T>()?), dst, pass),
        }
    });
    Ok(())
}

/// `out = x ^ exponent` (x contiguous), as PyTorch's `pow(x, scalar)`.
pub fn pow_scalar(x: View<'_>, exponent: f64, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), "pow", T => {
        let e = T::of(exponent);
        par_map(x.slice::<T>()?, out.slice_mut::<T>()?, move |v| v.powf(e));
    });
    Ok(())
}

/// `out = grad * exponent * x ^ (exponent - 1)` (0 for exponent 0), as PyTorch's pow backward;
/// `out` may be `grad` itself.
pub fn pow_scalar_backward(x: View<'_>, exponent: f64, grad: View<'_>, out: View<'_>) -> Result<()> {
    let in_place = out.same(grad);
    with_float!(x.dtype(), "pow_backward", T => {
        let (e, e1) = (T::of(exponent), T::of(exponent - 1.0));
        let zero = exponent == 0.0;
        let f = move |v: T, g: T| if zero { T::of(0.0) } else { g * e * v.powf(e1) };
        let dst = out.slice_mut::<T>()?;
        match in_place {
            true => apply_backward(x.slice::<T>()?, None, dst, f),
            false => apply_backward(x.slice::<T>()?, Some(grad.slice::<T>()?), dst, f),
        }
    });
    Ok(())
}

pub fn add_into(dst: View<'_>, src: View<'_>) -> Result<()> {
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
            let s = src.storage::<T>()?;
            let base = dst.storage_ptr() as *mut T;
            // Runs that follow one another in both (a channel slice's gradient, a sample a run) as
            // slices, so the additions vectorise; the same elements in the same order.
            for_each_run_pair(dst.layout(), src.layout(), |od, os, len| {
                // SAFETY: od..od + len are in-bounds element offsets of dst's storage (a run of
                // its layout), which nobody else is reading (Note [Storage aliasing]); the slice
                // lives for this run only.
                let d = unsafe { std::slice::from_raw_parts_mut(base.add(od), len) };
                d.iter_mut().zip(&s[os..os + len]).for_each(|(d, &v)| *d += v);
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// A contiguous f32 view of `data`.
    fn view<'a>(data: &'a mut [f32], layout: &'a crate::layout::Layout) -> View<'a> {
        // SAFETY: `data` outlives the view, is aligned for f32 and holds the layout's elements.
        unsafe {
            View::new(data.as_mut_ptr() as *mut u8, std::mem::size_of_val(data), crate::dtype::DType::F32, layout)
        }
    }

    /// sigmoid and silu in f32 (the vectorised exponential) against their f64 definitions, from
    /// the exponential's underflow to its overflow, on more values than one block and one parallel
    /// chunk; silu's backward the same in place over the gradient as into another buffer.
    #[test]
    fn sigmoid_and_silu_follow_their_definitions() {
        let n = 2 * PAR_CHUNK + 3 * SILU_BLOCK + 5;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 20011) as f32 / 20011.0 * 240.0 - 120.0).collect();
        let g: Vec<f32> = (0..n).map(|i| ((i * 104_729) % 997) as f32 / 997.0 - 0.5).collect();
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let close = |got: f32, want: f64, what: &str, x: f32| {
            // As PyTorch's formulas: once exp(-x) overflows f32 (x below -88.72), both are 0.
            if x < -88.73 {
                assert_eq!(got, 0.0, "{what}({x})");
                return;
            }
            let err = (f64::from(got) - want).abs();
            // Results below f32's normals (sigmoid under -87: exp(-x) overflows) count as 0.
            let tolerance = (4.0 * f64::from(f32::EPSILON) * want.abs()).max(f64::from(f32::MIN_POSITIVE));
            assert!(err <= tolerance, "{what}({x}) = {got}, want {want}");
        };
        let mut y = vec![0f32; n];
        forward_kernel(Unary::Sigmoid, &x, &mut y);
        x.iter().zip(&y).for_each(|(&x, &y)| close(y, sig(f64::from(x)), "sigmoid", x));
        forward_kernel(Unary::Silu, &x, &mut y);
        x.iter().zip(&y).for_each(|(&x, &y)| close(y, f64::from(x) * sig(f64::from(x)), "silu", x));
        let mut dx = vec![0f32; n];
        backward_kernel(Unary::Silu, &x, Some(&g), &mut dx);
        for ((&x, &g), &d) in x.iter().zip(&g).zip(&dx) {
            let (x64, s) = (f64::from(x), sig(f64::from(x)));
            let want = f64::from(g) * s * (1.0 + x64 * (1.0 - s));
            // Within a few units of the terms' size: PyTorch's formula rounds 1 - s, whose error
            // x multiplies (and the derivative has a root near x = -2.4).
            let scale = f64::from(g).abs() * s * (1.0 + x64.abs());
            assert!(
                (f64::from(d) - want).abs() <= 8.0 * f64::from(f32::EPSILON) * scale.max(1e-30),
                "silu'({x}) g {g}: {d}, want {want}"
            );
        }
        let mut over = g.clone();
        backward_kernel(Unary::Silu, &x, None, &mut over);
        assert_eq!(bits(&over), bits(&dx), "in place over the gradient");
    }

    /// A dtype the kernels do not compute in is refused naming the binary op.
    #[test]
    fn binary_ops_on_integers_are_refused_by_name() {
        let layout = crate::layout::Layout::contiguous(&[2]);
        let (mut a, mut b, mut out) = ([1i64, 2], [3i64, 4], [0i64; 2]);
        // SAFETY: each array outlives its view, is aligned for i64 and holds the layout's elements.
        let [a, b, out] = [&mut a, &mut b, &mut out]
            .map(|d| unsafe { View::new(d.as_mut_ptr() as *mut u8, 16, crate::dtype::DType::I64, &layout) });
        for (op, name) in [(Binary::Add, "add"), (Binary::Sub, "sub"), (Binary::Mul, "mul"), (Binary::Div, "div")] {
            match binary(op, a, b, out) {
                Err(crate::Error::DType(m)) => assert!(m.starts_with(&format!("{name} supports")), "{m}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    /// An operand that repeats along the other's rows (a bias, a position embedding; leading
    /// dimensions of size 1 or none) takes the row-by-row path, on either side and for every op,
    /// large enough to run in parallel; other broadcasts and empty tensors take the strided walk.
    /// Every route gives each element `op(a, b)` with a and b in their places.
    #[test]
    fn binary_ops_broadcast_rows_on_either_side() {
        use crate::layout::Layout;
        let rows = 2 * PAR_CHUNK / 48 + 7;
        // (full, part, whether part repeats along full's rows)
        let cases: [(Vec<usize>, Vec<usize>, bool); 5] = [
            (vec![rows, 3, 16], vec![3, 16], true),
            (vec![rows, 3, 16], vec![1, 1, 16], true),
            (vec![5, 3, 16], vec![1, 16], true),
            (vec![5, 3, 16], vec![5, 1, 16], false),
            (vec![4, 0, 16], vec![0, 16], false),
        ];
        for (full_shape, part_shape, rowwise) in cases {
            let (lf, lp) = (Layout::contiguous(&full_shape), Layout::contiguous(&part_shape));
            let (nf, np) = (lf.numel(), lp.numel());
            let mut full: Vec<f32> = (0..nf).map(|i| ((i * 37) % 101) as f32 / 8.0 - 6.0).collect();
            let mut part: Vec<f32> = (0..np).map(|i| ((i * 53) % 97) as f32 / 16.0 + 0.5).collect();
            let (vf, vp) = (view(&mut full, &lf), view(&mut part, &lp));
            assert_eq!(repeats_along_rows(&vf, &vp, &full_shape), rowwise, "{full_shape:?} {part_shape:?}");
            assert!(!repeats_along_rows(&vp, &vf, &full_shape), "{full_shape:?} {part_shape:?}");
            // The element of `part` that lines up with element i of `full`, broadcasting its size-1
            // dimensions and the missing leading ones.
            let part_of = |i: usize| {
                let (mut rest, mut at, mut stride) = (i, 0, 1);
                for k in (0..full_shape.len()).rev() {
                    let idx = rest % full_shape[k];
                    rest /= full_shape[k];
                    if let Some(&d) = (k + part_shape.len()).checked_sub(full_shape.len()).map(|j| &part_shape[j]) {
                        at += if d == 1 { 0 } else { idx * stride };
                        stride *= d;
                    }
                }
                at
            };
            for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div] {
                for part_first in [false, true] {
                    let mut out = vec![0.0f32; nf];
                    let lo = Layout::contiguous(&full_shape);
                    let (vf, vp, vo) = (view(&mut full, &lf), view(&mut part, &lp), view(&mut out, &lo));
                    let r = if part_first { binary(op, vp, vf, vo) } else { binary(op, vf, vp, vo) };
                    r.unwrap();
                    for (i, &got) in out.iter().enumerate() {
                        let (f, p) = (full[i], part[part_of(i)]);
                        let want = if part_first { apply(op, p, f) } else { apply(op, f, p) };
                        assert_eq!(got.to_bits(), want.to_bits(), "{full_shape:?} {part_shape:?} {op:?} at {i}");
                    }
                }
            }
        }
    }

    /// Neg's gradient is the negated gradient on every route: with or without a saved tensor (the op
    /// saves none; the kernel takes one as any unary does), written over the gradient or apart.
    #[test]
    fn neg_backward_negates_the_gradient_whatever_is_saved() {
        let layout = crate::layout::Layout::contiguous(&[3]);
        let (mut saved, mut out) = ([5.0f32, -6.0, 7.0], [0.0f32; 3]);
        for with_saved in [false, true] {
            for in_place in [false, true] {
                let mut grad = [1.0f32, -2.0, 0.5];
                let s = with_saved.then(|| view(&mut saved, &layout));
                let g = view(&mut grad, &layout);
                let o = if in_place { g } else { view(&mut out, &layout) };
                unary_backward(Unary::Neg, s, g, o).unwrap();
                let got = if in_place { grad } else { out };
                assert_eq!(got, [-1.0, 2.0, -0.5], "saved {with_saved}, in place {in_place}");
            }
        }
    }

    /// The f32 slices of GELU (forward, with its derivative, backward over either operand) and exp run
    /// `memfit-kernels`' vectorised math for the process's instruction set, chunked and in parallel as
    /// they may be: every element has the kernels' bits, which the scalar formulas (the f64 path) do
    /// not all share.
    #[test]
    fn f32_slices_run_the_vectorised_math() {
        // Parallel chunks, and a last one with a tail shorter than any vector.
        let n = 2 * PAR_CHUNK + 5;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 / n as f32 - 0.5) * 12.0).collect();
        let g: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let isa = Isa::active();
        let (mut want, mut got) = (vec![0.0f32; n], vec![0.0f32; n]);

        math::gelu(isa, &x, &mut want);
        gelu_slice(&x, &mut got);
        assert_eq!(bits(&got), bits(&want), "gelu_slice");
        assert!(x.iter().zip(&want).any(|(&x, &w)| gelu_erf(x).to_bits() != w.to_bits()), "the scalar GELU differs");

        let mut want_d = vec![0.0f32; n];
        math::gelu_with_derivative(isa, &x, &mut want, &mut want_d);
        let mut xd = x.clone();
        gelu_with_derivative_slice(&mut got, &mut xd);
        assert_eq!((bits(&got), bits(&xd)), (bits(&want), bits(&want_d)), "gelu_with_derivative_slice");

        math::gelu_backward(isa, &x, &g, &mut want);
        gelu_backward_slice(&x, &g, &mut got);
        assert_eq!(bits(&got), bits(&want), "gelu_backward_slice");
        let mut over_grad = g.clone();
        gelu_backward_over_grad(&x, &mut over_grad);
        assert_eq!(bits(&over_grad), bits(&want), "gelu_backward_over_grad");
        let mut over_input = x.clone();
        gelu_backward_over_input(&g, &mut over_input);
        assert_eq!(bits(&over_input), bits(&want), "gelu_backward_over_input");
        assert!(
            x.iter().zip(&g).zip(&want).any(|((&x, &g), &w)| gelu_erf_backward(x, g).to_bits() != w.to_bits()),
            "the scalar GELU backward differs"
        );

        math::exp(isa, &x, &mut want);
        let mut e = x.clone();
        exp_in_place(&mut e);
        assert_eq!(bits(&e), bits(&want), "exp_in_place");
        assert!(x.iter().zip(&want).any(|(&x, &w)| x.exp().to_bits() != w.to_bits()), "the scalar exp differs");
    }
}
