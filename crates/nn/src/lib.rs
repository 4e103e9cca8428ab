//! memfit-nn: layers, the model zoo (PyTorch `state_dict` names and layouts), optimizers with
//! PyTorch's update rules, dynamic loss scaling, safetensors checkpoints, and which model segments
//! run with activation checkpointing.

pub mod amp;
pub mod checkpoint;
pub mod checkpointing;
pub mod init;
pub mod layers;
pub mod models;
pub mod optim;

pub use checkpointing::Checkpointing;
pub use models::{build_model, build_stage, stage_units, Exported, GptConfig, Model, ModelInput, ModelKind, ModelSpec};
pub use optim::{Optimizer, OptimizerConfig, StateFormat};
