//! memfit-train: runs training under a memory budget. A straight stack: each layer imports only
//! the layers below it (`ARCHITECTURE.md` draws it).
//!
//! - settings and errors: [`cost`] (the step-time formula, a [`cost::CostModel`]), [`error`] (every
//!   way a run ends, and the doctor's [`Diagnosis`]), [`output`] (the one home of path checks and
//!   atomic, durable writes; Note [Paths]), [`config`] (a run's settings, their bounds and checks);
//! - data: [`samples`] (where a step's inputs come from: images, text windows or synthetic, written
//!   straight into device tensors), [`task`] (what each model kind learns from, and how a job loads it);
//! - the session: [`trainer`] (the training loop with gradient accumulation and out-of-memory
//!   recovery, Note [Recovery], on any device, `meta` included, so the same code predicts and runs;
//!   the [`trainer::Peers`] trait is all it knows of other processes);
//! - its drivers across processes: [`parallel`] (ranks, `--parallel data|zero1`; Note [Data
//!   parallel]) and [`pipeline`] (stages, `--parallel pipeline`; Note [Pipeline]);
//! - planning: [`dry_run`] (one meta dry run shared by every planner), [`calibration`] (the cost model,
//!   measured), [`planner`] (the micro-batch, checkpointing and storage for a budget), [`stages`] (a
//!   pipeline's cut), [`devices`] (`plan --devices N`), [`doctor`] (when nothing fits, the remedies,
//!   as data; Note [One doctor]);
//! - on top: [`job`] (a run), [`resume`] (training checkpoints, exact; Note [Exact resume]),
//!   [`report`] (the JSON report and the memory table), [`bench`], [`generate`], [`profile`].

pub mod bench;
pub mod calibration;
pub mod config;
pub mod cost;
pub mod devices;
pub mod doctor;
pub mod dry_run;
pub mod error;
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

pub use config::{CheckpointChoice, OptimizerChoice, OptimizerStep, Precision, Segments, TrainConfig};
pub use doctor::plan;
pub use error::TrainError;
pub use error::{Diagnosis, Remedy};
pub use job::{train, Observer, Quiet};
pub use planner::{Plan, PlanRequest};
pub use report::Report;
pub use report::RunSummary;
pub use trainer::{RunOptions, Session, StepEvent};
