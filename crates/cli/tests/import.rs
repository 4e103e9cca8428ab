//! `--model PATH.pt2`: a user's PyTorch model (exported by `torch.export.save`) planned, trained under a
//! budget with recovery and checkpointing of its modules, reported and saved under its `state_dict`
//! names; a missing file or a model that does not fit the data is a clear error with exit 1.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

/// memfit with a cost cache of this test process's own (never the user's `~/.cache/memfit`, whose
/// entries would decide the plans).
fn memfit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .env("MEMFIT_CACHE_DIR", temp("costs"))
        .output()
        .expect("the memfit binary runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-cli-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../import/tests/fixtures").join(name);
    path.to_str().unwrap().to_string()
}

#[test]
fn an_exported_model_plans_trains_under_a_budget_recovers_and_saves_its_state_dict() {
    let model = fixture("tiny_cnn.pt2");
    let out = memfit(&["plan", "--model", &model, "--memory", "2MiB", "--batch-size", "256"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("tiny_cnn.pt2 (1x28x28) with a budget of 2.00 MiB"), "{}", text(&out));
    let (report, saved) = (temp("tiny.json"), temp("tiny.safetensors"));
    let args = [
        "train",
        "--model",
        &model,
        "--data",
        "embedded",
        "--max-steps",
        "3",
        "--batch-size",
        "256",
        "--memory",
        "2MiB",
        "--inject-oom",
        "60",
        "--report",
        report.to_str().unwrap(),
        "--save",
        saved.to_str().unwrap(),
    ];
    let out = memfit(&args);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["model"], model.as_str());
    assert!(r["num_injected_faults"].as_u64().unwrap() > 0);
    assert_eq!(r["oom_recoveries"], r["num_ooms"], "every out-of-memory recovered");
    assert_eq!(r["samples_seen"], 3 * 256, "no sample lost");
    assert!(r["peak_reserved_bytes"].as_u64().unwrap() <= 2 << 20, "within the budget through every recovery");
    assert!(r["val_accuracy"].as_f64().unwrap() > 0.1);
    // Without faults the plan is exact. (With them, a pass that fails after committing gradients as
    // complete replays the window and commits the rest transactionally, which may hold a second set
    // of gradients the plan's dry run never does: within the budget, not at the prediction.)
    let clean = temp("tiny-clean.json");
    let out = memfit(&[&args[..11], &["--report", clean.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&clean).unwrap()).unwrap();
    assert_eq!(r["num_ooms"], 0);
    assert_eq!(r["peak_allocated_bytes"], r["predicted_peak_allocated_bytes"]);
    assert_eq!(r["peak_reserved_bytes"], r["predicted_peak_reserved_bytes"]);
    let bytes = std::fs::read(&saved).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    for name in ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias"] {
        assert!(header.get(name).is_some(), "{name} saved: {header}");
    }
}

/// A VisionTransformer's encoder blocks checkpointed (its segments are its module paths): the run
/// peaks exactly as predicted, below the plain run's, recovers from injected faults, and saves the
/// same weights bit for bit as the plain run; the planner weighs the segments by name; an unknown
/// segment is an error listing them.
#[test]
fn an_exported_model_checkpoints_its_modules_with_the_same_numbers() {
    let model = fixture("tiny_vit.pt2");
    let blocks = "encoder.layers.encoder_layer_0,encoder.layers.encoder_layer_1";
    let run = |name: &str, extra: &[&str]| {
        let (report, saved) = (temp(&format!("{name}.json")), temp(&format!("{name}.safetensors")));
        let mut args = vec!["train", "--model", &model, "--data", "embedded", "--max-steps", "3", "--batch-size", "64"];
        args.extend_from_slice(&["--no-eval", "--report", report.to_str().unwrap(), "--save", saved.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let out = memfit(&args);
        assert!(out.status.success(), "{}", text(&out));
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (r, std::fs::read(&saved).unwrap())
    };
    let (plain, plain_weights) = run("vit-plain", &["--micro-batch", "64"]);
    let (r, weights) = run("vit-blocks", &["--checkpoint", blocks, "--memory", "3MiB", "--inject-oom", "400"]);
    assert_eq!(r["checkpointed_segments"], serde_json::json!(blocks.split(',').collect::<Vec<_>>()));
    assert!(r["num_injected_faults"].as_u64().unwrap() > 0);
    assert_eq!(r["oom_recoveries"], r["num_ooms"], "every out-of-memory recovered");
    assert_eq!(r["peak_allocated_bytes"], r["predicted_peak_allocated_bytes"]);
    assert!(r["peak_allocated_bytes"].as_u64() < plain["peak_allocated_bytes"].as_u64(), "{r} vs {plain}");
    assert!(weights == plain_weights, "checkpointing and recovery change no bit of the saved weights");
    let out = memfit(&["plan", "--model", &model, "--batch-size", "256", "--memory", "2MiB"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("encoder.layers.encoder_layer_0"), "{}", text(&out));
    // bf16 storage of the saved activations, planned and measured alike.
    let report = temp("vit-bf16.json");
    let out = memfit(&[
        "train",
        "--model",
        &model,
        "--precision",
        "bf16",
        "--batch-size",
        "256",
        "--memory",
        "2MiB",
        "--max-steps",
        "2",
        "--no-eval",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["precision"], "bf16", "{r}");
    assert_eq!(r["peak_allocated_bytes"], r["predicted_peak_allocated_bytes"]);
    let out = memfit(&["train", "--model", &model, "--checkpoint", "layers.0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("no segment \"layers.0\"; its segments are conv_proj, encoder.layers"),
        "{}",
        text(&out)
    );
}

/// `bench` runs an exported model's step on synthetic data of its shapes, at the batch given; an
/// archive that cannot be read is named before anything is measured.
#[test]
fn an_exported_model_is_benched_at_the_batch_given() {
    let model = fixture("tiny_vit.pt2");
    let out = memfit(&["bench", "--model", &model, "--batch-size", "16", "--steps", "2", "--warmup", "1", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let case = &r["cases"][0];
    assert_eq!(case["name"], model.as_str());
    assert!(case["median_ms"].as_f64().unwrap() > 0.0 && case["peak_allocated_bytes"].as_u64().unwrap() > 0);
    // 16 images: less than the default 64's peak.
    let out = memfit(&["bench", "--model", &model, "--steps", "1", "--warmup", "0", "--json"]);
    let default: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(default["cases"][0]["peak_allocated_bytes"].as_u64() > case["peak_allocated_bytes"].as_u64());
    let missing = temp("missing.pt2");
    let out = memfit(&["bench", "--model", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("missing.pt2"), "{}", text(&out));
}

/// An imported next-token predictor's saved weights continue a prompt with `generate --model`: the
/// same seed the same text; the file alone names what is missing; a model that is not causal cannot
/// continue a prompt shorter than its context, and says so.
#[test]
fn an_exported_gpt_generates_text_and_a_bidirectional_one_is_refused() {
    let model = fixture("tiny_gpt.pt2");
    let saved = temp("gpt-gen.safetensors");
    let out = memfit(&["train", "--model", &model, "--max-steps", "5", "--no-eval", "--save", saved.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let generate = |model: Option<&str>, prompt: &str| {
        let mut args = vec!["generate", "--load", saved.to_str().unwrap(), "--prompt", prompt, "--tokens", "20"];
        if let Some(m) = model {
            args.extend_from_slice(&["--model", m]);
        }
        memfit(&args)
    };
    let (a, b) = (generate(Some(&model), "Call me"), generate(Some(&model), "Call me"));
    assert!(a.status.success(), "{}", text(&a));
    let story = String::from_utf8_lossy(&a.stdout).to_string();
    assert!(story.starts_with("Call me") && story.trim_end().chars().count() >= 7 + 1, "{story:?}");
    assert_eq!(a.stdout, b.stdout, "the same seed, the same text");
    assert!(text(&a).contains("tiny_gpt.pt2"), "{}", text(&a));
    // A prompt longer than the context of 8: its last 8 characters.
    let long = generate(Some(&model), "It was the best of times");
    assert!(long.status.success(), "{}", text(&long));
    let alone = generate(None, "Call me");
    assert_eq!(alone.status.code(), Some(1));
    assert!(text(&alone).contains("give its archive too, with --model PATH.pt2"), "{}", text(&alone));
    let bidirectional = fixture("tiny_bidirectional.pt2");
    let saved_b = temp("bi.safetensors");
    let out = memfit(&[
        "train",
        "--model",
        &bidirectional,
        "--max-steps",
        "1",
        "--no-eval",
        "--save",
        saved_b.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = memfit(&["generate", "--model", &bidirectional, "--load", saved_b.to_str().unwrap(), "--prompt", "Call"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("not causal") && text(&out).contains("context of 8"), "{}", text(&out));
    let full = ["generate", "--model", &bidirectional, "--load", saved_b.to_str().unwrap(), "--prompt", "Call me "];
    assert!(memfit(&full).status.success(), "a full window needs no fill");
}

/// Batch norm over a 1 x 1 map takes no micro-batch of one sample (PyTorch refuses it): the planner
/// never plans one (recovery never halves below it: `trainer.rs`'s unit test), and a micro-batch,
/// batch or epoch that would leave one is refused before any work, with what does.
#[test]
fn batch_norm_over_one_value_per_channel_never_gets_a_micro_batch_of_one() {
    let model = fixture("tiny_pooled_bn.pt2");
    let report = temp("pooled.json");
    let out = memfit(&[
        "train",
        "--model",
        &model,
        "--batch-size",
        "64",
        "--memory",
        "2MiB",
        "--inject-oom",
        "60",
        "--max-steps",
        "3",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert!(r["num_injected_faults"].as_u64().unwrap() > 0);
    assert_eq!(r["oom_recoveries"], r["num_ooms"]);
    assert_eq!(r["samples_seen"], 3 * 64);
    assert_eq!(r["peak_allocated_bytes"], r["predicted_peak_allocated_bytes"]);
    let refused = |args: &[&str], says: &str| {
        let mut all = vec!["train", "--model", &model, "--max-steps", "1"];
        all.extend_from_slice(args);
        let out = memfit(&all);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(text(&out).contains("needs at least 2 samples") && text(&out).contains(says), "{}", text(&out));
    };
    refused(&["--micro-batch", "1"], "--micro-batch 1 is fewer");
    refused(
        &["--batch-size", "9", "--micro-batch", "4"],
        "leaves a micro-batch of 1 of the batch of 9 (--micro-batch 3 does)",
    );
    refused(&["--batch-size", "1"], "give a --batch-size of at least 2");
    refused(&["--batch-size", "7999"], "leave a last step of 1 in batches of 7999");
    let out = memfit(&["plan", "--model", &model, "--memory", "100KiB", "--batch-size", "64"]);
    assert!(text(&out).contains("even a micro-batch of 2"), "{}", text(&out));
}

#[test]
fn a_missing_archive_and_a_model_that_does_not_fit_the_data_are_clear_errors() {
    let out = memfit(&["train", "--model", "/nonexistent/model.pt2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("/nonexistent/model.pt2: no such file"), "{}", text(&out));
    // The tiny MLP flattens its input itself, so it takes 1x28x28 like the data; an archive whose
    // signature is not image classification is refused by the nn crate's test of the signature.
    let out = memfit(&["train", "--model", &fixture("tiny_mlp.pt2"), "--data", "embedded", "--max-steps", "1"]);
    assert!(out.status.success(), "{}", text(&out));
    let not_an_archive = temp("not-an-archive.pt2");
    std::fs::write(&not_an_archive, "hello").unwrap();
    let out = memfit(&["plan", "--model", not_an_archive.to_str().unwrap(), "--memory", "8MiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("not a torch.export archive"), "{}", text(&out));
}

/// An interrupted run of an exported model resumes exactly: the same saved bytes as the run that was
/// not interrupted (the checkpoint names the archive; batch norm's buffers and Adam's state come back).
#[test]
fn an_exported_model_resumes_exactly_and_profiles() {
    let model = fixture("tiny_resnet.pt2");
    let (whole, resumed, dir) = (temp("whole.safetensors"), temp("resumed.safetensors"), temp("resume-dir"));
    let common = ["--model", model.as_str(), "--data", "embedded", "--batch-size", "16"];
    let out = memfit(&[&["train"][..], &common, &["--max-steps", "6", "--save", whole.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", text(&out));
    let first =
        [&["train"][..], &common, &["--max-steps", "3", "--save-every", "3", "--save-dir", dir.to_str().unwrap()]];
    let out = memfit(&first.concat());
    assert!(out.status.success(), "{}", text(&out));
    let out =
        memfit(&["train", "--resume", dir.to_str().unwrap(), "--max-steps", "6", "--save", resumed.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&whole).unwrap(), std::fs::read(&resumed).unwrap(), "the same bytes");
    let profile = temp("profile");
    let out = memfit(&[&["profile"][..], &common, &["--max-steps", "2", "--out", profile.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", text(&out));
    assert!(profile.join("memory.html").is_file());
}

/// A next-token model exported from PyTorch (the reference GPT: int64 tokens [N, T] in, [N, T, V]
/// out) trains on the text like memfit's own GPT: planned under a budget, recovering from injected
/// faults with no window lost, at the predicted peak.
#[test]
fn an_exported_gpt_trains_on_text_under_a_budget() {
    let model = fixture("tiny_gpt.pt2");
    let out = memfit(&["plan", "--model", &model, "--memory", "4MiB", "--batch-size", "64"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("tiny_gpt.pt2 (context 8, vocabulary 96) with a budget of 4.00 MiB"), "{}", text(&out));
    let report = temp("gpt.json");
    let args = [
        "train",
        "--model",
        &model,
        "--max-steps",
        "3",
        "--batch-size",
        "64",
        "--lr",
        "3e-3",
        "--memory",
        "2MiB",
        "--inject-oom",
        "400",
        "--report",
        report.to_str().unwrap(),
    ];
    let out = memfit(&args);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["task"], "next_character", "{r}");
    assert!(r["gpt"].is_null(), "an imported model's sizes are its graph's: {r}");
    assert!(r["num_injected_faults"].as_u64().unwrap() > 0);
    assert_eq!(r["oom_recoveries"], r["num_ooms"]);
    assert_eq!(r["samples_seen"], 3 * 64);
    assert_eq!(r["peak_allocated_bytes"], r["predicted_peak_allocated_bytes"]);
    assert!(r["val_loss"].as_f64().unwrap() < 4.6, "below uniform over 96 tokens: {}", r["val_loss"]);
    // A next-token predictor's defaults are the GPT's: 32 windows a step at lr 1e-3.
    let out =
        memfit(&["train", "--model", &model, "--max-steps", "1", "--no-eval", "--report", report.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!((r["samples_seen"].as_u64(), r["lr"].as_f64()), (Some(32), Some(1e-3)), "{r}");
}
