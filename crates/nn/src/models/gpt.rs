//! The reference GPT (`torch_models.py`): `tok = Embedding(vocab, d)`, `pos = Embedding(max_t, d)`,
//! pre-norm blocks `blocks.{i}` = {`ln1`, `attn` (MultiheadAttention, batch_first), `ln2`, `mlp.0`
//! (Linear d -> 4d), GELU (erf), `mlp.2` (Linear 4d -> d)}, final `ln`, `head = Linear(d, vocab)`, and the
//! bool buffer `mask = triu(ones(max_t, max_t), 1)` (True = not allowed), used as `mask[:T, :T]`.
//! int64 tokens [B, T] -> logits [B, T, vocab]. No dropout.

use super::{GptConfig, Model, ModelKind};
use crate::checkpointing::Checkpointing;
use crate::init::Initializer;
use crate::layers::{Embedding, LayerNorm, Linear, Module, MultiheadAttention};
use memfit_tensor::{Category, DType, Error, Result, Tensor};
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
        let x = x.add(&self.attn.forward_self_after_layer_norm(x, &self.ln1, Some(mask), false)?)?;
        let m = self.fc2.forward_after_gelu(&self.fc1.forward_after_layer_norm(&x, &self.ln2)?)?;
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
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Arc<Block>>,
    ln: LayerNorm,
    head: Linear,
    mask: Tensor,
    /// Segments: the blocks.
    checkpointing: Checkpointing,
}

impl Gpt {
    pub fn new(init: &Initializer, config: GptConfig) -> Result<Self> {
        let GptConfig { vocab, d_model, heads, layers, max_t } = config;
        for (name, v) in [("vocab", vocab), ("d_model", d_model), ("heads", heads), ("max_t", max_t)] {
            if v == 0 {
                return Err(Error::invalid(format!("gpt: {name} must be positive")));
            }
        }
        if d_model % heads != 0 {
            return Err(Error::invalid(format!("gpt: d_model {d_model} must be divisible by heads {heads}")));
        }
        Ok(Gpt {
            config,
            tok: Embedding::new(init, "tok", vocab, d_model)?,
            pos: Embedding::new(init, "pos", max_t, d_model)?,
            blocks: (0..layers)
                .map(|i| Block::new(init, &format!("blocks.{i}"), d_model, heads).map(Arc::new))
                .collect::<Result<_>>()?,
            ln: LayerNorm::new(init, "ln", d_model)?,
            head: Linear::new(init, "head", d_model, vocab, true)?,
            mask: init.causal_mask(max_t)?,
            checkpointing: Checkpointing::new((0..layers).map(|i| format!("blocks.{i}")).collect()),
        })
    }

    pub fn config(&self) -> GptConfig {
        self.config
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

    fn forward(&self, idx: &Tensor, _train: bool) -> Result<Tensor> {
        if idx.dtype() != DType::I64 || idx.rank() != 2 {
            return Err(Error::shape(format!(
                "gpt: expected int64 token ids [B, T], got {:?} {}",
                idx.shape(),
                idx.dtype()
            )));
        }
        let t = idx.shape()[1];
        if t == 0 || t > self.config.max_t {
            return Err(Error::shape(format!(
                "gpt: sequence length {t} must be between 1 and the model's max_t {}",
                self.config.max_t
            )));
        }
        let device = idx.device();
        let positions = Tensor::empty(device, &[t], DType::I64, Category::Temporary, "arange")?;
        positions.write_with::<i64>(|p| p.iter_mut().zip(0..).for_each(|(p, i)| *p = i))?;
        let mut x = self.tok.forward(idx)?.add(&self.pos.forward(&positions)?)?;
        let mask = self.mask_for(t)?;
        for (i, block) in self.blocks.iter().enumerate() {
            let (b, m) = (block.clone(), mask.clone());
            x = self.checkpointing.run(i, &x, || block.parameter_tensors(), move |x| b.forward(x, &m))?;
        }
        self.head.forward_after_layer_norm(&x, &self.ln)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = self.tok.parameters();
        out.extend(self.pos.parameters());
        for block in &self.blocks {
            out.extend(block.modules().into_iter().flat_map(|m| m.parameters()));
        }
        out.extend(self.ln.parameters());
        out.extend(self.head.parameters());
        out
    }

    fn checkpointing(&self) -> Option<&Checkpointing> {
        Some(&self.checkpointing)
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        vec![("mask".to_string(), self.mask.clone())]
    }
}
