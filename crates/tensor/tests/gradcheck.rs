//! Finite-difference gradient checks in f64 for every differentiable op.
//!
//! For an op `f` and a seeded random upstream gradient `r`, the analytic gradient of
//! `L = sum(f(x) * r)` (autograd, via `backward_with(f(x), r)`) must match the central difference
//! `(L(x + h e_i) - L(x - h e_i)) / 2h` with `h = 1e-6` for every element `i` of every input checked,
//! within `|analytic - numeric| <= 1e-6 * max(|analytic|, |numeric|) + 1e-7 * max(1, max|analytic|)`
//! (the absolute part covers the rounding noise of the difference quotient, ~1e-9 here).
//! Inputs are seeded random values; ops with kinks (relu, max, max-pooling) get inputs kept away
//! from them (no value near 0 for relu, no near-ties for max), so the numeric derivative exists.

use memfit_tensor::autograd::backward_with;
use memfit_tensor::ops::{self, Conv2dParams, Pool2dParams};
use memfit_tensor::{Category, DType, Device, Result, Tensor};

const H: f64 = 1e-6;
const RTOL: f64 = 1e-6;
const ATOL: f64 = 1e-7;

/// SplitMix64: a small seeded generator, so every run checks the same inputs.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_5EED)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Values in (-hi, -lo] U [lo, hi): bounded away from 0.
    fn away_from_zero(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi) * if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 }).collect()
    }
    /// Distinct values at least 0.05 apart (a shuffled grid plus small jitter): no near-ties.
    fn distinct(&mut self, n: usize) -> Vec<f64> {
        let mut v: Vec<f64> = (0..n).map(|i| (i as f64 - n as f64 / 2.0) * 0.1).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
        v.into_iter().map(|x| x + self.uniform(-0.02, 0.02)).collect()
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// One input of a checked function: its values, shape, and whether its gradient is checked.
struct Input {
    shape: Vec<usize>,
    data: Vec<f64>,
    wrt: bool,
}

fn input(shape: &[usize], data: Vec<f64>) -> Input {
    assert_eq!(numel(shape), data.len(), "test bug: data does not fill {shape:?}");
    Input { shape: shape.to_vec(), data, wrt: true }
}

fn constant(shape: &[usize], data: Vec<f64>) -> Input {
    Input { wrt: false, ..input(shape, data) }
}

fn rand_input(rng: &mut Rng, shape: &[usize]) -> Input {
    input(shape, rng.vec(numel(shape), -1.0, 1.0))
}

fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3))
}

/// Checks the gradients of `f` with respect to every `wrt` input (see the file docs).
fn gradcheck(name: &str, inputs: &[Input], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let device = Device::cpu();
    let make = |values: &[&[f64]], grad: bool| -> Vec<Tensor> {
        inputs
            .iter()
            .zip(values)
            .map(|(i, v)| {
                let t = Tensor::from_slice(&device, v, &i.shape, Category::Input).expect("input");
                if grad && i.wrt {
                    t.set_requires_grad(true)
                } else {
                    t
                }
            })
            .collect()
    };
    let base: Vec<&[f64]> = inputs.iter().map(|i| i.data.as_slice()).collect();
    let leaves = make(&base, true);
    let out = f(&leaves).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    assert_eq!(out.dtype(), DType::F64, "{name}: output dtype");
    let mut rng = Rng::new(seed_of(name));
    let r = rng.vec(out.numel(), -1.0, 1.0);
    let r_tensor = Tensor::from_slice(&device, &r, out.shape(), Category::Input).expect("upstream gradient");
    backward_with(&out, r_tensor).unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));

    // L(x) = sum(f(x) * r), evaluated without autograd.
    let loss = |values: &[&[f64]]| -> f64 {
        let _no_grad = device.no_grad();
        let xs = make(values, false);
        let y = f(&xs).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
        let y = y.to_vec::<f64>().expect("output values");
        y.iter().zip(&r).map(|(a, b)| a * b).sum()
    };

    let mut checked = 0;
    for (k, inp) in inputs.iter().enumerate() {
        if !inp.wrt {
            continue;
        }
        checked += 1;
        let grad = leaves[k].grad().unwrap_or_else(|| panic!("{name}: input {k} received no gradient"));
        assert_eq!(grad.shape(), inp.shape.as_slice(), "{name}: gradient shape of input {k}");
        let analytic = grad.to_vec::<f64>().expect("gradient values");
        let max_abs = analytic.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let mut worst: Option<(usize, f64, f64, f64)> = None;
        for i in 0..inp.data.len() {
            let mut plus = inp.data.clone();
            let mut minus = inp.data.clone();
            plus[i] += H;
            minus[i] -= H;
            let mut values = base.clone();
            values[k] = &plus;
            let lp = loss(&values);
            values[k] = &minus;
            let lm = loss(&values);
            let numeric = (lp - lm) / (2.0 * H);
            let a = analytic[i];
            let err = (a - numeric).abs();
            let allowed = RTOL * a.abs().max(numeric.abs()) + ATOL * max_abs;
            let ratio = err / allowed;
            let ok = err <= allowed; // false for NaN
            let worse = match worst {
                None => true,
                Some(w) => ratio.is_nan() || ratio > w.3,
            };
            if !ok && worse {
                worst = Some((i, a, numeric, ratio));
            }
        }
        if let Some((i, a, n, _)) = worst {
            panic!(
                "{name}: gradient of input {k} {:?} is off; worst element {i}: analytic {a:.12e}, numeric {n:.12e}, |diff| {:.3e}",
                inp.shape,
                (a - n).abs()
            );
        }
    }
    assert!(checked > 0, "{name}: test bug: nothing to check");
}

// ----- elementwise ---------------------------------------------------------------------------

#[test]
fn gradcheck_unary() {
    let mut rng = Rng::new(1);
    let shape = [3, 4, 5];
    let n = numel(&shape);
    gradcheck("relu", &[input(&shape, rng.away_from_zero(n, 0.05, 1.5))], |x| x[0].relu());
    gradcheck("gelu", &[input(&shape, rng.vec(n, -3.0, 3.0))], |x| x[0].gelu());
    gradcheck("gelu_tanh", &[input(&shape, rng.vec(n, -3.0, 3.0))], |x| x[0].gelu_tanh());
    gradcheck("tanh", &[input(&shape, rng.vec(n, -2.0, 2.0))], |x| x[0].tanh());
    gradcheck("sigmoid", &[input(&shape, rng.vec(n, -4.0, 4.0))], |x| x[0].sigmoid());
    gradcheck("exp", &[input(&shape, rng.vec(n, -2.0, 2.0))], |x| x[0].exp());
    gradcheck("log", &[input(&shape, rng.vec(n, 0.3, 3.0))], |x| x[0].log());
    gradcheck("neg", &[rand_input(&mut rng, &shape)], |x| x[0].neg());
    gradcheck("sqrt", &[input(&shape, rng.vec(n, 0.3, 3.0))], |x| x[0].sqrt());
    gradcheck("rsqrt", &[input(&shape, rng.vec(n, 0.3, 3.0))], |x| x[0].rsqrt());
    gradcheck("cos", &[input(&shape, rng.vec(n, -4.0, 4.0))], |x| x[0].cos());
    gradcheck("sin", &[input(&shape, rng.vec(n, -4.0, 4.0))], |x| x[0].sin());
    gradcheck("abs", &[input(&shape, rng.away_from_zero(n, 0.05, 1.5))], |x| x[0].abs());
    gradcheck("pow 1.7", &[input(&shape, rng.vec(n, 0.3, 3.0))], |x| x[0].pow_scalar(1.7));
    gradcheck("pow 4", &[input(&shape, rng.vec(n, -2.0, 2.0))], |x| x[0].pow_scalar(4.0));
    // Below, inside and above [-0.5, 0.7], away from both bounds.
    let bounded: Vec<f64> = rng
        .vec(n, 0.05, 0.45)
        .into_iter()
        .enumerate()
        .map(|(i, x)| match i % 3 {
            0 => x,
            1 => -0.5 - x,
            _ => 0.7 + x,
        })
        .collect();
    gradcheck("clamp", &[input(&shape, bounded.clone())], |x| x[0].clamp(-0.5, 0.7));
    gradcheck("clamp below only", &[input(&shape, bounded.clone())], |x| x[0].clamp(-0.5, f64::INFINITY));
    gradcheck("hardtanh", &[input(&shape, bounded)], |x| x[0].hardtanh(-0.5, 0.7));
    // Below 0, between 0 and 6, above 6: away from both kinks.
    let three_sides: Vec<f64> = rng
        .vec(n, 0.1, 5.9)
        .into_iter()
        .enumerate()
        .map(|(i, x)| match i % 3 {
            0 => x,
            1 => -x,
            _ => x + 6.2,
        })
        .collect();
    gradcheck("relu6", &[input(&shape, three_sides)], |x| x[0].relu6());
    // Below -3, between, above 3: away from the kinks at -3 and 3.
    let around_three: Vec<f64> = rng
        .vec(n, -2.9, 2.9)
        .into_iter()
        .enumerate()
        .map(|(i, x)| match i % 3 {
            0 => x,
            1 => x - 6.0,
            _ => x + 6.0,
        })
        .collect();
    gradcheck("hardsigmoid", &[input(&shape, around_three.clone())], |x| x[0].hardsigmoid());
    gradcheck("hardswish", &[input(&shape, around_three)], |x| x[0].hardswish());
    gradcheck("silu", &[rand_input(&mut rng, &shape)], |x| x[0].silu());
    gradcheck("affine", &[rand_input(&mut rng, &shape)], |x| x[0].affine(-1.7, 0.3));
    gradcheck("mul_scalar", &[rand_input(&mut rng, &shape)], |x| x[0].mul_scalar(2.5));
}

#[test]
fn gradcheck_binary_broadcasting() {
    let mut rng = Rng::new(2);
    let cases: [(&[usize], &[usize]); 4] =
        [(&[4, 1, 5], &[3, 5]), (&[3, 5], &[3, 5]), (&[2, 3, 1], &[1]), (&[5], &[2, 4, 5])];
    for (sa, sb) in cases {
        let a = || rand_input(&mut Rng::new(seed_of(&format!("{sa:?}"))), sa);
        let b = rng.vec(numel(sb), -1.0, 1.0);
        let b_away = rng.away_from_zero(numel(sb), 0.5, 2.0);
        gradcheck(&format!("add {sa:?} {sb:?}"), &[a(), input(sb, b.clone())], |x| x[0].add(&x[1]));
        gradcheck(&format!("sub {sa:?} {sb:?}"), &[a(), input(sb, b.clone())], |x| x[0].sub(&x[1]));
        gradcheck(&format!("mul {sa:?} {sb:?}"), &[a(), input(sb, b.clone())], |x| x[0].mul(&x[1]));
        gradcheck(&format!("div {sa:?} {sb:?}"), &[a(), input(sb, b_away)], |x| x[0].div(&x[1]));
    }
    // The same tensor on both sides: gradients from both operands add up.
    gradcheck("mul self", &[rand_input(&mut rng, &[3, 4])], |x| x[0].mul(&x[0]));
    // One tensor feeding two branches whose backwards could run in place on a shared gradient
    // (Note [Gradient ownership]).
    gradcheck("relu(x) + sigmoid(x)", &[input(&[4, 5], rng.away_from_zero(20, 0.05, 2.0))], |x| {
        x[0].relu()?.add(&x[0].sigmoid()?)
    });
    gradcheck("sigmoid(x) + relu(x)", &[input(&[4, 5], rng.away_from_zero(20, 0.05, 2.0))], |x| {
        x[0].sigmoid()?.add(&x[0].relu()?)
    });
    gradcheck("x * x + x", &[rand_input(&mut rng, &[3, 4])], |x| x[0].mul(&x[0])?.add(&x[0]));
    gradcheck("tanh(x + x)", &[rand_input(&mut rng, &[3, 4])], |x| x[0].add(&x[0])?.tanh());
    // One operand constant.
    let c = rng.vec(5, -1.0, 1.0);
    gradcheck("mul constant", &[rand_input(&mut rng, &[3, 5]), constant(&[5], c)], |x| x[0].mul(&x[1]));
}

// ----- reductions ----------------------------------------------------------------------------

#[test]
fn gradcheck_sum_mean() {
    let mut rng = Rng::new(3);
    let shape = [3, 4, 5];
    for dim in [0isize, 1, 2, -1] {
        for keepdim in [false, true] {
            gradcheck(&format!("sum_dim {dim} {keepdim}"), &[rand_input(&mut rng, &shape)], |x| {
                x[0].sum_dim(dim, keepdim)
            });
            gradcheck(&format!("mean_dim {dim} {keepdim}"), &[rand_input(&mut rng, &shape)], |x| {
                x[0].mean_dim(dim, keepdim)
            });
        }
    }
    gradcheck("sum_all", &[rand_input(&mut rng, &shape)], |x| x[0].sum_all());
    gradcheck("mean_all", &[rand_input(&mut rng, &shape)], |x| x[0].mean_all());
    // A reduction of a non-contiguous view.
    gradcheck("sum_dim of transpose", &[rand_input(&mut rng, &shape)], |x| x[0].transpose(0, 2)?.sum_dim(1, false));
}

#[test]
fn gradcheck_max() {
    let mut rng = Rng::new(4);
    let shape = [3, 4, 5];
    for dim in [0isize, 1, -1] {
        for keepdim in [false, true] {
            gradcheck(&format!("max_dim {dim} {keepdim}"), &[input(&shape, rng.distinct(60))], |x| {
                Ok(x[0].max_dim(dim, keepdim)?.0)
            });
        }
    }
    gradcheck("max_all", &[input(&shape, rng.distinct(60))], |x| x[0].max_all());
}

#[test]
fn gradcheck_softmax() {
    let mut rng = Rng::new(5);
    let shape = [3, 4, 5];
    for dim in [-1isize, 1, 0] {
        gradcheck(&format!("softmax {dim}"), &[input(&shape, rng.vec(60, -3.0, 3.0))], |x| ops::softmax(&x[0], dim));
        gradcheck(&format!("log_softmax {dim}"), &[input(&shape, rng.vec(60, -3.0, 3.0))], |x| {
            ops::log_softmax(&x[0], dim)
        });
    }
}

// ----- matrix products -----------------------------------------------------------------------

#[test]
fn gradcheck_matmul() {
    let mut rng = Rng::new(6);
    let cases: [(&[usize], &[usize]); 5] = [
        (&[5, 7], &[7, 3]),
        (&[2, 4, 5, 6], &[2, 4, 6, 3]),
        (&[2, 1, 5, 6], &[3, 6, 4]),
        (&[4, 3], &[2, 3, 5]),
        (&[2, 3, 4], &[4, 2]),
    ];
    for (sa, sb) in cases {
        gradcheck(&format!("matmul {sa:?} {sb:?}"), &[rand_input(&mut rng, sa), rand_input(&mut rng, sb)], |x| {
            x[0].matmul(&x[1])
        });
    }
    // A transposed (strided) operand.
    gradcheck("matmul transposed", &[rand_input(&mut rng, &[4, 5]), rand_input(&mut rng, &[3, 5])], |x| {
        x[0].matmul(&x[1].transpose(0, 1)?)
    });
}

#[test]
fn gradcheck_linear() {
    let mut rng = Rng::new(7);
    for xs in [&[4usize, 7][..], &[2, 4, 7]] {
        let inputs = [rand_input(&mut rng, xs), rand_input(&mut rng, &[3, 7]), rand_input(&mut rng, &[3])];
        gradcheck(&format!("linear {xs:?}"), &inputs, |x| ops::linear(&x[0], &x[1], Some(&x[2])));
        let inputs = [rand_input(&mut rng, xs), rand_input(&mut rng, &[3, 7])];
        gradcheck(&format!("linear no bias {xs:?}"), &inputs, |x| ops::linear(&x[0], &x[1], None));
    }
    // Only the weight needs a gradient (a first layer).
    let inputs = [constant(&[4, 7], rng.vec(28, -1.0, 1.0)), rand_input(&mut rng, &[3, 7]), rand_input(&mut rng, &[3])];
    gradcheck("linear constant input", &inputs, |x| ops::linear(&x[0], &x[1], Some(&x[2])));
}

#[test]
fn gradcheck_gelu_linear() {
    let mut rng = Rng::new(19);
    // Inputs in [-3, 3): both tails and the bend of GELU.
    let wide = |rng: &mut Rng, shape: &[usize]| input(shape, rng.vec(numel(shape), -3.0, 3.0));
    for xs in [&[4usize, 7][..], &[2, 4, 7]] {
        let inputs = [wide(&mut rng, xs), rand_input(&mut rng, &[3, 7]), rand_input(&mut rng, &[3])];
        gradcheck(&format!("gelu_linear {xs:?}"), &inputs, |x| ops::gelu_linear(&x[0], &x[1], Some(&x[2])));
        let inputs = [wide(&mut rng, xs), rand_input(&mut rng, &[3, 7])];
        gradcheck(&format!("gelu_linear no bias {xs:?}"), &inputs, |x| ops::gelu_linear(&x[0], &x[1], None));
    }
    // More rows than one block (512), and an input produced by an op: its gradient is then written
    // over the saved input in place.
    let inputs = [wide(&mut rng, &[600, 3]), rand_input(&mut rng, &[2, 3]), rand_input(&mut rng, &[2])];
    gradcheck("gelu_linear blocks, in place", &inputs, |x| {
        ops::gelu_linear(&x[0].mul_scalar(1.5)?, &x[1], Some(&x[2]))
    });
    // A transposed (strided) weight, and a constant input (only the weight and bias get gradients).
    let inputs = [wide(&mut rng, &[5, 4]), rand_input(&mut rng, &[4, 3])];
    gradcheck("gelu_linear strided weight", &inputs, |x| ops::gelu_linear(&x[0], &x[1].transpose(0, 1)?, None));
    let inputs = [constant(&[5, 4], rng.vec(20, -3.0, 3.0)), rand_input(&mut rng, &[3, 4]), rand_input(&mut rng, &[3])];
    gradcheck("gelu_linear constant input", &inputs, |x| ops::gelu_linear(&x[0], &x[1], Some(&x[2])));
    // Only the input needs a gradient (a frozen layer), as a leaf and in place.
    let inputs = [wide(&mut rng, &[5, 4]), constant(&[3, 4], rng.vec(12, -1.0, 1.0))];
    gradcheck("gelu_linear constant weight", &inputs, |x| ops::gelu_linear(&x[0], &x[1], None));
    gradcheck("gelu_linear constant weight, in place", &inputs, |x| {
        ops::gelu_linear(&x[0].mul_scalar(1.0)?, &x[1], None)
    });
}

// ----- convolution and pooling ---------------------------------------------------------------

#[test]
fn gradcheck_conv2d() {
    let mut rng = Rng::new(8);
    // (input, weight, stride, padding, dilation, groups, bias)
    #[allow(clippy::type_complexity)]
    let cases: [([usize; 4], [usize; 4], [usize; 2], [usize; 2], [usize; 2], usize, bool); 7] = [
        ([2, 3, 6, 6], [4, 3, 3, 3], [1, 1], [1, 1], [1, 1], 1, true),
        ([2, 3, 7, 8], [4, 3, 3, 3], [2, 2], [0, 0], [1, 1], 1, false),
        ([1, 2, 7, 7], [3, 2, 3, 3], [1, 1], [2, 2], [2, 2], 1, true),
        ([2, 4, 5, 5], [6, 2, 3, 3], [1, 1], [1, 1], [1, 1], 2, true),
        ([2, 4, 7, 7], [4, 1, 3, 3], [2, 2], [1, 1], [1, 1], 4, false),
        ([1, 3, 5, 6], [2, 3, 1, 1], [1, 1], [0, 0], [1, 1], 1, true),
        ([2, 2, 6, 7], [3, 2, 1, 3], [1, 2], [0, 1], [1, 1], 1, true),
    ];
    for (xs, ws, stride, padding, dilation, groups, bias) in cases {
        let p = Conv2dParams { stride, padding, dilation, groups };
        let name = format!("conv2d x{xs:?} w{ws:?} {p:?} bias={bias}");
        let mut inputs = vec![rand_input(&mut rng, &xs), rand_input(&mut rng, &ws)];
        if bias {
            inputs.push(rand_input(&mut rng, &[ws[0]]));
        }
        gradcheck(&name, &inputs, |x| ops::conv2d(&x[0], &x[1], x.get(2), p));
    }
    // Input without gradient (the first layer of a network).
    let inputs = [constant(&[1, 2, 5, 5], rng.vec(50, -1.0, 1.0)), rand_input(&mut rng, &[3, 2, 3, 3])];
    gradcheck("conv2d constant input", &inputs, |x| ops::conv2d(&x[0], &x[1], None, Conv2dParams::default()));
}

fn pool(
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
) -> Pool2dParams {
    Pool2dParams { kernel, stride, padding, dilation, ceil_mode }
}

#[test]
fn gradcheck_max_pool2d() {
    let mut rng = Rng::new(9);
    let cases = [
        ([2, 3, 6, 6], pool([2, 2], [2, 2], [0, 0], [1, 1], false)),
        ([2, 2, 7, 7], pool([3, 3], [2, 2], [1, 1], [1, 1], false)),
        ([1, 2, 5, 6], pool([3, 2], [1, 2], [0, 0], [1, 1], false)),
        ([1, 2, 7, 7], pool([2, 2], [1, 1], [0, 0], [2, 2], false)),
        ([1, 2, 7, 7], pool([2, 2], [2, 2], [0, 0], [1, 1], true)),
    ];
    for (xs, p) in cases {
        // Overlapping windows share elements: values distinct so each window has one clear maximum.
        gradcheck(&format!("max_pool2d {xs:?} {p:?}"), &[input(&xs, rng.distinct(numel(&xs)))], |x| {
            ops::max_pool2d(&x[0], p)
        });
    }
}

#[test]
fn gradcheck_avg_pool2d() {
    let mut rng = Rng::new(10);
    let cases = [
        ([2, 3, 6, 6], pool([2, 2], [2, 2], [0, 0], [1, 1], false), true),
        ([2, 2, 7, 7], pool([3, 3], [2, 2], [1, 1], [1, 1], false), true),
        ([2, 2, 7, 7], pool([3, 3], [2, 2], [1, 1], [1, 1], false), false),
        ([1, 2, 5, 6], pool([3, 2], [1, 2], [0, 1], [1, 1], false), true),
        ([1, 2, 7, 7], pool([2, 2], [2, 2], [0, 0], [1, 1], true), true),
    ];
    for (xs, p, include_pad) in cases {
        gradcheck(&format!("avg_pool2d {xs:?} {p:?} include_pad={include_pad}"), &[rand_input(&mut rng, &xs)], |x| {
            ops::avg_pool2d(&x[0], p, include_pad)
        });
    }
}

#[test]
fn gradcheck_adaptive_avg_pool2d() {
    let mut rng = Rng::new(11);
    for (xs, out) in [([2, 3, 5, 5], [1, 1]), ([2, 2, 5, 7], [2, 3]), ([1, 2, 6, 4], [4, 3]), ([1, 1, 3, 3], [5, 4])] {
        gradcheck(&format!("adaptive_avg_pool2d {xs:?} -> {out:?}"), &[rand_input(&mut rng, &xs)], |x| {
            ops::adaptive_avg_pool2d(&x[0], out)
        });
    }
}

// ----- normalization -------------------------------------------------------------------------

#[test]
fn gradcheck_layer_norm() {
    let mut rng = Rng::new(12);
    let inputs = [rand_input(&mut rng, &[2, 3, 8]), input(&[8], rng.vec(8, 0.5, 1.5)), rand_input(&mut rng, &[8])];
    gradcheck("layer_norm affine", &inputs, |x| ops::layer_norm(&x[0], &[8], Some(&x[1]), Some(&x[2]), 1e-5));
    gradcheck("layer_norm plain", &[rand_input(&mut rng, &[4, 6])], |x| ops::layer_norm(&x[0], &[6], None, None, 1e-5));
    let inputs =
        [rand_input(&mut rng, &[2, 3, 4]), input(&[3, 4], rng.vec(12, 0.5, 1.5)), rand_input(&mut rng, &[3, 4])];
    gradcheck("layer_norm over 2 dims", &inputs, |x| ops::layer_norm(&x[0], &[3, 4], Some(&x[1]), Some(&x[2]), 1e-5));
}

#[test]
fn gradcheck_layer_norm_linear() {
    let mut rng = Rng::new(21);
    // x [..., 6], ln weight and bias [6], weight [4, 6], bias [4].
    let ln_inputs = |rng: &mut Rng, xs: &[usize]| {
        [
            rand_input(rng, xs),
            input(&[6], rng.vec(6, 0.5, 1.5)),
            rand_input(rng, &[6]),
            rand_input(rng, &[4, 6]),
            rand_input(rng, &[4]),
        ]
    };
    for xs in [&[5usize, 6][..], &[2, 3, 6]] {
        gradcheck(&format!("layer_norm_linear {xs:?}"), &ln_inputs(&mut rng, xs), |x| {
            ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
        });
    }
    let inputs = ln_inputs(&mut rng, &[3, 6]);
    gradcheck("layer_norm_linear no bias", &inputs[..4], |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], None)
    });
    // More rows than one block (512), and an input produced by an op: its gradient is then written
    // over the saved input in place. A transposed (strided) weight.
    gradcheck("layer_norm_linear blocks, in place", &ln_inputs(&mut rng, &[530, 6]), |x| {
        ops::layer_norm_linear(&x[0].mul_scalar(1.5)?, &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
    });
    let mut inputs = ln_inputs(&mut rng, &[3, 6]);
    inputs[3] = rand_input(&mut rng, &[6, 4]);
    gradcheck("layer_norm_linear strided weight", &inputs, |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3].transpose(0, 1)?, Some(&x[4]))
    });
    // Only some inputs need gradients (a constant input; constant norm parameters).
    let mut inputs = ln_inputs(&mut rng, &[3, 6]);
    inputs[0].wrt = false;
    gradcheck("layer_norm_linear constant input", &inputs, |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
    });
    let mut inputs = ln_inputs(&mut rng, &[3, 6]);
    inputs[1].wrt = false;
    inputs[2].wrt = false;
    gradcheck("layer_norm_linear constant norm", &inputs, |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
    });
    // A constant weight: the layer-norm gradients are then summed over the rows (with the weight's
    // gradient they come from its product). Without the linear bias too, whose column sums the
    // product otherwise needs a scratch for.
    let mut inputs = ln_inputs(&mut rng, &[530, 6]);
    inputs[3].wrt = false;
    gradcheck("layer_norm_linear constant weight", &inputs, |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
    });
    let mut inputs = ln_inputs(&mut rng, &[3, 6]);
    inputs[3].wrt = false;
    gradcheck("layer_norm_linear constant weight, no bias", &inputs[..4], |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], None)
    });
    let mut inputs = ln_inputs(&mut rng, &[3, 6]);
    inputs[4].wrt = false;
    gradcheck("layer_norm_linear constant bias", &inputs, |x| {
        ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
    });
    let mut inputs = ln_inputs(&mut rng, &[3, 6]);
    inputs[1..].iter_mut().for_each(|i| i.wrt = false);
    gradcheck("layer_norm_linear input only, in place", &inputs, |x| {
        ops::layer_norm_linear(&x[0].mul_scalar(1.0)?, &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
    });
}

#[test]
fn gradcheck_batch_norm() {
    let mut rng = Rng::new(13);
    for xs in [&[4usize, 3, 3, 3][..], &[6, 4]] {
        let c = xs[1];
        let rm = rng.vec(c, -0.5, 0.5);
        let rv = rng.vec(c, 0.5, 2.0);
        let inputs = [rand_input(&mut rng, xs), input(&[c], rng.vec(c, 0.5, 1.5)), rand_input(&mut rng, &[c])];
        for training in [true, false] {
            // Fresh running statistics for every evaluation (training updates them in place).
            gradcheck(&format!("batch_norm {xs:?} training={training}"), &inputs, |x| {
                let d = x[0].device();
                let m = Tensor::from_slice(d, &rm, &[c], Category::Input)?;
                let v = Tensor::from_slice(d, &rv, &[c], Category::Input)?;
                ops::batch_norm(&x[0], Some(&m), Some(&v), Some(&x[1]), Some(&x[2]), training, 0.1, 1e-5)
            });
        }
        gradcheck(&format!("batch_norm {xs:?} no stats, no affine"), &[rand_input(&mut rng, xs)], |x| {
            ops::batch_norm(&x[0], None, None, None, None, true, 0.1, 1e-5)
        });
    }
}

// ----- lookup and losses ---------------------------------------------------------------------

#[test]
fn gradcheck_embedding() {
    let mut rng = Rng::new(14);
    // Repeated indices: their gradients must add up.
    let idx: Vec<i64> = vec![1, 3, 3, 0, 9, 1, 7, 3, 2, 2, 5, 1];
    gradcheck("embedding", &[rand_input(&mut rng, &[10, 4])], |x| {
        let i = Tensor::from_slice(x[0].device(), &idx, &[2, 6], Category::Input)?;
        ops::embedding(&i, &x[0])
    });
}

#[test]
fn gradcheck_losses() {
    let mut rng = Rng::new(15);
    let target: Vec<i64> = vec![0, 4, 2, 2, 1, 3];
    for smoothing in [0.0, 0.1] {
        gradcheck(&format!("cross_entropy smoothing={smoothing}"), &[input(&[6, 5], rng.vec(30, -2.0, 2.0))], |x| {
            let t = Tensor::from_slice(x[0].device(), &target, &[6], Category::Input)?;
            ops::cross_entropy(&x[0], &t, smoothing)
        });
    }
    gradcheck("nll_loss", &[input(&[6, 5], rng.vec(30, -3.0, 0.0))], |x| {
        let t = Tensor::from_slice(x[0].device(), &target, &[6], Category::Input)?;
        ops::nll_loss(&x[0], &t)
    });
    gradcheck("nll_loss(log_softmax)", &[input(&[6, 5], rng.vec(30, -2.0, 2.0))], |x| {
        let t = Tensor::from_slice(x[0].device(), &target, &[6], Category::Input)?;
        ops::nll_loss(&ops::log_softmax(&x[0], -1)?, &t)
    });
    gradcheck("mse_loss", &[rand_input(&mut rng, &[4, 5]), rand_input(&mut rng, &[4, 5])], |x| {
        ops::mse_loss(&x[0], &x[1])
    });
}

// ----- attention -----------------------------------------------------------------------------

#[test]
fn gradcheck_attention() {
    let mut rng = Rng::new(16);
    let qkv = |rng: &mut Rng, tq: usize, tk: usize| {
        [rand_input(rng, &[2, 2, tq, 4]), rand_input(rng, &[2, 2, tk, 4]), rand_input(rng, &[2, 2, tk, 3])]
    };
    gradcheck("sdpa", &qkv(&mut rng, 5, 5), |x| ops::scaled_dot_product_attention(&x[0], &x[1], &x[2], false, None));
    gradcheck("sdpa causal", &qkv(&mut rng, 5, 5), |x| {
        ops::scaled_dot_product_attention(&x[0], &x[1], &x[2], true, None)
    });
    gradcheck("sdpa Tq != Tk", &qkv(&mut rng, 3, 6), |x| {
        ops::scaled_dot_product_attention(&x[0], &x[1], &x[2], false, None)
    });
    // A bool mask, True = not allowed; every query keeps at least key 0.
    let (tq, tk) = (4, 6);
    let mask: Vec<bool> = (0..tq * tk).map(|i| i % tk != 0 && rng.below(3) == 0).collect();
    gradcheck("sdpa mask", &qkv(&mut rng, tq, tk), |x| {
        let m = Tensor::from_slice(x[0].device(), &mask, &[tq, tk], Category::Input)?;
        ops::scaled_dot_product_attention(&x[0], &x[1], &x[2], false, Some(&m))
    });
    // More query rows than one block (64): the backward recomputes P block by block.
    gradcheck(
        "sdpa row blocks",
        &[
            rand_input(&mut rng, &[1, 1, 70, 2]),
            rand_input(&mut rng, &[1, 1, 70, 2]),
            rand_input(&mut rng, &[1, 1, 70, 2]),
        ],
        |x| ops::scaled_dot_product_attention(&x[0], &x[1], &x[2], true, None),
    );
}

#[test]
fn gradcheck_packed_self_attention() {
    let mut rng = Rng::new(20);
    // qkv [B, T, 3E] with E = 6, 2 heads of 3 features.
    gradcheck("packed", &[rand_input(&mut rng, &[2, 5, 18])], |x| ops::packed_self_attention(&x[0], 2, false, None));
    gradcheck("packed causal", &[rand_input(&mut rng, &[2, 5, 18])], |x| {
        ops::packed_self_attention(&x[0], 2, true, None)
    });
    // A per-(batch, head) mask with a fully masked row (output and gradient 0 there).
    let t = 4;
    let mut mask: Vec<bool> = (0..2 * 2 * t * t).map(|i| i % t != 0 && rng.below(3) == 0).collect();
    mask[t..2 * t].iter_mut().for_each(|m| *m = true);
    gradcheck("packed mask", &[rand_input(&mut rng, &[2, t, 18])], |x| {
        let m = Tensor::from_slice(x[0].device(), &mask, &[2, 2, t, t], Category::Input)?;
        ops::packed_self_attention(&x[0], 2, false, Some(&m))
    });
    // Several row blocks, the input produced by an op.
    gradcheck("packed row blocks", &[rand_input(&mut rng, &[1, 70, 6])], |x| {
        ops::packed_self_attention(&x[0].mul_scalar(2.0)?, 1, true, None)
    });
}

// ----- dropout -------------------------------------------------------------------------------

#[test]
fn gradcheck_dropout() {
    let mut rng = Rng::new(17);
    // The same seed draws the same mask in every evaluation, so the op is linear in x.
    gradcheck("dropout", &[rand_input(&mut rng, &[4, 50])], |x| ops::dropout(&x[0], 0.3, true, 1234));
    gradcheck("dropout eval", &[rand_input(&mut rng, &[4, 5])], |x| ops::dropout(&x[0], 0.3, false, 1234));
}

// ----- views ---------------------------------------------------------------------------------

#[test]
fn gradcheck_views() {
    let mut rng = Rng::new(18);
    let s = [2usize, 3, 4];
    gradcheck("reshape", &[rand_input(&mut rng, &s)], |x| x[0].reshape(&[4, -1]));
    gradcheck("reshape of transpose", &[rand_input(&mut rng, &s)], |x| x[0].transpose(0, 1)?.reshape(&[-1]));
    gradcheck("permute", &[rand_input(&mut rng, &s)], |x| x[0].permute(&[2, 0, 1]));
    gradcheck("transpose", &[rand_input(&mut rng, &s)], |x| x[0].transpose(0, 2));
    gradcheck("narrow", &[rand_input(&mut rng, &s)], |x| x[0].narrow(1, 1, 2));
    gradcheck("narrow twice", &[rand_input(&mut rng, &s)], |x| x[0].narrow(2, 1, 3)?.narrow(0, 1, 1));
    gradcheck("expand", &[rand_input(&mut rng, &[3, 1])], |x| x[0].expand(&[2, 3, 4]));
    gradcheck("slice_step", &[rand_input(&mut rng, &[2, 7, 3])], |x| x[0].slice_step(1, 1, 7, 2));
    gradcheck("slice_step past the end", &[rand_input(&mut rng, &s)], |x| x[0].slice_step(2, 1, 99, 3));
    gradcheck("cat", &[rand_input(&mut rng, &[2, 1, 4]), rand_input(&mut rng, &s)], |x| {
        memfit_tensor::ops::cat(&[x[0].clone(), x[1].clone(), x[0].clone()], 1)
    });
    gradcheck("cat of views", &[rand_input(&mut rng, &s)], |x| {
        memfit_tensor::ops::cat(&[x[0].narrow(2, 0, 1)?, x[0].transpose(1, 2)?.narrow(1, 1, 2)?.transpose(1, 2)?], 2)
    });
    gradcheck("where", &[rand_input(&mut rng, &s), rand_input(&mut rng, &[3, 1])], |x| {
        let cond = x[0].detach().compare(memfit_tensor::ops::Compare::Gt, &x[1].detach().mul_scalar(0.5)?)?;
        memfit_tensor::ops::where_(&cond, &x[0], &x[1])
    });
    gradcheck("pad", &[rand_input(&mut rng, &s)], |x| memfit_tensor::ops::pad(&x[0], &[1, 2, 0, 1], 0.0));
    gradcheck("pad with a value, cropping", &[rand_input(&mut rng, &s)], |x| {
        memfit_tensor::ops::pad(&x[0], &[-1, 2, 1, -1, 1, 0], 0.5)
    });
    gradcheck("roll", &[rand_input(&mut rng, &s)], |x| {
        memfit_tensor::ops::roll(&memfit_tensor::ops::roll(&x[0], -1, 2)?, 5, 1)
    });
    gradcheck("stack", &[rand_input(&mut rng, &s), rand_input(&mut rng, &s)], |x| {
        memfit_tensor::ops::stack(&[x[0].clone(), x[1].clone()], 3)
    });
    gradcheck("contiguous", &[rand_input(&mut rng, &s)], |x| x[0].permute(&[1, 2, 0])?.contiguous());
    gradcheck("flatten_from", &[rand_input(&mut rng, &s)], |x| x[0].flatten_from(1));
    gradcheck("unsqueeze/squeeze", &[rand_input(&mut rng, &s)], |x| x[0].unsqueeze(1)?.squeeze(1)?.unsqueeze(0));
    // A view used twice: both paths' gradients accumulate.
    gradcheck("view reuse", &[rand_input(&mut rng, &[4, 4])], |x| x[0].transpose(0, 1)?.mul(&x[0]));
}

// ----- casts ---------------------------------------------------------------------------------

/// Casts round, so a finite difference through f64 -> f32 -> f64 measures rounding, not a derivative:
/// only the identity path (f64 -> f64, which is the tensor itself) is differentiated numerically.
/// The backward of a real cast is checked exactly instead: it is the upstream gradient cast back.
#[test]
fn gradcheck_to_dtype() {
    let mut rng = Rng::new(19);
    gradcheck("to_dtype f64 identity", &[rand_input(&mut rng, &[3, 4])], |x| x[0].to_dtype(DType::F64)?.mul(&x[0]));

    let device = Device::cpu();
    let x = Tensor::from_slice(&device, &rng.vec(6, -1.0, 1.0), &[6], Category::Input).unwrap().set_requires_grad(true);
    let y = x.to_dtype(DType::F32).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let g: Vec<f32> = rng.vec(6, -1.0, 1.0).into_iter().map(|v| v as f32).collect();
    backward_with(&y, Tensor::from_slice(&device, &g, &[6], Category::Input).unwrap()).unwrap();
    let grad = x.grad().expect("gradient through the cast");
    assert_eq!(grad.dtype(), DType::F64);
    let want: Vec<f64> = g.iter().map(|&v| f64::from(v)).collect();
    assert_eq!(grad.to_vec::<f64>().unwrap(), want);
}

// ----- the checker itself --------------------------------------------------------------------

/// The harness must reject a wrong gradient (a backward that is off by a factor).
#[test]
#[should_panic(expected = "gradient of input 0")]
fn gradcheck_catches_a_wrong_gradient() {
    let mut rng = Rng::new(20);
    // `affine(2)` has gradient 2 r; claiming it is the gradient of x*3 (numeric 3 r) must fail:
    // the function evaluated numerically differs from the one differentiated, via grad mode.
    gradcheck("wrong", &[rand_input(&mut rng, &[5])], |x| {
        if x[0].requires_grad() {
            x[0].affine(2.0, 0.0)
        } else {
            x[0].affine(3.0, 0.0)
        }
    });
}
