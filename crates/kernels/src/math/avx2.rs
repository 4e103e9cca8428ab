//! The AVX2/FMA element-wise path: [`Lanes`] over 8 f32 in a ymm register, the tail through
//! `vmaskmovps` (masked lanes are neither read nor written), and the `#[target_feature]` entry
//! points the dispatcher calls once the CPU is known to support AVX2 and FMA.

use super::lanes::{map_dual, map_fused, map_unary, Lanes};
use super::{Dual, Fused, Unary};
use std::arch::x86_64::*;

/// Eight f32 lanes.
#[derive(Clone, Copy)]
pub(super) struct F32x8(__m256);

/// `TAIL[8 - n..16 - n]` is the lane mask of the first `n` lanes.
static TAIL: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

/// The mask of the first `n <= 8` lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn first(n: usize) -> __m256i {
    _mm256_loadu_si256(TAIL.as_ptr().add(8 - n) as *const __m256i)
}

/// `2^k` for `k` in `[-126, 127]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pow2(k: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))))
}

/// `c[0] + c[1] u + ...` in f64 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn horner_f64(u: __m256d, c: &[f64]) -> __m256d {
    let mut s = _mm256_set1_pd(c[c.len() - 1]);
    for &ci in c[..c.len() - 1].iter().rev() {
        s = _mm256_fmadd_pd(s, u, _mm256_set1_pd(ci));
    }
    s
}

impl Lanes for F32x8 {
    const N: usize = 8;
    type Mask = __m256;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn splat(v: f32) -> Self {
        F32x8(_mm256_set1_ps(v))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(p: *const f32) -> Self {
        F32x8(_mm256_loadu_ps(p))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self {
        F32x8(_mm256_maskload_ps(p, first(n)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store_partial(self, p: *mut f32, n: usize) {
        _mm256_maskstore_ps(p, first(n), self.0)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add(self, b: Self) -> Self {
        F32x8(_mm256_add_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sub(self, b: Self) -> Self {
        F32x8(_mm256_sub_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul(self, b: Self) -> Self {
        F32x8(_mm256_mul_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        F32x8(_mm256_fmadd_ps(self.0, b.0, c.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul_sub(self, b: Self, c: Self) -> Self {
        F32x8(_mm256_fmsub_ps(self.0, b.0, c.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn abs(self) -> Self {
        F32x8(_mm256_andnot_ps(_mm256_set1_ps(-0.0), self.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn min(self, b: Self) -> Self {
        F32x8(_mm256_min_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max(self, b: Self) -> Self {
        F32x8(_mm256_max_ps(self.0, b.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn lt(self, b: Self) -> __m256 {
        _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, b.0)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn select(m: __m256, t: Self, f: Self) -> Self {
        F32x8(_mm256_blendv_ps(f.0, t.0, m))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn ratio<const A: usize, const B: usize>(self, p: &[f64; A], d: &[f64; B]) -> Self {
        let half = |u: __m128| {
            let u = _mm256_cvtps_pd(u);
            _mm256_cvtpd_ps(_mm256_div_pd(horner_f64(u, p), horner_f64(u, d)))
        };
        let lo = half(_mm256_castps256_ps128(self.0));
        let hi = half(_mm256_extractf128_ps::<1>(self.0));
        F32x8(_mm256_set_m128(hi, lo))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn ldexp(self, n: Self) -> Self {
        // Two exact steps of at most 2^127 each, so only the last one rounds.
        let n = _mm256_cvtps_epi32(n.0);
        let half = _mm256_srai_epi32::<1>(n);
        let rest = _mm256_sub_epi32(n, half);
        F32x8(_mm256_mul_ps(_mm256_mul_ps(self.0, pow2(half)), pow2(rest)))
    }
}

/// # Safety
/// As [`map_unary`]; the CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn unary<K: Unary>(n: usize, x: *const f32, y: *mut f32) {
    map_unary::<F32x8, K>(n, x, y)
}

/// # Safety
/// As [`map_dual`]; the CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dual<K: Dual>(n: usize, x: *const f32, y: *mut f32, d: *mut f32) {
    map_dual::<F32x8, K>(n, x, y, d)
}

/// # Safety
/// As [`map_fused`]; the CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fused<K: Fused>(n: usize, x: *const f32, g: *const f32, out: *mut f32) {
    map_fused::<F32x8, K>(n, x, g, out)
}
