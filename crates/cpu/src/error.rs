//! What a kernel can refuse: a dtype it does not compute in, or data it cannot take (an index out of
//! range, a view that is not contiguous, a buffer shorter than its plan). The tensor crate turns these
//! into its own errors.

use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A dtype the kernel does not support, or a view read as another dtype.
    DType(String),
    /// Anything else about the data (an index out of range, a layout the kernel cannot take).
    Invalid(String),
}

impl Error {
    pub fn dtype(msg: impl Into<String>) -> Self {
        Error::DType(msg.into())
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::DType(m) => write!(f, "dtype error: {m}"),
            Error::Invalid(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Refuses a buffer shorter than a kernel's plan: kernels that write outputs or workspaces through
/// raw pointers sized from their parameters check each buffer first, so a short one is reported,
/// not overrun.
pub(crate) fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::invalid(format!("{what}: {have} elements where the kernel needs {need}")));
    }
    Ok(())
}

/// The position of the first index outside `0..n` (negative or too large), if any: the one rule for
/// embedding indices and class targets, each of which words its own error.
pub(crate) fn first_out_of_range(ix: &[i64], n: usize) -> Option<usize> {
    ix.iter().position(|&i| i < 0 || i as u64 >= n as u64)
}
