//! Provenance: every allocation names its module (forward and backward), module names are interned
//! per device, spans are recorded only while profiling, and none of it changes what is allocated.

use memfit_tensor::autograd::backward;
use memfit_tensor::memory::EventKind;
use memfit_tensor::{Category, DType, Device, Phase, SpanKind, Tensor};

fn step(device: &Device) {
    let w = Tensor::full(device, &[16, 16], 0.5, DType::F32, Category::Parameter).unwrap().set_requires_grad(true);
    let x = Tensor::full(device, &[8, 16], 1.0, DType::F32, Category::Input).unwrap();
    let y = {
        let _p = device.enter_phase(Phase::Forward);
        let _m = device.enter_module("blocks.0.mlp");
        let h = x.matmul(&w.transpose(0, 1).unwrap()).unwrap();
        let _inner = device.enter_module("blocks.0.mlp.act");
        h.tanh().unwrap().sum_all().unwrap()
    };
    assert_eq!(device.module(), 0, "the scopes are closed");
    backward(&y).unwrap();
}

fn module_of(device: &Device, op: &str, phase: Phase) -> Vec<String> {
    let names = device.module_names();
    let events: Vec<_> = device.timeline_events();
    events
        .iter()
        .filter(|e| e.kind == EventKind::Alloc && e.op.starts_with(op) && e.phase == phase)
        .map(|e| names[e.module as usize].clone())
        .collect()
}

#[test]
fn forward_and_backward_allocations_name_their_module() {
    let device = Device::cpu();
    step(&device);
    assert_eq!(device.module_names(), vec!["", "blocks.0.mlp", "blocks.0.mlp.act"]);
    let fwd = module_of(&device, "matmul", Phase::Forward);
    assert!(!fwd.is_empty() && fwd.iter().all(|m| m == "blocks.0.mlp"), "{fwd:?}");
    let act = module_of(&device, "tanh", Phase::Forward);
    assert!(!act.is_empty() && act.iter().all(|m| m == "blocks.0.mlp.act"), "{act:?}");
    // Backward allocations happen outside the scopes but under the module of the op they undo.
    let names = device.module_names();
    let backward_modules: Vec<String> = device
        .timeline_events()
        .into_iter()
        .filter(|e| e.kind == EventKind::Alloc && e.phase == Phase::Backward)
        .map(|e| names[e.module as usize].clone())
        .collect();
    assert!(backward_modules.iter().any(|m| m == "blocks.0.mlp.act"), "{backward_modules:?}");
    assert!(backward_modules.iter().any(|m| m == "blocks.0.mlp"), "{backward_modules:?}");
    // Interning: entering a module again reuses its id.
    let again = device.enter_module("blocks.0.mlp");
    assert_eq!(device.module(), 1);
    drop(again);
}

#[test]
fn spans_are_recorded_only_while_profiling_and_change_no_allocation() {
    let plain = Device::cpu();
    step(&plain);
    assert!(plain.take_spans().is_empty(), "no spans unless profiling");
    let profiled = Device::cpu();
    profiled.set_profiling(true);
    step(&profiled);
    let spans = profiled.take_spans();
    let modules: Vec<_> = spans.iter().filter(|s| s.kind == SpanKind::Module).collect();
    assert_eq!(modules.len(), 2, "{spans:?}");
    assert!(
        spans.iter().any(|s| s.kind == SpanKind::Op && s.phase == Phase::Backward && s.name == "tanh"),
        "{spans:?}"
    );
    assert!(spans.iter().all(|s| s.end_ns >= s.start_ns));
    let events = |d: &Device| d.timeline_events();
    assert_eq!(events(&plain), events(&profiled), "profiling changes no allocation");
    let meta = Device::meta();
    meta.set_profiling(true);
    step(&meta);
    assert_eq!(events(&plain), events(&meta), "meta == cpu, provenance included");
}
