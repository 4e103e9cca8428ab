//! The AVX-512 micro-kernel: a 12 x 32 f32 tile in 24 zmm accumulators; each step loads two
//! vectors of B and broadcasts twelve elements of A.

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
                    $lo[i] = _mm512_add_ps($lo[i], _mm512_loadu_ps(p));
                    $hi[i] = _mm512_add_ps($hi[i], _mm512_loadu_ps(p.add(16)));
                }
            }
            Start::Bias(row) => {
                let (r0, r1) = (_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)));
                for i in 0..MR {
                    $lo[i] = _mm512_add_ps($lo[i], r0);
                    $hi[i] = _mm512_add_ps($hi[i], r1);
                }
            }
        }
        for i in 0..MR {
            let p = $c.offset(i as isize * $rs_c);
            _mm512_storeu_ps(p, $lo[i]);
            _mm512_storeu_ps(p.add(16), $hi[i]);
        }
    };
}

const MR: usize = 12;
const NR: usize = 32;
/// Depth steps ahead that B's lines are fetched.
const B_AHEAD: isize = 8;

/// Asks for B's step `B_AHEAD` steps ahead (both of its lines; past the end is harmless: a
/// prefetch never faults).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_b(b: *const f32, ldb: isize) {
    let ahead = b.wrapping_offset(B_AHEAD * ldb) as *const i8;
    _mm_prefetch::<_MM_HINT_T0>(ahead);
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
}

/// Asks for the C tile the kernel stores at the end, while it computes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_tile(c: *mut f32, rs_c: isize) {
    for i in 0..MR {
        let row = c.wrapping_offset(i as isize * rs_c) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(row);
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(64));
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) const F32: MicroKernel<f32> = MicroKernel {
    mr: MR,
    nr: NR,
    run: run_checked,
    run_direct: Some(run_direct_checked),
    pack_lines: Some(super::transpose::pack_lines_checked),
    b_in_place: true,
};
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const F32: MicroKernel<f32> = super::portable::kernel::<f32>();

/// # Safety
/// As [`super::MicroKernelFn`]; only handed out when the CPU supports AVX-512F.
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
/// As [`super::MicroKernelDirectFn`]; only handed out when the CPU supports AVX-512F.
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
#[target_feature(enable = "avx512f")]
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
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    let rows: [*const f32; MR] = std::array::from_fn(|i| a.offset(i as isize * lda));
    prefetch_tile(c, rs_c);
    for p in 0..kc {
        prefetch_b(b, ldb);
        let b0 = _mm512_loadu_ps(b);
        let b1 = _mm512_loadu_ps(b.add(16));
        for i in 0..MR {
            let ai = _mm512_set1_ps(*rows[i].add(p));
            lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
            hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
        }
        b = b.offset(ldb);
    }
    store!(lo, hi, c, rs_c, start);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
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
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    prefetch_tile(c, rs_c);
    for _ in 0..kc {
        prefetch_b(b, ldb);
        let b0 = _mm512_loadu_ps(b);
        let b1 = _mm512_loadu_ps(b.add(16));
        for i in 0..MR {
            let ai = _mm512_set1_ps(*a.add(i));
            lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
            hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
        }
        a = a.offset(lda);
        b = b.offset(ldb);
    }
    store!(lo, hi, c, rs_c, start);
}
