//! memfit's CPU kernels: the arithmetic of the cpu backend, with no knowledge of tensors, devices
//! or memory accounting (callers hand in pointers to allocator-owned memory).
//!
//! Every kernel has a path per instruction set ([`Isa`]): AVX-512, AVX2/FMA and portable Rust,
//! picked at run time ([`Isa::active`]); tests run each supported path against the portable one.
//! The only memory a kernel keeps is GEMM's per-thread packing workspace, bounded by
//! [`gemm::WORKSPACE_BYTES_PER_THREAD`].

pub mod gemm;
pub mod isa;
pub mod math;

pub use isa::Isa;
