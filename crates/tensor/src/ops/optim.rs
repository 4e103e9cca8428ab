//! Fused, in-place optimizer updates and gradient unscaling, with PyTorch's exact update rules.
//! They allocate nothing: the optimizer state tensors are passed in (allocated by the caller as
//! `optimizer_state`).

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// SGD for one parameter: `g' = g + wd*p`; with momentum: `buf = g'` on the first step (`buf` is None
/// then and the caller passes a fresh buffer in `new_buf`), else `buf = momentum*buf + (1-dampening)*g'`;
/// Nesterov uses `g' + momentum*buf`; `p -= lr * update`.
#[allow(clippy::too_many_arguments)]
pub fn sgd_update(
    param: &Tensor,
    grad: &Tensor,
    momentum_buffer: Option<&Tensor>,
    first_step: bool,
    lr: f64,
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    weight_decay: f64,
) -> Result<()> {
    let _ = (param, grad, momentum_buffer, first_step, lr, momentum, dampening, nesterov, weight_decay);
    Err(Error::invalid("sgd_update is not implemented yet"))
}

/// Adam / AdamW for one parameter at step `step` (numbered from 1). Adam's weight decay is L2 added to
/// the gradient; AdamW (`decoupled`) first multiplies the parameter by (1 - lr*wd).
/// `p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`.
#[allow(clippy::too_many_arguments)]
pub fn adam_update(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
) -> Result<()> {
    let _ = (param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, decoupled);
    Err(Error::invalid("adam_update is not implemented yet"))
}

/// Multiplies `grad` in place by `inv_scale`; returns true when any result is inf or NaN
/// (GradScaler's unscale_ + found_inf).
pub fn unscale_(grad: &Tensor, inv_scale: f64) -> Result<bool> {
    let _ = (grad, inv_scale);
    Err(Error::invalid("unscale_ is not implemented yet"))
}
