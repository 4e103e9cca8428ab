//! Fashion-MNIST loading: folders (gz, raw, mixed), every folder-level
//! error, the embedded subset, the system package and `Source` display.

mod common;

use std::path::Path;

use common::{images, labels, write_fashion_dir, TempDir};
use memfit_data::*;

#[test]
fn loads_a_folder_of_gzip_files() {
    let dir = TempDir::new("gzdir");
    write_fashion_dir(dir.path(), 30, 12, true);
    let ds = load_fashion_mnist(Some(dir.path())).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (30, 12));
    assert_eq!(ds.image_size(), 784);
    assert_eq!(ds.train.images, images(30, 28, 28));
    assert_eq!(ds.val.labels, labels(12));
    assert_eq!(ds.source, Source::Dir(dir.path().to_path_buf()));
    assert!(ds.source.to_string().starts_with(&format!("folder {}", dir.path().display())));
    assert!(ds.summary().ends_with("30 train / 12 validation images of 28x28"), "{}", ds.summary());
}

#[test]
fn loads_a_folder_of_raw_files_and_prefers_gz_when_both_exist() {
    let dir = TempDir::new("rawdir");
    write_fashion_dir(dir.path(), 7, 3, false);
    let ds = load_fashion_mnist_dir(dir.path()).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (7, 3));

    // Add .gz versions with other sizes: they win.
    write_fashion_dir(dir.path(), 9, 4, true);
    let ds = load_fashion_mnist(Some(dir.path())).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (9, 4));
    assert!(has_fashion_files(dir.path()));
    assert_eq!(find_file(dir.path(), TRAIN_IMAGES).unwrap(), dir.join("train-images-idx3-ubyte.gz"));
}

#[test]
fn missing_folder_message() {
    let dir = TempDir::new("nodir");
    let missing = dir.join("nope");
    let err = load_fashion_mnist(Some(&missing)).unwrap_err();
    assert!(matches!(err, DataError::MissingDir { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("missing folder {}: --data must name a folder", missing.display())), "{msg}");
    assert!(msg.contains("train-images-idx3-ubyte.gz"), "{msg}");
}

#[test]
fn missing_file_message_names_the_file() {
    let dir = TempDir::new("nofile");
    write_fashion_dir(dir.path(), 5, 5, true);
    std::fs::remove_file(dir.join("train-labels-idx1-ubyte.gz")).unwrap();
    assert!(!has_fashion_files(dir.path()));
    let err = load_fashion_mnist(Some(dir.path())).unwrap_err();
    assert!(matches!(err, DataError::MissingFile { .. }), "{err}");
    let expected = format!(
        "missing file {}: --data must name a folder with the four Fashion-MNIST IDX files (train-images-idx3-ubyte.gz, ",
        dir.join("train-labels-idx1-ubyte.gz").display()
    );
    assert!(err.to_string().starts_with(&expected), "{err}");
}

#[test]
fn label_out_of_range_is_an_error() {
    let dir = TempDir::new("badlabel");
    write_fashion_dir(dir.path(), 6, 4, true);
    let mut l = labels(4);
    l[2] = 10;
    write_idx_labels(&dir.join("t10k-labels-idx1-ubyte.gz"), &l, true).unwrap();
    let err = load_fashion_mnist(Some(dir.path())).unwrap_err();
    assert!(matches!(err, DataError::LabelOutOfRange { index: 2, label: 10, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("t10k-labels-idx1-ubyte.gz: label 10 of sample 2 is out of range"), "{msg}");
    assert!(msg.contains("0..=9"), "{msg}");

    assert!(check_labels("x", &[0, 9, 3], NUM_CLASSES).is_ok());
    assert!(check_labels("x", &[255], NUM_CLASSES).is_err());
}

#[test]
fn image_and_label_count_mismatch_is_an_error() {
    let dir = TempDir::new("count");
    write_fashion_dir(dir.path(), 6, 4, false);
    write_idx_labels(&dir.join("train-labels-idx1-ubyte"), &labels(5), false).unwrap();
    let err = load_fashion_mnist(Some(dir.path())).unwrap_err();
    assert!(matches!(err, DataError::CountMismatch { images: 6, labels: 5, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("train-images-idx3-ubyte holds 6 images"), "{msg}");
    assert!(msg.contains("train-labels-idx1-ubyte holds 5 labels"), "{msg}");
}

#[test]
fn non_28x28_images_are_rejected() {
    let dir = TempDir::new("dims");
    write_fashion_dir(dir.path(), 3, 3, true);
    write_idx_images(&dir.join("train-images-idx3-ubyte.gz"), &images(3, 32, 32), true).unwrap();
    let err = load_fashion_mnist(Some(dir.path())).unwrap_err();
    assert!(matches!(err, DataError::BadDimensions { .. }), "{err}");
    assert!(err.to_string().contains("32x32"), "{err}");
}

#[test]
fn damaged_file_in_folder_is_reported_with_its_path() {
    let dir = TempDir::new("damaged");
    write_fashion_dir(dir.path(), 4, 4, false);
    let p = dir.join("t10k-images-idx3-ubyte");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let msg = load_fashion_mnist(Some(dir.path())).unwrap_err().to_string();
    assert!(msg.starts_with(&format!("{}: truncated:", p.display())), "{msg}");
}

#[test]
fn embedded_subset_has_8000_train_2000_val_and_all_classes() {
    let ds = load_embedded().unwrap();
    assert_eq!(ds.source, Source::Embedded);
    assert_eq!(ds.train.len(), 8000);
    assert_eq!(ds.val.len(), 2000);
    assert_eq!((EMBEDDED_TRAIN, EMBEDDED_VAL), (8000, 2000));
    for split in [&ds.train, &ds.val] {
        assert_eq!((split.images.rows, split.images.cols), (28, 28));
        assert_eq!(split.images.pixels.len(), split.len() * 784);
        let counts = split.class_counts();
        assert!(counts.iter().all(|&c| c > 0), "{counts:?}");
        assert_eq!(counts.iter().sum::<usize>(), split.len());
    }
    // Real images: not blank, full 0..=255 range.
    assert_eq!(*ds.train.images.pixels.iter().max().unwrap(), 255);
    assert_eq!(*ds.train.images.pixels.iter().min().unwrap(), 0);
    assert_eq!(ds.source.to_string(), "embedded subset (8,000 train / 2,000 validation from Fashion-MNIST t10k)");
    // Deterministic.
    assert_eq!(load_embedded().unwrap(), ds);
}

#[test]
fn embedded_subset_is_the_system_t10k_split_in_order() {
    let sys = Path::new(SYSTEM_DIR);
    if !has_fashion_files(sys) {
        eprintln!("skipping: {SYSTEM_DIR} not installed");
        return;
    }
    let t10k = load_split(&sys.join("t10k-images-idx3-ubyte.gz"), &sys.join("t10k-labels-idx1-ubyte.gz")).unwrap();
    let ds = load_embedded().unwrap();
    assert_eq!(ds.train, t10k.slice(0..8000));
    assert_eq!(ds.val, t10k.slice(8000..10000));
}

#[test]
fn default_load_uses_system_package_or_embedded() {
    let ds = load_fashion_mnist(None).unwrap();
    if has_fashion_files(Path::new(SYSTEM_DIR)) {
        assert_eq!(ds.source, Source::SystemPackage(SYSTEM_DIR.into()));
        assert_eq!((ds.train.len(), ds.val.len()), (60_000, 10_000));
        for split in [&ds.train, &ds.val] {
            assert!(split.class_counts().iter().all(|&c| c == split.len() / 10));
        }
        assert!(ds.source.to_string().contains(SYSTEM_DIR));
        assert!(ds.summary().contains("60,000 train / 10,000 validation"), "{}", ds.summary());
    } else {
        assert_eq!(ds.source, Source::Embedded);
    }
}

#[test]
fn class_names_and_constants() {
    assert_eq!(CLASS_NAMES.len(), NUM_CLASSES);
    assert_eq!(CLASS_NAMES[9], "Ankle boot");
    assert_eq!(IMAGE_SIZE, IMAGE_ROWS * IMAGE_COLS);
    assert_eq!(image_size(), 784);
}
