//! Planning for several devices (`plan --devices N`): which of data parallel, ZeRO-1 and (for a
//! model of stages) a pipeline fits N ranks with the budget each, every rank's predicted peak, and the
//! predicted step time with communication at a nominal bandwidth. The ranks themselves are
//! `parallel.rs` (Note [Data parallel]) and `pipeline.rs` (Note [Pipeline]).

use crate::config::ParallelMode;
use crate::error::TrainError;

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
        let plan = match crate::planner::choose(&r) {
            Ok(p) => Ok(p),
            Err(TrainError::Invalid(why)) => Err(why),
            Err(TrainError::DoesNotFit(d)) => Err(d.problem),
            Err(e) => return Err(e),
        };
        let mut per_rank = Vec::new();
        let mut step_ms = None;
        if let Ok(p) = &plan {
            let fixed = crate::planner::PlanRequest {
                checkpoint: p.checkpoint.clone(),
                precision: p.precision,
                segments: p.segments,
                ..r
            };
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
                c.step_ms_in(local, p.micro_batch, &names, p.precision) + communication_ms(mode, p)
            });
        }
        out.push(DevicesPlan { mode, ranks, plan, per_rank, step_ms, stages: Vec::new() });
    }
    Ok(out)
}

/// [`plan_devices`] for a pipeline: the cut and micro-batch of `crate::stages::plan_stages`, as a
/// plan every stage follows, and GPipe's step time: (micro-batches + stages - 1) times the slowest
/// stage's share of a micro-batch, plus the stream crossing each boundary twice per micro-batch.
fn plan_pipeline(
    req: &crate::planner::PlanRequest,
    ranks: usize,
    costs: Option<&crate::cost::CostModel>,
) -> Result<DevicesPlan, TrainError> {
    let checkpoint = crate::stages::stage_checkpoint(&req.checkpoint);
    let single = crate::planner::PlanRequest { parallel: None, checkpoint, ..req.clone() };
    let staged = match crate::stages::plan_stages(&single, ranks, costs) {
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
        checkpoint: staged.checkpoint.clone(),
        candidates: Vec::new(),
        predicted_step_ms: None,
        calibration_ms: 0.0,
        costs: None,
        precision: req.precision,
        segments: req.segments,
        optimizer_step: crate::config::OptimizerStep::After,
    };
    let units = memfit_nn::stage_units(&req.model).unwrap_or(0);
    let step_ms = costs.map(|c| pipeline_step_ms(req, &staged, c));
    Ok(DevicesPlan {
        mode: ParallelMode::Pipeline,
        ranks,
        plan: Ok(plan),
        per_rank: staged.per_stage,
        step_ms,
        stages: staged.stages.iter().map(|s| crate::stages::describe_units(s, units)).collect(),
    })
}

/// GPipe's step time of `staged`: (micro-batches + stages - 1) times the slowest stage's share of a
/// micro-batch, its share of the optimizer, and the stream crossing each boundary twice per
/// micro-batch at [`NOMINAL_ALLREDUCE_BYTES_PER_S`].
pub fn pipeline_step_ms(
    req: &crate::planner::PlanRequest,
    staged: &crate::stages::StagePlan,
    c: &crate::cost::CostModel,
) -> f64 {
    let (micro, ranks) = (staged.micro_batch, staged.stages.len());
    let parts = req.effective_batch.div_ceil(micro.max(1));
    let slowest = staged.time_shares.iter().cloned().fold(0.0, f64::max);
    let stream_bytes = (micro * req.model.gpt.max_t * req.model.gpt.d_model * 4) as f64;
    (parts + ranks - 1) as f64 * slowest * c.micro_ms(micro, &[])
        + c.optimizer_ms * slowest
        + 1e3 * parts as f64 * 2.0 * stream_bytes / NOMINAL_ALLREDUCE_BYTES_PER_S
}
