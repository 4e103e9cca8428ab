//! Activation checkpointing at the model level: a model's checkpointable segments (each GPT block,
//! each ResNet stage, each CNN stage), which of them run checkpointed, and running one.
//!
//! A checkpointed segment keeps only its input between forward and backward and is re-run in
//! backward (`memfit_tensor::autograd::checkpoint`); the rest of the model is untouched. Which
//! segments to checkpoint is the caller's choice (the planner's); by default none is.

use memfit_tensor::autograd::{checkpoint, Pass, Segment};
use memfit_tensor::{Error, Result, Tensor};
use std::sync::{Arc, Mutex};

/// A model's segments and which of them run checkpointed.
pub struct Checkpointing {
    names: Vec<String>,
    on: Mutex<Vec<bool>>,
}

impl Checkpointing {
    /// Segments named `names` (their `state_dict` prefixes), none checkpointed.
    pub fn new(names: Vec<String>) -> Self {
        let on = Mutex::new(vec![false; names.len()]);
        Checkpointing { names, on }
    }

    /// The segments' names, in forward order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Which segments run checkpointed, one flag per segment.
    pub fn set(&self, which: &[bool]) -> Result<()> {
        if which.len() != self.names.len() {
            return Err(Error::invalid(format!(
                "checkpointing: {} flags for {} segments ({})",
                which.len(),
                self.names.len(),
                self.names.join(", ")
            )));
        }
        *self.lock() = which.to_vec();
        Ok(())
    }

    /// The current flags.
    pub fn get(&self) -> Vec<bool> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<bool>> {
        self.on.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs segment `i` on `x`: checkpointed when its flag is set (then `params`, the tensors the
    /// segment reads that may want gradients, get theirs through the checkpoint, and `f` is called
    /// again in backward with [`Pass::Rerun`]), else directly.
    pub fn run(
        &self,
        i: usize,
        x: &Tensor,
        params: impl FnOnce() -> Vec<Tensor>,
        f: impl Fn(&Tensor, Pass) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Result<Tensor> {
        if !self.lock().get(i).copied().unwrap_or(false) {
            return f(x, Pass::Forward);
        }
        let segment: Segment = Arc::new(move |xs: &[Tensor], pass| f(&xs[0], pass));
        checkpoint(&[x], &params(), segment)
    }
}
