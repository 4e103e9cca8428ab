//! The CPU kernels' one door to GEMM: `memfit-kernels`' packed products for the process's
//! instruction set, on strided operands, plus the raw-pointer wrapper parallel kernels share. Each
//! door takes the device's [`Products`]: a bf16 or fp16 product of f32 operands goes to
//! `memfit_kernels::gemm_bf16` (Notes [bf16 products] and [fp16 products] there) at the level the
//! instruction set gives; f64 operands always multiply in f64.

use crate::dtype::Float;
use memfit_kernels::gemm::{gemm, gemm_row_blocks, gemm_with_row_sums, MatMut, Start};
pub use memfit_kernels::gemm_bf16::Products;
use memfit_kernels::gemm_bf16::{gemm_rounded, with_prepared_rounded, PreparedRounded, Rounded};

/// A strided matrix operand (the kernels crate's; one home for the idea).
pub(crate) use memfit_kernels::gemm::MatRef as Mat;
use memfit_kernels::gemm::PreparedB;

/// A right operand prepared once for several products: for the f32 GEMM, or for rounded (bf16,
/// fp16) products.
pub(crate) enum Prepared<T> {
    F32(PreparedB<T>),
    Rounded(PreparedRounded),
}
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

/// How a product of `T` operands under `products` rounds them (bf16 or fp16 products, of f32
/// operands only): None for an f32 product.
fn rounded<T: Float>(products: Products) -> Option<Rounded> {
    Rounded::active(products).filter(|_| std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
}

/// The rounded product `C[m x n] (+)= A @ B` of f32 operands given as `T` (checked by [`rounded`]).
///
/// # Safety
/// As [`gemm_into`]; `T` is f32.
#[allow(clippy::too_many_arguments)]
unsafe fn rounded_into<T: Float>(
    level: Rounded,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: Mat<T>,
    b: Mat<T>,
    threads: usize,
) {
    let f = |x: Mat<T>| Mat { ptr: x.ptr as *const f32, rs: x.rs, cs: x.cs };
    let start = match start {
        Start::Zero => Start::Zero,
        Start::Accumulate => Start::Accumulate,
        Start::Bias(row) => Start::Bias(row as *const f32),
    };
    let c = MatMut { ptr: c.ptr as *mut f32, rs: c.rs };
    gemm_rounded(level, m, n, k, c, start, f(a), f(b), threads);
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
    products: Products,
) {
    gemm_summing_into(m, n, k, dst, dst_rs, accumulate, a, b, threads, None, products)
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
    products: Products,
) {
    let (isa, c, start) = (memfit_kernels::Isa::active(), MatMut { ptr: dst, rs: dst_rs }, Start::adding(accumulate));
    if let Some(level) = rounded::<T>(products) {
        // The sums are of A as it is (a bias gradient stays f32), each row's elements in order.
        if let Some(sums) = row_sums {
            let sums = std::slice::from_raw_parts_mut(sums, m);
            // Along A's contiguous direction; each sum still takes its row's elements in order.
            if a.rs == 1 {
                for t in 0..k {
                    add_into(isa, sums, std::slice::from_raw_parts(a.ptr.offset(t as isize * a.cs), m));
                }
            } else {
                for (i, s) in sums.iter_mut().enumerate() {
                    for t in 0..k {
                        *s += *a.ptr.offset(i as isize * a.rs + t as isize * a.cs);
                    }
                }
            }
        }
        return rounded_into(level, m, n, k, c, start, a, b, threads);
    }
    match row_sums {
        Some(sums) => gemm_with_row_sums(isa, m, n, k, c, start, a, b, threads, sums),
        None => gemm(isa, m, n, k, c, start, a, b, threads),
    }
}

memfit_kernels::multiversion! {
    /// `sums += values`, element by element.
    fn add_into<T: Float>(sums: &mut [T], values: &[T]) {
        sums.iter_mut().zip(values).for_each(|(s, &v)| *s += v);
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
    products: Products,
) {
    let (start, c) = (bias.map_or(Start::Zero, Start::Bias), MatMut { ptr: dst, rs: dst_rs });
    if let Some(level) = rounded::<T>(products) {
        return rounded_into(level, m, n, k, c, start, a, b, threads);
    }
    gemm(memfit_kernels::Isa::active(), m, n, k, c, start, a, b, threads);
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
    mut a_block: impl FnMut(usize, usize) -> Mat<T>,
    b: Mat<T>,
    products: Products,
) {
    let c = MatMut { ptr: dst, rs: dst_rs };
    let threads = rayon::current_num_threads();
    let start = bias.map_or(Start::Zero, Start::Bias);
    if let Some(level) = rounded::<T>(products) {
        for r0 in (0..m).step_by(block_rows.max(1)) {
            let rows = block_rows.max(1).min(m - r0);
            let block = MatMut { ptr: dst.offset(r0 as isize * dst_rs), rs: dst_rs };
            rounded_into(level, rows, n, k, block, start, a_block(r0, rows), b, threads);
        }
        return;
    }
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
    products: Products,
    f: impl FnOnce(&Prepared<T>) -> R,
) -> R {
    if let Some(level) = rounded::<T>(products) {
        let b = Mat { ptr: b.ptr as *const f32, rs: b.rs, cs: b.cs };
        return with_prepared_rounded(level, k, n, b, |p| f(&Prepared::Rounded(*p)));
    }
    let isa = memfit_kernels::Isa::active();
    memfit_kernels::gemm::with_prepared_b(isa, k, n, b, rayon::current_num_threads(), |p| f(&Prepared::F32(*p)))
}

/// `dst[m x n] (+)= a[m x k] @ b` with a prepared `b`; otherwise as [`gemm_into`].
///
/// # Safety
/// As [`gemm_into`].
pub(crate) unsafe fn prepared_gemm_into<T: Float>(
    b: &Prepared<T>,
    m: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    threads: usize,
) {
    let (k, n) = b.dims();
    prepared_part_into(b, m, n, k, dst, dst_rs, accumulate, a, threads)
}

impl<T: Float> Prepared<T> {
    /// The operand's rows and columns.
    pub(crate) fn dims(&self) -> (usize, usize) {
        match self {
            Prepared::F32(p) => {
                let (_, k, n) = p.operand();
                (k, n)
            }
            Prepared::Rounded(p) => p.dims(),
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
    let need = memfit_kernels::gemm::prepared_b_capacity(k, n).max(PreparedRounded::capacity(k, n));
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
    products: Products,
) -> Prepared<T> {
    if let Some(level) = rounded::<T>(products) {
        // f32 elements and pair words are both 4 bytes.
        let b = Mat { ptr: b.ptr as *const f32, rs: b.rs, cs: b.cs };
        let words = std::mem::size_of_val(buf) / 4;
        return Prepared::Rounded(PreparedRounded::prepare_into(level, k, n, b, buf.as_mut_ptr() as *mut u32, words));
    }
    let isa = memfit_kernels::Isa::active();
    Prepared::F32(PreparedB::prepare_into(isa, k, n, b, buf.as_mut_ptr(), buf.len(), threads))
}

/// `dst[m x n] (+)= a[m x k] @ b[..k, ..n]` with the first `k` rows and `n` columns of a prepared
/// `b`; otherwise as [`gemm_into`].
///
/// # Safety
/// As [`gemm_into`]; `n` and `k` at most `b`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn prepared_part_into<T: Float>(
    b: &Prepared<T>,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    threads: usize,
) {
    let (c, start) = (MatMut { ptr: dst, rs: dst_rs }, Start::adding(accumulate));
    match b {
        Prepared::F32(b) => b.gemm_part(m, n, k, c, start, a, threads),
        Prepared::Rounded(b) => {
            // Only f32 operands are prepared for rounded products (`rounded`).
            let a = Mat { ptr: a.ptr as *const f32, rs: a.rs, cs: a.cs };
            let c = MatMut { ptr: c.ptr as *mut f32, rs: c.rs };
            b.gemm_part(m, n, k, c, Start::adding(accumulate), a, threads)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
