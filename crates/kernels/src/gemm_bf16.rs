//! `C (+)= A @ B` as a bfloat16 product (Note [bf16 products]): both operands rounded to bfloat16,
//! the products accumulated in f32, in the order AVX512-BF16's `vdpbf16ps` takes them, so every
//! level but AMX computes the same bits (AMX: the same up to the order of additions, Note [AMX
//! order] in `amx.rs`); or as an fp16 product (Note [fp16 products]), the same with
//! binary16 and the steps in order.
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
//! Note [fp16 products]
//! An fp16 product (`--precision fp16`'s) is defined the same way with binary16 for bfloat16
//! ([`round_f16`]: to nearest even, overflow to infinity, subnormals kept; a product of two
//! binary16 values is exact in f32 too) and the steps of a block added in order, one after another
//! (no pairs: no CPU instruction multiplies binary16 pairs into f32 here). Every instruction set's
//! f32 tile adds them so (`Rounded::f16`), on packs of the rounded values.
//!
//! The levels ([`Bf16Level`]) differ only in how many of these additions one instruction makes, so
//! they agree bit for bit while no product or sum falls below f32's smallest normal (1.2e-38),
//! which the AVX512-BF16 instruction flushes to zero and the other levels keep (the tests pin each
//! level against the definition). The exception is AMX, whose tile unit adds a block's products
//! in its own order (Note [AMX order]): the same rounded operands, blocks and starts, other last
//! bits. What is rounded is PyTorch autocast's split: matrix products take
//! bfloat16 operands and accumulate in f32; everything else stays f32.
//!
//! Both operands are always packed, rounded. AVX512-BF16's packs hold pair words (a step pair's two
//! bfloat16, the even step in the low half: half the bytes of an f32 pack) for its own 12 x 32
//! tile (AMX's too, A's laid out by lines for its tiles); the other levels' packs hold the rounded values as f32, each pair's odd step first, for the
//! f32 GEMM's tile of the same level, which adds the steps in order (an exact product, then one
//! rounding, whether fused or not) and so computes the definition. The packs live in each thread's
//! reused buffers, as the f32 GEMM's do.

use crate::gemm::{with_pack, MatMut, MatRef, MicroKernel, Shared, Start, A_PACK, B_PACK, KC, MC, PANEL_PAD};
use crate::Isa;
use rayon::prelude::*;

mod amx;
pub use amx::AMX_ENV;

/// How a product computes (the device's setting, `--precision`): in f32, or as a bf16 product
/// (Note [bf16 products]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Products {
    #[default]
    F32,
    Bf16,
    /// fp16 products (Note [fp16 products]).
    F16,
}

impl Products {
    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Products::F32 => "fp32",
            Products::Bf16 => "bf16",
            Products::F16 => "fp16",
        }
    }
}

/// Columns of B packed at once: twice the f32 GEMM's `NC`, so that a product of up to 1,024 columns
/// (the GPT's) packs and rounds its left operand once; a block of them takes the bytes of the f32
/// GEMM's B block (4-byte words against its 8-byte pool elements).
const NC: usize = 1024;

/// Rows and columns of the AVX512-BF16 tile (its packs hold pair words).
const PAIR_MR: usize = 12;
const PAIR_NR: usize = 32;
/// The largest tile of any level (an edge tile is computed whole on the stack): AMX's.
const MAX_TILE: usize = amx::MR * amx::NR;

/// A level of the bf16 product, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bf16Level {
    /// AMX-BF16's `tdpbf16ps` (Intel Xeon since Sapphire Rapids) on 16 x 16 tiles of pair words: a
    /// 32 x 32 block of C per 4 instructions, in the tile unit's order of additions (Note [AMX
    /// order]); used once the process has checked its tiles.
    Amx,
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
    pub const ALL: [Bf16Level; 5] =
        [Bf16Level::Amx, Bf16Level::Avx512Bf16, Bf16Level::Avx512, Bf16Level::Avx2, Bf16Level::Portable];

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Level::Amx => "amx",
            Bf16Level::Avx512Bf16 => "avx512_bf16",
            Bf16Level::Avx512 => "avx512",
            Bf16Level::Avx2 => "avx2",
            Bf16Level::Portable => "portable",
        }
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            Bf16Level::Amx => amx::hardware().is_ok(),
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

    /// Why this CPU or process does not run the level (None where it does).
    pub fn unsupported_reason(self) -> Option<&'static str> {
        match self {
            Bf16Level::Amx => amx::hardware().err(),
            _ if self.is_supported() => None,
            _ => Some("this CPU lacks its instructions"),
        }
    }

    /// The level for an instruction set (`MEMFIT_ISA` forces one): under AVX-512, AMX when the
    /// process may use it (`MEMFIT_AMX=0` says no), else AVX512-BF16 when the CPU has it.
    pub fn for_isa(isa: Isa) -> Bf16Level {
        let want = match isa {
            Isa::Avx512 if Bf16Level::Amx.is_supported() => Bf16Level::Amx,
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

/// `x` rounded to binary16 (to nearest, ties to even), as an f32: what an fp16 product reads for it
/// (Note [fp16 products]). A NaN stays a quiet NaN with the payload binary16 keeps, a magnitude of
/// 65,520 or more becomes an infinity, and binary16's subnormals (multiples of 2^-24) are kept:
/// F16C's `vcvtps2ph` and back, bit for bit.
pub fn round_f16(x: f32) -> f32 {
    let bits = x.to_bits();
    let (sign, magnitude) = (bits & 0x8000_0000, bits & 0x7FFF_FFFF);
    if magnitude > 0x7F80_0000 {
        return f32::from_bits((bits | 0x0040_0000) & 0xFFFF_E000);
    }
    let a = f32::from_bits(magnitude);
    let r = if a >= 65520.0 {
        f32::INFINITY
    } else if a < 1.0 / 16384.0 {
        // Below binary16's smallest normal (2^-14): a multiple of 2^-24 (both scalings exact).
        (a * 16_777_216.0).round_ties_even() / 16_777_216.0
    } else {
        // Ten bits of mantissa kept of f32's 23.
        f32::from_bits((magnitude + 0x0FFF + ((magnitude >> 13) & 1)) & !0x1FFF)
    };
    f32::from_bits(r.to_bits() | sign)
}

/// How a rounded product computes: a level of the bf16 product, or fp16 products on an instruction
/// set's f32 tile.
#[derive(Clone, Copy)]
pub struct Rounded(Kernel);

impl Rounded {
    /// fp16 products with `isa`'s f32 tile.
    pub fn f16(isa: Isa) -> Rounded {
        Rounded(Kernel::f16(isa))
    }

    /// How the device setting `products` computes on this CPU (its active instruction set); None
    /// for f32 products.
    pub fn active(products: Products) -> Option<Rounded> {
        match products {
            Products::F32 => None,
            Products::Bf16 => Some(Bf16Level::active().into()),
            Products::F16 => Some(Rounded::f16(Isa::active())),
        }
    }
}

impl From<Bf16Level> for Rounded {
    fn from(level: Bf16Level) -> Rounded {
        Rounded(Kernel::of(level))
    }
}

/// How a level's packs hold the operands, and its micro-kernel.
#[derive(Clone, Copy)]
enum Kernel {
    /// Pair words (a step pair's two bfloat16, the even step low), `vdpbf16ps`.
    Pairs,
    /// Pair words in AMX's packs, `tdpbf16ps` on a unit (Note [AMX order]).
    Amx(amx::Unit),
    /// Rounded values as f32, one step at a time with each pair's odd step first, so that the f32
    /// GEMM's tile, adding the steps in order (an exact product then one rounding, fused or not),
    /// computes the definition. With the loops the level packs with.
    Steps(MicroKernel<f32>, Loops, Rounding),
}

/// What a Steps level's packs round to, and in which order they lay the steps.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rounding {
    /// bfloat16, each pair's odd step first (Note [bf16 products]).
    Bf16,
    /// binary16, the steps in order (Note [fp16 products]).
    F16,
}

/// Which vector loops a level's packs use (the plain ones on any CPU).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Loops {
    Avx512,
    Avx2,
    Plain,
}

impl Kernel {
    fn of(level: Bf16Level) -> Kernel {
        let isa = match level {
            Bf16Level::Amx if level.is_supported() => return Kernel::Amx(amx::Unit::Hardware),
            #[cfg(target_arch = "x86_64")]
            Bf16Level::Avx512Bf16 | Bf16Level::Amx if Bf16Level::Avx512Bf16.is_supported() => return Kernel::Pairs,
            Bf16Level::Amx | Bf16Level::Avx512Bf16 | Bf16Level::Avx512 => Isa::Avx512,
            Bf16Level::Avx2 => Isa::Avx2Fma,
            Bf16Level::Portable => Isa::Portable,
        };
        // The f32 GEMM's kernel for the level (its portable one where the CPU lacks the level).
        let loops = match isa {
            _ if !isa.is_supported() => Loops::Plain,
            Isa::Avx512 => Loops::Avx512,
            Isa::Avx2Fma => Loops::Avx2,
            Isa::Portable => Loops::Plain,
        };
        Kernel::Steps(<f32 as crate::gemm::sealed::Sealed>::micro_kernel(isa), loops, Rounding::Bf16)
    }

    /// fp16 products on `isa`'s f32 tile (the portable one where the CPU lacks it), packed with
    /// AVX2's loops and F16C's conversions where the CPU has both.
    fn f16(isa: Isa) -> Kernel {
        let isa = if isa.is_supported() { isa } else { Isa::Portable };
        #[cfg(target_arch = "x86_64")]
        let vector = Isa::Avx2Fma.is_supported() && std::arch::is_x86_feature_detected!("f16c");
        #[cfg(not(target_arch = "x86_64"))]
        let vector = false;
        let loops = if vector && isa != Isa::Portable { Loops::Avx2 } else { Loops::Plain };
        Kernel::Steps(<f32 as crate::gemm::sealed::Sealed>::micro_kernel(isa), loops, Rounding::F16)
    }

    /// What the packs round to (the pair kernel's: bfloat16).
    fn rounding(self) -> Rounding {
        match self {
            Kernel::Pairs | Kernel::Amx(_) => Rounding::Bf16,
            Kernel::Steps(.., rounding) => rounding,
        }
    }

    /// `bits` of an f32 rounded as this kernel's operands are.
    fn round(self, bits: u32) -> u32 {
        match self.rounding() {
            Rounding::Bf16 => round_bits(bits),
            Rounding::F16 => round_f16(f32::from_bits(bits)).to_bits(),
        }
    }

    /// The loops the packs use: the level's own (a forced lower level packs as that level's CPU
    /// would).
    fn loops(self) -> Loops {
        match self {
            Kernel::Pairs | Kernel::Amx(_) => Loops::Avx512,
            Kernel::Steps(_, loops, _) => loops,
        }
    }

    /// The tile's rows and columns.
    fn tile(self) -> (usize, usize) {
        match self {
            Kernel::Pairs => (PAIR_MR, PAIR_NR),
            Kernel::Amx(_) => (amx::MR, amx::NR),
            Kernel::Steps(mk, ..) => (mk.mr, mk.nr),
        }
    }

    /// Step pairs a packed panel holds for `pairs` (AMX's padded to whole tiles with zeros).
    fn panel_pairs(self, pairs: usize) -> usize {
        match self {
            Kernel::Amx(_) => amx::padded(pairs),
            _ => pairs,
        }
    }

    /// Words of one packed panel of `width` lines over `pairs` step pairs: room for the panel as
    /// f32 (two words a pair; AMX's one, its pair words), padded.
    fn panel_words(self, pairs: usize, width: usize) -> usize {
        match self {
            Kernel::Amx(_) => self.panel_pairs(pairs) * width + PANEL_PAD,
            _ => 2 * pairs * width + PANEL_PAD,
        }
    }

    /// Words of a `k x n` operand packed whole (blocks of [`NC`] columns and [`KC`] steps, each in
    /// whole panels).
    fn words(self, k: usize, n: usize) -> usize {
        let nr = self.tile().1;
        (0..n)
            .step_by(NC)
            .map(|jc| {
                (0..k)
                    .step_by(KC)
                    .map(|pc| NC.min(n - jc).div_ceil(nr) * self.panel_words(KC.min(k - pc).div_ceil(2), nr))
                    .sum::<usize>()
            })
            .sum()
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
            Kernel::Amx(unit) => amx::run(unit, pairs, a, b, c, rs_c, start),
            Kernel::Steps(mk, ..) => {
                (mk.run)(2 * pairs, a as *const f32, mk.mr as isize, b as *const f32, mk.nr as isize, c, rs_c, start)
            }
        }
    }

    /// Packs `lines` lines of `depth` steps (step s of line i at `src + i * line_stride + s *
    /// step_stride`) into panels of `width` lines of `operand`, rounded, zero past the block's
    /// edges, in one pass that reads whichever direction is contiguous in order (the panel being
    /// written stays in L1).
    ///
    /// # Safety
    /// The block's elements must be valid; `out` holds `lines.div_ceil(width)` panels of
    /// [`Kernel::panel_words`] words.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pack(
        self,
        operand: Operand,
        src: *const f32,
        line_stride: isize,
        step_stride: isize,
        lines: usize,
        depth: usize,
        width: usize,
        out: *mut u32,
    ) {
        let pairs = depth.div_ceil(2);
        let pairs_kernel = matches!(self, Kernel::Pairs | Kernel::Amx(_));
        let f16 = self.rounding() == Rounding::F16;
        // Where step s of line w goes in a panel: a pair word's half, or a step (bf16: each pair's
        // odd step first).
        let swap = usize::from(!f16);
        let steps_at = |s: usize, w: usize| (s ^ swap) * width + w;
        let panel_words = self.panel_words(pairs, width);
        let zero_where_needed = |panel: usize| {
            let n = width.min(lines - panel * width);
            if n < width || depth % 2 == 1 || self.panel_pairs(pairs) != pairs {
                std::ptr::write_bytes(out.add(panel * panel_words), 0, panel_words - PANEL_PAD);
            }
        };
        let line_packs = matches!(self, Kernel::Amx(_)) && operand == Operand::A;
        #[cfg(target_arch = "x86_64")]
        if line_stride == 1 && !line_packs {
            // A step's lines are adjacent: every panel's lines of a step (or a pair) one after
            // another, so that B's rows and a transposed A's are read in order, once.
            let wide = self.loops() == Loops::Avx512 && !f16 && avx512_pack::usable(line_stride, step_stride);
            if wide || (self.loops() == Loops::Avx2 && !pairs_kernel) {
                (0..lines.div_ceil(width)).for_each(&zero_where_needed);
                if wide {
                    avx512_pack::adjacent(pairs_kernel, src, step_stride, lines, depth, width, panel_words, out);
                } else if f16 {
                    avx2_pack::f16_adjacent(src, step_stride, lines, depth, width, panel_words, out);
                } else {
                    avx2_pack::steps_adjacent(src, step_stride, lines, depth, width, panel_words, out);
                }
                return;
            }
        }
        for panel in 0..lines.div_ceil(width) {
            let dst = out.add(panel * panel_words);
            let first = src.offset((panel * width) as isize * line_stride);
            let n = width.min(lines - panel * width);
            zero_where_needed(panel);
            if line_packs {
                amx::pack_lines(first, line_stride, step_stride, n, depth, dst);
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if self.loops() == Loops::Avx512
                && !f16
                && step_stride == 1
                && avx512_pack::usable(line_stride, step_stride)
            {
                avx512_pack::panel(pairs_kernel, first, line_stride, n, depth, width, dst);
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if self.loops() == Loops::Avx2 && !pairs_kernel && step_stride == 1 {
                if f16 {
                    avx2_pack::f16_panel(first, line_stride, step_stride, n, depth, width, dst);
                } else {
                    avx2_pack::steps_panel(first, line_stride, step_stride, n, depth, width, dst);
                }
                continue;
            }
            let at =
                |w: usize, s: usize| (*first.offset(w as isize * line_stride + s as isize * step_stride)).to_bits();
            if line_stride == 1 && step_stride != 1 {
                // The lines of a step are adjacent (a row-major B): step by step, or pair by pair.
                for p in 0..pairs {
                    let odd = 2 * p + 1 < depth;
                    if pairs_kernel {
                        let d = dst.add(p * width);
                        for w in 0..n {
                            let hi = if odd { round_bits(at(w, 2 * p + 1)) } else { 0 };
                            *d.add(w) = round_bits(at(w, 2 * p)) >> 16 | hi;
                        }
                    } else {
                        let (de, dodd) = (dst.add(steps_at(2 * p, 0)), dst.add(steps_at(2 * p + 1, 0)));
                        for w in 0..n {
                            *de.add(w) = self.round(at(w, 2 * p));
                            if odd {
                                *dodd.add(w) = self.round(at(w, 2 * p + 1));
                            }
                        }
                    }
                }
            } else {
                // Line by line along its steps (a row-major A, a transposed B).
                for w in 0..n {
                    let line = first.offset(w as isize * line_stride);
                    let get = |s: usize| (*line.offset(s as isize * step_stride)).to_bits();
                    if pairs_kernel {
                        for p in 0..depth / 2 {
                            *dst.add(p * width + w) = round_bits(get(2 * p)) >> 16 | round_bits(get(2 * p + 1));
                        }
                        if depth % 2 == 1 {
                            *dst.add((depth / 2) * width + w) = round_bits(get(depth - 1)) >> 16;
                        }
                    } else {
                        for s in 0..depth {
                            *dst.add(steps_at(s, w)) = self.round(get(s));
                        }
                    }
                }
            }
        }
    }
}

/// Which operand a pack is of (AMX lays A's panels out by lines, B's by pairs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Operand {
    A,
    B,
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

/// The packs' loops on AVX-512 (with VL's scatters), for operands contiguous along their lines or
/// along their steps: the same words as the plain loops of [`Kernel::pack`].
#[cfg(target_arch = "x86_64")]
mod avx512_pack {
    use std::arch::x86_64::*;

    /// Whether this CPU and these strides take the vector loops.
    pub(super) fn usable(line_stride: isize, step_stride: isize) -> bool {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        (line_stride == 1 || step_stride == 1)
            && *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl"))
    }

    /// [`super::round_bits`] on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn round(x: __m512i) -> __m512i {
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let rounded = _mm512_and_si512(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), high);
        let quiet = _mm512_and_si512(_mm512_or_si512(x, _mm512_set1_epi32(0x0040_0000)), high);
        let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
        let denormal = _mm512_testn_epi32_mask(r, _mm512_set1_epi32(0x7F80_0000));
        _mm512_mask_blend_epi32(denormal, r, _mm512_and_si512(r, _mm512_set1_epi32(0x8000_0000u32 as i32)))
    }

    /// The first `n` (at most 16) lanes.
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xFFFF
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// Every panel (of `width` lines, `panel_words` apart) of `lines` lines and `depth` steps, a
    /// step's lines adjacent (`step_stride` apart), pair by pair: each pair's lines read in order,
    /// 16 at a time. The panels are already zeroed where the block ends.
    ///
    /// # Safety
    /// As [`super::Kernel::pack`] with a line stride of 1; the CPU has AVX-512F and VL.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn adjacent(
        pairs_kernel: bool,
        src: *const f32,
        step_stride: isize,
        lines: usize,
        depth: usize,
        width: usize,
        panel_words: usize,
        dst: *mut u32,
    ) {
        for p in 0..depth.div_ceil(2) {
            let even = src.offset((2 * p) as isize * step_stride) as *const i32;
            let odd = (2 * p + 1 < depth).then(|| src.offset((2 * p + 1) as isize * step_stride) as *const i32);
            for l0 in (0..lines).step_by(width) {
                let (count, out) = (width.min(lines - l0), dst.add(l0 / width * panel_words));
                for w0 in (0..count).step_by(16) {
                    let m = lanes(count - w0);
                    let e = round(_mm512_maskz_loadu_epi32(m, even.add(l0 + w0)));
                    let o = match odd {
                        Some(o) => round(_mm512_maskz_loadu_epi32(m, o.add(l0 + w0))),
                        None => _mm512_setzero_si512(),
                    };
                    if pairs_kernel {
                        let word = _mm512_or_si512(_mm512_srli_epi32::<16>(e), o);
                        _mm512_mask_storeu_epi32(out.add(p * width + w0) as *mut i32, m, word);
                    } else {
                        // Each pair's odd step first.
                        _mm512_mask_storeu_epi32(out.add(2 * p * width + w0) as *mut i32, m, o);
                        _mm512_mask_storeu_epi32(out.add((2 * p + 1) * width + w0) as *mut i32, m, e);
                    }
                }
            }
        }
    }

    /// One panel of `n` lines (of `width`) and `depth` steps into `dst`, a line's steps adjacent,
    /// already zeroed where the block ends.
    ///
    /// # Safety
    /// As [`super::Kernel::pack`] for the panel, with a step stride of 1; the CPU has AVX-512F and
    /// VL.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn panel(
        pairs_kernel: bool,
        src: *const f32,
        line_stride: isize,
        n: usize,
        depth: usize,
        width: usize,
        dst: *mut u32,
    ) {
        // A line's steps are adjacent: 16 steps at a time, scattered to their places in the panel.
        let w = width as i32;
        let pair_index = _mm256_setr_epi32(0, w, 2 * w, 3 * w, 4 * w, 5 * w, 6 * w, 7 * w);
        let step_index = _mm512_setr_epi32(
            w,
            0,
            3 * w,
            2 * w,
            5 * w,
            4 * w,
            7 * w,
            6 * w,
            9 * w,
            8 * w,
            11 * w,
            10 * w,
            13 * w,
            12 * w,
            15 * w,
            14 * w,
        );
        for l in 0..n {
            let line = src.offset(l as isize * line_stride) as *const i32;
            for s0 in (0..depth).step_by(16) {
                let m = lanes(depth - s0);
                let r = round(_mm512_maskz_loadu_epi32(m, line.add(s0)));
                if pairs_kernel {
                    // 16 steps are 8 pair words: the high halves side by side.
                    let words = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(r));
                    let pm = ((1u32 << (depth - s0).div_ceil(2).min(8)) - 1) as __mmask8;
                    _mm256_mask_i32scatter_epi32::<4>(dst.add((s0 / 2) * width + l) as *mut i32, pm, pair_index, words);
                } else {
                    _mm512_mask_i32scatter_epi32::<4>(dst.add(s0 * width + l) as *mut i32, m, step_index, r);
                }
            }
        }
    }

    /// An AMX A panel (`amx::pack_lines`): line w's pair p at `w * stride + p`, pair words, for
    /// `lines` lines of `depth` steps contiguous along their lines or their steps.
    ///
    /// # Safety
    /// As `amx::pack_lines`; the CPU has AVX-512F and VL; one of the strides is 1.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn lines_panel(
        src: *const f32,
        line_stride: isize,
        step_stride: isize,
        lines: usize,
        depth: usize,
        stride: usize,
        dst: *mut u32,
    ) {
        if step_stride == 1 {
            // A line's steps are adjacent: 16 steps are 8 pair words, stored side by side.
            for w in 0..lines {
                let line = src.offset(w as isize * line_stride) as *const i32;
                for s0 in (0..depth).step_by(16) {
                    let r = round(_mm512_maskz_loadu_epi32(lanes(depth - s0), line.add(s0)));
                    let words = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(r));
                    let pm = ((1u32 << (depth - s0).div_ceil(2).min(8)) - 1) as __mmask8;
                    _mm256_mask_storeu_epi32(dst.add(w * stride + s0 / 2) as *mut i32, pm, words);
                }
            }
            return;
        }
        // A step's lines are adjacent: 16 lines' pair words at a time, scattered a line apart.
        let s = stride as i32;
        let index = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(s),
        );
        for p in 0..depth.div_ceil(2) {
            let even = src.offset((2 * p) as isize * step_stride) as *const i32;
            let odd = (2 * p + 1 < depth).then(|| src.offset((2 * p + 1) as isize * step_stride) as *const i32);
            for w0 in (0..lines).step_by(16) {
                let m = lanes(lines - w0);
                let e = round(_mm512_maskz_loadu_epi32(m, even.add(w0)));
                let o = match odd {
                    Some(o) => round(_mm512_maskz_loadu_epi32(m, o.add(w0))),
                    None => _mm512_setzero_si512(),
                };
                let word = _mm512_or_si512(_mm512_srli_epi32::<16>(e), o);
                _mm512_mask_i32scatter_epi32::<4>(dst.add(w0 * stride + p) as *mut i32, m, index, word);
            }
        }
    }
}

/// The AVX2 level's packs (rounded values, each pair's odd step first), for operands contiguous
/// along their lines or along their steps: 8 values rounded at a time; the same words as the plain
/// loops of [`Kernel::pack`].
#[cfg(target_arch = "x86_64")]
mod avx2_pack {
    use super::round_bits;
    use crate::gemm::transpose::transpose8;
    use std::arch::x86_64::*;

    /// [`super::round_bits`] on 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn round(x: __m256i) -> __m256i {
        let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        // The magnitude is at most 0x7FFF_FFFF: a signed comparison is the unsigned one.
        let nan =
            _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF)), _mm256_set1_epi32(0x7F80_0000));
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
        let rounded = _mm256_and_si256(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), high);
        let quiet = _mm256_and_si256(_mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000)), high);
        let r = _mm256_blendv_epi8(rounded, quiet, nan);
        let denormal = _mm256_cmpeq_epi32(_mm256_and_si256(r, _mm256_set1_epi32(0x7F80_0000)), _mm256_setzero_si256());
        _mm256_blendv_epi8(r, _mm256_and_si256(r, _mm256_set1_epi32(0x8000_0000u32 as i32)), denormal)
    }

    /// [`super::round_f16`] on 8 lanes (F16C's conversions, to nearest even both ways).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn round_f16(x: __m256i) -> __m256i {
        _mm256_castps_si256(_mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_castsi256_ps(x))))
    }

    /// One panel of `n` lines (of `width`) and `depth` steps into `dst`, already zeroed where the
    /// block ends, rounded to bfloat16 and each pair's odd step first.
    ///
    /// # Safety
    /// As [`super::Kernel::pack`] for the panel; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn steps_panel(
        src: *const f32,
        line_stride: isize,
        step_stride: isize,
        n: usize,
        depth: usize,
        width: usize,
        dst: *mut u32,
    ) {
        panel(src, line_stride, step_stride, n, depth, width, dst, |x| round(x), round_bits, 1)
    }

    /// [`steps_panel`] rounded to binary16, the steps in order.
    ///
    /// # Safety
    /// As [`steps_panel`]; the CPU has F16C too.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_panel(
        src: *const f32,
        line_stride: isize,
        step_stride: isize,
        n: usize,
        depth: usize,
        width: usize,
        dst: *mut u32,
    ) {
        let scalar = |bits: u32| super::round_f16(f32::from_bits(bits)).to_bits();
        panel(src, line_stride, step_stride, n, depth, width, dst, |x| round_f16(x), scalar, 0)
    }

    /// Every panel (of `width` lines, `panel_words` apart) of `lines` lines and `depth` steps, a
    /// step's lines adjacent (`step_stride` apart), rounded to bfloat16, each pair's odd step first.
    ///
    /// # Safety
    /// As [`super::Kernel::pack`] with a line stride of 1; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn steps_adjacent(
        src: *const f32,
        step_stride: isize,
        lines: usize,
        depth: usize,
        width: usize,
        panel_words: usize,
        dst: *mut u32,
    ) {
        adjacent(src, step_stride, lines, depth, width, panel_words, dst, |x| round(x), 1)
    }

    /// [`steps_adjacent`] rounded to binary16, the steps in order.
    ///
    /// # Safety
    /// As [`steps_adjacent`]; the CPU has F16C too.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_adjacent(
        src: *const f32,
        step_stride: isize,
        lines: usize,
        depth: usize,
        width: usize,
        panel_words: usize,
        dst: *mut u32,
    ) {
        adjacent(src, step_stride, lines, depth, width, panel_words, dst, |x| round_f16(x), 0)
    }

    /// The loops of both, inlined into each: place by place (step `place ^ swap`, a zero step past
    /// the depth), every panel's lines of the step in order, 8 at a time. A panel narrower than 8
    /// lines (A's 6) stores all 8 lanes: the 2 past it land on the next place's first lanes, which
    /// the next place's store then writes (the last place's on the panel's pad); lines past the
    /// operand's are read as zeros.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn adjacent(
        src: *const f32,
        step_stride: isize,
        lines: usize,
        depth: usize,
        width: usize,
        panel_words: usize,
        dst: *mut u32,
        round: impl Fn(__m256i) -> __m256i,
        swap: usize,
    ) {
        let places = if swap == 1 { depth.next_multiple_of(2) } else { depth };
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let first = |count: usize| _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), lane);
        for place in 0..places {
            let step = place ^ swap;
            // (Not read past the depth.)
            let from = src.wrapping_offset(step as isize * step_stride) as *const i32;
            for l0 in (0..lines).step_by(width) {
                let count = width.min(lines - l0);
                let to = dst.add(l0 / width * panel_words + place * width) as *mut i32;
                for w0 in (0..count).step_by(8) {
                    // The lines this vector reads: up to 8, inside the operand.
                    let read = 8.min(lines - l0 - w0);
                    let x = if step >= depth {
                        _mm256_setzero_si256()
                    } else if read == 8 {
                        round(_mm256_loadu_si256(from.add(l0 + w0) as *const __m256i))
                    } else {
                        round(_mm256_maskload_epi32(from.add(l0 + w0), first(read)))
                    };
                    if width < 8 || w0 + 8 <= width {
                        _mm256_storeu_si256(to.add(w0) as *mut __m256i, x);
                    } else {
                        _mm256_maskstore_epi32(to.add(w0), first(count - w0), x);
                    }
                }
            }
        }
    }

    /// The panel loops of both, inlined into each: `vector` and `scalar` round, step s goes to the
    /// place `s ^ swap`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn panel(
        src: *const f32,
        line_stride: isize,
        step_stride: isize,
        n: usize,
        depth: usize,
        width: usize,
        dst: *mut u32,
        vector: impl Fn(__m256i) -> __m256i,
        scalar: impl Fn(u32) -> u32,
        swap: usize,
    ) {
        let round = vector;
        let at = |w: usize, s: usize| (*src.offset(w as isize * line_stride + s as isize * step_stride)).to_bits();
        // A line's steps are adjacent: 8 steps of 8 lines rounded, turned in registers, and stored
        // as 8 steps of 8 lines, in the order of their places; the last steps one by one. Lines
        // past the panel's are zeros: a panel of at most 8 lines (A's 6) stores all 8 lanes, the
        // zeros landing on the next place's first lanes before that place is stored (or on what is
        // zero anyway: an odd depth's last step, the panel's pad); a wider one stores through a mask.
        let whole = depth - depth % 8;
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for w0 in (0..n).step_by(8) {
            let count = 8.min(n - w0);
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), lanes);
            let whole_stores = width <= 8 || w0 + 8 <= width;
            for s0 in (0..whole).step_by(8) {
                let mut rows = [_mm256_setzero_ps(); 8];
                for (i, row) in rows.iter_mut().enumerate().take(count) {
                    let line = src.offset((w0 + i) as isize * line_stride).add(s0) as *const __m256i;
                    *row = _mm256_castsi256_ps(round(_mm256_loadu_si256(line)));
                }
                let steps = transpose8(rows);
                for place in 0..8 {
                    let (to, step) = (dst.add((s0 + place) * width + w0) as *mut i32, steps[place ^ swap]);
                    if whole_stores {
                        _mm256_storeu_si256(to as *mut __m256i, _mm256_castps_si256(step));
                    } else {
                        _mm256_maskstore_epi32(to, mask, _mm256_castps_si256(step));
                    }
                }
            }
            for w in w0..w0 + count {
                for s in whole..depth {
                    *dst.add((s ^ swap) * width + w) = scalar(at(w, s));
                }
            }
        }
    }
}

/// Multiplies one packed A block (`mc` rows) by the packed B block (`nc` columns, panels
/// `b_panel_words` apart), `pairs` pairs deep, into C's block at `c`, the tiles of B's panels
/// `panels` only.
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
    b_panel_words: usize,
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
            let b = b_pack.add(jr * b_panel_words);
            let dst = c.at(ir * mr, jr * nr).ptr;
            let st = start.at_col(jr * nr);
            if rows == mr && cols == nr {
                kernel.run(pairs, a, b, dst, c.rs, st);
            } else {
                // An edge tile: the kernel writes a whole tile on the stack (not zeroed first: it
                // writes all of it), the corner goes to C.
                let mut tile = std::mem::MaybeUninit::<[f32; MAX_TILE]>::uninit();
                let at = tile.as_mut_ptr() as *mut f32;
                kernel.run(pairs, a, b, at, nr as isize, Start::Zero);
                store(std::slice::from_raw_parts(at, mr * nr), nr, rows, cols, dst, c.rs, st);
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
pub unsafe fn gemm_rounded(
    level: impl Into<Rounded>,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<f32>,
    start: Start<f32>,
    a: MatRef<f32>,
    b: MatRef<f32>,
    threads: usize,
) {
    product(level.into().0, m, n, k, c, start, a, Source::Pack(b), threads)
}

/// Where a product's B blocks come from: packed as the product goes, or prepared whole.
#[derive(Clone, Copy)]
enum Source<'a> {
    Pack(MatRef<f32>),
    Prepared(&'a PreparedRounded),
}

/// The driver: blocks of [`NC`] columns and [`KC`] steps of B, each multiplied by A's blocks of
/// [`MC`] rows (packed per product).
///
/// # Safety
/// As [`gemm_bf16`].
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    kernel: Kernel,
    m: usize,
    n: usize,
    k: usize,
    c: MatMut<f32>,
    start: Start<f32>,
    a: MatRef<f32>,
    b: Source<'_>,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        let zeros = [0f32; MAX_TILE];
        for i0 in (0..m).step_by(PAIR_MR) {
            for j0 in (0..n).step_by(PAIR_NR) {
                let (rows, cols) = (PAIR_MR.min(m - i0), PAIR_NR.min(n - j0));
                store(&zeros, PAIR_NR, rows, cols, c.at(i0, j0).ptr, c.rs, start.at_col(j0));
            }
        }
        return;
    }
    let (mr, nr) = kernel.tile();
    let parallel = threads > 1 && m * n * k >= crate::gemm::PARALLEL_WORK;
    // A's blocks of rows: at most MC, as many as the threads (or a multiple) when A has the tiles,
    // and of even sizes, so no thread waits on another's larger block.
    let mut blocks = m.div_ceil(MC);
    if parallel && m.div_ceil(mr) >= threads {
        blocks = blocks.next_multiple_of(threads);
    }
    let block_rows = m.div_ceil(mr).div_ceil(blocks) * mr;
    let blocks = m.div_ceil(block_rows);
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let panels = nc.div_ceil(nr);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let pairs = kc.div_ceil(2);
            let st = start.at_col(jc).for_block(pc);
            let body = |b_pack: *const u32, b_panel_words: usize| {
                let b_shared = Shared(b_pack as *mut u32);
                let run = |ib: usize, cols: std::ops::Range<usize>| {
                    let (ic, mc) = (ib * block_rows, block_rows.min(m - ib * block_rows));
                    with_pack(&A_PACK, mc.div_ceil(mr) * kernel.panel_words(pairs, mr), |a_pack: *mut u32| {
                        // A's lines are its rows (packed to this product's depth: a prepared B's
                        // steps past it meet zeros).
                        kernel.pack(Operand::A, a.at(ic, pc).ptr, a.rs, a.cs, mc, kc, mr, a_pack);
                        let b = b_shared.get();
                        multiply_block(kernel, pairs, a_pack, mc, b, b_panel_words, nc, cols, c.at(ic, jc), st);
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
            };
            match b {
                Source::Pack(b) => with_pack(&B_PACK, panels * kernel.panel_words(pairs, nr), |b_pack: *mut u32| {
                    // B's lines are its columns; its panels are shared out among the threads.
                    let parts = if parallel { threads.min(panels) } else { 1 };
                    let (from, to) = (Shared(b.at(pc, jc).ptr as *mut f32), Shared(b_pack));
                    (0..parts).into_par_iter().for_each(|p| {
                        let (first, last) = (panels * p / parts, panels * (p + 1) / parts);
                        let lines = nc.min(last * nr) - first * nr;
                        let src = from.get().offset((first * nr) as isize * b.cs);
                        let dst = to.get().add(first * kernel.panel_words(pairs, nr));
                        // SAFETY: part p packs panels first..last only, from B's columns of them.
                        unsafe { kernel.pack(Operand::B, src, b.cs, b.rs, lines, kc, nr, dst) };
                    });
                    body(b_pack, kernel.panel_words(pairs, nr))
                }),
                Source::Prepared(p) => body(p.block(jc, pc), p.panel_words(pc)),
            }
        }
    }
}

/// Runs `f` with `b` (`k x n`) prepared for several bf16 products, packed whole into one of this
/// thread's buffers when it fits one block of [`NC`] columns and [`KC`] steps (as the f32 GEMM's
/// `with_prepared_b`), else as it is.
///
/// # Safety
/// B must be valid for its shape and strides, and unchanged until `f` returns.
pub unsafe fn with_prepared_rounded<R>(
    level: impl Into<Rounded>,
    k: usize,
    n: usize,
    b: MatRef<f32>,
    f: impl FnOnce(&PreparedRounded) -> R,
) -> R {
    let words = PreparedRounded::capacity(KC, NC);
    with_pack(&B_PACK, words, |buf: *mut u32| f(&PreparedRounded::prepare_into(level, k, n, b, buf, words)))
}

/// A right operand packed once for several bf16 products that each use its first rows and
/// columns (attention's keys up to a block's last visible one; a fused op's weight for all its row
/// blocks), when it fits the caller's buffer; else packed by each product. A part's depth is cut by
/// A's packed zeros: the prepared steps past it are multiplied by zero (finite operands, as
/// attention's keys and a weight are).
#[derive(Clone, Copy)]
pub struct PreparedRounded {
    kernel: Kernel,
    k: usize,
    n: usize,
    b: MatRef<f32>,
    packed: Option<*const u32>,
}

// SAFETY: the packed buffer and B are only read, by parallel regions, while the caller keeps them.
unsafe impl Send for PreparedRounded {}
unsafe impl Sync for PreparedRounded {}

impl PreparedRounded {
    /// Words a buffer needs to hold a `k x n` operand prepared on any level.
    pub fn capacity(k: usize, n: usize) -> usize {
        let kernels = Bf16Level::ALL.map(Kernel::of).into_iter().chain([Kernel::Amx(amx::Unit::Model)]);
        kernels.map(|kernel| kernel.words(k, n)).max().unwrap_or(0)
    }

    /// `b` (`k x n`) packed into `buf` (`len` words) when it fits, else kept as it is.
    ///
    /// # Safety
    /// B must be valid for its shape and strides; it and the buffer must stay unchanged while the
    /// result is used.
    pub unsafe fn prepare_into(
        level: impl Into<Rounded>,
        k: usize,
        n: usize,
        b: MatRef<f32>,
        buf: *mut u32,
        len: usize,
    ) -> Self {
        let kernel = level.into().0;
        let mut prepared = PreparedRounded { kernel, k, n, b, packed: None };
        if k == 0 || n == 0 || kernel.words(k, n) > len {
            return prepared;
        }
        let nr = kernel.tile().1;
        for jc in (0..n).step_by(NC) {
            for pc in (0..k).step_by(KC) {
                let dst = buf.add(prepared.offset(jc, pc));
                kernel.pack(Operand::B, b.at(pc, jc).ptr, b.cs, b.rs, NC.min(n - jc), KC.min(k - pc), nr, dst);
            }
        }
        prepared.packed = Some(buf);
        prepared
    }

    /// Words from one packed panel to the next in the blocks of depth `pc`.
    fn panel_words(&self, pc: usize) -> usize {
        self.kernel.panel_words(KC.min(self.k - pc).div_ceil(2), self.kernel.tile().1)
    }

    /// Where the block of columns `jc` and depth `pc` starts in the packed buffer (blocks by
    /// columns, then depth; each whole panels of the full operand).
    fn offset(&self, jc: usize, pc: usize) -> usize {
        let nr = self.kernel.tile().1;
        let block = |j: usize, p: usize| NC.min(self.n - j).div_ceil(nr) * self.panel_words(p);
        let before: usize =
            (0..jc).step_by(NC).map(|j| (0..self.k).step_by(KC).map(|p| block(j, p)).sum::<usize>()).sum();
        before + (0..pc).step_by(KC).map(|p| block(jc, p)).sum::<usize>()
    }

    /// The packed block of columns `jc` and depth `pc`.
    fn block(&self, jc: usize, pc: usize) -> *const u32 {
        let base = self.packed.expect("a prepared operand's blocks");
        // SAFETY: the offset is inside the buffer the operand was packed into.
        unsafe { base.add(self.offset(jc, pc)) }
    }

    /// `C[m x n] (+)= A[m x k] @ B[..k, ..n]` as a bf16 product, with the first `n` columns and `k`
    /// rows of this B.
    ///
    /// # Safety
    /// As [`gemm_bf16`]; `n` and `k` at most this B's.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_part(
        &self,
        m: usize,
        n: usize,
        k: usize,
        c: MatMut<f32>,
        start: Start<f32>,
        a: MatRef<f32>,
        threads: usize,
    ) {
        debug_assert!(n <= self.n && k <= self.k, "a part of B inside B");
        let source = if self.packed.is_some() { Source::Prepared(self) } else { Source::Pack(self.b) };
        product(self.kernel, m, n, k, c, start, a, source, threads)
    }

    /// Its rows and columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
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

    /// Which definition a reference computes.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Definition {
        /// Note [bf16 products].
        Bf16,
        /// Note [fp16 products].
        F16,
        /// Note [bf16 products] in the tile unit's order (Note [AMX order]).
        Amx,
    }

    impl Definition {
        /// What a level computes.
        fn of(kernel: Kernel) -> Definition {
            match kernel {
                Kernel::Amx(_) => Definition::Amx,
                _ if kernel.rounding() == Rounding::F16 => Definition::F16,
                _ => Definition::Bf16,
            }
        }
    }

    /// The definition of Note [bf16 products], of Note [fp16 products], or of Note [AMX order],
    /// element by element.
    #[allow(clippy::too_many_arguments)]
    fn reference_of(
        definition: Definition,
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
                    let round = if definition == Definition::F16 { round_f16 } else { round_bf16 };
                    let s = |t: usize| {
                        if t < kc {
                            round(a[i * ars + (k0 + t) * acs]) * round(b[(k0 + t) * brs + j * bcs])
                        } else {
                            0.0
                        }
                    };
                    match definition {
                        Definition::F16 => (0..kc).for_each(|t| acc += s(t)),
                        Definition::Bf16 => {
                            for p in 0..kc.div_ceil(2) {
                                acc += s(2 * p + 1);
                                acc += s(2 * p);
                            }
                        }
                        Definition::Amx => {
                            // Per 16 pairs: the even steps' and the odd steps' sums apart, then
                            // the two added, and that to the accumulator.
                            for chunk in (0..amx::padded(kc.div_ceil(2))).step_by(amx::TILE_PAIRS) {
                                let (mut even, mut odd) = (0f32, 0f32);
                                for p in chunk..chunk + amx::TILE_PAIRS {
                                    even += s(2 * p);
                                    odd += s(2 * p + 1);
                                }
                                acc += even + odd;
                            }
                        }
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

    /// binary16's rounding: ties to even, overflow at 65,520, subnormals kept and rounded, NaN
    /// quiet; and F16C's conversions give the same bits over many values where the CPU has them.
    #[test]
    fn fp16_rounding_is_to_nearest_even_with_subnormals_and_overflow() {
        let ulp = 1.0 / 1024.0;
        assert_eq!(round_f16(1.0 + ulp / 2.0), 1.0, "a tie goes to the even one");
        assert_eq!(round_f16(1.0 + 1.5 * ulp), 1.0 + 2.0 * ulp, "a tie goes to the even one");
        assert_eq!(round_f16(1.0 + 0.6 * ulp), 1.0 + ulp);
        assert_eq!(round_f16(-3.0 - 0.4 * 2.0 * ulp), -3.0);
        assert_eq!(round_f16(65519.0), 65504.0, "below the overflow threshold: binary16's largest");
        assert_eq!(round_f16(65520.0), f32::INFINITY, "from 65,520 up: an infinity");
        assert_eq!(round_f16(-1e6), f32::NEG_INFINITY);
        assert_eq!(round_f16(f32::INFINITY), f32::INFINITY, "an infinity stays");
        let q = 1.0 / 16_777_216.0; // binary16's smallest subnormal, 2^-24
        assert_eq!(round_f16(0.5 * q), 0.0, "a tie between 0 and 2^-24 goes to 0");
        assert_eq!(round_f16(1.5 * q), 2.0 * q, "a tie between 2^-24 and 2^-23 goes to 2^-23");
        assert_eq!(round_f16(-7.3 * q), -7.0 * q);
        assert_eq!(round_f16(1e-30).to_bits(), 0, "too small: zero");
        assert_eq!(round_f16(-1e-30).to_bits(), 0x8000_0000, "a zero of its sign");
        assert!(round_f16(f32::NAN).is_nan());
        assert_eq!(round_f16(f32::from_bits(0x7F80_0001)).to_bits(), 0x7FC0_0000, "a quiet NaN");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx2") {
            let mut bits = 0x1234_5678u32;
            for _ in 0..200_000 {
                bits ^= bits << 13;
                bits ^= bits >> 17;
                bits ^= bits << 5;
                let x = f32::from_bits(bits);
                // SAFETY: the CPU has F16C (checked above).
                let hw = unsafe { f16c_round(x) };
                assert_eq!(round_f16(x).to_bits(), hw.to_bits(), "{x:e} ({bits:#x})");
            }
        }
    }

    /// F16C's conversion to binary16 and back.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "f16c")]
    unsafe fn f16c_round(x: f32) -> f32 {
        use std::arch::x86_64::*;
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))))
    }

    /// The device setting's rounded products: none for f32, a bf16 level, fp16 on this CPU's tile.
    #[test]
    fn the_settings_products_round_as_they_say() {
        assert!(Rounded::active(Products::F32).is_none());
        let (a, b) = (values(12 * 8, 1, 2.0), values(8 * 16, 2, 2.0));
        for products in [Products::Bf16, Products::F16] {
            let level = Rounded::active(products).expect("a rounded product");
            let want_f16 = products == Products::F16;
            assert_eq!(level.0.rounding() == Rounding::F16, want_f16, "{products:?}");
            let (mut want, mut got) = (vec![0f32; 12 * 16], vec![0f32; 12 * 16]);
            reference_of(Definition::of(level.0), 12, 16, 8, &a, (8, 1), &b, (16, 1), &mut want, "zero", &[]);
            let (am, bm) = (MatRef { ptr: a.as_ptr(), rs: 8, cs: 1 }, MatRef { ptr: b.as_ptr(), rs: 16, cs: 1 });
            // SAFETY: the operands are the vectors above with these shapes and strides.
            unsafe { gemm_rounded(level, 12, 16, 8, MatMut { ptr: got.as_mut_ptr(), rs: 16 }, Start::Zero, am, bm, 1) };
            agree(level.0, &want, &got, &scale(12, 16, 8, &a, &b), &format!("{products:?}"));
        }
    }

    /// fp16 products on every instruction set's tile compute the definition's bits (the cases of
    /// [`definition_cases`]).
    #[test]
    fn every_isa_computes_the_fp16_definitions_bits() {
        for isa in Isa::supported() {
            definition_cases(Rounded::f16(isa), isa.name());
        }
        let rounded = values(64, 3, 2.0).iter().map(|&v| round_f16(v)).collect::<Vec<_>>();
        assert!(rounded.iter().zip(values(64, 3, 2.0)).any(|(r, v)| *r != v), "the operands carry bits binary16 drops");
    }

    #[test]
    fn rounding_is_to_nearest_even_with_nan_infinity_and_denormals_as_the_instruction_reads_them() {
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to the even one, 1; 1 + 3 * 2^-8 to 1 + 2^-6.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 1.0 + 1.0 / 128.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        // A signalling NaN comes back quiet, its low half dropped.
        assert_eq!(to_bf16(f32::from_bits(0x7F80_0001)), 0x7FC0);
        assert_eq!(round_bf16(f32::from_bits(0xFF81_2345)).to_bits(), 0xFFC1_0000);
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert_eq!(to_bf16(f32::from_bits(0x0040_0000)), 0, "a denormal reads as zero");
        assert_eq!(to_bf16(-f32::from_bits(0x0040_0000)), 0x8000, "of its sign");
        assert_eq!(round_bf16(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
    }

    /// Every supported level computes the definition's bits (the cases of [`definition_cases`]);
    /// AMX's hardware its order's within the order of additions, its differing bits counted.
    #[test]
    fn every_level_computes_the_definitions_bits() {
        let (mut checked, mut differ) = (0, 0);
        for level in Bf16Level::supported() {
            let (c, d) = definition_cases(level.into(), level.name());
            (checked, differ) = (checked + c, differ + d);
        }
        let skipped: Vec<String> = Bf16Level::ALL
            .iter()
            .filter_map(|l| l.unsupported_reason().map(|why| format!("{} ({why})", l.name())))
            .collect();
        println!(
            "bf16 products: {checked} cases on {:?} ({differ} results of AMX's tiles differ from the model's bits); \
             skipped: {skipped:?}",
            Bf16Level::supported()
        );
    }

    /// The AMX level's packs, tiles and edges on the tile unit's model, on every CPU: the bits of
    /// the definition in Note [AMX order]'s order.
    #[test]
    fn the_amx_model_computes_the_amx_orders_bits() {
        let (checked, _) = definition_cases(Rounded(Kernel::Amx(amx::Unit::Model)), "amx model");
        assert!(checked > 0);
    }

    /// AMX's order is not the other levels': the same operands give other bits somewhere, so the
    /// AMX reference is not the bf16 one.
    #[test]
    fn the_amx_order_differs_from_the_pairs_order() {
        let (m, n, k) = (4, 40, 300);
        let (a, b) = (values(m * k, 7, 1.0), values(k * n, 8, 1.0));
        let (mut pairs, mut tiles) = (vec![0f32; m * n], vec![0f32; m * n]);
        reference_of(Definition::Bf16, m, n, k, &a, (k, 1), &b, (n, 1), &mut pairs, "zero", &[]);
        reference_of(Definition::Amx, m, n, k, &a, (k, 1), &b, (n, 1), &mut tiles, "zero", &[]);
        let differ = pairs.iter().zip(&tiles).filter(|(p, t)| p.to_bits() != t.to_bits()).count();
        assert!(differ > 0, "the two orders gave the same bits everywhere");
        assert!(pairs.iter().zip(&tiles).all(|(p, t)| (p - t).abs() <= 1e-5 * (1.0 + p.abs())));
    }

    /// For each result, the sum of its products' magnitudes (row-major `a` and `b`): what the order
    /// of f32 additions can move it by, scaled.
    fn scale(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut s = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                s[i * n + j] = (0..k).map(|t| (a[i * k + t] * b[t * n + j]).abs()).sum();
            }
        }
        s
    }

    /// `got` is `want` bit for bit, or on AMX's hardware (whose order of additions is the SDM's
    /// word, not checked here: Note [AMX order]) within the order of additions (`scale`); the
    /// results that differ in bits.
    fn agree(kernel: Kernel, want: &[f32], got: &[f32], scale: &[f32], what: &str) -> usize {
        let differ = want.iter().zip(got).filter(|(w, g)| w.to_bits() != g.to_bits()).count();
        if kernel_is_hardware_amx(kernel) {
            for (i, ((w, g), s)) in want.iter().zip(got).zip(scale).enumerate() {
                assert!((w - g).abs() <= 1e-5 * (s + w.abs()), "{what}: result {i}: {g} against {w}");
            }
        } else {
            assert_eq!(differ, 0, "{what}: {differ} of {} differ", want.len());
        }
        differ
    }

    /// Every supported level's kernel, and the AMX model's, with their names.
    fn kernels() -> Vec<(Rounded, String)> {
        let levels = Bf16Level::supported().into_iter().map(|l| (l.into(), l.name().to_string()));
        levels.chain([(Rounded(Kernel::Amx(amx::Unit::Model)), "amx model".to_string())]).collect()
    }

    /// The magnitudes of a `rows x cols` operand of strides `(rs, cs)` in `x`, row-major.
    fn strided_abs(x: &[f32], rows: usize, cols: usize, (rs, cs): (usize, usize)) -> Vec<f32> {
        (0..rows * cols).map(|e| x[(e / cols) * rs + (e % cols) * cs].abs()).collect()
    }

    fn kernel_is_hardware_amx(kernel: Kernel) -> bool {
        matches!(kernel, Kernel::Amx(amx::Unit::Hardware))
    }

    /// `level` against its definition ([`Definition::of`]), bit for bit (AMX's hardware: [`agree`]):
    /// shapes across the tile, block and depth edges (odd depths, a partial 8-step block, more than
    /// one depth block, partial tiles), operands row- and column-major, C overwritten, accumulated
    /// into and started from a bias, on one thread and two. The cases checked, and the results that
    /// differ in bits.
    fn definition_cases(level: Rounded, name: &str) -> (usize, usize) {
        let definition = Definition::of(level.0);
        let shapes = [
            (1, 1, 1),
            (12, 32, 2),
            (13, 33, 3),
            (9, 20, 21),
            (25, 70, 517),
            (200, 40, 64),
            (64, 64, 600),
            (7, 530, 1030),
            (3, 5, 0),
        ];
        let (mut checked, mut differ) = (0, 0);
        for &(m, n, k) in &shapes {
            for (case, (a_major, b_major)) in [(true, true), (false, false), (true, false)].into_iter().enumerate() {
                for start in ["zero", "accumulate", "bias"] {
                    let a = values(m * k, 1 + case as u64, 2.0);
                    let b = values(k * n, 9, 3.0);
                    let (bias, before) = (values(n, 4, 1.0), values(m * n, 5, 1.0));
                    let (ast, ars) = if a_major { ((k, 1), k as isize) } else { ((1, m), 1) };
                    let (bst, brs) = if b_major { ((n, 1), n as isize) } else { ((1, k), 1) };
                    let mut want = before.clone();
                    reference_of(definition, m, n, k, &a, ast, &b, bst, &mut want, start, &bias);
                    let mut got = before.clone();
                    let st = match start {
                        "zero" => Start::Zero,
                        "accumulate" => Start::Accumulate,
                        _ => Start::Bias(bias.as_ptr()),
                    };
                    let am = MatRef { ptr: a.as_ptr(), rs: ars, cs: if a_major { 1 } else { m as isize } };
                    let bm = MatRef { ptr: b.as_ptr(), rs: brs, cs: if b_major { 1 } else { k as isize } };
                    let c = MatMut { ptr: got.as_mut_ptr(), rs: n as isize };
                    // SAFETY: the operands are the vectors above with these shapes and strides.
                    unsafe { gemm_rounded(level, m, n, k, c, st, am, bm, 1 + case % 2) };
                    // The magnitudes, row-major, with C's start.
                    let mut sums = scale(m, n, k, &strided_abs(&a, m, k, ast), &strided_abs(&b, k, n, bst));
                    sums.iter_mut().zip(&before).enumerate().for_each(|(x, (s, c))| *s += c.abs() + bias[x % n].abs());
                    let what = format!("{name} m {m} n {n} k {k} a row-major {a_major} b row-major {b_major} {start}");
                    differ += agree(level.0, &want, &got, &sums, &what);
                    checked += 1;
                }
            }
        }
        (checked, differ)
    }

    /// Operands strided in both directions (a sub-matrix of every other row and column) take the
    /// plain packing loops and still compute the definition's bits.
    #[test]
    fn operands_strided_both_ways_compute_the_definitions_bits() {
        let (m, n, k) = (19, 37, 23);
        let a = values(4 * m * k, 31, 1.0);
        let b = values(4 * k * n, 32, 1.0);
        // A(i, t) = a[i * 4k + 2t], B(t, j) = b[t * 4n + 2j].
        let (ast, bst) = ((4 * k, 2), (4 * n, 2));
        for (level, name) in kernels() {
            let mut want = vec![0f32; m * n];
            reference_of(Definition::of(level.0), m, n, k, &a, ast, &b, bst, &mut want, "zero", &[]);
            let mut got = vec![0f32; m * n];
            let am = MatRef { ptr: a.as_ptr(), rs: (4 * k) as isize, cs: 2 };
            let bm = MatRef { ptr: b.as_ptr(), rs: (4 * n) as isize, cs: 2 };
            // SAFETY: the strided operands stay inside `a` and `b`.
            unsafe {
                gemm_rounded(level, m, n, k, MatMut { ptr: got.as_mut_ptr(), rs: n as isize }, Start::Zero, am, bm, 1)
            };
            let (abs_a, abs_b) = (strided_abs(&a, m, k, ast), strided_abs(&b, k, n, bst));
            agree(level.0, &want, &got, &scale(m, n, k, &abs_a, &abs_b), &name);
        }
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
            gemm_rounded(
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

    /// A prepared operand's parts (first rows and columns, odd depths among them, across depth and
    /// column blocks) give the bits of the product with the part as its own operand; and an operand
    /// too large for the buffer is multiplied as it is.
    #[test]
    fn prepared_parts_compute_the_products_of_the_parts() {
        let (k, n) = (KC + 70, NC + 45);
        let b = values(k * n, 21, 1.0);
        let bm = MatRef { ptr: b.as_ptr(), rs: n as isize, cs: 1 };
        for (level, name) in kernels() {
            let mut buf = vec![0u32; PreparedRounded::capacity(k, n)];
            // SAFETY: the operand is `b`, the buffer holds the capacity.
            let prepared = unsafe { PreparedRounded::prepare_into(level, k, n, bm, buf.as_mut_ptr(), buf.len()) };
            let too_small = unsafe { PreparedRounded::prepare_into(level, k, n, bm, buf.as_mut_ptr(), 10) };
            assert!(prepared.packed.is_some() && too_small.packed.is_none(), "{}", name);
            assert_eq!(prepared.dims(), (k, n));
            // The blocks lie one after another inside the buffer, in order.
            let starts: Vec<usize> = (0..n)
                .step_by(NC)
                .flat_map(|jc| (0..k).step_by(KC).map(move |pc| (jc, pc)))
                .map(|(j, p)| prepared.offset(j, p))
                .collect();
            assert!(starts.windows(2).all(|w| w[0] < w[1]) && starts[0] == 0, "{}: {starts:?}", name);
            assert!(*starts.last().unwrap() < buf.len(), "{}: {starts:?}", name);
            // The level's own size is exactly enough.
            let words = level.0.words(k, n);
            assert!(words <= buf.len());
            // SAFETY: the operand is `b`; the buffer holds at least `words` words.
            let exact = unsafe { PreparedRounded::prepare_into(level, k, n, bm, buf.as_mut_ptr(), words) };
            // SAFETY: as above.
            let short = unsafe { PreparedRounded::prepare_into(level, k, n, bm, buf.as_mut_ptr(), words - 1) };
            assert!(exact.packed.is_some() && short.packed.is_none(), "{}: {words} words", name);
            let panels = n.div_ceil(level.0.tile().1);
            assert!(words < (k + 2) * panels * 32 + 4 * panels * PANEL_PAD, "{}: {words} words", name);
            for &(m, pn, pk) in &[(5, n, k), (13, 33, 7), (30, NC + 1, KC + 3), (1, 1, 1), (12, 70, 64)] {
                let a = values(m * pk, 22 + pk as u64, 1.0);
                let am = MatRef { ptr: a.as_ptr(), rs: pk as isize, cs: 1 };
                let mut want = vec![0f32; m * pn];
                let mut got = vec![1f32; m * pn];
                let mut plain = vec![2f32; m * pn];
                // SAFETY: row-major operands and outputs of these shapes; the part is inside B.
                unsafe {
                    gemm_rounded(
                        level,
                        m,
                        pn,
                        pk,
                        MatMut { ptr: want.as_mut_ptr(), rs: pn as isize },
                        Start::Zero,
                        am,
                        bm,
                        2,
                    );
                    prepared.gemm_part(
                        m,
                        pn,
                        pk,
                        MatMut { ptr: got.as_mut_ptr(), rs: pn as isize },
                        Start::Zero,
                        am,
                        2,
                    );
                    too_small.gemm_part(
                        m,
                        pn,
                        pk,
                        MatMut { ptr: plain.as_mut_ptr(), rs: pn as isize },
                        Start::Zero,
                        am,
                        1,
                    );
                }
                let same = |x: &[f32]| want.iter().zip(x).all(|(w, g)| w.to_bits() == g.to_bits());
                assert!(same(&got), "{} prepared part m {m} n {pn} k {pk}", name);
                assert!(same(&plain), "{} unprepared part m {m} n {pn} k {pk}", name);
            }
        }
    }

    /// A bf16 product's packs fit the bytes of the f32 GEMM's pool buffers they share, on every
    /// level, so the per-thread workspace keeps its bound (`WORKSPACE_BYTES_PER_THREAD`).
    #[test]
    fn packs_fit_the_f32_gemms_workspace() {
        use crate::gemm::{A_PACK_ELEMS, B_PACK_ELEMS};
        let kernels = Bf16Level::ALL.map(|l| (Kernel::of(l), l.name())).into_iter();
        for (kernel, name) in kernels.chain([(Kernel::Amx(amx::Unit::Model), "amx")]) {
            let mr = kernel.tile().0;
            let (a_words, b_words) = (MC.div_ceil(mr) * kernel.panel_words(KC / 2, mr), kernel.words(KC, NC));
            assert!(a_words * 4 <= A_PACK_ELEMS * 8, "{name}: A {a_words} words");
            assert!(b_words * 4 <= B_PACK_ELEMS * 8, "{name}: B {b_words} words");
            assert!(b_words <= PreparedRounded::capacity(KC, NC));
        }
        assert!(PreparedRounded::capacity(KC, NC) * 4 <= B_PACK_ELEMS * 8);
    }

    #[test]
    fn names_are_the_reports_and_memfit_isas() {
        assert_eq!([Products::F32.name(), Products::Bf16.name()], ["fp32", "bf16"]);
        let names: Vec<&str> = Bf16Level::ALL.iter().map(|l| l.name()).collect();
        assert_eq!(names, ["amx", "avx512_bf16", "avx512", "avx2", "portable"]);
        assert_eq!(Products::default(), Products::F32);
    }

    #[test]
    fn the_level_follows_the_instruction_set() {
        assert_eq!(Bf16Level::for_isa(Isa::Portable), Bf16Level::Portable);
        if Isa::Avx2Fma.is_supported() {
            assert_eq!(Bf16Level::for_isa(Isa::Avx2Fma), Bf16Level::Avx2);
        }
        if Isa::Avx512.is_supported() {
            let want = [Bf16Level::Amx, Bf16Level::Avx512Bf16, Bf16Level::Avx512]
                .into_iter()
                .find(|l| l.is_supported())
                .expect("AVX-512F runs the avx512 level");
            assert_eq!(Bf16Level::for_isa(Isa::Avx512), want);
        }
        assert_eq!(Bf16Level::supported().last(), Some(&Bf16Level::Portable));
    }
}
