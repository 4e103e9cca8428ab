//! CPU kernel of the dtype casts (`ops/cast.rs`): element-wise conversion between the float dtypes
//! (through the `half` crate for f16/bf16) and from the integer and bool dtypes.

use crate::dtype::DType;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::view::View;
use crate::PAR_CHUNK;
use half::{bf16, f16};
use rayon::prelude::*;

/// `dst[i] = f(src[i])` across dtypes, in parallel for large tensors.
fn map_into<S: Element, D: Element>(x: View<'_>, out: View<'_>, f: impl Fn(S) -> D + Sync + Send) -> Result<()> {
    let (src, dst) = (x.slice::<S>()?, out.slice_mut::<D>()?);
    let run = |(d, s): (&mut [D], &[S])| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s));
    if dst.len() >= 2 * PAR_CHUNK {
        dst.par_chunks_mut(PAR_CHUNK).zip(src.par_chunks(PAR_CHUNK)).for_each(run);
    } else {
        run((dst, src));
    }
    Ok(())
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
        (F32, BF16) => map_into(x, out, bf16::from_f32),
        (F64, F32) => map_into(x, out, |v: f64| v as f32),
        (F64, F16) => map_into(x, out, |v: f64| f16::from_f32(v as f32)),
        (F64, BF16) => map_into(x, out, |v: f64| bf16::from_f32(v as f32)),
        (F16, F32) => map_into(x, out, |v: f16| v.to_f32()),
        (F16, F64) => map_into(x, out, |v: f16| v.to_f64()),
        (F16, BF16) => map_into(x, out, |v: f16| bf16::from_f32(v.to_f32())),
        (BF16, F32) => map_into(x, out, |v: bf16| v.to_f32()),
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
