//! 2-D convolution (cross-correlation, NCHW, weight [out, in/groups, kh, kw]) with stride, padding,
//! dilation and groups, by im2col + GEMM. The im2col workspace comes from the allocator as a temporary,
//! sized from shapes only (never from the thread count), so meta and cpu allocate the same bytes.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyper-parameters of a 2-D convolution, `[h, w]` pairs as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Conv2dParams { stride: [1, 1], padding: [0, 0], dilation: [1, 1], groups: 1 }
    }
}

/// `F.conv2d(x, weight, bias, stride, padding, dilation, groups)`: x [N, C, H, W] -> [N, O, OH, OW],
/// OH = floor((H + 2p - d(k-1) - 1)/s) + 1.
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, params: Conv2dParams) -> Result<Tensor> {
    let _ = (x, weight, bias, params);
    Err(Error::invalid("conv2d is not implemented yet"))
}
