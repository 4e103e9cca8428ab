//! The tensor crate's core, checked where mutation testing (`tools/mutants`, docs/mutants.md) found
//! behaviour no other test pinned down: when an op records a graph node (and so re-tags what it saves
//! as an activation), what backward refuses, the device, storage, dtype and error plumbing, the
//! tensor accessors and in-place writes, and the ops' shape rules.

use memfit_tensor::autograd::{self, backward, grad, needs_grad, Backward};
use memfit_tensor::memory::{Event, EventKind, FaultInjection};
use memfit_tensor::{
    ops, Category, DType, Device, DeviceConfig, DeviceKind, Error, Float, Phase, Result, SpanKind, Target, Tensor,
};
use std::sync::{Arc, Mutex};

fn leaf(device: &Device, values: &[f64]) -> Tensor {
    Tensor::from_slice(device, values, &[values.len()], Category::Parameter).unwrap().set_requires_grad(true)
}

fn constant(device: &Device, values: &[f64]) -> Tensor {
    Tensor::from_slice(device, values, &[values.len()], Category::Input).unwrap()
}

// ----- whether an op records a node -----

#[test]
fn an_op_on_a_tensor_that_requires_grad_records_a_node_and_saves_its_output() {
    let device = Device::cpu();
    let x = leaf(&device, &[0.5, -1.0]);
    assert!(needs_grad(&[&x]));
    let y = x.tanh().unwrap();
    assert!(!y.is_leaf() && y.requires_grad());
    // tanh saves its output for backward: re-tagged from temporary to activation.
    assert_eq!(y.storage().category(), Category::Activation);
    assert_eq!(x.storage().category(), Category::Parameter, "a saved parameter stays a parameter");
}

#[test]
fn an_op_under_no_grad_records_nothing_and_saves_nothing() {
    let device = Device::cpu();
    let x = leaf(&device, &[0.5, -1.0]);
    let y = {
        let _no_grad = device.no_grad();
        assert!(!needs_grad(&[&x]), "no_grad wins over an input that requires grad");
        x.tanh().unwrap()
    };
    assert!(y.is_leaf() && !y.requires_grad());
    assert_eq!(y.storage().category(), Category::Temporary, "nothing was saved, so nothing re-tagged");
    let err = backward(&y.sum_all().unwrap()).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
}

#[test]
fn an_op_on_tensors_that_do_not_require_grad_records_nothing() {
    let device = Device::cpu();
    let a = constant(&device, &[1.0, 2.0]);
    let b = constant(&device, &[3.0, 4.0]);
    assert!(device.grad_enabled());
    assert!(!needs_grad(&[&a, &b]));
    let y = a.tanh().unwrap();
    assert!(y.is_leaf() && !y.requires_grad());
    assert_eq!(y.storage().category(), Category::Temporary);
    // Any input that requires grad is enough, wherever it is.
    let w = leaf(&device, &[1.0, 1.0]);
    assert!(needs_grad(&[&a, &w]) && needs_grad(&[&w, &a]));
    assert!(!a.add(&w).unwrap().is_leaf());
}

#[test]
fn no_inputs_never_need_grad() {
    assert!(!needs_grad(&[]));
}

// ----- what backward refuses -----

#[test]
fn backward_through_a_tensor_without_graph_that_does_not_require_grad_fails() {
    let device = Device::cpu();
    let loss = constant(&device, &[3.0]);
    let err = backward(&loss).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)));
    assert!(err.to_string().contains("does not require grad"), "{err}");
    let err = grad(&[loss], &[None], &[]).unwrap_err();
    assert!(err.to_string().contains("does not require grad"), "{err}");
}

#[test]
fn backward_from_a_scalar_leaf_gives_it_gradient_one() {
    let device = Device::cpu();
    let x = leaf(&device, &[2.5]);
    backward(&x).unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.to_f64_vec().unwrap(), [1.0]);
    assert_eq!(g.storage().category(), Category::Gradient);
}

#[test]
fn backward_needs_a_scalar_and_a_matching_gradient() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    let y = x.tanh().unwrap();
    let err = backward(&y).unwrap_err();
    assert!(matches!(err, Error::Shape(_)), "{err}");
    assert!(err.to_string().contains("needs a scalar output"), "{err}");
    let wrong = Tensor::full(&device, &[3], 1.0, DType::F64, Category::Temporary).unwrap();
    let err = autograd::backward_with(&y, wrong).unwrap_err();
    assert!(matches!(err, Error::Shape(_)), "{err}");
    assert!(x.grad().is_none(), "a failed backward commits nothing");
    // The phase and grad mode are restored after backward, whatever happened.
    assert_eq!(device.phase(), Phase::Setup);
    assert!(device.grad_enabled());
}

// ----- graph execution -----

/// A two-input op whose backward writes down the `needs` it was given and the order it ran in, and
/// passes its gradient to every input that needs one.
struct Logged {
    name: &'static str,
    log: Arc<Mutex<Vec<(&'static str, Vec<bool>)>>>,
    inputs: usize,
}

impl Backward for Logged {
    fn backward(self: Box<Self>, g: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        self.log.lock().unwrap().push((self.name, needs.to_vec()));
        Ok(needs.iter().take(self.inputs).map(|&need| need.then(|| g.clone())).collect())
    }
}

type Log = Arc<Mutex<Vec<(&'static str, Vec<bool>)>>>;

/// `name(inputs)`: the first input's values, with a logged node when grad is needed.
fn logged(name: &'static str, inputs: &[&Tensor], log: &Log) -> Tensor {
    let out = inputs[0].detach().mul_scalar(1.0).unwrap();
    if !needs_grad(inputs) {
        return out;
    }
    autograd::record(out, name, inputs, Logged { name, log: log.clone(), inputs: inputs.len() })
}

#[test]
fn grad_asks_a_node_only_for_the_gradients_that_lead_to_its_inputs() {
    let device = Device::cpu();
    let log: Log = Arc::default();
    let (a, b, d) = (leaf(&device, &[1.0]), leaf(&device, &[2.0]), leaf(&device, &[3.0]));
    let m = logged("m", &[&d], &log);
    let out = logged("out", &[&a, &b, &m], &log);
    // Only a: neither the leaf b nor the node m (behind which is only d) is wanted.
    let got = grad(std::slice::from_ref(&out), &[None], std::slice::from_ref(&a)).unwrap();
    assert_eq!(got[0].as_ref().unwrap().to_f64_vec().unwrap(), [1.0]);
    assert_eq!(*log.lock().unwrap(), [("out", vec![true, false, false])]);

    // The intermediate m: its node is not run, but the gradient reaching it is returned.
    log.lock().unwrap().clear();
    let out = logged("out", &[&a, &b, &m], &log);
    let got = grad(&[out], &[None], std::slice::from_ref(&m)).unwrap();
    assert_eq!(got[0].as_ref().unwrap().to_f64_vec().unwrap(), [1.0]);
    assert_eq!(*log.lock().unwrap(), [("out", vec![false, false, true])]);

    // backward wants every leaf.
    log.lock().unwrap().clear();
    let out = logged("out", &[&a, &b, &m], &log);
    backward(&out).unwrap();
    assert_eq!(*log.lock().unwrap(), [("out", vec![true, true, true]), ("m", vec![true])]);
    for t in [&a, &b, &d] {
        assert_eq!(t.grad().unwrap().to_f64_vec().unwrap(), [1.0]);
    }
}

#[test]
fn the_same_output_twice_is_differentiated_once_with_both_seeds() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    let y = x.mul(&x).unwrap().sum_all().unwrap();
    let got = grad(&[y.clone(), y], &[None, None], std::slice::from_ref(&x)).unwrap();
    assert_eq!(got[0].as_ref().unwrap().to_f64_vec().unwrap(), [4.0, 8.0]);
}

#[test]
fn a_checkpointed_segment_whose_output_needs_no_grad_gives_no_gradient() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    let constant: autograd::Segment =
        Arc::new(|inputs: &[Tensor], _| Tensor::full(inputs[0].device(), &[2], 7.0, DType::F64, Category::Temporary));
    let out = autograd::checkpoint(&[&x], &[], constant).unwrap();
    assert!(!out.is_leaf(), "x requires grad: the checkpoint records a node");
    backward(&out.sum_all().unwrap()).unwrap();
    assert!(x.grad().is_none());
}

#[test]
fn committing_into_an_existing_gradient_allocates_nothing() {
    let device = Device::cpu();
    let x = leaf(&device, &[0.5, -1.0, 2.0]);
    let allocations_of_backward = || {
        let loss = x.tanh().unwrap().sum_all().unwrap();
        let before = device.stats().allocation.allocated;
        backward(&loss).unwrap();
        device.stats().allocation.allocated - before
    };
    // The first backward moves its (exclusively owned) gradient into .grad, the second adds into it:
    // neither copies.
    let first = allocations_of_backward();
    let second = allocations_of_backward();
    assert_eq!(first, second);
    assert_eq!(x.grad().unwrap().storage().category(), Category::Gradient);
}

// ----- the device -----

#[test]
fn device_kinds_have_names_and_parse_back() {
    let kinds = [
        (DeviceKind::Cpu, "cpu", Target::Cpu),
        (DeviceKind::META, "meta", Target::Cpu),
        (DeviceKind::CUDA, "cuda", Target::Cuda),
        (DeviceKind::Cuda(3), "cuda:3", Target::Cuda),
        (DeviceKind::Meta(Target::Cuda), "meta:cuda", Target::Cuda),
    ];
    for (kind, name, target) in kinds {
        assert_eq!(kind.name(), name);
        assert_eq!(kind.to_string(), name);
        assert_eq!(DeviceKind::parse(name).unwrap(), kind);
        assert_eq!(kind.target(), target, "{name}");
        assert_eq!(kind.computes(), !name.starts_with("meta"), "{name}");
        assert_eq!(kind.host_readable(), name == "cpu", "{name}");
    }
    assert_eq!(DeviceKind::parse("cuda:0").unwrap(), DeviceKind::CUDA);
    assert_eq!(DeviceKind::parse("meta:cpu").unwrap(), DeviceKind::META);
    for bad in ["gpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "cuda:1024", "meta:gpu", "CPU"] {
        let err = DeviceKind::parse(bad).unwrap_err();
        assert!(matches!(err, Error::Invalid(_)) && err.to_string().contains(&format!("{bad:?}")), "{err}");
    }
    assert_eq!(format!("{:?}", Device::meta()), "Device(meta)");
    assert_eq!(format!("{:?}", Device::cpu()), "Device(cpu)");
}

#[test]
fn a_gpu_target_holds_cublas_workspace_from_open_to_close() {
    let workspace = memfit_cuda::LIBRARY_WORKSPACE_BYTES;
    let gpu = Device::new(DeviceConfig::new(DeviceKind::Meta(Target::Cuda))).unwrap();
    assert_eq!(gpu.target(), Target::Cuda);
    let stats = gpu.stats();
    assert_eq!(stats.allocated_bytes.current, workspace);
    assert_eq!(stats.by_category[Category::Other.index()].current, workspace);
    assert!(gpu.timeline_events().iter().any(|e| e.op == "cublas_workspace" && e.bytes == workspace));
    assert_eq!(Device::meta().stats().allocated_bytes.current, 0, "a cpu target holds none");
    // A capacity below it cannot open: an out-of-memory error, not a panic.
    let small = Device::new(DeviceConfig::new(DeviceKind::Meta(Target::Cuda)).capacity(Some(workspace - 1)));
    assert!(small.unwrap_err().is_oom());
}

#[test]
fn a_gpu_target_holds_the_rounding_workspace_while_its_products_are_rounded() {
    use memfit_tensor::Products;
    let (library, rounding) = (memfit_cuda::LIBRARY_WORKSPACE_BYTES, memfit_cuda::ROUNDING_WORKSPACE_BYTES);
    let gpu = Device::new(DeviceConfig::new(DeviceKind::Meta(Target::Cuda))).unwrap();
    let held = |d: &Device| d.stats().allocated_bytes.current;
    gpu.set_products(Products::Bf16).unwrap();
    assert_eq!(held(&gpu), library + rounding);
    assert!(gpu.timeline_events().iter().any(|e| e.op == "rounding_workspace" && e.bytes == rounding));
    // Once: fp16 after bf16 keeps the same block; f32 gives it back; bf16 again takes it again.
    gpu.set_products(Products::F16).unwrap();
    assert_eq!(held(&gpu), library + rounding);
    gpu.set_products(Products::F32).unwrap();
    assert_eq!((held(&gpu), gpu.products()), (library, Products::F32));
    gpu.set_products(Products::Bf16).unwrap();
    assert_eq!((held(&gpu), gpu.products()), (library + rounding, Products::Bf16));
    // A cpu target rounds in its kernels' packs: nothing held.
    let cpu = Device::meta();
    cpu.set_products(Products::Bf16).unwrap();
    assert_eq!(held(&cpu), 0);
    // A GPU too small for it: an out-of-memory error, and the products stay as they were.
    let small =
        Device::new(DeviceConfig::new(DeviceKind::Meta(Target::Cuda)).capacity(Some(library + rounding - 1))).unwrap();
    assert!(small.set_products(Products::Bf16).unwrap_err().is_oom());
    assert_eq!((held(&small), small.products()), (library, Products::F32));
}

#[test]
fn a_device_is_what_was_configured() {
    let cpu = Device::cpu();
    assert_eq!(cpu.kind(), DeviceKind::Cpu);
    assert!(cpu.computes() && !Device::meta().computes());
    assert_eq!(Device::meta().kind(), DeviceKind::META);
    assert_eq!(cpu.capacity(), None);
    let limited = Device::new(DeviceConfig::new(DeviceKind::META).capacity(Some(3 << 20))).unwrap();
    assert_eq!(limited.capacity(), Some(3 << 20));
    assert_eq!(limited.memory_state().capacity, Some(3 << 20));
    assert!(cpu.same(&cpu.clone()));
    assert!(!cpu.same(&Device::cpu()));
    let mut config = DeviceConfig::new(DeviceKind::Cpu);
    config.timeline_events = 10;
    let per_event = (std::mem::size_of::<Event>() + std::mem::size_of::<u64>()) as u64;
    assert_eq!(Device::new(config).unwrap().timeline_max_bytes(), 10 * per_event);
}

#[test]
fn allocations_are_counted_recorded_and_returned() {
    let device = Device::cpu();
    let t = Tensor::zeros(&device, &[3, 5], DType::F32, Category::Input).unwrap();
    assert_eq!(t.storage().requested_bytes(), 60);
    assert!(t.storage().device().same(&device));
    let stats = device.stats();
    assert_eq!((stats.allocated_bytes.current, stats.requested_bytes.current), (512, 60));
    let events = device.timeline_events();
    assert_eq!(events.last().unwrap().kind, EventKind::Alloc);
    assert_eq!(events.last().unwrap().category, Category::Input);
    let state = device.memory_state();
    assert_eq!(state.stats, stats);
    assert_eq!(state.events.len(), events.len());
    drop(t);
    let stats = device.stats();
    assert_eq!(stats.allocated_bytes.current, 0, "a dropped tensor's storage is freed");
    assert_eq!(stats.allocated_bytes.peak, 512);
    assert_eq!(stats.reserved_bytes.current, 2 << 20, "and cached");
    device.reset_peak_stats();
    assert_eq!(device.stats().allocated_bytes.peak, 0);
    device.empty_cache();
    assert_eq!(device.stats().reserved_bytes.current, 0);
}

#[test]
fn injected_faults_reach_tensor_ops_as_out_of_memory() {
    let device = Device::meta();
    device.set_fault_injection(Some(FaultInjection::Nth(1)));
    let err = Tensor::zeros(&device, &[4], DType::F32, Category::Input).unwrap_err();
    assert!(err.is_oom());
    let oom = err.as_oom().expect("an out-of-memory error carries its report");
    assert!(oom.injected);
    assert_eq!(err.to_string(), oom.to_string());
    device.set_fault_injection(None);
    Tensor::zeros(&device, &[4], DType::F32, Category::Input).unwrap();
}

#[test]
fn guards_restore_phase_grad_mode_recomputation_and_module() {
    let device = Device::cpu();
    assert_eq!(device.phase(), Phase::Setup);
    {
        let _phase = device.enter_phase(Phase::Optimizer);
        assert_eq!(device.phase(), Phase::Optimizer);
    }
    assert_eq!(device.phase(), Phase::Setup);

    {
        let _no_grad = device.no_grad();
        assert!(!device.grad_enabled());
        {
            let _grad = device.enable_grad();
            assert!(device.grad_enabled());
        }
        assert!(!device.grad_enabled());
    }
    assert!(device.grad_enabled());

    assert!(!device.recomputing());
    {
        let _outer = device.recompute();
        assert!(device.recomputing());
        {
            let _inner = device.recompute();
            assert!(device.recomputing());
        }
        assert!(device.recomputing(), "still inside the outer re-run");
    }
    assert!(!device.recomputing());

    assert_eq!(device.module(), 0);
    {
        let _a = device.enter_module("a");
        assert_eq!(device.module(), 1);
        {
            let _b = device.enter_module("b");
            assert_eq!(device.module(), 2);
            let _back = device.restore_module(0);
            assert_eq!(device.module(), 0);
        }
        assert_eq!(device.module(), 1);
    }
    assert_eq!(device.module(), 0);
    assert_eq!(device.module_names(), ["", "a", "b"]);
}

#[test]
fn spans_are_timed_and_recorded_only_while_profiling() {
    let device = Device::cpu();
    {
        let _m = device.enter_module("quiet");
        let _op = device.op_scope("quiet_op");
    }
    assert!(device.take_spans().is_empty(), "not profiling");
    device.set_profiling(true);
    {
        let _phase = device.enter_phase(Phase::Forward);
        let _m = device.enter_module("layer");
        let _op = device.op_scope("matmul");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let spans = device.take_spans();
    assert_eq!(spans.len(), 2, "{spans:?}");
    // The op's scope closes first.
    assert_eq!(
        (spans[0].name, spans[0].kind, spans[0].phase, spans[0].module),
        ("matmul", SpanKind::Op, Phase::Forward, 2)
    );
    assert_eq!(
        (spans[1].name, spans[1].kind, spans[1].module),
        ("module", SpanKind::Module, 2),
        "the module it entered"
    );
    for span in &spans {
        assert!(span.end_ns >= span.start_ns + 1_000_000, "{span:?}");
    }
    assert!(device.take_spans().is_empty(), "taken");
    // A restored module (autograd's) records no span.
    {
        let _back = device.restore_module(1);
    }
    assert!(device.take_spans().is_empty());
    device.set_profiling(false);
    {
        let _op = device.op_scope("matmul");
    }
    assert!(device.take_spans().is_empty());
}

// ----- dtypes and errors -----

#[test]
fn dtypes_have_sizes_names_and_kinds() {
    let all = [
        (DType::F32, 4, "f32", true),
        (DType::F64, 8, "f64", true),
        (DType::F16, 2, "f16", true),
        (DType::BF16, 2, "bf16", true),
        (DType::I64, 8, "i64", false),
        (DType::U8, 1, "u8", false),
        (DType::Bool, 1, "bool", false),
    ];
    for (dtype, size, name, float) in all {
        assert_eq!(
            (dtype.size(), dtype.name(), dtype.to_string(), dtype.is_float()),
            (size, name, name.to_string(), float)
        );
    }
}

#[test]
fn float_conversions_and_erf() {
    assert_eq!(<f32 as Float>::of(0.25), 0.25f32);
    assert_eq!(<f64 as Float>::of(0.25), 0.25f64);
    assert_eq!(Float::f64(0.75f32), 0.75);
    assert_eq!(Float::f64(-0.75f64), -0.75);
    assert!((Float::erf(0.5f32) - 0.520_499_9).abs() < 1e-6);
    assert!((Float::erf(0.5f64) - 0.520_499_877_813_046_5).abs() < 1e-15);
    let mut v = vec![1.5f32, 2.5];
    assert_eq!(<f32 as Float>::as_f32(&v), Some(&[1.5f32, 2.5][..]));
    <f32 as Float>::as_f32_mut(&mut v).unwrap()[1] = 4.0;
    assert_eq!(v, [1.5, 4.0]);
    let mut w = vec![1.5f64];
    assert!(<f64 as Float>::as_f32(&w).is_none() && <f64 as Float>::as_f32_mut(&mut w).is_none());
    assert_eq!(<f32 as Float>::DTYPE, DType::F32);
    assert_eq!(<f64 as Float>::DTYPE, DType::F64);
}

#[test]
fn errors_say_what_kind_they_are() {
    let cases = [
        (Error::shape("bad"), "shape error: bad"),
        (Error::dtype("bad"), "dtype error: bad"),
        (Error::device("bad"), "device error: bad"),
        (Error::invalid("bad"), "bad"),
    ];
    for (err, text) in cases {
        assert_eq!(err.to_string(), text);
        assert!(!err.is_oom() && err.as_oom().is_none());
    }
    assert!(matches!(Error::shape("x"), Error::Shape(m) if m == "x"));
    assert!(matches!(Error::dtype("x"), Error::DType(m) if m == "x"));
    assert!(matches!(Error::device("x"), Error::Device(m) if m == "x"));
    assert!(matches!(Error::invalid("x"), Error::Invalid(m) if m == "x"));
    // Data asked of meta is a device error naming the device.
    let t = Tensor::zeros(&Device::meta(), &[2], DType::F32, Category::Input).unwrap();
    let err = t.to_f64_vec().unwrap_err();
    assert!(matches!(err, Error::Device(_)) && err.to_string().contains("meta"), "{err}");
}

// ----- what ops refuse, and edge shapes (found by mutation testing of ops/ and backend/cpu/) -----

#[test]
fn ops_refuse_tensors_on_two_devices_or_of_two_dtypes() {
    let (a, b) = (Device::cpu(), Device::cpu());
    let x = Tensor::from_slice(&a, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2], Category::Input).unwrap();
    let y = Tensor::from_slice(&b, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2], Category::Input).unwrap();
    let err = x.matmul(&y).unwrap_err();
    assert!(matches!(err, Error::Device(_)) && err.to_string().contains("different devices"), "{err}");
    let err = x.add(&y).unwrap_err();
    assert!(err.to_string().contains("different devices"), "{err}");
    let wide = Tensor::from_slice(&a, &[1.0f64, 2.0, 3.0, 4.0], &[2, 2], Category::Input).unwrap();
    let err = x.add(&wide).unwrap_err();
    assert!(matches!(err, Error::DType(_)) && err.to_string().contains("f32 and f64 differ"), "{err}");
    assert!(x.matmul(&wide).is_err());
}

#[test]
fn integer_and_bool_tensors_cast_to_f32_and_f64_only() {
    let d = Device::cpu();
    let ints = Tensor::from_slice(&d, &[-2i64, 0, 7], &[3], Category::Input).unwrap();
    assert_eq!(ints.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), [-2.0, 0.0, 7.0]);
    assert_eq!(ints.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(), [-2.0, 0.0, 7.0]);
    let bools = Tensor::from_slice(&d, &[true, false], &[2], Category::Input).unwrap();
    assert_eq!(bools.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(), [1.0, 0.0]);
    for (t, to) in [(&ints, DType::F16), (&ints, DType::BF16), (&bools, DType::BF16)] {
        let err = t.to_dtype(to).unwrap_err();
        assert!(err.to_string().contains("casts only to f32 or f64"), "{err}");
    }
    let floats = Tensor::from_slice(&d, &[1.5f32], &[1], Category::Input).unwrap();
    assert!(floats.to_dtype(DType::I64).is_err());
    // A cast of a constant records no graph: its output is a plain tensor.
    let wide = floats.to_dtype(DType::F64).unwrap();
    assert!(wide.is_leaf() && !wide.requires_grad());
    // A cast of a parameter does, and back-propagates in the parameter's dtype.
    let p = leaf(&d, &[0.25, 4.0]);
    let narrow = p.to_dtype(DType::F32).unwrap();
    assert!(!narrow.is_leaf() && narrow.requires_grad());
    backward(&narrow.sum_all().unwrap()).unwrap();
    assert_eq!(p.grad().unwrap().to_vec::<f64>().unwrap(), [1.0, 1.0]);
}

#[test]
fn an_embedding_of_zero_width_gives_empty_rows() {
    let d = Device::cpu();
    let table = Tensor::zeros(&d, &[5, 0], DType::F32, Category::Parameter).unwrap();
    let ids = Tensor::from_slice(&d, &[0i64, 4, 2], &[3], Category::Input).unwrap();
    let rows = memfit_tensor::ops::embedding(&ids, &table).unwrap();
    assert_eq!(rows.shape(), [3, 0]);
    let bad = Tensor::from_slice(&d, &[5i64], &[1], Category::Input).unwrap();
    assert!(memfit_tensor::ops::embedding(&bad, &table).unwrap_err().to_string().contains("out of range"));
}

#[test]
fn nesterov_needs_momentum_and_no_dampening() {
    let d = Device::cpu();
    let p = Tensor::from_slice(&d, &[1.0f32, 2.0], &[2], Category::Parameter).unwrap();
    let g = Tensor::from_slice(&d, &[0.5f32, 0.5], &[2], Category::Gradient).unwrap();
    let buf = Tensor::zeros(&d, &[2], DType::F32, Category::OptimizerState).unwrap();
    let sgd = |momentum, dampening| {
        memfit_tensor::ops::sgd_update(&p, &g, Some(&buf), true, 0.1, momentum, dampening, true, 0.0)
    };
    for (momentum, dampening) in [(0.9, 0.1), (0.0, 0.0)] {
        let err = sgd(momentum, dampening).unwrap_err();
        assert!(err.to_string().contains("Nesterov"), "momentum {momentum}, dampening {dampening}: {err}");
    }
    assert_eq!(p.to_vec::<f32>().unwrap(), [1.0, 2.0], "a refused update changes nothing");
    sgd(0.9, 0.0).unwrap();
    assert_ne!(p.to_vec::<f32>().unwrap(), [1.0, 2.0]);
}

/// `max_all` computes its value: the gradient check alone passed with a kernel that wrote nothing
/// (a constant output has a zero gradient, and no element ties with it).
#[test]
fn max_all_is_the_largest_element_in_every_float_dtype() {
    let dev = Device::cpu();
    for dtype in [DType::F32, DType::F64] {
        let t = Tensor::from_slice(&dev, &[-3.0f64, -1.5, -7.0, -2.0, -1.75, -9.0], &[2, 3], Category::Input)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_eq!(t.max_all().unwrap().item().unwrap(), -1.5, "{dtype}");
        // A strided view: the op makes it contiguous first.
        assert_eq!(t.transpose(0, 1).unwrap().max_all().unwrap().item().unwrap(), -1.5, "{dtype}");
    }
}

// ----- tensor accessors and in-place writes -----

#[test]
fn size_resolves_negative_dims_and_refuses_dims_out_of_range() {
    let t = Tensor::zeros(&Device::cpu(), &[2, 3, 5], DType::F32, Category::Activation).unwrap();
    assert_eq!([t.size(0).unwrap(), t.size(1).unwrap(), t.size(-1).unwrap(), t.size(-3).unwrap()], [2, 3, 5, 2]);
    assert!(t.size(3).is_err() && t.size(-4).is_err());
}

#[test]
fn write_with_fills_a_cpu_tensor_checks_its_dtype_and_leaves_meta_alone() {
    let t = Tensor::zeros(&Device::cpu(), &[3], DType::F32, Category::Activation).unwrap();
    t.write_with::<f32>(|s| s.copy_from_slice(&[1.0, 2.0, 3.5])).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.5]);
    assert_eq!(t.read_with::<f32, f32>(|s| s.iter().sum()).unwrap(), Some(6.5));
    assert!(t.write_with::<f64>(|_| ()).is_err(), "an f32 tensor written as f64");

    let meta = Tensor::zeros(&Device::meta(), &[3], DType::F32, Category::Activation).unwrap();
    let mut called = false;
    meta.write_with::<f32>(|_| called = true).unwrap();
    assert!(!called, "meta holds no data to fill");
}

#[test]
fn copy_from_overwrites_in_place_from_any_layout_and_refuses_other_shapes() {
    let device = Device::cpu();
    let dst = Tensor::zeros(&device, &[2, 2], DType::F32, Category::Parameter).unwrap();
    let src = Tensor::from_slice(&device, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2], Category::Input).unwrap();
    dst.copy_from(&src).unwrap();
    assert_eq!(dst.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    dst.copy_from(&src.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(dst.to_vec::<f32>().unwrap(), [1.0, 3.0, 2.0, 4.0]);
    let err = dst.copy_from(&src.reshape(&[4]).unwrap()).unwrap_err();
    assert!(err.to_string().contains("copy_from: destination [2, 2]"), "{err}");
    assert!(dst.copy_from(&src.to_dtype(DType::F64).unwrap()).is_err());
    assert_eq!(dst.to_vec::<f32>().unwrap(), [1.0, 3.0, 2.0, 4.0], "a refused copy writes nothing");
}

#[test]
fn a_tensor_debug_prints_its_shape_dtype_device_and_grad_flag() {
    let device = Device::cpu();
    assert_eq!(format!("{:?}", leaf(&device, &[1.0, 2.0])), "Tensor([2], f64, cpu, requires_grad)");
    let meta = Tensor::zeros(&Device::meta(), &[2, 3], DType::F32, Category::Activation).unwrap();
    assert_eq!(format!("{meta:?}"), "Tensor([2, 3], f32, meta)");
}

// ----- attention's shape rules -----

#[test]
fn attention_takes_unbatched_inputs_of_different_lengths_and_widths() {
    let device = Device::cpu();
    let z = |shape: &[usize]| Tensor::zeros(&device, shape, DType::F32, Category::Activation).unwrap();
    // Rank 2: Tq 3, Tk 5, D 4, Dv 2 (Dv != Tk, Tq != Tk).
    let out = ops::scaled_dot_product_attention(&z(&[3, 4]), &z(&[5, 4]), &z(&[5, 2]), false, None).unwrap();
    assert_eq!(out.shape(), [3, 2]);
    // Rank 5: leading dims checked in full.
    let out =
        ops::scaled_dot_product_attention(&z(&[2, 1, 3, 3, 4]), &z(&[2, 1, 3, 5, 4]), &z(&[2, 1, 3, 5, 2]), true, None);
    assert_eq!(out.unwrap().shape(), [2, 1, 3, 3, 2]);
    for (q, k, v) in [
        (&[2, 1, 3, 3, 4][..], &[2, 1, 2, 5, 4][..], &[2, 1, 3, 5, 2][..]),
        (&[2, 1, 3, 3, 4], &[2, 1, 3, 5, 4], &[2, 1, 2, 5, 2]),
        (&[3, 4], &[5, 4], &[4, 2]),
        (&[4], &[4], &[4]),
        // k or v of a higher rank whose leading dims and sizes would otherwise line up.
        (&[2, 3, 4], &[2, 5, 4, 9], &[2, 5, 2]),
        (&[2, 3, 4], &[2, 5, 4], &[2, 5, 2, 9]),
    ] {
        let err = ops::scaled_dot_product_attention(&z(q), &z(k), &z(v), false, None).unwrap_err();
        assert!(err.to_string().contains("expected q [..., Tq, D]"), "{q:?} {k:?} {v:?}: {err}");
    }
}

#[test]
fn packed_attention_needs_a_width_that_splits_into_three_times_the_heads() {
    let qkv = Tensor::zeros(&Device::cpu(), &[1, 2, 9], DType::F32, Category::Activation).unwrap();
    let err = ops::packed_self_attention(&qkv, 2, false, None).unwrap_err();
    assert!(err.to_string().contains("positive multiple of heads = 2"), "{err}");
    assert_eq!(ops::packed_self_attention(&qkv, 3, false, None).unwrap().shape(), [1, 2, 3]);
}

#[test]
fn matmul_linear_and_layer_norm_check_ranks_before_indexing() {
    let device = Device::cpu();
    let z = |shape: &[usize]| Tensor::zeros(&device, shape, DType::F64, Category::Activation).unwrap();
    let err = z(&[3]).matmul(&z(&[3, 2])).unwrap_err();
    assert!(err.to_string().contains("rank >= 2"), "{err}");
    let err = z(&[2, 3]).matmul(&z(&[3])).unwrap_err();
    assert!(err.to_string().contains("rank >= 2"), "{err}");
    // A single sample without a batch dim: linear maps [in] to [out].
    let x = constant(&device, &[1.0, 2.0, 3.0]);
    let w = Tensor::from_slice(&device, &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0], &[2, 3], Category::Parameter).unwrap();
    assert_eq!(ops::linear(&x, &w, None).unwrap().to_vec::<f64>().unwrap(), [4.0, 2.0]);
    // normalized_shape longer than the input's rank.
    let err = ops::layer_norm(&z(&[4]), &[2, 4], None, None, 1e-5).unwrap_err();
    assert!(err.to_string().contains("does not match the trailing dims"), "{err}");
}

/// Gradient accumulation adds in place only into a tensor nobody else holds: writing into a shared
/// one would change the other holder's values (the gradient-aliasing bug class).
#[test]
fn add_accumulate_never_writes_into_a_tensor_someone_else_holds() {
    let device = Device::cpu();
    let prev = constant(&device, &[1.0, 2.0]);
    let held = prev.clone();
    let sum = ops::add_accumulate(prev, &constant(&device, &[10.0, 20.0])).unwrap();
    assert_eq!(sum.to_vec::<f64>().unwrap(), [11.0, 22.0]);
    assert_eq!(held.to_vec::<f64>().unwrap(), [1.0, 2.0], "the other holder's values changed");
    // Held by nobody else: added in place, allocating nothing.
    let (alone, g) = (constant(&device, &[1.0, 2.0]), constant(&device, &[0.5, 0.5]));
    let before = device.stats().allocation.allocated;
    let sum = ops::add_accumulate(alone, &g).unwrap();
    assert_eq!(device.stats().allocation.allocated, before, "an exclusively held tensor is added into");
    assert_eq!(sum.to_vec::<f64>().unwrap(), [1.5, 2.5]);
}

#[test]
fn permute_needs_every_dim_exactly_once() {
    let t = Tensor::zeros(&Device::cpu(), &[2, 3], DType::F32, Category::Activation).unwrap();
    assert_eq!(t.permute(&[1, 0]).unwrap().shape(), [3, 2]);
    for dims in [&[1][..], &[1, 0, 2], &[0, 0], &[0, 2]] {
        let err = t.permute(dims).unwrap_err();
        assert!(err.to_string().contains("is not a permutation of 2 dims"), "{dims:?}: {err}");
    }
}

#[test]
fn unsqueeze_takes_any_dim_up_to_the_rank() {
    let t = Tensor::zeros(&Device::cpu(), &[2, 3], DType::F32, Category::Activation).unwrap();
    assert_eq!(t.unsqueeze(0).unwrap().shape(), [1, 2, 3]);
    assert_eq!(t.unsqueeze(2).unwrap().shape(), [2, 3, 1], "after the last dim");
    let err = t.unsqueeze(3).unwrap_err();
    assert!(err.to_string().contains("unsqueeze: dim 3 out of range for rank 2"), "{err}");
}

#[test]
fn linear_needs_a_weight_of_rank_2() {
    let device = Device::cpu();
    let z = |shape: &[usize]| Tensor::zeros(&device, shape, DType::F64, Category::Activation).unwrap();
    for weight in [&[3][..], &[2, 3, 1]] {
        let err = ops::linear(&z(&[2, 3]), &z(weight), None).unwrap_err();
        assert!(err.to_string().contains("linear: input [2, 3], weight"), "{weight:?}: {err}");
    }
}

/// The fused layer norm + linear gives the layer norm's weight gradient when its bias needs none, and
/// the other way round: each is the same as when both are asked for.
#[test]
fn layer_norm_linear_gives_one_affine_gradient_without_the_other() {
    let device = Device::cpu();
    let x = Tensor::from_slice(&device, &[0.1, -0.4, 0.9, 0.3, 0.7, -0.2], &[2, 3], Category::Input).unwrap();
    let w = Tensor::from_slice(&device, &[0.5, -0.3, 0.2, 0.1, 0.4, -0.6], &[2, 3], Category::Parameter).unwrap();
    // With the weight frozen (column sums over the rows) and trained (sums from its product).
    for w in [w.clone(), w.clone().set_requires_grad(true)] {
        let run = |lw_grad: bool, lb_grad: bool| {
            let param = |v: &[f64], grad: bool| {
                Tensor::from_slice(&device, v, &[3], Category::Parameter).unwrap().set_requires_grad(grad)
            };
            let (lw, lb) = (param(&[1.2, 0.8, 1.1], lw_grad), param(&[0.1, -0.2, 0.05], lb_grad));
            let out = ops::layer_norm_linear(&x, &lw, &lb, 1e-5, &w, None).unwrap();
            backward(&out.mul(&out).unwrap().sum_all().unwrap()).unwrap();
            let grad = |t: &Tensor| t.grad().map(|g| g.to_vec::<f64>().unwrap());
            (grad(&lw), grad(&lb))
        };
        let (lw_both, lb_both) = run(true, true);
        assert!(lw_both.is_some() && lb_both.is_some());
        assert_eq!(run(true, false), (lw_both, None));
        assert_eq!(run(false, true), (None, lb_both));
    }
}

/// The fused layer norm + linear's layer-norm gradients, in f32 over more rows than one block: from
/// the weight-gradient product (weight trained) and from column sums over the rows (weight frozen),
/// both as the unfused layer norm and linear give them, to f32 rounding.
#[test]
fn layer_norm_linear_affine_gradients_agree_with_the_unfused_ops_whether_the_weight_trains_or_not() {
    let device = Device::cpu();
    let (rows, d, out) = (1100, 24, 40);
    let values = |n: usize, seed: u64| -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    };
    let t = |v: Vec<f64>, shape: &[usize], grad: bool| {
        let t = Tensor::from_slice(&device, &v, shape, Category::Parameter).unwrap().to_dtype(DType::F32).unwrap();
        t.set_requires_grad(grad)
    };
    let seed = t(values(rows * out, 5), &[rows, out], false);
    let run = |fused: bool, weight_grad: bool| {
        let x = t(values(rows * d, 1).iter().map(|v| v * 3.0 + 0.5).collect(), &[rows, d], true);
        let lw = t(values(d, 2).iter().map(|v| v + 1.5).collect(), &[d], true);
        let lb = t(values(d, 3), &[d], true);
        let w = t(values(out * d, 4), &[out, d], weight_grad);
        let b = t(values(out, 6), &[out], true);
        let y = if fused {
            ops::layer_norm_linear(&x, &lw, &lb, 1e-5, &w, Some(&b)).unwrap()
        } else {
            ops::linear(&ops::layer_norm(&x, &[d], Some(&lw), Some(&lb), 1e-5).unwrap(), &w, Some(&b)).unwrap()
        };
        backward(&y.mul(&seed).unwrap().sum_all().unwrap()).unwrap();
        let g = |t: &Tensor| t.grad().expect("gradient").to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
        [g(&lw), g(&lb), g(&x), g(&b)]
    };
    let want = run(false, true);
    for weight_grad in [true, false] {
        let got = run(true, weight_grad);
        for (i, name) in ["ln weight", "ln bias", "input", "bias"].iter().enumerate() {
            let scale = want[i].iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (g, w) in got[i].iter().zip(&want[i]) {
                assert!((g - w).abs() <= 1e-5 * scale, "{name} (weight grad {weight_grad}): {g} vs {w}");
            }
        }
    }
}

#[test]
fn batch_norm_refuses_either_running_statistic_strided() {
    let device = Device::cpu();
    let x = Tensor::from_slice(&device, &[0.1, -0.4, 0.9, 0.3, 0.7, -0.2, 0.5, 0.8], &[2, 2, 1, 2], Category::Input);
    let x = x.unwrap();
    let buffer = || Tensor::zeros(&device, &[2], DType::F64, Category::Parameter).unwrap();
    // A [1] value seen as [2]: stride 0, not a buffer of its own.
    let strided = || Tensor::full(&device, &[1], 1.0, DType::F64, Category::Parameter).unwrap().expand(&[2]).unwrap();
    for (mean, var) in [(buffer(), strided()), (strided(), buffer())] {
        let err = ops::batch_norm(&x, Some(&mean), Some(&var), None, None, true, 0.1, 1e-5).unwrap_err();
        assert!(err.to_string().contains("running statistics must be contiguous"), "{err}");
    }
    assert!(ops::batch_norm(&x, Some(&buffer()), Some(&buffer()), None, None, true, 0.1, 1e-5).is_ok());
}

/// Negation's gradient needs no saved tensor: its input stays what it was, not an activation.
#[test]
fn neg_saves_nothing() {
    let device = Device::cpu();
    let h = leaf(&device, &[1.0, 2.0]).mul_scalar(2.0).unwrap();
    let activations = || device.stats().by_category[Category::Activation.index()].current;
    let before = activations();
    let y = h.neg().unwrap();
    assert!(y.requires_grad());
    assert_eq!(activations(), before);
    assert_eq!(h.storage().category(), Category::Temporary);
}

#[test]
fn reshape_infers_a_dim_only_when_the_rest_divide_the_count() {
    let t = Tensor::zeros(&Device::cpu(), &[6], DType::F32, Category::Activation).unwrap();
    assert_eq!(t.reshape(&[2, -1]).unwrap().shape(), [2, 3]);
    let err = t.reshape(&[4, -1]).unwrap_err();
    assert!(err.to_string().contains("reshape: cannot reshape [6] into [4, -1]"), "{err}");
    let empty = Tensor::zeros(&Device::cpu(), &[0, 3], DType::F32, Category::Activation).unwrap();
    assert!(empty.reshape(&[0, -1]).unwrap_err().to_string().contains("cannot reshape"));
}

#[test]
fn conv2d_refuses_a_kernel_empty_in_either_dim() {
    let device = Device::cpu();
    let x = Tensor::zeros(&device, &[1, 1, 4, 4], DType::F32, Category::Input).unwrap();
    for kernel in [[3, 0], [0, 3]] {
        let w = Tensor::zeros(&device, &[1, 1, kernel[0], kernel[1]], DType::F32, Category::Parameter).unwrap();
        let err = ops::conv2d(&x, &w, None, ops::Conv2dParams::default()).unwrap_err();
        assert!(err.to_string().contains("has an empty kernel"), "{kernel:?}: {err}");
    }
}

#[test]
fn layer_norm_over_every_dim_of_its_input() {
    let device = Device::cpu();
    let x = constant(&device, &[1.0, 2.0, 3.0, 6.0]);
    let y = ops::layer_norm(&x, &[4], None, None, 0.0).unwrap().to_vec::<f64>().unwrap();
    // Mean 3, variance 3.5.
    let want = [-2.0, -1.0, 0.0, 3.0].map(|v: f64| v / 3.5f64.sqrt());
    assert!(y.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{y:?}");
}

/// The largest block `op` allocated on `device` so far, from its timeline.
fn largest_allocation(device: &Device, op: &str) -> Option<u64> {
    device.timeline_events().iter().filter(|e| e.kind == EventKind::Alloc && e.op == op).map(|e| e.bytes).max()
}

/// The fused layer norm + linear prepares its input a block of at most 512 rows at a time, in a
/// scratch as long as the block, not longer.
#[test]
fn layer_norm_linear_scratch_is_one_block_of_the_rows_there_are() {
    let device = Device::cpu();
    let x = Tensor::zeros(&device, &[3, 64], DType::F64, Category::Input).unwrap();
    let ln = Tensor::full(&device, &[64], 1.0, DType::F64, Category::Parameter).unwrap();
    let w = Tensor::zeros(&device, &[2, 64], DType::F64, Category::Parameter).unwrap();
    let out = ops::layer_norm_linear(&x, &ln, &ln, 1e-5, &w, None).unwrap();
    assert_eq!(out.shape(), [3, 2]);
    let largest = largest_allocation(&device, "layer_norm_linear");
    // The scratch: 3 rows of 64 f64 (1536 bytes); the output is smaller.
    assert_eq!(largest, Some(3 * 64 * 8));
}

#[test]
fn narrow_refuses_ranges_past_the_end_even_when_their_sum_overflows() {
    let t = Tensor::from_slice(&Device::cpu(), &[1.0f32, 2.0, 3.0], &[3], Category::Input).unwrap();
    assert_eq!(t.narrow(0, 1, 2).unwrap().to_vec::<f32>().unwrap(), [2.0, 3.0]);
    for (start, len) in [(1, 3), (4, 0), (usize::MAX, 2)] {
        let err = t.narrow(0, start, len).unwrap_err();
        assert!(err.to_string().contains("out of range for size 3"), "{start} + {len}: {err}");
    }
}

#[test]
fn class_losses_need_logits_of_rank_2() {
    let device = Device::cpu();
    let logits = Tensor::zeros(&device, &[2, 3, 4], DType::F32, Category::Activation).unwrap();
    let target = Tensor::from_slice(&device, &[0i64, 1], &[2], Category::Input).unwrap();
    let err = ops::cross_entropy(&logits, &target, 0.0).unwrap_err();
    assert!(err.to_string().contains("expected input [N, C] and target [N]"), "{err}");
    assert!(ops::nll_loss(&logits, &target).is_err());
}

/// With only the weight needing a gradient, the fused GELU + linear backward keeps one block of
/// GELU rows, not the second block a derivative needs when the input's gradient is wanted too.
#[test]
fn gelu_linear_backward_scratch_holds_the_derivative_only_when_needed() {
    let device = Device::cpu();
    let x = Tensor::full(&device, &[3, 64], 0.5, DType::F64, Category::Input).unwrap();
    let w = Tensor::full(&device, &[2, 64], 0.1, DType::F64, Category::Parameter).unwrap().set_requires_grad(true);
    let out = ops::gelu_linear(&x, &w, None).unwrap();
    backward(&out.sum_all().unwrap()).unwrap();
    let scratch = largest_allocation(&device, "gelu_linear_backward");
    // 3 rows of 64 f64; the weight gradient [2, 64] is smaller.
    assert_eq!(scratch, Some(3 * 64 * 8));
}

/// `count_equal` counts equal int64 elements of any layout (a transposed view too) into a 0-d
/// int64 tensor; other dtypes and shapes are refused, naming both.
#[test]
fn count_equal_counts_equal_elements_and_refuses_other_dtypes_or_shapes() {
    let device = Device::cpu();
    let a = Tensor::from_slice(&device, &[1i64, 2, 3, 4, 5, 6], &[2, 3], Category::Input).unwrap();
    let b = Tensor::from_slice(&device, &[1i64, 0, 3, 4, 0, 6], &[2, 3], Category::Input).unwrap();
    let c = a.count_equal(&b).unwrap();
    assert_eq!((c.shape().to_vec(), c.dtype(), c.item().unwrap()), (vec![], DType::I64, 4.0));
    let at =
        Tensor::from_slice(&device, &[1i64, 4, 2, 5, 3, 6], &[3, 2], Category::Input).unwrap().transpose(0, 1).unwrap();
    assert_eq!(at.count_equal(&a).unwrap().item().unwrap(), 6.0);
    let f = Tensor::from_slice(&device, &[1f32; 6], &[2, 3], Category::Input).unwrap();
    assert!(f.count_equal(&f).unwrap_err().to_string().contains("int64"));
    let short = Tensor::from_slice(&device, &[1i64; 3], &[3], Category::Input).unwrap();
    assert!(a.count_equal(&short).unwrap_err().to_string().contains("[3]"));
}

/// `count_up` adds one to every element of an int64 tensor in place and refuses other dtypes.
#[test]
fn count_up_adds_one_in_place_and_refuses_other_dtypes() {
    let device = Device::cpu();
    let t = Tensor::from_slice(&device, &[3i64, -1, 0], &[3], Category::Other).unwrap();
    t.count_up().unwrap();
    t.count_up().unwrap();
    assert_eq!(t.to_vec::<i64>().unwrap(), vec![5, 1, 2]);
    let f = Tensor::from_slice(&device, &[1f32], &[1], Category::Other).unwrap();
    assert!(f.count_up().unwrap_err().to_string().contains("int64"));
}
