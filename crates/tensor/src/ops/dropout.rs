//! Dropout with an explicit seed: zeroes elements with probability p and scales the rest by 1/(1-p).
//!
//! Element `i` is kept when a SplitMix64 draw keyed by (seed, i) is >= p, so the mask depends only on
//! the seed and the element's position (never on threading). Backward uses the mask saved as one bit
//! per element (a u8 tensor of ceil(numel / 8) bytes, bit `i % 8` of byte `i / 8`). The kernels are
//! the backend's (`memfit-cpu`'s `dropout.rs`).

use super::output;
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `F.dropout(x, p, training)`; the mask is drawn from `seed` (same seed, same mask). Identity when
/// not training or p == 0.
pub fn dropout(x: &Tensor, p: f64, training: bool, seed: u64) -> Result<Tensor> {
    let _op = x.device().op_scope("dropout");
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::invalid(format!("dropout: probability has to be between 0 and 1, got {p}")));
    }
    if !training || p == 0.0 {
        return Ok(x.clone());
    }
    let x = x.contiguous()?;
    let numel = x.numel();
    let grad = needs_grad(&[&x]);
    let out = output(&x, x.shape(), x.dtype(), "dropout")?;
    let mask = if grad { Some(super::output_any(&x, &[numel.div_ceil(8)], DType::U8, "dropout")?) } else { None };
    x.device().backend().dropout(&x, p, seed, &out, mask.as_ref())?;
    match mask {
        Some(mask) => Ok(record(out, "dropout", &[&x], DropoutBack { mask: save(&mask), p })),
        None => Ok(out),
    }
}

struct DropoutBack {
    mask: Tensor,
    p: f64,
}

impl Backward for DropoutBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let gx = output(&grad, grad.shape(), grad.dtype(), "dropout_backward")?;
        grad.device().backend().dropout_backward(&grad, &self.mask, self.p, &gx)?;
        Ok(vec![Some(gx)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::backward_with;
    use crate::ops::softmax::test_support::*;
    use crate::{Category, Device};
    use memfit_cpu::dropout::{mix, uniform};
    use memfit_cpu::PAR_CHUNK;

    #[test]
    fn identity_when_not_training_or_p_zero() {
        let dev = Device::cpu();
        let x = t64(&dev, &[1.0, 2.0], &[2]);
        assert!(dropout(&x, 0.5, false, 1).unwrap().same(&x));
        assert!(dropout(&x, 0.0, true, 1).unwrap().same(&x));
        assert!(dropout(&x, 1.5, false, 1).is_err());
        assert!(dropout(&x, -0.1, true, 1).is_err());
        assert!(dropout(&x, f64::NAN, true, 1).is_err());
        // p == 1 zeroes everything.
        assert_eq!(dropout(&x, 1.0, true, 1).unwrap().to_f64_vec().unwrap(), vec![0.0, 0.0]);
    }

    #[test]
    fn mask_statistics_scaling_and_determinism() {
        let dev = Device::cpu();
        let n = 3 * PAR_CHUNK + 5; // several tasks and a ragged tail
        let x = Tensor::full(&dev, &[n], 2.0, DType::F32, Category::Input).unwrap().set_requires_grad(true);
        let p = 0.3;
        let y = dropout(&x, p, true, 42).unwrap();
        let v = y.to_f64_vec().unwrap();
        let scaled = (2.0f32 / 0.7f32) as f64;
        assert!(v.iter().all(|&a| a == 0.0 || a == scaled));
        let kept = v.iter().filter(|&&a| a != 0.0).count() as f64 / n as f64;
        // Binomial std at n ~ 1e5 is ~0.0015.
        assert!((kept - 0.7).abs() < 0.01, "kept fraction {kept}");
        // Same seed, same mask (with or without grad); another seed, another mask.
        let again = {
            let _g = dev.no_grad();
            dropout(&x, p, true, 42).unwrap().to_f64_vec().unwrap()
        };
        assert_eq!(v, again);
        assert_ne!(v, dropout(&x, p, true, 43).unwrap().to_f64_vec().unwrap());
        // Element i's fate is the pure function uniform(mix(seed), i) >= p.
        let key = mix(42);
        for i in [0, 1, 7, 8, PAR_CHUNK, n - 1] {
            assert_eq!(v[i] != 0.0, uniform(key, i as u64) >= p, "element {i}");
        }
        // Backward: the same mask, the same scale.
        let g = Tensor::full(&dev, &[n], 1.0, DType::F32, Category::Temporary).unwrap();
        backward_with(&y, g).unwrap();
        let gx = x.grad().unwrap().to_f64_vec().unwrap();
        let s = (1.0f32 / 0.7f32) as f64;
        assert!(gx.iter().zip(&v).all(|(&g, &y)| if y == 0.0 { g == 0.0 } else { g == s }));
    }

    #[test]
    fn gradients_match_finite_differences() {
        gradcheck(&[(values(37, 1), vec![37])], |t| dropout(&t[0], 0.4, true, 7));
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let x = Tensor::full(dev, &[3, 1000], 1.0, DType::F32, Category::Input)?.set_requires_grad(true);
            let y = dropout(&x, 0.1, true, 5)?;
            crate::autograd::backward(&y.sum_all()?)
        });
    }
}
