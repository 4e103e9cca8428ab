//! The out-of-memory doctor: when a run does not fit its budget, what would, as data ([`Diagnosis`],
//! defined with the error it travels in).
//!
//! Note [One doctor]: each [`Remedy`] is a change to the request (a budget, the planner's free choices,
//! half storage, more ranks) that the planner then plans like any request; the remedy carries that
//! plan's exact predicted peak (meta) and its predicted step time (the cost model), whether it changes
//! the numbers (half storage does; micro-batches, accumulation, checkpointing and ranks do not) and
//! whether this memfit can run it (ranks need a build with MPI). Text ([`Diagnosis`]'s `Display`) and
//! JSON (`serde`) are two renderings of that one value, so no figure is printed that the planner did
//! not produce. A remedy's command is the user's own command line with only the flags it needs set
//! or removed (`crates/cli/tests/doctor.rs` pastes every command of a grid of cases and checks each
//! fits at its predicted peak).

use crate::config::{CheckpointChoice, OptimizerStep, ParallelMode, Precision, Segments};
use crate::dry_run::Prediction;
use crate::error::{Diagnosis, Remedy, TrainError};
use crate::planner::{self, Plan, PlanRequest};

/// A change to the command line: a flag set to a value, or removed.
#[derive(Clone, Debug, PartialEq)]
pub enum Edit {
    Set(&'static str, String),
    Remove(&'static str),
}

/// The planner's plan ([`planner::choose`]), or, when nothing fits, the diagnosis with its remedies.
pub fn plan(req: &PlanRequest) -> Result<Plan, TrainError> {
    match planner::choose(req) {
        Err(TrainError::DoesNotFit(_)) => Err(TrainError::DoesNotFit(Box::new(diagnose(req)?))),
        result => result,
    }
}

/// The request the least of `req` is: `auto` checkpointing as every segment, `auto` precision as bf16.
fn least_of(req: &PlanRequest) -> PlanRequest {
    PlanRequest {
        checkpoint: match &req.checkpoint {
            CheckpointChoice::Auto => CheckpointChoice::All,
            c => c.clone(),
        },
        precision: match req.precision {
            Precision::Auto => Precision::Bf16,
            p => p,
        },
        ..req.clone()
    }
}

/// What `req` needs at the least, with no budget: the peak reserved of its lightest micro-batch (and
/// an evaluation one when it evaluates) and that micro-batch. The lightest is the user's, else
/// micro-batch 1 or the whole batch in one (which holds no accumulated gradients beside a pass's own,
/// and can be the lighter: Note [Lightest micro-batch] in `planner.rs`); with `auto` segments, the
/// lighter of fixed and expandable ones, and with an `auto` optimizer step, of stepping after and
/// inside backward. Zero for a model without segments asked to checkpoint some.
pub fn least_needs(req: &PlanRequest) -> Result<(u64, usize), TrainError> {
    let mut least = least_of(req);
    if least.checkpoint == CheckpointChoice::All && planner::segment_names(req)?.is_empty() {
        // A model without segments re-runs nothing.
        least.checkpoint = CheckpointChoice::None;
    }
    let eval = req.evaluate.then_some(1);
    let segments = match req.segments {
        Segments::Auto => vec![Segments::Fixed, Segments::Expandable],
        s => vec![s],
    };
    let steps = match req.optimizer_step {
        OptimizerStep::Auto if req.steps_in_backward_allowed() => vec![OptimizerStep::After, OptimizerStep::InBackward],
        OptimizerStep::Auto => vec![OptimizerStep::After],
        s => vec![s],
    };
    let mut best: Option<(u64, usize)> = None;
    for micro in planner::lightest_candidates(req) {
        for (&segments, &optimizer_step) in segments.iter().flat_map(|s| steps.iter().map(move |o| (s, o))) {
            let r = PlanRequest { segments, optimizer_step, ..least.clone() };
            if let Some(p) = planner::predict(&r, micro, eval, None)? {
                let needs = least_budget(&r, micro, eval, &p)?;
                if best.is_none_or(|(b, _)| needs < b) {
                    best = Some((needs, micro));
                }
            }
        }
    }
    Ok(best.unwrap_or((0, planner::lightest_candidates(req)[0])))
}

/// The peak reserved of `r` at `micro` under the least budget it fits, `unbounded` being its run with
/// none. Without a budget the allocator keeps what it freed; under one it releases its cache and
/// tries again before failing, so it can fit in less than it reserves unbounded (deepcnn's 8 MiB
/// unbounded fits 6 MiB). Searched in whole MiB (KiB below 1 MiB), as `--memory` is suggested.
fn least_budget(r: &PlanRequest, micro: usize, eval: Option<usize>, unbounded: &Prediction) -> Result<u64, TrainError> {
    let unit: u64 = if unbounded.peak_reserved >= 1 << 20 { 1 << 20 } else { 1 << 10 };
    // Below the allocated peak nothing fits; the unbounded reserved peak does.
    let (mut lo, mut hi) = (unbounded.peak_allocated.saturating_sub(1) / unit, unbounded.peak_reserved.div_ceil(unit));
    let mut fitting = unbounded.peak_reserved;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match planner::predict(r, micro, eval, Some(mid * unit))? {
            Some(p) => {
                hi = mid;
                fitting = p.peak_reserved;
            }
            None => lo = mid,
        }
    }
    Ok(fitting)
}

/// The diagnosis of a request that does not fit (Note [One doctor]).
pub fn diagnose(req: &PlanRequest) -> Result<Diagnosis, TrainError> {
    let (needs, lightest) = least_needs(req)?;
    let names = planner::segment_names(req)?;
    let costs = crate::calibration::model_for(req, &names).ok().map(|(c, _)| c);
    let mut remedies = Vec::new();
    let mut add = |r: &PlanRequest, what: String, edits: Vec<Edit>, changes_numbers: bool| -> Result<(), TrainError> {
        if let Some(remedy) = remedy(r, what, edits, changes_numbers, &names, costs.as_ref())? {
            remedies.push(remedy);
        }
        Ok(())
    };
    // The planner's own choices, when the user fixed them.
    let pinned = req.micro_batch.is_some() || req.checkpoint != CheckpointChoice::Auto;
    if pinned && req.capacity.is_some() {
        let free = PlanRequest { micro_batch: None, checkpoint: CheckpointChoice::Auto, ..req.clone() };
        let mut edits = vec![Edit::Remove("--micro-batch")];
        if req.checkpoint != CheckpointChoice::Auto {
            edits.push(Edit::Set("--checkpoint", "auto".into()));
        }
        add(&free, "let the planner choose the micro-batch and checkpointing".into(), edits, false)?;
    }
    // Expandable segments, when the user pinned fixed ones (a budget's default weighs them already).
    if req.segments == Segments::Fixed && req.capacity.is_some() && req.target == memfit_tensor::Target::Cpu {
        let grown = PlanRequest { segments: Segments::Expandable, ..req.clone() };
        let edits = vec![Edit::Set("--segments", "expandable".into())];
        add(&grown, "expandable segments (reserved follows allocated)".into(), edits, false)?;
    }
    // The optimizer step inside backward, when the user pinned it after (a budget's default weighs it
    // already): it changes no number, and helps where a window is one micro-batch.
    if req.optimizer_step == OptimizerStep::After && req.capacity.is_some() && req.steps_in_backward_allowed() {
        let inside = PlanRequest { optimizer_step: OptimizerStep::InBackward, ..req.clone() };
        let edits = vec![Edit::Set("--optimizer-step", "in-backward".into())];
        add(
            &inside,
            "the optimizer step inside backward (the gradients never all exist at once)".into(),
            edits,
            false,
        )?;
    }
    // A budget that fits the run as asked.
    if needs > 0 {
        let flag = planner::memory_flag(planner::with_margin(req, needs));
        if let Ok(bytes) = memfit_tensor::memory::parse_bytes(&flag) {
            let larger = PlanRequest { capacity: Some(bytes), ..req.clone() };
            add(&larger, format!("a budget of {flag}"), vec![Edit::Set("--memory", flag.clone())], false)?;
        }
    }
    // Half storage of saved activations.
    if req.precision == Precision::Fp32 && req.capacity.is_some() {
        let half = PlanRequest { precision: Precision::Bf16, ..req.clone() };
        let edits = vec![Edit::Set("--precision", "bf16".into())];
        add(&half, "saved activations in bf16".into(), edits, true)?;
    }
    // Adam's moments in 8 bits (a quarter of their bytes).
    if req.capacity.is_some() && req.optimizer.state_format() == memfit_nn::StateFormat::Fp32 {
        if let memfit_nn::OptimizerConfig::Adam { .. } | memfit_nn::OptimizerConfig::AdamW { .. } = req.optimizer {
            let compact =
                PlanRequest { optimizer: req.optimizer.with_state_format(memfit_nn::StateFormat::Int8), ..req.clone() };
            let edits = vec![Edit::Set("--optimizer-state", "int8".into())];
            add(&compact, "Adam's moments in 8 bits, block-wise".into(), edits, true)?;
        }
    }
    // Two ranks, each with the budget (each needs a sample of every batch).
    if req.parallel.is_none() && req.capacity.is_some() && req.effective_batch >= 2 {
        let zero = PlanRequest { parallel: Some((ParallelMode::Zero1, 2)), ..req.clone() };
        let edits = vec![Edit::Set("--parallel", "zero1".into())];
        add(&zero, "2 ranks with the optimizer state split (ZeRO-1)".into(), edits, false)?;
        if let Some(r) = pipeline_remedy(req, costs.as_ref())? {
            remedies.push(r);
        }
    }
    // `plan` plans ranks of every mode with one command (`--devices 2`): name it once.
    let mut seen = std::collections::HashSet::new();
    remedies.retain(|r| seen.insert(r.command.clone()));
    remedies.sort_by(|a, b| {
        let rank = |r: &Remedy| (r.changes_numbers, r.unavailable.is_some());
        rank(a).cmp(&rank(b)).then(
            a.predicted_step_time_ms
                .unwrap_or(f64::INFINITY)
                .total_cmp(&b.predicted_step_time_ms.unwrap_or(f64::INFINITY)),
        )
    });
    Ok(Diagnosis {
        problem: planner::problem(req, needs, lightest),
        capacity_bytes: req.capacity,
        needs_bytes: needs,
        remedies,
    })
}

/// The remedy that applies `edits`, planned as `r`; None when it does not fit either.
fn remedy(
    r: &PlanRequest,
    what: String,
    edits: Vec<Edit>,
    changes_numbers: bool,
    names: &[String],
    costs: Option<&crate::cost::CostModel>,
) -> Result<Option<Remedy>, TrainError> {
    let p = match planner::choose(r) {
        Ok(p) => p,
        Err(TrainError::DoesNotFit(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let ranks = r.parallel.map_or(1, |(_, n)| n);
    let step = p.predicted_step_ms.or_else(|| {
        costs.map(|c| {
            let checkpointed = match &p.checkpoint {
                CheckpointChoice::All => names.to_vec(),
                other => other.segment_names(),
            };
            let mut t = c.step_ms_in(r.rank_batch(), p.micro_batch, &checkpointed, p.precision);
            if let Some((mode, _)) = r.parallel {
                t += crate::devices::communication_ms(mode, &p);
            }
            t
        })
    });
    Ok(Some(Remedy {
        what,
        plan: plan_words(&p, ranks),
        command: command(&edits, ranks),
        flags: flags_of(&edits),
        predicted_peak_reserved_bytes: p.predicted.peak_reserved,
        predicted_step_time_ms: step,
        nominal_time: costs.is_some_and(|c| c.nominal),
        changes_numbers,
        ranks,
        unavailable: unavailable(ranks),
    }))
}

/// A GPT cut into two pipeline stages, each rank holding half of it.
fn pipeline_remedy(req: &PlanRequest, costs: Option<&crate::cost::CostModel>) -> Result<Option<Remedy>, TrainError> {
    let Some(units) = memfit_nn::stage_units(&req.model) else { return Ok(None) };
    // As `plan --devices` plans it (`auto`: its stages re-run their blocks where nothing else fits).
    let whole = PlanRequest { checkpoint: crate::stages::stage_checkpoint(&req.checkpoint), ..req.clone() };
    let staged = match crate::stages::plan_stages(&whole, 2, costs) {
        Ok(s) => s,
        Err(TrainError::Invalid(_) | TrainError::DoesNotFit(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let cut: Vec<String> = staged.stages.iter().map(|r| crate::stages::describe_units(r, units)).collect();
    Ok(Some(Remedy {
        what: "2 pipeline ranks, each holding part of the model".into(),
        plan: format!("stages {}, micro-batch {}", cut.join(" | "), staged.micro_batch),
        command: command(&[Edit::Set("--parallel", "pipeline".into())], 2),
        flags: flags_of(&[Edit::Set("--parallel", "pipeline".into())]),
        predicted_peak_reserved_bytes: staged.per_stage.iter().map(|p| p.peak_reserved).max().unwrap_or(0),
        predicted_step_time_ms: costs.map(|c| crate::devices::pipeline_step_ms(&whole, &staged, c)),
        nominal_time: costs.is_some_and(|c| c.nominal),
        changes_numbers: false,
        ranks: 2,
        unavailable: unavailable(2),
    }))
}

/// Why this memfit cannot run a remedy on `ranks` ranks: `train` needs MPI for ranks (`plan` plans
/// for them with `--devices` anywhere).
fn unavailable(ranks: usize) -> Option<String> {
    let planning = std::env::args().nth(1).as_deref() == Some("plan");
    (ranks > 1 && !planning && !memfit_dist::MPI).then(|| {
        "ranks need a memfit built with MPI: `cargo build --release --features mpi` (Debian: apt-get install \
         libopenmpi-dev openmpi-bin libclang-dev)"
            .to_string()
    })
}

/// "micro-batch 8 x 4 accumulation steps = effective batch 32, checkpointing blocks.0, bf16 storage".
fn plan_words(p: &Plan, ranks: usize) -> String {
    let mut s = match ranks {
        1 => planner::window_words(p.effective_batch, p.micro_batch),
        _ => format!(
            "micro-batch {} x {} on each of {ranks} ranks = effective batch {}",
            p.micro_batch, p.accumulation_steps, p.effective_batch
        ),
    };
    match &p.checkpoint {
        CheckpointChoice::All => s.push_str(", every segment checkpointed"),
        CheckpointChoice::Segments(names) => s.push_str(&format!(", checkpointing {}", names.join(", "))),
        CheckpointChoice::None | CheckpointChoice::Auto => {}
    }
    if p.precision.saved_dtype().is_some() {
        s.push_str(&format!(", {} storage", p.precision.name()));
    }
    s
}

/// The command line that applies `edits`: this process's own (when it is the `memfit` command) with
/// each edited flag set or removed, the rest as the user gave it; on `ranks` ranks, under `mpirun` for
/// `train` and with `--devices` for `plan`. Outside `memfit` (a library caller), the edits alone.
pub fn command(edits: &[Edit], ranks: usize) -> String {
    let args: Vec<String> = std::env::args().collect();
    let is_memfit = args.first().and_then(|a| std::path::Path::new(a).file_name()).is_some_and(|n| n == "memfit");
    let planning = args.get(1).is_some_and(|a| a == "plan");
    let mut edits = edits.to_vec();
    if planning && ranks > 1 {
        edits.retain(|e| !matches!(e, Edit::Set("--parallel", _)));
        edits.push(Edit::Set("--devices", ranks.to_string()));
    }
    let name_of = |e: &Edit| match e {
        Edit::Set(f, _) | Edit::Remove(f) => *f,
    };
    if !is_memfit {
        let words: Vec<String> = edits
            .iter()
            .map(|e| match e {
                Edit::Set(f, v) => format!("{f} {v}"),
                Edit::Remove(f) => format!("without {f}"),
            })
            .collect();
        return format!("flags: {}", words.join(", "));
    }
    let mut out = vec!["memfit".to_string()];
    let mut rest = args[1..].iter();
    while let Some(arg) = rest.next() {
        let name = arg.split('=').next().unwrap_or(arg);
        if edits.iter().any(|e| name_of(e) == name) {
            if !arg.contains('=') && name.starts_with("--") && !is_switch(name) {
                rest.next(); // its value
            }
            continue;
        }
        out.push(arg.clone());
    }
    for e in &edits {
        if let Edit::Set(flag, value) = e {
            out.push(flag.to_string());
            out.push(value.clone());
        }
    }
    let line = out.join(" ");
    match ranks > 1 && !planning {
        true => format!("mpirun -np {ranks} {line}"),
        false => line,
    }
}

/// `edits` as data: (flag, value), the value None for a flag removed.
fn flags_of(edits: &[Edit]) -> Vec<(String, Option<String>)> {
    edits
        .iter()
        .map(|e| match e {
            Edit::Set(f, v) => (f.to_string(), Some(v.clone())),
            Edit::Remove(f) => (f.to_string(), None),
        })
        .collect()
}

/// Flags that take no value (their next word is another flag).
fn is_switch(flag: &str) -> bool {
    matches!(flag, "--no-eval" | "--json")
}
