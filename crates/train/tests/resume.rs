//! Training checkpoints resume exactly (Note [Exact resume] in `train/src/resume.rs`): a run stopped
//! after step k and resumed from its checkpoint ends with the same parameters, byte for byte, and the
//! same report counts as the uninterrupted run; settings that differ are refused by name; a corrupt or
//! missing checkpoint is a clear error.

use memfit_nn::ModelKind;
use memfit_train::job::Observer;
use memfit_train::resume::Checkpoint;
use memfit_train::{train, OptimizerChoice, Quiet, RunSummary, StepEvent, TrainConfig, TrainError};
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-resume-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// simplecnn on the shipped images, 6 steps of 8 in micro-batches of 4 (accumulation 2).
fn image_config() -> TrainConfig {
    TrainConfig {
        model: ModelKind::SimpleCnn,
        data: Some(PathBuf::from("embedded")),
        batch_size: 8,
        micro_batch: Some(4),
        max_steps: Some(6),
        evaluate: false,
        threads: Some(2),
        seed: 5,
        ..TrainConfig::default()
    }
}

/// A tiny GPT on a short text: 4 steps per epoch, so 6 steps cross into a second epoch.
fn gpt_config(dir: &Path) -> TrainConfig {
    let text: String =
        (0..400).map(|i| ["the whale ", "call me ", "ishmael. "][i % 3]).collect::<String>()[..400].into();
    let path = dir.join("text.txt");
    std::fs::write(&path, text).unwrap();
    let mut cfg = TrainConfig {
        model: ModelKind::Gpt,
        data: Some(path),
        batch_size: 5,
        max_steps: Some(6),
        lr: 1e-2,
        optimizer: OptimizerChoice::Adam,
        evaluate: true,
        threads: Some(2),
        data_seed: Some(9),
        ..TrainConfig::default()
    };
    cfg.gpt.layers = 1;
    cfg.gpt.d_model = 16;
    cfg.gpt.heads = 2;
    cfg.gpt.max_t = 16;
    cfg
}

/// The tensors of a safetensors file (name, shape, dtype, the bits of every value) and its metadata:
/// equal when the parameters are equal byte for byte (the file's header lists the metadata in a
/// hash map's order, which varies between runs).
fn tensors(
    path: &Path,
) -> (Vec<(String, Vec<usize>, String, Vec<u64>)>, Option<std::collections::HashMap<String, String>>) {
    let device = memfit_tensor::Device::cpu();
    let named = memfit_nn::checkpoint::load_named(path, &device, memfit_tensor::Category::Parameter).unwrap();
    let values = named
        .into_iter()
        .map(|(n, t)| {
            let bits = t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            (n, t.shape().to_vec(), t.dtype().to_string(), bits)
        })
        .collect();
    (values, memfit_nn::checkpoint::read_metadata(path).unwrap())
}

/// Asks the run to stop (as SIGINT does) after step `after`.
struct StopAfter {
    after: usize,
    last: usize,
}

impl Observer for StopAfter {
    fn step(&mut self, e: &StepEvent) {
        self.last = e.step;
    }
    fn interrupted(&mut self) -> Option<i32> {
        (self.last == self.after).then_some(2)
    }
}

fn counts(s: &RunSummary) -> (usize, usize, usize, usize, Option<usize>) {
    let o = &s.outcome;
    (o.steps, o.epochs, o.samples_seen, o.curve.len(), o.eval.as_ref().map(|e| e.samples))
}

/// Stops `cfg` after each of `kill_points`, resumes it, and compares the saved parameters with the
/// uninterrupted run's, byte for byte.
fn check_resume_is_exact(name: &str, cfg: TrainConfig, kill_points: &[usize], dir: &Path) {
    let full_path = dir.join("full.safetensors");
    let full = train(&TrainConfig { save: Some(full_path.clone()), ..cfg.clone() }, &mut Quiet).unwrap();
    let full_bytes = tensors(&full_path);
    for &k in kill_points {
        let save_dir = dir.join(format!("ckpt-{k}"));
        let stopped = TrainConfig { save_dir: Some(save_dir.clone()), ..cfg.clone() };
        let e = train(&stopped, &mut StopAfter { after: k, last: 0 }).expect_err("the run stops");
        let TrainError::Interrupted { signal, message } = &e else { panic!("{name} k={k}: {e}") };
        assert_eq!(*signal, 2);
        assert!(
            message.contains(&format!("after step {k} of 6")) && message.contains("memfit train --resume"),
            "{message}"
        );
        let out = dir.join(format!("resumed-{k}.safetensors"));
        let resumed = TrainConfig { resume: Some(save_dir.clone()), save: Some(out.clone()), ..stopped };
        let summary = train(&resumed, &mut Quiet).unwrap_or_else(|e| panic!("{name} resume at {k}: {e}"));
        assert!(tensors(&out) == full_bytes, "{name}: resumed after step {k}, parameters differ");
        assert_eq!(counts(&summary), counts(&full), "{name}: report counts after resuming at step {k}");
        assert_eq!(summary.outcome.last_loss, full.outcome.last_loss, "{name}: last loss after resuming at {k}");
    }
}

#[test]
fn an_image_model_with_accumulation_resumes_bit_identically_after_steps_1_2_and_5() {
    let dir = scratch("image");
    check_resume_is_exact("simplecnn", image_config(), &[1, 2, 5], &dir);
}

/// fp16 (its products, storage and loss scale): the checkpoint keeps the loss scale and its count
/// of clean steps, and the resumed run ends as the uninterrupted one.
#[test]
fn fp16_resumes_bit_identically_with_its_loss_scale() {
    let dir = scratch("fp16");
    let cfg = TrainConfig { precision: memfit_train::Precision::Fp16, ..image_config() };
    check_resume_is_exact("simplecnn fp16", cfg.clone(), &[2, 5], &dir);
    for k in [2, 5] {
        // The newest checkpoint there is the resumed run's last, after all 6 steps.
        let state = Checkpoint::latest(&dir.join(format!("ckpt-{k}"))).unwrap().state;
        let (scale, clean) = state.loss_scale.expect("an fp16 checkpoint keeps its loss scale");
        // 65536 halved once per skipped step, the clean steps since the last halving counted.
        assert!(clean <= 6, "scale {scale}, {clean} clean steps");
        assert_eq!(scale * 2f64.powi(6 - clean as i32), 65536.0, "scale {scale} after {clean} clean steps of 6");
    }
    let fp32_dir = dir.join("fp32");
    let fp32 = TrainConfig { save_dir: Some(fp32_dir.clone()), max_steps: Some(1), ..image_config() };
    train(&fp32, &mut Quiet).unwrap();
    assert_eq!(Checkpoint::latest(&fp32_dir).unwrap().state.loss_scale, None, "fp32 keeps no loss scale");
}

#[test]
fn a_tiny_gpt_resumes_bit_identically_across_an_epoch_boundary() {
    let dir = scratch("gpt");
    let cfg = gpt_config(&dir);
    check_resume_is_exact("gpt", TrainConfig { micro_batch: Some(2), ..cfg.clone() }, &[1, 4, 5], &dir);
    // SGD with momentum (the momentum buffer is the state) and no accumulation.
    let sgd = TrainConfig { optimizer: OptimizerChoice::Sgd, ..cfg };
    check_resume_is_exact("gpt-sgd", sgd, &[2], &scratch("gpt-sgd"));
}

#[test]
fn periodic_checkpoints_keep_the_newest_and_resume_after_a_crash() {
    let dir = scratch("periodic");
    let save_dir = dir.join("ckpt");
    let cfg = TrainConfig { save_every: Some(2), keep: 2, save_dir: Some(save_dir.clone()), ..image_config() };
    let full_path = dir.join("full.safetensors");
    train(&TrainConfig { save: Some(full_path.clone()), ..cfg.clone() }, &mut Quiet).unwrap();
    let mut names: Vec<String> =
        std::fs::read_dir(&save_dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let expected: Vec<String> = [4, 6]
        .iter()
        .flat_map(|s| ["json", "model.safetensors", "optimizer.safetensors"].map(|k| format!("step-{s:010}.{k}")))
        .collect::<Vec<_>>();
    let mut expected = expected;
    expected.sort();
    assert_eq!(names, expected, "only the newest 2 checkpoints are kept");
    // A crash after step 5: the newest whole checkpoint is step 4 (step 6's JSON was never written).
    std::fs::remove_file(save_dir.join("step-0000000006.json")).unwrap();
    let out = dir.join("resumed.safetensors");
    let summary = train(&TrainConfig { resume: Some(save_dir.clone()), save: Some(out.clone()), ..cfg }, &mut Quiet)
        .expect("resume from step 4");
    assert_eq!(summary.outcome.steps, 6);
    assert!(tensors(&out) == tensors(&full_path), "parameters differ");
    // The weights file is the same safetensors `--save` writes: loadable as weights.
    let loaded = TrainConfig {
        load: Some(save_dir.join("step-0000000006.model.safetensors")),
        epochs: Some(0),
        max_steps: None,
        ..image_config()
    };
    train(&loaded, &mut Quiet).expect("a checkpoint's weights load with --load");
}

/// A finished run extended with `--max-steps` ends exactly as one longer run; resuming a finished run
/// without a longer horizon says nothing was left to do.
#[test]
fn a_finished_run_extends_into_exactly_the_longer_run() {
    let dir = scratch("extend");
    for (name, cfg) in [("simplecnn", image_config()), ("gpt", gpt_config(&dir))] {
        let long_path = dir.join(format!("{name}-long.safetensors"));
        let long = train(&TrainConfig { max_steps: Some(9), save: Some(long_path.clone()), ..cfg.clone() }, &mut Quiet)
            .unwrap();
        let save_dir = dir.join(format!("{name}-ckpt"));
        let short = TrainConfig { save_dir: Some(save_dir.clone()), ..cfg.clone() };
        train(&short, &mut Quiet).unwrap();
        let e = train(&TrainConfig { resume: Some(save_dir.clone()), ..short.clone() }, &mut Quiet)
            .expect_err("finished")
            .to_string();
        assert!(e.contains("nothing was left to do") && e.contains("--max-steps N (above 6)"), "{e}");
        let out = dir.join(format!("{name}-extended.safetensors"));
        let extended = TrainConfig { resume: Some(save_dir), max_steps: Some(9), save: Some(out.clone()), ..short };
        let summary = train(&extended, &mut Quiet).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(tensors(&out) == tensors(&long_path), "{name}: the extended run's parameters differ");
        assert_eq!(summary.outcome.steps, 9);
        assert_eq!(summary.outcome.last_loss, long.outcome.last_loss, "{name}");
    }
}

#[test]
fn a_setting_that_differs_from_the_checkpoint_is_refused_by_name() {
    let dir = scratch("refused");
    let save_dir = dir.join("ckpt");
    let cfg = TrainConfig { save_dir: Some(save_dir.clone()), ..image_config() };
    train(&cfg, &mut StopAfter { after: 1, last: 0 }).expect_err("stopped");
    // A library caller with another learning rate.
    let e = train(&TrainConfig { resume: Some(save_dir.clone()), lr: 0.1, ..cfg.clone() }, &mut Quiet)
        .expect_err("another --lr")
        .to_string();
    assert!(e.contains("--lr 0.1 differs") && e.contains("0.003"), "{e}");
    // The CLI's path: flags given on the command line must match, the others come from the checkpoint.
    let ckpt = Checkpoint::latest(&save_dir).unwrap();
    let mut given = TrainConfig { batch_size: 16, resume: Some(save_dir.clone()), ..TrainConfig::default() };
    let e = ckpt.configure(&mut given, &|id| id == "batch_size").expect_err("--batch-size").to_string();
    assert!(e.contains("--batch-size 16 differs") && e.contains("--batch-size 8"), "{e}");
    let mut bare = TrainConfig { resume: Some(save_dir.clone()), ..TrainConfig::default() };
    ckpt.configure(&mut bare, &|_| false).unwrap();
    assert_eq!((bare.batch_size, bare.micro_batch, bare.seed, bare.max_steps), (8, Some(4), 5, Some(6)));
    assert_eq!(bare.save_dir.as_deref(), Some(save_dir.as_path()));
    // A new run may not write over another run's checkpoints.
    let e = train(&cfg, &mut Quiet).expect_err("save dir in use").to_string();
    assert!(e.contains("--save-dir") && e.contains("already holds") && e.contains("--resume"), "{e}");
}

#[test]
fn a_corrupt_or_missing_checkpoint_is_a_clear_error() {
    let dir = scratch("corrupt");
    let missing = dir.join("nothing-here");
    let e =
        train(&TrainConfig { resume: Some(missing.clone()), ..image_config() }, &mut Quiet).unwrap_err().to_string();
    assert!(e.contains("--resume") && e.contains("nothing-here") && e.contains("cannot read it"), "{e}");
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = train(&TrainConfig { resume: Some(empty), ..image_config() }, &mut Quiet).unwrap_err().to_string();
    assert!(e.contains("holds no training checkpoint"), "{e}");

    let save_dir = dir.join("ckpt");
    let cfg = TrainConfig { save_dir: Some(save_dir.clone()), ..image_config() };
    train(&cfg, &mut StopAfter { after: 2, last: 0 }).expect_err("stopped");
    let resume = TrainConfig { resume: Some(save_dir.clone()), ..cfg };
    let weights = save_dir.join("step-0000000002.model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&weights, &bytes).unwrap();
    let e = train(&resume, &mut Quiet).unwrap_err().to_string();
    assert!(e.contains("step-0000000002.model.safetensors") && e.contains("is corrupt"), "{e}");
    std::fs::write(save_dir.join("step-0000000002.json"), b"{ not json").unwrap();
    let e = train(&resume, &mut Quiet).unwrap_err().to_string();
    assert!(e.contains("step-0000000002.json") && e.contains("is corrupt"), "{e}");
}

#[test]
fn an_interrupted_run_without_a_save_dir_says_nothing_can_be_resumed() {
    let e = train(&image_config(), &mut StopAfter { after: 1, last: 0 }).unwrap_err();
    let TrainError::Interrupted { signal: 2, message } = e else { panic!("{e}") };
    assert!(message.contains("SIGINT after step 1") && message.contains("nothing can be resumed"), "{message}");
}
