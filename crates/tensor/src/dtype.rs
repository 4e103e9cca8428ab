//! Element types. [`DType`], [`Element`] and [`Float`] are defined by `memfit-cpu`, whose kernels
//! compute in them, and are this crate's too.

pub use memfit_cpu::dtype::{DType, Element, Float};
