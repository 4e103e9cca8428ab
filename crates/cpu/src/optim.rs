//! CPU kernels of the fused optimizer updates and gradient unscaling (`ops/optim.rs`): one pass over
//! memory per update, following PyTorch's single-tensor CPU path rounding step by rounding step
//! (Note [Optimizer arithmetic] in `ops/optim.rs`). Large tensors are split into disjoint chunks
//! updated in parallel (elementwise, so the result does not depend on the thread count).

use crate::dtype::Float;
use crate::error::Result;
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

/// One SGD step's hyper-parameters as the caller gives them (Python floats: f64); the kernel casts
/// them to the parameter's dtype (Note [Optimizer arithmetic]).
#[derive(Clone, Copy, Debug)]
pub struct SgdStep {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// The momentum buffer is fresh: it is overwritten with the gradient, not blended.
    pub first_step: bool,
}

/// One Adam / AdamW step's hyper-parameters as the caller gives them (Python floats: f64); the
/// kernel derives the bias corrections in f64 and casts to the parameter's dtype
/// (Note [Optimizer arithmetic]).
#[derive(Clone, Copy, Debug)]
pub struct AdamStep {
    /// Numbered from 1.
    pub step: u64,
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: decay the parameter, not the gradient.
    pub decoupled: bool,
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

/// One SGD step over `param` (and `momentum_buffer` when given), all contiguous, same dtype.
pub fn sgd_update(param: View<'_>, grad: View<'_>, buf: Option<View<'_>>, step: SgdStep) -> Result<()> {
    let SgdStep { lr, momentum, dampening, nesterov, weight_decay, first_step } = step;
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

/// One Adam / AdamW step over `param`, `exp_avg` and `exp_avg_sq`, all contiguous, same dtype.
pub fn adam_update(
    param: View<'_>,
    grad: View<'_>,
    exp_avg: View<'_>,
    exp_avg_sq: View<'_>,
    step: AdamStep,
) -> Result<()> {
    let AdamStep { step, lr, betas, eps, weight_decay, decoupled } = step;
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

/// `grad *= inv_scale` in place (contiguous); `found_inf` becomes true when any value is inf or NaN
/// before or after the multiplication (it is left alone otherwise).
pub fn unscale(grad: View<'_>, inv_scale: f64, found_inf: &mut bool) -> Result<()> {
    let bad = with_float!(grad.dtype(), "unscale_", T => {
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
    *found_inf |= bad;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_avg.lerp_(grad, w)` as ATen computes it: `m + w (g - m)` for a weight below one half,
    /// `g - (g - m)(1 - w)` from one half up. The two round differently, so the first moment's bits
    /// say which was taken.
    #[test]
    fn the_first_moment_follows_atens_two_sided_lerp() {
        let cases: Vec<(f32, f32)> =
            (0..2000).map(|i| ((i as f32 * 0.37).sin() * 3.0, (i as f32 * 0.91).cos() * 2.0)).collect();
        for beta1 in [0.9f32, 0.3] {
            let w = 1.0 - beta1;
            let k = Adam::<f32> {
                decay: None,
                l2: None,
                lerp_weight: w,
                beta2: 0.999,
                one_minus_beta2: 0.001,
                bias_correction2_sqrt: 1.0,
                eps: 1e-8,
                neg_step_size: -1e-3,
            };
            let (g, mut m): (Vec<f32>, Vec<f32>) = cases.iter().copied().unzip();
            let (mut p, mut v) = (vec![1.0f32; g.len()], vec![0.5f32; g.len()]);
            let m0 = m.clone();
            k.update_chunk(&mut p, &g, &mut m, &mut v);
            let low = |g: f32, m: f32| m + w * (g - m);
            let high = |g: f32, m: f32| g - (g - m) * (1.0 - w);
            let (aten, other): (&dyn Fn(f32, f32) -> f32, &dyn Fn(f32, f32) -> f32) =
                if w < 0.5 { (&low, &high) } else { (&high, &low) };
            for ((&g, &m0), &m) in g.iter().zip(&m0).zip(&m) {
                assert_eq!(m.to_bits(), aten(g, m0).to_bits(), "beta1 {beta1}: g {g}, exp_avg {m0}");
            }
            assert!(
                g.iter().zip(&m0).any(|(&g, &m0)| aten(g, m0).to_bits() != other(g, m0).to_bits()),
                "beta1 {beta1}: the cases tell the two formulas apart"
            );
        }
    }
}
