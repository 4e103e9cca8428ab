//! The `memfit` command: turns arguments into typed configuration, shows progress, prints results.
//! All the work happens in memfit-train; errors print one clear message and exit non-zero.

mod ranks;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memfit_nn::{GptConfig, ModelKind, ModelSpec};
use memfit_tensor::memory::{format_bytes, parse_bytes, FaultInjection};
use memfit_tensor::DeviceKind;
use memfit_train::config::limits;
use memfit_train::generate::GenerateConfig;
use memfit_train::job::Observer;
use memfit_train::parallel::ParallelMode;
use memfit_train::{
    CheckpointChoice, OptimizerChoice, OptimizerStep, Plan, PlanRequest, Precision, Report, Segments, StepEvent,
    TrainConfig,
};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "memfit", version, about = "Deep-learning training whose memory is planned, bounded and explained")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model and report its memory: image models on Fashion-MNIST (the full set when installed,
    /// else the subset shipped inside memfit), the GPT on a text (Moby Dick shipped inside memfit, or --data FILE).
    Train(TrainArgs),
    /// Choose a micro-batch and accumulation that fit an effective batch into a memory budget.
    Plan(PlanArgs),
    /// Measure training-step time and memory of the model zoo.
    Bench(BenchArgs),
    /// Continue a prompt with a GPT saved by `memfit train --model gpt --save PATH`.
    Generate(GenerateArgs),
    /// Record a few training steps and write where the memory went: an HTML page, a PyTorch memory
    /// snapshot, a Chrome trace and a summary.
    Profile(ProfileArgs),
}

/// The GPT's sizes (its vocabulary is the text's distinct characters, or `--vocab`).
#[derive(Args)]
struct GptArgs {
    /// GPT: transformer blocks.
    #[arg(long, allow_negative_numbers = true, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    layers: u32,
    /// GPT: model width (a multiple of --heads).
    #[arg(long, allow_negative_numbers = true, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    d_model: u32,
    /// GPT: attention heads.
    #[arg(long, allow_negative_numbers = true, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    heads: u32,
    /// GPT: context length in characters (samples are windows of context + 1 characters).
    #[arg(long, allow_negative_numbers = true, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=65536))]
    context: u32,
    /// GPT: the model's vocabulary, at least the text's characters; the tokens past them are never
    /// seen, as GPT-2's padding to 50304 (sizes the embedding, the head and the logits) [default:
    /// the text's characters]
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    vocab: Option<u32>,
}

impl GptArgs {
    /// The sizes, checked before any data is read.
    fn config(&self) -> Result<GptConfig, String> {
        if self.d_model % self.heads != 0 {
            return Err(format!(
                "--d-model {} must be a multiple of --heads {} (each head gets d_model / heads features)",
                self.d_model, self.heads
            ));
        }
        let (layers, d_model, heads, max_t) =
            (self.layers as usize, self.d_model as usize, self.heads as usize, self.context as usize);
        Ok(GptConfig { layers, d_model, heads, max_t, ..GptConfig::default() })
    }
}

/// Defaults that depend on the task: image models train at lr 3e-3 in batches of 64, the GPT at
/// lr 1e-3 in batches of 32 (the PyTorch reference's setting). `train`, `profile` and `plan` share them.
fn default_lr(model: &ModelArg) -> f64 {
    if model.learns_text() {
        1e-3
    } else {
        3e-3
    }
}

fn default_batch(model: &ModelArg) -> usize {
    if model.learns_text() {
        32
    } else {
        64
    }
}

/// What to run and where: the flags `train` and `profile` share.
#[derive(Args)]
struct RunArgs {
    /// mlp, simplecnn, deepcnn, resnet (Fashion-MNIST) or gpt (characters of a text); or a PyTorch image
    /// classifier or next-token predictor exported by torch.export.save, by the path of its .pt2 file.
    #[arg(long, default_value = "simplecnn", value_parser = parse_model)]
    model: ModelArg,
    /// Image models: folder with the four Fashion-MNIST IDX files (default: /usr/share/datasets/fashion-mnist
    /// when installed, else the subset shipped inside memfit). gpt: a UTF-8 text file, gzip or not (default:
    /// Moby Dick, shipped inside memfit). `embedded` forces the shipped data.
    #[arg(long)]
    data: Option<PathBuf>,
    #[command(flatten)]
    gpt: GptArgs,
    /// Effective batch: samples (images or text windows) per optimizer step [default: 64; gpt and an
    /// imported next-token predictor 32].
    #[arg(long, allow_negative_numbers = true, value_parser = batch_parser())]
    batch_size: Option<u64>,
    /// Force the micro-batch (gradient accumulation makes up the effective batch); evaluation uses it too,
    /// unless --memory is given (then the planner fits evaluation around it).
    #[arg(long, allow_negative_numbers = true, value_parser = batch_parser())]
    micro_batch: Option<u64>,
    /// Learning rate, finite and above 0 [default: 3e-3, which reaches 88-89% validation accuracy in one
    /// epoch of simplecnn on the full set; gpt and an imported next-token predictor 1e-3].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_lr)]
    lr: Option<f64>,
    /// sgd (momentum 0.9), adam or adamw.
    #[arg(long, default_value = "adamw", value_parser = OptimizerChoice::parse)]
    optimizer: OptimizerChoice,
    /// Device capacity with a unit, e.g. 256MiB or 2GiB, at most 1024TiB (default: unlimited). The planner
    /// then chooses the micro-batch, accumulation and checkpointing (none changes a number) unless given.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_capacity)]
    memory: Option<u64>,
    /// cpu or cuda (cuda:N for GPU N) compute; meta allocates exactly what cpu would and computes
    /// nothing (a prediction), meta:cuda exactly what cuda would, on a machine without a GPU.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: DeviceKind,
    /// Seed of the parameters' initialization (and of the data order unless --data-seed is given).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    seed: u64,
    /// Seed of the data order: epoch shuffles and text windows [default: --seed].
    #[arg(long, allow_negative_numbers = true)]
    data_seed: Option<u64>,
    /// Worker threads, from 1 to 16 per core (default: all cores).
    #[arg(long, allow_negative_numbers = true, value_parser = threads_parser())]
    threads: Option<u64>,
    /// Make every N-th allocation fail (N >= 1), to see recovery at work.
    #[arg(long, allow_negative_numbers = true, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    inject_oom: Option<u64>,
    /// Fraction of the capacity the planner keeps free, from 0 to 0.5.
    #[arg(long, allow_hyphen_values = true, default_value_t = 0.0, value_parser = parse_safety_margin)]
    safety_margin: f64,
    /// Activation checkpointing: none, all, auto (with --memory: the planner weighs segments against the
    /// micro-batch they allow by predicted step time and takes the fastest plan that fits), or segment
    /// names separated by commas (gpt: blocks.0, blocks.1, ...; resnet: layer1..layer3; deepcnn:
    /// c1..c3; simplecnn: conv1; an imported model: its module paths, such as layer1 or
    /// encoder.layers.encoder_layer_0, which an unknown name's error lists). A checkpointed
    /// segment keeps only its input for backward and runs its forward again there: less memory, more
    /// time, the same numbers [default: auto with --memory, else none].
    #[arg(long, value_parser = CheckpointChoice::parse)]
    checkpoint: Option<CheckpointChoice>,
    /// Precision: fp32; bf16 (saved activations in bf16, about half their bytes, and matrix products
    /// on bf16 operands with f32 accumulation: the cpu's AVX512-BF16 where it has it, a GPU's tensor
    /// cores); fp16 (the same with fp16, and the loss scaled as GradScaler does: a step whose
    /// gradients overflow is skipped and the scale halved; on a cpu slower than fp32, for a GPU's
    /// numbers); or auto (with --memory: the planner takes bf16 when it gives the fastest plan that
    /// fits).
    #[arg(long, default_value = "fp32", value_parser = Precision::parse)]
    precision: Precision,
    /// The allocator's segments: fixed (PyTorch's caching allocator: 2 MiB and 20 MiB segments, kept
    /// whole while a block in them lives), expandable (one segment per pool that grows and shrinks a
    /// 2 MiB page at a time, so reserved follows allocated: PyTorch's expandable_segments; on a GPU
    /// through CUDA's virtual memory calls), or auto (with --memory: fixed when the plan fits them,
    /// else expandable; a GPU keeps fixed ones unless asked). Neither changes a number [default:
    /// auto with --memory, else fixed].
    #[arg(long, value_parser = Segments::parse)]
    segments: Option<Segments>,
    /// Where the optimizer steps: after (the window's backward, as PyTorch's loop), in-backward (a
    /// window of one micro-batch updates each parameter as soon as its gradient is complete and frees
    /// that gradient, so the gradients never all exist at once: PyTorch's post-accumulate-grad
    /// hook), or auto (with --memory: after when the plan fits so, else in-backward). Neither changes
    /// a number; in-backward cannot run with --parallel or fp16 storage [default: auto with --memory,
    /// else after].
    #[arg(long, value_parser = OptimizerStep::parse)]
    optimizer_step: Option<OptimizerStep>,
    /// How Adam's two moments are stored: fp32 (as PyTorch), bf16 (half their bytes) or int8
    /// (8-bit block-wise with a dynamic map, as bitsandbytes' Adam8bit: a quarter; parameters under
    /// 4096 values keep fp32). bf16 and int8 change the numbers (slightly) and are never chosen for you.
    #[arg(long, default_value = "fp32", value_parser = memfit_nn::StateFormat::parse)]
    optimizer_state: memfit_nn::StateFormat,
}

impl RunArgs {
    /// The configuration these flags describe (one epoch, no outputs; callers add theirs).
    fn config(self) -> Result<TrainConfig, String> {
        Ok(TrainConfig {
            model: self.model.kind,
            model_file: self.model.file.clone(),
            gpt: self.gpt.config()?,
            vocab: self.gpt.vocab.map(|v| v as usize),
            data: self.data,
            batch_size: self.batch_size.map_or(default_batch(&self.model), |b| b as usize),
            micro_batch: self.micro_batch.map(|m| m as usize),
            lr: self.lr.unwrap_or(default_lr(&self.model)),
            optimizer: self.optimizer,
            memory: self.memory,
            device: self.device,
            seed: self.seed,
            data_seed: self.data_seed,
            threads: self.threads.map(|t| t as usize),
            fault: self.inject_oom.map(FaultInjection::EveryNth),
            safety_margin: self.safety_margin,
            checkpoint: checkpoint_or_default(self.checkpoint, self.memory),
            precision: self.precision,
            segments: Segments::or_default(self.segments, self.memory),
            optimizer_step: OptimizerStep::or_default(self.optimizer_step, self.memory),
            optimizer_state: self.optimizer_state,
            ..TrainConfig::default()
        })
    }
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Passes over the training data, 0 to evaluate only (gpt: an epoch draws as many random windows as
    /// fit the text end to end) [default: 1, or as many as --max-steps needs].
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(0..=limits::MAX_EPOCHS))]
    epochs: Option<u64>,
    /// Stop after this many optimizer steps, running across epochs as needed.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_STEPS))]
    max_steps: Option<u64>,
    /// Write the JSON report here, and training curves (loss, memory per step) beside it as .svg.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Save the trained parameters (safetensors).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Load parameters (safetensors, PyTorch state_dict names) before training.
    #[arg(long)]
    load: Option<PathBuf>,
    /// Skip the validation pass at the end.
    #[arg(long)]
    no_eval: bool,
    /// When the run meets an out-of-memory (recovered or not), write its memory profile into this directory.
    #[arg(long, value_name = "DIR")]
    profile_on_oom: Option<PathBuf>,
    /// Write a training checkpoint every N optimizer steps into --save-dir: weights, optimizer state, data
    /// position and settings, all --resume needs. (Not --checkpoint, which is activation checkpointing.)
    #[arg(long, visible_alias = "checkpoint-every", allow_negative_numbers = true, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=limits::MAX_STEPS))]
    save_every: Option<u64>,
    /// Directory of the training checkpoints (created if missing; must not hold another run's). Also
    /// written when SIGINT (Ctrl-C) or SIGTERM stops the run.
    #[arg(long, visible_alias = "checkpoint-dir", value_name = "DIR")]
    save_dir: Option<PathBuf>,
    /// Training checkpoints kept in --save-dir: the newest N, from 1 to 1000.
    #[arg(long, allow_negative_numbers = true, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_KEEP as u64))]
    keep: u64,
    /// Continue the run whose newest training checkpoint is in DIR, ending exactly as an uninterrupted run
    /// would. Its settings come from the checkpoint; a flag that changes the numbers (--model, --batch-size,
    /// --lr, --seed, ...) given with another value is refused.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Train as one of the ranks `mpirun -np N` starts: data (each rank takes a shard of every batch;
    /// gradients summed by all-reduce), zero1 (data, with the optimizer state split between ranks) or
    /// pipeline (gpt: the model cut into one stage per rank, planned to fit --memory). Needs a memfit
    /// built with `--features mpi`.
    #[arg(long, value_name = "MODE", value_parser = ParallelMode::parse)]
    parallel: Option<ParallelMode>,
}

#[derive(Args)]
struct ProfileArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Optimizer steps to record (from the start: setup, the first step that creates the optimizer state,
    /// then steady-state steps).
    #[arg(long, visible_alias = "steps", allow_negative_numbers = true, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_steps: u32,
    /// Directory for memory.html, snapshot.pickle, trace.json and summary.txt/json (created; an existing
    /// one may hold only an earlier profile).
    #[arg(long, default_value = "memfit-profile")]
    out: PathBuf,
}

#[derive(Args)]
struct PlanArgs {
    /// The model to plan: mlp, simplecnn, deepcnn, resnet or gpt, or a .pt2 file (torch.export.save).
    #[arg(long, value_parser = parse_model)]
    model: ModelArg,
    /// Memory budget, e.g. 64MiB or 80GiB (at most 1024TiB) [default: unlimited: the plan then says what the
    /// whole batch needs].
    #[arg(long, allow_negative_numbers = true, value_parser = parse_capacity)]
    memory: Option<u64>,
    /// Effective batch to keep: samples per optimizer step [default: train's, 64; gpt 32].
    #[arg(long, allow_negative_numbers = true, value_parser = batch_parser())]
    batch_size: Option<u64>,
    /// Image models: input shape CxHxW (default 1x28x28, Fashion-MNIST).
    #[arg(long, default_value = "1x28x28", value_parser = parse_shape)]
    input: [usize; 3],
    /// gpt: the text it will train on, for its vocabulary (default: Moby Dick, shipped inside memfit).
    #[arg(long)]
    data: Option<PathBuf>,
    #[command(flatten)]
    gpt: GptArgs,
    /// sgd (momentum 0.9), adam or adamw.
    #[arg(long, default_value = "adamw", value_parser = OptimizerChoice::parse)]
    optimizer: OptimizerChoice,
    /// Learning rate, finite and above 0 (memory does not depend on it) [default: train's, 3e-3; gpt and
    /// an imported next-token predictor 1e-3].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_lr)]
    lr: Option<f64>,
    /// Fraction of the budget the plan keeps free, from 0 to 0.5.
    #[arg(long, allow_hyphen_values = true, default_value_t = 0.0, value_parser = parse_safety_margin)]
    safety_margin: f64,
    /// Seed of the dry runs' initialization and synthetic data.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    seed: u64,
    /// Activation checkpointing the plan assumes: none, all, auto (the planner weighs which segments to
    /// checkpoint against a larger micro-batch, by predicted step time), or segment names separated by
    /// commas [default: auto with --memory, else none].
    #[arg(long, value_parser = CheckpointChoice::parse)]
    checkpoint: Option<CheckpointChoice>,
    /// Keep this micro-batch (samples per forward/backward) and fit the rest around it.
    #[arg(long, allow_negative_numbers = true, value_parser = batch_parser())]
    micro_batch: Option<u64>,
    /// Precision the plan assumes (saved activations' storage; bf16 and fp16 also multiply in it):
    /// fp32, bf16, fp16, or auto (bf16 weighed too).
    #[arg(long, default_value = "fp32", value_parser = Precision::parse)]
    precision: Precision,
    /// The allocator's segments the plan assumes: fixed, expandable, or auto
    /// (expandable when fixed ones do not fit) [default: auto with --memory, else fixed].
    #[arg(long, value_parser = Segments::parse)]
    segments: Option<Segments>,
    /// Where the optimizer steps in the plan: after backward, in-backward (a window of one
    /// micro-batch), or auto (in-backward when after does not fit) [default: auto with --memory,
    /// else after].
    #[arg(long, value_parser = OptimizerStep::parse)]
    optimizer_step: Option<OptimizerStep>,
    /// How Adam's moments are stored in the plan: fp32, bf16 or int8 (these change the numbers).
    #[arg(long, default_value = "fp32", value_parser = memfit_nn::StateFormat::parse)]
    optimizer_state: memfit_nn::StateFormat,
    /// Plan for this many ranks (devices) too: which of data parallel, ZeRO-1 and (gpt) a pipeline
    /// fits, each rank's predicted peak and the predicted throughput, beside one device's plan.
    #[arg(long, allow_negative_numbers = true, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=limits::MAX_RANKS))]
    devices: Option<u64>,
    /// The device the plan is for: cpu, or cuda (a GPU: its workspaces and policy, predicted on the
    /// meta device, so no GPU is needed to plan for one). meta and meta:cuda plan as cpu and cuda.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: DeviceKind,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// Worker threads, from 1 to 16 per core (default: all cores).
    #[arg(long, allow_negative_numbers = true, value_parser = threads_parser())]
    threads: Option<u64>,
    /// Only this model's case (repeatable): mlp, simplecnn, deepcnn, resnet, gpt, or a case by name
    /// (mlp-b256, simplecnn-b128, deepcnn-b64, resnet-b64, gpt-b32); gpt2 (gpt2-124m-b8 and
    /// gpt2-124m-b16: GPT-2 small, for a GPU) runs only when named; or a model exported by torch.export.save, by the path of its
    /// .pt2 file (synthetic data of its shapes; PyTorch runs the same archive).
    #[arg(long = "model", visible_alias = "case")]
    cases: Vec<String>,
    /// The batch of an exported model's case [default: 64 images; 32 text windows].
    #[arg(long, allow_negative_numbers = true, value_parser = batch_parser())]
    batch_size: Option<u64>,
    /// Timed steps per case, from 1 to 10000.
    #[arg(long, allow_negative_numbers = true, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BENCH_STEPS))]
    steps: u64,
    /// Rounds per case, from 1 to 100: with --compare-pytorch, memfit and PyTorch take turns and each
    /// side's time is the median of its rounds' medians (fairer on a busy machine), and the table
    /// gives the lowest and highest of the rounds' own ratios.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BENCH_ROUNDS))]
    rounds: u64,
    /// Warm-up steps per case, from 0 to 10000.
    #[arg(long, allow_negative_numbers = true, default_value_t = 3, value_parser = clap::value_parser!(u64).range(0..=limits::MAX_BENCH_STEPS))]
    warmup: u64,
    /// Also run each case in PyTorch with this Python interpreter (one with torch installed), right
    /// after memfit's, and print the ratios.
    #[arg(long, value_name = "PYTHON")]
    compare_pytorch: Option<PathBuf>,
    /// With --compare-pytorch: also run each case with PyTorch's model under `torch.compile` (its
    /// compilation in the warm-up steps, at least two of them), and print that ratio too.
    #[arg(long, requires = "compare_pytorch")]
    compare_compiled: bool,
    /// fp32, or bf16 (memfit's --precision bf16: bf16 storage and products; PyTorch's bf16 autocast
    /// with --compare-pytorch), or fp16 (memfit's fp16 storage, products and loss scale; PyTorch's
    /// fp16 autocast with GradScaler).
    #[arg(long, default_value = "fp32", value_parser = Precision::parse)]
    precision: Precision,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// cpu or cuda (cuda:N for GPU N); with --compare-pytorch, PyTorch runs on the same device.
    #[arg(long, default_value = "cpu", value_parser = parse_compute_device)]
    device: DeviceKind,
}

#[derive(Args)]
struct GenerateArgs {
    /// A next-token predictor exported by torch.export.save (its .pt2 file), whose weights --load
    /// holds (default: memfit's GPT, sized by the checkpoint).
    #[arg(long, value_parser = parse_archive)]
    model: Option<PathBuf>,
    /// A GPT checkpoint saved by `memfit train --model gpt --save PATH` (or by `memfit train --model
    /// PATH.pt2 --save PATH` with --model PATH.pt2).
    #[arg(long)]
    load: PathBuf,
    /// The text to continue (characters of the training text only).
    #[arg(long)]
    prompt: String,
    /// Characters to generate.
    #[arg(long, allow_negative_numbers = true, default_value_t = 200, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    tokens: u32,
    /// Sampling temperature, from 0 to 100: 0 always takes the most likely character; higher is more random.
    #[arg(long, allow_hyphen_values = true, default_value_t = 0.8, value_parser = parse_temperature)]
    temperature: f64,
    /// Seed of the sampling: the same seed gives the same text.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    seed: u64,
    /// Device capacity with a unit, e.g. 64MiB, at most 1024TiB (default: unlimited).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_capacity)]
    memory: Option<u64>,
    /// Worker threads, from 1 to 16 per core (default: all cores).
    #[arg(long, allow_negative_numbers = true, value_parser = threads_parser())]
    threads: Option<u64>,
    /// cpu or cuda (cuda:N for GPU N).
    #[arg(long, default_value = "cpu", value_parser = parse_compute_device)]
    device: DeviceKind,
}

/// `--checkpoint` as given, else `auto` under a budget (the planner then checkpoints only what the
/// budget needs: it never changes a number) and `none` without one.
fn checkpoint_or_default(given: Option<CheckpointChoice>, memory: Option<u64>) -> CheckpointChoice {
    given.unwrap_or(if memory.is_some() { CheckpointChoice::Auto } else { CheckpointChoice::None })
}

/// `--model`: a zoo model by name, or a user's model by the path of its `torch.export` archive.
#[derive(Clone, Debug)]
struct ModelArg {
    kind: ModelKind,
    /// The archive of an imported model.
    file: Option<PathBuf>,
    /// An imported next-token predictor (its defaults are the GPT's); an archive that cannot be read
    /// is not one here, and is reported where it is opened.
    text: bool,
}

impl ModelArg {
    /// Whether the model learns a text (the GPT, or an imported next-token predictor).
    fn learns_text(&self) -> bool {
        self.kind == ModelKind::Gpt || self.text
    }

    /// As people name it: the zoo's name or the archive's path.
    fn name(&self) -> String {
        match &self.file {
            Some(path) => path.display().to_string(),
            None => self.kind.name().to_string(),
        }
    }
}

/// The path of a `.pt2` archive that exists.
fn parse_archive(s: &str) -> Result<PathBuf, String> {
    match parse_model(s)? {
        ModelArg { file: Some(path), .. } => Ok(path),
        _ => Err(format!("{s}: give the path of a model exported by torch.export.save (a .pt2 file)")),
    }
}

fn parse_model(s: &str) -> Result<ModelArg, String> {
    if s.ends_with(".pt2") {
        let path = PathBuf::from(s);
        if !path.is_file() {
            return Err(format!("{s}: no such file (a model exported by torch.export.save)"));
        }
        let text = memfit_nn::ModelSpec::exported(&path)
            .is_ok_and(|spec| matches!(spec.input_kind(), memfit_nn::ModelInput::Tokens { .. }));
        return Ok(ModelArg { kind: ModelKind::Imported, file: Some(path), text });
    }
    ModelKind::parse(s)
        .map(|kind| ModelArg { kind, file: None, text: false })
        .map_err(|e| format!("{e}\n(or the path of a PyTorch model exported by torch.export.save: a .pt2 file)"))
}

/// Batch and micro-batch sizes: 1 to [`limits::MAX_BATCH`].
fn batch_parser() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=limits::MAX_BATCH)
}

/// Worker threads: 1 to [`limits::THREADS_PER_CORE`] per available core.
fn threads_parser() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=limits::max_threads() as u64)
}

/// A capacity: a size [`parse_bytes`] reads, with a unit, above 0 and at most [`limits::MAX_CAPACITY`].
/// A bare number is refused: `--memory 80` meant 80 bytes to the parser and 80 GiB to its user.
fn parse_capacity(s: &str) -> Result<u64, String> {
    let text = s.trim();
    if !text.is_empty() && text.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(format!("{text} has no unit: add one, such as {text}MiB or {text}GiB"));
    }
    let bytes = parse_bytes(s)?;
    if bytes == 0 {
        return Err("a capacity of 0 bytes holds nothing: give a size such as 256MiB".to_string());
    }
    if bytes > limits::MAX_CAPACITY {
        return Err(format!("{} is more than memfit manages: give at most 1024TiB", format_bytes(bytes)));
    }
    Ok(bytes)
}

/// What a `--memory` written in decimal units was read as (`80GB` is 80 x 10^9 bytes = 74.51 GiB, not
/// the 80 GiB an "80GB" GPU holds); None for binary units.
fn decimal_unit_note(text: &str) -> Option<String> {
    let text = text.trim();
    let unit_at = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(unit_at);
    let binary = match unit.trim().to_ascii_lowercase().as_str() {
        "kb" => "KiB",
        "mb" => "MiB",
        "gb" => "GiB",
        "tb" => "TiB",
        _ => return None,
    };
    let bytes = parse_bytes(text).ok()?;
    Some(format!(
        "note: --memory {text} is read in decimal units: {bytes} bytes = {}; for {number} {binary} write {number}{binary}",
        format_bytes(bytes)
    ))
}

/// A number in `range` (finite), or a message saying which numbers are accepted.
fn parse_f64_in(s: &str, ok: impl Fn(f64) -> bool, accepted: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("not a number: {accepted}"))?;
    if v.is_finite() && ok(v) {
        Ok(v)
    } else {
        Err(format!("out of range: {accepted}"))
    }
}

fn parse_lr(s: &str) -> Result<f64, String> {
    parse_f64_in(s, |v| v > 0.0, "give a finite learning rate above 0, such as 3e-3")
}

fn parse_safety_margin(s: &str) -> Result<f64, String> {
    parse_f64_in(s, |v| (0.0..=limits::MAX_SAFETY_MARGIN).contains(&v), "give a fraction from 0 to 0.5, such as 0.1")
}

fn parse_temperature(s: &str) -> Result<f64, String> {
    parse_f64_in(s, |v| (0.0..=100.0).contains(&v), "give a temperature from 0 (greedy) to 100, such as 0.8")
}

fn parse_device(s: &str) -> Result<DeviceKind, String> {
    DeviceKind::parse(s).map_err(|e| e.to_string())
}

/// A device that computes (for commands whose output is computed values or times: `generate`,
/// `bench`); meta is refused with what to use instead.
fn parse_compute_device(s: &str) -> Result<DeviceKind, String> {
    let kind = parse_device(s)?;
    if kind.is_meta() {
        return Err(format!(
            "{s} computes nothing, so it has no text or step times to give: use cpu or cuda (`memfit plan --device cuda` \
             predicts a GPU's memory without one)"
        ));
    }
    Ok(kind)
}

/// The largest channel count and side of a `plan --input` shape.
const MAX_INPUT_CHANNELS: usize = 4096;
const MAX_INPUT_SIDE: usize = 65536;

fn parse_shape(s: &str) -> Result<[usize; 3], String> {
    let dims: Vec<usize> = s
        .split(['x', ','])
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("invalid input shape {s:?}: expected CxHxW such as 1x28x28 or 3x64x64"))?;
    match dims.as_slice() {
        [c, h, w] if (1..=MAX_INPUT_CHANNELS).contains(c)
            && (1..=MAX_INPUT_SIDE).contains(h)
            && (1..=MAX_INPUT_SIDE).contains(w) =>
        {
            Ok([*c, *h, *w])
        }
        [_, _, _] => Err(format!(
            "input shape {s:?} is out of range: channels 1 to {MAX_INPUT_CHANNELS}, height and width 1 to {MAX_INPUT_SIDE}"
        )),
        _ => Err(format!("invalid input shape {s:?}: expected three positive sizes CxHxW such as 3x64x64")),
    }
}

fn main() -> ExitCode {
    // Every refused argument exits with 1, like every other error (clap's own code is 2); help and
    // version print to stdout and succeed.
    let parsed = Cli::command().try_get_matches().and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
        }
    };
    // The kernels' instruction set may be forced by MEMFIT_ISA; a wrong value is an error here,
    // before any work (the library would quietly use the detected one).
    if let Err(message) = memfit_tensor::Isa::from_env() {
        eprintln!("error: {message}");
        return ExitCode::FAILURE;
    }
    // Which flags were given on the command line (a resumed run takes the others from its checkpoint).
    let sub = matches.subcommand().map(|(_, m)| m.clone());
    let memory_text = sub.as_ref().and_then(|m| m.try_get_raw("memory").ok().flatten()).and_then(|mut v| v.next());
    if let Some(note) = memory_text.and_then(|t| decimal_unit_note(&t.to_string_lossy())) {
        eprintln!("{note}");
    }
    let given =
        |id: &str| sub.as_ref().is_some_and(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine));
    let result = match cli.command {
        Command::Train(a) => train(a, &given),
        Command::Plan(a) => plan(a).map_err(Failure::from),
        Command::Bench(a) => bench(a).map_err(Failure::from),
        Command::Generate(a) => generate(a).map_err(Failure::from),
        Command::Profile(a) => profile(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure { message, code }) => {
            eprintln!("error: {message}");
            ExitCode::from(code)
        }
    }
}

/// Shows a progress bar on a terminal, and a line every tenth of the run otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    last_line: usize,
    model: String,
    /// The first stopping signal received (0: none), set by [`stop_on_signals`].
    signal: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Observer for Progress {
    fn interrupted(&mut self) -> Option<i32> {
        match self.signal.load(std::sync::atomic::Ordering::SeqCst) {
            0 => None,
            n => i32::try_from(n).ok(),
        }
    }

    fn checkpoint_saved(&mut self, path: &std::path::Path) {
        let line = format!("checkpoint {}", path.display());
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn data_loaded(&mut self, description: &str, _train: usize, _val: usize) {
        eprintln!("data: {description}");
    }

    fn notice(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn planned(&mut self, plan: &Plan) {
        eprint!("{}", plan.describe(&self.model));
    }

    fn staged(&mut self, plan: &memfit_train::stages::StagePlan, spec: &ModelSpec) {
        let units = memfit_nn::stage_units(spec).unwrap_or(0);
        eprintln!("pipeline of {} stages, micro-batch {}:", plan.stages.len(), plan.micro_batch);
        for (rank, (range, p)) in plan.stages.iter().zip(&plan.per_stage).enumerate() {
            eprintln!(
                "  rank {rank}: {} (predicted peak {} allocated, {} reserved)",
                memfit_train::stages::describe_units(range, units),
                format_bytes(p.peak_allocated),
                format_bytes(p.peak_reserved)
            );
        }
    }

    fn step(&mut self, e: &StepEvent) {
        let loss = e.loss.map_or("-".to_string(), |l| format!("{l:.4}"));
        let acc = e.accuracy.map_or("-".to_string(), |a| format!("{:.3}", a));
        let rate = if e.step_ms > 0.0 { e.samples as f64 / e.step as f64 / e.step_ms * 1e3 } else { 0.0 };
        let msg = format!(
            "loss {loss} acc {acc} {rate:.0} samples/s mem {} (peak {}) micro {}",
            format_bytes(e.allocated),
            format_bytes(e.peak_allocated),
            e.micro_batch
        );
        if let Some(bar) = &self.bar {
            bar.set_length(e.total_steps as u64);
            bar.set_position(e.step as u64);
            bar.set_message(msg);
        } else if e.step == e.total_steps || e.step * 10 / e.total_steps.max(1) > self.last_line {
            self.last_line = e.step * 10 / e.total_steps.max(1);
            eprintln!("step {}/{} {msg}", e.step, e.total_steps);
        }
    }
}

/// A failed command: its message and exit code (1, or 128 + the signal that interrupted a run).
struct Failure {
    message: String,
    code: u8,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure { message, code: 1 }
    }
}

/// SIGINT and SIGTERM, for a training run: the first asks the run to stop after its current step (the
/// job then writes a checkpoint and says how to resume); a second one exits at once with 128 + signal.
/// Returns the number of the first signal received (0: none yet).
fn stop_on_signals() -> Result<std::sync::Arc<std::sync::atomic::AtomicUsize>, String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::Arc;
    let asked = Arc::new(AtomicBool::new(false));
    let which = Arc::new(AtomicUsize::new(0));
    for (signal, code) in [(SIGINT, 130), (SIGTERM, 143)] {
        let fail = |e: std::io::Error| format!("cannot handle signal {signal}: {e}");
        // Registered first, so it sees the flag as the previous signal left it: set means a second signal.
        signal_hook::flag::register_conditional_shutdown(signal, code, Arc::clone(&asked)).map_err(fail)?;
        signal_hook::flag::register_usize(signal, Arc::clone(&which), signal as usize).map_err(fail)?;
        signal_hook::flag::register(signal, Arc::clone(&asked)).map_err(fail)?;
    }
    Ok(which)
}

fn train(a: TrainArgs, given: &dyn Fn(&str) -> bool) -> Result<(), Failure> {
    let mut cfg = TrainConfig {
        epochs: a.epochs.map(|e| e as usize),
        max_steps: a.max_steps.map(|s| s as usize),
        load: a.load,
        save: a.save,
        report: a.report,
        evaluate: !a.no_eval,
        profile_on_oom: a.profile_on_oom,
        save_every: a.save_every.map(|n| n as usize),
        save_dir: a.save_dir,
        keep: a.keep as usize,
        resume: a.resume.clone(),
        parallel: a.parallel,
        ..a.run.config()?
    };
    if let Some(dir) = &a.resume {
        let checkpoint = memfit_train::resume::Checkpoint::latest(dir).map_err(|e| e.to_string())?;
        checkpoint.configure(&mut cfg, given).map_err(|e| e.to_string())?;
        eprintln!("resuming {} at step {} from {}", cfg.model_name(), checkpoint.step, dir.display());
    }
    // Flags are refused before anything else, with or without MPI.
    cfg.check().map_err(|e| Failure::from(e.to_string()))?;
    let group = ranks::join(cfg.parallel)?;
    if group.as_ref().is_some_and(|g| g.rank() != 0) {
        // Rank 0 speaks for the job; the others train quietly and abort it if they fail.
        let result = memfit_train::job::train_ranks(&cfg, &mut memfit_train::Quiet, group.clone());
        return ranks::finish(group, result.map(|_| ()).map_err(failure));
    }
    let summary = match run_with_progress(&cfg, group.clone()) {
        Ok(s) => s,
        Err(e) => return ranks::finish(group, Err(e)),
    };
    let report = Report::new(&summary);
    let what = if cfg.device.is_meta() { "predicted (meta device: nothing computed)" } else { "trained" };
    println!(
        "{what} {} for {} step{} ({} samples, micro-batch {} x {}), step median {:.1} ms",
        report.model,
        report.steps,
        if report.steps == 1 { "" } else { "s" },
        report.samples_seen,
        report.plan.micro_batch,
        report.plan.accumulation_steps,
        report.step_time_ms_median
    );
    match (report.val_accuracy, report.val_loss, report.val_perplexity) {
        (Some(acc), Some(loss), Some(ppl)) => {
            println!("validation loss {loss:.4} nats/char (perplexity {ppl:.2}), next-character accuracy {acc:.4}")
        }
        (Some(acc), Some(loss), None) => println!("validation accuracy {acc:.4}, loss {loss:.4}"),
        _ if summary.outcome.eval.as_ref().is_some_and(|e| e.samples == 0) => {
            println!("no validation: the validation set is empty")
        }
        _ => {}
    }
    print!("{}", report.memory_table());
    if let Some(p) = &report.parallel {
        print!("{}", ranks::table(p));
    }
    if !summary.profile_files.is_empty() {
        println!("the run met an out-of-memory: its memory profile is in {}", profile_dir(&summary.profile_files));
    }
    ranks::finish(group, Ok(()))
}

/// A job's error as the command's failure (exit 128 + signal for an interrupted run).
fn failure(e: memfit_train::TrainError) -> Failure {
    match e {
        memfit_train::TrainError::Interrupted { signal, message } => {
            Failure { message, code: 128u8.saturating_add(u8::try_from(signal).unwrap_or(0)) }
        }
        e => Failure::from(e.to_string()),
    }
}

/// The folder of a profile's files.
fn profile_dir(files: &[PathBuf]) -> String {
    files.first().and_then(|f| f.parent()).map_or(String::new(), |d| d.display().to_string())
}

fn profile(a: ProfileArgs) -> Result<(), Failure> {
    let cfg = TrainConfig {
        max_steps: Some(a.max_steps as usize),
        evaluate: false,
        profile: Some(a.out.clone()),
        ..a.run.config()?
    };
    let summary = run_with_progress(&cfg, None)?;
    let summary_file = summary.profile_files.iter().find(|f| f.ends_with("summary.txt"));
    if let Some(text) = summary_file.and_then(|f| std::fs::read_to_string(f).ok()) {
        print!("{text}");
    }
    println!(
        "profile of {} step{} written to {}:",
        summary.outcome.steps,
        if summary.outcome.steps == 1 { "" } else { "s" },
        a.out.display()
    );
    for f in &summary.profile_files {
        println!("  {}", f.display());
    }
    println!(
        "open memory.html in a browser; PyTorch's viewer: python -m torch.cuda._memory_viz trace_plot {} -o trace.html",
        a.out.join("snapshot.pickle").display()
    );
    Ok(())
}

/// Runs a job with a progress bar on a terminal (a line every tenth of the run otherwise).
fn run_with_progress(
    cfg: &TrainConfig,
    group: Option<std::sync::Arc<dyn memfit_dist::Group>>,
) -> Result<memfit_train::RunSummary, Failure> {
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    if cfg.device.is_meta() && (cfg.save.is_some() || cfg.load.is_some()) {
        eprintln!("note: the meta device holds no data: --save and --load are skipped");
    }
    let signal = stop_on_signals()?;
    let mut progress = Progress { bar, last_line: 0, model: cfg.model_name(), signal };
    let result = memfit_train::job::train_ranks(cfg, &mut progress, group);
    if let Some(bar) = &progress.bar {
        bar.finish_and_clear();
    }
    result.map_err(failure)
}

fn plan(a: PlanArgs) -> Result<(), String> {
    a.optimizer.check_state(a.optimizer_state)?;
    let spec = match (&a.model.file, a.model.kind) {
        // An imported model's input and classes are its signature's.
        (Some(path), _) => ModelSpec::exported(path)?,
        (None, ModelKind::Gpt) => {
            let config = a.gpt.config()?;
            let corpus = memfit_train::task::load_text(a.data.as_deref()).map_err(|e| e.to_string())?;
            let vocab = corpus.model_vocab(a.gpt.vocab.map(|v| v as usize)).map_err(|e| e.to_string())?;
            ModelSpec::gpt(GptConfig { vocab, ..config })
        }
        (None, kind) => ModelSpec::image(kind, a.input, 10),
    };
    let (spec_context, spec_vocab, spec_input) = (spec.gpt.max_t, spec.gpt.vocab, spec.input);
    let tokens = matches!(spec.input_kind(), memfit_nn::ModelInput::Tokens { .. });
    let lr = a.lr.unwrap_or(default_lr(&a.model));
    let request = PlanRequest {
        model: spec,
        optimizer: a.optimizer.config(lr).with_state_format(a.optimizer_state),
        effective_batch: a.batch_size.map_or(default_batch(&a.model), |b| b as usize),
        capacity: a.memory,
        safety_margin: a.safety_margin,
        checkpoint: checkpoint_or_default(a.checkpoint.clone(), a.memory),
        seed: a.seed,
        costs: memfit_train::calibration::default_cache()
            .map_or(memfit_train::cost::Costs::Calibrate, memfit_train::cost::Costs::Cached),
        micro_batch: a.micro_batch.map(|m| m as usize),
        precision: a.precision,
        parallel: None,
        target: a.device.target(),
        segments: Segments::or_default(a.segments, a.memory).on(a.device.target()),
        evaluate: true,
        optimizer_step: OptimizerStep::or_default(a.optimizer_step, a.memory),
        // A plan knows no run length: whole windows (a run adds its data's last window).
        last_window: None,
    };
    let single = memfit_train::plan(&request);
    let devices = match a.devices.filter(|&n| n > 1) {
        Some(n) => Some(devices_plan(&request, n as usize, single.as_ref().ok())?),
        None => None,
    };
    let plan = match (single, devices) {
        (Ok(plan), devices) => (plan, devices),
        (Err(e), devices) => {
            // One device cannot: say why, what would fit (the doctor's remedies) and what several can.
            let diagnosis = match &e {
                memfit_train::TrainError::DoesNotFit(d) => Some(d.as_ref()),
                _ => None,
            };
            if a.json {
                let json = serde_json::json!({"model": a.model.name(), "capacity_bytes": a.memory,
                    "fits_one_device": false, "one_device": e.to_string(), "diagnosis": diagnosis,
                    "devices": devices.as_ref().map(|(json, _)| json)});
                println!("{}", serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?);
            }
            return match devices {
                Some((_, text)) if !a.json => {
                    println!("one device: {e}\n{text}");
                    Ok(())
                }
                Some(_) => Ok(()),
                None => Err(e.to_string()),
            };
        }
    };
    let (plan, devices) = plan;
    if a.json {
        let p = &plan.predicted;
        let json = serde_json::json!({
            "model": a.model.name(),
            "input": if tokens {
                serde_json::json!({"context": spec_context, "vocab": spec_vocab})
            } else {
                serde_json::json!(spec_input)
            },
            "optimizer": a.optimizer.name(),
            "lr": lr,
            "capacity_bytes": a.memory,
            "budget_bytes": plan.budget,
            "micro_batch": plan.micro_batch,
            "accumulation_steps": plan.accumulation_steps,
            "effective_batch": plan.effective_batch,
            "eval_micro_batch": plan.eval_micro_batch,
            "predicted_peak_allocated_bytes": p.peak_allocated,
            "predicted_peak_reserved_bytes": p.peak_reserved,
            "training_peak_allocated_bytes": plan.training.peak_allocated,
            "training_peak_reserved_bytes": plan.training.peak_reserved,
            "training_at_peak_by_category": memfit_tensor::Category::ALL
                .iter()
                .map(|c| (c.name(), plan.training.at_peak[c.index()]))
                .collect::<std::collections::BTreeMap<_, _>>(),
            "dominant_category": plan.training.dominant().name(),
            "larger_budget": plan.larger.map(|(m, b)| serde_json::json!({"micro_batch": m, "needs_bytes": b})),
            "checkpointed_segments": plan.checkpoint.segment_names(),
            "precision": plan.precision.name(),
            "segments": plan.segments.name(),
            "optimizer_step": plan.optimizer_step.name(),
            "predicted_step_time_ms": plan.predicted_step_ms,
            "candidates": plan.candidates.iter().map(|c| serde_json::json!({
                "checkpointed_segments": c.checkpointed,
                "precision": c.precision.name(),
                "micro_batch": if c.fits() { Some(c.micro_batch) } else { None },
                "accumulation_steps": if c.fits() { Some(c.accumulation_steps) } else { None },
                "predicted_peak_reserved_bytes": c.peak_reserved,
                "predicted_step_time_ms": c.step_ms,
                "fits": c.fits(),
            })).collect::<Vec<_>>(),
            "calibration_ms": plan.calibration_ms,
            "planning_ms": plan.planning_ms,
            "target": a.device.target().name(),
            "fits_one_device": true,
            "devices": devices.as_ref().map(|(json, _)| json.clone()),
        });
        println!("{}", serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?);
    } else {
        let input = if tokens {
            format!("context {spec_context}, vocabulary {spec_vocab}")
        } else {
            format!("{}x{}x{}", spec_input[0], spec_input[1], spec_input[2])
        };
        print!("{}", plan.describe(&format!("{} ({input})", a.model.name())));
        if let Some((_, text)) = devices {
            print!("{text}");
        }
    }
    Ok(())
}

/// The GPT size flags of a request that differ from the defaults (empty for image models).
fn gpt_flags(request: &PlanRequest) -> String {
    if request.model.kind != ModelKind::Gpt {
        return String::new();
    }
    let (g, d) = (request.model.gpt, GptConfig::default());
    [
        ("--layers", g.layers, d.layers),
        ("--d-model", g.d_model, d.d_model),
        ("--heads", g.heads, d.heads),
        ("--context", g.max_t, d.max_t),
    ]
    .iter()
    .filter(|(_, v, default)| v != default)
    .map(|(flag, v, _)| format!(" {flag} {v}"))
    .collect()
}

/// `plan --devices N`: each parallel mode on `n` ranks (memfit_train::devices::plan_devices), as JSON
/// and as text, with one device's predicted step time beside them.
fn devices_plan(request: &PlanRequest, n: usize, single: Option<&Plan>) -> Result<(serde_json::Value, String), String> {
    let names = memfit_train::planner::segment_names(request).map_err(|e| e.to_string())?;
    let (costs, _) = memfit_train::calibration::model_for(request, &names).map_err(|e| e.to_string())?;
    let plans = memfit_train::devices::plan_devices(request, n, Some(&costs)).map_err(|e| e.to_string())?;
    let batch = request.effective_batch as f64;
    let unit = if costs.nominal { " units" } else { " ms" };
    let per = if costs.nominal { "1000 units" } else { "s" };
    let mut text = format!(
        "on {n} devices (each with the budget; communication at a nominal {:.1} GB/s):\n",
        memfit_train::devices::NOMINAL_ALLREDUCE_BYTES_PER_S / 1e9
    );
    if let Some(p) = single {
        let checkpointed = match &p.checkpoint {
            CheckpointChoice::All => names.clone(),
            c => c.segment_names(),
        };
        let step = costs.step_ms_in(request.effective_batch, p.micro_batch, &checkpointed, p.precision);
        text.push_str(&format!(
            "  one device:         step {step:.1}{unit} ({:.0} samples/{per})\n",
            batch / step * 1e3
        ));
    }
    let mut json = Vec::new();
    for d in &plans {
        let peaks: Vec<u64> = d.per_rank.iter().map(|p| p.peak_reserved).collect();
        match &d.plan {
            Ok(p) => {
                let step = d.step_ms.unwrap_or(f64::NAN);
                text.push_str(&format!(
                    "  --parallel {:<8} fits: micro-batch {} x {} per {}, peak per rank {}, step {:.1}{unit} ({:.0} samples/{})\n",
                    d.mode.name(),
                    p.micro_batch,
                    p.accumulation_steps,
                    if d.mode == ParallelMode::Pipeline { "window" } else { "rank" },
                    peaks.iter().map(|&b| format_bytes(b)).collect::<Vec<_>>().join(" / "),
                    step,
                    batch / step * 1e3,
                    per
                ));
                text.push_str(&format!(
                    "    mpirun -np {n} memfit train --model {}{} --parallel {} --batch-size {} --memory {}\n",
                    request.model.name(),
                    gpt_flags(request),
                    d.mode.name(),
                    request.effective_batch,
                    memfit_train::planner::memory_flag(request.capacity.unwrap_or(0))
                ));
                if !d.stages.is_empty() {
                    text.push_str(&format!("    stages: {}\n", d.stages.join(" | ")));
                }
            }
            Err(why) => text.push_str(&format!(
                "  --parallel {:<8} does not fit: {}\n",
                d.mode.name(),
                why.lines().next().unwrap_or("")
            )),
        }
        json.push(serde_json::json!({
            "mode": d.mode.name(),
            "ranks": n,
            "fits": d.plan.is_ok(),
            "why_not": d.plan.as_ref().err(),
            "micro_batch": d.plan.as_ref().ok().map(|p| p.micro_batch),
            "accumulation_steps": d.plan.as_ref().ok().map(|p| p.accumulation_steps),
            "eval_micro_batch": d.plan.as_ref().ok().map(|p| p.eval_micro_batch),
            "checkpointed_segments": d.plan.as_ref().ok().map(|p| p.checkpoint.segment_names()),
            "precision": d.plan.as_ref().ok().map(|p| p.precision.name()),
            "per_rank": d.per_rank.iter().enumerate().map(|(r, p)| serde_json::json!({
                "rank": r,
                "predicted_peak_allocated_bytes": p.peak_allocated,
                "predicted_peak_reserved_bytes": p.peak_reserved,
                "optimizer_state_bytes": p.category_peaks[memfit_tensor::Category::OptimizerState.index()],
                "communication_bytes": p.category_peaks[memfit_tensor::Category::Communication.index()],
            })).collect::<Vec<_>>(),
            "stages": d.stages,
            "predicted_step_time_ms": d.step_ms,
            "predicted_samples_per_second": d.step_ms.map(|s| batch / s * 1e3),
            "nominal_time": costs.nominal,
        }));
    }
    Ok((serde_json::Value::Array(json), text))
}

fn bench(a: BenchArgs) -> Result<(), String> {
    let threads = a.threads.map_or_else(limits::cores, |t| t as usize);
    let (warmup, steps) = (a.warmup as usize, a.steps as usize);
    let report = memfit_train::bench::run(&memfit_train::bench::BenchConfig {
        device: a.device,
        threads,
        only: &a.cases,
        batch: a.batch_size.map(|b| b as usize),
        warmup,
        steps,
        rounds: a.rounds as usize,
        pytorch: a.compare_pytorch.as_deref(),
        pytorch_compiled: a.compare_compiled,
        precision: a.precision,
    })
    .map_err(|e| e.to_string())?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?);
        return Ok(());
    }
    println!(
        "memfit bench: AdamW training step on {}, {threads} thread{}, median of {} steps{}, {} kernels{}{}",
        report.device,
        if threads == 1 { "" } else { "s" },
        a.steps,
        if a.rounds > 1 { format!(" (median of {} alternating rounds)", a.rounds) } else { String::new() },
        report.isa,
        match a.precision {
            Precision::Fp32 => String::new(),
            _ => format!(", precision {} (products: {})", report.precision, report.products),
        },
        report.pytorch_version.as_ref().map_or(String::new(), |v| {
            let autocast = if a.precision == Precision::Bf16 { " with bf16 autocast" } else { "" };
            format!(", vs PyTorch {v}{autocast} in the same run")
        })
    );
    let compare = report.pytorch_version.is_some();
    let compiled = a.compare_compiled && compare;
    // With several rounds, the spread of the rounds' own ratios (the host's noise) after the ratio.
    let spread = compare && report.rounds > 1;
    // Wide enough for an archive's path.
    let width = report.cases.iter().map(|c| c.name.len()).max().unwrap_or(0).max(16);
    print!("{:<width$} {:>10} {:>16} {:>16}", "case", "median ms", "peak allocated", "peak reserved");
    if compare {
        print!(" {:>12} {:>8}", "PyTorch ms", "ratio");
        if spread {
            print!(" {:>13}", "round ratios");
        }
        print!(" {:>14} {:>8}", "PyTorch peak", "ratio");
        if compiled {
            print!(" {:>12} {:>8}", "compiled ms", "ratio");
            if spread {
                print!(" {:>13}", "round ratios");
            }
        }
    }
    println!();
    for c in &report.cases {
        print!(
            "{:<width$} {:>10.2} {:>16} {:>16}",
            c.name,
            c.median_ms,
            format_bytes(c.peak_allocated_bytes),
            format_bytes(c.peak_reserved_bytes)
        );
        match &c.pytorch {
            Some(p) => {
                let peak = p.peak_bytes.map_or("n/a".to_string(), format_bytes);
                let peak_ratio =
                    p.peak_bytes.map_or("".to_string(), |b| format!("{:.2}", c.peak_allocated_bytes as f64 / b as f64));
                print!(" {:>12.2} {:>8.2}", p.median_ms, c.median_ms / p.median_ms);
                if spread {
                    print!(" {:>13}", ratio_spread(&c.round_ratios));
                }
                print!(" {:>14} {:>8}", peak, peak_ratio);
            }
            None if compare => {
                print!(" {:>12}", "n/a");
                if compiled {
                    // Blank PyTorch columns, so the compiled ones stay under their heading.
                    print!(" {:>8}{} {:>14} {:>8}", "", " ".repeat(14 * usize::from(spread)), "", "");
                }
            }
            None => {}
        }
        if compiled {
            match &c.pytorch_compiled {
                Some(p) => {
                    print!(" {:>12.2} {:>8.2}", p.median_ms, c.median_ms / p.median_ms);
                    if spread {
                        print!(" {:>13}", ratio_spread(&c.compiled_round_ratios));
                    }
                }
                None => print!(" {:>12}", "n/a"),
            }
        }
        println!();
    }
    for c in report.cases.iter().filter(|c| !c.kernels_used.is_empty()) {
        println!("{}: kernels: {}", c.name, c.kernels_used.join("; "));
    }
    for c in &report.cases {
        if let Some(l) = &c.launches {
            println!("{}: a step: {}", c.name, step_launches(l));
        }
    }
    if compare {
        let peak = if report.device.starts_with("cuda") {
            "its caching allocator's measured peak allocated"
        } else {
            "its MemTracker estimate"
        };
        println!("ratio = memfit / PyTorch (below 1: memfit is faster or smaller); PyTorch's peak is {peak}");
        if compiled {
            println!("compiled = PyTorch's model under torch.compile (its optimizer step eager), compiled in the warm-up steps");
        }
        if spread {
            println!("round ratios = the lowest and highest of the rounds' own step-time ratios (each round's pair ran back to back)");
        }
    }
    Ok(())
}

/// A step's work on a GPU as one line: `912 launches, products and copies, queued as 6 graph
/// launches and 3 alone (CUDA graphs)`.
fn step_launches(l: &memfit_train::bench::StepLaunches) -> String {
    let asked = format!("{:.0} launches, products and copies", l.asked);
    if !l.graphs {
        return format!(
            "{asked}, each queued alone (CUDA graphs off; {}=1 turns them on)",
            memfit_tensor::CUDA_GRAPHS_VARIABLE
        );
    }
    let alone = l.queued - l.graph_launches;
    let mut line =
        format!("{asked}, queued as {:.0} graph launches and {alone:.0} alone (CUDA graphs)", l.graph_launches);
    if let Some(why) = &l.graphs_off {
        line.push_str(&format!("; {why}"));
    }
    line
}

/// The lowest and highest of the rounds' ratios, as `0.81-0.93`.
fn ratio_spread(ratios: &[f64]) -> String {
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.2}-{hi:.2}")
}

fn generate(a: GenerateArgs) -> Result<(), String> {
    let cfg = GenerateConfig {
        model: a.model,
        load: a.load,
        prompt: a.prompt,
        tokens: a.tokens as usize,
        temperature: a.temperature,
        seed: a.seed,
        memory: a.memory,
        threads: a.threads.map(|t| t as usize),
        device: a.device,
    };
    use std::io::Write;
    let mut out = std::io::stdout();
    let mut echoed_prompt = false;
    let g = memfit_train::generate::generate(&cfg, &mut |text: &str| {
        // Writes fail only on a closed pipe (`| head`): generation still finishes and reports.
        if !echoed_prompt {
            let _ = write!(out, "{}", cfg.prompt);
            echoed_prompt = true;
        }
        let _ = write!(out, "{text}");
        let _ = out.flush();
    })
    .map_err(|e| e.to_string())?;
    if g.text.is_empty() {
        print!("{}", cfg.prompt);
    }
    println!();
    eprintln!(
        "generated {} characters in {:.0} ms with {}; memory: peak allocated {}, reserved {}",
        g.text.chars().count(),
        g.ms,
        g.model,
        format_bytes(g.stats.allocated_bytes.peak),
        format_bytes(g.stats.reserved_bytes.peak)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every flag of every command says what it is for (`--help` shows no bare flags).
    #[test]
    fn every_flag_has_help_text() {
        let cli = Cli::command();
        cli.clone().debug_assert();
        let mut bare = Vec::new();
        for command in cli.get_subcommands() {
            for arg in command.get_arguments() {
                if arg.get_help().is_none() && !["help", "version"].contains(&arg.get_id().as_str()) {
                    bare.push(format!("{} --{}", command.get_name(), arg.get_id()));
                }
            }
        }
        assert!(bare.is_empty(), "flags without help text: {bare:?}");
    }
}
