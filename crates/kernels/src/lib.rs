//! memfit's CPU kernels: the arithmetic of the cpu backend, with no knowledge of tensors, devices
//! or memory accounting (callers hand in pointers to allocator-owned memory).
//!
//! Every kernel has a path per instruction set ([`Isa`]): AVX-512, AVX2/FMA and portable Rust,
//! picked at run time ([`Isa::active`]); tests run each supported path against the portable one.
//! Products in bfloat16 ([`gemm_bf16`], `--precision bf16`) have their own levels, AMX and
//! AVX512-BF16 among them, that compute the same bits (AMX: up to the order of additions).
//! The only memory a kernel keeps is GEMM's per-thread packing workspace, bounded by
//! [`gemm::WORKSPACE_BYTES_PER_THREAD`].

pub mod gemm;
pub mod gemm_bf16;
pub mod isa;
pub mod math;

pub use isa::Isa;
