//! Training checkpoints that resume exactly (`--save-every N --save-dir DIR`, `--resume DIR`), the one
//! home of their format. Not to be confused with activation checkpointing (`--checkpoint`), which
//! trades memory for recomputation inside a step.
//!
//! Note [Exact resume]: the run continued from the checkpoint of step k takes exactly the steps the
//! uninterrupted run took after step k, so both end with the same parameters byte for byte. That
//! holds because everything a step reads is either saved or a pure function of what is saved:
//! - the parameters and buffers (batch-norm statistics): `step-K.model.safetensors`, PyTorch
//!   `state_dict` names with the task's metadata (normalization, or the GPT's sizes and vocabulary),
//!   the same file `--save` writes, so PyTorch and `--load` read it;
//! - the optimizer's state (exp_avg, exp_avg_sq or momentum_buffer, named `{param}.{state}`; 8-bit
//!   moments as their u8 codes with `exp_avg_absmax`/`exp_avg_sq_absmax`):
//!   `step-K.optimizer.safetensors`; its step counts in the JSON;
//! - the position: the epoch and the windows done in it ([`Progress`]); the data order is a function
//!   of the data seed and the epoch (`Samples::epoch_ids`), initialization of the seed only (and is
//!   overwritten by the saved weights anyway); no step draws random numbers;
//! - the micro-batch in force and the streak since the last recovery (so the windows split the same way),
//!   the plan, and every flag that changes the numbers ([`RunSpec`]): a resumed run takes them from
//!   the checkpoint, and refuses a flag given with another value, naming it; except the run's length
//!   ([`HORIZON`]: `--max-steps`, `--epochs`), which no step depends on, so `--resume DIR --max-steps N`
//!   extends a finished run (a run with `--save-dir` writes a checkpoint after its last step) into
//!   exactly the run of N steps.
//!
//! A checkpoint is three files written through `output::write_atomic` (temporary file, fsync, rename,
//! fsync of the directory): the two safetensors files, then `step-K.json`, which holds the small
//! state and the length and hash of the other two. The JSON is written last, so a checkpoint exists
//! only once it is whole; reading one checks the hashes, so a truncated or altered file is an error that
//! names it. After each checkpoint, all but the newest `--keep` are removed (only files named
//! `step-N.*` that memfit writes).
//!
//! Test: `train/tests/resume.rs` (kill points of an image model with accumulation and of a tiny GPT,
//! compared bytewise with uninterrupted runs; a refused flag; corrupt and missing checkpoints) and
//! `cli/tests/resume.rs` (SIGINT to a child `memfit train`, then `--resume`).

use crate::config::{CheckpointChoice, OptimizerChoice, TrainConfig};
use crate::error::TrainError;
use crate::trainer::{Progress, Session};
use memfit_nn::ModelKind;
use memfit_tensor::Category;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The `format` field of a checkpoint's JSON.
pub const FORMAT: &str = "memfit-training-checkpoint-1";

/// Every setting that changes the numbers of a run, under the name of its flag (`batch_size` is
/// `--batch-size`). A resumed run must have the same.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    pub model: String,
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub context: usize,
    pub data: Option<PathBuf>,
    pub epochs: Option<usize>,
    pub max_steps: Option<usize>,
    pub batch_size: usize,
    pub micro_batch: Option<usize>,
    pub lr: f64,
    pub optimizer: String,
    pub memory: Option<u64>,
    pub safety_margin: f64,
    pub seed: u64,
    pub data_seed: Option<u64>,
    pub checkpoint: String,
    /// Absent in checkpoints written before `--precision` existed: fp32.
    #[serde(default = "fp32")]
    pub precision: String,
    /// Absent in checkpoints written before `--optimizer-state` existed: fp32.
    #[serde(default = "fp32")]
    pub optimizer_state: String,
}

fn fp32() -> String {
    "fp32".to_string()
}

impl RunSpec {
    pub fn of(cfg: &TrainConfig) -> RunSpec {
        RunSpec {
            model: cfg.model_name(),
            layers: cfg.gpt.layers,
            d_model: cfg.gpt.d_model,
            heads: cfg.gpt.heads,
            context: cfg.gpt.max_t,
            data: cfg.data.clone(),
            epochs: cfg.epochs,
            max_steps: cfg.max_steps,
            batch_size: cfg.batch_size,
            micro_batch: cfg.micro_batch,
            lr: cfg.lr,
            optimizer: cfg.optimizer.name().to_string(),
            memory: cfg.memory,
            safety_margin: cfg.safety_margin,
            seed: cfg.seed,
            data_seed: cfg.data_seed,
            checkpoint: cfg.checkpoint.as_flag(),
            precision: cfg.precision.name().to_string(),
            optimizer_state: cfg.optimizer_state.name().to_string(),
        }
    }

    /// Sets these settings in `cfg`.
    fn apply_to(&self, cfg: &mut TrainConfig) -> Result<(), TrainError> {
        let corrupt = |m: String| TrainError::Checkpoint(format!("the checkpoint's settings are invalid: {m}"));
        match ModelKind::parse(&self.model) {
            Ok(kind) => cfg.model = kind,
            // An imported model is saved as its archive's path.
            Err(_) if self.model.ends_with(".pt2") => {
                cfg.model = ModelKind::Imported;
                cfg.model_file = Some(self.model.clone().into());
            }
            Err(e) => return Err(corrupt(e)),
        }
        cfg.gpt.layers = self.layers;
        cfg.gpt.d_model = self.d_model;
        cfg.gpt.heads = self.heads;
        cfg.gpt.max_t = self.context;
        cfg.data = self.data.clone();
        cfg.epochs = self.epochs;
        cfg.max_steps = self.max_steps;
        cfg.batch_size = self.batch_size;
        cfg.micro_batch = self.micro_batch;
        cfg.lr = self.lr;
        cfg.optimizer = OptimizerChoice::parse(&self.optimizer).map_err(corrupt)?;
        cfg.memory = self.memory;
        cfg.safety_margin = self.safety_margin;
        cfg.seed = self.seed;
        cfg.data_seed = self.data_seed;
        cfg.checkpoint = CheckpointChoice::parse(&self.checkpoint).map_err(corrupt)?;
        cfg.precision = crate::config::Precision::parse(&self.precision).map_err(corrupt)?;
        cfg.optimizer_state = memfit_nn::StateFormat::parse(&self.optimizer_state).map_err(corrupt)?;
        Ok(())
    }

    /// The settings in which `self` (the checkpoint's) and `given` differ: (flag id, saved, given). The
    /// run's length ([`HORIZON`]) may differ: it extends or shortens the run, and changes no step.
    pub fn differences(&self, given: &RunSpec) -> Vec<(String, String, String)> {
        let (a, b) = (fields(self), fields(given));
        a.into_iter()
            .filter(|(id, _)| !HORIZON.contains(&id.as_str()))
            .filter_map(|(id, saved)| {
                let other = b.get(&id).cloned().unwrap_or(serde_json::Value::Null);
                (other != saved).then(|| (id, show(&saved), show(&other)))
            })
            .collect()
    }
}

/// The settings that say how long a run is (`--epochs`, `--max-steps`), not what any of its steps
/// computes: the first N steps of a longer run are the steps of a run of N (the data order is a
/// function of the seed and the epoch; nothing depends on the total), so a resumed run may change them
/// to extend a finished run exactly (Note [Exact resume]).
pub const HORIZON: [&str; 2] = ["epochs", "max_steps"];

fn fields(spec: &RunSpec) -> BTreeMap<String, serde_json::Value> {
    match serde_json::to_value(spec) {
        Ok(serde_json::Value::Object(m)) => m.into_iter().collect(),
        _ => BTreeMap::new(),
    }
}

fn show(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "none".to_string(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The flag of a setting id (`batch_size` -> `--batch-size`).
pub fn flag(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}

/// Settings that change no number, restored when a resumed run does not give them, so that
/// `memfit train --resume DIR` alone continues the run as it was started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunOutputs {
    pub save: Option<PathBuf>,
    pub report: Option<PathBuf>,
    pub evaluate: bool,
    pub threads: Option<usize>,
    pub save_every: Option<usize>,
    pub keep: usize,
}

/// The small state of a checkpoint (its JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct State {
    pub format: String,
    pub spec: RunSpec,
    pub outputs: RunOutputs,
    pub progress: Progress,
    /// The plan: training and evaluation micro-batches, segments run with activation checkpointing.
    pub micro_batch: usize,
    pub eval_micro_batch: usize,
    pub checkpointed_segments: Vec<String>,
    /// The optimizer's step count and each parameter's.
    pub optimizer_steps: u64,
    pub param_steps: Vec<(String, u64)>,
    /// fp16's loss scale and its count of clean steps (absent in the other precisions, and in
    /// checkpoints written before fp16 scaled its loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<(f64, u32)>,
    /// Samples in a training epoch (a check that the data is the same).
    pub train_samples: usize,
    /// The task's metadata (as in the weights file): model kind, normalization, or GPT sizes and vocabulary.
    pub metadata: BTreeMap<String, String>,
    /// The other files of the checkpoint: name, length, FNV-1a 64 hash.
    pub files: Vec<(String, u64, String)>,
}

/// A checkpoint found on disk: its state and where its files are.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub step: usize,
    pub state: State,
}

fn stem(step: usize) -> String {
    format!("step-{step:010}")
}

/// The step of a file memfit writes into a checkpoint directory (`step-N.json`, `step-N.*.safetensors`).
fn step_of(name: &str) -> Option<(usize, bool)> {
    let rest = name.strip_prefix("step-")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let tail = &rest[digits.len()..];
    let json = tail == ".json";
    let ours = json || tail == ".model.safetensors" || tail == ".optimizer.safetensors";
    (ours && !digits.is_empty()).then(|| digits.parse().ok().map(|s| (s, json)))?
}

/// Steps with a whole checkpoint (their JSON written) in `dir`, oldest first, and every file memfit
/// wrote there with its step.
fn listing(dir: &Path) -> std::io::Result<(Vec<usize>, Vec<(usize, PathBuf)>)> {
    let mut steps = Vec::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some((step, json)) = name.to_str().and_then(step_of) else { continue };
        if !entry.file_type()?.is_file() {
            continue;
        }
        if json {
            steps.push(step);
        }
        files.push((step, entry.path()));
    }
    steps.sort_unstable();
    Ok((steps, files))
}

/// FNV-1a, 64 bits: detects a truncated or altered file (not an adversary).
fn hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

impl Checkpoint {
    /// The newest whole checkpoint in `dir` (`--resume DIR`), its files checked against their hashes.
    pub fn latest(dir: &Path) -> Result<Checkpoint, TrainError> {
        let bad = |why: String| TrainError::Checkpoint(format!("--resume {}: {why}", dir.display()));
        match std::fs::metadata(dir) {
            Err(e) => return Err(bad(format!("cannot read it ({e}): give the --save-dir of the run to continue"))),
            Ok(m) if !m.is_dir() => {
                return Err(bad("it is not a directory: give the --save-dir of the run to continue".into()))
            }
            Ok(_) => {}
        }
        let (steps, _) = listing(dir).map_err(|e| bad(format!("cannot list it: {e}")))?;
        let Some(&step) = steps.last() else {
            return Err(bad(
                "it holds no training checkpoint (step-N.json, written by --save-dir): nothing to resume; start a \
                 new run"
                    .into(),
            ));
        };
        let json = dir.join(format!("{}.json", stem(step)));
        let corrupt = |what: &Path, why: String| {
            TrainError::Checkpoint(format!(
                "--resume {}: checkpoint file {} {why}; move step-{step:010}.* out of the directory to resume from \
                 the checkpoint before it, or start a new run",
                dir.display(),
                what.display()
            ))
        };
        let text = std::fs::read(&json).map_err(|e| corrupt(&json, format!("cannot be read: {e}")))?;
        let state: State =
            serde_json::from_slice(&text).map_err(|e| corrupt(&json, format!("is corrupt (not its JSON: {e})")))?;
        if state.format != FORMAT {
            return Err(corrupt(&json, format!("has format {:?}; this memfit reads {FORMAT:?}", state.format)));
        }
        if state.progress.steps != step {
            return Err(corrupt(&json, format!("says step {}, its name step {step}", state.progress.steps)));
        }
        for (name, len, sum) in &state.files {
            let path = dir.join(name);
            let bytes = std::fs::read(&path).map_err(|e| corrupt(&path, format!("cannot be read: {e}")))?;
            if bytes.len() as u64 != *len || hash(&bytes) != *sum {
                return Err(corrupt(
                    &path,
                    format!(
                        "is corrupt: {} bytes (hash {}), the checkpoint wrote {len} (hash {sum})",
                        bytes.len(),
                        hash(&bytes)
                    ),
                ));
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), step, state })
    }

    fn file(&self, kind: &str) -> PathBuf {
        self.dir.join(format!("{}.{kind}.safetensors", stem(self.step)))
    }

    /// Sets the checkpoint's settings in `cfg` (`--resume`): a setting `given(flag id)` says was given
    /// must have the saved value, else the error names its flag; the others come from the checkpoint,
    /// outputs included, so `memfit train --resume DIR` alone continues the run.
    pub fn configure(&self, cfg: &mut TrainConfig, given: &dyn Fn(&str) -> bool) -> Result<(), TrainError> {
        let differ: Vec<_> =
            self.state.spec.differences(&RunSpec::of(cfg)).into_iter().filter(|(id, _, _)| given(id)).collect();
        if let Some(e) = self.refusal(&differ) {
            return Err(e);
        }
        let (epochs, max_steps) = (cfg.epochs, cfg.max_steps);
        self.state.spec.apply_to(cfg)?;
        // A length given extends (or ends) the run; not given, the run keeps its own.
        if given("epochs") {
            cfg.epochs = epochs;
        }
        if given("max_steps") {
            cfg.max_steps = max_steps;
        }
        let o = &self.state.outputs;
        if !given("save") {
            cfg.save = o.save.clone();
        }
        if !given("report") {
            cfg.report = o.report.clone();
        }
        if !given("no_eval") {
            cfg.evaluate = o.evaluate;
        }
        if !given("threads") {
            cfg.threads = o.threads;
        }
        if !given("save_every") {
            cfg.save_every = o.save_every;
        }
        if !given("keep") {
            cfg.keep = o.keep;
        }
        if !given("save_dir") {
            cfg.save_dir = Some(self.dir.clone());
        }
        Ok(())
    }

    /// The error for settings that differ from the checkpoint's, naming the first flag.
    fn refusal(&self, differ: &[(String, String, String)]) -> Option<TrainError> {
        let (id, saved, given) = differ.first()?;
        let others = if differ.len() > 1 {
            format!(" (also {})", differ[1..].iter().map(|(id, _, _)| flag(id)).collect::<Vec<_>>().join(", "))
        } else {
            String::new()
        };
        Some(TrainError::Invalid(format!(
            "{} {given} differs from the run being resumed ({} {saved} in {}){others}: a resumed run keeps the \
             settings it was started with; leave {} out, or start a new run in another --save-dir",
            flag(id),
            flag(id),
            self.dir.display(),
            flag(id)
        )))
    }

    /// Errors unless `cfg` has exactly the checkpoint's settings (a library caller's guard; the CLI
    /// fills them in with [`Checkpoint::configure`]).
    pub fn check_config(&self, cfg: &TrainConfig) -> Result<(), TrainError> {
        match self.refusal(&self.state.spec.differences(&RunSpec::of(cfg))) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Errors unless the task's data is the one the checkpoint trained on (same epoch size, same
    /// vocabulary and normalization).
    pub fn check_task(&self, train_samples: usize, metadata: &BTreeMap<String, String>) -> Result<(), TrainError> {
        if train_samples != self.state.train_samples || *metadata != self.state.metadata {
            return Err(TrainError::Invalid(format!(
                "--data: the run being resumed ({}) trained on other data ({} samples per epoch; now {train_samples}, \
                 or another vocabulary or normalization): give the same --data",
                self.dir.display(),
                self.state.train_samples
            )));
        }
        Ok(())
    }

    /// Loads the weights, the optimizer state and fp16's loss scale into `session`.
    pub fn restore(&self, session: &mut Session) -> Result<(), TrainError> {
        let ckpt = |e: memfit_tensor::Error| TrainError::Checkpoint(e.to_string());
        memfit_nn::checkpoint::load(self.file("model"), session.model.as_ref()).map_err(ckpt)?;
        let named = memfit_nn::checkpoint::load_named(self.file("optimizer"), &session.device, Category::Temporary)
            .map_err(ckpt)?;
        let mut tensors = Vec::with_capacity(named.len());
        for (name, t) in named {
            let (param, kind) = name.rsplit_once('.').ok_or_else(|| {
                TrainError::Checkpoint(format!(
                    "{}: tensor {name:?} is not PARAM.STATE",
                    self.file("optimizer").display()
                ))
            })?;
            tensors.push((param.to_string(), kind.to_string(), t));
        }
        session
            .optimizer
            .restore(self.state.optimizer_steps, &self.state.param_steps, &tensors)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", self.file("optimizer").display())))?;
        match self.state.loss_scale {
            Some((scale, growth)) => session.restore_loss_scale(scale, growth),
            None => Ok(()),
        }
    }
}

/// Errors unless `--save-dir` can take this run's checkpoints, before any work: it is (or is created
/// as) a writable directory, and holds no checkpoint of another run (`resuming`: the directory being
/// resumed, whose checkpoints are this run's).
pub fn check_save_dir(dir: &Path, resuming: Option<&Path>) -> Result<(), TrainError> {
    let bad = |why: String| TrainError::Invalid(format!("--save-dir {}: {why}", dir.display()));
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(|e| bad(format!("cannot create it (with its parents): {e}")))?
        }
        Err(e) => return Err(bad(format!("cannot read it: {e}"))),
        Ok(m) if !m.is_dir() => return Err(bad("it is not a directory: name a directory (created if missing)".into())),
        Ok(_) => {}
    }
    crate::output::check_writable_dir("--save-dir", dir, dir)?;
    let same_as_resumed = resuming.is_some_and(|r| match (std::fs::canonicalize(r), std::fs::canonicalize(dir)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    });
    let (steps, _) = listing(dir).map_err(|e| bad(format!("cannot list it: {e}")))?;
    if let (Some(newest), false) = (steps.last(), same_as_resumed) {
        return Err(bad(format!(
            "it already holds the training checkpoints of a run (newest: step {newest}): continue that run with \
             --resume {}, or give an empty directory",
            dir.display()
        )));
    }
    Ok(())
}

/// What a checkpoint records besides the session and the progress (fixed for a run).
pub struct Template {
    pub spec: RunSpec,
    pub outputs: RunOutputs,
    pub micro_batch: usize,
    pub eval_micro_batch: usize,
    pub checkpointed_segments: Vec<String>,
    pub train_samples: usize,
    pub metadata: BTreeMap<String, String>,
}

impl Template {
    pub fn of(cfg: &TrainConfig) -> (RunSpec, RunOutputs) {
        let outputs = RunOutputs {
            save: cfg.save.clone(),
            report: cfg.report.clone(),
            evaluate: cfg.evaluate,
            threads: cfg.threads,
            save_every: cfg.save_every,
            keep: cfg.keep,
        };
        (RunSpec::of(cfg), outputs)
    }
}

/// Writes the checkpoint of `session` at `progress` into `dir` (Note [Exact resume]), then removes all
/// but the newest `keep`. Returns the JSON's path.
pub fn write(
    dir: &Path,
    keep: usize,
    template: &Template,
    session: &Session,
    progress: &Progress,
) -> Result<PathBuf, TrainError> {
    session.check_finite_parameters(progress.steps)?;
    let step = progress.steps;
    let ckpt = |e: memfit_tensor::Error| TrainError::Checkpoint(e.to_string());
    let model_name = format!("{}.model.safetensors", stem(step));
    let model_path = dir.join(&model_name);
    let metadata = template.metadata.clone().into_iter().collect();
    let weights = memfit_nn::checkpoint::state_dict(session.model.as_ref());
    let model_bytes = memfit_nn::checkpoint::to_bytes(&model_path, &weights, Some(metadata)).map_err(ckpt)?;
    let opt_name = format!("{}.optimizer.safetensors", stem(step));
    let opt_path = dir.join(&opt_name);
    let state: Vec<(String, memfit_tensor::Tensor)> =
        session.optimizer.state().into_iter().map(|(p, k, t)| (format!("{p}.{k}"), t)).collect();
    let opt_bytes = memfit_nn::checkpoint::to_bytes(&opt_path, &state, None).map_err(ckpt)?;
    crate::output::write_atomic("--save-dir", &model_path, &model_bytes)?;
    crate::output::write_atomic("--save-dir", &opt_path, &opt_bytes)?;
    let json = State {
        format: FORMAT.to_string(),
        spec: template.spec.clone(),
        outputs: template.outputs.clone(),
        progress: progress.clone(),
        micro_batch: template.micro_batch,
        eval_micro_batch: template.eval_micro_batch,
        checkpointed_segments: template.checkpointed_segments.clone(),
        optimizer_steps: session.optimizer.steps(),
        param_steps: session.optimizer.param_step_counts(),
        loss_scale: session.loss_scale(),
        train_samples: template.train_samples,
        metadata: template.metadata.clone(),
        files: vec![
            (model_name, model_bytes.len() as u64, hash(&model_bytes)),
            (opt_name, opt_bytes.len() as u64, hash(&opt_bytes)),
        ],
    };
    let text = serde_json::to_string_pretty(&json)
        .map_err(|e| TrainError::Checkpoint(format!("cannot encode the checkpoint's state: {e}")))?;
    let json_path = dir.join(format!("{}.json", stem(step)));
    crate::output::write_atomic("--save-dir", &json_path, (text + "\n").as_bytes())?;
    prune(dir, keep, step)?;
    Ok(json_path)
}

/// Removes every checkpoint file in `dir` but those of the newest `keep` whole checkpoints (the JSON
/// first, so a half-removed checkpoint is never taken for a whole one), and leftovers of an
/// interrupted write older than `newest`.
fn prune(dir: &Path, keep: usize, newest: usize) -> Result<(), TrainError> {
    let fail = |e: std::io::Error| {
        TrainError::Checkpoint(format!("--save-dir {}: cannot remove old checkpoints: {e}", dir.display()))
    };
    let (steps, mut files) = listing(dir).map_err(fail)?;
    let kept: Vec<usize> = steps.iter().rev().take(keep).copied().collect();
    files.sort_by_key(|(s, p)| (*s, p.extension().is_none_or(|e| e != "json")));
    for (step, path) in files {
        if step < newest && !kept.contains(&step) {
            std::fs::remove_file(&path).map_err(fail)?;
        }
    }
    Ok(())
}

/// The name of a termination signal, for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}
