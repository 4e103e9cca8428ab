//! General matrix multiply, `C (+)= A @ B`, on strided operands (so transposed views multiply
//! without copies), blocked and packed in the BLIS way with one micro-kernel per instruction set.
//!
//! Loop nest (C row-major, the micro-kernel's vector dimension along C's rows):
//! `jc` over N in blocks of [`NC`] → `pc` over K in blocks of [`KC`] (pack `B[kc x nc]`, kept in
//! L2) → `ic` over M in blocks of [`MC`] (pack `A[mc x kc]`) → `ir` over micro-panels of MR rows
//! (one A micro-panel stays in L1) → `jr` over micro-panels of NR columns → micro-kernel
//! `C[MR x NR] (+)= A[MR x kc] B[kc x NR]`. Edge tiles are zero-padded in the packs and written
//! through a small tile on the stack.
//!
//! Operands read in place: a row-major A by whole tiles of rows (`run_direct`), and, for the levels
//! where that is faster, a row-major B by whole panels (the kernels take B's step stride); for a
//! block of at most [`SHORT_DEPTH`] steps also a column-major A (the packed kernel takes A's step
//! stride) and a row-major B on every level; not when their rows (or steps) are a multiple of
//! 4 KiB apart, except a row-major A on a level whose tile has at most [`ALIASED_ROWS`] rows.
//! Only their partial edge tiles and panels are packed then.
//!
//! C starts from zero, from its own values, or from a bias row ([`Start`]), added to each tile as
//! the micro-kernel stores it. A right operand used by several products (a fused op's row blocks)
//! can be prepared once ([`with_prepared_b`], or [`PreparedB::prepare_into`] a buffer of the
//! caller's): packed whole where the level would pack it per product, and multiplied whole or by
//! its first rows and columns ([`PreparedB::gemm_part`]). A product can add up A's rows as it packs
//! them ([`gemm_with_row_sums`]: a weight gradient's bias gradient). Packed panels are padded
//! ([`PANEL_PAD`]) so that a pack's writes at one depth step do not share an L1 set.
//!
//! Threads: a product large enough runs on up to `threads` threads that pack each B block together
//! (panels shared out) and then multiply their own ranges of rows; a product with too few rows for
//! that, or with columns enough for whole B blocks per thread, splits its columns instead.
//! Workspace: each thread keeps an A block, a B block and a prepared B of at most
//! [`WORKSPACE_BYTES_PER_THREAD`] bytes together, reused; their size depends on the block sizes
//! only, never on the operands.

use crate::isa::Isa;
use rayon::prelude::*;
use std::cell::RefCell;

mod avx2;
mod avx512;
mod portable;
pub(crate) mod transpose;

/// Depth of one packed block (elements of K).
pub const KC: usize = 512;
/// Rows of A packed at once.
pub const MC: usize = 192;
/// Columns of B packed at once.
pub const NC: usize = 512;
/// The largest micro-kernel tile side; block sizes above are multiples of every MR and NR.
const MAX_TILE: usize = 32;
/// The narrowest panels of any level (the portable kernel's tile), which pad a block the most.
const MIN_MR: usize = 4;
const MIN_NR: usize = 8;
/// Elements between one packed panel's end and the next one's start. Unpadded, the panels of a
/// block start a multiple of 4 KiB apart (`KC` x panel width x 4 bytes), so the lines a pack writes
/// at one depth step, one per panel, all fall in the same L1 set and evict each other (measured on
/// the pack alone: AVX2's 16-wide B panels 17 → 48 GB/s with 64 bytes of padding, AVX-512's 32-wide
/// 43 → 74, the 6- and 12-row A panels +19% and +28%; the GPT step on the AVX2 path -10 to -30 ms).
pub(crate) const PANEL_PAD: usize = 16;

/// Elements from one packed panel of `width` lines and `depth` steps to the next.
fn panel_stride(depth: usize, width: usize) -> usize {
    depth * width + PANEL_PAD
}
/// The most bytes one thread's packing workspace holds: an A block, a B block, and a B prepared
/// whole ([`with_prepared_b`]) that a fused op keeps while it runs other products, each padded to
/// whole tiles, in f64 (the widest scalar; f32 products use half).
pub const WORKSPACE_BYTES_PER_THREAD: usize = (A_PACK_ELEMS + 2 * B_PACK_ELEMS) * std::mem::size_of::<f64>();
/// Work (m*n*k) below which a product runs on one thread.
pub const PARALLEL_WORK: usize = 48 * 48 * 48;

/// A strided matrix operand: base pointer, row stride and column stride in elements.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<T> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

impl<T> MatRef<T> {
    /// The operand starting at element (row, col).
    ///
    /// # Safety
    /// The element must be inside the operand's allocation.
    pub(crate) unsafe fn at(self, row: usize, col: usize) -> Self {
        MatRef { ptr: self.ptr.offset(row as isize * self.rs + col as isize * self.cs), ..self }
    }
}

/// The output of a product: base pointer, row stride (its column stride is 1).
#[derive(Clone, Copy, Debug)]
pub struct MatMut<T> {
    pub ptr: *mut T,
    pub rs: isize,
}

impl<T> MatMut<T> {
    /// The output starting at element (row, col).
    ///
    /// # Safety
    /// The element must be inside the output's allocation.
    pub(crate) unsafe fn at(self, row: usize, col: usize) -> Self {
        MatMut { ptr: self.ptr.offset(row as isize * self.rs + col as isize), ..self }
    }
}

// SAFETY: a `MatRef` is read by parallel regions, a `MatMut` written in disjoint regions only
// (the driver splits the output); the caller of `gemm` guarantees validity.
unsafe impl<T> Send for MatRef<T> {}
unsafe impl<T> Sync for MatRef<T> {}
unsafe impl<T> Send for MatMut<T> {}
unsafe impl<T> Sync for MatMut<T> {}

/// A micro-kernel: `C[MR x NR] = start + A_panel · B_panel` over `kc` steps. A's step k is the MR
/// contiguous elements at `a + k * lda` (`lda` = MR for a packed panel, A's column stride when a
/// column-major A is read in place); B's step k is the NR contiguous elements at `b + k * ldb`
/// (`ldb` = NR for a packed panel, B's row stride when B is read in place); C has row stride
/// `rs_c` and column stride 1. The tile starts from zero, from C's own values, or from the NR values of a bias row
/// under every row (added to the product as it is stored: the bits of accumulating onto the bias).
pub type MicroKernelFn<T> =
    unsafe fn(kc: usize, a: *const T, lda: isize, b: *const T, ldb: isize, c: *mut T, rs_c: isize, start: Start<T>);

/// A micro-kernel reading A in place (row stride `lda`, column stride 1) instead of from a pack:
/// `C[MR x NR] (+)= A[MR rows x kc] · B_panel`, B as in [`MicroKernelFn`].
pub type MicroKernelDirectFn<T> =
    unsafe fn(kc: usize, a: *const T, lda: isize, b: *const T, ldb: isize, c: *mut T, rs_c: isize, start: Start<T>);

/// A micro-kernel and its tile.
#[derive(Clone, Copy)]
pub struct MicroKernel<T> {
    pub mr: usize,
    pub nr: usize,
    pub run: MicroKernelFn<T>,
    /// The variant for a row-major A (no packing of A), when the level has one.
    pub run_direct: Option<MicroKernelDirectFn<T>>,
    /// A faster packing of lines contiguous along the depth (transposed operands), when the level
    /// has one.
    pub pack_lines: Option<PackLinesFn<T>>,
    /// Whether the kernel reads a row-major B in place rather than packed (measured per level: the
    /// AVX-512 tile's two lines per step gain, the AVX2 tile's one line per step loses; the portable
    /// level does, so that the path is tested on every CPU).
    pub b_in_place: bool,
}

/// Packs `len` lines of `depth` contiguous elements (line stride `ls`) into panels of `panel`
/// lines, `stride` elements apart (the layout `pack` writes).
pub type PackLinesFn<T> =
    unsafe fn(src: *const T, ls: isize, len: usize, depth: usize, panel: usize, stride: usize, out: *mut T);

/// A scalar the GEMM computes in.
pub trait GemmScalar:
    sealed::Sealed + Copy + Default + Send + Sync + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + 'static
{
}
impl GemmScalar for f32 {}
impl GemmScalar for f64 {}

pub(crate) mod sealed {
    use super::{Isa, MicroKernel};
    pub trait Sealed: Sized {
        /// The micro-kernel for `isa` (a level without a kernel of its own for this type uses
        /// the portable one).
        fn micro_kernel(isa: Isa) -> MicroKernel<Self>;
    }
}

impl sealed::Sealed for f32 {
    fn micro_kernel(isa: Isa) -> MicroKernel<f32> {
        match isa {
            Isa::Avx512 if isa.is_supported() => avx512::F32,
            Isa::Avx2Fma if isa.is_supported() => avx2::F32,
            _ => portable::kernel::<f32>(),
        }
    }
}

impl sealed::Sealed for f64 {
    fn micro_kernel(_isa: Isa) -> MicroKernel<f64> {
        portable::kernel::<f64>()
    }
}

thread_local! {
    /// This thread's A blocks (f64 elements so either scalar fits), one per product running on it.
    pub(crate) static A_PACK: RefCell<Vec<Vec<f64>>> = const { RefCell::new(Vec::new()) };
    /// The B blocks of the products this thread runs or leads.
    pub(crate) static B_PACK: RefCell<Vec<Vec<f64>>> = const { RefCell::new(Vec::new()) };
}

/// Elements of a packed A block and of a packed B block.
/// (A block of at most `MC` rows, or `NC` columns, of at most `KC` steps, in whole panels (the block
/// sizes are multiples of every tile side), each padded: the most panels on the level with the
/// narrowest.)
pub(crate) const A_PACK_ELEMS: usize = MC * KC + MC / MIN_MR * PANEL_PAD;
pub(crate) const B_PACK_ELEMS: usize = NC * KC + NC / MIN_NR * PANEL_PAD;

/// Runs `f` on one of this thread's buffers from `pool`, grown to `elems` elements of `T`, and puts
/// it back. A product that starts on this thread while another one holds a buffer (a rayon task
/// stolen while waiting) takes a second buffer, kept for the next time: the pool grows to the
/// deepest such nesting once and is reused after, never per product.
pub(crate) fn with_pack<T, R>(
    pool: &'static std::thread::LocalKey<RefCell<Vec<Vec<f64>>>>,
    elems: usize,
    f: impl FnOnce(*mut T) -> R,
) -> R {
    let need = (elems * std::mem::size_of::<T>()).div_ceil(std::mem::size_of::<f64>());
    let mut buf = pool.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    if buf.len() < need {
        buf.resize(need, 0.0);
    }
    let result = f(buf.as_mut_ptr() as *mut T);
    pool.with(|p| p.borrow_mut().push(buf));
    result
}

/// A packed buffer shared by the threads of one product (each writes or reads its own panels).
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(pub(crate) *mut T);
// SAFETY: threads write disjoint panels of the buffer, and read it only after the join that ends
// the writes.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}
impl<T> Shared<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// What a product's output starts from before `A @ B` is added to it.
#[derive(Clone, Copy, Debug)]
pub enum Start<T> {
    /// Nothing: C is overwritten.
    Zero,
    /// C's own values: the product is added to them.
    Accumulate,
    /// A bias row of `n` values (a linear layer's): each row of C becomes the product's row plus it,
    /// added tile by tile as the product writes C (no pass over C before or after), with the bits
    /// of filling C with the bias and accumulating.
    Bias(*const T),
}

// SAFETY: the bias row is only read, by parallel regions; the caller of `gemm` guarantees validity.
unsafe impl<T> Send for Start<T> {}
unsafe impl<T> Sync for Start<T> {}

impl<T> Start<T> {
    /// [`Start::Accumulate`] when `accumulate`, else [`Start::Zero`].
    pub fn adding(accumulate: bool) -> Self {
        if accumulate {
            Start::Accumulate
        } else {
            Start::Zero
        }
    }

    /// The start of the columns from `col` on (a bias row offset with them).
    ///
    /// # Safety
    /// The column must be inside the bias row.
    pub(crate) unsafe fn at_col(self, col: usize) -> Self {
        match self {
            Start::Bias(b) => Start::Bias(b.add(col)),
            other => other,
        }
    }

    /// The start of depth block `pc`: the first block starts from this, the later ones add to what
    /// the earlier ones wrote.
    pub(crate) fn for_block(self, pc: usize) -> Self {
        if pc > 0 {
            Start::Accumulate
        } else {
            self
        }
    }
}

/// `C[m x n] (+)= A[m x k] @ B[k x n]` with the kernels of `isa`, on up to `threads` threads of
/// the current rayon pool; C starts from `start` (overwritten, accumulated into, or a bias row).
///
/// # Safety
/// The operands must be valid for their shapes and strides, and C must not overlap A or B.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm<T: GemmScalar>(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: MatRef<T>,
    b: MatRef<T>,
    threads: usize,
) {
    product(isa, m, n, k, c, start, a, b, threads, None)
}

/// As [`gemm`], and adds each row of A to `row_sums` (`m` values): `row_sums[i] += A[i, p]` one
/// element at a time for `p` in `0..k`, in order, so sums that start from zero have the bits of a
/// plain sequential sum. Read as A is packed, so a weight-gradient product `dW = dY^T X` gives the
/// bias gradient (the column sums of `dY`) with no pass over `dY` of its own.
///
/// # Safety
/// As [`gemm`]; `row_sums` valid for `m` elements, overlapping no operand.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_with_row_sums<T: GemmScalar>(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: MatRef<T>,
    b: MatRef<T>,
    threads: usize,
    row_sums: *mut T,
) {
    product(isa, m, n, k, c, start, a, b, threads, Some(Shared(row_sums)))
}

/// [`gemm`], with A's row sums when asked ([`gemm_with_row_sums`]).
#[allow(clippy::too_many_arguments)]
unsafe fn product<T: GemmScalar>(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: MatRef<T>,
    b: MatRef<T>,
    threads: usize,
    sums: Option<Shared<T>>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let dst = c.ptr.offset(i as isize * c.rs + j as isize);
                match start {
                    Start::Zero => *dst = T::default(),
                    Start::Accumulate => {}
                    Start::Bias(b) => *dst = *b.add(j),
                }
            }
        }
        return;
    }
    let kernel = <T as sealed::Sealed>::micro_kernel(isa);
    let parts = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_WORK { threads.max(1) } else { 1 };
    if parts == 1 {
        single(kernel, m, n, k, c, start, a, BSource::Strided(b), sums);
    } else if m >= 2 * parts * kernel.mr && !columns_split_evenly(kernel, parts, n) {
        shared_b(kernel, parts, m, n, k, c, start, a, BSource::Strided(b), sums);
    } else {
        // Too few rows to share out, or columns for a whole B block per thread: each thread takes
        // whole columns, packing its own B blocks and all of A (whose row sums the first takes).
        let parts = parts.min(n.div_ceil(kernel.nr));
        (0..parts).into_par_iter().for_each(|p| {
            let (lo, hi) = column_part(kernel, parts, n, p);
            if lo < hi {
                let (c, start, b) = (c.at(0, lo), start.at_col(lo), BSource::Strided(b.at(0, lo)));
                // SAFETY: each part writes its own columns of C (and only the first the sums);
                // operands are offset inside bounds.
                unsafe { single(kernel, m, hi - lo, k, c, start, a, b, sums.filter(|_| lo == 0)) };
            }
        });
    }
}

/// Columns `lo..hi` of part `p` of `parts` when a product splits its columns: whole tiles, shared
/// out as evenly as they go.
fn column_part<T: GemmScalar>(kernel: MicroKernel<T>, parts: usize, n: usize, p: usize) -> (usize, usize) {
    let tiles = n.div_ceil(kernel.nr);
    (tiles * p / parts * kernel.nr, (tiles * (p + 1) / parts * kernel.nr).min(n))
}

/// Whether splitting the columns of a product among `parts` threads gives each at least one whole
/// [`NC`] block and no more blocks in all than the product has (every block of columns packs, or
/// reads, all of A once). Then the threads do not share B blocks: each packs its own, which stay in
/// its own L2, with no join per block. Measured against sharing (`gemm_bench`, 2 threads): the
/// products with n = 1024 +4 to +9% on AVX-512 and AVX2; with n = 768 or 784, which split into
/// blocks narrower than NC, no clear gain.
fn columns_split_evenly<T: GemmScalar>(kernel: MicroKernel<T>, parts: usize, n: usize) -> bool {
    let (mut blocks, mut narrowest) = (0, usize::MAX);
    for p in 0..parts {
        let (lo, hi) = column_part(kernel, parts, n, p);
        blocks += (hi - lo).div_ceil(NC);
        narrowest = narrowest.min(hi - lo);
    }
    narrowest >= NC && blocks <= n.div_ceil(NC)
}

/// `C[m x n] (+)= A @ B` with A given `block_rows` rows at a time: `a_block(r0, rows)` returns rows
/// `r0..r0 + rows` of A (it may compute them into a buffer of its own, read before its next call).
/// B is prepared once for all the blocks ([`with_prepared_b`]), so a fused op that prepares its left
/// operand a block at a time (GELU, layer norm) does not repack its weight per block. Otherwise as
/// [`gemm`].
///
/// # Safety
/// As [`gemm`], for every block `a_block` returns.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_row_blocks<T: GemmScalar>(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    block_rows: usize,
    mut a_block: impl FnMut(usize, usize) -> MatRef<T>,
    b: MatRef<T>,
    threads: usize,
) {
    let block_rows = block_rows.max(1);
    with_prepared_b(isa, k, n, b, threads, |b| {
        for r0 in (0..m).step_by(block_rows) {
            let rows = block_rows.min(m - r0);
            b.gemm(rows, c.at(r0, 0), start, a_block(r0, rows), threads);
        }
    })
}

/// A right operand `B[k x n]` prepared once for several products `C (+)= A @ B` with different
/// left operands (the row blocks of a fused op, forward or backward): packed whole into this
/// thread's B workspace when the kernels pack a B like it and it fits there, else left as it is
/// (read in place, or packed block by block per product, as [`gemm`] does).
#[derive(Clone, Copy)]
pub struct PreparedB<T> {
    isa: Isa,
    kernel: MicroKernel<T>,
    k: usize,
    n: usize,
    b: MatRef<T>,
    /// B packed whole (the layout of [`pack_whole`]), when it was.
    packed: Option<*const T>,
}

/// Runs `f` with `b` (`k x n`) prepared for products on up to `threads` threads; the packed copy,
/// when there is one, lives until `f` returns.
///
/// # Safety
/// B must be valid for its shape and strides, and unchanged until `f` returns.
pub unsafe fn with_prepared_b<T: GemmScalar, R>(
    isa: Isa,
    k: usize,
    n: usize,
    b: MatRef<T>,
    threads: usize,
    f: impl FnOnce(&PreparedB<T>) -> R,
) -> R {
    with_pack(&B_PACK, B_PACK_ELEMS, |bpack: *mut T| {
        f(&PreparedB::prepare_into(isa, k, n, b, bpack, B_PACK_ELEMS, threads))
    })
}

/// The elements a buffer needs for [`PreparedB::prepare_into`] to pack a `k x n` B whole, on any
/// level: `k` rows of `n` padded to the widest panel (each level pads to its own panel width,
/// which divides the widest), and the panels' padding.
pub fn prepared_b_capacity(k: usize, n: usize) -> usize {
    // Panels at least MIN_NR wide, each padded once per block of KC rows.
    n.div_ceil(MAX_TILE) * MAX_TILE * (k + PANEL_PAD / MIN_NR * k.div_ceil(KC))
}

impl<T: GemmScalar> PreparedB<T> {
    /// `b` (`k x n`) prepared in a buffer of the caller's (`dst`, `len` elements): packed whole there,
    /// on up to `threads` threads, when the level would pack a B like it and it fits (see
    /// [`prepared_b_capacity`]), else left as it is. For an operand multiplied by many products of
    /// its own, on many threads at once (attention's keys and values, one matrix per task), where
    /// one thread's workspace would not do.
    ///
    /// # Safety
    /// B must be valid for its shape and strides; `dst` valid for `len` elements. Both must stay
    /// unchanged (but for this packing) while the result is used.
    pub unsafe fn prepare_into(
        isa: Isa,
        k: usize,
        n: usize,
        b: MatRef<T>,
        dst: *mut T,
        len: usize,
        threads: usize,
    ) -> Self {
        let kernel = <T as sealed::Sealed>::micro_kernel(isa);
        let plain = PreparedB { isa, kernel, k, n, b, packed: None };
        if n == 0 || k == 0 || reads_b_in_place(kernel, b, k) || packed_len(kernel, k, n) > len {
            return plain;
        }
        pack_whole(kernel, threads.max(1), k, n, b, dst);
        PreparedB { packed: Some(dst as *const T), ..plain }
    }

    /// The operand as given, and its rows and columns.
    pub fn operand(&self) -> (MatRef<T>, usize, usize) {
        (self.b, self.k, self.n)
    }

    /// `C[m x n] (+)= A[m x k] @ B` on up to `threads` threads; as [`gemm`] with this B.
    ///
    /// # Safety
    /// As [`gemm`].
    pub unsafe fn gemm(&self, m: usize, c: MatMut<T>, start: Start<T>, a: MatRef<T>, threads: usize) {
        self.gemm_part(m, self.n, self.k, c, start, a, threads)
    }

    /// `C[m x n] (+)= A[m x k] @ B[..k, ..n]`: the product with the first `n` columns and the first
    /// `k` rows (depth steps) of this B only (attention's keys up to a block's last visible one).
    ///
    /// # Safety
    /// As [`gemm`]; `n` and `k` at most this B's.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_part(
        &self,
        m: usize,
        n: usize,
        k: usize,
        c: MatMut<T>,
        start: Start<T>,
        a: MatRef<T>,
        threads: usize,
    ) {
        debug_assert!(n <= self.n && k <= self.k, "a part of B inside B");
        let kernel = self.kernel;
        let Some(bpack) = self.packed else {
            return gemm(self.isa, m, n, k, c, start, a, self.b, threads);
        };
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            return gemm(self.isa, m, n, 0, c, start, a, self.b, threads);
        }
        let b = BSource::Packed { ptr: bpack, k: self.k, n: self.n };
        let parts = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_WORK { threads.max(1) } else { 1 };
        if parts > 1 && m >= 2 * parts * kernel.mr {
            shared_b(kernel, parts, m, n, k, c, start, a, b, None);
        } else {
            single(kernel, m, n, k, c, start, a, b, None);
        }
    }
}

/// Where a product's B comes from.
#[derive(Clone, Copy)]
enum BSource<T> {
    /// B itself, packed block by block into the workspace (or read in place).
    Strided(MatRef<T>),
    /// B packed whole beforehand (by [`pack_whole`]), `k x n` in all: a product may use its first
    /// rows and columns only.
    Packed { ptr: *const T, k: usize, n: usize },
}

// SAFETY: as for `MatRef`: read only, by parallel regions that start after the packing ended.
unsafe impl<T> Send for BSource<T> {}
unsafe impl<T> Sync for BSource<T> {}

impl<T: GemmScalar> BSource<T> {
    /// Block (jc, pc) of B (`nc` columns, `kc` deep) and the panels of it still to pack (from the
    /// first returned): none when B was packed whole, the last partial one when B is read in place.
    ///
    /// # Safety
    /// The block must be inside B; `bpack` the workspace this product packs B blocks into.
    unsafe fn block(
        self,
        kernel: MicroKernel<T>,
        k: usize,
        jc: usize,
        pc: usize,
        nc: usize,
        bpack: *mut T,
    ) -> BBlock<T> {
        let whole = nc - nc % kernel.nr;
        match self {
            BSource::Strided(b) => {
                let depth = KC.min(k - pc);
                let in_place = reads_b_in_place(kernel, b, depth);
                BBlock { packed: bpack, depth, in_place: in_place.then(|| b.at(pc, jc)), whole }
            }
            BSource::Packed { ptr, k, n } => {
                // The block as packed: the whole B's columns and depth at (jc, pc).
                let (nc, depth) = (NC.min(n - jc), KC.min(k - pc));
                BBlock { packed: ptr.add(packed_offset(kernel, k, jc, pc, nc)), depth, in_place: None, whole: 0 }
            }
        }
    }

    /// The first panel of a block that has to be packed now (`panels` when none).
    fn first_to_pack(self, block: &BBlock<T>, kernel: MicroKernel<T>, panels: usize) -> usize {
        match self {
            BSource::Packed { .. } => panels,
            BSource::Strided(_) if block.in_place.is_some() => block.whole / kernel.nr,
            BSource::Strided(_) => 0,
        }
    }

    /// Packs panels `q0..q1` of block (jc, pc) into `bpack` (a no-op for an empty range).
    ///
    /// # Safety
    /// As [`pack`]; the block must be inside B.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pack_panels(
        self,
        kernel: MicroKernel<T>,
        jc: usize,
        pc: usize,
        nc: usize,
        kc: usize,
        q: (usize, usize),
        bpack: *mut T,
    ) {
        let nr = kernel.nr;
        let (lo, hi) = (q.0 * nr, (q.1 * nr).min(nc));
        if let (BSource::Strided(b), true) = (self, lo < hi) {
            let at = bpack.add(lo / nr * panel_stride(kc, nr));
            pack(kernel, b.at(pc, jc + lo).ptr, b.cs, b.rs, hi - lo, kc, nr, at, None);
        }
    }

    /// Runs `f` with this product's B workspace: one from the pool when B is packed block by block,
    /// none when it was packed whole.
    fn with_workspace<R>(self, f: impl FnOnce(*mut T) -> R) -> R {
        match self {
            BSource::Strided(_) => with_pack(&B_PACK, B_PACK_ELEMS, f),
            BSource::Packed { .. } => f(std::ptr::null_mut()),
        }
    }
}

/// Elements of the blocks before block (jc, pc) in a B packed whole: blocks in loop order (jc, then
/// pc), each `kc` deep, its columns in whole padded panels (every earlier column block holds NC / NR
/// panels of all k rows, padded once per depth block).
fn packed_offset<T>(kernel: MicroKernel<T>, k: usize, jc: usize, pc: usize, nc: usize) -> usize {
    let nr = kernel.nr;
    jc / nr * (k * nr + PANEL_PAD * k.div_ceil(KC)) + nc.div_ceil(nr) * (pc * nr + PANEL_PAD * (pc / KC))
}

/// Elements a B of `k x n` packed whole takes: every block but the last is NC wide, a multiple of
/// NR, so only the last block's columns are padded.
fn packed_len<T>(kernel: MicroKernel<T>, k: usize, n: usize) -> usize {
    n.div_ceil(kernel.nr) * (k * kernel.nr + PANEL_PAD * k.div_ceil(KC))
}

/// Packs all of B (`k x n`), block by block in loop order, on up to `parts` threads.
///
/// # Safety
/// B must be valid for its shape and strides; `out` must hold [`packed_len`] elements.
unsafe fn pack_whole<T: GemmScalar>(
    kernel: MicroKernel<T>,
    parts: usize,
    k: usize,
    n: usize,
    b: MatRef<T>,
    out: *mut T,
) {
    let out = Shared(out);
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let panels = nc.div_ceil(kernel.nr);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let at = packed_offset(kernel, k, jc, pc, nc);
            (0..parts).into_par_iter().for_each(|p| {
                // SAFETY: part p packs its own panels of this block; B is read inside its bounds.
                unsafe {
                    BSource::Strided(b).pack_panels(
                        kernel,
                        jc,
                        pc,
                        nc,
                        kc,
                        (panels * p / parts, panels * (p + 1) / parts),
                        out.get().add(at),
                    )
                };
            });
        }
    }
}

/// The whole product on this thread.
#[allow(clippy::too_many_arguments)]
unsafe fn single<T: GemmScalar>(
    kernel: MicroKernel<T>,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: MatRef<T>,
    b: BSource<T>,
    sums: Option<Shared<T>>,
) {
    b.with_workspace(|bpack: *mut T| {
        with_pack(&A_PACK, A_PACK_ELEMS, |apack: *mut T| {
            for jc in (0..n).step_by(NC) {
                let nc = NC.min(n - jc);
                for pc in (0..k).step_by(KC) {
                    let kc = KC.min(k - pc);
                    let block = b.block(kernel, k, jc, pc, nc, bpack);
                    let panels = nc.div_ceil(kernel.nr);
                    b.pack_panels(kernel, jc, pc, nc, kc, (b.first_to_pack(&block, kernel, panels), panels), bpack);
                    let (c, start, sums) = (c.at(0, jc), start.at_col(jc).for_block(pc), sums.filter(|_| jc == 0));
                    rows(kernel, 0..m, nc, kc, pc, c, start, a, apack, block, sums);
                }
            }
        })
    })
}

/// The product on `parts` threads sharing each packed B block: the threads pack its panels
/// together, then each multiplies its own whole-tile range of rows.
#[allow(clippy::too_many_arguments)]
unsafe fn shared_b<T: GemmScalar>(
    kernel: MicroKernel<T>,
    parts: usize,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: MatRef<T>,
    b: BSource<T>,
    sums: Option<Shared<T>>,
) {
    let (mr, nr) = (kernel.mr, kernel.nr);
    let row_tiles = m.div_ceil(mr);
    b.with_workspace(|bpack: *mut T| {
        let bpack = Shared(bpack);
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let block = b.block(kernel, k, jc, pc, nc, bpack.get());
                let panels = nc.div_ceil(nr);
                let first = b.first_to_pack(&block, kernel, panels);
                if first < panels {
                    (0..parts).into_par_iter().for_each(|p| {
                        let to_pack = panels - first;
                        let q = (first + to_pack * p / parts, first + to_pack * (p + 1) / parts);
                        // SAFETY: part p packs panels q only; B is read inside its bounds.
                        unsafe { b.pack_panels(kernel, jc, pc, nc, kc, q, bpack.get()) };
                    });
                }
                (0..parts).into_par_iter().for_each(|p| {
                    let (lo, hi) = (row_tiles * p / parts * mr, (row_tiles * (p + 1) / parts * mr).min(m));
                    if lo < hi {
                        // SAFETY: part p writes rows lo..hi of C only; the B block is complete and
                        // only read from here on.
                        unsafe {
                            with_pack(&A_PACK, A_PACK_ELEMS, |apack: *mut T| {
                                rows(
                                    kernel,
                                    lo..hi,
                                    nc,
                                    kc,
                                    pc,
                                    c.at(0, jc),
                                    start.at_col(jc).for_block(pc),
                                    a,
                                    apack,
                                    block,
                                    sums.filter(|_| jc == 0),
                                )
                            })
                        };
                    }
                });
            }
        }
    })
}

/// Whether a block of `depth` steps of B is read in place instead of packed: when B is row-major,
/// each depth step of a panel is NR contiguous elements, which a micro-kernel that says so
/// (`b_in_place`), or any for at most [`SHORT_DEPTH`] steps, loads where they are. Not when B's
/// rows are a multiple of 4 KiB apart: a panel's steps then share a few cache sets and evict each
/// other, and packing is faster (measured: `gemm_bench` "sq 1024" and "gpt dW fc2").
fn reads_b_in_place<T>(kernel: MicroKernel<T>, b: MatRef<T>, depth: usize) -> bool {
    (kernel.b_in_place || depth <= SHORT_DEPTH) && b.cs == 1 && (b.rs * std::mem::size_of::<T>() as isize) % 4096 != 0
}

/// Where the micro-kernels read one `kc x nc` block of B: whole panels from B itself when B is read
/// in place, the rest (all, when packed; the last partial panel, in place) from the packed block.
#[derive(Clone, Copy)]
struct BBlock<T> {
    packed: *const T,
    /// The depth the block's panels were packed with (each panel is `depth x NR`): the product's
    /// `kc`, or more when it uses the first rows of a B packed whole.
    depth: usize,
    /// B at the block's first element, when read in place.
    in_place: Option<MatRef<T>>,
    /// Columns of whole panels (a multiple of NR).
    whole: usize,
}

// SAFETY: as for `MatRef`: the block is only read once packed (the join that ends the packing comes
// first).
unsafe impl<T> Send for BBlock<T> {}
unsafe impl<T> Sync for BBlock<T> {}

impl<T> BBlock<T> {
    /// The panel starting at column `jr`: its pointer and the stride between its depth steps.
    ///
    /// # Safety
    /// `jr` must be a panel start inside the block.
    unsafe fn panel(&self, jr: usize, nr: usize) -> (*const T, isize) {
        match &self.in_place {
            Some(b) if jr + nr <= self.whole => (b.ptr.add(jr), b.rs),
            _ => (self.packed.add(jr / nr * panel_stride(self.depth, nr)), nr as isize),
        }
    }
}

/// Rows `range` of one packed B block: `C[range, 0..nc] (+)= A[range, pc..pc+kc] @ Bblock`,
/// packing A in blocks of [`MC`] rows; `c` (and a bias `start`) starts at the block's first column.
#[allow(clippy::too_many_arguments)]
unsafe fn rows<T: GemmScalar>(
    kernel: MicroKernel<T>,
    range: std::ops::Range<usize>,
    nc: usize,
    kc: usize,
    pc: usize,
    c: MatMut<T>,
    start: Start<T>,
    a: MatRef<T>,
    apack: *mut T,
    b: BBlock<T>,
    sums: Option<Shared<T>>,
) {
    let (mr, nr) = (kernel.mr, kernel.nr);
    // A partial tile's products, written whole (MR x NR, row stride NR) by a micro-kernel before
    // `write_tile` reads their top-left part: never read uninitialized, so never zeroed (a 4 KiB
    // memset per call counts in attention's many small products).
    let mut tile = [std::mem::MaybeUninit::<T>::uninit(); MAX_TILE * MAX_TILE];
    // A row-major A is read in place by whole tiles of rows (it is already contiguous along K), and
    // so is a column-major one (a transposed operand: each step's MR elements contiguous, as in a
    // pack) of at most `SHORT_DEPTH` steps; only the last partial tile is packed. Not when the
    // rows, or steps, are a multiple of 4 KiB apart and a tile has more of them than
    // `ALIASED_ROWS`: they then fall in one L1 set and evict each other (packing is faster).
    let apart =
        |stride: isize, lines: usize| lines > ALIASED_ROWS && (stride * std::mem::size_of::<T>() as isize) % 4096 == 0;
    let direct = match kernel.run_direct {
        Some(run) if a.cs == 1 && !apart(a.rs, mr) => Some((run, a.rs)),
        _ if a.rs == 1 && kc <= SHORT_DEPTH && !apart(a.cs, kc) => Some((kernel.run, a.cs)),
        _ => None,
    };
    for ic in range.clone().step_by(MC) {
        let mc = MC.min(range.end - ic);
        let packed_from = if direct.is_some() { mc - mc % mr } else { 0 };
        let sums = sums.map(|s| s.get().add(ic));
        if packed_from < mc {
            pack(
                kernel,
                a.at(ic + packed_from, pc).ptr,
                a.rs,
                a.cs,
                mc - packed_from,
                kc,
                mr,
                apack.add(packed_from / mr * panel_stride(kc, mr)),
                sums.map(|s| s.add(packed_from)),
            );
        }
        if let (Some(sums), true) = (sums, packed_from > 0) {
            add_line_sums(a.at(ic, pc).ptr, a.rs, a.cs, packed_from, kc, sums);
        }
        for ir in (0..mc).step_by(mr) {
            let rows = mr.min(mc - ir);
            let ap = apack.add(ir / mr * panel_stride(kc, mr));
            for jr in (0..nc).step_by(nr) {
                let cols = nr.min(nc - jr);
                let (bp, ldb) = b.panel(jr, nr);
                let cp = c.at(ic + ir, jr).ptr;
                // A whole tile starts where C does (its bias row from this tile's column); a
                // partial one is computed from zero on the stack and written with what C starts from.
                let whole_start = start.at_col(jr);
                let tp = tile.as_mut_ptr() as *mut T;
                match direct {
                    Some((run, lda)) if ir < packed_from && cols == nr => {
                        run(kc, a.at(ic + ir, pc).ptr, lda, bp, ldb, cp, c.rs, whole_start)
                    }
                    Some((run, lda)) if ir < packed_from => {
                        run(kc, a.at(ic + ir, pc).ptr, lda, bp, ldb, tp, nr as isize, Start::Zero);
                        write_tile(tp, nr, rows, cols, cp, c.rs, whole_start);
                    }
                    _ if rows == mr && cols == nr => (kernel.run)(kc, ap, mr as isize, bp, ldb, cp, c.rs, whole_start),
                    _ => {
                        (kernel.run)(kc, ap, mr as isize, bp, ldb, tp, nr as isize, Start::Zero);
                        write_tile(tp, nr, rows, cols, cp, c.rs, whole_start);
                    }
                }
            }
        }
    }
}

/// The most rows of A 4 KiB apart that a tile reads in place: they share one L1 set, which
/// (8-way on current x86 cores) then still holds the B lines the tile meets. Measured on the AVX2
/// tile's 6 rows: the GPT's K = 1024 products +6-9% over packing them, `sq 1024` +2%; the AVX-512
/// tile's 12 rows evict each other and are packed.
const ALIASED_ROWS: usize = 6;

/// Steps of a column-major A that [`rows`] reads in place rather than packs, and of a row-major B
/// that every level reads in place: few enough that a tile's or panel's steps, a cache line each,
/// stay in L1 while they are reused (attention's per-block dK and dV products, 24 steps; a weight
/// gradient's 512 would not).
const SHORT_DEPTH: usize = 64;

/// Writes the top-left `rows x cols` of a tile with row stride `nr` into C, added to what C starts
/// from (as a micro-kernel's store does).
///
/// # Safety
/// Those elements of the tile must be initialized, and C valid for the writes.
unsafe fn write_tile<T: GemmScalar>(
    tile: *const T,
    nr: usize,
    rows: usize,
    cols: usize,
    c: *mut T,
    rs_c: isize,
    start: Start<T>,
) {
    for i in 0..rows {
        for j in 0..cols {
            let dst = c.offset(i as isize * rs_c + j as isize);
            let v = *tile.add(i * nr + j);
            *dst = match start {
                Start::Zero => v,
                Start::Accumulate => *dst + v,
                Start::Bias(b) => v + *b.add(j),
            };
        }
    }
}

/// Packs `len` lines (rows of A, or columns of B) of `depth` elements into panels of `panel`
/// lines, [`panel_stride`] apart: `out[p * panel_stride(depth, panel) + d * panel + l]` = element
/// (line `p * panel + l`, depth `d`), zero past `len`. `ls` is the stride between lines, `ds` between depth steps. Contiguous lines
/// are read one depth step at a time and dealt out to the panels; contiguous depth (a transposed operand) is transposed in chunks of depth that
/// keep the panel's written lines in L1. With `sums`, adds each line's elements to its sum, in
/// depth order (while the step is in L1, for contiguous lines).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack<T: GemmScalar>(
    kernel: MicroKernel<T>,
    src: *const T,
    ls: isize,
    ds: isize,
    len: usize,
    depth: usize,
    panel: usize,
    out: *mut T,
    sums: Option<*mut T>,
) {
    /// Depth steps transposed at once: `DEPTH_CHUNK * panel` elements written stay in L1.
    const DEPTH_CHUNK: usize = 32;
    let stride = panel_stride(depth, panel);
    if let (1, Some(pack_lines)) = (ds, kernel.pack_lines) {
        if ls != 1 {
            pack_lines(src, ls, len, depth, panel, panel_stride(depth, panel), out);
            if let Some(sums) = sums {
                add_line_sums(src, ls, ds, len, depth, sums);
            }
            return;
        }
    }
    if ls == 1 {
        // Lines contiguous (a transposed A, or a row-major B): each depth step is one run of
        // `len` elements, read once, in order, and dealt out to the panels. The run `PACK_AHEAD`
        // steps on is asked for first: steps far apart (a page or more) are each a short stream of
        // their own, which the hardware prefetchers do not start early enough.
        for d in 0..depth {
            let from = src.offset(d as isize * ds);
            prefetch_run(src.wrapping_offset((d + PACK_AHEAD) as isize * ds), len);
            for p0 in (0..len).step_by(panel) {
                copy_run(from.add(p0), out.add(p0 / panel * stride + d * panel), panel.min(len - p0), panel);
            }
            if let Some(sums) = sums {
                let (step, sums) = (std::slice::from_raw_parts(from, len), std::slice::from_raw_parts_mut(sums, len));
                sums.iter_mut().zip(step).for_each(|(s, &v)| *s = *s + v);
            }
        }
        return;
    }
    if let Some(sums) = sums {
        add_line_sums(src, ls, ds, len, depth, sums);
    }
    for p0 in (0..len).step_by(panel) {
        let lines = panel.min(len - p0);
        let dst = out.add(p0 / panel * stride);
        let src = src.offset(p0 as isize * ls);
        if ds == 1 {
            for d0 in (0..depth).step_by(DEPTH_CHUNK) {
                let dn = DEPTH_CHUNK.min(depth - d0);
                for l in 0..lines {
                    let row = src.offset(l as isize * ls).add(d0);
                    let o = dst.add(d0 * panel + l);
                    for d in 0..dn {
                        *o.add(d * panel) = *row.add(d);
                    }
                }
            }
        } else {
            for d in 0..depth {
                let col = src.offset(d as isize * ds);
                let o = dst.add(d * panel);
                for l in 0..lines {
                    *o.add(l) = *col.offset(l as isize * ls);
                }
            }
        }
        if lines < panel {
            for d in 0..depth {
                for l in lines..panel {
                    *dst.add(d * panel + l) = T::default();
                }
            }
        }
    }
}

/// Adds the `depth` elements of each of `len` lines (line stride `ls`, depth stride `ds`) to its sum
/// in `sums`, in depth order.
///
/// # Safety
/// The lines must be valid for reads, `sums` for `len` elements.
unsafe fn add_line_sums<T: GemmScalar>(src: *const T, ls: isize, ds: isize, len: usize, depth: usize, sums: *mut T) {
    for l in 0..len {
        let line = src.offset(l as isize * ls);
        let sum = &mut *sums.add(l);
        for d in 0..depth {
            *sum = *sum + *line.offset(d as isize * ds);
        }
    }
}

/// Depth steps ahead that [`pack`] asks for a run of contiguous lines (measured on `gemm_bench`'s
/// GPT dW products, whose depth steps are 4 KiB apart: 2 to 16 steps alike, +9 to +15% over none).
const PACK_AHEAD: usize = 8;

/// Asks for the cache lines of `len` elements from `p` (past an allocation's end is harmless: a
/// prefetch never faults).
#[inline(always)]
fn prefetch_run<T>(p: *const T, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..len * std::mem::size_of::<T>()).step_by(64) {
        // SAFETY: a prefetch is only a hint: it reads nothing the program sees and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((p as *const i8).wrapping_add(off))
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// Copies `lines` elements from `from` to `to` and zeroes the rest of a `panel`-element run, with a
/// fixed-size copy for the panel widths of the micro-kernels.
#[inline(always)]
unsafe fn copy_run<T: GemmScalar>(from: *const T, to: *mut T, lines: usize, panel: usize) {
    #[inline(always)]
    unsafe fn fixed<T: Copy, const N: usize>(from: *const T, to: *mut T) {
        (to as *mut [T; N]).write_unaligned((from as *const [T; N]).read_unaligned());
    }
    match (lines == panel, panel) {
        (true, 32) => fixed::<T, 32>(from, to),
        (true, 16) => fixed::<T, 16>(from, to),
        (true, 12) => fixed::<T, 12>(from, to),
        (true, 8) => fixed::<T, 8>(from, to),
        (true, 6) => fixed::<T, 6>(from, to),
        (true, 4) => fixed::<T, 4>(from, to),
        _ => {
            std::ptr::copy_nonoverlapping(from, to, lines);
            for l in lines..panel {
                *to.add(l) = T::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 reference of `A @ B` (+ C0 when accumulating) for strided operands.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        ars: usize,
        acs: usize,
        b: &[f32],
        brs: usize,
        bcs: usize,
        c0: &[f32],
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = c0[i * n + j] as f64;
                for p in 0..k {
                    s += a[i * ars + p * acs] as f64 * b[p * brs + j * bcs] as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Every supported level, each layout (NN, NT, TN, TT), edge sizes, accumulation, 1 and 2
    /// threads (rows split, and columns split for too few rows or for whole B blocks per thread),
    /// and K longer than one block: equal to the f64 reference within f32 rounding, and the SIMD
    /// levels equal the portable level within rounding.
    #[test]
    fn every_level_matches_the_reference_and_the_portable_level() {
        let shapes = [(1, 1, 1), (3, 5, 7), (13, 33, 17), (37, 70, 300), (200, 65, 64), (64, 130, 520), (50, 1030, 9)];
        for (m, n, k) in shapes {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for accumulate in [false, true] {
                    let a = values(m * k, 1);
                    let b = values(k * n, 2);
                    let c0 = values(m * n, 3);
                    let (ars, acs) = if ta { (1, m) } else { (k, 1) };
                    let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
                    let zero = vec![0.0; m * n];
                    let want = reference(m, n, k, &a, ars, acs, &b, brs, bcs, if accumulate { &c0 } else { &zero });
                    let mut portable = Vec::new();
                    for isa in Isa::supported().into_iter().rev() {
                        for threads in [1, 2] {
                            let mut c = c0.clone();
                            // SAFETY: the buffers hold exactly the shapes and strides passed.
                            unsafe {
                                gemm(
                                    isa,
                                    m,
                                    n,
                                    k,
                                    MatMut { ptr: c.as_mut_ptr(), rs: n as isize },
                                    Start::adding(accumulate),
                                    MatRef { ptr: a.as_ptr(), rs: ars as isize, cs: acs as isize },
                                    MatRef { ptr: b.as_ptr(), rs: brs as isize, cs: bcs as isize },
                                    threads,
                                )
                            };
                            let tol = 1e-5 * (k as f64).sqrt().max(1.0);
                            for (idx, (&got, &w)) in c.iter().zip(&want).enumerate() {
                                assert!((got as f64 - w).abs() <= tol, "{isa} {m}x{n}x{k} ta={ta} tb={tb} acc={accumulate} t={threads} [{idx}]: {got} vs {w}");
                            }
                            if isa == Isa::Portable {
                                portable = c;
                            } else {
                                for (&got, &p) in c.iter().zip(&portable) {
                                    assert!(
                                        (got - p).abs() <= 2e-6 * (k as f32).sqrt().max(1.0),
                                        "{isa} vs portable: {got} vs {p}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Row blocks with B packed once (B transposed, as a weight `x W^T`) or not (B row-major, read
    /// in place; and B too large for the workspace): the same bits as one product, for every level.
    #[test]
    fn row_blocks_match_one_product() {
        for (m, n, k, block) in [(100, 70, 40, 32), (37, 33, 600, 12), (64, 130, 20, 64), (50, 1100, 300, 25)] {
            for tb in [true, false] {
                let a = values(m * k, 4);
                let b = values(k * n, 5);
                let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
                let bm = MatRef { ptr: b.as_ptr(), rs: brs as isize, cs: bcs as isize };
                for isa in Isa::supported() {
                    for accumulate in [false, true] {
                        let c0 = values(m * n, 6);
                        let (mut whole, mut blocks) = (c0.clone(), c0.clone());
                        let am = MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 };
                        let mut calls = Vec::new();
                        // SAFETY: the buffers hold exactly the shapes and strides passed; each block
                        // is rows r0..r0+rows of A.
                        unsafe {
                            gemm(
                                isa,
                                m,
                                n,
                                k,
                                MatMut { ptr: whole.as_mut_ptr(), rs: n as isize },
                                Start::adding(accumulate),
                                am,
                                bm,
                                2,
                            );
                            let c = MatMut { ptr: blocks.as_mut_ptr(), rs: n as isize };
                            gemm_row_blocks(
                                isa,
                                m,
                                n,
                                k,
                                c,
                                Start::adding(accumulate),
                                block,
                                |r0, rows| {
                                    calls.push((r0, rows));
                                    am.at(r0, 0)
                                },
                                bm,
                                2,
                            );
                        }
                        assert_eq!(whole, blocks, "{isa} {m}x{n}x{k} tb={tb} acc={accumulate}");
                        let want: Vec<_> = (0..m).step_by(block).map(|r0| (r0, block.min(m - r0))).collect();
                        assert_eq!(calls, want);
                    }
                }
            }
        }
    }

    /// One B prepared for several products gives each the bits of a plain product with that B, on
    /// every level: row-major B (packed whole, or read in place where the level does), a transposed
    /// B, rows 4 KiB apart, a B too big for one workspace (left as it is), an empty product, a zero
    /// depth, and accumulation.
    #[test]
    fn a_prepared_b_multiplies_as_the_plain_product() {
        for isa in Isa::supported() {
            for &(k, n, tb) in
                &[(37, 45, false), (37, 45, true), (300, 1024, false), (KC + 9, NC + 40, false), (0, 5, false)]
            {
                let b = values(k * n, 11);
                let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
                let bm = MatRef { ptr: b.as_ptr(), rs: brs as isize, cs: bcs as isize };
                let products: Vec<(usize, Vec<f32>, bool)> = [(1, false), (40, true), (0, false), (77, false)]
                    .iter()
                    .map(|&(m, acc)| (m, values(m * k, m as u64), acc))
                    .collect();
                let plain: Vec<Vec<f32>> = products
                    .iter()
                    .map(|(m, a, acc)| {
                        let mut c = values(m * n, 3);
                        // SAFETY: the buffers hold exactly the shapes and strides passed.
                        unsafe {
                            let am = MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 };
                            gemm(
                                isa,
                                *m,
                                n,
                                k,
                                MatMut { ptr: c.as_mut_ptr(), rs: n as isize },
                                Start::adding(*acc),
                                am,
                                bm,
                                2,
                            )
                        };
                        c
                    })
                    .collect();
                // SAFETY: B is valid and unchanged while prepared; each product's buffers hold
                // exactly its shapes and strides.
                let prepared: Vec<Vec<f32>> = unsafe {
                    with_prepared_b(isa, k, n, bm, 2, |pb| {
                        let whole = packed_len(pb.kernel, k, n) <= B_PACK_ELEMS && !reads_b_in_place(pb.kernel, bm, k);
                        assert_eq!(pb.packed.is_some(), whole && k > 0, "{isa} k={k} n={n} tb={tb}");
                        products
                            .iter()
                            .map(|(m, a, acc)| {
                                let mut c = values(m * n, 3);
                                let am = MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 };
                                pb.gemm(*m, MatMut { ptr: c.as_mut_ptr(), rs: n as isize }, Start::adding(*acc), am, 2);
                                c
                            })
                            .collect()
                    })
                };
                assert_eq!(prepared, plain, "{isa} k={k} n={n} tb={tb}");
            }
        }
    }

    /// A bias start gives the bits of filling C with the bias row and accumulating (what the linear
    /// layers did before), on every level, for products one thread runs, that share B blocks, that
    /// split their columns (the bias offset with them), deeper than one block, with B prepared, and
    /// through row blocks; C's row stride wider than its row.
    #[test]
    fn a_bias_start_equals_filling_with_the_bias_and_accumulating() {
        for isa in Isa::supported() {
            for &(m, n, k, threads) in
                &[(5, 7, 3, 1), (64, 40, 70, 2), (13, 1030, 33, 2), (50, 45, KC + 20, 2), (3, 1, 1, 1)]
            {
                let (a, b, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
                let rs = n + 3;
                let am = MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 };
                let bm = MatRef { ptr: b.as_ptr(), rs: 1, cs: k as isize };
                let mut filled = vec![9.0f32; m * rs];
                for row in filled.chunks_mut(rs) {
                    row[..n].copy_from_slice(&bias);
                }
                let mut biased = vec![9.0f32; m * rs];
                let mut prepared = biased.clone();
                let mut blocks = biased.clone();
                let start = Start::Bias(bias.as_ptr());
                // SAFETY: every buffer holds the shapes and strides passed; the bias holds n values.
                unsafe {
                    let out = |c: &mut Vec<f32>| MatMut { ptr: c.as_mut_ptr(), rs: rs as isize };
                    gemm(isa, m, n, k, out(&mut filled), Start::Accumulate, am, bm, threads);
                    gemm(isa, m, n, k, out(&mut biased), start, am, bm, threads);
                    with_prepared_b(isa, k, n, bm, threads, |pb| pb.gemm(m, out(&mut prepared), start, am, threads));
                    gemm_row_blocks(isa, m, n, k, out(&mut blocks), start, 4, |r0, _| am.at(r0, 0), bm, threads);
                }
                let tag = format!("{isa} {m}x{n}x{k} t={threads}");
                assert_eq!(biased, filled, "{tag}");
                assert_eq!(prepared, filled, "{tag} prepared");
                assert_eq!(blocks, filled, "{tag} row blocks");
            }
        }
    }

    /// A B prepared in a buffer of the caller's is packed there exactly when the level would pack
    /// it and the buffer holds it (row-major and transposed, across the block edges, with a partial
    /// last panel; a buffer one panel short); a product with it, or with any first rows and columns
    /// of it (`gemm_part`), has the bits of the plain product with that part of B, on one thread
    /// and on two, from zero and accumulating.
    #[test]
    fn a_b_prepared_in_a_buffer_multiplies_any_part_as_the_plain_product() {
        for isa in Isa::supported() {
            let kernel = <f32 as sealed::Sealed>::micro_kernel(isa);
            for &(k, n, tb, short) in &[
                (37, 45, false, false),
                (37, 45, true, false),
                (KC + 9, NC + 40, true, false),
                (128, 64, true, true),
                (128, 64, false, false),
                (3, 1, true, false),
            ] {
                let b = values(k * n, 5);
                let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
                let bm = MatRef { ptr: b.as_ptr(), rs: brs as isize, cs: bcs as isize };
                let capacity = prepared_b_capacity(k, n);
                assert!(capacity >= packed_len(kernel, k, n), "{isa} {k}x{n}");
                let len = if short { packed_len(kernel, k, n) - kernel.nr } else { capacity };
                let mut buf = vec![f32::NAN; len];
                // SAFETY: B holds k x n at its strides; the buffer holds len elements and outlives pb.
                let pb = unsafe { PreparedB::prepare_into(isa, k, n, bm, buf.as_mut_ptr(), len, 2) };
                let tag = format!("{isa} B {k}x{n} tb={tb} short={short}");
                assert_eq!(pb.packed.is_some(), !short && !reads_b_in_place(kernel, bm, k), "{tag}");
                for &(m, kp, np, acc, threads) in &[
                    (40, k, n, false, 2),
                    (13, k, n, true, 1),
                    (70, k.div_ceil(2), n, true, 2),
                    (9, k, n.div_ceil(3), false, 1),
                    (64, k - 1, n - n / 4, false, 2),
                    (5, 0, n, true, 1),
                ] {
                    let a = values(m * kp, m as u64);
                    let am = MatRef { ptr: a.as_ptr(), rs: kp as isize, cs: 1 };
                    let c0 = values(m * np, 3);
                    let (mut plain, mut part) = (c0.clone(), c0);
                    let start = Start::adding(acc);
                    // SAFETY: the buffers hold the shapes and strides passed; B and its pack live.
                    unsafe {
                        gemm(
                            isa,
                            m,
                            np,
                            kp,
                            MatMut { ptr: plain.as_mut_ptr(), rs: np as isize },
                            start,
                            am,
                            bm,
                            threads,
                        );
                        pb.gemm_part(m, np, kp, MatMut { ptr: part.as_mut_ptr(), rs: np as isize }, start, am, threads);
                    }
                    assert_eq!(part, plain, "{tag}, part {m}x{np}x{kp} acc={acc} t={threads}");
                }
            }
        }
    }

    /// A product with A's row sums writes the bits of the plain product, and adds to each sum the
    /// bits of a sequential sum of its row from where it started, on every level: A row-major (read
    /// in place but for a partial tile), row-major with rows 4 KiB apart (packed, or in place for
    /// a tile of at most `ALIASED_ROWS` rows), transposed (a
    /// weight gradient's `dY^T`) and with no unit stride; deeper than one block, wider than one
    /// (each row summed once), on one thread, with shared B blocks and with the columns split.
    #[test]
    fn row_sums_of_a_are_sequential_sums_alongside_the_plain_product() {
        for isa in Isa::supported() {
            for &(m, n, k, threads) in &[(5, 7, 3, 1), (64, 40, KC + 70, 2), (13, 2 * NC + 30, 33, 2), (100, 45, 9, 2)]
            {
                let (a, b) = (values((m * 1024).max(k * (2 * m + 1) + 2 * m), 1), values(k * n, 2));
                let bm = MatRef { ptr: b.as_ptr(), rs: n as isize, cs: 1 };
                for (layout, am) in [
                    ("row-major", MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 }),
                    ("rows 4 KiB apart", MatRef { ptr: a.as_ptr(), rs: 1024, cs: 1 }),
                    ("transposed", MatRef { ptr: a.as_ptr(), rs: 1, cs: m as isize }),
                    ("no unit stride", MatRef { ptr: a.as_ptr(), rs: 2, cs: 2 * m as isize + 1 }),
                ] {
                    let start_sums = values(m, 4);
                    let want_sums: Vec<f32> = (0..m)
                        .map(|i| {
                            // SAFETY: row i of A is inside `a` at these strides.
                            (0..k).fold(start_sums[i], |s, p| {
                                s + unsafe { *am.ptr.offset(i as isize * am.rs + p as isize * am.cs) }
                            })
                        })
                        .collect();
                    let (mut plain, mut summed, mut sums) = (values(m * n, 3), values(m * n, 3), start_sums.clone());
                    // SAFETY: the buffers hold the shapes and strides passed; sums holds m values.
                    unsafe {
                        gemm(
                            isa,
                            m,
                            n,
                            k,
                            MatMut { ptr: plain.as_mut_ptr(), rs: n as isize },
                            Start::Accumulate,
                            am,
                            bm,
                            threads,
                        );
                        let out = MatMut { ptr: summed.as_mut_ptr(), rs: n as isize };
                        gemm_with_row_sums(isa, m, n, k, out, Start::Accumulate, am, bm, threads, sums.as_mut_ptr());
                    }
                    let tag = format!("{isa} {layout} {m}x{n}x{k} t={threads}");
                    assert_eq!(summed, plain, "{tag}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&sums), bits(&want_sums), "{tag} sums");
                }
            }
        }
    }

    /// Which row-major B is read in place: at most `SHORT_DEPTH` steps on every level, deeper only on
    /// the levels whose kernels say so, never with rows 4 KiB apart or a column stride.
    #[test]
    fn short_row_major_b_is_read_in_place_on_every_level() {
        let b = [0f32; 1];
        for isa in Isa::supported() {
            let kernel = <f32 as sealed::Sealed>::micro_kernel(isa);
            let at = |rs: isize, cs: isize| MatRef { ptr: b.as_ptr(), rs, cs };
            for (m, depth, want) in [
                (at(40, 1), SHORT_DEPTH, true),
                (at(40, 1), SHORT_DEPTH + 1, kernel.b_in_place),
                (at(40, 1), KC, kernel.b_in_place),
                (at(1024, 1), 8, false),
                (at(1, 40), 8, false),
            ] {
                assert_eq!(reads_b_in_place(kernel, m, depth), want, "{isa} rs={} cs={} depth={depth}", m.rs, m.cs);
            }
        }
    }

    /// The blocks of a B packed whole follow each other with no gap or overlap, padded panels and
    /// all, within what `prepared_b_capacity` promises (exactly that on the level with the
    /// narrowest panels, for whole widest panels), on every level; a block of A or of B fits its
    /// workspace, exactly on that level.
    #[test]
    fn packed_b_layout_covers_every_block_once() {
        for isa in Isa::ALL {
            let kernel = <f32 as sealed::Sealed>::micro_kernel(isa);
            let (mr, nr) = (kernel.mr, kernel.nr);
            assert!(mr >= MIN_MR && nr >= MIN_NR && MC % mr == 0 && NC % nr == 0 && MAX_TILE % nr == 0, "{isa} tile");
            let (a_block, b_block) = (MC / mr * panel_stride(KC, mr), NC / nr * panel_stride(KC, nr));
            assert!(a_block <= A_PACK_ELEMS && b_block <= B_PACK_ELEMS, "{isa} blocks");
            let narrowest = (mr, nr) == (MIN_MR, MIN_NR);
            if narrowest {
                assert_eq!((a_block, b_block), (A_PACK_ELEMS, B_PACK_ELEMS), "{isa} blocks");
            }
            for (k, n) in [
                (1, 1),
                (KC, NC),
                (KC + 1, NC + 1),
                (3 * KC + 5, 2 * NC + 9),
                (7, NC - 1),
                (2, 2 * NC - 3),
                (KC + 3, 96),
            ] {
                let mut next = 0;
                for jc in (0..n).step_by(NC) {
                    let nc = NC.min(n - jc);
                    for pc in (0..k).step_by(KC) {
                        assert_eq!(packed_offset(kernel, k, jc, pc, nc), next, "{isa} k={k} n={n} block ({jc}, {pc})");
                        next += nc.div_ceil(kernel.nr) * panel_stride(KC.min(k - pc), kernel.nr);
                    }
                }
                assert_eq!(packed_len(kernel, k, n), next, "{isa} k={k} n={n}");
                assert!(next <= prepared_b_capacity(k, n), "{isa} k={k} n={n}");
                if narrowest && n % MAX_TILE == 0 {
                    assert_eq!(next, prepared_b_capacity(k, n), "{isa} k={k} n={n}");
                }
            }
        }
    }

    #[test]
    fn an_empty_depth_zeroes_keeps_or_biases_the_output() {
        let mut c = vec![7.0f32; 6];
        let a = MatRef { ptr: [].as_ptr(), rs: 0, cs: 1 };
        // SAFETY: k = 0 reads neither operand; c holds 2 x 3.
        unsafe {
            gemm::<f32>(Isa::active(), 2, 3, 0, MatMut { ptr: c.as_mut_ptr(), rs: 3 }, Start::Accumulate, a, a, 2)
        };
        assert_eq!(c, vec![7.0; 6]);
        // SAFETY: as above.
        unsafe { gemm::<f32>(Isa::active(), 2, 3, 0, MatMut { ptr: c.as_mut_ptr(), rs: 3 }, Start::Zero, a, a, 2) };
        assert_eq!(c, vec![0.0; 6]);
        let bias = [1.0f32, -2.0, 3.5];
        // SAFETY: as above; the bias holds n = 3 values.
        unsafe {
            gemm::<f32>(
                Isa::active(),
                2,
                3,
                0,
                MatMut { ptr: c.as_mut_ptr(), rs: 3 },
                Start::Bias(bias.as_ptr()),
                a,
                a,
                2,
            )
        };
        assert_eq!(c, [bias, bias].concat());
    }

    #[test]
    fn f64_products_are_exact_on_small_integers() {
        let (m, n, k) = (5, 9, 300);
        let a: Vec<f64> = (0..m * k).map(|i| (i % 7) as f64 - 3.0).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i % 5) as f64 - 2.0).collect();
        let mut c = vec![0.0; m * n];
        // SAFETY: the buffers hold exactly the shapes and strides passed.
        unsafe {
            gemm(
                Isa::Portable,
                m,
                n,
                k,
                MatMut { ptr: c.as_mut_ptr(), rs: n as isize },
                Start::Zero,
                MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 },
                MatRef { ptr: b.as_ptr(), rs: n as isize, cs: 1 },
                2,
            )
        };
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                assert_eq!(c[i * n + j], want);
            }
        }
    }

    /// The threads split the columns only where that was measured to win: each gets at least one
    /// whole NC block and the split adds no blocks of columns (so n = 1024 on two threads, not 784,
    /// 1536, or 1020, whose last part is 508 wide). Parts are whole tiles, shared out evenly.
    #[test]
    fn columns_split_only_into_whole_blocks() {
        let k = portable::kernel::<f32>();
        assert_eq!(k.nr, 8);
        assert_eq!([0, 1].map(|p| column_part(k, 2, 1030, p)), [(0, 512), (512, 1030)]);
        assert_eq!([0, 1, 2].map(|p| column_part(k, 3, 24, p)), [(0, 8), (8, 16), (16, 24)]);
        for (parts, n, split) in
            [(2, 1024, true), (2, 2048, true), (2, 784, false), (2, 1536, false), (3, 1024, false), (2, 1020, false)]
        {
            assert_eq!(columns_split_evenly(k, parts, n), split, "{parts} parts, n = {n}");
        }
    }
}
