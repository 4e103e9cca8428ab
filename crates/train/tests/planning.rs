//! Planning: for each zoo model and several budgets, the plan's configuration run for real on `cpu`
//! with that capacity never runs out of memory and peaks exactly where the `meta` dry run said.

mod common;
use common::*;
use memfit_nn::{ModelKind, ModelSpec};
use memfit_tensor::DeviceKind;
use memfit_train::plan;
use memfit_train::planner::{dry_run, predict, PlanRequest};
use memfit_train::{RunOptions, Session, TrainError};

fn request(kind: ModelKind, effective: usize, capacity: Option<u64>) -> PlanRequest {
    plan_request(ModelSpec::image(kind, [1, 28, 28], 10), effective, capacity)
}

#[test]
fn planned_runs_fit_and_peak_exactly_as_predicted() {
    for kind in [ModelKind::Mlp, ModelKind::SimpleCnn, ModelKind::DeepCnn, ModelKind::ResNet] {
        let effective = 48;
        let full = predict(&request(kind, effective, None), effective, Some(effective), None).unwrap().unwrap();
        let smallest = predict(&request(kind, effective, None), 1, Some(1), None).unwrap().unwrap();
        let span = full.peak_reserved - smallest.peak_reserved;
        for fraction in [0.25, 0.6, 1.0] {
            let capacity = smallest.peak_reserved + (span as f64 * fraction) as u64;
            let req = request(kind, effective, Some(capacity));
            let plan = plan(&req).unwrap_or_else(|e| panic!("{kind:?} at {capacity}: {e}"));
            assert!(plan.predicted.peak_reserved <= capacity);
            assert_eq!(plan.accumulation_steps, effective.div_ceil(plan.micro_batch));
            // Balanced: no smaller accumulation count would fit the same micro-batch budget.
            assert_eq!(plan.micro_batch, effective.div_ceil(plan.accumulation_steps));
            // Run the planned configuration on cpu with the real capacity.
            let dev = device(DeviceKind::Cpu, Some(capacity), None);
            let mut session = Session::new(dev.clone(), &req.model, req.optimizer, req.seed).unwrap();
            let recoveries =
                dry_run(&req, plan.micro_batch, plan.eval_micro_batch).run(&mut session, true, true).unwrap();
            let stats = dev.stats();
            assert_eq!(stats.num_ooms, 0, "{kind:?}: the planned run never hit out-of-memory");
            assert_eq!(recoveries, 0);
            assert_eq!(stats.allocated_bytes.peak, plan.predicted.peak_allocated, "{kind:?} allocated peak");
            assert_eq!(stats.reserved_bytes.peak, plan.predicted.peak_reserved, "{kind:?} reserved peak");
        }
        // A budget below micro-batch 1 is refused with what the smallest step needs.
        let too_small = request(kind, effective, Some(smallest.peak_reserved / 2));
        match plan(&too_small) {
            Err(TrainError::DoesNotFit(d)) => {
                assert!(d.problem.contains("even a micro-batch of 1 needs"), "{d}");
                assert!(d.needs_bytes > smallest.peak_reserved / 2, "{d}");
                // A remedy that keeps the numbers on one rank needs at least what the run needs; one
                // that changes them (8-bit Adam state) may fit in less.
                for r in &d.remedies {
                    assert!(
                        r.predicted_peak_reserved_bytes >= d.needs_bytes || r.ranks > 1 || r.changes_numbers,
                        "{d}"
                    );
                }
            }
            other => panic!("{kind:?}: expected a does-not-fit error, got {other:?}"),
        }
    }
}

#[test]
fn planning_prefers_the_whole_batch_when_it_fits() {
    let req = request(ModelKind::SimpleCnn, 32, Some(1 << 30));
    let plan = plan(&req).unwrap();
    assert_eq!((plan.micro_batch, plan.accumulation_steps), (32, 1));
    assert!(plan.larger.is_none());
}

#[test]
fn the_safety_margin_keeps_part_of_the_budget_free() {
    let mut req = request(ModelKind::SimpleCnn, 64, Some(24 << 20));
    req.safety_margin = 0.25;
    let chosen = plan(&req).unwrap();
    assert_eq!(chosen.budget, Some(18 << 20));
    assert!(chosen.predicted.peak_reserved <= 18 << 20, "the plan fits the budget less the margin");
    req.safety_margin = 0.9;
    assert!(matches!(plan(&req), Err(TrainError::Invalid(m)) if m.contains("safety margin")));
}

#[test]
fn a_dry_run_of_the_representative_window_peaks_like_the_whole_window() {
    // Note [Bounded planning]: the planner's dry runs train on at most three micro-batches a window.
    use memfit_train::planner::{representative_window, PLAN_STEPS};
    use memfit_train::samples::synthetic;
    assert_eq!(representative_window(1_000_000_000, 417), 2 * 417 + (1_000_000_000 - 2_398_081 * 417));
    assert_eq!(representative_window(24, 8), 24);
    let specs = [
        ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10),
        ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10),
        ModelSpec::image(ModelKind::ResNet, [1, 28, 28], 10),
        tiny_gpt(13),
    ];
    for spec in specs {
        let kind = spec.kind;
        for (effective, micro) in [(50, 8), (40, 8), (37, 5), (9, 2)] {
            let req = PlanRequest { model: spec.clone(), ..request(kind, effective, None) };
            assert!(representative_window(effective, micro) < effective);
            let bounded = predict(&req, micro, Some(micro), None).unwrap().unwrap();
            let dev = device(DeviceKind::META, None, None);
            let mut session = Session::new(dev.clone(), &req.model, req.optimizer, req.seed).unwrap();
            let program = dry_run(&req, micro, micro);
            let o = RunOptions { effective_batch: effective, ..program.phases[0].1.clone() };
            let whole = synthetic(&req.model, PLAN_STEPS * effective, req.seed);
            session.run(whole.as_ref(), Some(program.val.as_ref()), &o, &mut |_| {}).unwrap();
            let stats = dev.stats();
            let what = format!("{kind:?} batch {effective} in micro-batches of {micro}");
            assert_eq!(stats.allocated_bytes.peak, bounded.peak_allocated, "{what}: allocated peak");
            assert_eq!(stats.reserved_bytes.peak, bounded.peak_reserved, "{what}: reserved peak");
            assert_eq!(stats.category_at_peak, bounded.at_peak, "{what}: categories at the peak");
        }
    }
}

/// A refusal's "needs" is the least budget that fits, at the lightest micro-batch: for mlp at batch
/// 256 with SGD that is the whole batch in one (its 7 MiB of weights outweigh its activations, and a
/// micro-batch after a window's first holds the window's gradients beside the ones it makes), and a
/// budget of what the refusal names plans while one MiB less does not.
#[test]
fn a_refusal_names_the_least_budget_that_fits_and_its_lightest_micro_batch() {
    let mib = 1u64 << 20;
    let req = |capacity: u64| PlanRequest {
        optimizer: sgd(),
        segments: memfit_train::Segments::Auto,
        ..request(ModelKind::Mlp, 256, Some(capacity))
    };
    let d = match plan(&req(20 * mib)) {
        Err(TrainError::DoesNotFit(d)) => d,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert!(d.problem.contains("the whole batch of 256 in one"), "{}", d.problem);
    let needs = d.needs_bytes.div_ceil(mib) * mib;
    let fits = plan(&req(needs)).unwrap_or_else(|e| panic!("a budget of what it needs: {e}"));
    assert_eq!(fits.micro_batch, 256);
    assert!(plan(&req(needs - mib)).is_err(), "one MiB less than {needs} does not fit");
    // deepcnn on 64x64 colour images: with no budget its allocator keeps 8 MiB, under a budget it
    // releases its cache and fits in less; the refusal names the least budget.
    let req = |capacity: u64| PlanRequest {
        model: ModelSpec::image(ModelKind::DeepCnn, [3, 64, 64], 10),
        segments: memfit_train::Segments::Auto,
        checkpoint: memfit_train::CheckpointChoice::All,
        ..request(ModelKind::DeepCnn, 16, Some(capacity))
    };
    let d = match plan(&req(4 * mib)) {
        Err(TrainError::DoesNotFit(d)) => d,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let needs = d.needs_bytes.div_ceil(mib) * mib;
    assert!(plan(&req(needs)).is_ok(), "a budget of what it needs ({needs}) fits");
    assert!(plan(&req(needs - mib)).is_err(), "one MiB less than {needs} does not fit");
}
