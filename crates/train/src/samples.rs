//! Sources of training samples. A source writes a micro-batch straight into device tensors (inputs
//! `[n, C, H, W]` f32 and int64 targets, category `input`), so there is no host staging copy; on
//! `meta` only the allocation happens.

use memfit_data::{fill_batch, Normalization, Rng, Split};
use memfit_tensor::{Category, Device, Result, Tensor};

/// Indexable labelled images of one shape.
pub trait Samples: Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// (C, H, W).
    fn input_shape(&self) -> [usize; 3];
    fn num_classes(&self) -> usize;
    /// Writes samples `indices` as normalized pixels and class labels.
    fn fill(&self, indices: &[usize], pixels: &mut [f32], labels: &mut [i64]);

    /// The micro-batch `indices` as device tensors (inputs, targets).
    fn to_device(&self, device: &Device, indices: &[usize]) -> Result<(Tensor, Tensor)> {
        let [c, h, w] = self.input_shape();
        let x = Tensor::empty(device, &[indices.len(), c, h, w], memfit_tensor::DType::F32, Category::Input, "batch")?;
        let y = Tensor::empty(device, &[indices.len()], memfit_tensor::DType::I64, Category::Input, "batch")?;
        let mut labels = Ok(());
        x.write_with::<f32>(|px| labels = y.write_with::<i64>(|lb| self.fill(indices, px, lb)))?;
        labels?;
        Ok((x, y))
    }
}

/// A Fashion-MNIST split, normalized with the dataset's mean and std.
pub struct SplitSamples<'a> {
    pub split: &'a Split,
}

impl Samples for SplitSamples<'_> {
    fn len(&self) -> usize {
        self.split.len()
    }
    fn input_shape(&self) -> [usize; 3] {
        [1, self.split.images.rows, self.split.images.cols]
    }
    fn num_classes(&self) -> usize {
        memfit_data::NUM_CLASSES
    }
    fn fill(&self, indices: &[usize], pixels: &mut [f32], labels: &mut [i64]) {
        // Indices come from an EpochOrder over this split and the buffers are sized for them, so this
        // cannot fail; a failure would be a bug in the trainer.
        fill_batch(self.split, indices, Normalization::FASHION_MNIST, pixels, labels)
            .expect("trainer sized the batch for its indices");
    }
}

/// Random inputs (uniform in [-1, 1)) and labels of any shape, for benchmarks and planning. Sample i is
/// a function of (seed, i) only. Cheap to make, so benchmarks time the model, not the data.
pub struct SyntheticSamples {
    pub len: usize,
    pub shape: [usize; 3],
    pub classes: usize,
    pub seed: u64,
}

impl Samples for SyntheticSamples {
    fn len(&self) -> usize {
        self.len
    }
    fn input_shape(&self) -> [usize; 3] {
        self.shape
    }
    fn num_classes(&self) -> usize {
        self.classes
    }
    fn fill(&self, indices: &[usize], pixels: &mut [f32], labels: &mut [i64]) {
        let size = self.shape.iter().product::<usize>();
        for (row, &i) in indices.iter().enumerate() {
            let mut rng = Rng::derive(self.seed, i as u64);
            labels[row] = rng.gen_index(self.classes) as i64;
            for p in &mut pixels[row * size..(row + 1) * size] {
                *p = rng.next_f32() * 2.0 - 1.0;
            }
        }
    }
}
