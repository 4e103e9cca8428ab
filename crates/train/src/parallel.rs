//! Training across ranks (`--parallel`): what a [`Session`](crate::Session) does differently when it
//! is one of several processes that train one model together.
//!
//! Note [Data parallel]: every rank holds the whole model. Each effective batch (the window) is the
//! global one; rank r takes its shard (`memfit_dist::partition::shard`), and each micro-batch's loss is
//! weighted by its share of the *global* window (Note [Loss normalization]), so the sum over ranks of
//! the accumulated gradients is exactly the single-process gradient of the window. Gradients are summed
//! by all-reduce, piece by piece through one persistent bucket (category `communication`), then every rank applies
//! the same update to the same parameters; a fingerprint of the parameters is compared across ranks
//! after every step, so a divergence is an error, never a silent drift. Out-of-memory recovery stays
//! local: a rank re-runs its own samples smaller and no collective happens inside a micro-batch.
//! Losses, accuracies and recoveries are summed over ranks; evaluation is sharded the same way.
//!
//! Note [ZeRO-1]: `--parallel zero1` is data parallel with the optimizer state partitioned. The
//! parameters' elements, flattened in `Model::parameters()` order, are cut into `size` contiguous
//! ranges (`memfit_dist::partition::shard`, as DeepSpeed's stage 1 cuts its flat buffer): rank r's
//! optimizer runs over views of its range (a parameter that straddles two ranges is two slices), keeps
//! state for those elements only, and updates them from the same views of the summed gradients; then
//! each slice's owner broadcasts the new values in place. Each rank holds 1/N of the optimizer state
//! (to an element), with no extra buffer, and since the optimizers' rules are element-wise, the update
//! is bit for bit data parallel's.

use crate::error::TrainError;
use memfit_dist::{partition, GradientBucket, Group};
use memfit_nn::{Model, Optimizer};
use memfit_tensor::{Device, Phase, Tensor};
use std::sync::Arc;

/// How ranks share the work (`--parallel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ParallelMode {
    /// Replicated model, sharded batch, all-reduced gradients (Note [Data parallel]).
    Data,
    /// Data parallel with the optimizer state sharded (Note [ZeRO-1]).
    Zero1,
    /// The layer sequence cut into one stage per rank (Note [Pipeline] in `pipeline.rs`).
    Pipeline,
}

impl ParallelMode {
    pub const ALL: [ParallelMode; 3] = [ParallelMode::Data, ParallelMode::Zero1, ParallelMode::Pipeline];

    pub fn parse(text: &str) -> Result<ParallelMode, String> {
        match text.trim() {
            "data" => Ok(ParallelMode::Data),
            "zero1" => Ok(ParallelMode::Zero1),
            "pipeline" => Ok(ParallelMode::Pipeline),
            other => Err(format!("unknown parallel mode {other:?}: give data, zero1 or pipeline")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ParallelMode::Data => "data",
            ParallelMode::Zero1 => "zero1",
            ParallelMode::Pipeline => "pipeline",
        }
    }
}

/// A session's place among its ranks.
pub struct Ranks {
    pub group: Arc<dyn Group>,
    pub mode: ParallelMode,
    bucket: GradientBucket,
    /// ZeRO-1: every rank's slices of the parameters (Note [ZeRO-1]); empty for data parallel.
    slices: Vec<Slice>,
}

/// Elements `start..start + len` of parameter `param` (flattened), whose optimizer state `owner` keeps;
/// `view` is that range of the parameter's storage.
struct Slice {
    param: usize,
    start: usize,
    len: usize,
    owner: usize,
    view: Tensor,
}

/// A flat range of `t`'s elements sharing its storage, outside any graph.
fn flat_range(t: &Tensor, start: usize, len: usize) -> Result<Tensor, TrainError> {
    let _ng = t.device().no_grad();
    Ok(t.reshape(&[-1])?.narrow(0, start, len)?.detach())
}

impl Ranks {
    /// Joins `model` to `group`: allocates the gradient bucket and, for ZeRO-1, returns the optimizer
    /// over this rank's slices of the parameters (the caller's optimizer is replaced by it).
    pub fn join(
        group: Arc<dyn Group>,
        mode: ParallelMode,
        device: &Device,
        model: &dyn Model,
        optimizer: &Optimizer,
    ) -> Result<(Ranks, Option<Optimizer>), TrainError> {
        if mode == ParallelMode::Pipeline {
            return Err(TrainError::Invalid("internal: a pipeline stage is built by Session::new_stage".into()));
        }
        let _phase = device.enter_phase(Phase::Setup);
        let params = model.parameters();
        let total: usize = params.iter().map(|(_, p)| p.numel()).sum();
        let bucket = GradientBucket::new(device, total, memfit_dist::collective::DEFAULT_BUCKET_BYTES)?;
        let mut slices = Vec::new();
        let mut sharded = None;
        if mode == ParallelMode::Zero1 {
            let mut offset = 0;
            for (param, (_, p)) in params.iter().enumerate() {
                let (first, last) = (offset, offset + p.numel());
                for owner in 0..group.size() {
                    let range = partition::shard(total, owner, group.size());
                    let (a, b) = (range.start.max(first), range.end.min(last));
                    if a < b {
                        let view = flat_range(p, a - first, b - a)?;
                        slices.push(Slice { param, start: a - first, len: b - a, owner, view });
                    }
                }
                offset = last;
            }
            let mine = slices
                .iter()
                .filter(|s| s.owner == group.rank())
                .map(|s| (format!("{}[{}..{}]", params[s.param].0, s.start, s.start + s.len), s.view.clone()))
                .collect();
            sharded = Some(Optimizer::new(mine, optimizer.config()));
        }
        Ok((Ranks { group, mode, bucket, slices }, sharded))
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's samples of a window.
    pub fn shard<'a>(&self, window: &'a [usize]) -> &'a [usize] {
        &window[partition::shard(window.len(), self.rank(), self.size())]
    }

    /// Sums every rank's gradients into each rank's (Note [Data parallel]); under ZeRO-1, hands this
    /// rank's slices their ranges of the summed gradients (views: nothing is copied).
    pub fn reduce_gradients(&self, model: &dyn Model) -> Result<(), TrainError> {
        let params: Vec<Tensor> = model.parameters().into_iter().map(|(_, p)| p).collect();
        self.bucket.all_reduce(self.group.as_ref(), &params)?;
        for s in self.slices.iter().filter(|s| s.owner == self.rank()) {
            let grad = params[s.param].grad().ok_or_else(|| TrainError::Invalid("internal: no gradient".into()))?;
            s.view.set_grad(Some(flat_range(&grad, s.start, s.len)?));
        }
        Ok(())
    }

    /// After the optimizer step: under ZeRO-1 each slice's owner broadcasts its updated values; every
    /// gradient is freed.
    pub fn finish_step(&self, model: &dyn Model) -> Result<(), TrainError> {
        for s in &self.slices {
            memfit_dist::collective::broadcast(self.group.as_ref(), &s.view, s.owner)?;
            s.view.set_grad(None);
        }
        for (_, p) in model.parameters() {
            p.set_grad(None);
        }
        Ok(())
    }

    /// Errors unless every rank holds the same parameters after `step`.
    pub fn check_replicas(&self, model: &dyn Model, step: usize) -> Result<(), TrainError> {
        let params: Vec<Tensor> = model.parameters().into_iter().map(|(_, p)| p).collect();
        let Some(mine) = memfit_dist::collective::fingerprint(&params)? else { return Ok(()) };
        let all = self.group.all_gather_u64(mine);
        if all.iter().any(|&f| f != mine) {
            return Err(TrainError::Invalid(format!(
                "internal error: the ranks' parameters differ after step {step} (fingerprints {all:x?}); the run \
                 stopped rather than train diverged replicas"
            )));
        }
        Ok(())
    }

    /// Sums small host values over ranks (losses, counts).
    pub fn sum(&self, values: &mut [f64]) {
        self.group.all_reduce_sum_f64(values)
    }

    /// True when any rank says true (so all ranks stop after the same step).
    pub fn any(&self, flag: bool) -> bool {
        memfit_dist::collective::any(self.group.as_ref(), flag)
    }
}

/// All-reduce bandwidth assumed when predicting a parallel step's time: what
/// `mpirun -np 2 memfit-collectives --bandwidth 40` measured between two ranks of one 2-core machine
/// (1.23 GB/s for 40 MiB). Real interconnects differ; the figure is printed with the prediction.
pub const NOMINAL_ALLREDUCE_BYTES_PER_S: f64 = 1.2e9;

/// The predicted communication of one step of `plan`'s configuration in `mode`: the gradients'
/// all-reduce (f32, as many bytes as the parameters) and under ZeRO-1 the owners' broadcasts of the
/// updated parameters, at [`NOMINAL_ALLREDUCE_BYTES_PER_S`].
pub fn communication_ms(mode: ParallelMode, plan: &crate::planner::Plan) -> f64 {
    let parameter_bytes = plan.training.category_peaks[memfit_tensor::Category::Parameter.index()] as f64;
    let moved = if mode == ParallelMode::Zero1 { 2.0 } else { 1.0 } * parameter_bytes;
    1e3 * moved / NOMINAL_ALLREDUCE_BYTES_PER_S
}

/// One parallel mode planned for `ranks` devices (`memfit plan --devices N`).
#[derive(Clone, Debug)]
pub struct DevicesPlan {
    pub mode: ParallelMode,
    pub ranks: usize,
    /// The plan every rank follows (micro-batch per rank, checkpointing, precision), or why none fits.
    pub plan: Result<crate::planner::Plan, String>,
    /// Each rank's predicted memory for that plan.
    pub per_rank: Vec<crate::planner::Prediction>,
    /// Predicted step time: the largest rank's compute (the cost model, at its shard of the batch)
    /// plus communication at [`NOMINAL_ALLREDUCE_BYTES_PER_S`].
    pub step_ms: Option<f64>,
    /// Pipeline: what each stage holds (empty otherwise).
    pub stages: Vec<String>,
}

/// Plans `req` (one device's request) for `ranks` devices in every mode; `costs` gives step times.
pub fn plan_devices(
    req: &crate::planner::PlanRequest,
    ranks: usize,
    costs: Option<&crate::cost::CostModel>,
) -> Result<Vec<DevicesPlan>, TrainError> {
    let all_segments = crate::planner::segment_names(req)?;
    let mut out = Vec::new();
    for mode in ParallelMode::ALL {
        if mode == ParallelMode::Pipeline {
            if memfit_nn::stage_units(&req.model).is_some() {
                out.push(plan_pipeline(req, ranks, costs)?);
            }
            continue;
        }
        let r = crate::planner::PlanRequest { parallel: Some((mode, ranks)), ..req.clone() };
        // Why a mode does not fit is one line of the devices' table: the problem, not the doctor.
        let plan = match crate::planner::plan_unexplained(&r) {
            Ok(p) => Ok(p),
            Err(TrainError::Invalid(why)) => Err(why),
            Err(TrainError::DoesNotFit(d)) => Err(d.problem),
            Err(e) => return Err(e),
        };
        let mut per_rank = Vec::new();
        let mut step_ms = None;
        if let Ok(p) = &plan {
            let fixed = crate::planner::PlanRequest { checkpoint: p.checkpoint.clone(), precision: p.precision, ..r };
            for rank in 0..ranks {
                let prediction = crate::planner::predict_rank(
                    &fixed,
                    Some(rank),
                    p.micro_batch,
                    Some(p.eval_micro_batch),
                    fixed.budget(),
                )?;
                per_rank.push(prediction.ok_or_else(|| {
                    TrainError::Invalid(format!("internal: rank {rank} of a plan that fits has no prediction"))
                })?);
            }
            step_ms = costs.map(|c| {
                let local = memfit_dist::partition::shard(req.effective_batch, 0, ranks).len();
                let names = match p.checkpoint {
                    crate::config::CheckpointChoice::All => all_segments.clone(),
                    ref c => c.segment_names(),
                };
                let half = p.precision != crate::config::Precision::Fp32;
                c.step_ms_in(local, p.micro_batch, &names, half) + communication_ms(mode, p)
            });
        }
        out.push(DevicesPlan { mode, ranks, plan, per_rank, step_ms, stages: Vec::new() });
    }
    Ok(out)
}

/// [`plan_devices`] for a pipeline: the cut and micro-batch of `crate::pipeline::plan_stages`, as a
/// plan every stage follows, and GPipe's step time: (micro-batches + stages - 1) times the slowest
/// stage's share of a micro-batch, plus the stream crossing each boundary twice per micro-batch.
fn plan_pipeline(
    req: &crate::planner::PlanRequest,
    ranks: usize,
    costs: Option<&crate::cost::CostModel>,
) -> Result<DevicesPlan, TrainError> {
    let single = crate::planner::PlanRequest {
        parallel: None,
        checkpoint: crate::config::CheckpointChoice::None,
        ..req.clone()
    };
    let staged = match crate::pipeline::plan_stages(&single, ranks, costs) {
        Ok(s) => s,
        Err(TrainError::Invalid(why)) => {
            return Ok(DevicesPlan {
                mode: ParallelMode::Pipeline,
                ranks,
                plan: Err(why),
                per_rank: Vec::new(),
                step_ms: None,
                stages: Vec::new(),
            })
        }
        Err(e) => return Err(e),
    };
    let micro = staged.micro_batch;
    let worst = staged
        .per_stage
        .iter()
        .max_by_key(|p| p.peak_reserved)
        .cloned()
        .ok_or_else(|| TrainError::Invalid("internal: a pipeline plan without stages".into()))?;
    let parts = req.effective_batch.div_ceil(micro);
    let plan = crate::planner::Plan {
        micro_batch: micro,
        accumulation_steps: parts,
        effective_batch: req.effective_batch,
        eval_micro_batch: micro.min(crate::planner::MAX_EVAL_MICRO),
        evaluates: req.evaluate,
        budget: req.budget(),
        predicted: worst.clone(),
        training: worst,
        larger: None,
        dry_runs: 0,
        planning_ms: 0.0,
        checkpoint: crate::config::CheckpointChoice::None,
        candidates: Vec::new(),
        predicted_step_ms: None,
        calibration_ms: 0.0,
        costs: None,
        precision: req.precision,
    };
    let units = memfit_nn::stage_units(&req.model).unwrap_or(0);
    let step_ms = costs.map(|c| {
        let slowest = staged.time_shares.iter().cloned().fold(0.0, f64::max);
        let stream_bytes = (micro * req.model.gpt.max_t * req.model.gpt.d_model * 4) as f64;
        (parts + ranks - 1) as f64 * slowest * c.micro_ms(micro, &[])
            + c.optimizer_ms * slowest
            + 1e3 * parts as f64 * 2.0 * stream_bytes / NOMINAL_ALLREDUCE_BYTES_PER_S
    });
    Ok(DevicesPlan {
        mode: ParallelMode::Pipeline,
        ranks,
        plan: Ok(plan),
        per_rank: staged.per_stage,
        step_ms,
        stages: staged.stages.iter().map(|s| crate::pipeline::describe_units(s, units)).collect(),
    })
}
