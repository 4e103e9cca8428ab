//! Embedding lookup: rows of a weight table picked by int64 indices; the gradient scatter-adds.
//! Saves only the indices (and the table's row count) for backward. The kernels (and the check of
//! the index values, which only a computing device can read) are the backend's
//! (`memfit-cpu`'s `embedding.rs`).

use super::{output, zeros_output};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `F.embedding(indices int64 [...], weight [V, D])` -> [..., D].
pub fn embedding(indices: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let _op = weight.device().op_scope("embedding");
    if !indices.device().same(weight.device()) {
        return Err(Error::device("embedding: indices and weight are on different devices"));
    }
    if indices.dtype() != DType::I64 {
        return Err(Error::dtype(format!("embedding: indices must be int64, got {}", indices.dtype())));
    }
    if weight.rank() != 2 {
        return Err(Error::shape(format!("embedding: weight must be [V, D], got {:?}", weight.shape())));
    }
    let (v, d) = (weight.shape()[0], weight.shape()[1]);
    let indices = indices.contiguous()?;
    let weight = weight.contiguous()?;
    let mut shape = indices.shape().to_vec();
    shape.push(d);
    let out = output(&weight, &shape, weight.dtype(), "embedding")?;
    weight.device().backend().embedding(&indices, &weight, &out)?;
    if !needs_grad(&[&weight]) {
        return Ok(out);
    }
    Ok(record(out, "embedding", &[&weight], EmbeddingBack { indices: save(&indices), rows: v }))
}

struct EmbeddingBack {
    indices: Tensor,
    rows: usize,
}

impl Backward for EmbeddingBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let d = grad.shape().last().copied().unwrap_or(1);
        let gw = zeros_output(&grad, &[self.rows, d], grad.dtype(), "embedding_backward")?;
        // A GPU sorts the positions by the row they name (Note [Embedding backward on a GPU]).
        let n = self.indices.numel();
        let ws = super::gpu_workspace(&grad, embedding_workspace_len(self.rows, n), DType::I64, "embedding_backward")?;
        grad.device().backend().embedding_backward(&self.indices, &grad, &gw, ws.as_ref())?;
        Ok(vec![Some(gw)])
    }
}

/// Positions per tile of a GPU's radix sort of the positions by row (embedding.cu's SORT_TILE).
pub(crate) const EMBEDDING_SORT_TILE: usize = 256;

/// The int64 words of a GPU's embedding backward workspace for a table of `rows` and `positions`
/// indices (Note [Embedding backward on a GPU] in embedding.cu): where each row's positions start,
/// the sorted positions and a spare buffer for the sort's passes, and the sort's digit counts (256
/// per tile, after a leading zero).
pub(crate) fn embedding_workspace_len(rows: usize, positions: usize) -> usize {
    rows + 1 + 2 * positions + 1 + 256 * positions.div_ceil(EMBEDDING_SORT_TILE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::backward_with;
    use crate::ops::softmax::test_support::*;
    use crate::{Category, Device};

    fn ix(dev: &Device, v: &[i64], shape: &[usize]) -> Tensor {
        Tensor::from_slice(dev, v, shape, Category::Input).unwrap()
    }

    #[test]
    fn hand_checked_values_and_scatter_add() {
        let dev = Device::cpu();
        let w = t64(&dev, &[0.0, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]).set_requires_grad(true);
        let i = ix(&dev, &[2, 0, 2, 1], &[2, 2]);
        let y = embedding(&i, &w).unwrap();
        assert_eq!(y.shape(), &[2, 2, 2]);
        assert_eq!(y.to_f64_vec().unwrap(), vec![20.0, 21.0, 0.0, 1.0, 20.0, 21.0, 10.0, 11.0]);
        let g = t64(&dev, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &[2, 2, 2]);
        backward_with(&y, g).unwrap();
        // Row 2 was used twice: its gradient is the sum.
        assert_eq!(w.grad().unwrap().to_f64_vec().unwrap(), vec![3.0, 4.0, 7.0, 8.0, 6.0, 8.0]);
        // A 0-d index gives one row.
        assert_eq!(embedding(&ix(&dev, &[1], &[]), &w).unwrap().to_f64_vec().unwrap(), vec![10.0, 11.0]);
    }

    #[test]
    fn bad_indices_are_errors() {
        let dev = Device::cpu();
        let w = t64(&dev, &[0.0; 6], &[3, 2]);
        let err = embedding(&ix(&dev, &[0, 3], &[2]), &w).unwrap_err().to_string();
        assert!(err.contains("index 3") && err.contains("position 1"), "{err}");
        assert!(embedding(&ix(&dev, &[-1], &[1]), &w).unwrap_err().to_string().contains("index -1"));
        assert!(embedding(&w, &w).is_err());
        assert!(embedding(&ix(&dev, &[0], &[1]), &t64(&dev, &[0.0; 6], &[6])).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        gradcheck(&[(values(12, 1), vec![4, 3])], |t| embedding(&ix(t[0].device(), &[3, 1, 3, 0, 3], &[5]), &t[0]));
    }

    #[test]
    fn big_backward_takes_the_parallel_path() {
        let dev = Device::cpu();
        let (v, d, n) = (7, 200, 400);
        let w = t64(&dev, &values(v * d, 2), &[v, d]).set_requires_grad(true);
        let idx: Vec<i64> = (0..n as i64).map(|k| (k * k) % v as i64).collect();
        let y = embedding(&ix(&dev, &idx, &[n]), &w).unwrap();
        let g = values(n * d, 3);
        backward_with(&y, t64(&dev, &g, &[n, d])).unwrap();
        let mut want = vec![0.0; v * d];
        for (k, &i) in idx.iter().enumerate() {
            for j in 0..d {
                want[i as usize * d + j] += g[k * d + j];
            }
        }
        assert_eq!(w.grad().unwrap().to_f64_vec().unwrap(), want);
    }

    #[test]
    fn golden_embedding() {
        let g = Golden::open("loss.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            let name = format!("embedding_{}", suffix(dtype));
            let k = |s: &str| format!("{name}/{s}");
            let w = g.leaf(&dev, &k("weight"));
            let y = embedding(&g.tensor(&dev, &k("indices")), &w).unwrap();
            assert_golden(&y, &g.f64s(&k("output")), dtype, &name);
            backward_with(&y, g.tensor(&dev, &k("grad_out"))).unwrap();
            assert_golden(&w.grad().unwrap(), &g.f64s(&k("grad_weight")), dtype, &name);
        }
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let w = Tensor::full(dev, &[10, 4], 0.5, DType::F32, Category::Parameter)?.set_requires_grad(true);
            let i = Tensor::from_slice(dev, &[1i64, 2, 3, 9, 0, 0], &[2, 3], Category::Input)?;
            let y = embedding(&i, &w)?;
            crate::autograd::backward(&y.sum_all()?)
        });
    }
}
