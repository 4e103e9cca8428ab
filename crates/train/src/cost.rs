//! The time side of planning: a [`CostModel`] predicts the step time of any micro-batch, checkpointed
//! set and storage precision of one model on this machine, from times `calibration.rs` measured:
//!
//! step = optimizer + (1 + precision) * sum over the window's micro-batches m of
//!        plain(m) * (1 + recompute * sum over checkpointed segments s of share(s))
//!
//! where `plain` interpolates the measured forward-and-backward times linearly between the measured
//! micro-batches (beyond them keeping the largest one's time per sample; a micro-batch counted as the
//! next multiple of [`CostModel::sample_rounds`], Note [Samples in rounds]), `recompute` is the
//! measured extra time of checkpointing every segment as a fraction of `plain`, and `precision` the
//! measured extra time of half-precision storage (fp16), or of bf16 storage and products (bf16:
//! negative where bf16 products are faster), 0 in f32. A model too large to time on this host gets
//! [`CostModel::nominal`], said so wherever its times are shown.

use crate::config::Precision;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where the step-time model comes from.
#[derive(Clone, Debug, Default)]
pub enum Costs {
    /// Measure on this machine, every time.
    #[default]
    Calibrate,
    /// Measure, cached in this file.
    Cached(PathBuf),
    /// This model (tests, and callers that calibrated already).
    Given(CostModel),
}

/// Predicted step times of one model on this machine (see the module documentation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Micro-batches measured, ascending.
    pub micro: Vec<usize>,
    /// Forward and backward of one micro-batch of each size, nothing checkpointed (ms).
    pub plain_ms: Vec<f64>,
    /// The extra time of checkpointing every segment, as a fraction of the plain time.
    pub recompute: f64,
    /// The optimizer update and the step's other fixed work (ms).
    pub optimizer_ms: f64,
    /// The extra time of storing saved activations in half precision (conversions; fp16), as a
    /// fraction of the plain time.
    pub half_overhead: f64,
    /// The extra time of bf16 precision (bf16 storage and bf16 products), as a fraction of the plain
    /// time: negative where bf16 products are faster than f32's. Absent from models calibrated
    /// before bf16 products: taken as `half_overhead` then.
    #[serde(default)]
    pub bf16_overhead: Option<f64>,
    /// Each segment's share of the recomputation (its share of the forward), summing to 1.
    pub segments: BTreeMap<String, f64>,
    /// How long calibration took (ms).
    pub calibration_ms: f64,
    /// Not measured (the model is too large to time on this host): times are relative units, from
    /// the usual proportions (cost linear in the samples, a re-run forward a third of a step).
    #[serde(default)]
    pub nominal: bool,
    /// The model's kernels share a micro-batch's samples out to this many threads, so a micro-batch
    /// costs as much as the next multiple of it (with 2 threads, 3 samples take as long as 4); 0 or 1
    /// when calibration found no such steps. Measured, not assumed: see [`crate::calibration::calibrate`].
    #[serde(default)]
    pub sample_rounds: usize,
}

impl CostModel {
    /// The uncalibrated model: one unit per sample, recomputation a third of the forward-and-backward,
    /// segments alike, half storage 3% dearer.
    pub fn nominal(segments: &[String]) -> CostModel {
        CostModel {
            micro: vec![1],
            plain_ms: vec![1.0],
            recompute: 1.0 / 3.0,
            optimizer_ms: 0.0,
            half_overhead: 0.03,
            bf16_overhead: None,
            segments: segments.iter().map(|s| (s.clone(), 1.0 / segments.len() as f64)).collect(),
            calibration_ms: 0.0,
            nominal: true,
            sample_rounds: 0,
        }
    }

    /// Forward and backward of a micro-batch of `m` with `checkpointed` segments (names) re-run.
    pub fn micro_ms(&self, m: usize, checkpointed: &[String]) -> f64 {
        let plain = interpolate(&self.micro, &self.plain_ms, m.next_multiple_of(self.sample_rounds.max(1)));
        let share: f64 = checkpointed.iter().map(|s| self.share(s)).sum();
        plain * (1.0 + self.recompute * share)
    }

    /// One optimizer step over `effective` samples in micro-batches of `micro` (the last one partial).
    pub fn step_ms(&self, effective: usize, micro: usize, checkpointed: &[String]) -> f64 {
        let micro = micro.clamp(1, effective.max(1));
        let parts = effective.div_ceil(micro).max(1);
        let last = effective - (parts - 1) * micro;
        self.optimizer_ms + (parts - 1) as f64 * self.micro_ms(micro, checkpointed) + self.micro_ms(last, checkpointed)
    }

    /// [`CostModel::step_ms`] in `precision` (`auto` unresolved: as f32).
    pub fn step_ms_in(&self, effective: usize, micro: usize, checkpointed: &[String], precision: Precision) -> f64 {
        let step = self.step_ms(effective, micro, checkpointed);
        let extra = match precision {
            Precision::Fp16 => self.half_overhead,
            Precision::Bf16 => self.bf16_overhead.unwrap_or(self.half_overhead),
            Precision::Fp32 | Precision::Auto => return step,
        };
        self.optimizer_ms + (step - self.optimizer_ms) * (1.0 + extra)
    }

    /// A predicted step time for people ([`describe_step`]).
    pub fn describe(&self, step_ms: f64) -> String {
        describe_step(self.nominal, step_ms)
    }

    /// The recomputation share of checkpointing `segment` (0 for a name it does not know).
    pub fn share(&self, segment: &str) -> f64 {
        self.segments.get(segment).copied().unwrap_or(0.0)
    }
}

/// A predicted step time for people: "~N ms a step", or units for a nominal model.
pub fn describe_step(nominal: bool, step_ms: f64) -> String {
    match nominal {
        false => format!("~{step_ms:.0} ms a step"),
        true => format!("~{step_ms:.1} units a step (nominal)"),
    }
}

/// `ys` at `x`, linear between the measured `xs` (ascending), and proportional to `x` outside them
/// (below the first, and beyond the last at the last point's time per sample: a slope measured between
/// two small micro-batches says nothing of larger ones, and extending it made the planner prefer
/// smaller micro-batches it had never timed).
fn interpolate(xs: &[usize], ys: &[f64], x: usize) -> f64 {
    let x = x as f64;
    let points: Vec<(f64, f64)> = xs.iter().map(|&x| x as f64).zip(ys.iter().copied()).collect();
    match points.as_slice() {
        [] => 0.0,
        [(x0, y0)] => y0 * x / x0,
        _ => {
            if x <= points[0].0 {
                return points[0].1 * x / points[0].0;
            }
            let (x_last, y_last) = points[points.len() - 1];
            if x > x_last {
                return y_last * x / x_last;
            }
            let i = points.windows(2).position(|w| x <= w[1].0).unwrap_or(points.len() - 2);
            let ((xa, ya), (xb, yb)) = (points[i], points[i + 1]);
            (ya + (yb - ya) * (x - xa) / (xb - xa)).max(0.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            micro: vec![1, 4, 16],
            plain_ms: vec![2.0, 5.0, 17.0],
            recompute: 0.4,
            half_overhead: 0.1,
            bf16_overhead: None,
            optimizer_ms: 1.0,
            segments: [("a".to_string(), 0.25), ("b".to_string(), 0.75)].into_iter().collect(),
            calibration_ms: 0.0,
            nominal: false,
            sample_rounds: 0,
        }
    }

    #[test]
    fn interpolation_is_linear_between_points_and_proportional_outside_them() {
        let (xs, ys) = ([1, 4, 16], [2.0, 5.0, 17.0]);
        assert_eq!(interpolate(&xs, &ys, 1), 2.0);
        assert_eq!(interpolate(&xs, &ys, 2), 3.0);
        assert_eq!(interpolate(&xs, &ys, 4), 5.0);
        assert_eq!(interpolate(&xs, &ys, 10), 11.0);
        assert_eq!(interpolate(&xs, &ys, 32), 34.0, "beyond the last point: its time per sample");
        assert_eq!(interpolate(&[4], &[8.0], 2), 4.0);
        assert_eq!(interpolate(&[2, 4], &[4.0, 6.0], 1), 2.0, "below the first point: proportional");
        assert_eq!(interpolate(&[], &[], 3), 0.0);
    }

    #[test]
    fn a_step_adds_the_optimizer_each_micro_batch_and_the_recomputation_of_its_segments() {
        let c = model();
        assert_eq!(c.micro_ms(4, &[]), 5.0);
        assert_eq!(c.micro_ms(4, &["a".into()]), 5.5);
        assert_eq!(c.micro_ms(4, &["a".into(), "b".into()]), 7.0);
        assert_eq!(c.micro_ms(16, &["b".into()]), 17.0 * 1.3);
        assert_eq!(c.micro_ms(4, &["unknown".into()]), 5.0);
        // 10 samples in micro-batches of 4: 4 + 4 + 2.
        assert_eq!(c.step_ms(10, 4, &[]), 1.0 + 5.0 + 5.0 + 3.0);
        assert_eq!(c.step_ms(4, 16, &[]), 1.0 + 5.0, "a micro-batch above the batch is the batch");
        assert_eq!(c.share("b"), 0.75);
    }

    #[test]
    fn samples_shared_out_to_threads_cost_a_whole_round() {
        let rounds = CostModel { sample_rounds: 2, ..model() };
        assert_eq!(rounds.micro_ms(3, &[]), rounds.micro_ms(4, &[]), "3 samples on 2 threads take as long as 4");
        assert_eq!(rounds.micro_ms(4, &[]), 5.0);
        assert!(model().micro_ms(3, &[]) < model().micro_ms(4, &[]));
        // So the planner's fastest split of 12 samples is 4 x 3, not 3 x 4 (which pays for 4 x 4).
        assert!(rounds.step_ms(12, 4, &[]) < rounds.step_ms(12, 3, &[]));
    }

    #[test]
    fn the_nominal_model_charges_samples_and_a_third_for_a_re_run() {
        let names = ["x".to_string(), "y".to_string()];
        let c = CostModel::nominal(&names);
        assert!(c.nominal);
        assert_eq!(c.step_ms(8, 4, &[]), 8.0);
        assert!((c.step_ms(8, 4, &names) - 8.0 * 4.0 / 3.0).abs() < 1e-12);
        assert!((c.step_ms_in(8, 4, &[], Precision::Bf16) - 8.0 * 1.03).abs() < 1e-12);
    }

    /// fp16 pays its storage's conversions; bf16 its own measured factor, a saving when negative
    /// (its products are faster), or fp16's where a model calibrated before bf16 products has none;
    /// the optimizer's fixed work is never scaled.
    #[test]
    fn each_precision_scales_the_micro_batches_by_its_own_factor() {
        let mut c = model();
        c.half_overhead = 0.1;
        c.bf16_overhead = Some(-0.2);
        let plain = c.step_ms(16, 4, &[]);
        let scaled = |f: f64| c.optimizer_ms + (plain - c.optimizer_ms) * (1.0 + f);
        assert_eq!(c.step_ms_in(16, 4, &[], Precision::Fp32), plain);
        assert_eq!(c.step_ms_in(16, 4, &[], Precision::Auto), plain);
        assert!((c.step_ms_in(16, 4, &[], Precision::Fp16) - scaled(0.1)).abs() < 1e-12);
        assert!((c.step_ms_in(16, 4, &[], Precision::Bf16) - scaled(-0.2)).abs() < 1e-12);
        assert!(c.step_ms_in(16, 4, &[], Precision::Bf16) < plain);
        c.bf16_overhead = None;
        assert!((c.step_ms_in(16, 4, &[], Precision::Bf16) - scaled(0.1)).abs() < 1e-12);
    }
}
