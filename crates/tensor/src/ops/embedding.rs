//! Embedding lookup: rows of a weight table picked by int64 indices; the gradient scatter-adds.
//! Saves only the indices (and the table's row count) for backward.

use crate::backend::cpu::gemm::SendPtr;
use super::{output, zeros_output, PAR_CHUNK};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::with_float;
use rayon::prelude::*;

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
    if weight.device().computes() {
        let ix = indices.slice::<i64>()?;
        if let Some(p) = ix.iter().position(|&i| i < 0 || i as u64 >= v as u64) {
            return Err(Error::invalid(format!(
                "embedding: index {} (position {p}) is out of range for a table of {v} rows",
                ix[p]
            )));
        }
        if d > 0 {
            with_float!(weight.dtype(), "embedding", T => {
                let w = weight.slice::<T>()?;
                let dst = out.slice_mut::<T>()?;
                let copy = |(row, &i): (&mut [T], &i64)| row.copy_from_slice(&w[i as usize * d..(i as usize + 1) * d]);
                if dst.len() >= 2 * PAR_CHUNK {
                    dst.par_chunks_mut(d).zip(ix.par_iter()).for_each(copy);
                } else {
                    dst.chunks_mut(d).zip(ix.iter()).for_each(copy);
                }
            });
        }
    }
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
        if grad.device().computes() && d > 0 {
            with_float!(grad.dtype(), "embedding_backward", T => {
                let (ix, g) = (self.indices.slice::<i64>()?, grad.slice::<T>()?);
                let dst = gw.slice_mut::<T>()?;
                // Column blocks are disjoint, so tasks never add into the same element; within a
                // block the indices are visited in order (deterministic).
                const COLS: usize = 64;
                let blocks = d.div_ceil(COLS);
                if g.len() >= 2 * PAR_CHUNK && blocks > 1 {
                    let p = SendPtr(dst.as_mut_ptr());
                    (0..blocks).into_par_iter().for_each(|b| {
                        #[allow(clippy::redundant_locals)] // capture the Send wrapper, not its raw pointer field
                        let p = p;
                        let (j0, j1) = (b * COLS, ((b + 1) * COLS).min(d));
                        for (k, &i) in ix.iter().enumerate() {
                            for j in j0..j1 {
                                // SAFETY: columns j0..j1 of the fresh gradient belong to this task.
                                unsafe { *p.0.add(i as usize * d + j) += g[k * d + j] };
                            }
                        }
                    });
                } else {
                    for (k, &i) in ix.iter().enumerate() {
                        let row = &mut dst[i as usize * d..(i as usize + 1) * d];
                        row.iter_mut().zip(&g[k * d..(k + 1) * d]).for_each(|(a, &b)| *a += b);
                    }
                }
            });
        }
        Ok(vec![Some(gw)])
    }
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
