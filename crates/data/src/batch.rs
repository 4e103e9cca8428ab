//! Batching: the seeded per-epoch sample order (`EpochOrder`), its batches
//! of indices, `Normalization`, and `fill_batch`, which writes a batch into
//! caller-owned host buffers (f32 pixels in N x 1 x rows x cols, i64 labels).

use std::borrow::Borrow;

use crate::error::DataError;
use crate::fashion::Split;
use crate::rng::Rng;

/// The order in which one epoch visits samples `0..len`: the identity, or a
/// permutation determined only by `(seed, epoch)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochOrder {
    indices: Vec<usize>,
}

impl EpochOrder {
    /// The order for `epoch` of a run seeded with `seed`: shuffled with
    /// [`Rng::derive`]`(seed, epoch)` if `shuffle`, else `0..len` in order.
    pub fn new(len: usize, seed: u64, epoch: u64, shuffle: bool) -> EpochOrder {
        let mut indices: Vec<usize> = (0..len).collect();
        if shuffle {
            Rng::derive(seed, epoch).shuffle(&mut indices);
        }
        EpochOrder { indices }
    }

    /// All sample indices in visiting order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Batches of `batch_size` indices in order; the last one holds the
    /// remainder (it is not dropped) and may be shorter.
    ///
    /// # Panics
    /// If `batch_size == 0`.
    pub fn batches(&self, batch_size: usize) -> std::slice::Chunks<'_, usize> {
        assert!(batch_size > 0, "EpochOrder::batches: batch size must be at least 1");
        self.indices.chunks(batch_size)
    }

    /// How many batches [`EpochOrder::batches`] yields (`ceil(len / batch_size)`).
    ///
    /// # Panics
    /// If `batch_size == 0`.
    pub fn num_batches(&self, batch_size: usize) -> usize {
        assert!(batch_size > 0, "EpochOrder::num_batches: batch size must be at least 1");
        self.indices.len().div_ceil(batch_size)
    }
}

/// Pixel normalization: `x = (p / 255 - mean) / std`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalization {
    pub mean: f32,
    pub std: f32,
}

impl Normalization {
    /// Fashion-MNIST training-set statistics of `p / 255`.
    pub const FASHION_MNIST: Normalization = Normalization { mean: 0.2860, std: 0.3530 };
    /// Only scale to `[0, 1]`.
    pub const UNIT: Normalization = Normalization { mean: 0.0, std: 1.0 };

    /// The normalized value of pixel `p`.
    #[inline]
    pub fn apply(&self, p: u8) -> f32 {
        (p as f32 / 255.0 - self.mean) / self.std
    }

    /// The normalized value of every possible pixel byte.
    pub fn table(&self) -> [f32; 256] {
        let mut t = [0.0; 256];
        for (p, v) in t.iter_mut().enumerate() {
            *v = self.apply(p as u8);
        }
        t
    }
}

impl Default for Normalization {
    fn default() -> Self {
        Normalization::FASHION_MNIST
    }
}

/// Pixels per Fashion-MNIST image (28 x 28).
pub fn image_size() -> usize {
    crate::fashion::IMAGE_SIZE
}

/// Writes samples `indices` of `split` into the batch buffers: pixels
/// normalized with `norm` in N x 1 x rows x cols order
/// (`out_pixels.len() == indices.len() * split.image_size()`), labels as
/// i64 (`out_labels.len() == indices.len()`). `norm` may be passed by value
/// or by reference.
pub fn fill_batch(
    split: &Split,
    indices: &[usize],
    norm: impl Borrow<Normalization>,
    out_pixels: &mut [f32],
    out_labels: &mut [i64],
) -> Result<(), DataError> {
    let n = indices.len();
    let size = split.image_size();
    if out_pixels.len() != n * size {
        return Err(DataError::BatchShape {
            what: "pixel",
            expected: n * size,
            found: out_pixels.len(),
            detail: format!("{n} samples x 1 x {} x {}", split.images.rows, split.images.cols),
        });
    }
    if out_labels.len() != n {
        return Err(DataError::BatchShape {
            what: "label",
            expected: n,
            found: out_labels.len(),
            detail: format!("one label per sample, {n} samples"),
        });
    }
    if let Some(&index) = indices.iter().find(|&&i| i >= split.len()) {
        return Err(DataError::IndexOutOfRange { index, len: split.len() });
    }
    let table = norm.borrow().table();
    for (k, &i) in indices.iter().enumerate() {
        let out = &mut out_pixels[k * size..(k + 1) * size];
        for (o, &p) in out.iter_mut().zip(split.images.image(i)) {
            *o = table[p as usize];
        }
        out_labels[k] = split.labels[i] as i64;
    }
    Ok(())
}
