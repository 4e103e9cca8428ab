//! Pipeline parallelism (`--parallel pipeline`): the model's layer sequence cut into stages, one per
//! rank, for a model that does not fit one rank's budget.
//!
//! Note [Pipeline]: stage s holds units `stages[s]` of the layer sequence (`memfit_nn::stage_units`:
//! the GPT's embeddings, blocks and head) and only their parameters and optimizer state. A window runs
//! in rounds of `2 * stages` micro-batches, each with GPipe's schedule: every micro-batch of the round
//! forward through the stages (each stage receives the residual stream from the one before, runs its
//! units, sends its output on), then every one backward in reverse (each stage receives the gradient of
//! its output, back-propagates it, and sends the gradient of its input back). A stage so holds the
//! activations of one round at most, whatever the window; gradients accumulate across rounds, each
//! leaf's into `.grad` as soon as a backward pass has completed it (`autograd::backward_as_complete`,
//! Note [Committing as complete]: no second set of gradients while accumulating, and no transaction
//! needed, since a failure re-runs the whole window). The last stage computes the loss of each
//! micro-batch weighted by its share of the window (Note [Loss normalization]), so the accumulated
//! gradients are the single-process ones.
//! Every message is a status followed, when it is good, by the tensor, and a stage that ran out of
//! memory still takes part in every exchange (it receives and drops what it is sent, and sends failure
//! statuses), so no stage ever waits for one that failed. After the window the stages agree whether any
//! failed; if so, every stage drops the attempt (its gradients too) and the whole window runs again:
//! at the same micro-batch, and at half of it once a stage has failed twice in a row (Note [Recovery];
//! evaluation retries a round at a time): no sample is lost or counted twice.
//! On `meta` no message moves: a stage's dry run is its allocations, received tensors included.
//!
//!
//! Planning a pipeline (where to cut, the micro-batch) is `stages.rs`'s.

use crate::error::TrainError;
use crate::samples::Samples;
use crate::trainer::{argmax_classes, loss, MicroResult, Peers, Session};
use memfit_dist::{collective, Group};
use memfit_tensor::{autograd, Category, DType, Device, Phase, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// A session's stage of a pipeline.
pub struct Pipeline {
    pub group: Arc<dyn Group>,
    /// The units of the layer sequence each stage holds, in rank order.
    pub stages: Vec<Range<usize>>,
    /// The residual stream of one sample: [T, d].
    stream: [usize; 2],
}

impl Pipeline {
    fn stage(&self) -> usize {
        self.group.rank()
    }

    fn first(&self) -> bool {
        self.stage() == 0
    }

    fn last(&self) -> bool {
        self.stage() + 1 == self.stages.len()
    }

    /// Micro-batches in flight at once: each round runs this many forward, then backward (GPipe's
    /// schedule within a round; gradients accumulate across rounds), so a stage holds the activations
    /// of at most this many micro-batches whatever the window. Twice the stages keeps the pipeline's
    /// idle share (stages - 1) / (round + stages - 1) at a fifth for two stages.
    pub(crate) fn round(&self) -> usize {
        rounds_of(self.stages.len())
    }

    /// The stream of `n` samples crossing between stages.
    fn shape(&self, n: usize) -> [usize; 3] {
        [n, self.stream[0], self.stream[1]]
    }

    /// Sends `t` to stage `to`, or a failure status when this stage has failed (None).
    fn post(&self, device: &Device, t: Option<&Tensor>, to: usize) -> Result<(), TrainError> {
        if !device.computes() {
            return Ok(());
        }
        self.group.send(&[if t.is_some() { 1.0 } else { 0.0 }], to);
        if let Some(t) = t {
            collective::send(self.group.as_ref(), t, to)?;
        }
        Ok(())
    }

    /// What stage `from` sends: the tensor (category `communication`), None when that stage failed,
    /// or this stage's out-of-memory when it cannot hold the tensor (then the bytes are received and
    /// dropped on the host, so the sender never waits).
    fn fetch(&self, device: &Device, n: usize, from: usize, name: &'static str) -> Result<Option<Tensor>, TrainError> {
        if device.computes() {
            let mut status = [0.0f32];
            self.group.receive(&mut status, from);
            if status[0] != 1.0 {
                return Ok(None);
            }
        }
        let shape = self.shape(n);
        match Tensor::empty(device, &shape, DType::F32, Category::Communication, name) {
            Ok(t) => {
                collective::receive(self.group.as_ref(), &t, from)?;
                Ok(Some(t))
            }
            Err(e) => {
                if device.computes() {
                    let mut drain = vec![0.0f32; shape.iter().product()];
                    self.group.receive(&mut drain, from);
                }
                Err(e.into())
            }
        }
    }

    /// Which stages say true.
    fn which(&self, flag: bool) -> Vec<bool> {
        collective::which(self.group.as_ref(), flag)
    }

    /// True when any stage says true.
    pub(crate) fn any(&self, flag: bool) -> bool {
        collective::any(self.group.as_ref(), flag)
    }
}

/// Micro-batches per round for a pipeline of `stages` ([`Pipeline::round`]).
pub fn rounds_of(stages: usize) -> usize {
    2 * stages
}

/// A failure inside an attempt: out-of-memory is survivable (the stages agree and retry), anything
/// else ends the run.
fn survivable(e: TrainError) -> Result<TrainError, TrainError> {
    if e.as_oom().is_some() {
        Ok(e)
    } else {
        Err(e)
    }
}

/// One micro-batch's state between its forward and its backward.
struct InFlight {
    /// The received stream (a leaf requiring grad), on every stage but the first.
    input: Option<Tensor>,
    /// The stage's output (the weighted loss on the last stage).
    output: Tensor,
}

impl Session {
    /// Builds rank `group.rank()`'s stage of `spec` cut into `stages` (Note [Pipeline]).
    pub fn new_stage(
        device: Device,
        spec: &memfit_nn::ModelSpec,
        optimizer: memfit_nn::OptimizerConfig,
        seed: u64,
        group: Arc<dyn Group>,
        stages: Vec<Range<usize>>,
    ) -> Result<Session, TrainError> {
        let units = stages.get(group.rank()).cloned().ok_or_else(|| {
            TrainError::Invalid(format!("a pipeline of {} stages has no stage for rank {}", stages.len(), group.rank()))
        })?;
        if stages.len() != group.size() {
            return Err(TrainError::Invalid(format!(
                "a pipeline of {} stages needs as many ranks, not {}",
                stages.len(),
                group.size()
            )));
        }
        let model = {
            let _phase = device.enter_phase(Phase::Setup);
            memfit_nn::build_stage(spec, &device, seed, units)?
        };
        let optimizer = memfit_nn::Optimizer::new(model.parameters(), optimizer);
        let stream = [spec.gpt.max_t, spec.gpt.d_model];
        Ok(Session {
            device,
            model,
            optimizer,
            skipped_steps: 0,
            peers: Some(Box::new(Pipeline { group, stages, stream })),
            smallest_micro_batch: spec.smallest_micro_batch(),
            step_in_backward: false,
            proven: None,
            scaler: std::sync::Mutex::new(None),
        })
    }
}

impl Pipeline {
    /// One window through the pipeline (Note [Pipeline]), retried whole after an out-of-memory on any
    /// stage. Returns the window's results (summed over the stages) and the recoveries it took.
    fn window(
        &self,
        s: &Session,
        samples: &dyn Samples,
        window: &[usize],
        micro: &mut usize,
        recover: bool,
        train: bool,
    ) -> Result<(MicroResult, usize), TrainError> {
        let mut recoveries = 0;
        // The stages that failed the attempt before at this micro-batch size.
        let mut failed_before = vec![false; self.stages.len()];
        loop {
            let before = s.allocated();
            let (result, failure) = self.attempt(s, samples, window, *micro, train)?;
            // A stage's own out-of-memory (a stage that only heard of another's failure does not count).
            let failed = self.which(failure.as_ref().is_some_and(|e| e.as_oom().is_some()));
            if !failed.contains(&true) {
                let mut sums = [result.loss_sum, result.correct as f64, result.predictions as f64];
                self.group.all_reduce_sum_f64(&mut sums);
                let total = MicroResult { loss_sum: sums[0], correct: sums[1] as usize, predictions: sums[2] as usize };
                return Ok((total, recoveries));
            }
            for (_, param) in s.model.parameters() {
                param.set_grad(None);
            }
            s.check_released(before)?;
            s.device.empty_cache();
            // A stage failing twice in a row at one size is short of memory (not a transient fault):
            // halve the micro-batch; it cannot go below one sample.
            let repeated = failed.iter().zip(&failed_before).any(|(now, then)| *now && *then);
            if !recover || (repeated && *micro == 1) {
                return Err(failure.unwrap_or_else(|| {
                    TrainError::Invalid(format!(
                        "another stage of the pipeline ran out of memory at micro-batch {micro} and could not recover \
                         (its error says how much it needs)"
                    ))
                }));
            }
            recoveries += 1;
            if repeated {
                *micro = micro.div_ceil(2);
                failed_before = vec![false; self.stages.len()];
            } else {
                failed_before = failed;
            }
        }
    }

    /// One attempt at a window: every micro-batch forward, then (training) every one backward in
    /// reverse. Returns this stage's results and its out-of-memory, if it had one; other errors end
    /// the run.
    fn attempt(
        &self,
        s: &Session,
        samples: &dyn Samples,
        window: &[usize],
        micro: usize,
        train: bool,
    ) -> Result<(MicroResult, Option<TrainError>), TrainError> {
        let device = &s.device;
        let n = window.len();
        let chunks: Vec<&[usize]> = window.chunks(micro.max(1)).collect();
        let mut result = MicroResult { loss_sum: 0.0, correct: 0, predictions: 0 };
        let mut failure: Option<TrainError> = None;
        let stage = self.stage();
        for round in chunks.chunks(self.round()) {
            let mut in_flight: Vec<Option<InFlight>> = Vec::with_capacity(round.len());
            for &chunk in round {
                let mut flight = None;
                if failure.is_none() {
                    match self.stage_forward(s, samples, chunk, n, train, &mut result) {
                        Ok(Some(f)) => flight = Some(f),
                        Ok(None) => failure = Some(TrainError::Invalid("an earlier stage ran out of memory".into())),
                        Err(e) => failure = Some(survivable(e)?),
                    }
                } else if !self.first() {
                    // Take (and drop) what the stage before sends, so it never waits.
                    if let Err(e) = self.fetch(device, chunk.len(), stage - 1, "stage_input") {
                        survivable(e)?;
                    }
                }
                if !self.last() {
                    self.post(device, flight.as_ref().map(|f| &f.output), stage + 1)?;
                }
                in_flight.push(flight.filter(|_| train));
            }
            if !train {
                continue;
            }
            let _phase = device.enter_phase(Phase::Backward);
            for (i, chunk) in round.iter().enumerate().rev() {
                let flight = in_flight[i].take();
                let grad = if self.last() {
                    None
                } else {
                    match self.fetch(device, chunk.len(), stage + 1, "stage_output_grad") {
                        Ok(Some(g)) => Some(g),
                        Ok(None) => {
                            failure.get_or_insert(TrainError::Invalid("a later stage ran out of memory".into()));
                            None
                        }
                        Err(e) => {
                            failure.get_or_insert(survivable(e)?);
                            None
                        }
                    }
                };
                let mut sent = None;
                if let (None, Some(f)) = (&failure, flight) {
                    // Each gradient goes into `.grad` as soon as it is complete: a failure drops
                    // them all and re-runs the window anyway (Note [Pipeline]).
                    match autograd::backward_as_complete(&f.output, grad) {
                        Ok(()) => sent = f.input.as_ref().and_then(|x| x.grad()),
                        Err(e) => failure = Some(survivable(e.into())?),
                    }
                }
                if !self.first() {
                    self.post(device, sent.as_ref().filter(|_| failure.is_none()), stage - 1)?;
                }
            }
        }
        Ok((result, failure))
    }

    /// One micro-batch forward on this stage: its input (the batch, or the stream the stage before
    /// sent), its units, and on the last stage the weighted loss and the predictions' counts. None when
    /// the stage before failed.
    fn stage_forward(
        &self,
        s: &Session,
        samples: &dyn Samples,
        chunk: &[usize],
        n: usize,
        train: bool,
        result: &mut MicroResult,
    ) -> Result<Option<InFlight>, TrainError> {
        let device = &s.device;
        let phase = if train { Phase::Forward } else { Phase::Eval };
        // The stage before's message first, before anything here can fail: every message of the
        // round is taken exactly once (Note [Pipeline]).
        let received = match self.first() {
            true => None,
            false => {
                let _p = device.enter_phase(phase);
                match self.fetch(device, chunk.len(), self.stage() - 1, "stage_input")? {
                    Some(t) => Some(t.set_requires_grad(train)),
                    None => return Ok(None),
                }
            }
        };
        let (tokens, targets) = if self.first() || self.last() {
            let _p = device.enter_phase(Phase::Data);
            let (x, y) = samples.to_device(device, chunk)?;
            (self.first().then_some(x), self.last().then_some(y))
        } else {
            (None, None)
        };
        let _phase = device.enter_phase(phase);
        let input = match (tokens, received) {
            (Some(x), _) => x,
            (None, Some(t)) => t,
            (None, None) => return Err(TrainError::Invalid("internal: a stage with no input".into())),
        };
        let output = s.model.forward(&input, train)?;
        let Some(y) = targets else {
            let received = (!self.first()).then_some(input);
            return Ok(Some(InFlight { input: received, output }));
        };
        let l = loss(&output, &y)?;
        let predicted = argmax_classes(&output)?;
        drop(output);
        // Counted on every device alike (meta allocates the count too).
        let correct = predicted.count_equal(&y)?;
        if device.computes() {
            // Training sums per-sample means (the window's mean loss); evaluation per prediction.
            let mean = l.item()?;
            result.loss_sum += mean * if train { chunk.len() } else { y.numel() } as f64;
            result.correct += correct.item()? as usize;
        }
        result.predictions += y.numel();
        let weighted = if !train || chunk.len() == n { l } else { l.mul_scalar(chunk.len() as f64 / n as f64)? };
        let received = (!self.first()).then_some(input);
        Ok(Some(InFlight { input: received, output: weighted }))
    }
}

impl Peers for Pipeline {
    fn run_window(
        &self,
        session: &Session,
        samples: &dyn Samples,
        window: &[usize],
        micro: &mut usize,
        recover: bool,
        train: bool,
    ) -> Option<Result<(MicroResult, usize), TrainError>> {
        Some(self.window(session, samples, window, micro, recover, train))
    }

    fn eval_round(&self) -> Option<usize> {
        Some(self.round())
    }

    /// Every stage skips the step, or none does.
    fn overflowed(&self, local: bool) -> bool {
        self.any(local)
    }

    fn any(&self, flag: bool) -> bool {
        Pipeline::any(self, flag)
    }
}

/// The whole model's parameters and buffers on rank 0, in the full model's order, gathered from every
/// stage (the other stages' parameters arrive in host memory outside the budget: the bytes of the file
/// being saved); None on the other ranks. Every rank calls it.
pub fn gather_state_dict(
    session: &Session,
    spec: &memfit_nn::ModelSpec,
    seed: u64,
    group: &dyn Group,
    stages: &[Range<usize>],
) -> Result<Option<Vec<(String, Tensor)>>, TrainError> {
    if group.rank() != 0 {
        for (_, t) in session.model.parameters() {
            collective::send(group, &t, 0)?;
        }
        return Ok(None);
    }
    let mut named: std::collections::HashMap<String, Tensor> =
        memfit_nn::checkpoint::state_dict(session.model.as_ref()).into_iter().collect();
    let host = Device::cpu();
    for (stage, units) in stages.iter().enumerate().skip(1) {
        // The stage's names and shapes, from a model on meta (nothing allocated).
        let shapes = memfit_nn::build_stage(spec, &Device::meta(), seed, units.clone())?;
        for (name, t) in shapes.parameters() {
            let received = Tensor::empty(&host, t.shape(), DType::F32, Category::Parameter, "gathered")?;
            collective::receive(group, &received, stage)?;
            named.insert(name, received);
        }
    }
    let order = memfit_nn::checkpoint::state_dict(memfit_nn::build_model(spec, &Device::meta(), seed)?.as_ref());
    order
        .into_iter()
        .map(|(name, _)| {
            let t =
                named.remove(&name).ok_or_else(|| TrainError::Invalid(format!("internal: no stage holds {name}")))?;
            Ok((name, t))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
