//! Activation checkpointing (`autograd::checkpoint`): gradients equal the plain run's bit for bit,
//! only the segment's inputs are kept between forward and backward, `meta` allocates exactly what
//! `cpu` does (re-run included), and the re-run is marked so side effects are not repeated.

use memfit_tensor::autograd::{backward, checkpoint, Segment};
use memfit_tensor::{ops, Category, Device, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

struct Net {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
}

impl Net {
    fn new(device: &Device) -> Net {
        let p = |v: Vec<f32>, shape: &[usize]| {
            Tensor::from_slice(device, &v, shape, Category::Parameter).unwrap().set_requires_grad(true)
        };
        Net { w1: p(values(64 * 32, 1), &[64, 32]), b1: p(values(64, 2), &[64]), w2: p(values(32 * 64, 3), &[32, 64]) }
    }

    fn params(&self) -> Vec<Tensor> {
        vec![self.w1.clone(), self.b1.clone(), self.w2.clone()]
    }

    /// One residual block: x + linear(gelu(linear(layer_norm(x)))) -- several saved activations.
    fn block(&self, x: &Tensor) -> memfit_tensor::Result<Tensor> {
        let h = ops::layer_norm(x, &[32], None, None, 1e-5)?;
        let h = ops::linear(&h, &self.w1, Some(&self.b1))?.gelu()?;
        x.add(&ops::linear(&h, &self.w2, None)?)
    }

    /// Two blocks, each checkpointed or not; the loss is the sum of squares.
    fn loss(self: &Arc<Self>, x: &Tensor, checkpointed: bool) -> Tensor {
        let mut h = x.clone();
        for _ in 0..2 {
            h = if checkpointed {
                let net = self.clone();
                let segment: Segment = Arc::new(move |xs: &[Tensor], _| net.block(&xs[0]));
                checkpoint(&[&h], &self.params(), segment).unwrap()
            } else {
                self.block(&h).unwrap()
            };
        }
        h.mul(&h).unwrap().sum_all().unwrap()
    }
}

/// Runs forward and backward; returns the gradients of x and the parameters, and the activation
/// bytes held between forward and backward.
fn run(device: &Device, checkpointed: bool) -> (Vec<Vec<f32>>, u64, Vec<u64>) {
    let net = Arc::new(Net::new(device));
    let x =
        Tensor::from_slice(device, &values(16 * 32, 4), &[16, 32], Category::Input).unwrap().set_requires_grad(true);
    let loss = net.loss(&x, checkpointed);
    let held = device.stats().category(Category::Activation).current;
    backward(&loss).unwrap();
    let grads = if device.computes() {
        [&x, &net.w1, &net.b1, &net.w2].iter().map(|t| t.grad().unwrap().to_vec::<f32>().unwrap()).collect()
    } else {
        Vec::new()
    };
    let stats = device.stats();
    (
        grads,
        held,
        vec![
            stats.allocated_bytes.peak,
            stats.reserved_bytes.peak,
            stats.allocation.allocated,
            stats.requested_bytes.peak,
        ],
    )
}

#[test]
fn checkpointed_gradients_equal_the_plain_ones_bit_for_bit_and_keep_less() {
    let (plain, plain_held, _) = run(&Device::cpu(), false);
    let (ckpt, ckpt_held, _) = run(&Device::cpu(), true);
    assert_eq!(plain, ckpt, "gradients differ");
    // Checkpointed, only each block's input [16, 32] f32 (2 KiB each, 512-byte rounded) is kept.
    assert_eq!(ckpt_held, 2 * 16 * 32 * 4, "activation bytes between forward and backward");
    assert!(plain_held > 4 * ckpt_held, "plain keeps {plain_held}, checkpointed {ckpt_held}");
}

#[test]
fn meta_predicts_the_checkpointed_run_exactly() {
    for checkpointed in [false, true] {
        let (_, cpu_held, cpu) = run(&Device::cpu(), checkpointed);
        let (_, meta_held, meta) = run(&Device::meta(), checkpointed);
        assert_eq!((cpu_held, cpu), (meta_held, meta), "checkpointed: {checkpointed}");
    }
}

#[test]
fn the_re_run_is_marked_and_without_grad_the_segment_just_runs() {
    let device = Device::cpu();
    let runs = Arc::new(AtomicUsize::new(0));
    let recomputing = Arc::new(AtomicUsize::new(0));
    let (r, rc) = (runs.clone(), recomputing.clone());
    let segment: Segment = Arc::new(move |xs: &[Tensor], _| {
        r.fetch_add(1, Ordering::Relaxed);
        if xs[0].device().recomputing() {
            rc.fetch_add(1, Ordering::Relaxed);
        }
        xs[0].tanh()
    });
    let x = Tensor::from_slice(&device, &[0.5f32, -1.0], &[2], Category::Input).unwrap().set_requires_grad(true);
    let y = checkpoint(&[&x], &[], segment.clone()).unwrap();
    backward(&y.sum_all().unwrap()).unwrap();
    assert_eq!((runs.load(Ordering::Relaxed), recomputing.load(Ordering::Relaxed)), (2, 1));
    assert!(!device.recomputing());
    let want: Vec<f32> = [0.5f32, -1.0].iter().map(|v| 1.0 - v.tanh() * v.tanh()).collect();
    let got = x.grad().unwrap().to_vec::<f32>().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
    }
    {
        let _no_grad = device.no_grad();
        let y = checkpoint(&[&x], &[], segment.clone()).unwrap();
        assert!(y.is_leaf());
    }
    assert_eq!(runs.load(Ordering::Relaxed), 3, "no re-run without a graph");
    assert!(checkpoint(&[], &[], segment).is_err(), "a segment without inputs is an error, not a panic");
}
