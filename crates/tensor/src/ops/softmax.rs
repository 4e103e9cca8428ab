//! softmax and log_softmax over one dim (numerically stable: max subtracted).

use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub fn softmax(x: &Tensor, dim: isize) -> Result<Tensor> {
    let _ = (x, dim);
    Err(Error::invalid("softmax is not implemented yet"))
}

pub fn log_softmax(x: &Tensor, dim: isize) -> Result<Tensor> {
    let _ = (x, dim);
    Err(Error::invalid("log_softmax is not implemented yet"))
}
