//! memfit-train: runs training under a memory budget.
//!
//! - [`task`]: what each model kind learns from (Fashion-MNIST images, or the characters of a text)
//!   and how a job loads it;
//! - [`samples`]: where a step's inputs come from (images, text windows, or synthetic), written
//!   straight into device tensors;
//! - [`trainer`]: the training loop with gradient accumulation and out-of-memory recovery (Note
//!   [Recovery]) on any device, `meta` included, so the same code predicts and runs;
//! - [`planner`]: chooses the micro-batch for an effective batch and a budget by dry runs on `meta`;
//! - [`doctor`]: when nothing fits, the remedies that would, as data (Note [One doctor]);
//! - [`report`]: the JSON report and the memory table people read;
//! - [`bench`]: step-time and memory benchmarks of the model zoo;
//! - [`generate`]: text from a saved GPT;
//! - [`resume`]: training checkpoints (`--save-every`, `--save-dir`) and `--resume`, exact (Note
//!   [Exact resume]);
//! - [`output`]: the one home of path checks and atomic, durable writes (Note [Paths]);
//! - [`parallel`]: training as one of several ranks (`--parallel data|zero1`; Note [Data parallel]);
//! - [`pipeline`]: a model cut into stages across ranks (`--parallel pipeline`; Note [Pipeline]);
//! - [`profile`]: memory profiles of a run (HTML page, PyTorch snapshot, Chrome trace, summary).

pub mod bench;
pub mod calibration;
pub mod config;
pub mod cost;
pub mod devices;
pub mod doctor;
pub mod dry_run;
mod error;
pub mod generate;
pub mod job;
pub mod output;
pub mod parallel;
pub mod pipeline;
pub mod planner;
pub mod profile;
pub mod report;
pub mod resume;
pub mod samples;
pub mod stages;
pub mod task;
pub mod trainer;

pub use config::{CheckpointChoice, OptimizerChoice, Precision, TrainConfig};
pub use doctor::plan;
pub use error::TrainError;
pub use error::{Diagnosis, Remedy};
pub use job::{train, Observer, Quiet};
pub use planner::{Plan, PlanRequest};
pub use report::Report;
pub use report::RunSummary;
pub use trainer::{RunOptions, Session, StepEvent};
