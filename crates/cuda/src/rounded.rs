//! Rounded products on a GPU: a bf16 (fp16) product of f32 tensors (Notes [bf16 products] and
//! [fp16 products] in `memfit-kernels`) as cuBLAS can be made to compute it exactly. cuBLAS's
//! `CUBLAS_COMPUTE_32F_FAST_16BF` on f32 operands is leave to convert, not a promise: on an H100 it
//! chose f32 kernels for small products and for some of GPT-2's (every element of a bf16 linear
//! layer off the definition, and at f32 speed). So the operands are rounded by memfit's own kernel
//! (`round_operands_*` in `data.cu`, the definition's rounding) into a workspace of fixed size, and
//! cuBLAS multiplies the 16-bit copies with f32 accumulation ([`GemmType::Bf16`]), which only the
//! tensor cores do.
//!
//! [`rounded_steps`] cuts a product into pieces whose two rounded operands fit the workspace: whole
//! matrices of a batch where they fit, else blocks as large as fit (k in chunks, each later chunk
//! adding onto C with beta 1, rather than narrow blocks of C: [`blocks`]). The backend runs the
//! steps in order (`memfit-tensor`'s cuda backend), on a GPU and on the emulator alike.

use crate::machine::{Gemm, GemmType};

/// `batch` column-major f32 matrices of `rows` x `cols` (leading dimension `ld`, matrix i at
/// `src + 4 i stride`) to round into the workspace at `dst`, packed (leading dimension `rows`,
/// matrix i at `dst + 2 i rows cols`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundOperand {
    pub src: u64,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub stride: usize,
    pub batch: usize,
    pub dst: u64,
}

/// One step of a rounded product, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RoundedStep {
    Round(RoundOperand),
    /// A product of rounded copies (`GemmType::Bf16` or `F16`).
    Product(Gemm),
}

/// A launch of the rounding kernel (one or two roundings: data.cu's `round_operands_*` takes a
/// product's A and B at once) or a product, in the order the steps give them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RoundedLaunch {
    Round(RoundOperand, Option<RoundOperand>),
    Product(Gemm),
}

/// `steps` as launches: each two roundings in a row go in one launch (they write different parts
/// of the workspace, and both come before the product that reads them).
pub fn rounded_launches(steps: Vec<RoundedStep>) -> Vec<RoundedLaunch> {
    let mut launches = Vec::with_capacity(steps.len());
    let mut steps = steps.into_iter().peekable();
    while let Some(step) = steps.next() {
        launches.push(match step {
            RoundedStep::Round(a) => match steps.next_if(|s| matches!(s, RoundedStep::Round(_))) {
                Some(RoundedStep::Round(b)) => RoundedLaunch::Round(a, Some(b)),
                _ => RoundedLaunch::Round(a, None),
            },
            RoundedStep::Product(g) => RoundedLaunch::Product(g),
        });
    }
    launches
}

/// Elements B's rounded copy starts at a multiple of, after A's: 16 bytes, the alignment cuBLAS's
/// tensor-core kernels take 16-bit operands at.
const ALIGN: usize = 8;

/// Rows or columns of C a block keeps before k is cut into chunks: products narrower than this ran
/// the H100's tensor cores far below their speed (`m333 n333 k50304` at 39 TFLOP/s, a ninth of the
/// card's tiles busy).
const WIDE: usize = 2048;

/// `x` rounded up to a multiple of [`ALIGN`].
fn padded(x: usize) -> usize {
    x.next_multiple_of(ALIGN)
}

/// `x` rounded down to a multiple of [`ALIGN`] where it holds one.
fn aligned_down(x: usize) -> usize {
    if x >= ALIGN {
        x / ALIGN * ALIGN
    } else {
        x
    }
}

/// The block of `len` cut into as few blocks of at most `most` as it takes, evened out (on the
/// H100, GPT-2's head's gradient in blocks of 2,048 and 512 columns ran the 512 at a sixth of the
/// 2,048's speed), a multiple of [`ALIGN`] where that stays within `most`.
fn balanced(len: usize, most: usize) -> usize {
    if len <= most {
        return len;
    }
    let even = len.div_ceil(len.div_ceil(most));
    let up = even.next_multiple_of(ALIGN);
    if up <= most {
        up
    } else {
        even
    }
}

/// The blocks (mc, nc, kc) of an m x n x k product whose rounded operands do not fit `capacity`
/// elements together: k whole where blocks of C up to [`WIDE`] a side fit with it, else in chunks
/// that leave room for such blocks (each later chunk adds onto C); then C whole where it fits, else
/// its longer side in blocks at least as long as its shorter side (which stays whole), else both
/// sides halved; each cut [`balanced`]. A's block, padded to [`ALIGN`], plus B's always fit.
fn blocks(m: usize, n: usize, k: usize, capacity: usize) -> (usize, usize, usize) {
    let fits = |mc: usize, nc: usize, kc: usize| padded(mc * kc) + nc * kc <= capacity;
    let room = capacity - (ALIGN - 1);
    let (m0, n0) = (m.min(WIDE), n.min(WIDE));
    let kc = if fits(m0, n0, k) { k } else { balanced(k, aligned_down(room / (m0 + n0)).max(1)) };
    if fits(m, n, kc) {
        return (m, n, kc);
    }
    // The longer side in blocks, the shorter whole, where the blocks stay at least as long.
    let (long, short) = (m.max(n), m.min(n));
    let along = (room / kc).saturating_sub(short);
    let (mc, nc) = if along >= short {
        let along = balanced(long, aligned_down(along));
        if m >= n {
            (along, n)
        } else {
            (m, along)
        }
    } else {
        let half = aligned_down((room / kc / 2).max(1));
        (balanced(m, half), balanced(n, half))
    };
    debug_assert!(fits(mc, nc, kc), "m {m} n {n} k {k} capacity {capacity}: blocks {mc} {nc} {kc}");
    (mc, nc, kc)
}

/// The steps that compute `g` (a [`GemmType::F32Bf16`] or [`GemmType::F32F16`] product) through a
/// workspace of `capacity` two-byte elements at `workspace`; None when `g` is not such a product,
/// has a bias without beta 0 and a batch of 1 ([`Gemm::bias`]), or the workspace holds fewer than 16
/// elements. A bias goes with the product that writes each block of C first (its rows' part).
/// `rounded[0]` (`[1]`): `g.a` (`g.b`) holds the operand's 16-bit bits already (a kernel wrote them
/// so: GELU-linear's activation), laid out as `g` says in two-byte elements; the products read it
/// where it is and nothing rounds it.
pub fn rounded_steps(g: &Gemm, rounded: [bool; 2], workspace: u64, capacity: usize) -> Option<Vec<RoundedStep>> {
    let kind = match g.dtype {
        GemmType::F32Bf16 => GemmType::Bf16,
        GemmType::F32F16 => GemmType::F16,
        _ => return None,
    };
    if capacity < 2 * ALIGN || (g.bias != 0 && (g.batch != 1 || g.beta != 0.0)) {
        return None;
    }
    let mut steps = Vec::new();
    let (m, n, k) = (g.m, g.n, g.k);
    if m == 0 || n == 0 || k == 0 || g.batch == 0 {
        return Some(steps);
    }
    // The bytes of an element of A and of B as stored (two where already rounded).
    let size = |pre: bool| if pre { 2 } else { 4 };
    // Op(A)'s block rows i0.., columns l0.. as stored (k x m when transposed), likewise op(B)'s
    // block rows l0.., columns j0.. (n x k when transposed): (address, rows, cols).
    let block_a = |i0: usize, mc: usize, l0: usize, kc: usize, matrix: usize| {
        let base = g.a + size(rounded[0]) * (matrix * g.stride_a) as u64;
        if g.transa {
            (base + size(rounded[0]) * (l0 + i0 * g.lda) as u64, kc, mc)
        } else {
            (base + size(rounded[0]) * (i0 + l0 * g.lda) as u64, mc, kc)
        }
    };
    let block_b = |l0: usize, kc: usize, j0: usize, nc: usize, matrix: usize| {
        let base = g.b + size(rounded[1]) * (matrix * g.stride_b) as u64;
        if g.transb {
            (base + size(rounded[1]) * (j0 + l0 * g.ldb) as u64, nc, kc)
        } else {
            (base + size(rounded[1]) * (l0 + j0 * g.ldb) as u64, kc, nc)
        }
    };
    // What the workspace holds a matrix of: the operands not already rounded.
    let per_matrix = usize::from(!rounded[0]) * m * k + usize::from(!rounded[1]) * k * n;
    if per_matrix + ALIGN <= capacity {
        // Whole matrices, as many of the batch at a time as fit (B's after A's, aligned).
        let count = ((capacity - ALIGN) / per_matrix.max(1)).min(g.batch);
        for b0 in (0..g.batch).step_by(count) {
            let nb = count.min(g.batch - b0);
            let (sa, ra, ca) = block_a(0, m, 0, k, b0);
            let (sb, rb, cb) = block_b(0, k, 0, n, b0);
            let dst_b = workspace + 2 * padded(usize::from(!rounded[0]) * nb * m * k) as u64;
            // Each operand: read where it is when already rounded, else from its rounded copy.
            let mut operand = |pre: bool, (src, rows, cols): (u64, usize, usize), ld, stride, dst, packed| {
                if pre {
                    return (src, ld, stride);
                }
                steps.push(RoundedStep::Round(RoundOperand { src, rows, cols, ld, stride, batch: nb, dst }));
                (dst, rows, packed)
            };
            let (a, lda, stride_a) = operand(rounded[0], (sa, ra, ca), g.lda, g.stride_a, workspace, m * k);
            let (b, ldb, stride_b) = operand(rounded[1], (sb, rb, cb), g.ldb, g.stride_b, dst_b, k * n);
            steps.push(RoundedStep::Product(Gemm {
                dtype: kind,
                a,
                lda,
                stride_a,
                b,
                ldb,
                stride_b,
                c: g.c + 4 * (b0 * g.stride_c) as u64,
                batch: nb,
                ..*g
            }));
        }
        return Some(steps);
    }
    // One matrix at a time, in blocks (see [`blocks`]).
    let (mc, nc, kc) = blocks(m, n, k, capacity);
    // One matrix's block, stored `rows` x `cols` with leading dimension `ld`, rounded to `dst`.
    let round = |(src, rows, cols): (u64, usize, usize), ld, dst| {
        RoundedStep::Round(RoundOperand { src, rows, cols, ld, stride: 0, batch: 1, dst })
    };
    for matrix in 0..g.batch {
        for i0 in (0..m).step_by(mc) {
            let mb = mc.min(m - i0);
            for l0 in (0..k).step_by(kc) {
                let kb = kc.min(k - l0);
                let a = block_a(i0, mb, l0, kb, matrix);
                // A's block where it is when already rounded, else its rounded copy.
                let (a, lda) = if rounded[0] {
                    (a.0, g.lda)
                } else {
                    steps.push(round(a, g.lda, workspace));
                    (workspace, a.1)
                };
                let dst_b = workspace + 2 * padded(mb * kb) as u64;
                for j0 in (0..n).step_by(nc) {
                    let nb = nc.min(n - j0);
                    let b = block_b(l0, kb, j0, nb, matrix);
                    let (b, ldb) = if rounded[1] {
                        (b.0, g.ldb)
                    } else {
                        steps.push(round(b, g.ldb, dst_b));
                        (dst_b, b.1)
                    };
                    steps.push(RoundedStep::Product(Gemm {
                        dtype: kind,
                        m: mb,
                        n: nb,
                        k: kb,
                        a,
                        lda,
                        b,
                        ldb,
                        // C's block (i0, j0); k's later chunks add onto the first, which adds
                        // the bias's rows i0.. (bias[i] goes to C's row i).
                        beta: if l0 == 0 { g.beta } else { 1.0 },
                        bias: if g.bias != 0 && l0 == 0 { g.bias + 4 * i0 as u64 } else { 0 },
                        c: g.c + 4 * (matrix * g.stride_c + i0 + j0 * g.ldc) as u64,
                        // One matrix: g's strides are never used.
                        batch: 1,
                        ..*g
                    }));
                }
            }
        }
    }
    Some(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds to bf16 bits as the kernel does (to nearest even; no denormals or overflow here).
    fn bits(x: f32) -> u16 {
        let u = x.to_bits();
        ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }

    /// Where a step may read or write: `batch` column-major matrices of `rows` x `cols` elements of
    /// `size` bytes from `base`, leading dimension `ld`, `stride` elements apart.
    #[derive(Clone, Copy)]
    struct Region {
        base: u64,
        size: usize,
        rows: usize,
        cols: usize,
        ld: usize,
        stride: usize,
        batch: usize,
    }

    impl Region {
        fn holds(&self, address: u64) -> bool {
            let Some(bytes) = address.checked_sub(self.base) else { return false };
            let offset = bytes as usize / self.size;
            let (i, within) = (offset / self.stride.max(1), offset % self.stride.max(1));
            bytes as usize % self.size == 0
                && i < self.batch
                && within % self.ld < self.rows
                && within / self.ld < self.cols
        }
    }

    /// Runs `steps` on host memory (addresses are host pointers), checking that every element a
    /// step reads or writes lies in its place: roundings read A's or B's matrices and write the
    /// workspace, products read the workspace (or an operand `rounded` already) and the bias, and
    /// write C's m x n matrices, nothing past them.
    fn run(
        steps: &[RoundedStep],
        operands: [Region; 2],
        rounded: [bool; 2],
        (c_region, bias_region): (Region, Region),
        workspace: Region,
    ) {
        let at = |base: u64, size: usize, i: usize| base + (size * i) as u64;
        for step in steps {
            match *step {
                RoundedStep::Round(o) => {
                    for i in 0..o.batch {
                        for c in 0..o.cols {
                            for r in 0..o.rows {
                                let src = at(o.src, 4, i * o.stride + r + c * o.ld);
                                let dst = at(o.dst, 2, i * o.rows * o.cols + r + c * o.rows);
                                let unrounded = (0..2).any(|x| !rounded[x] && operands[x].holds(src));
                                assert!(unrounded, "a rounding reads outside A and B, or an operand rounded already");
                                assert!(workspace.holds(dst), "a rounding writes outside the workspace");
                                // SAFETY: both addresses lie in the test's buffers (just checked).
                                unsafe { *(dst as *mut u16) = bits(*(src as *const f32)) };
                            }
                        }
                    }
                }
                RoundedStep::Product(g) => {
                    assert_eq!(g.dtype, GemmType::Bf16);
                    let value = |p: u64, i: usize| {
                        let address = at(p, 2, i);
                        let already = (0..2).any(|o| rounded[o] && operands[o].holds(address));
                        assert!(workspace.holds(address) || already, "a product reads outside the workspace");
                        // SAFETY: in the workspace (just checked).
                        f32::from_bits(u32::from(unsafe { *(address as *const u16) }) << 16)
                    };
                    for b in 0..g.batch {
                        for j in 0..g.n {
                            for i in 0..g.m {
                                let mut acc = 0.0f64;
                                for l in 0..g.k {
                                    let ai = if g.transa { l + i * g.lda } else { i + l * g.lda };
                                    let bi = if g.transb { j + l * g.ldb } else { l + j * g.ldb };
                                    acc += f64::from(value(g.a, b * g.stride_a + ai) * value(g.b, b * g.stride_b + bi));
                                }
                                let out = at(g.c, 4, b * g.stride_c + i + j * g.ldc);
                                assert!(c_region.holds(out), "a product writes outside C");
                                // SAFETY: in C (just checked).
                                unsafe {
                                    let out = out as *mut f32;
                                    *out = if g.bias != 0 {
                                        assert!(
                                            bias_region.holds(at(g.bias, 4, i)),
                                            "a product reads outside the bias"
                                        );
                                        (g.alpha * acc + f64::from(*(at(g.bias, 4, i) as *const f32))) as f32
                                    } else {
                                        (g.alpha * acc + g.beta * f64::from(*out)) as f32
                                    };
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The rounded product of `g`'s shape computed directly, against the steps through a workspace
    /// of `capacity` elements, for A and B stored either way; C starts non-zero (beta 0.5).
    /// `expected_products`: how many products the pieces take (as few as the workspace allows).
    fn check(m: usize, n: usize, k: usize, batch: usize, capacity: usize, expected_products: usize) {
        for rounded in [[false, false], [true, false], [false, true], [true, true]] {
            check_with(m, n, k, batch, capacity, expected_products, rounded, false);
        }
        // With a bias (beta 0, one matrix): added once to each element, by C's row.
        if batch == 1 {
            for rounded in [[false, false], [true, true]] {
                check_with(m, n, k, batch, capacity, expected_products, rounded, true);
            }
        }
    }

    /// [`check`] with the operands `rounded` already given as their 16-bit bits, and with a bias
    /// (beta 0) where `with_bias`.
    #[allow(clippy::too_many_arguments)]
    fn check_with(
        m: usize,
        n: usize,
        k: usize,
        batch: usize,
        capacity: usize,
        expected_products: usize,
        rounded: [bool; 2],
        with_bias: bool,
    ) {
        for (transa, transb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (lda, ldb, ldc) = (if transa { k + 1 } else { m + 2 }, if transb { n + 3 } else { k }, m + 1);
            let (sa, sb, sc) = (lda * if transa { m } else { k } + 5, ldb * if transb { k } else { n }, ldc * n + 2);
            // Quarters from -8 to 8.5: bf16 holds them exactly and every sum here is exact in f32, so
            // any order of additions (k in chunks) gives the same bits.
            let value = |i: usize, seed: usize| ((i * 7 + seed * 13) % 67) as f32 / 4.0 - 8.0;
            let a: Vec<f32> = (0..sa * batch).map(|i| value(i, 1)).collect();
            let b: Vec<f32> = (0..sb * batch).map(|i| value(i, 2)).collect();
            // The operands rounded already: their bits.
            let (a16, b16): (Vec<u16>, Vec<u16>) =
                (a.iter().map(|&x| bits(x)).collect(), b.iter().map(|&x| bits(x)).collect());
            let (a_at, b_at) = (
                if rounded[0] { a16.as_ptr() as u64 } else { a.as_ptr() as u64 },
                if rounded[1] { b16.as_ptr() as u64 } else { b.as_ptr() as u64 },
            );
            let c0: Vec<f32> = (0..sc * batch).map(|i| value(i, 3)).collect();
            // bias[i] for C's row i, and one value past the end that nothing may read.
            let bias: Vec<f32> = (0..=m).map(|i| value(i, 4)).collect();
            let g = |c: &mut Vec<f32>| Gemm {
                dtype: GemmType::F32Bf16,
                transa,
                transb,
                m,
                n,
                k,
                alpha: 2.0,
                a: a_at,
                lda,
                stride_a: sa,
                b: b_at,
                ldb,
                stride_b: sb,
                beta: if with_bias { 0.0 } else { 0.5 },
                c: c.as_mut_ptr() as u64,
                ldc,
                stride_c: sc,
                batch,
                bias: if with_bias { bias.as_ptr() as u64 } else { 0 },
            };
            // Directly: every operand rounded, the sum in f64.
            let mut want = c0.clone();
            let direct = g(&mut want);
            let round = |x: f32| f32::from_bits(u32::from(bits(x)) << 16);
            for bi in 0..batch {
                for j in 0..n {
                    for i in 0..m {
                        let acc: f64 = (0..k)
                            .map(|l| {
                                let ai = if transa { l + i * lda } else { i + l * lda };
                                let bj = if transb { j + l * ldb } else { l + j * ldb };
                                f64::from(round(a[bi * sa + ai]) * round(b[bi * sb + bj]))
                            })
                            .sum();
                        let out = &mut want[bi * sc + i + j * ldc];
                        let added = if with_bias { f64::from(bias[i]) } else { direct.beta * f64::from(*out) };
                        *out = (direct.alpha * acc + added) as f32;
                    }
                }
            }
            let mut got = c0.clone();
            let mut workspace = vec![0u16; capacity];
            let steps = rounded_steps(&g(&mut got), rounded, workspace.as_mut_ptr() as u64, capacity)
                .expect("a rounded product");
            let region =
                |base: u64, size, (rows, cols), ld, stride| Region { base, size, rows, cols, ld, stride, batch };
            let stored = |t: bool, (r, c): (usize, usize)| if t { (c, r) } else { (r, c) };
            let size = |pre: bool| if pre { 2 } else { 4 };
            let operands = [
                region(a_at, size(rounded[0]), stored(transa, (m, k)), lda, sa),
                region(b_at, size(rounded[1]), stored(transb, (k, n)), ldb, sb),
            ];
            let ws = Region {
                base: workspace.as_ptr() as u64,
                size: 2,
                rows: capacity,
                cols: 1,
                ld: capacity,
                stride: capacity,
                batch: 1,
            };
            let bias_region =
                Region { base: bias.as_ptr() as u64, size: 4, rows: m, cols: 1, ld: m, stride: m, batch: 1 };
            run(&steps, operands, rounded, (region(got.as_ptr() as u64, 4, (m, n), ldc, sc), bias_region), ws);
            // A bias goes with the first product of each block of C only.
            if with_bias {
                let with = steps.iter().filter(|s| matches!(s, RoundedStep::Product(p) if p.bias != 0)).count();
                let firsts = steps.iter().filter(|s| matches!(s, RoundedStep::Product(p) if p.beta == 0.0)).count();
                assert_eq!(with, firsts, "m {m} n {n} k {k} capacity {capacity}: products with the bias");
            }
            // Nothing rounds what is rounded already.
            let roundings = steps.iter().filter(|s| matches!(s, RoundedStep::Round(_))).count();
            let products = steps.len() - roundings;
            if rounded[0] && rounded[1] {
                assert_eq!(roundings, 0);
            } else if rounded.contains(&true) {
                assert!(roundings <= products, "{roundings} roundings for {products} products");
            }
            // As few as the workspace allows: fewer where an operand rounded already leaves it more room.
            let what = format!("m {m} n {n} k {k} batch {batch} capacity {capacity} rounded {rounded:?}: products");
            match rounded.contains(&true) {
                false => assert_eq!(products, expected_products, "{what}"),
                true => assert!(products <= expected_products, "{what}: {products}"),
            }
            assert_eq!(
                got, want,
                "m {m} n {n} k {k} batch {batch} transa {transa} transb {transb} capacity {capacity} rounded {rounded:?}"
            );
            // Nothing outside C changed: the padding between columns and matrices kept its values.
            for (i, (x, y)) in got.iter().zip(&c0).enumerate() {
                let (r, col) = ((i % sc) % ldc, (i % sc) / ldc);
                if r >= m || col >= n {
                    assert_eq!(x, y, "C's padding at {i}");
                }
            }
        }
    }

    #[test]
    fn a_rounded_product_in_pieces_is_the_product_of_the_rounded_operands() {
        check(5, 4, 3, 1, 1000, 1); // whole
        check(5, 4, 3, 3, 1000, 1); // a whole batch
        check(5, 4, 3, 3, 70, 2); // two matrices at a time (5 x 3 + 3 x 4 = 27 each, and 8 to align), then one
        check(5, 4, 3, 3, 35, 3); // one matrix at a time
        check(7, 6, 9, 1, 60, 3); // C whole, k in chunks of 3 (at most 4), the later adding onto C
        check(3, 8, 4, 1, 16, 4); // C whole, k one at a time
        check(2100, 2, 3, 1, 6200, 2); // k whole, C's 2,100 rows in blocks of 1,056 and 1,044
        check(2, 2100, 3, 1, 6200, 2); // likewise its 2,100 columns
        check(20, 20, 5, 1, 16, 125); // a workspace too small for a row: blocks of C of 4 x 4, k one at a time
        check(5, 4, 3, 1, 30, 1); // 27 elements and B's alignment do not fit 30: the blocks' path, C whole
        check(5, 4, 3, 3, 30, 3); // likewise each matrix of a batch, one at a time
        check(5, 4, 3, 3, 60, 3); // a batch: 2 x 27 and the alignment do not fit 60, one matrix at a time
        check(7, 6, 10, 1, 60, 3); // k in chunks of 4, 4 and 2
        check(5, 4, 3, 2, 62, 1); // two whole matrices exactly fill 62 (2 x 27 and 8 to align)
    }

    /// An operand rounded already takes no room in the workspace: with A's bits given, a batch of
    /// three 5 x 3 by 3 x 4 products keeps only B's 12 elements a matrix there, so all three go in
    /// one product where both operands' 27 take two.
    #[test]
    fn an_operand_rounded_already_leaves_the_workspace_to_the_other() {
        check_with(5, 4, 3, 3, 70, 1, [true, false], false);
        check_with(5, 4, 3, 3, 70, 1, [false, true], false);
        check_with(5, 4, 3, 3, 70, 2, [false, false], false);
    }

    /// GPT-2's products that do not fit the 64 MiB workspace cut into large pieces: the head's
    /// logits for a chunk of 2,048 rows, their gradient through the head's weight, and a weight's
    /// gradient over 342 x 1,024 positions.
    #[test]
    fn large_products_keep_large_blocks() {
        let capacity = (64 << 20) / 2;
        // At most 41,640 rows a block: two of 25,152.
        assert_eq!(blocks(50_304, 2048, 768, capacity), (25_152, 2048, 768));
        // At most 11,912 of k a chunk: five of 10,064 (the last 50,304 - 4 x 10,064 = 10,048).
        assert_eq!(blocks(768, 2048, 50_304, capacity), (768, 2048, 10_064));
        // At most 21,840: seventeen of 20,608.
        assert_eq!(blocks(768, 768, 342 * 1024, capacity), (768, 768, 20_608));
        // GPT-2's head gradient for a chunk of 2,560 rows: k in five even chunks leaves room for C
        // whole (before, chunks of 11,912 left 2,048 and 512 columns, the 512 at a sixth of the speed).
        assert_eq!(blocks(768, 2560, 50_304, capacity), (768, 2560, 10_064));
        assert_eq!((balanced(10, 4), balanced(9, 4), balanced(4, 4), balanced(100, 48)), (4, 3, 4, 40));
        // Both sides longer than the workspace holds at k's chunk: both halved, evened out.
        assert_eq!(blocks(3000, 3000, 20, 40_000), (1504, 1504, 8));
    }

    /// Roundings go two to a launch where two come in a row, in order: a whole product's A and B, or
    /// a k chunk's; in blocks of C's columns, A's with B's first block, then B's later ones alone.
    #[test]
    fn roundings_in_a_row_share_a_launch() {
        let g = Gemm {
            dtype: GemmType::F32Bf16,
            transa: false,
            transb: false,
            m: 40,
            n: 40,
            k: 3,
            alpha: 1.0,
            a: 1 << 20,
            lda: 40,
            stride_a: 0,
            b: 2 << 20,
            ldb: 3,
            stride_b: 0,
            beta: 0.0,
            c: 3 << 20,
            ldc: 40,
            stride_c: 0,
            batch: 1,
            bias: 0,
        };
        let kinds = |m: usize, n: usize, capacity| {
            let g = Gemm { m, n, lda: m, ldc: m, ..g };
            let steps = rounded_steps(&g, [false; 2], 4 << 20, capacity).unwrap();
            let launches = rounded_launches(steps.clone());
            // Nothing lost or reordered.
            let flat: Vec<RoundedStep> = launches
                .iter()
                .flat_map(|l| match *l {
                    RoundedLaunch::Round(a, b) => [Some(RoundedStep::Round(a)), b.map(RoundedStep::Round)],
                    RoundedLaunch::Product(p) => [Some(RoundedStep::Product(p)), None],
                })
                .flatten()
                .collect();
            assert_eq!(flat, steps);
            launches
                .iter()
                .map(|l| match l {
                    RoundedLaunch::Round(_, Some(_)) => "AB",
                    RoundedLaunch::Round(_, None) => "B",
                    RoundedLaunch::Product(_) => "P",
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(40, 40, 1000), ["AB", "P"]);
        // 240 elements do not fit 180: k in chunks of 2 and 1, A and B rounded for each.
        assert_eq!(kinds(40, 40, 180), ["AB", "P", "AB", "P"]);
        // C's 2,100 columns in two blocks (k whole): A once, B's blocks alone.
        assert_eq!(kinds(2, 2100, 6200), ["AB", "P", "B", "P"]);
    }

    #[test]
    fn only_rounded_products_are_cut_and_a_bias_only_with_beta_0_and_one_matrix() {
        let g = Gemm {
            dtype: GemmType::F32,
            transa: false,
            transb: false,
            m: 2,
            n: 2,
            k: 2,
            alpha: 1.0,
            a: 0,
            lda: 2,
            stride_a: 0,
            b: 0,
            ldb: 2,
            stride_b: 0,
            beta: 0.0,
            c: 0,
            ldc: 2,
            stride_c: 0,
            batch: 1,
            bias: 0,
        };
        assert_eq!(rounded_steps(&g, [false; 2], 0, 100), None);
        let biased = Gemm { dtype: GemmType::F32Bf16, bias: 8, ..g };
        assert!(rounded_steps(&biased, [false; 2], 0, 100).is_some());
        assert_eq!(rounded_steps(&Gemm { beta: 1.0, ..biased }, [false; 2], 0, 100), None);
        assert_eq!(rounded_steps(&Gemm { batch: 2, ..biased }, [false; 2], 0, 100), None);
        assert_eq!(rounded_steps(&Gemm { dtype: GemmType::F32Bf16, ..g }, [false; 2], 0, 15), None);
        // A product of nothing (or over nothing) takes no steps: the backend handles those.
        for (m, n, k, batch) in [(0, 2, 2, 1), (2, 0, 2, 1), (2, 2, 0, 1), (2, 2, 2, 0)] {
            let empty = Gemm { dtype: GemmType::F32Bf16, m, n, k, batch, ..g };
            assert_eq!(rounded_steps(&empty, [false; 2], 0, 100), Some(Vec::new()), "{m} {n} {k} {batch}");
        }
        let steps = rounded_steps(&Gemm { dtype: GemmType::F32F16, ..g }, [false; 2], 64, 100).unwrap();
        // B's copy after A's 4 elements, at the next 16 bytes.
        assert!(matches!(steps[2], RoundedStep::Product(p) if p.dtype == GemmType::F16 && p.a == 64 && p.b == 64 + 16));
    }
}
