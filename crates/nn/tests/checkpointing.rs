//! Activation checkpointing of every zoo model's segments (GPT blocks, ResNet stages, CNN stages):
//! a training step's gradients and batch-norm running statistics equal the plain step's bit for
//! bit, the checkpointed step keeps less between forward and backward, and `meta` predicts its
//! allocations exactly.

use memfit_nn::{build_model, GptConfig, ModelKind, ModelSpec};
use memfit_tensor::{autograd, ops, Category, DType, Device, Phase, Tensor};

fn specs() -> Vec<ModelSpec> {
    vec![
        ModelSpec::image(ModelKind::SimpleCnn, [1, 12, 12], 10),
        ModelSpec::image(ModelKind::DeepCnn, [3, 16, 16], 10),
        ModelSpec::image(ModelKind::ResNet, [3, 16, 16], 10),
        ModelSpec::gpt(GptConfig { vocab: 20, d_model: 32, heads: 4, layers: 3, max_t: 16 }),
    ]
}

/// A deterministic batch of 4 samples (images, or token windows with next-token targets).
fn batch(spec: &ModelSpec, device: &Device) -> (Tensor, Tensor) {
    if spec.kind == ModelKind::Gpt {
        let (b, t) = (4, spec.gpt.max_t);
        let ids: Vec<i64> = (0..b * (t + 1)).map(|i| ((i * 7 + 3) % spec.gpt.vocab) as i64).collect();
        let x: Vec<i64> = (0..b).flat_map(|r| ids[r * (t + 1)..r * (t + 1) + t].to_vec()).collect();
        let y: Vec<i64> = (0..b).flat_map(|r| ids[r * (t + 1) + 1..(r + 1) * (t + 1)].to_vec()).collect();
        let x = Tensor::from_slice(device, &x, &[b, t], Category::Input).unwrap();
        let y = Tensor::from_slice(device, &y, &[b * t], Category::Input).unwrap();
        return (x, y);
    }
    let [c, h, w] = spec.input;
    let n = 4 * c * h * w;
    let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let x = Tensor::from_slice(device, &x, &[4, c, h, w], Category::Input).unwrap();
    let y = Tensor::from_slice(device, &[1i64, 7, 3, 0], &[4], Category::Input).unwrap();
    (x, y)
}

struct Step {
    grads: Vec<Vec<u8>>,
    buffers: Vec<Vec<u8>>,
    peak: u64,
    /// Allocated bytes between forward and backward (what autograd keeps).
    held: u64,
    allocations: u64,
    requested: u64,
}

fn bytes(t: &Tensor) -> Vec<u8> {
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::I64 => t.to_vec::<i64>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::Bool => t.to_vec::<bool>().unwrap().iter().map(|&v| v as u8).collect(),
        other => panic!("unexpected dtype {other}"),
    }
}

/// One training forward and backward with every segment checkpointed or none.
fn step(spec: &ModelSpec, device: &Device, checkpointed: bool) -> Step {
    let model = build_model(spec, device, 3).unwrap();
    let segments = model.checkpointing().expect("the model has segments");
    assert!(!segments.names().is_empty());
    segments.set(&vec![checkpointed; segments.names().len()]).unwrap();
    let (x, y) = batch(spec, device);
    device.reset_peak_stats();
    let held;
    {
        let _p = device.enter_phase(Phase::Forward);
        let logits = model.forward(&x, true).unwrap();
        let classes = *logits.shape().last().unwrap() as isize;
        let loss = ops::cross_entropy(&logits.reshape(&[-1, classes]).unwrap(), &y, 0.0).unwrap();
        drop(logits);
        held = device.stats().allocated_bytes.current;
        autograd::backward(&loss).unwrap();
    }
    let stats = device.stats();
    let computes = device.computes();
    Step {
        grads: if computes {
            model.parameters().iter().map(|(_, p)| bytes(&p.grad().unwrap())).collect()
        } else {
            vec![]
        },
        buffers: if computes { model.buffers().iter().map(|(_, b)| bytes(b)).collect() } else { vec![] },
        peak: stats.allocated_bytes.peak,
        held,
        allocations: stats.allocation.allocated,
        requested: stats.requested_bytes.allocated,
    }
}

#[test]
fn checkpointed_segments_give_the_plain_gradients_and_running_statistics() {
    for spec in specs() {
        let plain = step(&spec, &Device::cpu(), false);
        let ckpt = step(&spec, &Device::cpu(), true);
        let name = spec.kind.name();
        assert_eq!(plain.grads, ckpt.grads, "{name}: gradients differ");
        assert_eq!(plain.buffers, ckpt.buffers, "{name}: buffers (running statistics) differ");
        assert!(ckpt.held < plain.held, "{name}: checkpointed keeps {} bytes, plain {}", ckpt.held, plain.held);
    }
}

#[test]
fn meta_predicts_checkpointed_steps_exactly() {
    for spec in specs() {
        for checkpointed in [false, true] {
            let cpu = step(&spec, &Device::cpu(), checkpointed);
            let meta = step(&spec, &Device::meta(), checkpointed);
            let name = spec.kind.name();
            assert_eq!(
                (cpu.peak, cpu.held, cpu.allocations, cpu.requested),
                (meta.peak, meta.held, meta.allocations, meta.requested),
                "{name} checkpointed={checkpointed}"
            );
        }
    }
}
