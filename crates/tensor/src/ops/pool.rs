//! 2-D pooling over NCHW: max_pool2d (with flat `h*W + w` indices), avg_pool2d and adaptive_avg_pool2d.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyper-parameters of a 2-D pooling window, `[h, w]` pairs as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dParams {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
}

impl Pool2dParams {
    /// A square window of `k` with stride `k` (the common `max_pool2d(x, k)`).
    pub fn square(k: usize) -> Self {
        Pool2dParams { kernel: [k, k], stride: [k, k], padding: [0, 0], dilation: [1, 1], ceil_mode: false }
    }
}

/// `F.max_pool2d`: pads with -inf, first maximum in row-major window order wins.
pub fn max_pool2d(x: &Tensor, params: Pool2dParams) -> Result<Tensor> {
    Ok(max_pool2d_with_indices(x, params)?.0)
}

/// `F.max_pool2d(..., return_indices=True)`: indices are int64 flat `h*W + w` positions per (n, c) plane.
pub fn max_pool2d_with_indices(x: &Tensor, params: Pool2dParams) -> Result<(Tensor, Tensor)> {
    let _ = (x, params);
    Err(Error::invalid("max_pool2d is not implemented yet"))
}

/// `F.avg_pool2d` (divisor_override None). Uses kernel/stride/padding/ceil_mode of `params`; dilation must be 1.
pub fn avg_pool2d(x: &Tensor, params: Pool2dParams, count_include_pad: bool) -> Result<Tensor> {
    let _ = (x, params, count_include_pad);
    Err(Error::invalid("avg_pool2d is not implemented yet"))
}

/// `F.adaptive_avg_pool2d`: window i spans floor(i*H/out) .. ceil((i+1)*H/out).
pub fn adaptive_avg_pool2d(x: &Tensor, output_size: [usize; 2]) -> Result<Tensor> {
    let _ = (x, output_size);
    Err(Error::invalid("adaptive_avg_pool2d is not implemented yet"))
}
