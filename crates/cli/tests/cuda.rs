//! `--device cuda` on the command line without a GPU: a missing driver is one clear error and exit
//! 1 before any data loads (never a panic); bad device names are refused; `meta:cuda` and `plan
//! --device cuda` predict a GPU run, with the GPU's own allocations (cuBLAS's workspace) in it.
//! On a machine whose driver is there, the no-driver check says `skipped` on its own line.

use serde_json::Value;
use std::process::{Command, Output};

fn memfit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit")).args(args).output().expect("the memfit binary runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn report(args: &[&str], name: &str) -> Value {
    let dir = std::env::temp_dir().join(format!("memfit-cuda-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let all = [args, &["--report", path.to_str().unwrap()]].concat();
    let out = memfit(&all);
    assert!(out.status.success(), "memfit {all:?} failed:\n{}", text(&out));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn without_a_driver_cuda_is_one_clear_error_before_the_data_loads() {
    if memfit_cuda::Library::Driver.present() {
        println!("skipped: an NVIDIA driver is present here; the GPU check (tools/gpu-check) covers cuda");
        return;
    }
    for device in ["cuda", "cuda:1"] {
        let out = memfit(&["train", "--device", device, "--data", "embedded", "--max-steps", "1"]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{all}");
        assert!(all.contains(&format!("--device {device}: no NVIDIA driver (libcuda.so.1 not found)")), "{all}");
        assert!(all.contains("meta:cuda"), "the error names the way to predict without a GPU: {all}");
        assert!(!all.contains("data:") && !all.contains("panicked"), "{all}");
    }
}

#[test]
fn device_names_that_are_not_devices_are_refused() {
    for (device, words) in [("gpu", "expected cpu, cuda"), ("cuda:x", "a GPU's number"), ("meta:tpu", "meta:cuda")] {
        let out = memfit(&["train", "--device", device]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(text(&out).contains(words), "{device}: {}", text(&out));
    }
}

#[test]
fn a_misspelt_choice_of_attention_kernels_is_refused_on_meta_cuda_too() {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["train", "--model", "gpt", "--device", "meta:cuda", "--max-steps", "1"])
        .env("MEMFIT_CUDA_ATTENTION", "wdie")
        .output()
        .expect("the memfit binary runs");
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("MEMFIT_CUDA_ATTENTION=wdie: expected `cuda-cores` or `wide`"), "{all}");
    assert!(!all.contains("panicked") && !all.contains("step "), "{all}");
}

#[test]
fn meta_cuda_predicts_a_gpu_run_with_the_gpus_own_allocations() {
    let args = ["train", "--model", "gpt", "--layers", "2", "--d-model", "64", "--max-steps", "2", "--no-eval"];
    let cpu = report(&[&args[..], &["--device", "meta"]].concat(), "meta.json");
    let gpu = report(&[&args[..], &["--device", "meta:cuda"]].concat(), "meta-cuda.json");
    assert_eq!(gpu["device"], "meta:cuda");
    let peak = |r: &Value| r["peak_allocated_bytes"].as_u64().unwrap();
    // cuBLAS's workspace is allocated when the device opens and held: it adds to every peak.
    let workspace = memfit_cuda::LIBRARY_WORKSPACE_BYTES;
    assert!(peak(&gpu) >= peak(&cpu) + workspace, "{} vs {} + {workspace}", peak(&gpu), peak(&cpu));
    // Deterministic: the same prediction twice.
    let again = report(&[&args[..], &["--device", "meta:cuda"]].concat(), "meta-cuda-2.json");
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "peak_by_category", "num_allocations"] {
        assert_eq!(gpu[key], again[key], "{key}");
    }
}

#[test]
fn plan_for_cuda_needs_no_gpu_and_counts_its_workspace() {
    let plan = |device: &str| {
        let out = memfit(&[
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "256",
            "--memory",
            "64MiB",
            "--device",
            device,
            "--json",
        ]);
        assert!(out.status.success(), "{}", text(&out));
        let mut json = serde_json::from_slice::<Value>(&out.stdout).unwrap();
        json.as_object_mut().unwrap().remove("planning_ms");
        json
    };
    let (cpu, gpu) = (plan("cpu"), plan("cuda"));
    assert_eq!((cpu["target"].as_str(), gpu["target"].as_str()), (Some("cpu"), Some("cuda")));
    assert_eq!(gpu, plan("meta:cuda"), "meta:cuda plans as cuda");
    let workspace = memfit_cuda::LIBRARY_WORKSPACE_BYTES;
    // The same bookkeeping on both (the window's score slots), plus cuBLAS's workspace on the GPU.
    let other = |p: &Value| p["training_at_peak_by_category"]["other"].as_u64().unwrap();
    assert_eq!(other(&gpu), other(&cpu) + workspace, "{gpu}");
    let micro = |p: &Value| p["micro_batch"].as_u64().unwrap();
    // 8 MiB fewer for activations: never a larger micro-batch than on cpu.
    assert!(micro(&gpu) <= micro(&cpu), "{gpu} vs {cpu}");
}

/// `report`, with the emulated GPU (`MEMFIT_CUDA_EMULATOR=1`: memfit's CUDA kernel sources compiled
/// for the host, cuBLAS's contract by its definition) behind `--device cuda`.
fn emulated_report(args: &[&str], name: &str) -> Value {
    emulated_report_as("1", args, name)
}

/// [`emulated_report`] with `MEMFIT_CUDA_EMULATOR=mode`.
fn emulated_report_as(mode: &str, args: &[&str], name: &str) -> Value {
    emulated_report_with(&[("MEMFIT_CUDA_EMULATOR", mode)], args, name)
}

/// `report` on `--device cuda` with the variables `vars` set.
fn emulated_report_with(vars: &[(&str, &str)], args: &[&str], name: &str) -> Value {
    let dir = std::env::temp_dir().join(format!("memfit-cuda-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let all = [args, &["--device", "cuda", "--report", path.to_str().unwrap()]].concat();
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(&all)
        .envs(vars.iter().copied())
        .output()
        .expect("the memfit binary runs");
    assert!(out.status.success(), "memfit {all:?} with {vars:?} failed:\n{}", text(&out));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Every launcher and kernel of the cuda backend runs here, on the emulated GPU: the three model
/// families train (the GPT also with `--precision bf16` and `fp16`), `meta:cuda` predicts each run's peaks (allocated, reserved, by category) to the
/// byte, the losses follow the cpu run's, and recovery from out-of-memory loses no sample.
#[test]
fn an_emulated_gpu_trains_and_meta_cuda_predicts_it_to_the_byte() {
    const GPT: [&str; 14] = [
        "train",
        "--model",
        "gpt",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--context",
        "16",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
        "--no-eval",
    ];
    let gpt_bf16 = [&GPT[..], &["--precision", "bf16"]].concat();
    let gpt_fp16 = [&GPT[..], &["--precision", "fp16"]].concat();
    let cases: [(&str, &[&str]); 8] = [
        ("mlp", &["train", "--model", "mlp", "--max-steps", "3", "--no-eval"]),
        // The optimizer step inside backward: rehearsed on the GPU's allocator, no kernel launched.
        (
            "mlp-in-backward",
            &["train", "--model", "mlp", "--max-steps", "3", "--no-eval", "--optimizer-step", "in-backward"],
        ),
        // 8-bit Adam state: its codes and blocks' maxima, allocated and predicted alike.
        ("mlp-int8", &["train", "--model", "mlp", "--max-steps", "3", "--no-eval", "--optimizer-state", "int8"]),
        // Expandable segments: device pages mapped and unmapped (the emulator's host pages).
        ("mlp-expandable", &["train", "--model", "mlp", "--max-steps", "3", "--no-eval", "--segments", "expandable"]),
        ("simplecnn", &["train", "--model", "simplecnn", "--max-steps", "2", "--no-eval"]),
        ("gpt", &GPT),
        // bf16 products (cuBLAS's tensor-core mode, the attention kernels' rounding) and bf16 storage.
        ("gpt-bf16", &gpt_bf16),
        // fp16 products (cuBLAS's fp16 tensor-core mode) and storage, GradScaler's loss scale.
        ("gpt-fp16", &gpt_fp16),
    ];
    let (mut losses, mut kernels) = (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
    for (name, args) in cases {
        let gpu = emulated_report(args, &format!("{name}-cuda.json"));
        losses.insert(name, gpu["final_train_loss"].clone());
        kernels.insert(name, gpu["kernels_used"].clone());
        assert_eq!(gpu["device"], "cuda", "{name}");
        let meta = report(&[args, &["--device", "meta:cuda"]].concat(), &format!("{name}-meta-cuda.json"));
        for key in [
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "peak_by_category",
            "at_peak_by_category",
            "num_allocations",
        ] {
            assert_eq!(gpu[key], meta[key], "{name}: {key} on the emulated GPU and as meta:cuda predicts it");
        }
        let cpu = report(&[args, &["--device", "cpu"]].concat(), &format!("{name}-cpu.json"));
        // Batches went up through pinned buffers (at least one of the smallest size); none on cpu.
        let pinned = |r: &Value| r["host"]["pinned_bytes"].as_u64().unwrap();
        assert!(pinned(&gpu) >= memfit_cuda::staging::MIN_BUFFER_BYTES as u64, "{name}: {}", gpu["host"]);
        assert_eq!(pinned(&cpu), 0, "{name}");
        let loss = |r: &Value| r["final_train_loss"].as_f64().unwrap();
        assert!(
            (loss(&gpu) - loss(&cpu)).abs() <= 1e-4 * loss(&cpu).abs(),
            "{name}: loss {} on the emulated GPU, {} on cpu",
            loss(&gpu),
            loss(&cpu)
        );
    }
    assert_eq!(losses["mlp-in-backward"], losses["mlp"], "the step inside backward: the same bits on the GPU");
    assert_ne!(losses["gpt-bf16"], losses["gpt"], "bf16 products change the GPU's numbers");
    // Which kernels ran, as the report says: attention on the tensor cores only with rounded
    // products, reading its inputs as saved in 16 bits, in place (Note [Attention's saved
    // operands]); biases
    // in the product's epilogue, of f32 and rounded products alike (the emulator fuses them as
    // cuBLASLt does); a linear layer's weight gradient and the fused linear ops' backward reading
    // their inputs as saved in 16 bits; rounded
    // products' shared operands rounded once, a bias gradient summed from that reading (Note [Held
    // operands] in the cuda backend).
    let used = |name: &str| {
        kernels[name].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    let rounded = [
        "attention: operands read as saved in 16 bits",
        "attention: saved operands read in place",
        "attention: tensor cores",
        "bias: in the product's epilogue (cuBLASLt)",
        "bias: summed as its gradient is rounded",
        "gelu_linear: input read as saved in 16 bits",
        "layer_norm_linear: input read as saved in 16 bits",
        "linear: input read as saved in 16 bits",
        "products: shared operands rounded once",
    ];
    assert_eq!(used("gpt-bf16"), rounded);
    assert_eq!(used("gpt-fp16"), used("gpt-bf16"));
    assert_eq!(used("gpt"), ["attention: CUDA cores, tiled", "bias: in the product's epilogue (cuBLASLt)"]);
    assert_ne!(losses["gpt-fp16"], losses["gpt"], "fp16 products change the GPU's numbers");
    // Injected out-of-memory errors: the failed attempts are dropped and the same samples re-run.
    let args = ["train", "--model", "mlp", "--max-steps", "3", "--no-eval"];
    let plain = emulated_report(&args, "plain.json");
    let injected = emulated_report(&[&args[..], &["--inject-oom", "40"]].concat(), "injected.json");
    assert!(injected["oom_recoveries"].as_u64().unwrap() > 0, "{injected}");
    assert_eq!(plain["final_train_loss"], injected["final_train_loss"], "recovery changed the update");
    assert_eq!(plain["samples_seen"], injected["samples_seen"]);
}

/// `report` on the emulated GPU with CUDA graphs on (`MEMFIT_CUDA_GRAPHS=1`) or off.
fn emulated_report_graphs(graphs: bool, args: &[&str], name: &str) -> Value {
    let vars = [("MEMFIT_CUDA_EMULATOR", "1"), ("MEMFIT_CUDA_GRAPHS", if graphs { "1" } else { "0" })];
    emulated_report_with(&vars, args, name)
}

/// CUDA graphs (Note [CUDA graphs] in memfit-cuda) replay exactly the work asked for: with them on,
/// the same losses to the bit and the same peaks as without, while most of the work runs inside
/// graph launches (AdamW's step count given to its node before each replay), through evaluation's
/// other shapes, fp16's loss scale, accumulation and recovery from out-of-memory.
#[test]
fn cuda_graphs_replay_exactly_the_work_asked_for() {
    let gpt = ["train", "--model", "gpt", "--layers", "1", "--d-model", "32", "--context", "16", "--batch-size", "4"];
    let gpt = [&gpt[..], &["--max-steps", "5", "--no-eval"]].concat();
    let gpt_fp16 = [&gpt[..], &["--precision", "fp16"]].concat();
    // The optimizer step inside backward (each parameter's update a chunk's work, its step count
    // set anew every step) and expandable segments (pages mapped and unmapped: boundaries).
    let gpt_in_backward = [&gpt[..], &["--optimizer-step", "in-backward"]].concat();
    let gpt_expandable = [&gpt[..], &["--segments", "expandable"]].concat();
    let mlp = ["train", "--model", "mlp", "--max-steps", "4", "--batch-size", "64", "--micro-batch", "32"];
    let mlp_injected = [&mlp[..], &["--no-eval", "--inject-oom", "40"]].concat();
    let cases: [(&str, &[&str]); 6] = [
        ("gpt", &gpt),
        ("gpt-fp16", &gpt_fp16),
        ("gpt-in-backward", &gpt_in_backward),
        ("gpt-expandable", &gpt_expandable),
        ("mlp-eval-accumulated", &mlp),
        ("mlp-injected", &mlp_injected),
    ];
    for (name, args) in cases {
        let off = emulated_report_graphs(false, args, &format!("{name}-graphs-off.json"));
        let on = emulated_report_graphs(true, args, &format!("{name}-graphs-on.json"));
        for key in
            ["final_train_loss", "final_eval_loss", "peak_allocated_bytes", "peak_reserved_bytes", "samples_seen"]
        {
            assert_eq!(on[key], off[key], "{name}: {key} with CUDA graphs and without");
        }
        let (l_on, l_off) = (&on["launches"], &off["launches"]);
        let count = |l: &Value, key: &str| l[key].as_u64().unwrap();
        assert_eq!(count(l_on, "asked"), count(l_off, "asked"), "{name}: the same work asked for");
        assert_eq!(count(l_off, "queued"), count(l_off, "asked"), "{name}: without graphs each op queued alone");
        assert_eq!((count(l_off, "graph_launches"), l_off["graphs"].as_bool()), (0, Some(false)), "{name}");
        assert!(l_on["graphs_off"].is_null(), "{name}: {l_on}");
        assert!(
            count(l_on, "captured") > 0 && count(l_on, "graph_launches") > count(l_on, "captured"),
            "{name}: {l_on}"
        );
        assert!(count(l_on, "queued") < count(l_off, "queued"), "{name}: {l_on}");
        if name.starts_with("gpt") {
            // Five steps: the first two alone (the first makes the optimizer's state), the third
            // captured, the fourth and fifth replayed (the fifth's last chunk differs: the check
            // of the parameters after the last step). (The mlp's evaluation writes each
            // micro-batch's scores into its own slot, so its chunks repeat only after 32.)
            assert!(3 * count(l_on, "replayed") > count(l_on, "asked"), "{name}: {l_on}");
            assert!(3 * count(l_on, "queued") < 2 * count(l_off, "queued"), "{name}: {l_on}");
            assert!(count(l_on, "updated") > 0, "{name}: AdamW's step count changes every step: {l_on}");
        }
    }
}

/// `bench` prints a timed step's work on a GPU and how it was queued: each op alone without CUDA
/// graphs (saying how to turn them on), as graph launches with them (the host-only emulator: the
/// counts are the host's, as on a GPU).
#[test]
fn bench_says_how_a_steps_work_was_queued() {
    let bench = |graphs: &str, json: bool| {
        let args = ["bench", "--model", "gpt", "--device", "cuda", "--steps", "3", "--warmup", "2"];
        let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
            .args(if json { [&args[..], &["--json"]].concat() } else { args.to_vec() })
            .env("MEMFIT_CUDA_EMULATOR", "host")
            .env("MEMFIT_CUDA_GRAPHS", graphs)
            .output()
            .expect("the memfit binary runs");
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let line = |graphs: &str| {
        let stdout = bench(graphs, false);
        stdout
            .lines()
            .find(|l| l.starts_with("gpt-b32: a step: "))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("{stdout}"))
    };
    let (off, on) = (line("0"), line("1"));
    let asked =
        |l: &str| l.split(" launches, products and copies").next().unwrap().rsplit(' ').next().unwrap().to_string();
    assert!(off.ends_with(", each queued alone (CUDA graphs off; MEMFIT_CUDA_GRAPHS=1 turns them on)"), "{off}");
    assert_eq!(asked(&on), asked(&off), "the same work asked for: {on} / {off}");
    assert!(asked(&off).parse::<u64>().unwrap() > 100, "{off}");
    // Warmed up, a timed step's chunks are graphs' by then: a few graph launches, and few ops
    // queued alone (the run's last step checks the parameters, a chunk of its own).
    let queued = on.split(", queued as ").nth(1).unwrap_or_else(|| panic!("{on}"));
    let numbers: Vec<u64> = queued.split(' ').filter_map(|w| w.parse().ok()).collect();
    let asked: u64 = asked(&on).parse().unwrap();
    assert!(queued.ends_with(" alone (CUDA graphs)") && numbers.len() == 2, "{on}");
    assert!((1..10).contains(&numbers[0]) && numbers[1] * 10 < asked, "{on}");
    // The line's numbers are the report's: graph launches, and the calls queued less them.
    let report: Value = serde_json::from_str(&bench("1", true)).unwrap();
    let l = &report["cases"][0]["launches"];
    let (queued, launched) = (l["queued"].as_f64().unwrap(), l["graph_launches"].as_f64().unwrap());
    assert_eq!((launched.round() as u64, (queued - launched).round() as u64), (numbers[0], numbers[1]), "{l}");
    assert_eq!((l["graphs"].as_bool(), l["asked"].as_f64().unwrap().round() as u64), (Some(true), asked), "{l}");
}

/// `MEMFIT_CUDA_EMULATOR=host`: the emulated GPU with no arithmetic (a step's host work alone, what
/// a GPU step cannot go below) takes the paths a GPU takes, with its allocations: meta:cuda's peaks
/// to the byte, attention on the tensor cores (their check still runs), and losses of zero (nothing
/// computed them).
#[test]
fn the_host_only_emulator_allocates_as_the_gpu_without_arithmetic() {
    let args = ["train", "--model", "gpt", "--layers", "1", "--d-model", "32", "--context", "16", "--batch-size", "4"];
    let args = [&args[..], &["--max-steps", "2", "--no-eval", "--precision", "bf16"]].concat();
    let host = emulated_report_as("host", &args, "host-only.json");
    let meta = report(&[&args[..], &["--device", "meta:cuda"]].concat(), "host-only-meta-cuda.json");
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "peak_by_category", "num_allocations"] {
        assert_eq!(host[key], meta[key], "{key}");
    }
    assert_eq!(
        host["kernels_used"],
        serde_json::json!([
            "attention: operands read as saved in 16 bits",
            "attention: saved operands read in place",
            "attention: tensor cores",
            "bias: in the product's epilogue (cuBLASLt)",
            "bias: summed as its gradient is rounded",
            "gelu_linear: input read as saved in 16 bits",
            "layer_norm_linear: input read as saved in 16 bits",
            "linear: input read as saved in 16 bits",
            "products: shared operands rounded once"
        ])
    );
    assert_eq!(host["final_train_loss"].as_f64(), Some(0.0), "{}", host["final_train_loss"]);
}
