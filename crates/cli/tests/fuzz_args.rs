//! Fuzzing the command line (issue 12): combinations of `train` and `plan` flags, each value drawn
//! from sensible, boundary and absurd ones, run on the `meta` device (fast: nothing computes). Every
//! combination must end within seconds with exit code 0, or 1 and one `error:` line; never a panic,
//! a signal, a hang or clap's own exit code. `MEMFIT_FUZZ_CASES=N` runs N combinations (default 48:
//! each is a process).

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `MEMFIT_FUZZ_CASES` cases (default 48) from seed `MEMFIT_FUZZ_SEED` (default fixed, so a
/// CI run is reproducible; give another seed, or many cases, to explore).
fn config() -> Config {
    let env = |key: &str| std::env::var(key).ok().and_then(|v| v.parse::<u64>().ok());
    let cases = env("MEMFIT_FUZZ_CASES").map_or(48, |n| n.min(u32::MAX as u64) as u32);
    Config { cases, rng_seed: RngSeed::Fixed(env("MEMFIT_FUZZ_SEED").unwrap_or(0x5eed)), ..Config::default() }
}

fn value(choices: &'static [&'static str]) -> impl Strategy<Value = String> {
    proptest::sample::select(choices).prop_map(str::to_string)
}

/// One optional flag: absent, a sensible value (`good`, three times as likely) or any of `bad`.
fn flag(
    name: &'static str,
    good: &'static [&'static str],
    bad: &'static [&'static str],
) -> impl Strategy<Value = Vec<String>> {
    let v = prop_oneof![3 => value(good), 1 => value(bad)];
    proptest::option::of(v).prop_map(move |v| v.map(|v| vec![name.to_string(), v]).unwrap_or_default())
}

fn args() -> impl Strategy<Value = Vec<String>> {
    const NUMBERS: &[&str] = &["0", "-1", "1000000000", "18446744073709551615", "9223372036854775808", "x", ""];
    (
        value(&["train", "plan"]),
        flag("--model", &["mlp", "simplecnn", "deepcnn", "resnet", "gpt"], &["vgg", ""]),
        flag("--batch-size", &["1", "2", "7", "64"], NUMBERS),
        flag("--micro-batch", &["1", "2", "7", "64"], NUMBERS),
        flag("--max-steps", &["1", "2"], &["0", "-3", "4294967297"]),
        flag("--memory", &["64MiB", "2MiB", "1024TiB"], &["1KiB", "0", "2048TiB", "12XB", "nan", "-5MiB"]),
        flag("--lr", &["0.001", "1e300"], &["0", "-1", "inf", "nan", "abc"]),
        flag("--threads", &["1", "2"], &["0", "100000", "-2"]),
        flag("--safety-margin", &["0", "0.1", "0.5"], &["0.9", "nan", "-0.1"]),
        (
            flag("--checkpoint", &["none", "all", "blocks.0", "layer1"], &["nope", ""]),
            flag("--precision", &["fp32", "bf16", "fp16"], &["fp8", "", "BF16"]),
        ),
        flag("--context", &["8", "1"], &["0", "70000"]),
        flag("--heads", &["2", "1"], &["0", "3"]),
    )
        .prop_map(|(cmd, a, b, c, d, e, f, g, h, i, j, k)| {
            let mut out = vec![cmd.clone()];
            for part in [a, b, c, e, i.0, i.1, j, k] {
                out.extend(part);
            }
            if cmd == "train" {
                for part in [d, f, g, h] {
                    out.extend(part);
                }
                out.extend(["--device", "meta", "--data", "embedded", "--no-eval"].map(String::from));
                if !out.iter().any(|a| a == "--max-steps") {
                    out.extend(["--max-steps", "1"].map(String::from));
                }
            } else {
                if !out.iter().any(|a| a == "--memory") {
                    out.extend(["--memory", "64MiB"].map(String::from));
                }
                if !out.iter().any(|a| a == "--batch-size") {
                    out.extend(["--batch-size", "32"].map(String::from));
                }
            }
            out
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_flag_combination_ends_quickly_with_success_or_one_clear_error(args in args()) {
        let started = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let limit = Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() && started.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        let finished = child.try_wait().unwrap().is_some();
        if !finished {
            child.kill().unwrap();
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        prop_assert!(finished, "{:?} still ran after {:?}", args, limit);
        prop_assert!(!stderr.contains("panicked"), "{:?}: {}", args, stderr);
        match out.status.code() {
            Some(0) => {}
            Some(1) => {
                let errors = stderr.lines().filter(|l| l.starts_with("error:")).count();
                prop_assert_eq!(errors, 1, "{:?}: {}", args, stderr);
                prop_assert!(!stderr.contains("error: error"), "{:?}: {}", args, stderr);
            }
            other => prop_assert!(false, "{:?} exited with {:?}: {}", args, other, stderr),
        }
    }
}
