//! Ranks without MPI (Note [Data parallel] in `train/src/parallel.rs`): one rank of data parallel or
//! ZeRO-1 is the plain run bit for bit, a simulated rank on `meta` allocates exactly as a real one on
//! `cpu`, and ZeRO-1's ranks split the optimizer state. Real multi-rank jobs: `cli/tests/mpi.rs`.

mod common;
use common::*;
use memfit_dist::{Group, Simulated, Solo};
use memfit_nn::ModelKind;
use memfit_tensor::{Category, DeviceKind};
use memfit_train::parallel::ParallelMode;
use memfit_train::Session;
use std::sync::Arc;

fn params(s: &Session) -> Vec<(String, Vec<u64>)> {
    s.model
        .parameters()
        .into_iter()
        .map(|(n, t)| (n, t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect()))
        .collect()
}

#[test]
fn one_rank_is_the_plain_run_bit_for_bit() {
    let spec = small_spec(ModelKind::SimpleCnn);
    let samples = data(&spec, 40);
    let o = opts(16, 8, 3);
    let (_, _, plain) = run(device(DeviceKind::Cpu, None, None), &spec, adamw(), &samples, &o);
    for mode in [ParallelMode::Data, ParallelMode::Zero1] {
        let dev = device(DeviceKind::Cpu, None, None);
        let mut s = Session::new(dev.clone(), &spec, adamw(), 3).unwrap();
        s.join(Arc::new(Solo), mode).unwrap();
        let out = s.run(&samples, Some(&data(&spec, 10)), &o, &mut |_| {}).unwrap();
        assert_eq!(out.steps, 3);
        assert_eq!(params(&s), params(&plain), "{mode:?}");
        let total: usize = s.model.parameters().iter().map(|(_, p)| p.numel()).sum();
        let bucket = (total.min(memfit_dist::collective::DEFAULT_BUCKET_BYTES as usize / 4) * 4).div_ceil(512) * 512;
        assert_eq!(dev.stats().category(Category::Communication).peak, bucket as u64, "{mode:?}");
    }
}

#[test]
fn a_simulated_rank_on_meta_allocates_as_a_rank_on_cpu() {
    for (kind, mode) in [(ModelKind::Mlp, ParallelMode::Data), (ModelKind::SimpleCnn, ParallelMode::Zero1)] {
        let spec = small_spec(kind);
        let samples = data(&spec, 40);
        let o = opts(16, 8, 3);
        let groups: [(DeviceKind, Arc<dyn Group>); 2] =
            [(DeviceKind::Cpu, Arc::new(Solo)), (DeviceKind::META, Arc::new(Simulated { rank: 0, size: 1 }))];
        let mut devices = Vec::new();
        for (kind, group) in groups {
            let dev = device(kind, None, None);
            let mut s = Session::new(dev.clone(), &spec, adamw(), 1).unwrap();
            s.join(group, mode).unwrap();
            s.run(&samples, Some(&data(&spec, 20)), &o, &mut |_| {}).unwrap();
            devices.push(dev);
        }
        assert_eq!(devices[0].timeline_events(), devices[1].timeline_events(), "{kind:?} {mode:?}");
        assert_eq!(devices[0].stats(), devices[1].stats(), "{kind:?} {mode:?}");
    }
}

#[test]
fn zero1_ranks_split_the_optimizer_state_and_data_ranks_do_not() {
    let spec = small_spec(ModelKind::Mlp);
    let samples = data(&spec, 16);
    let o = opts(8, 4, 2);
    // (elements of optimizer state, bytes of optimizer state) of rank `rank` of 2.
    let state = |mode, rank| {
        let dev = device(DeviceKind::META, None, None);
        let mut s = Session::new(dev.clone(), &spec, adamw(), 1).unwrap();
        s.join(Arc::new(Simulated { rank, size: 2 }), mode).unwrap();
        s.run(&samples, None, &o, &mut |_| {}).unwrap();
        let elements: usize = s.optimizer.state().iter().map(|(_, _, t)| t.numel()).sum();
        (elements, dev.stats().category(Category::OptimizerState).peak)
    };
    let full = state(ParallelMode::Data, 0);
    assert_eq!(state(ParallelMode::Data, 1), full);
    let (a, b) = (state(ParallelMode::Zero1, 0), state(ParallelMode::Zero1, 1));
    assert_eq!(a.0 + b.0, full.0, "every element's state is kept by exactly one rank");
    assert!(a.0.abs_diff(b.0) <= 2, "split to an element: {} and {} of {}", a.0, b.0, full.0);
    // In bytes, each slice's state is rounded to the allocator's 512-byte blocks.
    assert!(a.1.max(b.1) <= full.1 / 2 + 4 * 512, "{} and {} bytes of {}", a.1, b.1, full.1);
}

#[test]
fn a_simulated_rank_moves_no_cpu_data() {
    let dev = device(DeviceKind::Cpu, None, None);
    let t = memfit_tensor::Tensor::zeros(&dev, &[4], memfit_tensor::DType::F32, Category::Other).unwrap();
    let err = memfit_dist::collective::broadcast(&Simulated { rank: 0, size: 2 }, &t, 1).unwrap_err();
    assert!(err.to_string().contains("simulated rank"), "{err}");
    let ints = memfit_tensor::Tensor::zeros(&dev, &[4], memfit_tensor::DType::I64, Category::Other).unwrap();
    let err = memfit_dist::collective::broadcast(&Solo, &ints, 0).unwrap_err();
    assert!(err.to_string().contains("f32"), "{err}");
}
