//! One `memfit train` job end to end, for any task: load the task's data, plan the micro-batch when
//! a budget is given, build the model on the chosen device, load a checkpoint, train, evaluate, save,
//! and summarize.

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::parallel::ParallelMode;
use crate::planner::{self, Plan, PlanRequest};
use crate::resume::{Checkpoint, Template};
use crate::samples::Samples;
use crate::task::Task;
use crate::trainer::{AfterStep, RunOptions, Session, StepEvent};
use memfit_dist::Group;
use memfit_nn::ModelSpec;
use memfit_tensor::memory::format_bytes;
use memfit_tensor::{Device, DeviceConfig};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use crate::task::EMBEDDED;

pub use crate::report::RunSummary;

/// Clean steps after which a micro-batch that recovery shrank doubles again (Note [Recovery]).
const GROW_AFTER: usize = 50;

/// What the job tells its caller while it runs.
pub trait Observer: Send {
    fn data_loaded(&mut self, _description: &str, _train: usize, _val: usize) {}
    fn planned(&mut self, _plan: &Plan) {}
    /// A pipeline's cut (`--parallel pipeline`), on rank 0.
    fn staged(&mut self, _plan: &crate::stages::StagePlan, _spec: &ModelSpec) {}
    fn step(&mut self, _event: &StepEvent) {}
    fn evaluating(&mut self, _samples: usize) {}
    /// Something the user should know while the run goes on: a batch larger than the data, an
    /// out-of-memory the run recovered from. One line.
    fn notice(&mut self, _line: &str) {}
    /// Asked after every step: the signal (2 SIGINT, 15 SIGTERM) that asks the run to stop, if any.
    /// The job then writes a checkpoint (with `--save-dir`) and ends with `TrainError::Interrupted`.
    fn interrupted(&mut self) -> Option<i32> {
        None
    }
    /// A training checkpoint was written (its JSON file).
    fn checkpoint_saved(&mut self, _path: &std::path::Path) {}
}

/// An observer that ignores everything.
pub struct Quiet;
impl Observer for Quiet {}

/// Runs a training job on the rayon pool of `cfg.threads` threads.
pub fn train(cfg: &TrainConfig, observer: &mut dyn Observer) -> Result<RunSummary, TrainError> {
    train_ranks(cfg, observer, None)
}

/// [`train`] as one rank of `group` (`cfg.parallel`; Note [Data parallel]). Every rank plans the
/// same (rank 0's step-time model is shared), trains its shard and applies the same updates; rank 0
/// alone writes the report, the saved model, training checkpoints and profiles.
pub fn train_ranks(
    cfg: &TrainConfig,
    observer: &mut dyn Observer,
    group: Option<Arc<dyn Group>>,
) -> Result<RunSummary, TrainError> {
    cfg.check()?;
    // A GPU whose driver or libraries are missing is refused before the data loads.
    Device::probe(cfg.device)?;
    let group = match (cfg.parallel, group) {
        (Some(_), Some(g)) => Some(g),
        (Some(mode), None) => {
            return Err(TrainError::Invalid(format!(
                "--parallel {} needs ranks: start memfit with `mpirun -np N memfit train --parallel {} ...` from a \
                 memfit built with `--features mpi`",
                mode.name(),
                mode.name()
            )))
        }
        (None, _) => None,
    };
    let sharded = cfg.parallel.is_some_and(|m| m != crate::parallel::ParallelMode::Pipeline);
    if let Some(g) = group.as_ref().filter(|g| sharded && cfg.batch_size < g.size()) {
        return Err(TrainError::Invalid(format!(
            "--batch-size {} is smaller than the {} ranks: every rank needs a sample of each batch",
            cfg.batch_size,
            g.size()
        )));
    }
    let threads = cfg.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Invalid(format!("cannot start {threads} worker threads: {e}")))?;
    pool.install(|| train_in_pool(cfg, threads, observer, group))
}

fn train_in_pool(
    cfg: &TrainConfig,
    threads: usize,
    observer: &mut dyn Observer,
    group: Option<Arc<dyn Group>>,
) -> Result<RunSummary, TrainError> {
    let rss_at_start = memfit_tensor::memory::process::resident().map(|r| r.current);
    // The rank that writes files (the only one without ranks).
    let lead = group.as_ref().is_none_or(|g| g.rank() == 0);
    let resumed = check_before_work(cfg, lead)?;
    let task = Task::load(cfg)?;
    let (train_samples, val_samples) = (task.train_samples(), task.val_samples());
    let task_metadata: std::collections::BTreeMap<String, String> = task.checkpoint_metadata().into_iter().collect();
    if let Some(ckpt) = &resumed {
        check_resumable(cfg, ckpt, train_samples.len(), &task_metadata)?;
    }
    observer.data_loaded(&task.source(), train_samples.len(), val_samples.len());
    // A batch larger than the data is the data: one step takes every sample (the numbers are the
    // same; the plan is made for the samples a step really holds).
    let batch_size = cfg.batch_size.min(train_samples.len().max(1));
    if batch_size < cfg.batch_size {
        observer.notice(&format!(
            "--batch-size {} is more than the {batch_size} training samples: every step takes all {batch_size}",
            cfg.batch_size
        ));
    }
    let spec = task.spec.clone();
    let request = PlanRequest {
        last_window: last_window_reached(
            cfg,
            train_samples.len(),
            batch_size,
            resumed.as_ref().map_or(0, |c| c.state.progress.steps),
        )?,
        ..plan_request(cfg, &spec, batch_size, group.as_deref())?
    };
    let staged = plan_pipeline(cfg, &request, group.as_deref(), observer)?;
    planner::check_smallest(&request)?;
    check_last_window(&spec, train_samples.len(), batch_size)?;
    let (micro, eval_micro, plan) = choose_micro_batches(cfg, &request, staged.as_ref(), observer)?;
    // The plan's segments; with none (a fixed micro-batch that fits no plan runs on recovery), `auto`
    // takes expandable ones: the fewest bytes reserved for the same blocks.
    let segments = match (staged.as_ref(), &plan, request.segments) {
        (Some(s), _, _) => s.segments,
        (None, Some(p), _) => p.segments,
        (None, None, crate::config::Segments::Auto) => crate::config::Segments::Expandable,
        (None, None, s) => s,
    };
    // The plan's placement of the optimizer step; without a plan, `auto` steps after backward.
    let optimizer_step = match (&plan, request.optimizer_step) {
        (Some(p), _) => p.optimizer_step,
        (None, crate::config::OptimizerStep::Auto) => crate::config::OptimizerStep::After,
        (None, s) => s,
    };
    // Every later prediction (the remedies' savings, a profile's) is of the run as it runs.
    let request = PlanRequest { segments, optimizer_step, ..request };
    let device = run_device(cfg, segments)?;
    if let (Some(memory), Some(free)) = (cfg.memory, device.free_at_open()) {
        if memory > free {
            observer.notice(&format!(
                "note: --memory {} is more than the {} free on {}: past that, the GPU itself runs out of memory, \
                 which recovery handles as any out-of-memory (smaller micro-batches)",
                format_bytes(memory),
                format_bytes(free),
                device.describe()
            ));
        }
    }
    let mut session = build_session(cfg, &request, &device, group.as_ref(), staged.as_ref())?;
    let (checkpointed, precision, savings) =
        configure_session(&session, cfg, &request, plan.as_ref(), staged.as_ref(), micro)?;
    session.set_optimizer_step(optimizer_step)?;
    if let Some(ckpt) = &resumed {
        restore(ckpt, &mut session, micro, eval_micro)?;
    }
    if let Some(path) = &cfg.load {
        check_vocab(path, &task)?;
        load_weights(cfg, path, &session, staged.is_some())?;
    }
    let (spec_saved, outputs_saved) = Template::of(cfg);
    let template = Template {
        spec: spec_saved,
        outputs: outputs_saved,
        micro_batch: micro,
        eval_micro_batch: eval_micro,
        checkpointed_segments: checkpointed.clone(),
        train_samples: train_samples.len(),
        metadata: task_metadata,
    };
    let opts = RunOptions {
        effective_batch: batch_size,
        micro_batch: micro,
        eval_micro_batch: eval_micro,
        epochs: cfg.epochs,
        max_steps: cfg.max_steps,
        data_seed: cfg.data_seed.unwrap_or(cfg.seed),
        recover: true,
        grow_after: GROW_AFTER,
        record_samples: cfg.record_samples,
    };
    let val: Option<&dyn Samples> = if cfg.evaluate { Some(val_samples.as_ref()) } else { None };
    let (result, interrupt) = run_steps(
        &mut session,
        Steps { cfg, lead, template: &template, samples: train_samples.as_ref(), val, opts: &opts },
        resumed.as_ref(),
        observer,
    );
    let title = format!("{}, batch {} (micro {micro}) on {}", spec.name(), cfg.batch_size, cfg.device.name());
    let (outcome, profile_files) = with_profile(cfg, lead, &device, &request, result, title)?;
    if let Some(stop) = interrupt {
        return Err(stop.error(cfg));
    }
    save_model(cfg, lead, &task, &session, group.as_deref(), staged.as_ref())?;
    let stats = device.stats();
    let ranks = group.as_ref().map(|g| {
        let stages = staged.as_ref().map_or(Vec::new(), |s| {
            let units = memfit_nn::stage_units(&spec).unwrap_or(0);
            s.stages.iter().map(|r| crate::stages::describe_units(r, units)).collect()
        });
        let predicted = staged.as_ref().map_or(Vec::new(), |s| s.per_stage.clone());
        crate::report::RanksSummary::gather(g.as_ref(), cfg, &stats, stages, &predicted)
    });
    let summary = RunSummary {
        config: cfg.clone(),
        spec,
        data_source: task.source(),
        micro_batch: micro,
        accumulation_steps: request.rank_batch().div_ceil(micro),
        eval_micro_batch: eval_micro,
        plan,
        outcome,
        stats,
        capacity: device.capacity(),
        device_name: device.describe(),
        context_bytes: device.context_bytes(),
        threads,
        profile_files,
        checkpointed,
        precision,
        products: crate::report::products_label(&device),
        kernels_used: device.kernels_used(),
        launches: device.launches(),
        segments,
        optimizer_step,
        skipped_steps: session.skipped_steps,
        host: crate::report::HostMemory {
            dataset_bytes: task.host_bytes(),
            timeline_bytes: device.timeline_max_bytes(),
            // The cpu kernels' packing buffers; a GPU's workspaces are device memory, in the table.
            kernel_workspace_bytes: if cfg.device.target() == memfit_tensor::Target::Cpu {
                (memfit_kernels::gemm::WORKSPACE_BYTES_PER_THREAD * threads) as u64
            } else {
                0
            },
            pinned_bytes: device.pinned_bytes().1,
            rss_at_start_bytes: rss_at_start,
            peak_rss_bytes: memfit_tensor::memory::process::resident().map(|r| r.peak),
        },
        savings,
        ranks,
    };
    if let (Some(path), true) = (&cfg.report, lead) {
        crate::report::write(path, &summary)?;
    }
    Ok(summary)
}

/// Everything checked before any work (Note [Paths]): inputs and outputs, the report a `--report`
/// would replace, the model flags, the run being resumed and the save directory. Returns the
/// checkpoint being resumed.
fn check_before_work(cfg: &TrainConfig, lead: bool) -> Result<Option<Checkpoint>, TrainError> {
    let (outputs, inputs) = cfg.paths();
    for input in &inputs {
        crate::output::check_input(&input.flag, &input.path)?;
    }
    if lead {
        crate::output::check_outputs(&outputs, &inputs)?;
        if let Some(report) = &cfg.report {
            crate::report::check_replaceable(report)?;
        }
    }
    check_model_flags(cfg)?;
    let resumed = cfg.resume.as_deref().map(Checkpoint::latest).transpose()?;
    if let Some(ckpt) = &resumed {
        ckpt.check_config(cfg)?;
    }
    if let (Some(dir), true) = (&cfg.save_dir, lead) {
        crate::resume::check_save_dir(dir, cfg.resume.as_deref())?;
    }
    Ok(resumed)
}

/// Errors unless the run in `ckpt` trained on this data and has steps left to take.
fn check_resumable(
    cfg: &TrainConfig,
    ckpt: &Checkpoint,
    train_samples: usize,
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<(), TrainError> {
    ckpt.check_task(train_samples, metadata)?;
    let per_epoch = train_samples.div_ceil(cfg.batch_size.min(train_samples.max(1)));
    let total = crate::trainer::total_steps(per_epoch, cfg.epochs, cfg.max_steps)?;
    let done = ckpt.state.progress.steps;
    if done >= total {
        return Err(TrainError::Invalid(format!(
            "the run in {} has trained {done} steps and this one asks for {total}: nothing was left to do; give \
             --max-steps N (above {done}) or --epochs N to train it further, exactly as one longer run would",
            ckpt.dir.display()
        )));
    }
    Ok(())
}

/// The planner's request for this run: its model, batch and budget; with ranks, rank 0's step-time
/// model shared by all.
fn plan_request(
    cfg: &TrainConfig,
    spec: &ModelSpec,
    batch_size: usize,
    group: Option<&dyn Group>,
) -> Result<PlanRequest, TrainError> {
    let request = PlanRequest {
        model: spec.clone(),
        optimizer: cfg.optimizer.config(cfg.lr).with_state_format(cfg.optimizer_state),
        effective_batch: batch_size,
        capacity: cfg.memory,
        safety_margin: cfg.safety_margin,
        seed: cfg.seed,
        checkpoint: cfg.checkpoint.clone(),
        costs: crate::calibration::default_cache().map_or(crate::cost::Costs::Calibrate, crate::cost::Costs::Cached),
        micro_batch: cfg.micro_batch,
        precision: cfg.precision,
        // A pipeline's request is the whole model's: its stages are planned by `stages::plan_stages`.
        parallel: cfg.parallel.filter(|&m| m != ParallelMode::Pipeline).zip(group.map(|g| g.size())),
        target: cfg.device.target(),
        segments: cfg.segments.on(cfg.device.target()),
        evaluate: cfg.evaluate,
        optimizer_step: cfg.optimizer_step,
        last_window: None,
    };
    // Ranks and fp16 storage need every gradient before any update: `auto` steps after backward.
    let optimizer_step = match request.optimizer_step {
        crate::config::OptimizerStep::Auto if !request.steps_in_backward_allowed() => {
            crate::config::OptimizerStep::After
        }
        s => s,
    };
    let request = PlanRequest { optimizer_step, ..request };
    match group {
        Some(g) => shared_costs(request, g, cfg.parallel == Some(ParallelMode::Pipeline)),
        None => Ok(request),
    }
}

/// The samples of an epoch's last window when the data leaves fewer than `batch` after whole windows
/// and the run, from step `done` (a resumed run's), trains one (a run that stops before an epoch's
/// end never holds it): what the plan's dry runs add to the whole windows (Note [Bounded planning]).
fn last_window_reached(
    cfg: &TrainConfig,
    samples: usize,
    batch: usize,
    done: usize,
) -> Result<Option<usize>, TrainError> {
    let (per_epoch, last) = (samples.div_ceil(batch.max(1)).max(1), samples % batch.max(1));
    let total = crate::config::total_steps(per_epoch, cfg.epochs, cfg.max_steps)?;
    // Step s (from 1) trains an epoch's last window when s is a multiple of per_epoch.
    Ok((last > 0 && total / per_epoch > done / per_epoch).then_some(last))
}

/// Errors when an epoch's last window (what the data leaves after whole batches) is smaller than the
/// model takes in training (`ModelSpec::smallest_micro_batch`): PyTorch would fail on it too.
fn check_last_window(spec: &ModelSpec, samples: usize, batch: usize) -> Result<(), TrainError> {
    let smallest = spec.smallest_micro_batch();
    let last = samples % batch.max(1);
    if last == 0 || last >= smallest {
        return Ok(());
    }
    Err(TrainError::Invalid(format!(
        "{}: its batch norm sees one value per channel per sample, so every step needs at least {smallest} \
         samples, but the {samples} training samples leave a last step of {last} in batches of {batch}: give \
         another --batch-size",
        spec.name()
    )))
}

/// The training and evaluation micro-batches and the plan: a pipeline's, planned under a budget
/// (around a micro-batch the user fixed), forced, or the whole batch. Evaluation runs in micro-batches
/// of the training micro-batch unless the planner chose its own.
fn choose_micro_batches(
    cfg: &TrainConfig,
    request: &PlanRequest,
    staged: Option<&crate::stages::StagePlan>,
    observer: &mut dyn Observer,
) -> Result<(usize, usize, Option<Plan>), TrainError> {
    if let Some(s) = staged {
        return Ok((s.micro_batch, s.micro_batch.min(planner::MAX_EVAL_MICRO), None));
    }
    Ok(match (cfg.micro_batch, cfg.memory) {
        (fixed, Some(_)) => match planner::choose(request) {
            Ok(plan) => {
                observer.planned(&plan);
                (plan.micro_batch, plan.eval_micro_batch, Some(plan))
            }
            // A micro-batch the user fixed runs even where it does not fit: recovery shrinks it and
            // loses no sample (Note [Recovery]).
            Err(TrainError::DoesNotFit(d)) if fixed.is_some() => {
                observer.notice(&format!(
                    "note: {} Recovery will try smaller micro-batches where it does not fit (no sample lost).",
                    d.problem
                ));
                let m = fixed.unwrap_or(1).min(request.rank_batch());
                (m, m, None)
            }
            Err(TrainError::DoesNotFit(_)) => {
                return Err(TrainError::DoesNotFit(Box::new(crate::doctor::diagnose(request)?)))
            }
            Err(e) => return Err(e),
        },
        (Some(m), None) => (m.min(request.rank_batch()), m.min(request.rank_batch()), None),
        (None, None) => (request.rank_batch(), request.rank_batch(), None),
    })
}

/// With `--parallel pipeline`: the cut of the model into the ranks' stages and its micro-batch
/// (rank 0's step-time model shared by all).
fn plan_pipeline(
    cfg: &TrainConfig,
    request: &PlanRequest,
    group: Option<&dyn Group>,
    observer: &mut dyn Observer,
) -> Result<Option<crate::stages::StagePlan>, TrainError> {
    let Some(g) = group.filter(|_| cfg.parallel == Some(ParallelMode::Pipeline)) else { return Ok(None) };
    let costs = match &request.costs {
        crate::cost::Costs::Given(c) => Some(c.clone()),
        _ => None,
    };
    let request = PlanRequest { checkpoint: crate::stages::stage_checkpoint(&request.checkpoint), ..request.clone() };
    let staged = crate::stages::plan_stages(&request, g.size(), costs.as_ref())?;
    observer.staged(&staged, &request.model);
    Ok(Some(staged))
}

/// Continues the run of `ckpt` in `session`: it must have planned the same micro-batches.
fn restore(ckpt: &Checkpoint, session: &mut Session, micro: usize, eval_micro: usize) -> Result<(), TrainError> {
    if (ckpt.state.micro_batch, ckpt.state.eval_micro_batch) != (micro, eval_micro) {
        return Err(TrainError::Invalid(format!(
            "the run being resumed ({}) trained in micro-batches of {} (evaluation {}), this one plans {micro} \
             ({eval_micro}): resume with the memfit version that started it",
            ckpt.dir.display(),
            ckpt.state.micro_batch,
            ckpt.state.eval_micro_batch
        )));
    }
    ckpt.restore(session)
}

/// The run's outcome, its memory profile written first (`--profile`, or `--profile-on-oom` after an
/// out-of-memory), whether the run succeeded or not: a failed run is what it is for. A run's own error
/// comes first (with the doctor's advice and where its profile is); a profile that could not be written
/// is the error of a run that otherwise succeeded.
fn with_profile(
    cfg: &TrainConfig,
    lead: bool,
    device: &Device,
    request: &PlanRequest,
    result: Result<crate::trainer::RunOutcome, TrainError>,
    title: String,
) -> Result<(crate::trainer::RunOutcome, Vec<PathBuf>), TrainError> {
    let profile_dir =
        cfg.profile.as_ref().or(cfg.profile_on_oom.as_ref().filter(|_| device.stats().num_ooms > 0)).filter(|_| lead);
    let profile =
        profile_dir.map(|dir| (dir, crate::profile::write_profile(dir, &crate::profile::recording(device, title))));
    let outcome = result.map_err(|e| match (advise(e, request), &profile) {
        (TrainError::OutOfMemory { oom, advice }, Some((dir, Ok(_)))) => TrainError::OutOfMemory {
            oom,
            advice: format!("{advice}\nthe memory profile of this run is in {} (open memory.html)", dir.display()),
        },
        (e, _) => e,
    })?;
    let files = match profile {
        Some((_, written)) => written?,
        None => Vec::new(),
    };
    Ok((outcome, files))
}

/// The run's device: its capacity, segments (the plan's) and fault injection, recording a timeline
/// when a profile is asked.
fn run_device(cfg: &TrainConfig, segments: crate::config::Segments) -> Result<Device, TrainError> {
    let mut device_config =
        DeviceConfig::new(cfg.device).capacity(cfg.memory).fault(cfg.fault).expandable(segments.expandable());
    let profiling = cfg.profile.is_some() || cfg.profile_on_oom.is_some();
    if profiling {
        device_config.timeline_events = crate::profile::PROFILE_TIMELINE_EVENTS;
    }
    let device = Device::new(device_config)?;
    device.set_profiling(profiling);
    Ok(device)
}

/// The session: a pipeline stage, one of several ranks, or alone.
fn build_session(
    cfg: &TrainConfig,
    request: &PlanRequest,
    device: &Device,
    group: Option<&Arc<dyn Group>>,
    staged: Option<&crate::stages::StagePlan>,
) -> Result<Session, TrainError> {
    let (spec, optimizer) = (&request.model, request.optimizer);
    Ok(match (group, cfg.parallel, staged) {
        (Some(g), _, Some(staged)) => {
            Session::new_stage(device.clone(), spec, optimizer, cfg.seed, g.clone(), staged.stages.clone())?
        }
        (Some(g), Some(mode), None) => {
            let mut s = Session::new(device.clone(), spec, optimizer, cfg.seed).map_err(|e| advise(e, request))?;
            s.join(g.clone(), mode).map_err(|e| advise(e, request))?;
            s
        }
        _ => Session::new(device.clone(), spec, optimizer, cfg.seed).map_err(|e| advise(e, request))?,
    })
}

/// Sets the session's activation checkpointing and storage precision; returns the segments
/// checkpointed, the precision (`auto` resolved) and what the remedies in force saved.
fn configure_session(
    session: &Session,
    cfg: &TrainConfig,
    request: &PlanRequest,
    plan: Option<&Plan>,
    stage_plan: Option<&crate::stages::StagePlan>,
    micro: usize,
) -> Result<(Vec<String>, crate::config::Precision, planner::Savings), TrainError> {
    use crate::config::{CheckpointChoice, Precision};
    let staged = stage_plan.is_some();
    // `auto` is what the planner chose: for the planned micro-batch, or for a forced one under a
    // budget (then the fastest checkpointing with which it fits); none without a budget. A pipeline
    // stage checkpoints all its blocks or none (`auto`: the stage plan's choice).
    let checkpoint = match (&cfg.checkpoint, plan, cfg.memory) {
        (CheckpointChoice::Auto, _, _) if staged => stage_plan.map_or(CheckpointChoice::None, |s| s.checkpoint.clone()),
        (CheckpointChoice::All, _, _)
            if staged && session.model.checkpointing().is_none_or(|c| c.names().is_empty()) =>
        {
            CheckpointChoice::None
        }
        (CheckpointChoice::Auto, Some(p), _) => p.checkpoint.clone(),
        (CheckpointChoice::Auto, None, Some(_)) => {
            planner::fastest_segments(request, micro)?.map_or(CheckpointChoice::None, |(c, _)| c)
        }
        (choice, _, _) => choice.clone(),
    };
    let checkpointed = session.set_checkpointing(&checkpoint)?;
    // `auto` is the plan's choice; without a plan, nothing is halved.
    let precision = match (cfg.precision, plan) {
        (Precision::Auto, Some(p)) => p.precision,
        (Precision::Auto, None) => Precision::Fp32,
        (p, _) => p,
    };
    session.set_precision(precision)?;
    // What the remedies in force saved (with a budget; a pipeline's stages are planned apart).
    let savings = match cfg.memory {
        Some(_) if !staged => {
            let costs = plan.and_then(|p| p.costs.as_ref());
            planner::savings(request, micro, &checkpointed, precision, costs)?
        }
        _ => planner::Savings::default(),
    };
    Ok((checkpointed, precision, savings))
}

/// `--load`: the weights of `path` into the session (a pipeline stage takes its own part). Nothing is
/// read on a device that holds no data.
fn load_weights(cfg: &TrainConfig, path: &std::path::Path, session: &Session, stage: bool) -> Result<(), TrainError> {
    if !cfg.device.computes() {
        return Ok(());
    }
    // The checkpoint's errors name the file already.
    let loaded = match stage {
        true => {
            memfit_nn::checkpoint::load_into(path, &memfit_nn::checkpoint::state_dict(session.model.as_ref()), false)
        }
        false => memfit_nn::checkpoint::load(path, session.model.as_ref()),
    };
    loaded.map_err(|e| TrainError::Checkpoint(e.to_string()))
}

/// What the steps of a run need besides the session.
struct Steps<'a> {
    cfg: &'a TrainConfig,
    /// This process writes the files (rank 0, or alone).
    lead: bool,
    template: &'a Template,
    samples: &'a dyn Samples,
    val: Option<&'a dyn Samples>,
    opts: &'a RunOptions,
}

/// A run stopped by a signal: the signal, the step after which it stopped, the run's steps and the
/// training checkpoint written then.
struct Interrupt {
    signal: i32,
    step: usize,
    total: usize,
    written: Option<PathBuf>,
}

impl Interrupt {
    /// The error the run ends with: how to resume it, or that nothing can be resumed.
    fn error(self, cfg: &TrainConfig) -> TrainError {
        let (step, total) = (self.step, self.total);
        let name = crate::resume::signal_name(self.signal);
        let message = match (&cfg.save_dir, self.written) {
            (Some(dir), Some(json)) => format!(
                "interrupted by {name} after step {step} of {total}: checkpoint {} written; resume with: memfit train \
                 --resume {}",
                json.display(),
                dir.display()
            ),
            _ => format!(
                "interrupted by {name} after step {step} of {total}: nothing can be resumed (no --save-dir); give \
                 --save-dir DIR (and --save-every N) to write training checkpoints"
            ),
        };
        TrainError::Interrupted { signal: self.signal, message }
    }
}

/// Trains (from the checkpoint being resumed, if any), telling `observer` of every step and
/// recovery, writing training checkpoints when due, and stopping after the step a signal arrived in.
fn run_steps(
    session: &mut Session,
    run: Steps,
    resumed: Option<&Checkpoint>,
    observer: &mut dyn Observer,
) -> (Result<crate::trainer::RunOutcome, TrainError>, Option<Interrupt>) {
    let Steps { cfg, lead, template, samples, val, opts } = run;
    let mut interrupt = None;
    let mut recovered = resumed.map_or(0, |c| c.state.progress.oom_recoveries);
    let mut after = |s: &Session, e: &StepEvent, p: &crate::trainer::Progress| -> Result<AfterStep, TrainError> {
        if e.oom_recoveries > recovered {
            let times = e.oom_recoveries - recovered;
            observer.notice(&format!(
                "step {}: out of memory {}, recovered: the same samples ran again in micro-batches of {} (no \
                 sample lost; it grows back after {GROW_AFTER} clean steps)",
                e.step,
                if times == 1 { "once".to_string() } else { format!("{times} times") },
                e.micro_batch
            ));
            recovered = e.oom_recoveries;
        }
        observer.step(e);
        let signal = observer.interrupted();
        // Every N steps, and after the last (so a finished run can be extended with --resume).
        let due = cfg.save_every.is_some_and(|n| p.steps.is_multiple_of(n)) || e.step == e.total_steps;
        let mut written = None;
        if let (Some(dir), true) = (&cfg.save_dir, lead && (due || signal.is_some())) {
            let path = crate::resume::write(dir, cfg.keep, template, s, p)?;
            observer.checkpoint_saved(&path);
            written = Some(path);
        }
        Ok(match signal {
            Some(signal) => {
                interrupt = Some(Interrupt { signal, step: e.step, total: e.total_steps, written });
                AfterStep::Stop
            }
            None => AfterStep::Continue,
        })
    };
    let start = resumed.map(|c| c.state.progress.clone());
    let result = session.run_from(samples, val, opts, start, &mut after);
    (result, interrupt)
}

/// `--save`: the trained parameters (a pipeline's gathered from its stages onto rank 0, every rank
/// taking part), written by the lead rank with the task's metadata.
fn save_model(
    cfg: &TrainConfig,
    lead: bool,
    task: &Task,
    session: &Session,
    group: Option<&dyn Group>,
    staged: Option<&crate::stages::StagePlan>,
) -> Result<(), TrainError> {
    let (Some(path), true) = (&cfg.save, cfg.device.computes()) else { return Ok(()) };
    let gathered = match (staged, group) {
        (Some(s), Some(g)) => crate::pipeline::gather_state_dict(session, &task.spec, cfg.seed, g, &s.stages)?,
        _ => None,
    };
    if lead {
        let metadata: HashMap<String, String> = task.checkpoint_metadata().into_iter().collect();
        let tensors = gathered.unwrap_or_else(|| memfit_nn::checkpoint::state_dict(session.model.as_ref()));
        let bytes = memfit_nn::checkpoint::to_bytes(path, &tensors, Some(metadata))
            .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        crate::output::write_atomic("--save", path, &bytes)?;
    }
    Ok(())
}

/// With ranks and a plan that weighs time (`auto` checkpointing or precision under a budget): rank 0
/// calibrates (or reads its cache) and every rank plans with its step-time model, so all ranks choose
/// the same plan.
fn shared_costs(request: PlanRequest, group: &dyn Group, pipeline: bool) -> Result<PlanRequest, TrainError> {
    let weighs = request.checkpoint == crate::config::CheckpointChoice::Auto
        || request.precision == crate::config::Precision::Auto;
    // A pipeline's cut balances the stages' times, with or without a budget.
    if !pipeline && (request.capacity.is_none() || !weighs) {
        return Ok(request);
    }
    let json = if group.rank() == 0 {
        let alone = PlanRequest { parallel: None, ..request.clone() };
        let names = planner::segment_names(&alone)?;
        let (model, _) = crate::calibration::model_for(&alone, &names)?;
        serde_json::to_vec(&model).map_err(|e| TrainError::Invalid(format!("internal: cost model: {e}")))?
    } else {
        Vec::new()
    };
    let json = memfit_dist::collective::broadcast_bytes(group, &json, 0);
    let model = serde_json::from_slice(&json)
        .map_err(|e| TrainError::Invalid(format!("internal: rank 0's cost model did not arrive whole: {e}")))?;
    Ok(PlanRequest { costs: crate::cost::Costs::Given(model), ..request })
}

/// Turns an out-of-memory that recovery could not absorb into the explanation plus the doctor's
/// diagnosis (Note [One doctor]).
fn advise(e: TrainError, request: &PlanRequest) -> TrainError {
    let Some(oom) = e.as_oom().cloned() else { return e };
    let advice = if oom.injected && request.capacity.is_none() {
        "this out-of-memory was injected by --inject-oom where recovery cannot absorb it (during setup, or on \
         one sample twice in a row); it is not a shortage of memory (no --memory cap is set; the fault was \
         injected, not met): use a larger --inject-oom N"
            .to_string()
    } else {
        advice_for_budget(request)
    };
    TrainError::OutOfMemory { oom: Box::new(oom), advice }
}

/// What would fit: the doctor's diagnosis when the least of the run does not fit the budget; else why
/// recovery could not help.
fn advice_for_budget(request: &PlanRequest) -> String {
    let needs = match crate::doctor::least_needs(request) {
        Ok((n, _)) => n,
        Err(e) => return format!("(the doctor could not look: {e})"),
    };
    let flag = planner::memory_flag(needs);
    match request.budget() {
        Some(budget) if needs > budget => match crate::doctor::diagnose(request) {
            Ok(d) => d.to_string(),
            Err(e) => format!("(the doctor could not look: {e})"),
        },
        Some(_) => format!(
            "memfit could not recover although the least of this run needs only {} (peak reserved), which fits: \
             run `memfit plan --model {} --memory {} --batch-size {}` to see a configuration that fits.",
            format_bytes(needs),
            request.model.name(),
            planner::memory_flag(request.capacity.unwrap_or(needs)),
            request.effective_batch
        ),
        None => format!(
            "no --memory cap was set, so the host itself could not provide the memory; the least of this run \
             needs {} (peak reserved): use a smaller model or batch, or give --memory {flag} or less to plan it.",
            format_bytes(needs)
        ),
    }
}

/// What can be checked about the model before the data loads, so a wrong flag costs no loading time:
/// the model a `--load` file holds (its metadata names it) and the `--checkpoint` segments (on a
/// model built on meta; a GPT's vocabulary does not change its segments).
fn check_model_flags(cfg: &TrainConfig) -> Result<(), TrainError> {
    if let Some(path) = &cfg.load {
        let metadata = memfit_nn::checkpoint::read_metadata(path)
            .map_err(|e| TrainError::Checkpoint(e.to_string()))?
            .unwrap_or_default();
        if let Some(saved) = metadata.get(memfit_nn::models::MODEL_KEY) {
            if !saved.eq_ignore_ascii_case(cfg.model.name()) {
                return Err(TrainError::Checkpoint(format!(
                    "checkpoint {} holds a {saved} model (its metadata says so), not {}: add --model {saved}",
                    path.display(),
                    cfg.model.name()
                )));
            }
        }
    }
    if matches!(cfg.checkpoint, crate::config::CheckpointChoice::None | crate::config::CheckpointChoice::Auto) {
        return Ok(());
    }
    let spec = match cfg.model {
        memfit_nn::ModelKind::Gpt => ModelSpec::gpt(memfit_nn::GptConfig { vocab: 2, ..cfg.gpt }),
        memfit_nn::ModelKind::Imported => crate::task::imported_spec(cfg)?,
        kind => ModelSpec::image(kind, [1, 28, 28], memfit_data::NUM_CLASSES),
    };
    Session::new(Device::meta(), &spec, cfg.optimizer.config(cfg.lr).with_state_format(cfg.optimizer_state), cfg.seed)?
        .set_checkpointing(&cfg.checkpoint)?;
    Ok(())
}

/// Errors when a checkpoint made for a text task was trained on another vocabulary: its token ids
/// would mean other characters.
fn check_vocab(path: &std::path::Path, task: &Task) -> Result<(), TrainError> {
    let Some(vocab) = task.vocab() else { return Ok(()) };
    let metadata = memfit_nn::checkpoint::read_metadata(path)
        .map_err(|e| TrainError::Checkpoint(e.to_string()))?
        .unwrap_or_default();
    let size = match metadata.get(memfit_nn::models::VOCAB_SIZE_KEY) {
        Some(size) if task.spec.kind == memfit_nn::ModelKind::Gpt => size.parse().ok(),
        _ => None,
    };
    if let Some(size) = size.filter(|&size: &usize| size != task.spec.gpt.vocab) {
        return Err(TrainError::Checkpoint(format!(
            "checkpoint {} is of a model with a vocabulary of {size} tokens; this run's has {}: give --vocab {size}",
            path.display(),
            task.spec.gpt.vocab
        )));
    }
    match metadata.get(memfit_nn::models::VOCAB_KEY) {
        Some(saved) if *saved == vocab.as_string() => Ok(()),
        Some(saved) => Err(TrainError::Checkpoint(format!(
            "checkpoint {} was trained on a text with another vocabulary ({} characters; this text has {}): \
             train on the same text, or start without --load",
            path.display(),
            saved.chars().count(),
            vocab.len()
        ))),
        None => Err(TrainError::Checkpoint(format!(
            "checkpoint {} has no vocabulary: it was not saved by `memfit train --model gpt`",
            path.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run holds an epoch's last window only where the data leaves one and some step it takes ends
    /// an epoch: 274 samples in batches of 37 make epochs of 8 steps, the 8th of 15 samples.
    #[test]
    fn the_last_window_is_planned_where_a_step_ends_an_epoch() {
        let run =
            |epochs: Option<usize>, max_steps: Option<usize>| TrainConfig { epochs, max_steps, ..Default::default() };
        let last =
            |cfg: &TrainConfig, samples: usize, done: usize| last_window_reached(cfg, samples, 37, done).unwrap();
        assert_eq!(last(&run(None, Some(7)), 274, 0), None, "seven steps stop before the epoch's end");
        assert_eq!(last(&run(None, Some(8)), 274, 0), Some(15));
        assert_eq!(last(&run(Some(1), None), 274, 0), Some(15));
        assert_eq!(last(&run(Some(2), None), 296, 0), None, "296 is eight whole batches");
        // Resumed at step 8 (past the first epoch's end), to step 15: not the second's (step 16).
        assert_eq!(last(&run(None, Some(15)), 274, 8), None);
        assert_eq!(last(&run(None, Some(16)), 274, 8), Some(15));
        assert_eq!(last(&run(None, Some(9)), 274, 7), Some(15), "step 8 is still to come");
    }
}
