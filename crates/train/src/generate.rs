//! `memfit generate`: sample a continuation of a prompt from a GPT checkpoint saved by
//! `memfit train --model gpt --save`, or from an imported next-token predictor (`--model PATH.pt2`)
//! with the weights `memfit train --model PATH.pt2 --save` wrote. The checkpoint carries the
//! character vocabulary (and memfit's GPT its sizes; see [`crate::task::Task::checkpoint_metadata`]).
//! Runs under no-grad on `cpu` (optionally capped), one forward pass over the last `context`
//! characters per new character, sampling from `softmax(logits / temperature)` with the project's
//! seeded generator: the same seed gives the same text.
//!
//! An imported program's context is fixed by its export: a shorter window is filled on the right,
//! which changes nothing before the fill in a causal model. That the model is causal is checked, not
//! assumed: the first window is run with two different fills, and the last prompt position's logits
//! must agree.

use crate::error::TrainError;
use memfit_data::{Rng, Vocab};
use memfit_nn::models::{MODEL_KEY, VOCAB_KEY};
use memfit_nn::{GptConfig, ModelSpec};
use memfit_tensor::{Category, Device, DeviceConfig, DeviceKind, MemoryStats, Phase, Tensor};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// An imported next-token predictor's archive (None: memfit's GPT, sized by the checkpoint).
    pub model: Option<PathBuf>,
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
    /// The model, described: `gpt L4 d256 h4 T128 (vocabulary 83)`, or the archive's path.
    pub model: String,
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
        Some("imported") => {
            return Err(fail(
                "it holds an imported model's weights: give its archive too, with --model PATH.pt2".into(),
            ))
        }
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
    let (spec, vocab, context, described) = match &cfg.model {
        None => {
            let (config, vocab) = read_gpt_checkpoint(&cfg.load)?;
            let described = format!(
                "gpt L{} d{} h{} T{} (vocabulary {})",
                config.layers, config.d_model, config.heads, config.max_t, config.vocab
            );
            (ModelSpec::gpt(config), vocab, config.max_t, described)
        }
        Some(path) => {
            let (spec, vocab, context) = read_imported(path, &cfg.load)?;
            (spec, vocab, context, path.display().to_string())
        }
    };
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
            memfit_nn::build_model(&spec, &device, 0)?
        };
        memfit_nn::checkpoint::load(&cfg.load, model.as_ref()).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        let _no_grad = device.no_grad();
        let _phase = device.enter_phase(Phase::Eval);
        let mut tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
        let mut rng = Rng::new(cfg.seed);
        let mut text = String::new();
        // The logits after the window's last character; an imported program's window filled with
        // `fill` up to its fixed context.
        let last_logits = |window: &[i64], fill: i64| -> Result<Vec<f64>, TrainError> {
            let mut input = window.to_vec();
            if cfg.model.is_some() {
                input.resize(context, fill);
            }
            let x = Tensor::from_slice(&device, &input, &[1, input.len()], Category::Input)?;
            let logits = model.forward(&x, false)?;
            Ok(logits.narrow(1, window.len() - 1, 1)?.to_f64_vec()?)
        };
        if cfg.model.is_some() && tokens.len() < context && cfg.tokens > 0 {
            let window = &tokens[..];
            if last_logits(window, 0)? != last_logits(window, 1)? {
                return Err(TrainError::Invalid(format!(
                    "{}: the model is not causal (a position's logits depend on later tokens), so it cannot \
                     continue a prompt shorter than its context of {context}: give a prompt of {context} characters",
                    described
                )));
            }
        }
        for _ in 0..cfg.tokens {
            let window = &tokens[tokens.len().saturating_sub(context)..];
            let last = last_logits(window, 0)?;
            // Only the text's characters: a model's vocabulary may be padded past them (`--vocab`).
            let next = sample(&last[..vocab.len()], cfg.temperature, &mut rng);
            tokens.push(next as i64);
            let c = vocab.decode(&[next]);
            on_text(&c);
            text.push_str(&c);
        }
        Ok(Generation {
            text,
            model: described.clone(),
            stats: device.stats(),
            ms: start.elapsed().as_secs_f64() * 1e3,
        })
    })
}

/// An imported next-token predictor's spec, with the vocabulary its weights were trained with (the
/// checkpoint's) and its fixed context.
fn read_imported(archive: &std::path::Path, load: &std::path::Path) -> Result<(ModelSpec, Vocab, usize), TrainError> {
    crate::output::check_input("--load", load)?;
    let spec = ModelSpec::exported(archive).map_err(TrainError::Invalid)?;
    let memfit_nn::ModelInput::Tokens { context, vocab: size } = spec.input_kind() else {
        return Err(TrainError::Invalid(format!(
            "{}: an image classifier; generation needs a next-token predictor (int64 tokens [N, T] in, logits \
             [N, T, V] out)",
            archive.display()
        )));
    };
    let fail = |why: String| TrainError::Checkpoint(format!("cannot generate from {}: {why}", load.display()));
    let metadata = memfit_nn::checkpoint::read_metadata(load)
        .map_err(|e| TrainError::Checkpoint(e.to_string()))?
        .unwrap_or_default();
    let chars = metadata.get(VOCAB_KEY).ok_or_else(|| {
        fail(format!("it has no vocabulary: save it with `memfit train --model {} --save PATH`", archive.display()))
    })?;
    let vocab = Vocab::from_chars(chars).map_err(|e| fail(e.to_string()))?;
    if vocab.len() > size {
        return Err(fail(format!("its vocabulary of {} characters is more than the model's {size}", vocab.len())));
    }
    Ok((spec, vocab, context))
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
