//! Test helpers: a unique temporary folder removed on drop, and small
//! synthetic Fashion-MNIST-shaped data.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use memfit_data::{write_idx_images, write_idx_labels, Images};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh folder under the system temp dir, deleted when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let path = std::env::temp_dir().join(format!("memfit-data-test-{}-{tag}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `count` images of `rows` x `cols` with a recognizable pixel pattern.
pub fn images(count: usize, rows: usize, cols: usize) -> Images {
    let pixels = (0..count * rows * cols).map(|i| (i * 7 % 256) as u8).collect();
    Images::new(count, rows, cols, pixels)
}

/// `count` labels cycling through 0..=9.
pub fn labels(count: usize) -> Vec<u8> {
    (0..count).map(|i| (i % 10) as u8).collect()
}

/// Writes the four Fashion-MNIST files (28x28) with `train` and `val`
/// samples into `dir`, gzip-compressed or not.
pub fn write_fashion_dir(dir: &Path, train: usize, val: usize, gzip: bool) {
    let ext = if gzip { ".gz" } else { "" };
    write_idx_images(&dir.join(format!("train-images-idx3-ubyte{ext}")), &images(train, 28, 28), gzip).unwrap();
    write_idx_labels(&dir.join(format!("train-labels-idx1-ubyte{ext}")), &labels(train), gzip).unwrap();
    write_idx_images(&dir.join(format!("t10k-images-idx3-ubyte{ext}")), &images(val, 28, 28), gzip).unwrap();
    write_idx_labels(&dir.join(format!("t10k-labels-idx1-ubyte{ext}")), &labels(val), gzip).unwrap();
}
