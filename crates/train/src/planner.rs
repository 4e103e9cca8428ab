//! The planner: fits an effective batch into a memory budget by dry-running the real trainer on the
//! `meta` device (same code, same allocator policy, no compute) for candidate micro-batches.
//!
//! A candidate is run for [`PLAN_STEPS`] optimizer steps (the first allocates the optimizer state,
//! the rest are the steady state) and one evaluation micro-batch, on a `meta` device whose capacity
//! is the budget less the safety margin, with recovery off: it fits when no allocation fails. The
//! prediction is exact for a run of the same steps on `cpu` with at least that capacity, because the
//! allocation sequence is the same (the invariant `meta == cpu`).
//!
//! Note [Bounded planning]: the planner's work does not grow with the batch. A dry run's window is
//! [`representative_window`]: the micro-batches of a real window are a first one (which creates the
//! gradients), identical middle ones (each leaves the allocator as it found it) and a last, possibly
//! partial one, so a window of the first two and the last has the peak of any window of the same
//! micro-batches (`train/tests/planning.rs` checks it against full windows). Candidate micro-batches
//! are searched up to [`search_limit`]: no micro-batch fits whose inputs alone exceed the budget.

use crate::config::CheckpointChoice;
use crate::error::TrainError;
use crate::samples::{synthetic, Samples};
use crate::trainer::{RunOptions, Session};
use memfit_nn::{ModelInput, ModelSpec, OptimizerConfig};
use memfit_tensor::memory::format_bytes;
use memfit_tensor::{Category, Device, DeviceConfig, DeviceKind};
use std::time::Instant;

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
    pub parallel: Option<(crate::parallel::ParallelMode, usize)>,
    /// The machine the run is for: its dry runs imitate it (`meta:cuda` for a GPU run).
    pub target: memfit_tensor::Target,
    /// The run evaluates after training (`--no-eval`: false): the plan's prediction includes it.
    pub evaluate: bool,
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

/// "micro-batch 16 x 4 accumulation steps = effective batch 64", exact when the last micro-batch is
/// smaller ("micro-batch 13 x 5 accumulation steps, the last of 12, = effective batch 64").
pub fn window_words(effective: usize, micro: usize) -> String {
    let micro = micro.clamp(1, effective.max(1));
    let parts = effective.div_ceil(micro).max(1);
    let last = effective - (parts - 1) * micro;
    let steps = if parts == 1 { "step" } else { "steps" };
    match last == micro {
        true => format!("micro-batch {micro} x {parts} accumulation {steps} = effective batch {effective}"),
        false => format!(
            "micro-batch {micro} x {parts} accumulation {steps}, the last of {last}, = effective batch {effective}"
        ),
    }
}

/// A chosen configuration.
#[derive(Clone, Debug)]
pub struct Plan {
    pub micro_batch: usize,
    pub accumulation_steps: usize,
    pub effective_batch: usize,
    pub eval_micro_batch: usize,
    /// The run evaluates after training: `predicted` includes an evaluation micro-batch.
    pub evaluates: bool,
    pub budget: Option<u64>,
    /// The whole dry run: training steps and an evaluation micro-batch (when the run evaluates).
    pub predicted: Prediction,
    /// The training steps alone (what a training step holds at its peak).
    pub training: Prediction,
    /// (micro-batch, predicted peak reserved with unlimited memory) of a larger configuration, when
    /// the chosen one is limited by the budget: what a larger budget would allow.
    pub larger: Option<(usize, u64)>,
    /// Dry runs made.
    pub dry_runs: usize,
    pub planning_ms: f64,
    /// The activation checkpointing the plan assumes (`auto` resolved to the segments it chose).
    pub checkpoint: CheckpointChoice,
    /// The configurations weighed (`--checkpoint auto`), in the order tried; empty otherwise.
    pub candidates: Vec<Candidate>,
    /// The step time the cost model predicts for the plan (`--checkpoint auto`).
    pub predicted_step_ms: Option<f64>,
    /// Time spent calibrating the cost model for this plan (0 when it came from the cache).
    pub calibration_ms: f64,
    /// The step-time model the candidates were weighed with (`--checkpoint auto`).
    pub costs: Option<crate::cost::CostModel>,
    /// The precision the plan assumes (`auto` resolved).
    pub precision: crate::config::Precision,
}

/// One configuration the planner weighed: which segments it checkpoints, the largest micro-batch
/// that then fits, its exact predicted peak and its predicted step time; `micro_batch` 0 when not even
/// a micro-batch of 1 fits (then `peak_reserved` is what a micro-batch of 1 needs).
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub precision: crate::config::Precision,
    pub checkpointed: Vec<String>,
    /// The fastest micro-batch that fits (0: none fits).
    pub micro_batch: usize,
    /// The largest micro-batch that fits (0: none).
    pub largest_micro_batch: usize,
    pub accumulation_steps: usize,
    pub peak_reserved: u64,
    pub step_ms: f64,
}

impl Candidate {
    pub fn fits(&self) -> bool {
        self.micro_batch > 0
    }

    /// The `--checkpoint` value that applies it.
    pub fn checkpoint_flag(&self, all_segments: usize) -> String {
        match self.checkpointed.len() {
            0 => "none".to_string(),
            n if n == all_segments => "all".to_string(),
            _ => self.checkpointed.join(","),
        }
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
    let ranks = if mode == crate::parallel::ParallelMode::Data { 1 } else { size };
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
    // A GPU target's device holds cuBLAS's workspace from the start: a capacity below it fits nothing.
    let device = match Device::new(DeviceConfig::new(DeviceKind::Meta(req.target)).capacity(capacity)) {
        Ok(d) => d,
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut session = match Session::new(device.clone(), &req.model, req.optimizer, req.seed) {
        Ok(s) => s,
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e),
    };
    let ranks = req.parallel.zip(rank);
    if let Some(((mode, size), rank)) = ranks {
        match session.join(std::sync::Arc::new(memfit_dist::Simulated { rank, size }), mode) {
            Ok(()) => {}
            Err(e) if e.as_oom().is_some() => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    session.set_checkpointing(&req.checkpoint)?;
    session.set_precision(req.precision)?;
    let (train, val, opts) =
        dry_run_rank(req, ranks.map(|((_, size), rank)| (rank, size)), micro, eval_micro.unwrap_or(1), 1);
    let val: Option<&dyn Samples> = if eval_micro.is_some() { Some(val.as_ref()) } else { None };
    match session.run(train.as_ref(), val, &opts, &mut |_| {}) {
        Ok(_) => Ok(Some(prediction_of(&device))),
        Err(e) if e.as_oom().is_some() => Ok(None),
        Err(e) => Err(e),
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

/// The program a dry run executes: synthetic samples shaped like the model's input (images or token
/// windows), `PLAN_STEPS` full windows, one evaluation micro-batch, recovery off. Running it on `cpu`
/// with the same capacity reproduces the prediction exactly.
pub fn dry_run(req: &PlanRequest, micro: usize, eval_micro: usize) -> (Box<dyn Samples>, Box<dyn Samples>, RunOptions) {
    dry_run_rank(req, None, micro, eval_micro, 1)
}

/// [`dry_run`] for a pipeline stage, whose window runs in rounds of `round` micro-batches (Note
/// [Pipeline]): a round plays the part of a micro-batch in the representative window.
pub fn dry_run_rounds(
    req: &PlanRequest,
    micro: usize,
    eval_micro: usize,
    round: usize,
) -> (Box<dyn Samples>, Box<dyn Samples>, RunOptions) {
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
) -> (Box<dyn Samples>, Box<dyn Samples>, RunOptions) {
    let (local, size) = match rank {
        Some((r, size)) => (memfit_dist::partition::shard(req.effective_batch, r, size).len().max(1), size),
        None => (req.effective_batch, 1),
    };
    let window = if round > 1 {
        representative_window(local, micro.saturating_mul(round)).min(local)
    } else {
        representative_window(local, micro)
    } * size;
    let train = synthetic(&req.model, PLAN_STEPS * window, req.seed);
    let val = synthetic(&req.model, eval_micro * size, req.seed);
    let opts = RunOptions {
        effective_batch: window,
        micro_batch: micro,
        eval_micro_batch: eval_micro,
        epochs: Some(1),
        max_steps: Some(PLAN_STEPS),
        data_seed: req.seed,
        recover: false,
        grow_after: usize::MAX,
        record_samples: false,
    };
    (train, val, opts)
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

/// Largest value in `1..=high` for which `fits` holds, assuming it holds for 1 and is monotone.
fn largest_fitting(high: usize, mut fits: impl FnMut(usize) -> Result<bool, TrainError>) -> Result<usize, TrainError> {
    if fits(high)? {
        return Ok(high);
    }
    let (mut lo, mut hi) = (1, high); // fits(lo), !fits(hi)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// Chooses the largest micro-batch (and evaluation micro-batch) whose dry run fits the budget. With
/// `--checkpoint auto` and a budget, also which segments to checkpoint: Note [Choosing segments].
/// When nothing fits, [`TrainError::DoesNotFit`] carries the doctor's diagnosis (Note [One doctor]).
pub fn plan(req: &PlanRequest) -> Result<Plan, TrainError> {
    match plan_unexplained(req) {
        Err(TrainError::DoesNotFit(_)) => Err(TrainError::DoesNotFit(Box::new(crate::doctor::diagnose(req)?))),
        result => result,
    }
}

/// [`plan`] without the doctor: a request that does not fit ends with a bare [`TrainError::DoesNotFit`].
pub(crate) fn plan_unexplained(req: &PlanRequest) -> Result<Plan, TrainError> {
    use crate::config::Precision;
    let (auto_checkpoint, auto_precision) =
        (req.checkpoint == CheckpointChoice::Auto, req.precision == Precision::Auto);
    if !auto_checkpoint && !auto_precision {
        return plan_fixed(req);
    }
    let resolved = PlanRequest {
        checkpoint: if auto_checkpoint { CheckpointChoice::None } else { req.checkpoint.clone() },
        precision: if auto_precision { Precision::Fp32 } else { req.precision },
        ..req.clone()
    };
    let names = segment_names(req)?;
    if req.budget().is_none() || (names.is_empty() && !auto_precision) {
        return plan_fixed(&resolved);
    }
    // The whole batch in one micro-batch, nothing re-run, stored as computed: when it fits, it is the
    // plan (Note [Choosing segments]), with nothing to weigh or calibrate.
    let whole = req.rank_batch().min(MAX_MICRO);
    if req.micro_batch.is_none()
        && whole == req.rank_batch()
        && resolved.checkpoint == CheckpointChoice::None
        && predict(&resolved, whole, Some(1), req.budget())?.is_some()
    {
        return plan_fixed(&resolved);
    }
    let start = Instant::now();
    let weighed = weigh(req, &names)?;
    let best = weighed.fastest();
    let Some(best) = best else {
        let needs = weighed.candidates.iter().map(|c| c.peak_reserved).min().unwrap_or(0);
        return Err(TrainError::DoesNotFit(Box::new(crate::doctor::Diagnosis::bare(req, needs))));
    };
    let chosen =
        PlanRequest { checkpoint: weighed.choice(best), precision: weighed.candidates[best].precision, ..req.clone() };
    // The candidate's own micro-batch: the fastest, which need not be the largest that fits.
    let micro = weighed.candidates[best].micro_batch;
    let mut p = plan_fixed(&PlanRequest { micro_batch: Some(micro), ..chosen })?;
    if micro < weighed.candidates[best].largest_micro_batch {
        // Limited by speed, not by the budget: more memory would not change it.
        p.larger = None;
    }
    p.predicted_step_ms = Some(weighed.candidates[best].step_ms);
    p.dry_runs += weighed.dry_runs;
    p.calibration_ms = weighed.calibration_ms;
    p.candidates = weighed.candidates;
    p.costs = Some(weighed.costs);
    p.planning_ms = start.elapsed().as_secs_f64() * 1e3;
    Ok(p)
}

// Note [Choosing segments]
// Which segments to checkpoint is a trade of saved bytes against recompute time, decided with exact
// peaks from meta and times from the calibrated cost model (`cost.rs`). Each segment is first
// checkpointed alone at micro-batch 1 on meta: the bytes it saves, divided by its share of the
// recomputation, rank the segments (the most bytes per millisecond first). The candidates are the
// ranked prefixes: none, the best one, the best two, ..., all (beyond 8 segments, geometric steps), each
// in f32 storage and, with `--precision auto`, in bf16 storage too. For each the planner finds the largest
// micro-batch that fits (or checks the one the user fixed), then times every micro-batch up to it (one
// per number of accumulation steps, each as even as that count allows) and keeps the fastest: a larger
// micro-batch is not always faster per sample on a CPU, and taking only the largest made more memory
// give a slower plan. It takes the fastest candidate that fits (ties: fewer segments). Fewer checkpointed
// segments recompute less, so at a mid budget the choice is often a few segments and a larger
// micro-batch, faster than checkpointing everything and than a fixed sqrt(n) rule
// (`train/tests/checkpointing.rs`). Since every micro-batch that fits a budget fits a larger one, more
// memory never gives a slower predicted plan. When the whole batch fits as one micro-batch with nothing
// re-run and f32 storage, that is the plan: nothing re-runs, nothing accumulates, nothing is weighed
// (or calibrated). Each candidate costs a binary search over the training micro-batch (only the
// chosen one gets the evaluation micro-batch and the rest of a plan): about a hundred dry runs, 0.1 s,
// for the GPT once the cost model is calibrated; 0.9 s for a 24-layer one.

/// The configurations weighed for one request.
pub struct Weighed {
    pub candidates: Vec<Candidate>,
    /// The model's segments.
    pub segments: Vec<String>,
    pub dry_runs: usize,
    pub calibration_ms: f64,
    /// The step-time model the candidates were timed with.
    pub costs: crate::cost::CostModel,
}

impl Weighed {
    /// The index of the fastest candidate that fits (ties: the first, which has fewer segments).
    pub fn fastest(&self) -> Option<usize> {
        let mut best: Option<usize> = None;
        for (i, c) in self.candidates.iter().enumerate() {
            if c.fits() && best.is_none_or(|b| c.step_ms < self.candidates[b].step_ms) {
                best = Some(i);
            }
        }
        best
    }

    /// The checkpointing of candidate `i`.
    pub fn choice(&self, i: usize) -> CheckpointChoice {
        let names = &self.candidates[i].checkpointed;
        match names.len() {
            0 => CheckpointChoice::None,
            n if n == self.segments.len() => CheckpointChoice::All,
            _ => CheckpointChoice::Segments(names.clone()),
        }
    }
}

/// The segments `req.model` can checkpoint, by name (empty for a model without any).
pub fn segment_names(req: &PlanRequest) -> Result<Vec<String>, TrainError> {
    Ok(Session::new(Device::meta(), &req.model, req.optimizer, req.seed)?
        .model
        .checkpointing()
        .map(|c| c.names().to_vec())
        .unwrap_or_default())
}

/// Weighs the ranked prefixes of `names` (Note [Choosing segments]) when checkpointing is `auto`,
/// else the request's own segments; each in f32 and, when precision is `auto`, with bf16 storage;
/// each at its largest fitting micro-batch, or at the one the user fixed.
pub fn weigh(req: &PlanRequest, names: &[String]) -> Result<Weighed, TrainError> {
    use crate::config::Precision;
    let micro = req.micro_batch;
    let (costs, calibrated) = crate::cost::model_for(req, names)?;
    let calibration_ms = if calibrated { costs.calibration_ms } else { 0.0 };
    let mut dry_runs = 0;
    let with = |checkpoint: CheckpointChoice| PlanRequest { checkpoint, precision: Precision::Fp32, ..req.clone() };
    let ranked: Vec<String> = if req.checkpoint == CheckpointChoice::Auto {
        let training_peak = |r: &PlanRequest, dry_runs: &mut usize| -> Result<u64, TrainError> {
            *dry_runs += 1;
            Ok(predict(r, 1, None, None)?.map_or(u64::MAX, |p| p.peak_allocated))
        };
        let base = training_peak(&with(CheckpointChoice::None), &mut dry_runs)?;
        let mut scored = Vec::new();
        for name in names {
            let peak = training_peak(&with(CheckpointChoice::Segments(vec![name.clone()])), &mut dry_runs)?;
            let saved = base.saturating_sub(peak) as f64;
            scored.push((saved / costs.share(name).max(1e-9), name.clone()));
        }
        // Stable: equal scores keep the model's order.
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        scored.into_iter().map(|(_, n)| n).collect()
    } else {
        names.to_vec()
    };
    let sets: Vec<Vec<String>> = match &req.checkpoint {
        CheckpointChoice::Auto => prefix_lengths(ranked.len()).into_iter().map(|k| ranked[..k].to_vec()).collect(),
        CheckpointChoice::None => vec![Vec::new()],
        CheckpointChoice::All => vec![names.to_vec()],
        CheckpointChoice::Segments(s) => vec![s.clone()],
    };
    let precisions = match req.precision {
        Precision::Auto => vec![Precision::Fp32, Precision::Bf16],
        p => vec![p],
    };
    let mut candidates = Vec::new();
    for &precision in &precisions {
        for checkpointed in &sets {
            let choice = match checkpointed.len() {
                0 => CheckpointChoice::None,
                k if k == names.len() => CheckpointChoice::All,
                _ => CheckpointChoice::Segments(checkpointed.clone()),
            };
            let r = PlanRequest { precision, ..with(choice) };
            let budget = r.budget();
            let mut run = |m: usize, eval: Option<usize>, cap: Option<u64>| {
                dry_runs += 1;
                predict(&r, m, eval, cap)
            };
            // Each candidate's training micro-batch: the fastest of those that fit (Note [Choosing
            // segments]); only the chosen candidate gets a whole plan.
            let half = precision.saved_dtype().is_some();
            let time = |m: usize| costs.step_ms_in(req.rank_batch(), m, checkpointed, half);
            let fitting = match fitting_micro(&r, &mut run)? {
                Some((largest, _, balanced)) => {
                    let mut options = balanced_micro_batches(r.rank_batch(), largest, r.micro_batch);
                    // Fastest first; ties (to a nanosecond): the larger micro-batch (fewer accumulation steps).
                    options.sort_by_key(|&m| ((time(m) * 1e6).round() as i64, std::cmp::Reverse(m)));
                    let mut found = None;
                    for m in options {
                        if let Some(p) = run(m, None, budget)? {
                            found = Some((m, largest, p.peak_reserved));
                            break;
                        }
                    }
                    found.or(run(balanced, None, budget)?.map(|p| (balanced, largest, p.peak_reserved)))
                }
                None => None,
            };
            let m = fitting.map_or(micro.unwrap_or(1), |(m, _, _)| m);
            let step_ms = time(m);
            candidates.push(match fitting {
                Some((m, largest, peak)) => Candidate {
                    precision,
                    micro_batch: m,
                    largest_micro_batch: largest,
                    accumulation_steps: req.rank_batch().div_ceil(m),
                    peak_reserved: peak,
                    step_ms,
                    checkpointed: checkpointed.clone(),
                },
                None => {
                    dry_runs += 1;
                    let needs =
                        predict(&r, m, Some(m.min(MAX_EVAL_MICRO)), None)?.map_or(u64::MAX, |p| p.peak_reserved);
                    Candidate {
                        precision,
                        micro_batch: 0,
                        largest_micro_batch: 0,
                        accumulation_steps: 0,
                        peak_reserved: needs,
                        step_ms,
                        checkpointed: checkpointed.clone(),
                    }
                }
            });
        }
    }
    Ok(Weighed { candidates, segments: names.to_vec(), dry_runs, calibration_ms, costs })
}

/// The micro-batches worth timing for `effective` samples when at most `largest` fit: one for each
/// number of accumulation steps from the fewest up, each as even as that count allows (`ceil(effective
/// / k)`), largest first; only `fixed` when the user fixed one. About 2 sqrt(effective) of them.
fn balanced_micro_batches(effective: usize, largest: usize, fixed: Option<usize>) -> Vec<usize> {
    if let Some(m) = fixed {
        return vec![m.min(effective.max(1))];
    }
    let effective = effective.max(1);
    let mut out = Vec::new();
    let mut k = effective.div_ceil(largest.clamp(1, effective));
    while k <= effective {
        let m = effective.div_ceil(k);
        out.push(m);
        if m == 1 {
            break;
        }
        // The next count that gives a smaller micro-batch.
        k = effective.div_ceil(m - 1);
    }
    out
}

/// How many of `n` ranked segments the candidates checkpoint: every count up to 8 segments, then
/// roughly geometric steps (each about 1.5 times the last) and all of them, so that planning stays
/// well under a second for deep models.
fn prefix_lengths(n: usize) -> Vec<usize> {
    let mut ks: Vec<usize> = (0..=n.min(8)).collect();
    let mut k = 8;
    while k < n {
        k = (k + k / 2).min(n);
        ks.push(k);
    }
    ks
}

/// The fastest checkpointing (Note [Choosing segments]) with which a fixed micro-batch `micro` fits the
/// budget, training and an evaluation micro-batch as large: `None` when nothing fits; also the dry runs made.
pub fn fastest_segments(req: &PlanRequest, micro: usize) -> Result<Option<(CheckpointChoice, usize)>, TrainError> {
    let names = segment_names(req)?;
    let none = PlanRequest { checkpoint: CheckpointChoice::None, ..req.clone() };
    if names.is_empty() {
        let fits = predict(&none, micro, Some(micro), none.budget())?.is_some();
        return Ok(fits.then_some((CheckpointChoice::None, 1)));
    }
    let weighed = weigh(&PlanRequest { micro_batch: Some(micro), ..req.clone() }, &names)?;
    Ok(weighed.fastest().map(|i| (weighed.choice(i), weighed.dry_runs)))
}

/// What the remedies in force saved, predicted on meta for the run's own configuration: peak reserved
/// bytes without accumulation (the whole batch as one micro-batch) and without checkpointing, less the
/// run's; and the share of the step the cost model gives to recomputation.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Savings {
    pub accumulation_saved_bytes: Option<u64>,
    pub checkpointing_saved_bytes: Option<u64>,
    /// Against f32 storage (with `--precision bf16|fp16`).
    pub precision_saved_bytes: Option<u64>,
    pub recompute_time_share: Option<f64>,
}

/// [`Savings`] of running `req` in micro-batches of `micro` with `checkpointed` segments (resolved
/// names) and `precision` (resolved); `costs` gives the recompute share when the plan was weighed by
/// time.
pub fn savings(
    req: &PlanRequest,
    micro: usize,
    checkpointed: &[String],
    precision: crate::config::Precision,
    costs: Option<&crate::cost::CostModel>,
) -> Result<Savings, TrainError> {
    let as_run = PlanRequest {
        checkpoint: match checkpointed.is_empty() {
            true => CheckpointChoice::None,
            false => CheckpointChoice::Segments(checkpointed.to_vec()),
        },
        precision,
        ..req.clone()
    };
    let peak = |r: &PlanRequest, m: usize| -> Result<Option<u64>, TrainError> {
        Ok(predict(r, m, None, None)?.map(|p| p.peak_reserved))
    };
    let Some(own) = peak(&as_run, micro)? else { return Ok(Savings::default()) };
    let whole = req.rank_batch().min(MAX_MICRO);
    let accumulation_saved_bytes = match micro < whole {
        true => peak(&as_run, whole)?.map(|p| p.saturating_sub(own)),
        false => None,
    };
    let plain = PlanRequest { checkpoint: CheckpointChoice::None, ..as_run.clone() };
    let checkpointing_saved_bytes = match checkpointed.is_empty() {
        true => None,
        false => peak(&plain, micro)?.map(|p| p.saturating_sub(own)),
    };
    let f32_storage = PlanRequest { precision: crate::config::Precision::Fp32, ..as_run.clone() };
    let precision_saved_bytes = match precision.saved_dtype() {
        None => None,
        Some(_) => peak(&f32_storage, micro)?.map(|p| p.saturating_sub(own)),
    };
    let recompute_time_share = costs.filter(|_| !checkpointed.is_empty()).map(|c| {
        let with = c.step_ms(req.rank_batch(), micro, checkpointed);
        let without = c.step_ms(req.rank_batch(), micro, &[]);
        if with > 0.0 {
            (with - without) / with
        } else {
            0.0
        }
    });
    Ok(Savings { accumulation_saved_bytes, checkpointing_saved_bytes, precision_saved_bytes, recompute_time_share })
}

/// A `--memory` value of at least `bytes`, rounded up to a whole MiB (KiB below 1 MiB).
pub fn memory_flag(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes.div_ceil(1 << 20))
    } else {
        format!("{}KiB", bytes.div_ceil(1 << 10).max(1))
    }
}

/// The capacity whose budget (less the safety margin) is `bytes`.
pub(crate) fn with_margin(req: &PlanRequest, bytes: u64) -> u64 {
    ((bytes as f64) / (1.0 - req.safety_margin)).ceil() as u64
}

/// A dry run: (training micro-batch, evaluation micro-batch, capacity) -> the prediction, None when
/// it does not fit.
type DryRun<'a> = dyn FnMut(usize, Option<usize>, Option<u64>) -> Result<Option<Prediction>, TrainError> + 'a;

/// The training micro-batch of `req` under its budget: (largest that fits, accumulation steps, the
/// micro-batch to run), or None when not even the first (1, or the user's) fits.
fn fitting_micro(req: &PlanRequest, run: &mut DryRun) -> Result<Option<(usize, usize, usize)>, TrainError> {
    let budget = req.budget();
    let first = req.micro_batch.unwrap_or(1).min(req.rank_batch());
    if run(first, Some(first.min(MAX_EVAL_MICRO)), budget)?.is_none() {
        return Ok(None);
    }
    if req.micro_batch.is_some() {
        return Ok(Some((first, req.rank_batch().div_ceil(first), first)));
    }
    let high = search_limit(&req.model, req.rank_batch().min(MAX_MICRO), budget);
    let largest = largest_fitting(high, |m| Ok(run(m, Some(1), budget)?.is_some()))?;
    // Balance the micro-batches: as many accumulation steps as the largest fitting micro-batch needs,
    // but equal parts (188 + 68 becomes 128 + 128): as fast, and lighter.
    let accumulation_steps = req.rank_batch().div_ceil(largest);
    let balanced = req.rank_batch().div_ceil(accumulation_steps);
    // Lighter in bytes allocated, but the reserved peak is not monotone in the micro-batch (segment
    // reuse): keep the balanced parts only when they fit too.
    let micro = if balanced == largest || run(balanced, Some(1), budget)?.is_some() { balanced } else { largest };
    Ok(Some((largest, accumulation_steps, micro)))
}

fn plan_fixed(req: &PlanRequest) -> Result<Plan, TrainError> {
    let start = Instant::now();
    if req.effective_batch == 0 {
        return Err(TrainError::Invalid("the batch size must be at least 1".into()));
    }
    if !(0.0..=0.5).contains(&req.safety_margin) {
        return Err(TrainError::Invalid(format!(
            "safety margin {} is out of range: use a fraction between 0 and 0.5",
            req.safety_margin
        )));
    }
    let budget = req.budget();
    let mut dry_runs = 0;
    let mut run = |micro: usize, eval: Option<usize>, cap: Option<u64>| {
        dry_runs += 1;
        predict(req, micro, eval, cap)
    };
    let Some((largest, accumulation_steps, micro)) = fitting_micro(req, &mut run)? else {
        let first = req.micro_batch.unwrap_or(1).min(req.rank_batch());
        let needs = run(first, Some(first.min(MAX_EVAL_MICRO)), None)?.map(|p| p.peak_reserved).unwrap_or(0);
        return Err(TrainError::DoesNotFit(Box::new(crate::doctor::Diagnosis::bare(req, needs))));
    };
    let not_fit = || TrainError::Invalid("internal error: the chosen plan did not fit on a second dry run".into());
    let training = run(micro, None, budget)?.ok_or_else(not_fit)?;
    let (eval_micro, predicted) = match req.evaluate {
        true => {
            let eval_micro = eval_micro_within(req, micro, &training, &mut run)?;
            (eval_micro, run(micro, Some(eval_micro), budget)?.ok_or_else(not_fit)?)
        }
        false => (micro, training.clone()),
    };
    let larger = if micro < req.rank_batch() && budget.is_some() {
        let bigger = largest.saturating_mul(2).min(req.rank_batch()).min(MAX_MICRO);
        let bigger = req.rank_batch().div_ceil(req.rank_batch().div_ceil(bigger));
        run(bigger, Some(1), None)?.map(|p| (bigger, p.peak_reserved))
    } else {
        None
    };
    Ok(Plan {
        micro_batch: micro,
        accumulation_steps,
        effective_batch: req.effective_batch,
        eval_micro_batch: eval_micro,
        evaluates: req.evaluate,
        budget,
        predicted,
        training,
        larger,
        dry_runs,
        planning_ms: start.elapsed().as_secs_f64() * 1e3,
        checkpoint: req.checkpoint.clone(),
        candidates: Vec::new(),
        predicted_step_ms: None,
        calibration_ms: 0.0,
        costs: None,
        precision: req.precision,
    })
}

/// The evaluation micro-batch (Note [Evaluation's micro-batch]): the largest, up to [`MAX_EVAL_MICRO`],
/// with which the run reserves no more than its training steps do; 1 when none does.
fn eval_micro_within(
    req: &PlanRequest,
    micro: usize,
    training: &Prediction,
    run: &mut DryRun,
) -> Result<usize, TrainError> {
    let budget = req.budget();
    let high = search_limit(&req.model, MAX_EVAL_MICRO.max(micro).min(MAX_MICRO), budget);
    let mut within = |e: usize| -> Result<bool, TrainError> {
        Ok(run(micro, Some(e), budget)?.is_some_and(|p| p.peak_reserved <= training.peak_reserved))
    };
    match within(1)? {
        true => largest_fitting(high, within),
        false => Ok(1),
    }
}

// Note [Evaluation's micro-batch]
// Evaluation keeps no activations for backward, so it could take far larger micro-batches than
// training; filling the whole budget with them (808.8 MiB of a 1 GiB budget for a 207 MiB training step)
// made the run's peak evaluation's, hid the training step's real need and left nothing to other users
// of the device. The planner takes the largest evaluation micro-batch (at most MAX_EVAL_MICRO) with which
// the whole run, dry-run at the budget, reserves no more than its training steps: the run's peak
// reserved is the training step's, and evaluation is as fast as that memory allows. (Fitting under a
// cap of the training peak is not the same: under a cap the allocator releases its cache and retries,
// so the same run at the budget reserves more.) The search is bounded like training's.

impl Plan {
    /// A few lines a person reads: the choice, the predicted peak by category, what dominates, and
    /// what would change it.
    pub fn describe(&self, model: &str) -> String {
        let mut s = String::new();
        let budget = self.budget.map_or("unlimited memory".to_string(), |b| format!("a budget of {}", format_bytes(b)));
        let evaluation = match self.evaluates {
            true => format!(" (evaluation micro-batch {})", self.eval_micro_batch),
            false => " (no evaluation)".to_string(),
        };
        s.push_str(&format!(
            "plan for {model} with {budget}: {}{evaluation}\n",
            window_words(self.effective_batch, self.micro_batch)
        ));
        match &self.checkpoint {
            CheckpointChoice::All => s.push_str("activation checkpointing: every segment\n"),
            CheckpointChoice::Segments(names) => s.push_str(&format!(
                "activation checkpointing: {} (each keeps only its input; its forward runs again in backward)\n",
                names.join(", ")
            )),
            CheckpointChoice::None | CheckpointChoice::Auto => {}
        }
        if self.precision.saved_dtype().is_some() {
            s.push_str(&format!(
                "saved activations stored in {} (converted back to f32 when backward reads them)\n",
                self.precision.name()
            ));
        }
        match self.evaluates {
            true => s.push_str(&format!(
                "predicted peak of the whole run: {} allocated, {} reserved (training steps alone: {} allocated, {} reserved)\n",
                format_bytes(self.predicted.peak_allocated),
                format_bytes(self.predicted.peak_reserved),
                format_bytes(self.training.peak_allocated),
                format_bytes(self.training.peak_reserved),
            )),
            false => s.push_str(&format!(
                "predicted peak of the run: {} allocated, {} reserved\n",
                format_bytes(self.predicted.peak_allocated),
                format_bytes(self.predicted.peak_reserved),
            )),
        }
        s.push_str("a training step at its peak holds:\n");
        let t = &self.training;
        let total = t.peak_allocated.max(1) as f64;
        let mut cats: Vec<Category> = Category::ALL.to_vec();
        cats.sort_by_key(|c| std::cmp::Reverse(t.at_peak[c.index()]));
        for c in cats {
            let b = t.at_peak[c.index()];
            if b > 0 {
                s.push_str(&format!(
                    "  {:<16} {:>12}  {:>5.1}%\n",
                    c.name(),
                    format_bytes(b),
                    100.0 * b as f64 / total
                ));
            }
        }
        s.push_str(&format!("dominated by {}\n", t.dominant().name()));
        if let Some((micro, needs)) = self.larger {
            s.push_str(&format!(
                "a budget of {} would allow micro-batch {micro} ({} accumulation step{})\n",
                format_bytes(needs),
                self.effective_batch.div_ceil(micro),
                if self.effective_batch.div_ceil(micro) == 1 { "" } else { "s" }
            ));
        }
        if !self.candidates.is_empty() {
            s.push_str(&self.candidates_table());
        }
        s.push_str(&format!("planned in {:.0} ms ({} dry runs on meta)", self.planning_ms, self.dry_runs));
        if self.calibration_ms > 0.0 {
            s.push_str(&format!(
                ", {:.1} s of it calibrating step times on this machine (cached)",
                self.calibration_ms / 1e3
            ));
        }
        s.push('\n');
        s
    }

    /// The configurations weighed, one a line, the chosen one marked.
    pub fn candidates_table(&self) -> String {
        let nominal = self.costs.as_ref().is_some_and(|c| c.nominal);
        let mut s = String::from(match nominal {
            false => {
                "candidates weighed (peak exact from meta; step time from the cost model calibrated on this machine):\n"
            }
            true => {
                "candidates weighed (peak exact from meta; the model is too large to time on this host, so step \
                     times are nominal: one unit a sample, a re-run forward a third of a step):\n"
            }
        });
        s.push_str(&format!(
            "    {:<9} {:<32} {:>14} {:>14} {:>12}\n",
            "storage", "checkpointed", "micro-batch", "peak reserved", "step time"
        ));
        let chosen = self.checkpoint.segment_names();
        let segments = self.candidates.iter().map(|c| c.checkpointed.len()).max().unwrap_or(0);
        for c in &self.candidates {
            let names = match c.checkpointed.len() {
                0 => "none".to_string(),
                k if k == segments && chosen == ["all"] || k == segments && segments > 3 => "all".to_string(),
                k if k > 3 => format!("{k} of {segments}: {}, ...", c.checkpointed[..2].join(",")),
                _ => c.checkpointed.join(","),
            };
            let is_chosen = c.fits()
                && c.precision == self.precision
                && c.micro_batch == self.micro_batch
                && (c.checkpointed == chosen || (chosen == ["all"] && c.checkpointed.len() == segments));
            let micro = if c.fits() {
                format!("{} x {}", c.micro_batch, c.accumulation_steps)
            } else {
                "does not fit".to_string()
            };
            let time = match nominal {
                false => format!("{:.0} ms", c.step_ms),
                true => format!("{:.1} units", c.step_ms),
            };
            s.push_str(&format!(
                "  {} {:<9} {:<32} {:>14} {:>14} {:>12}\n",
                if is_chosen { "*" } else { " " },
                c.precision.name(),
                names,
                micro,
                format_bytes(c.peak_reserved),
                time
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_take_every_prefix_of_a_few_segments_and_geometric_steps_of_many() {
        assert_eq!(prefix_lengths(0), [0]);
        assert_eq!(prefix_lengths(4), [0, 1, 2, 3, 4]);
        assert_eq!(prefix_lengths(8), [0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(prefix_lengths(24), [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 24]);
        assert_eq!(*prefix_lengths(1000).last().unwrap(), 1000);
        assert!(prefix_lengths(1000).len() < 30);
    }

    #[test]
    fn micro_batches_are_one_per_accumulation_count_each_as_even_as_it_allows() {
        assert_eq!(balanced_micro_batches(64, 64, None), [64, 32, 22, 16, 13, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(balanced_micro_batches(64, 20, None)[..3], [16, 13, 11]);
        assert_eq!(balanced_micro_batches(10, 100, None), [10, 5, 4, 3, 2, 1]);
        assert_eq!(balanced_micro_batches(1, 1, None), [1]);
        assert_eq!(balanced_micro_batches(64, 64, Some(8)), [8]);
        let many = balanced_micro_batches(1 << 30, 1 << 16, None);
        assert!(many.len() < 70_000 && many[0] == 1 << 16 && many.windows(2).all(|w| w[0] > w[1]));
    }

    #[test]
    fn memory_flags_round_up_to_whole_units() {
        assert_eq!(memory_flag(1), "1KiB");
        assert_eq!(memory_flag(1 << 20), "1MiB");
        assert_eq!(memory_flag((1 << 20) + 1), "2MiB");
        assert_eq!(memory_flag(1023 << 10), "1023KiB");
    }
}
