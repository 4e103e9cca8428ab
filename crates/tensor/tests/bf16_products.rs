//! A device's bf16 and fp16 products (`Device::set_products`, `--precision bf16`'s and `fp16`'s
//! arithmetic; Notes [bf16 products] and [fp16 products] in `memfit-kernels`): every product op of
//! the cpu backend multiplies operands rounded to bfloat16 (binary16), forward and backward; nothing allocates differently, so meta still predicts the
//! device to the byte. (The cuda backend's bf16 products: `cuda_parity`.)

use memfit_tensor::autograd::backward_with;
use memfit_tensor::ops::{self, Conv2dParams};
use memfit_tensor::{Category, Device, DeviceConfig, DeviceKind, Products, Result, Target, Tensor};

/// Seeded values in [-1, 1), carrying bits bfloat16 drops.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `f`'s output and its inputs' gradients on `device` (inputs from `shapes`, rounded to bfloat16
/// first when `round`), as host vectors.
fn run(device: &Device, shapes: &[&[usize]], round: bool, f: &dyn Fn(&[Tensor]) -> Result<Tensor>) -> Vec<Vec<f32>> {
    let inputs: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let mut v = values(shape.iter().product(), 3 + i as u64);
            if round {
                v.iter_mut().for_each(|x| *x = memfit_kernels::gemm_bf16::round_bf16(*x));
            }
            Tensor::from_slice(device, &v, shape, Category::Input).unwrap().set_requires_grad(true)
        })
        .collect();
    let out = f(&inputs).unwrap();
    let upstream = Tensor::from_slice(device, &values(out.numel(), 99), out.shape(), Category::Input).unwrap();
    backward_with(&out, upstream).unwrap();
    let mut all = vec![out.to_vec::<f32>().unwrap()];
    all.extend(inputs.iter().map(|t| t.grad().map(|g| g.to_vec::<f32>().unwrap()).unwrap_or_default()));
    all
}

/// The largest difference between two results, relative to the largest value.
fn gap(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

type Op = (&'static str, Vec<&'static [usize]>, fn(&[Tensor]) -> Result<Tensor>);

/// Every op whose arithmetic is a matrix product, with shapes over several tiles.
fn product_ops() -> Vec<Op> {
    vec![
        ("linear", vec![&[37, 70], &[45, 70], &[45]], |x| ops::linear(&x[0], &x[1], Some(&x[2]))),
        ("matmul", vec![&[2, 19, 33], &[2, 33, 21]], |x| x[0].matmul(&x[1])),
        ("conv2d", vec![&[3, 5, 9, 8], &[7, 5, 3, 3], &[7]], |x| {
            ops::conv2d(&x[0], &x[1], Some(&x[2]), Conv2dParams { padding: [1, 1], ..Default::default() })
        }),
        ("attention", vec![&[2, 2, 40, 16], &[2, 2, 40, 16], &[2, 2, 40, 16]], |x| {
            ops::scaled_dot_product_attention(&x[0], &x[1], &x[2], true, None)
        }),
        ("layer_norm_linear", vec![&[50, 24], &[24], &[24], &[30, 24], &[30]], |x| {
            ops::layer_norm_linear(&x[0], &x[1], &x[2], 1e-5, &x[3], Some(&x[4]))
        }),
        ("gelu_linear", vec![&[50, 24], &[30, 24], &[30]], |x| ops::gelu_linear(&x[0], &x[1], Some(&x[2]))),
    ]
}

/// Forward and backward of every product op change under bf16 products by bfloat16's rounding
/// (about 2^-8 of the values, never more than a few times that), under fp16 products by binary16's
/// (2^-11, eight times less), and not otherwise.
#[test]
fn every_product_op_multiplies_in_bf16_or_fp16_forward_and_backward() {
    for (products, (least, most)) in [(Products::Bf16, (1e-5, 4e-2)), (Products::F16, (2e-6, 5e-3))] {
        rounded_products_change_every_op(products, least, most);
    }
}

fn rounded_products_change_every_op(products: Products, least: f32, most: f32) {
    let (f32_device, bf16_device) = (Device::cpu(), Device::cpu());
    bf16_device.set_products(products).unwrap();
    assert_eq!(f32_device.products(), Products::F32, "f32 products are the default");
    for (name, shapes, f) in product_ops() {
        let want = run(&f32_device, &shapes, false, &f);
        let got = run(&bf16_device, &shapes, false, &f);
        // A bias gradient (the last input's, for the ops with a bias) is a sum of the output's
        // gradient, not a product: the same bits.
        let bias = ["linear", "conv2d", "layer_norm_linear", "gelu_linear"].contains(&name).then_some(shapes.len());
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            let d = gap(w, g);
            if Some(k) == bias {
                assert_eq!(w, g, "{name}: the bias gradient is no product");
            } else {
                assert!(d > least && d < most, "{name} result {k}: {products:?} products differ from f32 by {d}");
            }
        }
    }
}

/// On operands that are already bfloat16 values, a bf16 product is an f32 product added in
/// another order: forward results agree with f32 products to f32's rounding.
#[test]
fn on_bfloat16_operands_the_forward_agrees_with_f32_products() {
    let (f32_device, bf16_device) = (Device::cpu(), Device::cpu());
    bf16_device.set_products(Products::Bf16).unwrap();
    for (name, shapes, f) in product_ops().into_iter().filter(|(n, ..)| ["linear", "matmul", "conv2d"].contains(n)) {
        let (want, got) = (run(&f32_device, &shapes, true, &f), run(&bf16_device, &shapes, true, &f));
        let d = gap(&want[0], &got[0]);
        assert!(d < 1e-5, "{name}: {d}");
    }
}

/// bf16 and fp16 products allocate exactly what f32 products allocate, so meta (which computes
/// nothing) predicts such a run to the byte.
#[test]
fn bf16_products_allocate_as_f32_products() {
    let stats = |products: Products| {
        let d = Device::cpu();
        d.set_products(products).unwrap();
        for (_, shapes, f) in product_ops() {
            run(&d, &shapes, false, &f);
        }
        (d.stats(), d.timeline_events())
    };
    assert_eq!(stats(Products::Bf16), stats(Products::F32));
    assert_eq!(stats(Products::F16), stats(Products::F32));
}

/// The setting holds on every device kind, a GPU target's included (meta:cuda predicts cuda).
#[test]
fn every_device_takes_the_setting() {
    for kind in [DeviceKind::Meta(Target::Cuda), DeviceKind::META, DeviceKind::Cpu] {
        let device = Device::new(DeviceConfig::new(kind)).unwrap();
        for products in [Products::Bf16, Products::F16, Products::F32] {
            device.set_products(products).unwrap();
            assert_eq!(device.products(), products, "{kind:?}");
        }
    }
}
