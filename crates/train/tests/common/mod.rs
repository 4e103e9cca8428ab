//! Shared helpers for the trainer's integration tests.
#![allow(dead_code)]

use memfit_nn::{ModelKind, ModelSpec, OptimizerConfig};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::{Device, DeviceConfig, DeviceKind};
use memfit_train::samples::{Samples, SyntheticSamples};
use memfit_train::trainer::RunOutcome;
use memfit_train::{RunOptions, Session};

pub fn adamw() -> OptimizerConfig {
    OptimizerConfig::adamw(1e-3)
}

pub fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 1e-4 }
}

pub fn small_spec(kind: ModelKind) -> ModelSpec {
    ModelSpec::image(kind, [1, 12, 12], 10)
}

pub fn device(kind: DeviceKind, capacity: Option<u64>, fault: Option<FaultInjection>) -> Device {
    Device::new(DeviceConfig::new(kind).capacity(capacity).fault(fault)).unwrap()
}

pub fn opts(effective: usize, micro: usize, steps: usize) -> RunOptions {
    RunOptions {
        effective_batch: effective,
        micro_batch: micro,
        eval_micro_batch: effective,
        epochs: Some(1),
        max_steps: Some(steps),
        data_seed: 7,
        recover: true,
        grow_after: 3,
        record_samples: true,
    }
}

/// A small GPT (fast on cpu, several allocations per op family).
pub fn tiny_gpt(vocab: usize) -> ModelSpec {
    ModelSpec::gpt(memfit_nn::GptConfig { vocab, d_model: 16, heads: 2, layers: 2, max_t: 12 })
}

pub fn data(spec: &ModelSpec, len: usize) -> SyntheticSamples {
    SyntheticSamples { len, shape: spec.input, classes: spec.num_classes, seed: 11 }
}

/// Runs `opts` on a fresh session and returns the outcome and the final parameters.
pub fn run(
    device: Device,
    spec: &ModelSpec,
    optimizer: OptimizerConfig,
    samples: &dyn Samples,
    opts: &RunOptions,
) -> (RunOutcome, Vec<(String, Vec<f64>)>, Session) {
    let mut session = Session::new(device, spec, optimizer, 3).expect("session");
    let outcome = session.run(samples, None, opts, &mut |_| {}).expect("run");
    let params =
        session.model.parameters().into_iter().map(|(n, t)| (n, t.to_f64_vec().expect("cpu tensor"))).collect();
    (outcome, params, session)
}

/// Golden-style comparison: |a - b| <= rtol*|b| + rtol*max|b| per tensor.
pub fn assert_params_close(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)], rtol: f64, what: &str) {
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let max = vb.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (x, y)) in va.iter().zip(vb).enumerate() {
            assert!((x - y).abs() <= rtol * y.abs() + rtol * max, "{what}: parameter {na}[{i}] differs: {x} vs {y}");
        }
    }
}

/// Each step's samples as a sorted list: recovery may reorder the samples inside a step, never change them.
pub fn sorted(log: &[Vec<usize>]) -> Vec<Vec<usize>> {
    log.iter()
        .map(|w| {
            let mut w = w.clone();
            w.sort_unstable();
            w
        })
        .collect()
}

/// Runs `plan`'s configuration (its segments, precision, optimizer step and micro-batches, as a dry
/// run's program)
/// on `cpu` with `capacity` and recovery on: it must never run out of memory and must peak exactly
/// where meta predicted (invariant 8).
pub fn assert_plan_holds_on_cpu(req: &memfit_train::PlanRequest, plan: &memfit_train::Plan, capacity: u64) {
    let fixed = memfit_train::PlanRequest {
        checkpoint: plan.checkpoint.clone(),
        precision: plan.precision,
        parallel: None,
        target: memfit_tensor::Target::Cpu,
        segments: plan.segments,
        evaluate: true,
        optimizer_step: plan.optimizer_step,
        capacity: Some(capacity),
        ..req.clone()
    };
    let dev =
        Device::new(DeviceConfig::new(DeviceKind::Cpu).capacity(Some(capacity)).expandable(plan.segments.expandable()))
            .unwrap();
    let mut session = Session::new(dev.clone(), &fixed.model, fixed.optimizer, fixed.seed).unwrap();
    session.set_checkpointing(&fixed.checkpoint).unwrap();
    session.set_precision(fixed.precision).unwrap();
    session.set_optimizer_step(fixed.optimizer_step).unwrap();
    let recoveries = memfit_train::planner::dry_run(&fixed, plan.micro_batch, plan.eval_micro_batch)
        .run(&mut session, true, true)
        .unwrap();
    let stats = dev.stats();
    assert_eq!((stats.num_ooms, recoveries), (0, 0), "the planned run never ran out of memory");
    assert_eq!(stats.reserved_bytes.peak, plan.predicted.peak_reserved);
    assert_eq!(stats.allocated_bytes.peak, plan.predicted.peak_allocated);
}

/// A plan request for `model` at `effective` samples a step under `capacity`, with the planner's
/// defaults (AdamW, seed 5, no margin, nothing fixed) on the cpu target.
pub fn plan_request(model: ModelSpec, effective: usize, capacity: Option<u64>) -> memfit_train::planner::PlanRequest {
    memfit_train::planner::PlanRequest {
        model,
        optimizer: adamw(),
        effective_batch: effective,
        capacity,
        safety_margin: 0.0,
        seed: 5,
        checkpoint: Default::default(),
        costs: Default::default(),
        micro_batch: None,
        precision: Default::default(),
        parallel: None,
        target: memfit_tensor::Target::Cpu,
        segments: Default::default(),
        evaluate: true,
        optimizer_step: Default::default(),
        last_window: None,
    }
}
