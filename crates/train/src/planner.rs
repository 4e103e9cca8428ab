//! The planner: fits an effective batch into a memory budget by dry-running the real trainer on the
//! `meta` device (same code, same allocator policy, no compute) for candidate micro-batches.
//!
//! A candidate is run for [`crate::dry_run::PLAN_STEPS`] optimizer steps (the first allocates the optimizer state,
//! the rest are the steady state) and one evaluation micro-batch, on a `meta` device whose capacity
//! is the budget less the safety margin, with recovery off: it fits when no allocation fails. The
//! prediction is exact for a run of the same steps on `cpu` with at least that capacity, because the
//! allocation sequence is the same (the invariant `meta == cpu`).

use crate::config::{CheckpointChoice, OptimizerStep, Precision, Segments};
pub use crate::dry_run::{
    dry_run, dry_run_rounds, predict, predict_rank, prediction_of, representative_window, search_limit, PlanRequest,
    Prediction, MAX_EVAL_MICRO, MAX_MICRO, PLAN_STEPS,
};
use crate::error::{Diagnosis, TrainError};
use crate::trainer::Session;

use memfit_tensor::memory::format_bytes;
use memfit_tensor::Device;
use rayon::prelude::*;
use std::time::Instant;

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
    pub precision: Precision,
    /// The allocator's segments the plan assumes (`auto` resolved).
    pub segments: crate::config::Segments,
    /// Where the optimizer steps in the plan (`auto` resolved).
    pub optimizer_step: OptimizerStep,
}

/// One configuration the planner weighed: which segments it checkpoints, the largest micro-batch
/// that then fits, its exact predicted peak and its predicted step time; `micro_batch` 0 when not even
/// a micro-batch of 1 fits (then `peak_reserved` is what a micro-batch of 1 needs).
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub precision: Precision,
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

/// Largest value in `low..=high` for which `fits` holds, assuming it holds for `low` and is monotone.
fn largest_fitting(
    low: usize,
    high: usize,
    mut fits: impl FnMut(usize) -> Result<bool, TrainError>,
) -> Result<usize, TrainError> {
    if fits(high)? {
        return Ok(high);
    }
    let (mut lo, mut hi) = (low, high); // fits(lo), !fits(hi)
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
/// When nothing fits, [`TrainError::DoesNotFit`] says what the least of the run needs; the doctor's
/// [`crate::doctor::plan`] adds the remedies.
pub fn choose(req: &PlanRequest) -> Result<Plan, TrainError> {
    check_smallest(req)?;
    // The step inside backward changes no number and costs no time the cost model sees; weighed
    // by fit alone, like expandable segments, it is taken when the plan does not fit otherwise.
    if req.optimizer_step == OptimizerStep::Auto {
        let after = PlanRequest { optimizer_step: OptimizerStep::After, ..req.clone() };
        return match choose(&after) {
            Err(TrainError::DoesNotFit(refused)) if req.steps_in_backward_allowed() => {
                match choose(&PlanRequest { optimizer_step: OptimizerStep::InBackward, ..req.clone() }) {
                    Err(TrainError::DoesNotFit(_)) => Err(TrainError::DoesNotFit(refused)),
                    result => result,
                }
            }
            result => result,
        };
    }
    // Expandable segments change no number and cost no time that the cost model sees: weighed by
    // fit alone, they are taken when the plan does not fit fixed ones (so a plan that fits is the
    // one it always was).
    if req.segments == Segments::Auto {
        let fixed = PlanRequest { segments: Segments::Fixed, ..req.clone() };
        return match choose(&fixed) {
            Err(TrainError::DoesNotFit(refused)) => {
                match choose(&PlanRequest { segments: Segments::Expandable, ..req.clone() }) {
                    Err(TrainError::DoesNotFit(_)) => Err(TrainError::DoesNotFit(refused)),
                    result => result,
                }
            }
            result => result,
        };
    }
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
        return Err(refusal(req, needs, req.model.smallest_micro_batch()));
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
// for the GPT once the cost model is calibrated; 0.9 s for a 24-layer one (one core; see below).

// Note [Planning on every core]
// A dry run is a session on a `meta` device of its own: its allocator, model and tensors are the
// device's, and nothing it reads is shared but the request and the cost model. So `weigh` runs the
// independent ones at once on rayon's pool: first the segments' peaks, then one job per candidate
// (its binary search and its timed options, in the order one core took them), collected in the
// candidates' order. The plan, its table and the count of dry runs are what one core gives. On 2
// cores (an AMD EPYC), GPT-2's `plan --device cuda --model gpt --layers 12 --d-model 768 --heads 12
// --context 1024 --vocab 50304 --precision bf16 --memory 80GiB --batch-size 1024` (13 candidates,
// 169 dry runs) went from 0.93-1.10 s to 0.52-0.59 s, the same plan.

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
    let micro = req.micro_batch;
    let (costs, calibrated) = crate::calibration::model_for(req, names)?;
    let calibration_ms = if calibrated { costs.calibration_ms } else { 0.0 };
    let with = |checkpoint: CheckpointChoice| PlanRequest { checkpoint, precision: Precision::Fp32, ..req.clone() };
    // The dry runs below are independent (each on a device of its own), so they run on every core:
    // the segments' peaks at once, then the candidates at once, in their order (Note [Planning on
    // every core]).
    let training_peak = |r: &PlanRequest| -> Result<u64, TrainError> {
        Ok(predict(r, lightest_candidates(r)[0], None, None)?.map_or(u64::MAX, |p| p.peak_allocated))
    };
    let mut dry_runs = 0;
    let ranked: Vec<String> = if req.checkpoint == CheckpointChoice::Auto {
        let alone = |name: &String| CheckpointChoice::Segments(vec![name.clone()]);
        let peaks = std::iter::once(CheckpointChoice::None)
            .chain(names.iter().map(alone))
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|choice| training_peak(&with(choice)))
            .collect::<Result<Vec<u64>, TrainError>>()?;
        dry_runs += peaks.len();
        let base = peaks[0];
        let mut scored: Vec<(f64, String)> = names
            .iter()
            .zip(&peaks[1..])
            .map(|(name, &peak)| (base.saturating_sub(peak) as f64 / costs.share(name).max(1e-9), name.clone()))
            .collect();
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
    let jobs: Vec<(Precision, &Vec<String>)> =
        precisions.iter().flat_map(|&precision| sets.iter().map(move |set| (precision, set))).collect();
    let weighed = jobs
        .into_par_iter()
        .map(|(precision, checkpointed)| {
            let mut dry_runs = 0;
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
            let time = |m: usize| costs.step_ms_in(req.rank_batch(), m, checkpointed, precision);
            let fitting = match fitting_micro(&r, &mut run)? {
                Some((largest, _, balanced)) => {
                    let mut options =
                        balanced_micro_batches(r.rank_batch(), largest, r.micro_batch, r.model.smallest_micro_batch());
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
            let m = fitting.map_or(micro.unwrap_or(req.model.smallest_micro_batch()), |(m, _, _)| m);
            let step_ms = time(m);
            let candidate = match fitting {
                Some((m, largest, peak)) => Candidate {
                    precision,
                    micro_batch: m,
                    largest_micro_batch: largest,
                    accumulation_steps: req.rank_batch().div_ceil(m),
                    peak_reserved: peak,
                    step_ms,
                    checkpointed: checkpointed.clone(),
                },
                None => Candidate {
                    precision,
                    micro_batch: 0,
                    largest_micro_batch: 0,
                    accumulation_steps: 0,
                    peak_reserved: run(m, Some(m.min(MAX_EVAL_MICRO)), None)?.map_or(u64::MAX, |p| p.peak_reserved),
                    step_ms,
                    checkpointed: checkpointed.clone(),
                },
            };
            Ok((candidate, dry_runs))
        })
        .collect::<Result<Vec<(Candidate, usize)>, TrainError>>()?;
    dry_runs += weighed.iter().map(|(_, n)| n).sum::<usize>();
    let candidates = weighed.into_iter().map(|(c, _)| c).collect();
    Ok(Weighed { candidates, segments: names.to_vec(), dry_runs, calibration_ms, costs })
}

/// The micro-batches worth timing for `effective` samples when at most `largest` fit: one for each
/// number of accumulation steps from the fewest up, each as even as that count allows (`ceil(effective
/// / k)`), largest first; only `fixed` when the user fixed one. About 2 sqrt(effective) of them.
/// Micro-batches whose every chunk holds at least `smallest` samples (the last one too) are kept.
fn balanced_micro_batches(effective: usize, largest: usize, fixed: Option<usize>, smallest: usize) -> Vec<usize> {
    if let Some(m) = fixed {
        return vec![m.min(effective.max(1))];
    }
    let effective = effective.max(1);
    let mut out = Vec::new();
    let mut k = effective.div_ceil(largest.clamp(1, effective));
    while k <= effective {
        let m = effective.div_ceil(k);
        if splits_into(effective, m, smallest) {
            out.push(m);
        }
        if m <= smallest.max(1) {
            break;
        }
        // The next count that gives a smaller micro-batch.
        k = effective.div_ceil(m - 1);
    }
    out
}

/// Whether `samples` in micro-batches of `micro` (the last one what is left) give every micro-batch at
/// least `smallest` samples.
pub fn splits_into(samples: usize, micro: usize, smallest: usize) -> bool {
    let micro = micro.clamp(1, samples.max(1));
    let last = samples - (samples.div_ceil(micro).max(1) - 1) * micro;
    micro >= smallest && last >= smallest
}

/// The largest micro-batch up to `micro` that splits `samples` into micro-batches of at least
/// `smallest` (`micro` itself when the model takes any); None when none does.
fn splitting_micro(samples: usize, micro: usize, smallest: usize) -> Option<usize> {
    (smallest..=micro.min(samples)).rev().find(|&m| splits_into(samples, m, smallest))
}

/// Errors before any planning when the request's batch cannot be cut into micro-batches the model
/// takes: a model whose batch norm sees one value per channel per sample trains on at least 2 samples
/// at once (`ModelSpec::smallest_micro_batch`), so a batch of 1, a micro-batch of 1, or one that
/// leaves a last micro-batch of 1 would fail as PyTorch does.
pub fn check_smallest(req: &PlanRequest) -> Result<(), TrainError> {
    let smallest = req.model.smallest_micro_batch();
    if smallest <= 1 {
        return Ok(());
    }
    let why = format!(
        "{}: its batch norm sees one value per channel per sample, so every micro-batch needs at least {smallest} \
         samples (as in PyTorch)",
        req.model.name()
    );
    let batch = req.rank_batch();
    if batch < smallest {
        return Err(TrainError::Invalid(format!("{why}: give a --batch-size of at least {smallest}")));
    }
    if let Some(m) = req.micro_batch {
        if m < smallest {
            return Err(TrainError::Invalid(format!("{why}: --micro-batch {m} is fewer")));
        }
        if !splits_into(batch, m, smallest) {
            let hint =
                splitting_micro(batch, m, smallest).map_or(String::new(), |ok| format!(" (--micro-batch {ok} does)"));
            return Err(TrainError::Invalid(format!(
                "{why}: --micro-batch {m} leaves a micro-batch of {} of the batch of {batch}{hint}",
                batch - (batch.div_ceil(m.max(1)) - 1) * m.max(1)
            )));
        }
    }
    Ok(())
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
    precision: Precision,
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
    let f32_storage = PlanRequest { precision: Precision::Fp32, ..as_run.clone() };
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

// Note [Lightest micro-batch]
// A smaller micro-batch holds fewer activations, but once a window has more than one micro-batch its
// later passes hold the window's gradients beside the gradients they make (each committed as soon as
// it is complete, `autograd::backward_as_complete`, so at most a few at once: the largest weight's,
// say). The whole batch in one micro-batch holds only its own. So when activations are small beside
// the weights (mlp's 7 MiB of weights against its activations at batch 256), the whole batch is the
// lightest micro-batch, not 1: the planner tries it when micro-batch 1 does not fit, and a refusal
// names whichever of the two needs less.

/// The micro-batches that can be a request's lightest (Note [Lightest micro-batch]): the user's, else
/// 1 and, when larger (and plannable), the whole batch.
pub(crate) fn lightest_candidates(req: &PlanRequest) -> Vec<usize> {
    let whole = req.rank_batch().max(1);
    // The smallest micro-batch the model takes that splits the batch (Note [Lightest micro-batch]).
    let smallest = req.model.smallest_micro_batch();
    let least = (smallest..whole).find(|&m| splits_into(whole, m, smallest)).unwrap_or(whole);
    match req.micro_batch {
        Some(m) => vec![m.min(whole)],
        None if whole > least && whole <= MAX_MICRO => vec![least, whole],
        None => vec![least],
    }
}

/// The training micro-batch of `req` under its budget: (largest that fits, accumulation steps, the
/// micro-batch to run), or None when not even the first (1, or the user's) fits, nor the whole batch
/// in one (Note [Lightest micro-batch]).
fn fitting_micro(req: &PlanRequest, run: &mut DryRun) -> Result<Option<(usize, usize, usize)>, TrainError> {
    let budget = req.budget();
    let smallest = req.model.smallest_micro_batch();
    let first = req.micro_batch.unwrap_or(lightest_candidates(req)[0]).min(req.rank_batch());
    if run(first, Some(first.min(MAX_EVAL_MICRO)), budget)?.is_none() {
        let whole = req.rank_batch();
        let lighter = req.micro_batch.is_none()
            && lightest_candidates(req).contains(&whole)
            && whole != first
            && run(whole, Some(whole.min(MAX_EVAL_MICRO)), budget)?.is_some();
        return Ok(lighter.then_some((whole, 1, whole)));
    }
    if req.micro_batch.is_some() {
        return Ok(Some((first, req.rank_batch().div_ceil(first), first)));
    }
    let high = search_limit(&req.model, req.rank_batch().min(MAX_MICRO), budget);
    let largest = largest_fitting(first, high.max(first), |m| Ok(run(m, Some(1), budget)?.is_some()))?;
    // A micro-batch that splits the batch into parts the model takes (all, but for batch norm over
    // one value per channel: none of 1).
    let largest = splitting_micro(req.rank_batch(), largest, smallest).unwrap_or(first);
    // Balance the micro-batches: as many accumulation steps as the largest fitting micro-batch needs,
    // but equal parts (188 + 68 becomes 128 + 128): as fast, and lighter.
    let accumulation_steps = req.rank_batch().div_ceil(largest);
    let balanced = req.rank_batch().div_ceil(accumulation_steps);
    let balanced = if splits_into(req.rank_batch(), balanced, smallest) { balanced } else { largest };
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
        let mut least: Option<(u64, usize)> = None;
        for m in lightest_candidates(req) {
            if let Some(p) = run(m, Some(m.min(MAX_EVAL_MICRO)), None)? {
                if least.is_none_or(|(b, _)| p.peak_reserved < b) {
                    least = Some((p.peak_reserved, m));
                }
            }
        }
        let (needs, lightest) = least.unwrap_or((0, lightest_candidates(req)[0]));
        return Err(refusal(req, needs, lightest));
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
        segments: req.segments,
        optimizer_step: req.optimizer_step,
    })
}

/// The planner's refusal: the run does not fit, and what the least of it needs (`needs`, peak
/// reserved). The doctor adds remedies ([`crate::doctor::plan`]).
pub fn refusal(req: &PlanRequest, needs: u64, lightest: usize) -> TrainError {
    TrainError::DoesNotFit(Box::new(Diagnosis {
        problem: problem(req, needs, lightest),
        capacity_bytes: req.capacity,
        needs_bytes: needs,
        remedies: Vec::new(),
    }))
}

/// "gpt does not fit in 40.00 MiB: even a micro-batch of 1 with every segment checkpointed needs 52.00
/// MiB (peak reserved)."
pub(crate) fn problem(req: &PlanRequest, needs: u64, lightest: usize) -> String {
    let cap = req.capacity.map_or("unlimited memory".to_string(), format_bytes);
    let margin = match req.safety_margin > 0.0 {
        true => format!(" with a {:.0}% safety margin", req.safety_margin * 100.0),
        false => String::new(),
    };
    let micro = match req.micro_batch {
        Some(m) => format!("micro-batch {m} as asked"),
        None if lightest > 1 && lightest == req.rank_batch() => {
            format!("its lightest micro-batch, the whole batch of {lightest} in one,")
        }
        None => format!("a micro-batch of {lightest}"),
    };
    let segments = segment_names(req).is_ok_and(|n| !n.is_empty());
    let checkpointing = match &req.checkpoint {
        CheckpointChoice::Auto | CheckpointChoice::All if segments => " with every segment checkpointed",
        CheckpointChoice::Auto | CheckpointChoice::All => "",
        CheckpointChoice::Segments(_) => " with the segments asked checkpointed",
        CheckpointChoice::None => "",
    };
    format!(
        "{} does not fit in {cap}{margin}: even {micro}{checkpointing} needs {} (peak reserved).",
        req.model.name(),
        format_bytes(needs)
    )
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
        true => largest_fitting(1, high, within),
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
        assert_eq!(balanced_micro_batches(64, 64, None, 1), [64, 32, 22, 16, 13, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(balanced_micro_batches(64, 20, None, 1)[..3], [16, 13, 11]);
        assert_eq!(balanced_micro_batches(10, 100, None, 1), [10, 5, 4, 3, 2, 1]);
        // A model that takes no micro-batch of 1: 3 would leave one (3 + 3 + 3 + 1).
        assert_eq!(balanced_micro_batches(10, 100, None, 2), [10, 5, 4, 2]);
        assert_eq!(balanced_micro_batches(1, 1, None, 1), [1]);
        assert_eq!(balanced_micro_batches(64, 64, Some(8), 1), [8]);
        let many = balanced_micro_batches(1 << 30, 1 << 16, None, 1);
        assert!(many.len() < 70_000 && many[0] == 1 << 16 && many.windows(2).all(|w| w[0] > w[1]));
    }

    #[test]
    fn a_split_keeps_every_micro_batch_at_the_smallest_the_model_takes() {
        assert!(splits_into(10, 4, 2) && !splits_into(10, 3, 2) && splits_into(10, 3, 1));
        assert!(!splits_into(9, 2, 2) && splits_into(9, 3, 2) && !splits_into(1, 1, 2));
        assert_eq!(splitting_micro(9, 4, 2), Some(3));
        assert_eq!(splitting_micro(512, 170, 2), Some(170));
        assert_eq!(splitting_micro(1, 1, 2), None);
    }

    #[test]
    fn memory_flags_round_up_to_whole_units() {
        assert_eq!(memory_flag(1), "1KiB");
        assert_eq!(memory_flag(1 << 20), "1MiB");
        assert_eq!(memory_flag((1 << 20) + 1), "2MiB");
        assert_eq!(memory_flag(1023 << 10), "1023KiB");
    }
}
