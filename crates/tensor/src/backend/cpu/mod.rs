//! The `cpu` backend: every kernel of [`Backend`], computed on this machine's CPU. One file per op
//! family, mirroring `ops/`; each kernel matches the dtype once (`with_float!`) and calls
//! `memfit-kernels` where a path per instruction set exists.

pub(crate) mod elementwise;
pub(crate) mod gemm;

use super::Backend;
use crate::error::Result;
use crate::ops::{Binary, Unary};
use crate::tensor::Tensor;
use crate::with_float;

/// The CPU backend (stateless: the instruction set is chosen process-wide by `memfit-kernels`).
pub(crate) struct Cpu;

impl Backend for Cpu {
    fn fill_zeros(&self, t: &Tensor) -> Result<()> {
        t.bytes_mut()?.fill(0);
        Ok(())
    }

    fn fill(&self, t: &Tensor, value: f64) -> Result<()> {
        with_float!(t.dtype(), "full", T => t.slice_mut::<T>()?.fill(<T as crate::Float>::of(value)));
        Ok(())
    }

    fn write_bytes(&self, t: &Tensor, bytes: &[u8]) -> Result<()> {
        t.bytes_mut()?.copy_from_slice(bytes);
        Ok(())
    }

    fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        src.copy_into_bytes(dst.bytes_mut()?)
    }

    fn unary(&self, op: Unary, x: &Tensor, out: &Tensor) -> Result<()> {
        elementwise::unary(op, x, out)
    }

    fn unary_backward(&self, op: Unary, saved: Option<&Tensor>, grad: &Tensor, out: &Tensor) -> Result<()> {
        elementwise::unary_backward(op, saved, grad, out)
    }

    fn affine(&self, x: &Tensor, scale: f64, shift: f64, out: &Tensor) -> Result<()> {
        elementwise::affine(x, scale, shift, out)
    }

    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        elementwise::binary(op, a, b, out)
    }

    fn add_into(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        elementwise::add_into(dst, src)
    }
}
