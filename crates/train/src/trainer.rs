//! The training loop: windows of `effective_batch` samples, each run as micro-batches whose
//! gradients accumulate, then one optimizer step. The same code runs on `cpu` (training) and on
//! `meta` (prediction): nothing here depends on data values except the reported loss and accuracy.
//!
//! It knows no task: samples come from any [`Samples`] (images and labels, text windows), and the
//! loss is the cross-entropy of the model's logits over their last dim against int64 targets shaped
//! like the logits without it: one prediction per image, one per position of a text window. The
//! reported accuracy counts argmax hits over all predictions.
//!
//! Note [Loss normalization]: a micro-batch of `m` samples out of a window of `n` back-propagates
//! `mean_loss(micro) * m / n`, so the accumulated gradient is exactly the gradient of the mean loss
//! over the window, also for a last, partial window and for micro-batches of unequal size. (Batch-norm
//! statistics are per micro-batch: a known, documented difference from one big batch.)
//!
//! Note [Recovery]: when an allocation fails inside a micro-batch, everything the attempt allocated is
//! dropped (its tensors go out of scope and the backward is transactional, see
//! `memfit_tensor::autograd`), the allocated bytes are checked to be back at their level before the
//! attempt, the model's buffers (batch-norm running statistics) are restored from a snapshot taken at
//! the start of the attempt, and the allocator's cache is released. The same samples then run again at the same size
//! once (a transient failure, such as fragmentation the released cache cures or an injected fault,
//! passes without shrinking anything); if they fail again they are re-run as two halves. The smaller
//! micro-batch sticks, and grows back after `grow_after` successful steps. Each sample of the window
//! contributes exactly once to its update. A single sample that fails twice ends the run with the
//! out-of-memory explanation.
//!
//! Accumulating, every micro-batch of a window after the first commits each gradient into `.grad` as
//! soon as its backward has completed it (`autograd::backward_as_complete`), so that a pass never
//! holds a second set of gradients beside the window's. Such a pass is not transactional: when it
//! fails, `.grad` is partly updated, so every gradient is dropped and the micro-batches they held are
//! replayed, at their sizes and in their order, before the failed one is tried again; the rest of
//! that window commits at the end of each pass, as the first micro-batch does, so a window replays
//! at most once however close together its failures come. A replay runs
//! exactly as the first time except that the model's buffers stay as the first run left them
//! (`Device::replay`: batch norm normalizes with the batch's own statistics, so its gradients do
//! not depend on them). The window's update is the same bits as without the failure.
//!
//! Note [Step in backward]: with `--optimizer-step in-backward`, a window of one micro-batch updates
//! each parameter the moment its gradient is complete (`autograd::backward_handing_over`, then
//! `Optimizer::step_one`: the same kernel on the same gradient as the step after backward, so the
//! same bits) and frees that gradient, so the gradients never all exist at once: PyTorch's
//! post-accumulate-grad-hook recipe. The optimizer's state is made before the pass. A parameter is
//! handed over only when every node that reads it has run its backward, so nothing reads a
//! parameter after its update. A window split in parts (by the plan or by recovery) accumulates and
//! steps after backward as usual; ranks (which sum gradients first) and fp16 storage (which skips a
//! window whose gradients overflowed) cannot step inside backward and are refused by name.
//!
//! An update cannot be undone, so the first one is a point of no return: recovery may drop and re-run
//! an attempt before it, never after. Before the pass, the window is rehearsed
//! (`Device::rehearse`: the same code and requests on the same allocator, no kernel) until a
//! rehearsal needs no new memory at all (every request served by a free block; it may not release
//! the cache to make room either: `Device::set_keep_cache`). The allocator is deterministic, so the
//! real pass from that layout (`Device::layout_digest`: segments and blocks) makes the same requests
//! in the same places and needs no new memory: nothing it asks for can be refused. From its first
//! update it runs `Device::set_held_only` (an injected fault, which stands for a refusal, skips such
//! requests; a pass that needed new memory anyway would end the run as memfit's error, and none ever
//! does: `train/tests/step_in_backward.rs` injects a fault at every request). A failure in a
//! rehearsal (a budget too tight to hold the pass without releasing the cache is an out-of-memory
//! there) or before the first update is an ordinary failed attempt. A layout proven for a
//! micro-batch is remembered, so only the first step from it rehearses (usually twice: the first
//! rehearsal makes the segments, the second finds them); meta rehearses alike and predicts it all.

use crate::error::TrainError;
use crate::samples::Samples;
use memfit_nn::{Model, Optimizer};
use memfit_tensor::{autograd, ops, Category, DType, Device, Phase, Tensor};
use std::collections::VecDeque;
use std::time::Instant;

/// A model, its optimizer and the device they live on.
pub struct Session {
    pub device: Device,
    pub model: Box<dyn Model>,
    pub optimizer: Optimizer,
    /// Optimizer steps skipped because a gradient overflowed (fp16 storage only).
    pub skipped_steps: usize,
    /// The processes this session trains with, if any: ranks that share every window
    /// (`parallel::Ranks`) or the other stages of a pipeline (`pipeline::Pipeline`).
    pub peers: Option<Box<dyn Peers>>,
    /// The fewest samples a training micro-batch can hold (`ModelSpec::smallest_micro_batch`):
    /// recovery never splits below it.
    pub smallest_micro_batch: usize,
    /// A window of one micro-batch is updated inside its backward ([`Session::set_optimizer_step`],
    /// Note [Step in backward]).
    pub(crate) step_in_backward: bool,
    /// (layout digest, micro-batch) from which a rehearsal proved a step in backward needs no new
    /// memory (Note [Step in backward]).
    pub(crate) proven: Option<(u64, usize)>,
    /// fp16's dynamic loss scale (GradScaler's rules: from 65536, halved on an overflow, which
    /// skips the step, doubled after 2000 clean steps); None in the other precisions.
    pub(crate) scaler: std::sync::Mutex<Option<memfit_nn::amp::GradScaler>>,
}

/// What a session does differently as one of several processes that train one model: one of ranks
/// that share every window (`parallel::Ranks`: `--parallel data|zero1`, Note [Data parallel]) or a
/// stage of a pipeline (`pipeline::Pipeline`: `--parallel pipeline`, Note [Pipeline]). The session
/// calls these at fixed points of its loop and knows nothing else of them; the drivers build on the
/// session, never the other way. Every default is what a process alone does.
pub trait Peers: Send + Sync {
    /// The ids of `ids` (a window, or the evaluation set) this process takes.
    fn shard<'a>(&self, ids: &'a [usize]) -> &'a [usize] {
        ids
    }
    /// Runs `window` (training when `train`, else evaluation) when its micro-batches cross processes:
    /// the results summed over the processes and the recoveries it took; None: the session runs them
    /// as alone.
    fn run_window(
        &self,
        _session: &Session,
        _samples: &dyn Samples,
        _window: &[usize],
        _micro: &mut usize,
        _recover: bool,
        _train: bool,
    ) -> Option<Result<(MicroResult, usize), TrainError>> {
        None
    }
    /// Micro-batches an evaluation window holds, when evaluation runs in windows ([`Peers::run_window`]).
    fn eval_round(&self) -> Option<usize> {
        None
    }
    /// After backward, before the update: the gradients summed across ranks.
    fn reduce_gradients(&self, _model: &dyn Model) -> Result<(), TrainError> {
        Ok(())
    }
    /// Whether any process's gradients overflowed, when every process must skip the step together.
    fn overflowed(&self, local: bool) -> bool {
        local
    }
    /// After the update (or the skipped one): ZeRO-1's owners broadcast their parameters.
    fn finish_step(&self, _model: &dyn Model) -> Result<(), TrainError> {
        Ok(())
    }
    /// `values` summed over processes whose results are partial (ranks' shards).
    fn sum(&self, _values: &mut [f64]) {}
    /// After step `step`: the replicas still agree.
    fn check_replicas(&self, _model: &dyn Model, _step: usize) -> Result<(), TrainError> {
        Ok(())
    }
    /// True when any process says true (so all stop after the same step).
    fn any(&self, flag: bool) -> bool;
}

impl Session {
    /// Stores saved activations in `precision`'s dtype and, for bf16, makes matrix products bf16
    /// products, on every device (resolved: `auto` is the planner's to decide).
    pub fn set_precision(&self, precision: crate::config::Precision) -> Result<(), TrainError> {
        self.device.set_saved_dtype(precision.saved_dtype())?;
        self.device.set_products(precision.products())?;
        let scaler = match precision {
            crate::config::Precision::Fp16 => Some(memfit_nn::amp::GradScaler::new(Default::default())?),
            _ => None,
        };
        *self.scaler.lock().unwrap_or_else(|e| e.into_inner()) = scaler;
        Ok(())
    }

    /// fp16's loss scale now and its count of clean steps towards the next growth (None in the
    /// other precisions): what a training checkpoint keeps.
    pub fn loss_scale(&self) -> Option<(f64, u32)> {
        self.scaler.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| (s.scale(), s.growth_tracker()))
    }

    /// Restores a checkpoint's loss scale (resume).
    pub fn restore_loss_scale(&self, scale: f64, growth_tracker: u32) -> Result<(), TrainError> {
        match self.scaler.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(s) => Ok(s.restore(scale, growth_tracker)?),
            None => Err(TrainError::Checkpoint("a loss scale saved for a run that is not fp16".into())),
        }
    }

    /// Where the optimizer steps: after the window's backward, or inside it (Note [Step in
    /// backward]) whenever a window is one micro-batch. Refused, naming why, where gradients must all
    /// exist before any update: ranks sum them first, and fp16 storage skips a window whose
    /// gradients overflowed. Call after [`Session::set_precision`].
    pub fn set_optimizer_step(&mut self, step: crate::config::OptimizerStep) -> Result<(), TrainError> {
        let inside = step == crate::config::OptimizerStep::InBackward;
        if inside {
            if let Some(why) = self.step_in_backward_refused() {
                return Err(TrainError::Invalid(format!(
                    "--optimizer-step in-backward: {why}; use --optimizer-step after"
                )));
            }
        }
        self.step_in_backward = inside;
        Ok(())
    }

    /// Why this session cannot step inside backward, if it cannot.
    fn step_in_backward_refused(&self) -> Option<&'static str> {
        if self.peers.is_some() {
            return Some("with ranks or pipeline stages, gradients are summed across processes before any update");
        }
        if self.device.saved_dtype() == Some(DType::F16) {
            return Some("fp16 storage skips a window whose gradients overflowed, which needs them all first");
        }
        None
    }

    /// In fp16, the loss was scaled before backward (fp16 products would lose small gradients):
    /// the gradients are divided by the scale, and a window whose gradients hold an inf or NaN (the
    /// scale, or an activation, overflowed binary16) is not applied, as `GradScaler` skips such
    /// steps. True when the step must be skipped; [`Session::update_loss_scale`] follows.
    fn gradients_overflowed(&self) -> Result<bool, TrainError> {
        let mut scaler = self.scaler.lock().unwrap_or_else(|e| e.into_inner());
        match scaler.as_mut() {
            Some(scaler) if self.device.computes() => Ok(scaler.unscale(&self.model.parameters())?),
            _ => Ok(false),
        }
    }

    /// The window's outcome for the loss scale: `overflowed` as every rank agreed.
    fn update_loss_scale(&self, overflowed: bool) -> Result<(), TrainError> {
        let mut scaler = self.scaler.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(scaler) = scaler.as_mut().filter(|_| self.device.computes()) {
            scaler.agree(overflowed)?;
            scaler.update()?;
        }
        Ok(())
    }

    /// The scale fp16's backward starts from (None in the other precisions; meta multiplies too,
    /// so it allocates the scaled loss as the device does).
    fn backward_scale(&self) -> Option<f64> {
        self.scaler.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| s.scale())
    }

    /// Applies `choice` to the model's segments; returns the names of those that now run
    /// checkpointed.
    pub fn set_checkpointing(&self, choice: &crate::config::CheckpointChoice) -> Result<Vec<String>, TrainError> {
        let name = match self.model.kind() {
            memfit_nn::ModelKind::Imported => "the imported model",
            kind => kind.name(),
        };
        let Some(segments) = self.model.checkpointing() else {
            return match choice {
                crate::config::CheckpointChoice::None | crate::config::CheckpointChoice::Auto => Ok(Vec::new()),
                _ => Err(TrainError::Invalid(format!(
                    "--checkpoint: {name} has no segments to checkpoint{}",
                    crate::config::path_hint(&choice.as_flag())
                ))),
            };
        };
        let flags = choice.flags(name, segments.names()).map_err(TrainError::Invalid)?;
        segments.set(&flags)?;
        Ok(segments.names().iter().zip(&flags).filter(|(_, &on)| on).map(|(n, _)| n.clone()).collect())
    }

    pub fn new(
        device: Device,
        spec: &memfit_nn::ModelSpec,
        optimizer: memfit_nn::OptimizerConfig,
        seed: u64,
    ) -> Result<Session, TrainError> {
        let _phase = device.enter_phase(Phase::Setup);
        let model = memfit_nn::build_model(spec, &device, seed)?;
        let optimizer = Optimizer::new(model.parameters(), optimizer);
        let smallest_micro_batch = spec.smallest_micro_batch();
        Ok(Session {
            device,
            model,
            optimizer,
            skipped_steps: 0,
            peers: None,
            smallest_micro_batch,
            step_in_backward: false,
            proven: None,
            scaler: std::sync::Mutex::new(None),
        })
    }

    pub(crate) fn allocated(&self) -> u64 {
        self.device.stats().allocated_bytes.current
    }
}

/// How to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub effective_batch: usize,
    pub micro_batch: usize,
    pub eval_micro_batch: usize,
    /// Passes over the samples; None = one, or as many as `max_steps` needs.
    pub epochs: Option<usize>,
    /// Stop after this many optimizer steps (running across epochs as needed).
    pub max_steps: Option<usize>,
    /// Seed of the data order (which samples each epoch takes, in which order).
    pub data_seed: u64,
    /// Recover from out-of-memory by splitting (off for planning dry runs: a failure means "does not fit").
    pub recover: bool,
    /// Successful steps after which a shrunk micro-batch doubles again (towards `micro_batch`).
    pub grow_after: usize,
    pub record_samples: bool,
}

/// Progress of one optimizer step.
#[derive(Clone, Debug)]
pub struct StepEvent {
    pub step: usize,
    pub total_steps: usize,
    pub epoch: usize,
    pub samples: usize,
    /// Mean loss over the window (None on meta).
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub micro_batch: usize,
    pub oom_recoveries: usize,
    pub allocated: u64,
    pub peak_allocated: u64,
    pub reserved: u64,
    pub step_ms: f64,
}

/// Evaluation results. Loss and accuracy are None on `meta` and for an empty validation set
/// ("no validation", never an accuracy of 0).
#[derive(Clone, Debug)]
pub struct EvalResult {
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub samples: usize,
    pub micro_batch: usize,
    pub oom_recoveries: usize,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct RunOutcome {
    pub steps: usize,
    /// Epochs begun.
    pub epochs: usize,
    pub samples_seen: usize,
    pub step_times_ms: Vec<f64>,
    pub oom_recoveries: usize,
    pub final_micro_batch: usize,
    pub last_loss: Option<f64>,
    pub eval: Option<EvalResult>,
    /// Sample indices of each step, in the order they were used (when asked for).
    pub sample_log: Vec<Vec<usize>>,
    /// Loss and memory after every step, for training curves.
    pub curve: Vec<StepPoint>,
    /// The run was stopped by its caller after `steps` steps (an interrupt), before it ended.
    pub stopped: bool,
}

/// One step's point on the training curves.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepPoint {
    pub step: usize,
    /// Mean loss over the step's window (None on meta).
    pub loss: Option<f64>,
    /// Allocated bytes after the step, and the peak so far.
    pub allocated: u64,
    pub peak_allocated: u64,
    /// Reserved bytes after the step.
    #[serde(default)]
    pub reserved: u64,
}

/// Where a run is, after a whole optimizer step: everything the loop needs to continue exactly as an
/// uninterrupted run would (the data order is a function of the data seed and the epoch, so the
/// epoch and the windows done in it are its whole position), plus the counts the report adds up.
/// A training checkpoint saves it (`resume.rs`); [`Session::run_from`] starts from it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Optimizer steps taken.
    pub steps: usize,
    /// The epoch the next step belongs to, and the windows of it already trained.
    pub epoch: usize,
    pub window: usize,
    /// The micro-batch in force (smaller than planned after a recovery) and the successful steps since
    /// the last recovery (it grows back after `grow_after`).
    pub micro: usize,
    pub streak: usize,
    /// Report counts so far.
    pub epochs_begun: usize,
    pub samples_seen: usize,
    pub oom_recoveries: usize,
    pub last_loss: Option<f64>,
    pub step_times_ms: Vec<f64>,
    pub curve: Vec<StepPoint>,
}

/// What the loop does after a step ([`Session::run_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterStep {
    Continue,
    /// Stop now: the run returns with [`RunOutcome::stopped`] set, without evaluating.
    Stop,
}

/// The micro-batches still to run over a list of samples, and what to do when one fails
/// (Note [Recovery]): run it again at the same size once, then split it in two halves at the front
/// of the queue; a chunk that fails twice and cannot be halved (a single sample, or fewer than twice
/// the model's smallest micro-batch) ends the run. Micro-batches that ran already can be sent round
/// again ([`MicroQueue::replay`]), marked as replays.
struct MicroQueue<'a> {
    /// Each chunk, and whether it is a replay.
    queue: VecDeque<(&'a [usize], bool)>,
    /// The micro-batch size in force (shrinks when a split happens).
    micro: usize,
    /// The chunk that already failed once at its size (the same samples: address and length).
    retried: Option<&'a [usize]>,
    /// No half is smaller than this (batch norm over one value per channel needs 2 samples).
    smallest: usize,
}

impl<'a> MicroQueue<'a> {
    fn new(samples: &'a [usize], micro: usize, smallest: usize) -> Self {
        let queue = samples.chunks(micro.max(1)).map(|c| (c, false)).collect();
        MicroQueue { queue, micro: micro.max(1), retried: None, smallest: smallest.max(1) }
    }

    /// The next chunk, and whether it is a replay.
    fn next(&mut self) -> Option<(&'a [usize], bool)> {
        self.queue.pop_front()
    }

    fn is_retried(&self, chunk: &[usize]) -> bool {
        self.retried.is_some_and(|r| std::ptr::eq(r, chunk))
    }

    fn succeeded(&mut self, chunk: &[usize]) {
        if self.is_retried(chunk) {
            self.retried = None;
        }
    }

    /// Requeues `chunk` (a replay or not, and its halves alike) after an out-of-memory `error`;
    /// returns the error when nothing is left to try.
    fn failed(&mut self, chunk: &'a [usize], replay: bool, error: TrainError) -> Result<(), TrainError> {
        if !self.is_retried(chunk) {
            // A transient failure (fragmentation that the released cache cures, an injected fault)
            // passes on a second try and must not shrink the micro-batch.
            self.retried = Some(chunk);
            self.queue.push_front((chunk, replay));
            return Ok(());
        }
        if chunk.len() < 2 * self.smallest {
            return Err(error);
        }
        self.retried = None;
        let half = chunk.len().div_ceil(2);
        self.micro = self.micro.min(half);
        let (a, b) = chunk.split_at(half);
        self.queue.push_front((b, replay));
        self.queue.push_front((a, replay));
        Ok(())
    }

    /// Puts `chunk` back at the front as it was, its failure not counted.
    fn again(&mut self, chunk: &'a [usize], replay: bool) {
        self.queue.push_front((chunk, replay));
    }

    /// Puts `chunks`, which ran already, back at the front in their order, as replays.
    fn replay(&mut self, chunks: Vec<&'a [usize]>) {
        for chunk in chunks.into_iter().rev() {
            self.queue.push_front((chunk, true));
        }
    }
}

/// How a micro-batch runs: its backward commits each gradient as soon as it is complete (into
/// gradients that earlier micro-batches of the window left), and it replays one that ran before
/// (the model's buffers stay as they are).
#[derive(Clone, Copy)]
struct MicroPass {
    as_complete: bool,
    replay: bool,
}

/// What a backward hands each complete gradient to, in a step inside backward (Note [Step in
/// backward]).
type HandOver<'a> = &'a mut dyn FnMut(&Tensor, Tensor) -> memfit_tensor::Result<()>;

/// Rehearsals a step inside backward may take to reach a layout from which it needs no new memory
/// (Note [Step in backward]): the first makes the segments the pass needs, the second finds them.
const MAX_REHEARSALS: usize = 4;

/// What micro-batches (or a window of them) add up to: the loss and the right predictions.
pub struct MicroResult {
    /// Mean loss over the micro-batch's predictions, times its samples.
    pub loss_sum: f64,
    pub correct: usize,
    pub predictions: usize,
}

/// The mean cross-entropy of `logits` [..., C] against int64 `targets` [...] (every prediction
/// weighs the same).
pub fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor, TrainError> {
    let classes = logits.shape().last().copied().unwrap_or(0) as isize;
    Ok(ops::cross_entropy(&logits.reshape(&[-1, classes])?, &targets.reshape(&[-1])?, 0.0)?)
}

/// The argmax class of every prediction of `logits` [..., C]: int64 [...] in device memory, made on
/// every device alike (so meta predicts these allocations too), without a graph.
pub(crate) fn argmax_classes(logits: &Tensor) -> Result<Tensor, TrainError> {
    let _no_grad = logits.device().no_grad();
    Ok(logits.max_dim(-1, false)?.1)
}

/// How a micro-batch's loss counts in a sum: `loss * window / chunk * chunk` (training: the
/// window's weight taken back off, times its samples; evaluation: times its predictions, `chunk`
/// 1), and how many predictions it made.
struct Weighing {
    window: f64,
    chunk: f64,
    predictions: usize,
}

/// The scores of a window's micro-batches (or of an evaluation pass), summed in order. Each
/// micro-batch writes its loss and its count of right predictions into the next slot of two small
/// device tensors, made once before the first micro-batch (so a window's peak does not grow with
/// its length); the host reads them when all [`Scores::HELD`] slots are full and at the end: one
/// synchronisation a window on a GPU, not one a micro-batch.
struct Scores {
    /// f32 [HELD] and int64 [HELD].
    losses: Tensor,
    counts: Tensor,
    /// The filled slots' weighings, in order.
    filled: Vec<Weighing>,
    total: MicroResult,
}

impl Scores {
    const HELD: usize = 32;

    /// The slots, made on `device`; with `recover`, a failure to allocate them (an injected fault,
    /// a cache to release) is retried once after releasing the cache, counted in `recoveries`.
    fn new(device: &Device, recover: bool, recoveries: &mut usize) -> Result<Self, TrainError> {
        match Self::allocate(device) {
            Err(e) if recover && e.as_oom().is_some() => {
                device.empty_cache();
                *recoveries += 1;
                Self::allocate(device)
            }
            made => made,
        }
    }

    fn allocate(device: &Device) -> Result<Self, TrainError> {
        Ok(Scores {
            losses: Tensor::empty(device, &[Self::HELD], DType::F32, Category::Other, "scores")?,
            counts: Tensor::empty(device, &[Self::HELD], DType::I64, Category::Other, "scores")?,
            filled: Vec::with_capacity(Self::HELD),
            total: MicroResult { loss_sum: 0.0, correct: 0, predictions: 0 },
        })
    }

    /// Writes a micro-batch's count of right predictions (int64 0-d) into the next slot. A failed
    /// attempt's slot is written again by the next one.
    fn record_count(&self, correct: &Tensor) -> Result<(), TrainError> {
        let slot = self.filled.len();
        Ok(self.counts.narrow(0, slot, 1)?.copy_from(&correct.reshape(&[1])?)?)
    }

    /// Writes a micro-batch's loss (0-d) into the next slot.
    fn record_loss(&self, loss: &Tensor) -> Result<(), TrainError> {
        let slot = self.filled.len();
        let loss = loss.detach();
        let loss = if loss.dtype() == DType::F32 { loss } else { loss.to_dtype(DType::F32)? };
        Ok(self.losses.narrow(0, slot, 1)?.copy_from(&loss.reshape(&[1])?)?)
    }

    /// Forgets every score so far (the micro-batches that made them run again).
    fn restart(&mut self) {
        self.filled.clear();
        self.total = MicroResult { loss_sum: 0.0, correct: 0, predictions: 0 };
    }

    /// Takes the slot written as the micro-batch's, weighed by `w`; reads them all once full.
    fn commit(&mut self, w: Weighing) -> Result<(), TrainError> {
        self.filled.push(w);
        if self.filled.len() == Self::HELD {
            self.read_filled()?;
        }
        Ok(())
    }

    /// Adds the filled slots to the total on the host, in order (f64). NaN loss and no right
    /// predictions on a device that computes nothing.
    fn read_filled(&mut self) -> Result<(), TrainError> {
        if self.filled.is_empty() {
            return Ok(());
        }
        let computes = self.losses.device().computes();
        let (losses, counts) =
            if computes { (self.losses.to_vec::<f32>()?, self.counts.to_vec::<i64>()?) } else { (vec![], vec![]) };
        for (i, w) in self.filled.drain(..).enumerate() {
            self.total.predictions += w.predictions;
            if !computes {
                self.total.loss_sum = f64::NAN;
                continue;
            }
            self.total.loss_sum += f64::from(losses[i]) * w.window / w.chunk * w.chunk;
            self.total.correct += counts[i] as usize;
        }
        Ok(())
    }

    fn read(mut self) -> Result<MicroResult, TrainError> {
        self.read_filled()?;
        Ok(self.total)
    }
}

/// What a forward pass leaves besides its loss: the logits, or (a model that fused its head with the
/// loss) the predictions themselves.
enum Outputs {
    Logits(Tensor),
    Predicted(Tensor),
}

impl Outputs {
    /// Each prediction's argmax class (the logits are dropped once it is taken).
    fn predicted(self) -> Result<Tensor, TrainError> {
        match self {
            Outputs::Logits(logits) => argmax_classes(&logits),
            Outputs::Predicted(p) => Ok(p),
        }
    }
}

impl Session {
    /// The model's mean loss on `x` against `y` and what it leaves to score: fused with its head where
    /// the model does that (`Model::fused_loss`), else from its logits.
    fn forward_loss(&self, x: &Tensor, y: &Tensor, train: bool) -> Result<(Tensor, Outputs), TrainError> {
        if let Some(fused) = self.model.fused_loss(x, y, train) {
            let (loss, predicted) = fused?;
            return Ok((loss, Outputs::Predicted(predicted)));
        }
        let logits = self.model.forward(x, train)?;
        let loss = loss(&logits, y)?;
        Ok((loss, Outputs::Logits(logits)))
    }

    /// One micro-batch, leaving the model's buffers as they were if it fails: batch norm updates its
    /// running statistics in the forward pass, and the re-run after a recovery must not count the
    /// failed attempt's batch twice. The snapshot is allocator memory (category `other`, a few KiB)
    /// made inside the attempt, so it is planned and released like the rest.
    ///
    /// `pass` says how its backward commits gradients and whether it is a replay (buffers frozen).
    fn micro_step(
        &self,
        samples: &dyn Samples,
        chunk: &[usize],
        window: usize,
        scores: &Scores,
        pass: MicroPass,
        hand_over: Option<HandOver<'_>>,
    ) -> Result<Weighing, TrainError> {
        let _frozen = pass.replay.then(|| self.device.replay());
        let buffers = self.model.buffers();
        let mut snapshot = Vec::with_capacity(buffers.len());
        for (_, b) in &buffers {
            let copy = Tensor::empty(&self.device, b.shape(), b.dtype(), Category::Other, "buffer_snapshot")?;
            copy.copy_from(b)?;
            snapshot.push(copy);
        }
        let result = self.forward_backward(samples, chunk, window, scores, pass.as_complete, hand_over);
        if result.is_err() {
            for ((_, b), copy) in buffers.iter().zip(&snapshot) {
                b.copy_from(copy)?;
            }
        }
        result
    }

    /// Forward and backward of one micro-batch, its loss weighted by `chunk / window`
    /// (Note [Loss normalization]), its scores written into `scores`' next slot. Every tensor it
    /// makes is dropped when it returns.
    fn forward_backward(
        &self,
        samples: &dyn Samples,
        chunk: &[usize],
        window: usize,
        scores: &Scores,
        as_complete: bool,
        hand_over: Option<HandOver<'_>>,
    ) -> Result<Weighing, TrainError> {
        let device = &self.device;
        // The micro-batch's random draws (an imported model's dropout) follow its samples, so the same
        // samples run again (a retry, a replay) draw the same masks.
        device.set_random_seed(
            chunk
                .iter()
                .fold(0x9E37_79B9_7F4A_7C15u64, |h, &id| (h ^ id as u64).wrapping_mul(0x100_0000_01B3).rotate_left(29)),
        );
        let (x, y) = {
            let _p = device.enter_phase(Phase::Data);
            samples.to_device(device, chunk)?
        };
        let (loss, outputs) = {
            let _p = device.enter_phase(Phase::Forward);
            let (loss, outputs) = self.forward_loss(&x, &y, true)?;
            let weight = chunk.len() as f64 / window as f64;
            let weighted = if chunk.len() == window { loss.clone() } else { loss.mul_scalar(weight)? };
            (weighted, outputs)
        };
        drop(x);
        // Before backward: a failure here is still a failed attempt with nothing committed.
        let predicted = outputs.predicted()?;
        scores.record_count(&predicted.count_equal(&y)?)?;
        drop(predicted);
        scores.record_loss(&loss)?;
        // fp16: backward from the loss times the scale (the gradients are divided by it before the
        // step); the same allocation on meta.
        let loss = match self.backward_scale() {
            Some(scale) => loss.mul_scalar(scale)?,
            None => loss,
        };
        match hand_over {
            Some(hand_over) => autograd::backward_handing_over(&loss, hand_over)?,
            None if as_complete => autograd::backward_as_complete(&loss, None)?,
            None => autograd::backward(&loss)?,
        }
        Ok(Weighing { window: window as f64, chunk: chunk.len() as f64, predictions: y.numel() })
    }

    /// Errors when a parameter holds NaN or infinity after `step` (a huge learning rate diverges in one
    /// update, before any loss shows it): such weights are never evaluated or saved.
    pub(crate) fn check_finite_parameters(&self, step: usize) -> Result<(), TrainError> {
        if !self.device.computes() {
            return Ok(());
        }
        let params = self.model.parameters();
        // A multiplication by 1 (exact: it changes no value) that reports any NaN or infinity, on
        // the device: no host copy of the weights, and one read of the flag for all of them. Only
        // when one is found are they asked one by one, to name it.
        if !ops::unscale_(&params.iter().map(|(_, p)| p).collect::<Vec<_>>(), 1.0)? {
            return Ok(());
        }
        for (name, p) in &params {
            if ops::unscale_(&[p], 1.0)? {
                return Err(TrainError::NotFinite(format!(
                    "parameter {name} holds NaN or infinity after step {step}: training diverged and stopped \
                     (nothing is saved); try a smaller --lr"
                )));
            }
        }
        Ok(())
    }

    /// After a failed attempt has been dropped, its bytes must all be back (Note [Recovery]).
    pub(crate) fn check_released(&self, before: u64) -> Result<(), TrainError> {
        let after = self.allocated();
        if after != before {
            return Err(TrainError::Invalid(format!(
                "internal error: a failed attempt left {} bytes allocated (before {before}, after {after})",
                after as i128 - before as i128
            )));
        }
        Ok(())
    }

    /// One optimizer step over `window` (Note [Recovery]). Returns the window's summed micro-batch
    /// results and the recoveries it took.
    /// With ranks, `window` is this rank's shard of a window of `n` samples.
    fn train_window(
        &mut self,
        samples: &dyn Samples,
        window: &[usize],
        n: usize,
        micro: &mut usize,
        recover: bool,
        used: &mut Vec<usize>,
    ) -> Result<(MicroResult, usize), TrainError> {
        let crossing = self.peers.as_ref().and_then(|p| p.run_window(self, samples, window, micro, recover, true));
        let (total, mut recoveries, stepped) = match crossing {
            Some(done) => {
                used.extend_from_slice(window);
                let (total, recoveries) = done?;
                (total, recoveries, false)
            }
            None => self.accumulate(samples, window, n, micro, recover, used)?,
        };
        if stepped {
            // Updated inside its backward (Note [Step in backward]): no gradient is left.
            self.finish_step()?;
            return Ok((total, recoveries));
        }
        {
            let _p = self.device.enter_phase(Phase::Optimizer);
            if let Some(peers) = &self.peers {
                peers.reduce_gradients(self.model.as_ref())?;
            }
            let mut overflowed = self.gradients_overflowed()?;
            if let Some(peers) = &self.peers {
                overflowed = peers.overflowed(overflowed);
            }
            self.update_loss_scale(overflowed)?;
            if overflowed {
                self.skipped_steps += 1;
                self.optimizer.zero_grad();
                self.finish_step()?;
                return Ok((total, recoveries));
            }
            // The optimizer allocates all its state before it updates anything, so a failed step
            // changed nothing: release the cache and try once more.
            if let Err(e) = self.optimizer.step() {
                if !(recover && e.is_oom()) {
                    return Err(e.into());
                }
                self.device.empty_cache();
                recoveries += 1;
                self.optimizer.step()?;
            }
            self.optimizer.zero_grad();
            self.finish_step()?;
        }
        Ok((total, recoveries))
    }

    /// The micro-batches of one window (this rank's shard of `n` samples), accumulating gradients, with
    /// recovery (Note [Recovery]). Also says whether the window was updated inside its backward
    /// (Note [Step in backward]): then no gradient is left for an optimizer step.
    fn accumulate(
        &mut self,
        samples: &dyn Samples,
        window: &[usize],
        n: usize,
        micro: &mut usize,
        recover: bool,
        used: &mut Vec<usize>,
    ) -> Result<(MicroResult, usize, bool), TrainError> {
        let mut queue = MicroQueue::new(window, *micro, self.smallest_micro_batch);
        let mut recoveries = 0;
        let mut scores = Scores::new(&self.device, recover, &mut recoveries)?;
        // A window of one micro-batch steps inside its backward: its state is made first, all of it
        // or none (a failure is retried once after releasing the cache, as the step after is).
        let in_backward = self.step_in_backward && window.len() <= *micro;
        if in_backward {
            if let Err(e) = self.optimizer.prepare_step_in_backward() {
                if !(recover && e.is_oom()) {
                    return Err(e.into());
                }
                self.device.empty_cache();
                recoveries += 1;
                self.optimizer.prepare_step_in_backward()?;
            }
        }
        let mut stepped = false;
        // What the window holds before any gradient: the level a pass that committed as complete
        // returns to when it fails.
        let (start, used_at_start) = (self.allocated(), used.len());
        // The chunks whose gradients `.grad` holds, in order (Note [Recovery]).
        let mut held: Vec<&[usize]> = Vec::new();
        // Whether the window replayed once already: the rest of it commits at the end of each pass,
        // so that failures close together (injected every few requests) cannot replay it forever.
        let mut replayed = false;
        while let Some((chunk, replay)) = queue.next() {
            let before = self.allocated();
            // Into existing gradients, each is committed as soon as it is complete, so the pass
            // never holds a second set (Note [Committing as complete] in memfit_tensor::autograd).
            let pass = MicroPass { as_complete: !held.is_empty() && !replayed, replay };
            // The whole window in one pass: it steps inside its backward (a part of it, after a
            // failure split it, accumulates and steps after).
            let whole = in_backward && held.is_empty() && !replay && chunk.len() == window.len();
            let attempt = match whole {
                true => self.micro_step_in_backward(samples, chunk, n, &scores),
                false => self.micro_step(samples, chunk, n, &scores, pass, None),
            };
            match attempt {
                Ok(weighing) => {
                    scores.commit(weighing)?;
                    used.extend_from_slice(chunk);
                    queue.succeeded(chunk);
                    held.push(chunk);
                    stepped = whole;
                }
                Err(e) if recover && e.as_oom().is_some() => {
                    if pass.as_complete {
                        // `.grad` holds part of this pass: drop every gradient, and run again what
                        // they held, scored afresh.
                        self.optimizer.zero_grad();
                        scores.restart();
                        self.check_released(start)?;
                    } else {
                        self.check_released(before)?;
                    }
                    self.device.empty_cache();
                    if pass.as_complete {
                        // Not a try at its size that counts: it runs next as a pass of its own kind,
                        // after the replays (which an injected fault every few requests may also hit).
                        queue.again(chunk, replay);
                        queue.replay(std::mem::take(&mut held));
                        used.truncate(used_at_start);
                        replayed = true;
                    } else {
                        queue.failed(chunk, replay, e)?;
                    }
                    recoveries += 1;
                }
                Err(e) => return Err(e),
            }
        }
        *micro = queue.micro;
        Ok((scores.read()?, recoveries, stepped))
    }

    /// A window of one micro-batch whose parameters are updated inside its backward, each as soon
    /// as its gradient is complete (Note [Step in backward]). Rehearsals first prove that the pass
    /// needs no memory the allocator does not hold; until the first update, a failure is an ordinary
    /// failed attempt (an out-of-memory, recovered as Note [Recovery] says); after it, none can
    /// happen, and one that did anyway would be an error of memfit's, reported as such.
    fn micro_step_in_backward(
        &mut self,
        samples: &dyn Samples,
        chunk: &[usize],
        window: usize,
        scores: &Scores,
    ) -> Result<Weighing, TrainError> {
        let pass = MicroPass { as_complete: false, replay: false };
        self.prove_held(samples, chunk, window, scores)?;
        let device = self.device.clone();
        // The optimizer is taken out for the pass, so that the backward can update through it while
        // the session runs the model.
        let placeholder = Optimizer::new(Vec::new(), self.optimizer.config());
        let mut optimizer = std::mem::replace(&mut self.optimizer, placeholder);
        let new_memory_before = device.requests_for_new_memory();
        let mut updated = 0usize;
        let result = {
            let mut hand_over = |param: &Tensor, grad: Tensor| -> memfit_tensor::Result<()> {
                // The first update is the point of no return: from here every request is served
                // from memory the rehearsal proved the allocator holds.
                device.set_held_only(true);
                updated += 1;
                optimizer.step_one(param, &grad.contiguous()?)
            };
            self.micro_step(samples, chunk, window, scores, pass, Some(&mut hand_over))
        };
        device.set_held_only(false);
        let beyond = device.requests_for_new_memory() - new_memory_before;
        if result.is_ok() {
            // Counted as `Optimizer::step` counts a step, with or without gradients.
            optimizer.finish_step_in_backward();
        }
        self.optimizer = optimizer;
        match result {
            Err(e) if updated > 0 => Err(TrainError::Invalid(format!(
                "internal error: the step inside backward failed after updating {updated} parameters, so this \
                 window cannot be run again ({e}); run with --optimizer-step after"
            ))),
            _ if beyond > 0 => Err(TrainError::Invalid(format!(
                "internal error: the step inside backward made {beyond} requests for new memory, which its \
                 rehearsal said it would not; run with --optimizer-step after"
            ))),
            result => result,
        }
    }

    /// Rehearses a window of one micro-batch stepping inside its backward (`Device::rehearse`: the
    /// same requests, no kernel) until a rehearsal needs no new memory at all: the real pass, from the
    /// same layout, then makes exactly the same requests in the same places, all served from memory
    /// held (Note [Step in backward]). A rehearsal never releases the cache to make room (that would
    /// be new memory too), so a budget too tight for the pass fails it as an out-of-memory, which
    /// changed nothing and is recovered (or planned) as any other. A layout already proven for this
    /// micro-batch needs no rehearsal.
    fn prove_held(
        &mut self,
        samples: &dyn Samples,
        chunk: &[usize],
        window: usize,
        scores: &Scores,
    ) -> Result<(), TrainError> {
        let pass = MicroPass { as_complete: false, replay: false };
        for _ in 0..MAX_REHEARSALS {
            let digest = self.device.layout_digest();
            if self.proven == Some((digest, chunk.len())) {
                return Ok(());
            }
            let before = self.device.requests_for_new_memory();
            let rehearsed = {
                let _rehearsal = self.device.rehearse();
                self.device.set_keep_cache(true);
                let mut hand_over = |_: &Tensor, grad: Tensor| grad.contiguous().map(drop);
                let rehearsed = self.micro_step(samples, chunk, window, scores, pass, Some(&mut hand_over));
                self.device.set_keep_cache(false);
                rehearsed
            };
            rehearsed?;
            if self.device.requests_for_new_memory() == before {
                self.proven = Some((digest, chunk.len()));
                return Ok(());
            }
        }
        Err(TrainError::Invalid(format!(
            "the step inside backward still asked for new memory after {MAX_REHEARSALS} rehearsals of a micro-batch \
             of {}, so it cannot be sure its pass needs none after the first update; run with --optimizer-step after",
            chunk.len()
        )))
    }

    /// With ranks: ZeRO-1's owners broadcast their updated parameters, and every gradient is freed.
    fn finish_step(&self) -> Result<(), TrainError> {
        match &self.peers {
            Some(peers) => peers.finish_step(self.model.as_ref()),
            None => Ok(()),
        }
    }

    /// Mean loss and accuracy over `samples`, under no-grad, in micro-batches of `eval_micro`
    /// (halved on out-of-memory; the training micro-batch is never touched).
    pub fn evaluate(&self, samples: &dyn Samples, eval_micro: usize, recover: bool) -> Result<EvalResult, TrainError> {
        let device = &self.device;
        let _ng = device.no_grad();
        let _p = device.enter_phase(Phase::Eval);
        let all = samples.eval_ids();
        if let Some((p, round)) = self.peers.as_ref().and_then(|p| Some((p, p.eval_round()?))) {
            // One round at a time, each retried on its own (Note [Pipeline]).
            let mut micro = eval_micro;
            let (mut r, mut recoveries) = (MicroResult { loss_sum: 0.0, correct: 0, predictions: 0 }, 0);
            let mut start = 0;
            while start < all.len() {
                let end = (start + round * micro).min(all.len());
                let (part, rec) = p
                    .run_window(self, samples, &all[start..end], &mut micro, recover, false)
                    .ok_or_else(|| TrainError::Invalid("internal: evaluation rounds without windows".into()))??;
                r.loss_sum += part.loss_sum;
                r.correct += part.correct;
                r.predictions += part.predictions;
                recoveries += rec;
                start = end;
            }
            let computes = device.computes() && r.predictions > 0;
            let n = r.predictions.max(1) as f64;
            return Ok(EvalResult {
                loss: computes.then_some(r.loss_sum / n),
                accuracy: computes.then_some(r.correct as f64 / n),
                samples: all.len(),
                micro_batch: micro,
                oom_recoveries: recoveries,
            });
        }
        let order = self.peers.as_ref().map_or(&all[..], |p| p.shard(&all));
        // Evaluation normalizes by the running statistics: any micro-batch will do.
        let mut queue = MicroQueue::new(order, eval_micro, 1);
        let mut recoveries = 0;
        let mut scores = Scores::new(device, recover, &mut recoveries)?;
        while let Some((chunk, _)) = queue.next() {
            let before = self.allocated();
            let attempt = |scores: &Scores| -> Result<Weighing, TrainError> {
                let (x, y) = samples.to_device(device, chunk)?;
                let (loss, outputs) = self.forward_loss(&x, &y, false)?;
                drop(x);
                let predicted = outputs.predicted()?;
                scores.record_count(&predicted.count_equal(&y)?)?;
                scores.record_loss(&loss)?;
                Ok(Weighing { window: y.numel() as f64, chunk: 1.0, predictions: y.numel() })
            };
            match attempt(&scores) {
                Ok(weighing) => {
                    scores.commit(weighing)?;
                    queue.succeeded(chunk);
                }
                Err(e) if recover && e.as_oom().is_some() => {
                    self.check_released(before)?;
                    device.empty_cache();
                    queue.failed(chunk, false, e)?;
                    recoveries += 1;
                }
                Err(e) => return Err(e),
            }
        }
        let MicroResult { mut loss_sum, mut correct, mut predictions } = scores.read()?;
        if let Some(peers) = &self.peers {
            let mut sums = [loss_sum, correct as f64, predictions as f64, recoveries as f64];
            peers.sum(&mut sums);
            (loss_sum, correct, predictions, recoveries) =
                (sums[0], sums[1] as usize, sums[2] as usize, sums[3] as usize);
        }
        let n = predictions.max(1) as f64;
        let computes = device.computes() && predictions > 0;
        Ok(EvalResult {
            loss: computes.then_some(loss_sum / n),
            accuracy: computes.then_some(correct as f64 / n),
            samples: all.len(),
            micro_batch: queue.micro,
            oom_recoveries: recoveries,
        })
    }

    /// Trains over `train` (and evaluates on `val` at the end when given).
    pub fn run(
        &mut self,
        train: &dyn Samples,
        val: Option<&dyn Samples>,
        opts: &RunOptions,
        on_step: &mut dyn FnMut(&StepEvent),
    ) -> Result<RunOutcome, TrainError> {
        self.run_from(train, val, opts, None, &mut |_, e, _| {
            on_step(e);
            Ok(AfterStep::Continue)
        })
    }

    /// One optimizer step over `window` (Note [Recovery]; with ranks, this rank's shard of it):
    /// updates the progress `p` and returns the step's event and the samples it used (with
    /// `opts.record_samples`).
    fn train_step(
        &mut self,
        train: &dyn Samples,
        window: &[usize],
        opts: &RunOptions,
        total: usize,
        p: &mut Progress,
    ) -> Result<(StepEvent, Vec<usize>), TrainError> {
        let planned_micro = opts.micro_batch.min(opts.effective_batch);
        let start = Instant::now();
        let mut used = Vec::with_capacity(if opts.record_samples { window.len() } else { 0 });
        let local = self.peers.as_ref().map_or(window, |peers| peers.shard(window));
        let skipped_before = self.skipped_steps;
        let (mut result, mut recoveries) =
            self.train_window(train, local, window.len(), &mut p.micro, opts.recover, &mut used)?;
        if let Some(peers) = &self.peers {
            let mut sums = [result.loss_sum, result.correct as f64, result.predictions as f64, recoveries as f64];
            peers.sum(&mut sums);
            result = MicroResult { loss_sum: sums[0], correct: sums[1] as usize, predictions: sums[2] as usize };
            recoveries = sums[3] as usize;
            peers.check_replicas(self.model.as_ref(), p.steps + 1)?;
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        p.streak = if recoveries > 0 { 0 } else { p.streak + 1 };
        if p.micro < planned_micro && p.streak >= opts.grow_after {
            p.micro = (p.micro * 2).min(planned_micro);
            p.streak = 0;
        }
        p.steps += 1;
        p.window += 1;
        p.samples_seen += window.len();
        p.step_times_ms.push(ms);
        p.oom_recoveries += recoveries;
        let computes = self.device.computes();
        let loss = computes.then(|| result.loss_sum / window.len() as f64);
        // A step fp16 skipped for overflow (GradScaler's rule) may have overflowed in the forward
        // already, with fp16 products: its loss is no divergence, the next step's scale is smaller.
        let overflow_skipped = self.skipped_steps > skipped_before;
        if let Some(l) = loss.filter(|l| !l.is_finite() && !overflow_skipped) {
            return Err(TrainError::NotFinite(format!(
                "the training loss at step {} is {l}: training diverged and stopped (nothing is saved); \
                 try a smaller --lr",
                p.steps
            )));
        }
        p.last_loss = loss;
        let stats = self.device.stats();
        p.curve.push(StepPoint {
            step: p.steps,
            loss,
            allocated: stats.allocated_bytes.current,
            peak_allocated: stats.allocated_bytes.peak,
            reserved: stats.reserved_bytes.current,
        });
        let event = StepEvent {
            step: p.steps,
            total_steps: total,
            epoch: p.epoch,
            samples: p.samples_seen,
            loss,
            accuracy: computes.then(|| result.correct as f64 / result.predictions.max(1) as f64),
            micro_batch: p.micro,
            oom_recoveries: p.oom_recoveries,
            allocated: stats.allocated_bytes.current,
            peak_allocated: stats.allocated_bytes.peak,
            reserved: stats.reserved_bytes.current,
            step_ms: ms,
        };
        Ok((event, used))
    }

    /// [`Session::run`] from `start` (a checkpoint's [`Progress`]; None: the beginning), calling
    /// `after` with the session, the step's event and the progress after every step; `after` may save
    /// a checkpoint and stop the run. A run continued from a step's progress takes exactly the steps the
    /// uninterrupted run took after it: the same windows in the same micro-batches.
    pub fn run_from(
        &mut self,
        train: &dyn Samples,
        val: Option<&dyn Samples>,
        opts: &RunOptions,
        start: Option<Progress>,
        after: &mut dyn FnMut(&Session, &StepEvent, &Progress) -> Result<AfterStep, TrainError>,
    ) -> Result<RunOutcome, TrainError> {
        if opts.effective_batch == 0 || opts.micro_batch == 0 {
            return Err(TrainError::Invalid("the batch size and micro-batch must be at least 1".into()));
        }
        if train.is_empty() {
            return Err(TrainError::Invalid("the training set is empty".into()));
        }
        let per_epoch = train.len().div_ceil(opts.effective_batch);
        let total = total_steps(per_epoch, opts.epochs, opts.max_steps)?;
        let planned_micro = opts.micro_batch.min(opts.effective_batch);
        let mut p = start.unwrap_or(Progress { micro: planned_micro, ..Progress::default() });
        if p.micro == 0 || p.micro > planned_micro || p.window >= per_epoch {
            return Err(TrainError::Invalid(format!(
                "cannot continue at micro-batch {} and window {} of an epoch of {per_epoch} windows (micro-batch {planned_micro})",
                p.micro, p.window
            )));
        }
        let mut stopped = false;
        let mut sample_log = Vec::new();
        'epochs: while p.steps < total {
            let order = train.epoch_ids(opts.data_seed, p.epoch);
            p.epochs_begun = p.epochs_begun.max(p.epoch + 1);
            for window in order.chunks(opts.effective_batch).skip(p.window) {
                if p.steps >= total {
                    break;
                }
                let (event, used) = self.train_step(train, window, opts, total, &mut p)?;
                if opts.record_samples {
                    sample_log.push(used);
                }
                // The position after this step: the next window, or the start of the next epoch.
                if p.window == per_epoch {
                    p.epoch += 1;
                    p.window = 0;
                }
                let mut stop = after(self, &event, &p)? == AfterStep::Stop;
                if let Some(peers) = &self.peers {
                    // Every process stops after the same step, or the others would wait for it.
                    stop = peers.any(stop);
                }
                if stop {
                    stopped = true;
                    break 'epochs;
                }
            }
            if p.window != 0 {
                // Only reached when `total` ended the run inside an epoch.
                break;
            }
        }
        if p.steps > 0 {
            self.check_finite_parameters(p.steps)?;
        }
        let mut out = RunOutcome {
            steps: p.steps,
            epochs: p.epochs_begun,
            samples_seen: p.samples_seen,
            step_times_ms: p.step_times_ms,
            oom_recoveries: p.oom_recoveries,
            final_micro_batch: p.micro,
            last_loss: p.last_loss,
            eval: None,
            sample_log,
            curve: p.curve,
            stopped,
        };
        if let (Some(val), false) = (val, stopped) {
            out.eval = Some(self.evaluate(val, opts.eval_micro_batch, opts.recover)?);
        }
        Ok(out)
    }
}

pub use crate::config::total_steps;

/// The median of a list of timings (0 for none).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::MicroQueue;
    use crate::error::TrainError;

    fn oom() -> TrainError {
        TrainError::Invalid("out of memory".into())
    }

    /// A chunk that fails twice is halved, never below the model's smallest micro-batch: with 2,
    /// four samples become two and two, and three samples (one half would be 1) end the run.
    #[test]
    fn recovery_halves_a_chunk_but_never_below_the_smallest_micro_batch() {
        let samples: Vec<usize> = (0..7).collect();
        let mut queue = MicroQueue::new(&samples, 4, 2);
        let (first, _) = queue.next().unwrap();
        assert_eq!(first, &[0, 1, 2, 3]);
        queue.failed(first, false, oom()).unwrap(); // once: retried as it is
        let (again, _) = queue.next().unwrap();
        assert_eq!(again, first);
        queue.failed(again, false, oom()).unwrap(); // twice: halved
        assert_eq!(queue.next().unwrap().0, &[0, 1]);
        assert_eq!(queue.next().unwrap().0, &[2, 3]);
        let (three, _) = queue.next().unwrap();
        assert_eq!(three, &[4, 5, 6]);
        queue.failed(three, false, oom()).unwrap();
        let (three, _) = queue.next().unwrap();
        assert!(queue.failed(three, false, oom()).is_err(), "3 samples cannot be halved into parts of 2");
        // A model that takes one sample halves them.
        let mut any = MicroQueue::new(&samples[4..], 3, 1);
        let (three, _) = any.next().unwrap();
        any.failed(three, false, oom()).unwrap();
        let (three, _) = any.next().unwrap();
        any.failed(three, false, oom()).unwrap();
        assert_eq!(any.next().unwrap().0, &[4, 5]);
        assert_eq!(any.next().unwrap().0, &[6]);
    }
}
