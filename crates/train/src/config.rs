//! Typed training configuration (the CLI turns arguments into this; nothing here parses strings
//! except the small enums' `parse`).

use memfit_nn::{GptConfig, ModelKind, OptimizerConfig};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::DeviceKind;
use std::path::PathBuf;

/// `--data embedded` selects the data shipped inside memfit even when other data is installed.
pub const EMBEDDED: &str = "embedded";

/// Bounds of every size a user gives (the CLI's value parsers and the job both use them): past these a
/// run is a typo, and inside them every product memfit forms (samples x steps, batch x sample bytes)
/// fits in 64 bits.
pub mod limits {
    /// Samples per optimizer step or micro-batch (about a billion).
    pub const MAX_BATCH: u64 = 1 << 30;
    /// Passes over the training data.
    pub const MAX_EPOCHS: u64 = 1_000_000;
    /// Optimizer steps of a run (`--max-steps`) or of a benchmark.
    pub const MAX_STEPS: u64 = 1 << 32;
    /// Timed steps of a benchmark case (`bench --steps`), and its warm-up steps.
    pub const MAX_BENCH_STEPS: u64 = 10_000;
    /// `memfit bench --rounds`.
    pub const MAX_BENCH_ROUNDS: u64 = 100;
    /// Device capacity: 1024 TiB (1 PiB).
    pub const MAX_CAPACITY: u64 = 1 << 50;
    /// Worker threads per available core.
    pub const THREADS_PER_CORE: usize = 16;
    /// Training checkpoints kept (`--keep`).
    pub const MAX_KEEP: usize = 1000;
    /// The most ranks `plan --devices` plans for.
    pub const MAX_RANKS: u64 = 1024;
    /// The largest safety margin (a fraction of the capacity kept free).
    pub const MAX_SAFETY_MARGIN: f64 = 0.5;

    /// The cores this process may use.
    pub fn cores() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }

    /// The most worker threads memfit starts: a sane multiple of the cores.
    pub fn max_threads() -> usize {
        cores().saturating_mul(THREADS_PER_CORE)
    }
}

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerChoice {
    Sgd,
    Adam,
    AdamW,
}

impl OptimizerChoice {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "sgd" => Ok(OptimizerChoice::Sgd),
            "adam" => Ok(OptimizerChoice::Adam),
            "adamw" => Ok(OptimizerChoice::AdamW),
            other => Err(format!("unknown optimizer {other:?}: expected sgd, adam or adamw")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OptimizerChoice::Sgd => "sgd",
            OptimizerChoice::Adam => "adam",
            OptimizerChoice::AdamW => "adamw",
        }
    }

    /// Refuses an `--optimizer-state` this optimizer has no moments for (SGD's momentum stays fp32).
    pub fn check_state(self, state: memfit_nn::StateFormat) -> Result<(), String> {
        if self == OptimizerChoice::Sgd && state != memfit_nn::StateFormat::Fp32 {
            return Err(format!(
                "--optimizer-state {} stores Adam's moments: give it with --optimizer adam or adamw (sgd's momentum \
                 stays fp32)",
                state.name()
            ));
        }
        Ok(())
    }

    /// PyTorch's defaults, with SGD given momentum 0.9 (plain SGD trains these models slowly).
    pub fn config(self, lr: f64) -> OptimizerConfig {
        match self {
            OptimizerChoice::Sgd => {
                OptimizerConfig::Sgd { lr, momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
            }
            OptimizerChoice::Adam => OptimizerConfig::adam(lr),
            OptimizerChoice::AdamW => OptimizerConfig::adamw(lr),
        }
    }
}

/// How the device's allocator reserves memory (`--segments`): PyTorch's caching allocator's fixed
/// segments, or one expandable segment per pool whose reserved bytes follow the allocated ones
/// (`memfit_memory`'s allocator docs). Neither changes a number. On a GPU, expandable segments map
/// device memory page by page with CUDA's virtual memory calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Segments {
    #[default]
    Fixed,
    Expandable,
    /// The planner's choice under a budget: fixed segments when the plan fits them, else expandable.
    Auto,
}

impl Segments {
    pub fn parse(text: &str) -> Result<Segments, String> {
        match text.trim() {
            "fixed" => Ok(Segments::Fixed),
            "expandable" => Ok(Segments::Expandable),
            "auto" => Ok(Segments::Auto),
            other => Err(format!("unknown segments {other:?}: give fixed, expandable or auto")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Segments::Fixed => "fixed",
            Segments::Expandable => "expandable",
            Segments::Auto => "auto",
        }
    }

    /// Whether a device of this policy has expandable segments (`auto` unresolved: fixed).
    pub fn expandable(self) -> bool {
        self == Segments::Expandable
    }

    /// The policy as asked, or `auto` given (with a budget: weighed by the planner) or none (fixed).
    pub fn or_default(given: Option<Segments>, memory: Option<u64>) -> Segments {
        given.unwrap_or(if memory.is_some() { Segments::Auto } else { Segments::Fixed })
    }

    /// The policy the planner may weigh for `target`: a GPU's `auto` is fixed (its expandable
    /// segments are tested on the emulated GPU only: they are there to be asked for, not chosen).
    pub fn on(self, target: memfit_tensor::Target) -> Segments {
        match (self, target) {
            (Segments::Auto, memfit_tensor::Target::Cuda) => Segments::Fixed,
            (s, _) => s,
        }
    }
}

/// Where the optimizer steps (`--optimizer-step`): after the window's backward (PyTorch's usual
/// loop), or inside it, each parameter as soon as its gradient is complete and that gradient freed
/// (PyTorch's post-accumulate-grad hook; Note [Step in backward] in `trainer.rs`), for a window of
/// one micro-batch. The same bits either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerStep {
    #[default]
    After,
    InBackward,
    /// The planner's choice under a budget: after backward when the plan fits so, else inside it.
    Auto,
}

impl OptimizerStep {
    pub fn parse(text: &str) -> Result<OptimizerStep, String> {
        match text.trim() {
            "after" => Ok(OptimizerStep::After),
            "in-backward" => Ok(OptimizerStep::InBackward),
            "auto" => Ok(OptimizerStep::Auto),
            other => Err(format!("unknown optimizer step {other:?}: give after, in-backward or auto")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OptimizerStep::After => "after",
            OptimizerStep::InBackward => "in-backward",
            OptimizerStep::Auto => "auto",
        }
    }

    /// The placement as asked, or `auto` given a budget (weighed by the planner), else after.
    pub fn or_default(given: Option<OptimizerStep>, memory: Option<u64>) -> OptimizerStep {
        given.unwrap_or(if memory.is_some() { OptimizerStep::Auto } else { OptimizerStep::After })
    }
}

/// `--precision`: the dtype activations are saved in for backward (Note [Half-precision storage] in
/// `tensor/src/autograd.rs`) and, for bf16, how matrix products compute (bf16 operands, f32
/// accumulation: PyTorch autocast's split). Parameters, gradients and optimizer state stay f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Activations saved as computed (the default: numerics never change).
    #[default]
    Fp32,
    /// Large saved activations in bfloat16.
    Bf16,
    /// Large saved activations in float16; a step whose gradients overflow is skipped (GradScaler's rule).
    Fp16,
    /// The planner's choice under a budget: bf16 storage when it makes the fastest fitting plan.
    Auto,
}

impl Precision {
    pub fn parse(text: &str) -> Result<Precision, String> {
        match text.trim() {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" => Ok(Precision::Fp16),
            "auto" => Ok(Precision::Auto),
            other => Err(format!("unknown precision {other:?}: give fp32, bf16, fp16 or auto")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Auto => "auto",
        }
    }

    /// How matrix products compute under this precision: bf16 products for bf16, fp16 products for
    /// fp16 (Notes [bf16 products] and [fp16 products] in `memfit-kernels`), else f32.
    pub fn products(self) -> memfit_tensor::Products {
        match self {
            Precision::Bf16 => memfit_tensor::Products::Bf16,
            Precision::Fp16 => memfit_tensor::Products::F16,
            Precision::Fp32 | Precision::Auto => memfit_tensor::Products::F32,
        }
    }

    /// The device's saved dtype for this precision (`auto` unresolved: none).
    pub fn saved_dtype(self) -> Option<memfit_tensor::DType> {
        match self {
            Precision::Bf16 => Some(memfit_tensor::DType::BF16),
            Precision::Fp16 => Some(memfit_tensor::DType::F16),
            Precision::Fp32 | Precision::Auto => None,
        }
    }
}

/// Which model segments run with activation checkpointing (`--checkpoint`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CheckpointChoice {
    /// None: every activation is kept for backward (the default; numerics never change either way).
    #[default]
    None,
    /// Every segment (each GPT block, ResNet stage, CNN stage).
    All,
    /// The segments with these names (as `memfit plan` lists them, e.g. `blocks.0`).
    Segments(Vec<String>),
    /// The planner's choice under a budget: the segments of the fastest plan that fits (Note
    /// [Choosing segments] in `planner.rs`). Without a budget, none.
    Auto,
}

/// For a `--checkpoint` value that looks like a folder: the flags of training checkpoints.
pub fn path_hint(value: &str) -> String {
    match value.contains('/') || std::path::Path::new(value).exists() {
        true => format!(
            " (--checkpoint is activation checkpointing; to write training checkpoints into {value} give --save-dir \
             {value}, to continue the run saved there give --resume {value})"
        ),
        false => String::new(),
    }
}

impl CheckpointChoice {
    /// `none`, `all`, `auto`, or a comma-separated list of segment names.
    pub fn parse(text: &str) -> Result<CheckpointChoice, String> {
        match text.trim() {
            "none" => Ok(CheckpointChoice::None),
            "all" => Ok(CheckpointChoice::All),
            "auto" => Ok(CheckpointChoice::Auto),
            "" => Err("give none, all, auto, or segment names separated by commas (such as blocks.0,blocks.1)".into()),
            list => Ok(CheckpointChoice::Segments(list.split(',').map(|n| n.trim().to_string()).collect())),
        }
    }

    /// The segments named by a resolved choice (`all` as the word "all"; none and auto: empty).
    pub fn segment_names(&self) -> Vec<String> {
        match self {
            CheckpointChoice::All => vec!["all".to_string()],
            CheckpointChoice::Segments(names) => names.clone(),
            CheckpointChoice::None | CheckpointChoice::Auto => Vec::new(),
        }
    }

    /// The flag's text for this choice (what [`CheckpointChoice::parse`] reads back).
    pub fn as_flag(&self) -> String {
        match self {
            CheckpointChoice::None => "none".into(),
            CheckpointChoice::All => "all".into(),
            CheckpointChoice::Segments(names) => names.join(","),
            CheckpointChoice::Auto => "auto".into(),
        }
    }

    /// One flag per segment of a model with segments `names` (`auto` not yet planned: none); an
    /// unknown name is an error that lists the model's segments.
    pub fn flags(&self, model: &str, names: &[String]) -> Result<Vec<bool>, String> {
        match self {
            CheckpointChoice::None | CheckpointChoice::Auto => Ok(vec![false; names.len()]),
            CheckpointChoice::All => Ok(vec![true; names.len()]),
            CheckpointChoice::Segments(wanted) => {
                if let Some(bad) = wanted.iter().find(|w| !names.contains(w)) {
                    return Err(format!(
                        "--checkpoint: {model} has no segment {bad:?}; its segments are {}{}",
                        if names.is_empty() { "none".to_string() } else { names.join(", ") },
                        path_hint(bad)
                    ));
                }
                Ok(names.iter().map(|n| wanted.contains(n)).collect())
            }
        }
    }
}

/// Everything one training run needs.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: ModelKind,
    /// The `torch.export` archive of an imported model (`model` is then [`ModelKind::Imported`]).
    pub model_file: Option<PathBuf>,
    /// The GPT's sizes (its vocabulary comes from the text and `vocab`; ignored by image models).
    pub gpt: GptConfig,
    /// GPT: the model's vocabulary, the text's characters and unused tokens after them (GPT-2's
    /// 50,304, say); None: the text's characters.
    pub vocab: Option<usize>,
    /// Image models: folder with the four Fashion-MNIST IDX files; None = system package or embedded
    /// subset. GPT: a UTF-8 text file; None = Moby Dick shipped inside memfit. `embedded` forces the
    /// shipped data.
    pub data: Option<PathBuf>,
    /// Passes over the training data; None = one, or as many as `max_steps` needs.
    pub epochs: Option<usize>,
    /// Stop after this many optimizer steps, running across epochs as needed.
    pub max_steps: Option<usize>,
    /// The effective batch: samples per optimizer step.
    pub batch_size: usize,
    /// Forces the micro-batch; None = the whole batch, or a plan when `memory` is set and it does not fit.
    pub micro_batch: Option<usize>,
    pub lr: f64,
    pub optimizer: OptimizerChoice,
    /// Device capacity in bytes; None = unlimited.
    pub memory: Option<u64>,
    pub device: DeviceKind,
    /// Seed of initialization (and of data order unless `data_seed` is given).
    pub seed: u64,
    /// Seed of the data order (epoch shuffles, text windows); None = `seed`.
    pub data_seed: Option<u64>,
    /// Worker threads for kernels; None = all cores.
    pub threads: Option<usize>,
    pub fault: Option<FaultInjection>,
    /// Fraction of the capacity the planner keeps free (0.0 - 0.5).
    pub safety_margin: f64,
    /// Load parameters from this checkpoint before training.
    pub load: Option<PathBuf>,
    /// Save parameters to this checkpoint after training.
    pub save: Option<PathBuf>,
    /// Evaluate on the validation split at the end.
    pub evaluate: bool,
    /// Keep the sample indices of every step in the summary (for tests).
    pub record_samples: bool,
    /// Write a memory profile of the run into this directory (`memfit profile`).
    pub profile: Option<PathBuf>,
    /// Write a memory profile into this directory when the run met an out-of-memory.
    pub profile_on_oom: Option<PathBuf>,
    /// Write the JSON report here, and the training curves beside it as `.svg`.
    pub report: Option<PathBuf>,
    /// Segments that run with activation checkpointing.
    pub checkpoint: CheckpointChoice,
    /// The dtype of saved activations (`--precision`).
    pub precision: Precision,
    /// The allocator's segments (`--segments`).
    pub segments: Segments,
    /// Where the optimizer steps (`--optimizer-step`).
    pub optimizer_step: OptimizerStep,
    /// How Adam's moments are stored (`--optimizer-state`; changes the numbers unless fp32).
    pub optimizer_state: memfit_nn::StateFormat,
    /// Write a training checkpoint (to resume from) every this many optimizer steps (`--save-every`).
    pub save_every: Option<usize>,
    /// Directory of the training checkpoints (`--save-dir`); also written on SIGINT/SIGTERM.
    pub save_dir: Option<PathBuf>,
    /// Training checkpoints kept in `save_dir` (the newest; older ones are removed).
    pub keep: usize,
    /// Continue the run whose newest training checkpoint is in this directory (`--resume`).
    pub resume: Option<PathBuf>,
    /// Training as one of several ranks (`--parallel`, under `mpirun`; Note [Data parallel]).
    pub parallel: Option<ParallelMode>,
}

impl TrainConfig {
    /// Errors unless every size and rate is inside [`limits`] (the CLI's parsers refuse the same values
    /// with the flag's name; this guards library callers).
    pub fn check(&self) -> Result<(), crate::TrainError> {
        let bad = |m: String| Err(crate::TrainError::Invalid(m));
        self.optimizer.check_state(self.optimizer_state).map_err(crate::TrainError::Invalid)?;
        let max_batch = limits::MAX_BATCH as usize;
        if !(1..=max_batch).contains(&self.batch_size) {
            return bad(format!("--batch-size {} is out of range: use 1 to {max_batch}", self.batch_size));
        }
        if let Some(m) = self.micro_batch.filter(|m| !(1..=max_batch).contains(m)) {
            return bad(format!("--micro-batch {m} is out of range: use 1 to {max_batch}"));
        }
        if let Some(e) = self.epochs.filter(|&e| e as u64 > limits::MAX_EPOCHS) {
            return bad(format!("--epochs {e} is out of range: use 0 to {}", limits::MAX_EPOCHS));
        }
        if let Some(s) = self.max_steps.filter(|&s| s == 0 || s as u64 > limits::MAX_STEPS) {
            return bad(format!("--max-steps {s} is out of range: use 1 to {}", limits::MAX_STEPS));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("--lr {} must be a finite number above 0, such as 3e-3", self.lr));
        }
        if !(0.0..=limits::MAX_SAFETY_MARGIN).contains(&self.safety_margin) {
            return bad(format!(
                "--safety-margin {} is out of range: use a fraction from 0 to {}",
                self.safety_margin,
                limits::MAX_SAFETY_MARGIN
            ));
        }
        if let Some(m) = self.memory.filter(|&m| m > limits::MAX_CAPACITY) {
            return bad(format!("--memory {m} bytes is more than memfit manages: give at most 1024TiB"));
        }
        if let Some(n) = self.save_every.filter(|&n| n == 0 || n as u64 > limits::MAX_STEPS) {
            return bad(format!("--save-every {n} is out of range: use 1 to {}", limits::MAX_STEPS));
        }
        if self.save_every.is_some() && self.save_dir.is_none() {
            return bad("--save-every needs --save-dir DIR: the directory the training checkpoints go to".into());
        }
        if !(1..=limits::MAX_KEEP).contains(&self.keep) {
            return bad(format!("--keep {} is out of range: use 1 to {}", self.keep, limits::MAX_KEEP));
        }
        let resumable = self.save_dir.is_some() || self.resume.is_some();
        if resumable && !self.device.computes() {
            return bad(format!(
                "--save-dir and --resume need a device that computes (cpu or cuda): the {} device holds no values to save",
                self.device.name()
            ));
        }
        if let Some(mode) = self.parallel.filter(|&m| m != ParallelMode::Data && resumable) {
            return bad(format!(
                "--save-dir and --resume are not available with --parallel {} (each rank holds part of the state): \
                 use --parallel data, or --save for the weights",
                mode.name()
            ));
        }
        if self.optimizer_step == OptimizerStep::InBackward {
            if let Some(mode) = self.parallel {
                return bad(format!(
                    "--optimizer-step in-backward is not available with --parallel {}: the ranks sum every gradient \
                     before any update; use --optimizer-step after",
                    mode.name()
                ));
            }
            if self.precision == Precision::Fp16 {
                return bad(
                    "--optimizer-step in-backward is not available with --precision fp16: a window whose gradients \
                     overflowed is skipped whole, which needs them all first; use bf16 storage or --optimizer-step \
                     after"
                        .into(),
                );
            }
        }
        if self.parallel == Some(ParallelMode::Pipeline) && self.precision == Precision::Fp16 {
            return bad(
                "--precision fp16 is not available with --parallel pipeline: its loss scale is not carried from the \
                 last stage's loss to the others yet; use --precision bf16 (no loss scale needed)"
                    .into(),
            );
        }
        if self.parallel == Some(ParallelMode::Pipeline) && matches!(self.checkpoint, CheckpointChoice::Segments(_)) {
            return bad(
                "--checkpoint with segment names is not available with --parallel pipeline: give all, none or \
                 auto (none)"
                    .into(),
            );
        }
        if self.resume.is_some() && self.load.is_some() {
            return bad("--load and --resume cannot be combined: the checkpoint being resumed holds the weights".into());
        }
        if let Some(t) = self.threads.filter(|&t| t == 0 || t > limits::max_threads()) {
            return bad(format!(
                "--threads {t} is out of range: use 1 to {} ({} per core, {} cores)",
                limits::max_threads(),
                limits::THREADS_PER_CORE,
                limits::cores()
            ));
        }
        Ok(())
    }

    /// The files and directories this run writes and reads, named by their flags (Note [Paths]).
    pub fn paths(&self) -> (Vec<crate::output::NamedPath>, Vec<crate::output::NamedPath>) {
        use crate::output::NamedPath;
        let mut outputs = Vec::new();
        if let Some(p) = &self.save {
            outputs.push(NamedPath::file("--save", p));
        }
        if let Some(p) = &self.report {
            outputs.push(NamedPath::file("--report", p));
            outputs.push(NamedPath::file("--report (its curves)", &p.with_extension("svg")));
        }
        if let Some(p) = &self.profile {
            outputs.push(NamedPath::dir("--out", p));
        }
        if let Some(p) = &self.profile_on_oom {
            outputs.push(NamedPath::dir("--profile-on-oom", p));
        }
        let mut inputs = Vec::new();
        if let Some(p) = &self.load {
            inputs.push(NamedPath::file("--load", p));
        }
        if let Some(p) = self.data.as_ref().filter(|p| self.model == ModelKind::Gpt && p.as_os_str() != EMBEDDED) {
            inputs.push(NamedPath::file("--data", p));
        }
        (outputs, inputs)
    }
}

impl TrainConfig {
    /// The model as people name it and as `--model` takes it back: a zoo name or an archive's path.
    pub fn model_name(&self) -> String {
        match &self.model_file {
            Some(path) if self.model == ModelKind::Imported => path.display().to_string(),
            _ => self.model.name().to_string(),
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            checkpoint: CheckpointChoice::None,
            precision: Precision::Fp32,
            segments: Segments::Fixed,
            optimizer_step: OptimizerStep::After,
            optimizer_state: memfit_nn::StateFormat::Fp32,
            model: ModelKind::SimpleCnn,
            model_file: None,
            gpt: GptConfig::default(),
            vocab: None,
            data: None,
            epochs: None,
            max_steps: None,
            batch_size: 64,
            micro_batch: None,
            lr: 3e-3,
            optimizer: OptimizerChoice::AdamW,
            memory: None,
            device: DeviceKind::Cpu,
            seed: 0,
            data_seed: None,
            threads: None,
            fault: None,
            safety_margin: 0.0,
            load: None,
            save: None,
            evaluate: true,
            record_samples: false,
            profile: None,
            profile_on_oom: None,
            report: None,
            save_every: None,
            save_dir: None,
            keep: 2,
            resume: None,
            parallel: None,
        }
    }
}

/// Optimizer steps of a run with `per_epoch` steps per epoch: `epochs` passes (default one), or
/// `max_steps` across as many epochs as it takes when no epoch count is given; with both, whichever
/// ends first. Overflow is an error, never a wrap.
pub fn total_steps(
    per_epoch: usize,
    epochs: Option<usize>,
    max_steps: Option<usize>,
) -> Result<usize, crate::TrainError> {
    let by_epochs = |e: usize| {
        per_epoch.checked_mul(e).ok_or_else(|| {
            crate::TrainError::Invalid(format!(
                "--epochs {e} of {per_epoch} steps each is more steps than memfit can count"
            ))
        })
    };
    Ok(match (epochs, max_steps) {
        (None, None) => per_epoch,
        (None, Some(m)) => m,
        (Some(e), None) => by_epochs(e)?,
        (Some(e), Some(m)) => by_epochs(e).map_or(m, |t| t.min(m)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Library callers get the same bounds as the CLI's parsers: each absurd value is refused by name.
    #[test]
    fn check_refuses_every_value_out_of_bounds() {
        assert!(TrainConfig::default().check().is_ok());
        let cases: Vec<(TrainConfig, &str)> = vec![
            (TrainConfig { batch_size: 0, ..TrainConfig::default() }, "--batch-size"),
            (TrainConfig { batch_size: usize::MAX, ..TrainConfig::default() }, "--batch-size"),
            (TrainConfig { micro_batch: Some(0), ..TrainConfig::default() }, "--micro-batch"),
            (TrainConfig { epochs: Some(usize::MAX), ..TrainConfig::default() }, "--epochs"),
            (TrainConfig { max_steps: Some(0), ..TrainConfig::default() }, "--max-steps"),
            (TrainConfig { lr: f64::INFINITY, ..TrainConfig::default() }, "--lr"),
            (TrainConfig { lr: f64::NAN, ..TrainConfig::default() }, "--lr"),
            (TrainConfig { lr: 0.0, ..TrainConfig::default() }, "--lr"),
            (TrainConfig { safety_margin: f64::NAN, ..TrainConfig::default() }, "--safety-margin"),
            (TrainConfig { memory: Some(u64::MAX), ..TrainConfig::default() }, "--memory"),
            (TrainConfig { threads: Some(0), ..TrainConfig::default() }, "--threads"),
            (TrainConfig { threads: Some(limits::max_threads() + 1), ..TrainConfig::default() }, "--threads"),
        ];
        for (cfg, flag) in cases {
            let message = cfg.check().expect_err(flag).to_string();
            assert!(message.contains(flag), "{message}");
        }
    }

    #[test]
    fn steps_run_across_epochs_and_never_wrap() {
        assert_eq!(total_steps(10, None, None).unwrap(), 10);
        assert_eq!(total_steps(10, None, Some(25)).unwrap(), 25);
        assert_eq!(total_steps(10, Some(2), Some(25)).unwrap(), 20);
        assert_eq!(total_steps(10, Some(3), None).unwrap(), 30);
        assert!(total_steps(usize::MAX, Some(2), None).is_err());
        assert_eq!(total_steps(usize::MAX, Some(2), Some(7)).unwrap(), 7);
    }
}
