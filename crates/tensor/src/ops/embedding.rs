//! Embedding lookup: rows of a weight table picked by int64 indices; the gradient scatter-adds.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `F.embedding(indices int64 [...], weight [V, D])` -> [..., D].
pub fn embedding(indices: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let _ = (indices, weight);
    Err(Error::invalid("embedding is not implemented yet"))
}
