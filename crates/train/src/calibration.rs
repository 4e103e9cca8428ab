//! Calibration: the cost model of one model on this machine ([`crate::cost::CostModel`]), measured.
//! [`calibrate`] times a few real training steps on `cpu` (synthetic data, no cap) at micro-batches 1,
//! 2, 4, 8, ... until a step gets long, times the largest again with every segment checkpointed,
//! with fp16 storage and in bf16 (storage and products), times one micro-batch of threads + 1 samples (Note [Samples in rounds]) and
//! a window of two one-sample micro-batches (the step's fixed work, counted once a step),
//! profiles which share of the forward each segment takes (in a step of its own: recording spans costs
//! time), and times the optimizer update alone. Each time is the median of at least five steps, more
//! for short ones (a run's report gives its median too); a larger micro-batch never costs more per
//! sample than a smaller one measured (a slower one is noise). A model whose micro-batch-1 step would need
//! more than 1 GiB is not run on this host: it gets [`CostModel::nominal`]. A model is cached per model,
//! optimizer, instruction set, thread count and build of memfit (`costs.json` in `MEMFIT_CACHE_DIR`,
//! else `~/.cache/memfit`), so calibration is paid once per build; the run's report gives the
//! prediction's error.

use crate::config::CheckpointChoice;
use crate::config::Precision;
use crate::cost::{CostModel, Costs};
use crate::dry_run::PlanRequest;
use crate::error::TrainError;
use crate::samples::synthetic;
use crate::trainer::{RunOptions, Session};
use memfit_tensor::{Category, Device, Phase, SpanKind, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Optimizer steps timed per measurement at least; one more runs first (it creates the optimizer
/// state). The median counts, as in a run's report.
const TIMED_STEPS: usize = 5;
/// Short steps are timed until they add up to this much (a few milliseconds a step vary by a third
/// from run to run on a shared machine)...
const MIN_TIMED_MS: f64 = 150.0;
/// ...or this many steps.
const MAX_TIMED_STEPS: usize = 60;
/// Calibration stops growing the micro-batch when the next one would take about this long a step (or
/// at the effective batch).
const LONG_STEP_MS: f64 = 250.0;
/// The largest micro-batch calibration measures.
const MAX_CALIBRATION_MICRO: usize = 256;
/// Calibration runs real steps on this host only for a model whose micro-batch-1 step needs at most
/// this much memory (the planner may plan for devices far larger than the host); larger models get
/// [`CostModel::nominal`].
const MAX_CALIBRATION_BYTES: u64 = 1 << 30;

/// The cost model `req.costs` asks for: given, read from its cache, or calibrated (and cached); true
/// when it was calibrated now.
pub fn model_for(req: &PlanRequest, segments: &[String]) -> Result<(CostModel, bool), TrainError> {
    let path = match &req.costs {
        Costs::Given(model) => return Ok((model.clone(), false)),
        Costs::Calibrate => None,
        Costs::Cached(path) => Some(path),
    };
    let key = cache_key(req);
    let mut cache: BTreeMap<String, CostModel> = path
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    let (built, pinned) = (format!("{key} | build {}", build_id()), format!("{key} | pinned"));
    if let Some(model) = cache.get(&built).or_else(|| cache.get(&pinned)) {
        return Ok((model.clone(), false));
    }
    let fp32 =
        PlanRequest { checkpoint: CheckpointChoice::None, precision: crate::config::Precision::Fp32, ..req.clone() };
    let smallest = req.model.smallest_micro_batch();
    let one = crate::dry_run::predict(&fp32, smallest, None, None)?.map_or(u64::MAX, |p| p.peak_reserved);
    if one > MAX_CALIBRATION_BYTES {
        return Ok((CostModel::nominal(segments), false));
    }
    let model = calibrate(req, segments)?;
    if let Some(path) = path {
        // Other builds' times of this model are stale: the kernels they timed are gone.
        cache.retain(|k, _| k != &key && !k.starts_with(&format!("{key} | build ")));
        cache.insert(built, model.clone());
        // A cache that cannot be written costs a calibration next time, nothing else.
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let text = serde_json::to_string_pretty(&cache).expect("a cost cache serializes");
        let _ = crate::output::write_atomic("cost cache", path, text.as_bytes());
    }
    Ok((model, true))
}

/// `costs.json` in `MEMFIT_CACHE_DIR`, else in `$HOME/.cache/memfit`; None without either.
pub fn default_cache() -> Option<PathBuf> {
    let dir = match std::env::var_os("MEMFIT_CACHE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache").join("memfit"),
    };
    Some(dir.join("costs.json"))
}

/// This binary, as the cost cache tells builds apart: its size and modification time. memfit's
/// version does not change when its kernels do, so times a rebuilt (or upgraded) binary would
/// reuse could be another build's. A cache entry is read only by the build that measured it, or
/// when a person pinned it (its key ends in `| pinned`, as the README's fixture does).
fn build_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let meta = std::env::current_exe().and_then(std::fs::metadata);
        match meta {
            Ok(m) => {
                let modified = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                format!("{} B {} ns", m.len(), modified.map_or(0, |d| d.as_nanos()))
            }
            Err(_) => "unknown".to_string(),
        }
    })
}

/// What a cost model depends on besides the machine itself (and the build: [`build_id`]).
fn cache_key(req: &PlanRequest) -> String {
    // The kind of optimizer and how its state is stored (8-bit moments cost time), not its rates:
    // they do not change the time. fp32 state adds nothing, so keys written before it still hold.
    let kind = format!("{:?}", req.optimizer).split([' ', '{', '(']).next().unwrap_or_default().to_string();
    let optimizer = match req.optimizer.state_format() {
        memfit_nn::StateFormat::Fp32 => kind,
        state => format!("{kind} state {}", state.name()),
    };
    format!(
        "costs v3 | {:?} | {optimizer} | isa {} | threads {} | memfit {}",
        req.model,
        memfit_tensor::Isa::active(),
        rayon::current_num_threads(),
        env!("CARGO_PKG_VERSION")
    )
}

/// Times real training steps on `cpu` (see the module documentation).
pub fn calibrate(req: &PlanRequest, segments: &[String]) -> Result<CostModel, TrainError> {
    let start = Instant::now();
    // From the smallest micro-batch the model takes (1, or 2 for batch norm over one value per channel).
    let smallest = req.model.smallest_micro_batch();
    let effective = req.effective_batch.clamp(smallest, MAX_CALIBRATION_MICRO.max(smallest));
    let (mut micro, mut plain_ms) = (Vec::new(), Vec::new());
    let mut m = smallest;
    let optimizer_ms = loop {
        let measured = time_steps(req, m, &CheckpointChoice::None)?;
        micro.push(m);
        plain_ms.push(measured.step_ms);
        let next_too_long = measured.step_ms * ((m * 2).min(effective) as f64 / m as f64) > LONG_STEP_MS;
        if m == effective || next_too_long {
            break measured.optimizer_ms;
        }
        m = (m * 2).min(effective);
    };
    let largest = *micro.last().expect("one micro-batch measured");
    let optimizer_ms = fixed_step_ms(req, plain_ms[0], optimizer_ms)?;
    let sample_rounds = sample_rounds(req, &micro)?;
    let profile = segment_forward_ms(req, largest, segments)?;
    for p in plain_ms.iter_mut() {
        // A sample is never free: a noisy step below the fixed work keeps a tenth of its time.
        *p = (*p - optimizer_ms).max(0.1 * *p);
    }
    per_sample_envelope(&micro, &mut plain_ms);
    // Extra time of a variant of the largest measured step, as a fraction of its plain time.
    let plain = *plain_ms.last().expect("one micro-batch measured");
    let extra = |step_ms: f64| if plain > 0.0 { ((step_ms - optimizer_ms) / plain - 1.0).max(0.0) } else { 0.0 };
    let recompute = match segments.is_empty() {
        true => 0.0,
        false => extra(time_steps(req, largest, &CheckpointChoice::All)?.step_ms),
    };
    // Half storage alone (fp16's conversions), and bf16 precision (its storage and products, which
    // may well be faster than f32's: not clamped at zero).
    let half = time_steps_in(req, largest, &CheckpointChoice::None, Precision::Fp16)?;
    let half_overhead = extra(half.step_ms);
    let bf16 = time_steps_in(req, largest, &CheckpointChoice::None, Precision::Bf16)?;
    let bf16_overhead = if plain > 0.0 { ((bf16.step_ms - optimizer_ms) / plain - 1.0).max(-0.9) } else { 0.0 };
    let total: f64 = profile.values().sum();
    let shares = segments
        .iter()
        .map(|s| {
            let share = match total > 0.0 {
                true => profile.get(s).copied().unwrap_or(0.0) / total,
                false => 1.0 / segments.len() as f64,
            };
            (s.clone(), share)
        })
        .collect();
    Ok(CostModel {
        micro,
        plain_ms,
        recompute,
        optimizer_ms,
        half_overhead,
        bf16_overhead: Some(bf16_overhead),
        segments: shares,
        calibration_ms: start.elapsed().as_secs_f64() * 1e3,
        nominal: false,
        sample_rounds,
    })
}

/// Caps each measured time at the time per sample of the micro-batch before it (`micro` ascending): a
/// larger micro-batch measured slower per sample than a smaller one is taken as noise, since other work
/// on a shared machine only adds time. One slow measurement (resnet's micro-batch 32 at 1.44 ms a
/// sample between 1.14 and 1.09) otherwise made the planner prefer micro-batches 20% slower in fact.
fn per_sample_envelope(micro: &[usize], plain_ms: &mut [f64]) {
    for i in 1..plain_ms.len().min(micro.len()) {
        let rate = plain_ms[i - 1] / micro[i - 1].max(1) as f64;
        plain_ms[i] = plain_ms[i].min(rate * micro[i] as f64);
    }
}

/// The fixed work of a step, done once whatever its micro-batches (the optimizer update, clearing
/// the gradients, the loop's own bookkeeping): a window of two micro-batches of one sample takes
/// `2 * one - fixed`, where `one` is a window of one (`one_sample_ms`). Counting it once per
/// micro-batch, as a step of one micro-batch measures it, over-predicted accumulated windows of small
/// models by 15-20% (simplecnn's 13 x 5). At least the optimizer update alone (`optimizer_ms`), at most
/// 90% of the one-sample step (a sample is never free); the optimizer alone when the window of two
/// was not measurably slower than the window of one (noise).
fn fixed_step_ms(req: &PlanRequest, one_sample_ms: f64, optimizer_ms: f64) -> Result<f64, TrainError> {
    // One-sample micro-batches, or the smallest the model takes (the first calibration measured).
    let smallest = req.model.smallest_micro_batch();
    if req.effective_batch < 2 * smallest {
        return Ok(optimizer_ms);
    }
    let two = time_windows(req, smallest, 2, &CheckpointChoice::None, Precision::Fp32)?.step_ms;
    if two <= one_sample_ms * 1.05 {
        return Ok(optimizer_ms);
    }
    Ok((2.0 * one_sample_ms - two).clamp(optimizer_ms, (0.9 * one_sample_ms).max(optimizer_ms)))
}

/// Note [Samples in rounds]: kernels that split a micro-batch's samples between threads (convolutions,
/// pooling) take as long for 3 samples as for 4 on 2 threads: the thread with two samples sets the time.
/// Interpolating between the measured powers of two then under-predicts odd micro-batches (deepcnn's
/// 3 x 22 ran 30% slower than predicted), and the planner picked them. Calibration times one micro-batch
/// of threads + 1 samples: when its time is nearer the next multiple of the thread count's than the
/// interpolated one, the model rounds every micro-batch up to a multiple of the threads
/// ([`CostModel::sample_rounds`]), and the planner prefers even splits. A GPT's kernels split rows of
/// tokens instead, and its model keeps plain interpolation.
///
/// The three micro-batches are timed here, one after the other (so the same load on the machine
/// weighs on all three), `rounds` of times each, and the median decides: one noisy comparison
/// against points timed seconds apart used to flip the answer from one calibration to the next.
/// `micro` are the micro-batches calibration measured (the test runs only where it has no odd one).
fn sample_rounds(req: &PlanRequest, micro: &[usize]) -> Result<usize, TrainError> {
    const ROUNDS: usize = 3;
    let threads = rayon::current_num_threads();
    let (low, odd, even) = (threads, threads + 1, 2 * threads);
    if threads < 2 || !micro.contains(&even) || micro.contains(&odd) {
        return Ok(0);
    }
    let mut votes = 0;
    for _ in 0..ROUNDS {
        let time = |m: usize| -> Result<f64, TrainError> { Ok(time_steps(req, m, &CheckpointChoice::None)?.step_ms) };
        let (t_low, t_odd, t_even) = (time(low)?, time(odd)?, time(even)?);
        let linear = t_low + (t_even - t_low) * (odd - low) as f64 / (even - low) as f64;
        if (t_odd - t_even).abs() < (t_odd - linear).abs() {
            votes += 1;
        }
    }
    Ok(if 2 * votes > ROUNDS { threads } else { 0 })
}

/// What one measurement gives.
struct Measured {
    /// Fastest step, the first step not counted (ms).
    step_ms: f64,
    /// Fastest optimizer update alone (ms).
    optimizer_ms: f64,
}

/// Times optimizer steps of one micro-batch of `micro` (unprofiled: recording spans costs time the
/// runs being planned do not pay), then the optimizer update alone (on zero gradients: its arithmetic
/// does not depend on the values).
fn time_steps(req: &PlanRequest, micro: usize, checkpoint: &CheckpointChoice) -> Result<Measured, TrainError> {
    time_steps_in(req, micro, checkpoint, Precision::Fp32)
}

/// A session of `req`'s model on `cpu` and the options of `steps` one-micro-batch steps of `micro`.
fn timing_session(
    req: &PlanRequest,
    micro: usize,
    checkpoint: &CheckpointChoice,
    precision: Precision,
    steps: usize,
) -> Result<(Session, Box<dyn crate::samples::Samples>, RunOptions), TrainError> {
    timing_windows(req, micro, 1, checkpoint, precision, steps)
}

/// [`timing_session`] with windows of `parts` micro-batches of `micro`.
fn timing_windows(
    req: &PlanRequest,
    micro: usize,
    parts: usize,
    checkpoint: &CheckpointChoice,
    precision: Precision,
    steps: usize,
) -> Result<(Session, Box<dyn crate::samples::Samples>, RunOptions), TrainError> {
    let device = Device::cpu();
    let session = Session::new(device.clone(), &req.model, req.optimizer, req.seed)?;
    session.set_checkpointing(checkpoint)?;
    session.set_precision(precision)?;
    let train = synthetic(&req.model, steps * micro * parts, req.seed);
    let opts = RunOptions {
        effective_batch: micro * parts,
        micro_batch: micro,
        eval_micro_batch: 1,
        epochs: Some(1),
        max_steps: Some(steps),
        data_seed: req.seed,
        recover: false,
        grow_after: usize::MAX,
        record_samples: false,
    };
    Ok((session, train, opts))
}

/// [`time_steps`] in `precision` (saved activations' storage, and bf16's products).
fn time_steps_in(
    req: &PlanRequest,
    micro: usize,
    checkpoint: &CheckpointChoice,
    precision: Precision,
) -> Result<Measured, TrainError> {
    time_windows(req, micro, 1, checkpoint, precision)
}

/// [`time_steps_in`] for windows of `parts` micro-batches of `micro`.
fn time_windows(
    req: &PlanRequest,
    micro: usize,
    parts: usize,
    checkpoint: &CheckpointChoice,
    precision: Precision,
) -> Result<Measured, TrainError> {
    let (mut session, train, opts) = timing_windows(req, micro, parts, checkpoint, precision, TIMED_STEPS + 1)?;
    let outcome = session.run(train.as_ref(), None, &opts, &mut |_| {})?;
    let mut times = outcome.step_times_ms.get(1..).unwrap_or(&[]).to_vec();
    // Short steps are noisy: time more of them, up to MIN_TIMED_MS in all.
    let more = RunOptions { max_steps: Some(TIMED_STEPS), ..opts };
    while times.iter().sum::<f64>() < MIN_TIMED_MS && times.len() < MAX_TIMED_STEPS {
        times.extend(session.run(train.as_ref(), None, &more, &mut |_| {})?.step_times_ms);
    }
    let device = session.device.clone();
    for (_, p) in session.model.parameters() {
        p.set_grad(Some(Tensor::zeros(&device, p.shape(), p.dtype(), Category::Gradient)?));
    }
    let mut updates = Vec::new();
    for _ in 0..TIMED_STEPS {
        let start = Instant::now();
        session.optimizer.step()?;
        updates.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Measured { step_ms: crate::trainer::median(&times), optimizer_ms: crate::trainer::median(&updates) })
}

/// The forward time of each segment at micro-batch `micro`, from a profiled step (the second: the
/// first creates the optimizer state); empty without segments.
fn segment_forward_ms(
    req: &PlanRequest,
    micro: usize,
    segments: &[String],
) -> Result<BTreeMap<String, f64>, TrainError> {
    if segments.is_empty() {
        return Ok(BTreeMap::new());
    }
    let (mut session, train, opts) = timing_session(req, micro, &CheckpointChoice::None, Precision::Fp32, 2)?;
    let device = session.device.clone();
    let mut steps = 0;
    session.run(train.as_ref(), None, &opts, &mut |_| {
        steps += 1;
        // Profile the second step only.
        device.set_profiling(steps == 1);
        if steps == 1 {
            let _ = device.take_spans();
        }
    })?;
    device.set_profiling(false);
    let names = device.module_names();
    let spans: Vec<(String, u64, u64)> = device
        .take_spans()
        .into_iter()
        .filter(|s| s.kind == SpanKind::Module && s.phase == Phase::Forward)
        .map(|s| (names.get(s.module as usize).cloned().unwrap_or_default(), s.start_ns, s.end_ns))
        .collect();
    Ok(segment_times(&spans, segments))
}

/// Forward time of each segment: the union of the intervals of its modules' spans (modules nest).
fn segment_times(spans: &[(String, u64, u64)], segments: &[String]) -> BTreeMap<String, f64> {
    segments
        .iter()
        .map(|segment| {
            let prefix = format!("{segment}.");
            let mut intervals: Vec<(u64, u64)> = spans
                .iter()
                .filter(|(name, _, _)| name == segment || name.starts_with(&prefix))
                .map(|&(_, a, b)| (a, b))
                .collect();
            intervals.sort_unstable();
            let (mut total, mut end) = (0u64, 0u64);
            for (a, b) in intervals {
                let a = a.max(end);
                if b > a {
                    total += b - a;
                    end = b;
                }
            }
            (segment.clone(), total as f64 / 1e6)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_per_sample_never_grows_with_the_micro_batch() {
        let micro = [1, 2, 4, 8];
        let mut plain = [2.0, 3.0, 9.0, 10.0];
        per_sample_envelope(&micro, &mut plain);
        assert_eq!(plain, [2.0, 3.0, 6.0, 10.0], "4 capped at 2's rate; 8 already below 4's");
        let mut steady = [1.0, 1.5, 2.5, 4.0];
        per_sample_envelope(&micro, &mut steady);
        assert_eq!(steady, [1.0, 1.5, 2.5, 4.0], "a falling rate is kept");
    }

    #[test]
    fn segment_time_is_the_union_of_its_module_spans() {
        let spans = vec![
            ("blocks.0.attn".to_string(), 0, 10),
            ("blocks.0.attn.qkv".to_string(), 2, 5), // nested: counted once
            ("blocks.0.mlp".to_string(), 12, 20),
            ("blocks.1.mlp".to_string(), 20, 23),
            ("blocks.10.mlp".to_string(), 30, 31),
            ("head".to_string(), 40, 50),
        ];
        let t = segment_times(&spans, &["blocks.0".into(), "blocks.1".into()]);
        assert_eq!(t["blocks.0"], 18.0 / 1e6);
        assert_eq!(t["blocks.1"], 3.0 / 1e6);
    }
}
