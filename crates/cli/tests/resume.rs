//! Signals end to end: `memfit train` as a child process gets SIGINT after its first checkpoint, exits
//! with 130 and the command that resumes it; `memfit train --resume DIR` then ends with the parameters
//! of an uninterrupted run, byte for byte. SIGTERM exits with 143.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-cli-resume-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const RUN: &[&str] = &[
    "train",
    "--data",
    "embedded",
    "--model",
    "simplecnn",
    "--batch-size",
    "8",
    "--micro-batch",
    "4",
    "--max-steps",
    "400",
    "--no-eval",
    "--threads",
    "2",
    "--seed",
    "3",
];

/// The tensors of a safetensors file with the bits of every value, and its metadata.
fn tensors(path: &Path) -> (Vec<(String, Vec<usize>, Vec<u64>)>, Option<std::collections::HashMap<String, String>>) {
    let device = memfit_tensor::Device::cpu();
    let named = memfit_nn::checkpoint::load_named(path, &device, memfit_tensor::Category::Parameter).unwrap();
    let values = named
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect()))
        .collect();
    (values, memfit_nn::checkpoint::read_metadata(path).unwrap())
}

/// Starts `memfit args`, waits for a stderr line starting with `wait_for`, sends `signal`, and returns
/// the exit code and all of stderr.
fn interrupt(args: &[&str], wait_for: &str, signal: &str) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memfit starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with(wait_for) {
            break;
        }
    }
    assert!(seen.lines().any(|l| l.starts_with(wait_for)), "memfit never printed {wait_for:?}:\n{seen}");
    let sent = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    for line in lines {
        seen.push_str(&line.unwrap());
        seen.push('\n');
    }
    (child.wait().unwrap().code(), seen)
}

#[test]
fn sigint_writes_a_checkpoint_exits_130_and_the_resumed_run_ends_bit_identical() {
    let dir = scratch("sigint");
    let save_dir = dir.join("ckpt");
    let (save_dir_s, out) = (save_dir.to_str().unwrap(), dir.join("model.safetensors"));
    let mut args = RUN.to_vec();
    args.extend(["--save-every", "1", "--save-dir", save_dir_s, "--save", out.to_str().unwrap()]);
    let (code, stderr) = interrupt(&args, "checkpoint ", "-INT");
    assert_eq!(code, Some(130), "{stderr}");
    assert!(stderr.contains("interrupted by SIGINT after step"), "{stderr}");
    let resume_command = format!("memfit train --resume {save_dir_s}");
    assert!(stderr.contains(&resume_command), "{stderr}");
    assert!(!out.exists(), "an interrupted run saves no final weights");

    // The command it printed: the checkpoint supplies every setting, --save included.
    let resumed = Command::new(env!("CARGO_BIN_EXE_memfit")).args(["train", "--resume", save_dir_s]).output().unwrap();
    let text = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{text}");
    assert!(String::from_utf8_lossy(&resumed.stdout).contains("for 400 steps (3200 samples"), "{text}");

    let full = dir.join("full.safetensors");
    let mut args = RUN.to_vec();
    args.extend(["--save", full.to_str().unwrap()]);
    let plain = Command::new(env!("CARGO_BIN_EXE_memfit")).args(&args).output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    assert!(tensors(&out) == tensors(&full), "the resumed run's parameters differ from the uninterrupted run's");

    // A flag that would change the run is refused by name, before any work.
    let refused = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["train", "--resume", save_dir_s, "--lr", "0.1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{text}");
    assert!(text.contains("--lr 0.1 differs from the run being resumed"), "{text}");
}

#[test]
fn sigterm_exits_143_and_says_nothing_can_be_resumed_without_a_save_dir() {
    let (code, stderr) = interrupt(RUN, "step ", "-TERM");
    assert_eq!(code, Some(143), "{stderr}");
    assert!(stderr.contains("interrupted by SIGTERM") && stderr.contains("nothing can be resumed"), "{stderr}");
}
