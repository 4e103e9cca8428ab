//! CPU kernels that move data: zero and value fills, host bytes in, tensor-to-tensor copies.

use crate::error::Result;
use crate::tensor::Tensor;
use crate::with_float;

pub(crate) fn fill_zeros(t: &Tensor) -> Result<()> {
    t.bytes_mut()?.fill(0);
    Ok(())
}

pub(crate) fn fill(t: &Tensor, value: f64) -> Result<()> {
    with_float!(t.dtype(), "full", T => t.slice_mut::<T>()?.fill(<T as crate::Float>::of(value)));
    Ok(())
}

pub(crate) fn write_bytes(t: &Tensor, bytes: &[u8]) -> Result<()> {
    t.bytes_mut()?.copy_from_slice(bytes);
    Ok(())
}

pub(crate) fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    src.copy_into_bytes(dst.bytes_mut()?)
}
