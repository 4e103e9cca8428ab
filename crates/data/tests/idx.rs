//! IDX reader/writer tests: round trips, and every kind of damaged file.

mod common;

use common::{images, labels, TempDir};
use memfit_data::*;

#[test]
fn round_trip_images_and_labels_gzip_and_raw() {
    let dir = TempDir::new("roundtrip");
    let imgs = images(5, 3, 4);
    let labs = labels(5);
    for gzip in [true, false] {
        let ip = dir.join(&format!("imgs-{gzip}"));
        let lp = dir.join(&format!("labs-{gzip}"));
        write_idx_images(&ip, &imgs, gzip).unwrap();
        write_idx_labels(&lp, &labs, gzip).unwrap();
        assert_eq!(is_gzip(&std::fs::read(&ip).unwrap()), gzip);
        let back = read_idx_images(&ip).unwrap();
        assert_eq!(back, imgs);
        assert_eq!((back.count, back.rows, back.cols, back.image_size()), (5, 3, 4, 12));
        assert_eq!(back.image(1), &imgs.pixels[12..24]);
        assert_eq!(read_idx_labels(&lp).unwrap(), labs);
    }
}

#[test]
fn round_trip_from_bytes() {
    let imgs = images(2, 28, 28);
    for gzip in [true, false] {
        let b = encode_idx_images(&imgs, gzip);
        assert_eq!(read_idx_images_from_bytes("x", &b).unwrap(), imgs);
        let l = encode_idx_labels(&[3, 1, 4], gzip);
        assert_eq!(read_idx_labels_from_bytes("y", &l).unwrap(), vec![3, 1, 4]);
    }
}

#[test]
fn raw_layout_is_big_endian_idx() {
    let b = encode_idx_images(&images(1, 2, 3), false);
    assert_eq!(&b[..16], &[0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3]);
    assert_eq!(b.len(), 16 + 6);
    let l = encode_idx_labels(&[9, 0], false);
    assert_eq!(l, vec![0, 0, 8, 1, 0, 0, 0, 2, 9, 0]);
}

#[test]
fn empty_files_are_valid() {
    let b = encode_idx_images(&images(0, 28, 28), true);
    assert_eq!(read_idx_images_from_bytes("e", &b).unwrap().count, 0);
    assert!(read_idx_labels_from_bytes("e", &encode_idx_labels(&[], false)).unwrap().is_empty());
}

#[test]
fn truncated_images_error_mentions_truncated_file_and_sizes() {
    let dir = TempDir::new("trunc");
    for gzip in [true, false] {
        let path = dir.join(if gzip { "t10k-images-idx3-ubyte.gz" } else { "t10k-images-idx3-ubyte" });
        // Cut the raw file, then (maybe) compress the cut file: a valid
        // gzip stream whose content is too short.
        let mut raw = encode_idx_images(&images(10, 28, 28), false);
        raw.truncate(16 + 1000);
        let bytes = if gzip { gzip_bytes(&raw) } else { raw };
        std::fs::write(&path, &bytes).unwrap();
        let err = read_idx_images(&path).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, DataError::Truncated { .. }), "{msg}");
        assert!(msg.contains("truncated"), "{msg}");
        assert!(msg.contains(path.file_name().unwrap().to_str().unwrap()), "{msg}");
        assert!(msg.contains("10 images of 28x28 (7840 bytes)"), "{msg}");
        assert!(msg.contains("holds 1000 bytes"), "{msg}");
        assert!(msg.contains("download or reinstall"), "{msg}");
    }
}

/// Gzips arbitrary bytes (e.g. a damaged IDX file), so that the gzip
/// stream itself is valid and only its content is wrong.
fn gzip_bytes(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[test]
fn truncated_labels_and_short_headers() {
    let mut l = encode_idx_labels(&labels(50), false);
    l.truncate(8 + 20);
    let msg = read_idx_labels_from_bytes("train-labels-idx1-ubyte", &l).unwrap_err().to_string();
    assert!(msg.starts_with("train-labels-idx1-ubyte: truncated:"), "{msg}");
    assert!(msg.contains("50 labels"), "{msg}");
    assert!(msg.contains("holds 20 bytes"), "{msg}");

    let i = encode_idx_images(&images(1, 28, 28), false);
    for cut in [0, 3, 4, 15] {
        let err = read_idx_images_from_bytes("imgs", &i[..cut]).unwrap_err();
        assert!(matches!(err, DataError::Truncated { .. }), "cut {cut}: {err}");
        assert!(err.to_string().contains("16-byte header"), "{err}");
    }
    let err = read_idx_labels_from_bytes("labs", &l[..6]).unwrap_err();
    assert!(err.to_string().contains("truncated") && err.to_string().contains("8-byte header"), "{err}");
}

#[test]
fn trailing_bytes_are_an_error() {
    for gzip in [false, true] {
        let mut raw = encode_idx_images(&images(2, 28, 28), false);
        raw.extend_from_slice(&[0; 5]);
        let bytes = if gzip { gzip_bytes(&raw) } else { raw };
        let err = read_idx_images_from_bytes("imgs.gz", &bytes).unwrap_err();
        assert!(matches!(err, DataError::TrailingBytes { extra: 5, .. }), "{err}");
        assert!(err.to_string().contains("imgs.gz: 5 unexpected trailing bytes"), "{err}");

        let mut l = encode_idx_labels(&[1, 2], false);
        l.push(7);
        let bytes = if gzip { gzip_bytes(&l) } else { l };
        let err = read_idx_labels_from_bytes("labs", &bytes).unwrap_err();
        assert!(matches!(err, DataError::TrailingBytes { extra: 1, .. }), "{err}");
    }
}

#[test]
fn bad_magic_is_reported_with_values_and_swap_hint() {
    let labels_file = encode_idx_labels(&[1, 2], true);
    let err = read_idx_images_from_bytes("train-images-idx3-ubyte.gz", &labels_file).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, DataError::BadMagic { expected: 0x803, found: 0x801, .. }), "{msg}");
    assert!(msg.contains("train-images-idx3-ubyte.gz: bad magic number 0x00000801, expected 0x00000803"), "{msg}");
    assert!(msg.contains("label file where an image file was expected"), "{msg}");

    let images_file = encode_idx_images(&images(1, 2, 2), false);
    let err = read_idx_labels_from_bytes("labs", &images_file).unwrap_err();
    assert!(matches!(err, DataError::BadMagic { expected: 0x801, found: 0x803, .. }), "{err}");

    let html = b"<html><body>Not Found</body></html>";
    let err = read_idx_images_from_bytes("page", html).unwrap_err();
    assert!(matches!(err, DataError::BadMagic { .. }), "{err}");
}

#[test]
fn zero_or_absurd_dimensions_are_rejected() {
    let mut raw = encode_idx_images(&images(1, 2, 2), false);
    raw[8..12].copy_from_slice(&0u32.to_be_bytes());
    let err = read_idx_images_from_bytes("z", &raw).unwrap_err();
    assert!(matches!(err, DataError::BadDimensions { .. }), "{err}");
    assert!(err.to_string().contains("1 images of 0x2"), "{err}");

    let mut raw = encode_idx_images(&images(1, 2, 2), false);
    for r in [4..8, 8..12, 12..16] {
        raw[r].copy_from_slice(&u32::MAX.to_be_bytes());
    }
    let err = read_idx_images_from_bytes("huge", &raw).unwrap_err();
    assert!(matches!(err, DataError::BadDimensions { .. }), "{err}");
}

#[test]
fn corrupt_gzip_is_reported() {
    let gz = encode_idx_images(&images(20, 28, 28), true);
    // Damage the compressed body.
    let mut bad = gz.clone();
    let mid = bad.len() / 2;
    for b in &mut bad[mid..mid + 16] {
        *b ^= 0x5a;
    }
    let err = read_idx_images_from_bytes("t10k-images-idx3-ubyte.gz", &bad).unwrap_err();
    assert!(matches!(err, DataError::Gzip { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with("t10k-images-idx3-ubyte.gz: corrupt gzip data"), "{msg}");
    assert!(msg.contains("download or reinstall"), "{msg}");

    // Damage the CRC trailer only: the data decompresses but fails its check.
    let mut bad = gz.clone();
    let n = bad.len();
    bad[n - 8] ^= 0xff;
    let err = read_idx_images_from_bytes("crc.gz", &bad).unwrap_err();
    assert!(matches!(err, DataError::Gzip { .. }), "{err}");

    // Cut the compressed stream.
    for cut in [gz.len() / 2, gz.len() - 4, 12] {
        let err = read_idx_images_from_bytes("cut.gz", &gz[..cut]).unwrap_err();
        assert!(matches!(err, DataError::Gzip { .. }), "cut {cut}: {err}");
        assert!(err.to_string().starts_with("cut.gz: "), "{err}");
    }
}

#[test]
fn missing_file_is_reported_with_path() {
    let dir = TempDir::new("missing");
    let p = dir.join("train-labels-idx1-ubyte.gz");
    let err = read_idx_labels(&p).unwrap_err();
    assert!(matches!(err, DataError::MissingFile { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("missing file {}:", p.display())), "{msg}");
    assert!(msg.contains("--data must name a folder"), "{msg}");

    // A folder where a file is expected is an I/O error naming the path.
    let err = read_idx_images(dir.path()).unwrap_err();
    assert!(err.to_string().contains(&dir.path().display().to_string()), "{err}");
    assert!(std::error::Error::source(&err).is_some());
}
