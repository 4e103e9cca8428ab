//! Dynamic loss scaling with the semantics of PyTorch's `torch.amp.GradScaler`.
//!
//! One iteration: `scaler.scale_loss(&loss)` (the loss times the scale) -> backward ->
//! optionally `scaler.unscale(params)` (to clip or inspect true gradients) -> `scaler.step(&mut opt)`
//! (unscales if not done yet; skips the optimizer step when any gradient is inf/NaN) ->
//! `scaler.update()` (halves the scale after a bad step, doubles it after `growth_interval`
//! consecutive good ones).
//!
//! The scale is kept as an f32 value, like PyTorch's float32 `_scale` tensor, and every update of it
//! rounds as ATen's `_amp_update_scale_` does, so the sequence of scales matches PyTorch's exactly.

use crate::optim::Optimizer;
use memfit_tensor::ops::unscale_;
use memfit_tensor::{Error, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    /// PyTorch's defaults: 2^16, x2, x0.5, every 2000 good steps.
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

impl GradScalerConfig {
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if !(c.init_scale > 0.0 && (c.init_scale as f32).is_finite()) {
            return Err(Error::invalid(format!(
                "GradScaler: init_scale {} must be positive and finite in f32",
                c.init_scale
            )));
        }
        let growth_ok = c.growth_factor > 1.0;
        let backoff_ok = c.backoff_factor > 0.0 && c.backoff_factor < 1.0;
        if !growth_ok || !backoff_ok {
            return Err(Error::invalid(format!(
                "GradScaler: growth_factor {} must be > 1 and backoff_factor {} in (0, 1)",
                c.growth_factor, c.backoff_factor
            )));
        }
        if c.growth_interval == 0 {
            return Err(Error::invalid("GradScaler: growth_interval must be at least 1"));
        }
        Ok(())
    }
}

pub struct GradScaler {
    config: GradScalerConfig,
    /// The current scale (an f32 value, as PyTorch's `_scale` tensor).
    scale: f32,
    /// Consecutive good steps since the last change of scale.
    growth_tracker: u32,
    /// Whether this iteration's gradients held inf/NaN, once they have been unscaled; None before.
    found_inf: Option<bool>,
}

impl GradScaler {
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(GradScaler { config, scale: config.init_scale as f32, growth_tracker: 0, found_inf: None })
    }

    /// The current loss scale.
    pub fn scale(&self) -> f64 {
        f64::from(self.scale)
    }

    /// Consecutive good steps counted towards the next growth.
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    pub fn config(&self) -> GradScalerConfig {
        self.config
    }

    /// This iteration's inf/NaN check, once gradients were unscaled (None before).
    pub fn found_inf(&self) -> Option<bool> {
        self.found_inf
    }

    /// Restores a saved scale and growth tracker (checkpoint loading).
    pub fn restore(&mut self, scale: f64, growth_tracker: u32) -> Result<()> {
        if !(scale > 0.0 && (scale as f32).is_finite()) {
            return Err(Error::invalid(format!("GradScaler: cannot restore scale {scale}")));
        }
        self.scale = scale as f32;
        self.growth_tracker = growth_tracker;
        self.found_inf = None;
        Ok(())
    }

    /// `loss * scale`, to backpropagate instead of `loss`.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        loss.mul_scalar(self.scale())
    }

    /// Divides every gradient of `params` by the scale in place (PyTorch's `unscale_`) and returns
    /// whether any of them holds inf or NaN. All gradients are unscaled even after a bad one is found.
    /// Errors if this iteration's gradients were already unscaled (call `update` in between).
    pub fn unscale(&mut self, params: &[(String, Tensor)]) -> Result<bool> {
        if self.found_inf.is_some() {
            return Err(Error::invalid("GradScaler: unscale() was already called since the last update()"));
        }
        // PyTorch: inv_scale = scale.double().reciprocal().float().
        let inv_scale = f64::from((1.0 / f64::from(self.scale)) as f32);
        let grads: Vec<Tensor> = params.iter().filter_map(|(_, p)| p.grad()).collect();
        let found_inf = unscale_(&grads.iter().collect::<Vec<_>>(), inv_scale).map_err(|e| match e {
            Error::OutOfMemory(_) => e,
            other => Error::invalid(format!("GradScaler: unscaling the gradients: {other}")),
        })?;
        self.found_inf = Some(found_inf);
        Ok(found_inf)
    }

    /// Replaces this iteration's check by `found_inf`, the one every rank agreed on (a rank whose
    /// own gradients were finite still skips when another's overflowed). Errors before `unscale`.
    pub fn agree(&mut self, found_inf: bool) -> Result<()> {
        match self.found_inf {
            Some(_) => {
                self.found_inf = Some(found_inf);
                Ok(())
            }
            None => Err(Error::invalid("GradScaler: agree() before unscale()")),
        }
    }

    /// Unscales the optimizer's gradients unless `unscale` already did, then takes the optimizer step
    /// unless a gradient held inf/NaN. Returns whether the step was taken.
    pub fn step(&mut self, optimizer: &mut Optimizer) -> Result<bool> {
        let found_inf = match self.found_inf {
            Some(found) => found,
            None => self.unscale(optimizer.params())?,
        };
        if found_inf {
            return Ok(false);
        }
        optimizer.step()?;
        Ok(true)
    }

    /// Adjusts the scale for the next iteration from this iteration's check: after a bad step the
    /// scale is multiplied by `backoff_factor` and the tracker resets; after `growth_interval`
    /// consecutive good steps it is multiplied by `growth_factor` (unless that overflows f32).
    /// Errors if no gradients were checked since the last update.
    pub fn update(&mut self) -> Result<()> {
        let found_inf = self.found_inf.take().ok_or_else(|| {
            Error::invalid("GradScaler: update() without unscale() or step() since the last update()")
        })?;
        // As ATen's _amp_update_scale_: products in double, stored back to the float scale.
        if found_inf {
            self.scale = (f64::from(self.scale) * self.config.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            let successful = self.growth_tracker + 1;
            if successful == self.config.growth_interval {
                let grown = (f64::from(self.scale) * self.config.growth_factor) as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::OptimizerConfig;
    use memfit_tensor::{autograd, Category, Device};

    fn config(init_scale: f64, growth_interval: u32) -> GradScalerConfig {
        GradScalerConfig { init_scale, growth_factor: 2.0, backoff_factor: 0.5, growth_interval }
    }

    /// One iteration with loss = sum(p * g_true); returns whether the step was taken.
    fn iteration(scaler: &mut GradScaler, opt: &mut Optimizer, p: &Tensor, g_true: &[f32]) -> bool {
        let d = p.device();
        let g = Tensor::from_slice(d, g_true, &[g_true.len()], Category::Input).unwrap();
        let loss = p.mul(&g).unwrap().sum_all().unwrap();
        autograd::backward(&scaler.scale_loss(&loss).unwrap()).unwrap();
        let stepped = scaler.step(opt).unwrap();
        scaler.update().unwrap();
        opt.zero_grad();
        stepped
    }

    #[test]
    fn skips_bad_steps_backs_off_and_grows() {
        let d = Device::cpu();
        let p = Tensor::from_slice(&d, &[1.0f32, 2.0], &[2], Category::Parameter).unwrap().set_requires_grad(true);
        let mut opt = Optimizer::new(vec![("p".into(), p.clone())], OptimizerConfig::sgd(0.5));
        let mut scaler = GradScaler::new(config(8.0, 2)).unwrap();

        assert!(iteration(&mut scaler, &mut opt, &p, &[1.0, 2.0]));
        // The unscaled gradient was used: p -= 0.5 * g_true exactly (powers of two).
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.5, 1.0]);
        assert_eq!((scaler.scale(), scaler.growth_tracker()), (8.0, 1));

        assert!(iteration(&mut scaler, &mut opt, &p, &[1.0, 1.0]));
        assert_eq!((scaler.scale(), scaler.growth_tracker()), (16.0, 0), "grows after 2 good steps");

        // inf in the true gradient: skipped, parameters unchanged, scale halves, tracker resets.
        assert!(!iteration(&mut scaler, &mut opt, &p, &[f32::INFINITY, 0.0]));
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.0, 0.5]);
        assert_eq!((scaler.scale(), scaler.growth_tracker()), (8.0, 0));

        // A finite gradient that overflows f32 once scaled is also a bad step.
        assert!(!iteration(&mut scaler, &mut opt, &p, &[f32::MAX / 2.0, 0.0]));
        assert_eq!((scaler.scale(), scaler.growth_tracker()), (4.0, 0));
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.0, 0.5]);
    }

    #[test]
    fn explicit_unscale_then_step_unscales_once() {
        let d = Device::cpu();
        let p = Tensor::from_slice(&d, &[0.0f32], &[1], Category::Parameter).unwrap().set_requires_grad(true);
        let mut opt = Optimizer::new(vec![("p".into(), p.clone())], OptimizerConfig::sgd(1.0));
        let mut scaler = GradScaler::new(config(1024.0, 1000)).unwrap();
        let loss = p.mul_scalar(3.0).unwrap().sum_all().unwrap();
        autograd::backward(&scaler.scale_loss(&loss).unwrap()).unwrap();
        assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![3072.0]);
        assert!(!scaler.unscale(opt.params()).unwrap());
        assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0]);
        assert!(scaler.unscale(opt.params()).is_err(), "twice in one iteration");
        assert!(scaler.step(&mut opt).unwrap());
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![-3.0], "the gradient was unscaled once, not twice");
        scaler.update().unwrap();
        assert!(scaler.update().is_err(), "no check recorded since the last update");
    }

    /// Ranks agree on a skip: a rank whose own gradients were finite backs off as the one that
    /// overflowed, and agreeing before any check is refused.
    #[test]
    fn an_agreed_overflow_backs_off_a_finite_rank() {
        let d = Device::cpu();
        let p = Tensor::from_slice(&d, &[1.0f32], &[1], Category::Parameter).unwrap().set_requires_grad(true);
        autograd::backward(&p.mul_scalar(2.0).unwrap().sum_all().unwrap()).unwrap();
        let mut scaler = GradScaler::new(config(1024.0, 2)).unwrap();
        assert!(scaler.agree(true).is_err(), "agree before unscale");
        assert!(!scaler.unscale(&[("p".into(), p.clone())]).unwrap(), "finite here");
        scaler.agree(true).unwrap();
        assert_eq!(scaler.found_inf(), Some(true));
        scaler.update().unwrap();
        assert_eq!((scaler.scale(), scaler.growth_tracker()), (512.0, 0));
    }

    #[test]
    fn growth_stops_at_the_f32_limit() {
        let mut scaler = GradScaler::new(config(2f64.powi(127), 1)).unwrap();
        scaler.found_inf = Some(false);
        scaler.update().unwrap();
        assert_eq!(scaler.scale(), 2f64.powi(127), "2^128 would be inf in f32");
        assert_eq!(scaler.growth_tracker(), 0);
        assert!(GradScaler::new(config(0.0, 1)).is_err());
        assert!(GradScaler::new(GradScalerConfig { growth_interval: 0, ..Default::default() }).is_err());
    }
}
