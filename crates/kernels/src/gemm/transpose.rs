//! Packing of an operand whose lines are contiguous along the depth (a transposed view, such as
//! the weight `W[out, in]` read as `W^T` by `x W^T`): 8 x 8 blocks transposed in AVX registers, then
//! one 4 x 8 block for a panel's next four lines (the AVX-512 tile's 12 = 8 + 4, the AVX2 tile's
//! 6 = 4 + 2), shared by the AVX2 and AVX-512 levels.

/// Packs `len` lines of `depth` contiguous elements (line stride `ls`) into panels of `panel`
/// lines `stride` apart, as `gemm::pack` does for this layout: `out[p * stride + d * panel + l]`,
/// zero past `len`.
///
/// # Safety
/// As `gemm::pack`; only called when the CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn pack_lines_checked(
    src: *const f32,
    ls: isize,
    len: usize,
    depth: usize,
    panel: usize,
    stride: usize,
    out: *mut f32,
) {
    pack_lines(src, ls, len, depth, panel, stride, out)
}

/// The 8 x 8 transpose in AVX registers: lane i of result j is lane j of row i.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_lines(src: *const f32, ls: isize, len: usize, depth: usize, panel: usize, stride: usize, out: *mut f32) {
    use std::arch::x86_64::*;
    for p0 in (0..len).step_by(panel) {
        let lines = panel.min(len - p0);
        let dst = out.add(p0 / panel * stride);
        let src = src.offset(p0 as isize * ls);
        let (full_lines, full_depth) = (lines - lines % 8, depth - depth % 8);
        for l0 in (0..full_lines).step_by(8) {
            let row = |i: usize| src.offset((l0 + i) as isize * ls);
            for d0 in (0..full_depth).step_by(8) {
                let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(row(i).add(d0)));
                let cols = transpose8(r);
                for (j, col) in cols.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add((d0 + j) * panel + l0), col);
                }
            }
            for d in full_depth..depth {
                for i in 0..8 {
                    *dst.add(d * panel + l0 + i) = *row(i).add(d);
                }
            }
        }
        if lines - full_lines >= 4 {
            // Four more lines: 4 x 8 blocks, each depth step's four elements one 128-bit store.
            let l0 = full_lines;
            let row = |i: usize| src.offset((l0 + i) as isize * ls);
            for d0 in (0..full_depth).step_by(8) {
                let r: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(row(i).add(d0)));
                let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                // Depth steps j (low half) and j + 4 (high half) of the four lines.
                let s = [
                    _mm256_shuffle_ps::<0x44>(t0, t2),
                    _mm256_shuffle_ps::<0xEE>(t0, t2),
                    _mm256_shuffle_ps::<0x44>(t1, t3),
                    _mm256_shuffle_ps::<0xEE>(t1, t3),
                ];
                for (j, sj) in s.into_iter().enumerate() {
                    _mm_storeu_ps(dst.add((d0 + j) * panel + l0), _mm256_castps256_ps128(sj));
                    _mm_storeu_ps(dst.add((d0 + j + 4) * panel + l0), _mm256_extractf128_ps::<1>(sj));
                }
            }
            for d in full_depth..depth {
                for i in 0..4 {
                    *dst.add(d * panel + l0 + i) = *row(i).add(d);
                }
            }
        }
        let done = if lines - full_lines >= 4 { full_lines + 4 } else { full_lines };
        for l in done..lines {
            let row = src.offset(l as isize * ls);
            for d in 0..depth {
                *dst.add(d * panel + l) = *row.add(d);
            }
        }
        for d in 0..depth {
            for l in lines..panel {
                *dst.add(d * panel + l) = 0.0;
            }
        }
    }
}
