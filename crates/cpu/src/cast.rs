//! CPU kernel of the dtype casts (`ops/cast.rs`): element-wise conversion between the float dtypes
//! (through the `half` crate for f16/bf16; f32 to and from bf16, which `--precision bf16` does to
//! every saved activation, in loops compiled per instruction set with the crate's bits) and from
//! the integer and bool dtypes.

use crate::dtype::DType;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::view::View;
use crate::PAR_CHUNK;
use half::{bf16, f16};
use memfit_kernels::{multiversion, Isa};
use rayon::prelude::*;

/// `dst[i] = f(src[i])` across dtypes, in parallel for large tensors.
fn map_into<S: Element, D: Element>(x: View<'_>, out: View<'_>, f: impl Fn(S) -> D + Sync + Send) -> Result<()> {
    map_chunks(x, out, |_, s: &[S], d: &mut [D]| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s)))
}

/// `dst = convert(src)` chunk by chunk, in parallel for large tensors (a loop per instruction set).
fn map_chunks<S: Element, D: Element>(
    x: View<'_>,
    out: View<'_>,
    convert: impl Fn(Isa, &[S], &mut [D]) + Sync + Send,
) -> Result<()> {
    let (src, dst) = (x.slice::<S>()?, out.slice_mut::<D>()?);
    let isa = Isa::active();
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK).zip(src.par_chunks(PAR_CHUNK)).for_each(|(d, s)| convert(isa, s, d));
    } else {
        convert(isa, src, dst);
    }
    Ok(())
}

/// `x`'s bits rounded to bfloat16 as `half::bf16::from_f32` rounds them (to nearest even; a NaN
/// keeps its high bits, made quiet; denormals kept), without branches so that the loops vectorise.
#[inline(always)]
fn bf16_bits(x: u32) -> u16 {
    let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    (if nan { x >> 16 | 0x0040 } else { rounded }) as u16
}

/// `bits` of a bfloat16 as an f32, as `half::bf16::to_f32` reads them (a NaN made quiet).
#[inline(always)]
fn bf16_value(bits: u16) -> f32 {
    let quiet = if bits & 0x7FFF > 0x7F80 { 0x0040 } else { 0 };
    f32::from_bits(((bits | quiet) as u32) << 16)
}

multiversion! {
    /// `dst = src` rounded to bfloat16.
    fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(bf16_bits(s.to_bits()));
        }
    }
}

multiversion! {
    /// `dst = src`, bfloat16 read as f32 (exact).
    fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16_value(s.to_bits());
        }
    }
}

/// `out = x` converted to `out`'s dtype (x contiguous, same shape). Nothing to do when empty.
pub fn cast(x: View<'_>, out: View<'_>) -> Result<()> {
    use DType::*;
    if x.numel() == 0 {
        return Ok(());
    }
    match (x.dtype(), out.dtype()) {
        (F32, F64) => map_into(x, out, |v: f32| v as f64),
        (F32, F16) => map_into(x, out, f16::from_f32),
        (F32, BF16) => map_chunks(x, out, f32_to_bf16),
        (F64, F32) => map_into(x, out, |v: f64| v as f32),
        (F64, F16) => map_into(x, out, |v: f64| f16::from_f32(v as f32)),
        (F64, BF16) => map_into(x, out, |v: f64| bf16::from_f32(v as f32)),
        (F16, F32) => map_into(x, out, |v: f16| v.to_f32()),
        (F16, F64) => map_into(x, out, |v: f16| v.to_f64()),
        (F16, BF16) => map_into(x, out, |v: f16| bf16::from_f32(v.to_f32())),
        (BF16, F32) => map_chunks(x, out, bf16_to_f32),
        (BF16, F64) => map_into(x, out, |v: bf16| v.to_f64()),
        (BF16, F16) => map_into(x, out, |v: bf16| f16::from_f32(v.to_f32())),
        (I64, F32) => map_into(x, out, |v: i64| v as f32),
        (I64, F64) => map_into(x, out, |v: i64| v as f64),
        (U8, F32) => map_into(x, out, |v: u8| v as f32),
        (U8, F64) => map_into(x, out, |v: u8| v as f64),
        (Bool, F32) => map_into(x, out, |v: bool| v as u8 as f32),
        (Bool, F64) => map_into(x, out, |v: bool| v as u8 as f64),
        (from, to) => Err(Error::dtype(format!("to_dtype: no cast from {from} to {to}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loops of every instruction set give `half`'s bits both ways, on random bit patterns and
    /// on the edges (ties, NaNs, infinities, denormals, the largest values).
    #[test]
    fn bf16_casts_give_the_half_crates_bits_on_every_level() {
        let mut bits = vec![
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0xFFC0_1234,
            0x7FFF_FFFF,
            0x0000_0001,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x807F_FFFF,
        ];
        let mut state = 0x9E37_79B9u32;
        bits.extend((0..100_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        }));
        let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let want: Vec<u16> = src.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let halves: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let back: Vec<u32> = halves.iter().map(|h| h.to_f32().to_bits()).collect();
        for isa in Isa::supported() {
            let mut got = vec![bf16::ZERO; src.len()];
            f32_to_bf16(isa, &src, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), *w, "{isa}: {:#x}", bits[i]);
            }
            let mut values = vec![0f32; halves.len()];
            bf16_to_f32(isa, &halves, &mut values);
            for (h, (v, w)) in values.iter().zip(&back).enumerate() {
                assert_eq!(v.to_bits(), *w, "{isa}: {h:#x}");
            }
        }
    }
}
