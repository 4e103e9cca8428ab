//! Fashion-MNIST: finding and loading the data set (an explicit folder, the
//! Debian system package, or the subset embedded in the binary), label and
//! count validation, and the train/validation `Split`s with their `Source`.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::DataError;
use crate::idx::{read_idx_images, read_idx_images_from_bytes, read_idx_labels, read_idx_labels_from_bytes, Images};

/// Number of classes (labels are `0..NUM_CLASSES`).
pub const NUM_CLASSES: usize = 10;
/// Image height in pixels.
pub const IMAGE_ROWS: usize = 28;
/// Image width in pixels.
pub const IMAGE_COLS: usize = 28;
/// Pixels per image (`IMAGE_ROWS * IMAGE_COLS`).
pub const IMAGE_SIZE: usize = IMAGE_ROWS * IMAGE_COLS;
/// Class names, indexed by label.
pub const CLASS_NAMES: [&str; NUM_CLASSES] =
    ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"];

/// Training images file name (without `.gz`).
pub const TRAIN_IMAGES: &str = "train-images-idx3-ubyte";
/// Training labels file name (without `.gz`).
pub const TRAIN_LABELS: &str = "train-labels-idx1-ubyte";
/// Test images file name (without `.gz`); memfit uses the test set for validation.
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte";
/// Test labels file name (without `.gz`).
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte";

/// Where Debian's `dataset-fashion-mnist` package installs the data set.
pub const SYSTEM_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Samples of the embedded subset used for training (the first ones).
pub const EMBEDDED_TRAIN: usize = 8_000;
/// Samples of the embedded subset used for validation (the last ones).
pub const EMBEDDED_VAL: usize = 2_000;

static EMBEDDED_IMAGES: &[u8] = include_bytes!("../assets/t10k-images-idx3-ubyte.gz");
static EMBEDDED_LABELS: &[u8] = include_bytes!("../assets/t10k-labels-idx1-ubyte.gz");

/// Images with one label each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub images: Images,
    pub labels: Vec<u8>,
}

impl Split {
    /// Pairs images with labels, checking that the counts match and that
    /// every label is below [`NUM_CLASSES`]. `images_name` and `labels_name`
    /// name the files in errors.
    pub fn new(images_name: &str, images: Images, labels_name: &str, labels: Vec<u8>) -> Result<Split, DataError> {
        check_labels(labels_name, &labels, NUM_CLASSES)?;
        if images.count != labels.len() {
            return Err(DataError::CountMismatch {
                images_name: images_name.to_string(),
                images: images.count,
                labels_name: labels_name.to_string(),
                labels: labels.len(),
            });
        }
        Ok(Split { images, labels })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Pixels per image.
    pub fn image_size(&self) -> usize {
        self.images.image_size()
    }

    /// Length of the pixel buffer for a batch of `batch` samples
    /// (`batch * image_size()`).
    pub fn pixels_len(&self, batch: usize) -> usize {
        batch * self.image_size()
    }

    /// A copy of samples `range`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Split {
        Split { images: self.images.slice(range.clone()), labels: self.labels[range].to_vec() }
    }

    /// How many samples of each class (indexed by label).
    pub fn class_counts(&self) -> [usize; NUM_CLASSES] {
        let mut counts = [0; NUM_CLASSES];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }
}

/// Where a loaded data set came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The subset of the t10k test set compiled into the binary.
    Embedded,
    /// Debian's `dataset-fashion-mnist` package (its folder).
    SystemPackage(PathBuf),
    /// A folder named by the user (`--data`).
    Dir(PathBuf),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Embedded => write!(
                f,
                "embedded subset ({} train / {} validation from Fashion-MNIST t10k)",
                thousands(EMBEDDED_TRAIN),
                thousands(EMBEDDED_VAL)
            ),
            Source::SystemPackage(p) => write!(
                f,
                "system package dataset-fashion-mnist at {} (train set for training, t10k test set for validation)",
                p.display()
            ),
            Source::Dir(p) => {
                write!(f, "folder {} (train set for training, t10k test set for validation)", p.display())
            }
        }
    }
}

/// Fashion-MNIST, ready for training: a training and a validation split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FashionMnist {
    pub train: Split,
    pub val: Split,
    pub source: Source,
}

impl FashionMnist {
    /// Pixels per image.
    pub fn image_size(&self) -> usize {
        self.train.image_size()
    }

    /// Number of classes.
    pub fn num_classes(&self) -> usize {
        NUM_CLASSES
    }

    /// One line for the CLI, e.g. "embedded subset (...): 8,000 train / 2,000
    /// validation images of 28x28".
    pub fn summary(&self) -> String {
        format!(
            "{}: {} train / {} validation images of {}x{}",
            self.source,
            thousands(self.train.len()),
            thousands(self.val.len()),
            self.train.images.rows,
            self.train.images.cols
        )
    }
}

/// Loads Fashion-MNIST:
/// - from `dir` if given (or fails with an error naming what is missing);
/// - else from [`SYSTEM_DIR`] if it holds the four files (60,000 train,
///   10,000 test used as validation);
/// - else the embedded subset ([`load_embedded`]).
pub fn load_fashion_mnist(dir: Option<&Path>) -> Result<FashionMnist, DataError> {
    if let Some(dir) = dir {
        return load_dir(dir, Source::Dir(dir.to_path_buf()));
    }
    let system = Path::new(SYSTEM_DIR);
    if has_fashion_files(system) {
        return load_dir(system, Source::SystemPackage(system.to_path_buf()));
    }
    load_embedded()
}

/// Loads the four Fashion-MNIST files from `dir` (each as `name.gz` or
/// uncompressed `name`); the result's source is [`Source::Dir`].
pub fn load_fashion_mnist_dir(dir: &Path) -> Result<FashionMnist, DataError> {
    load_dir(dir, Source::Dir(dir.to_path_buf()))
}

/// The embedded subset: the Fashion-MNIST t10k set compiled into the
/// binary, first [`EMBEDDED_TRAIN`] samples for training and last
/// [`EMBEDDED_VAL`] for validation.
pub fn load_embedded() -> Result<FashionMnist, DataError> {
    let images_name = "embedded t10k-images-idx3-ubyte.gz";
    let labels_name = "embedded t10k-labels-idx1-ubyte.gz";
    let images = read_idx_images_from_bytes(images_name, EMBEDDED_IMAGES)?;
    let labels = read_idx_labels_from_bytes(labels_name, EMBEDDED_LABELS)?;
    check_image_dims(images_name, &images)?;
    let all = Split::new(images_name, images, labels_name, labels)?;
    let total = EMBEDDED_TRAIN + EMBEDDED_VAL;
    if all.len() != total {
        return Err(DataError::Inconsistent {
            detail: format!("{images_name} holds {} samples, expected {total}", all.len()),
        });
    }
    Ok(FashionMnist {
        train: all.slice(0..EMBEDDED_TRAIN),
        val: all.slice(EMBEDDED_TRAIN..total),
        source: Source::Embedded,
    })
}

/// Whether `dir` holds all four Fashion-MNIST files (gzip-compressed or not).
pub fn has_fashion_files(dir: &Path) -> bool {
    [TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS].iter().all(|n| find_file(dir, n).is_some())
}

/// The path of `name.gz` in `dir` if it exists, else of `name`, else `None`.
pub fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Some(gz);
    }
    let raw = dir.join(name);
    raw.is_file().then_some(raw)
}

/// Checks that every label is below `num_classes`; `name` names the file.
pub fn check_labels(name: &str, labels: &[u8], num_classes: usize) -> Result<(), DataError> {
    match labels.iter().position(|&l| l as usize >= num_classes) {
        None => Ok(()),
        Some(index) => {
            Err(DataError::LabelOutOfRange { name: name.to_string(), index, label: labels[index], num_classes })
        }
    }
}

/// Loads one split (an image file and its label file) with all checks.
pub fn load_split(images_path: &Path, labels_path: &Path) -> Result<Split, DataError> {
    let images_name = images_path.display().to_string();
    let labels_name = labels_path.display().to_string();
    let images = read_idx_images(images_path)?;
    check_image_dims(&images_name, &images)?;
    let labels = read_idx_labels(labels_path)?;
    Split::new(&images_name, images, &labels_name, labels)
}

// ---------------------------------------------------------------------------

fn load_dir(dir: &Path, source: Source) -> Result<FashionMnist, DataError> {
    if dir.is_file() {
        return Err(DataError::NotAFolder { path: dir.to_path_buf() });
    }
    if !dir.is_dir() {
        return Err(DataError::MissingDir { path: dir.to_path_buf() });
    }
    // Report the first missing file before reading anything.
    let mut paths = Vec::with_capacity(4);
    for name in [TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS] {
        match find_file(dir, name) {
            Some(p) => paths.push(p),
            None => return Err(DataError::MissingFile { path: dir.join(format!("{name}.gz")) }),
        }
    }
    let train = load_split(&paths[0], &paths[1])?;
    let val = load_split(&paths[2], &paths[3])?;
    Ok(FashionMnist { train, val, source })
}

fn check_image_dims(name: &str, images: &Images) -> Result<(), DataError> {
    if images.rows != IMAGE_ROWS || images.cols != IMAGE_COLS {
        return Err(DataError::BadDimensions {
            name: name.to_string(),
            detail: format!(
                "images are {}x{} but Fashion-MNIST images are {IMAGE_ROWS}x{IMAGE_COLS}",
                images.rows, images.cols
            ),
        });
    }
    Ok(())
}

/// `8000` -> `"8,000"`.
#[allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; the workspace supports 1.80
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(8000), "8,000");
        assert_eq!(thousands(60000), "60,000");
        assert_eq!(thousands(1234567), "1,234,567");
    }
}
