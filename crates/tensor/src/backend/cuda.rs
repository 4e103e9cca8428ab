//! The `cuda` backend: not built yet. Opening a `cuda` device says so.

use crate::error::{Error, Result};

pub(crate) fn open(_ordinal: u32) -> Result<super::Opened> {
    Err(Error::device("--device cuda: this memfit has no CUDA backend yet"))
}
