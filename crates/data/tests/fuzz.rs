//! Fuzzing the data readers (issue 12): IDX image and label files and text files, from seeds that are
//! real files (the shipped Fashion-MNIST subset and Moby Dick) and small hand-made ones, mutated by
//! proptest (bytes flipped, inserted, removed, the file cut short or grown, gzip or not). A reader
//! must return a value or an error that names the file; it must never panic, hang or allocate without
//! bound. `MEMFIT_FUZZ_CASES=N` runs N cases per target (default 256, CI's bounded run); failures
//! proptest finds are kept in `fuzz.proptest-regressions` beside this file and replayed first.

use flate2::read::GzDecoder;
use memfit_data::{load_text, read_idx_images_from_bytes, read_idx_labels_from_bytes};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::io::Read;

/// `MEMFIT_FUZZ_CASES` cases (default 256) from seed `MEMFIT_FUZZ_SEED` (default fixed, so a
/// CI run is reproducible; give another seed, or many cases, to explore).
fn config() -> Config {
    let env = |key: &str| std::env::var(key).ok().and_then(|v| v.parse::<u64>().ok());
    let cases = env("MEMFIT_FUZZ_CASES").map_or(256, |n| n.min(u32::MAX as u64) as u32);
    Config { cases, rng_seed: RngSeed::Fixed(env("MEMFIT_FUZZ_SEED").unwrap_or(0x5eed)), ..Config::default() }
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    GzDecoder::new(bytes).read_to_end(&mut out).unwrap();
    out
}

/// Seed files: the first images and labels of the shipped subset (cut to a few samples so a case is
/// cheap), plus hand-made headers.
fn idx_seeds() -> Vec<Vec<u8>> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/");
    let images = gunzip(&std::fs::read(format!("{dir}t10k-images-idx3-ubyte.gz")).unwrap());
    let labels = gunzip(&std::fs::read(format!("{dir}t10k-labels-idx1-ubyte.gz")).unwrap());
    let mut few_images = images[..16 + 3 * 784].to_vec();
    few_images[4..8].copy_from_slice(&3u32.to_be_bytes());
    let mut few_labels = labels[..8 + 3].to_vec();
    few_labels[4..8].copy_from_slice(&3u32.to_be_bytes());
    let tiny = [0u8, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 2, 1, 2, 3, 4].to_vec();
    let huge_dims = [0u8, 0, 8, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff].to_vec();
    vec![few_images, few_labels, tiny, huge_dims, Vec::new()]
}

/// A mutation of one seed: edits at positions, then maybe a cut or an extension, maybe gzip.
fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    (
        0..n,
        proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8),
        proptest::option::of(any::<usize>()),
        proptest::collection::vec(any::<u8>(), 0..16),
        any::<bool>(),
    )
        .prop_map(move |(i, edits, cut, tail, gzip)| {
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
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            b.extend(tail);
            if gzip {
                use flate2::write::GzEncoder;
                use std::io::Write;
                let mut e = GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(&b).unwrap();
                b = e.finish().unwrap();
            }
            b
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn idx_readers_return_a_value_or_an_error_naming_the_file(bytes in mutated(idx_seeds())) {
        match read_idx_images_from_bytes("fuzz-images", &bytes) {
            Ok(images) => prop_assert_eq!(images.pixels.len(), images.count * images.rows * images.cols),
            Err(e) => prop_assert!(e.to_string().contains("fuzz-images"), "{}", e),
        }
        match read_idx_labels_from_bytes("fuzz-labels", &bytes) {
            Ok(labels) => prop_assert!(labels.len() <= bytes.len()),
            Err(e) => prop_assert!(e.to_string().contains("fuzz-labels"), "{}", e),
        }
    }

    #[test]
    fn the_text_reader_returns_a_corpus_or_an_error_naming_the_file(
        bytes in mutated(vec![b"Call me Ishmael.".to_vec(), "caf\u{e9} \u{1f40b}\n".as_bytes().to_vec(), vec![0xff, 0xfe], Vec::new()])
    ) {
        let dir = std::env::temp_dir().join(format!("memfit-fuzz-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fuzz.txt");
        std::fs::write(&path, &bytes).unwrap();
        match load_text(&path) {
            Ok(corpus) => prop_assert!(!corpus.vocab.is_empty() && !(corpus.train.is_empty() && corpus.val.is_empty())),
            Err(e) => prop_assert!(e.to_string().contains("fuzz.txt"), "{}", e),
        }
    }
}
