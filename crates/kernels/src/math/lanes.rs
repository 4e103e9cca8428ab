//! The vector abstraction the element-wise math is written against once: [`Lanes`], implemented
//! per instruction set (AVX-512: 16 f32 lanes, AVX2/FMA: 8, portable: 1), and the loops that
//! stream slices through a kernel in whole vectors plus one partial (masked) tail vector.

use super::{Dual, Fused, Unary};

/// `N` f32 lanes and the operations the approximations need. Every operation has the semantics
/// of the x86 instruction it maps to, and the portable implementation reproduces them in plain
/// Rust (fused multiply-adds included), so all paths compute the same values.
///
/// # Safety
/// Every method may use instructions of the implementation's instruction set: call them only on
/// a CPU that supports it (the entry points check [`crate::Isa::is_supported`] first).
pub(super) trait Lanes: Copy {
    /// Lanes per vector.
    const N: usize;
    /// The result of a lane-wise comparison.
    type Mask: Copy;

    unsafe fn splat(v: f32) -> Self;
    /// Reads `N` elements from `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// Reads the first `n < N` elements from `p` (touching no memory past them); the other lanes
    /// are zero.
    unsafe fn load_partial(p: *const f32, n: usize) -> Self;
    /// Writes `N` elements to `p`.
    unsafe fn store(self, p: *mut f32);
    /// Writes the first `n < N` lanes to `p` (touching no memory past them).
    unsafe fn store_partial(self, p: *mut f32, n: usize);
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    /// `self * b + c`, rounded once.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// `self * b - c`, rounded once.
    unsafe fn mul_sub(self, b: Self, c: Self) -> Self;
    /// `|self|` (clears the sign bit, NaN stays NaN).
    unsafe fn abs(self) -> Self;
    /// `if self < b { self } else { b }` (x86 `minps`): `b` when either is NaN, so
    /// `splat(c).min(x)` keeps a NaN `x`.
    unsafe fn min(self, b: Self) -> Self;
    /// `if self > b { self } else { b }` (x86 `maxps`): `b` when either is NaN.
    unsafe fn max(self, b: Self) -> Self;
    /// `self < b` (false when either is NaN).
    unsafe fn lt(self, b: Self) -> Self::Mask;
    /// `if m { t } else { f }` lane-wise.
    unsafe fn select(m: Self::Mask, t: Self, f: Self) -> Self;
    /// `p(self) / d(self)`, polynomials with coefficients in increasing degree, evaluated in f64
    /// (Horner's rule) and rounded once to f32.
    unsafe fn ratio<const A: usize, const B: usize>(self, p: &[f64; A], d: &[f64; B]) -> Self;
    /// `self * 2^n` for integral `n` in `[-252, 254]`, rounded once (so a subnormal result is
    /// rounded correctly); NaN in `self` or `n` gives NaN.
    unsafe fn ldexp(self, n: Self) -> Self;
}

/// `y[i] = K(x[i])` for `i < n`. `y` may equal `x` (in place); they must not overlap otherwise.
///
/// # Safety
/// `x` is readable and `y` writable for `n` elements; the CPU supports `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn map_unary<V: Lanes, K: Unary>(n: usize, x: *const f32, y: *mut f32) {
    if x == y.cast_const() {
        // One pointer, so the compiler needs no overlap check (which would send an in-place
        // call of the portable path down its unvectorized loop).
        unary_loop::<V, K>(n, y.cast_const(), y)
    } else {
        unary_loop::<V, K>(n, x, y)
    }
}

#[inline(always)]
unsafe fn unary_loop<V: Lanes, K: Unary>(n: usize, x: *const f32, y: *mut f32) {
    let mut i = 0;
    while i + V::N <= n {
        K::apply(V::load(x.add(i))).store(y.add(i));
        i += V::N;
    }
    if i < n {
        K::apply(V::load_partial(x.add(i), n - i)).store_partial(y.add(i), n - i);
    }
}

/// `(y[i], d[i]) = K(x[i])` for `i < n`. `d` may equal `x` (the derivative over its input);
/// otherwise no two ranges overlap.
///
/// # Safety
/// `x` is readable and `y`, `d` writable for `n` elements; the CPU supports `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn map_dual<V: Lanes, K: Dual>(n: usize, x: *const f32, y: *mut f32, d: *mut f32) {
    let mut i = 0;
    while i + V::N <= n {
        let (a, b) = K::apply(V::load(x.add(i)));
        a.store(y.add(i));
        b.store(d.add(i));
        i += V::N;
    }
    if i < n {
        let (a, b) = K::apply(V::load_partial(x.add(i), n - i));
        a.store_partial(y.add(i), n - i);
        b.store_partial(d.add(i), n - i);
    }
}

/// `out[i] = K(x[i], g[i])` for `i < n`. `out` may equal `g` or `x` (in place); otherwise no
/// range overlaps `out`.
///
/// # Safety
/// `x`, `g` are readable and `out` writable for `n` elements; the CPU supports `V`'s instruction
/// set.
#[inline(always)]
pub(super) unsafe fn map_fused<V: Lanes, K: Fused>(n: usize, x: *const f32, g: *const f32, out: *mut f32) {
    if g == out.cast_const() {
        // In place: one pointer (see `map_unary`).
        fused_loop::<V, K>(n, x, out.cast_const(), out)
    } else {
        fused_loop::<V, K>(n, x, g, out)
    }
}

#[inline(always)]
unsafe fn fused_loop<V: Lanes, K: Fused>(n: usize, x: *const f32, g: *const f32, out: *mut f32) {
    let mut i = 0;
    while i + V::N <= n {
        K::apply(V::load(x.add(i)), V::load(g.add(i))).store(out.add(i));
        i += V::N;
    }
    if i < n {
        let r = n - i;
        K::apply(V::load_partial(x.add(i), r), V::load_partial(g.add(i), r)).store_partial(out.add(i), r);
    }
}
