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
}

impl PlanRequest {
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

/// A chosen configuration.
#[derive(Clone, Debug)]
pub struct Plan {
    pub micro_batch: usize,
    pub accumulation_steps: usize,
    pub effective_batch: usize,
    pub eval_micro_batch: usize,
    pub budget: Option<u64>,
    /// The whole dry run: training steps and an evaluation micro-batch.
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
}

/// Dry-runs `micro` (and an evaluation micro-batch, when given) on `meta` with `capacity`. None when it
/// does not fit.
pub fn predict(
    req: &PlanRequest,
    micro: usize,
    eval_micro: Option<usize>,
    capacity: Option<u64>,
) -> Result<Option<Prediction>, TrainError> {
    let device = Device::new(DeviceConfig::new(DeviceKind::Meta).capacity(capacity));
    let mut session = match Session::new(device.clone(), &req.model, req.optimizer, req.seed) {
        Ok(s) => s,
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e),
    };
    session.set_checkpointing(&req.checkpoint)?;
    let (train, val, opts) = dry_run(req, micro, eval_micro.unwrap_or(1));
    let val: Option<&dyn Samples> = if eval_micro.is_some() { Some(val.as_ref()) } else { None };
    match session.run(train.as_ref(), val, &opts, &mut |_| {}) {
        Ok(_) => {}
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e),
    }
    let stats = device.stats();
    let mut category_peaks = [0; Category::COUNT];
    for c in Category::ALL {
        category_peaks[c.index()] = stats.category(c).peak;
    }
    Ok(Some(Prediction {
        peak_allocated: stats.allocated_bytes.peak,
        peak_reserved: stats.reserved_bytes.peak,
        at_peak: stats.category_at_peak,
        category_peaks,
    }))
}

/// The program a dry run executes: synthetic samples shaped like the model's input (images or token
/// windows), `PLAN_STEPS` full windows, one evaluation micro-batch, recovery off. Running it on `cpu`
/// with the same capacity reproduces the prediction exactly.
pub fn dry_run(req: &PlanRequest, micro: usize, eval_micro: usize) -> (Box<dyn Samples>, Box<dyn Samples>, RunOptions) {
    let window = representative_window(req.effective_batch, micro);
    let train = synthetic(&req.model, PLAN_STEPS * window, req.seed);
    let val = synthetic(&req.model, eval_micro, req.seed);
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
/// `--checkpoint auto`, first the activation checkpointing: none when micro-batch 1 fits without it,
/// else the fewest segments, earliest first, with which it fits (recomputing costs time, so as little
/// as the budget forces).
pub fn plan(req: &PlanRequest) -> Result<Plan, TrainError> {
    if req.checkpoint != CheckpointChoice::Auto {
        return plan_fixed(req);
    }
    let start = Instant::now();
    let none = PlanRequest { checkpoint: CheckpointChoice::None, ..req.clone() };
    if req.budget().is_none() {
        return plan_fixed(&none);
    }
    match fewest_segments(req, 1)? {
        Some((choice, dry_runs)) => {
            let mut p = plan_fixed(&PlanRequest { checkpoint: choice, ..req.clone() })?;
            p.dry_runs += dry_runs;
            p.planning_ms = start.elapsed().as_secs_f64() * 1e3;
            Ok(p)
        }
        // Nothing fits: say what the lightest configuration (every segment checkpointed) needs.
        None => {
            let all = PlanRequest { checkpoint: CheckpointChoice::All, ..req.clone() };
            let needs = predict(&all, 1, Some(1), None)?.map(|p| p.peak_reserved).unwrap_or(0);
            let cap = req.capacity.map_or("unlimited".to_string(), format_bytes);
            let message = does_not_fit_message(req, needs, &cap);
            Err(TrainError::Invalid(message.replacen(
                ": even a micro-batch of 1",
                " even with activation checkpointing of every segment: a micro-batch of 1",
                1,
            )))
        }
    }
}

/// The fewest segments, earliest first, whose checkpointing lets `micro` (training and an
/// evaluation micro-batch as large) fit the budget: `None` when nothing fits; also the dry runs made.
pub fn fewest_segments(req: &PlanRequest, micro: usize) -> Result<Option<(CheckpointChoice, usize)>, TrainError> {
    let names = Session::new(Device::meta(), &req.model, req.optimizer, req.seed)?
        .model
        .checkpointing()
        .map(|c| c.names().to_vec())
        .unwrap_or_default();
    for k in 0..=names.len() {
        let choice = if k == 0 { CheckpointChoice::None } else { CheckpointChoice::Segments(names[..k].to_vec()) };
        let candidate = PlanRequest { checkpoint: choice, ..req.clone() };
        if predict(&candidate, micro, Some(micro), candidate.budget())?.is_some() {
            return Ok(Some((candidate.checkpoint, k + 1)));
        }
    }
    Ok(None)
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
    if run(1, Some(1), budget)?.is_none() {
        let needs = run(1, Some(1), None)?.map(|p| p.peak_reserved).unwrap_or(0);
        return Err(does_not_fit(req, needs, checkpointing_remedy(req)?));
    }
    let high = search_limit(&req.model, req.effective_batch.min(MAX_MICRO), budget);
    let largest = largest_fitting(high, |m| Ok(run(m, Some(1), budget)?.is_some()))?;
    // Balance the micro-batches: as many accumulation steps as the largest fitting micro-batch needs,
    // but equal parts (188 + 68 becomes 128 + 128): as fast, and lighter.
    let accumulation_steps = req.effective_batch.div_ceil(largest);
    let micro = req.effective_batch.div_ceil(accumulation_steps);
    let eval_high = search_limit(&req.model, MAX_EVAL_MICRO.max(req.effective_batch.min(MAX_MICRO)), budget);
    let eval_micro = largest_fitting(eval_high, |e| Ok(run(micro, Some(e), budget)?.is_some()))?;
    let not_fit = || TrainError::Invalid("internal error: the chosen plan did not fit on a second dry run".into());
    let predicted = run(micro, Some(eval_micro), budget)?.ok_or_else(not_fit)?;
    let training = run(micro, None, budget)?.ok_or_else(not_fit)?;
    let larger = if micro < req.effective_batch && budget.is_some() {
        let bigger = largest.saturating_mul(2).min(req.effective_batch).min(MAX_MICRO);
        let bigger = req.effective_batch.div_ceil(req.effective_batch.div_ceil(bigger));
        run(bigger, Some(1), None)?.map(|p| (bigger, p.peak_reserved))
    } else {
        None
    };
    Ok(Plan {
        micro_batch: micro,
        accumulation_steps,
        effective_batch: req.effective_batch,
        eval_micro_batch: eval_micro,
        budget,
        predicted,
        training,
        larger,
        dry_runs,
        planning_ms: start.elapsed().as_secs_f64() * 1e3,
        checkpoint: req.checkpoint.clone(),
    })
}

/// When the request does not checkpoint every segment and checkpointing them all makes the batch
/// fit: the plan that then fits, as advice (what to add, the micro-batch, the predicted peak).
fn checkpointing_remedy(req: &PlanRequest) -> Result<Option<String>, TrainError> {
    if matches!(req.checkpoint, CheckpointChoice::All | CheckpointChoice::Auto) || req.capacity.is_none() {
        return Ok(None);
    }
    let all = PlanRequest { checkpoint: CheckpointChoice::All, ..req.clone() };
    let segments = Session::new(Device::meta(), &req.model, req.optimizer, req.seed)?
        .model
        .checkpointing()
        .map_or(0, |c| c.names().len());
    if segments == 0 || predict(&all, 1, Some(1), all.budget())?.is_none() {
        return Ok(None);
    }
    let p = plan(&all)?;
    Ok(Some(format!(
        "With activation checkpointing of all {segments} segments (each keeps only its input and runs its forward \
         again in backward: less memory, more time, the same numbers) it fits: add --checkpoint all for micro-batch \
         {} x {} (peak {} reserved).",
        p.micro_batch,
        p.accumulation_steps,
        format_bytes(p.predicted.peak_reserved)
    )))
}

/// The error for a budget below what micro-batch 1 needs, with a remedy that fits when there is one.
pub fn does_not_fit(req: &PlanRequest, needs: u64, remedy: Option<String>) -> TrainError {
    let cap = req.capacity.map_or("unlimited".to_string(), format_bytes);
    let message = does_not_fit_message(req, needs, &cap);
    TrainError::Invalid(match remedy {
        Some(r) => format!("{message} {r}"),
        None => message,
    })
}

fn does_not_fit_message(req: &PlanRequest, needs: u64, cap: &str) -> String {
    format!(
        "{} does not fit in {cap}{}: even a micro-batch of 1 needs {} (peak reserved). \
         Use --memory {} or more, or a smaller model.",
        req.model.kind.name(),
        if req.safety_margin > 0.0 {
            format!(" with a {:.0}% safety margin", req.safety_margin * 100.0)
        } else {
            String::new()
        },
        format_bytes(needs),
        format_bytes(((needs as f64) / (1.0 - req.safety_margin)).ceil() as u64),
    )
}

impl Plan {
    /// A few lines a person reads: the choice, the predicted peak by category, what dominates, and
    /// what would change it.
    pub fn describe(&self, model: &str) -> String {
        let mut s = String::new();
        let budget = self.budget.map_or("unlimited memory".to_string(), |b| format!("a budget of {}", format_bytes(b)));
        s.push_str(&format!(
            "plan for {model} with {budget}: micro-batch {} x {} accumulation step{} = effective batch {} (evaluation micro-batch {})\n",
            self.micro_batch,
            self.accumulation_steps,
            if self.accumulation_steps == 1 { "" } else { "s" },
            self.effective_batch,
            self.eval_micro_batch,
        ));
        match &self.checkpoint {
            CheckpointChoice::All => s.push_str("activation checkpointing: every segment\n"),
            CheckpointChoice::Segments(names) => s.push_str(&format!(
                "activation checkpointing: {} (each keeps only its input; its forward runs again in backward)\n",
                names.join(", ")
            )),
            CheckpointChoice::None | CheckpointChoice::Auto => {}
        }
        s.push_str(&format!(
            "predicted peak of the whole run: {} allocated, {} reserved (training steps alone: {} allocated, {} reserved)\n",
            format_bytes(self.predicted.peak_allocated),
            format_bytes(self.predicted.peak_reserved),
            format_bytes(self.training.peak_allocated),
            format_bytes(self.training.peak_reserved),
        ));
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
        s.push_str(&format!("planned in {:.0} ms ({} dry runs on meta)\n", self.planning_ms, self.dry_runs));
        s
    }
}
