//! The one error type of tensor operations.

use memfit_memory::OutOfMemory;
use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
pub enum Error {
    /// The allocator could not provide the memory; boxed because it carries a report.
    OutOfMemory(Box<OutOfMemory>),
    /// Shapes that do not fit the op.
    Shape(String),
    /// A dtype the op does not support, or mismatched dtypes.
    DType(String),
    /// Tensors on different devices, or data asked of a device that holds none (meta).
    Device(String),
    /// Anything else a caller got wrong (bad argument, backward twice, ...).
    Invalid(String),
}

impl Error {
    pub fn shape(msg: impl Into<String>) -> Self {
        Error::Shape(msg.into())
    }
    pub fn dtype(msg: impl Into<String>) -> Self {
        Error::DType(msg.into())
    }
    pub fn device(msg: impl Into<String>) -> Self {
        Error::Device(msg.into())
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }
    pub fn as_oom(&self) -> Option<&OutOfMemory> {
        match self {
            Error::OutOfMemory(oom) => Some(oom),
            _ => None,
        }
    }
}

impl From<OutOfMemory> for Error {
    fn from(oom: OutOfMemory) -> Self {
        Error::OutOfMemory(Box::new(oom))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory(oom) => write!(f, "{oom}"),
            Error::Shape(m) => write!(f, "shape error: {m}"),
            Error::DType(m) => write!(f, "dtype error: {m}"),
            Error::Device(m) => write!(f, "device error: {m}"),
            Error::Invalid(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for Error {}
