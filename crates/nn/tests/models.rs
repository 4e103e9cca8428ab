//! Model-zoo tests: PyTorch `state_dict` names and shapes (against torch_models.py and the golden
//! manifest), forward shapes, a training step reaching every parameter, seeded initialization,
//! safetensors checkpoints (round trip, PyTorch files, corrupt/truncated/mismatched files), spec
//! validation, and SimpleCNN / GPT logits, loss and gradients against the golden PyTorch values.

use memfit_nn::checkpoint;
use memfit_nn::models::GptConfig;
use memfit_nn::{build_model, Model, ModelKind, ModelSpec};
use memfit_tensor::autograd::backward;
use memfit_tensor::ops::cross_entropy;
use memfit_tensor::{Category, DType, Device, Result, Tensor};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden");
const MODEL_RTOL: f64 = 1e-4;

fn tiny_gpt() -> GptConfig {
    GptConfig { vocab: 11, d_model: 16, heads: 2, layers: 2, max_t: 6 }
}

fn gpt_spec(config: GptConfig) -> ModelSpec {
    ModelSpec { kind: ModelKind::Gpt, input: [0, 0, 0], num_classes: 0, gpt: config, exported: None }
}

fn shapes(named: &[(String, Tensor)]) -> Vec<(String, Vec<usize>)> {
    named.iter().map(|(n, t)| (n.clone(), t.shape().to_vec())).collect()
}

fn expect(list: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
    list.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect()
}

/// A unique scratch path for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-nn-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Deterministic pseudo-random f32 values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = memfit_data::Rng::new(seed);
    (0..n).map(|_| rng.uniform_f32(-1.0, 1.0)).collect()
}

fn image_batch(dev: &Device, n: usize, input: [usize; 3], seed: u64) -> Tensor {
    let numel = n * input.iter().product::<usize>();
    Tensor::from_slice(dev, &values(numel, seed), &[n, input[0], input[1], input[2]], Category::Input).unwrap()
}

fn labels(dev: &Device, shape: &[usize], classes: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<i64> = (0..n).map(|i| ((i * 7 + 3) % classes) as i64).collect();
    Tensor::from_slice(dev, &v, shape, Category::Input).unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

/// `|got - ref| <= rtol |ref| + rtol max|ref|` elementwise (the golden README's rule).
fn assert_close(what: &str, got: &[f32], reference: &[f32], rtol: f64) {
    assert_eq!(got.len(), reference.len(), "{what}: length");
    let max = reference.iter().fold(0f64, |m, v| m.max((*v as f64).abs()));
    for (i, (g, r)) in got.iter().zip(reference).enumerate() {
        let (g, r) = (*g as f64, *r as f64);
        assert!((g - r).abs() <= rtol * r.abs() + rtol * max, "{what}[{i}]: got {g}, reference {r}");
    }
}

// ---------------------------------------------------------------- golden file access (safetensors)

struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn open(file: &str) -> Golden {
        let path = Path::new(GOLDEN).join(file);
        Golden { bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) }
    }

    fn shape(&self, key: &str) -> Vec<usize> {
        SafeTensors::deserialize(&self.bytes).unwrap().tensor(key).unwrap().shape().to_vec()
    }

    fn f32(&self, key: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let v = st.tensor(key).unwrap_or_else(|_| panic!("golden key {key}"));
        assert_eq!(v.dtype(), safetensors::Dtype::F32, "{key}");
        v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn i64(&self, key: &str) -> (Vec<i64>, Vec<usize>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let v = st.tensor(key).unwrap();
        assert_eq!(v.dtype(), safetensors::Dtype::I64, "{key}");
        (v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(), v.shape().to_vec())
    }

    /// Copies `<case>/init/<name>` into every f32 parameter of the model.
    fn load_params(&self, case: &str, model: &dyn Model) {
        let dev = model.parameters()[0].1.device().clone();
        for (name, p) in model.parameters() {
            let key = format!("{case}/init/{name}");
            let src = Tensor::from_slice(&dev, &self.f32(&key), &self.shape(&key), Category::Other).unwrap();
            p.copy_from(&src).unwrap();
        }
    }
}

/// The `param_init` tensors of a golden case in the manifest's (PyTorch `state_dict`) order, as
/// (name, shape), with the shapes checked against the safetensors file.
fn golden_state_dict(file: &str, case: &str) -> Vec<(String, Vec<usize>)> {
    let text = std::fs::read_to_string(Path::new(GOLDEN).join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = manifest["cases"].as_array().unwrap().iter().find(|c| c["name"] == case).expect("golden case");
    let golden = Golden::open(file);
    let mut out = Vec::new();
    for t in case["tensors"].as_array().unwrap() {
        if t["role"] == "param_init" {
            let shape: Vec<usize> =
                t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            assert_eq!(golden.shape(t["key"].as_str().unwrap()), shape);
            out.push((t["param"].as_str().unwrap().to_string(), shape));
        }
    }
    out
}

// ---------------------------------------------------------------- names and shapes

#[test]
fn mlp_names_match_nn_sequential() {
    let m = build_model(&ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10), &Device::cpu(), 0).unwrap();
    assert_eq!(m.kind(), ModelKind::Mlp);
    assert_eq!(
        shapes(&m.parameters()),
        expect(&[
            ("0.weight", &[1024, 784]),
            ("0.bias", &[1024]),
            ("2.weight", &[1024, 1024]),
            ("2.bias", &[1024]),
            ("4.weight", &[10, 1024]),
            ("4.bias", &[10]),
        ])
    );
    assert!(m.buffers().is_empty());
    let rgb = build_model(&ModelSpec::image(ModelKind::Mlp, [3, 8, 8], 4), &Device::cpu(), 0).unwrap();
    assert_eq!(rgb.parameters()[0].1.shape(), [1024, 192]);
    assert_eq!(rgb.parameters()[5].1.shape(), [4]);
}

#[test]
fn simplecnn_names_match_torch_models_and_golden_manifest() {
    let m = build_model(&ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10), &Device::cpu(), 0).unwrap();
    let want = expect(&[
        ("conv1.weight", &[16, 1, 3, 3]),
        ("conv1.bias", &[16]),
        ("fc.weight", &[10, 16 * 14 * 14]),
        ("fc.bias", &[10]),
    ]);
    assert_eq!(shapes(&m.parameters()), want);
    assert_eq!(golden_state_dict("model_simplecnn.safetensors", "simplecnn_adamw"), want);
    assert!(m.buffers().is_empty());
    // Odd sizes floor: 3x15x9 -> 16 * 7 * 4.
    let odd = build_model(&ModelSpec::image(ModelKind::SimpleCnn, [3, 15, 9], 5), &Device::cpu(), 0).unwrap();
    assert_eq!(odd.parameters()[0].1.shape(), [16, 3, 3, 3]);
    assert_eq!(odd.parameters()[2].1.shape(), [5, 16 * 7 * 4]);
}

#[test]
fn deepcnn_fc_is_sized_from_the_input() {
    let m = build_model(&ModelSpec::image(ModelKind::DeepCnn, [3, 64, 64], 10), &Device::cpu(), 0).unwrap();
    assert_eq!(
        shapes(&m.parameters()),
        expect(&[
            ("c1.weight", &[32, 3, 3, 3]),
            ("c1.bias", &[32]),
            ("c2.weight", &[64, 32, 3, 3]),
            ("c2.bias", &[64]),
            ("c3.weight", &[128, 64, 3, 3]),
            ("c3.bias", &[128]),
            ("fc.weight", &[10, 8192]),
            ("fc.bias", &[10]),
        ])
    );
    let mnist = build_model(&ModelSpec::image(ModelKind::DeepCnn, [1, 28, 28], 10), &Device::cpu(), 0).unwrap();
    assert_eq!(mnist.parameters()[0].1.shape(), [32, 1, 3, 3]);
    assert_eq!(mnist.parameters()[6].1.shape(), [10, 128 * 3 * 3]);
    let small = build_model(&ModelSpec::image(ModelKind::DeepCnn, [1, 8, 9], 2), &Device::cpu(), 0).unwrap();
    assert_eq!(small.parameters()[6].1.shape(), [2, 128]);
}

#[test]
fn resnet_uses_torchvision_names() {
    let m = build_model(&ModelSpec::image(ModelKind::ResNet, [3, 32, 32], 10), &Device::cpu(), 0).unwrap();
    let bn = |p: &str, c: usize| -> Vec<(String, Vec<usize>)> {
        vec![(format!("{p}.weight"), vec![c]), (format!("{p}.bias"), vec![c])]
    };
    let mut want = vec![("conv1.weight".to_string(), vec![16, 3, 3, 3])];
    want.extend(bn("bn1", 16));
    want.push(("layer1.0.conv1.weight".into(), vec![16, 16, 3, 3]));
    want.extend(bn("layer1.0.bn1", 16));
    want.push(("layer1.0.conv2.weight".into(), vec![16, 16, 3, 3]));
    want.extend(bn("layer1.0.bn2", 16));
    for (stage, cin, c) in [(2, 16, 32), (3, 32, 64)] {
        want.push((format!("layer{stage}.0.conv1.weight"), vec![c, cin, 3, 3]));
        want.extend(bn(&format!("layer{stage}.0.bn1"), c));
        want.push((format!("layer{stage}.0.conv2.weight"), vec![c, c, 3, 3]));
        want.extend(bn(&format!("layer{stage}.0.bn2"), c));
        want.push((format!("layer{stage}.0.downsample.0.weight"), vec![c, cin, 1, 1]));
        want.extend(bn(&format!("layer{stage}.0.downsample.1"), c));
    }
    want.push(("fc.weight".into(), vec![10, 64]));
    want.push(("fc.bias".into(), vec![10]));
    assert_eq!(shapes(&m.parameters()), want);

    let buffers = m.buffers();
    let bn_prefixes: Vec<String> =
        want.iter().filter_map(|(n, _)| n.strip_suffix(".bias").filter(|p| *p != "fc").map(str::to_string)).collect();
    let mut want_buffers = Vec::new();
    for p in &bn_prefixes {
        let c = want.iter().find(|(n, _)| *n == format!("{p}.bias")).unwrap().1.clone();
        want_buffers.push((format!("{p}.running_mean"), c.clone()));
        want_buffers.push((format!("{p}.running_var"), c));
        want_buffers.push((format!("{p}.num_batches_tracked"), vec![]));
    }
    assert_eq!(shapes(&buffers), want_buffers);
    for (name, t) in &buffers {
        let want_dtype = if name.ends_with("num_batches_tracked") { DType::I64 } else { DType::F32 };
        assert_eq!(t.dtype(), want_dtype, "{name}");
        assert!(!t.requires_grad(), "{name}");
        assert_eq!(t.storage().category(), Category::Other, "{name}");
    }
}

#[test]
fn gpt_names_match_the_golden_state_dict() {
    let m = build_model(&gpt_spec(tiny_gpt()), &Device::cpu(), 0).unwrap();
    let golden = golden_state_dict("model_gpt.safetensors", "gpt_tiny_adamw");
    let (mask, params): (Vec<_>, Vec<_>) = golden.into_iter().partition(|(n, _)| n == "mask");
    assert_eq!(shapes(&m.parameters()), params);
    assert_eq!(shapes(&m.buffers()), mask);
    assert_eq!(m.buffers()[0].1.dtype(), DType::Bool);
    // The default configuration of torch_models.py's GPT.
    let big = build_model(&gpt_spec(GptConfig::default()), &Device::meta(), 0).unwrap();
    let n: usize = big.parameters().iter().map(|(_, t)| t.numel()).sum();
    let (v, d, l, t) = (96, 256, 4, 128);
    let per_block = 2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d + 4 * d * d + 4 * d + 4 * d * d + d;
    assert_eq!(n, v * d + t * d + l * per_block + 2 * d + d * v + v);
}

#[test]
fn parameters_and_buffers_are_allocated_in_their_categories() {
    for kind in ModelKind::ALL {
        let spec = if kind == ModelKind::Gpt { gpt_spec(tiny_gpt()) } else { ModelSpec::image(kind, [1, 28, 28], 10) };
        let dev = Device::cpu();
        let m = build_model(&spec, &dev, 1).unwrap();
        for (name, p) in m.parameters() {
            assert!(p.requires_grad() && p.is_leaf(), "{} {name}", kind.name());
            assert_eq!(p.dtype(), DType::F32);
            assert_eq!(p.storage().category(), Category::Parameter, "{} {name}", kind.name());
        }
        let param_bytes: usize = m.parameters().iter().map(|(_, t)| t.numel() * 4).sum();
        let buffer_bytes: usize = m.buffers().iter().map(|(_, t)| t.numel() * t.dtype().size()).sum();
        let stats = dev.stats();
        // Categories count allocated (rounded-up) block sizes; requested bytes are exact.
        let (n_params, n_buffers) = (m.parameters().len() as u64, m.buffers().len() as u64);
        let in_params = stats.category(Category::Parameter).current;
        let in_other = stats.category(Category::Other).current;
        assert!(in_params >= param_bytes as u64 && in_params < param_bytes as u64 + 512 * n_params, "{}", kind.name());
        assert!(
            in_other >= buffer_bytes as u64 && in_other < buffer_bytes as u64 + 512 * n_buffers.max(1),
            "{}",
            kind.name()
        );
        assert_eq!(
            in_params + in_other,
            stats.allocated_bytes.current,
            "{}: nothing else stays allocated",
            kind.name()
        );
        assert_eq!(stats.requested_bytes.current, (param_bytes + buffer_bytes) as u64, "{}", kind.name());
    }
}

// ---------------------------------------------------------------- initialization

#[test]
fn init_follows_pytorch_defaults_and_is_seeded() {
    let dev = Device::cpu();
    let spec = ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10);
    let a = build_model(&spec, &dev, 7).unwrap();
    let b = build_model(&spec, &dev, 7).unwrap();
    let c = build_model(&spec, &dev, 8).unwrap();
    for ((name, pa), ((_, pb), (_, pc))) in a.parameters().iter().zip(b.parameters().iter().zip(c.parameters().iter()))
    {
        assert_eq!(f32s(pa), f32s(pb), "{name}: same seed, same values");
        assert_ne!(f32s(pa), f32s(pc), "{name}: another seed, other values");
    }
    // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases.
    for (name, p) in a.parameters() {
        let fan_in = if name.starts_with("conv1") { 9.0f32 } else { 3136.0 };
        let bound = 1.0 / fan_in.sqrt();
        let v = f32s(&p);
        assert!(v.iter().all(|x| x.abs() <= bound), "{name}");
        if v.len() > 100 {
            assert!(v.iter().any(|x| x.abs() > 0.9 * bound), "{name} should fill its range");
        }
    }
    // Distinct tensors get distinct streams (no two parameters share values).
    let p = a.parameters();
    assert_ne!(f32s(&p[1].1)[..10], f32s(&p[2].1)[..10]);
}

#[test]
fn init_does_not_depend_on_construction_order() {
    use memfit_nn::init::Initializer;
    use memfit_nn::layers::{Linear, Module};
    let dev = Device::cpu();
    let init = Initializer::new(&dev, 3);
    let first = Linear::new(&init, "fc", 20, 5, true).unwrap();
    let init = Initializer::new(&dev, 3);
    let _other = Linear::new(&init, "head", 7, 7, true).unwrap();
    let second = Linear::new(&init, "fc", 20, 5, true).unwrap();
    for ((n, a), (_, b)) in first.parameters().iter().zip(second.parameters().iter()) {
        assert_eq!(f32s(a), f32s(b), "{n}");
    }
}

#[test]
fn gpt_init_follows_pytorch_modules() {
    let m = build_model(&gpt_spec(tiny_gpt()), &Device::cpu(), 5).unwrap();
    let params = m.parameters();
    let get = |name: &str| f32s(&params.iter().find(|(n, _)| n == name).unwrap().1);
    let tok = get("tok.weight");
    let mean = tok.iter().map(|&v| v as f64).sum::<f64>() / tok.len() as f64;
    let std = (tok.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / tok.len() as f64).sqrt();
    assert!(mean.abs() < 0.25 && (std - 1.0).abs() < 0.25, "tok ~ N(0,1): mean {mean}, std {std}");
    assert!(tok.iter().any(|v| v.abs() > 1.0), "normal, not uniform");
    assert_eq!(get("blocks.0.ln1.weight"), vec![1.0; 16]);
    assert_eq!(get("blocks.0.ln1.bias"), vec![0.0; 16]);
    assert_eq!(get("blocks.1.attn.in_proj_bias"), vec![0.0; 48]);
    assert_eq!(get("blocks.1.attn.out_proj.bias"), vec![0.0; 16]);
    let xavier = (6.0f32 / 64.0).sqrt();
    assert!(get("blocks.0.attn.in_proj_weight").iter().all(|v| v.abs() <= xavier));
    assert!(get("blocks.0.mlp.2.weight").iter().all(|v| v.abs() <= 0.125), "fan_in 64");
    let mask = m.buffers()[0].1.to_vec::<bool>().unwrap();
    for i in 0..6 {
        for j in 0..6 {
            assert_eq!(mask[i * 6 + j], j > i, "mask[{i}][{j}]");
        }
    }
}

// ---------------------------------------------------------------- validation

#[test]
fn specs_are_validated_with_clear_errors() {
    let dev = Device::cpu();
    let err = |spec: ModelSpec| build_model(&spec, &dev, 0).err().expect("should fail").to_string();
    let e = err(ModelSpec::image(ModelKind::DeepCnn, [1, 7, 28], 10));
    assert!(e.contains("deepcnn") && e.contains("too small") && e.contains("pooling stage 3"), "{e}");
    let e = err(ModelSpec::image(ModelKind::SimpleCnn, [1, 1, 28], 10));
    assert!(e.contains("simplecnn") && e.contains("too small"), "{e}");
    let e = err(ModelSpec::image(ModelKind::Mlp, [1, 0, 28], 10));
    assert!(e.contains("positive"), "{e}");
    let e = err(ModelSpec::image(ModelKind::ResNet, [3, 32, 32], 0));
    assert!(e.contains("num_classes"), "{e}");
    let e = err(gpt_spec(GptConfig { heads: 3, ..tiny_gpt() }));
    assert!(e.contains("divisible"), "{e}");
    let e = err(gpt_spec(GptConfig { max_t: 0, ..tiny_gpt() }));
    assert!(e.contains("max_t"), "{e}");
}

#[test]
fn forward_rejects_inputs_of_the_wrong_shape() {
    let dev = Device::cpu();
    let m = build_model(&ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10), &dev, 0).unwrap();
    let e = m.forward(&image_batch(&dev, 2, [1, 28, 27], 0), true).unwrap_err().to_string();
    assert!(e.contains("mlp was built for inputs [N, 1, 28, 28]") && e.contains("[2, 1, 28, 27]"), "{e}");
    let g = build_model(&gpt_spec(tiny_gpt()), &dev, 0).unwrap();
    let e = g.forward(&labels(&dev, &[2, 7], 11), true).unwrap_err().to_string();
    assert!(e.contains("max_t 6"), "{e}");
    let e = g.forward(&image_batch(&dev, 1, [1, 2, 3], 0), true).unwrap_err().to_string();
    assert!(e.contains("int64"), "{e}");
}

// ---------------------------------------------------------------- forward and training

fn image_specs() -> Vec<(ModelSpec, usize)> {
    vec![
        (ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10), 4),
        (ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10), 3),
        (ModelSpec::image(ModelKind::DeepCnn, [3, 16, 20], 7), 2),
        (ModelSpec::image(ModelKind::ResNet, [1, 28, 28], 10), 2),
        (ModelSpec::image(ModelKind::ResNet, [3, 32, 32], 5), 2),
    ]
}

/// Forward in training mode, mean cross-entropy, backward: every parameter gets a finite gradient
/// of its own shape, and nothing else changes.
fn training_step(model: &dyn Model, x: &Tensor, target: &Tensor) -> Result<Tensor> {
    let logits = model.forward(x, true)?;
    let classes = *logits.shape().last().unwrap();
    let loss = cross_entropy(&logits.reshape(&[-1, classes as isize])?, &target.reshape(&[-1])?, 0.0)?;
    backward(&loss)?;
    Ok(loss)
}

#[test]
fn image_models_forward_shapes_and_gradients() {
    for (spec, n) in image_specs() {
        let dev = Device::cpu();
        let m = build_model(&spec, &dev, 11).unwrap();
        let x = image_batch(&dev, n, spec.input, 1);
        let eval = m.forward(&x, false).unwrap();
        assert_eq!(eval.shape(), [n, spec.num_classes], "{spec:?}");
        assert!(f32s(&eval).iter().all(|v| v.is_finite()));
        let loss = training_step(m.as_ref(), &x, &labels(&dev, &[n], spec.num_classes)).unwrap().item().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{spec:?}: loss {loss}");
        for (name, p) in m.parameters() {
            let g = p.grad().unwrap_or_else(|| panic!("{spec:?}: no gradient for {name}"));
            assert_eq!(g.shape(), p.shape(), "{name}");
            let gv = f32s(&g);
            assert!(gv.iter().all(|v| v.is_finite()), "{name}");
            assert!(gv.iter().any(|&v| v != 0.0), "{spec:?}: {name} gradient is all zero");
        }
    }
}

#[test]
fn gpt_forward_shapes_and_gradients() {
    let dev = Device::cpu();
    let m = build_model(&gpt_spec(tiny_gpt()), &dev, 2).unwrap();
    for t in [6, 4] {
        let tokens = labels(&dev, &[3, t], 11);
        let logits = m.forward(&tokens, false).unwrap();
        assert_eq!(logits.shape(), [3, t, 11]);
    }
    let tokens = labels(&dev, &[2, 5], 11);
    let target = labels(&dev, &[2, 5], 7);
    let loss = training_step(m.as_ref(), &tokens, &target).unwrap().item().unwrap();
    assert!(loss.is_finite());
    for (name, p) in m.parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(g.shape(), p.shape(), "{name}");
        let gv = f32s(&g);
        assert!(gv.iter().all(|v| v.is_finite()), "{name}");
        if name == "pos.weight" {
            // Only the first 5 of 6 positions were used: the last row gets exactly zero.
            assert!(gv[5 * 16..].iter().all(|&v| v == 0.0));
            assert!(gv[..5 * 16].iter().any(|&v| v != 0.0));
        } else {
            assert!(gv.iter().any(|&v| v != 0.0), "{name} gradient is all zero");
        }
    }
}

#[test]
fn gpt_logits_are_causal() {
    let dev = Device::cpu();
    let m = build_model(&gpt_spec(tiny_gpt()), &dev, 4).unwrap();
    let a = Tensor::from_slice(&dev, &[1i64, 2, 3, 4, 5, 6], &[1, 6], Category::Input).unwrap();
    let b = Tensor::from_slice(&dev, &[1i64, 2, 3, 9, 0, 10], &[1, 6], Category::Input).unwrap();
    let (la, lb) = (f32s(&m.forward(&a, false).unwrap()), f32s(&m.forward(&b, false).unwrap()));
    assert_eq!(la[..3 * 11], lb[..3 * 11], "positions before the change see the same prefix");
    assert_ne!(la[3 * 11..4 * 11], lb[3 * 11..4 * 11]);
}

#[test]
fn batchnorm_running_stats_update_only_in_training() {
    let dev = Device::cpu();
    let spec = ModelSpec::image(ModelKind::ResNet, [1, 28, 28], 10);
    let m = build_model(&spec, &dev, 0).unwrap();
    let x = image_batch(&dev, 2, spec.input, 9);
    let get = |name: &str| m.buffers().into_iter().find(|(n, _)| n == name).unwrap().1;
    let before = f32s(&get("bn1.running_mean"));
    m.forward(&x, false).unwrap();
    assert_eq!(f32s(&get("bn1.running_mean")), before, "eval leaves running stats alone");
    assert_eq!(get("bn1.num_batches_tracked").to_vec::<i64>().unwrap(), [0]);
    m.forward(&x, true).unwrap();
    m.forward(&x, true).unwrap();
    assert_ne!(f32s(&get("bn1.running_mean")), before);
    assert_ne!(f32s(&get("layer3.0.downsample.1.running_var")), vec![1.0; 64]);
    for (name, t) in m.buffers() {
        if name.ends_with("num_batches_tracked") {
            assert_eq!(t.to_vec::<i64>().unwrap(), [2], "{name}");
        }
    }
}

#[test]
fn meta_models_allocate_like_cpu_models() {
    for (spec, n) in image_specs().into_iter().chain([(gpt_spec(tiny_gpt()), 2)]) {
        let (cpu, meta) = (Device::cpu(), Device::meta());
        let mut shapes_seen = Vec::new();
        for dev in [&cpu, &meta] {
            let m = build_model(&spec, dev, 3).unwrap();
            let (x, y) = if spec.kind == ModelKind::Gpt {
                let t = Tensor::zeros(dev, &[n, 6], DType::I64, Category::Input).unwrap();
                (t.clone(), t)
            } else {
                let x =
                    Tensor::zeros(dev, &[n, spec.input[0], spec.input[1], spec.input[2]], DType::F32, Category::Input)
                        .unwrap();
                (x, Tensor::zeros(dev, &[n], DType::I64, Category::Input).unwrap())
            };
            training_step(m.as_ref(), &x, &y).unwrap();
            shapes_seen
                .push(m.parameters().iter().map(|(_, p)| p.grad().unwrap().shape().to_vec()).collect::<Vec<_>>());
        }
        assert_eq!(shapes_seen[0], shapes_seen[1]);
        let (c, m) = (cpu.stats(), meta.stats());
        assert_eq!(c.requested_bytes.allocated, m.requested_bytes.allocated, "{spec:?}");
        assert_eq!(c.requested_bytes.peak, m.requested_bytes.peak, "{spec:?}");
        assert_eq!(c.allocation.allocated, m.allocation.allocated, "{spec:?}");
    }
}

// ---------------------------------------------------------------- checkpoints

#[test]
fn checkpoint_round_trip_restores_parameters_buffers_and_logits() {
    for (spec, n) in image_specs().into_iter().chain([(gpt_spec(tiny_gpt()), 2)]) {
        let dev = Device::cpu();
        let a = build_model(&spec, &dev, 21).unwrap();
        let x =
            if spec.kind == ModelKind::Gpt { labels(&dev, &[n, 6], 11) } else { image_batch(&dev, n, spec.input, 5) };
        a.forward(&x, true).unwrap(); // moves batch-norm running statistics away from their init
        let path = scratch(&format!("roundtrip-{}.safetensors", spec.kind.name()));
        checkpoint::save(&path, a.as_ref()).unwrap();
        let b = build_model(&spec, &dev, 22).unwrap();
        assert_ne!(f32s(&a.parameters()[0].1), f32s(&b.parameters()[0].1));
        checkpoint::load(&path, b.as_ref()).unwrap();
        for ((name, ta), (_, tb)) in
            checkpoint::state_dict(a.as_ref()).iter().zip(checkpoint::state_dict(b.as_ref()).iter())
        {
            assert_eq!(ta.dtype(), tb.dtype(), "{name}");
            assert_eq!(ta.to_f64_vec().unwrap(), tb.to_f64_vec().unwrap(), "{name}");
        }
        assert_eq!(f32s(&a.forward(&x, false).unwrap()), f32s(&b.forward(&x, false).unwrap()), "{spec:?}");
        let meta = checkpoint::read_metadata(&path).unwrap().unwrap();
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn checkpoint_files_are_plain_safetensors_with_state_dict_names() {
    let dev = Device::cpu();
    let spec = ModelSpec::image(ModelKind::ResNet, [1, 28, 28], 10);
    let m = build_model(&spec, &dev, 1).unwrap();
    let path = scratch("plain.safetensors");
    checkpoint::save(&path, m.as_ref()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), m.parameters().len() + m.buffers().len());
    let nbt = st.tensor("layer2.0.downsample.1.num_batches_tracked").unwrap();
    assert_eq!((nbt.dtype(), nbt.shape()), (safetensors::Dtype::I64, &[][..]));
    let w = st.tensor("conv1.weight").unwrap();
    assert_eq!((w.dtype(), w.shape()), (safetensors::Dtype::F32, &[16, 1, 3, 3][..]));
    let want: Vec<u8> = f32s(&m.parameters()[0].1).iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(w.data(), &want[..]);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn pytorch_state_dict_files_load() {
    // The golden file was written by safetensors.torch from PyTorch tensors: rebuild a plain
    // state_dict file (f32 parameters + the bool mask) from it and load it strictly into a GPT.
    let dev = Device::cpu();
    let all = checkpoint::load_named(Path::new(GOLDEN).join("model_gpt.safetensors"), &dev, Category::Other).unwrap();
    let state: Vec<(String, Tensor)> = all
        .iter()
        .filter_map(|(n, t)| n.strip_prefix("gpt_tiny_adamw/init/").map(|n| (n.to_string(), t.clone())))
        .collect();
    assert_eq!(state.len(), 1 + 2 + 2 * 12 + 4);
    let path = scratch("torch-state-dict.safetensors");
    checkpoint::save_tensors(&path, &state, None).unwrap();
    let m = build_model(&gpt_spec(tiny_gpt()), &dev, 99).unwrap();
    checkpoint::load(&path, m.as_ref()).unwrap();
    for (name, t) in checkpoint::state_dict(m.as_ref()) {
        let src = &state.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(t.to_f64_vec().unwrap(), src.to_f64_vec().unwrap(), "{name}");
    }
    std::fs::remove_file(&path).unwrap();
}

fn params_snapshot(m: &dyn Model) -> Vec<Vec<f64>> {
    checkpoint::state_dict(m).iter().map(|(_, t)| t.to_f64_vec().unwrap()).collect()
}

#[test]
fn bad_checkpoints_are_clear_errors_and_leave_the_model_unchanged() {
    let dev = Device::cpu();
    let spec = ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10);
    let source = build_model(&spec, &dev, 1).unwrap();
    let good = scratch("good.safetensors");
    checkpoint::save(&good, source.as_ref()).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let target = build_model(&spec, &dev, 2).unwrap();
    let before = params_snapshot(target.as_ref());
    let try_load = |name: &str, content: &[u8]| -> String {
        let path = scratch(name);
        std::fs::write(&path, content).unwrap();
        let e = checkpoint::load(&path, target.as_ref()).err().expect("load should fail").to_string();
        assert!(e.contains(&path.display().to_string()), "error should name the file: {e}");
        std::fs::remove_file(&path).unwrap();
        e
    };
    let e = try_load("truncated.safetensors", &bytes[..bytes.len() - 100]);
    assert!(e.contains("truncated"), "{e}");
    let e = try_load("short.safetensors", &bytes[..5]);
    assert!(e.contains("truncated"), "{e}");
    let e = try_load("empty.safetensors", &[]);
    assert!(e.contains("not a valid safetensors file"), "{e}");
    let mut garbage = bytes.clone();
    garbage[8..40].copy_from_slice(&[0xff; 32]);
    let e = try_load("garbage.safetensors", &garbage);
    assert!(e.contains("not a valid safetensors file"), "{e}");
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    try_load("huge-header.safetensors", &huge);
    let e = checkpoint::load(scratch("does-not-exist.safetensors"), target.as_ref()).unwrap_err().to_string();
    assert!(e.contains("cannot read checkpoint"), "{e}");

    // A checkpoint of another input size: fc.weight has another shape.
    let other = build_model(&ModelSpec::image(ModelKind::SimpleCnn, [1, 32, 32], 10), &dev, 1).unwrap();
    let wrong = scratch("wrong-shape.safetensors");
    checkpoint::save(&wrong, other.as_ref()).unwrap();
    let e = checkpoint::load(&wrong, target.as_ref()).unwrap_err().to_string();
    assert!(e.contains("fc.weight: the file has [10, 4096] f32, the model expects [10, 3136] f32"), "{e}");

    // Missing and unexpected names.
    let mut partial = checkpoint::state_dict(source.as_ref());
    partial.retain(|(n, _)| n != "conv1.bias");
    partial.push(("extra.weight".into(), source.parameters()[1].1.clone()));
    let odd = scratch("missing.safetensors");
    checkpoint::save_tensors(&odd, &partial, None).unwrap();
    let e = checkpoint::load(&odd, target.as_ref()).unwrap_err().to_string();
    assert!(e.contains("conv1.bias: missing (expected [16] f32)"), "{e}");
    assert!(e.contains("extra.weight: unexpected"), "{e}");
    // Non-strict loading ignores the extra name but still needs every target.
    let e = checkpoint::load_into(&odd, &checkpoint::state_dict(target.as_ref()), false).unwrap_err().to_string();
    assert!(e.contains("conv1.bias: missing") && !e.contains("extra.weight"), "{e}");

    // Wrong dtype.
    let as_f64 = Tensor::from_slice(&dev, &vec![0.5f64; 16], &[16], Category::Other).unwrap();
    let mut typed = checkpoint::state_dict(source.as_ref());
    typed[1].1 = as_f64;
    checkpoint::save_tensors(&odd, &typed, None).unwrap();
    let e = checkpoint::load(&odd, target.as_ref()).unwrap_err().to_string();
    assert!(e.contains("conv1.bias: the file has [16] f64, the model expects [16] f32"), "{e}");

    assert_eq!(params_snapshot(target.as_ref()), before, "failed loads must not change the model");
    checkpoint::load(&good, target.as_ref()).unwrap();
    assert_eq!(params_snapshot(target.as_ref()), params_snapshot(source.as_ref()));
    for p in [good, wrong, odd] {
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn corrupt_bool_bytes_are_rejected() {
    let dev = Device::cpu();
    let m = build_model(&gpt_spec(tiny_gpt()), &dev, 0).unwrap();
    let path = scratch("bad-bool.safetensors");
    checkpoint::save(&path, m.as_ref()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let start = 8 + n + meta.info("mask").unwrap().data_offsets.0;
    bytes[start] = 7;
    std::fs::write(&path, &bytes).unwrap();
    let e = checkpoint::load(&path, m.as_ref()).unwrap_err().to_string();
    assert!(e.contains("mask") && e.contains("corrupt"), "{e}");
    let e = checkpoint::load_named(&path, &dev, Category::Other).unwrap_err().to_string();
    assert!(e.contains("mask") && e.contains("corrupt"), "{e}");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn meta_models_cannot_be_saved_but_can_check_a_checkpoint() {
    let spec = ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10);
    let on_meta = build_model(&spec, &Device::meta(), 0).unwrap();
    let path = scratch("meta.safetensors");
    let e = checkpoint::save(&path, on_meta.as_ref()).unwrap_err().to_string();
    assert!(e.contains("meta"), "{e}");
    assert!(!path.exists());
    checkpoint::save(&path, build_model(&spec, &Device::cpu(), 0).unwrap().as_ref()).unwrap();
    checkpoint::load(&path, on_meta.as_ref()).unwrap();
    std::fs::remove_file(&path).unwrap();
}

/// The same model with the same metadata saves to the same bytes every time (the safetensors crate
/// writes metadata in a hash map's order; memfit sorts the header), and the file still reads back.
#[test]
fn saving_is_byte_reproducible() {
    let spec = ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10);
    let model = build_model(&spec, &Device::cpu(), 3).unwrap();
    let tensors = checkpoint::state_dict(model.as_ref());
    let metadata: std::collections::HashMap<String, String> =
        (0..12).map(|i| (format!("key{i}"), format!("value {i}"))).collect();
    let path = scratch("reproducible.safetensors");
    let first = checkpoint::to_bytes(&path, &tensors, Some(metadata.clone())).unwrap();
    for _ in 0..4 {
        let again: std::collections::HashMap<String, String> = metadata.clone().into_iter().collect();
        assert!(checkpoint::to_bytes(&path, &tensors, Some(again)).unwrap() == first, "the bytes differ");
    }
    let header_len = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
    assert_eq!(header_len % 8, 0, "the header stays 8-byte aligned");
    std::fs::write(&path, &first).unwrap();
    assert_eq!(checkpoint::read_metadata(&path).unwrap().unwrap(), {
        let mut m = metadata;
        m.insert("format".into(), "pt".into());
        m
    });
    checkpoint::load(&path, build_model(&spec, &Device::cpu(), 4).unwrap().as_ref()).unwrap();
    // The metadata comes from the header alone: a file cut inside its tensors still names its model,
    // and loading it is the error.
    std::fs::write(&path, &first[..header_len + 8 + 16]).unwrap();
    assert_eq!(checkpoint::read_metadata(&path).unwrap().unwrap()["key3"], "value 3");
    assert!(checkpoint::load(&path, build_model(&spec, &Device::cpu(), 4).unwrap().as_ref()).is_err());
    // A header that is not one (a JSON file) is read whole and named.
    std::fs::write(&path, b"{\"format\": \"memfit-training-checkpoint-1\"}").unwrap();
    let e = checkpoint::read_metadata(&path).unwrap_err().to_string();
    assert!(e.contains("is JSON, not safetensors"), "{e}");
    std::fs::remove_file(&path).unwrap();
}

// ---------------------------------------------------------------- golden PyTorch values

#[test]
fn simplecnn_matches_pytorch_logits_loss_and_gradients() {
    let g = Golden::open("model_simplecnn.safetensors");
    let case = "simplecnn_adamw";
    let dev = Device::cpu();
    let m = build_model(&ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10), &dev, 0).unwrap();
    g.load_params(case, m.as_ref());
    let x = Tensor::from_slice(&dev, &g.f32(&format!("{case}/input")), &[8, 1, 28, 28], Category::Input).unwrap();
    let (y, y_shape) = g.i64(&format!("{case}/target"));
    let y = Tensor::from_slice(&dev, &y, &y_shape, Category::Input).unwrap();
    let logits = m.forward(&x, true).unwrap();
    assert_close("logits", &f32s(&logits), &g.f32(&format!("{case}/logits")), MODEL_RTOL);
    let loss = cross_entropy(&logits, &y, 0.0).unwrap();
    assert_close("loss", &f32s(&loss), &g.f32(&format!("{case}/loss")), MODEL_RTOL);
    backward(&loss).unwrap();
    for (name, p) in m.parameters() {
        assert_close(
            &format!("grad {name}"),
            &f32s(&p.grad().unwrap()),
            &g.f32(&format!("{case}/grad/{name}")),
            MODEL_RTOL,
        );
    }
}

#[test]
fn gpt_matches_pytorch_logits_loss_and_gradients() {
    let g = Golden::open("model_gpt.safetensors");
    let case = "gpt_tiny_adamw";
    let dev = Device::cpu();
    let m = build_model(&gpt_spec(tiny_gpt()), &dev, 0).unwrap();
    g.load_params(case, m.as_ref());
    let (x, x_shape) = g.i64(&format!("{case}/input"));
    let (y, y_shape) = g.i64(&format!("{case}/target"));
    let x = Tensor::from_slice(&dev, &x, &x_shape, Category::Input).unwrap();
    let y = Tensor::from_slice(&dev, &y, &y_shape, Category::Input).unwrap();
    let logits = m.forward(&x, true).unwrap();
    assert_eq!(logits.shape(), [2, 6, 11]);
    assert_close("logits", &f32s(&logits), &g.f32(&format!("{case}/logits")), MODEL_RTOL);
    let loss = cross_entropy(&logits.reshape(&[-1, 11]).unwrap(), &y.reshape(&[-1]).unwrap(), 0.0).unwrap();
    assert_close("loss", &f32s(&loss), &g.f32(&format!("{case}/loss")), MODEL_RTOL);
    backward(&loss).unwrap();
    for (name, p) in m.parameters() {
        assert_close(
            &format!("grad {name}"),
            &f32s(&p.grad().unwrap()),
            &g.f32(&format!("{case}/grad/{name}")),
            MODEL_RTOL,
        );
    }
}
