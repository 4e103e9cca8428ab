//! Layers with PyTorch's parameter layouts, names and default initialization: [`Linear`], [`Conv2d`],
//! [`BatchNorm2d`], [`LayerNorm`], [`Embedding`] and [`MultiheadAttention`] (`batch_first`).
//!
//! A layer is built with its `state_dict` prefix (e.g. `"blocks.0.attn"`): the prefix names its
//! tensors ([`Module::parameters`], [`Module::buffers`] return full PyTorch keys such as
//! `"blocks.0.attn.in_proj_weight"`) and selects their random streams (see [`crate::init`]). Layers are
//! cheap handles: forward takes `&self`; the only state a forward changes is batch norm's running
//! statistics, in place. Each forward runs under its module scope ([`memfit_tensor::Device::enter_module`] with the
//! layer's prefix), so every allocation it makes, and its backward's, names the layer.

use crate::init::{join, Initializer};
use memfit_tensor::ops::{self, Conv2dParams};
use memfit_tensor::{DType, Error, Result, Tensor};

/// Something that owns named tensors, listed in PyTorch `state_dict` order with full names.
pub trait Module {
    /// Trainable parameters.
    fn parameters(&self) -> Vec<(String, Tensor)>;
    /// Non-trainable state (running statistics, masks, counters).
    fn buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}

fn named(prefix: &str, name: &str, t: &Tensor) -> (String, Tensor) {
    (join(prefix, name), t.clone())
}

fn check_positive(layer: &str, prefix: &str, what: &[(&str, usize)]) -> Result<()> {
    for (name, v) in what {
        if *v == 0 {
            return Err(Error::invalid(format!("{layer} {prefix:?}: {name} must be positive")));
        }
    }
    Ok(())
}

/// `nn.Linear(in, out, bias)`: weight [out, in], bias [out]; `y = x W^T + b` over the last dim.
#[derive(Clone, Debug)]
pub struct Linear {
    prefix: String,
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(init: &Initializer, prefix: &str, in_features: usize, out_features: usize, bias: bool) -> Result<Self> {
        check_positive("Linear", prefix, &[("in_features", in_features), ("out_features", out_features)])?;
        let weight = init.kaiming_uniform(&join(prefix, "weight"), &[out_features, in_features])?;
        let bias =
            if bias { Some(init.fan_in_bias(&join(prefix, "bias"), &[out_features], in_features)?) } else { None };
        Ok(Linear { prefix: prefix.to_string(), weight, bias })
    }

    /// A linear layer over given tensors (weight [out, in], bias [out]).
    pub fn from_parts(prefix: &str, weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        if weight.rank() != 2 || bias.as_ref().is_some_and(|b| b.shape() != [weight.shape()[0]]) {
            return Err(Error::shape(format!(
                "Linear {prefix:?}: weight {:?} and bias {:?} do not form a linear layer",
                weight.shape(),
                bias.as_ref().map(|b| b.shape().to_vec())
            )));
        }
        Ok(Linear { prefix: prefix.to_string(), weight, bias })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        ops::linear(x, &self.weight, self.bias.as_ref())
    }

    /// `self.forward(&x.gelu()?)` (exact GELU) as one fused op ([`ops::gelu_linear`]): backward keeps
    /// only `x`, not GELU's output as well.
    pub fn forward_after_gelu(&self, x: &Tensor) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        ops::gelu_linear(x, &self.weight, self.bias.as_ref())
    }

    /// [`Linear::forward_after_gelu`]'s graph and output bytes without the product
    /// ([`ops::gelu_linear_graph`]): for a checkpointed segment's re-run that ends here.
    pub fn graph_after_gelu(&self, x: &Tensor) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        ops::gelu_linear_graph(x, &self.weight, self.bias.as_ref())
    }

    /// `self.forward(&norm.forward(x)?)` as one fused op ([`ops::layer_norm_linear`]): backward keeps
    /// `x` (and per-row statistics), not the normalized tensor as well.
    pub fn forward_after_layer_norm(&self, x: &Tensor, norm: &LayerNorm) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        ops::layer_norm_linear(x, &norm.weight, &norm.bias, norm.eps, &self.weight, self.bias.as_ref())
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Module for Linear {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![named(&self.prefix, "weight", &self.weight)];
        out.extend(self.bias.iter().map(|b| named(&self.prefix, "bias", b)));
        out
    }
}

/// The output size of a convolution or pooling window along one dim (PyTorch's formula, floor mode):
/// `floor((size + 2 padding - dilation (kernel - 1) - 1) / stride) + 1`; None when the window does not fit.
pub fn window_output_size(size: usize, kernel: usize, stride: usize, padding: usize, dilation: usize) -> Option<usize> {
    let span = dilation.checked_mul(kernel.checked_sub(1)?)?.checked_add(1)?;
    let padded = size.checked_add(padding.checked_mul(2)?)?;
    if stride == 0 || padded < span {
        return None;
    }
    Some((padded - span) / stride + 1)
}

/// `nn.Conv2d(in, out, kernel, stride, padding, dilation, groups, bias)`: weight
/// [out, in/groups, kh, kw], bias [out], over NCHW inputs.
#[derive(Clone, Debug)]
pub struct Conv2d {
    prefix: String,
    weight: Tensor,
    bias: Option<Tensor>,
    params: Conv2dParams,
}

impl Conv2d {
    pub fn new(
        init: &Initializer,
        prefix: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        params: Conv2dParams,
        bias: bool,
    ) -> Result<Self> {
        check_positive(
            "Conv2d",
            prefix,
            &[
                ("in_channels", in_channels),
                ("out_channels", out_channels),
                ("kernel height", kernel[0]),
                ("kernel width", kernel[1]),
                ("groups", params.groups),
                ("stride", params.stride[0].min(params.stride[1])),
                ("dilation", params.dilation[0].min(params.dilation[1])),
            ],
        )?;
        if in_channels % params.groups != 0 || out_channels % params.groups != 0 {
            return Err(Error::invalid(format!(
                "Conv2d {prefix:?}: in_channels {in_channels} and out_channels {out_channels} must be divisible by groups {}",
                params.groups
            )));
        }
        let shape = [out_channels, in_channels / params.groups, kernel[0], kernel[1]];
        let weight = init.kaiming_uniform(&join(prefix, "weight"), &shape)?;
        let fan_in = shape[1] * shape[2] * shape[3];
        let bias = if bias { Some(init.fan_in_bias(&join(prefix, "bias"), &[out_channels], fan_in)?) } else { None };
        Ok(Conv2d { prefix: prefix.to_string(), weight, bias, params })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        ops::conv2d(x, &self.weight, self.bias.as_ref(), self.params)
    }

    /// Output [height, width] for an input of [height, width]; an error naming the layer when the
    /// (padded) input is smaller than the kernel.
    pub fn output_size(&self, input: [usize; 2]) -> Result<[usize; 2]> {
        let k = [self.weight.shape()[2], self.weight.shape()[3]];
        let p = self.params;
        let mut out = [0; 2];
        for d in 0..2 {
            out[d] = window_output_size(input[d], k[d], p.stride[d], p.padding[d], p.dilation[d]).ok_or_else(|| {
                Error::shape(format!(
                    "Conv2d {:?}: input {}x{} is smaller than its {}x{} kernel (padding {:?}, dilation {:?})",
                    self.prefix, input[0], input[1], k[0], k[1], p.padding, p.dilation
                ))
            })?;
        }
        Ok(out)
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    pub fn params(&self) -> Conv2dParams {
        self.params
    }
    pub fn out_channels(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Module for Conv2d {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![named(&self.prefix, "weight", &self.weight)];
        out.extend(self.bias.iter().map(|b| named(&self.prefix, "bias", b)));
        out
    }
}

/// `nn.BatchNorm2d(C)` (affine, tracking running stats): weight 1, bias 0, running_mean 0,
/// running_var 1 and an int64 `num_batches_tracked`, momentum 0.1, eps 1e-5.
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    prefix: String,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
    pub momentum: f64,
    pub eps: f64,
}

impl BatchNorm2d {
    pub fn new(init: &Initializer, prefix: &str, num_features: usize) -> Result<Self> {
        check_positive("BatchNorm2d", prefix, &[("num_features", num_features)])?;
        Ok(BatchNorm2d {
            prefix: prefix.to_string(),
            weight: init.constant(&[num_features], 1.0)?,
            bias: init.constant(&[num_features], 0.0)?,
            running_mean: init.buffer_full(&[num_features], 0.0)?,
            running_var: init.buffer_full(&[num_features], 1.0)?,
            num_batches_tracked: init.buffer_zeros(&[], DType::I64)?,
            momentum: 0.1,
            eps: 1e-5,
        })
    }

    /// Training: normalizes with the batch statistics, updates the running statistics in place and
    /// counts the batch in `num_batches_tracked` (not while a checkpointed segment is re-run). Eval:
    /// normalizes with the running statistics.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        if x.rank() != 4 {
            return Err(Error::shape(format!(
                "BatchNorm2d {:?}: expected a 4-d [N, C, H, W] input, got {:?}",
                self.prefix,
                x.shape()
            )));
        }
        // Re-running a checkpointed segment in backward, or replaying a micro-batch, normalizes with
        // the same batch statistics but must not move the running statistics a second time.
        let update = train && !x.device().buffers_frozen();
        let (mean, var) =
            if update || !train { (Some(&self.running_mean), Some(&self.running_var)) } else { (None, None) };
        let y = ops::batch_norm(x, mean, var, Some(&self.weight), Some(&self.bias), train, self.momentum, self.eps)?;
        if update {
            self.count_batch()?;
        }
        Ok(y)
    }

    /// `num_batches_tracked += 1`, in place on the device (nothing to do on meta).
    fn count_batch(&self) -> Result<()> {
        self.num_batches_tracked.count_up()
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
    pub fn running_mean(&self) -> &Tensor {
        &self.running_mean
    }
    pub fn running_var(&self) -> &Tensor {
        &self.running_var
    }
    pub fn num_batches_tracked(&self) -> &Tensor {
        &self.num_batches_tracked
    }
}

impl Module for BatchNorm2d {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        vec![named(&self.prefix, "weight", &self.weight), named(&self.prefix, "bias", &self.bias)]
    }
    fn buffers(&self) -> Vec<(String, Tensor)> {
        vec![
            named(&self.prefix, "running_mean", &self.running_mean),
            named(&self.prefix, "running_var", &self.running_var),
            named(&self.prefix, "num_batches_tracked", &self.num_batches_tracked),
        ]
    }
}

/// `nn.LayerNorm(d)` over the last dim: weight 1, bias 0, eps 1e-5.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    prefix: String,
    weight: Tensor,
    bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(init: &Initializer, prefix: &str, dim: usize) -> Result<Self> {
        check_positive("LayerNorm", prefix, &[("normalized_shape", dim)])?;
        Ok(LayerNorm {
            prefix: prefix.to_string(),
            weight: init.constant(&[dim], 1.0)?,
            bias: init.constant(&[dim], 0.0)?,
            eps: 1e-5,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        ops::layer_norm(x, self.weight.shape(), Some(&self.weight), Some(&self.bias), self.eps)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
}

impl Module for LayerNorm {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        vec![named(&self.prefix, "weight", &self.weight), named(&self.prefix, "bias", &self.bias)]
    }
}

/// `nn.Embedding(num, dim)`: weight [num, dim] ~ N(0, 1); int64 indices [...] -> [..., dim].
#[derive(Clone, Debug)]
pub struct Embedding {
    prefix: String,
    weight: Tensor,
}

impl Embedding {
    pub fn new(init: &Initializer, prefix: &str, num_embeddings: usize, dim: usize) -> Result<Self> {
        check_positive("Embedding", prefix, &[("num_embeddings", num_embeddings), ("embedding_dim", dim)])?;
        let weight = init.normal(&join(prefix, "weight"), &[num_embeddings, dim], 0.0, 1.0)?;
        Ok(Embedding { prefix: prefix.to_string(), weight })
    }

    pub fn forward(&self, indices: &Tensor) -> Result<Tensor> {
        let _module = indices.device().enter_module(&self.prefix);
        ops::embedding(indices, &self.weight)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn num_embeddings(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Module for Embedding {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        vec![named(&self.prefix, "weight", &self.weight)]
    }
}

/// `nn.MultiheadAttention(d, heads, batch_first=True)` without dropout: `in_proj_weight` [3d, d]
/// stacks Wq, Wk, Wv (xavier_uniform), `in_proj_bias` [3d] (zeros), `out_proj` Linear(d, d) (default
/// weight, zero bias). Head i uses features `i*d/heads .. (i+1)*d/heads`.
#[derive(Clone, Debug)]
pub struct MultiheadAttention {
    prefix: String,
    heads: usize,
    in_proj_weight: Tensor,
    in_proj_bias: Tensor,
    out_proj: Linear,
}

impl MultiheadAttention {
    pub fn new(init: &Initializer, prefix: &str, embed_dim: usize, heads: usize) -> Result<Self> {
        check_positive("MultiheadAttention", prefix, &[("embed_dim", embed_dim), ("num_heads", heads)])?;
        if embed_dim % heads != 0 {
            return Err(Error::invalid(format!(
                "MultiheadAttention {prefix:?}: embed_dim {embed_dim} must be divisible by num_heads {heads}"
            )));
        }
        let d = embed_dim;
        let in_proj_weight = init.xavier_uniform(&join(prefix, "in_proj_weight"), &[3 * d, d])?;
        let in_proj_bias = init.constant(&[3 * d], 0.0)?;
        let out_prefix = join(prefix, "out_proj");
        let out_weight = init.kaiming_uniform(&join(&out_prefix, "weight"), &[d, d])?;
        let out_proj = Linear::from_parts(&out_prefix, out_weight, Some(init.constant(&[d], 0.0)?))?;
        Ok(MultiheadAttention { prefix: prefix.to_string(), heads, in_proj_weight, in_proj_bias, out_proj })
    }

    pub fn embed_dim(&self) -> usize {
        self.in_proj_weight.shape()[1]
    }
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// `attn(query, key, value, attn_mask=mask, need_weights=False)[0]` for `[B, T, d]` inputs.
    /// `mask` is bool, True where attention is NOT allowed: [Tq, Tk] (shared by all batches and heads)
    /// or [B*heads, Tq, Tk]. `causal` adds the causal mask (query i sees keys j <= i).
    pub fn forward(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
    ) -> Result<Tensor> {
        let _module = query.device().enter_module(&self.prefix);
        let d = self.embed_dim();
        let (h, dh) = (self.heads, d / self.heads);
        for (what, t) in [("query", query), ("key", key), ("value", value)] {
            if t.rank() != 3 || t.shape()[2] != d {
                return Err(Error::shape(format!(
                    "MultiheadAttention {:?}: {what} should be [B, T, {d}] (batch_first), got {:?}",
                    self.prefix,
                    t.shape()
                )));
            }
        }
        let (b, tq, tk) = (query.shape()[0], query.shape()[1], key.shape()[1]);
        if key.shape()[0] != b || value.shape()[0] != b || value.shape()[1] != tk {
            return Err(Error::shape(format!(
                "MultiheadAttention {:?}: query {:?}, key {:?} and value {:?} do not match",
                self.prefix,
                query.shape(),
                key.shape(),
                value.shape()
            )));
        }
        let mask = match mask {
            None => None,
            Some(m) => Some(self.attention_mask(m, b, tq, tk)?),
        };
        if query.same(key) && key.same(value) {
            // Self-attention: one packed projection [B, T, 3d].
            let qkv = ops::linear(query, &self.in_proj_weight, Some(&self.in_proj_bias))?;
            return self.attend_packed(qkv, mask.as_ref(), causal);
        }
        let split = |t: &Tensor, len: usize| -> Result<Tensor> {
            // [B, T, d] -> [B, heads, T, d/heads]
            t.reshape(&[b as isize, len as isize, h as isize, dh as isize])?.permute(&[0, 2, 1, 3])
        };
        let project = |x: &Tensor, i: usize, len: usize| -> Result<Tensor> {
            let w = self.in_proj_weight.narrow(0, i * d, d)?;
            let bias = self.in_proj_bias.narrow(0, i * d, d)?;
            split(&ops::linear(x, &w, Some(&bias))?, len)
        };
        let (q, k, v) = (project(query, 0, tq)?, project(key, 1, tk)?, project(value, 2, tk)?);
        let attn = ops::scaled_dot_product_attention(&q, &k, &v, causal, mask.as_ref())?;
        let merged = attn.permute(&[0, 2, 1, 3])?.reshape(&[b as isize, tq as isize, d as isize])?;
        self.out_proj.forward(&merged)
    }

    /// Self-attention of `norm(x)` for a `[B, T, d]` input: `self.forward(&h, &h, &h, mask, causal)`
    /// with `h = norm.forward(x)`, the normalization fused into the in-projection
    /// ([`ops::layer_norm_linear`]) so that backward keeps `x`, not `h` as well (a pre-norm block).
    pub fn forward_self_after_layer_norm(
        &self,
        x: &Tensor,
        norm: &LayerNorm,
        mask: Option<&Tensor>,
        causal: bool,
    ) -> Result<Tensor> {
        let _module = x.device().enter_module(&self.prefix);
        let d = self.embed_dim();
        if x.rank() != 3 || x.shape()[2] != d {
            return Err(Error::shape(format!(
                "MultiheadAttention {:?}: input should be [B, T, {d}] (batch_first), got {:?}",
                self.prefix,
                x.shape()
            )));
        }
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let mask = match mask {
            None => None,
            Some(m) => Some(self.attention_mask(m, b, t, t)?),
        };
        let qkv = ops::layer_norm_linear(
            x,
            &norm.weight,
            &norm.bias,
            norm.eps,
            &self.in_proj_weight,
            Some(&self.in_proj_bias),
        )?;
        self.attend_packed(qkv, mask.as_ref(), causal)
    }

    /// Attention over the packed projection `qkv` [B, T, 3d], then `out_proj`: attended in place (no
    /// split or merge copies, see [`ops::packed_self_attention`]); backward keeps `qkv` and a
    /// log-sum-exp per row.
    fn attend_packed(&self, qkv: Tensor, mask: Option<&Tensor>, causal: bool) -> Result<Tensor> {
        let attn = ops::packed_self_attention(&qkv, self.heads, causal, mask)?;
        drop(qkv);
        self.out_proj.forward(&attn)
    }

    /// The bool mask as a tensor broadcastable to [B, heads, Tq, Tk].
    fn attention_mask(&self, m: &Tensor, b: usize, tq: usize, tk: usize) -> Result<Tensor> {
        if m.dtype() != DType::Bool {
            return Err(Error::dtype(format!(
                "MultiheadAttention {:?}: attn_mask must be bool (True = not allowed), got {}",
                self.prefix,
                m.dtype()
            )));
        }
        match m.shape() {
            [q, k] if *q == tq && *k == tk => Ok(m.clone()),
            [n, q, k] if *n == b * self.heads && *q == tq && *k == tk => {
                m.reshape(&[b as isize, self.heads as isize, tq as isize, tk as isize])
            }
            other => Err(Error::shape(format!(
                "MultiheadAttention {:?}: attn_mask {other:?} should be [{tq}, {tk}] or [{}, {tq}, {tk}]",
                self.prefix,
                b * self.heads
            ))),
        }
    }
}

impl Module for MultiheadAttention {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            named(&self.prefix, "in_proj_weight", &self.in_proj_weight),
            named(&self.prefix, "in_proj_bias", &self.in_proj_bias),
        ];
        out.extend(self.out_proj.parameters());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfit_tensor::{Category, Device};

    fn names(m: &dyn Module) -> Vec<String> {
        m.parameters().into_iter().chain(m.buffers()).map(|(n, _)| n).collect()
    }

    #[test]
    fn linear_names_shapes_and_forward() {
        let dev = Device::cpu();
        let init = Initializer::new(&dev, 0);
        let l = Linear::new(&init, "fc", 3, 2, true).unwrap();
        assert_eq!(names(&l), ["fc.weight", "fc.bias"]);
        assert_eq!(l.weight().shape(), [2, 3]);
        let x = Tensor::from_slice(&dev, &[1.0f32, 2.0, 3.0], &[1, 3], Category::Input).unwrap();
        let y = l.forward(&x).unwrap().to_vec::<f32>().unwrap();
        let (w, b) = (l.weight().to_vec::<f32>().unwrap(), l.bias().unwrap().to_vec::<f32>().unwrap());
        for o in 0..2 {
            let want = b[o] + w[o * 3] + 2.0 * w[o * 3 + 1] + 3.0 * w[o * 3 + 2];
            assert!((y[o] - want).abs() < 1e-6);
        }
        assert!(Linear::new(&init, "x", 0, 2, true).is_err());
        let top = Linear::new(&init, "", 3, 2, false).unwrap();
        assert_eq!(names(&top), ["weight"]);
    }

    #[test]
    fn conv_shapes_and_output_size() {
        let init = Initializer::new(&Device::cpu(), 0);
        let p = Conv2dParams { padding: [1, 1], ..Default::default() };
        let c = Conv2d::new(&init, "c1", 3, 32, [3, 3], p, true).unwrap();
        assert_eq!(c.weight().shape(), [32, 3, 3, 3]);
        assert_eq!(c.output_size([64, 64]).unwrap(), [64, 64]);
        let bound = 1.0 / 27f32.sqrt();
        assert!(c.bias().unwrap().to_vec::<f32>().unwrap().iter().all(|v| v.abs() <= bound));
        let valid = Conv2d::new(&init, "v", 1, 1, [5, 5], Conv2dParams::default(), false).unwrap();
        let err = valid.output_size([3, 3]).unwrap_err().to_string();
        assert!(err.contains("smaller than its 5x5 kernel"), "{err}");
        let grouped = Conv2dParams { groups: 2, ..Default::default() };
        assert!(Conv2d::new(&init, "g", 3, 4, [3, 3], grouped, true).is_err());
        assert_eq!(window_output_size(28, 2, 2, 0, 1), Some(14));
        assert_eq!(window_output_size(7, 2, 2, 0, 1), Some(3));
        assert_eq!(window_output_size(1, 2, 2, 0, 1), None);
    }

    #[test]
    fn batchnorm_and_layernorm_init() {
        let init = Initializer::new(&Device::cpu(), 0);
        let bn = BatchNorm2d::new(&init, "bn1", 4).unwrap();
        assert_eq!(
            names(&bn),
            ["bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]
        );
        assert_eq!(bn.weight().to_vec::<f32>().unwrap(), [1.0; 4]);
        assert_eq!(bn.bias().to_vec::<f32>().unwrap(), [0.0; 4]);
        assert_eq!(bn.running_var().to_vec::<f32>().unwrap(), [1.0; 4]);
        assert_eq!(bn.num_batches_tracked().dtype(), DType::I64);
        assert_eq!(bn.num_batches_tracked().shape(), [] as [usize; 0]);
        assert!(bn.weight().requires_grad() && !bn.running_mean().requires_grad());
        assert_eq!(bn.running_mean().storage().category(), Category::Other);
        let ln = LayerNorm::new(&init, "ln", 8).unwrap();
        assert_eq!(names(&ln), ["ln.weight", "ln.bias"]);
    }

    /// The fused forwards (GELU into a linear, layer norm into a linear or the attention's
    /// in-projection, packed self-attention) give the composed modules' outputs and gradients.
    #[test]
    fn fused_forwards_match_the_composed_modules() {
        use memfit_tensor::autograd::backward;
        let dev = Device::cpu();
        let init = Initializer::new(&dev, 3);
        let (b, t, d) = (2, 5, 16);
        let ln = LayerNorm::new(&init, "ln", d).unwrap();
        // Non-default norm parameters, so that they matter.
        ln.weight()
            .write_with::<f32>(|w| w.iter_mut().enumerate().for_each(|(i, w)| *w = 0.5 + i as f32 / 16.0))
            .unwrap();
        ln.bias().write_with::<f32>(|w| w.iter_mut().enumerate().for_each(|(i, w)| *w = 0.1 * i as f32 - 0.7)).unwrap();
        let fc = Linear::new(&init, "fc", d, 3, true).unwrap();
        let attn = MultiheadAttention::new(&init, "attn", d, 2).unwrap();
        let data: Vec<f32> = (0..b * t * d).map(|i| (i * 37 % 101) as f32 / 25.0 - 2.0).collect();
        let x = Tensor::from_slice(&dev, &data, &[b, t, d], Category::Input).unwrap().set_requires_grad(true);
        let causal: Vec<bool> = (0..t * t).map(|i| i % t > i / t).collect();
        let mask = Tensor::from_slice(&dev, &causal, &[t, t], Category::Input).unwrap();
        let mut leaves = vec![x.clone()];
        for m in [&ln as &dyn Module, &fc, &attn] {
            leaves.extend(m.parameters().into_iter().map(|(_, p)| p));
        }
        // Output and every leaf's gradient of sum(y * r), r a fixed pattern.
        let run = |f: &dyn Fn() -> Result<Tensor>| -> Vec<Vec<f32>> {
            let y = f().unwrap();
            let r: Vec<f32> = (0..y.numel()).map(|i| (i * 13 % 7) as f32 - 3.0).collect();
            let r = Tensor::from_slice(&dev, &r, y.shape(), Category::Input).unwrap();
            backward(&y.mul(&r).unwrap().sum_all().unwrap()).unwrap();
            let mut out = vec![y.to_vec::<f32>().unwrap()];
            out.extend(leaves.iter().map(|l| l.take_grad().map_or(vec![], |g| g.to_vec::<f32>().unwrap())));
            out
        };
        let check = |what: &str, got: Vec<Vec<f32>>, want: Vec<Vec<f32>>| {
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.len(), w.len(), "{what}: tensor {k}");
                let scale = w.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert!((a - b).abs() <= 2e-5 * scale, "{what}: tensor {k} [{i}]: {a} vs {b}");
                }
            }
        };
        check("gelu", run(&|| fc.forward_after_gelu(&x)), run(&|| fc.forward(&x.gelu()?)));
        check("layer norm", run(&|| fc.forward_after_layer_norm(&x, &ln)), run(&|| fc.forward(&ln.forward(&x)?)));
        // Packed self-attention (one input) against the separate projections (distinct key/value).
        check(
            "self-attention",
            run(&|| attn.forward(&x, &x, &x, Some(&mask), false)),
            run(&|| {
                let kv = x.mul_scalar(1.0)?;
                attn.forward(&x, &kv, &kv, Some(&mask), false)
            }),
        );
        check(
            "normed self-attention",
            run(&|| attn.forward_self_after_layer_norm(&x, &ln, Some(&mask), false)),
            run(&|| {
                let h = ln.forward(&x)?;
                attn.forward(&h, &h, &h, Some(&mask), false)
            }),
        );
        assert!(attn.forward_self_after_layer_norm(&x.narrow(2, 0, 8).unwrap(), &ln, None, false).is_err());
    }

    #[test]
    fn mha_layout() {
        let init = Initializer::new(&Device::cpu(), 0);
        let a = MultiheadAttention::new(&init, "blocks.0.attn", 16, 2).unwrap();
        let ps = a.parameters();
        let got: Vec<(&str, &[usize])> = ps.iter().map(|(n, t)| (n.as_str(), t.shape())).collect();
        assert_eq!(
            got,
            [
                ("blocks.0.attn.in_proj_weight", &[48usize, 16][..]),
                ("blocks.0.attn.in_proj_bias", &[48][..]),
                ("blocks.0.attn.out_proj.weight", &[16, 16][..]),
                ("blocks.0.attn.out_proj.bias", &[16][..]),
            ]
        );
        assert_eq!(ps[1].1.to_vec::<f32>().unwrap(), [0.0; 48]);
        assert_eq!(ps[3].1.to_vec::<f32>().unwrap(), [0.0; 16]);
        assert!(MultiheadAttention::new(&init, "a", 10, 3).is_err());
    }
}
