//! `memfit generate`: sample a continuation of a prompt from a GPT checkpoint saved by
//! `memfit train --model gpt --save`. The checkpoint carries the model's sizes and its character
//! vocabulary (see [`crate::task::Task::checkpoint_metadata`]), so nothing else is needed. Runs under
//! no-grad on `cpu` (optionally capped), one forward pass over the last `context` characters per new
//! character, sampling from `softmax(logits / temperature)` with the project's seeded generator:
//! the same seed gives the same text.

use crate::error::TrainError;
use memfit_data::{Rng, Vocab};
use memfit_nn::models::{MODEL_KEY, VOCAB_KEY};
use memfit_nn::{GptConfig, ModelSpec};
use memfit_tensor::{Category, Device, DeviceConfig, DeviceKind, MemoryStats, Phase, Tensor};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateConfig {
    pub load: PathBuf,
    pub prompt: String,
    /// Characters to generate.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely character every time.
    pub temperature: f64,
    pub seed: u64,
    /// Device capacity in bytes; None = unlimited.
    pub memory: Option<u64>,
    pub threads: Option<usize>,
    /// The device that computes (cpu or cuda).
    pub device: DeviceKind,
}

/// A finished generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated characters (the prompt not included).
    pub text: String,
    pub model: GptConfig,
    pub stats: MemoryStats,
    pub ms: f64,
}

/// Reads the GPT's sizes and vocabulary from a checkpoint's metadata.
pub fn read_gpt_checkpoint(path: &std::path::Path) -> Result<(GptConfig, Vocab), TrainError> {
    let fail = |why: String| TrainError::Checkpoint(format!("cannot generate from {}: {why}", path.display()));
    crate::output::check_input("--load", path)?;
    // The checkpoint reader's errors name the file already: they are not prefixed again.
    let metadata = memfit_nn::checkpoint::read_metadata(path)
        .map_err(|e| TrainError::Checkpoint(e.to_string()))?
        .unwrap_or_default();
    match metadata.get(MODEL_KEY).map(String::as_str) {
        Some("gpt") => {}
        Some(other) => return Err(fail(format!("it holds a {other} model; generation needs a gpt checkpoint"))),
        None => {
            return Err(fail(
                "it has no memfit model metadata; save one with `memfit train --model gpt --save PATH`".into(),
            ))
        }
    }
    let chars = metadata.get(VOCAB_KEY).ok_or_else(|| fail("it has no vocabulary".into()))?;
    let vocab = Vocab::from_chars(chars).map_err(|e| fail(e.to_string()))?;
    let config = GptConfig::from_metadata(&metadata, vocab.len()).map_err(|e| fail(e.to_string()))?;
    Ok((config, vocab))
}

/// Generates `cfg.tokens` characters after `cfg.prompt`, calling `on_text` with each new character.
pub fn generate(cfg: &GenerateConfig, on_text: &mut (dyn FnMut(&str) + Send)) -> Result<Generation, TrainError> {
    if !cfg.temperature.is_finite() || cfg.temperature < 0.0 {
        return Err(TrainError::Invalid(format!(
            "--temperature {} is not usable: give a number >= 0 (0 = always the most likely character, 0.8 is typical)",
            cfg.temperature
        )));
    }
    if let Some(t) = cfg.threads.filter(|&t| t == 0 || t > crate::config::limits::max_threads()) {
        return Err(TrainError::Invalid(format!(
            "--threads {t} is out of range: use 1 to {}",
            crate::config::limits::max_threads()
        )));
    }
    let (config, vocab) = read_gpt_checkpoint(&cfg.load)?;
    let prompt = vocab.encode(&cfg.prompt).map_err(|e| TrainError::Invalid(format!("--prompt: {e}")))?;
    if prompt.is_empty() {
        return Err(TrainError::Invalid("--prompt is empty: give at least one character to continue".into()));
    }
    let threads = cfg.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Invalid(format!("cannot start {threads} worker threads: {e}")))?;
    pool.install(|| {
        let start = Instant::now();
        let device = Device::new(DeviceConfig::new(cfg.device).capacity(cfg.memory))?;
        let model = {
            let _p = device.enter_phase(Phase::Setup);
            memfit_nn::build_model(&ModelSpec::gpt(config), &device, 0)?
        };
        memfit_nn::checkpoint::load(&cfg.load, model.as_ref()).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        let _no_grad = device.no_grad();
        let _phase = device.enter_phase(Phase::Eval);
        let mut tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
        let mut rng = Rng::new(cfg.seed);
        let mut text = String::new();
        for _ in 0..cfg.tokens {
            let window = &tokens[tokens.len().saturating_sub(config.max_t)..];
            let x = Tensor::from_slice(&device, window, &[1, window.len()], Category::Input)?;
            let logits = model.forward(&x, false)?;
            let last = logits.narrow(1, window.len() - 1, 1)?.to_f64_vec()?;
            let next = sample(&last, cfg.temperature, &mut rng);
            tokens.push(next as i64);
            let c = vocab.decode(&[next]);
            on_text(&c);
            text.push_str(&c);
        }
        Ok(Generation { text, model: config, stats: device.stats(), ms: start.elapsed().as_secs_f64() * 1e3 })
    })
}

/// Draws an index from `softmax(logits / temperature)` (the argmax, first among ties, at 0).
pub fn sample(logits: &[f64], temperature: f64, rng: &mut Rng) -> usize {
    let argmax = logits.iter().enumerate().fold(0, |b, (i, &v)| if v > logits[b] { i } else { b });
    if temperature == 0.0 {
        return argmax;
    }
    let top = logits[argmax];
    let weights: Vec<f64> = logits.iter().map(|&v| ((v - top) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i;
        }
        u -= w;
    }
    argmax
}
