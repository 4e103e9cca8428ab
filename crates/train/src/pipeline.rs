//! Pipeline parallelism (`--parallel pipeline`): the model's layer sequence cut into stages, one per
//! rank, for a model that does not fit one rank's budget.
//!
//! Note [Pipeline]: stage s holds units `stages[s]` of the layer sequence (`memfit_nn::stage_units`:
//! the GPT's embeddings, blocks and head) and only their parameters and optimizer state. A window runs
//! in rounds of `2 * stages` micro-batches, each with GPipe's schedule: every micro-batch of the round
//! forward through the stages (each stage receives the residual stream from the one before, runs its
//! units, sends its output on), then every one backward in reverse (each stage receives the gradient of
//! its output, back-propagates it, and sends the gradient of its input back). A stage so holds the
//! activations of one round at most, whatever the window; gradients accumulate across rounds. The last stage computes the loss of each micro-batch weighted by its share of
//! the window (Note [Loss normalization]), so the accumulated gradients are the single-process ones.
//! Every message is a status followed, when it is good, by the tensor, and a stage that ran out of
//! memory still takes part in every exchange (it receives and drops what it is sent, and sends failure
//! statuses), so no stage ever waits for one that failed. After the window the stages agree whether any
//! failed; if so, every stage drops the attempt (its gradients too) and the whole window runs again:
//! at the same micro-batch, and at half of it once a stage has failed twice in a row (Note [Recovery];
//! evaluation retries a round at a time): no sample is lost or counted twice.
//! On `meta` no message moves: a stage's dry run is its allocations, received tensors included.
//!
//! The planner ([`plan_stages`]) cuts the sequence where each stage fits its rank's budget and the stages'
//! predicted times are most even, then takes the largest micro-batch every stage fits. A block's time is
//! its share of the blocks' forward as the cost model timed it; the embeddings and the head, which it
//! does not time, count as what the blocks' shares leave of one (nothing, when they sum to one): beside
//! a block they are small (the GPT's head is one d x vocab product). Without a cost model every unit
//! counts the same.

use crate::error::TrainError;
use crate::planner::{PlanRequest, Prediction};
use crate::samples::Samples;
use crate::trainer::{argmax_classes, count_correct, loss, MicroResult, Session};
use memfit_dist::{collective, Group};
use memfit_tensor::{autograd, Category, DType, Device, Phase, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// A session's stage of a pipeline.
pub struct Pipeline {
    pub group: Arc<dyn Group>,
    /// The units of the layer sequence each stage holds, in rank order.
    pub stages: Vec<Range<usize>>,
    /// The residual stream of one sample: [T, d].
    stream: [usize; 2],
}

impl Pipeline {
    fn stage(&self) -> usize {
        self.group.rank()
    }

    fn first(&self) -> bool {
        self.stage() == 0
    }

    fn last(&self) -> bool {
        self.stage() + 1 == self.stages.len()
    }

    /// Micro-batches in flight at once: each round runs this many forward, then backward (GPipe's
    /// schedule within a round; gradients accumulate across rounds), so a stage holds the activations
    /// of at most this many micro-batches whatever the window. Twice the stages keeps the pipeline's
    /// idle share (stages - 1) / (round + stages - 1) at a fifth for two stages.
    pub(crate) fn round(&self) -> usize {
        rounds_of(self.stages.len())
    }

    /// The stream of `n` samples crossing between stages.
    fn shape(&self, n: usize) -> [usize; 3] {
        [n, self.stream[0], self.stream[1]]
    }

    /// Sends `t` to stage `to`, or a failure status when this stage has failed (None).
    fn post(&self, device: &Device, t: Option<&Tensor>, to: usize) -> Result<(), TrainError> {
        if !device.computes() {
            return Ok(());
        }
        self.group.send(&[if t.is_some() { 1.0 } else { 0.0 }], to);
        if let Some(t) = t {
            collective::send(self.group.as_ref(), t, to)?;
        }
        Ok(())
    }

    /// What stage `from` sends: the tensor (category `communication`), None when that stage failed,
    /// or this stage's out-of-memory when it cannot hold the tensor (then the bytes are received and
    /// dropped on the host, so the sender never waits).
    fn fetch(&self, device: &Device, n: usize, from: usize, name: &'static str) -> Result<Option<Tensor>, TrainError> {
        if device.computes() {
            let mut status = [0.0f32];
            self.group.receive(&mut status, from);
            if status[0] != 1.0 {
                return Ok(None);
            }
        }
        let shape = self.shape(n);
        match Tensor::empty(device, &shape, DType::F32, Category::Communication, name) {
            Ok(t) => {
                collective::receive(self.group.as_ref(), &t, from)?;
                Ok(Some(t))
            }
            Err(e) => {
                if device.computes() {
                    let mut drain = vec![0.0f32; shape.iter().product()];
                    self.group.receive(&mut drain, from);
                }
                Err(e.into())
            }
        }
    }

    /// Which stages say true.
    fn which(&self, flag: bool) -> Vec<bool> {
        collective::which(self.group.as_ref(), flag)
    }

    /// True when any stage says true.
    pub(crate) fn any(&self, flag: bool) -> bool {
        collective::any(self.group.as_ref(), flag)
    }
}

/// Micro-batches per round for a pipeline of `stages` ([`Pipeline::round`]).
pub fn rounds_of(stages: usize) -> usize {
    2 * stages
}

/// A failure inside an attempt: out-of-memory is survivable (the stages agree and retry), anything
/// else ends the run.
fn survivable(e: TrainError) -> Result<TrainError, TrainError> {
    if e.as_oom().is_some() {
        Ok(e)
    } else {
        Err(e)
    }
}

/// One micro-batch's state between its forward and its backward.
struct InFlight {
    /// The received stream (a leaf requiring grad), on every stage but the first.
    input: Option<Tensor>,
    /// The stage's output (the weighted loss on the last stage).
    output: Tensor,
}

impl Session {
    /// Builds rank `group.rank()`'s stage of `spec` cut into `stages` (Note [Pipeline]).
    pub fn new_stage(
        device: Device,
        spec: &memfit_nn::ModelSpec,
        optimizer: memfit_nn::OptimizerConfig,
        seed: u64,
        group: Arc<dyn Group>,
        stages: Vec<Range<usize>>,
    ) -> Result<Session, TrainError> {
        let units = stages.get(group.rank()).cloned().ok_or_else(|| {
            TrainError::Invalid(format!("a pipeline of {} stages has no stage for rank {}", stages.len(), group.rank()))
        })?;
        if stages.len() != group.size() {
            return Err(TrainError::Invalid(format!(
                "a pipeline of {} stages needs as many ranks, not {}",
                stages.len(),
                group.size()
            )));
        }
        let model = {
            let _phase = device.enter_phase(Phase::Setup);
            memfit_nn::build_stage(spec, &device, seed, units)?
        };
        let optimizer = memfit_nn::Optimizer::new(model.parameters(), optimizer);
        let stream = [spec.gpt.max_t, spec.gpt.d_model];
        Ok(Session {
            device,
            model,
            optimizer,
            skipped_steps: 0,
            ranks: None,
            pipeline: Some(Pipeline { group, stages, stream }),
        })
    }

    /// One window through the pipeline (Note [Pipeline]), retried whole after an out-of-memory on any
    /// stage. Returns the window's results (summed over the stages) and the recoveries it took.
    pub(crate) fn pipeline_window(
        &self,
        samples: &dyn Samples,
        window: &[usize],
        micro: &mut usize,
        recover: bool,
        train: bool,
    ) -> Result<(MicroResult, usize), TrainError> {
        let p = self.pipeline.as_ref().ok_or_else(|| TrainError::Invalid("internal: not a pipeline stage".into()))?;
        let mut recoveries = 0;
        // The stages that failed the attempt before at this micro-batch size.
        let mut failed_before = vec![false; p.stages.len()];
        loop {
            let before = self.allocated();
            let (result, failure) = self.pipeline_attempt(p, samples, window, *micro, train)?;
            // A stage's own out-of-memory (a stage that only heard of another's failure does not count).
            let failed = p.which(failure.as_ref().is_some_and(|e| e.as_oom().is_some()));
            if !failed.contains(&true) {
                let mut sums = [result.loss_sum, result.correct as f64, result.predictions as f64];
                p.group.all_reduce_sum_f64(&mut sums);
                let total = MicroResult { loss_sum: sums[0], correct: sums[1] as usize, predictions: sums[2] as usize };
                return Ok((total, recoveries));
            }
            for (_, param) in self.model.parameters() {
                param.set_grad(None);
            }
            self.check_released(before)?;
            self.device.empty_cache();
            // A stage failing twice in a row at one size is short of memory (not a transient fault):
            // halve the micro-batch; it cannot go below one sample.
            let repeated = failed.iter().zip(&failed_before).any(|(now, then)| *now && *then);
            if !recover || (repeated && *micro == 1) {
                return Err(failure.unwrap_or_else(|| {
                    TrainError::Invalid(format!(
                        "another stage of the pipeline ran out of memory at micro-batch {micro} and could not recover \
                         (its error says how much it needs)"
                    ))
                }));
            }
            recoveries += 1;
            if repeated {
                *micro = micro.div_ceil(2);
                failed_before = vec![false; p.stages.len()];
            } else {
                failed_before = failed;
            }
        }
    }

    /// One attempt at a window: every micro-batch forward, then (training) every one backward in
    /// reverse. Returns this stage's results and its out-of-memory, if it had one; other errors end
    /// the run.
    fn pipeline_attempt(
        &self,
        p: &Pipeline,
        samples: &dyn Samples,
        window: &[usize],
        micro: usize,
        train: bool,
    ) -> Result<(MicroResult, Option<TrainError>), TrainError> {
        let device = &self.device;
        let n = window.len();
        let chunks: Vec<&[usize]> = window.chunks(micro.max(1)).collect();
        let mut result = MicroResult { loss_sum: 0.0, correct: 0, predictions: 0 };
        let mut failure: Option<TrainError> = None;
        let stage = p.stage();
        for round in chunks.chunks(p.round()) {
            let mut in_flight: Vec<Option<InFlight>> = Vec::with_capacity(round.len());
            for &chunk in round {
                let mut flight = None;
                if failure.is_none() {
                    match self.stage_forward(p, samples, chunk, n, train, &mut result) {
                        Ok(Some(f)) => flight = Some(f),
                        Ok(None) => failure = Some(TrainError::Invalid("an earlier stage ran out of memory".into())),
                        Err(e) => failure = Some(survivable(e)?),
                    }
                } else if !p.first() {
                    // Take (and drop) what the stage before sends, so it never waits.
                    if let Err(e) = p.fetch(device, chunk.len(), stage - 1, "stage_input") {
                        survivable(e)?;
                    }
                }
                if !p.last() {
                    p.post(device, flight.as_ref().map(|f| &f.output), stage + 1)?;
                }
                in_flight.push(flight.filter(|_| train));
            }
            if !train {
                continue;
            }
            let _phase = device.enter_phase(Phase::Backward);
            for (i, chunk) in round.iter().enumerate().rev() {
                let flight = in_flight[i].take();
                let grad = if p.last() {
                    None
                } else {
                    match p.fetch(device, chunk.len(), stage + 1, "stage_output_grad") {
                        Ok(Some(g)) => Some(g),
                        Ok(None) => {
                            failure.get_or_insert(TrainError::Invalid("a later stage ran out of memory".into()));
                            None
                        }
                        Err(e) => {
                            failure.get_or_insert(survivable(e)?);
                            None
                        }
                    }
                };
                let mut sent = None;
                if let (None, Some(f)) = (&failure, flight) {
                    let step = match grad {
                        Some(g) => autograd::backward_with(&f.output, g),
                        None => autograd::backward(&f.output),
                    };
                    match step {
                        Ok(()) => sent = f.input.as_ref().and_then(|x| x.grad()),
                        Err(e) => failure = Some(survivable(e.into())?),
                    }
                }
                if !p.first() {
                    p.post(device, sent.as_ref().filter(|_| failure.is_none()), stage - 1)?;
                }
            }
        }
        Ok((result, failure))
    }

    /// One micro-batch forward on this stage: its input (the batch, or the stream the stage before
    /// sent), its units, and on the last stage the weighted loss and the predictions' counts. None when
    /// the stage before failed.
    fn stage_forward(
        &self,
        p: &Pipeline,
        samples: &dyn Samples,
        chunk: &[usize],
        n: usize,
        train: bool,
        result: &mut MicroResult,
    ) -> Result<Option<InFlight>, TrainError> {
        let device = &self.device;
        let phase = if train { Phase::Forward } else { Phase::Eval };
        // The stage before's message first, before anything here can fail: every message of the
        // round is taken exactly once (Note [Pipeline]).
        let received = match p.first() {
            true => None,
            false => {
                let _p = device.enter_phase(phase);
                match p.fetch(device, chunk.len(), p.stage() - 1, "stage_input")? {
                    Some(t) => Some(t.set_requires_grad(train)),
                    None => return Ok(None),
                }
            }
        };
        let (tokens, targets) = if p.first() || p.last() {
            let _p = device.enter_phase(Phase::Data);
            let (x, y) = samples.to_device(device, chunk)?;
            (p.first().then_some(x), p.last().then_some(y))
        } else {
            (None, None)
        };
        let _phase = device.enter_phase(phase);
        let input = match (tokens, received) {
            (Some(x), _) => x,
            (None, Some(t)) => t,
            (None, None) => return Err(TrainError::Invalid("internal: a stage with no input".into())),
        };
        let output = self.model.forward(&input, train)?;
        let Some(y) = targets else {
            let received = (!p.first()).then_some(input);
            return Ok(Some(InFlight { input: received, output }));
        };
        let l = loss(&output, &y)?;
        let predicted = argmax_classes(&output)?;
        drop(output);
        if device.computes() {
            // Training sums per-sample means (the window's mean loss); evaluation per prediction.
            let mean = l.item()?;
            result.loss_sum += mean * if train { chunk.len() } else { y.numel() } as f64;
            result.correct += count_correct(&predicted, &y)?;
        }
        result.predictions += y.numel();
        let weighted = if !train || chunk.len() == n { l } else { l.mul_scalar(chunk.len() as f64 / n as f64)? };
        let received = (!p.first()).then_some(input);
        Ok(Some(InFlight { input: received, output: weighted }))
    }
}

/// A cut of the layer sequence into stages, and the micro-batch every stage fits.
#[derive(Clone, Debug)]
pub struct StagePlan {
    pub stages: Vec<Range<usize>>,
    pub micro_batch: usize,
    /// Each stage's predicted memory at that micro-batch (training and one evaluation micro-batch).
    pub per_stage: Vec<Prediction>,
    /// Each stage's share of the step's compute (what the cut balances).
    pub time_shares: Vec<f64>,
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
    let config = memfit_tensor::DeviceConfig::new(memfit_tensor::DeviceKind::Meta(req.target)).capacity(capacity);
    // A GPU target's device holds cuBLAS's workspace from the start: a capacity below it fits nothing.
    let device = match Device::new(config) {
        Ok(d) => d,
        Err(e) if e.as_oom().is_some() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let group: Arc<dyn Group> = Arc::new(memfit_dist::Simulated { rank: stage, size: stages.len() });
    let mut session =
        match Session::new_stage(device.clone(), &req.model, req.optimizer, req.seed, group, stages.to_vec()) {
            Ok(s) => s,
            Err(e) if e.as_oom().is_some() => return Ok(None),
            Err(e) => return Err(e),
        };
    session.set_checkpointing(&req.checkpoint)?;
    session.set_precision(req.precision)?;
    let (train, val, opts) =
        crate::planner::dry_run_rounds(req, micro, eval_micro.unwrap_or(1), rounds_of(stages.len()));
    let val: Option<&dyn Samples> = if eval_micro.is_some() { Some(val.as_ref()) } else { None };
    match session.run(train.as_ref(), val, &opts, &mut |_| {}) {
        Ok(_) => Ok(Some(crate::planner::prediction_of(&device))),
        Err(e) if e.as_oom().is_some() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The most cuts weighed (contiguous cuts of u units into n stages number C(u - 1, n - 1)).
const MAX_CUTS: usize = 4096;

/// Cuts `req`'s model into `n` stages (Note [Pipeline]): of the cuts whose every stage fits the budget
/// at micro-batch 1, the one with the most even predicted times; then the micro-batch: `req.micro_batch`
/// when fixed, else without a budget one round of micro-batches per window, else the largest that
/// every stage fits.
pub fn plan_stages(
    req: &PlanRequest,
    n: usize,
    costs: Option<&crate::cost::CostModel>,
) -> Result<StagePlan, TrainError> {
    let units = memfit_nn::stage_units(&req.model).ok_or_else(|| {
        TrainError::Invalid(format!(
            "--parallel pipeline: {} has no stages to cut; the gpt does (embeddings, blocks, head)",
            req.model.kind.name()
        ))
    })?;
    if n < 2 || n > units {
        return Err(TrainError::Invalid(format!(
            "--parallel pipeline: the {} has {units} units to cut (embeddings, {} blocks, head), so 2 to {units} ranks, \
             not {n}",
            req.model.kind.name(),
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
            req.model.kind.name(),
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
        let high = crate::planner::search_limit(&req.model, req.effective_batch.min(crate::planner::MAX_MICRO), budget);
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
            predict_stage(req, &stages, s, micro, Some(micro.min(crate::planner::MAX_EVAL_MICRO)), budget)?
                .ok_or_else(|| {
                    TrainError::Invalid("internal: the chosen pipeline stage did not fit on a second dry run".into())
                })?,
        );
    }
    let time_shares = time(&stages);
    Ok(StagePlan { stages, micro_batch: micro, per_stage, time_shares })
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

/// The whole model's parameters and buffers on rank 0, in the full model's order, gathered from every
/// stage (the other stages' parameters arrive in host memory outside the budget: the bytes of the file
/// being saved); None on the other ranks. Every rank calls it.
pub fn gather_state_dict(
    session: &Session,
    spec: &memfit_nn::ModelSpec,
    seed: u64,
    group: &dyn Group,
    stages: &[Range<usize>],
) -> Result<Option<Vec<(String, Tensor)>>, TrainError> {
    if group.rank() != 0 {
        for (_, t) in session.model.parameters() {
            collective::send(group, &t, 0)?;
        }
        return Ok(None);
    }
    let mut named: std::collections::HashMap<String, Tensor> =
        memfit_nn::checkpoint::state_dict(session.model.as_ref()).into_iter().collect();
    let host = Device::cpu();
    for (stage, units) in stages.iter().enumerate().skip(1) {
        // The stage's names and shapes, from a model on meta (nothing allocated).
        let shapes = memfit_nn::build_stage(spec, &Device::meta(), seed, units.clone())?;
        for (name, t) in shapes.parameters() {
            let received = Tensor::empty(&host, t.shape(), DType::F32, Category::Parameter, "gathered")?;
            collective::receive(group, &received, stage)?;
            named.insert(name, received);
        }
    }
    let order = memfit_nn::checkpoint::state_dict(memfit_nn::build_model(spec, &Device::meta(), seed)?.as_ref());
    order
        .into_iter()
        .map(|(name, _)| {
            let t =
                named.remove(&name).ok_or_else(|| TrainError::Invalid(format!("internal: no stage holds {name}")))?;
            Ok((name, t))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
