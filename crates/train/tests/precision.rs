//! Half-precision storage of saved activations (`--precision`, Note [Half-precision storage]): it
//! halves what a GPT keeps for backward, meta predicts cpu's allocations exactly with it, the planner
//! takes it only when it is allowed and pays, and fp16 storage skips a step whose gradients overflow.

mod common;

use common::*;
use memfit_nn::{GptConfig, ModelKind, ModelSpec};
use memfit_tensor::{Category, DeviceKind};
use memfit_train::cost::{CostModel, Costs};
use memfit_train::plan;
use memfit_train::planner::{predict, PlanRequest};
use memfit_train::samples::{SplitSamples, TextWindows};
use memfit_train::TrainError;
use memfit_train::{CheckpointChoice, Precision, Session};

fn text_gpt(layers: usize, d_model: usize, max_t: usize) -> (memfit_data::TextCorpus, ModelSpec) {
    let text = memfit_data::load_embedded_text().expect("the embedded text");
    let spec = ModelSpec::gpt(GptConfig { vocab: text.vocab.len(), d_model, heads: 2, layers, max_t });
    (text, spec)
}

#[test]
fn half_storage_halves_saved_activations_and_meta_allocates_as_cpu() {
    let (text, gpt) = text_gpt(2, 32, 32);
    let windows = TextWindows::train(&text.train, gpt.gpt.max_t);
    let cnn = small_spec(ModelKind::SimpleCnn);
    let images = data(&cnn, 40);
    let cases: [(&ModelSpec, &dyn memfit_train::samples::Samples); 2] = [(&gpt, &windows), (&cnn, &images)];
    for (spec, samples) in cases {
        let mut activation_peaks = Vec::new();
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
            let (cpu, meta) = (device(DeviceKind::Cpu, None, None), device(DeviceKind::META, None, None));
            for dev in [&cpu, &meta] {
                let mut s = Session::new(dev.clone(), spec, adamw(), 1).unwrap();
                s.set_precision(precision).unwrap();
                s.run(samples, None, &opts(8, 4, 2), &mut |_| {}).unwrap();
            }
            assert_eq!(cpu.timeline_events(), meta.timeline_events(), "{:?} {precision:?}", spec.kind);
            assert_eq!(cpu.stats(), meta.stats(), "{:?} {precision:?}", spec.kind);
            activation_peaks.push(cpu.stats().category(Category::Activation).peak);
        }
        let [fp32, bf16, fp16] = activation_peaks[..] else { unreachable!() };
        assert_eq!(bf16, fp16, "{:?}: both half formats take two bytes", spec.kind);
        assert!(bf16 < fp32 * 7 / 10, "{:?}: saved activations {bf16} vs {fp32} in f32", spec.kind);
    }
}

#[test]
fn bf16_storage_trains_like_fp32_and_fp32_is_untouched() {
    let (text, spec) = text_gpt(2, 32, 32);
    let windows = TextWindows::train(&text.train, spec.gpt.max_t);
    let val = TextWindows::train(&text.val, spec.gpt.max_t);
    let o = opts(16, 8, 30);
    let losses: Vec<f64> = [Precision::Fp32, Precision::Bf16, Precision::Fp32]
        .into_iter()
        .map(|precision| {
            let mut s = Session::new(device(DeviceKind::Cpu, None, None), &spec, adamw(), 1).unwrap();
            s.set_precision(precision).unwrap();
            s.run(&windows, None, &o, &mut |_| {}).unwrap();
            s.evaluate(&val, 64, false).unwrap().loss.unwrap()
        })
        .collect();
    assert_eq!(losses[0], losses[2], "fp32 is deterministic and unchanged by the feature");
    let relative = (losses[1] - losses[0]).abs() / losses[0];
    assert!(relative < 0.01, "bf16 validation loss {} vs fp32 {} ({relative:.4})", losses[1], losses[0]);
    assert_ne!(losses[1], losses[0], "bf16 storage rounds what backward reads");
}

#[test]
fn bf16_storage_classifies_fashion_mnist_like_fp32() {
    let data = memfit_data::load_embedded().expect("the embedded Fashion-MNIST subset");
    let (train, val) = (SplitSamples { split: &data.train }, SplitSamples { split: &data.val });
    let spec = ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10);
    let o = opts(64, 64, 40);
    let results: Vec<(f64, f64)> = [Precision::Fp32, Precision::Bf16]
        .into_iter()
        .map(|precision| {
            let mut s = Session::new(device(DeviceKind::Cpu, None, None), &spec, adamw(), 1).unwrap();
            s.set_precision(precision).unwrap();
            s.run(&train, None, &o, &mut |_| {}).unwrap();
            let e = s.evaluate(&val, 500, false).unwrap();
            (e.loss.unwrap(), e.accuracy.unwrap())
        })
        .collect();
    let [(loss32, acc32), (loss16, acc16)] = results[..] else { unreachable!() };
    assert!(acc32 > 0.5, "the fp32 run learned: accuracy {acc32}");
    assert!((loss16 - loss32).abs() / loss32 < 0.02, "validation loss bf16 {loss16} vs fp32 {loss32}");
    assert!((acc16 - acc32).abs() < 0.02, "validation accuracy bf16 {acc16} vs fp32 {acc32}");
}

#[test]
fn fp16_storage_skips_a_step_whose_gradients_overflow() {
    let spec = small_spec(ModelKind::SimpleCnn);
    let samples = data(&spec, 16);
    let mut skipped = Vec::new();
    for precision in [Precision::Fp32, Precision::Fp16] {
        let dev = device(DeviceKind::Cpu, None, None);
        let mut s = Session::new(dev.clone(), &spec, adamw(), 1).unwrap();
        s.set_precision(precision).unwrap();
        // Activations beyond f16's 65504, well inside f32's range.
        for (name, p) in s.model.parameters() {
            if name == "conv1.weight" {
                p.copy_from(&p.mul_scalar(3e5).unwrap()).unwrap();
            }
        }
        let before: Vec<Vec<f64>> = s.model.parameters().iter().map(|(_, p)| p.to_f64_vec().unwrap()).collect();
        let mut o = opts(8, 8, 1);
        o.recover = false;
        s.run(&samples, None, &o, &mut |_| {}).unwrap();
        let after: Vec<Vec<f64>> = s.model.parameters().iter().map(|(_, p)| p.to_f64_vec().unwrap()).collect();
        assert_eq!(before == after, s.skipped_steps == 1, "{precision:?}: a skipped step changes nothing");
        skipped.push(s.skipped_steps);
        // Back in range, the next step is taken again.
        for (name, p) in s.model.parameters() {
            if name == "conv1.weight" {
                p.copy_from(&p.mul_scalar(1.0 / 3e5).unwrap()).unwrap();
            }
        }
        let steps = s.optimizer.steps();
        s.run(&samples, None, &o, &mut |_| {}).unwrap();
        assert_eq!(s.optimizer.steps(), steps + 1, "{precision:?}: the run recovers");
    }
    assert_eq!(skipped, [0, 1], "f32 storage holds the values; f16 overflows and the step is skipped");
}

fn costs() -> Costs {
    Costs::Given(CostModel {
        micro: vec![1, 4, 16],
        plain_ms: vec![10.0, 16.0, 40.0],
        recompute: 0.35,
        optimizer_ms: 2.0,
        half_overhead: 0.1,
        bf16_overhead: None,
        segments: (0..2).map(|i| (format!("blocks.{i}"), 0.5)).collect(),
        calibration_ms: 0.0,
        nominal: false,
        sample_rounds: 0,
    })
}

#[test]
fn auto_precision_takes_bf16_only_where_it_is_needed_and_the_plan_holds() {
    let (_, spec) = text_gpt(2, 128, 128);
    let request = |capacity, precision| PlanRequest {
        model: spec.clone(),
        optimizer: adamw(),
        effective_batch: 64,
        capacity,
        safety_margin: 0.0,
        seed: 5,
        checkpoint: CheckpointChoice::None,
        costs: costs(),
        micro_batch: Some(64),
        precision,
        parallel: None,
        target: memfit_tensor::Target::Cpu,
        segments: Default::default(),
        evaluate: true,
        optimizer_step: Default::default(),
        last_window: None,
    };
    let need = |p| predict(&request(None, p), 64, Some(64), None).unwrap().unwrap().peak_reserved;
    let (fp32, bf16) = (need(Precision::Fp32), need(Precision::Bf16));
    assert!(bf16 < fp32, "{bf16} vs {fp32}");
    // Ample memory: f32 storage is faster.
    assert_eq!(plan(&request(Some(1 << 32), Precision::Auto)).unwrap().precision, Precision::Fp32);
    // Where only bf16 storage fits: it is chosen, and the plan holds on cpu.
    let capacity = (bf16 + fp32) / 2;
    assert!(plan(&request(Some(capacity), Precision::Fp32)).is_err());
    let chosen = plan(&request(Some(capacity), Precision::Auto)).unwrap();
    assert_eq!(chosen.precision, Precision::Bf16, "{:?}", chosen.candidates);
    assert_plan_holds_on_cpu(&request(Some(capacity), Precision::Auto), &chosen, capacity);
    // Not allowed to change the numbers, the doctor lists it, marked so, after those that keep them.
    let Err(TrainError::DoesNotFit(d)) = plan(&request(Some(capacity), Precision::Fp32)) else { panic!() };
    let half = d.remedies.iter().position(|r| r.command.contains("--precision bf16")).expect("bf16 listed");
    assert!(d.remedies[half].changes_numbers, "{d}");
    assert!(d.remedies[..half].iter().all(|r| !r.changes_numbers), "{d}");
    assert!(d.to_string().contains("changes the numbers"), "{d}");
}

/// Invariant 7 with half storage: a fault at any allocation of a bf16 run (conversions included) is
/// recovered, the same windows train, nothing leaks, and the parameters end as the clean run's.
#[test]
fn a_fault_at_every_allocation_of_a_bf16_run_loses_no_window() {
    let (text, spec) = text_gpt(2, 8, 6);
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    let o = opts(4, 4, 2);
    let run = |fault| {
        let dev = device(DeviceKind::Cpu, None, fault);
        let mut s = Session::new(dev, &spec, adamw(), 3).unwrap();
        s.set_precision(Precision::Bf16).unwrap();
        let out = s.run(&train, None, &o, &mut |_| {}).unwrap();
        let params: Vec<(String, Vec<f64>)> =
            s.model.parameters().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect();
        (out, params, s)
    };
    let setup = {
        let dev = device(DeviceKind::Cpu, None, None);
        drop(Session::new(dev.clone(), &spec, adamw(), 3).unwrap());
        dev.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run(None);
    let clean_stats = clean_session.device.stats();
    for k in 1..=clean_stats.allocation.allocated - setup {
        let (out, params, session) = run(Some(memfit_tensor::memory::FaultInjection::Nth(setup + k)));
        let stats = session.device.stats();
        assert_eq!(stats.num_injected_faults, 1, "fault at request {k}");
        assert!(out.oom_recoveries >= 1, "fault at request {k} was recovered");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "fault at request {k}: the same windows");
        assert_params_close(&params, &clean_params, 1e-5, &format!("fault at request {k}"));
        assert_eq!(stats.allocated_bytes.current, clean_stats.allocated_bytes.current, "fault {k}: nothing leaked");
    }
}
