//! Normalization: layer_norm over the trailing dims, batch_norm (training with running-statistics
//! update, and eval).

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `F.layer_norm(x, normalized_shape, weight, bias, eps)`: biased variance, eps inside the sqrt.
pub fn layer_norm(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let _ = (x, normalized_shape, weight, bias, eps);
    Err(Error::invalid("layer_norm is not implemented yet"))
}

/// `F.batch_norm` over channel dim 1 of x [N, C, ...]. Training: normalizes with the biased batch
/// variance and updates the running statistics in place (`rm = (1-m) rm + m mean`,
/// `rv = (1-m) rv + m var * n/(n-1)`); gradients flow through the batch statistics. Eval: uses the
/// running statistics as constants.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let _ = (x, running_mean, running_var, weight, bias, training, momentum, eps);
    Err(Error::invalid("batch_norm is not implemented yet"))
}
