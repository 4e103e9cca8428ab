//! The AMX level of the bf16 product (Intel Xeon since Sapphire Rapids): `tdpbf16ps` on tiles, a
//! 32 x 32 block of C in four accumulator tiles; its packs; a software model of the tile unit; and
//! the checks that decide whether this process may use the hardware.
//!
//! Note [AMX order]
//! The tile unit computes Note [bf16 products]'s product (operands rounded to bfloat16, blocks of
//! `KC` steps, C's start) but adds a block's products in its own order. The SDM's pseudo-code for
//! `TDPBF16PS` gives it per instruction, that is per 16 step pairs: each output keeps two sums from
//! zero, one of the even steps' products and one of the odd steps', each step a fused multiply-add
//! rounded to f32; then the two sums are added, and that to the accumulator (each addition rounded
//! to nearest even; denormal inputs read as zero and denormal results flush to zero, as
//! `vdpbf16ps`'s). A block of this level therefore agrees with the other levels up to the order of
//! f32 additions, not bit for bit.
//!
//! [`Model`] computes that order in software, on the same packs and through the same driver as the
//! hardware, so the packs, the tiling and the edges are tested on every CPU against an element-wise
//! reference. On a CPU with AMX the tests compare the hardware with the model: bit for bit on
//! operands whose sums are exact in any order (small integers: any layout or instruction mistake
//! shows), and within the order of additions on any operands, printing how many results differ in
//! their last bits (which says whether the hardware adds in the SDM's order).
//!
//! The hardware is used only after the same exact check passes once in the process
//! ([`hardware`]): a CPU or kernel whose tiles disagree falls back to AVX512-BF16 with the reason
//! recorded, never computes wrong numbers. `MEMFIT_AMX=0` turns the level off (to compare with
//! AVX512-BF16 on the same machine).
//!
//! The packs hold pair words (a step pair's two bfloat16, the even step in the low half), their
//! depth padded with zero pairs to whole tiles of [`TILE_PAIRS`]: A's panel as 32 lines, each its
//! pairs contiguous (a tile row is 16 pairs of one line); B's as AVX512-BF16's, its pairs one after
//! another, each 32 lines wide (a tile row is one pair of 16 lines, rows 128 bytes apart).

use super::Start;

/// Rows and columns of C's block: two by two tiles of 16 x 16.
pub(super) const MR: usize = 32;
pub(super) const NR: usize = 32;
/// Step pairs one tile row holds (64 bytes of pair words).
pub(super) const TILE_PAIRS: usize = 16;

/// The environment variable that turns the AMX level off (`0`).
pub const AMX_ENV: &str = "MEMFIT_AMX";

/// `pairs` padded to whole tiles.
pub(super) fn padded(pairs: usize) -> usize {
    pairs.next_multiple_of(TILE_PAIRS)
}

/// Which tile unit runs the level's products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unit {
    /// The CPU's (only once [`hardware`] says yes).
    Hardware,
    /// [`Model`]: the SDM's order in software, on any CPU (tests, and the hardware's check).
    Model,
}

/// What the driver needs of a tile unit: tiles 0-3 accumulate C's four 16 x 16 quarters, 4-5 hold
/// two 16-row tiles of A, 6-7 two 16-column tiles of B.
pub(super) trait TileUnit {
    /// Configures the tiles (eight of 16 rows of 64 bytes) and zeroes the accumulators.
    ///
    /// # Safety
    /// On the hardware, only after [`hardware`] said yes.
    unsafe fn begin(&mut self);

    /// One step of 16 pairs: loads A's tiles from `a0`, `a1` (rows `stride_a` bytes apart) and B's
    /// from `b0`, `b1` (rows `stride_b` bytes apart), and adds the four products.
    ///
    /// # Safety
    /// Each tile's 16 rows of 64 bytes must be readable.
    unsafe fn step(
        &mut self,
        a0: *const u32,
        a1: *const u32,
        b0: *const u32,
        b1: *const u32,
        stride_a: usize,
        stride_b: usize,
    );

    /// Stores the accumulators as a 32 x 32 block at `out`, rows `stride` bytes apart, and releases
    /// the tiles.
    ///
    /// # Safety
    /// `out` holds 32 rows of 32 values `stride` bytes apart.
    unsafe fn finish(&mut self, out: *mut f32, stride: usize);
}

/// `C[32 x 32] = start + A_panel · B_panel` over `pairs` step pairs (the packs padded to
/// [`padded`]) on `unit`.
///
/// # Safety
/// The panels hold `padded(pairs)` pairs of this level's packing; C's tile is valid; the hardware
/// only after [`hardware`] said yes.
pub(super) unsafe fn run(
    unit: Unit,
    pairs: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    rs_c: isize,
    start: Start<f32>,
) {
    match unit {
        #[cfg(target_arch = "x86_64")]
        Unit::Hardware => block(&mut Hardware, pairs, a, b, c, rs_c, start),
        #[cfg(not(target_arch = "x86_64"))]
        Unit::Hardware => unreachable!("AMX is an x86-64 level"),
        Unit::Model => block(&mut Model::default(), pairs, a, b, c, rs_c, start),
    }
}

/// [`run`] on one unit.
///
/// # Safety
/// As [`run`].
unsafe fn block<U: TileUnit>(
    unit: &mut U,
    pairs: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    rs_c: isize,
    start: Start<f32>,
) {
    let depth = padded(pairs);
    let (stride_a, stride_b) = (depth * 4, NR * 4);
    unit.begin();
    for chunk in (0..depth).step_by(TILE_PAIRS) {
        // A: lines 0-15 and 16-31 from this chunk's pair; B: this chunk's 16 pairs, lines 0-15
        // and 16-31.
        let (a0, b0) = (a.add(chunk), b.add(chunk * NR));
        unit.step(a0, a0.add(16 * depth), b0, b0.add(16), stride_a, stride_b);
    }
    if let Start::Zero = start {
        // The sums are C: stored in place.
        unit.finish(c, rs_c as usize * 4);
    } else {
        let mut sums = [0f32; MR * NR];
        unit.finish(sums.as_mut_ptr(), NR * 4);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            add_start(&sums, c, rs_c, start);
            return;
        }
        super::store(&sums, NR, MR, NR, c, rs_c, start);
    }
}

/// `C = sums + start` for a whole 32 x 32 block, 16 values at a time: what [`super::store`] does
/// (the sum first, then what C starts from), without its scalar loop, which would take as long as
/// the block's products.
///
/// # Safety
/// C's 32 rows of 32 values (and a bias row's 32) must be valid; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_start(sums: &[f32; MR * NR], c: *mut f32, rs_c: isize, start: Start<f32>) {
    use std::arch::x86_64::*;
    for i in 0..MR {
        let row = c.offset(i as isize * rs_c);
        for j in (0..NR).step_by(16) {
            let sum = _mm512_loadu_ps(sums.as_ptr().add(i * NR + j));
            let v = match start {
                Start::Zero => sum,
                Start::Accumulate => _mm512_add_ps(sum, _mm512_loadu_ps(row.add(j))),
                Start::Bias(b) => _mm512_add_ps(sum, _mm512_loadu_ps(b.add(j))),
            };
            _mm512_storeu_ps(row.add(j), v);
        }
    }
}

/// The tile unit in software (Note [AMX order]): eight tiles of 16 rows of 16 words.
pub(super) struct Model {
    tiles: [[u32; 256]; 8],
}

impl Default for Model {
    fn default() -> Self {
        Model { tiles: [[0; 256]; 8] }
    }
}

/// A denormal flushed to a zero of its sign.
fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        0f32.copysign(x)
    } else {
        x
    }
}

/// The f32 value of a pair word's half (`high`: the odd step), a denormal read as zero.
fn half(word: u32, high: bool) -> f32 {
    let bits = if high { word & 0xFFFF_0000 } else { word << 16 };
    flush(f32::from_bits(bits))
}

impl Model {
    /// `tileloadd`: 16 rows of 64 bytes, `stride` bytes apart.
    unsafe fn load(&mut self, t: usize, p: *const u32, stride: usize) {
        for r in 0..16 {
            let row = (p as *const u8).add(r * stride) as *const u32;
            for j in 0..16 {
                self.tiles[t][r * 16 + j] = row.add(j).read_unaligned();
            }
        }
    }

    /// `tdpbf16ps c, a, b` in the SDM's order.
    fn dot(&mut self, c: usize, a: usize, b: usize) {
        for m in 0..16 {
            let mut sums = [0f32; 32];
            for k in 0..16 {
                let aw = self.tiles[a][m * 16 + k];
                for n in 0..16 {
                    let bw = self.tiles[b][k * 16 + n];
                    sums[2 * n] = flush(half(aw, false).mul_add(half(bw, false), sums[2 * n]));
                    sums[2 * n + 1] = flush(half(aw, true).mul_add(half(bw, true), sums[2 * n + 1]));
                }
            }
            for n in 0..16 {
                let acc = f32::from_bits(self.tiles[c][m * 16 + n]);
                self.tiles[c][m * 16 + n] = flush(acc + flush(sums[2 * n] + sums[2 * n + 1])).to_bits();
            }
        }
    }

    /// `tilestored`: 16 rows of 16 values, `stride` bytes apart.
    unsafe fn store(&self, t: usize, p: *mut f32, stride: usize) {
        for r in 0..16 {
            let row = (p as *mut u8).add(r * stride) as *mut u32;
            for j in 0..16 {
                row.add(j).write_unaligned(self.tiles[t][r * 16 + j]);
            }
        }
    }
}

impl TileUnit for Model {
    unsafe fn begin(&mut self) {
        self.tiles[..4].iter_mut().for_each(|t| t.fill(0));
    }

    unsafe fn step(
        &mut self,
        a0: *const u32,
        a1: *const u32,
        b0: *const u32,
        b1: *const u32,
        stride_a: usize,
        stride_b: usize,
    ) {
        self.load(4, a0, stride_a);
        self.load(5, a1, stride_a);
        self.load(6, b0, stride_b);
        self.load(7, b1, stride_b);
        self.dot(0, 4, 6);
        self.dot(1, 4, 7);
        self.dot(2, 5, 6);
        self.dot(3, 5, 7);
    }

    unsafe fn finish(&mut self, out: *mut f32, stride: usize) {
        let lower = (out as *mut u8).add(16 * stride) as *mut f32;
        self.store(0, out, stride);
        self.store(1, out.add(16), stride);
        self.store(2, lower, stride);
        self.store(3, lower.add(16), stride);
    }
}

/// The CPU's tile unit.
#[cfg(target_arch = "x86_64")]
struct Hardware;

/// The tile configuration: palette 1, eight tiles of 16 rows of 64 bytes (bytes 16-31 hold each
/// tile's bytes per row as 16-bit words, bytes 48-55 its rows).
#[cfg(target_arch = "x86_64")]
static CONFIG: [u8; 64] = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    c
};

#[cfg(target_arch = "x86_64")]
impl TileUnit for Hardware {
    unsafe fn begin(&mut self) {
        // SAFETY (caller's): the process may use the tiles; the configuration is 64 valid bytes.
        std::arch::asm!(
            "ldtilecfg [{cfg}]",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            cfg = in(reg) CONFIG.as_ptr(),
            options(nostack, readonly),
        );
    }

    unsafe fn step(
        &mut self,
        a0: *const u32,
        a1: *const u32,
        b0: *const u32,
        b1: *const u32,
        stride_a: usize,
        stride_b: usize,
    ) {
        // SAFETY (caller's): each tile's rows are readable; begin configured the tiles.
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {sa} * 1]",
            "tileloadd tmm5, [{a1} + {sa} * 1]",
            "tileloadd tmm6, [{b0} + {sb} * 1]",
            "tileloadd tmm7, [{b1} + {sb} * 1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            b0 = in(reg) b0,
            b1 = in(reg) b1,
            sa = in(reg) stride_a,
            sb = in(reg) stride_b,
            options(nostack, readonly),
        );
    }

    unsafe fn finish(&mut self, out: *mut f32, stride: usize) {
        let lower = (out as *mut u8).add(16 * stride) as *mut f32;
        // SAFETY (caller's): `out` holds 32 rows of 32 values `stride` bytes apart.
        std::arch::asm!(
            "tilestored [{o0} + {s} * 1], tmm0",
            "tilestored [{o1} + {s} * 1], tmm1",
            "tilestored [{o2} + {s} * 1], tmm2",
            "tilestored [{o3} + {s} * 1], tmm3",
            "tilerelease",
            o0 = in(reg) out,
            o1 = in(reg) out.add(16),
            o2 = in(reg) lower,
            o3 = in(reg) lower.add(16),
            s = in(reg) stride,
            options(nostack),
        );
    }
}

/// Whether this process may use the CPU's tiles: `Ok` once the CPU says it has AMX-BF16, Linux
/// grants the tile data's permission, and the hardware computes the model's bits on a product
/// whose sums are exact in any order; else why not. Decided once per process.
pub(super) fn hardware() -> Result<(), &'static str> {
    use std::sync::OnceLock;
    static STATE: OnceLock<Result<(), &'static str>> = OnceLock::new();
    *STATE.get_or_init(|| decide(std::env::var(AMX_ENV).ok().as_deref()))
}

/// [`hardware`]'s decision, with `MEMFIT_AMX`'s value.
fn decide(setting: Option<&str>) -> Result<(), &'static str> {
    if setting.is_some_and(|v| v.trim() == "0") {
        return Err("turned off by MEMFIT_AMX=0");
    }
    cpu_has_amx()?;
    request_permission()?;
    // SAFETY: the CPU has the tiles and the process their permission (checked above).
    if unsafe { exact_check(Unit::Hardware) } != unsafe { exact_check(Unit::Model) } {
        return Err("the tiles disagreed with the model on an exact product: AMX is left off");
    }
    Ok(())
}

/// The CPU's AMX-TILE and AMX-BF16 flags ([`amx_bits`]), and AVX-512F (the level's packs' loops).
fn cpu_has_amx() -> Result<(), &'static str> {
    #[cfg(target_arch = "x86_64")]
    if amx_bits(std::arch::x86_64::__cpuid_count(7, 0).edx) && std::arch::is_x86_feature_detected!("avx512f") {
        return Ok(());
    }
    Err("this CPU has no AMX-BF16")
}

/// Whether CPUID leaf 7's EDX says AMX-TILE (bit 24) and AMX-BF16 (bit 22).
fn amx_bits(edx: u32) -> bool {
    edx >> 24 & 1 == 1 && edx >> 22 & 1 == 1
}

/// Linux's permission for the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
/// once per process: without it the first tile instruction faults).
fn request_permission() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a system call with integer arguments only.
        if unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0 {
            return Ok(());
        }
        Err("Linux refused the tiles' permission (arch_prctl)")
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("AMX is used on Linux only (its permission request)")
}

/// A 32 x 32 block of 40 pairs (three tiles deep, the last padded) of small integers, whose every
/// sum is exact in any order, on `unit`: its bits.
///
/// # Safety
/// The hardware only where the CPU has the tiles and the process their permission.
unsafe fn exact_check(unit: Unit) -> Vec<u32> {
    let pairs = 40;
    let depth = padded(pairs);
    // Pair words of bfloat16 integers in [-8, 8], zero pairs past the depth.
    let word = |i: usize| {
        let v = |x: usize| super::to_bf16(((x * 7 + 3) % 17) as f32 - 8.0) as u32;
        v(2 * i) | v(2 * i + 1) << 16
    };
    let a: Vec<u32> = (0..MR * depth).map(|i| if i % depth < pairs { word(i) } else { 0 }).collect();
    let b: Vec<u32> = (0..depth * NR).map(|i| if i / NR < pairs { word(i * 5 + 1) } else { 0 }).collect();
    let mut c = vec![0f32; MR * NR];
    run(unit, pairs, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), NR as isize, Start::Zero);
    c.iter().map(|x| x.to_bits()).collect()
}

/// Packs `lines` lines of `depth` steps (step s of line i at `src + i * line_stride + s *
/// step_stride`) as an A panel of this level: line w's pair p at `w * padded(pairs) + p`, the
/// panel already zeroed where the block ends.
///
/// # Safety
/// As the level's [`super::Kernel::pack`] for one panel of [`MR`] lines.
pub(super) unsafe fn pack_lines(
    src: *const f32,
    line_stride: isize,
    step_stride: isize,
    lines: usize,
    depth: usize,
    dst: *mut u32,
) {
    let stride = padded(depth.div_ceil(2));
    #[cfg(target_arch = "x86_64")]
    if super::avx512_pack::usable(line_stride, step_stride) {
        super::avx512_pack::lines_panel(src, line_stride, step_stride, lines, depth, stride, dst);
        return;
    }
    let round = |s: *const f32| super::round_bits((*s).to_bits());
    for w in 0..lines {
        let line = src.offset(w as isize * line_stride);
        let out = dst.add(w * stride);
        for p in 0..depth / 2 {
            let even = round(line.offset((2 * p) as isize * step_stride));
            *out.add(p) = even >> 16 | round(line.offset((2 * p + 1) as isize * step_stride));
        }
        if depth % 2 == 1 {
            *out.add(depth / 2) = round(line.offset((depth - 1) as isize * step_stride)) >> 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check's product has sums exact in any order: the model gives the integer products, so
    /// any order, the hardware's included, must give the same bits.
    #[test]
    fn the_exact_check_computes_integer_sums() {
        // SAFETY: the model runs on any CPU.
        let got = unsafe { exact_check(Unit::Model) };
        let depth = padded(40);
        let value = |x: usize| ((x * 7 + 3) % 17) as i64 - 8;
        let mut nonzero = 0;
        for i in 0..MR {
            for j in 0..NR {
                // Pair word w holds values 2w and 2w + 1; A's line i pair p is word i * depth + p, B's
                // pair p line j is word (p * NR + j) * 5 + 1.
                let exact: i64 = (0..40)
                    .flat_map(|p| {
                        let (aw, bw) = (i * depth + p, (p * NR + j) * 5 + 1);
                        [value(2 * aw) * value(2 * bw), value(2 * aw + 1) * value(2 * bw + 1)]
                    })
                    .sum();
                assert_eq!(f32::from_bits(got[i * NR + j]), exact as f32, "({i}, {j})");
                nonzero += usize::from(exact != 0);
            }
        }
        assert!(nonzero > MR * NR / 2);
    }

    /// The model reads denormal operands as zero and flushes denormal sums, as the instruction does.
    #[test]
    fn the_model_reads_denormals_as_zero_and_flushes_them() {
        let tiny = f32::MIN_POSITIVE / 4.0;
        assert_eq!(half(tiny.to_bits(), true), 0.0);
        assert_eq!(half(tiny.to_bits() >> 16, false), 0.0);
        assert_eq!(half(1.5f32.to_bits(), true), 1.5);
        assert_eq!(half(1.5f32.to_bits() >> 16, false), 1.5);
        assert_eq!(flush(-tiny).to_bits(), 0x8000_0000, "a zero of its sign");
        // 2^-70 squared is below f32's normals: the sum flushes to zero.
        let mut model = Model::default();
        let small = 2f32.powi(-70).to_bits() >> 16;
        model.tiles[4][0] = small;
        model.tiles[6][0] = small;
        model.dot(0, 4, 6);
        assert_eq!(model.tiles[0][0], 0);
        model.tiles[4][0] = 2f32.to_bits() >> 16 | 3f32.to_bits() & 0xFFFF_0000;
        model.tiles[6][0] = 5f32.to_bits() >> 16 | 7f32.to_bits() & 0xFFFF_0000;
        model.dot(0, 4, 6);
        assert_eq!(f32::from_bits(model.tiles[0][0]), 2.0 * 5.0 + 3.0 * 7.0);
    }

    /// Where Linux reports the flags (its `/proc/cpuinfo`), the CPUID check sees them. Not the
    /// converse: a kernel without AMX support hides flags the CPU has (its permission request then
    /// fails, which `decide` checks next).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_cpu_check_reads_the_flags_linux_reports() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let flags = info.lines().find(|l| l.starts_with("flags")).expect("a flags line");
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        if has("amx_tile") && has("amx_bf16") && has("avx512f") {
            assert_eq!(cpu_has_amx(), Ok(()), "{flags}");
        } else if !has("amx_tile") || !has("amx_bf16") {
            // Without the flags Linux gives no permission either: the level is off, by one check or
            // the other.
            assert!(decide(None).is_err(), "{flags}");
        }
    }

    /// Both flags, and only they, say AMX.
    #[test]
    fn amx_needs_the_tile_and_bf16_bits() {
        let (tile, bf16) = (1u32 << 24, 1u32 << 22);
        assert!(amx_bits(tile | bf16));
        assert!(amx_bits(!0));
        assert!(!amx_bits(tile) && !amx_bits(bf16) && !amx_bits(0));
        assert!(!amx_bits(!0 ^ tile) && !amx_bits(!0 ^ bf16));
        assert!(!amx_bits(tile << 1 | bf16 << 1) && !amx_bits(tile >> 1 | bf16 >> 1));
    }

    /// The tile configuration the hardware loads: palette 1, eight tiles of 16 rows of 64 bytes,
    /// the rest zero (the SDM's layout: bytes 16-47 each tile's bytes per row, 48-63 its rows).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_tile_configuration_is_eight_tiles_of_16_rows_of_64_bytes() {
        let mut want = [0u8; 64];
        want[0] = 1;
        for t in 0..8 {
            want[16 + 2 * t] = 64;
            want[48 + t] = 16;
        }
        assert_eq!(CONFIG, want);
        assert_eq!(u16::from_le_bytes([CONFIG[16 + 2 * 7], CONFIG[17 + 2 * 7]]), 64, "little-endian words");
    }

    /// `MEMFIT_AMX=0` turns the level off; without AMX the reason says so.
    #[test]
    fn the_level_is_off_when_asked_or_absent() {
        assert_eq!(decide(Some("0")), Err("turned off by MEMFIT_AMX=0"));
        if cpu_has_amx().is_err() {
            assert_eq!(decide(None), Err("this CPU has no AMX-BF16"));
            assert_eq!(hardware(), Err("this CPU has no AMX-BF16"));
        } else {
            println!("this CPU has AMX-BF16: {:?}", decide(None));
        }
    }
}
