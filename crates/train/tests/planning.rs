//! Planning: for each zoo model and several budgets, the plan's configuration run for real on `cpu`
//! with that capacity never runs out of memory and peaks exactly where the `meta` dry run said.

mod common;
use common::*;
use memfit_nn::{ModelKind, ModelSpec};
use memfit_tensor::DeviceKind;
use memfit_train::planner::{dry_run, plan, predict, PlanRequest};
use memfit_train::{Session, TrainError};

fn request(kind: ModelKind, effective: usize, capacity: Option<u64>) -> PlanRequest {
    PlanRequest {
        model: ModelSpec::image(kind, [1, 28, 28], 10),
        optimizer: adamw(),
        effective_batch: effective,
        capacity,
        safety_margin: 0.0,
        seed: 5,
    }
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
            let (train, val, mut o) = dry_run(&req, plan.micro_batch, plan.eval_micro_batch);
            o.recover = true;
            let outcome = session.run(train.as_ref(), Some(val.as_ref()), &o, &mut |_| {}).unwrap();
            let stats = dev.stats();
            assert_eq!(stats.num_ooms, 0, "{kind:?}: the planned run never hit out-of-memory");
            assert_eq!(outcome.oom_recoveries, 0);
            assert_eq!(stats.allocated_bytes.peak, plan.predicted.peak_allocated, "{kind:?} allocated peak");
            assert_eq!(stats.reserved_bytes.peak, plan.predicted.peak_reserved, "{kind:?} reserved peak");
        }
        // A budget below micro-batch 1 is refused with what the smallest step needs.
        let too_small = request(kind, effective, Some(smallest.peak_reserved / 2));
        match plan(&too_small) {
            Err(TrainError::Invalid(msg)) => assert!(msg.contains("even a micro-batch of 1 needs"), "{msg}"),
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
