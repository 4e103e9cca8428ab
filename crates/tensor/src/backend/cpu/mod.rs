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
// Seam B.
pub(crate) mod attention;
pub(crate) mod loss;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod softmax;

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

    // Seam B: matmul.
    fn matmul(&self, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        matmul::matmul(a, b, out)
    }

    fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, out: &Tensor) -> Result<()> {
        matmul::linear(x, weight, bias, out)
    }

    fn gelu_linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, scratch: &Tensor, out: &Tensor) -> Result<()> {
        matmul::gelu_linear(x, weight, bias, scratch, out)
    }

    fn gelu_linear_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        scratch: &Tensor,
    ) -> Result<()> {
        matmul::gelu_linear_backward(x, weight, grad, gx, gw, scratch)
    }

    // Seam B: norm.
    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        d: usize,
        eps: f64,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    ) -> Result<()> {
        norm::layer_norm(x, weight, bias, d, eps, out, mean, rstd)
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        d: usize,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
    ) -> Result<()> {
        norm::layer_norm_backward(x, weight, mean, rstd, d, grad, gx, gw, gb)
    }

    fn layer_norm_linear(
        &self,
        x: &Tensor,
        ln_weight: &Tensor,
        ln_bias: &Tensor,
        eps: f64,
        weight: &Tensor,
        bias: Option<&Tensor>,
        scratch: &Tensor,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    ) -> Result<()> {
        norm::layer_norm_linear(x, ln_weight, ln_bias, eps, weight, bias, scratch, out, mean, rstd)
    }

    fn layer_norm_linear_backward(
        &self,
        x: &Tensor,
        ln_weight: &Tensor,
        ln_bias: &Tensor,
        weight: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        grad: &Tensor,
        gx: Option<&Tensor>,
        glw: Option<&Tensor>,
        glb: Option<&Tensor>,
        gw: Option<&Tensor>,
        scratch: &Tensor,
        sums: Option<&Tensor>,
    ) -> Result<()> {
        norm::layer_norm_linear_backward(x, ln_weight, ln_bias, weight, mean, rstd, grad, gx, glw, glb, gw, scratch, sums)
    }

    fn batch_norm(
        &self,
        x: &Tensor,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    ) -> Result<()> {
        norm::batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps, out, mean, rstd)
    }

    fn batch_norm_backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        training: bool,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
    ) -> Result<()> {
        norm::batch_norm_backward(x, weight, mean, rstd, training, grad, gx, gw, gb)
    }

    // Seam B: attention.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        pb: &crate::ops::AttnProblem,
        out: &Tensor,
        lse: Option<&Tensor>,
    ) -> Result<()> {
        attention::attention(q, k, v, mask, pb, out, lse)
    }

    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        lse: &Tensor,
        pb: &crate::ops::AttnProblem,
        grad: &Tensor,
        gq: Option<&Tensor>,
        gk: Option<&Tensor>,
        gv: Option<&Tensor>,
    ) -> Result<()> {
        attention::attention_backward(q, k, v, mask, lse, pb, grad, gq, gk, gv)
    }

    // Seam B: loss.
    fn cross_entropy(&self, logits: &Tensor, target: &Tensor, label_smoothing: f64, out: &Tensor) -> Result<()> {
        loss::cross_entropy(logits, target, label_smoothing, out)
    }

    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        target: &Tensor,
        label_smoothing: f64,
        grad: &Tensor,
        gx: &Tensor,
    ) -> Result<()> {
        loss::cross_entropy_backward(logits, target, label_smoothing, grad, gx)
    }

    fn nll_loss(&self, log_probs: &Tensor, target: &Tensor, out: &Tensor) -> Result<()> {
        loss::nll_loss(log_probs, target, out)
    }

    fn nll_loss_backward(&self, target: &Tensor, grad: &Tensor, gx: &Tensor) -> Result<()> {
        loss::nll_loss_backward(target, grad, gx)
    }

    fn mse_loss(&self, input: &Tensor, target: &Tensor, out: &Tensor) -> Result<()> {
        loss::mse_loss(input, target, out)
    }

    fn mse_loss_backward(
        &self,
        input: &Tensor,
        target: &Tensor,
        grad: &Tensor,
        ga: Option<&Tensor>,
        gb: Option<&Tensor>,
    ) -> Result<()> {
        loss::mse_loss_backward(input, target, grad, ga, gb)
    }

    // Seam B: softmax.
    fn softmax(&self, x: &Tensor, dim: usize, log: bool, out: &Tensor) -> Result<()> {
        softmax::softmax(x, dim, log, out)
    }

    fn softmax_backward(&self, out: &Tensor, grad: &Tensor, dim: usize, log: bool, gx: &Tensor) -> Result<()> {
        softmax::softmax_backward(out, grad, dim, log, gx)
    }
}
