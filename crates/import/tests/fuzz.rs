//! Fuzzing the importer: every fixture's graph (`models/model.json`) mutated where a user's or a
//! broken exporter's file would differ: an argument's number, list or name changed, a node's op
//! swapped for another memfit imports, an argument or an output dropped. Opening the archive, making
//! the program on `meta` and `cpu` and running a pass must give a value or an error; never a panic,
//! and never an allocation sized by what the file claims beyond the device's (capped) memory.
//! `MEMFIT_FUZZ_CASES=N` runs N cases (default 256); `MEMFIT_FUZZ_SEED` another seed.

use memfit_import::{Archive, Program, SUPPORTED_OPS};
use memfit_tensor::{Category, DType, Device, DeviceConfig, DeviceKind, Tensor};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};

fn config() -> Config {
    let env = |key: &str| std::env::var(key).ok().and_then(|v| v.parse::<u64>().ok());
    let cases = env("MEMFIT_FUZZ_CASES").map_or(256, |n| n.min(u32::MAX as u64) as u32);
    Config { cases, rng_seed: RngSeed::Fixed(env("MEMFIT_FUZZ_SEED").unwrap_or(0x5eed)), ..Config::default() }
}

const FIXTURES: [&str; 8] = [
    "tiny_ops",
    "tiny_vit",
    "tiny_swin",
    "tiny_gpt",
    "tiny_resnet",
    "tiny_mobile",
    "tiny_stochastic",
    "tiny_attention_pool",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(format!("{name}.pt2"))
}

/// The archive's entries, read once per fixture.
fn entries(path: &Path) -> Vec<(String, Vec<u8>)> {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(path).unwrap()).unwrap();
    (0..zip.len())
        .map(|i| {
            let mut entry = zip.by_index(i).unwrap();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
            (entry.name().to_string(), bytes)
        })
        .collect()
}

fn write(path: &Path, entries: &[(String, Vec<u8>)]) {
    let mut out = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in entries {
        out.start_file(name.as_str(), options).unwrap();
        out.write_all(bytes).unwrap();
    }
    out.finish().unwrap();
}

/// A small deterministic generator for the mutations' choices.
struct Pick(u64);
impl Pick {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Numbers a file may hold where a size or a dimension is expected.
const ODD_INTS: [i64; 9] = [0, -1, -2, 1, 2, 3, 7, 1 << 40, i64::MAX];

/// One mutation of the graph's nodes, chosen by `pick`.
fn mutate(model: &mut Value, pick: &mut Pick) {
    let Some(nodes) = model["graph_module"]["graph"]["nodes"].as_array_mut() else { return };
    if nodes.is_empty() {
        return;
    }
    let at = pick.below(nodes.len());
    let node = &mut nodes[at];
    match pick.below(5) {
        // An op swapped for another memfit imports.
        0 => node["target"] = Value::String(SUPPORTED_OPS[pick.below(SUPPORTED_OPS.len())].to_string()),
        // An argument dropped.
        1 => {
            if let Some(inputs) = node["inputs"].as_array_mut() {
                if !inputs.is_empty() {
                    let i = pick.below(inputs.len());
                    inputs.remove(i);
                }
            }
        }
        // An output dropped, or one more.
        2 => {
            if let Some(outputs) = node["outputs"].as_array_mut() {
                match outputs.pop() {
                    Some(o) if pick.below(2) == 0 => {
                        outputs.push(o.clone());
                        outputs.push(o);
                    }
                    _ => {}
                }
            }
        }
        // A number or a list of numbers changed.
        _ => {
            let Some(inputs) = node["inputs"].as_array_mut() else { return };
            if inputs.is_empty() {
                return;
            }
            let at = pick.below(inputs.len());
            let arg = &mut inputs[at]["arg"];
            let odd = ODD_INTS[pick.below(ODD_INTS.len())];
            if arg.get("as_int").is_some() {
                arg["as_int"] = odd.into();
            } else if let Some(list) = arg.get_mut("as_ints").and_then(Value::as_array_mut) {
                match pick.below(3) {
                    0 => list.clear(),
                    1 => list.push(odd.into()),
                    _ => {
                        if !list.is_empty() {
                            let i = pick.below(list.len());
                            list[i] = odd.into();
                        }
                    }
                }
            } else if arg.get("as_float").is_some() {
                arg["as_float"] = [f64::NAN, -1.0, 0.0, 1e30][pick.below(4)].into();
            } else if let Some(t) = arg.get_mut("as_tensor") {
                // Another value's name (made later, or never).
                t["name"] = ["x", "nothing", "linear", "p_fc_weight"][pick.below(4)].into();
            }
        }
    }
}

/// Opens the mutated archive and runs a training pass on `meta` and `cpu` (capped): any value or
/// error is fine; a panic fails the case.
fn run(path: &Path) {
    let Ok(archive) = Archive::open(path) else { return };
    let archive = std::sync::Arc::new(archive);
    for kind in [DeviceKind::META, DeviceKind::Cpu] {
        let device = Device::new(DeviceConfig::new(kind).capacity(Some(64 << 20))).unwrap();
        let Ok(program) = Program::new(archive.clone(), &device) else { continue };
        let input = match program.archive().name.as_str() {
            "tiny_gpt" => Tensor::zeros(&device, &[2, 8], DType::I64, Category::Input),
            _ => Tensor::zeros(&device, &[2, 1, 28, 28], DType::F32, Category::Input),
        };
        let Ok(x) = input else { continue };
        let flags = vec![true; program.segments().len()];
        let _ = program.forward_checkpointed(&x, true, &flags).and_then(|y| {
            let loss = y.sum_all()?;
            memfit_tensor::autograd::backward(&loss)
        });
        let _ = program.forward(&x, false);
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_mutated_graph_opens_and_runs_or_is_an_error_never_a_panic(
        which in 0..FIXTURES.len(),
        seed in any::<u64>(),
        count in 1usize..4,
    ) {
        let name = FIXTURES[which];
        let mut files = entries(&fixture(name));
        let (i, bytes) = files
            .iter()
            .enumerate()
            .find(|(_, (n, _))| n.ends_with("models/model.json"))
            .map(|(i, (_, b))| (i, b.clone()))
            .unwrap();
        let mut model: Value = serde_json::from_slice(&bytes).unwrap();
        let mut pick = Pick(seed);
        for _ in 0..count {
            mutate(&mut model, &mut pick);
        }
        files[i].1 = serde_json::to_vec(&model).unwrap();
        let dir = std::env::temp_dir().join(format!("memfit-import-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.pt2"));
        write(&path, &files);
        run(&path);
    }
}
