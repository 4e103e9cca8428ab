//! The CPU kernels' one door to GEMM: `memfit-kernels`' packed products for the process's
//! instruction set, on strided operands, plus the raw-pointer wrapper parallel kernels share.

use crate::dtype::Float;
use crate::elementwise::for_row_groups;
use memfit_kernels::gemm::{gemm, gemm_row_blocks, gemm_with_row_sums, MatMut, Start};

/// A strided matrix operand (the kernels crate's; one home for the idea).
pub(crate) use memfit_kernels::gemm::MatRef as Mat;
/// A right operand prepared once for several products (the kernels crate's).
pub(crate) use memfit_kernels::gemm::PreparedB;
/// Work (m*n*k) below which a product runs on one thread.
pub(crate) use memfit_kernels::gemm::PARALLEL_WORK as GEMM_PARALLEL_WORK;

/// A raw pointer that may cross into rayon tasks; each task writes a disjoint region.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: used only to hand disjoint output regions to parallel tasks.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: see above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The `len` elements from element `at`, for writing (a method, so a closure captures the
    /// whole `Send` wrapper).
    ///
    /// # Safety
    /// The elements must be inside the allocation, and nobody else may use them while the slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(self, at: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// `dst[m x n] (+)= a[m x k] @ b[k x n]`; `dst` row stride `dst_rs`, column stride 1.
/// `accumulate` adds to dst instead of overwriting it. Runs `memfit-kernels`' GEMM for the
/// process's instruction set on up to `threads` threads.
///
/// # Safety
/// All pointers must be valid for the given shapes and strides, and `dst` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    b: Mat<T>,
    threads: usize,
) {
    gemm_summing_into(m, n, k, dst, dst_rs, accumulate, a, b, threads, None)
}

/// As [`gemm_into`], and, when `row_sums` is given, adds each row of `a` to its sum there (`m`
/// values, each row's elements one at a time in order, read as `a` is packed): a weight-gradient
/// product `g^T x` gives the bias gradient, the column sums of `g`, on the way.
///
/// # Safety
/// As [`gemm_into`]; `row_sums` valid for `m` elements, overlapping no operand.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_summing_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    b: Mat<T>,
    threads: usize,
    row_sums: Option<*mut T>,
) {
    let (isa, c, start) = (memfit_kernels::Isa::active(), MatMut { ptr: dst, rs: dst_rs }, Start::adding(accumulate));
    match row_sums {
        Some(sums) => gemm_with_row_sums(isa, m, n, k, c, start, a, b, threads, sums),
        None => gemm(isa, m, n, k, c, start, a, b, threads),
    }
}

/// `dst[m x n] = a[m x k] @ b[k x n] + bias` (each row of `dst` plus the `n` values at `bias`, when
/// given; the bias is added tile by tile as the product writes `dst`); otherwise as [`gemm_into`].
///
/// # Safety
/// As [`gemm_into`]; `bias` must hold `n` elements.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_bias_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    bias: Option<*const T>,
    a: Mat<T>,
    b: Mat<T>,
    threads: usize,
) {
    let start = bias.map_or(Start::Zero, Start::Bias);
    gemm(memfit_kernels::Isa::active(), m, n, k, MatMut { ptr: dst, rs: dst_rs }, start, a, b, threads);
}

/// As [`gemm_bias_into`], with `a` given `block_rows` rows at a time by `a_block(r0, rows)` (which
/// may compute them into a scratch it owns) and `b` packed once for all the blocks
/// (`memfit_kernels::gemm::gemm_row_blocks`), on all the pool's threads.
///
/// # Safety
/// As [`gemm_into`], for every block `a_block` returns.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_row_blocks_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    bias: Option<*const T>,
    block_rows: usize,
    a_block: impl FnMut(usize, usize) -> Mat<T>,
    b: Mat<T>,
) {
    let c = MatMut { ptr: dst, rs: dst_rs };
    let threads = rayon::current_num_threads();
    let start = bias.map_or(Start::Zero, Start::Bias);
    gemm_row_blocks(memfit_kernels::Isa::active(), m, n, k, c, start, block_rows, a_block, b, threads);
}

/// Runs `f` with `b` [k x n] prepared once for several products `dst (+)= a_i @ b`
/// (`memfit_kernels::gemm::with_prepared_b`: packed whole when the kernels would pack it per
/// product), for the process's instruction set and the pool's threads; multiply with
/// [`prepared_gemm_into`].
///
/// # Safety
/// `b` must be valid for its shape and strides, and unchanged until `f` returns.
pub(crate) unsafe fn with_prepared_b<T: Float, R>(
    k: usize,
    n: usize,
    b: Mat<T>,
    f: impl FnOnce(&PreparedB<T>) -> R,
) -> R {
    memfit_kernels::gemm::with_prepared_b(memfit_kernels::Isa::active(), k, n, b, rayon::current_num_threads(), f)
}

/// `dst[m x n] (+)= a[m x k] @ b` with a prepared `b`; otherwise as [`gemm_into`].
///
/// # Safety
/// As [`gemm_into`].
pub(crate) unsafe fn prepared_gemm_into<T: Float>(
    b: &PreparedB<T>,
    m: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    threads: usize,
) {
    b.gemm(m, MatMut { ptr: dst, rs: dst_rs }, Start::adding(accumulate), a, threads);
}

/// Columns of a row that [`weight_grad_from_rows`] has computed at once (a multiple of every
/// micro-kernel's panel width), on the stack.
pub(crate) const ROW_RUN: usize = 256;

/// A weight gradient `dw[m x n] (+)= g_t[m x k] @ y[k x n]` (with `g_t`'s row sums added to
/// `row_sums`, when given, as [`gemm_summing_into`]) whose right operand `y` a fused op computes
/// row by row: `fill(r, j0, run)` writes columns `j0..j0 + run.len()` of row `r` (runs of at most
/// [`ROW_RUN`]; each (row, run) once, rows in parallel groups). Where the kernels would pack such
/// a `y`, the runs go from the stack straight into the packed layout in `buf` (no row-major copy
/// and no packing pass); otherwise into `buf` row-major, rows `rs` apart, and the product reads
/// them there. The same bits either way.
///
/// # Safety
/// `g_t` valid for `m x k`, `dw` for `m x n` (row stride `n`) and `row_sums` for `m`, none
/// overlapping `buf`; `buf` must hold `k` rows of `rs >= n` elements.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn weight_grad_from_rows<T: Float>(
    isa: memfit_kernels::Isa,
    m: usize,
    n: usize,
    k: usize,
    dw: *mut T,
    accumulate: bool,
    g_t: Mat<T>,
    row_sums: Option<*mut T>,
    buf: &mut [T],
    rs: usize,
    fill: impl Fn(usize, usize, &mut [T]) + Sync + Send,
) {
    debug_assert!(k == 0 || buf.len() >= (k - 1) * rs + n, "k rows of the buffer");
    let threads = rayon::current_num_threads();
    let c = MatMut { ptr: dw, rs: n as isize };
    let start = Start::adding(accumulate);
    match PreparedB::for_rows(isa, k, n, rs, buf.as_mut_ptr(), buf.len()) {
        Some(pb) => {
            for_row_groups(k, n, |r0, rows| {
                let mut run = [T::zero(); ROW_RUN];
                for r in r0..r0 + rows {
                    for j0 in (0..n).step_by(ROW_RUN) {
                        let run = &mut run[..ROW_RUN.min(n - j0)];
                        fill(r, j0, run);
                        // SAFETY: row r's runs start at multiples of ROW_RUN and end at one or
                        // at n; this task alone writes them.
                        unsafe { pb.write_row(r, j0, run) };
                    }
                }
            });
            match row_sums {
                Some(sums) => pb.gemm_with_row_sums(m, c, start, g_t, threads, sums),
                None => pb.gemm(m, c, start, g_t, threads),
            }
        }
        None => {
            let rows = SendPtr(buf.as_mut_ptr());
            for_row_groups(k, n, |r0, count| {
                for r in r0..r0 + count {
                    for j0 in (0..n).step_by(ROW_RUN) {
                        // SAFETY: row r of the buffer (checked to hold k rows of rs) is this
                        // task's alone.
                        fill(r, j0, unsafe { rows.slice_mut(r * rs + j0, ROW_RUN.min(n - j0)) });
                    }
                }
            });
            let (y, start) = (Mat { ptr: buf.as_ptr(), rs: rs as isize, cs: 1 }, Start::adding(accumulate));
            match row_sums {
                Some(sums) => gemm_with_row_sums(isa, m, n, k, c, start, g_t, y, threads, sums),
                None => gemm(isa, m, n, k, c, start, g_t, y, threads),
            }
        }
    }
}

/// The most elements attention (or any kernel) gives one operand it prepares in a buffer of its own
/// ([`prepare_b_in`]): 64 Ki elements (256 KiB of f32), so a `T = 1024`, head size 64 key matrix
/// is packed once and a larger one is multiplied as it is.
pub(crate) const PREPARED_B_MAX_ELEMS: usize = 1 << 16;

/// Elements of the buffer [`prepare_b_in`] packs a `k x n` operand into: enough for any instruction
/// set, or none past [`PREPARED_B_MAX_ELEMS`] (the operand is then multiplied as it is).
pub(crate) fn prepared_b_len(k: usize, n: usize) -> usize {
    let need = memfit_kernels::gemm::prepared_b_capacity(k, n);
    if need <= PREPARED_B_MAX_ELEMS {
        need
    } else {
        0
    }
}

/// `b` [k x n] prepared in `buf` (the caller's, [`prepared_b_len`] elements) for several products
/// that each use its first rows and columns ([`prepared_part_into`]): packed there, on up to
/// `threads` threads, when the kernels would pack it per product and it fits.
///
/// # Safety
/// `b` must be valid for its shape and strides; it and `buf` must stay unchanged while the result is
/// used.
pub(crate) unsafe fn prepare_b_in<T: Float>(
    k: usize,
    n: usize,
    b: Mat<T>,
    buf: &mut [T],
    threads: usize,
) -> PreparedB<T> {
    PreparedB::prepare_into(memfit_kernels::Isa::active(), k, n, b, buf.as_mut_ptr(), buf.len(), threads)
}

/// `dst[m x n] (+)= a[m x k] @ b[..k, ..n]` with the first `k` rows and `n` columns of a prepared
/// `b`; otherwise as [`gemm_into`].
///
/// # Safety
/// As [`gemm_into`]; `n` and `k` at most `b`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn prepared_part_into<T: Float>(
    b: &PreparedB<T>,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    threads: usize,
) {
    b.gemm_part(m, n, k, MatMut { ptr: dst, rs: dst_rs }, Start::adding(accumulate), a, threads);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A weight gradient from rows computed a run at a time has the bits of the plain product and
    /// row sums over the same rows laid out row-major, on every level, whether the rows went
    /// straight into the packed layout (AVX2's 16-wide panels; rows 4 KiB apart on every level) or
    /// row-major (a short depth, read in place; a buffer too short to pack into), from zero and
    /// accumulating; each (row, run) is computed once.
    #[test]
    fn a_weight_gradient_from_rows_equals_the_plain_product() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let value = |r: usize, j: usize| ((r * 31 + j * 17) % 23) as f32 / 8.0 - 1.25;
        for isa in memfit_kernels::Isa::supported() {
            for &(m, n, k, rs, short) in &[
                (40, 256, 1030, 256, false),
                (7, 45, 37, 50, false),
                (33, 300, 530, 1024, false),
                (12, 70, 600, 70, true),
            ] {
                let len = if short {
                    (k - 1) * rs + n
                } else {
                    (k * rs).max(memfit_kernels::gemm::prepared_b_capacity(k, n))
                };
                let g: Vec<f32> = crate::test_values::uniform(k * m, 3).map(|v| v as f32).collect();
                let g_t = Mat { ptr: g.as_ptr(), rs: 1, cs: m as isize };
                let y: Vec<f32> = (0..k * n).map(|i| value(i / n, i % n)).collect();
                for accumulate in [false, true] {
                    let (mut want, mut want_sums) = (vec![0.5f32; m * n], vec![0.25f32; m]);
                    let (mut got, mut got_sums) = (want.clone(), want_sums.clone());
                    let mut buf = vec![f32::NAN; len];
                    let calls = AtomicUsize::new(0);
                    let fill = |r: usize, j0: usize, run: &mut [f32]| {
                        calls.fetch_add(1, Ordering::Relaxed);
                        run.iter_mut().enumerate().for_each(|(i, v)| *v = value(r, j0 + i));
                    };
                    // SAFETY: every buffer holds the shapes and strides passed.
                    unsafe {
                        let (c, start) = (MatMut { ptr: want.as_mut_ptr(), rs: n as isize }, Start::adding(accumulate));
                        let ym = Mat { ptr: y.as_ptr(), rs: n as isize, cs: 1 };
                        gemm_with_row_sums(isa, m, n, k, c, start, g_t, ym, 2, want_sums.as_mut_ptr());
                        let sums = Some(got_sums.as_mut_ptr());
                        weight_grad_from_rows(
                            isa,
                            m,
                            n,
                            k,
                            got.as_mut_ptr(),
                            accumulate,
                            g_t,
                            sums,
                            &mut buf,
                            rs,
                            fill,
                        );
                    }
                    let tag = format!("{isa} {m}x{n}x{k} rs={rs} short={short} acc={accumulate}");
                    assert_eq!(got, want, "{tag}");
                    assert_eq!(got_sums, want_sums, "{tag} sums");
                    assert_eq!(calls.load(Ordering::Relaxed), k * n.div_ceil(ROW_RUN), "{tag} calls");
                }
            }
        }
    }

    /// An operand up to the limit gets a buffer that holds it packed on any level; a larger one
    /// none (it is multiplied as it is), so a task's scratch stays bounded.
    #[test]
    fn prepared_operands_get_a_buffer_up_to_the_limit_only() {
        let capacity = memfit_kernels::gemm::prepared_b_capacity;
        assert_eq!(prepared_b_len(64, 128), capacity(64, 128));
        assert!(capacity(500, 128) <= PREPARED_B_MAX_ELEMS && capacity(512, 128) > PREPARED_B_MAX_ELEMS);
        assert_eq!(prepared_b_len(500, 128), capacity(500, 128));
        assert_eq!(prepared_b_len(512, 128), 0);
        assert_eq!(PREPARED_B_MAX_ELEMS, 65_536);
    }
}
