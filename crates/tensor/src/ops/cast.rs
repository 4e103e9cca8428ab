//! Dtype casts between f32, f64, f16 and bf16 (round to nearest even, subnormals kept), differentiable.
//! Also i64 / u8 / bool -> f32 / f64 (not differentiable). Casts to integer dtypes are errors.
//!
//! Like PyTorch, a cast to f16 or bf16 goes through f32 (`c10::Half` and `c10::BFloat16` are built from
//! a float): f64 -> f16 rounds to f32 first, then to f16. Rounding uses the `half` crate, which rounds
//! to nearest even, keeps subnormals and overflows to infinity (checked bit for bit against PyTorch in
//! the tests). The kernel is the backend's (`memfit-cpu`'s `cast.rs`).

use super::output_any;
use crate::autograd::{needs_grad, record, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// A copy in `dtype` (this tensor itself when the dtype already matches).
    pub fn to_dtype(&self, dtype: crate::DType) -> Result<Tensor> {
        let _op = self.device().op_scope("to_dtype");
        let from = self.dtype();
        if from == dtype {
            return Ok(self.clone());
        }
        if !dtype.is_float() {
            return Err(Error::dtype(format!(
                "to_dtype: cannot cast {from} to {dtype}: casts to integer or bool dtypes are not supported"
            )));
        }
        if !from.is_float() && !matches!(dtype, DType::F32 | DType::F64) {
            return Err(Error::dtype(format!("to_dtype: {from} casts only to f32 or f64, not {dtype}")));
        }
        let x = self.contiguous()?;
        let out = output_any(&x, x.shape(), dtype, "cast")?;
        x.device().backend().cast(&x, &out)?;
        if from.is_float() && needs_grad(&[&x]) {
            Ok(record(out, "cast", &[&x], CastBack { from }))
        } else {
            Ok(out)
        }
    }
}

/// The gradient of a cast is the upstream gradient cast back to the input's dtype.
struct CastBack {
    from: DType,
}

impl Backward for CastBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad.to_dtype(self.from)?)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::backward_with;
    use crate::ops::softmax::test_support::*;
    use crate::{Category, Device};
    use half::{bf16, f16};
    use memfit_cpu::PAR_CHUNK;

    #[test]
    fn golden_rounding_is_bit_exact() {
        let g = Golden::open("mixed_precision.safetensors");
        let dev = Device::cpu();
        for (case, dtype) in [("round_f16", DType::F16), ("round_bf16", DType::BF16)] {
            let x = g.tensor(&dev, &format!("{case}/input"));
            assert_eq!(x.dtype(), DType::F32);
            let y = x.to_dtype(dtype).unwrap();
            let (_, shape, want) = g.raw(&format!("{case}/output"));
            assert_eq!(y.shape(), shape.as_slice());
            let got: Vec<u8> = match dtype {
                DType::F16 => y.to_vec::<f16>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                _ => y.to_vec::<bf16>().unwrap().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
            };
            for (i, (a, b)) in got.chunks(2).zip(want.chunks(2)).enumerate() {
                assert_eq!(a, b, "{case}[{i}]: input {:e}", x.to_vec::<f32>().unwrap()[i]);
            }
            // Widening back to f32 is exact and matches PyTorch's output_as_f32 (bit for bit).
            let back = y.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let want32: Vec<u32> = g
                .tensor(&dev, &format!("{case}/output_as_f32"))
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want32, "{case} widened");
        }
    }

    #[test]
    fn hand_checked_rounding() {
        let dev = Device::cpu();
        let x = t32(
            &dev,
            &[65519.0, 65520.0, -1e6, 2f32.powi(-24), 2f32.powi(-25), 3.0 * 2f32.powi(-25), 1.0 + 2f32.powi(-11), -0.0],
            &[8],
        );
        let h: Vec<u16> =
            x.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap().iter().map(|v| v.to_bits()).collect();
        // 65504 (max), +inf, -inf, smallest subnormal, tie to 0, tie to 2 ulps (even), tie to 1.0, -0.
        assert_eq!(h, vec![0x7BFF, 0x7C00, 0xFC00, 0x0001, 0x0000, 0x0002, 0x3C00, 0x8000]);
        let x = t32(&dev, &[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), f32::MAX, 1e-40], &[4]);
        let b: Vec<f32> =
            x.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap().iter().map(|v| v.to_f32()).collect();
        assert_eq!(b[..2], [1.0, 1.0 + 2f32.powi(-6)]);
        assert_eq!(b[2], f32::INFINITY);
        assert!(b[3] > 0.0 && b[3] < 1.2e-38, "bf16 keeps f32 subnormals: {}", b[3]);
        // f64 -> f16 rounds through f32 like PyTorch: 1 + 2^-11 + 2^-40 becomes the tie 1 + 2^-11 in
        // f32, which rounds to even (1.0); rounding the f64 directly would give 1 + 2^-10.
        let d = t64(&dev, &[1.0 + 2f64.powi(-11) + 2f64.powi(-40)], &[1]);
        assert_eq!(d.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap()[0].to_f32(), 1.0);
        // f64 <-> f32 and integer sources.
        assert_eq!(t64(&dev, &[0.1], &[1]).to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![0.1f32]);
        let i = Tensor::from_slice(&dev, &[-3i64, (1 << 24) + 1], &[2], Category::Input).unwrap();
        assert_eq!(i.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![-3.0, 16777216.0]);
        let bo = Tensor::from_slice(&dev, &[true, false], &[2], Category::Input).unwrap();
        assert_eq!(bo.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(), vec![1.0, 0.0]);
        let u = Tensor::from_slice(&dev, &[255u8], &[1], Category::Input).unwrap();
        assert_eq!(u.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![255.0]);
        // Same dtype: the same tensor. Float -> integer and integer -> half: errors.
        let f = t64(&dev, &[1.0], &[1]);
        assert!(f.to_dtype(DType::F64).unwrap().same(&f));
        assert!(f.to_dtype(DType::I64).is_err());
        assert!(f.to_dtype(DType::Bool).is_err());
        assert!(i.to_dtype(DType::F16).is_err());
        // Non-contiguous input.
        let m = t32(&dev, &[1.0, 2.0, 3.0, 4.0], &[2, 2]).transpose(0, 1).unwrap();
        assert_eq!(m.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    }

    #[test]
    fn gradient_is_cast_back() {
        let dev = Device::cpu();
        let x = t32(&dev, &[1.5, -2.0], &[2]).set_requires_grad(true);
        let y = x.to_dtype(DType::F16).unwrap().to_dtype(DType::F64).unwrap();
        assert!(y.requires_grad());
        backward_with(&y, t64(&dev, &[0.1, 3.0], &[2])).unwrap();
        let g = x.grad().unwrap();
        assert_eq!(g.dtype(), DType::F32);
        // 0.1 through f16: the gradient is rounded like any f16 value.
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![f16::from_f32(0.1).to_f32(), 3.0]);
        // Integer sources are not differentiable.
        let i = Tensor::from_slice(&dev, &[1i64], &[1], Category::Input).unwrap();
        assert!(!i.to_dtype(DType::F32).unwrap().requires_grad());
    }

    #[test]
    fn gradients_match_finite_differences() {
        // Values k/64 and a step of 2^-10 are exact in f32, so differences through the narrowing cast
        // are exact too; the gradient itself passes through f32 (relative error ~6e-8, within the
        // check's 1e-6). Through f16 the gradient is rounded to f16, see `gradient_is_cast_back`.
        let x: Vec<f64> = (0..12).map(|k| (k as f64 - 6.0) / 64.0).collect();
        gradcheck_with_step(&[(x, vec![3, 4])], 2f64.powi(-10), |t| {
            t[0].to_dtype(DType::F32)?.to_dtype(DType::F64)?.mul(&t[0])
        });
    }

    #[test]
    fn big_tensor_takes_the_parallel_path() {
        let dev = Device::cpu();
        let n = 2 * PAR_CHUNK + 3;
        let data: Vec<f32> = values(n, 4).iter().map(|&v| (v * 1e5) as f32).collect();
        let y = t32(&dev, &data, &[n]).to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap();
        assert!(y.iter().zip(&data).all(|(a, &b)| a.to_bits() == bf16::from_f32(b).to_bits()));
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let x = Tensor::full(dev, &[5, 7], 0.5, DType::F32, Category::Parameter)?.set_requires_grad(true);
            let y = x.to_dtype(DType::BF16)?.to_dtype(DType::F64)?;
            let g = Tensor::full(dev, &[5, 7], 1.0, DType::F64, Category::Temporary)?;
            backward_with(&y, g)
        });
    }
}
