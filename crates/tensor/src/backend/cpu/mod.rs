//! The `cpu` backend: every kernel of [`super::Backend`], computed on this machine's CPU. One file per
//! op family, mirroring `ops/`; each kernel is a function named as its trait method (the trait's
//! `impl` for [`Cpu`] is generated from the kernel list in `backend/mod.rs` and calls
//! `kernels::<name>`), matches the dtype once (`with_float!`) and calls `memfit-kernels` where a path
//! per instruction set exists.

pub(crate) mod attention;
pub(crate) mod cast;
pub(crate) mod conv;
pub(crate) mod data;
pub(crate) mod dropout;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod gemm;
pub(crate) mod loss;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod pool;
pub(crate) mod reduce;
pub(crate) mod softmax;

/// Every kernel by its trait method's name.
pub(crate) mod kernels {
    pub(crate) use super::attention::*;
    pub(crate) use super::cast::*;
    pub(crate) use super::conv::*;
    pub(crate) use super::data::*;
    pub(crate) use super::dropout::*;
    pub(crate) use super::elementwise::*;
    pub(crate) use super::embedding::*;
    pub(crate) use super::loss::*;
    pub(crate) use super::matmul::*;
    pub(crate) use super::norm::*;
    pub(crate) use super::optim::*;
    pub(crate) use super::pool::*;
    pub(crate) use super::reduce::*;
    pub(crate) use super::softmax::*;
}

/// The CPU backend (stateless: the instruction set is chosen process-wide by `memfit-kernels`).
pub(crate) struct Cpu;
