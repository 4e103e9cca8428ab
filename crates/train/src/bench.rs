//! `memfit bench`: per model (the zoo's cases, or a user's model exported by `torch.export.save`, at
//! a batch the user gives), the median AdamW training-step time after warm-up and a steady-state
//! step's peak allocated and reserved bytes, on synthetic data, on the cpu or a GPU; with a PyTorch
//! interpreter, the same step of the same model in PyTorch on the same device, run right after each
//! case (`assets/pytorch_bench.py`, embedded), so every ratio comes from one run on one machine. With several rounds, memfit and PyTorch take
//! turns (memfit, PyTorch, memfit, PyTorch, ...) and each side's time is the median of its rounds'
//! medians: on a shared, noisy host a slow spell then falls on both sides instead of on one.

use crate::error::TrainError;
use crate::samples::synthetic;
use crate::trainer::{median, RunOptions, Session};
use memfit_nn::{GptConfig, ModelKind, ModelSpec, OptimizerConfig};
use memfit_tensor::{Device, DeviceConfig, DeviceKind};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// PyTorch's side of the comparison: the cases' models in PyTorch, timed as memfit times them.
const PYTORCH_BENCH: &str = include_str!("../assets/pytorch_bench.py");

/// One benchmark case: a model and its batch.
#[derive(Clone, Copy, Debug)]
pub struct BenchCase {
    pub name: &'static str,
    pub spec: fn() -> ModelSpec,
    pub batch: usize,
    /// Run when no case is named; a case that needs a GPU's memory and speed runs only when named.
    pub by_default: bool,
}

/// GPT-2 small (124M parameters: L12 d768 h12 T1024, GPT-2's vocabulary of 50,257 padded to 50,304).
pub const GPT2_124M: GptConfig = GptConfig { vocab: 50_304, d_model: 768, heads: 12, layers: 12, max_t: 1024 };

/// The cases of `shared/pytorch-reference/torch_models.py` (and resnet): the GPT is L4 d256 h4 T128
/// with the reference's vocabulary of 96; GPT-2 small at batch 8 (`torch_gpu_gpt.py`'s fp32 case)
/// and at batch 16 (its bf16 case, issue 32's), on a GPU, when named (`memfit bench gpt2 --device
/// cuda`: both).
pub const CASES: [BenchCase; 7] = [
    BenchCase {
        name: "mlp-b256",
        spec: || ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10),
        batch: 256,
        by_default: true,
    },
    BenchCase {
        name: "simplecnn-b128",
        spec: || ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10),
        batch: 128,
        by_default: true,
    },
    BenchCase {
        name: "deepcnn-b64",
        spec: || ModelSpec::image(ModelKind::DeepCnn, [3, 64, 64], 10),
        batch: 64,
        by_default: true,
    },
    BenchCase {
        name: "resnet-b64",
        spec: || ModelSpec::image(ModelKind::ResNet, [3, 32, 32], 10),
        batch: 64,
        by_default: true,
    },
    BenchCase { name: "gpt-b32", spec: || ModelSpec::gpt(GptConfig::default()), batch: 32, by_default: true },
    BenchCase { name: "gpt2-124m-b8", spec: || ModelSpec::gpt(GPT2_124M), batch: 8, by_default: false },
    BenchCase { name: "gpt2-124m-b16", spec: || ModelSpec::gpt(GPT2_124M), batch: 16, by_default: false },
];

#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    pub name: String,
    /// The median of the rounds' medians.
    pub median_ms: f64,
    /// Each round's median step time, in the order run.
    pub round_ms: Vec<f64>,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub steps: usize,
    /// The same step in PyTorch, when asked for and the case has a PyTorch reference.
    pub pytorch: Option<PytorchCase>,
    /// Each round's memfit / PyTorch step-time ratio, in the order run (empty without PyTorch): the
    /// two sides take turns, so a round's pair ran close together, and the spread shows how much
    /// of the case's ratio is the host's noise.
    pub round_ratios: Vec<f64>,
    /// The same step with PyTorch's model under `torch.compile`, when asked for
    /// (`--compare-compiled`).
    pub pytorch_compiled: Option<PytorchCase>,
    /// Each round's memfit / compiled PyTorch ratio, as `round_ratios`.
    pub compiled_round_ratios: Vec<f64>,
    /// Which of a GPU's alternative kernels the case ran (`Device::kernels_used`; empty on cpu).
    #[serde(default)]
    pub kernels_used: Vec<String>,
    /// A timed step's work on a GPU and the calls that queued it (None on cpu).
    pub launches: Option<StepLaunches>,
}

/// A GPU step's work, the mean of the timed steps (Note [CUDA graphs] in memfit-cuda).
#[derive(Clone, Debug, Serialize)]
pub struct StepLaunches {
    /// Work asked for: kernel launches, products, device copies and zeroings.
    pub asked: f64,
    /// Calls that queued it on the GPU: each op queued alone, and each graph launch.
    pub queued: f64,
    /// Of `queued`, graph launches.
    pub graph_launches: f64,
    /// Whether CUDA graphs were asked for (`MEMFIT_CUDA_GRAPHS=1`).
    pub graphs: bool,
    /// Why graphs are off although asked for, if they are.
    pub graphs_off: Option<String>,
}

impl StepLaunches {
    /// The mean step between two counts taken `steps` steps apart.
    fn between(before: &memfit_tensor::Launches, after: &memfit_tensor::Launches, steps: usize) -> StepLaunches {
        let per = |a: u64, b: u64| (b - a) as f64 / steps.max(1) as f64;
        StepLaunches {
            asked: per(before.asked, after.asked),
            queued: per(before.queued, after.queued),
            graph_launches: per(before.graph_launches, after.graph_launches),
            graphs: after.on,
            graphs_off: after.off.clone(),
        }
    }
}

/// One case measured in PyTorch by `assets/pytorch_bench.py`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PytorchCase {
    /// The median of the rounds' medians.
    pub median_ms: f64,
    /// Each round's median step time, in the order run (filled by memfit, not the script).
    #[serde(default)]
    pub round_ms: Vec<f64>,
    /// PyTorch's MemTracker estimate of a steady-state step's peak (null when unavailable).
    pub peak_bytes: Option<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Where the steps ran: `cpu`, or `cuda:N (its name)`.
    pub device: String,
    pub threads: usize,
    /// Rounds per case (memfit and PyTorch alternating).
    pub rounds: usize,
    /// The instruction set memfit's kernels ran with.
    pub isa: String,
    /// The precision the cases ran in (`fp32`, `bf16`, `fp16`), and how memfit's matrix products
    /// computed (`crate::report::products_label`).
    pub precision: String,
    pub products: String,
    /// The PyTorch version compared against, when one was.
    pub pytorch_version: Option<String>,
    pub cases: Vec<CaseResult>,
}

/// Checks that `python` runs and imports torch; returns torch's version. Called before any
/// measuring, so a wrong interpreter fails at once.
pub fn pytorch_version(python: &Path) -> Result<String, TrainError> {
    let out = Command::new(python)
        .args(["-c", "import torch; print(torch.__version__)"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| TrainError::Invalid(format!("--compare-pytorch {}: cannot run it: {e}", python.display())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no message");
        return Err(TrainError::Invalid(format!(
            "--compare-pytorch {}: cannot import torch ({last}); give a Python with PyTorch, e.g. set one up with \
             `python3 -m venv /tmp/torch-venv && /tmp/torch-venv/bin/pip install torch`",
            python.display()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// What one measured case runs: its name, model and batch, and how PyTorch names it (a zoo case's
/// name; for an archive `pt2 PATH BATCH` and its task's shapes).
struct Planned {
    name: String,
    spec: ModelSpec,
    batch: usize,
    pytorch_case: Vec<String>,
}

/// The case of an exported model: its archive's path as the name, `batch` samples (None: 64 images
/// or 32 text windows) of synthetic data of the export's shapes; PyTorch runs the same archive
/// (`torch.export.load`).
fn archive_case(path: &Path, batch: Option<usize>) -> Result<Planned, TrainError> {
    let spec = ModelSpec::exported(path).map_err(TrainError::Invalid)?;
    let text = matches!(spec.input_kind(), memfit_nn::ModelInput::Tokens { .. });
    let batch = batch.unwrap_or(if text { 32 } else { 64 });
    let mut pytorch_case = vec!["pt2".to_string(), path.display().to_string(), batch.to_string()];
    pytorch_case.extend(match spec.input_kind() {
        memfit_nn::ModelInput::Image { shape, classes } => {
            vec!["image".into(), shape[0].to_string(), shape[1].to_string(), shape[2].to_string(), classes.to_string()]
        }
        memfit_nn::ModelInput::Tokens { context, vocab } => {
            vec!["tokens".into(), context.to_string(), vocab.to_string()]
        }
    });
    Ok(Planned { name: path.display().to_string(), spec, batch, pytorch_case })
}

/// Runs one case in PyTorch (its model under `torch.compile` when `compiled`); `None` when
/// PyTorch has no reference for it.
fn run_pytorch_case(
    cfg: &BenchConfig,
    python: &Path,
    case: &[String],
    compiled: bool,
) -> Result<Option<PytorchCase>, TrainError> {
    let name = case.join(" ") + if compiled { " (torch.compile)" } else { "" };
    let (warmup, steps, threads) = (cfg.warmup, cfg.steps, cfg.threads);
    // PyTorch's name of the device.
    let device = match cfg.device {
        DeviceKind::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".to_string(),
    };
    let fail =
        |what: String| TrainError::Invalid(format!("--compare-pytorch {}: case {name}: {what}", python.display()));
    let mut child = Command::new(python)
        .arg("-")
        .args([case[0].clone(), warmup.to_string(), steps.to_string(), threads.to_string(), device])
        .args(&case[1..])
        // bf16: PyTorch's autocast; fp16 storage has no PyTorch counterpart, so it runs fp32.
        .env(
            "MEMFIT_BENCH_AUTOCAST",
            match cfg.precision {
                crate::config::Precision::Bf16 => "bf16",
                crate::config::Precision::Fp16 => "fp16",
                _ => "",
            },
        )
        .env("MEMFIT_BENCH_COMPILE", if compiled { "1" } else { "" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run it: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(PYTORCH_BENCH.as_bytes()).map_err(|e| fail(format!("cannot send the script: {e}")))?;
    }
    let out = child.wait_with_output().map_err(|e| fail(format!("{e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(fail(format!("the PyTorch script failed: {}", err.lines().last().unwrap_or("no message"))));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line =
        text.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or_else(|| fail("no result printed".into()))?;
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| fail(format!("unreadable result {line:?}: {e}")))?;
    if value.get("error").is_some() {
        return Ok(None);
    }
    let result: PytorchCase =
        serde_json::from_value(value).map_err(|e| fail(format!("unreadable result {line:?}: {e}")))?;
    if !(result.median_ms.is_finite() && result.median_ms > 0.0) {
        return Err(fail(format!("implausible step time {} ms", result.median_ms)));
    }
    Ok(Some(result))
}

/// Measures one case on `kind`: `warmup` steps, then `steps` timed steps; the peaks are those of
/// the timed (steady-state, optimizer state present) steps.
pub fn run_case(case: &BenchCase, kind: DeviceKind, warmup: usize, steps: usize) -> Result<CaseResult, TrainError> {
    let planned = Planned { name: case.name.to_string(), spec: (case.spec)(), batch: case.batch, pytorch_case: vec![] };
    measure(&planned, kind, warmup, steps, crate::config::Precision::Fp32)
}

fn measure(
    case: &Planned,
    kind: DeviceKind,
    warmup: usize,
    steps: usize,
    precision: crate::config::Precision,
) -> Result<CaseResult, TrainError> {
    let spec = &case.spec;
    let device = Device::new(DeviceConfig::new(kind))?;
    let optimizer = OptimizerConfig::adamw(1e-3);
    let mut session = Session::new(device.clone(), spec, optimizer, 0)?;
    session.set_precision(precision)?;
    // Two windows of data, reused across epochs: the data's size does not grow with the steps.
    let data = synthetic(spec, case.batch * 2, 0);
    let opts = |n: usize| RunOptions {
        effective_batch: case.batch,
        micro_batch: case.batch,
        eval_micro_batch: case.batch,
        epochs: None,
        max_steps: Some(n),
        data_seed: 0,
        recover: false,
        grow_after: usize::MAX,
        record_samples: false,
    };
    session.run(data.as_ref(), None, &opts(warmup), &mut |_| {})?;
    device.reset_peak_stats();
    let timed = synthetic(spec, case.batch * 2, 1);
    let launched_before = device.launches();
    let outcome = session.run(timed.as_ref(), None, &opts(steps), &mut |_| {})?;
    let launches = launched_before.zip(device.launches()).map(|(b, a)| StepLaunches::between(&b, &a, steps));
    let stats = device.stats();
    let median_ms = median(&outcome.step_times_ms);
    Ok(CaseResult {
        name: case.name.clone(),
        median_ms,
        round_ms: vec![median_ms],
        peak_allocated_bytes: stats.allocated_bytes.peak,
        peak_reserved_bytes: stats.reserved_bytes.peak,
        steps,
        pytorch: None,
        round_ratios: Vec::new(),
        pytorch_compiled: None,
        compiled_round_ratios: Vec::new(),
        kernels_used: device.kernels_used(),
        launches,
    })
}

/// Each round's ratio of memfit's step time to PyTorch's, rounds paired in the order run.
fn round_ratios(ours: &[f64], theirs: &[f64]) -> Vec<f64> {
    ours.iter().zip(theirs).map(|(o, t)| o / t).collect()
}

/// What `memfit bench` runs.
pub struct BenchConfig<'a> {
    /// cpu or cuda (meta computes no times).
    pub device: DeviceKind,
    /// The cpu's worker threads (PyTorch gets as many).
    pub threads: usize,
    /// The cases, by case or model name, or the path of a model exported by `torch.export.save` (a
    /// `.pt2` file); the zoo's default cases when empty.
    pub only: &'a [String],
    /// The batch of an exported model's case (None: 64 images or 32 text windows).
    pub batch: Option<usize>,
    pub warmup: usize,
    pub steps: usize,
    /// Rounds per case: memfit and PyTorch alternate.
    pub rounds: usize,
    /// A Python interpreter with PyTorch, to run each case there too.
    pub pytorch: Option<&'a Path>,
    /// With `pytorch`: each case in PyTorch under `torch.compile` too.
    pub pytorch_compiled: bool,
    /// fp32, bf16 (memfit's `--precision bf16`; PyTorch's bf16 autocast) or fp16 (memfit's storage,
    /// products and loss scale; PyTorch's fp16 autocast with GradScaler); `auto` is refused.
    pub precision: crate::config::Precision,
}

/// Runs the cases (all when `only` is empty) on a pool of `threads` threads, each `rounds` times;
/// with `pytorch` (a Python interpreter with PyTorch), each round of a case is followed by the same
/// case in PyTorch with as many threads, on the same device.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport, TrainError> {
    let (threads, only, rounds, pytorch) = (cfg.threads, cfg.only, cfg.rounds, cfg.pytorch);
    if cfg.device.is_meta() {
        return Err(TrainError::Invalid(
            "bench: the meta device computes nothing, so it has no step times: use cpu or cuda".into(),
        ));
    }
    if rounds == 0 {
        return Err(TrainError::Invalid("bench: --rounds must be at least 1".into()));
    }
    if cfg.precision == crate::config::Precision::Auto {
        return Err(TrainError::Invalid(
            "bench: --precision auto is the planner's choice under a budget; give fp32, bf16 or fp16".into(),
        ));
    }
    // A case is named by itself (`gpt-b32`) or by its model (`gpt`, as `--model` elsewhere), any case.
    let named = |c: &BenchCase, name: &str| {
        c.name.eq_ignore_ascii_case(name) || c.name.split('-').next().is_some_and(|m| m.eq_ignore_ascii_case(name))
    };
    let archive = |name: &str| name.ends_with(".pt2");
    for name in only {
        if !archive(name) && !CASES.iter().any(|c| named(c, name)) {
            let names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
            return Err(TrainError::Invalid(format!(
                "unknown bench case {name:?}: expected a model (mlp, simplecnn, deepcnn, resnet, gpt, gpt2), a case ({}) \
                 or a model exported by torch.export.save (a .pt2 file)",
                names.join(", ")
            )));
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Invalid(format!("cannot start {threads} worker threads: {e}")))?;
    // The device first (a missing GPU is named before PyTorch is asked anything), then PyTorch.
    Device::probe(cfg.device)?;
    let opened = Device::new(DeviceConfig::new(cfg.device))?;
    let device = opened.describe();
    // How the cases' products compute on this device (each case's own device is set the same way).
    opened.set_products(cfg.precision.products())?;
    let products = crate::report::products_label(&opened);
    drop(opened);
    let pytorch_version = pytorch.map(pytorch_version).transpose()?;
    // The archives are read (and refused with their reason) before anything is measured.
    let mut planned: Vec<Planned> = Vec::new();
    let chosen = |c: &BenchCase| if only.is_empty() { c.by_default } else { only.iter().any(|n| named(c, n)) };
    for case in CASES.iter().filter(|c| chosen(c)) {
        let pytorch_case = vec![case.name.to_string()];
        planned.push(Planned { name: case.name.to_string(), spec: (case.spec)(), batch: case.batch, pytorch_case });
    }
    for path in only.iter().filter(|n| archive(n)) {
        planned.push(archive_case(Path::new(path), cfg.batch)?);
    }
    let mut cases = Vec::new();
    for case in &planned {
        let (mut ours, mut theirs, mut compiled) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            ours.push(pool.install(|| measure(case, cfg.device, cfg.warmup, cfg.steps, cfg.precision))?);
            if let Some(python) = pytorch {
                theirs.push(run_pytorch_case(cfg, python, &case.pytorch_case, false)?);
                if cfg.pytorch_compiled {
                    compiled.push(run_pytorch_case(cfg, python, &case.pytorch_case, true)?);
                }
            }
        }
        let round_ms: Vec<f64> = ours.iter().map(|r| r.median_ms).collect();
        let mut result = ours.pop().expect("at least one round");
        result.median_ms = median(&round_ms);
        result.round_ms = round_ms;
        // A case without a PyTorch reference is None in every round.
        if let Some(last) = theirs.iter().flatten().last() {
            let round_ms: Vec<f64> = theirs.iter().flatten().map(|p| p.median_ms).collect();
            result.round_ratios = round_ratios(&result.round_ms, &round_ms);
            result.pytorch = Some(PytorchCase { median_ms: median(&round_ms), round_ms, peak_bytes: last.peak_bytes });
        }
        if let Some(last) = compiled.iter().flatten().last() {
            let round_ms: Vec<f64> = compiled.iter().flatten().map(|p| p.median_ms).collect();
            result.compiled_round_ratios = round_ratios(&result.round_ms, &round_ms);
            let peak_bytes = last.peak_bytes;
            result.pytorch_compiled = Some(PytorchCase { median_ms: median(&round_ms), round_ms, peak_bytes });
        }
        cases.push(result);
    }
    Ok(BenchReport {
        device,
        threads,
        rounds,
        isa: memfit_tensor::Isa::active().to_string(),
        precision: cfg.precision.name().to_string(),
        products,
        pytorch_version,
        cases,
    })
}

#[cfg(test)]
mod tests {
    use super::round_ratios;

    #[test]
    fn round_ratios_pair_the_rounds_in_order() {
        assert_eq!(round_ratios(&[10.0, 30.0, 20.0], &[20.0, 20.0, 40.0]), vec![0.5, 1.5, 0.5]);
        assert!(round_ratios(&[10.0], &[]).is_empty());
    }
}
