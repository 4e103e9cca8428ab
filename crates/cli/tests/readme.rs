//! The README's examples print what memfit prints: every output block that starts with `$ memfit ...`
//! is run and compared line by line (a line `  ...` stands for lines left out; timings, which vary, are
//! compared up to the number), and every inline claim "`memfit ...` completes with `...`" is run and
//! checked.

use std::path::{Path, PathBuf};
use std::process::Command;

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md")).unwrap()
}

/// A cost cache holding the step-time calibration the README's plans were printed with
/// (`tests/fixtures/costs.json`, the same for every instruction set and for 1 or 2 threads; the
/// GPT's entries with 8-bit Adam state are its fp32 ones with the optimizer update 5.36x longer, the
/// ratio measured on an AMD EPYC: 12.8 against 2.4 ms), copied
/// to a directory of its own: a plan's choices follow measured step times, which vary from machine to
/// machine and run to run, so the README's outputs are reproduced from pinned ones.
fn pinned_costs() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-readme-costs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/costs.json");
    std::fs::copy(fixture, dir.join("costs.json")).unwrap();
    dir
}

/// Runs `memfit ARGS` (split on spaces) with the pinned costs and returns stdout and stderr, in that
/// order.
fn run(command: &str) -> String {
    let args: Vec<&str> = command.trim().strip_prefix("memfit ").unwrap().split_whitespace().collect();
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(&args)
        .env("MEMFIT_CACHE_DIR", pinned_costs())
        .output()
        .unwrap();
    // Progress lines ("data: ...", "step ...") go to stderr between the output lines; the README
    // shows stdout and the error message.
    let stderr: String = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.starts_with("data: ") && !l.starts_with("step "))
        .map(|l| format!("{l}\n"))
        .collect();
    format!("{}{stderr}", String::from_utf8_lossy(&out.stdout))
}

/// A line up to its first timing ("... 4.5 ms ..."), which varies from run to run.
fn untimed(line: &str) -> &str {
    match line.find(" ms") {
        Some(end) => {
            let start = line[..end].rfind(' ').unwrap_or(0);
            &line[..start]
        }
        None => line,
    }
}

#[test]
fn every_readme_output_block_is_what_memfit_prints() {
    let text = readme();
    let mut blocks = 0;
    for block in text.split("```").skip(1).step_by(2) {
        let mut lines = block.lines().skip(1); // the fence's language tag
        let Some(command) = lines.next().and_then(|l| l.strip_prefix("$ ")) else { continue };
        blocks += 1;
        let expected: Vec<&str> = lines.collect();
        let actual = run(command);
        let actual: Vec<&str> = actual.lines().collect();
        let mut at = 0;
        let mut skipping = false;
        for want in expected {
            if want.trim() == "..." {
                skipping = true;
                continue;
            }
            while skipping && at < actual.len() && untimed(actual[at]) != untimed(want) {
                at += 1;
            }
            skipping = false;
            let got = actual.get(at).copied().unwrap_or("<end of output>");
            assert_eq!(
                untimed(got),
                untimed(want),
                "`{command}`: line {} differs; it printed:\n{}",
                at + 1,
                actual.join("\n")
            );
            at += 1;
        }
    }
    assert!(blocks >= 3, "found the README's output blocks ({blocks})");
}

#[test]
fn every_readme_claim_of_what_a_run_ends_with_holds() {
    let text = readme().replace('\n', " ");
    let mut claims = 0;
    for (i, _) in text.match_indices("` completes with `") {
        let command = &text[text[..i].rfind('`').unwrap() + 1..i];
        let rest = &text[i + "` completes with `".len()..];
        let claim = &rest[..rest.find('`').unwrap()];
        let out = run(command);
        assert!(out.contains(claim), "`{command}` should end with {claim:?}; it printed:\n{out}");
        claims += 1;
    }
    assert!(claims >= 1, "found the README's claims");
}
