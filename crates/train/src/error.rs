//! Errors a run can end with, each with a message that names the thing and what to do.

use memfit_tensor::memory::format_bytes;
use memfit_tensor::OutOfMemory;
use serde::Serialize;
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
    DoesNotFit(Box<Diagnosis>),
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

/// Why a run does not fit, and what would.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diagnosis {
    /// What does not fit and what the least of it needs, for people.
    pub problem: String,
    pub capacity_bytes: Option<u64>,
    /// What the run as asked needs at the least (its smallest micro-batch, every segment it may
    /// checkpoint re-run): peak reserved.
    pub needs_bytes: u64,
    /// Those that keep the numbers and run here first, each group fastest first.
    pub remedies: Vec<Remedy>,
}

/// One way to make the run fit, with the plan it gives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Remedy {
    /// What it changes, for people ("a budget of 42MiB").
    pub what: String,
    /// What the planner then chooses ("micro-batch 8 x 4 accumulation steps = effective batch 32").
    pub plan: String,
    /// The command line that applies it: the user's own, with only the flags it needs changed.
    pub command: String,
    /// The flags it changes: each set to a value, or removed (null).
    pub flags: Vec<(String, Option<String>)>,
    pub predicted_peak_reserved_bytes: u64,
    pub predicted_step_time_ms: Option<f64>,
    /// The step time is in nominal units (a model too large to time on this host).
    pub nominal_time: bool,
    /// It changes the numbers the run computes (half storage of saved activations).
    pub changes_numbers: bool,
    /// Ranks it runs on (1: this process alone).
    pub ranks: usize,
    /// Why this memfit cannot run it (None: it can).
    pub unavailable: Option<String>,
}

impl std::fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.problem)?;
        if self.remedies.is_empty() {
            return write!(f, " Use a smaller model or batch.");
        }
        write!(
            f,
            "\nremedies (peak reserved predicted exactly on meta; step time from the cost model), those that keep \
             the numbers first:"
        )?;
        for r in &self.remedies {
            let time = r
                .predicted_step_time_ms
                .map_or(String::new(), |t| format!(", {}", crate::cost::describe_step(r.nominal_time, t)));
            let numbers = if r.changes_numbers { "; changes the numbers" } else { "" };
            write!(
                f,
                "\n  {}: {}; peak {}{time}{numbers}",
                r.what,
                r.plan,
                format_bytes(r.predicted_peak_reserved_bytes)
            )?;
            match &r.unavailable {
                Some(why) => write!(f, "\n    (this memfit cannot run it: {why})\n    {}", r.command)?,
                None => write!(f, "\n    {}", r.command)?,
            }
        }
        write!(f, "\n  or a smaller model or batch.")
    }
}

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
