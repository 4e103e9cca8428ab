//! Tasks: what a model kind learns from, and how a job loads it. The one place that maps a model
//! kind to its data: image models classify Fashion-MNIST; the GPT predicts the next character of a
//! UTF-8 text (Moby Dick shipped inside memfit, or `--data FILE`). Everything past this point (the
//! trainer, planner, recovery, report) sees only a [`ModelSpec`] and [`Samples`].

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::samples::{Samples, SplitSamples, TextWindows};
use memfit_data::{FashionMnist, TextCorpus, Vocab};
use memfit_nn::{GptConfig, ModelKind, ModelSpec};
use std::path::Path;

pub use crate::config::EMBEDDED;

pub use crate::samples::IMAGE_NORMALIZATION;

/// Checkpoint metadata keys of the input normalization: the formula, the mean and the std.
pub const NORMALIZATION_KEYS: [&str; 3] = ["memfit.input.normalization", "memfit.input.mean", "memfit.input.std"];

/// What a task's data is.
pub enum TaskData {
    /// Labelled images (train and validation splits).
    Images(FashionMnist),
    /// A tokenized text; windows of `context + 1` characters are its samples.
    Text { corpus: TextCorpus, context: usize },
}

/// A task, loaded: the model it trains and its data.
pub struct Task {
    pub spec: ModelSpec,
    pub data: TaskData,
}

/// The model `cfg.model_file` holds (an imported model's spec), its archive read and checked.
pub fn imported_spec(cfg: &TrainConfig) -> Result<ModelSpec, TrainError> {
    let path =
        cfg.model_file.as_deref().ok_or_else(|| TrainError::Invalid("an imported model needs its .pt2 file".into()))?;
    ModelSpec::exported(path).map_err(TrainError::Invalid)
}

impl Task {
    /// Loads the data `cfg.model` learns from and sizes the model for it (image shape, vocabulary).
    pub fn load(cfg: &TrainConfig) -> Result<Task, TrainError> {
        let data = cfg.data.as_deref();
        if cfg.model == ModelKind::Imported {
            let spec = imported_spec(cfg)?;
            if let memfit_nn::ModelInput::Tokens { vocab, context } = spec.input_kind() {
                let corpus = load_text(data)?;
                if corpus.vocab.len() > vocab {
                    return Err(TrainError::Invalid(format!(
                        "{} predicts {vocab} tokens; the text has {} characters ({}): export the model with a \
                         vocabulary of at least {}",
                        spec.name(),
                        corpus.vocab.len(),
                        corpus.summary(),
                        corpus.vocab.len()
                    )));
                }
                corpus.check_context(context)?;
                return Ok(Task { spec, data: TaskData::Text { corpus, context } });
            }
        }
        if cfg.model == ModelKind::Gpt {
            let corpus = load_text(data)?;
            let gpt = GptConfig { vocab: corpus.model_vocab(cfg.vocab)?, ..cfg.gpt };
            corpus.check_context(gpt.max_t)?;
            return Ok(Task { spec: ModelSpec::gpt(gpt), data: TaskData::Text { corpus, context: gpt.max_t } });
        }
        let images = match data {
            Some(dir) if dir.as_os_str() == EMBEDDED => memfit_data::load_embedded()?,
            dir => memfit_data::load_fashion_mnist(dir)?,
        };
        let input = [1, images.train.images.rows, images.train.images.cols];
        if cfg.model == ModelKind::Imported {
            let spec = imported_spec(cfg)?;
            if spec.input != input || spec.num_classes < memfit_data::NUM_CLASSES {
                return Err(TrainError::Invalid(format!(
                    "{} takes images of {:?} (C, H, W) into {} classes; the data are {:?} images of {} classes \
                     (Fashion-MNIST): export the model for 1x{}x{} inputs and at least {} outputs",
                    spec.name(),
                    spec.input,
                    spec.num_classes,
                    input,
                    memfit_data::NUM_CLASSES,
                    input[1],
                    input[2],
                    memfit_data::NUM_CLASSES
                )));
            }
            return Ok(Task { spec, data: TaskData::Images(images) });
        }
        Ok(Task { spec: ModelSpec::image(cfg.model, input, memfit_data::NUM_CLASSES), data: TaskData::Images(images) })
    }

    /// Host bytes the loaded data holds (pixels and labels, or token ids and the vocabulary): memory
    /// outside the device's capacity, bounded by the data's size.
    pub fn host_bytes(&self) -> u64 {
        let bytes = match &self.data {
            TaskData::Images(d) => [&d.train, &d.val].iter().map(|s| s.images.pixels.len() + s.labels.len()).sum(),
            TaskData::Text { corpus, .. } => {
                (corpus.train.len() + corpus.val.len() + corpus.vocab.len()) * std::mem::size_of::<u32>()
            }
        };
        bytes as u64
    }

    /// Where the data came from, for people.
    pub fn source(&self) -> String {
        match &self.data {
            TaskData::Images(d) => d.source.to_string(),
            TaskData::Text { corpus, .. } => corpus.summary(),
        }
    }

    pub fn train_samples(&self) -> Box<dyn Samples + '_> {
        match &self.data {
            TaskData::Images(d) => Box::new(SplitSamples { split: &d.train }),
            TaskData::Text { corpus, context } => Box::new(TextWindows::train(&corpus.train, *context)),
        }
    }

    pub fn val_samples(&self) -> Box<dyn Samples + '_> {
        match &self.data {
            TaskData::Images(d) => Box::new(SplitSamples { split: &d.val }),
            TaskData::Text { corpus, context } => Box::new(TextWindows::eval(&corpus.val, *context)),
        }
    }

    /// The character vocabulary of a text task (saved with its checkpoints).
    pub fn vocab(&self) -> Option<&Vocab> {
        match &self.data {
            TaskData::Images(_) => None,
            TaskData::Text { corpus, .. } => Some(&corpus.vocab),
        }
    }

    /// Checkpoint metadata that rebuilds this task's model and its inputs: the model kind; for an image
    /// model the input normalization (`x = (pixel / 255 - mean) / std`, so a PyTorch user evaluates
    /// the same way); for a GPT its sizes and vocabulary.
    pub fn checkpoint_metadata(&self) -> Vec<(String, String)> {
        let mut out = vec![(memfit_nn::models::MODEL_KEY.to_string(), self.spec.kind.name().to_string())];
        if let TaskData::Images(_) = &self.data {
            let n = IMAGE_NORMALIZATION;
            out.push((NORMALIZATION_KEYS[0].to_string(), "x = (pixel / 255 - mean) / std".to_string()));
            out.push((NORMALIZATION_KEYS[1].to_string(), n.mean.to_string()));
            out.push((NORMALIZATION_KEYS[2].to_string(), n.std.to_string()));
        }
        if let Some(vocab) = self.vocab() {
            // memfit's GPT carries its sizes; an imported model's are its archive's.
            if self.spec.kind != ModelKind::Imported {
                out = self.spec.gpt.to_metadata();
            }
            out.push((memfit_nn::models::VOCAB_KEY.to_string(), vocab.as_string()));
        }
        out
    }
}

/// The text a GPT trains on: `path` (any UTF-8 file, gzip or not), or Moby Dick shipped inside memfit
/// when `path` is None or `embedded`.
pub fn load_text(path: Option<&Path>) -> Result<TextCorpus, TrainError> {
    Ok(match path {
        Some(p) if p.as_os_str() != EMBEDDED => {
            crate::output::check_input("--data", p)?;
            memfit_data::load_text(p)?
        }
        _ => memfit_data::load_embedded_text()?,
    })
}
