//! The reference GPT (`torch_models.py`): `tok = Embedding(vocab, d)`, `pos = Embedding(max_t, d)`,
//! pre-norm blocks `blocks.{i}` = {`ln1`, `attn` (MultiheadAttention, batch_first), `ln2`, `mlp.0`
//! (Linear d -> 4d), GELU (erf), `mlp.2` (Linear 4d -> d)}, final `ln`, `head = Linear(d, vocab)`, and the
//! bool buffer `mask = triu(ones(max_t, max_t), 1)` (True = not allowed), used as `mask[:T, :T]`.
//! int64 tokens [B, T] -> logits [B, T, vocab]. No dropout.
//!
//! A pipeline stage ([`Gpt::stage`]) is a contiguous range of the layer sequence: unit 0 the embeddings,
//! units 1..=layers the blocks, unit layers + 1 the final norm and head. It holds only its units'
//! parameters (with the full model's names and values: each is drawn from its own name's stream), takes
//! tokens when it starts with unit 0 and the residual stream [B, T, d] otherwise, and returns logits
//! when it ends with the head and the residual stream otherwise.

use super::{GptConfig, Model, ModelKind};
use crate::checkpointing::Checkpointing;
use crate::init::Initializer;
use crate::layers::{Embedding, LayerNorm, Linear, Module, MultiheadAttention};
use memfit_tensor::autograd::Pass;
use memfit_tensor::{ops, Category, DType, Error, Result, Tensor};
use std::sync::Arc;

/// One pre-norm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
pub struct Block {
    ln1: LayerNorm,
    attn: MultiheadAttention,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    pub fn new(init: &Initializer, prefix: &str, d: usize, heads: usize) -> Result<Self> {
        let p = |s: &str| format!("{prefix}.{s}");
        Ok(Block {
            ln1: LayerNorm::new(init, &p("ln1"), d)?,
            attn: MultiheadAttention::new(init, &p("attn"), d, heads)?,
            ln2: LayerNorm::new(init, &p("ln2"), d)?,
            fc1: Linear::new(init, &p("mlp.0"), d, 4 * d, true)?,
            fc2: Linear::new(init, &p("mlp.2"), 4 * d, d, true)?,
        })
    }

    /// `mask`: bool [T, T], True where attention is not allowed.
    ///
    /// Each layer norm is fused into the projection after it, and GELU into `mlp.2`, so that backward
    /// keeps per block only the residual stream before each norm, the packed q/k/v projection, the
    /// attention output and `mlp.0`'s output (plus per-row statistics); the numerics are those of the
    /// unfused modules.
    pub fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        self.run(x, mask, Pass::Forward)
    }

    /// [`Block::forward`] as a checkpointed segment's `pass`. On the re-run in backward the block's
    /// output is never read, only its graph, and `mlp.2`'s backward needs its input and weight, not
    /// its output: its product (a third of the block's arithmetic) is skipped.
    fn run(&self, x: &Tensor, mask: &Tensor, pass: Pass) -> Result<Tensor> {
        let x = x.add(&self.attn.forward_self_after_layer_norm(x, &self.ln1, Some(mask), false)?)?;
        let h = self.fc1.forward_after_layer_norm(&x, &self.ln2)?;
        let m = match pass {
            Pass::Forward => self.fc2.forward_after_gelu(&h)?,
            Pass::Rerun => self.fc2.graph_after_gelu(&h)?,
        };
        x.add(&m)
    }

    fn modules(&self) -> [&dyn Module; 5] {
        [&self.ln1, &self.attn, &self.ln2, &self.fc1, &self.fc2]
    }

    fn parameter_tensors(&self) -> Vec<Tensor> {
        self.modules().into_iter().flat_map(|m| m.parameters()).map(|(_, t)| t).collect()
    }
}

pub struct Gpt {
    config: GptConfig,
    /// The units of the layer sequence this model holds (all of them unless it is a pipeline stage).
    units: std::ops::Range<usize>,
    tok: Option<Embedding>,
    pos: Option<Embedding>,
    blocks: Vec<Arc<Block>>,
    ln: Option<LayerNorm>,
    head: Option<Linear>,
    mask: Tensor,
    /// Segments: the blocks.
    checkpointing: Checkpointing,
}

impl Gpt {
    pub fn new(init: &Initializer, config: GptConfig) -> Result<Self> {
        Gpt::stage(init, config, 0..config.layers + 2)
    }

    /// Units in the layer sequence: the embeddings, each block, the head.
    pub fn units(config: &GptConfig) -> usize {
        config.layers + 2
    }

    /// The pipeline stage holding `units` of the layer sequence (see the module documentation).
    pub fn stage(init: &Initializer, config: GptConfig, units: std::ops::Range<usize>) -> Result<Self> {
        let GptConfig { vocab, d_model, heads, layers, max_t } = config;
        if units.is_empty() || units.end > layers + 2 {
            return Err(Error::invalid(format!(
                "gpt: a stage needs a non-empty range of the {} units (embeddings, {layers} blocks, head), got {units:?}",
                layers + 2
            )));
        }
        for (name, v) in [("vocab", vocab), ("d_model", d_model), ("heads", heads), ("max_t", max_t)] {
            if v == 0 {
                return Err(Error::invalid(format!("gpt: {name} must be positive")));
            }
        }
        if d_model % heads != 0 {
            return Err(Error::invalid(format!("gpt: d_model {d_model} must be divisible by heads {heads}")));
        }
        let has = |unit: usize| units.contains(&unit);
        let blocks: Vec<usize> = (0..layers).filter(|&i| has(i + 1)).collect();
        Ok(Gpt {
            config,
            tok: has(0).then(|| Embedding::new(init, "tok", vocab, d_model)).transpose()?,
            pos: has(0).then(|| Embedding::new(init, "pos", max_t, d_model)).transpose()?,
            blocks: blocks
                .iter()
                .map(|i| Block::new(init, &format!("blocks.{i}"), d_model, heads).map(Arc::new))
                .collect::<Result<_>>()?,
            ln: has(layers + 1).then(|| LayerNorm::new(init, "ln", d_model)).transpose()?,
            head: has(layers + 1).then(|| Linear::new(init, "head", d_model, vocab, true)).transpose()?,
            mask: init.causal_mask(max_t)?,
            checkpointing: Checkpointing::new(blocks.iter().map(|i| format!("blocks.{i}")).collect()),
            units,
        })
    }

    pub fn config(&self) -> GptConfig {
        self.config
    }

    /// Errors unless a sequence of `t` positions fits the model.
    fn check_length(&self, t: usize) -> Result<()> {
        if t == 0 || t > self.config.max_t {
            return Err(Error::shape(format!(
                "gpt: sequence length {t} must be between 1 and the model's max_t {}",
                self.config.max_t
            )));
        }
        Ok(())
    }

    /// The embeddings (on the first stage) and the blocks: the residual stream [B, T, d] before the
    /// final norm.
    fn body(&self, input: &Tensor) -> Result<Tensor> {
        let mut x = match (&self.tok, &self.pos) {
            (Some(tok), Some(pos)) => {
                let idx = input;
                if idx.dtype() != DType::I64 || idx.rank() != 2 {
                    return Err(Error::shape(format!(
                        "gpt: expected int64 token ids [B, T], got {:?} {}",
                        idx.shape(),
                        idx.dtype()
                    )));
                }
                self.check_length(idx.shape()[1])?;
                let t = idx.shape()[1];
                let device = idx.device();
                let positions = Tensor::empty(device, &[t], DType::I64, Category::Temporary, "arange")?;
                positions.overwrite_async_with::<i64>(|p| p.iter_mut().zip(0..).for_each(|(p, i)| *p = i))?;
                tok.forward(idx)?.add(&pos.forward(&positions)?)?
            }
            _ => {
                if input.dtype() != DType::F32 || input.rank() != 3 || input.shape()[2] != self.config.d_model {
                    return Err(Error::shape(format!(
                        "gpt stage {:?}: expected the residual stream f32 [B, T, {}], got {:?} {}",
                        self.units,
                        self.config.d_model,
                        input.shape(),
                        input.dtype()
                    )));
                }
                self.check_length(input.shape()[1])?;
                input.clone()
            }
        };
        let mask = self.mask_for(x.shape()[1])?;
        for (i, block) in self.blocks.iter().enumerate() {
            let (b, m) = (block.clone(), mask.clone());
            x = self.checkpointing.run(i, &x, || block.parameter_tensors(), move |x, pass| b.run(x, &m, pass))?;
        }
        Ok(x)
    }

    /// `mask[:t, :t]`, contiguous.
    fn mask_for(&self, t: usize) -> Result<Tensor> {
        if t == self.config.max_t {
            return Ok(self.mask.clone());
        }
        self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?.contiguous()
    }
}

impl Model for Gpt {
    fn kind(&self) -> ModelKind {
        ModelKind::Gpt
    }

    fn forward(&self, input: &Tensor, _train: bool) -> Result<Tensor> {
        let x = self.body(input)?;
        match (&self.head, &self.ln) {
            (Some(head), Some(ln)) => head.forward_after_layer_norm(&x, ln),
            _ => Ok(x),
        }
    }

    /// With a vocabulary whose logits for this batch are more than one chunk: the final norm, then
    /// the head and the loss chunk by chunk (`ops::linear_cross_entropy`).
    fn fused_loss(&self, input: &Tensor, targets: &Tensor, _train: bool) -> Option<Result<(Tensor, Tensor)>> {
        let (Some(head), Some(ln)) = (&self.head, &self.ln) else { return None };
        let rows = targets.numel();
        let chunk = ops::head_chunk_rows(input.device(), self.config.vocab, DType::F32);
        if rows <= chunk {
            return None;
        }
        Some((|| {
            let x = ln.forward(&self.body(input)?)?;
            let d = self.config.d_model as isize;
            let _module = x.device().enter_module("head");
            let (loss, predicted) = ops::linear_cross_entropy(
                &x.reshape(&[-1, d])?,
                head.weight(),
                head.bias(),
                &targets.reshape(&[-1])?,
                0.0,
                chunk,
            )?;
            let shape: Vec<isize> = targets.shape().iter().map(|&s| s as isize).collect();
            Ok((loss, predicted.reshape(&shape)?))
        })())
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for m in [&self.tok, &self.pos].into_iter().flatten() {
            out.extend(m.parameters());
        }
        for block in &self.blocks {
            out.extend(block.modules().into_iter().flat_map(|m| m.parameters()));
        }
        if let (Some(ln), Some(head)) = (&self.ln, &self.head) {
            out.extend(ln.parameters());
            out.extend(head.parameters());
        }
        out
    }

    fn checkpointing(&self) -> Option<&Checkpointing> {
        Some(&self.checkpointing)
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        vec![("mask".to_string(), self.mask.clone())]
    }
}
