//! Fused, in-place optimizer updates and gradient unscaling, with PyTorch's exact update rules.
//! They allocate nothing: the optimizer state tensors are passed in (allocated by the caller as
//! `optimizer_state`).
//!
//! Note [Optimizer arithmetic]: the updates follow PyTorch's single-tensor (non-foreach) CPU path
//! operation by operation, in the parameter's dtype: every hyper-parameter is first computed as a
//! Python float would be (f64), then cast to the parameter's dtype, and each tensor op of the
//! reference (`add(alpha)`, `mul_`, `lerp_`, `addcmul_`, `sqrt`, `div`, `add_`, `addcdiv_`) becomes
//! the same rounding step here. Only the tensor traffic is fused: one pass over memory per update.
//! Large tensors are split into disjoint chunks updated in parallel (elementwise, so the result does
//! not depend on the thread count). The kernels are the backend's (`memfit-cpu`'s `optim.rs`).

use super::check_same;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::DType;
/// Values per block of 8-bit optimizer state (one absolute maximum each).
pub use memfit_cpu::optim::QUANT_BLOCK;
pub(crate) use memfit_cpu::optim::{AdamStep, SgdStep};
use std::sync::Arc;

/// Validates an in-place update: same device and dtype, same shape, contiguous, no two tensors
/// sharing storage (the kernel holds a mutable slice of some of them while reading the others).
fn check_update(op: &str, param: &Tensor, grad: &Tensor, states: &[&Tensor]) -> Result<()> {
    let mut all = vec![param, grad];
    all.extend_from_slice(states);
    check_same(op, &all)?;
    super::check_computable(op, param.dtype())?;
    for t in &all[1..] {
        if t.shape() != param.shape() {
            return Err(Error::shape(format!(
                "{op}: parameter {:?} and gradient/state {:?} differ in shape",
                param.shape(),
                t.shape()
            )));
        }
    }
    for t in &all {
        if !t.is_contiguous() {
            return Err(Error::invalid(format!(
                "{op}: parameters, gradients and optimizer state must be contiguous (got a {:?} view)",
                t.shape()
            )));
        }
    }
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if Arc::ptr_eq(a.storage(), b.storage()) {
                return Err(Error::invalid(format!("{op}: parameter, gradient and state must not share storage")));
            }
        }
    }
    Ok(())
}

/// SGD for one parameter: `g' = g + wd*p`; with momentum: `buf = g'` on the first step (the caller
/// passes a freshly allocated buffer and `first_step = true`; its contents are overwritten), else
/// `buf = momentum*buf + (1-dampening)*g'`; Nesterov uses `g' + momentum*buf`; `p -= lr * update`.
/// `momentum_buffer` is required when `momentum != 0` and ignored otherwise. The gradient is not
/// modified. On `meta` only the arguments are checked.
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
    let _op = param.device().op_scope("sgd_update");
    let buf = if momentum != 0.0 {
        Some(momentum_buffer.ok_or_else(|| Error::invalid("sgd_update: momentum needs a momentum buffer"))?)
    } else {
        None
    };
    if nesterov && (momentum <= 0.0 || dampening != 0.0) {
        return Err(Error::invalid("sgd_update: Nesterov momentum requires a momentum and zero dampening"));
    }
    check_update("sgd_update", param, grad, buf.as_slice())?;
    let step = SgdStep { lr, momentum, dampening, nesterov, weight_decay, first_step };
    param.device().backend().sgd_update(param, grad, buf, step)
}

/// Adam / AdamW for one parameter at step `step` (numbered from 1). Adam's weight decay is L2 added to
/// the gradient; AdamW (`decoupled`) first multiplies the parameter by (1 - lr*wd).
/// `p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`. `exp_avg` and `exp_avg_sq` start as zeros
/// (the caller allocates them); the gradient is not modified. On `meta` only the arguments are checked.
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
    let _op = param.device().op_scope("adam_update");
    if step == 0 {
        return Err(Error::invalid("adam_update: steps are numbered from 1"));
    }
    let step = AdamStep { step, lr, betas, eps, weight_decay, decoupled };
    // bf16 moments of an f32 parameter (Note [Compact optimizer state] in memfit-cpu).
    if param.dtype() == DType::F32 && exp_avg.dtype() == DType::BF16 && exp_avg_sq.dtype() == DType::BF16 {
        check_update("adam_update", param, grad, &[])?;
        check_state("adam_update", param, &[(exp_avg, param.numel()), (exp_avg_sq, param.numel())])?;
        return param.device().backend().adam_update_bf16_state(param, grad, exp_avg, exp_avg_sq, step);
    }
    check_update("adam_update", param, grad, &[exp_avg, exp_avg_sq])?;
    param.device().backend().adam_update(param, grad, exp_avg, exp_avg_sq, step)
}

/// [`adam_update`] of every `[param, grad, exp_avg, exp_avg_sq]` of `group` at one `step`, each
/// with dense moments of its parameter's dtype: the same bits, and on a GPU a launch for many
/// tensors instead of one each. Every tensor is checked before any is updated, so an error leaves
/// them all unchanged.
#[allow(clippy::too_many_arguments)]
pub fn adam_update_all(
    group: &[[&Tensor; 4]],
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
) -> Result<()> {
    let Some([first, ..]) = group.first() else { return Ok(()) };
    let _op = first.device().op_scope("adam_update");
    if step == 0 {
        return Err(Error::invalid("adam_update: steps are numbered from 1"));
    }
    // A parameter twice in one group would be updated twice at once (one launch on a GPU).
    let mut seen = std::collections::HashSet::new();
    for [param, grad, exp_avg, exp_avg_sq] in group {
        if !param.device().same(first.device()) {
            return Err(Error::device("adam_update: the tensors of one step are on different devices".to_string()));
        }
        check_update("adam_update", param, grad, &[exp_avg, exp_avg_sq])?;
        if !seen.insert((Arc::as_ptr(param.storage()), param.layout().offset())) {
            return Err(Error::invalid(format!(
                "adam_update: a parameter {:?} appears twice in one step",
                param.shape()
            )));
        }
    }
    let step = AdamStep { step, lr, betas, eps, weight_decay, decoupled };
    first.device().backend().adam_update_all(group, step)
}

/// Adam / AdamW as [`adam_update`] for an f32 parameter whose moments are 8-bit block-wise: u8
/// `*_codes` of the parameter's length and f32 `*_absmax`, one per block of
/// [`memfit_cpu::optim::QUANT_BLOCK`] values (Note [Compact optimizer state] in memfit-cpu). Zero
/// codes and absolute maxima are zero moments.
#[allow(clippy::too_many_arguments)]
pub fn adam_update_8bit(
    param: &Tensor,
    grad: &Tensor,
    (m_codes, m_absmax): (&Tensor, &Tensor),
    (v_codes, v_absmax): (&Tensor, &Tensor),
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
) -> Result<()> {
    let _op = param.device().op_scope("adam_update_8bit");
    if step == 0 {
        return Err(Error::invalid("adam_update_8bit: steps are numbered from 1"));
    }
    if param.dtype() != DType::F32 {
        return Err(Error::dtype(format!("adam_update_8bit: the parameter must be f32, not {}", param.dtype())));
    }
    check_update("adam_update_8bit", param, grad, &[])?;
    let (n, blocks) = (param.numel(), param.numel().div_ceil(memfit_cpu::optim::QUANT_BLOCK));
    for (t, dtype) in [(m_codes, DType::U8), (v_codes, DType::U8), (m_absmax, DType::F32), (v_absmax, DType::F32)] {
        if t.dtype() != dtype {
            return Err(Error::dtype(format!(
                "adam_update_8bit: codes are u8 and absolute maxima f32, got {}",
                t.dtype()
            )));
        }
    }
    check_state("adam_update_8bit", param, &[(m_codes, n), (v_codes, n), (m_absmax, blocks), (v_absmax, blocks)])?;
    let step = AdamStep { step, lr, betas, eps, weight_decay, decoupled };
    param.device().backend().adam_update_8bit(param, grad, m_codes, m_absmax, v_codes, v_absmax, step)
}

/// Optimizer state of its own dtype beside `param`: on its device, contiguous, of the element counts
/// given, sharing storage with nothing else given.
fn check_state(op: &str, param: &Tensor, states: &[(&Tensor, usize)]) -> Result<()> {
    for (i, (t, n)) in states.iter().enumerate() {
        if !t.device().same(param.device()) {
            return Err(Error::device(format!("{op}: tensors are on different devices")));
        }
        if t.numel() != *n || !t.is_contiguous() {
            return Err(Error::shape(format!("{op}: a state tensor {:?} should be {n} contiguous values", t.shape())));
        }
        let shared = Arc::ptr_eq(t.storage(), param.storage())
            || states[i + 1..].iter().any(|(o, _)| Arc::ptr_eq(t.storage(), o.storage()));
        if shared {
            return Err(Error::invalid(format!("{op}: parameter, gradient and state must not share storage")));
        }
    }
    Ok(())
}

/// Multiplies each of `grads` in place by `inv_scale` (cast to the gradient's dtype, as GradScaler's
/// f32 `inv_scale` tensor); returns true when any value of any of them is inf or NaN before or after
/// the multiplication (GradScaler's unscale_ + found_inf). Every gradient is unscaled, and a GPU
/// reports the flag once for all. On `meta` nothing happens and it returns false.
pub fn unscale_(grads: &[&Tensor], inv_scale: f64) -> Result<bool> {
    let Some(first) = grads.first() else { return Ok(false) };
    for grad in grads {
        if !grad.is_contiguous() {
            return Err(Error::invalid(format!("unscale_: the gradient {:?} must be contiguous", grad.shape())));
        }
        if !grad.device().same(first.device()) {
            return Err(Error::invalid("unscale_: the gradients must be on one device"));
        }
        super::check_computable("unscale_", grad.dtype())?;
    }
    let mut found_inf = false;
    first.device().backend().unscale_all(grads, inv_scale, &mut found_inf)?;
    Ok(found_inf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Category, Device};
    use memfit_cpu::PAR_CHUNK;

    fn t64(d: &Device, v: &[f64]) -> Tensor {
        Tensor::from_slice(d, v, &[v.len()], Category::Parameter).unwrap()
    }

    fn close(a: &[f64], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }

    /// A deterministic pseudo-random sequence in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn adam_on_a_group_is_adam_on_each_and_checks_all_before_any() {
        let d = Device::cpu();
        let sizes = [3, 0, 7];
        let make = |seed: u64| sizes.iter().map(|&n| t64(&d, &values(n, seed + n as u64))).collect::<Vec<_>>();
        let (p1, p2, g) = (make(1), make(1), make(2));
        let zeros = || sizes.iter().map(|&n| t64(&d, &vec![0.0; n])).collect::<Vec<_>>();
        let (m1, v1, m2, v2) = (zeros(), zeros(), zeros(), zeros());
        let group: Vec<[&Tensor; 4]> = (0..3).map(|i| [&p1[i], &g[i], &m1[i], &v1[i]]).collect();
        for step in 1..=2 {
            adam_update_all(&group, step, 0.1, (0.9, 0.99), 1e-8, 0.01, true).unwrap();
            for i in 0..3 {
                adam_update(&p2[i], &g[i], &m2[i], &v2[i], step, 0.1, (0.9, 0.99), 1e-8, 0.01, true).unwrap();
            }
        }
        for (a, b) in p1.iter().chain(&m1).chain(&v1).zip(p2.iter().chain(&m2).chain(&v2)) {
            assert_eq!(a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
        }
        assert!(adam_update_all(&[], 1, 0.1, (0.9, 0.99), 1e-8, 0.0, true).is_ok());
        assert!(adam_update_all(&group, 0, 0.1, (0.9, 0.99), 1e-8, 0.0, true).is_err());
        // The same parameter twice, or a state of another shape: refused before anything changes.
        let before = p1[0].to_vec::<f64>().unwrap();
        let twice = [group[0], group[0]];
        let e = adam_update_all(&twice, 3, 0.1, (0.9, 0.99), 1e-8, 0.0, true).unwrap_err();
        assert!(e.to_string().contains("appears twice"), "{e}");
        let wrong = [group[0], [&p1[2], &g[2], &m1[0], &v1[2]]];
        assert!(adam_update_all(&wrong, 3, 0.1, (0.9, 0.99), 1e-8, 0.0, true).is_err());
        assert_eq!(p1[0].to_vec::<f64>().unwrap(), before);
    }

    #[test]
    fn sgd_momentum_by_hand() {
        let d = Device::cpu();
        let p = t64(&d, &[1.0, -2.0]);
        let buf = t64(&d, &[123.0, 456.0]); // garbage: overwritten on the first step
        let g = t64(&d, &[0.5, 1.0]);
        sgd_update(&p, &g, Some(&buf), true, 0.1, 0.9, 0.0, false, 0.0).unwrap();
        // buf = g; p -= 0.1 g
        close(&buf.to_vec::<f64>().unwrap(), &[0.5, 1.0], 1e-15);
        close(&p.to_vec::<f64>().unwrap(), &[0.95, -2.1], 1e-15);
        sgd_update(&p, &g, Some(&buf), false, 0.1, 0.9, 0.0, false, 0.0).unwrap();
        // buf = 0.9*0.5 + 0.5 = 0.95, 0.9*1 + 1 = 1.9
        close(&buf.to_vec::<f64>().unwrap(), &[0.95, 1.9], 1e-15);
        close(&p.to_vec::<f64>().unwrap(), &[0.855, -2.29], 1e-15);
        // The gradient is untouched.
        close(&g.to_vec::<f64>().unwrap(), &[0.5, 1.0], 0.0);
    }

    #[test]
    fn sgd_weight_decay_dampening_nesterov_by_hand() {
        let d = Device::cpu();
        // Weight decay enters the gradient before the momentum buffer.
        let p = t64(&d, &[2.0]);
        let g = t64(&d, &[1.0]);
        let buf = t64(&d, &[0.0]);
        sgd_update(&p, &g, Some(&buf), true, 0.5, 0.9, 0.5, false, 0.1).unwrap();
        // g' = 1 + 0.2 = 1.2, buf = 1.2 (no dampening on the first step), p = 2 - 0.6 = 1.4
        close(&buf.to_vec::<f64>().unwrap(), &[1.2], 1e-15);
        close(&p.to_vec::<f64>().unwrap(), &[1.4], 1e-15);
        sgd_update(&p, &g, Some(&buf), false, 0.5, 0.9, 0.5, false, 0.1).unwrap();
        // g' = 1 + 0.14 = 1.14, buf = 1.08 + 0.57 = 1.65, p = 1.4 - 0.825 = 0.575
        close(&buf.to_vec::<f64>().unwrap(), &[1.65], 1e-15);
        close(&p.to_vec::<f64>().unwrap(), &[0.575], 1e-15);

        // Nesterov: step with g' + m*buf.
        let p = t64(&d, &[1.0]);
        let buf = t64(&d, &[0.0]);
        sgd_update(&p, &g, Some(&buf), true, 0.1, 0.9, 0.0, true, 0.0).unwrap();
        // buf = 1, d = 1 + 0.9 = 1.9, p = 1 - 0.19
        close(&p.to_vec::<f64>().unwrap(), &[0.81], 1e-15);
        sgd_update(&p, &g, Some(&buf), false, 0.1, 0.9, 0.0, true, 0.0).unwrap();
        // buf = 1.9, d = 1 + 1.71 = 2.71, p = 0.81 - 0.271
        close(&p.to_vec::<f64>().unwrap(), &[0.539], 1e-15);

        // Plain SGD needs no buffer.
        let p = t64(&d, &[1.0]);
        sgd_update(&p, &g, None, true, 0.25, 0.0, 0.0, false, 0.0).unwrap();
        close(&p.to_vec::<f64>().unwrap(), &[0.75], 1e-15);
    }

    #[test]
    fn adam_first_step_moves_by_lr_times_sign() {
        // At step 1 the bias-corrected moments are g and g^2: p -= lr * g / (|g| + eps).
        let d = Device::cpu();
        let p = t64(&d, &[1.0, 1.0, 1.0]);
        let g = t64(&d, &[0.3, -2.0, 1e-3]);
        let (m, v) = (t64(&d, &[0.0; 3]), t64(&d, &[0.0; 3]));
        adam_update(&p, &g, &m, &v, 1, 0.01, (0.9, 0.999), 1e-8, 0.0, false).unwrap();
        let want: Vec<f64> = [0.3f64, -2.0, 1e-3].iter().map(|g| 1.0 - 0.01 * g / (g.abs() + 1e-8)).collect();
        close(&p.to_vec::<f64>().unwrap(), &want, 1e-13);
        close(&m.to_vec::<f64>().unwrap(), &[0.03, -0.2, 1e-4], 1e-13);
        close(&v.to_vec::<f64>().unwrap(), &[0.09e-3, 4e-3, 1e-9], 1e-13);
    }

    /// A plain f64 transcription of torch.optim's single-tensor Adam/AdamW.
    #[allow(clippy::too_many_arguments)]
    fn adam_reference(
        p: &mut [f64],
        g: &[f64],
        m: &mut [f64],
        v: &mut [f64],
        t: u64,
        lr: f64,
        wd: f64,
        decoupled: bool,
    ) {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        for i in 0..p.len() {
            let mut grad = g[i];
            if decoupled {
                p[i] *= 1.0 - lr * wd;
            } else {
                grad += wd * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * grad;
            v[i] = b2 * v[i] + (1.0 - b2) * grad * grad;
            let mhat = m[i] / (1.0 - b1.powi(t as i32));
            let vhat = v[i] / (1.0 - b2.powi(t as i32));
            p[i] -= lr * mhat / (vhat.sqrt() + eps);
        }
    }

    #[test]
    fn adam_and_adamw_follow_the_textbook_formula() {
        for decoupled in [false, true] {
            let d = Device::cpu();
            let n = 50;
            let init = values(n, 1);
            let p = t64(&d, &init);
            let (m, v) = (t64(&d, &vec![0.0; n]), t64(&d, &vec![0.0; n]));
            let (mut rp, mut rm, mut rv) = (init.clone(), vec![0.0; n], vec![0.0; n]);
            for t in 1..=5u64 {
                let gv = values(n, 10 + t);
                let g = t64(&d, &gv);
                adam_update(&p, &g, &m, &v, t, 0.01, (0.9, 0.999), 1e-8, 0.05, decoupled).unwrap();
                adam_reference(&mut rp, &gv, &mut rm, &mut rv, t, 0.01, 0.05, decoupled);
            }
            close(&p.to_vec::<f64>().unwrap(), &rp, 1e-12);
            close(&m.to_vec::<f64>().unwrap(), &rm, 1e-12);
            close(&v.to_vec::<f64>().unwrap(), &rv, 1e-12);
        }
    }

    #[test]
    fn parallel_chunks_match_the_serial_result() {
        // Same elementwise values whatever the chunking: compare a big tensor with its prefix run alone.
        let d = Device::cpu();
        let n = 3 * PAR_CHUNK + 17;
        let init: Vec<f32> = values(n, 3).into_iter().map(|x| x as f32).collect();
        let grads: Vec<f32> = values(n, 4).into_iter().map(|x| x as f32).collect();
        let big = |v: &[f32]| Tensor::from_slice(&d, v, &[v.len()], Category::Parameter).unwrap();
        let (p, g, m, v) = (big(&init), big(&grads), big(&vec![0.0; n]), big(&vec![0.0; n]));
        let small = 100;
        let (ps, gs, ms, vs) =
            (big(&init[..small]), big(&grads[..small]), big(&vec![0.0; small]), big(&vec![0.0; small]));
        for t in 1..=2 {
            adam_update(&p, &g, &m, &v, t, 1e-3, (0.9, 0.999), 1e-8, 0.01, true).unwrap();
            adam_update(&ps, &gs, &ms, &vs, t, 1e-3, (0.9, 0.999), 1e-8, 0.01, true).unwrap();
        }
        assert_eq!(&p.to_vec::<f32>().unwrap()[..small], &ps.to_vec::<f32>().unwrap()[..]);
        let buf = big(&vec![0.0; n]);
        let bufs = big(&vec![0.0; small]);
        sgd_update(&p, &g, Some(&buf), true, 0.1, 0.9, 0.0, true, 0.01).unwrap();
        sgd_update(&ps, &gs, Some(&bufs), true, 0.1, 0.9, 0.0, true, 0.01).unwrap();
        assert_eq!(&p.to_vec::<f32>().unwrap()[..small], &ps.to_vec::<f32>().unwrap()[..]);
        assert!(!unscale_(&[&g], 0.5).unwrap());
        assert_eq!(g.to_vec::<f32>().unwrap()[n - 1], grads[n - 1] * 0.5);
    }

    #[test]
    fn unscale_multiplies_and_reports_non_finite_values() {
        let d = Device::cpu();
        let g = Tensor::from_slice(&d, &[2.0f32, -4.0, 8.0], &[3], Category::Gradient).unwrap();
        assert!(!unscale_(&[&g], 0.25).unwrap());
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![0.5, -1.0, 2.0]);
        let g = Tensor::from_slice(&d, &[1.0f32, f32::INFINITY], &[2], Category::Gradient).unwrap();
        assert!(unscale_(&[&g], 0.5).unwrap());
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![0.5, f32::INFINITY]);
        let g = Tensor::from_slice(&d, &[f64::NAN], &[1], Category::Gradient).unwrap();
        assert!(unscale_(&[&g], 1.0).unwrap());
        // A big tensor with one inf in a late chunk.
        let mut v = vec![1.0f32; 2 * PAR_CHUNK + 5];
        v[2 * PAR_CHUNK + 3] = f32::NEG_INFINITY;
        let g = Tensor::from_slice(&d, &v, &[v.len()], Category::Gradient).unwrap();
        assert!(unscale_(&[&g], 0.5).unwrap());
    }

    #[test]
    fn meta_checks_but_does_nothing() {
        let d = Device::meta();
        let p = Tensor::zeros(&d, &[4], crate::DType::F32, Category::Parameter).unwrap();
        let g = Tensor::zeros(&d, &[4], crate::DType::F32, Category::Gradient).unwrap();
        let m = Tensor::zeros(&d, &[4], crate::DType::F32, Category::OptimizerState).unwrap();
        let v = Tensor::zeros(&d, &[4], crate::DType::F32, Category::OptimizerState).unwrap();
        let before = d.stats();
        adam_update(&p, &g, &m, &v, 1, 1e-3, (0.9, 0.999), 1e-8, 0.0, false).unwrap();
        sgd_update(&p, &g, Some(&m), true, 0.1, 0.9, 0.0, false, 0.0).unwrap();
        assert!(!unscale_(&[&g], 0.5).unwrap());
        assert_eq!(d.stats(), before, "no allocation");
        let wrong = Tensor::zeros(&d, &[5], crate::DType::F32, Category::Gradient).unwrap();
        assert!(adam_update(&p, &wrong, &m, &v, 1, 1e-3, (0.9, 0.999), 1e-8, 0.0, false).is_err());
    }

    #[test]
    fn bad_arguments_are_errors() {
        let d = Device::cpu();
        let p = t64(&d, &[1.0, 2.0]);
        let g = t64(&d, &[1.0, 2.0]);
        assert!(sgd_update(&p, &g, None, true, 0.1, 0.9, 0.0, false, 0.0).is_err(), "momentum without a buffer");
        assert!(sgd_update(&p, &p, None, true, 0.1, 0.0, 0.0, false, 0.0).is_err(), "aliasing");
        let g32 = Tensor::from_slice(&d, &[1.0f32, 2.0], &[2], Category::Gradient).unwrap();
        assert!(sgd_update(&p, &g32, None, true, 0.1, 0.0, 0.0, false, 0.0).is_err(), "dtype mismatch");
        let (m, v) = (t64(&d, &[0.0, 0.0]), t64(&d, &[0.0, 0.0]));
        assert!(adam_update(&p, &g, &m, &v, 0, 1e-3, (0.9, 0.999), 1e-8, 0.0, false).is_err(), "step 0");
        let wide = Tensor::from_slice(&d, &[0.0f64; 4], &[2, 2], Category::Gradient).unwrap();
        let view = wide.transpose(0, 1).unwrap();
        assert!(!view.is_contiguous());
        assert!(unscale_(&[&view], 0.5).is_err(), "non-contiguous gradient");
    }
}
