//! The AVX-512 element-wise path: [`Lanes`] over 16 f32 in a zmm register, the tail through
//! masked loads and stores (masked lanes are neither read nor written), `vscalefps` for the
//! power-of-two scaling, and the `#[target_feature]` entry points the dispatcher calls once the
//! CPU is known to support AVX-512F.

use super::lanes::{map_dual, map_fused, map_unary, Lanes};
use super::{Dual, Fused, Unary};
use std::arch::x86_64::*;

/// Sixteen f32 lanes.
#[derive(Clone, Copy)]
pub(super) struct F32x16(__m512);

/// The mask of the first `n < 16` lanes.
#[inline(always)]
fn first(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// `c[0] + c[1] u + ...` in f64 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn horner_f64(u: __m512d, c: &[f64]) -> __m512d {
    let mut s = _mm512_set1_pd(c[c.len() - 1]);
    for &ci in c[..c.len() - 1].iter().rev() {
        s = _mm512_fmadd_pd(s, u, _mm512_set1_pd(ci));
    }
    s
}

impl Lanes for F32x16 {
    const N: usize = 16;
    type Mask = __mmask16;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn splat(v: f32) -> Self {
        F32x16(_mm512_set1_ps(v))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const f32) -> Self {
        F32x16(_mm512_loadu_ps(p))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self {
        F32x16(_mm512_maskz_loadu_ps(first(n), p))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_partial(self, p: *mut f32, n: usize) {
        _mm512_mask_storeu_ps(p, first(n), self.0)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn add(self, b: Self) -> Self {
        F32x16(_mm512_add_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sub(self, b: Self) -> Self {
        F32x16(_mm512_sub_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn mul(self, b: Self) -> Self {
        F32x16(_mm512_mul_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        F32x16(_mm512_fmadd_ps(self.0, b.0, c.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn mul_sub(self, b: Self, c: Self) -> Self {
        F32x16(_mm512_fmsub_ps(self.0, b.0, c.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn abs(self) -> Self {
        F32x16(_mm512_abs_ps(self.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn min(self, b: Self) -> Self {
        F32x16(_mm512_min_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn max(self, b: Self) -> Self {
        F32x16(_mm512_max_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn lt(self, b: Self) -> __mmask16 {
        _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, b.0)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn select(m: __mmask16, t: Self, f: Self) -> Self {
        F32x16(_mm512_mask_blend_ps(m, f.0, t.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn ratio<const A: usize, const B: usize>(self, p: &[f64; A], d: &[f64; B]) -> Self {
        let half = |u: __m256| {
            let u = _mm512_cvtps_pd(u);
            _mm512_cvtpd_ps(_mm512_div_pd(horner_f64(u, p), horner_f64(u, d)))
        };
        let lo = half(_mm512_castps512_ps256(self.0));
        let hi = half(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))));
        F32x16(_mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn ldexp(self, n: Self) -> Self {
        // One rounding, like the two exact steps of the other paths.
        F32x16(_mm512_scalef_ps(self.0, n.0))
    }
}

/// # Safety
/// As [`map_unary`]; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn unary<K: Unary>(n: usize, x: *const f32, y: *mut f32) {
    map_unary::<F32x16, K>(n, x, y)
}

/// # Safety
/// As [`map_dual`]; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn dual<K: Dual>(n: usize, x: *const f32, y: *mut f32, d: *mut f32) {
    map_dual::<F32x16, K>(n, x, y, d)
}

/// # Safety
/// As [`map_fused`]; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fused<K: Fused>(n: usize, x: *const f32, g: *const f32, out: *mut f32) {
    map_fused::<F32x16, K>(n, x, g, out)
}
