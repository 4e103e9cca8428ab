//! Losses, reduction mean: cross_entropy (logits + int64 class targets, optional label smoothing),
//! nll_loss (on log-probabilities) and mse_loss.
//!
//! This file holds shapes, outputs and autograd; the kernels are the backend's (`memfit-cpu`'s `loss.rs`).
//! cross_entropy is one fused kernel (log-sum-exp per row, no probability tensor in forward); it saves
//! the logits and the targets, and its backward recomputes the softmax straight into the gradient.
//! Sums over rows are taken in fixed blocks and added in block order, so results do not depend on the
//! thread count.

use super::{output, zeros_output};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Checks that `target` is int64 on `input`'s device.
fn check_target_kind(op: &str, input: &Tensor, target: &Tensor) -> Result<()> {
    if !input.device().same(target.device()) {
        return Err(Error::device(format!("{op}: input and target are on different devices")));
    }
    if target.dtype() != DType::I64 {
        return Err(Error::dtype(format!("{op}: target must be int64 class indices, got {}", target.dtype())));
    }
    Ok(())
}

/// Checks that `target` is int64 `[n]` on `input`'s device.
fn check_targets(op: &str, input: &Tensor, target: &Tensor, n: usize) -> Result<()> {
    check_target_kind(op, input, target)?;
    if target.rank() != 1 || target.shape()[0] != n {
        return Err(Error::shape(format!("{op}: expected target [{n}], got {:?}", target.shape())));
    }
    Ok(())
}

/// Checks `[N, C]` float input and int64 `[N]` target; returns (N, C).
fn check_class_inputs(op: &str, input: &Tensor, target: &Tensor) -> Result<(usize, usize)> {
    check_target_kind(op, input, target)?;
    if input.rank() != 2 || target.rank() != 1 || input.shape()[0] != target.shape()[0] {
        return Err(Error::shape(format!(
            "{op}: expected input [N, C] and target [N], got {:?} and {:?}",
            input.shape(),
            target.shape()
        )));
    }
    let (n, c) = (input.shape()[0], input.shape()[1]);
    if n == 0 || c == 0 {
        return Err(Error::shape(format!("{op}: needs at least one sample and one class, got {:?}", input.shape())));
    }
    Ok((n, c))
}

/// `F.cross_entropy(logits [N, C], target int64 [N], label_smoothing)`, mean over N.
pub fn cross_entropy(logits: &Tensor, target: &Tensor, label_smoothing: f64) -> Result<Tensor> {
    let _op = logits.device().op_scope("cross_entropy");
    check_class_inputs("cross_entropy", logits, target)?;
    if !(0.0..=1.0).contains(&label_smoothing) {
        return Err(Error::invalid(format!("cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")));
    }
    let logits = logits.contiguous()?;
    let target = target.contiguous()?;
    let out = output(&logits, &[], logits.dtype(), "cross_entropy")?;
    // A GPU computes each row's loss in a block of its own, then sums them in a fixed order.
    let rows = logits.shape()[0];
    let ws = super::gpu_workspace(&logits, rows, logits.dtype(), "cross_entropy")?;
    logits.device().backend().cross_entropy(&logits, &target, label_smoothing, &out, ws.as_ref())?;
    if !needs_grad(&[&logits]) {
        return Ok(out);
    }
    let back = CrossEntropyBack { logits: save(&logits), target: save(&target), label_smoothing };
    Ok(record(out, "cross_entropy", &[&logits], back))
}

struct CrossEntropyBack {
    logits: Tensor,
    target: Tensor,
    label_smoothing: f64,
}

impl Backward for CrossEntropyBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let gx = output(&grad, self.logits.shape(), grad.dtype(), "cross_entropy_backward")?;
        grad.device().backend().cross_entropy_backward(&self.logits, &self.target, self.label_smoothing, &grad, &gx)?;
        Ok(vec![Some(gx)])
    }
}

/// Logits [`linear_cross_entropy`] holds at a time on a cpu, at most (Note [Chunked head]).
pub const HEAD_CHUNK_BYTES: usize = 64 << 20;

/// The same on a GPU target (`cuda`, `meta:cuda`): a chunk of 64 MiB is 333 rows of GPT-2's
/// 50,304 logits, and products of 333 rows kept an H100's tensor cores mostly idle (the head's
/// pieces ran at 39 TFLOP/s, a third of GPT-2's bf16 step); 512 MiB is 2,560 rows (in multiples of
/// 128, the tensor cores' tile), about 1 GiB of logits and their gradient at the peak.
pub const GPU_HEAD_CHUNK_BYTES: usize = 512 << 20;

/// Rows of logits of `classes` values of `dtype` in the chunk `device` holds ([`HEAD_CHUNK_BYTES`],
/// [`GPU_HEAD_CHUNK_BYTES`] in multiples of 128 rows where it holds as many), at least one.
pub fn head_chunk_rows(device: &crate::Device, classes: usize, dtype: DType) -> usize {
    let row = (classes * dtype.size()).max(1);
    match device.target() {
        crate::Target::Cpu => (HEAD_CHUNK_BYTES / row).max(1),
        crate::Target::Cuda => match GPU_HEAD_CHUNK_BYTES / row {
            rows if rows >= 128 => rows / 128 * 128,
            rows => rows.max(1),
        },
    }
}

// Note [Chunked head]: a language model's head and loss, `cross_entropy(linear(x, W, b), target)`,
// with a large vocabulary hold logits [N, V] and their gradient [N, V]: for GPT-2 small at batch 8
// (N = 8192, V = 50,304) 1.6 GB each, a third of the step's memory. `linear_cross_entropy` takes
// the rows `chunk` at a time: each chunk's logits are made, scored (loss, argmax) and, when gradients
// are wanted, turned at once into the chunk's share of dx, dW and db (with the upstream gradient
// taken as 1), then freed; backward only scales those by the real upstream gradient (Liger-Kernel's
// scheme). So no more than one chunk of logits (and of their gradient) ever exists, and no product is
// run twice. The values are the unchunked ones up to the order of float additions (the loss and dW,
// db are summed over chunks); the saved dx, dW and db are counted as activations. A chunk's loss and
// its logits' gradient come from one backend call (`cross_entropy_with_grad`), which a GPU serves
// with one kernel reading the logits twice where the two ops read them five times. On a GPU whose
// products round f32 (bf16, fp16), that kernel writes the gradient as those products' operand bits
// (16-bit: half the chunk's gradient, and nothing rounds it again), since only the two products read
// it; a bias gradient, summed in f32, is summed in the same call from the f32 gradient, which the
// kernel writes over the logits it came from (they are read no more).

/// `cross_entropy(linear(x, weight, bias), target, label_smoothing)` (x [N, in], weight [V, in], bias
/// [V], int64 target [N]) and each row's argmax class (int64 [N], no graph), never holding more than
/// `chunk` rows of logits (Note [Chunked head]).
pub fn linear_cross_entropy(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    target: &Tensor,
    label_smoothing: f64,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    let _op = x.device().op_scope("linear_cross_entropy");
    let (v, d) = super::matmul::check_linear("linear_cross_entropy", x, weight, bias)?;
    if x.rank() != 2 {
        return Err(Error::shape(format!("linear_cross_entropy: expected x [N, in], got {:?}", x.shape())));
    }
    let n = x.shape()[0];
    check_targets("linear_cross_entropy", x, target, n)?;
    if n == 0 {
        return Err(Error::shape("linear_cross_entropy: needs at least one row".to_string()));
    }
    if !(0.0..=1.0).contains(&label_smoothing) {
        return Err(Error::invalid(format!(
            "linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}"
        )));
    }
    let (x, target, chunk) = (x.contiguous()?, target.contiguous()?, chunk.max(1));
    let bias_c = super::matmul::contiguous_bias(bias)?;
    let mut inputs = vec![&x, weight];
    inputs.extend(bias);
    let grads = needs_grad(&inputs);
    let backend = x.device().backend();
    let dtype = x.dtype();
    let loss = zeros_output(&x, &[], dtype, "linear_cross_entropy")?;
    let predicted = super::output_any(&x, &[n], DType::I64, "linear_cross_entropy")?;
    // The logits' gradient as the products' operand bits (above), or in the logits' dtype; on a GPU
    // the bias gradient is summed in the same call, from the f32 gradient.
    let gpu = x.device().target() == crate::Target::Cuda;
    let grad_dtype = match (gpu, super::products_of(&x), dtype) {
        (true, crate::Products::Bf16, DType::F32) => DType::BF16,
        (true, crate::Products::F16, DType::F32) => DType::F16,
        _ => dtype,
    };
    let (gx, gw, gb) = if grads {
        let gx = output(&x, &[n, d], dtype, "linear_cross_entropy")?;
        let gw = zeros_output(&x, &[v, d], dtype, "linear_cross_entropy")?;
        let gb = bias.map(|_| zeros_output(&x, &[v], dtype, "linear_cross_entropy")).transpose()?;
        (Some(gx), Some(gw), gb)
    } else {
        (None, None, None)
    };
    for start in (0..n).step_by(chunk) {
        let rows = chunk.min(n - start);
        let (xc, tc) = (x.narrow(0, start, rows)?, target.narrow(0, start, rows)?);
        let logits = output(&x, &[rows, v], dtype, "linear_cross_entropy")?;
        backend.linear(&xc, weight, bias_c.as_ref(), &logits, super::products_of(&xc))?;
        // Each row's class: with gradients, from the loss's own reading of the logits (before the
        // gradient may be written over them), else through max_dim.
        let classes = predicted.narrow(0, start, rows)?;
        // This chunk's mean loss, weighed by its share of the rows; and when gradients are wanted,
        // d(mean loss over all N rows) / d(this chunk's logits), the chunk's mean times its share,
        // from the same reading of the logits.
        let share = rows as f64 / n as f64;
        let part = output(&x, &[], dtype, "linear_cross_entropy")?;
        let ws = super::gpu_workspace(&x, rows, dtype, "linear_cross_entropy")?;
        let (glogits, summed_gb) = match (&gx, &gw) {
            (Some(_), Some(_)) => {
                let upstream = Tensor::full(x.device(), &[], share, dtype, crate::Category::Temporary)?;
                // (Operand bits are stored, not computed in: `output_any`.)
                let glogits = super::output_any(&x, &[rows, v], grad_dtype, "linear_cross_entropy")?;
                let gb_part =
                    gb.as_ref().filter(|_| gpu).map(|_| output(&x, &[v], dtype, "linear_cross_entropy")).transpose()?;
                backend.cross_entropy_with_grad(
                    &logits,
                    &tc,
                    label_smoothing,
                    &part,
                    ws.as_ref(),
                    &upstream,
                    &glogits,
                    gb_part.as_ref(),
                    Some(&classes),
                )?;
                (Some(glogits), gb_part)
            }
            _ => {
                let best = output(&x, &[rows], dtype, "linear_cross_entropy")?;
                backend.max_dim(&logits, rows, v, 1, &best, &classes)?;
                drop(best);
                backend.cross_entropy(&logits, &tc, label_smoothing, &part, ws.as_ref())?;
                (None, None)
            }
        };
        drop((ws, logits));
        let weighed = output(&x, &[], dtype, "linear_cross_entropy")?;
        backend.affine(&part, share, 0.0, &weighed)?;
        backend.add_into(&loss, &weighed)?;
        drop((part, weighed));
        let (Some(gx), Some(gw), Some(glogits)) = (&gx, &gw, glogits) else { continue };
        backend.matmul(&glogits, weight, &gx.narrow(0, start, rows)?, super::products_of(&glogits))?;
        let gw_part = output(&x, &[v, d], dtype, "linear_cross_entropy")?;
        // The bias gradient summed above (a GPU's), else with the weight's.
        let unsummed = match summed_gb {
            Some(_) => None,
            None => gb.as_ref().map(|_| output(&x, &[v], dtype, "linear_cross_entropy")).transpose()?,
        };
        backend.linear_weight_grad(&glogits, &xc, &gw_part, unsummed.as_ref(), super::products_of(&xc))?;
        let gb_part = summed_gb.or(unsummed);
        drop(glogits);
        backend.add_into(gw, &gw_part)?;
        if let (Some(gb), Some(part)) = (&gb, &gb_part) {
            backend.add_into(gb, part)?;
        }
    }
    let (Some(gx), Some(gw)) = (gx, gw) else { return Ok((loss, predicted)) };
    let back = LinearCrossEntropyBack { gx: save(&gx), gw: save(&gw), gb: gb.as_ref().map(save) };
    Ok((record(loss, "linear_cross_entropy", &inputs, back), predicted))
}

/// The gradients [`linear_cross_entropy`] computed in forward for an upstream gradient of 1.
struct LinearCrossEntropyBack {
    gx: Tensor,
    gw: Tensor,
    gb: Option<Tensor>,
}

impl Backward for LinearCrossEntropyBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let scaled = |t: &Tensor, wanted: bool| if wanted { t.mul(&grad).map(Some) } else { Ok(None) };
        let mut grads = vec![scaled(&self.gx, needs[0])?, scaled(&self.gw, needs[1])?];
        if let Some(gb) = &self.gb {
            grads.push(scaled(gb, needs.get(2).copied().unwrap_or(false))?);
        }
        Ok(grads)
    }
}

/// `F.nll_loss(log_probs [N, C], target int64 [N])`, mean over N.
pub fn nll_loss(log_probs: &Tensor, target: &Tensor) -> Result<Tensor> {
    let _op = log_probs.device().op_scope("nll_loss");
    let (_, c) = check_class_inputs("nll_loss", log_probs, target)?;
    let target = target.contiguous()?;
    let out = output(log_probs, &[], log_probs.dtype(), "nll_loss")?;
    log_probs.device().backend().nll_loss(log_probs, &target, &out)?;
    if !needs_grad(&[log_probs]) {
        return Ok(out);
    }
    let back = NllBack { target: save(&target), classes: c };
    Ok(record(out, "nll_loss", &[log_probs], back))
}

struct NllBack {
    target: Tensor,
    classes: usize,
}

impl Backward for NllBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (n, c) = (self.target.shape()[0], self.classes);
        let gx = zeros_output(&grad, &[n, c], grad.dtype(), "nll_loss_backward")?;
        grad.device().backend().nll_loss_backward(&self.target, &grad, &gx)?;
        Ok(vec![Some(gx)])
    }
}

/// `F.mse_loss(input, target)`, mean over all elements; gradient flows to both.
pub fn mse_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    let _op = input.device().op_scope("mse_loss");
    super::check_same("mse_loss", &[input, target])?;
    if input.shape() != target.shape() {
        return Err(Error::shape(format!(
            "mse_loss: input {:?} and target {:?} must have the same shape",
            input.shape(),
            target.shape()
        )));
    }
    let (a, b) = (input.contiguous()?, target.contiguous()?);
    let out = output(&a, &[], a.dtype(), "mse_loss")?;
    a.device().backend().mse_loss(&a, &b, &out)?;
    if !needs_grad(&[&a, &b]) {
        return Ok(out);
    }
    let back = MseBack { input: save(&a), target: save(&b) };
    Ok(record(out, "mse_loss", &[&a, &b], back))
}

struct MseBack {
    input: Tensor,
    target: Tensor,
}

impl Backward for MseBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let shape = self.input.shape().to_vec();
        let ga = if needs[0] { Some(output(&grad, &shape, grad.dtype(), "mse_loss_backward")?) } else { None };
        let gb = if needs[1] { Some(output(&grad, &shape, grad.dtype(), "mse_loss_backward")?) } else { None };
        grad.device().backend().mse_loss_backward(&self.input, &self.target, &grad, ga.as_ref(), gb.as_ref())?;
        Ok(vec![ga, gb])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{backward, backward_with};
    use crate::ops::softmax::test_support::*;
    use crate::ops::{log_softmax, softmax};
    use crate::{Category, Device};

    fn targets(dev: &Device, t: &[i64]) -> Tensor {
        Tensor::from_slice(dev, t, &[t.len()], Category::Input).unwrap()
    }

    #[test]
    fn a_gpu_holds_a_larger_head_chunk_in_whole_tiles() {
        let gpu = Device::new(crate::DeviceConfig::new(crate::DeviceKind::Meta(crate::Target::Cuda))).unwrap();
        // GPT-2's vocabulary: 333 rows in 64 MiB on a cpu; 2,668 rows in 512 MiB, 2,560 in tiles of 128.
        assert_eq!(head_chunk_rows(&Device::cpu(), 50_304, DType::F32), 333);
        assert_eq!(head_chunk_rows(&Device::meta(), 50_304, DType::F32), 333);
        assert_eq!(head_chunk_rows(&gpu, 50_304, DType::F32), 2560);
        // Rows too long for a tile of 128 in the chunk: as many as fit, at least one.
        assert_eq!(head_chunk_rows(&gpu, 1 << 23, DType::F32), 16);
        assert_eq!(head_chunk_rows(&gpu, 1 << 30, DType::F64), 1);
        assert_eq!(head_chunk_rows(&Device::cpu(), 1 << 30, DType::F64), 1);
    }

    /// The backend's loss with its gradient and, when asked, the gradient's column sums (a head's
    /// bias gradient, which a GPU sums in the same call): on the cpu, the sums of the gradient it
    /// wrote, bit for bit; and each row's class, when asked, max_dim's.
    #[test]
    fn the_loss_call_sums_the_bias_gradient_and_finds_the_classes_when_asked() {
        let dev = Device::cpu();
        let (n, c) = (6, 9);
        let logits = t64(&dev, &values(n * c, 3), &[n, c]).to_dtype(DType::F32).unwrap();
        let t = targets(&dev, &[0, 8, 3, 3, 5, 1]);
        let upstream = Tensor::full(&dev, &[], 0.5, DType::F32, Category::Input).unwrap();
        let out = |shape: &[usize]| output(&logits, shape, DType::F32, "test").unwrap();
        let (loss, gx, gb) = (out(&[]), out(&[n, c]), out(&[c]));
        let classes = crate::ops::output_any(&logits, &[n], DType::I64, "test").unwrap();
        dev.backend()
            .cross_entropy_with_grad(&logits, &t, 0.1, &loss, None, &upstream, &gx, Some(&gb), Some(&classes))
            .unwrap();
        let want = gx.sum_dim(0, false).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(gb.to_vec::<f32>().unwrap(), want);
        assert!(want.iter().any(|&v| v != 0.0), "{want:?}");
        let (_, best) = logits.max_dim(1, false).unwrap();
        assert_eq!(classes.to_vec::<i64>().unwrap(), best.to_vec::<i64>().unwrap());
    }

    #[test]
    fn hand_checked_values() {
        let dev = Device::cpu();
        // Uniform logits over 4 classes: loss ln 4 whatever the smoothing.
        let x = t64(&dev, &[0.0; 8], &[2, 4]).set_requires_grad(true);
        let t = targets(&dev, &[1, 3]);
        let l = cross_entropy(&x, &t, 0.0).unwrap();
        assert_close(&[l.item().unwrap()], &[4f64.ln()], 1e-15, "ce");
        backward(&l).unwrap();
        // d/dx = (p - onehot) / N = (0.25 - [c == t]) / 2.
        let want = [0.125, -0.375, 0.125, 0.125, 0.125, 0.125, 0.125, -0.375];
        assert_close(&x.grad().unwrap().to_f64_vec().unwrap(), &want, 1e-15, "ce grad");

        // One row [0, ln 3]: p = [1/4, 3/4]; target 0: nll = ln 4, sum_c -log p = ln 4 + ln(4/3).
        let x = t64(&dev, &[0.0, 3f64.ln()], &[1, 2]);
        let e = 0.2;
        let l = cross_entropy(&x, &targets(&dev, &[0]), e).unwrap().item().unwrap();
        let want = (1.0 - e) * 4f64.ln() + e / 2.0 * (4f64.ln() + (4.0f64 / 3.0).ln());
        assert_close(&[l], &[want], 1e-15, "label smoothing");

        // nll_loss picks -x[i, t_i] and averages.
        let lp = t64(&dev, &[-1.0, -2.0, -3.0, -4.0], &[2, 2]).set_requires_grad(true);
        let l = nll_loss(&lp, &targets(&dev, &[1, 0])).unwrap();
        assert_eq!(l.item().unwrap(), 2.5);
        backward(&l).unwrap();
        assert_eq!(lp.grad().unwrap().to_f64_vec().unwrap(), vec![0.0, -0.5, -0.5, 0.0]);

        // mse: ((1-0)^2 + (2-4)^2) / 2 = 2.5; grads +-(a-b) = +-[1, -2].
        let a = t64(&dev, &[1.0, 2.0], &[2]).set_requires_grad(true);
        let b = t64(&dev, &[0.0, 4.0], &[2]).set_requires_grad(true);
        let l = mse_loss(&a, &b).unwrap();
        assert_eq!(l.item().unwrap(), 2.5);
        backward(&l).unwrap();
        assert_eq!(a.grad().unwrap().to_f64_vec().unwrap(), vec![1.0, -2.0]);
        assert_eq!(b.grad().unwrap().to_f64_vec().unwrap(), vec![-1.0, 2.0]);
    }

    #[test]
    fn invalid_inputs_are_errors() {
        let dev = Device::cpu();
        let x = t64(&dev, &[0.0; 6], &[2, 3]);
        let err = cross_entropy(&x, &targets(&dev, &[0, 3]), 0.0).unwrap_err().to_string();
        assert!(err.contains("target 3") && err.contains("sample 1"), "{err}");
        let err = nll_loss(&x, &targets(&dev, &[-1, 0])).unwrap_err().to_string();
        assert!(err.contains("target -1"), "{err}");
        assert!(cross_entropy(&x, &targets(&dev, &[0]), 0.0).is_err());
        assert!(cross_entropy(&t64(&dev, &[], &[0, 3]), &targets(&dev, &[]), 0.0).is_err());
        assert!(cross_entropy(&x, &x, 0.0).is_err());
        assert!(cross_entropy(&x, &targets(&dev, &[0, 1]), 1.5).is_err());
        assert!(mse_loss(&x, &t64(&dev, &[0.0; 6], &[6])).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        let x = values(15, 2).iter().map(|v| v * 4.0).collect::<Vec<_>>();
        for e in [0.0, 0.3] {
            gradcheck(&[(x.clone(), vec![5, 3])], |t| {
                cross_entropy(&t[0], &targets(t[0].device(), &[0, 2, 1, 1, 0]), e)
            });
        }
        gradcheck(&[(x.clone(), vec![5, 3])], |t| {
            nll_loss(&log_softmax(&t[0], 1)?, &targets(t[0].device(), &[2, 2, 0, 1, 0]))
        });
        gradcheck(&[(x.clone(), vec![3, 5]), (values(15, 7), vec![3, 5])], |t| mse_loss(&t[0], &t[1]));
    }

    #[test]
    fn cross_entropy_equals_nll_of_log_softmax_on_big_input() {
        // Big enough for the parallel paths (several row blocks).
        let dev = Device::cpu();
        let (n, c) = (700, 129);
        let x = t64(&dev, &values(n * c, 4).iter().map(|v| v * 6.0).collect::<Vec<_>>(), &[n, c]);
        let t: Vec<i64> = (0..n as i64).map(|i| (i * 37) % c as i64).collect();
        let (xa, xb) = (x.set_requires_grad(true), x.set_requires_grad(true));
        let a = cross_entropy(&xa, &targets(&dev, &t), 0.0).unwrap();
        let b = nll_loss(&log_softmax(&xb, 1).unwrap(), &targets(&dev, &t)).unwrap();
        assert_close(&[a.item().unwrap()], &[b.item().unwrap()], 1e-13, "loss");
        backward(&a).unwrap();
        backward(&b).unwrap();
        let (ga, gb) = (xa.grad().unwrap().to_f64_vec().unwrap(), xb.grad().unwrap().to_f64_vec().unwrap());
        assert_close(&ga, &gb, 1e-13, "grad");
        // The gradient is (softmax - onehot) / N.
        let p = softmax(&x, 1).unwrap().to_f64_vec().unwrap();
        assert_close(&[ga[1] * n as f64], &[p[1]], 1e-12, "softmax");
    }

    #[test]
    fn golden_losses() {
        let g = Golden::open("loss.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            let sfx = suffix(dtype);
            for (case, e) in [("cross_entropy", 0.0), ("cross_entropy_label_smoothing", 0.1), ("nll_log_softmax", 0.0)]
            {
                let name = format!("{case}_{sfx}");
                let x = g.leaf(&dev, &format!("{name}/input"));
                let t = g.tensor(&dev, &format!("{name}/target"));
                let l = if case == "nll_log_softmax" {
                    nll_loss(&log_softmax(&x, -1).unwrap(), &t)
                } else {
                    cross_entropy(&x, &t, e)
                }
                .unwrap();
                assert_golden(&l, &g.f64s(&format!("{name}/output")), dtype, &name);
                backward_with(&l, g.tensor(&dev, &format!("{name}/grad_out"))).unwrap();
                assert_golden(&x.grad().unwrap(), &g.f64s(&format!("{name}/grad_input")), dtype, &name);
            }
            let name = format!("mse_loss_{sfx}");
            let (a, b) = (g.leaf(&dev, &format!("{name}/input")), g.leaf(&dev, &format!("{name}/target")));
            let l = mse_loss(&a, &b).unwrap();
            assert_golden(&l, &g.f64s(&format!("{name}/output")), dtype, &name);
            backward_with(&l, g.tensor(&dev, &format!("{name}/grad_out"))).unwrap();
            assert_golden(&a.grad().unwrap(), &g.f64s(&format!("{name}/grad_input")), dtype, &name);
            assert_golden(&b.grad().unwrap(), &g.f64s(&format!("{name}/grad_target")), dtype, &name);
        }
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let x = Tensor::full(dev, &[6, 5], 0.5, DType::F32, Category::Input)?.set_requires_grad(true);
            let t = Tensor::from_slice(dev, &[0i64, 1, 2, 3, 4, 0], &[6], Category::Input)?;
            let l = cross_entropy(&x, &t, 0.1)?;
            let l2 = nll_loss(&log_softmax(&x, 1)?, &t)?;
            let l3 = mse_loss(&x, &x.detach())?;
            backward(&l)?;
            backward(&l2)?;
            backward(&l3)
        });
    }
}
