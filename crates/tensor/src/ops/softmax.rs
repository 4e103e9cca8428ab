//! softmax and log_softmax over one dim (numerically stable: max subtracted): shapes, outputs and
//! autograd; the kernels are the backend's (`memfit-cpu`'s `softmax.rs`). Both save only their output
//! for backward. Also holds the `test_support` helpers (gradient check, golden files, meta vs cpu)
//! shared by the unit tests of softmax, loss, norm, embedding, attention, dropout and cast.

use super::output;
use crate::autograd::{needs_grad, record, save, Backward};
use crate::error::Result;
use crate::layout::resolve_dim;
use crate::tensor::Tensor;

fn softmax_impl(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    let name = if log { "log_softmax" } else { "softmax" };
    let x = x.contiguous()?;
    let d = resolve_dim(dim, x.rank())?;
    let out = output(&x, x.shape(), x.dtype(), name)?;
    x.device().backend().softmax(&x, d, log, &out)?;
    if !needs_grad(&[&x]) {
        return Ok(out);
    }
    let back = SoftmaxBack { out: save(&out), dim: d, log };
    Ok(record(out, name, &[&x], back))
}

/// `F.softmax(x, dim)`.
pub fn softmax(x: &Tensor, dim: isize) -> Result<Tensor> {
    let _op = x.device().op_scope("softmax");
    softmax_impl(x, dim, false)
}

/// `F.log_softmax(x, dim)`.
pub fn log_softmax(x: &Tensor, dim: isize) -> Result<Tensor> {
    let _op = x.device().op_scope("log_softmax");
    softmax_impl(x, dim, true)
}

struct SoftmaxBack {
    out: Tensor,
    dim: usize,
    log: bool,
}

impl Backward for SoftmaxBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let name = if self.log { "log_softmax_backward" } else { "softmax_backward" };
        let grad = grad.contiguous()?;
        let gx = output(&grad, self.out.shape(), grad.dtype(), name)?;
        grad.device().backend().softmax_backward(&self.out, &grad, self.dim, self.log, &gx)?;
        Ok(vec![Some(gx)])
    }
}

/// Helpers for the unit tests of this crate's op files (softmax, loss, norm, embedding, attention,
/// dropout, cast): finite-difference gradient checks, golden-file access and the meta-vs-cpu check.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::autograd::backward_with;
    use crate::{Category, DType, Device, Result, Tensor};
    use memfit_memory::Event;

    /// The repository's copy of the PyTorch golden data (owned by the nn crate's golden runner).
    pub const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../nn/tests/golden");

    /// A float64 leaf on `dev`.
    pub fn t64(dev: &Device, data: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_slice(dev, data, shape, Category::Input).unwrap()
    }

    /// A float32 leaf on `dev`.
    pub fn t32(dev: &Device, data: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(dev, data, shape, Category::Input).unwrap()
    }

    /// The allocations (bytes, op) of `dev`'s allocator after its first `before` timeline events.
    pub fn allocations_since(dev: &Device, before: usize) -> Vec<(u64, &'static str)> {
        let a = dev.allocator();
        let events = a.timeline().events();
        events.skip(before).filter(|e| e.kind == memfit_memory::EventKind::Alloc).map(|e| (e.bytes, e.op)).collect()
    }

    /// Deterministic pseudo-random values in [-1, 1) (a Weyl sequence), distinct per `salt`.
    pub fn values(n: usize, salt: u64) -> Vec<f64> {
        (0..n)
            .map(|i| {
                let x = (i as f64 + 1.0) * 0.754_877_666_246_692_7 + salt as f64 * 0.569_840_290_998_053_3;
                2.0 * (x - x.floor()) - 1.0
            })
            .collect()
    }

    /// Asserts `|got - want| <= tol * (1 + |want|)` elementwise.
    pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths differ");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
        }
    }

    /// Compares `f`'s analytic gradients (for the seed `sum(out * r)` with a fixed random `r`) with
    /// central differences, in float64, for every input in `inputs` (data, shape).
    pub fn gradcheck(inputs: &[(Vec<f64>, Vec<usize>)], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
        gradcheck_with_step(inputs, 1e-6, f)
    }

    /// [`gradcheck`] with a chosen finite-difference step `h`.
    pub fn gradcheck_with_step(inputs: &[(Vec<f64>, Vec<usize>)], h: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
        let dev = Device::cpu();
        let leaves: Vec<Tensor> = inputs.iter().map(|(d, s)| t64(&dev, d, s).set_requires_grad(true)).collect();
        let out = f(&leaves).unwrap();
        let r = values(out.numel(), 99);
        backward_with(&out, t64(&dev, &r, out.shape())).unwrap();
        let objective = |data: &[Vec<f64>]| -> f64 {
            let _g = dev.no_grad();
            let ts: Vec<Tensor> = data.iter().zip(inputs).map(|(d, (_, s))| t64(&dev, d, s)).collect();
            let o = f(&ts).unwrap().to_f64_vec().unwrap();
            o.iter().zip(&r).map(|(a, b)| a * b).sum()
        };
        for (k, leaf) in leaves.iter().enumerate() {
            let analytic = leaf.grad().expect("input got no gradient").to_f64_vec().unwrap();
            let mut data: Vec<Vec<f64>> = inputs.iter().map(|(d, _)| d.clone()).collect();
            for e in 0..data[k].len() {
                let orig = data[k][e];
                data[k][e] = orig + h;
                let plus = objective(&data);
                data[k][e] = orig - h;
                let minus = objective(&data);
                data[k][e] = orig;
                let numeric = (plus - minus) / (2.0 * h);
                let a = analytic[e];
                assert!(
                    (a - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                    "input {k} element {e}: analytic {a}, numeric {numeric}"
                );
            }
        }
    }

    /// Runs `program` on a fresh cpu device and a fresh meta device and asserts that both saw the
    /// same allocator events (sizes, categories, ops, phases, order) and statistics.
    pub fn assert_meta_matches_cpu(program: impl Fn(&Device) -> Result<()>) {
        let run = |dev: Device| -> (Vec<Event>, crate::MemoryStats) {
            program(&dev).unwrap();
            let a = dev.allocator();
            (a.timeline().events().copied().collect(), a.stats().clone())
        };
        let (cpu_events, cpu_stats) = run(Device::cpu());
        let (meta_events, meta_stats) = run(Device::meta());
        assert!(!cpu_events.is_empty(), "the program allocated nothing");
        assert_eq!(cpu_events, meta_events, "allocator events differ between cpu and meta");
        assert_eq!(cpu_stats, meta_stats, "allocator statistics differ between cpu and meta");
    }

    /// One golden .safetensors file, read whole.
    pub struct Golden {
        bytes: Vec<u8>,
    }

    impl Golden {
        pub fn open(file: &str) -> Golden {
            let path = format!("{GOLDEN_DIR}/{file}");
            Golden { bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}")) }
        }

        fn view(&self, key: &str) -> safetensors::tensor::TensorView<'_> {
            let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("valid safetensors");
            st.tensor(key).unwrap_or_else(|e| panic!("golden key {key}: {e:?}"))
        }

        /// Shape and raw little-endian bytes of a tensor.
        pub fn raw(&self, key: &str) -> (safetensors::Dtype, Vec<usize>, Vec<u8>) {
            let v = self.view(key);
            (v.dtype(), v.shape().to_vec(), v.data().to_vec())
        }

        /// A golden tensor on `dev`, in its stored dtype.
        pub fn tensor(&self, dev: &Device, key: &str) -> Tensor {
            use safetensors::Dtype as D;
            let (dtype, shape, b) = self.raw(key);
            macro_rules! load {
                ($t:ty, $n:expr, $conv:expr) => {{
                    let v: Vec<$t> = b.chunks_exact($n).map($conv).collect();
                    Tensor::from_slice(dev, &v, &shape, Category::Input).unwrap()
                }};
            }
            match dtype {
                D::F32 => load!(f32, 4, |c| f32::from_le_bytes(c.try_into().unwrap())),
                D::F64 => load!(f64, 8, |c| f64::from_le_bytes(c.try_into().unwrap())),
                D::I64 => load!(i64, 8, |c| i64::from_le_bytes(c.try_into().unwrap())),
                D::F16 => load!(half::f16, 2, |c| half::f16::from_le_bytes(c.try_into().unwrap())),
                D::BF16 => load!(half::bf16, 2, |c| half::bf16::from_le_bytes(c.try_into().unwrap())),
                D::BOOL => load!(bool, 1, |c: &[u8]| c[0] != 0),
                other => panic!("golden dtype {other:?} not handled"),
            }
        }

        /// Values of a golden float tensor as f64.
        pub fn f64s(&self, key: &str) -> Vec<f64> {
            self.tensor(&Device::cpu(), key).to_f64_vec().unwrap()
        }

        /// Golden leaf that requires grad.
        pub fn leaf(&self, dev: &Device, key: &str) -> Tensor {
            self.tensor(dev, key).set_requires_grad(true)
        }
    }

    /// The golden tolerance: `|got - ref| <= rtol |ref| + rtol max|ref|`.
    pub fn assert_golden(got: &Tensor, want: &[f64], dtype: DType, what: &str) {
        let rtol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let got = got.to_f64_vec().unwrap();
        assert_eq!(got.len(), want.len(), "{what}: lengths differ");
        let atol = rtol * want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= rtol * w.abs() + atol, "{what}[{i}]: got {g}, want {w}");
        }
    }

    /// `_f32` / `_f64` suffix of a golden case for a dtype.
    pub fn suffix(dtype: DType) -> &'static str {
        if dtype == DType::F64 {
            "f64"
        } else {
            "f32"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use crate::autograd::backward_with;
    use crate::{DType, Device};
    use memfit_cpu::softmax::softmax_block;
    use memfit_cpu::PAR_CHUNK;

    #[test]
    fn hand_checked_values() {
        let dev = Device::cpu();
        let x = t64(&dev, &[1.0, 2.0, 3.0, 1000.0, 1000.0, f64::NEG_INFINITY], &[2, 3]);
        let y = softmax(&x, -1).unwrap().to_f64_vec().unwrap();
        let e = [1.0f64.exp(), 2.0f64.exp(), 3.0f64.exp()];
        let s: f64 = e.iter().sum();
        let want = [e[0] / s, e[1] / s, e[2] / s, 0.5, 0.5, 0.0];
        assert_close(&y, &want, 1e-15, "softmax");
        let ly = log_softmax(&x, 1).unwrap().to_f64_vec().unwrap();
        let want_log = [1.0 - s.ln(), 2.0 - s.ln(), 3.0 - s.ln(), -(2.0f64.ln()), -(2.0f64.ln())];
        assert_close(&ly[..5], &want_log, 1e-15, "log_softmax");
        assert_eq!(ly[5], f64::NEG_INFINITY);
        // Over dim 0 of [2, 3]: pairs (1, 1000), (2, 1000), (3, -inf).
        let y0 = softmax(&x, 0).unwrap().to_f64_vec().unwrap();
        assert_eq!(y0[2], 1.0);
        assert_eq!(y0[5], 0.0);
        assert!(y0[0] < 1e-300 && y0[3] == 1.0);
        // A row of -inf only is NaN, as in PyTorch.
        let z = t64(&dev, &[f64::NEG_INFINITY; 2], &[2]);
        assert!(softmax(&z, 0).unwrap().to_f64_vec().unwrap().iter().all(|v| v.is_nan()));
        assert!(softmax(&x, 2).is_err());
        assert!(softmax(&x, -3).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        let x = values(24, 1).iter().map(|v| v * 3.0).collect::<Vec<_>>();
        for dim in [0isize, 1, 2, -1] {
            gradcheck(&[(x.clone(), vec![2, 3, 4])], |t| softmax(&t[0], dim));
            gradcheck(&[(x.clone(), vec![2, 3, 4])], |t| log_softmax(&t[0], dim));
        }
    }

    #[test]
    fn non_contiguous_input_and_big_parallel_tensor() {
        let dev = Device::cpu();
        let x = t64(&dev, &values(6, 3), &[2, 3]);
        let xt = x.transpose(0, 1).unwrap();
        let a = softmax(&xt, 1).unwrap().to_f64_vec().unwrap();
        let b = softmax(&x, 0).unwrap().transpose(0, 1).unwrap().to_f64_vec().unwrap();
        assert_close(&a, &b, 1e-15, "transposed");
        // Large enough to take the parallel path; compare against the per-row serial kernel.
        let n = 3 * PAR_CHUNK;
        let data: Vec<f32> = values(n, 5).iter().map(|&v| (v * 10.0) as f32).collect();
        let big = t32(&dev, &data, &[n / 96, 96]);
        let y = softmax(&big, -1).unwrap().to_vec::<f32>().unwrap();
        let mut want = vec![0f32; n];
        for (s, d) in data.chunks(96).zip(want.chunks_mut(96)) {
            softmax_block(s, d, 96, 1, false);
        }
        assert_eq!(y, want);
        let rows: Vec<f64> = y.chunks(96).map(|r| r.iter().map(|&v| v as f64).sum()).collect();
        assert_close(&rows, &vec![1.0; n / 96], 1e-5, "row sums");
    }

    #[test]
    fn golden_softmax_and_log_softmax() {
        let g = Golden::open("reduction.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            for (case, log) in [("softmax", false), ("log_softmax", true)] {
                let name = format!("{case}_{}", suffix(dtype));
                let x = g.leaf(&dev, &format!("{name}/input"));
                let y = if log { log_softmax(&x, -1) } else { softmax(&x, -1) }.unwrap();
                assert_golden(&y, &g.f64s(&format!("{name}/output")), dtype, &name);
                backward_with(&y, g.tensor(&dev, &format!("{name}/grad_out"))).unwrap();
                assert_golden(&x.grad().unwrap(), &g.f64s(&format!("{name}/grad_input")), dtype, &name);
            }
        }
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let x = Tensor::full(dev, &[4, 5, 6], 0.5, DType::F32, crate::Category::Input)?.set_requires_grad(true);
            let y = softmax(&x, 1)?;
            let z = log_softmax(&y, -1)?;
            let g = Tensor::full(dev, z.shape(), 1.0, DType::F32, crate::Category::Temporary)?;
            backward_with(&z, g)
        });
    }
}
