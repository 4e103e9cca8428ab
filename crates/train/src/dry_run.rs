//! One dry run of the real trainer on `meta`, shared by every planner (one device, ranks, pipeline
//! stages): the request ([`PlanRequest`]), the program a dry run executes, and what it peaked at
//! ([`Prediction`]).
//!
//! Note [Bounded planning]: the planner's work does not grow with the batch. A dry run's window is
//! [`representative_window`]: the micro-batches of a real window are a first one (which creates the
//! gradients), identical middle ones (each leaves the allocator as it found it) and a last, possibly
//! partial one, so a window of the first two and the last has the peak of any window of the same
//! micro-batches (`train/tests/planning.rs` checks it against full windows). Where a run reaches an
//! epoch's end and its data leaves a last window smaller than the batch, the dry run trains that
//! window too, compressed the same way, after its whole windows and before one more: its smaller
//! micro-batches can leave the cache holding other segments (a GPT epoch on Moby Dick reserved 4-10
//! MiB past a prediction made of whole windows only). Candidate micro-batches are searched up to
//! [`search_limit`]: no micro-batch fits whose inputs alone exceed the budget.

use crate::config::ParallelMode;
use crate::error::TrainError;
use crate::samples::{synthetic, Samples};
use crate::trainer::{RunOptions, Session};
use memfit_nn::{ModelInput, ModelSpec, OptimizerConfig};
use memfit_tensor::{Category, Device, DeviceConfig, DeviceKind};

/// Optimizer steps in a planning dry run.
pub const PLAN_STEPS: usize = 3;
/// The largest evaluation micro-batch the planner considers.
pub const MAX_EVAL_MICRO: usize = 1024;
/// The largest training micro-batch the planner considers, whatever the budget: a dry run walks the
/// ids of a few micro-batches on the host, and beyond this a batch's host-side inputs outweigh any
/// device saving (a 10^9 batch with a 1024 TiB budget used to exhaust the host's memory).
pub const MAX_MICRO: usize = 1 << 16;

#[derive(Clone, Debug)]
pub struct PlanRequest {
    pub model: ModelSpec,
    pub optimizer: OptimizerConfig,
    pub effective_batch: usize,
    /// The device's capacity; None = unlimited (everything fits).
    pub capacity: Option<u64>,
    /// Fraction of the capacity to keep free (0.0 - 0.5).
    pub safety_margin: f64,
    pub seed: u64,
    /// Segments that run with activation checkpointing (the dry runs apply it too).
    pub checkpoint: crate::config::CheckpointChoice,
    /// Where step times come from when the planner weighs configurations (`--checkpoint auto`).
    pub costs: crate::cost::Costs,
    /// A micro-batch the user fixed (`plan --micro-batch`): the plan keeps it and fits the rest.
    pub micro_batch: Option<usize>,
    /// The dtype of saved activations; `auto` lets the planner weigh bf16 storage too.
    pub precision: crate::config::Precision,
    /// Training as `size` ranks in `mode` (`effective_batch` is then the global batch): every
    /// prediction is the largest of the ranks' (Note [Data parallel]).
    pub parallel: Option<(ParallelMode, usize)>,
    /// The machine the run is for: its dry runs imitate it (`meta:cuda` for a GPU run).
    pub target: memfit_tensor::Target,
    /// The allocator's segments (`auto`: the planner tries fixed, then expandable; a dry run of an
    /// unresolved `auto` uses fixed).
    pub segments: crate::config::Segments,
    /// The run evaluates after training (`--no-eval`: false): the plan's prediction includes it.
    pub evaluate: bool,
    /// Where the optimizer steps (`auto`: the planner tries after backward, then inside it; a dry
    /// run of an unresolved `auto` steps after).
    pub optimizer_step: crate::config::OptimizerStep,
    /// The samples of an epoch's last window, where the data leaves fewer than `effective_batch`
    /// after whole windows and the run trains that far (None: every window it trains is whole; what
    /// `memfit plan`, which knows no run length, assumes). Dry runs then train one between whole
    /// windows, as a run does at each epoch's end (Note [Bounded planning]).
    pub last_window: Option<usize>,
}

impl PlanRequest {
    /// The samples of each window one rank trains on: the whole effective batch alone, the largest
    /// shard with ranks (rank 0's; Note [Data parallel]).
    pub fn rank_batch(&self) -> usize {
        match self.parallel {
            Some((_, size)) => memfit_dist::partition::shard(self.effective_batch, 0, size).len(),
            None => self.effective_batch,
        }
    }

    /// Whether the optimizer can step inside backward in this run (Note [Step in backward]): not
    /// with ranks, which sum gradients first, nor with fp16 storage, which skips a window whose
    /// gradients overflowed.
    pub fn steps_in_backward_allowed(&self) -> bool {
        self.parallel.is_none() && self.precision != crate::config::Precision::Fp16
    }

    /// The capacity the plan must fit in: the budget less the margin.
    pub fn budget(&self) -> Option<u64> {
        self.capacity.map(|c| (c as f64 * (1.0 - self.safety_margin)).floor() as u64)
    }
}

/// Predicted memory of a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prediction {
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// Allocated bytes per category at the moment of the overall peak.
    pub at_peak: [u64; Category::COUNT],
    /// Each category's own peak.
    pub category_peaks: [u64; Category::COUNT],
}

impl Prediction {
    /// The category holding the most bytes at the peak.
    pub fn dominant(&self) -> Category {
        Category::ALL.into_iter().max_by_key(|c| self.at_peak[c.index()]).unwrap_or(Category::Other)
    }
}

/// Dry-runs `micro` (and an evaluation micro-batch, when given) on `meta` with `capacity`. None when it
/// does not fit. With ranks, the prediction of the rank with the highest peak (rank 0 holds the largest
/// shard; under ZeRO-1 every rank is run, as their optimizer state differs); None when any rank does
/// not fit.
pub fn predict(
    req: &PlanRequest,
    micro: usize,
    eval_micro: Option<usize>,
    capacity: Option<u64>,
) -> Result<Option<Prediction>, TrainError> {
    let Some((mode, size)) = req.parallel else { return predict_rank(req, None, micro, eval_micro, capacity) };
    let ranks = if mode == ParallelMode::Data { 1 } else { size };
    let mut worst: Option<Prediction> = None;
    for rank in 0..ranks {
        let Some(p) = predict_rank(req, Some(rank), micro, eval_micro, capacity)? else { return Ok(None) };
        if worst.as_ref().is_none_or(|w| p.peak_reserved > w.peak_reserved) {
            worst = Some(p);
        }
    }
    Ok(worst)
}

/// [`predict`] for one rank (`rank` of `req.parallel`; None without ranks).
pub fn predict_rank(
    req: &PlanRequest,
    rank: Option<usize>,
    micro: usize,
    eval_micro: Option<usize>,
    capacity: Option<u64>,
) -> Result<Option<Prediction>, TrainError> {
    let ranks = req.parallel.zip(rank);
    let program = dry_run_rank(req, ranks.map(|((_, size), rank)| (rank, size)), micro, eval_micro.unwrap_or(1), 1);
    dry_run_on(req, capacity, program, eval_micro.is_some(), |device| {
        let mut session = Session::new(device, &req.model, req.optimizer, req.seed)?;
        if let Some(((mode, size), rank)) = ranks {
            session.join(std::sync::Arc::new(memfit_dist::Simulated { rank, size }), mode)?;
        }
        Ok(session)
    })
}

/// Runs `program` (training samples, evaluation samples, options; evaluation only when `evaluate`)
/// with the session `build` makes on a fresh `meta` device of `capacity`, imitating `req`'s target
/// with its checkpointing and precision: the prediction, or None when it does not fit (out of memory
/// anywhere, the session's setup included). Every planner's dry run: one device, a rank, a stage.
pub fn dry_run_on(
    req: &PlanRequest,
    capacity: Option<u64>,
    program: DryRun,
    evaluate: bool,
    build: impl FnOnce(Device) -> Result<Session, TrainError>,
) -> Result<Option<Prediction>, TrainError> {
    // A GPU target's device holds cuBLAS's workspace from the start: a capacity below it fits nothing.
    let config =
        DeviceConfig::new(DeviceKind::Meta(req.target)).capacity(capacity).expandable(req.segments.expandable());
    let device = match Device::new(config) {
        Ok(d) => d,
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut session = match build(device.clone()) {
        Ok(s) => s,
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e),
    };
    session.set_checkpointing(&req.checkpoint)?;
    session.set_precision(req.precision)?;
    // The doctor's remedies with ranks keep the request's placement, which ranks cannot take (a
    // run refuses that pairing before any work): they step after backward.
    let step = match req.steps_in_backward_allowed() {
        true => req.optimizer_step,
        false => crate::config::OptimizerStep::After,
    };
    session.set_optimizer_step(step)?;
    match program.run(&mut session, evaluate, false) {
        Ok(_) => Ok(Some(prediction_of(&device))),
        Err(e) if e.as_oom().is_some() => Ok(None),
        Err(e) => Err(e),
    }
}

/// What a dry run trains and evaluates (Note [Bounded planning]): phases run one after another on
/// one session (windows of synthetic samples shaped like the model's input), then one evaluation
/// micro-batch.
pub struct DryRun {
    /// `PLAN_STEPS` whole windows; where the request has an epoch's last window, that window, then
    /// one more whole window (the next epoch's first).
    pub phases: Vec<(Box<dyn Samples>, RunOptions)>,
    pub val: Box<dyn Samples>,
}

impl DryRun {
    /// Runs the phases on `session` in order, with recovery when `recover`, evaluating after the last
    /// when `evaluate`: the out-of-memory recoveries of all of them.
    pub fn run(&self, session: &mut Session, evaluate: bool, recover: bool) -> Result<usize, TrainError> {
        let mut recoveries = 0;
        for (i, (train, opts)) in self.phases.iter().enumerate() {
            let val: Option<&dyn Samples> = (evaluate && i + 1 == self.phases.len()).then_some(self.val.as_ref());
            let opts = RunOptions { recover, ..opts.clone() };
            recoveries += session.run(train.as_ref(), val, &opts, &mut |_| {})?.oom_recoveries;
        }
        Ok(recoveries)
    }
}

/// What a dry run on `device` peaked at.
pub fn prediction_of(device: &Device) -> Prediction {
    let stats = device.stats();
    let mut category_peaks = [0; Category::COUNT];
    for c in Category::ALL {
        category_peaks[c.index()] = stats.category(c).peak;
    }
    Prediction {
        peak_allocated: stats.allocated_bytes.peak,
        peak_reserved: stats.reserved_bytes.peak,
        at_peak: stats.category_at_peak,
        category_peaks,
    }
}

/// The program a dry run executes ([`DryRun`]) for training micro-batches of `micro` and an
/// evaluation micro-batch of `eval_micro`. Running it on `cpu` with the same capacity reproduces the
/// prediction exactly.
pub fn dry_run(req: &PlanRequest, micro: usize, eval_micro: usize) -> DryRun {
    dry_run_rank(req, None, micro, eval_micro, 1)
}

/// [`dry_run`] for a pipeline stage, whose window runs in rounds of `round` micro-batches (Note
/// [Pipeline]): a round plays the part of a micro-batch in the representative window.
pub fn dry_run_rounds(req: &PlanRequest, micro: usize, eval_micro: usize, round: usize) -> DryRun {
    dry_run_rank(req, None, micro, eval_micro, round)
}

/// [`dry_run`] as rank `rank` of `size`: windows of `size` times that rank's representative shard, so
/// that its shard of each is exactly what it trains on in a real window (Note [Data parallel]).
fn dry_run_rank(
    req: &PlanRequest,
    rank: Option<(usize, usize)>,
    micro: usize,
    eval_micro: usize,
    round: usize,
) -> DryRun {
    let (r, size) = rank.unwrap_or((0, 1));
    // This rank's shard of a window of `n` samples, compressed (Note [Bounded planning]), times the
    // ranks: a window whose shard of each rank is what that rank trains on.
    let compressed = |n: usize| {
        let local = memfit_dist::partition::shard(n, r, size).len();
        let kept = match round {
            _ if local == 0 => 0,
            1 => representative_window(local, micro),
            _ => representative_window(local, micro.saturating_mul(round)).min(local),
        };
        kept * size
    };
    let window = compressed(req.effective_batch).max(size);
    let phase = |windows: usize, samples: usize| {
        let opts = RunOptions {
            effective_batch: samples,
            micro_batch: micro,
            eval_micro_batch: eval_micro,
            epochs: Some(1),
            max_steps: Some(windows),
            data_seed: req.seed,
            recover: false,
            grow_after: usize::MAX,
            record_samples: false,
        };
        (synthetic(&req.model, windows * samples, req.seed), opts)
    };
    let mut phases = vec![phase(PLAN_STEPS, window)];
    // An epoch's last window, then the next epoch's first.
    let last = req.last_window.filter(|&n| n < req.effective_batch).map_or(0, compressed);
    if last > 0 {
        phases.extend([phase(1, last), phase(1, window)]);
    }
    DryRun { phases, val: synthetic(&req.model, eval_micro * size, req.seed) }
}

/// The window a dry run trains on for an effective batch of `effective` in micro-batches of `micro`
/// (Note [Bounded planning]): the whole batch when it takes at most three micro-batches, else two full
/// micro-batches and the last, partial or full, one: at most `3 * micro` samples.
pub fn representative_window(effective: usize, micro: usize) -> usize {
    let micro = micro.clamp(1, effective.max(1));
    let parts = effective.div_ceil(micro);
    if parts <= 3 {
        return effective;
    }
    let last = effective - (parts - 1) * micro;
    2 * micro + last
}

/// The largest micro-batch worth a dry run under `budget` (Note [Bounded planning]): `high`, or fewer
/// when the inputs of that many samples alone exceed the budget.
pub fn search_limit(model: &ModelSpec, high: usize, budget: Option<u64>) -> usize {
    let Some(budget) = budget else { return high.max(1) };
    let per_sample = match model.input_kind() {
        ModelInput::Image { shape: [c, h, w], .. } => {
            (c as u64 * h as u64 * w as u64).saturating_mul(4).saturating_add(8)
        }
        ModelInput::Tokens { context, .. } => (context as u64).saturating_mul(16),
    };
    let fit = budget / per_sample.max(1);
    high.min(usize::try_from(fit).unwrap_or(usize::MAX)).max(1)
}
