//! Engine invariants on whole training steps: `meta` and `cpu` see the same allocation events and
//! statistics byte for byte, and a dropped graph leaves exactly parameters, gradients and optimizer
//! state allocated.

mod common;
use common::*;
use memfit_nn::ModelKind;
use memfit_tensor::{autograd, ops, Category, DeviceKind, Phase};
use memfit_train::Session;

#[test]
fn meta_and_cpu_allocate_identically_for_training_steps() {
    for kind in [ModelKind::Mlp, ModelKind::SimpleCnn] {
        let spec = small_spec(kind);
        let samples = data(&spec, 40);
        let o = opts(16, 16, 3);
        let cpu = device(DeviceKind::Cpu, None, None);
        let meta = device(DeviceKind::META, None, None);
        for dev in [&cpu, &meta] {
            let mut s = Session::new(dev.clone(), &spec, adamw(), 1).unwrap();
            s.run(&samples, Some(&data(&spec, 20)), &o, &mut |_| {}).unwrap();
        }
        let events = |d: &memfit_tensor::Device| d.timeline_events();
        assert_eq!(events(&cpu), events(&meta), "{kind:?}: identical event sequences");
        assert!(!events(&cpu).is_empty());
        assert_eq!(cpu.stats(), meta.stats(), "{kind:?}: identical statistics");
    }
}

fn rounded(bytes: usize) -> u64 {
    (bytes.max(1).div_ceil(512) * 512) as u64
}

#[test]
fn a_dropped_graph_leaves_parameters_gradients_and_state() {
    let spec = small_spec(ModelKind::SimpleCnn);
    let dev = device(DeviceKind::Cpu, None, None);
    let mut s = Session::new(dev.clone(), &spec, adamw(), 1).unwrap();
    let samples = data(&spec, 8);
    {
        let (x, y) = memfit_train::samples::Samples::to_device(&samples, &dev, &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        let _p = dev.enter_phase(Phase::Forward);
        let logits = s.model.forward(&x, true).unwrap();
        let loss = ops::cross_entropy(&logits, &y, 0.0).unwrap();
        autograd::backward(&loss).unwrap();
        s.optimizer.step().unwrap();
        // logits, loss, x, y and the graph drop here.
    }
    let params: u64 = s.model.parameters().iter().map(|(_, t)| rounded(t.numel() * 4)).sum();
    let grads: u64 = s.model.parameters().iter().map(|(_, t)| rounded(t.grad().expect("a gradient").numel() * 4)).sum();
    let state: u64 = s.optimizer.state().iter().map(|(_, _, t)| rounded(t.numel() * 4)).sum();
    let buffers: u64 = s.model.buffers().iter().map(|(_, t)| rounded(t.numel() * t.dtype().size())).sum();
    let stats = dev.stats();
    assert_eq!(stats.category(Category::Parameter).current, params);
    assert_eq!(stats.category(Category::Gradient).current, grads);
    assert_eq!(stats.category(Category::OptimizerState).current, state);
    for c in [Category::Activation, Category::Temporary, Category::Input] {
        assert_eq!(stats.category(c).current, 0, "{c} bytes left after the graph was dropped");
    }
    assert_eq!(stats.allocated_bytes.current, params + grads + state + buffers);
    s.optimizer.zero_grad();
    assert_eq!(dev.stats().allocated_bytes.current, params + state + buffers);
}
