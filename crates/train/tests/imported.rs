//! A user's model, exported by `torch.export` (the import crate's fixtures), trains like a zoo model:
//! planned under a budget it peaks exactly where meta said, and a fault at every allocation of an
//! accumulating run loses no sample and ends with the clean run's parameters.

mod common;
use common::*;
use memfit_nn::{ModelKind, ModelSpec};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::DeviceKind;
use memfit_train::planner::dry_run;
use memfit_train::{plan, Session};
use std::path::PathBuf;

fn exported(name: &str) -> ModelSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../import/tests/fixtures").join(name);
    ModelSpec::exported(&path).unwrap()
}

fn tiny_cnn() -> ModelSpec {
    exported("tiny_cnn.pt2")
}

#[test]
fn an_exported_model_reads_its_task_from_its_signature() {
    let spec = tiny_cnn();
    assert_eq!((spec.kind, spec.input, spec.num_classes), (ModelKind::Imported, [1, 28, 28], 10));
    assert!(spec.name().ends_with("tiny_cnn.pt2"), "{}", spec.name());
}

#[test]
fn a_planned_exported_model_peaks_exactly_as_predicted() {
    let spec = tiny_cnn();
    let effective = 48;
    let req = |capacity| plan_request(spec.clone(), effective, capacity);
    let whole = memfit_train::planner::predict(&req(None), effective, Some(effective), None).unwrap().unwrap();
    let capacity = whole.peak_reserved / 2;
    let plan = plan(&req(Some(capacity))).unwrap();
    assert!(plan.micro_batch < effective, "half the whole batch's peak makes it accumulate");
    let dev = device(DeviceKind::Cpu, Some(capacity), None);
    let mut session = Session::new(dev.clone(), &spec, adamw(), 5).unwrap();
    dry_run(&req(Some(capacity)), plan.micro_batch, plan.eval_micro_batch).run(&mut session, true, true).unwrap();
    let stats = dev.stats();
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.allocated_bytes.peak, plan.predicted.peak_allocated);
    assert_eq!(stats.reserved_bytes.peak, plan.predicted.peak_reserved);
}

/// Trains `name` two steps of two micro-batches, clean and then with a fault at every `stride`-th
/// allocation: the same samples, and parameters and buffers bit for bit the clean run's.
fn every_fault_is_recovered_exactly(name: &str, stride: usize) {
    let spec = exported(name);
    let buffers = |s: &Session| -> Vec<(String, Vec<f64>)> {
        s.model.buffers().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect()
    };
    let samples = data(&spec, 2 * 8);
    let o = opts(8, 4, 2);
    let clean_device = device(DeviceKind::Cpu, None, None);
    let setup = {
        drop(Session::new(clean_device.clone(), &spec, adamw(), 3).unwrap());
        clean_device.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run(device(DeviceKind::Cpu, None, None), &spec, adamw(), &samples, &o);
    let requests = clean_session.device.stats().allocation.allocated - setup;
    for k in (1..=requests).step_by(stride) {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup + k)));
        let (out, params, session) = run(dev, &spec, adamw(), &samples, &o);
        assert_eq!(session.device.stats().num_injected_faults, 1, "{name}: fault at request {k}");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "{name}: fault at request {k}: same samples");
        assert!(params == clean_params, "{name}: fault at request {k}: the clean parameters, bit for bit");
        assert!(buffers(&session) == buffers(&clean_session), "{name}: fault at request {k}: the clean buffers");
    }
}

/// With batch norm (tiny_resnet): its running statistics move once per sample whatever the faults.
#[test]
fn a_fault_at_every_allocation_of_an_exported_model_loses_no_sample() {
    every_fault_is_recovered_exactly("tiny_resnet.pt2", 3);
}

/// With dropout, masks follow the micro-batch's samples: a fault at every allocation (retries at the
/// same size, replays of a window's micro-batches) ends with the clean run's parameters, bit for bit.
#[test]
fn dropout_masks_follow_the_samples_so_recovery_is_exact() {
    every_fault_is_recovered_exactly("tiny_dropout.pt2", 1);
}
