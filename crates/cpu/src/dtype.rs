//! Element types: [`DType`], [`Element`] (a Rust type stored in tensors) and the [`Float`] trait the
//! kernels are generic over. The match from a dtype to the Rust type a kernel computes in lives in
//! one place: [`crate::with_float!`].

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    U8,
    Bool,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type a tensor's elements can have.
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
        }
    };
}
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(half::f16, DType::F16);
element!(half::bf16, DType::BF16);
element!(i64, DType::I64);
element!(u8, DType::U8);
element!(bool, DType::Bool);

/// A dtype that CPU kernels compute in (f32, f64). Half types are storage formats: cast to f32 to compute.
pub trait Float:
    num_traits::Float
    + memfit_kernels::gemm::GemmScalar
    + num_traits::FromPrimitive
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + std::iter::Sum
    + Default
    + fmt::Debug
    + Send
    + Sync
    + 'static
{
    const DTYPE: DType;
    fn of(v: f64) -> Self;
    fn f64(self) -> f64;
    fn erf(self) -> Self;
    /// The slice as `f32` when `Self` is f32 (the type of the vectorised math kernels), else None.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// The slice as `f32` when `Self` is f32, else None.
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
}

impl Float for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn of(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erff(self)
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
}

impl Float for f64 {
    const DTYPE: DType = DType::F64;
    #[inline(always)]
    fn of(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

/// Runs `$body` with `$T` bound to the Rust type of a float dtype (f32 or f64); any other dtype
/// returns a dtype error naming `$op`.
#[macro_export]
macro_rules! with_float {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
            other => return Err($crate::error::Error::dtype(format!("{} supports f32 and f64, not {}", $op, other))),
        }
    };
}
