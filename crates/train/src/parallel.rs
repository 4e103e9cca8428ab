//! Training across ranks (`--parallel`): what a [`Session`](crate::Session) does differently when it
//! is one of several processes that train one model together.
//!
//! Note [Data parallel]: every rank holds the whole model. Each effective batch (the window) is the
//! global one; rank r takes its shard (`memfit_dist::partition::shard`), and each micro-batch's loss is
//! weighted by its share of the *global* window (Note [Loss normalization]), so the sum over ranks of
//! the accumulated gradients is exactly the single-process gradient of the window. Gradients are summed
//! by all-reduce, piece by piece through one persistent bucket (category `communication`), then every rank applies
//! the same update to the same parameters; a fingerprint of the parameters is compared across ranks
//! after every step, so a divergence is an error, never a silent drift. Out-of-memory recovery stays
//! local: a rank re-runs its own samples smaller and no collective happens inside a micro-batch.
//! Losses, accuracies and recoveries are summed over ranks; evaluation is sharded the same way.
//!
//! Note [ZeRO-1]: `--parallel zero1` is data parallel with the optimizer state partitioned. The
//! parameters' elements, flattened in `Model::parameters()` order, are cut into `size` contiguous
//! ranges (`memfit_dist::partition::shard`, as DeepSpeed's stage 1 cuts its flat buffer): rank r's
//! optimizer runs over views of its range (a parameter that straddles two ranges is two slices), keeps
//! state for those elements only, and updates them from the same views of the summed gradients; then
//! each slice's owner broadcasts the new values in place. Each rank holds 1/N of the optimizer state
//! (to an element), with no extra buffer, and since the optimizers' rules are element-wise, the update
//! is bit for bit data parallel's.

use crate::error::TrainError;
use crate::trainer::{Peers, Session};
use memfit_dist::{partition, GradientBucket, Group};
use memfit_nn::{Model, Optimizer};
use memfit_tensor::{Device, Phase, Tensor};
use std::sync::Arc;

pub use crate::config::ParallelMode;

/// A session's place among its ranks.
pub struct Ranks {
    pub group: Arc<dyn Group>,
    pub mode: ParallelMode,
    bucket: GradientBucket,
    /// ZeRO-1: every rank's slices of the parameters (Note [ZeRO-1]); empty for data parallel.
    slices: Vec<Slice>,
}

/// Elements `start..start + len` of parameter `param` (flattened), whose optimizer state `owner` keeps;
/// `view` is that range of the parameter's storage.
struct Slice {
    param: usize,
    start: usize,
    len: usize,
    owner: usize,
    view: Tensor,
}

/// A flat range of `t`'s elements sharing its storage, outside any graph.
fn flat_range(t: &Tensor, start: usize, len: usize) -> Result<Tensor, TrainError> {
    let _ng = t.device().no_grad();
    Ok(t.reshape(&[-1])?.narrow(0, start, len)?.detach())
}

impl Ranks {
    /// Joins `model` to `group`: allocates the gradient bucket and, for ZeRO-1, returns the optimizer
    /// over this rank's slices of the parameters (the caller's optimizer is replaced by it).
    pub fn join(
        group: Arc<dyn Group>,
        mode: ParallelMode,
        device: &Device,
        model: &dyn Model,
        optimizer: &Optimizer,
    ) -> Result<(Ranks, Option<Optimizer>), TrainError> {
        if mode == ParallelMode::Pipeline {
            return Err(TrainError::Invalid("internal: a pipeline stage is built by Session::new_stage".into()));
        }
        let _phase = device.enter_phase(Phase::Setup);
        let params = model.parameters();
        let total: usize = params.iter().map(|(_, p)| p.numel()).sum();
        let bucket = GradientBucket::new(device, total, memfit_dist::collective::DEFAULT_BUCKET_BYTES)?;
        let mut slices = Vec::new();
        let mut sharded = None;
        if mode == ParallelMode::Zero1 {
            let mut offset = 0;
            for (param, (_, p)) in params.iter().enumerate() {
                let (first, last) = (offset, offset + p.numel());
                for owner in 0..group.size() {
                    let range = partition::shard(total, owner, group.size());
                    let (a, b) = (range.start.max(first), range.end.min(last));
                    if a < b {
                        let view = flat_range(p, a - first, b - a)?;
                        slices.push(Slice { param, start: a - first, len: b - a, owner, view });
                    }
                }
                offset = last;
            }
            let mine = slices
                .iter()
                .filter(|s| s.owner == group.rank())
                .map(|s| (format!("{}[{}..{}]", params[s.param].0, s.start, s.start + s.len), s.view.clone()))
                .collect();
            sharded = Some(Optimizer::new(mine, optimizer.config()));
        }
        Ok((Ranks { group, mode, bucket, slices }, sharded))
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's samples of a window.
    pub fn shard<'a>(&self, window: &'a [usize]) -> &'a [usize] {
        &window[partition::shard(window.len(), self.rank(), self.size())]
    }

    /// Sums every rank's gradients into each rank's (Note [Data parallel]); under ZeRO-1, hands this
    /// rank's slices their ranges of the summed gradients (views: nothing is copied).
    pub fn reduce_gradients(&self, model: &dyn Model) -> Result<(), TrainError> {
        let params: Vec<Tensor> = model.parameters().into_iter().map(|(_, p)| p).collect();
        self.bucket.all_reduce(self.group.as_ref(), &params)?;
        for s in self.slices.iter().filter(|s| s.owner == self.rank()) {
            let grad = params[s.param].grad().ok_or_else(|| TrainError::Invalid("internal: no gradient".into()))?;
            s.view.set_grad(Some(flat_range(&grad, s.start, s.len)?));
        }
        Ok(())
    }

    /// After the optimizer step: under ZeRO-1 each slice's owner broadcasts its updated values; every
    /// gradient is freed.
    pub fn finish_step(&self, model: &dyn Model) -> Result<(), TrainError> {
        for s in &self.slices {
            memfit_dist::collective::broadcast(self.group.as_ref(), &s.view, s.owner)?;
            s.view.set_grad(None);
        }
        for (_, p) in model.parameters() {
            p.set_grad(None);
        }
        Ok(())
    }

    /// Errors unless every rank holds the same parameters after `step`.
    pub fn check_replicas(&self, model: &dyn Model, step: usize) -> Result<(), TrainError> {
        let params: Vec<Tensor> = model.parameters().into_iter().map(|(_, p)| p).collect();
        let Some(mine) = memfit_dist::collective::fingerprint(&params)? else { return Ok(()) };
        let all = self.group.all_gather_u64(mine);
        if all.iter().any(|&f| f != mine) {
            return Err(TrainError::Invalid(format!(
                "internal error: the ranks' parameters differ after step {step} (fingerprints {all:x?}); the run \
                 stopped rather than train diverged replicas"
            )));
        }
        Ok(())
    }

    /// Sums small host values over ranks (losses, counts).
    pub fn sum(&self, values: &mut [f64]) {
        self.group.all_reduce_sum_f64(values)
    }

    /// True when any rank says true (so all ranks stop after the same step).
    pub fn any(&self, flag: bool) -> bool {
        memfit_dist::collective::any(self.group.as_ref(), flag)
    }
}

impl Peers for Ranks {
    fn shard<'a>(&self, ids: &'a [usize]) -> &'a [usize] {
        Ranks::shard(self, ids)
    }
    fn reduce_gradients(&self, model: &dyn Model) -> Result<(), TrainError> {
        Ranks::reduce_gradients(self, model)
    }
    fn finish_step(&self, model: &dyn Model) -> Result<(), TrainError> {
        Ranks::finish_step(self, model)
    }
    fn sum(&self, values: &mut [f64]) {
        Ranks::sum(self, values)
    }
    fn check_replicas(&self, model: &dyn Model, step: usize) -> Result<(), TrainError> {
        Ranks::check_replicas(self, model, step)
    }
    fn any(&self, flag: bool) -> bool {
        Ranks::any(self, flag)
    }
}

impl Session {
    /// Trains from now on as one rank of `group` in `mode` (Note [Data parallel], Note [ZeRO-1]):
    /// allocates the gradient buckets and, for ZeRO-1, keeps optimizer state for this rank's
    /// parameters only. Call before the first step.
    pub fn join(
        &mut self,
        group: std::sync::Arc<dyn memfit_dist::Group>,
        mode: ParallelMode,
    ) -> Result<(), TrainError> {
        let (ranks, sharded) = Ranks::join(group, mode, &self.device, self.model.as_ref(), &self.optimizer)?;
        if let Some(optimizer) = sharded {
            self.optimizer = optimizer;
        }
        self.peers = Some(Box::new(ranks));
        Ok(())
    }
}
