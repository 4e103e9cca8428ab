//! The AVX2/FMA micro-kernel: a 6 x 16 f32 tile in 12 ymm accumulators; each step loads two
//! vectors of B and broadcasts six elements of A.

use super::{MicroKernel, Start};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Adds what the tile starts from to the accumulators (C's own values, or a bias row under every
/// row), then stores them into C (a macro, so the accumulators stay in registers).
macro_rules! store {
    ($lo:ident, $hi:ident, $c:expr, $rs_c:expr, $start:expr) => {
        match $start {
            Start::Zero => {}
            Start::Accumulate => {
                for i in 0..MR {
                    let p = $c.offset(i as isize * $rs_c);
                    $lo[i] = _mm256_add_ps($lo[i], _mm256_loadu_ps(p));
                    $hi[i] = _mm256_add_ps($hi[i], _mm256_loadu_ps(p.add(8)));
                }
            }
            Start::Bias(row) => {
                let (r0, r1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
                for i in 0..MR {
                    $lo[i] = _mm256_add_ps($lo[i], r0);
                    $hi[i] = _mm256_add_ps($hi[i], r1);
                }
            }
        }
        for i in 0..MR {
            let p = $c.offset(i as isize * $rs_c);
            _mm256_storeu_ps(p, $lo[i]);
            _mm256_storeu_ps(p.add(8), $hi[i]);
        }
    };
}

const MR: usize = 6;
const NR: usize = 16;

#[cfg(target_arch = "x86_64")]
pub(crate) const F32: MicroKernel<f32> = MicroKernel {
    mr: MR,
    nr: NR,
    run: run_checked,
    run_direct: Some(run_direct_checked),
    pack_lines: Some(super::transpose::pack_lines_checked),
    b_in_place: false,
};
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const F32: MicroKernel<f32> = super::portable::kernel::<f32>();

/// # Safety
/// As [`super::MicroKernelFn`]; only handed out when the CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_checked(
    kc: usize,
    a: *const f32,
    lda: isize,
    b: *const f32,
    ldb: isize,
    c: *mut f32,
    rs_c: isize,
    start: Start<f32>,
) {
    run(kc, a, lda, b, ldb, c, rs_c, start)
}

/// # Safety
/// As [`super::MicroKernelDirectFn`]; only handed out when the CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_direct_checked(
    kc: usize,
    a: *const f32,
    lda: isize,
    b: *const f32,
    ldb: isize,
    c: *mut f32,
    rs_c: isize,
    start: Start<f32>,
) {
    run_direct(kc, a, lda, b, ldb, c, rs_c, start)
}

/// The same tile with A read in place (row stride `lda`, unit column stride) instead of packed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_direct(
    kc: usize,
    a: *const f32,
    lda: isize,
    mut b: *const f32,
    ldb: isize,
    c: *mut f32,
    rs_c: isize,
    start: Start<f32>,
) {
    let mut lo = [_mm256_setzero_ps(); MR];
    let mut hi = [_mm256_setzero_ps(); MR];
    let rows: [*const f32; MR] = std::array::from_fn(|i| a.offset(i as isize * lda));
    for p in 0..kc {
        let b0 = _mm256_loadu_ps(b);
        let b1 = _mm256_loadu_ps(b.add(8));
        for i in 0..MR {
            let ai = _mm256_broadcast_ss(&*rows[i].add(p));
            lo[i] = _mm256_fmadd_ps(ai, b0, lo[i]);
            hi[i] = _mm256_fmadd_ps(ai, b1, hi[i]);
        }
        b = b.offset(ldb);
    }
    store!(lo, hi, c, rs_c, start);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    kc: usize,
    mut a: *const f32,
    lda: isize,
    mut b: *const f32,
    ldb: isize,
    c: *mut f32,
    rs_c: isize,
    start: Start<f32>,
) {
    let mut lo = [_mm256_setzero_ps(); MR];
    let mut hi = [_mm256_setzero_ps(); MR];
    for _ in 0..kc {
        let b0 = _mm256_loadu_ps(b);
        let b1 = _mm256_loadu_ps(b.add(8));
        for i in 0..MR {
            let ai = _mm256_broadcast_ss(&*a.add(i));
            lo[i] = _mm256_fmadd_ps(ai, b0, lo[i]);
            hi[i] = _mm256_fmadd_ps(ai, b1, hi[i]);
        }
        a = a.offset(lda);
        b = b.offset(ldb);
    }
    store!(lo, hi, c, rs_c, start);
}
