//! The model zoo and the [`Model`] trait the trainer drives: [`build_model`] validates a [`ModelSpec`]
//! and builds one of [`mlp::Mlp`], [`cnn::SimpleCnn`], [`cnn::DeepCnn`], [`resnet::ResNet`] and
//! [`gpt::Gpt`], with the `state_dict` names of the PyTorch reference models
//! (the PyTorch reference `torch_models.py` in `shared/pytorch-reference` beside the repository; the ResNet follows torchvision's names).

pub mod cnn;
pub mod gpt;
pub mod imported;
pub mod mlp;
pub mod resnet;

pub use cnn::{DeepCnn, SimpleCnn};
pub use gpt::Gpt;
pub use mlp::Mlp;
pub use resnet::ResNet;

use crate::checkpointing::Checkpointing;
use crate::init::Initializer;
use memfit_tensor::{Device, Error, Result, Tensor};

/// A trainable model. Parameters and buffers are listed in PyTorch `state_dict` order with PyTorch names.
pub trait Model: Send {
    fn kind(&self) -> ModelKind;
    /// Logits. `train` selects batch statistics for batch norm (updating running statistics) vs eval.
    /// Image models take f32 [N, C, H, W] and return [N, classes]; the GPT takes int64 tokens [B, T] and
    /// returns [B, T, vocab].
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor>;
    /// Trainable parameters (leaves that require grad).
    fn parameters(&self) -> Vec<(String, Tensor)>;
    /// Non-trainable state saved in checkpoints (batch-norm running statistics, masks).
    fn buffers(&self) -> Vec<(String, Tensor)>;
    /// The segments that can run with activation checkpointing, and which do (None: no segments).
    fn checkpointing(&self) -> Option<&Checkpointing> {
        None
    }
    /// The mean cross-entropy of the logits for `x` against int64 `targets` and each prediction's
    /// argmax class (int64, shaped like `targets`), when the model computes them with its output layer
    /// so that its logits never exist whole (the GPT with a large vocabulary: Note [Chunked head] in
    /// `memfit_tensor::ops::loss`); None: the caller takes them from [`Model::forward`]'s logits.
    fn fused_loss(&self, _x: &Tensor, _targets: &Tensor, _train: bool) -> Option<Result<(Tensor, Tensor)>> {
        None
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    Mlp,
    SimpleCnn,
    DeepCnn,
    ResNet,
    Gpt,
    /// A user's PyTorch model, exported by `torch.export` ([`ModelSpec::exported`]).
    Imported,
}

impl ModelKind {
    pub const ALL: [ModelKind; 5] =
        [ModelKind::Mlp, ModelKind::SimpleCnn, ModelKind::DeepCnn, ModelKind::ResNet, ModelKind::Gpt];

    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::SimpleCnn => "simplecnn",
            ModelKind::DeepCnn => "deepcnn",
            ModelKind::ResNet => "resnet",
            ModelKind::Gpt => "gpt",
            ModelKind::Imported => "imported",
        }
    }

    pub fn parse(text: &str) -> std::result::Result<ModelKind, String> {
        // Case does not matter (`GPT`, `ResNet`): a model has one name whatever its capitals.
        ModelKind::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(text.trim())).ok_or_else(|| {
            let names: Vec<&str> = ModelKind::ALL.iter().map(|k| k.name()).collect();
            format!("unknown model {text:?}: expected one of {}", names.join(", "))
        })
    }
}

/// What to build. `input` is (C, H, W) for image models; GPT fields are used by `Gpt` only.
#[derive(Clone, PartialEq)]
pub struct ModelSpec {
    pub kind: ModelKind,
    pub input: [usize; 3],
    pub num_classes: usize,
    pub gpt: GptConfig,
    /// The program of an imported model (kind [`ModelKind::Imported`]).
    pub exported: Option<Exported>,
}

/// As derived, but `exported` only when there is one: cost models are cached under this text, and
/// the zoo's keys stay what they were before imported models existed.
impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ModelSpec");
        d.field("kind", &self.kind).field("input", &self.input).field("num_classes", &self.num_classes);
        d.field("gpt", &self.gpt);
        if let Some(e) = &self.exported {
            d.field("exported", e);
        }
        d.finish()
    }
}

/// A `torch.export` archive a model is built from: its path and what was read from it once.
#[derive(Clone)]
pub struct Exported {
    pub path: std::path::PathBuf,
    pub archive: std::sync::Arc<memfit_import::Archive>,
    /// What it learns, from its signature.
    pub task: imported::Task,
    /// The fewest samples a training micro-batch can hold (`memfit_import::smallest_batch`).
    pub smallest_batch: usize,
}

/// Two specs of the same file are the same model (a spec is compared, not its weights).
impl PartialEq for Exported {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path
    }
}

/// The path and the program's size: what a cost model cached for it depends on.
impl std::fmt::Debug for Exported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let weights: usize = self.archive.weights.iter().map(|w| w.numel()).sum();
        write!(f, "Exported({}, {} nodes, {weights} weights)", self.path.display(), self.archive.nodes.len())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    pub max_t: usize,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig { vocab: 96, d_model: 256, heads: 4, layers: 4, max_t: 128 }
    }
}

/// What a model eats and predicts: the trainer's tasks and the planner's synthetic data follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelInput {
    /// f32 images [N, C, H, W] -> logits [N, classes].
    Image { shape: [usize; 3], classes: usize },
    /// int64 tokens [B, context] -> next-token logits [B, context, vocab].
    Tokens { vocab: usize, context: usize },
}

impl ModelSpec {
    /// Image model for inputs of shape (C, H, W).
    pub fn image(kind: ModelKind, input: [usize; 3], num_classes: usize) -> Self {
        ModelSpec { kind, input, num_classes, gpt: GptConfig::default(), exported: None }
    }

    /// The GPT of `config`.
    pub fn gpt(config: GptConfig) -> Self {
        ModelSpec { kind: ModelKind::Gpt, input: [0; 3], num_classes: 0, gpt: config, exported: None }
    }

    /// The model a `torch.export` archive holds, read from `path` (its ops checked), with its task
    /// from its signature ([`imported::task_of`]): image classification over K classes, or next-token
    /// prediction over a vocabulary of V in a context of T. Anything else is an error that says what
    /// memfit trains.
    pub fn exported(path: &std::path::Path) -> std::result::Result<ModelSpec, String> {
        let archive = memfit_import::Archive::open(path).map_err(|e| e.to_string())?;
        let task = imported::task_of(&archive).map_err(|e| format!("{}: {e}", path.display()))?;
        let smallest_batch = memfit_import::smallest_batch(&archive);
        let archive = std::sync::Arc::new(archive);
        let exported = Some(Exported { path: path.to_path_buf(), archive, task, smallest_batch });
        Ok(match task {
            imported::Task::Image { input, classes } => {
                ModelSpec { exported, ..ModelSpec::image(ModelKind::Imported, input, classes) }
            }
            imported::Task::Tokens { context, vocab } => ModelSpec {
                kind: ModelKind::Imported,
                input: [0; 3],
                num_classes: 0,
                gpt: GptConfig { vocab, max_t: context, ..GptConfig::default() },
                exported,
            },
        })
    }

    /// The model as people name it: the zoo's name, or an imported model's file.
    pub fn name(&self) -> String {
        match &self.exported {
            Some(e) => e.path.display().to_string(),
            None => self.kind.name().to_string(),
        }
    }

    /// The fewest samples a training micro-batch can hold: 1, or 2 for an imported model whose batch
    /// norm sees one value per channel per sample (`memfit_import::smallest_batch`).
    pub fn smallest_micro_batch(&self) -> usize {
        self.exported.as_ref().map_or(1, |e| e.smallest_batch)
    }

    pub fn input_kind(&self) -> ModelInput {
        if let Some(Exported { task: imported::Task::Tokens { context, vocab }, .. }) = &self.exported {
            return ModelInput::Tokens { vocab: *vocab, context: *context };
        }
        match self.kind {
            ModelKind::Gpt => ModelInput::Tokens { vocab: self.gpt.vocab, context: self.gpt.max_t },
            _ => ModelInput::Image { shape: self.input, classes: self.num_classes },
        }
    }
}

/// Checkpoint metadata keys of a GPT: its sizes and its vocabulary (so a saved model can be rebuilt
/// and sampled without the text it was trained on).
const GPT_KEYS: [&str; 4] = ["memfit.gpt.layers", "memfit.gpt.d_model", "memfit.gpt.heads", "memfit.gpt.context"];
/// The metadata key of the model kind.
pub const MODEL_KEY: &str = "memfit.model";
/// The metadata key of a character vocabulary (the characters in token-id order).
pub const VOCAB_KEY: &str = "memfit.vocab";
/// The metadata key of a GPT's vocabulary size (more than its text's characters with `--vocab`);
/// absent from older checkpoints, whose size is the characters' count.
pub const VOCAB_SIZE_KEY: &str = "memfit.gpt.vocab_size";

impl GptConfig {
    /// The sizes as checkpoint metadata (the vocabulary is stored by whoever knows its characters).
    pub fn to_metadata(&self) -> Vec<(String, String)> {
        let values = [self.layers, self.d_model, self.heads, self.max_t];
        let mut out: Vec<(String, String)> =
            GPT_KEYS.iter().zip(values).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        out.push((MODEL_KEY.to_string(), ModelKind::Gpt.name().to_string()));
        out.push((VOCAB_SIZE_KEY.to_string(), self.vocab.to_string()));
        out
    }

    /// Reads the sizes back from checkpoint metadata, for a text of `chars` characters (the
    /// vocabulary when the metadata gives no larger size); errors name the missing or wrong key.
    pub fn from_metadata(metadata: &std::collections::HashMap<String, String>, chars: usize) -> Result<GptConfig> {
        let vocab = match metadata.get(VOCAB_SIZE_KEY) {
            None => chars,
            Some(text) => text.parse().ok().filter(|&n: &usize| n >= chars).ok_or_else(|| {
                Error::invalid(format!(
                    "the checkpoint's {VOCAB_SIZE_KEY:?} entry {text:?} is not a vocabulary of at least its text's \
                     {chars} characters"
                ))
            })?,
        };
        let mut values = [0usize; 4];
        for (v, key) in values.iter_mut().zip(GPT_KEYS) {
            let text = metadata.get(key).ok_or_else(|| {
                Error::invalid(format!(
                    "the checkpoint has no {key:?} entry: it was not saved by `memfit train --model gpt`"
                ))
            })?;
            *v = text.parse().ok().filter(|&n: &usize| n > 0).ok_or_else(|| {
                Error::invalid(format!("the checkpoint's {key:?} entry {text:?} is not a positive number"))
            })?;
        }
        let [layers, d_model, heads, max_t] = values;
        Ok(GptConfig { vocab, d_model, heads, layers, max_t })
    }
}

/// Builds a model with PyTorch's default initialization, drawn from `seed`. Parameters are allocated
/// as `parameter`, buffers as `other`.
pub fn build_model(spec: &ModelSpec, device: &Device, seed: u64) -> Result<Box<dyn Model>> {
    let init = Initializer::new(device, seed);
    Ok(match spec.kind {
        ModelKind::Mlp => Box::new(Mlp::new(&init, spec.input, spec.num_classes)?),
        ModelKind::SimpleCnn => Box::new(SimpleCnn::new(&init, spec.input, spec.num_classes)?),
        ModelKind::DeepCnn => Box::new(DeepCnn::new(&init, spec.input, spec.num_classes)?),
        ModelKind::ResNet => Box::new(ResNet::new(&init, spec.input, spec.num_classes, resnet::DEFAULT_BLOCKS)?),
        ModelKind::Gpt => Box::new(Gpt::new(&init, spec.gpt)?),
        ModelKind::Imported => {
            let exported = spec.exported.as_ref().ok_or_else(|| {
                Error::invalid("an imported model needs its torch.export archive (ModelSpec::exported)")
            })?;
            Box::new(imported::Imported::new(exported.archive.clone(), device)?)
        }
    })
}

/// The units of a model's layer sequence a pipeline can cut (the GPT: embeddings, each block, head);
/// None for a model that has no pipeline stages.
pub fn stage_units(spec: &ModelSpec) -> Option<usize> {
    (spec.kind == ModelKind::Gpt).then(|| Gpt::units(&spec.gpt))
}

/// The pipeline stage of `spec` holding `units` of its layer sequence ([`stage_units`]), initialized
/// as the whole model would be (each parameter from its own name's stream).
pub fn build_stage(
    spec: &ModelSpec,
    device: &Device,
    seed: u64,
    units: std::ops::Range<usize>,
) -> Result<Box<dyn Model>> {
    let init = Initializer::new(device, seed);
    match spec.kind {
        ModelKind::Gpt => Ok(Box::new(Gpt::stage(&init, spec.gpt, units)?)),
        other => Err(Error::invalid(format!(
            "{}: pipeline stages are defined for the gpt only (its layer sequence: embeddings, blocks, head)",
            other.name()
        ))),
    }
}

/// Errors unless an image model's input (C, H, W) and class count are all positive.
fn check_image_spec(kind: ModelKind, input: [usize; 3], num_classes: usize) -> Result<()> {
    if input.contains(&0) {
        return Err(Error::invalid(format!(
            "{}: input (C, H, W) = {input:?} must have every dimension positive",
            kind.name()
        )));
    }
    if num_classes == 0 {
        return Err(Error::invalid(format!("{}: num_classes must be positive", kind.name())));
    }
    Ok(())
}

/// Errors unless `x` is [N, C, H, W] with the (C, H, W) the model was built for.
fn check_image_input(kind: ModelKind, input: [usize; 3], x: &Tensor) -> Result<()> {
    if x.rank() != 4 || x.shape()[1..] != input {
        return Err(Error::shape(format!(
            "{} was built for inputs [N, {}, {}, {}], got {:?}",
            kind.name(),
            input[0],
            input[1],
            input[2],
            x.shape()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPT's sizes come back from its checkpoint metadata, its vocabulary size too (the text's
    /// characters when an older checkpoint has none); a size under the characters' is refused.
    #[test]
    fn gpt_sizes_round_trip_through_checkpoint_metadata() {
        let config = GptConfig { vocab: 50_304, d_model: 48, heads: 3, layers: 2, max_t: 64 };
        let mut metadata: std::collections::HashMap<String, String> = config.to_metadata().into_iter().collect();
        assert_eq!(GptConfig::from_metadata(&metadata, 83).unwrap(), config);
        metadata.remove(VOCAB_SIZE_KEY);
        assert_eq!(GptConfig::from_metadata(&metadata, 83).unwrap(), GptConfig { vocab: 83, ..config });
        metadata.insert(VOCAB_SIZE_KEY.into(), "82".into());
        let err = GptConfig::from_metadata(&metadata, 83).unwrap_err().to_string();
        assert!(err.contains("\"82\"") && err.contains("83 characters"), "{err}");
        metadata.insert(VOCAB_SIZE_KEY.into(), "83".into());
        assert_eq!(GptConfig::from_metadata(&metadata, 83).unwrap().vocab, 83);
    }
}
