//! Typed training configuration (the CLI turns arguments into this; nothing here parses strings
//! except the small enums' `parse`).

use memfit_nn::{GptConfig, ModelKind, OptimizerConfig};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::DeviceKind;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerChoice {
    Sgd,
    Adam,
    AdamW,
}

impl OptimizerChoice {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "sgd" => Ok(OptimizerChoice::Sgd),
            "adam" => Ok(OptimizerChoice::Adam),
            "adamw" => Ok(OptimizerChoice::AdamW),
            other => Err(format!("unknown optimizer {other:?}: expected sgd, adam or adamw")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OptimizerChoice::Sgd => "sgd",
            OptimizerChoice::Adam => "adam",
            OptimizerChoice::AdamW => "adamw",
        }
    }

    /// PyTorch's defaults, with SGD given momentum 0.9 (plain SGD trains these models slowly).
    pub fn config(self, lr: f64) -> OptimizerConfig {
        match self {
            OptimizerChoice::Sgd => {
                OptimizerConfig::Sgd { lr, momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
            }
            OptimizerChoice::Adam => OptimizerConfig::Adam { lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0 },
            OptimizerChoice::AdamW => OptimizerConfig::AdamW { lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01 },
        }
    }
}

/// Everything one training run needs.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: ModelKind,
    /// The GPT's sizes (its vocabulary comes from the text; ignored by image models).
    pub gpt: GptConfig,
    /// Image models: folder with the four Fashion-MNIST IDX files; None = system package or embedded
    /// subset. GPT: a UTF-8 text file; None = Moby Dick shipped inside memfit. `embedded` forces the
    /// shipped data.
    pub data: Option<PathBuf>,
    pub epochs: usize,
    /// Stop after this many optimizer steps (over all epochs).
    pub max_steps: Option<usize>,
    /// The effective batch: samples per optimizer step.
    pub batch_size: usize,
    /// Forces the micro-batch; None = the whole batch, or a plan when `memory` is set and it does not fit.
    pub micro_batch: Option<usize>,
    pub lr: f64,
    pub optimizer: OptimizerChoice,
    /// Device capacity in bytes; None = unlimited.
    pub memory: Option<u64>,
    pub device: DeviceKind,
    pub seed: u64,
    /// Worker threads for kernels; None = all cores.
    pub threads: Option<usize>,
    pub fault: Option<FaultInjection>,
    /// Fraction of the capacity the planner keeps free (0.0 - 0.5).
    pub safety_margin: f64,
    /// Load parameters from this checkpoint before training.
    pub load: Option<PathBuf>,
    /// Save parameters to this checkpoint after training.
    pub save: Option<PathBuf>,
    /// Evaluate on the validation split at the end.
    pub evaluate: bool,
    /// Keep the sample indices of every step in the summary (for tests).
    pub record_samples: bool,
    /// Write a memory profile of the run into this directory (`memfit profile`).
    pub profile: Option<PathBuf>,
    /// Write a memory profile into this directory when the run met an out-of-memory.
    pub profile_on_oom: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelKind::SimpleCnn,
            gpt: GptConfig::default(),
            data: None,
            epochs: 1,
            max_steps: None,
            batch_size: 64,
            micro_batch: None,
            lr: 3e-3,
            optimizer: OptimizerChoice::AdamW,
            memory: None,
            device: DeviceKind::Cpu,
            seed: 0,
            threads: None,
            fault: None,
            safety_margin: 0.0,
            load: None,
            save: None,
            evaluate: true,
            record_samples: false,
            profile: None,
            profile_on_oom: None,
        }
    }
}
