//! Seeded parameter initialization with PyTorch's default schemes, and the allocation of parameters
//! (`parameter`, requiring grad) and buffers (`other`).
//!
//! Every tensor draws from its own random stream, `Rng::derive(seed, stream_of(state_dict name))`, so
//! a model's values depend only on the seed and the tensor names: never on the order in which layers
//! are built (see [`stream_of`]).
//!
//! Schemes (PyTorch's defaults):
//! - `nn.Linear` / `nn.Conv2d` weight: `kaiming_uniform_(a=sqrt(5))` = U(-1/sqrt(fan_in), 1/sqrt(fan_in));
//!   bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) ([`Initializer::kaiming_uniform`], [`Initializer::fan_in_bias`]).
//! - `nn.Embedding` weight: N(0, 1) ([`Initializer::normal`]).
//! - `nn.LayerNorm` / `nn.BatchNorm2d`: weight 1, bias 0; running_mean 0, running_var 1.
//! - `nn.MultiheadAttention`: in_proj_weight `xavier_uniform_`, in_proj_bias and out_proj.bias 0.
//!
//! Values are written straight into the allocated tensor (`Tensor::overwrite_with`); on `meta` only the
//! identical allocation happens, so both devices see the same allocator events.

use memfit_data::Rng;
use memfit_tensor::{Category, DType, Device, Error, Result, Tensor};

/// The random stream of the tensor named `name` (FNV-1a 64 of its `state_dict` name).
pub fn stream_of(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `fan_in` of a weight as PyTorch's `_calculate_fan_in_and_fan_out`: `shape[1] * prod(shape[2..])`.
pub fn fan_in(shape: &[usize]) -> Result<usize> {
    if shape.len() < 2 {
        return Err(Error::shape(format!("fan_in needs a weight of rank >= 2, got shape {shape:?}")));
    }
    Ok(shape[1] * shape[2..].iter().product::<usize>())
}

/// `fan_out` of a weight: `shape[0] * prod(shape[2..])`.
pub fn fan_out(shape: &[usize]) -> Result<usize> {
    if shape.len() < 2 {
        return Err(Error::shape(format!("fan_out needs a weight of rank >= 2, got shape {shape:?}")));
    }
    Ok(shape[0] * shape[2..].iter().product::<usize>())
}

/// Joins a module prefix and a local name the way PyTorch builds `state_dict` keys.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Allocates and initializes a model's tensors on one device from one seed. Parameters are f32.
#[derive(Clone, Debug)]
pub struct Initializer {
    device: Device,
    seed: u64,
}

impl Initializer {
    pub fn new(device: &Device, seed: u64) -> Self {
        Initializer { device: device.clone(), seed }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The generator of the tensor named `name`.
    pub fn rng(&self, name: &str) -> Rng {
        Rng::derive(self.seed, stream_of(name))
    }

    /// An f32 tensor of `shape` whose elements are drawn in row-major order by `draw` (not called on meta).
    fn generated(
        &self,
        name: &str,
        shape: &[usize],
        category: Category,
        mut draw: impl FnMut(&mut Rng) -> f32,
    ) -> Result<Tensor> {
        let t = Tensor::empty(&self.device, shape, DType::F32, category, "init")?;
        let mut rng = self.rng(name);
        t.overwrite_with::<f32>(|values| values.iter_mut().for_each(|v| *v = draw(&mut rng)))?;
        Ok(t)
    }

    /// A trainable parameter: U(low, high).
    pub fn uniform(&self, name: &str, shape: &[usize], low: f32, high: f32) -> Result<Tensor> {
        if low.is_nan() || high.is_nan() || low > high {
            return Err(Error::invalid(format!("init of {name}: uniform bounds {low} > {high}")));
        }
        Ok(self.generated(name, shape, Category::Parameter, |r| r.uniform_f32(low, high))?.set_requires_grad(true))
    }

    /// A trainable parameter: N(mean, std^2).
    pub fn normal(&self, name: &str, shape: &[usize], mean: f32, std: f32) -> Result<Tensor> {
        Ok(self.generated(name, shape, Category::Parameter, |r| mean + std * r.normal_f32())?.set_requires_grad(true))
    }

    /// A trainable parameter filled with `value`.
    pub fn constant(&self, shape: &[usize], value: f64) -> Result<Tensor> {
        Ok(Tensor::full(&self.device, shape, value, DType::F32, Category::Parameter)?.set_requires_grad(true))
    }

    /// `kaiming_uniform_(w, a=sqrt(5))`, PyTorch's default for Linear and Conv2d weights:
    /// U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    pub fn kaiming_uniform(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let fan = fan_in(shape)?;
        if fan == 0 {
            return Err(Error::invalid(format!("init of {name}: weight {shape:?} has fan_in 0")));
        }
        let bound = (1.0 / (fan as f64).sqrt()) as f32;
        self.uniform(name, shape, -bound, bound)
    }

    /// The default bias of Linear and Conv2d: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (zero width when fan_in is 0).
    pub fn fan_in_bias(&self, name: &str, shape: &[usize], fan_in: usize) -> Result<Tensor> {
        let bound = if fan_in > 0 { (1.0 / (fan_in as f64).sqrt()) as f32 } else { 0.0 };
        self.uniform(name, shape, -bound, bound)
    }

    /// `xavier_uniform_(w)`: U(-b, b), b = sqrt(6 / (fan_in + fan_out)).
    pub fn xavier_uniform(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let fans = fan_in(shape)? + fan_out(shape)?;
        if fans == 0 {
            return Err(Error::invalid(format!("init of {name}: weight {shape:?} has no fans")));
        }
        let bound = (6.0 / fans as f64).sqrt() as f32;
        self.uniform(name, shape, -bound, bound)
    }

    /// A non-trainable f32 buffer (`other`) filled with `value`.
    pub fn buffer_full(&self, shape: &[usize], value: f64) -> Result<Tensor> {
        Tensor::full(&self.device, shape, value, DType::F32, Category::Other)
    }

    /// A non-trainable zero buffer of any dtype (`other`), e.g. BatchNorm's int64 `num_batches_tracked`.
    pub fn buffer_zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::zeros(&self.device, shape, dtype, Category::Other)
    }

    /// The bool buffer `torch.triu(torch.ones(t, t, dtype=bool), 1)`: True above the diagonal
    /// (key j > query i: attention not allowed).
    pub fn causal_mask(&self, t: usize) -> Result<Tensor> {
        let mask = Tensor::empty(&self.device, &[t, t], DType::Bool, Category::Other, "init")?;
        mask.overwrite_with::<bool>(|values| values.iter_mut().enumerate().for_each(|(k, v)| *v = k % t > k / t))?;
        Ok(mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fans_follow_pytorch() {
        assert_eq!(fan_in(&[10, 784]).unwrap(), 784);
        assert_eq!(fan_in(&[16, 3, 3, 5]).unwrap(), 45);
        assert_eq!(fan_out(&[16, 3, 3, 5]).unwrap(), 240);
        assert!(fan_in(&[7]).is_err());
    }

    #[test]
    fn streams_depend_on_names_only() {
        assert_eq!(stream_of("fc.weight"), stream_of("fc.weight"));
        assert_ne!(stream_of("fc.weight"), stream_of("fc.bias"));
        // FNV-1a 64 reference value of "a".
        assert_eq!(stream_of("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn kaiming_uniform_bounds_and_reproducibility() {
        let dev = Device::cpu();
        let init = Initializer::new(&dev, 5);
        let w = init.kaiming_uniform("w", &[64, 100]).unwrap();
        assert!(w.requires_grad() && w.is_leaf());
        assert_eq!(w.storage().category(), Category::Parameter);
        let v = w.to_vec::<f32>().unwrap();
        assert!(v.iter().all(|x| x.abs() <= 0.1 + 1e-7));
        // Spread: a uniform on [-0.1, 0.1] has std 0.1/sqrt(3).
        let var = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((var.sqrt() - 0.1 / 3f64.sqrt()).abs() < 0.005, "std {}", var.sqrt());
        let again = Initializer::new(&dev, 5).kaiming_uniform("w", &[64, 100]).unwrap();
        assert_eq!(v, again.to_vec::<f32>().unwrap());
        let other = Initializer::new(&dev, 6).kaiming_uniform("w", &[64, 100]).unwrap();
        assert_ne!(v, other.to_vec::<f32>().unwrap());
    }

    #[test]
    fn xavier_bound() {
        let dev = Device::cpu();
        let w = Initializer::new(&dev, 1).xavier_uniform("w", &[48, 16]).unwrap();
        let b = (6.0f64 / 64.0).sqrt() as f32;
        let v = w.to_vec::<f32>().unwrap();
        assert!(v.iter().all(|x| x.abs() <= b));
        assert!(v.iter().any(|x| x.abs() > 0.9 * b));
    }

    #[test]
    fn causal_mask_is_strict_upper_triangle() {
        let m = Initializer::new(&Device::cpu(), 0).causal_mask(3).unwrap();
        assert_eq!(m.dtype(), DType::Bool);
        assert_eq!(m.to_vec::<bool>().unwrap(), vec![false, true, true, false, false, true, false, false, false]);
    }

    #[test]
    fn meta_allocates_the_same_bytes() {
        let (cpu, meta) = (Device::cpu(), Device::meta());
        for dev in [&cpu, &meta] {
            let init = Initializer::new(dev, 3);
            init.kaiming_uniform("w", &[30, 20]).unwrap();
            init.causal_mask(7).unwrap();
        }
        let (c, m) = (cpu.stats(), meta.stats());
        assert_eq!(c.requested_bytes.allocated, m.requested_bytes.allocated);
        assert_eq!(c.allocation.allocated, m.allocation.allocated);
        assert_eq!(c.requested_bytes.allocated, (30 * 20 * 4 + 49) as u64);
    }
}
