//! Errors a run can end with, each with a message that names the thing and what to do.

use memfit_tensor::OutOfMemory;
use std::fmt;

#[derive(Debug)]
pub enum TrainError {
    /// Training data could not be read.
    Data(memfit_data::DataError),
    /// Even the smallest micro-batch does not fit; `advice` says what would.
    OutOfMemory { oom: Box<OutOfMemory>, advice: String },
    /// A checkpoint could not be read or written.
    Checkpoint(String),
    /// Training diverged: a loss or a parameter is NaN or infinite (the message names the step).
    NotFinite(String),
    /// Stopped by a signal (SIGINT, SIGTERM) after a whole step; the message says whether and how the
    /// run can be resumed. Exit code 128 + `signal`.
    Interrupted { signal: i32, message: String },
    /// The run does not fit its budget at all: why, and the remedies that would fit (Note [One doctor]).
    DoesNotFit(Box<crate::doctor::Diagnosis>),
    /// A configuration that cannot work (message says why).
    Invalid(String),
    /// Any other engine error.
    Engine(memfit_tensor::Error),
}

impl TrainError {
    pub fn as_oom(&self) -> Option<&OutOfMemory> {
        match self {
            TrainError::OutOfMemory { oom, .. } => Some(oom),
            TrainError::Engine(e) => e.as_oom(),
            _ => None,
        }
    }
}

impl fmt::Display for TrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainError::Data(e) => write!(f, "{e}"),
            TrainError::OutOfMemory { oom, advice } => {
                write!(f, "{oom}")?;
                if !advice.is_empty() {
                    write!(f, "\n{advice}")?;
                }
                Ok(())
            }
            TrainError::Checkpoint(m) | TrainError::Invalid(m) | TrainError::NotFinite(m) => write!(f, "{m}"),
            TrainError::Engine(e) => write!(f, "{e}"),
            TrainError::DoesNotFit(d) => write!(f, "{d}"),
            TrainError::Interrupted { message, .. } => write!(f, "{message}"),
        }
    }
}

impl std::error::Error for TrainError {}

impl From<memfit_tensor::Error> for TrainError {
    fn from(e: memfit_tensor::Error) -> Self {
        TrainError::Engine(e)
    }
}

impl From<memfit_data::DataError> for TrainError {
    fn from(e: memfit_data::DataError) -> Self {
        TrainError::Data(e)
    }
}
