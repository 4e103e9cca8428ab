//! Milliseconds of conv2d's forward and of forward plus backward on the cpu, for every convolution
//! of torchvision's resnet18 on Fashion-MNIST (1 x 28 x 28, conv1 of one input channel, batch 64:
//! the `.pt2` bench case, `tools/torchvision-check.py export resnet18`), each shape weighted by how
//! often the model runs it, with a digest of the output's and the gradients' bits (a change to the
//! kernels' data movement must leave it as it was). The median of 15 calls after 3 unmeasured ones.
//! `efficientnet` times efficientnet_b0's depthwise convolutions instead (3 x 64 x 64, batch 32).
//! `cargo run --release -p memfit-tensor --example conv_bench [-- [efficientnet] [SHAPE]]`; `MEMFIT_ISA` picks the
//! instruction set.

use memfit_tensor::autograd::backward_with;
use memfit_tensor::ops::{self, Conv2dParams};
use memfit_tensor::{Category, Device, Tensor};
use std::time::Instant;

/// One convolution of the model: name, input, weight, stride, padding, whether the input needs a
/// gradient (the first layer's images do not), and how many the model runs.
struct Shape {
    name: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    stride: usize,
    padding: usize,
    dx: bool,
    count: usize,
}

const fn shape(name: &'static str, x: [usize; 4], w: [usize; 4], stride: usize, dx: bool, count: usize) -> Shape {
    Shape { name, x, w, stride, padding: w[2] / 2, dx, count }
}

const N: usize = 64;
const RESNET18: [Shape; 11] = [
    shape("conv1 7x7 s2", [N, 1, 28, 28], [64, 1, 7, 7], 2, false, 1),
    shape("layer1 64 3x3 @7", [N, 64, 7, 7], [64, 64, 3, 3], 1, true, 4),
    shape("layer2 64-128 s2", [N, 64, 7, 7], [128, 64, 3, 3], 2, true, 1),
    shape("layer2 128 3x3 @4", [N, 128, 4, 4], [128, 128, 3, 3], 1, true, 3),
    shape("layer2 down 1x1", [N, 64, 7, 7], [128, 64, 1, 1], 2, true, 1),
    shape("layer3 128-256 s2", [N, 128, 4, 4], [256, 128, 3, 3], 2, true, 1),
    shape("layer3 256 3x3 @2", [N, 256, 2, 2], [256, 256, 3, 3], 1, true, 3),
    shape("layer3 down 1x1", [N, 128, 4, 4], [256, 128, 1, 1], 2, true, 1),
    shape("layer4 256-512 s2", [N, 256, 2, 2], [512, 256, 3, 3], 2, true, 1),
    shape("layer4 512 3x3 @1", [N, 512, 1, 1], [512, 512, 3, 3], 1, true, 3),
    shape("layer4 down 1x1", [N, 256, 2, 2], [512, 256, 1, 1], 2, true, 1),
];

/// A depthwise convolution of torchvision's efficientnet_b0 on 3 x 64 x 64 images, batch 32.
const fn depthwise(name: &'static str, c: usize, hw: usize, k: usize, stride: usize, count: usize) -> Shape {
    shape(name, [32, c, hw, hw], [c, 1, k, k], stride, true, count)
}

/// efficientnet_b0's depthwise convolutions (3 x 64 x 64, batch 32; groups = channels).
const EFFICIENTNET_DEPTHWISE: [Shape; 12] = [
    depthwise("dw 32 3x3 @32", 32, 32, 3, 1, 1),
    depthwise("dw 96 3x3 s2 @32", 96, 32, 3, 2, 1),
    depthwise("dw 144 3x3 @16", 144, 16, 3, 1, 1),
    depthwise("dw 144 5x5 s2 @16", 144, 16, 5, 2, 1),
    depthwise("dw 240 5x5 @8", 240, 8, 5, 1, 1),
    depthwise("dw 240 3x3 s2 @8", 240, 8, 3, 2, 1),
    depthwise("dw 480 3x3 @4", 480, 4, 3, 1, 2),
    depthwise("dw 480 5x5 @4", 480, 4, 5, 1, 1),
    depthwise("dw 672 5x5 @4", 672, 4, 5, 1, 2),
    depthwise("dw 672 5x5 s2 @4", 672, 4, 5, 2, 1),
    depthwise("dw 1152 5x5 @2", 1152, 2, 5, 1, 3),
    depthwise("dw 1152 3x3 @2", 1152, 2, 3, 1, 1),
];

/// `n` values in [-0.5, 0.5), spread by the multiplier `mul`.
fn values(n: usize, mul: usize) -> Vec<f32> {
    (0..n).map(|i| (i * mul % 1000) as f32 / 1000.0 - 0.5).collect()
}

/// The median of `f`'s milliseconds over 15 calls after 3 unmeasured ones.
fn median_ms(mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..18)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .skip(3)
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// FNV-1a over the bits of every value.
fn digest(values: &[Vec<f32>]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in values.iter().flatten() {
        h = (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let shapes: &[Shape] = match args.peek().map(String::as_str) {
        Some("efficientnet") => {
            args.next();
            &EFFICIENTNET_DEPTHWISE
        }
        _ => &RESNET18,
    };
    let only = args.next();
    let device = Device::cpu();
    let (mut forward_total, mut both_total) = (0.0, 0.0);
    println!("{:<20} {:>5} {:>10} {:>12}  digest", "shape", "count", "forward ms", "fwd+bwd ms");
    for s in shapes.iter().filter(|s| only.as_deref().is_none_or(|o| s.name.contains(o))) {
        let x = Tensor::from_slice(&device, &values(s.x.iter().product(), 7), &s.x, Category::Input)
            .unwrap()
            .set_requires_grad(s.dx);
        let w = Tensor::from_slice(&device, &values(s.w.iter().product(), 13), &s.w, Category::Parameter)
            .unwrap()
            .set_requires_grad(true);
        // A weight of one input channel over several: a depthwise convolution (groups = channels).
        let groups = if s.w[1] == 1 { s.x[1] } else { 1 };
        let params = Conv2dParams { stride: [s.stride; 2], padding: [s.padding; 2], groups, ..Default::default() };
        let forward = || ops::conv2d(&x, &w, None, params).unwrap();
        let out = forward();
        let upstream = Tensor::from_slice(&device, &values(out.numel(), 3), out.shape(), Category::Input).unwrap();
        let step = || {
            x.set_grad(None);
            w.set_grad(None);
            let out = forward();
            backward_with(&out, upstream.clone()).unwrap();
            out
        };
        let out = step();
        let mut bits = vec![out.to_vec::<f32>().unwrap(), w.grad().unwrap().to_vec::<f32>().unwrap()];
        if s.dx {
            bits.push(x.grad().unwrap().to_vec::<f32>().unwrap());
        }
        let fwd = median_ms(|| {
            let _ng = device.no_grad();
            forward();
        });
        let both = median_ms(|| {
            step();
        });
        forward_total += fwd * s.count as f64;
        both_total += both * s.count as f64;
        println!("{:<20} {:>5} {:>10.3} {:>12.3}  {:016x}", s.name, s.count, fwd, both, digest(&bits));
    }
    println!("{:<20} {:>5} {:>10.3} {:>12.3}", "model (weighted)", "", forward_total, both_total);
}
