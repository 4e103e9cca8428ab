//! CPU kernels of the embedding lookup (`ops/embedding.rs`): the index range check, the row gather
//! and the gradient's scatter-add (column blocks in parallel, indices in order within each block).

use super::gemm::SendPtr;
use crate::error::{check_len, first_out_of_range, Error, Result};
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

/// `out[k, :] = weight[indices[k], :]` (indices int64, all contiguous); errors on an index outside
/// the table.
pub fn embedding(indices: View<'_>, weight: View<'_>, out: View<'_>) -> Result<()> {
    let (v, d) = (weight.shape()[0], weight.shape()[1]);
    let ix = indices.slice::<i64>()?;
    check_indices("embedding", ix, v)?;
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
    Ok(())
}

/// Errors on an index outside a table of `rows` rows.
fn check_indices(name: &str, ix: &[i64], rows: usize) -> Result<()> {
    match first_out_of_range(ix, rows) {
        Some(p) => Err(Error::invalid(format!(
            "{name}: index {} (position {p}) is out of range for a table of {rows} rows",
            ix[p]
        ))),
        None => Ok(()),
    }
}

/// `gw[indices[k], :] += grad[k, :]` over all k, into the zeroed `gw` [V, D] (grad contiguous).
/// Errors on an index outside the table and on a gradient shorter than one row per index (the
/// parallel scatter writes through a raw pointer).
pub fn embedding_backward(
    indices: View<'_>,
    grad: View<'_>,
    gw: View<'_>,
    _gpu_workspace: Option<View<'_>>,
) -> Result<()> {
    let (v, d) = (gw.shape()[0], gw.shape()[1]);
    if d == 0 {
        return Ok(());
    }
    with_float!(grad.dtype(), "embedding_backward", T => {
        let (ix, g) = (indices.slice::<i64>()?, grad.slice::<T>()?);
        check_indices("embedding_backward", ix, v)?;
        check_len("embedding_backward output gradient", g.len(), ix.len() * d)?;
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
    Ok(())
}
