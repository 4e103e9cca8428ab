//! The portable element-wise path: [`Lanes`] over one f32 in plain Rust, for any CPU. It mirrors
//! the x86 semantics of every operation — a fused multiply-add is evaluated in f64 (where the
//! product of two f32 is exact) and rounded to f32, `min`/`max` return the second operand on NaN,
//! `ldexp` rounds once — so it computes the same values as the SIMD paths (bit for bit on all
//! 2^32 inputs, as the exhaustive test checks).

use super::lanes::{map_dual, map_fused, map_unary, Lanes};
use super::{Dual, Fused, Unary};

/// One f32 lane.
#[derive(Clone, Copy)]
pub(super) struct F32x1(f32);

/// `a * b + c` with (practically) one rounding: the product is exact in f64, the sum is rounded
/// to f64 and then to f32 (a double rounding that differs from a true fused multiply-add only
/// when the f64 sum falls exactly halfway between two f32, which the approximations tolerate).
#[inline(always)]
fn fma(a: f32, b: f32, c: f64) -> f32 {
    (a as f64 * b as f64 + c) as f32
}

/// `2^k` for `k` in `[-126, 127]`.
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits((k.wrapping_add(127) as u32).wrapping_shl(23))
}

impl Lanes for F32x1 {
    const N: usize = 1;
    type Mask = bool;

    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        F32x1(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        F32x1(p.read())
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self {
        // One lane: a partial vector is empty (the drivers never ask for one).
        F32x1(if n > 0 { p.read() } else { 0.0 })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        p.write(self.0)
    }
    #[inline(always)]
    unsafe fn store_partial(self, p: *mut f32, n: usize) {
        if n > 0 {
            p.write(self.0)
        }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        F32x1(self.0 + b.0)
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        F32x1(self.0 - b.0)
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        F32x1(self.0 * b.0)
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        F32x1(fma(self.0, b.0, c.0 as f64))
    }
    #[inline(always)]
    unsafe fn mul_sub(self, b: Self, c: Self) -> Self {
        F32x1(fma(self.0, b.0, -(c.0 as f64)))
    }
    #[inline(always)]
    unsafe fn abs(self) -> Self {
        F32x1(self.0.abs())
    }
    #[inline(always)]
    unsafe fn min(self, b: Self) -> Self {
        F32x1(if self.0 < b.0 { self.0 } else { b.0 })
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        F32x1(if self.0 > b.0 { self.0 } else { b.0 })
    }
    #[inline(always)]
    unsafe fn lt(self, b: Self) -> bool {
        self.0 < b.0
    }
    #[inline(always)]
    unsafe fn select(m: bool, t: Self, f: Self) -> Self {
        if m {
            t
        } else {
            f
        }
    }
    #[inline(always)]
    unsafe fn ratio<const A: usize, const B: usize>(self, p: &[f64; A], d: &[f64; B]) -> Self {
        let u = self.0 as f64;
        let horner = |c: &[f64]| c.iter().rev().fold(0.0, |s, &c| s * u + c);
        F32x1((horner(p) / horner(d)) as f32)
    }
    #[inline(always)]
    unsafe fn ldexp(self, n: Self) -> Self {
        // Two exact steps of at most 2^127 each, so only the last one rounds (`as` maps NaN to 0;
        // the NaN in `self` then survives).
        let n = n.0 as i32;
        let half = n >> 1;
        F32x1(self.0 * pow2(half) * pow2(n - half))
    }
}

/// # Safety
/// As [`map_unary`] (any CPU).
pub(super) unsafe fn unary<K: Unary>(n: usize, x: *const f32, y: *mut f32) {
    map_unary::<F32x1, K>(n, x, y)
}

/// # Safety
/// As [`map_dual`] (any CPU).
pub(super) unsafe fn dual<K: Dual>(n: usize, x: *const f32, y: *mut f32, d: *mut f32) {
    map_dual::<F32x1, K>(n, x, y, d)
}

/// # Safety
/// As [`map_fused`] (any CPU).
pub(super) unsafe fn fused<K: Fused>(n: usize, x: *const f32, g: *const f32, out: *mut f32) {
    map_fused::<F32x1, K>(n, x, g, out)
}
