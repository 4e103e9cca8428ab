//! memfit-cpu: the `cpu` backend's kernels, one function per method of the tensor crate's
//! `Backend` trait, each named as its method. A kernel takes [`View`]s of tensors the op has
//! already checked and allocated (shapes, dtypes, outputs and workspaces are the op's business),
//! matches the dtype once ([`with_float!`]) and fills its outputs. It knows nothing of tensors,
//! devices, allocators or autograd, and allocates nothing tensor-sized: workspaces come in as views.
//!
//! One file per op family, mirroring the tensor crate's `ops/`. Each also holds the plain
//! description its op hands over (`ConvGeom`, `PoolGeom`, `AttnProblem`, the optimizer steps, ...).
//! What has a path per instruction set (GEMM, GELU, exp) is `memfit-kernels`', chosen at run time.

pub mod dtype;
pub mod error;
pub mod layout;
pub mod view;

pub mod attention;
pub mod cast;
pub mod conv;
pub mod data;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod reduce;
pub mod softmax;
#[cfg(test)]
mod test_values;

pub use error::{Error, Result};
pub use view::View;

/// Every kernel by its backend method's name.
pub mod kernels {
    pub use super::attention::*;
    pub use super::cast::*;
    pub use super::conv::*;
    pub use super::data::*;
    pub use super::dropout::*;
    pub use super::elementwise::*;
    pub use super::embedding::*;
    pub use super::loss::*;
    pub use super::matmul::*;
    pub use super::norm::*;
    pub use super::optim::*;
    pub use super::pool::*;
    pub use super::reduce::*;
    pub use super::softmax::*;
}

/// Elements per parallel task: below twice this, a kernel runs on one thread.
pub const PAR_CHUNK: usize = 1 << 15;
