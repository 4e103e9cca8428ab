//! One `memfit train` job end to end: load the data, plan the micro-batch when a budget is given,
//! build the model on the chosen device, load a checkpoint, train, evaluate, save, and summarize.

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::planner::{self, Plan, PlanRequest};
use crate::samples::{Samples, SplitSamples, SyntheticSamples};
use crate::trainer::{RunOptions, RunOutcome, Session, StepEvent};
use memfit_nn::{ModelKind, ModelSpec};
use memfit_tensor::{Device, DeviceConfig, DeviceKind, MemoryStats};

/// `--data embedded` selects the subset shipped inside memfit even when the full set is installed.
pub const EMBEDDED: &str = "embedded";

/// Everything a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub config: TrainConfig,
    pub data_source: String,
    pub micro_batch: usize,
    pub accumulation_steps: usize,
    pub eval_micro_batch: usize,
    /// The plan, when the planner chose the micro-batch.
    pub plan: Option<Plan>,
    pub outcome: RunOutcome,
    pub stats: MemoryStats,
    pub capacity: Option<u64>,
    pub threads: usize,
}

/// What the job tells its caller while it runs.
pub trait Observer: Send {
    fn data_loaded(&mut self, _description: &str, _train: usize, _val: usize) {}
    fn planned(&mut self, _plan: &Plan) {}
    fn step(&mut self, _event: &StepEvent) {}
    fn evaluating(&mut self, _samples: usize) {}
}

/// An observer that ignores everything.
pub struct Quiet;
impl Observer for Quiet {}

/// The image spec of `kind` for inputs (C, H, W).
pub fn image_spec(kind: ModelKind, input: [usize; 3], classes: usize) -> Result<ModelSpec, TrainError> {
    if kind == ModelKind::Gpt {
        return Err(TrainError::Invalid(
            "the gpt model needs token data: `memfit train` trains the image models (mlp, simplecnn, deepcnn, resnet)"
                .into(),
        ));
    }
    Ok(ModelSpec::image(kind, input, classes))
}

/// Runs a training job on the rayon pool of `cfg.threads` threads.
pub fn train(cfg: &TrainConfig, observer: &mut dyn Observer) -> Result<RunSummary, TrainError> {
    let threads = cfg.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Invalid(format!("cannot start {threads} worker threads: {e}")))?;
    pool.install(|| train_in_pool(cfg, threads, observer))
}

fn train_in_pool(cfg: &TrainConfig, threads: usize, observer: &mut dyn Observer) -> Result<RunSummary, TrainError> {
    if cfg.batch_size == 0 {
        return Err(TrainError::Invalid("--batch-size must be at least 1".into()));
    }
    if cfg.micro_batch == Some(0) {
        return Err(TrainError::Invalid("--micro-batch must be at least 1".into()));
    }
    let data = match cfg.data.as_deref() {
        Some(dir) if dir.as_os_str() == EMBEDDED => memfit_data::load_embedded()?,
        dir => memfit_data::load_fashion_mnist(dir)?,
    };
    observer.data_loaded(&data.source.to_string(), data.train.len(), data.val.len());
    let train_samples = SplitSamples { split: &data.train };
    let val_samples = SplitSamples { split: &data.val };
    let spec = image_spec(cfg.model, train_samples.input_shape(), train_samples.num_classes())?;
    let optimizer = cfg.optimizer.config(cfg.lr);
    let request = PlanRequest {
        model: spec.clone(),
        optimizer,
        effective_batch: cfg.batch_size,
        capacity: cfg.memory,
        safety_margin: cfg.safety_margin,
        seed: cfg.seed,
    };

    // Choose the micro-batches: forced, planned under a budget, or the whole batch.
    let default_eval = cfg.batch_size;
    let (micro, eval_micro, plan) = match (cfg.micro_batch, cfg.memory) {
        (Some(m), _) => (m.min(cfg.batch_size), default_eval, None),
        (None, Some(_)) => {
            let plan = planner::plan(&request)?;
            observer.planned(&plan);
            (plan.micro_batch, plan.eval_micro_batch, Some(plan))
        }
        (None, None) => (cfg.batch_size, default_eval, None),
    };

    let device = Device::new(DeviceConfig::new(cfg.device).capacity(cfg.memory).fault(cfg.fault));
    let mut session = Session::new(device.clone(), &spec, optimizer, cfg.seed).map_err(|e| advise(e, &request))?;
    if let Some(path) = &cfg.load {
        if cfg.device == DeviceKind::Cpu {
            memfit_nn::checkpoint::load(path, session.model.as_ref())
                .map_err(|e| TrainError::Checkpoint(format!("cannot load checkpoint {}: {e}", path.display())))?;
        }
    }
    let opts = RunOptions {
        effective_batch: cfg.batch_size,
        micro_batch: micro,
        eval_micro_batch: eval_micro,
        epochs: cfg.epochs,
        max_steps: cfg.max_steps,
        seed: cfg.seed,
        recover: true,
        grow_after: 50,
        record_samples: cfg.record_samples,
    };
    let val: Option<&dyn Samples> = if cfg.evaluate { Some(&val_samples) } else { None };
    let outcome = {
        let mut on_step = |e: &StepEvent| observer.step(e);
        session.run(&train_samples, val, &opts, &mut on_step).map_err(|e| advise(e, &request))?
    };
    if let Some(path) = &cfg.save {
        if cfg.device == DeviceKind::Cpu {
            memfit_nn::checkpoint::save(path, session.model.as_ref())
                .map_err(|e| TrainError::Checkpoint(format!("cannot save checkpoint {}: {e}", path.display())))?;
        }
    }
    let stats = device.stats();
    Ok(RunSummary {
        config: cfg.clone(),
        data_source: data.source.to_string(),
        micro_batch: micro,
        accumulation_steps: cfg.batch_size.div_ceil(micro),
        eval_micro_batch: eval_micro,
        plan,
        outcome,
        stats,
        capacity: cfg.memory,
        threads,
    })
}

/// Turns an out-of-memory that recovery could not absorb into the explanation plus the planner's advice.
fn advise(e: TrainError, request: &PlanRequest) -> TrainError {
    let Some(oom) = e.as_oom().cloned() else { return e };
    let advice = match planner::predict(request, 1, Some(1), None) {
        Ok(Some(p)) => {
            let fits = request.capacity.is_some_and(|c| p.peak_reserved <= c);
            if fits {
                format!(
                    "memfit could not recover: micro-batch 1 needs {} (peak reserved), which fits; \
                     run `memfit plan --model {} --memory ... --batch-size {}` to see a configuration that fits.",
                    memfit_tensor::memory::format_bytes(p.peak_reserved),
                    request.model.kind.name(),
                    request.effective_batch
                )
            } else {
                format!(
                    "even a micro-batch of 1 needs {} (peak reserved): use --memory {} or more, or a smaller model.",
                    memfit_tensor::memory::format_bytes(p.peak_reserved),
                    memfit_tensor::memory::format_bytes(p.peak_reserved)
                )
            }
        }
        _ => String::new(),
    };
    TrainError::OutOfMemory { oom: Box::new(oom), advice }
}

/// Synthetic samples shaped like the model's input, for planning and benchmarks.
pub fn synthetic(spec: &ModelSpec, len: usize, seed: u64) -> SyntheticSamples {
    SyntheticSamples { len, shape: spec.input, classes: spec.num_classes, seed }
}
