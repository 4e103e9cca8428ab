//! Fuzzing the safetensors checkpoint reader (issue 12): from seeds that are real checkpoints (a
//! zoo model's `state_dict` with memfit's metadata, a tensor of every dtype) and hand-made headers,
//! mutated by proptest (bytes flipped, inserted, removed, the header length field rewritten, the
//! file cut or grown). Loading must give tensors that match the header or an error naming the file;
//! never a panic or an allocation the file does not justify. `MEMFIT_FUZZ_CASES=N` runs N cases
//! (default 256).

use memfit_nn::checkpoint::{load_named, read_metadata, to_bytes};
use memfit_nn::{build_model, ModelKind, ModelSpec};
use memfit_tensor::{Category, Device, Tensor};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::collections::HashMap;
use std::path::Path;

/// `MEMFIT_FUZZ_CASES` cases (default 256) from seed `MEMFIT_FUZZ_SEED` (default fixed, so a
/// CI run is reproducible; give another seed, or many cases, to explore).
fn config() -> Config {
    let env = |key: &str| std::env::var(key).ok().and_then(|v| v.parse::<u64>().ok());
    let cases = env("MEMFIT_FUZZ_CASES").map_or(256, |n| n.min(u32::MAX as u64) as u32);
    Config { cases, rng_seed: RngSeed::Fixed(env("MEMFIT_FUZZ_SEED").unwrap_or(0x5eed)), ..Config::default() }
}

fn seeds() -> Vec<Vec<u8>> {
    let device = Device::cpu();
    let model = build_model(&ModelSpec::image(ModelKind::SimpleCnn, [1, 6, 6], 3), &device, 0).unwrap();
    let mut named = model.parameters();
    named.extend(model.buffers());
    let meta = HashMap::from([("memfit.model".to_string(), "simplecnn".to_string())]);
    let model_file = to_bytes(Path::new("seed"), &named, Some(meta)).unwrap();
    let mixed = vec![
        ("f32".to_string(), Tensor::from_slice(&device, &[1.0f32, -2.0], &[2], Category::Parameter).unwrap()),
        ("f64".to_string(), Tensor::from_slice(&device, &[0.5f64], &[1, 1], Category::Parameter).unwrap()),
        ("i64".to_string(), Tensor::from_slice(&device, &[7i64, 8, 9], &[3], Category::Parameter).unwrap()),
        ("empty".to_string(), Tensor::from_slice::<f32>(&device, &[], &[0, 4], Category::Parameter).unwrap()),
    ];
    let mixed_file = to_bytes(Path::new("seed"), &mixed, None).unwrap();
    let header = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut hand = (header.len() as u64).to_le_bytes().to_vec();
    hand.extend_from_slice(header);
    hand.extend_from_slice(&1.0f32.to_le_bytes());
    vec![model_file, mixed_file, hand, u64::MAX.to_le_bytes().to_vec(), Vec::new()]
}

fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let seeds = seeds();
    let n = seeds.len();
    (
        0..n,
        proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<usize>()),
        proptest::collection::vec(any::<u8>(), 0..16),
    )
        .prop_map(move |(i, edits, header_len, cut, tail)| {
            let mut b = seeds[i].clone();
            for (pos, byte, kind) in edits {
                let at = if b.is_empty() { 0 } else { pos % (b.len() + 1) };
                match kind {
                    0 if at < b.len() => b[at] = byte,
                    1 => b.insert(at, byte),
                    _ if at < b.len() => {
                        b.remove(at);
                    }
                    _ => {}
                }
            }
            if let (Some(len), true) = (header_len, b.len() >= 8) {
                // Often a small lie, sometimes a huge one.
                let len = if len % 2 == 0 { len % 4096 } else { len };
                b[..8].copy_from_slice(&len.to_le_bytes());
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            b.extend(tail);
            b
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_checkpoint_loads_or_is_refused_naming_the_file(bytes in mutated()) {
        let dir = std::env::temp_dir().join(format!("memfit-fuzz-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fuzz.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        match load_named(&path, &Device::cpu(), Category::Parameter) {
            Ok(tensors) => {
                let bytes_held: usize = tensors.iter().map(|(_, t)| t.numel() * t.dtype().size()).sum();
                prop_assert!(bytes_held <= bytes.len(), "{} bytes of tensors from a {}-byte file", bytes_held, bytes.len());
            }
            Err(e) => prop_assert!(e.to_string().contains("fuzz.safetensors"), "{}", e),
        }
        if let Err(e) = read_metadata(&path) {
            prop_assert!(e.to_string().contains("fuzz.safetensors"), "{}", e);
        }
    }
}
