//! Scaled dot-product attention: [`scaled_dot_product_attention`] over [..., T, D] tensors, and
//! [`packed_self_attention`], the core of `nn.MultiheadAttention`'s self-attention, which reads q, k and
//! v straight out of the packed in-projection output [B, T, 3E] and writes [B, T, E] with the heads
//! already merged (no split or merge copies). Both take the causal flag and/or a boolean mask.
//!
//! This file holds shapes, layouts, outputs and autograd; the kernels are the backend's
//! (`memfit-cpu`'s `attention.rs`). FlashAttention-style fused kernels, one task per (batch, head) matrix, `DP_ROWS` query rows at a
//! time: forward computes a block of scores `S = q k^T * scale + mask` into a scratch, softmaxes each
//! row (max, then exp and sum), multiplies by v into the output and keeps only the rows' log-sum-exp.
//! Backward saves q, k and v (or the packed qkv, one tensor), the output, the mask and the per-row
//! log-sum-exp (`lse`, [..., Tq], in the inputs' dtype) and nothing of size [Tq, Tk]: per row block
//! it recomputes `P = exp(S - lse)`, then `dV += P^T dO`, `dP = dO v^T`, `dS = P * (dP - D) * scale`,
//! `dQ = dS k` and `dK += dS^T q`, D each row's `rowsum(dO * O)` from a pass over the saved output
//! first (Note [Attention's D]). The only workspace is a per-task scratch of two `DP_ROWS x Tk`
//! blocks, bounded by a constant times Tk and independent of the batch size and the thread count;
//! outputs, the log-sum-exp, D and gradients come from the allocator.
//!
//! Keys hidden from every row of a block past its last visible key (a causal flag or a causal mask)
//! are skipped; their probabilities are exactly 0, so this changes nothing but the work.
//!
//! Note [Attention's D]
//! Softmax's backward needs `D = rowsum(P * dP)` of every query row, and with `dP = dO v^T` and
//! `O = P v` that is `rowsum(dO * O)` (FlashAttention-2's identity). memfit defines D so, on every
//! device: the f32 (or f64) dot product of the row's output gradient and its output as saved (in
//! the saved dtype under Note [Half-precision storage], as PyTorch's bf16 autocast keeps it), in any
//! order of additions. Attention saves its output for it; the op after attention saves the same
//! tensor as its input (out_proj), so the two share it (Note [Shared compact copies]). A GPU thus
//! computes D in one pass over the output's rows instead of a pass over every row's keys (two of
//! the backward's nine products). Under half-precision storage the backends read the output as it
//! is saved, in bf16 or f16, each element widened to the f32 that restoring it gives (the same D,
//! without an f32 copy of the output: [B, T, E] written and read again a layer).
//!
//! Note [Attention's saved operands]
//! On a GPU the tensor cores' kernels read q, k and v through 16-bit copies that a kernel rounds
//! them into (`attention_bits`). When they were saved in the products' own format (bf16 storage
//! with bf16 products, fp16 with fp16), the op hands the saved tensors to the backend as they
//! are: without the f32 copy of q, k and v (3 GiB at GPT-2's micro-batch of 342, whose step then
//! reserves 3 GiB less) or its traffic. Where their rows allow (`bits_in_place`: 16-byte aligned
//! rows of a multiple of 8 elements, as GPT-2's packed q, k and v), the kernels read them in place,
//! in backward and, the copies then made before the kernels (`saves_first`), in the forward too,
//! as saved (bfloat16 storage and a bf16 operand round f32 alike, so these are the operand bits;
//! but for a subnormal, which storage keeps and the operand rounding flushes to a zero of its sign:
//! such an element, below 2^-126, enters the products as itself), and backward's workspace holds the
//! output gradient's copy only; else the rounding kernel widens each element to the f32 that
//! restoring it would give before rounding it into a copy. Decided from the device's target, the
//! problem and the saved dtypes, so `meta:cuda` allocates as the GPU does; a GPU whose tensor cores
//! fail their check is then an error that names `MEMFIT_CUDA_ATTENTION=cuda-cores`, which the
//! decision reads too.
//!
//! Fully masked rows (every key masked) give output 0 and gradient 0, like PyTorch's
//! `F.scaled_dot_product_attention` since 2.5 (its math backend applies `_safe_softmax`; the fused
//! CPU kernels agree). A plain `softmax` of such a row would be NaN. Their log-sum-exp is -inf.

use super::{check_same, output};
use crate::autograd::{needs_grad, record, save, save_compact, Backward, Compact};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
pub(crate) use memfit_cpu::attention::{AttnAddr, AttnDims, AttnLayouts, AttnProblem};

/// Where a GPU's tensor-core attention finds its operands rounded (attention.cu's
/// `attention_round_*`): copies of q, k and v, and in backward of the output's gradient, each
/// [bh, rows, head size rounded up to 8] of 16-bit elements, at these offsets (elements) of the op's
/// workspace of `len`; with `in_place` (q, k and v saved in the products' own format, read in place
/// by the forward or backward: [`bits_in_place`]), the gradient's copy only, at 0 (none in a
/// forward). All
/// zero where those kernels do not run (anything but f32 tensors with bf16 or fp16 products and
/// heads up to 128) and for a problem of no rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttnBits {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub g: usize,
    pub len: usize,
    pub in_place: bool,
}

/// [`AttnBits`] of a problem on tensors of `dtype`, with the output's gradient's copy when
/// `backward`, q, k and v read in place when `in_place` (a forward then needs no copies: `len` 0).
pub(crate) fn attention_bits(pb: &AttnProblem, dtype: DType, backward: bool, in_place: bool) -> AttnBits {
    let d = pb.dims;
    if dtype != DType::F32 || pb.products == crate::Products::F32 || d.d.max(d.dv) > 128 {
        return AttnBits { q: 0, k: 0, v: 0, g: 0, len: 0, in_place: false };
    }
    let (dp, dvp) = (d.d.next_multiple_of(8), d.dv.next_multiple_of(8));
    if in_place {
        return AttnBits { q: 0, k: 0, v: 0, g: 0, len: if backward { d.bh * d.tq * dvp } else { 0 }, in_place };
    }
    let k = d.bh * d.tq * dp;
    let v = k + d.bh * d.tk * dp;
    let g = v + d.bh * d.tk * dvp;
    AttnBits { q: 0, k, v, g, len: if backward { g + d.bh * d.tq * dvp } else { g }, in_place: false }
}

/// Whether the tensor cores' kernels can read q, k and v of `pb` in place where they are saved in
/// the products' own 16 bits (Note [Attention's saved operands]): every row of them 16 bytes
/// aligned and a whole number of 16-byte copies long (head sizes, offsets and strides multiples of
/// 8 elements; an allocation starts 256-byte aligned), as the kernels stage their rounded copies.
/// GPT-2's packed q, k and v are (heads of 64, rows of 2,304).
pub(crate) fn bits_in_place(pb: &AttnProblem) -> bool {
    let d = pb.dims;
    let whole =
        |a: &AttnAddr| [a.offset, a.batch_stride, a.head_stride, a.row_stride].iter().all(|s| s.is_multiple_of(8));
    d.d.is_multiple_of(8) && d.dv.is_multiple_of(8) && whole(&pb.lay.q) && whole(&pb.lay.k) && whole(&pb.lay.v)
}

/// The op's workspace for [`attention_bits`] on a GPU target; None elsewhere or where there are none.
fn bits_workspace(like: &Tensor, pb: &AttnProblem, backward: bool, in_place: bool) -> Result<Option<Tensor>> {
    let len = attention_bits(pb, like.dtype(), backward, in_place).len;
    if len == 0 {
        return Ok(None);
    }
    let dtype = if pb.products == crate::Products::F16 { DType::F16 } else { DType::BF16 };
    super::gpu_workspace(like, len, dtype, "scaled_dot_product_attention")
}

/// Errors unless `m` is a bool mask on `like`'s device that broadcasts to `full`.
fn check_mask(op: &str, m: &Tensor, like: &Tensor, full: &[usize]) -> Result<()> {
    if !m.device().same(like.device()) {
        return Err(Error::device(format!("{op}: mask is on another device")));
    }
    if m.dtype() != DType::Bool {
        return Err(Error::dtype(format!("{op}: mask must be bool, got {}", m.dtype())));
    }
    let fits = m.rank() <= full.len() && m.shape().iter().rev().zip(full.iter().rev()).all(|(&a, &b)| a == b || a == 1);
    if !fits {
        return Err(Error::shape(format!("{op}: mask {:?} does not broadcast to {full:?}", m.shape())));
    }
    Ok(())
}

/// `F.scaled_dot_product_attention(q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], is_causal)` with scale
/// 1/sqrt(D). `mask` (bool, broadcastable to [B,H,Tq,Tk]) is True where attention is NOT allowed (the
/// convention of nn.MultiheadAttention's bool attn_mask). Causal: query i sees keys j <= i.
///
/// Any number of leading batch dims works (q, k and v must agree on them). `causal` and `mask` may be
/// combined (a key is then hidden when either hides it). A query row with every key hidden yields 0
/// (and gradient 0), as PyTorch's sdpa does.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let _op = q.device().op_scope("scaled_dot_product_attention");
    const NAME: &str = "scaled_dot_product_attention";
    check_same(NAME, &[q, k, v])?;
    let r = q.rank();
    let bad = || {
        Error::shape(format!(
            "scaled_dot_product_attention: expected q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] with the \
             same leading dims, got {:?}, {:?}, {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        ))
    };
    if r < 2
        || k.rank() != r
        || v.rank() != r
        || q.shape()[..r - 2] != k.shape()[..r - 2]
        || q.shape()[..r - 2] != v.shape()[..r - 2]
    {
        return Err(bad());
    }
    let (tq, d, tk, dv) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
    if k.shape()[r - 1] != d || v.shape()[r - 2] != tk {
        return Err(bad());
    }
    if d == 0 {
        return Err(Error::shape("scaled_dot_product_attention: head dim D must be > 0"));
    }
    let batch = &q.shape()[..r - 2];
    let mut full = batch.to_vec();
    full.extend([tq, tk]);
    if let Some(m) = mask {
        check_mask(NAME, m, q, &full)?;
    }
    let dims = AttnDims { bh: batch.iter().product(), heads: 1, tq, tk, d, dv };
    let lay = AttnLayouts {
        q: AttnAddr::stack(tq, d),
        k: AttnAddr::stack(tk, d),
        v: AttnAddr::stack(tk, dv),
        out: AttnAddr::stack(tq, dv),
    };
    let pb = AttnProblem { dims, lay, scale: 1.0 / (d as f64).sqrt(), causal, full, products: super::products_of(q) };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let mut out_shape = batch.to_vec();
    out_shape.extend([tq, dv]);
    let out = output(&q, &out_shape, q.dtype(), NAME)?;
    let grad = needs_grad(&[&q, &k, &v]);
    let lse = if grad { Some(output(&q, &pb.full[..r - 1], q.dtype(), NAME)?) } else { None };
    let save_inputs = || -> Result<[Compact; 3]> { Ok([save_compact(&q)?, save_compact(&k)?, save_compact(&v)?]) };
    let first = if grad && saves_first(&pb) { Some(save_inputs()?) } else { None };
    forward(&pb, [&q, &k, &v], &first.iter().flatten().collect::<Vec<_>>(), mask, &out, lse.as_ref())?;
    let Some(lse) = lse else { return Ok(out) };
    let saved = match first {
        Some(saved) => saved,
        None => save_inputs()?,
    };
    let back = AttentionBack {
        inputs: Saved::Separate(saved),
        out: save_compact(&out)?,
        lse: save(&lse),
        mask: mask.map(save),
        pb,
    };
    Ok(record(out, NAME, &[&q, &k, &v], back))
}

/// The self-attention core of `nn.MultiheadAttention` (batch_first, no dropout) on the packed
/// in-projection output `qkv` [B, T, 3E]: features [0, E) are the queries, [E, 2E) the keys and
/// [2E, 3E) the values, head h using features `h*E/heads .. (h+1)*E/heads` of each. Returns
/// [B, T, E] with head h in features `h*E/heads ..`: the same as splitting q, k, v into
/// [B, heads, T, E/heads], [`scaled_dot_product_attention`] and merging the heads back, without the
/// copies. q, k and v are read in place; backward saves `qkv` itself (plus the mask and the
/// log-sum-exp) and produces one [B, T, 3E] gradient.
///
/// `mask` (bool, True = not allowed) broadcasts to [B, heads, T, T]; scale 1/sqrt(E/heads).
pub fn packed_self_attention(qkv: &Tensor, heads: usize, causal: bool, mask: Option<&Tensor>) -> Result<Tensor> {
    let _op = qkv.device().op_scope("packed_self_attention");
    const NAME: &str = "packed_self_attention";
    if qkv.rank() != 3 || heads == 0 || !qkv.shape()[2].is_multiple_of(3 * heads) || qkv.shape()[2] == 0 {
        return Err(Error::shape(format!(
            "packed_self_attention: expected qkv [B, T, 3E] with E a positive multiple of heads = {heads}, got {:?}",
            qkv.shape()
        )));
    }
    if !qkv.dtype().is_float() {
        return Err(Error::dtype(format!("packed_self_attention supports f32 and f64, not {}", qkv.dtype())));
    }
    let (b, t, e) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let dh = e / heads;
    let full = vec![b, heads, t, t];
    if let Some(m) = mask {
        check_mask(NAME, m, qkv, &full)?;
    }
    let part = |i: usize| AttnAddr { offset: i * e, batch_stride: t * 3 * e, head_stride: dh, row_stride: 3 * e };
    let lay = AttnLayouts {
        q: part(0),
        k: part(1),
        v: part(2),
        out: AttnAddr { offset: 0, batch_stride: t * e, head_stride: dh, row_stride: e },
    };
    let dims = AttnDims { bh: b * heads, heads, tq: t, tk: t, d: dh, dv: dh };
    let pb =
        AttnProblem { dims, lay, scale: 1.0 / (dh as f64).sqrt(), causal, full, products: super::products_of(qkv) };
    let qkv = qkv.contiguous()?;
    let out = output(&qkv, &[b, t, e], qkv.dtype(), NAME)?;
    let grad = needs_grad(&[&qkv]);
    let lse = if grad { Some(output(&qkv, &[b, heads, t], qkv.dtype(), NAME)?) } else { None };
    let first = if grad && saves_first(&pb) { Some(save_compact(&qkv)?) } else { None };
    forward(&pb, [&qkv, &qkv, &qkv], &first.iter().collect::<Vec<_>>(), mask, &out, lse.as_ref())?;
    let Some(lse) = lse else { return Ok(out) };
    let saved = match first {
        Some(saved) => saved,
        None => save_compact(&qkv)?,
    };
    let back = AttentionBack {
        inputs: Saved::Packed(saved),
        out: save_compact(&out)?,
        lse: save(&lse),
        mask: mask.map(save),
        pb,
    };
    Ok(record(out, NAME, &[&qkv], back))
}

/// Whether training saves attention's inputs before its forward kernels, not after: where the tensor
/// cores may read the saved copies in place (`bits_in_place`; then no rounded copies are made, so
/// nothing lives beside them). Elsewhere after, so that a workspace of rounded copies and the saved
/// copies are never alive together. Decided from the problem only, as `meta:cuda` decides it.
fn saves_first(pb: &AttnProblem) -> bool {
    bits_in_place(pb)
}

/// The forward's kernels on q, k and v (`inputs`), or, where training saved them first (`saved`:
/// their compact copies; [`saves_first`]) in the products' own 16 bits and the tensor cores read
/// them in place (Note [Attention's saved operands]), on those copies: no rounded copies, no
/// workspace.
fn forward(
    pb: &AttnProblem,
    inputs: [&Tensor; 3],
    saved: &[&Compact],
    mask: Option<&Tensor>,
    out: &Tensor,
    lse: Option<&Tensor>,
) -> Result<()> {
    let backend = out.device().backend();
    let [q, k, v] = inputs;
    if !saved.is_empty() && reads_saved_operands(saved, pb, out) && bits_in_place(pb) {
        let stored: Vec<&Tensor> = saved.iter().map(|c| c.stored()).collect();
        let [sq, sk, sv] = match stored[..] {
            [qkv] => [qkv; 3],
            [q, k, v] => [q, k, v],
            _ => return Err(Error::invalid("internal: attention saved neither one nor three inputs")),
        };
        return backend.attention(sq, sk, sv, mask, pb, out, lse, None);
    }
    let ws = bits_workspace(q, pb, false, false)?;
    backend.attention(q, k, v, mask, pb, out, lse, ws.as_ref())
}

/// The saved inputs: separate q, k, v, or one packed qkv.
enum Saved {
    Separate([Compact; 3]),
    Packed(Compact),
}

/// What attention saves for backward (Note [Saved tensors]): the inputs, the output (for D, Note
/// [Attention's D]), the mask and the per-row log-sum-exp; never the probabilities.
struct AttentionBack {
    inputs: Saved,
    /// The output, as the op after attention saves its input (one copy: Note [Shared compact copies]).
    out: Compact,
    /// Per-row log-sum-exp of the scaled, masked scores, [bh, Tq] (-inf for a fully masked row).
    lse: Tensor,
    mask: Option<Tensor>,
    pb: AttnProblem,
}

impl Backward for AttentionBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let go = grad.contiguous()?;
        let name = "scaled_dot_product_attention_backward";
        let backend = go.device().backend();
        // D first, from the output as saved (widened where it is saved in 16 bits: no restored
        // copy), before q, k and v are read back (only dS uses it, but a GPU's dk and dv kernel
        // stages it with every query tile).
        let delta = output(&go, self.lse.shape(), go.dtype(), name)?;
        backend.attention_delta(self.out.stored(), &go, &self.pb, &delta)?;
        // Gradients (allocated first, in input order) and the tensors q, k, v are read from.
        let saved: Vec<&Compact> = match &self.inputs {
            Saved::Separate(qkv) => qkv.iter().collect(),
            Saved::Packed(qkv) => vec![qkv],
        };
        let as_saved = reads_saved_operands(&saved, &self.pb, &go);
        let operands: Vec<Tensor> = if as_saved {
            saved.iter().map(|c| c.stored().clone()).collect()
        } else {
            saved.iter().map(|c| c.restore()).collect::<Result<_>>()?
        };
        let (grads, ins): (Vec<Option<Tensor>>, [&Tensor; 3]) = match &operands[..] {
            [q, k, v] => {
                let qkv = [q, k, v];
                let mut grads = Vec::with_capacity(3);
                for (t, &need) in qkv.iter().zip(needs) {
                    grads.push(if need { Some(output(&go, t.shape(), go.dtype(), name)?) } else { None });
                }
                (grads, [q, k, v])
            }
            [qkv] => (vec![Some(output(&go, qkv.shape(), go.dtype(), name)?)], [qkv, qkv, qkv]),
            _ => return Err(Error::invalid("internal: attention saved neither one nor three inputs")),
        };
        let g = match &self.inputs {
            Saved::Separate(_) => [grads[0].as_ref(), grads[1].as_ref(), grads[2].as_ref()],
            // The packed gradient's q, k and v parts are disjoint column ranges of one tensor.
            Saved::Packed(_) => [grads[0].as_ref(); 3],
        };
        let [q, k, v] = ins;
        let [gq, gk, gv] = g;
        let ws = bits_workspace(&go, &self.pb, true, as_saved && bits_in_place(&self.pb))?;
        let mask = self.mask.as_ref();
        backend.attention_backward(q, k, v, mask, &self.lse, &self.pb, &go, Some(&delta), gq, gk, gv, ws.as_ref())?;
        Ok(grads)
    }
}

/// Whether attention hands its inputs to the backend as saved (Note [Attention's saved operands];
/// `like`: an f32 tensor of the problem, the output or its gradient): on a GPU target whose
/// attention rounds them into 16-bit copies for the tensor cores (and
/// `MEMFIT_CUDA_ATTENTION=cuda-cores` does not send it to the CUDA cores), when every one is saved
/// in the products' own 16-bit format.
fn reads_saved_operands(saved: &[&Compact], pb: &AttnProblem, like: &Tensor) -> bool {
    let Some(own) = super::operand_dtype_of(pb.products) else { return false };
    like.device().target() == crate::Target::Cuda
        && attention_bits(pb, like.dtype(), true, false).len > 0
        && !crate::backend::cuda::cuda_cores_asked()
        && saved.iter().all(|c| c.stored().dtype() == own)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{backward, backward_with};
    use crate::ops::softmax::test_support::*;
    use crate::ops::{softmax, sum_to_shape};
    use crate::{Category, Device};

    fn bools(dev: &Device, v: &[bool], shape: &[usize]) -> Tensor {
        Tensor::from_slice(dev, v, shape, Category::Input).unwrap()
    }

    /// sdpa composed of public ops (matmul, softmax), with mask as a large negative bias.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
        let d = q.shape()[q.rank() - 1] as f64;
        let s = q.matmul(&k.transpose(-2, -1).unwrap()).unwrap().mul_scalar(1.0 / d.sqrt()).unwrap();
        let s = if causal {
            let (tq, tk) = (s.shape()[s.rank() - 2], s.shape()[s.rank() - 1]);
            let bias: Vec<f64> = (0..tq * tk).map(|x| if x % tk > x / tk { -1e300 } else { 0.0 }).collect();
            let b = Tensor::from_slice(q.device(), &bias, &[tq, tk], Category::Input).unwrap();
            s.add(&b.to_dtype(q.dtype()).unwrap()).unwrap()
        } else {
            s
        };
        softmax(&s, -1).unwrap().matmul(v).unwrap()
    }

    #[test]
    fn hand_checked_uniform_attention() {
        let dev = Device::cpu();
        // q = k = 0: every allowed key gets the same weight.
        let q = t64(&dev, &[0.0; 6], &[1, 1, 3, 2]);
        let v = t64(&dev, &[1.0, 10.0, 2.0, 20.0, 6.0, 60.0], &[1, 1, 3, 2]);
        let y = scaled_dot_product_attention(&q, &q, &v, false, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[3.0, 30.0, 3.0, 30.0, 3.0, 30.0], 1e-15, "plain");
        let y = scaled_dot_product_attention(&q, &q, &v, true, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[1.0, 10.0, 1.5, 15.0, 3.0, 30.0], 1e-15, "causal");
        // A [Tq, Tk] mask broadcast over batch and heads; True hides the key.
        let m = bools(&dev, &[false, true, true, true, false, false, false, true, false], &[3, 3]);
        let y = scaled_dot_product_attention(&q, &q, &v, false, Some(&m)).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[1.0, 10.0, 4.0, 40.0, 3.5, 35.0], 1e-15, "mask");
        // The scale is 1/sqrt(D): one key with score 2*sqrt(2)*... check against the formula.
        let q1 = t64(&dev, &[1.0, 1.0], &[1, 1, 1, 2]);
        let k1 = t64(&dev, &[1.0, 1.0, 0.0, 0.0], &[1, 1, 2, 2]);
        let v1 = t64(&dev, &[1.0, 0.0], &[1, 1, 2, 1]);
        let y = scaled_dot_product_attention(&q1, &k1, &v1, false, None).unwrap().item().unwrap();
        let e = (2.0 / 2f64.sqrt()).exp();
        assert_close(&[y], &[e / (e + 1.0)], 1e-15, "scale");
    }

    /// A mask that hides the first key of every row (left padding) leaves the keys after it seen,
    /// and a mask with the causal flag hides what either hides.
    #[test]
    fn masks_hide_a_prefix_and_combine_with_the_causal_flag() {
        let dev = Device::cpu();
        let (t, d) = (5, 3);
        let q = t64(&dev, &values(2 * t * d, 11), &[1, 2, t, d]);
        let k = t64(&dev, &values(2 * t * d, 12), &[1, 2, t, d]);
        let v = t64(&dev, &values(2 * t * d, 13), &[1, 2, t, d]);
        let first: Vec<bool> = (0..t * t).map(|i| i % t == 0).collect();
        let first = bools(&dev, &first, &[t, t]);
        let y = scaled_dot_product_attention(&q, &k, &v, false, Some(&first)).unwrap();
        let rest = |x: &Tensor| x.narrow(2, 1, t - 1).unwrap();
        let r = scaled_dot_product_attention(&q, &rest(&k), &rest(&v), false, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 1e-14, "keys after a hidden first one");
        let y = scaled_dot_product_attention(&q, &k, &v, true, Some(&first)).unwrap();
        let either: Vec<bool> = (0..t * t).map(|i| i % t == 0 || i % t > i / t).collect();
        let r = scaled_dot_product_attention(&q, &k, &v, false, Some(&bools(&dev, &either, &[t, t]))).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 0.0, "causal flag and mask");
    }

    /// The kernel takes a mask shared by every matrix that hides exactly the later keys (a GPT's
    /// causal buffer) by its causal fast path, and one that hides nothing by the unmasked one: the
    /// same bits, forward and backward, as the causal flag, as no mask, and as the same masks given
    /// per head (read byte by byte); a mask one key away from causal is not mistaken for it.
    #[test]
    fn causal_and_empty_masks_take_the_fast_paths_with_the_same_bits() {
        let dev = Device::cpu();
        let (h, t, d) = (2, 30, 3);
        let run = |causal: bool, mask: Option<&Tensor>| {
            let q = t64(&dev, &values(h * t * d, 21), &[1, h, t, d]).set_requires_grad(true);
            let k = t64(&dev, &values(h * t * d, 22), &[1, h, t, d]).set_requires_grad(true);
            let v = t64(&dev, &values(h * t * d, 23), &[1, h, t, d]).set_requires_grad(true);
            let y = scaled_dot_product_attention(&q, &k, &v, causal, mask).unwrap();
            backward(&y.mul(&y).unwrap().sum_all().unwrap()).unwrap();
            let mut out = y.to_f64_vec().unwrap();
            for x in [&q, &k, &v] {
                out.extend(x.grad().unwrap().to_f64_vec().unwrap());
            }
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let pattern =
            |hide: &dyn Fn(usize, usize) -> bool| -> Vec<bool> { (0..t * t).map(|i| hide(i / t, i % t)).collect() };
        let shared = |p: &[bool]| bools(&dev, p, &[t, t]);
        let per_head = |p: &[bool]| bools(&dev, &p.repeat(h), &[1, h, t, t]);
        let causal = pattern(&|r, j| j > r);
        let flag = run(true, None);
        assert_eq!(run(false, Some(&shared(&causal))), flag, "causal mask");
        assert_eq!(run(false, Some(&per_head(&causal))), flag, "causal mask per head");
        assert_eq!(run(true, Some(&shared(&causal))), flag, "causal mask and flag");
        let nothing = pattern(&|_, _| false);
        assert_eq!(run(false, Some(&shared(&nothing))), run(false, None), "empty mask");
        assert_eq!(run(true, Some(&shared(&nothing))), flag, "empty mask and flag");
        let almost = pattern(&|r, j| j > r || (r, j) == (5, 2));
        let almost_shared = run(false, Some(&shared(&almost)));
        assert_ne!(almost_shared, flag, "one more hidden key");
        assert_eq!(almost_shared, run(false, Some(&per_head(&almost))), "almost causal, shared or per head");
    }

    #[test]
    fn fully_masked_rows_give_zero_not_nan() {
        let dev = Device::cpu();
        let q = t64(&dev, &values(8, 1), &[1, 2, 2, 2]).set_requires_grad(true);
        let k = t64(&dev, &values(8, 2), &[1, 2, 2, 2]).set_requires_grad(true);
        let v = t64(&dev, &values(8, 3), &[1, 2, 2, 2]).set_requires_grad(true);
        // Head 0 row 1 sees nothing; everything else sees key 0 only.
        let m = bools(&dev, &[false, true, true, true, false, true, false, true], &[1, 2, 2, 2]);
        let y = scaled_dot_product_attention(&q, &k, &v, false, Some(&m)).unwrap();
        let yv = y.to_f64_vec().unwrap();
        assert_eq!(&yv[2..4], &[0.0, 0.0]);
        let vv = values(8, 3);
        assert_close(&[yv[0], yv[1], yv[4], yv[6]], &[vv[0], vv[1], vv[4], vv[4]], 1e-15, "single key");
        backward(&y.sum_all().unwrap()).unwrap();
        let gq = q.grad().unwrap().to_f64_vec().unwrap();
        assert!(gq.iter().all(|g| g.is_finite()));
        assert_eq!(&gq[2..4], &[0.0, 0.0]);
        // Key 1 of head 0 is never visible: no gradient reaches it.
        assert_eq!(&k.grad().unwrap().to_f64_vec().unwrap()[2..4], &[0.0, 0.0]);
        // Tk = 0: every row is empty, the output is zeros.
        let e = t64(&dev, &[], &[1, 1, 0, 2]);
        let q0 = q.narrow(1, 0, 1).unwrap();
        let y = scaled_dot_product_attention(&q0, &e, &e, false, None).unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), vec![0.0; 4]);
        q.set_grad(None);
        backward(&y.sum_all().unwrap()).unwrap();
        assert_eq!(q.grad().unwrap().to_f64_vec().unwrap(), vec![0.0; 8]);
    }

    #[test]
    fn shape_errors() {
        let dev = Device::cpu();
        let q = t64(&dev, &[0.0; 24], &[1, 2, 3, 4]);
        let k5 = t64(&dev, &[0.0; 30], &[1, 2, 3, 5]);
        assert!(scaled_dot_product_attention(&q, &k5, &q, false, None).is_err());
        let q2 = t64(&dev, &[0.0; 24], &[2, 1, 3, 4]);
        assert!(scaled_dot_product_attention(&q, &q2, &q2, false, None).is_err());
        let bad_mask = bools(&dev, &[false; 4], &[2, 2]);
        assert!(scaled_dot_product_attention(&q, &q, &q, false, Some(&bad_mask)).is_err());
        let float_mask = t64(&dev, &[0.0; 9], &[3, 3]);
        assert!(scaled_dot_product_attention(&q, &q, &q, false, Some(&float_mask)).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (q, k, v) = (values(2 * 3 * 4, 1), values(2 * 5 * 4, 2), values(2 * 5 * 3, 3));
        let qs = (q.iter().map(|x| x * 2.0).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        let ks = (k.clone(), vec![1, 2, 5, 4]);
        let vs = (v.clone(), vec![1, 2, 5, 3]);
        let inputs = [qs, ks, vs];
        gradcheck(&inputs, |t| scaled_dot_product_attention(&t[0], &t[1], &t[2], false, None));
        gradcheck(&inputs, |t| scaled_dot_product_attention(&t[0], &t[1], &t[2], true, None));
        gradcheck(&inputs, |t| {
            let m: Vec<bool> = (0..15).map(|x| x % 4 == 1).collect();
            let m = bools(t[0].device(), &m, &[3, 5]);
            scaled_dot_product_attention(&t[0], &t[1], &t[2], false, Some(&m))
        });
    }

    #[test]
    fn matches_composed_ops_on_larger_inputs() {
        let dev = Device::cpu();
        // bh = 1 (threaded GEMMs) and bh = 6 (parallel over matrices); Tq != Tk, D != Dv.
        for (b, h) in [(1, 1), (2, 3)] {
            let (tq, tk, d, dv) = (70, 90, 16, 24);
            let q = t64(&dev, &values(b * h * tq * d, 4), &[b, h, tq, d]).set_requires_grad(true);
            let k = t64(&dev, &values(b * h * tk * d, 5), &[b, h, tk, d]).set_requires_grad(true);
            let v = t64(&dev, &values(b * h * tk * dv, 6), &[b, h, tk, dv]).set_requires_grad(true);
            for causal in [false, true] {
                let g = t64(&dev, &values(b * h * tq * dv, 7), &[b, h, tq, dv]);
                let y = scaled_dot_product_attention(&q, &k, &v, causal, None).unwrap();
                backward_with(&y, g.clone()).unwrap();
                let got: Vec<Vec<f64>> =
                    [&q, &k, &v].iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                let r = reference(&q, &k, &v, causal);
                assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 1e-12, "output");
                backward_with(&r, g).unwrap();
                for (i, t) in [&q, &k, &v].iter().enumerate() {
                    let want = sum_to_shape(&t.take_grad().unwrap(), t.shape()).unwrap().to_f64_vec().unwrap();
                    assert_close(&got[i], &want, 1e-11, "gradient");
                }
            }
        }
    }

    #[test]
    fn golden_sdpa() {
        let g = Golden::open("attention.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            for (case, causal) in [("sdpa", false), ("sdpa_causal", true), ("sdpa_cross", false)] {
                let name = format!("{case}_{}", suffix(dtype));
                let key = |s: &str| format!("{name}/{s}");
                let (q, k, v) = (g.leaf(&dev, &key("q")), g.leaf(&dev, &key("k")), g.leaf(&dev, &key("v")));
                let y = scaled_dot_product_attention(&q, &k, &v, causal, None).unwrap();
                assert_golden(&y, &g.f64s(&key("output")), dtype, &name);
                backward_with(&y, g.tensor(&dev, &key("grad_out"))).unwrap();
                assert_golden(&q.grad().unwrap(), &g.f64s(&key("grad_q")), dtype, &name);
                assert_golden(&k.grad().unwrap(), &g.f64s(&key("grad_k")), dtype, &name);
                assert_golden(&v.grad().unwrap(), &g.f64s(&key("grad_v")), dtype, &name);
            }
        }
    }

    #[test]
    fn saves_inputs_output_and_log_sum_exp_only() {
        // Backward keeps q, k, v, the output and the per-row log-sum-exp, never the [Tq, Tk]
        // probabilities, and allocates only the rows' D and the three gradients (its scratch is a
        // few rows, outside the allocator).
        let dev = Device::cpu();
        let (tq, d) = (64, 8);
        let t = |salt| {
            Tensor::from_slice(&dev, &values(2 * tq * d, salt), &[1, 2, tq, d], Category::Temporary)
                .unwrap()
                .set_requires_grad(true)
        };
        let (q, k, v) = (t(1), t(2), t(3));
        let activation = || dev.stats().category(Category::Activation).current;
        assert_eq!(activation(), 0);
        let y = scaled_dot_product_attention(&q, &k, &v, true, None).unwrap();
        let input_bytes = (2 * tq * d * 8) as u64;
        let lse_bytes = (2 * tq * 8) as u64;
        assert_eq!(activation(), 4 * input_bytes + lse_bytes, "q, k, v, the output and lse [1, 2, Tq] are saved");
        let g = t64(&dev, &values(2 * tq * d, 4), &[1, 2, tq, d]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let ops: Vec<&str> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| e.op)
            .collect();
        assert_eq!(ops, vec!["scaled_dot_product_attention_backward"; 4]);
        drop(a);
        assert_eq!(activation(), 4 * input_bytes, "the log-sum-exp is freed by backward (y itself lives)");
        // The packed op saves its one input, the output and the log-sum-exp, and allocates D and one
        // gradient.
        let qkv = Tensor::from_slice(&dev, &values(2 * 10 * 24, 5), &[2, 10, 24], Category::Temporary)
            .unwrap()
            .set_requires_grad(true);
        let before_act = activation();
        let y = packed_self_attention(&qkv, 2, true, None).unwrap();
        let saved = 4096 + 1536 + 512;
        assert_eq!(
            activation() - before_act,
            saved,
            "qkv [2, 10, 24], y [2, 10, 8] and lse [2, 2, 10], in 512 B blocks"
        );
        let g = t64(&dev, &values(2 * 10 * 8, 6), &[2, 10, 8]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let allocs: Vec<&str> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| e.op)
            .collect();
        assert_eq!(allocs, ["scaled_dot_product_attention_backward"; 2]);
    }

    /// The unfused multi-head path: split qkv [B, T, 3E] into heads, sdpa, merge the heads.
    fn split_sdpa_merge(qkv: &Tensor, heads: usize, causal: bool, mask: Option<&Tensor>) -> Tensor {
        let (b, t, e) = (qkv.shape()[0] as isize, qkv.shape()[1] as isize, qkv.shape()[2] as isize / 3);
        let h = heads as isize;
        let parts = qkv.reshape(&[b, t, 3, h, e / h]).unwrap().permute(&[2, 0, 3, 1, 4]).unwrap();
        let part = |i| parts.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
        let y = scaled_dot_product_attention(&part(0), &part(1), &part(2), causal, mask).unwrap();
        y.permute(&[0, 2, 1, 3]).unwrap().reshape(&[b, t, e]).unwrap()
    }

    #[test]
    fn packed_matches_split_heads_sdpa() {
        let dev = Device::cpu();
        let (b, t, e, heads) = (2, 70, 24, 3);
        let x = t64(&dev, &values(b * t * 3 * e, 8), &[b, t, 3 * e]).set_requires_grad(true);
        let g = t64(&dev, &values(b * t * e, 9), &[b, t, e]);
        // A causal [T, T] mask (GPT's), a [B, heads, T, T] mask with fully masked rows, the flag.
        let causal_mask: Vec<bool> = (0..t * t).map(|i| i % t > i / t).collect();
        let causal_mask = bools(&dev, &causal_mask, &[t, t]);
        let sparse: Vec<bool> = (0..b * heads * t * t).map(|i| (i / t) % 9 == 4 || (i * 7) % 5 == 0).collect();
        let sparse = bools(&dev, &sparse, &[b, heads, t, t]);
        for (causal, mask) in [(false, None), (true, None), (false, Some(&causal_mask)), (true, Some(&sparse))] {
            let y = packed_self_attention(&x, heads, causal, mask).unwrap();
            backward_with(&y, g.clone()).unwrap();
            let got = x.take_grad().unwrap().to_f64_vec().unwrap();
            let r = split_sdpa_merge(&x, heads, causal, mask);
            assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 1e-12, "output");
            backward_with(&r, g.clone()).unwrap();
            assert_close(&got, &x.take_grad().unwrap().to_f64_vec().unwrap(), 1e-12, "gradient");
        }
        let y = packed_self_attention(&x, heads, false, Some(&sparse)).unwrap().to_f64_vec().unwrap();
        assert!(y.iter().all(|v| v.is_finite()));
        // Errors: E not divisible into heads, a mask that does not broadcast, a non-packed input.
        assert!(packed_self_attention(&x, 5, false, None).is_err());
        assert!(packed_self_attention(&x, heads, false, Some(&bools(&dev, &[false; 4], &[2, 2]))).is_err());
        assert!(packed_self_attention(&x.reshape(&[-1]).unwrap(), heads, false, None).is_err());
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.1, DType::F32, Category::Input)?.set_requires_grad(true))
            };
            let (q, k, v) = (t(&[2, 2, 4, 8])?, t(&[2, 2, 5, 8])?, t(&[2, 2, 5, 3])?);
            let m = Tensor::from_slice(dev, &[false, true, false, false, true], &[5], Category::Input)?;
            let y = scaled_dot_product_attention(&q, &k, &v, true, Some(&m))?;
            backward(&y.sum_all()?)?;
            let qkv = Tensor::full(dev, &[2, 5, 12], 0.1, DType::F32, Category::Input)?.set_requires_grad(true);
            let y = packed_self_attention(&qkv, 2, false, Some(&m))?;
            backward(&y.sum_all()?)
        });
    }
}
