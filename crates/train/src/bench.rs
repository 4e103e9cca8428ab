//! `memfit bench`: per model, the median AdamW training-step time after warm-up and a steady-state
//! step's peak allocated and reserved bytes, on synthetic data.

use crate::error::TrainError;
use crate::job::{image_spec, synthetic};
use crate::samples::Samples;
use crate::trainer::{median, RunOptions, Session};
use memfit_nn::{ModelKind, OptimizerConfig};
use memfit_tensor::Device;
use serde::Serialize;

/// One benchmark case: a model, its input shape (C, H, W) and batch.
#[derive(Clone, Copy, Debug)]
pub struct BenchCase {
    pub name: &'static str,
    pub model: ModelKind,
    pub input: [usize; 3],
    pub batch: usize,
}

pub const CASES: [BenchCase; 4] = [
    BenchCase { name: "mlp-b256", model: ModelKind::Mlp, input: [1, 28, 28], batch: 256 },
    BenchCase { name: "simplecnn-b128", model: ModelKind::SimpleCnn, input: [1, 28, 28], batch: 128 },
    BenchCase { name: "deepcnn-b64", model: ModelKind::DeepCnn, input: [3, 64, 64], batch: 64 },
    BenchCase { name: "resnet-b64", model: ModelKind::ResNet, input: [3, 32, 32], batch: 64 },
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
    let spec = image_spec(case.model, case.input, 10)?;
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
    session.run(&data, None, &opts(warmup), &mut |_| {})?;
    device.allocator().reset_peak_stats();
    let timed = synthetic(&spec, case.batch * steps, 1);
    debug_assert_eq!(timed.len(), case.batch * steps);
    let outcome = session.run(&timed, None, &opts(steps), &mut |_| {})?;
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
