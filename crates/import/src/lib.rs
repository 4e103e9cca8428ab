//! memfit-import: PyTorch programs as memfit models. A `torch.export` archive (`.pt2`, written by
//! `torch.export.save`) holds a model's forward pass as a graph of ATen ops with typed arguments, its
//! weights under their `state_dict` names, and a signature saying which graph inputs are parameters,
//! buffers and the user's inputs. This crate reads one ([`Archive::open`]: the zip, `models/model.json`
//! and `data/weights/`, checked against the schema versions it knows) and runs it on a memfit
//! [`memfit_tensor::Device`] ([`Program`]): every node becomes the memfit op of the same meaning, so
//! memfit's autograd differentiates it, its allocator accounts every byte, and `meta` predicts it.
//!
//! What it knows of the archive format is in `archive.rs` (Note [The pt2 archive]); which ATen ops it
//! runs, with which arguments, is `program.rs`'s table; which parts of a graph can run with activation
//! checkpointing is `segments.rs`'s (Note [Imported segments]). An op, an argument or a dtype it does not know
//! is an error that names it, raised when the archive is opened, before any weight is read.
//!
//! Knows nothing of training: the train crate makes a model of a [`Program`].

mod archive;
mod program;
mod segments;

pub use archive::{Archive, Arg, GraphInput, Node, ValueMeta, Weight, FLOAT32, INT64};
pub use program::{smallest_batch, Program, SUPPORTED_OPS};

/// An archive that cannot be read or run, with what is wrong and where; or the device's own error
/// while its weights are made (an out-of-memory stays one, so a planner can weigh it).
#[derive(Debug)]
pub enum ImportError {
    Archive(String),
    Tensor(memfit_tensor::Error),
}

impl std::fmt::Display for ImportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImportError::Archive(m) => f.write_str(m),
            ImportError::Tensor(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ImportError {}

impl From<memfit_tensor::Error> for ImportError {
    fn from(e: memfit_tensor::Error) -> Self {
        ImportError::Tensor(e)
    }
}

impl From<ImportError> for memfit_tensor::Error {
    fn from(e: ImportError) -> Self {
        match e {
            ImportError::Tensor(e) => e,
            ImportError::Archive(m) => memfit_tensor::Error::invalid(m),
        }
    }
}

pub type Result<T> = std::result::Result<T, ImportError>;
