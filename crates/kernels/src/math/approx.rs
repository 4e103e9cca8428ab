//! The approximations behind the element-wise kernels, written once against [`Lanes`] so every
//! instruction set evaluates the same formulas with the same constants.
//!
//! * `exp(a)`: `a = n ln2 + r` with `n = round(a log2 e)` and `|r| <= ln2/2` (Cody–Waite with
//!   fused multiply-adds, so `a - n ln2_hi` is exact), `e^r` by a degree-6 polynomial
//!   (relative error 4e-9 with f32 coefficients), then `* 2^n` in one rounding (correct overflow
//!   to inf, gradual underflow to subnormals and 0). An optional low part of the argument carries
//!   the bits of `-x²/2` that do not fit in one f32.
//! * The normal tail `Q(u) = Φ(-u) = erfc(u/√2)/2`, `u = |x|`, is `e^{-u²/2} · R(u)` with `R` a
//!   (4, 5) rational minimax approximation of the scaled Mills ratio `Q(u) e^{u²/2}` on `[0, 16]`
//!   (relative error 7.2e-9). `R` is evaluated in f64 and rounded once (0.6 ulp worst, against
//!   4 ulp for the same Horner steps in f32: the steps' roundings add up for large `u`), and
//!   `-u²/2` is split exactly into two f32 for the exponential, so `Q` keeps its relative
//!   accuracy all the way down to the subnormals; the same formula serves every `u` (no
//!   branch). Then `Φ(x) = Q(|x|)` for `x < 0`, else `1 - Q(|x|)`, and
//!   `φ(x) = e^{-x²/2}/√(2π)`: GELU is `x Φ(x)`, its derivative `Φ(x) + x φ(x)`; for `x < 0`
//!   both are products of the tail (never `1 + erf`, which cancels), with the `2^n` of the
//!   exponential applied last so a normal result is never rounded as a subnormal on the way.

use super::lanes::Lanes;

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `1.5 * 2^23`: adding and subtracting it rounds an f32 of magnitude below `2^22` to an integer.
const ROUND: f32 = 12_582_912.0;
/// `ln 2` rounded to f32, and the rest (`ln 2 - LN2_HI`).
const LN2_HI: f32 = std::f32::consts::LN_2;
const LN2_LO: f32 = -1.904_654_2e-9;
/// `e^r ≈ 1 + r + r² (c2 + c3 r + c4 r² + c5 r³ + c6 r⁴)` on `|r| <= ln2/2` (relative minimax fit).
const EXP_POLY: [f32; 5] = [0.499_999_94, 0.166_665_21, 0.041_668_39, 0.008_368_716, 0.001_381_459_8];
/// Arguments above this give inf, below `EXP_MIN` 0 (the clamp keeps `n` in range).
const EXP_MAX: f32 = 89.0;
const EXP_MIN: f32 = -104.0;

/// `|x|` is clamped to this before the tail is evaluated: `Q(16) = 6e-58` is below the smallest
/// subnormal, and the clamp keeps `±inf` from making `inf * 0`.
const U_MAX: f32 = 16.0;
/// The scaled-Mills-ratio rational `R(u) = P(u) / D(u)`, coefficients in increasing degree (relative
/// minimax on `[0, 16]`, error 7.2e-9; evaluated in f64).
const MILLS_P: [f64; 5] = [
    0.500_000_003_527_806_6,
    0.441_121_618_346_808_35,
    0.185_338_962_031_469_8,
    0.041_345_034_407_928_6,
    0.004_222_626_014_149_224,
];
const MILLS_D: [f64; 6] = [
    1.0,
    1.680_128_293_593_006_4,
    1.211_220_768_495_801_8,
    0.475_026_408_673_207_6,
    0.103_642_167_537_597_17,
    0.010_584_455_984_878_274,
];
/// `1 / √(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `c[0] + c[1] x + ... + c[K-1] x^(K-1)` by Horner's rule in fused multiply-adds.
#[inline(always)]
unsafe fn horner<V: Lanes, const K: usize>(x: V, c: &[f32; K]) -> V {
    let mut s = V::splat(c[K - 1]);
    for &ci in c[..K - 1].iter().rev() {
        s = s.mul_add(x, V::splat(ci));
    }
    s
}

/// `e^(a + lo) = s * 2^n` for `a` in `[-128, EXP_MAX]` (or NaN) and `|lo| <= ulp(a)` (`lo` only
/// refines the reduced argument): `s` in `[0.7, 1.42]`, `n` integral in `[-185, 129]`. Callers
/// apply `2^n` last, so a product that ends up normal is rounded as a normal number even when
/// `e^a` alone would be subnormal.
#[inline(always)]
unsafe fn exp_parts<V: Lanes>(a: V, lo: V) -> (V, V) {
    let round = V::splat(ROUND);
    let n = a.mul_add(V::splat(LOG2E), round).sub(round);
    // Exact: for |a| >= 1/2 both a and n ln2_hi are multiples of 2^-24 and their difference is
    // below 1/2, so it fits in 24 bits; for smaller |a|, n = 0.
    let r = n.mul_add(V::splat(-LN2_HI), a);
    let r = r.add(n.mul_add(V::splat(-LN2_LO), lo));
    let s = horner(r, &EXP_POLY);
    let one = V::splat(1.0);
    (s.mul_add(r, one).mul_add(r, one), n)
}

/// `e^x`, every f32 `x`: inf above 88.72, 0 below -103.97, subnormals in between, NaN kept.
#[inline(always)]
pub(super) unsafe fn exp<V: Lanes>(x: V) -> V {
    // `splat(c).min(x)` / `.max(x)` return a NaN x unchanged.
    let a = V::splat(EXP_MIN).max(V::splat(EXP_MAX).min(x));
    let (s, n) = exp_parts(a, V::splat(0.0));
    s.ldexp(n)
}

/// What GELU and its derivative share, at `u = min(|x|, U_MAX)`: `e^{-u²/2} = s 2^n` and the
/// scaled Mills ratio `m = R(u)`, so `Q(u) = (s m) 2^n`.
#[derive(Clone, Copy)]
struct Tail<V> {
    u: V,
    s: V,
    n: V,
    m: V,
}

#[inline(always)]
unsafe fn tail<V: Lanes>(x: V) -> Tail<V> {
    let u = V::splat(U_MAX).min(x.abs());
    // -u²/2 = hi + lo exactly (u * -0.5 is exact; the fused multiply-subtract recovers the
    // rounding error of the product).
    let v = u.mul(V::splat(-0.5));
    let hi = u.mul(v);
    let lo = u.mul_sub(v, hi);
    let (s, n) = exp_parts(hi, lo);
    let m = u.ratio(&MILLS_P, &MILLS_D);
    Tail { u, s, n, m }
}

/// `Φ(x)` (the standard normal CDF), for tests of the tail.
#[cfg(test)]
#[inline(always)]
pub(super) unsafe fn normal_cdf<V: Lanes>(x: V) -> V {
    let t = tail(x);
    let q = t.s.mul(t.m).ldexp(t.n);
    V::select(x.lt(V::splat(0.0)), q, V::splat(1.0).sub(q))
}

/// GELU `x Φ(x)` from the shared tail.
#[inline(always)]
unsafe fn gelu_from<V: Lanes>(x: V, t: Tail<V>) -> V {
    let one = V::splat(1.0);
    let neg = x.lt(V::splat(0.0));
    // x < 0: x Q(|x|) = (s (x m)) 2^n, with x clamped like u (so -inf gives -0).
    // x >= 0 (and NaN): x (1 - Q(x)) with Q(x) = (s m) 2^n.
    let f = V::select(neg, V::splat(-U_MAX).max(x), one);
    let q = t.s.mul(f.mul(t.m)).ldexp(t.n);
    V::select(neg, q, x.mul(one.sub(q)))
}

/// GELU's derivative `Φ(x) + x φ(x)` from the shared tail.
#[inline(always)]
unsafe fn derivative_from<V: Lanes>(x: V, t: Tail<V>) -> V {
    // w = e^{-u²/2} (u/√(2π) - m) = |x| φ(x) - Q(|x|): the derivative is 1 + w for x >= 0 and
    // -w for x < 0.
    let w = t.s.mul(t.u.mul_sub(V::splat(FRAC_1_SQRT_2PI), t.m)).ldexp(t.n);
    V::select(x.lt(V::splat(0.0)), V::splat(0.0).sub(w), V::splat(1.0).add(w))
}

/// `gelu(x)`.
#[inline(always)]
pub(super) unsafe fn gelu<V: Lanes>(x: V) -> V {
    gelu_from(x, tail(x))
}

/// `(gelu(x), gelu'(x))`.
#[inline(always)]
pub(super) unsafe fn gelu_with_derivative<V: Lanes>(x: V) -> (V, V) {
    let t = tail(x);
    (gelu_from(x, t), derivative_from(x, t))
}

/// `g * gelu'(x)` (bit for bit `g` times the derivative of [`gelu_with_derivative`]).
#[inline(always)]
pub(super) unsafe fn gelu_backward<V: Lanes>(x: V, g: V) -> V {
    g.mul(derivative_from(x, tail(x)))
}
