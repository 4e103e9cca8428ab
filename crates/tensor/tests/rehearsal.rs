//! `Device::rehearse`: inside a rehearsal a device allocates exactly what it would, but runs no
//! kernel, copies nothing, says it does not compute and records no op spans.

use memfit_tensor::memory::EventKind;
use memfit_tensor::{Category, DType, Device, Phase, Tensor};

#[test]
fn a_rehearsal_allocates_as_the_run_would_and_computes_nothing() {
    let device = Device::cpu();
    let x = Tensor::from_slice(&device, &[1.0f64, 2.0, 3.0], &[3], Category::Input).unwrap();
    let real = {
        let before = device.stats().allocation.allocated;
        let y = x.mul(&x).unwrap().relu().unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), [1.0, 4.0, 9.0]);
        device.stats().allocation.allocated - before
    };
    assert!(device.computes() && !device.rehearsing());
    let out = Tensor::zeros(&device, &[3], DType::F64, Category::Temporary).unwrap();
    {
        let _outer = device.rehearse();
        {
            let _nested = device.rehearse();
            assert!(device.rehearsing());
        }
        assert!(device.rehearsing() && !device.computes(), "still rehearsing after a nested guard");
        let before = device.stats().allocation.allocated;
        let y = x.mul(&x).unwrap().relu().unwrap();
        assert_eq!(device.stats().allocation.allocated - before, real, "the same requests");
        out.copy_from(&y).unwrap();
        out.overwrite_with(|v: &mut [f64]| v.fill(7.0)).unwrap();
    }
    assert!(device.computes() && !device.rehearsing());
    assert_eq!(out.to_f64_vec().unwrap(), [0.0, 0.0, 0.0], "no kernel ran, nothing was written");
}

#[test]
fn a_rehearsal_tags_its_allocations_with_its_own_phase() {
    let device = Device::cpu();
    let x = Tensor::from_slice(&device, &[1.0f64, -2.0], &[2], Category::Input).unwrap();
    let _forward = device.enter_phase(Phase::Forward);
    {
        let _rehearsal = device.rehearse();
        assert_eq!(device.phase(), Phase::Rehearsal);
        x.relu().unwrap();
    }
    assert_eq!(device.phase(), Phase::Forward, "the phase entered comes back");
    x.relu().unwrap();
    let phases: Vec<Phase> =
        device.timeline_events().iter().filter(|e| e.kind == EventKind::Alloc).map(|e| e.phase).collect();
    assert_eq!(phases[phases.len() - 2..], [Phase::Rehearsal, Phase::Forward]);
}

#[test]
fn a_rehearsal_records_no_op_spans() {
    let device = Device::cpu();
    device.set_profiling(true);
    let x = Tensor::from_slice(&device, &[1.0f64, -2.0], &[2], Category::Input).unwrap();
    {
        let _rehearsal = device.rehearse();
        x.relu().unwrap();
    }
    assert!(device.take_spans().is_empty());
    x.relu().unwrap();
    assert!(!device.take_spans().is_empty(), "spans again once it is over");
}
