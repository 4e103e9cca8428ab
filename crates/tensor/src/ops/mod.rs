//! Tensor operations, one file per family: each holds what the op means — its API, argument checks,
//! output shapes, its backward and its unit tests. Every op allocates its outputs (and workspaces)
//! through the device's allocator, the same on every device, asks the device's backend to fill them
//! (`crate::backend`: the CPU kernels are the crate `memfit-cpu`, `meta` computes nothing), and records
//! an autograd node when grad is needed.

mod attention;
mod cast;
mod conv;
mod dropout;
mod elementwise;
mod embedding;
mod loss;
mod matmul;
mod norm;
mod optim;
mod pool;
mod reduce;
mod softmax;
mod view;

pub use attention::*;
pub use conv::*;
pub use dropout::*;
pub use elementwise::*;
pub use embedding::*;
pub use loss::*;
pub use matmul::*;
pub use norm::*;
pub use optim::*;
pub use pool::*;
pub use reduce::*;
pub use softmax::*;
pub use view::{cat, pad, roll, stack};

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::DType;
use memfit_memory::Category;

/// Errors unless kernels compute in `dtype` (f32 and f64). Ops check this before they allocate or run
/// anything, on every device, so `meta` refuses exactly what `cpu` refuses.
pub(crate) fn check_computable(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        other => Err(Error::dtype(format!("{op} supports f32 and f64, not {other}"))),
    }
}

/// A fresh output tensor for `op`, on `like`'s device, counted as a temporary until autograd saves it.
/// `dtype` is the dtype the op computes in, so it is checked ([`check_computable`]).
pub(crate) fn output(like: &Tensor, shape: &[usize], dtype: DType, op: &'static str) -> Result<Tensor> {
    check_computable(op, dtype)?;
    output_any(like, shape, dtype, op)
}

/// As [`output`], for a dtype the op stores rather than computes in: indices, masks, casts, copies.
pub(crate) fn output_any(like: &Tensor, shape: &[usize], dtype: DType, op: &'static str) -> Result<Tensor> {
    Tensor::empty(like.device(), shape, dtype, Category::Temporary, op)
}

/// A workspace of `len` elements of `dtype` that only a GPU's kernels use (a GPU target's: `cuda` and
/// `meta:cuda` allocate it alike); None on the cpu target.
pub(crate) fn gpu_workspace(like: &Tensor, len: usize, dtype: DType, op: &'static str) -> Result<Option<Tensor>> {
    if like.device().target() != crate::Target::Cuda {
        return Ok(None);
    }
    output_any(like, &[len.max(1)], dtype, op).map(Some)
}

/// Rows a fused layer-norm-linear or GELU-linear runs per block through its scratch: the cpu
/// kernels' block (`cpu_rows`: LN_ROWS or GELU_ROWS, one that stays in cache), or on a GPU target
/// [`GPU_FUSED_ROWS`] (`cuda` and `meta:cuda` alike).
pub(crate) fn fused_block_rows(like: &Tensor, cpu_rows: usize) -> usize {
    match like.device().target() {
        crate::Target::Cpu => cpu_rows,
        crate::Target::Cuda => GPU_FUSED_ROWS,
    }
}

/// A GPU's rows per fused block: cuBLAS ran GPT-2's MLP products on blocks of 1,024 rows at 33-36
/// TFLOP/s on an H100, on blocks of 4,096 at 42-47 (the QKV product is slow at either size, for a
/// reason of its own: `gpu.rs`); a block of 4,096 costs GPT-2's GELU-linear 48 MiB of scratch (96 in
/// a backward beside its input).
pub(crate) const GPU_FUSED_ROWS: usize = 4096;

/// How `t`'s device computes matrix products ([`crate::Device::products`]).
pub(crate) fn products_of(t: &Tensor) -> crate::Products {
    t.device().products()
}

/// The 16-bit dtype that `products` round f32 operands to (bf16, fp16), whose saved tensors hold
/// their operand bits already (Note [Half-precision storage]); None for f32 products.
pub(crate) fn operand_dtype_of(products: crate::Products) -> Option<DType> {
    match products {
        crate::Products::Bf16 => Some(DType::BF16),
        crate::Products::F16 => Some(DType::F16),
        crate::Products::F32 => None,
    }
}

/// Whether `x`, saved for backward, is kept in the 16-bit format that products of `g` (the f32
/// gradient it meets) round their operands to, on a GPU target: there a backward may hand its
/// kernels `x` as saved, without restoring it to f32 (a linear layer's weight gradient reads it as
/// its operand bits; GELU-linear's and layer-norm-linear's kernels widen each element as restoring
/// it would).
pub(crate) fn saved_in_operand_format(x: &crate::autograd::Compact, g: &Tensor) -> bool {
    let Some(own) = operand_dtype_of(products_of(g)) else { return false };
    g.device().target() == crate::Target::Cuda && g.dtype() == DType::F32 && x.stored().dtype() == own
}

/// A zero-filled output.
pub(crate) fn zeros_output(like: &Tensor, shape: &[usize], dtype: DType, op: &'static str) -> Result<Tensor> {
    let t = output(like, shape, dtype, op)?;
    like.device().backend().fill_zeros(&t)?;
    Ok(t)
}

/// Errors unless all tensors live on one device and share a dtype.
pub(crate) fn check_same(op: &str, tensors: &[&Tensor]) -> Result<()> {
    let first = tensors[0];
    for t in &tensors[1..] {
        if !t.device().same(first.device()) {
            return Err(Error::device(format!("{op}: tensors are on different devices")));
        }
        if t.dtype() != first.dtype() {
            return Err(Error::dtype(format!("{op}: dtypes {} and {} differ", first.dtype(), t.dtype())));
        }
    }
    Ok(())
}
