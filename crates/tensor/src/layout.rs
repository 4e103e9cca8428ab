//! The shape rules views and broadcasting follow, checked before any kernel runs. [`Layout`] itself
//! (shapes, strides, offsets and the strided walks) is `memfit-cpu`'s, whose kernels walk it.

use crate::error::{Error, Result};
pub use memfit_cpu::layout::{contiguous_strides, Layout};

/// The number of elements of `shape`, or an error naming it when that overflows `usize`. Every shape
/// a tensor gets from a caller goes through this (new tensors, reshape, expand), so [`Layout::numel`]
/// never wraps.
pub(crate) fn checked_numel(shape: &[usize]) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::shape(format!("shape {shape:?} has more elements than fit in memory")))
}

/// Resolves a possibly negative dim against a rank.
pub(crate) fn resolve_dim(dim: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r.max(1) {
        return Err(Error::shape(format!("dim {dim} out of range for a tensor of rank {rank}")));
    }
    Ok(d as usize)
}

/// The broadcast shape of two shapes (NumPy/PyTorch rules).
pub(crate) fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(Error::shape(format!("shapes {a:?} and {b:?} cannot be broadcast together"))),
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting() {
        assert_eq!(broadcast_shapes(&[4, 1, 5], &[3, 5]).unwrap(), vec![4, 3, 5]);
        assert!(broadcast_shapes(&[2, 3], &[4, 3]).is_err());
        assert_eq!(resolve_dim(-1, 3).unwrap(), 2);
        assert!(resolve_dim(3, 3).is_err());
    }
}
