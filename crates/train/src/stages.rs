//! Planning a pipeline (`--parallel pipeline`, Note [Pipeline] in `pipeline.rs`): where to cut the
//! layer sequence into stages and the micro-batch every stage fits, predicted on meta by running each
//! stage as it runs.
//!
//! [`plan_stages`] cuts the sequence where each stage fits its rank's budget and the stages'
//! predicted times are most even, then takes the largest micro-batch every stage fits. A block's time is
//! its share of the blocks' forward as the cost model timed it; the embeddings and the head, which it
//! does not time, count as what the blocks' shares leave of one (nothing, when they sum to one): beside
//! a block they are small (the GPT's head is one d x vocab product). Without a cost model every unit
//! counts the same.

use crate::dry_run::{PlanRequest, Prediction};
use crate::error::TrainError;
use crate::pipeline::rounds_of;
use crate::trainer::Session;
use memfit_dist::Group;
use std::ops::Range;
use std::sync::Arc;

/// A cut of the layer sequence into stages, and the micro-batch every stage fits.
#[derive(Clone, Debug)]
pub struct StagePlan {
    pub stages: Vec<Range<usize>>,
    pub micro_batch: usize,
    /// Each stage's predicted memory at that micro-batch (training and one evaluation micro-batch).
    pub per_stage: Vec<Prediction>,
    /// Each stage's share of the step's compute (what the cut balances).
    pub time_shares: Vec<f64>,
    /// The allocator's segments every stage's device has (`auto` resolved).
    pub segments: crate::config::Segments,
    /// Whether each stage re-runs its blocks in backward: `none` or `all` (`auto` resolved).
    pub checkpoint: crate::config::CheckpointChoice,
}

/// Every cut of `units` units into `n` non-empty contiguous ranges, at most `limit` of them.
fn cuts(units: usize, n: usize, limit: usize) -> Vec<Vec<Range<usize>>> {
    fn walk(
        start: usize,
        units: usize,
        left: usize,
        acc: &mut Vec<Range<usize>>,
        out: &mut Vec<Vec<Range<usize>>>,
        limit: usize,
    ) {
        if out.len() >= limit {
            return;
        }
        if left == 1 {
            acc.push(start..units);
            out.push(acc.clone());
            acc.pop();
            return;
        }
        for end in start + 1..=units - (left - 1) {
            acc.push(start..end);
            walk(end, units, left - 1, acc, out, limit);
            acc.pop();
        }
    }
    let mut out = Vec::new();
    if n >= 1 && n <= units {
        walk(0, units, n, &mut Vec::new(), &mut out, limit);
    }
    out
}

/// Each unit's share of the forward: a block its calibrated share (`costs`), the embeddings and the
/// head half of what the blocks' shares leave of one each; equal shares without a cost model.
fn unit_shares(units: usize, costs: Option<&crate::cost::CostModel>) -> Vec<f64> {
    let Some(c) = costs else { return vec![1.0 / units as f64; units] };
    let blocks: Vec<f64> = (0..units - 2).map(|i| c.share(&format!("blocks.{i}"))).collect();
    let rest = (1.0 - blocks.iter().sum::<f64>()).max(0.0) / 2.0;
    std::iter::once(rest).chain(blocks).chain(std::iter::once(rest)).collect()
}

/// Rank `stage`'s prediction for `stages` at `micro` (training windows of `req`, one evaluation
/// micro-batch of `eval_micro`), on `meta` with `capacity`; None when it does not fit.
pub fn predict_stage(
    req: &PlanRequest,
    stages: &[Range<usize>],
    stage: usize,
    micro: usize,
    eval_micro: Option<usize>,
    capacity: Option<u64>,
) -> Result<Option<Prediction>, TrainError> {
    let program = crate::dry_run::dry_run_rounds(req, micro, eval_micro.unwrap_or(1), rounds_of(stages.len()));
    crate::dry_run::dry_run_on(req, capacity, program, eval_micro.is_some(), |device| {
        let group: Arc<dyn Group> = Arc::new(memfit_dist::Simulated { rank: stage, size: stages.len() });
        Session::new_stage(device, &req.model, req.optimizer, req.seed, group, stages.to_vec())
    })
}

/// The most cuts weighed (contiguous cuts of u units into n stages number C(u - 1, n - 1)).
const MAX_CUTS: usize = 4096;

/// What a stage can do of a `--checkpoint` choice: re-run all its blocks or none. `auto` weighs both
/// ([`plan_stages`]), `all` is all, a list of segments (which a stage cannot follow) is none.
pub fn stage_checkpoint(choice: &crate::config::CheckpointChoice) -> crate::config::CheckpointChoice {
    use crate::config::CheckpointChoice;
    match choice {
        CheckpointChoice::Auto | CheckpointChoice::All => choice.clone(),
        _ => CheckpointChoice::None,
    }
}

/// Cuts `req`'s model into `n` stages (Note [Pipeline]): of the cuts whose every stage fits the budget
/// at micro-batch 1, the one with the most even predicted times; then the micro-batch: `req.micro_batch`
/// when fixed, else without a budget one round of micro-batches per window, else the largest that
/// every stage fits.
pub fn plan_stages(
    req: &PlanRequest,
    n: usize,
    costs: Option<&crate::cost::CostModel>,
) -> Result<StagePlan, TrainError> {
    use crate::config::{CheckpointChoice, Segments};
    // `auto` checkpointing: a stage re-runs all its blocks or none (Note [Pipeline]); none when a cut
    // fits so, else all. Inside, `auto` segments: fixed ones when a cut fits them, else expandable
    // (as `planner::choose`). So the order is the cheapest first: nothing, expandable segments (no
    // time), checkpointing (recomputation), both.
    if req.checkpoint == CheckpointChoice::Auto {
        let with = |checkpoint| PlanRequest { checkpoint, ..req.clone() };
        return plan_stages(&with(CheckpointChoice::None), n, costs)
            .or_else(|refused| plan_stages(&with(CheckpointChoice::All), n, costs).map_err(|_| refused));
    }
    if req.segments == Segments::Auto {
        return plan_stages(&PlanRequest { segments: Segments::Fixed, ..req.clone() }, n, costs).or_else(|refused| {
            plan_stages(&PlanRequest { segments: Segments::Expandable, ..req.clone() }, n, costs).map_err(|_| refused)
        });
    }
    let units = memfit_nn::stage_units(&req.model).ok_or_else(|| {
        TrainError::Invalid(format!(
            "--parallel pipeline: {} has no stages to cut; the gpt does (embeddings, blocks, head)",
            req.model.name()
        ))
    })?;
    if n < 2 || n > units {
        return Err(TrainError::Invalid(format!(
            "--parallel pipeline: the {} has {units} units to cut (embeddings, {} blocks, head), so 2 to {units} ranks, \
             not {n}",
            req.model.name(),
            units - 2
        )));
    }
    let budget = req.budget();
    let shares = unit_shares(units, costs);
    let time = |cut: &[Range<usize>]| -> Vec<f64> { cut.iter().map(|r| shares[r.clone()].iter().sum()).collect() };
    let mut all = cuts(units, n, MAX_CUTS);
    all.sort_by(|a, b| {
        let (ta, tb) = (time(a), time(b));
        ta.iter().cloned().fold(0.0, f64::max).total_cmp(&tb.iter().cloned().fold(0.0, f64::max))
    });
    let fits = |cut: &[Range<usize>], micro: usize, eval: Option<usize>| -> Result<bool, TrainError> {
        for s in 0..cut.len() {
            if predict_stage(req, cut, s, micro, eval, budget)?.is_none() {
                return Ok(false);
            }
        }
        Ok(true)
    };
    let first = req.micro_batch.unwrap_or(1).min(req.effective_batch);
    let mut chosen = None;
    for cut in &all {
        if fits(cut, first, Some(first))? {
            chosen = Some(cut.clone());
            break;
        }
    }
    let Some(stages) = chosen else {
        let needs: Vec<String> = all
            .first()
            .map(|cut| {
                (0..cut.len())
                    .map(|s| {
                        predict_stage(req, cut, s, first, Some(first), None)
                            .ok()
                            .flatten()
                            .map_or("?".into(), |p| memfit_tensor::memory::format_bytes(p.peak_reserved))
                    })
                    .collect()
            })
            .unwrap_or_default();
        return Err(TrainError::Invalid(format!(
            "--parallel pipeline: no cut of {} into {n} stages fits {} per rank at micro-batch {first} (the most even cut \
             needs {} per stage): use more ranks or a larger --memory",
            req.model.name(),
            budget.map_or("unlimited".into(), memfit_tensor::memory::format_bytes),
            needs.join(" / ")
        )));
    };
    let micro = if req.micro_batch.is_some() || budget.is_none() {
        // Without a budget: one round per window, so that every stage has work (a single micro-batch
        // of the whole window would leave all stages but one idle).
        let one_round = req.effective_batch.div_ceil(rounds_of(n)).max(1);
        req.micro_batch.unwrap_or(one_round).min(req.effective_batch)
    } else {
        let high = crate::dry_run::search_limit(&req.model, req.effective_batch.min(crate::dry_run::MAX_MICRO), budget);
        let (mut lo, mut hi) = (1, high);
        if fits(&stages, hi, Some(1))? {
            lo = hi;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(&stages, mid, Some(1))? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    };
    let mut per_stage = Vec::new();
    for s in 0..stages.len() {
        per_stage.push(
            predict_stage(req, &stages, s, micro, Some(micro.min(crate::dry_run::MAX_EVAL_MICRO)), budget)?
                .ok_or_else(|| {
                    TrainError::Invalid("internal: the chosen pipeline stage did not fit on a second dry run".into())
                })?,
        );
    }
    let time_shares = time(&stages);
    Ok(StagePlan {
        stages,
        micro_batch: micro,
        per_stage,
        time_shares,
        segments: req.segments,
        checkpoint: req.checkpoint.clone(),
    })
}

/// The names of a stage's units, for people: `tok+pos`, `blocks.0-1`, `head`.
pub fn describe_units(units: &Range<usize>, total: usize) -> String {
    let blocks = total - 2;
    let mut parts = Vec::new();
    if units.start == 0 {
        parts.push("embeddings".to_string());
    }
    let (a, b) = (units.start.max(1), units.end.min(blocks + 1));
    if a < b {
        parts.push(if b - a == 1 { format!("blocks.{}", a - 1) } else { format!("blocks.{}-{}", a - 1, b - 2) });
    }
    if units.end == total {
        parts.push("head".to_string());
    }
    parts.join(" + ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_are_every_contiguous_split() {
        assert_eq!(cuts(3, 2, 100), vec![vec![0..1, 1..3], vec![0..2, 2..3]]);
        assert_eq!(cuts(4, 3, 100).len(), 3);
        assert_eq!(cuts(6, 2, 100).len(), 5);
        assert!(cuts(2, 3, 100).is_empty());
        assert_eq!(cuts(10, 3, 7).len(), 7);
    }

    #[test]
    fn units_are_named() {
        assert_eq!(describe_units(&(0..2), 6), "embeddings + blocks.0");
        assert_eq!(describe_units(&(2..6), 6), "blocks.1-3 + head");
        assert_eq!(describe_units(&(5..6), 6), "head");
        assert_eq!(describe_units(&(1..5), 6), "blocks.0-3");
    }
}
