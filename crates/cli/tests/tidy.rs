//! House rules checked on every source file of the workspace: a `//!` doc saying what the file owns,
//! a `// SAFETY:` comment before every `unsafe` block, and no ignored tests.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_source_file_is_documented_and_every_unsafe_is_justified() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    rust_files(crates, &mut files);
    assert!(files.len() > 30, "found the sources ({})", files.len());
    // Built at run time so that this file's own text does not match.
    let (unsafe_block, unsafe_impl, ignore) =
        (["unsafe", " {"].concat(), ["unsafe", " impl"].concat(), ["#[", "ignore"].concat());
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let name = file.strip_prefix(crates).unwrap().display().to_string();
        if !text.trim_start().starts_with("//!") {
            problems.push(format!("{name}: no //! module doc at the top"));
        }
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains(&unsafe_block) || code.contains(&unsafe_impl) {
                let justified = lines[i.saturating_sub(6)..=i].iter().any(|l| l.contains("SAFETY:"));
                if !justified {
                    problems.push(format!("{name}:{}: unsafe without a // SAFETY: comment", i + 1));
                }
            }
            if code.trim_start().starts_with(&ignore) {
                problems.push(format!("{name}:{}: ignored test", i + 1));
            }
        }
    }
    assert!(problems.is_empty(), "house rules broken:\n{}", problems.join("\n"));
}
