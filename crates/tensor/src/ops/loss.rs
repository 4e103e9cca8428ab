//! Losses, reduction mean: cross_entropy (logits + int64 class targets, optional label smoothing),
//! nll_loss (on log-probabilities) and mse_loss.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `F.cross_entropy(logits [N, C], target int64 [N], label_smoothing)`, mean over N.
pub fn cross_entropy(logits: &Tensor, target: &Tensor, label_smoothing: f64) -> Result<Tensor> {
    let _ = (logits, target, label_smoothing);
    Err(Error::invalid("cross_entropy is not implemented yet"))
}

/// `F.nll_loss(log_probs [N, C], target int64 [N])`, mean over N.
pub fn nll_loss(log_probs: &Tensor, target: &Tensor) -> Result<Tensor> {
    let _ = (log_probs, target);
    Err(Error::invalid("nll_loss is not implemented yet"))
}

/// `F.mse_loss(input, target)`, mean over all elements; gradient flows to both.
pub fn mse_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    let _ = (input, target);
    Err(Error::invalid("mse_loss is not implemented yet"))
}
