//! `memfit bench`: per model, the median AdamW training-step time after warm-up and a steady-state
//! step's peak allocated and reserved bytes, on synthetic data.

use crate::error::TrainError;
use crate::samples::synthetic;
use crate::trainer::{median, RunOptions, Session};
use memfit_nn::{GptConfig, ModelKind, ModelSpec, OptimizerConfig};
use memfit_tensor::Device;
use serde::Serialize;

/// One benchmark case: a model and its batch.
#[derive(Clone, Copy, Debug)]
pub struct BenchCase {
    pub name: &'static str,
    pub spec: fn() -> ModelSpec,
    pub batch: usize,
}

/// The cases of `shared/pytorch-reference/torch_models.py` (and resnet): the GPT is L4 d256 h4 T128
/// with the reference's vocabulary of 96.
pub const CASES: [BenchCase; 5] = [
    BenchCase { name: "mlp-b256", spec: || ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10), batch: 256 },
    BenchCase { name: "simplecnn-b128", spec: || ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10), batch: 128 },
    BenchCase { name: "deepcnn-b64", spec: || ModelSpec::image(ModelKind::DeepCnn, [3, 64, 64], 10), batch: 64 },
    BenchCase { name: "resnet-b64", spec: || ModelSpec::image(ModelKind::ResNet, [3, 32, 32], 10), batch: 64 },
    BenchCase { name: "gpt-b32", spec: || ModelSpec::gpt(GptConfig::default()), batch: 32 },
];

#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    pub name: String,
    pub median_ms: f64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub steps: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub threads: usize,
    pub cases: Vec<CaseResult>,
}

/// Measures one case: `warmup` steps, then `steps` timed steps; the peaks are those of the timed
/// (steady-state, optimizer state present) steps.
pub fn run_case(case: &BenchCase, warmup: usize, steps: usize) -> Result<CaseResult, TrainError> {
    let spec = (case.spec)();
    let device = Device::cpu();
    let optimizer = OptimizerConfig::AdamW { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01 };
    let mut session = Session::new(device.clone(), &spec, optimizer, 0)?;
    let data = synthetic(&spec, case.batch * (warmup + steps), 0);
    let opts = |n: usize| RunOptions {
        effective_batch: case.batch,
        micro_batch: case.batch,
        eval_micro_batch: case.batch,
        epochs: 1,
        max_steps: Some(n),
        seed: 0,
        recover: false,
        grow_after: usize::MAX,
        record_samples: false,
    };
    session.run(data.as_ref(), None, &opts(warmup), &mut |_| {})?;
    device.allocator().reset_peak_stats();
    let timed = synthetic(&spec, case.batch * steps, 1);
    let outcome = session.run(timed.as_ref(), None, &opts(steps), &mut |_| {})?;
    let stats = device.stats();
    Ok(CaseResult {
        name: case.name.to_string(),
        median_ms: median(&outcome.step_times_ms),
        peak_allocated_bytes: stats.allocated_bytes.peak,
        peak_reserved_bytes: stats.reserved_bytes.peak,
        steps,
    })
}

/// Runs the cases (all when `only` is empty) on a pool of `threads` threads.
pub fn run(threads: usize, only: &[String], warmup: usize, steps: usize) -> Result<BenchReport, TrainError> {
    for name in only {
        if !CASES.iter().any(|c| c.name == name) {
            let names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
            return Err(TrainError::Invalid(format!(
                "unknown bench case {name:?}: expected one of {}",
                names.join(", ")
            )));
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Invalid(format!("cannot start {threads} worker threads: {e}")))?;
    let cases = pool.install(|| {
        CASES
            .iter()
            .filter(|c| only.is_empty() || only.iter().any(|n| n == c.name))
            .map(|c| run_case(c, warmup, steps))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(BenchReport { threads, cases })
}
