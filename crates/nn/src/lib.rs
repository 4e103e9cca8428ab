//! memfit-nn: layers, the model zoo (PyTorch `state_dict` names and layouts), optimizers with
//! PyTorch's update rules, dynamic loss scaling, and safetensors checkpoints.

pub mod amp;
pub mod checkpoint;
pub mod init;
pub mod layers;
pub mod models;
pub mod optim;

pub use models::{build_model, GptConfig, Model, ModelInput, ModelKind, ModelSpec};
pub use optim::{Optimizer, OptimizerConfig};
