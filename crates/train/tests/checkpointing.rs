//! Activation checkpointing through the trainer: training with checkpointed GPT blocks ends with
//! the plain run's parameters bit for bit (accumulation included), planned checkpointed runs fit
//! and peak exactly as predicted, checkpointing lowers the planned peak, and a fault at any
//! allocation of a checkpointed run (re-runs in backward included) loses no window.

mod common;

use common::*;
use memfit_nn::{GptConfig, ModelSpec};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::{Device, DeviceKind};
use memfit_train::planner::{dry_run, plan, predict, PlanRequest};
use memfit_train::samples::{Samples, TextWindows};
use memfit_train::trainer::RunOutcome;
use memfit_train::{CheckpointChoice, RunOptions, Session};

fn text_spec(layers: usize, d_model: usize, max_t: usize) -> (memfit_data::TextCorpus, ModelSpec) {
    let text = memfit_data::load_embedded_text().expect("the embedded text");
    let spec = ModelSpec::gpt(GptConfig { vocab: text.vocab.len(), d_model, heads: 2, layers, max_t });
    (text, spec)
}

/// A run on a fresh session with `choice`; the outcome, the parameters and the session.
fn run_with(
    device: Device,
    spec: &ModelSpec,
    samples: &dyn Samples,
    opts: &RunOptions,
    choice: &CheckpointChoice,
) -> (RunOutcome, Vec<(String, Vec<f64>)>, Session) {
    let mut session = Session::new(device, spec, adamw(), 3).expect("session");
    session.set_checkpointing(choice).expect("segments");
    let outcome = session.run(samples, None, opts, &mut |_| {}).expect("run");
    let params = session.model.parameters().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect();
    (outcome, params, session)
}

#[test]
fn checkpointed_training_ends_with_the_plain_parameters_bit_for_bit() {
    let (text, spec) = text_spec(3, 16, 12);
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    for micro in [12, 5] {
        let o = opts(12, micro, 3);
        let cpu = || device(DeviceKind::Cpu, None, None);
        let (plain, plain_params, _) = run_with(cpu(), &spec, &train, &o, &CheckpointChoice::None);
        for choice in [CheckpointChoice::All, CheckpointChoice::Segments(vec!["blocks.1".into()])] {
            let (ckpt, params, _) = run_with(cpu(), &spec, &train, &o, &choice);
            assert_eq!(ckpt.sample_log, plain.sample_log);
            assert_eq!(params, plain_params, "micro-batch {micro}, {choice:?}: parameters differ");
        }
    }
}

fn request(spec: &ModelSpec, effective: usize, capacity: Option<u64>, checkpoint: CheckpointChoice) -> PlanRequest {
    PlanRequest {
        model: spec.clone(),
        optimizer: adamw(),
        effective_batch: effective,
        capacity,
        safety_margin: 0.0,
        seed: 5,
        checkpoint,
    }
}

#[test]
fn checkpointing_lowers_the_peak_and_planned_checkpointed_runs_peak_as_predicted() {
    let (_, spec) = text_spec(4, 32, 32);
    let effective = 32;
    let plain =
        predict(&request(&spec, effective, None, CheckpointChoice::None), effective, None, None).unwrap().unwrap();
    let all = request(&spec, effective, None, CheckpointChoice::All);
    let ckpt = predict(&all, effective, None, None).unwrap().unwrap();
    assert!(ckpt.peak_allocated < plain.peak_allocated, "checkpointed {ckpt:?} vs plain {plain:?}");
    // A budget between the two: without checkpointing it needs accumulation, with it the whole batch fits.
    let capacity = (ckpt.peak_reserved + plain.peak_reserved) / 2;
    let plain_plan = plan(&request(&spec, effective, Some(capacity), CheckpointChoice::None)).unwrap();
    let req = request(&spec, effective, Some(capacity), CheckpointChoice::All);
    let ckpt_plan = plan(&req).unwrap();
    assert!(plain_plan.micro_batch < effective && ckpt_plan.micro_batch == effective, "{plain_plan:?} / {ckpt_plan:?}");
    let dev = device(DeviceKind::Cpu, Some(capacity), None);
    let mut session = Session::new(dev.clone(), &req.model, req.optimizer, req.seed).unwrap();
    session.set_checkpointing(&req.checkpoint).unwrap();
    let (train, val, mut o) = dry_run(&req, ckpt_plan.micro_batch, ckpt_plan.eval_micro_batch);
    o.recover = true;
    let outcome = session.run(train.as_ref(), Some(val.as_ref()), &o, &mut |_| {}).unwrap();
    let stats = dev.stats();
    assert_eq!((stats.num_ooms, outcome.oom_recoveries), (0, 0), "the planned run never ran out of memory");
    assert_eq!(stats.allocated_bytes.peak, ckpt_plan.predicted.peak_allocated);
    assert_eq!(stats.reserved_bytes.peak, ckpt_plan.predicted.peak_reserved);
}

#[test]
fn a_fault_at_every_allocation_of_a_checkpointed_run_loses_no_window() {
    let (text, spec) = text_spec(2, 8, 6);
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    let o = opts(4, 4, 2);
    let all = CheckpointChoice::All;
    let setup_requests = {
        let dev = device(DeviceKind::Cpu, None, None);
        drop(Session::new(dev.clone(), &spec, adamw(), 3).unwrap());
        dev.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run_with(device(DeviceKind::Cpu, None, None), &spec, &train, &o, &all);
    let clean_stats = clean_session.device.stats();
    let requests = clean_stats.allocation.allocated - setup_requests;
    for k in 1..=requests {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup_requests + k)));
        let (out, params, session) = run_with(dev, &spec, &train, &o, &all);
        let stats = session.device.stats();
        assert_eq!(stats.num_injected_faults, 1, "fault at request {k}");
        assert!(out.oom_recoveries >= 1, "fault at request {k} was recovered");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "fault at request {k}: the same windows");
        assert_params_close(&params, &clean_params, 1e-5, &format!("fault at request {k}"));
        assert_eq!(stats.allocated_bytes.current, clean_stats.allocated_bytes.current, "fault {k}: nothing leaked");
    }
}

#[test]
fn an_unknown_segment_is_refused_with_the_model_s_segments() {
    let (_, spec) = text_spec(2, 8, 6);
    let session = Session::new(Device::meta(), &spec, adamw(), 3).unwrap();
    let err = session.set_checkpointing(&CheckpointChoice::parse("blocks.7").unwrap()).unwrap_err().to_string();
    assert!(err.contains("no segment \"blocks.7\"") && err.contains("blocks.0, blocks.1"), "{err}");
    let mlp = Session::new(Device::meta(), &small_spec(memfit_nn::ModelKind::Mlp), adamw(), 3).unwrap();
    assert!(mlp.set_checkpointing(&CheckpointChoice::All).is_err());
    assert!(mlp.set_checkpointing(&CheckpointChoice::None).unwrap().is_empty());
}

#[test]
fn when_micro_batch_one_does_not_fit_the_planner_names_checkpointing_if_it_does() {
    // A long context: activations dominate even at one sample.
    let (_, spec) = text_spec(4, 64, 512);
    let plain_one = predict(&request(&spec, 4, None, CheckpointChoice::None), 1, Some(1), None).unwrap().unwrap();
    let ckpt_one = predict(&request(&spec, 4, None, CheckpointChoice::All), 1, Some(1), None).unwrap().unwrap();
    assert!(ckpt_one.peak_reserved < plain_one.peak_reserved);
    let capacity = (ckpt_one.peak_reserved + plain_one.peak_reserved) / 2;
    let err = plan(&request(&spec, 4, Some(capacity), CheckpointChoice::None)).unwrap_err().to_string();
    assert!(
        err.contains("even a micro-batch of 1 needs") && err.contains("add --checkpoint all for micro-batch"),
        "{err}"
    );
    // The advice is a plan that fits.
    let fitting = plan(&request(&spec, 4, Some(capacity), CheckpointChoice::All)).unwrap();
    assert!(err.contains(&format!("micro-batch {} x {}", fitting.micro_batch, fitting.accumulation_steps)), "{err}");
    assert!(fitting.predicted.peak_reserved <= capacity);
    // Below what checkpointing needs too, there is no such advice.
    let err =
        plan(&request(&spec, 4, Some(ckpt_one.peak_reserved / 2), CheckpointChoice::None)).unwrap_err().to_string();
    assert!(!err.contains("--checkpoint"), "{err}");
}

#[test]
fn auto_checkpoints_only_as_many_segments_as_the_budget_forces_and_the_plan_holds() {
    let (_, spec) = text_spec(4, 64, 512);
    let auto = |capacity| request(&spec, 2, capacity, CheckpointChoice::Auto);
    // An ample budget: no checkpointing.
    assert_eq!(plan(&auto(Some(1 << 30))).unwrap().checkpoint, CheckpointChoice::None);
    // Between what checkpointing everything and nothing need at micro-batch 1: a prefix of the blocks.
    let need =
        |c: CheckpointChoice| predict(&request(&spec, 2, None, c), 1, Some(1), None).unwrap().unwrap().peak_reserved;
    let (plain, all) = (need(CheckpointChoice::None), need(CheckpointChoice::All));
    let capacity = all + (plain - all) / 3;
    let req = auto(Some(capacity));
    let chosen = plan(&req).unwrap();
    let CheckpointChoice::Segments(names) = &chosen.checkpoint else { panic!("{:?}", chosen.checkpoint) };
    assert!(!names.is_empty() && names.len() <= 4 && names[0] == "blocks.0", "{names:?}");
    // Fewer segments would not fit micro-batch 1.
    let fewer = CheckpointChoice::Segments(names[..names.len() - 1].to_vec());
    let fewer = if names.len() == 1 { CheckpointChoice::None } else { fewer };
    let fewer_req = request(&spec, 2, Some(capacity), fewer);
    assert!(predict(&fewer_req, 1, Some(1), fewer_req.budget()).unwrap().is_none());
    // The planned run on cpu with that budget never runs out of memory and peaks as predicted.
    let fixed = request(&spec, 2, Some(capacity), chosen.checkpoint.clone());
    let dev = device(DeviceKind::Cpu, Some(capacity), None);
    let mut session = Session::new(dev.clone(), &fixed.model, fixed.optimizer, fixed.seed).unwrap();
    session.set_checkpointing(&fixed.checkpoint).unwrap();
    let (train, val, mut o) = dry_run(&fixed, chosen.micro_batch, chosen.eval_micro_batch);
    o.recover = true;
    session.run(train.as_ref(), Some(val.as_ref()), &o, &mut |_| {}).unwrap();
    let stats = dev.stats();
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.reserved_bytes.peak, chosen.predicted.peak_reserved);
    assert_eq!(stats.allocated_bytes.peak, chosen.predicted.peak_allocated);
    // Below what checkpointing everything needs, the error says so.
    let err = plan(&auto(Some(all / 2))).unwrap_err().to_string();
    assert!(err.contains("even with activation checkpointing of every segment"), "{err}");
}
