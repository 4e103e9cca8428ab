//! Optimizers (SGD with momentum/Nesterov/weight decay, Adam, AdamW) with PyTorch's exact update rules.
//! Their state lives in the allocator as `optimizer_state`.
//!
//! The arithmetic is in `memfit_tensor::ops::{sgd_update, adam_update}` (fused, in place, no
//! allocation). This file owns the bookkeeping: which parameters have state, per-parameter step
//! counts (as `torch.optim`: a parameter without a gradient is skipped and its count does not
//! advance), and the lazy, all-or-nothing allocation of the state (Note [Optimizer state allocation]).
//!
//! Note [Optimizer state allocation]: state tensors are created on the first step a parameter has a
//! gradient, as PyTorch does. `step` first allocates the missing state of every parameter that has a
//! gradient, and only then updates any parameter. An out-of-memory while allocating drops what this
//! call allocated and returns the error with every parameter, every existing state tensor and the
//! step counts exactly as before, so a trainer can free memory and call `step` again.

use memfit_tensor::ops::{adam_update, adam_update_8bit, adam_update_all, sgd_update};
use memfit_tensor::{Category, Error, Phase, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    Sgd { lr: f64, momentum: f64, dampening: f64, nesterov: bool, weight_decay: f64 },
    Adam { lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64, state: StateFormat },
    AdamW { lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64, state: StateFormat },
}

/// How Adam's moments are stored (`--optimizer-state`; Note [Compact optimizer state] in
/// memfit-cpu). Anything but `Fp32` changes the numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StateFormat {
    /// In the parameter's dtype, as PyTorch.
    #[default]
    Fp32,
    /// bf16 moments of f32 parameters (half the bytes).
    Bf16,
    /// 8-bit block-wise moments of f32 parameters of at least [`MIN_8BIT`] values (a quarter of the
    /// bytes); smaller ones keep f32 moments, as bitsandbytes does.
    Int8,
}

/// Parameters smaller than this keep f32 moments under [`StateFormat::Int8`] (bitsandbytes'
/// `min_8bit_size`): their state is small, and a block's maximum would be most of it.
pub const MIN_8BIT: usize = 4096;

impl StateFormat {
    pub fn parse(text: &str) -> std::result::Result<StateFormat, String> {
        match text.trim() {
            "fp32" => Ok(StateFormat::Fp32),
            "bf16" => Ok(StateFormat::Bf16),
            "int8" => Ok(StateFormat::Int8),
            other => Err(format!("unknown optimizer state {other:?}: give fp32, bf16 or int8")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StateFormat::Fp32 => "fp32",
            StateFormat::Bf16 => "bf16",
            StateFormat::Int8 => "int8",
        }
    }
}

impl OptimizerConfig {
    /// `torch.optim.SGD(lr)` defaults otherwise.
    pub fn sgd(lr: f64) -> Self {
        OptimizerConfig::Sgd { lr, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
    }

    /// `torch.optim.Adam(lr)` defaults otherwise.
    pub fn adam(lr: f64) -> Self {
        OptimizerConfig::Adam { lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, state: StateFormat::Fp32 }
    }

    /// `torch.optim.AdamW(lr)` defaults otherwise (weight_decay 0.01).
    pub fn adamw(lr: f64) -> Self {
        OptimizerConfig::AdamW { lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01, state: StateFormat::Fp32 }
    }

    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adam { lr, .. } | OptimizerConfig::AdamW { lr, .. } => {
                lr
            }
        }
    }

    fn set_lr(&mut self, new: f64) {
        match self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adam { lr, .. } | OptimizerConfig::AdamW { lr, .. } => {
                *lr = new
            }
        }
    }

    /// How Adam's moments are stored (`Fp32` for SGD).
    pub fn state_format(&self) -> StateFormat {
        match *self {
            OptimizerConfig::Sgd { .. } => StateFormat::Fp32,
            OptimizerConfig::Adam { state, .. } | OptimizerConfig::AdamW { state, .. } => state,
        }
    }

    /// The same optimizer with its moments stored as `format` (Adam and AdamW; SGD is left as it is).
    pub fn with_state_format(mut self, format: StateFormat) -> Self {
        if let OptimizerConfig::Adam { state, .. } | OptimizerConfig::AdamW { state, .. } = &mut self {
            *state = format;
        }
        self
    }

    /// Number of state tensors (each the size of its parameter) kept per parameter.
    pub fn state_tensors_per_param(&self) -> usize {
        match *self {
            OptimizerConfig::Sgd { momentum, .. } => usize::from(momentum != 0.0),
            OptimizerConfig::Adam { .. } | OptimizerConfig::AdamW { .. } => 2,
        }
    }

    /// Checks the hyper-parameters as `torch.optim` does.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::invalid(msg));
        // Written so that NaN fails every check.
        let non_negative = |x: f64| x >= 0.0;
        let lr = self.lr();
        if !non_negative(lr) {
            return bad(format!("invalid learning rate {lr}"));
        }
        match *self {
            OptimizerConfig::Sgd { momentum, dampening, nesterov, weight_decay, .. } => {
                if !non_negative(momentum) || !non_negative(weight_decay) {
                    return bad(format!("invalid SGD momentum {momentum} or weight decay {weight_decay}"));
                }
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return bad("Nesterov momentum requires a momentum and zero dampening".into());
                }
            }
            OptimizerConfig::Adam { betas, eps, weight_decay, .. }
            | OptimizerConfig::AdamW { betas, eps, weight_decay, .. } => {
                let beta_ok = |b: f64| (0.0..1.0).contains(&b);
                if !beta_ok(betas.0) || !beta_ok(betas.1) {
                    return bad(format!("invalid Adam betas {betas:?}: each must be in [0, 1)"));
                }
                if !non_negative(eps) || !non_negative(weight_decay) {
                    return bad(format!("invalid Adam eps {eps} or weight decay {weight_decay}"));
                }
            }
        }
        Ok(())
    }
}

/// The state of one parameter, created on its first step with a gradient.
enum ParamState {
    /// SGD; `momentum_buffer` is None without momentum. `steps` counts this parameter's updates.
    Sgd {
        momentum_buffer: Option<Tensor>,
        steps: u64,
    },
    Adam {
        moments: Moments,
        steps: u64,
    },
}

/// Adam's two moments (Note [Compact optimizer state] in memfit-cpu).
enum Moments {
    /// Tensors of the parameter's shape: its dtype, or bf16.
    Dense { exp_avg: Tensor, exp_avg_sq: Tensor },
    /// 8-bit block-wise: u8 codes of the parameter's length and one f32 absolute maximum per block.
    Quantized { m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor, v_absmax: Tensor },
}

impl ParamState {
    fn steps(&self) -> u64 {
        match self {
            ParamState::Sgd { steps, .. } | ParamState::Adam { steps, .. } => *steps,
        }
    }

    fn steps_mut(&mut self) -> &mut u64 {
        match self {
            ParamState::Sgd { steps, .. } | ParamState::Adam { steps, .. } => steps,
        }
    }

    /// The state's tensors by the names checkpoints give them (PyTorch's for SGD and Adam; 8-bit
    /// moments add `*_absmax`, their blocks' maxima).
    fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            ParamState::Sgd { momentum_buffer: Some(b), .. } => vec![("momentum_buffer", b)],
            ParamState::Sgd { .. } => Vec::new(),
            ParamState::Adam { moments: Moments::Dense { exp_avg, exp_avg_sq }, .. } => {
                vec![("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
            }
            ParamState::Adam { moments: Moments::Quantized { m_codes, m_absmax, v_codes, v_absmax }, .. } => vec![
                ("exp_avg", m_codes),
                ("exp_avg_absmax", m_absmax),
                ("exp_avg_sq", v_codes),
                ("exp_avg_sq_absmax", v_absmax),
            ],
        }
    }
}

/// What a caller can get wrong about a gradient: its device, layout, shape or dtype.
fn check_gradient(name: &str, p: &Tensor, g: &Tensor, device: &memfit_tensor::Device) -> Result<()> {
    if !g.device().same(p.device()) || !p.device().same(device) {
        return Err(Error::device(format!("optimizer: {name} and its gradient must be on one device")));
    }
    if !p.is_contiguous() || !g.is_contiguous() {
        return Err(Error::invalid(format!(
            "optimizer: {name} and its gradient must be contiguous to be updated in place"
        )));
    }
    if g.shape() != p.shape() || g.dtype() != p.dtype() {
        return Err(Error::shape(format!(
            "optimizer: gradient of {name} is {:?} {} but the parameter is {:?} {}",
            g.shape(),
            g.dtype(),
            p.shape(),
            p.dtype()
        )));
    }
    Ok(())
}

pub struct Optimizer {
    params: Vec<(String, Tensor)>,
    config: OptimizerConfig,
    /// One slot per parameter, None until its first step with a gradient.
    state: Vec<Option<ParamState>>,
    steps: u64,
}

impl Optimizer {
    /// `params` as from `Model::parameters()`.
    pub fn new(params: Vec<(String, Tensor)>, config: OptimizerConfig) -> Self {
        let state = params.iter().map(|_| None).collect();
        Optimizer { params, config, state, steps: 0 }
    }

    /// Like `new`, but rejects hyper-parameters `torch.optim` rejects.
    pub fn try_new(params: Vec<(String, Tensor)>, config: OptimizerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Optimizer::new(params, config))
    }

    /// Allocates the state of one parameter (Note [Optimizer state allocation]).
    fn allocate_state(&self, param: &Tensor) -> Result<ParamState> {
        let state = |shape: &[usize], dtype| Tensor::zeros(param.device(), shape, dtype, Category::OptimizerState);
        let zeros = || state(param.shape(), param.dtype());
        let f32_param = param.dtype() == memfit_tensor::DType::F32;
        Ok(match (self.config, self.config.state_format()) {
            (OptimizerConfig::Sgd { momentum, .. }, _) => {
                ParamState::Sgd { momentum_buffer: if momentum != 0.0 { Some(zeros()?) } else { None }, steps: 0 }
            }
            (_, StateFormat::Int8) if f32_param && param.numel() >= MIN_8BIT => {
                let (n, blocks) = (param.numel(), param.numel().div_ceil(memfit_tensor::ops::QUANT_BLOCK));
                let m_codes = state(&[n], memfit_tensor::DType::U8)?;
                let m_absmax = state(&[blocks], memfit_tensor::DType::F32)?;
                let v_codes = state(&[n], memfit_tensor::DType::U8)?;
                let moments = Moments::Quantized {
                    m_codes,
                    m_absmax,
                    v_codes,
                    v_absmax: state(&[blocks], memfit_tensor::DType::F32)?,
                };
                ParamState::Adam { moments, steps: 0 }
            }
            (_, StateFormat::Bf16) if f32_param => {
                let exp_avg = state(param.shape(), memfit_tensor::DType::BF16)?;
                let exp_avg_sq = state(param.shape(), memfit_tensor::DType::BF16)?;
                ParamState::Adam { moments: Moments::Dense { exp_avg, exp_avg_sq }, steps: 0 }
            }
            _ => {
                let exp_avg = zeros()?;
                ParamState::Adam { moments: Moments::Dense { exp_avg, exp_avg_sq: zeros()? }, steps: 0 }
            }
        })
    }

    /// One update from the parameters' `.grad` (parameters without a gradient are skipped, as in
    /// PyTorch). State is allocated on first use, for all parameters before any is updated, so an
    /// out-of-memory leaves parameters unchanged.
    pub fn step(&mut self) -> Result<()> {
        self.config.validate()?;
        let grads: Vec<Option<Tensor>> = self.params.iter().map(|(_, p)| p.grad()).collect();
        let Some(device) = self.params.first().map(|(_, p)| p.device().clone()) else {
            self.steps += 1;
            return Ok(());
        };
        let _phase = device.enter_phase(Phase::Optimizer);
        let _no_grad = device.no_grad();
        // Check everything a caller can get wrong before touching anything, so an error leaves every
        // parameter unchanged.
        for ((name, p), g) in self.params.iter().zip(&grads) {
            if let Some(g) = g {
                check_gradient(name, p, g, &device)?;
            }
        }
        // Phase 1: allocate all missing state; commit only if every allocation succeeded.
        let wanted: Vec<bool> = grads.iter().map(Option::is_some).collect();
        self.allocate_missing(&wanted)?;
        // Phase 2: update. Adam's dense moments in the parameter's dtype go together, a group per
        // step count (`adam_update_all`: on a GPU a few launches instead of one per parameter);
        // the rest one by one. The same bits either way: every update is element-wise.
        let mut groups: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            match self.adam_group_steps(i) {
                Some(steps) => groups.entry(steps).or_default().push(i),
                None => self.update(i, g)?,
            }
        }
        for (steps, members) in groups {
            self.update_group(steps, &members, &grads)?;
        }
        self.steps += 1;
        Ok(())
    }

    /// The steps taken by parameter `i` when it can be updated in a group (Adam or AdamW whose
    /// moments are dense in the parameter's dtype); None otherwise.
    fn adam_group_steps(&self, i: usize) -> Option<u64> {
        let (OptimizerConfig::Adam { .. } | OptimizerConfig::AdamW { .. }) = self.config else { return None };
        match self.state[i].as_ref()? {
            ParamState::Adam { moments: Moments::Dense { exp_avg, .. }, steps }
                if exp_avg.dtype() == self.params[i].1.dtype() =>
            {
                Some(*steps)
            }
            _ => None,
        }
    }

    /// One Adam step of the parameters `members` (each `adam_group_steps` gave `steps`) from their
    /// gradients in `grads`.
    fn update_group(&mut self, steps: u64, members: &[usize], grads: &[Option<Tensor>]) -> Result<()> {
        let (OptimizerConfig::Adam { lr, betas, eps, weight_decay, .. }
        | OptimizerConfig::AdamW { lr, betas, eps, weight_decay, .. }) = self.config
        else {
            return Err(Error::invalid("internal: a group update needs Adam"));
        };
        let decoupled = matches!(self.config, OptimizerConfig::AdamW { .. });
        let mut group = Vec::with_capacity(members.len());
        for &i in members {
            let (Some(ParamState::Adam { moments: Moments::Dense { exp_avg, exp_avg_sq }, .. }), Some(g)) =
                (self.state[i].as_ref(), grads[i].as_ref())
            else {
                return Err(Error::invalid("internal: a group member without dense Adam state or gradient"));
            };
            group.push([&self.params[i].1, g, exp_avg, exp_avg_sq]);
        }
        adam_update_all(&group, steps + 1, lr, betas, eps, weight_decay, decoupled).map_err(|e| match e {
            Error::OutOfMemory(_) => e,
            other => Error::invalid(format!("optimizer step on {} parameters: {other}", members.len())),
        })?;
        for &i in members {
            if let Some(ParamState::Adam { steps, .. }) = self.state[i].as_mut() {
                *steps += 1;
            }
        }
        Ok(())
    }

    /// Allocates the state of every parameter `wanted` marks that has none yet; all of it or, on an
    /// out-of-memory, none.
    fn allocate_missing(&mut self, wanted: &[bool]) -> Result<()> {
        let mut fresh: Vec<(usize, ParamState)> = Vec::new();
        for (i, (_, p)) in self.params.iter().enumerate() {
            if wanted[i] && self.state[i].is_none() {
                fresh.push((i, self.allocate_state(p)?));
            }
        }
        for (i, s) in fresh {
            self.state[i] = Some(s);
        }
        Ok(())
    }

    /// Before a step inside backward ([`Optimizer::step_one`]): allocates the state of every
    /// parameter that requires grad and has none yet (all or none, as [`Optimizer::step`] does), so
    /// that the updates made as gradients complete allocate nothing. PyTorch's optimizer makes a
    /// parameter's state at its first update; made here, it is the same zeros a little earlier.
    pub fn prepare_step_in_backward(&mut self) -> Result<()> {
        self.config.validate()?;
        let wanted: Vec<bool> = self.params.iter().map(|(_, p)| p.requires_grad()).collect();
        self.allocate_missing(&wanted)
    }

    /// Updates the one parameter `param` (a handle on one of the optimizer's) from its complete
    /// gradient `grad`, exactly as [`Optimizer::step`] would: the step inside backward, made as each
    /// gradient completes (Note [Step in backward] in the train crate). Its state must exist
    /// ([`Optimizer::prepare_step_in_backward`]); nothing is allocated. Call
    /// [`Optimizer::finish_step_in_backward`] once the pass is over.
    pub fn step_one(&mut self, param: &Tensor, grad: &Tensor) -> Result<()> {
        let i = self.params.iter().position(|(_, p)| p.same(param)).ok_or_else(|| {
            Error::invalid("optimizer: a gradient was handed over for a tensor that is not one of its parameters")
        })?;
        let (name, p) = &self.params[i];
        check_gradient(name, p, grad, p.device())?;
        if self.state[i].is_none() {
            return Err(Error::invalid(format!(
                "optimizer: {name} has no state to update in backward (prepare_step_in_backward first)"
            )));
        }
        let _phase = p.device().enter_phase(Phase::Optimizer);
        let _no_grad = p.device().no_grad();
        self.update(i, grad)
    }

    /// Counts the step whose parameters [`Optimizer::step_one`] updated.
    pub fn finish_step_in_backward(&mut self) {
        self.steps += 1;
    }

    /// Updates parameter `i` from `g` with its (existing) state.
    fn update(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let (name, p) = &self.params[i];
        let state = self.state[i].as_mut().ok_or_else(|| Error::invalid("internal: optimizer state missing"))?;
        let with_name = |e: Error| match e {
            Error::OutOfMemory(_) => e,
            other => Error::invalid(format!("optimizer step on {name}: {other}")),
        };
        match (self.config, state) {
            (
                OptimizerConfig::Sgd { lr, momentum, dampening, nesterov, weight_decay },
                ParamState::Sgd { momentum_buffer, steps },
            ) => {
                sgd_update(
                    p,
                    g,
                    momentum_buffer.as_ref(),
                    *steps == 0,
                    lr,
                    momentum,
                    dampening,
                    nesterov,
                    weight_decay,
                )
                .map_err(with_name)?;
                *steps += 1;
            }
            (
                OptimizerConfig::Adam { lr, betas, eps, weight_decay, .. }
                | OptimizerConfig::AdamW { lr, betas, eps, weight_decay, .. },
                ParamState::Adam { moments, steps },
            ) => {
                let decoupled = matches!(self.config, OptimizerConfig::AdamW { .. });
                let t = *steps + 1;
                match moments {
                    Moments::Dense { exp_avg, exp_avg_sq } => {
                        adam_update(p, g, exp_avg, exp_avg_sq, t, lr, betas, eps, weight_decay, decoupled)
                    }
                    Moments::Quantized { m_codes, m_absmax, v_codes, v_absmax } => adam_update_8bit(
                        p,
                        g,
                        (m_codes, m_absmax),
                        (v_codes, v_absmax),
                        t,
                        lr,
                        betas,
                        eps,
                        weight_decay,
                        decoupled,
                    ),
                }
                .map_err(with_name)?;
                *steps += 1;
            }
            _ => return Err(Error::invalid("internal: optimizer state does not match its configuration")),
        }
        Ok(())
    }

    /// Frees every gradient (`set_to_none=True`).
    pub fn zero_grad(&self) {
        for (_, p) in &self.params {
            p.set_grad(None);
        }
    }

    pub fn lr(&self) -> f64 {
        self.config.lr()
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.config.set_lr(lr);
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// State tensors as (parameter name, state name, tensor): "momentum_buffer", "exp_avg", "exp_avg_sq".
    pub fn state(&self) -> Vec<(String, &'static str, Tensor)> {
        let mut out = Vec::new();
        for ((name, _), s) in self.params.iter().zip(&self.state) {
            for (kind, t) in s.iter().flat_map(ParamState::tensors) {
                out.push((name.clone(), kind, t.clone()));
            }
        }
        out
    }

    /// The parameters this optimizer updates, in the order given to `new`.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    pub fn config(&self) -> OptimizerConfig {
        self.config
    }

    /// Updates taken by one parameter (PyTorch's per-parameter `state['step']`); None for an unknown
    /// name, 0 before its first update.
    pub fn param_steps(&self, name: &str) -> Option<u64> {
        let i = self.params.iter().position(|(n, _)| n == name)?;
        Some(self.state[i].as_ref().map_or(0, ParamState::steps))
    }

    /// Each parameter's update count, in parameter order (PyTorch's `state[p]['step']`; 0 before its
    /// first update): with [`Optimizer::state`] and [`Optimizer::steps`], all a resumed run needs.
    pub fn param_step_counts(&self) -> Vec<(String, u64)> {
        self.params
            .iter()
            .zip(&self.state)
            .map(|((n, _), s)| (n.clone(), s.as_ref().map_or(0, ParamState::steps)))
            .collect()
    }

    /// Restores the state [`Optimizer::state`], [`Optimizer::param_step_counts`] and
    /// [`Optimizer::steps`] described, so the next `step` is the one an uninterrupted run would take.
    /// `tensors` holds (parameter name, state name, values) as `state()` lists them; every parameter with
    /// a count above 0 gets its state allocated (category `optimizer_state`) and copied. Everything is
    /// checked before anything changes: an unknown parameter, a missing or misshapen state tensor is an
    /// error that names it, and leaves the optimizer as it was.
    pub fn restore(
        &mut self,
        steps: u64,
        counts: &[(String, u64)],
        tensors: &[(String, String, Tensor)],
    ) -> Result<()> {
        let find =
            |param: &str, kind: &str| tensors.iter().find(|(p, k, _)| p == param && k == kind).map(|(_, _, t)| t);
        let mut fresh: Vec<Option<ParamState>> = self.params.iter().map(|_| None).collect();
        for (name, count) in counts {
            let i = self.params.iter().position(|(n, _)| n == name).ok_or_else(|| {
                Error::invalid(format!("optimizer state names {name:?}, which the model does not have"))
            })?;
            if *count == 0 {
                continue;
            }
            let param = &self.params[i].1;
            let mut state = self.allocate_state(param)?;
            for (kind, dst) in state.tensors() {
                let src = find(name, kind)
                    .ok_or_else(|| Error::invalid(format!("optimizer state {name}.{kind} is missing")))?;
                if src.shape() != dst.shape() || src.dtype() != dst.dtype() {
                    return Err(Error::shape(format!(
                        "optimizer state {name}.{kind} is {:?} {} but this optimizer keeps {:?} {} (the parameter is \
                         {:?} {}; is --optimizer-state the one the checkpoint was written with?)",
                        src.shape(),
                        src.dtype(),
                        dst.shape(),
                        dst.dtype(),
                        param.shape(),
                        param.dtype()
                    )));
                }
                dst.copy_from(src)?;
            }
            *state.steps_mut() = *count;
            fresh[i] = Some(state);
        }
        self.state = fresh;
        self.steps = steps;
        Ok(())
    }

    /// Bytes of optimizer state currently held (allocated lazily, so 0 before the first step).
    pub fn state_bytes(&self) -> u64 {
        self.state().iter().map(|(_, _, t)| (t.numel() * t.dtype().size()) as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    /// Adam with bf16 and 8-bit moments: the state's bytes, updates close to f32 Adam's, and a
    /// restored optimizer that continues bit for bit.
    #[test]
    fn compact_moments_keep_their_bytes_track_f32_adam_and_restore_exactly() {
        let d = Device::cpu();
        let n = 5000; // at least MIN_8BIT: three blocks of 8-bit state
        let start: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).sin()).collect();
        let grad_at = |step: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * 7 + step * 13) as f32 * 0.05).cos() * 10f32.powi(-((i % 5) as i32))).collect()
        };
        let make = |format: StateFormat| {
            let p = leaf(&d, &start);
            let opt =
                Optimizer::new(vec![("w".into(), p.clone())], OptimizerConfig::adamw(1e-2).with_state_format(format));
            (p, opt)
        };
        let take = |p: &Tensor, opt: &mut Optimizer, steps: std::ops::Range<usize>| {
            for s in steps {
                p.set_grad(Some(grad(&d, &grad_at(s))));
                opt.step().unwrap();
            }
        };
        let (reference, mut fp32) = make(StateFormat::Fp32);
        take(&reference, &mut fp32, 0..5);
        let want = reference.to_vec::<f32>().unwrap();
        for (format, bytes) in [(StateFormat::Bf16, 2 * n * 2), (StateFormat::Int8, 2 * n + 2 * 3 * 4)] {
            let (p, mut opt) = make(format);
            take(&p, &mut opt, 0..3);
            assert_eq!(opt.state_bytes(), bytes as u64, "{format:?}");
            // A second optimizer restored from the first's state takes the same two steps.
            let q = leaf(&d, &p.to_vec::<f32>().unwrap());
            let mut restored =
                Optimizer::new(vec![("w".into(), q.clone())], OptimizerConfig::adamw(1e-2).with_state_format(format));
            let tensors: Vec<(String, String, Tensor)> =
                opt.state().into_iter().map(|(p, k, t)| (p, k.to_string(), t)).collect();
            restored.restore(opt.steps(), &opt.param_step_counts(), &tensors).unwrap();
            take(&p, &mut opt, 3..5);
            take(&q, &mut restored, 3..5);
            let got = p.to_vec::<f32>().unwrap();
            assert_eq!(got, q.to_vec::<f32>().unwrap(), "{format:?}: restored state continues bit for bit");
            // Five steps of lr 1e-2 move each weight up to 5e-2; compact moments stay close to that.
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst > 0.0 && worst < 5e-3, "{format:?}: {worst}");
            // A restore into an optimizer of another format is refused by name.
            let mut other = Optimizer::new(vec![("w".into(), leaf(&d, &start))], OptimizerConfig::adamw(1e-2));
            let err = other.restore(opt.steps(), &opt.param_step_counts(), &tensors).unwrap_err();
            assert!(err.to_string().contains("--optimizer-state"), "{err}");
        }
    }

    use super::*;
    use memfit_tensor::memory::FaultInjection;
    use memfit_tensor::{DType, Device, DeviceConfig, DeviceKind};

    fn leaf(d: &Device, v: &[f32]) -> Tensor {
        Tensor::from_slice(d, v, &[v.len()], Category::Parameter).unwrap().set_requires_grad(true)
    }

    fn grad(d: &Device, v: &[f32]) -> Tensor {
        Tensor::from_slice(d, v, &[v.len()], Category::Gradient).unwrap()
    }

    #[test]
    fn sgd_steps_and_skips_parameters_without_gradient() {
        let d = Device::cpu();
        let (a, b) = (leaf(&d, &[1.0, 2.0]), leaf(&d, &[3.0]));
        let mut opt = Optimizer::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], OptimizerConfig::sgd(0.5));
        a.set_grad(Some(grad(&d, &[1.0, -1.0])));
        opt.step().unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.5, 2.5]);
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![3.0]);
        assert_eq!((opt.steps(), opt.param_steps("a"), opt.param_steps("b")), (1, Some(1), Some(0)));
        assert!(opt.state().is_empty(), "plain SGD keeps no state");
        opt.zero_grad();
        assert!(a.grad().is_none() && b.grad().is_none());
        opt.set_lr(0.25);
        assert_eq!(opt.lr(), 0.25);
    }

    #[test]
    fn adam_state_is_lazy_and_per_parameter() {
        let d = Device::cpu();
        let (a, b) = (leaf(&d, &[1.0, 2.0]), leaf(&d, &[3.0]));
        let mut opt =
            Optimizer::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], OptimizerConfig::adam(0.1));
        assert_eq!(opt.state_bytes(), 0);
        assert_eq!(d.stats().category(Category::OptimizerState).current, 0);
        a.set_grad(Some(grad(&d, &[1.0, -1.0])));
        opt.step().unwrap();
        let names: Vec<(String, &str)> = opt.state().into_iter().map(|(n, s, _)| (n, s)).collect();
        assert_eq!(names, vec![("a".to_string(), "exp_avg"), ("a".to_string(), "exp_avg_sq")]);
        assert!(d.stats().category(Category::OptimizerState).current > 0);
        assert_eq!(d.stats().category(Category::OptimizerState).allocated, 2 * 512, "two blocks of 512 B");
        assert_eq!(opt.state_bytes(), 16);
        // Step 1 of Adam moves each element by lr (sign of the gradient).
        let av = a.to_vec::<f32>().unwrap();
        assert!((av[0] - 0.9).abs() < 1e-6 && (av[1] - 2.1).abs() < 1e-6, "{av:?}");
        // b gets its first gradient at optimizer step 2: its own step count starts at 1.
        b.set_grad(Some(grad(&d, &[2.0])));
        opt.step().unwrap();
        assert_eq!((opt.param_steps("a"), opt.param_steps("b")), (Some(2), Some(1)));
        assert!((b.to_vec::<f32>().unwrap()[0] - 2.9).abs() < 1e-6);
    }

    #[test]
    fn out_of_memory_leaves_everything_unchanged() {
        // AdamW needs 4 state tensors here; failing any of those allocations must leave parameters,
        // state and counters untouched.
        for fail_at in 1..=4u64 {
            let config = DeviceConfig::new(DeviceKind::Cpu);
            let d = Device::new(config).unwrap();
            let (a, b) = (leaf(&d, &[1.0, 2.0]), leaf(&d, &[3.0]));
            a.set_grad(Some(grad(&d, &[1.0, 1.0])));
            b.set_grad(Some(grad(&d, &[1.0])));
            let stats = d.stats();
            let requests = stats.allocation.allocated + stats.num_ooms;
            d.set_fault_injection(Some(FaultInjection::Nth(requests + fail_at)));
            let mut opt =
                Optimizer::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], OptimizerConfig::adamw(0.1));
            let err = opt.step().unwrap_err();
            assert!(err.is_oom(), "{err}");
            assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
            assert_eq!(b.to_vec::<f32>().unwrap(), vec![3.0]);
            assert_eq!(opt.steps(), 0);
            assert!(opt.state().is_empty());
            assert_eq!(d.stats().category(Category::OptimizerState).current, 0, "nothing leaked");
            // After the failure, a retry succeeds.
            d.set_fault_injection(None);
            opt.step().unwrap();
            assert_eq!(opt.state().len(), 4);
            assert_ne!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
        }
    }

    #[test]
    fn a_bad_gradient_is_reported_before_any_update() {
        let d = Device::cpu();
        let a = leaf(&d, &[1.0, 2.0]);
        let b = Tensor::from_slice(&d, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2], Category::Parameter).unwrap();
        let b = b.set_requires_grad(true);
        a.set_grad(Some(grad(&d, &[1.0, 1.0])));
        let g = Tensor::from_slice(&d, &[1.0f32; 4], &[2, 2], Category::Gradient).unwrap();
        b.set_grad(Some(g.transpose(0, 1).unwrap()));
        let mut opt = Optimizer::new(vec![("a".into(), a.clone()), ("b".into(), b)], OptimizerConfig::sgd(0.5));
        assert!(opt.step().is_err(), "a non-contiguous gradient");
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0], "nothing was updated");
        a.set_grad(Some(grad(&d, &[1.0, 1.0, 1.0])));
        assert!(opt.step().is_err(), "a gradient of the wrong shape");
        assert_eq!(opt.steps(), 0);
    }

    #[test]
    fn meta_allocates_the_same_state_as_cpu() {
        let run = |d: &Device| {
            let p = Tensor::zeros(d, &[3, 5], DType::F32, Category::Parameter).unwrap().set_requires_grad(true);
            p.set_grad(Some(Tensor::zeros(d, &[3, 5], DType::F32, Category::Gradient).unwrap()));
            let cfg =
                OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, nesterov: true, weight_decay: 0.0 };
            let mut opt = Optimizer::new(vec![("p".into(), p)], cfg);
            opt.step().unwrap();
            opt.step().unwrap();
            (*d.stats().category(Category::OptimizerState), opt.state_bytes())
        };
        let (cpu, meta) = (run(&Device::cpu()), run(&Device::meta()));
        assert_eq!(cpu.1, 60);
        assert!(cpu.0.current > 0);
        assert_eq!(cpu, meta);
    }

    #[test]
    fn invalid_configurations_are_rejected() {
        let bad = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.0, dampening: 0.0, nesterov: true, weight_decay: 0.0 };
        assert!(Optimizer::try_new(vec![], bad).is_err());
        assert!(OptimizerConfig::Adam {
            lr: 0.1,
            betas: (1.0, 0.9),
            eps: 1e-8,
            weight_decay: 0.0,
            state: StateFormat::Fp32
        }
        .validate()
        .is_err());
        assert!(OptimizerConfig::adam(-1.0).validate().is_err());
        assert!(OptimizerConfig::adamw(1e-3).validate().is_ok());
    }
}
