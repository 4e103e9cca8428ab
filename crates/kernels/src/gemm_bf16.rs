//! `C (+)= A @ B` as a bfloat16 product (Note [bf16 products]): both operands rounded to bfloat16,
//! the products accumulated in f32, in the order AVX512-BF16's `vdpbf16ps` takes them, so every
//! level computes the same bits.
//!
//! Note [bf16 products]
//! A bf16 product of `A[m x k]` and `B[k x n]` (f32 in memory) is defined as:
//! - each operand element is rounded to bfloat16, to nearest even ([`to_bf16`]); a NaN stays a NaN,
//!   and a value whose bfloat16 is denormal reads as a zero of its sign (the instruction's DAZ);
//! - the depth is cut into blocks of [`KC`] steps (the f32 GEMM's); within a block, each output
//!   element starts from zero and adds the products of the pairs of steps (2p, 2p + 1) in order of
//!   p, the odd step's product first, each addition rounded to f32 (a bfloat16 product is exact in
//!   f32, so this is `vdpbf16ps`, measured on an AMD EPYC: odd first, two roundings per pair);
//!   an odd depth's last pair has a zero second step;
//! - a block's sums are then added to C as the f32 GEMM adds a tile: onto zero, onto C's values,
//!   or onto a bias row (`Start`), the first block from the start and the later ones onto C.
//!
//! The levels ([`Bf16Level`]) differ only in how many of these additions one instruction makes, so
//! they agree bit for bit while no sum falls below f32's smallest normal (1.2e-38), which the
//! AVX512-BF16 instruction flushes to zero and the other levels keep (the tests pin each level
//! against the portable one). What is rounded is PyTorch autocast's split: matrix products take
//! bfloat16 operands and accumulate in f32; everything else stays f32.
//!
//! Both operands are always packed, rounded. AVX512-BF16's packs hold pair words (a step pair's two
//! bfloat16, the even step in the low half: half the bytes of an f32 pack) for its own 12 x 32
//! tile; the other levels' packs hold the rounded values as f32, each pair's odd step first, for the
//! f32 GEMM's tile of the same level, which adds the steps in order (an exact product, then one
//! rounding, whether fused or not) and so computes the definition. The packs live in each thread's
//! reused buffers, as the f32 GEMM's do.

use crate::gemm::{MatMut, MatRef, MicroKernel, Start, KC, MC, NC};
use crate::Isa;
use rayon::prelude::*;
use std::cell::RefCell;

/// How a product computes (the device's setting, `--precision`): in f32, or as a bf16 product
/// (Note [bf16 products]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Products {
    #[default]
    F32,
    Bf16,
}

impl Products {
    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Products::F32 => "fp32",
            Products::Bf16 => "bf16",
        }
    }
}

/// Rows and columns of the AVX512-BF16 tile (its packs hold pair words).
const PAIR_MR: usize = 12;
const PAIR_NR: usize = 32;
/// The largest tile of any level (an edge tile is computed whole on the stack).
const MAX_TILE: usize = 12 * 32;
/// Words between one packed panel's end and the next one's start (the f32 GEMM's `PANEL_PAD`: keeps
/// a pack's writes at one depth step out of one L1 set).
const PANEL_PAD: usize = 16;

/// A level of the bf16 product, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bf16Level {
    /// AVX512-BF16's `vdpbf16ps` (Intel since Cooper Lake, AMD since Zen 4) on packs of bfloat16
    /// pairs: two products per lane per instruction.
    Avx512Bf16,
    /// AVX-512F without BF16: the f32 GEMM's AVX-512 tile on packs of rounded values.
    Avx512,
    /// AVX2 with FMA: the f32 GEMM's AVX2 tile on packs of rounded values.
    Avx2,
    /// Plain Rust (any CPU): the f32 GEMM's portable tile on packs of rounded values.
    Portable,
}

impl Bf16Level {
    /// Every level, best first.
    pub const ALL: [Bf16Level; 4] = [Bf16Level::Avx512Bf16, Bf16Level::Avx512, Bf16Level::Avx2, Bf16Level::Portable];

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Level::Avx512Bf16 => "avx512_bf16",
            Bf16Level::Avx512 => "avx512",
            Bf16Level::Avx2 => "avx2",
            Bf16Level::Portable => "portable",
        }
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Bf16Level::Avx512Bf16 => Isa::Avx512.is_supported() && std::arch::is_x86_feature_detected!("avx512bf16"),
            #[cfg(not(target_arch = "x86_64"))]
            Bf16Level::Avx512Bf16 => false,
            Bf16Level::Avx512 => Isa::Avx512.is_supported(),
            Bf16Level::Avx2 => Isa::Avx2Fma.is_supported(),
            Bf16Level::Portable => true,
        }
    }

    /// The levels this CPU supports, best first (always ends with [`Bf16Level::Portable`]).
    pub fn supported() -> Vec<Bf16Level> {
        Bf16Level::ALL.into_iter().filter(|l| l.is_supported()).collect()
    }

    /// The level for an instruction set (`MEMFIT_ISA` forces one): AVX512-BF16 under AVX-512 when
    /// the CPU has it.
    pub fn for_isa(isa: Isa) -> Bf16Level {
        let want = match isa {
            Isa::Avx512 if Bf16Level::Avx512Bf16.is_supported() => Bf16Level::Avx512Bf16,
            Isa::Avx512 => Bf16Level::Avx512,
            Isa::Avx2Fma => Bf16Level::Avx2,
            Isa::Portable => Bf16Level::Portable,
        };
        if want.is_supported() {
            want
        } else {
            Bf16Level::Portable
        }
    }

    /// The level the process's instruction set ([`Isa::active`]) gives.
    pub fn active() -> Bf16Level {
        Bf16Level::for_isa(Isa::active())
    }
}

/// `x` rounded to bfloat16 (to nearest, ties to even), as its bits; a NaN stays a (quiet) NaN,
/// infinities stay, a finite value too large becomes an infinity, and a denormal result is a zero
/// of its sign (Note [bf16 products]).
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    (round_bits(x.to_bits()) >> 16) as u16
}

/// The f32 value of bfloat16 bits (exact).
#[inline(always)]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` rounded to bfloat16, as an f32 (what a bf16 product reads for it).
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    from_bf16(to_bf16(x))
}

/// How a level's packs hold the operands, and its micro-kernel.
#[derive(Clone, Copy)]
enum Kernel {
    /// Pair words (a step pair's two bfloat16, the even step low), `vdpbf16ps`.
    Pairs,
    /// Rounded values as f32, one step at a time with each pair's odd step first, so that the f32
    /// GEMM's tile, adding the steps in order (an exact product then one rounding, fused or not),
    /// computes the definition.
    Steps(MicroKernel<f32>),
}

impl Kernel {
    fn of(level: Bf16Level) -> Kernel {
        let isa = match level {
            #[cfg(target_arch = "x86_64")]
            Bf16Level::Avx512Bf16 if level.is_supported() => return Kernel::Pairs,
            Bf16Level::Avx512Bf16 | Bf16Level::Avx512 => Isa::Avx512,
            Bf16Level::Avx2 => Isa::Avx2Fma,
            Bf16Level::Portable => Isa::Portable,
        };
        // The f32 GEMM's kernel for the level (its portable one where the CPU lacks the level).
        Kernel::Steps(<f32 as crate::gemm::sealed::Sealed>::micro_kernel(isa))
    }

    /// The tile's rows and columns.
    fn tile(self) -> (usize, usize) {
        match self {
            Kernel::Pairs => (PAIR_MR, PAIR_NR),
            Kernel::Steps(mk) => (mk.mr, mk.nr),
        }
    }

    /// Words of one packed panel of `width` lines over `pairs` step pairs: room for the panel as
    /// f32 (which a pair-word panel is packed from, in place, into its first half), padded.
    fn panel_words(self, pairs: usize, width: usize) -> usize {
        2 * pairs * width + PANEL_PAD
    }

    /// `C[mr x nr] = start + A_panel · B_panel` over `pairs` step pairs.
    ///
    /// # Safety
    /// The panels hold `pairs` step pairs of this kernel's packing; C's tile is valid.
    unsafe fn run(self, pairs: usize, a: *const u32, b: *const u32, c: *mut f32, rs_c: isize, start: Start<f32>) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Pairs => avx512bf16::kernel_checked(pairs, a, b, c, rs_c, start),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Pairs => unreachable!("AVX512-BF16 is an x86-64 level"),
            Kernel::Steps(mk) => {
                (mk.run)(2 * pairs, a as *const f32, mk.mr as isize, b as *const f32, mk.nr as isize, c, rs_c, start)
            }
        }
    }

    /// Packs `lines` lines of `depth` steps (step s of line i at `src + i * line_stride + s *
    /// step_stride`) into panels of `width` lines, zero past the block's edges: each panel first as
    /// the f32 GEMM packs it (`gemm::pack`, transposing contiguous lines in registers), then rounded
    /// in place, into pair words or with each pair's steps swapped.
    ///
    /// # Safety
    /// The block's elements must be valid; `out` holds `lines.div_ceil(width)` panels of
    /// [`Kernel::panel_words`] words.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pack(
        self,
        src: *const f32,
        line_stride: isize,
        step_stride: isize,
        lines: usize,
        depth: usize,
        width: usize,
        out: *mut u32,
    ) {
        let pairs = depth.div_ceil(2);
        // The f32 packing of the same tile (its transposing path where the level has one).
        let f32_kernel = match self {
            Kernel::Pairs => <f32 as crate::gemm::sealed::Sealed>::micro_kernel(Isa::Avx512),
            Kernel::Steps(mk) => mk,
        };
        for panel in 0..lines.div_ceil(width) {
            let dst = out.add(panel * self.panel_words(pairs, width));
            let first = src.offset((panel * width) as isize * line_stride);
            let n = width.min(lines - panel * width);
            crate::gemm::pack(f32_kernel, first, line_stride, step_stride, n, depth, width, dst as *mut f32, None);
            if depth % 2 == 1 {
                std::ptr::write_bytes(dst.add(depth * width), 0, width);
            }
            for p in 0..pairs {
                let (even, odd) = (dst.add(2 * p * width), dst.add((2 * p + 1) * width));
                match self {
                    Kernel::Steps(_) => {
                        for w in 0..width {
                            let (e, o) = (*even.add(w), *odd.add(w));
                            *even.add(w) = round_bits(o);
                            *odd.add(w) = round_bits(e);
                        }
                    }
                    Kernel::Pairs => {
                        // Word p of a line lands at or before what it is made of: read a step pair,
                        // then write its words.
                        let mut words = [0u32; PAIR_NR];
                        for (w, word) in words.iter_mut().enumerate().take(width) {
                            *word = round_bits(*even.add(w)) >> 16 | (round_bits(*odd.add(w)) & 0xFFFF_0000);
                        }
                        std::ptr::copy_nonoverlapping(words.as_ptr(), dst.add(p * width), width);
                    }
                }
            }
        }
    }
}

/// The bits of the f32 `bits` rounded to bfloat16 ([`to_bf16`]) in the high half, without branches
/// (the packs' loops vectorize).
#[inline(always)]
fn round_bits(bits: u32) -> u32 {
    let nan = (bits & 0x7FFF_FFFF) > 0x7F80_0000;
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    let r = if nan { (bits | 0x0040_0000) & 0xFFFF_0000 } else { rounded };
    if r & 0x7F80_0000 == 0 {
        r & 0x8000_0000
    } else {
        r
    }
}

/// Adds a finished tile's sums to C as the f32 GEMM stores a tile (the sum first, then what C starts
/// from), for the `rows x cols` corner of a tile of row stride `nr`.
///
/// # Safety
/// C's rows and columns, and a bias row's columns, must be valid.
unsafe fn store(tile: &[f32], nr: usize, rows: usize, cols: usize, c: *mut f32, rs_c: isize, start: Start<f32>) {
    for i in 0..rows {
        let p = c.offset(i as isize * rs_c);
        for j in 0..cols {
            let v = tile[i * nr + j];
            *p.add(j) = match start {
                Start::Zero => v,
                Start::Accumulate => v + *p.add(j),
                Start::Bias(b) => v + *b.add(j),
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    use super::{Start, PAIR_MR as MR, PAIR_NR as NR};
    use std::arch::x86_64::*;

    /// # Safety
    /// As [`super::Kernel::run`]; handed out only when the CPU has AVX-512F and AVX512-BF16.
    pub(super) unsafe fn kernel_checked(
        pairs: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        rs_c: isize,
        start: Start<f32>,
    ) {
        kernel(pairs, a, b, c, rs_c, start)
    }

    /// The 12 x 32 tile in 24 zmm accumulators: each step pair loads B's two vectors of 16 pair words
    /// and broadcasts each row's word, 24 `vdpbf16ps` (two products per lane each).
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn kernel(pairs: usize, a: *const u32, b: *const u32, c: *mut f32, rs_c: isize, start: Start<f32>) {
        let mut lo = [_mm512_setzero_ps(); MR];
        let mut hi = [_mm512_setzero_ps(); MR];
        for p in 0..pairs {
            let bp = b.add(p * NR);
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(16) as *const _));
            let ap = a.add(p * MR);
            for i in 0..MR {
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
                lo[i] = _mm512_dpbf16_ps(lo[i], ai, b0);
                hi[i] = _mm512_dpbf16_ps(hi[i], ai, b1);
            }
        }
        for i in 0..MR {
            let p = c.offset(i as isize * rs_c);
            let (l, h) = match start {
                Start::Zero => (lo[i], hi[i]),
                Start::Accumulate => {
                    (_mm512_add_ps(lo[i], _mm512_loadu_ps(p)), _mm512_add_ps(hi[i], _mm512_loadu_ps(p.add(16))))
                }
                Start::Bias(r) => {
                    (_mm512_add_ps(lo[i], _mm512_loadu_ps(r)), _mm512_add_ps(hi[i], _mm512_loadu_ps(r.add(16))))
                }
            };
            _mm512_storeu_ps(p, l);
            _mm512_storeu_ps(p.add(16), h);
        }
    }
}

thread_local! {
    /// This thread's pack buffers (words), taken while a product uses one and put back after.
    static PACKS: RefCell<Vec<Vec<u32>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on one of this thread's pack buffers of at least `words` words.
fn with_pack<R>(words: usize, f: impl FnOnce(*mut u32) -> R) -> R {
    let mut buf = PACKS.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    if buf.len() < words {
        buf.resize(words, 0);
    }
    let result = f(buf.as_mut_ptr());
    PACKS.with(|p| p.borrow_mut().push(buf));
    result
}

/// A pointer shared by the tasks of one product, each using its own part.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: tasks read the shared B pack only after it is written, and write disjoint tiles of C.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}
impl<T> Shared<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Multiplies one packed A block (`mc` rows) by the packed B block (`nc` columns), `pairs` pairs
/// deep, into C's block at `c`, the tiles of B's panels `panels` only.
///
/// # Safety
/// As [`gemm_bf16`] for the block.
#[allow(clippy::too_many_arguments)]
unsafe fn multiply_block(
    kernel: Kernel,
    pairs: usize,
    a_pack: *const u32,
    mc: usize,
    b_pack: *const u32,
    nc: usize,
    panels: std::ops::Range<usize>,
    c: MatMut<f32>,
    start: Start<f32>,
) {
    let (mr, nr) = kernel.tile();
    for ir in 0..mc.div_ceil(mr) {
        let rows = mr.min(mc - ir * mr);
        for jr in panels.clone() {
            let cols = nr.min(nc - jr * nr);
            let a = a_pack.add(ir * kernel.panel_words(pairs, mr));
            let b = b_pack.add(jr * kernel.panel_words(pairs, nr));
            let dst = c.at(ir * mr, jr * nr).ptr;
            let st = start.at_col(jr * nr);
            if rows == mr && cols == nr {
                kernel.run(pairs, a, b, dst, c.rs, st);
            } else {
                // An edge tile: the kernel writes a whole tile on the stack, the corner goes to C.
                let mut tile = [0f32; MAX_TILE];
                kernel.run(pairs, a, b, tile.as_mut_ptr(), nr as isize, Start::Zero);
                store(&tile, nr, rows, cols, dst, c.rs, st);
            }
        }
    }
}

/// `C[m x n] (+)= A[m x k] @ B[k x n]` as a bf16 product (Note [bf16 products]) with `level`'s
/// micro-kernel (the portable one where the CPU lacks it), on up to `threads` threads of the
/// current rayon pool; C starts from `start`.
///
/// # Safety
/// The operands must be valid for their shapes and strides, and C must not overlap A or B.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16(
    level: Bf16Level,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<f32>,
    start: Start<f32>,
    a: MatRef<f32>,
    b: MatRef<f32>,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        let zeros = [0f32; MAX_TILE];
        for i0 in (0..m).step_by(PAIR_MR) {
            for j0 in (0..n).step_by(PAIR_NR) {
                store(
                    &zeros,
                    PAIR_NR,
                    PAIR_MR.min(m - i0),
                    PAIR_NR.min(n - j0),
                    c.at(i0, j0).ptr,
                    c.rs,
                    start.at_col(j0),
                );
            }
        }
        return;
    }
    let kernel = Kernel::of(level);
    let (mr, nr) = kernel.tile();
    let parallel = threads > 1 && m * n * k >= crate::gemm::PARALLEL_WORK;
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let panels = nc.div_ceil(nr);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let pairs = kc.div_ceil(2);
            let st = start.at_col(jc).for_block(pc);
            with_pack(panels * kernel.panel_words(pairs, nr), |b_pack| {
                // B's lines are its columns, A's its rows.
                kernel.pack(b.at(pc, jc).ptr, b.cs, b.rs, nc, kc, nr, b_pack);
                let (b_shared, blocks) = (Shared(b_pack), m.div_ceil(MC));
                let run = |ib: usize, cols: std::ops::Range<usize>| {
                    let (ic, mc) = (ib * MC, MC.min(m - ib * MC));
                    with_pack(mc.div_ceil(mr) * kernel.panel_words(pairs, mr), |a_pack| {
                        kernel.pack(a.at(ic, pc).ptr, a.rs, a.cs, mc, kc, mr, a_pack);
                        multiply_block(kernel, pairs, a_pack, mc, b_shared.get(), nc, cols, c.at(ic, jc), st);
                    });
                };
                if parallel && blocks >= threads {
                    (0..blocks).into_par_iter().for_each(|ib| run(ib, 0..panels));
                } else if parallel {
                    // Too few row blocks to share out: each thread takes a share of the columns.
                    let share = panels.div_ceil(threads);
                    for ib in 0..blocks {
                        (0..panels.div_ceil(share))
                            .into_par_iter()
                            .for_each(|t| run(ib, t * share..panels.min((t + 1) * share)));
                    }
                } else {
                    (0..blocks).for_each(|ib| run(ib, 0..panels));
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeded values in [-scale, scale), none denormal.
    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// The definition of Note [bf16 products], element by element.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        (ars, acs): (usize, usize),
        b: &[f32],
        (brs, bcs): (usize, usize),
        c: &mut [f32],
        start: &str,
        bias: &[f32],
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut out = c[i * n + j];
                for (blk, k0) in (0..k).step_by(KC).enumerate() {
                    let kc = KC.min(k - k0);
                    let mut acc = 0f32;
                    for p in 0..kc.div_ceil(2) {
                        let s = |t: usize| {
                            if t < kc {
                                round_bf16(a[i * ars + (k0 + t) * acs]) * round_bf16(b[(k0 + t) * brs + j * bcs])
                            } else {
                                0.0
                            }
                        };
                        acc += s(2 * p + 1);
                        acc += s(2 * p);
                    }
                    out = match (blk, start) {
                        (0, "zero") => acc,
                        (0, "bias") => acc + bias[j],
                        _ => acc + out,
                    };
                }
                if k == 0 {
                    out = match start {
                        "zero" => 0.0,
                        "bias" => bias[j],
                        _ => out,
                    };
                }
                c[i * n + j] = out;
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_with_nan_infinity_and_denormals_as_the_instruction_reads_them() {
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to the even one, 1; 1 + 3 * 2^-8 to 1 + 2^-6.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 1.0 + 1.0 / 128.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert_eq!(to_bf16(f32::from_bits(0x0040_0000)), 0, "a denormal reads as zero");
        assert_eq!(to_bf16(-f32::from_bits(0x0040_0000)), 0x8000, "of its sign");
        assert_eq!(round_bf16(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
    }

    /// Every supported level computes the definition's bits: shapes across the tile, block and
    /// depth edges (odd depths, more than one depth block, partial tiles), operands row- and
    /// column-major, C overwritten, accumulated into and started from a bias, on one thread and two.
    #[test]
    fn every_level_computes_the_definitions_bits() {
        let shapes = [(1, 1, 1), (12, 32, 2), (13, 33, 3), (25, 70, 517), (200, 40, 64), (7, 530, 1030), (3, 5, 0)];
        let mut checked = 0;
        for level in Bf16Level::supported() {
            for &(m, n, k) in &shapes {
                for (case, (a_major, b_major)) in [(true, true), (false, false), (true, false)].into_iter().enumerate()
                {
                    for start in ["zero", "accumulate", "bias"] {
                        let threads = 1 + case % 2;
                        let a = values(m * k, 1 + case as u64, 2.0);
                        let b = values(k * n, 9, 3.0);
                        let bias = values(n, 4, 1.0);
                        let before = values(m * n, 5, 1.0);
                        let (ast, ars) = if a_major { ((k, 1), k as isize) } else { ((1, m), 1) };
                        let (bst, brs) = if b_major { ((n, 1), n as isize) } else { ((1, k), 1) };
                        let mut want = before.clone();
                        reference(m, n, k, &a, ast, &b, bst, &mut want, start, &bias);
                        let mut got = before.clone();
                        let st = match start {
                            "zero" => Start::Zero,
                            "accumulate" => Start::Accumulate,
                            _ => Start::Bias(bias.as_ptr()),
                        };
                        let am = MatRef { ptr: a.as_ptr(), rs: ars, cs: if a_major { 1 } else { m as isize } };
                        let bm = MatRef { ptr: b.as_ptr(), rs: brs, cs: if b_major { 1 } else { k as isize } };
                        // SAFETY: the operands are the vectors above with these shapes and strides.
                        unsafe {
                            gemm_bf16(
                                level,
                                m,
                                n,
                                k,
                                MatMut { ptr: got.as_mut_ptr(), rs: n as isize },
                                st,
                                am,
                                bm,
                                threads,
                            )
                        };
                        let differ = want.iter().zip(&got).filter(|(w, g)| w.to_bits() != g.to_bits()).count();
                        assert_eq!(
                            differ, 0,
                            "{} m {m} n {n} k {k} a row-major {a_major} b row-major {b_major} {start}: {differ} of {} differ",
                            level.name(),
                            want.len()
                        );
                        checked += 1;
                    }
                }
            }
        }
        let skipped: Vec<&str> = Bf16Level::ALL.iter().filter(|l| !l.is_supported()).map(|l| l.name()).collect();
        println!(
            "bf16 products: {checked} cases on {:?}; skipped (not on this CPU): {skipped:?}",
            Bf16Level::supported()
        );
    }

    /// The definition is a product of bfloat16 operands: within f32 accumulation's error of the
    /// exact (f64) product of the rounded operands, and far from the f32 product when operands
    /// carry bits bfloat16 drops.
    #[test]
    fn a_bf16_product_is_the_product_of_the_rounded_operands() {
        let (m, n, k) = (9, 11, 300);
        let a = values(m * k, 3, 1.0);
        let b = values(k * n, 4, 1.0);
        let mut got = vec![0f32; m * n];
        // SAFETY: row-major operands of these shapes.
        unsafe {
            gemm_bf16(
                Bf16Level::Portable,
                m,
                n,
                k,
                MatMut { ptr: got.as_mut_ptr(), rs: n as isize },
                Start::Zero,
                MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 },
                MatRef { ptr: b.as_ptr(), rs: n as isize, cs: 1 },
                1,
            )
        };
        let mut far_from_f32 = 0;
        for i in 0..m {
            for j in 0..n {
                let exact: f64 =
                    (0..k).map(|t| round_bf16(a[i * k + t]) as f64 * round_bf16(b[t * n + j]) as f64).sum();
                let f32_exact: f64 = (0..k).map(|t| a[i * k + t] as f64 * b[t * n + j] as f64).sum();
                let g = got[i * n + j] as f64;
                assert!((g - exact).abs() <= 1e-5 * (1.0 + exact.abs()), "({i}, {j}): {g} vs {exact}");
                if (g - f32_exact).abs() > 1e-4 {
                    far_from_f32 += 1;
                }
            }
        }
        assert!(
            far_from_f32 > m * n / 2,
            "the operands were not rounded: {far_from_f32} of {} differ from f32's",
            m * n
        );
    }

    #[test]
    fn the_level_follows_the_instruction_set() {
        assert_eq!(Bf16Level::for_isa(Isa::Portable), Bf16Level::Portable);
        if Isa::Avx2Fma.is_supported() {
            assert_eq!(Bf16Level::for_isa(Isa::Avx2Fma), Bf16Level::Avx2);
        }
        if Isa::Avx512.is_supported() {
            let want = if Bf16Level::Avx512Bf16.is_supported() { Bf16Level::Avx512Bf16 } else { Bf16Level::Avx2 };
            assert_eq!(Bf16Level::for_isa(Isa::Avx512), want);
        }
        assert_eq!(Bf16Level::supported().last(), Some(&Bf16Level::Portable));
    }
}
