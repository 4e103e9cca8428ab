//! The optimizer step inside backward (Note [Step in backward] in `trainer.rs`): the same bits as the
//! step after backward for every optimizer, a lower peak, meta exact, and a fault at any allocation
//! either recovered before the first update or never possible after it.

mod common;
use common::*;
use memfit_nn::{ModelKind, ModelSpec, OptimizerConfig};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::{DeviceKind, MemoryStats};
use memfit_train::samples::Samples;
use memfit_train::{CheckpointChoice, OptimizerStep, Precision, RunOptions, Session, TrainConfig, TrainError};

/// The parameters and the optimizer's state after `o` with the optimizer step placed `step`, and the
/// device's statistics.
fn trained(
    kind: DeviceKind,
    spec: &ModelSpec,
    optimizer: OptimizerConfig,
    step: OptimizerStep,
    samples: &dyn Samples,
    o: &RunOptions,
    fault: Option<FaultInjection>,
) -> (Vec<(String, Vec<f64>)>, MemoryStats, usize) {
    let mut session = Session::new(device(kind, None, fault), spec, optimizer, 3).unwrap();
    session.set_optimizer_step(step).unwrap();
    let outcome = session.run(samples, None, o, &mut |_| {}).unwrap();
    let mut values: Vec<(String, Vec<f64>)> = Vec::new();
    if kind.computes() {
        values.extend(session.model.parameters().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())));
        for (name, what, t) in session.optimizer.state() {
            values.push((format!("{name}.{what}"), t.to_f64_vec().unwrap()));
        }
        values.extend(session.optimizer.param_step_counts().into_iter().map(|(n, c)| (n, vec![c as f64])));
        values.push(("steps".into(), vec![session.optimizer.steps() as f64]));
    }
    (values, session.device.stats(), outcome.oom_recoveries)
}

fn optimizers() -> Vec<(&'static str, OptimizerConfig)> {
    vec![("sgd", sgd()), ("adam", OptimizerConfig::adam(1e-3)), ("adamw", adamw())]
}

#[test]
fn every_optimizer_updates_the_same_bits_inside_backward_as_after_it_with_a_lower_peak() {
    let models = [small_spec(ModelKind::Mlp), small_spec(ModelKind::SimpleCnn), tiny_gpt(11)];
    for spec in &models {
        let samples = memfit_train::samples::synthetic(spec, 4 * 8, 11);
        let samples = samples.as_ref();
        let o = opts(8, 8, 4);
        for (name, optimizer) in optimizers() {
            let what = format!("{} {name}", spec.name());
            let (after, after_stats, _) =
                trained(DeviceKind::Cpu, spec, optimizer, OptimizerStep::After, samples, &o, None);
            let (inside, inside_stats, _) =
                trained(DeviceKind::Cpu, spec, optimizer, OptimizerStep::InBackward, samples, &o, None);
            assert_eq!(inside, after, "{what}: parameters, state and step counts bit for bit");
            assert!(
                inside_stats.allocated_bytes.peak < after_stats.allocated_bytes.peak,
                "{what}: the gradients never all exist at once ({} vs {})",
                inside_stats.allocated_bytes.peak,
                after_stats.allocated_bytes.peak
            );
            // Meta predicts the step inside backward, its rehearsals included, to the byte.
            let (_, meta_stats, _) =
                trained(DeviceKind::META, spec, optimizer, OptimizerStep::InBackward, samples, &o, None);
            assert_eq!(meta_stats, inside_stats, "{what}: meta == cpu");
        }
    }
}

#[test]
fn with_every_block_checkpointed_the_step_inside_backward_keeps_the_bits() {
    // A checkpointed block's parameters complete when its re-run's backward is over.
    let spec = tiny_gpt(11);
    let samples = memfit_train::samples::synthetic(&spec, 3 * 8, 11);
    let run = |step| {
        let mut session = Session::new(device(DeviceKind::Cpu, None, None), &spec, adamw(), 3).unwrap();
        session.set_checkpointing(&CheckpointChoice::All).unwrap();
        session.set_optimizer_step(step).unwrap();
        session.run(samples.as_ref(), None, &opts(8, 8, 3), &mut |_| {}).unwrap();
        let params: Vec<Vec<f64>> =
            session.model.parameters().into_iter().map(|(_, t)| t.to_f64_vec().unwrap()).collect();
        (params, session.device.stats().allocated_bytes.peak)
    };
    let ((after, after_peak), (inside, inside_peak)) = (run(OptimizerStep::After), run(OptimizerStep::InBackward));
    assert_eq!(inside, after);
    assert!(inside_peak < after_peak, "{inside_peak} vs {after_peak}");
}

#[test]
fn a_window_of_several_micro_batches_steps_after_backward_as_before() {
    let spec = small_spec(ModelKind::Mlp);
    let samples = data(&spec, 3 * 8);
    let o = opts(8, 4, 3);
    let (after, after_stats, _) = trained(DeviceKind::Cpu, &spec, adamw(), OptimizerStep::After, &samples, &o, None);
    let (inside, inside_stats, _) =
        trained(DeviceKind::Cpu, &spec, adamw(), OptimizerStep::InBackward, &samples, &o, None);
    assert_eq!(inside, after);
    assert_eq!(inside_stats, after_stats, "nothing rehearsed, nothing changed");
}

#[test]
fn only_the_first_step_from_a_layout_is_rehearsed() {
    let spec = small_spec(ModelKind::Mlp);
    let samples = data(&spec, 6 * 8);
    let requests = |step, steps| {
        let (_, stats, _) = trained(DeviceKind::Cpu, &spec, adamw(), step, &samples, &opts(8, 8, steps), None);
        stats.allocation.allocated
    };
    let per_step_after = requests(OptimizerStep::After, 5) - requests(OptimizerStep::After, 4);
    let per_step_inside = requests(OptimizerStep::InBackward, 5) - requests(OptimizerStep::InBackward, 4);
    assert_eq!(per_step_inside, per_step_after, "a proven layout takes no rehearsal");
    assert!(
        requests(OptimizerStep::InBackward, 1) >= 2 * per_step_after,
        "the first step rehearses (it makes its segments, then finds them)"
    );
}

#[test]
fn a_fault_at_every_allocation_is_recovered_before_the_first_update_and_cannot_happen_after_it() {
    for spec in [small_spec(ModelKind::SimpleCnn), tiny_gpt(11)] {
        let samples = memfit_train::samples::synthetic(&spec, 3 * 8, 11);
        let samples = samples.as_ref();
        let o = opts(8, 8, 3);
        let setup = device(DeviceKind::Cpu, None, None);
        drop(Session::new(setup.clone(), &spec, adamw(), 3).unwrap());
        let setup_requests = setup.stats().allocation.allocated;
        let (clean, clean_stats, _) =
            trained(DeviceKind::Cpu, &spec, adamw(), OptimizerStep::InBackward, samples, &o, None);
        let requests = clean_stats.allocation.allocated;
        let (mut recovered, mut held) = (0, 0);
        for k in setup_requests + 1..=requests {
            let fault = Some(FaultInjection::Nth(k));
            let (values, stats, recoveries) =
                trained(DeviceKind::Cpu, &spec, adamw(), OptimizerStep::InBackward, samples, &o, fault);
            assert_eq!(values, clean, "{} fault at request {k}: the same bits", spec.name());
            match stats.num_injected_faults {
                1 => {
                    assert!(recoveries >= 1, "fault at request {k} was recovered");
                    recovered += 1;
                }
                0 => held += 1,
                n => panic!("one fault asked, {n} injected"),
            }
            assert_eq!(stats.allocated_bytes.current, clean_stats.allocated_bytes.current, "nothing leaked");
        }
        assert!(
            recovered > 0 && held > 0,
            "{}: {recovered} faults recovered, {held} after a first update",
            spec.name()
        );
    }
}

#[test]
fn where_gradients_must_all_exist_the_step_inside_backward_is_refused_by_name() {
    let spec = small_spec(ModelKind::Mlp);
    let mut session = Session::new(device(DeviceKind::Cpu, None, None), &spec, adamw(), 3).unwrap();
    session.set_precision(Precision::Fp16).unwrap();
    let err = session.set_optimizer_step(OptimizerStep::InBackward).unwrap_err().to_string();
    assert!(err.contains("fp16") && err.contains("--optimizer-step after"), "{err}");
    session.set_precision(Precision::Bf16).unwrap();
    session.set_optimizer_step(OptimizerStep::InBackward).unwrap();

    let ranks = TrainConfig {
        optimizer_step: OptimizerStep::InBackward,
        parallel: Some(memfit_train::config::ParallelMode::Data),
        ..TrainConfig::default()
    };
    let err = ranks.check().unwrap_err().to_string();
    assert!(err.contains("--parallel data") && err.contains("--optimizer-step after"), "{err}");
    let half =
        TrainConfig { optimizer_step: OptimizerStep::InBackward, precision: Precision::Fp16, ..TrainConfig::default() };
    assert!(matches!(half.check(), Err(TrainError::Invalid(m)) if m.contains("fp16")));
}

#[test]
fn the_planner_steps_inside_backward_when_after_does_not_fit_and_the_plan_holds() {
    // Fashion-MNIST's size: both large weights' gradients (3 and 4 MiB) coexist after backward.
    let spec = ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10);
    let unlimited = memfit_train::planner::PlanRequest {
        micro_batch: Some(16),
        segments: memfit_train::Segments::Expandable,
        ..plan_request(spec.clone(), 16, None)
    };
    let after = memfit_train::planner::choose(&unlimited).unwrap();
    let inside = memfit_train::planner::choose(&memfit_train::planner::PlanRequest {
        optimizer_step: OptimizerStep::InBackward,
        ..unlimited.clone()
    })
    .unwrap();
    assert!(inside.predicted.peak_reserved < after.predicted.peak_reserved);
    // A budget between the two: `after` does not fit, `auto` steps inside backward, exactly.
    let capacity = inside.predicted.peak_reserved;
    let req = memfit_train::planner::PlanRequest {
        capacity: Some(capacity),
        optimizer_step: OptimizerStep::Auto,
        ..unlimited.clone()
    };
    let plan = memfit_train::planner::choose(&req).unwrap();
    assert_eq!(plan.optimizer_step, OptimizerStep::InBackward);
    assert_eq!((plan.micro_batch, plan.accumulation_steps), (16, 1));
    assert_plan_holds_on_cpu(&req, &plan, capacity);
    // With room for both, the plan is the one it always was.
    let roomy = memfit_train::planner::PlanRequest { capacity: Some(after.predicted.peak_reserved), ..req };
    assert_eq!(memfit_train::planner::choose(&roomy).unwrap().optimizer_step, OptimizerStep::After);
}

#[test]
fn under_any_budget_a_plan_stepping_inside_backward_holds_exactly_on_cpu() {
    // Tight budgets squeeze the rehearsals (they may not release the cache to make room): every budget
    // either does not fit or plans a run that peaks as predicted, never an internal error.
    let gpt = ModelSpec::gpt(memfit_nn::GptConfig { vocab: 11, d_model: 64, heads: 2, layers: 3, max_t: 64 });
    let mlp = ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10);
    for (spec, checkpoint) in [(mlp, CheckpointChoice::None), (gpt, CheckpointChoice::All)] {
        let base = memfit_train::planner::PlanRequest {
            micro_batch: Some(2),
            checkpoint,
            segments: memfit_train::Segments::Auto,
            optimizer_step: OptimizerStep::InBackward,
            ..plan_request(spec.clone(), 2, None)
        };
        let unbounded = memfit_train::planner::choose(&base).unwrap().predicted.peak_reserved;
        let (mut fitted, mut refused) = (0, 0);
        for mib in (1..=unbounded.div_ceil(1 << 20)).rev() {
            let capacity = mib << 20;
            let req = memfit_train::planner::PlanRequest { capacity: Some(capacity), ..base.clone() };
            match memfit_train::planner::choose(&req) {
                Ok(plan) => {
                    assert_eq!(plan.optimizer_step, OptimizerStep::InBackward);
                    assert_plan_holds_on_cpu(&req, &plan, capacity);
                    fitted += 1;
                }
                Err(TrainError::DoesNotFit(_)) => refused += 1,
                Err(e) => panic!("{} at {mib} MiB: {e}", spec.name()),
            }
        }
        assert!(fitted > 0 && refused > 0, "{}: {fitted} budgets fit, {refused} refused", spec.name());
    }
}

#[test]
fn a_budget_far_below_the_whole_batch_is_refused_not_an_internal_error() {
    // A 2-block GPT at 24 MiB: the doctor bisects the least budget of its whole batch of 32 stepping
    // inside backward, whose rehearsals run out of memory under most of those budgets (releasing the
    // cache to go on would be new memory the pass could not have after its first update). Caught the
    // proof "a rehearsal left the layout as it found it", which such a release and re-making passes.
    let spec = ModelSpec::gpt(memfit_nn::GptConfig { layers: 2, ..memfit_nn::GptConfig::default() });
    let req = memfit_train::planner::PlanRequest {
        capacity: Some(24 << 20),
        checkpoint: CheckpointChoice::Auto,
        segments: memfit_train::Segments::Auto,
        optimizer_step: OptimizerStep::Auto,
        costs: memfit_train::cost::Costs::Given(memfit_train::cost::CostModel::nominal(&[
            "blocks.0".into(),
            "blocks.1".into(),
        ])),
        ..plan_request(spec, 32, None)
    };
    match memfit_train::plan(&req) {
        Err(TrainError::DoesNotFit(d)) => assert!(d.needs_bytes > 24 << 20),
        other => panic!("expected a refusal, got {:?}", other.map(|p| p.micro_batch)),
    }
}
