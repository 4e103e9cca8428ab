//! Out-of-memory recovery: injected allocation failures at many points of training change neither
//! the samples used nor the final parameters, leak nothing, and are counted.

mod common;
use common::*;
use memfit_nn::ModelKind;
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::{DeviceKind, Phase};
use memfit_train::{Session, TrainError};

#[test]
fn a_fault_at_every_allocation_of_a_run_is_recovered() {
    let spec = small_spec(ModelKind::SimpleCnn);
    let samples = data(&spec, 3 * 8);
    let o = opts(8, 8, 3);
    let clean_device = device(DeviceKind::Cpu, None, None);
    let setup_requests = {
        let s = Session::new(clean_device.clone(), &spec, adamw(), 3).unwrap();
        drop(s);
        clean_device.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run(device(DeviceKind::Cpu, None, None), &spec, adamw(), &samples, &o);
    let clean_stats = clean_session.device.stats();
    let requests = clean_stats.allocation.allocated - setup_requests;
    assert!(requests > 20, "a run makes many requests ({requests})");
    for k in 1..=requests {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup_requests + k)));
        let (out, params, session) = run(dev, &spec, adamw(), &samples, &o);
        let stats = session.device.stats();
        assert_eq!(stats.num_injected_faults, 1, "fault at request {k}");
        assert_eq!(stats.num_ooms, 1);
        assert!(out.oom_recoveries >= 1, "fault at request {k} was recovered");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "fault at request {k}: same samples per step");
        assert_params_close(&params, &clean_params, 1e-5, &format!("fault at request {k}"));
        assert_eq!(
            stats.allocated_bytes.current, clean_stats.allocated_bytes.current,
            "fault at request {k}: nothing leaked"
        );
    }
}

#[test]
fn every_nth_faults_sweep_completes_with_the_clean_result() {
    let spec = small_spec(ModelKind::Mlp);
    let samples = data(&spec, 6 * 16);
    let o = opts(16, 16, 6);
    let (clean, clean_params, clean_session) = run(device(DeviceKind::Cpu, None, None), &spec, sgd(), &samples, &o);
    let clean_stats = clean_session.device.stats();
    let clean_allocated = clean_stats.allocated_bytes.current;
    // Faults every N requests, for N from just above one step's requests (so that a re-run half always
    // gets through) to a third of the run.
    let total = clean_stats.allocation.allocated;
    let per_step = total / 6;
    let sweep = [per_step + 3, per_step + 11, total / 5, total / 4, total / 3];
    for n in sweep {
        let (out, params, session) =
            run(device(DeviceKind::Cpu, None, Some(FaultInjection::EveryNth(n))), &spec, sgd(), &samples, &o);
        let stats = session.device.stats();
        assert!(stats.num_injected_faults > 0, "N={n} injected faults");
        assert_eq!(out.oom_recoveries as u64, stats.num_ooms, "N={n}: every OOM was recovered and counted");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "N={n}: same samples");
        assert_params_close(&params, &clean_params, 1e-5, &format!("N={n}"));
        assert_eq!(stats.allocated_bytes.current, clean_allocated, "N={n}: nothing leaked");
    }
}

#[test]
fn a_budget_below_micro_batch_one_stops_with_the_explanation() {
    let spec = small_spec(ModelKind::Mlp);
    let samples = data(&spec, 16);
    // The MLP's parameters alone need several MiB: 1 MiB cannot hold them.
    let dev = device(DeviceKind::Cpu, Some(4 << 20), None);
    let result = Session::new(dev.clone(), &spec, sgd(), 3).and_then(|mut s| {
        let _p = dev.enter_phase(Phase::Setup);
        s.run(&samples, None, &opts(16, 16, 1), &mut |_| {})
    });
    match result {
        Err(e @ TrainError::Engine(_)) | Err(e @ TrainError::OutOfMemory { .. }) => {
            let oom = e.as_oom().expect("an out-of-memory");
            assert!(e.to_string().contains("tried to allocate"), "{e}");
            assert_eq!(oom.capacity, Some(4 << 20));
        }
        other => panic!("expected an out-of-memory, got {:?}", other.map(|o| o.steps)),
    }
}

#[test]
fn an_out_of_memory_in_evaluation_never_shrinks_the_training_batch() {
    let spec = small_spec(ModelKind::SimpleCnn);
    let samples = data(&spec, 2 * 8);
    let val = data(&spec, 16);
    let o = opts(8, 8, 2);
    // Count the requests of setup and training, then fail one inside evaluation.
    let counting = device(DeviceKind::Cpu, None, None);
    let mut s = Session::new(counting.clone(), &spec, adamw(), 3).unwrap();
    s.run(&samples, None, &o, &mut |_| {}).unwrap();
    let before_eval = counting.stats().allocation.allocated;
    let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(before_eval + 2)));
    let mut s = Session::new(dev.clone(), &spec, adamw(), 3).unwrap();
    let out = s.run(&samples, Some(&val), &o, &mut |_| {}).unwrap();
    let eval = out.eval.expect("evaluated");
    assert_eq!(dev.stats().num_injected_faults, 1);
    assert_eq!(eval.oom_recoveries, 1, "the evaluation recovered");
    assert_eq!(eval.micro_batch, 8, "a transient failure passes on the retry without shrinking");
    assert_eq!(out.final_micro_batch, 8, "the training micro-batch is untouched");
    assert_eq!(out.oom_recoveries, 0);
    assert_eq!(eval.samples, 16);
}

#[test]
fn a_real_shortage_shrinks_the_micro_batch_and_a_transient_one_does_not() {
    // Fashion-MNIST's shape: micro-batch 64 needs large-pool segments, 16 does not.
    let spec = memfit_nn::ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10);
    let samples = data(&spec, 2 * 64);
    let o = opts(64, 64, 2);
    // Find the peak of micro-batch 16 and give a capacity between it and micro-batch 64's.
    let probe = |micro: usize| {
        let dev = device(DeviceKind::META, None, None);
        let mut s = Session::new(dev.clone(), &spec, adamw(), 3).unwrap();
        s.run(&samples, None, &opts(64, micro, 1), &mut |_| {}).unwrap();
        dev.stats().reserved_bytes.peak
    };
    let big = probe(64);
    // The largest micro-batch that needs less reserved memory than 64: the capacity to give.
    let small =
        [32, 16, 8, 4, 2, 1].into_iter().map(probe).find(|&r| r < big).expect("a smaller micro-batch needs less");
    let dev = device(DeviceKind::Cpu, Some(small), None);
    let mut s = Session::new(dev.clone(), &spec, adamw(), 3).unwrap();
    let out = s.run(&samples, Some(&data(&spec, 16)), &o, &mut |_| {}).unwrap();
    assert!(out.final_micro_batch < 64, "shrunk to {}", out.final_micro_batch);
    assert_eq!(dev.stats().num_injected_faults, 0, "a real shortage");
    assert!(out.oom_recoveries >= 2, "each level costs a same-size retry, then a split");
    assert_eq!(out.samples_seen, 2 * 64);
    // Injected (transient) faults every so often never shrink it.
    let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::EveryNth(41)));
    let mut s = Session::new(dev.clone(), &spec, adamw(), 3).unwrap();
    let out = s.run(&data(&spec, 4 * 64), None, &opts(64, 64, 4), &mut |_| {}).unwrap();
    assert!(dev.stats().num_injected_faults > 0);
    assert_eq!(out.final_micro_batch, 64);
}

#[test]
fn batch_norm_statistics_are_not_counted_twice_after_a_recovery() {
    let spec = small_spec(ModelKind::ResNet);
    let samples = data(&spec, 2 * 8);
    let o = opts(8, 8, 2);
    let buffers = |s: &Session| -> Vec<(String, Vec<f64>)> {
        s.model.buffers().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect()
    };
    let clean_device = device(DeviceKind::Cpu, None, None);
    let setup = {
        drop(Session::new(clean_device.clone(), &spec, sgd(), 3).unwrap());
        clean_device.stats().allocation.allocated
    };
    let (_, clean_params, clean) = run(device(DeviceKind::Cpu, None, None), &spec, sgd(), &samples, &o);
    let clean_buffers = buffers(&clean);
    assert!(!clean_buffers.is_empty());
    // Faults late in the first step's forward pass, after some batch-norm layers have updated.
    for k in [30, 45, 60, 75] {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup + k)));
        let (out, params, s) = run(dev, &spec, sgd(), &samples, &o);
        assert!(out.oom_recoveries >= 1);
        assert_params_close(&params, &clean_params, 1e-5, &format!("fault at {k}"));
        assert_params_close(&buffers(&s), &clean_buffers, 1e-6, &format!("buffers, fault at {k}"));
    }
}

/// Accumulating (two micro-batches a window), the second micro-batch commits each gradient into
/// `.grad` as soon as it is complete, so a fault in its backward leaves `.grad` partly updated: the
/// window's gradients are dropped and the micro-batches they held replayed, with batch norm's running
/// statistics left as they are. A fault at every allocation: the same samples, and parameters and
/// buffers bit for bit the clean run's, nothing leaked.
#[test]
fn a_fault_at_every_allocation_of_an_accumulating_run_replays_what_the_gradients_held() {
    let spec = small_spec(ModelKind::ResNet);
    let samples = data(&spec, 2 * 8);
    let o = opts(8, 4, 2);
    let buffers = |s: &Session| -> Vec<(String, Vec<f64>)> {
        s.model.buffers().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect()
    };
    let clean_device = device(DeviceKind::Cpu, None, None);
    let setup = {
        drop(Session::new(clean_device.clone(), &spec, adamw(), 3).unwrap());
        clean_device.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run(device(DeviceKind::Cpu, None, None), &spec, adamw(), &samples, &o);
    let clean_buffers = buffers(&clean_session);
    let clean_stats = clean_session.device.stats();
    let requests = clean_stats.allocation.allocated - setup;
    for k in 1..=requests {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup + k)));
        let (out, params, session) = run(dev, &spec, adamw(), &samples, &o);
        let stats = session.device.stats();
        assert_eq!(stats.num_injected_faults, 1, "fault at request {k}");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "fault at request {k}: same samples");
        assert!(params == clean_params, "fault at request {k}: the clean parameters, bit for bit");
        assert!(buffers(&session) == clean_buffers, "fault at request {k}: running statistics moved once");
        assert_eq!(stats.allocated_bytes.current, clean_stats.allocated_bytes.current, "fault at request {k}: leak");
    }
}
