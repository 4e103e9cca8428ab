//! The `cpu` backend: every kernel of [`Backend`], computed on this machine's CPU. One file per op
//! family, mirroring `ops/`; each kernel matches the dtype once (`with_float!`) and calls
//! `memfit-kernels` where a path per instruction set exists.

pub(crate) mod elementwise;
pub(crate) mod gemm;
// Seam A.
pub(crate) mod cast;
pub(crate) mod conv;
pub(crate) mod dropout;
pub(crate) mod embedding;
pub(crate) mod optim;
pub(crate) mod pool;
pub(crate) mod reduce;

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

    // Seam A: conv.
    fn conv2d(
        &self,
        g: &crate::ops::ConvGeom,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
        workspace: Option<&Tensor>,
    ) -> Result<()> {
        conv::conv2d(g, x, weight, bias, out, workspace)
    }

    fn conv2d_backward(
        &self,
        g: &crate::ops::ConvGeom,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        dx: Option<&Tensor>,
        dw: Option<&Tensor>,
        db: Option<&Tensor>,
        partials: Option<&Tensor>,
        workspace: Option<&Tensor>,
    ) -> Result<()> {
        conv::conv2d_backward(g, x, weight, grad, dx, dw, db, partials, workspace)
    }

    // Seam A: pool.
    fn max_pool2d(
        &self,
        g: &crate::ops::PoolGeom,
        x: &Tensor,
        out: &Tensor,
        indices: Option<&Tensor>,
        positions: Option<&Tensor>,
        width: usize,
    ) -> Result<()> {
        pool::max_pool2d(g, x, out, indices, positions, width)
    }

    fn max_pool2d_backward(
        &self,
        g: &crate::ops::PoolGeom,
        width: usize,
        grad: &Tensor,
        positions: &Tensor,
        dx: &Tensor,
    ) -> Result<()> {
        pool::max_pool2d_backward(g, width, grad, positions, dx)
    }

    fn avg_pool2d(&self, g: &crate::ops::PoolGeom, kind: crate::ops::Avg, x: &Tensor, out: &Tensor) -> Result<()> {
        pool::avg_pool2d(g, kind, x, out)
    }

    fn avg_pool2d_backward(
        &self,
        g: &crate::ops::PoolGeom,
        kind: crate::ops::Avg,
        grad: &Tensor,
        dx: &Tensor,
    ) -> Result<()> {
        pool::avg_pool2d_backward(g, kind, grad, dx)
    }

    // Seam A: dropout.
    fn dropout(&self, x: &Tensor, p: f64, seed: u64, out: &Tensor, mask: Option<&Tensor>) -> Result<()> {
        dropout::dropout(x, p, seed, out, mask)
    }

    fn dropout_backward(&self, grad: &Tensor, mask: &Tensor, p: f64, gx: &Tensor) -> Result<()> {
        dropout::dropout_backward(grad, mask, p, gx)
    }

    // Seam A: embedding.
    fn embedding(&self, indices: &Tensor, weight: &Tensor, out: &Tensor) -> Result<()> {
        embedding::embedding(indices, weight, out)
    }

    fn embedding_backward(&self, indices: &Tensor, grad: &Tensor, gw: &Tensor) -> Result<()> {
        embedding::embedding_backward(indices, grad, gw)
    }

    // Seam A: cast.
    fn cast(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        cast::cast(x, out)
    }

    // Seam A: reduce.
    fn sum_to_shape(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        reduce::sum_to_shape(x, out)
    }

    fn sum_dim(&self, x: &Tensor, outer: usize, size: usize, inner: usize, mean: bool, out: &Tensor) -> Result<()> {
        reduce::sum_dim(x, outer, size, inner, mean, out)
    }

    fn sum_backward(&self, grad: &Tensor, scale: f64, out: &Tensor) -> Result<()> {
        reduce::sum_backward(grad, scale, out)
    }

    fn max_dim(
        &self,
        x: &Tensor,
        outer: usize,
        size: usize,
        inner: usize,
        values: &Tensor,
        indices: &Tensor,
    ) -> Result<()> {
        reduce::max_dim(x, outer, size, inner, values, indices)
    }

    fn max_dim_backward(
        &self,
        grad: &Tensor,
        indices: &Tensor,
        outer: usize,
        size: usize,
        inner: usize,
        out: &Tensor,
    ) -> Result<()> {
        reduce::max_dim_backward(grad, indices, outer, size, inner, out)
    }

    fn max_all(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        reduce::max_all(x, out)
    }

    fn max_all_backward(&self, x: &Tensor, max: &Tensor, grad: &Tensor, out: &Tensor) -> Result<()> {
        reduce::max_all_backward(x, max, grad, out)
    }

    // Seam A: optim.
    fn sgd_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        momentum_buffer: Option<&Tensor>,
        step: crate::ops::SgdStep,
    ) -> Result<()> {
        optim::sgd_update(param, grad, momentum_buffer, step)
    }

    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        step: crate::ops::AdamStep,
    ) -> Result<()> {
        optim::adam_update(param, grad, exp_avg, exp_avg_sq, step)
    }

    fn unscale(&self, grad: &Tensor, inv_scale: f64, found_inf: &mut bool) -> Result<()> {
        optim::unscale(grad, inv_scale, found_inf)
    }
}
