//! The `cpu` backend: every kernel of [`super::Backend`] is `memfit-cpu`'s function of the same
//! name. The trait's `impl` for [`Cpu`] (generated from the kernel list in `backend/mod.rs`) lowers
//! each argument with [`Lower`] — a tensor to the [`View`] of its storage, anything else as it is —
//! and turns a kernel's refusal into this crate's [`Error`].

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use memfit_cpu::attention::AttnProblem;
use memfit_cpu::conv::ConvGeom;
use memfit_cpu::elementwise::{Binary, Compare, Unary};
use memfit_cpu::optim::{AdamStep, SgdStep};
use memfit_cpu::pool::{Avg, PoolGeom};
use memfit_cpu::View;

/// The CPU backend (stateless: the instruction set is chosen process-wide by `memfit-kernels`).
pub(crate) struct Cpu;

/// An argument as a `memfit-cpu` kernel takes it.
pub(crate) trait Lower {
    type Kernel;
    fn lower(self) -> Result<Self::Kernel>;
}

impl<'a> Lower for &'a Tensor {
    type Kernel = View<'a>;
    fn lower(self) -> Result<View<'a>> {
        self.view()
    }
}

impl<'a> Lower for Option<&'a Tensor> {
    type Kernel = Option<View<'a>>;
    fn lower(self) -> Result<Option<View<'a>>> {
        self.map(Tensor::view).transpose()
    }
}

/// Arguments a kernel takes as the op gives them.
macro_rules! as_is {
    ($($ty:ty),* $(,)?) => {
        $(impl<'a> Lower for $ty {
            type Kernel = Self;
            fn lower(self) -> Result<Self> {
                Ok(self)
            }
        })*
    };
}

as_is!(bool, f64, u64, usize, &'a [u8], &'a mut [u8], &'a mut bool, Unary, Binary, Compare, Avg, SgdStep, AdamStep);
as_is!(&'a ConvGeom, &'a PoolGeom, &'a AttnProblem, memfit_cpu::gemm::Products);

impl From<memfit_cpu::Error> for Error {
    fn from(e: memfit_cpu::Error) -> Self {
        match e {
            memfit_cpu::Error::DType(m) => Error::DType(m),
            memfit_cpu::Error::Invalid(m) => Error::Invalid(m),
        }
    }
}
