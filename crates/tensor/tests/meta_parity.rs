//! `meta` refuses exactly what `cpu` refuses: every public op, given inputs of every dtype, either
//! succeeds on both devices or fails on both with the same message (a plan made on meta must not
//! accept a program cpu would reject), and succeeds on both for the dtypes it supports.

use memfit_tensor::ops::{self, Conv2dParams, Pool2dParams};
use memfit_tensor::{Category, DType, Device, Result, Tensor};

const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U8, DType::Bool];

/// A zero tensor of the dtype under test.
fn z(d: &Device, shape: &[usize], dtype: DType) -> Tensor {
    Tensor::zeros(d, shape, dtype, Category::Activation).unwrap()
}

/// Class indices (always int64).
fn idx(d: &Device, shape: &[usize]) -> Tensor {
    z(d, shape, DType::I64)
}

type Program = fn(&Device, DType) -> Result<()>;

/// Each op, with its float operands in the dtype under test.
fn programs() -> Vec<(&'static str, Program)> {
    vec![
        ("full", |d, t| Tensor::full(d, &[3], 1.0, t, Category::Activation).map(drop)),
        ("scalar", |d, t| Tensor::scalar(d, 1.0, t, Category::Activation).map(drop)),
        ("relu", |d, t| z(d, &[4], t).relu().map(drop)),
        ("gelu", |d, t| z(d, &[4], t).gelu().map(drop)),
        ("gelu_tanh", |d, t| z(d, &[4], t).gelu_tanh().map(drop)),
        ("tanh", |d, t| z(d, &[4], t).tanh().map(drop)),
        ("sigmoid", |d, t| z(d, &[4], t).sigmoid().map(drop)),
        ("silu", |d, t| z(d, &[4], t).silu().map(drop)),
        ("exp", |d, t| z(d, &[4], t).exp().map(drop)),
        ("log", |d, t| z(d, &[4], t).log().map(drop)),
        ("neg", |d, t| z(d, &[4], t).neg().map(drop)),
        ("relu6", |d, t| z(d, &[4], t).relu6().map(drop)),
        ("hardsigmoid", |d, t| z(d, &[4], t).hardsigmoid().map(drop)),
        ("hardswish", |d, t| z(d, &[4], t).hardswish().map(drop)),
        ("sqrt", |d, t| z(d, &[4], t).sqrt().map(drop)),
        ("rsqrt", |d, t| z(d, &[4], t).rsqrt().map(drop)),
        ("cos", |d, t| z(d, &[4], t).cos().map(drop)),
        ("sin", |d, t| z(d, &[4], t).sin().map(drop)),
        ("abs", |d, t| z(d, &[4], t).abs().map(drop)),
        ("pow", |d, t| z(d, &[4], t).pow_scalar(1.5).map(drop)),
        ("clamp", |d, t| z(d, &[4], t).clamp(-1.0, 1.0).map(drop)),
        ("hardtanh", |d, t| z(d, &[4], t).hardtanh(-1.0, 1.0).map(drop)),
        ("compare", |d, t| z(d, &[2, 3], t).compare(memfit_tensor::ops::Compare::Lt, &z(d, &[3], t)).map(drop)),
        ("where", |d, t| {
            let cond = z(d, &[2, 3], t).compare(memfit_tensor::ops::Compare::Eq, &z(d, &[3], t))?;
            memfit_tensor::ops::where_(&cond, &z(d, &[2, 3], t), &z(d, &[1], t)).map(drop)
        }),
        ("cat", |d, t| memfit_tensor::ops::cat(&[z(d, &[2, 3], t), z(d, &[2, 1], t)], 1).map(drop)),
        ("roll", |d, t| memfit_tensor::ops::roll(&z(d, &[3, 4], t), 1, 1).map(drop)),
        ("fill_ of a view", |d, t| z(d, &[3, 4], t).narrow(1, 1, 2)?.fill_(2.0)),
        ("pad", |d, t| memfit_tensor::ops::pad(&z(d, &[2, 5], t), &[1, -1, 2, 0], 1.5).map(drop)),
        ("slice_step", |d, t| z(d, &[2, 5], t).slice_step(1, 0, 5, 2).map(drop)),
        ("affine", |d, t| z(d, &[4], t).affine(2.0, 1.0).map(drop)),
        ("mul_scalar", |d, t| z(d, &[4], t).mul_scalar(2.0).map(drop)),
        ("add", |d, t| z(d, &[2, 3], t).add(&z(d, &[3], t)).map(drop)),
        ("sub", |d, t| z(d, &[2, 3], t).sub(&z(d, &[2, 3], t)).map(drop)),
        ("mul", |d, t| z(d, &[2, 3], t).mul(&z(d, &[2, 1], t)).map(drop)),
        ("div", |d, t| z(d, &[3], t).div(&z(d, &[3], t)).map(drop)),
        ("add_into", |d, t| ops::add_into(&z(d, &[3], t), &z(d, &[3], t))),
        ("add_accumulate", |d, t| ops::add_accumulate(z(d, &[3], t), &z(d, &[3], t)).map(drop)),
        ("matmul", |d, t| z(d, &[2, 3], t).matmul(&z(d, &[3, 4], t)).map(drop)),
        ("linear", |d, t| ops::linear(&z(d, &[2, 3], t), &z(d, &[4, 3], t), Some(&z(d, &[4], t))).map(drop)),
        ("gelu_linear", |d, t| ops::gelu_linear(&z(d, &[2, 3], t), &z(d, &[4, 3], t), None).map(drop)),
        ("layer_norm", |d, t| {
            ops::layer_norm(&z(d, &[2, 3], t), &[3], Some(&z(d, &[3], t)), Some(&z(d, &[3], t)), 1e-5).map(drop)
        }),
        ("layer_norm_linear", |d, t| {
            let x = z(d, &[2, 3], t);
            ops::layer_norm_linear(&x, &z(d, &[3], t), &z(d, &[3], t), 1e-5, &z(d, &[4, 3], t), None).map(drop)
        }),
        ("batch_norm", |d, t| {
            let x = z(d, &[2, 3, 2, 2], t);
            let (m, v) = (z(d, &[3], t), z(d, &[3], t));
            ops::batch_norm(&x, Some(&m), Some(&v), Some(&z(d, &[3], t)), None, true, 0.1, 1e-5).map(drop)
        }),
        ("softmax", |d, t| ops::softmax(&z(d, &[2, 3], t), -1).map(drop)),
        ("log_softmax", |d, t| ops::log_softmax(&z(d, &[2, 3], t), -1).map(drop)),
        ("cross_entropy", |d, t| ops::cross_entropy(&z(d, &[2, 3], t), &idx(d, &[2]), 0.0).map(drop)),
        ("nll_loss", |d, t| ops::nll_loss(&z(d, &[2, 3], t), &idx(d, &[2])).map(drop)),
        ("mse_loss", |d, t| ops::mse_loss(&z(d, &[2, 3], t), &z(d, &[2, 3], t)).map(drop)),
        ("embedding", |d, t| ops::embedding(&idx(d, &[2]), &z(d, &[5, 3], t)).map(drop)),
        ("embedding indices", |d, t| ops::embedding(&z(d, &[2], t), &z(d, &[5, 3], DType::F32)).map(drop)),
        ("conv2d", |d, t| {
            ops::conv2d(&z(d, &[1, 2, 4, 4], t), &z(d, &[3, 2, 3, 3], t), None, Conv2dParams::default()).map(drop)
        }),
        ("max_pool2d", |d, t| ops::max_pool2d(&z(d, &[1, 2, 4, 4], t), Pool2dParams::square(2)).map(drop)),
        ("avg_pool2d", |d, t| ops::avg_pool2d(&z(d, &[1, 2, 4, 4], t), Pool2dParams::square(2), true).map(drop)),
        ("adaptive_avg_pool2d", |d, t| ops::adaptive_avg_pool2d(&z(d, &[1, 2, 4, 4], t), [1, 1]).map(drop)),
        ("sum_to_shape", |d, t| ops::sum_to_shape(&z(d, &[2, 3], t), &[3]).map(drop)),
        ("sum_dim", |d, t| z(d, &[2, 3], t).sum_dim(0, false).map(drop)),
        ("mean_dim", |d, t| z(d, &[2, 3], t).mean_dim(1, true).map(drop)),
        ("sum_all", |d, t| z(d, &[2, 3], t).sum_all().map(drop)),
        ("mean_all", |d, t| z(d, &[2, 3], t).mean_all().map(drop)),
        ("max_dim", |d, t| z(d, &[2, 3], t).max_dim(1, false).map(drop)),
        ("max_all", |d, t| z(d, &[2, 3], t).max_all().map(drop)),
        ("dropout", |d, t| ops::dropout(&z(d, &[8], t), 0.5, true, 7).map(drop)),
        ("contiguous", |d, t| z(d, &[2, 3], t).transpose(0, 1)?.contiguous().map(drop)),
        ("to_dtype f32", |d, t| z(d, &[3], t).to_dtype(DType::F32).map(drop)),
        ("to_dtype bf16", |d, t| z(d, &[3], t).to_dtype(DType::BF16).map(drop)),
        ("to_dtype i64", |d, t| z(d, &[3], t).to_dtype(DType::I64).map(drop)),
        ("copy_from", |d, t| z(d, &[3], t).copy_from(&z(d, &[3], t))),
        ("attention", |d, t| {
            let q = z(d, &[1, 2, 4, 8], t);
            ops::scaled_dot_product_attention(&q, &z(d, &[1, 2, 4, 8], t), &z(d, &[1, 2, 4, 8], t), true, None)
                .map(drop)
        }),
        ("attention mask", |d, t| {
            let q = z(d, &[1, 2, 4, 8], DType::F32);
            let mask = z(d, &[4, 4], t);
            ops::scaled_dot_product_attention(&q, &q, &q, false, Some(&mask)).map(drop)
        }),
        ("packed_self_attention", |d, t| ops::packed_self_attention(&z(d, &[1, 4, 12], t), 2, true, None).map(drop)),
        ("sgd_update", |d, t| {
            let p = z(d, &[3], t);
            ops::sgd_update(&p, &z(d, &[3], t), Some(&z(d, &[3], t)), true, 0.1, 0.9, 0.0, false, 0.0).map(drop)
        }),
        ("adam_update", |d, t| {
            let p = z(d, &[3], t);
            let (m, v) = (z(d, &[3], t), z(d, &[3], t));
            ops::adam_update(&p, &z(d, &[3], t), &m, &v, 1, 1e-3, (0.9, 0.999), 1e-8, 0.0, false).map(drop)
        }),
        ("unscale_", |d, t| ops::unscale_(&[&z(d, &[3], t)], 0.5).map(drop)),
    ]
}

/// Ok, or the error's message.
fn outcome(program: Program, device: &Device, dtype: DType) -> std::result::Result<(), String> {
    program(device, dtype).map_err(|e| e.to_string())
}

#[test]
fn meta_accepts_and_refuses_exactly_what_cpu_does() {
    let (cpu, meta) = (Device::cpu(), Device::meta());
    let mut differences = Vec::new();
    for (name, program) in programs() {
        for dtype in DTYPES {
            let (on_cpu, on_meta) = (outcome(program, &cpu, dtype), outcome(program, &meta, dtype));
            if on_cpu != on_meta {
                differences.push(format!("{name} {dtype}: cpu {on_cpu:?}, meta {on_meta:?}"));
            }
        }
    }
    assert!(differences.is_empty(), "meta and cpu disagree:\n{}", differences.join("\n"));
}

#[test]
fn every_op_runs_on_both_devices_for_f32_and_f64() {
    for device in [Device::cpu(), Device::meta()] {
        for (name, program) in programs() {
            if name.ends_with("indices") || name.ends_with("mask") || name == "to_dtype i64" {
                continue; // these vary a non-float operand; its f32/f64 form is an error by design
            }
            for dtype in [DType::F32, DType::F64] {
                if let Err(e) = program(&device, dtype) {
                    panic!("{name} {dtype} on {}: {e}", device.kind());
                }
            }
        }
    }
}
