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
//! not depend on the thread count).

use super::{check_same, PAR_CHUNK};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::with_float;
use rayon::prelude::*;
use std::sync::Arc;

/// Validates an in-place update: same device and dtype, same shape, contiguous, no two tensors
/// sharing storage (the kernel holds a mutable slice of some of them while reading the others).
fn check_update(op: &str, param: &Tensor, grad: &Tensor, states: &[&Tensor]) -> Result<()> {
    let mut all = vec![param, grad];
    all.extend_from_slice(states);
    check_same(op, &all)?;
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

/// SGD hyper-parameters already cast to the parameter's dtype (Note [Optimizer arithmetic]).
#[derive(Clone, Copy)]
struct Sgd<T> {
    weight_decay: Option<T>,
    momentum: T,
    one_minus_dampening: T,
    nesterov: bool,
    first_step: bool,
    neg_lr: T,
}

impl<T: Float> Sgd<T> {
    /// `grad.add(param, alpha=wd)`.
    #[inline(always)]
    fn decayed(&self, p: T, g: T) -> T {
        match self.weight_decay {
            Some(wd) => g + wd * p,
            None => g,
        }
    }

    /// Without momentum: `param.add_(g', alpha=-lr)`.
    #[inline(always)]
    fn plain(&self, p: &mut T, g: T) {
        let g = self.decayed(*p, g);
        *p += self.neg_lr * g;
    }

    /// With momentum: `buf = clone(g')` on the first step, else `buf.mul_(m).add_(g', alpha=1-d)`;
    /// the step direction is `g'.add(buf, alpha=m)` (Nesterov) or `buf`.
    #[inline(always)]
    fn with_momentum(&self, p: &mut T, g: T, buf: &mut T) {
        let g = self.decayed(*p, g);
        let b = if self.first_step { g } else { *buf * self.momentum + self.one_minus_dampening * g };
        *buf = b;
        let d = if self.nesterov { g + self.momentum * b } else { b };
        *p += self.neg_lr * d;
    }
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
    if !param.device().computes() {
        return Ok(());
    }
    with_float!(param.dtype(), "sgd_update", T => {
        let k = Sgd::<T> {
            weight_decay: (weight_decay != 0.0).then(|| T::of(weight_decay)),
            momentum: T::of(momentum),
            one_minus_dampening: T::of(1.0 - dampening),
            nesterov,
            first_step,
            neg_lr: T::of(-lr),
        };
        let p = param.slice_mut::<T>()?;
        let g = grad.slice::<T>()?;
        let parallel = p.len() >= 2 * PAR_CHUNK;
        match buf {
            None => {
                let run = |p: &mut [T], g: &[T]| p.iter_mut().zip(g).for_each(|(p, &g)| k.plain(p, g));
                if parallel {
                    p.par_chunks_mut(PAR_CHUNK).zip(g.par_chunks(PAR_CHUNK)).for_each(|(p, g)| run(p, g));
                } else {
                    run(p, g);
                }
            }
            Some(buf) => {
                let b = buf.slice_mut::<T>()?;
                let run = |p: &mut [T], g: &[T], b: &mut [T]| {
                    p.iter_mut().zip(g).zip(b.iter_mut()).for_each(|((p, &g), b)| k.with_momentum(p, g, b))
                };
                if parallel {
                    p.par_chunks_mut(PAR_CHUNK)
                        .zip(g.par_chunks(PAR_CHUNK))
                        .zip(b.par_chunks_mut(PAR_CHUNK))
                        .for_each(|((p, g), b)| run(p, g, b));
                } else {
                    run(p, g, b);
                }
            }
        }
    });
    Ok(())
}

/// Adam hyper-parameters already cast to the parameter's dtype (Note [Optimizer arithmetic]).
#[derive(Clone, Copy)]
struct Adam<T> {
    /// `1 - lr*wd` (AdamW) applied to the parameter first.
    decay: Option<T>,
    /// L2 weight decay (Adam) added to the gradient.
    l2: Option<T>,
    /// `1 - beta1`, the lerp weight.
    lerp_weight: T,
    beta2: T,
    one_minus_beta2: T,
    /// `sqrt(1 - beta2^t)`.
    bias_correction2_sqrt: T,
    eps: T,
    /// `-lr / (1 - beta1^t)`.
    neg_step_size: T,
}

impl<T: Float> Adam<T> {
    /// One element's update. The const flags select the variant at compile time, so the loop over
    /// elements has no branches and vectorizes (decoupled decay, L2 decay, which side of ATen's lerp).
    #[inline(always)]
    fn update<const DECAY: bool, const L2: bool, const LOW_WEIGHT: bool>(
        &self,
        p: &mut T,
        g: T,
        m: &mut T,
        v: &mut T,
        decay: T,
        wd: T,
    ) {
        let mut param = *p;
        let mut g = g;
        if DECAY {
            param *= decay; // param.mul_(1 - lr*wd)
        }
        if L2 {
            g += wd * param; // grad.add(param, alpha=wd)
        }
        // exp_avg.lerp_(grad, 1 - beta1), with ATen's two-sided lerp formula.
        let w = self.lerp_weight;
        let m_new = if LOW_WEIGHT { *m + w * (g - *m) } else { g - (g - *m) * (T::one() - w) };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
        let v_new = *v * self.beta2 + self.one_minus_beta2 * g * g;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = v_new.sqrt() / self.bias_correction2_sqrt + self.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        *p = param + self.neg_step_size * m_new / denom;
        *m = m_new;
        *v = v_new;
    }

    fn update_all<const DECAY: bool, const L2: bool, const LOW_WEIGHT: bool>(
        &self,
        p: &mut [T],
        g: &[T],
        m: &mut [T],
        v: &mut [T],
    ) {
        let decay = self.decay.unwrap_or(T::one());
        let wd = self.l2.unwrap_or(T::zero());
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            self.update::<DECAY, L2, LOW_WEIGHT>(p, g, m, v, decay, wd);
        }
    }

    fn update_chunk(&self, p: &mut [T], g: &[T], m: &mut [T], v: &mut [T]) {
        let low = self.lerp_weight < T::of(0.5);
        match (self.decay.is_some(), self.l2.is_some(), low) {
            (false, false, true) => self.update_all::<false, false, true>(p, g, m, v),
            (false, false, false) => self.update_all::<false, false, false>(p, g, m, v),
            (true, false, true) => self.update_all::<true, false, true>(p, g, m, v),
            (true, false, false) => self.update_all::<true, false, false>(p, g, m, v),
            (false, true, true) => self.update_all::<false, true, true>(p, g, m, v),
            (false, true, false) => self.update_all::<false, true, false>(p, g, m, v),
            (true, true, true) => self.update_all::<true, true, true>(p, g, m, v),
            (true, true, false) => self.update_all::<true, true, false>(p, g, m, v),
        }
    }
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
    check_update("adam_update", param, grad, &[exp_avg, exp_avg_sq])?;
    if !param.device().computes() {
        return Ok(());
    }
    let (beta1, beta2) = betas;
    // Python floats, as torch.optim computes them.
    let t = step as f64;
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.powf(0.5);
    with_float!(param.dtype(), "adam_update", T => {
        let k = Adam::<T> {
            decay: (weight_decay != 0.0 && decoupled).then(|| T::of(1.0 - lr * weight_decay)),
            l2: (weight_decay != 0.0 && !decoupled).then(|| T::of(weight_decay)),
            lerp_weight: T::of(1.0 - beta1),
            beta2: T::of(beta2),
            one_minus_beta2: T::of(1.0 - beta2),
            bias_correction2_sqrt: T::of(bias_correction2_sqrt),
            eps: T::of(eps),
            neg_step_size: T::of(-step_size),
        };
        let p = param.slice_mut::<T>()?;
        let g = grad.slice::<T>()?;
        let m = exp_avg.slice_mut::<T>()?;
        let v = exp_avg_sq.slice_mut::<T>()?;
        let run = |p: &mut [T], g: &[T], m: &mut [T], v: &mut [T]| k.update_chunk(p, g, m, v);
        if p.len() >= 2 * PAR_CHUNK {
            p.par_chunks_mut(PAR_CHUNK)
                .zip(g.par_chunks(PAR_CHUNK))
                .zip(m.par_chunks_mut(PAR_CHUNK))
                .zip(v.par_chunks_mut(PAR_CHUNK))
                .for_each(|(((p, g), m), v)| run(p, g, m, v));
        } else {
            run(p, g, m, v);
        }
    });
    Ok(())
}

/// Multiplies `grad` in place by `inv_scale` (cast to the gradient's dtype, as GradScaler's f32
/// `inv_scale` tensor); returns true when any value is inf or NaN before or after the
/// multiplication (GradScaler's unscale_ + found_inf). On `meta` nothing happens and it returns false.
pub fn unscale_(grad: &Tensor, inv_scale: f64) -> Result<bool> {
    if !grad.is_contiguous() {
        return Err(Error::invalid(format!("unscale_: the gradient {:?} must be contiguous", grad.shape())));
    }
    if !grad.device().computes() {
        return Ok(false);
    }
    let found_inf = with_float!(grad.dtype(), "unscale_", T => {
        let inv = T::of(inv_scale);
        let g = grad.slice_mut::<T>()?;
        let run = |c: &mut [T]| {
            let mut bad = false;
            for v in c.iter_mut() {
                let x = *v;
                let y = x * inv;
                bad |= !x.is_finite() || !y.is_finite();
                *v = y;
            }
            bad
        };
        if g.len() >= 2 * PAR_CHUNK {
            g.par_chunks_mut(PAR_CHUNK).map(run).reduce(|| false, |a, b| a || b)
        } else {
            run(g)
        }
    });
    Ok(found_inf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Category, Device};

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
        assert!(!unscale_(&g, 0.5).unwrap());
        assert_eq!(g.to_vec::<f32>().unwrap()[n - 1], grads[n - 1] * 0.5);
    }

    #[test]
    fn unscale_multiplies_and_reports_non_finite_values() {
        let d = Device::cpu();
        let g = Tensor::from_slice(&d, &[2.0f32, -4.0, 8.0], &[3], Category::Gradient).unwrap();
        assert!(!unscale_(&g, 0.25).unwrap());
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![0.5, -1.0, 2.0]);
        let g = Tensor::from_slice(&d, &[1.0f32, f32::INFINITY], &[2], Category::Gradient).unwrap();
        assert!(unscale_(&g, 0.5).unwrap());
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![0.5, f32::INFINITY]);
        let g = Tensor::from_slice(&d, &[f64::NAN], &[1], Category::Gradient).unwrap();
        assert!(unscale_(&g, 1.0).unwrap());
        // A big tensor with one inf in a late chunk.
        let mut v = vec![1.0f32; 2 * PAR_CHUNK + 5];
        v[2 * PAR_CHUNK + 3] = f32::NEG_INFINITY;
        let g = Tensor::from_slice(&d, &v, &[v.len()], Category::Gradient).unwrap();
        assert!(unscale_(&g, 0.5).unwrap());
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
        assert!(!unscale_(&g, 0.5).unwrap());
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
        assert!(unscale_(&view, 0.5).is_err(), "non-contiguous gradient");
    }
}
