//! Normalization: layer_norm over the trailing dims, batch_norm (training with running-statistics
//! update, and eval), and layer_norm_linear (a layer norm over the last dim fused with the linear
//! layer after it).
//!
//! All are fused kernels. layer_norm saves the input, the weight and per-row mean and rstd;
//! batch_norm saves the input, the weight and per-channel mean and rstd (the batch statistics in
//! training, the running statistics in eval); layer_norm_linear saves the input, per-row mean and
//! rstd and the weights, but not the normalized tensor, which its backward recomputes block by block.
//! Statistics are accumulated in f64 with two passes. This file holds shapes, outputs (and the fused
//! op's scratch) and autograd; the kernels are the backend's (`memfit-cpu`'s `norm.rs`).

use super::matmul::{bias_grad, check_linear, contiguous_bias};
use super::{check_same, output};
use crate::autograd::{needs_grad, record, save, save_compact, Backward, Compact};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
pub(crate) use memfit_cpu::norm::LN_ROWS;
use memfit_memory::Category;

/// `F.layer_norm(x, normalized_shape, weight, bias, eps)`: biased variance, eps inside the sqrt.
pub fn layer_norm(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let _op = x.device().op_scope("layer_norm");
    let mut all = vec![x];
    all.extend(weight);
    all.extend(bias);
    check_same("layer_norm", &all)?;
    let k = normalized_shape.len();
    if k == 0 || x.rank() < k || &x.shape()[x.rank() - k..] != normalized_shape {
        return Err(Error::shape(format!(
            "layer_norm: normalized_shape {normalized_shape:?} does not match the trailing dims of input {:?}",
            x.shape()
        )));
    }
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            if t.shape() != normalized_shape {
                return Err(Error::shape(format!(
                    "layer_norm: {name} {:?} should have shape normalized_shape {normalized_shape:?}",
                    t.shape()
                )));
            }
        }
    }
    let x = x.contiguous()?;
    let weight = weight.map(|w| w.contiguous()).transpose()?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let d: usize = normalized_shape.iter().product();
    let stats_shape = &x.shape()[..x.rank() - k];

    let mut inputs = vec![&x];
    inputs.extend(weight.as_ref());
    inputs.extend(bias.as_ref());
    let grad = needs_grad(&inputs);

    let out = output(&x, x.shape(), x.dtype(), "layer_norm")?;
    let stats = if grad {
        Some((output(&x, stats_shape, x.dtype(), "layer_norm")?, output(&x, stats_shape, x.dtype(), "layer_norm")?))
    } else {
        None
    };
    let (mean, rstd) = (stats.as_ref().map(|s| &s.0), stats.as_ref().map(|s| &s.1));
    x.device().backend().layer_norm(&x, weight.as_ref(), bias.as_ref(), d, eps, &out, mean, rstd)?;
    let Some((mean, rstd)) = stats else { return Ok(out) };
    let back = LayerNormBack {
        x: save_compact(&x)?,
        weight: weight.as_ref().map(save),
        mean: save(&mean),
        rstd: save(&rstd),
        has_bias: bias.is_some(),
        d,
    };
    Ok(record(out, "layer_norm", &inputs, back))
}

struct LayerNormBack {
    x: Compact,
    weight: Option<Tensor>,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    d: usize,
}

impl Backward for LayerNormBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let d = self.d;
        let has_w = self.weight.is_some();
        let need_x = needs[0];
        let need_w = has_w && needs[1];
        let need_b = self.has_bias && needs[if has_w { 2 } else { 1 }];
        let shape = self.x.shape().to_vec();
        // The normalized dims are the trailing dims after the (per-row) statistics' dims.
        let nshape = &self.x.shape()[self.mean.rank()..];
        let gx = if need_x { Some(output(&grad, &shape, grad.dtype(), "layer_norm_backward")?) } else { None };
        let gw = if need_w { Some(output(&grad, nshape, grad.dtype(), "layer_norm_backward")?) } else { None };
        let gb = if need_b { Some(output(&grad, nshape, grad.dtype(), "layer_norm_backward")?) } else { None };
        grad.device().backend().layer_norm_backward(
            &self.x.restore()?,
            self.weight.as_ref(),
            &self.mean,
            &self.rstd,
            d,
            &grad,
            gx.as_ref(),
            gw.as_ref(),
            gb.as_ref(),
        )?;
        let mut grads = vec![gx];
        if has_w {
            grads.push(gw);
        }
        if self.has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

/// `linear(layer_norm(x, [in], ln_weight, ln_bias, eps), weight, bias)` fused (a pre-norm
/// transformer's normalization and the projection after it): x [..., in], ln_weight and ln_bias [in],
/// weight [out, in], bias [out].
///
/// Unfused, autograd keeps both the normalization's input (for its backward) and its output (for the
/// linear's); this op saves only `x`, the per-row mean and rstd and the weights, and recomputes the
/// normalized rows in backward. Forward and backward work in blocks of `LN_ROWS` rows (on a GPU,
/// `GPU_FUSED_ROWS`) through one allocator scratch of a block x in, so the normalized tensor never
/// exists whole. Backward writes the
/// input gradient over the saved `x` when nobody else can see it (Note [Gradient ownership] in
/// `autograd.rs`), else into a new tensor. Normalized values and the input gradient are computed
/// exactly as [`layer_norm`] computes them; the linear weight gradient's sum over rows is split by
/// row blocks. The layer-norm weight and bias gradients are summed in an f64 [2, in] allocator
/// tensor: when the linear weight gradient is wanted too, from the weight-gradient product (taken
/// on the normalized rows before the affine, with the column sums of the output gradient; sums over
/// the `out` rows of the weight instead of over every input row, see `affine_after_product` in
/// `memfit-cpu`), else as the unfused layer norm sums them.
pub fn layer_norm_linear(
    x: &Tensor,
    ln_weight: &Tensor,
    ln_bias: &Tensor,
    eps: f64,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let _op = x.device().op_scope("layer_norm_linear");
    const NAME: &str = "layer_norm_linear";
    let (out_f, in_f) = check_linear(NAME, x, weight, bias)?;
    check_same(NAME, &[x, ln_weight, ln_bias])?;
    if in_f == 0 {
        return Err(Error::shape(format!("{NAME}: needs at least one feature, got input {:?}", x.shape())));
    }
    for (name, t) in [("ln_weight", ln_weight), ("ln_bias", ln_bias)] {
        if t.shape() != [in_f] {
            return Err(Error::shape(format!("{NAME}: {name} {:?} should be [{in_f}]", t.shape())));
        }
    }
    let x = x.contiguous()?;
    let (ln_w, ln_b) = (ln_weight.contiguous()?, ln_bias.contiguous()?);
    let rows = x.numel() / in_f;
    let mut inputs = vec![&x, &ln_w, &ln_b, weight];
    inputs.extend(bias);
    let grad = needs_grad(&inputs);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), NAME)?;
    let stats_shape = &x.shape()[..x.rank() - 1];
    let stats = if grad {
        Some((output(&x, stats_shape, x.dtype(), NAME)?, output(&x, stats_shape, x.dtype(), NAME)?))
    } else {
        None
    };
    let scratch = output(&x, &[rows.min(super::fused_block_rows(&x, LN_ROWS)), in_f], x.dtype(), NAME)?;
    let b = contiguous_bias(bias)?;
    let (mean, rstd) = (stats.as_ref().map(|s| &s.0), stats.as_ref().map(|s| &s.1));
    x.device().backend().layer_norm_linear(
        &x,
        &ln_w,
        &ln_b,
        eps,
        weight,
        b.as_ref(),
        &scratch,
        &out,
        mean,
        rstd,
        super::products_of(&x),
    )?;
    drop(b);
    drop(scratch);
    let Some((mean, rstd)) = stats else { return Ok(out) };
    let back = LayerNormLinearBack {
        x: save_compact(&x)?,
        ln_weight: save(&ln_w),
        ln_bias: save(&ln_b),
        weight: save(weight),
        mean: save(&mean),
        rstd: save(&rstd),
        has_bias: bias.is_some(),
    };
    Ok(record(out, NAME, &inputs, back))
}

struct LayerNormLinearBack {
    /// The normalization's input; overwritten with its gradient in backward when exclusively owned.
    x: Compact,
    ln_weight: Tensor,
    ln_bias: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
}

impl Backward for LayerNormLinearBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        const NAME: &str = "layer_norm_linear_backward";
        let LayerNormLinearBack { x, ln_weight, ln_bias, weight, mean, rstd, has_bias } = *self;
        // On a GPU, x saved in its products' own 16 bits is read as saved (the kernels widen each
        // element as restoring it would: the same bits, without the restored copy or its cast),
        // its gradient then a new tensor.
        let read_saved = super::saved_in_operand_format(&x, &grad);
        let x = if read_saved { x.stored().clone() } else { x.into_tensor()? };
        let (out_f, d) = (weight.shape()[0], weight.shape()[1]);
        let g2 = grad.contiguous()?.reshape(&[-1, out_f as isize])?;
        let rows = g2.shape()[0];
        let (need_x, need_lw, need_lb, need_w) = (needs[0], needs[1], needs[2], needs[3]);
        // Decided from who holds what, never from data, so meta allocates as cpu does.
        let in_place = need_x && !read_saved && x.owns_storage();
        let gx = if need_x && !in_place { Some(output(&grad, x.shape(), grad.dtype(), NAME)?) } else { None };
        let glw = if need_lw { Some(output(&grad, &[d], grad.dtype(), NAME)?) } else { None };
        let glb = if need_lb { Some(output(&grad, &[d], grad.dtype(), NAME)?) } else { None };
        let gw = if need_w { Some(output(&grad, &[out_f, d], grad.dtype(), NAME)?) } else { None };
        // The layer-norm gradients come from the weight-gradient product when it runs: it then sums
        // the columns of g (the linear bias gradient, or a scratch when that is not wanted).
        let want_gb = has_bias && needs[4];
        let gb = bias_grad(&g2, want_gb || (need_w && (need_lw || need_lb)), gw.is_some(), NAME)?;
        // Everything is allocated before x may be overwritten.
        let scratch = output(&grad, &[rows.min(super::fused_block_rows(&grad, LN_ROWS)), d], grad.dtype(), NAME)?;
        let sums = if need_lw || need_lb { Some(super::output_any(&grad, &[2, d], DType::F64, NAME)?) } else { None };
        // In place, the input gradient is x itself.
        let gx_target = if in_place { Some(&x) } else { gx.as_ref() };
        grad.device().backend().layer_norm_linear_backward(
            &x,
            &ln_weight,
            &ln_bias,
            &weight,
            &mean,
            &rstd,
            &g2,
            gx_target,
            glw.as_ref(),
            glb.as_ref(),
            gw.as_ref(),
            gb.as_ref().filter(|_| gw.is_some()),
            &scratch,
            sums.as_ref(),
            super::products_of(&x),
        )?;
        drop((scratch, sums));
        let gx = if in_place {
            // x now holds its gradient: a temporary again, no longer an activation.
            x.storage().set_category(Category::Temporary);
            Some(x)
        } else {
            gx
        };
        let mut grads = vec![gx, glw, glb, gw];
        if has_bias {
            grads.push(gb.filter(|_| want_gb));
        }
        Ok(grads)
    }
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
    let _op = x.device().op_scope("batch_norm");
    let mut all = vec![x];
    all.extend(running_mean);
    all.extend(running_var);
    all.extend(weight);
    all.extend(bias);
    check_same("batch_norm", &all)?;
    if x.rank() < 2 {
        return Err(Error::shape(format!("batch_norm: input must be [N, C, ...], got {:?}", x.shape())));
    }
    let (nb, c) = (x.shape()[0], x.shape()[1]);
    let s: usize = x.shape()[2..].iter().product();
    let n = nb * s;
    for (name, t) in [("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)]
    {
        if let Some(t) = t {
            if t.shape() != [c] {
                return Err(Error::shape(format!(
                    "batch_norm: {name} {:?} should be [{c}] for input {:?}",
                    t.shape(),
                    x.shape()
                )));
            }
        }
    }
    let running = match (running_mean, running_var) {
        (Some(m), Some(v)) => Some((m, v)),
        (None, None) => None,
        _ => return Err(Error::invalid("batch_norm: give both running_mean and running_var, or neither")),
    };
    if !training && running.is_none() {
        return Err(Error::invalid("batch_norm: eval mode needs running_mean and running_var"));
    }
    if let Some((m, v)) = running {
        if !m.is_contiguous() || !v.is_contiguous() {
            return Err(Error::invalid("batch_norm: running statistics must be contiguous buffers"));
        }
    }
    if training && n <= 1 {
        return Err(Error::invalid(format!(
            "batch_norm: expected more than 1 value per channel when training, got input {:?}",
            x.shape()
        )));
    }
    let x = x.contiguous()?;
    let weight = weight.map(|w| w.contiguous()).transpose()?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let mut inputs = vec![&x];
    inputs.extend(weight.as_ref());
    inputs.extend(bias.as_ref());
    let grad = needs_grad(&inputs);

    let out = output(&x, x.shape(), x.dtype(), "batch_norm")?;
    let stats = if grad {
        Some((output(&x, &[c], x.dtype(), "batch_norm")?, output(&x, &[c], x.dtype(), "batch_norm")?))
    } else {
        None
    };
    let (mean, rstd) = (stats.as_ref().map(|s| &s.0), stats.as_ref().map(|s| &s.1));
    x.device().backend().batch_norm(
        &x,
        running_mean,
        running_var,
        weight.as_ref(),
        bias.as_ref(),
        training,
        momentum,
        eps,
        &out,
        mean,
        rstd,
    )?;
    let Some((mean, rstd)) = stats else { return Ok(out) };
    let back = BatchNormBack {
        x: save_compact(&x)?,
        weight: weight.as_ref().map(save),
        mean: save(&mean),
        rstd: save(&rstd),
        has_bias: bias.is_some(),
        training,
    };
    Ok(record(out, "batch_norm", &inputs, back))
}

struct BatchNormBack {
    x: Compact,
    weight: Option<Tensor>,
    /// Per-channel statistics used to normalize: the batch's in training, the running ones in eval.
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    training: bool,
}

impl Backward for BatchNormBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let shape = self.x.shape().to_vec();
        let c = shape[1];
        let has_w = self.weight.is_some();
        let need_x = needs[0];
        let need_w = has_w && needs[1];
        let need_b = self.has_bias && needs[if has_w { 2 } else { 1 }];
        let gx = if need_x { Some(output(&grad, &shape, grad.dtype(), "batch_norm_backward")?) } else { None };
        let gw = if need_w { Some(output(&grad, &[c], grad.dtype(), "batch_norm_backward")?) } else { None };
        let gb = if need_b { Some(output(&grad, &[c], grad.dtype(), "batch_norm_backward")?) } else { None };
        grad.device().backend().batch_norm_backward(
            &self.x.restore()?,
            self.weight.as_ref(),
            &self.mean,
            &self.rstd,
            self.training,
            &grad,
            gx.as_ref(),
            gw.as_ref(),
            gb.as_ref(),
        )?;
        let mut grads = vec![gx];
        if has_w {
            grads.push(gw);
        }
        if self.has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{backward, backward_with};
    use crate::ops::softmax::test_support::*;
    use crate::{Category, DType, Device};

    #[test]
    fn layer_norm_hand_checked() {
        let dev = Device::cpu();
        // Row [1, 2, 3, 4]: mean 2.5, biased var 1.25.
        let x = t64(&dev, &[1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0], &[2, 4]);
        let w = t64(&dev, &[1.0, 2.0, 1.0, 1.0], &[4]);
        let b = t64(&dev, &[0.0, 0.0, 0.0, 1.0], &[4]);
        let eps = 1e-5;
        let y = layer_norm(&x, &[4], Some(&w), Some(&b), eps).unwrap().to_f64_vec().unwrap();
        let r = 1.0 / (1.25f64 + eps).sqrt();
        let want = [-1.5 * r, -0.5 * r * 2.0, 0.5 * r, 1.5 * r + 1.0, 0.0, 0.0, 0.0, 1.0];
        assert_close(&y, &want, 1e-14, "layer_norm");
        // Normalizing over both dims of a [2, 2] block.
        let y2 = layer_norm(&x.reshape(&[2, 2, 2]).unwrap(), &[2, 2], None, None, eps).unwrap();
        assert_close(&y2.to_f64_vec().unwrap()[..4], &[-1.5 * r, -0.5 * r, 0.5 * r, 1.5 * r], 1e-14, "2-d");
        assert!(layer_norm(&x, &[3], None, None, eps).is_err());
        assert!(layer_norm(&x, &[4], Some(&b.reshape(&[2, 2]).unwrap()), None, eps).is_err());
    }

    #[test]
    fn batch_norm_hand_checked_and_running_stats() {
        let dev = Device::cpu();
        // x [2, 2] (N=2, C=2): channel 0 = [1, 3] (mean 2, var 1), channel 1 = [2, 2] (mean 2, var 0).
        let x = t64(&dev, &[1.0, 2.0, 3.0, 2.0], &[2, 2]);
        let rm = Tensor::from_slice(&dev, &[0.0f64, 1.0], &[2], Category::Other).unwrap();
        let rv = Tensor::from_slice(&dev, &[1.0f64, 1.0], &[2], Category::Other).unwrap();
        let eps = 1e-5;
        let y = batch_norm(&x, Some(&rm), Some(&rv), None, None, true, 0.1, eps).unwrap();
        let r = 1.0 / (1.0f64 + eps).sqrt();
        assert_close(&y.to_f64_vec().unwrap(), &[-r, 0.0, r, 0.0], 1e-14, "train");
        // rm = 0.9 rm + 0.1 mean; rv = 0.9 rv + 0.1 * var * n/(n-1) (n = 2).
        assert_close(&rm.to_f64_vec().unwrap(), &[0.2, 1.1], 1e-15, "running_mean");
        assert_close(&rv.to_f64_vec().unwrap(), &[0.9 + 0.2, 0.9], 1e-15, "running_var");
        // Eval uses the running stats, weight and bias.
        let w = t64(&dev, &[2.0, 1.0], &[2]);
        let b = t64(&dev, &[0.5, 0.0], &[2]);
        let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), false, 0.1, eps).unwrap();
        let (r0, r1) = (1.0 / (1.1f64 + eps).sqrt(), 1.0 / (0.9f64 + eps).sqrt());
        let want = [(1.0 - 0.2) * r0 * 2.0 + 0.5, (2.0 - 1.1) * r1, (3.0 - 0.2) * r0 * 2.0 + 0.5, (2.0 - 1.1) * r1];
        assert_close(&y.to_f64_vec().unwrap(), &want, 1e-14, "eval");
        assert_close(&rm.to_f64_vec().unwrap(), &[0.2, 1.1], 0.0, "eval leaves running stats");
        // Errors.
        let one = t64(&dev, &[1.0, 2.0], &[1, 2]);
        assert!(batch_norm(&one, None, None, None, None, true, 0.1, eps)
            .unwrap_err()
            .to_string()
            .contains("more than 1"));
        assert!(batch_norm(&x, None, None, None, None, false, 0.1, eps).is_err());
        assert!(batch_norm(&x, Some(&rm), None, None, None, true, 0.1, eps).is_err());
        assert!(batch_norm(&x, None, None, Some(&t64(&dev, &[1.0; 3], &[3])), None, true, 0.1, eps).is_err());
        // Empty planes in evaluation: an empty output, and zero weight and bias gradients.
        let empty = Tensor::zeros(&dev, &[2, 2, 0], DType::F64, Category::Input).unwrap();
        let (w, b) = (w.set_requires_grad(true), b.set_requires_grad(true));
        let y = batch_norm(&empty, Some(&rm), Some(&rv), Some(&w), Some(&b), false, 0.1, eps).unwrap();
        assert_eq!(y.shape(), [2, 2, 0]);
        backward_with(&y, Tensor::zeros(&dev, &[2, 2, 0], DType::F64, Category::Input).unwrap()).unwrap();
        assert_eq!(w.grad().unwrap().to_f64_vec().unwrap(), [0.0, 0.0]);
        assert_eq!(b.grad().unwrap().to_f64_vec().unwrap(), [0.0, 0.0]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let x = values(24, 3).iter().map(|v| v * 2.0).collect::<Vec<_>>();
        let (w, b) = (values(4, 4).iter().map(|v| v + 1.5).collect::<Vec<_>>(), values(4, 5));
        gradcheck(&[(x.clone(), vec![2, 3, 4]), (w.clone(), vec![4]), (b.clone(), vec![4])], |t| {
            layer_norm(&t[0], &[4], Some(&t[1]), Some(&t[2]), 1e-5)
        });
        gradcheck(&[(x.clone(), vec![2, 3, 4])], |t| layer_norm(&t[0], &[3, 4], None, None, 1e-5));
        gradcheck(&[(x.clone(), vec![2, 3, 4]), (b.clone(), vec![4])], |t| {
            layer_norm(&t[0], &[4], None, Some(&t[1]), 1e-5)
        });
        // batch_norm over C = 3 with a trailing dim of 4, and the 2-D [N, C] form.
        let (w3, b3) = (vec![1.5, 0.7, -1.2], vec![0.1, -0.2, 0.3]);
        for training in [true, false] {
            let f = |t: &[Tensor]| {
                let dev = t[0].device();
                let rm = Tensor::from_slice(dev, &[0.1f64, -0.2, 0.3], &[3], Category::Other)?;
                let rv = Tensor::from_slice(dev, &[0.5f64, 1.5, 2.0], &[3], Category::Other)?;
                batch_norm(&t[0], Some(&rm), Some(&rv), Some(&t[1]), Some(&t[2]), training, 0.1, 1e-5)
            };
            gradcheck(&[(x.clone(), vec![2, 3, 4]), (w3.clone(), vec![3]), (b3.clone(), vec![3])], f);
            gradcheck(&[(x[..12].to_vec(), vec![4, 3]), (w3.clone(), vec![3]), (b3.clone(), vec![3])], f);
        }
        gradcheck(&[(x.clone(), vec![2, 3, 2, 2])], |t| batch_norm(&t[0], None, None, None, None, true, 0.1, 1e-5));
    }

    #[test]
    fn big_inputs_take_parallel_paths() {
        // Compare the parallel kernels with an f64 reference computed here.
        let dev = Device::cpu();
        let (rows, d) = (300, 257);
        let data = values(rows * d, 6);
        let x = t64(&dev, &data, &[rows, d]).set_requires_grad(true);
        let w = t64(&dev, &values(d, 7), &[d]).set_requires_grad(true);
        let y = layer_norm(&x, &[d], Some(&w), None, 1e-5).unwrap();
        let yv = y.to_f64_vec().unwrap();
        for r in [0, 123, rows - 1] {
            let row = &data[r * d..(r + 1) * d];
            let m = row.iter().sum::<f64>() / d as f64;
            let v = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / d as f64;
            let j = 100;
            let want = (row[j] - m) / (v + 1e-5).sqrt() * values(d, 7)[j];
            assert_close(&[yv[r * d + j]], &[want], 1e-12, "layer_norm row");
        }
        backward(&y.sum_all().unwrap()).unwrap();
        // With a sum loss and no bias: dw_j = sum_r xhat_rj; and dx rows sum to ~0.
        let gx = x.grad().unwrap().to_f64_vec().unwrap();
        assert!(gx[..d].iter().sum::<f64>().abs() < 1e-10);
        assert!(w.grad().is_some());

        let (n, c, s) = (8, 5, 1000);
        let xb = t64(&dev, &values(n * c * s, 8), &[n, c, s]);
        let y = batch_norm(&xb, None, None, None, None, true, 0.1, 0.0).unwrap().to_f64_vec().unwrap();
        for ch in 0..c {
            let vals: Vec<f64> = (0..n).flat_map(|i| y[(i * c + ch) * s..(i * c + ch + 1) * s].to_vec()).collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let v = vals.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / vals.len() as f64;
            assert!(m.abs() < 1e-12 && (v - 1.0).abs() < 1e-10, "channel {ch}: mean {m} var {v}");
        }
    }

    #[test]
    fn golden_layer_norm_and_batch_norm() {
        let g = Golden::open("norm.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            let sfx = suffix(dtype);
            let name = format!("layer_norm_{sfx}");
            let k = |s: &str| format!("{name}/{s}");
            let (x, w, b) = (g.leaf(&dev, &k("input")), g.leaf(&dev, &k("weight")), g.leaf(&dev, &k("bias")));
            let y = layer_norm(&x, &[8], Some(&w), Some(&b), 1e-5).unwrap();
            assert_golden(&y, &g.f64s(&k("output")), dtype, &name);
            backward_with(&y, g.tensor(&dev, &k("grad_out"))).unwrap();
            assert_golden(&x.grad().unwrap(), &g.f64s(&k("grad_input")), dtype, &name);
            assert_golden(&w.grad().unwrap(), &g.f64s(&k("grad_weight")), dtype, &name);
            assert_golden(&b.grad().unwrap(), &g.f64s(&k("grad_bias")), dtype, &name);

            for case in ["batch_norm_train", "batch_norm_train_2d", "batch_norm_eval"] {
                let name = format!("{case}_{sfx}");
                let k = |s: &str| format!("{name}/{s}");
                let training = case != "batch_norm_eval";
                let (x, w, b) = (g.leaf(&dev, &k("input")), g.leaf(&dev, &k("weight")), g.leaf(&dev, &k("bias")));
                let (rm, rv) = (g.tensor(&dev, &k("running_mean")), g.tensor(&dev, &k("running_var")));
                let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), training, 0.1, 1e-5).unwrap();
                assert_golden(&y, &g.f64s(&k("output")), dtype, &name);
                if training {
                    assert_golden(&rm, &g.f64s(&k("running_mean_after")), dtype, &name);
                    assert_golden(&rv, &g.f64s(&k("running_var_after")), dtype, &name);
                }
                backward_with(&y, g.tensor(&dev, &k("grad_out"))).unwrap();
                assert_golden(&x.grad().unwrap(), &g.f64s(&k("grad_input")), dtype, &name);
                assert_golden(&w.grad().unwrap(), &g.f64s(&k("grad_weight")), dtype, &name);
                assert_golden(&b.grad().unwrap(), &g.f64s(&k("grad_bias")), dtype, &name);
            }
        }
    }

    /// layer_norm_linear against `linear(layer_norm(x))`: output and every gradient, with the input a
    /// leaf (a new gradient tensor) or produced by an op (its gradient written over the saved input);
    /// in f32 both also against the f64 values. The fused layer-norm gradients are sums over the
    /// weight's rows of f32 sums over the input rows, the composed ones sums over the input rows of
    /// f32 products: in f32 they differ by the rounding of sums over these 2153 rows (the fused ones
    /// measured 1.0-1.6e-5 from f64, the composed 0.7-0.9e-5).
    #[test]
    fn layer_norm_linear_matches_composed_ops() {
        let dev = Device::cpu();
        // Several blocks of rows, the last one partial; 160 features: three column blocks, the last
        // partial, and a whole block of rows large enough to be worked in parallel row groups.
        let (rows, i, o) = (2 * LN_ROWS + 105, 160, 12);
        let mut truth: Vec<Vec<f64>> = Vec::new();
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 4e-5 };
            let leaf = |n, salt, scale: f64, shift: f64, shape: &[usize]| {
                let v: Vec<f64> = values(n, salt).iter().map(|v| v * scale + shift).collect();
                t64(&dev, &v, shape).to_dtype(dtype).unwrap().set_requires_grad(true)
            };
            let x = leaf(rows * i, 1, 3.0, 0.5, &[rows, i]);
            let (lw, lb) = (leaf(i, 2, 0.5, 1.0, &[i]), leaf(i, 3, 1.0, 0.0, &[i]));
            let (w, b) = (leaf(o * i, 4, 1.0, 0.0, &[o, i]), leaf(o, 5, 1.0, 0.0, &[o]));
            let g = t64(&dev, &values(rows * o, 6), &[rows, o]).to_dtype(dtype).unwrap();
            let leaves = [&x, &lw, &lb, &w, &b];
            for produced in [false, true] {
                let input = if produced { x.mul_scalar(1.0).unwrap() } else { x.clone() };
                let y = layer_norm_linear(&input, &lw, &lb, 1e-5, &w, Some(&b)).unwrap();
                drop(input);
                backward_with(&y, g.clone()).unwrap();
                let got: Vec<Vec<f64>> = leaves.iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                let h = layer_norm(&x, &[i], Some(&lw), Some(&lb), 1e-5).unwrap();
                let r = crate::ops::linear(&h, &w, Some(&b)).unwrap();
                assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), tol, "output");
                backward_with(&r, g.clone()).unwrap();
                let composed: Vec<Vec<f64>> =
                    leaves.iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                for k in 0..leaves.len() {
                    assert_close(&got[k], &composed[k], tol, &format!("gradient {k}"));
                }
                if dtype == DType::F64 {
                    truth = composed;
                } else {
                    for k in 0..leaves.len() {
                        assert_close(&got[k], &truth[k], 2.5e-5, &format!("gradient {k} against f64"));
                        assert_close(&composed[k], &truth[k], 2.5e-5, &format!("composed gradient {k} against f64"));
                    }
                }
            }
        }
        let x = t64(&dev, &[1.0; 6], &[2, 3]);
        let p = |n| t64(&dev, &vec![1.0; n], &[n]);
        let w = t64(&dev, &[1.0; 6], &[2, 3]);
        assert!(layer_norm_linear(&x, &p(3), &p(3), 1e-5, &w, Some(&p(2))).is_ok());
        assert!(layer_norm_linear(&x, &p(2), &p(3), 1e-5, &w, None).is_err(), "ln weight of the wrong size");
        assert!(layer_norm_linear(&x, &p(3), &p(3), 1e-5, &w, Some(&p(3))).is_err(), "bias of the wrong size");
    }

    #[test]
    fn layer_norm_linear_saves_its_input_and_statistics_only() {
        let dev = Device::cpu();
        let (rows, i, o) = (300, 64, 8);
        let leaf = |n, salt, shape: &[usize]| {
            Tensor::from_slice(&dev, &values(n, salt), shape, Category::Input).unwrap().set_requires_grad(true)
        };
        let (x, lw, lb, w) =
            (leaf(rows * i, 1, &[rows, i]), leaf(i, 2, &[i]), leaf(i, 3, &[i]), leaf(o * i, 4, &[o, i]));
        let h = x.mul_scalar(1.0).unwrap(); // a temporary of 300 x 64 f64 = 150 KiB
        let activation = || dev.stats().category(Category::Activation).current;
        let y = layer_norm_linear(&h, &lw, &lb, 1e-5, &w, None).unwrap();
        drop(h);
        assert_eq!(activation(), (rows * i * 8 + 2 * 2560) as u64, "x, mean and rstd [300] (in 512 B blocks)");
        let g = t64(&dev, &values(rows * o, 5), &[rows, o]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let allocs = allocations_since(&dev, before);
        // ln weight and bias gradients, the weight gradient, the column sums of g (no linear bias:
        // a scratch), a scratch of one block of rows and the f64 sums of the ln gradients; dx
        // overwrites the saved input; then the affine's backward.
        let name = "layer_norm_linear_backward";
        let block = (rows.min(LN_ROWS) * i * 8) as u64;
        assert_eq!(allocs[..6], [(512, name), (512, name), (4096, name), (512, name), (block, name), (1024, name)]);
        assert_eq!(allocs.len(), 7, "{allocs:?}");
        assert_eq!(dev.stats().category(Category::Activation).current, 0);
    }

    /// With the weight frozen, the layer-norm gradients are column sums over the rows: backward
    /// allocates no weight gradient and no column sums of the output gradient.
    #[test]
    fn layer_norm_linear_with_a_frozen_weight_allocates_no_product_buffers() {
        let dev = Device::cpu();
        let (rows, i, o) = (300, 64, 8);
        let leaf = |n, salt, shape: &[usize], grad: bool| {
            Tensor::from_slice(&dev, &values(n, salt), shape, Category::Input).unwrap().set_requires_grad(grad)
        };
        let (x, lw, lb) = (leaf(rows * i, 1, &[rows, i], true), leaf(i, 2, &[i], true), leaf(i, 3, &[i], true));
        let w = leaf(o * i, 4, &[o, i], false);
        let y = layer_norm_linear(&x, &lw, &lb, 1e-5, &w, None).unwrap();
        let g = t64(&dev, &values(rows * o, 5), &[rows, o]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let allocs = allocations_since(&dev, before);
        // The input gradient (x is a leaf), ln weight and bias gradients, a block of rows, the f64 sums.
        let name = "layer_norm_linear_backward";
        let block = (rows.min(LN_ROWS) * i * 8) as u64;
        let want = [(block, name), (512, name), (512, name), (block, name), (1024, name)];
        assert_eq!(allocs, want);
    }

    #[test]
    fn layer_norm_linear_meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.1, DType::F32, Category::Input)?.set_requires_grad(true))
            };
            let (x, lw, lb, w, b) = (t(&[3, 100, 8])?, t(&[8])?, t(&[8])?, t(&[5, 8])?, t(&[5])?);
            // Leaf input (new gradient) and an intermediate one (gradient in place).
            let y = layer_norm_linear(&x, &lw, &lb, 1e-5, &w, Some(&b))?;
            backward(&y.sum_all()?)?;
            let y = layer_norm_linear(&x.mul_scalar(2.0)?, &lw, &lb, 1e-5, &w, None)?;
            backward(&y.sum_all()?)
        });
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let p = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.5, DType::F32, Category::Parameter)?.set_requires_grad(true))
            };
            let x = Tensor::full(dev, &[4, 3, 2, 2], 1.0, DType::F32, Category::Input)?;
            let rm = Tensor::zeros(dev, &[3], DType::F32, Category::Other)?;
            let rv = Tensor::full(dev, &[3], 1.0, DType::F32, Category::Other)?;
            let (w, b) = (p(&[3])?, p(&[3])?);
            let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), true, 0.1, 1e-5)?;
            let (lw, lb) = (p(&[2])?, p(&[2])?);
            let z = layer_norm(&y, &[2], Some(&lw), Some(&lb), 1e-5)?;
            backward(&z.sum_all()?)
        });
    }
}
