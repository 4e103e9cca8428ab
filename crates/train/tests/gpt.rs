//! The GPT through the task-generic trainer: PyTorch's golden numbers, meta == cpu, exact plans,
//! accumulation, recovery that loses no window, and generation from a saved model.

mod common;
use common::*;
use memfit_data::TextCorpus;
use memfit_nn::{GptConfig, ModelSpec, OptimizerConfig};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::{Category, Device, DeviceKind, Result, Tensor};
use memfit_train::generate::{generate, GenerateConfig};
use memfit_train::plan;
use memfit_train::planner::{dry_run, predict, PlanRequest};
use memfit_train::samples::{Samples, TextWindows};
use memfit_train::{Session, TrainConfig};
use std::path::PathBuf;

fn corpus() -> TextCorpus {
    memfit_data::load_embedded_text().expect("the embedded text")
}

/// The golden batch (PyTorch's `gpt_tiny_adamw`): the same two windows every step.
struct GoldenBatch {
    input: Vec<i64>,
    target: Vec<i64>,
    shape: Vec<usize>,
}

impl Samples for GoldenBatch {
    fn len(&self) -> usize {
        self.shape[0]
    }
    fn epoch_ids(&self, _seed: u64, _epoch: usize) -> Vec<usize> {
        (0..self.len()).collect()
    }
    fn to_device(&self, device: &Device, ids: &[usize]) -> Result<(Tensor, Tensor)> {
        assert_eq!(ids, (0..self.len()).collect::<Vec<_>>(), "the golden batch runs whole");
        Ok((
            Tensor::from_slice(device, &self.input, &self.shape, Category::Input)?,
            Tensor::from_slice(device, &self.target, &self.shape, Category::Input)?,
        ))
    }
}

fn golden() -> Vec<(String, Tensor)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nn/tests/golden/model_gpt.safetensors");
    memfit_nn::checkpoint::load_named(&path, &Device::cpu(), Category::Other).expect("the golden GPT file")
}

fn golden_tensor<'a>(all: &'a [(String, Tensor)], key: &str) -> &'a Tensor {
    &all.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("golden key {key}")).1
}

#[test]
fn the_golden_gpt_trains_through_the_task_path_like_pytorch() {
    let g = golden();
    let case = "gpt_tiny_adamw";
    let input = golden_tensor(&g, &format!("{case}/input"));
    let batch = GoldenBatch {
        input: input.to_vec::<i64>().unwrap(),
        target: golden_tensor(&g, &format!("{case}/target")).to_vec::<i64>().unwrap(),
        shape: input.shape().to_vec(),
    };
    let spec = ModelSpec::gpt(GptConfig { vocab: 11, d_model: 16, heads: 2, layers: 2, max_t: 6 });
    let adamw = OptimizerConfig::adamw(1e-3);
    let mut session = Session::new(Device::cpu(), &spec, adamw, 0).unwrap();
    for (name, t) in session.model.parameters().into_iter().chain(session.model.buffers()) {
        t.copy_from(golden_tensor(&g, &format!("{case}/init/{name}"))).unwrap();
    }
    let mut o = opts(2, 2, 1);
    o.epochs = Some(3);
    let first = session.run(&batch, None, &o, &mut |_| {}).unwrap();
    let want_loss = golden_tensor(&g, &format!("{case}/loss")).item().unwrap();
    let got_loss = first.last_loss.unwrap();
    assert!((got_loss - want_loss).abs() <= 1e-4 * want_loss.abs(), "loss {got_loss} vs PyTorch {want_loss}");
    // Elements whose reference gradient is float32 rounding noise (the key bias: exactly zero in exact
    // arithmetic) move by up to lr per Adam step either way: allowed 2 * lr * step there, as the golden
    // runner does (Note [Gradients that are rounding noise] in crates/nn/tests/golden.rs).
    let check = |session: &Session, step: usize| {
        let mut relaxed = 0;
        for (name, t) in session.model.parameters() {
            let want = golden_tensor(&g, &format!("{case}/step{step}/{name}")).to_f64_vec().unwrap();
            let grad = golden_tensor(&g, &format!("{case}/grad/{name}")).to_f64_vec().unwrap();
            let grad_max = grad.iter().fold(0f64, |m, v| m.max(v.abs()));
            let got = t.to_f64_vec().unwrap();
            let max = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let noise = grad[i] != 0.0 && grad[i].abs() <= 1e-6 * grad_max;
                relaxed += usize::from(noise);
                let slack = if noise { 2e-3 * step as f64 } else { 0.0 };
                assert!((a - b).abs() <= 1e-4 * (b.abs() + max) + slack, "step {step} {name}[{i}]: {a} vs PyTorch {b}");
            }
        }
        assert!(relaxed < 40, "only the key biases are rounding noise ({relaxed} elements)");
    };
    check(&session, 1);
    o.max_steps = Some(2);
    session.run(&batch, None, &o, &mut |_| {}).unwrap();
    check(&session, 3);
}

#[test]
fn meta_and_cpu_allocate_identically_for_gpt_steps() {
    let text = corpus();
    let spec = tiny_gpt(text.vocab.len());
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    let val = TextWindows::eval(&text.val[..200], spec.gpt.max_t);
    let o = opts(8, 4, 3);
    let cpu = device(DeviceKind::Cpu, None, None);
    let meta = device(DeviceKind::META, None, None);
    for dev in [&cpu, &meta] {
        let mut s = Session::new(dev.clone(), &spec, adamw(), 1).unwrap();
        s.run(&train, Some(&val), &o, &mut |_| {}).unwrap();
    }
    let events = |d: &Device| d.timeline_events();
    assert!(!events(&cpu).is_empty());
    assert_eq!(events(&cpu), events(&meta), "identical event sequences");
    assert_eq!(cpu.stats(), meta.stats(), "identical statistics");
}

fn gpt_request(effective: usize, capacity: Option<u64>) -> PlanRequest {
    // Large enough that a batch needs several 2 MiB segments, so budgets can force accumulation.
    let model = ModelSpec::gpt(GptConfig { vocab: 40, d_model: 32, heads: 2, layers: 2, max_t: 32 });
    plan_request(model, effective, capacity)
}

#[test]
fn planned_gpt_runs_fit_and_peak_exactly_as_predicted() {
    let effective = 64;
    let full = predict(&gpt_request(effective, None), effective, Some(effective), None).unwrap().unwrap();
    let smallest = predict(&gpt_request(effective, None), 1, Some(1), None).unwrap().unwrap();
    let span = full.peak_reserved - smallest.peak_reserved;
    let mut accumulated = 0;
    for fraction in [0.2, 0.5, 0.8] {
        let capacity = smallest.peak_reserved + (span as f64 * fraction) as u64;
        let req = gpt_request(effective, Some(capacity));
        let plan = plan(&req).unwrap();
        accumulated += usize::from(plan.micro_batch < effective);
        let dev = device(DeviceKind::Cpu, Some(capacity), None);
        let mut session = Session::new(dev.clone(), &req.model, req.optimizer, req.seed).unwrap();
        let recoveries = dry_run(&req, plan.micro_batch, plan.eval_micro_batch).run(&mut session, true, true).unwrap();
        let stats = dev.stats();
        assert_eq!(stats.num_ooms, 0, "the planned run never hit out-of-memory");
        assert_eq!(recoveries, 0);
        assert_eq!(stats.allocated_bytes.peak, plan.predicted.peak_allocated);
        assert_eq!(stats.reserved_bytes.peak, plan.predicted.peak_reserved);
    }
    assert!(accumulated > 0, "some budget forces accumulation (full {full:?}, smallest {smallest:?})");
}

#[test]
fn gpt_accumulation_equals_the_full_batch() {
    let text = corpus();
    let spec = tiny_gpt(text.vocab.len());
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    let (full, full_params, _) = run(device(DeviceKind::Cpu, None, None), &spec, sgd(), &train, &opts(12, 12, 3));
    for micro in [5, 3] {
        let (acc, params, _) = run(device(DeviceKind::Cpu, None, None), &spec, sgd(), &train, &opts(12, micro, 3));
        assert_eq!(acc.sample_log, full.sample_log);
        assert_params_close(&params, &full_params, 1e-5, &format!("micro-batch {micro}"));
    }
}

#[test]
fn a_fault_at_every_allocation_of_a_gpt_run_loses_no_window() {
    let text = corpus();
    let spec = ModelSpec::gpt(GptConfig { vocab: text.vocab.len(), d_model: 8, heads: 2, layers: 1, max_t: 6 });
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    let o = opts(4, 4, 2);
    let setup_requests = {
        let dev = device(DeviceKind::Cpu, None, None);
        drop(Session::new(dev.clone(), &spec, adamw(), 3).unwrap());
        dev.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run(device(DeviceKind::Cpu, None, None), &spec, adamw(), &train, &o);
    let clean_stats = clean_session.device.stats();
    assert_eq!(clean.sample_log.iter().map(Vec::len).sum::<usize>(), 8, "two windows of 4 start offsets");
    let requests = clean_stats.allocation.allocated - setup_requests;
    assert!(requests > 50, "a GPT step makes many requests ({requests})");
    for k in 1..=requests {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup_requests + k)));
        let (out, params, session) = run(dev, &spec, adamw(), &train, &o);
        let stats = session.device.stats();
        assert_eq!(stats.num_injected_faults, 1, "fault at request {k}");
        assert!(out.oom_recoveries >= 1, "fault at request {k} was recovered");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "fault at request {k}: the same windows");
        assert_params_close(&params, &clean_params, 1e-5, &format!("fault at request {k}"));
        assert_eq!(stats.allocated_bytes.current, clean_stats.allocated_bytes.current, "fault {k}: nothing leaked");
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-gpt-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn a_saved_gpt_generates_the_same_text_for_a_seed() {
    let ckpt = scratch("tiny.safetensors");
    let cfg = TrainConfig {
        model: memfit_nn::ModelKind::Gpt,
        gpt: GptConfig { d_model: 16, heads: 2, layers: 1, max_t: 16, ..GptConfig::default() },
        max_steps: Some(3),
        batch_size: 8,
        lr: 1e-2,
        evaluate: false,
        save: Some(ckpt.clone()),
        ..TrainConfig::default()
    };
    let summary = memfit_train::train(&cfg, &mut memfit_train::Quiet).unwrap();
    assert_eq!(summary.outcome.steps, 3);
    let gen = |seed: u64, temperature: f64| {
        let g = GenerateConfig {
            model: None,
            load: ckpt.clone(),
            prompt: "Call me".into(),
            tokens: 60,
            temperature,
            seed,
            memory: None,
            threads: Some(1),
            device: memfit_tensor::DeviceKind::Cpu,
        };
        let mut streamed = String::new();
        let out = generate(&g, &mut |t: &str| streamed.push_str(t)).unwrap();
        assert_eq!(out.text, streamed, "what is streamed is what is returned");
        assert_eq!(out.text.chars().count(), 60);
        assert!(out.stats.allocated_bytes.peak > 0, "generation is accounted");
        out.text
    };
    assert_eq!(gen(1, 0.8), gen(1, 0.8), "deterministic for a seed");
    assert_ne!(gen(1, 0.8), gen(2, 0.8), "another seed, another text");
    assert_eq!(gen(1, 0.0), gen(2, 0.0), "temperature 0 is greedy");
    // Characters the model never saw, and checkpoints that are not GPTs, are refused clearly.
    let bad = GenerateConfig {
        model: None,
        load: ckpt.clone(),
        prompt: "Caf\u{e9}".into(),
        tokens: 5,
        temperature: 0.8,
        seed: 0,
        memory: None,
        threads: Some(1),
        device: memfit_tensor::DeviceKind::Cpu,
    };
    let e = generate(&bad, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("U+00E9") && e.contains("vocabulary"), "{e}");
    let image = scratch("mlp.safetensors");
    let image_cfg = TrainConfig {
        model: memfit_nn::ModelKind::Mlp,
        data: Some("embedded".into()),
        max_steps: Some(1),
        evaluate: false,
        save: Some(image.clone()),
        ..TrainConfig::default()
    };
    memfit_train::train(&image_cfg, &mut memfit_train::Quiet).unwrap();
    let e = generate(&GenerateConfig { load: image, prompt: "Call".into(), ..bad }, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("needs a gpt checkpoint"), "{e}");
}

/// A GPT whose logits for a micro-batch are more than one chunk (Note [Chunked head]): vocabulary
/// 16,384, so a chunk is 1,024 rows and a micro-batch of 16 x 256 tokens takes four.
fn wide_gpt() -> ModelSpec {
    ModelSpec::gpt(GptConfig { vocab: 16_384, d_model: 16, heads: 2, layers: 1, max_t: 256 })
}

/// Its head and loss go chunk by chunk: the loss, the right predictions and every parameter's
/// gradient are the unchunked ones (logits, then cross-entropy) up to the order of float additions;
/// the step's peak is lower by about two logits tensors; and meta allocates what the cpu allocates.
#[test]
fn a_wide_vocabulary_takes_the_chunked_head_with_the_same_numbers_and_less_memory() {
    use memfit_nn::build_model;
    use memfit_train::samples::{Samples as _, SyntheticTokens};
    let spec = wide_gpt();
    let data = SyntheticTokens { len: 16, vocab: 16_384, context: 256, seed: 3 };
    let ids: Vec<usize> = (0..16).collect();
    let step = |kind: DeviceKind, fused: bool| {
        let device = device(kind, None, None);
        let model = build_model(&spec, &device, 5).unwrap();
        let (x, y) = data.to_device(&device, &ids).unwrap();
        let before = device.stats().allocated_bytes.current;
        let (loss, predicted) = if fused {
            model.fused_loss(&x, &y, true).expect("the chunked head applies").unwrap()
        } else {
            let logits = model.forward(&x, true).unwrap();
            let loss = memfit_train::trainer::loss(&logits, &y).unwrap();
            (loss, logits.detach().max_dim(-1, false).unwrap().1)
        };
        memfit_tensor::autograd::backward(&loss).unwrap();
        let peak = device.stats().allocated_bytes.peak - before;
        if !device.computes() {
            return (0.0, 0.0, vec![], peak);
        }
        let right = predicted.count_equal(&y).unwrap().item().unwrap();
        let grads: Vec<Vec<f64>> =
            model.parameters().iter().map(|(_, p)| p.grad().unwrap().to_f64_vec().unwrap()).collect();
        (loss.item().unwrap(), right, grads, peak)
    };
    let (loss, right, grads, peak) = step(DeviceKind::Cpu, true);
    let (loss0, right0, grads0, peak0) = step(DeviceKind::Cpu, false);
    assert!((loss - loss0).abs() <= 1e-6 * loss0.abs(), "loss {loss} chunked, {loss0} whole");
    assert_eq!(right, right0, "right predictions");
    for (k, (g, g0)) in grads.iter().zip(&grads0).enumerate() {
        let scale = g0.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-6);
        for (a, b) in g.iter().zip(g0) {
            assert!((a - b).abs() <= 1e-4 * scale, "parameter {k}: gradient {a} chunked, {b} whole");
        }
    }
    // Whole: the logits and their gradient (4,096 rows each); chunked: a chunk of each (1,024 rows).
    let (logits, chunk) = ((16 * 256 * 16_384 * 4) as u64, (1024 * 16_384 * 4) as u64);
    assert!(peak + 2 * (logits - chunk) <= peak0 + (8 << 20), "peak {peak} B chunked vs {peak0} B whole");
    assert_eq!(step(DeviceKind::META, true).3, peak, "meta predicts the chunked step's peak");
}
