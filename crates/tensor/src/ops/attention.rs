//! Scaled dot-product attention over [B, H, T, D] tensors, optional causal or boolean mask.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `F.scaled_dot_product_attention(q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], is_causal)` with scale
/// 1/sqrt(D). `mask` (bool, broadcastable to [B,H,Tq,Tk]) is True where attention is NOT allowed (the
/// convention of nn.MultiheadAttention's bool attn_mask). Causal: query i sees keys j <= i.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let _ = (q, k, v, causal, mask);
    Err(Error::invalid("scaled_dot_product_attention is not implemented yet"))
}
