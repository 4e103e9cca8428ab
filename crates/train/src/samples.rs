//! Sources of samples, for any task. A source names its samples by ids, says which ids an epoch
//! uses (in order) and which an evaluation pass covers, and writes a micro-batch of ids straight into
//! device tensors (inputs and int64 targets, category `input`): in place on the cpu, through a pinned
//! buffer copied without waiting on a GPU (`Tensor::overwrite_async_with`); on `meta` only the allocation
//! happens.
//!
//! - [`SplitSamples`]: Fashion-MNIST images and labels (ids index the split, shuffled per epoch);
//! - [`TextWindows`]: windows of a tokenized text for next-token prediction (ids are window start
//!   offsets: an epoch draws them at random, evaluation covers the text once);
//! - [`SyntheticSamples`], [`SyntheticTokens`]: random data shaped like a model's input, for
//!   planning and benchmarks ([`synthetic`] picks the one a model eats).

use memfit_data::Split;
use memfit_data::{eval_window_starts, fill_batch, fill_windows, random_window_starts, EpochOrder, Rng};
use memfit_nn::{ModelInput, ModelSpec};
use memfit_tensor::{Category, DType, Device, Error, Result, Tensor};

/// The normalization of image inputs (the one [`crate::samples::SplitSamples`] applies).
pub const IMAGE_NORMALIZATION: memfit_data::Normalization = memfit_data::Normalization::FASHION_MNIST;

/// Samples of one task, named by ids.
pub trait Samples: Sync {
    /// Samples in one epoch (and in one evaluation pass).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The ids epoch `epoch` of a run seeded with `seed` trains on, in order.
    fn epoch_ids(&self, seed: u64, epoch: usize) -> Vec<usize> {
        EpochOrder::new(self.len(), seed, epoch as u64, true).indices().to_vec()
    }
    /// The ids an evaluation pass covers, in order.
    fn eval_ids(&self) -> Vec<usize> {
        (0..self.len()).collect()
    }
    /// The micro-batch `ids` as device tensors (inputs, targets).
    fn to_device(&self, device: &Device, ids: &[usize]) -> Result<(Tensor, Tensor)>;
}

/// Allocates inputs of `input_shape` and int64 targets of `target_shape` (category `input`) and
/// fills both from the host with `fill` (nothing runs on meta; a GPU does not wait).
fn batch_tensors<X: memfit_tensor::Element>(
    device: &Device,
    input_shape: &[usize],
    target_shape: &[usize],
    fill: impl FnOnce(&mut [X], &mut [i64]) -> Result<()>,
) -> Result<(Tensor, Tensor)> {
    let x = Tensor::empty(device, input_shape, X::DTYPE, Category::Input, "batch")?;
    let y = Tensor::empty(device, target_shape, DType::I64, Category::Input, "batch")?;
    let mut filled = Ok(());
    x.overwrite_async_with::<X>(|xs| {
        filled = y.overwrite_async_with::<i64>(|ys| {
            filled = fill(xs, ys);
        })
    })?;
    filled?;
    Ok((x, y))
}

/// A Fashion-MNIST split, normalized with the dataset's mean and std.
pub struct SplitSamples<'a> {
    pub split: &'a Split,
}

impl Samples for SplitSamples<'_> {
    fn len(&self) -> usize {
        self.split.len()
    }
    fn to_device(&self, device: &Device, ids: &[usize]) -> Result<(Tensor, Tensor)> {
        let (rows, cols) = (self.split.images.rows, self.split.images.cols);
        batch_tensors::<f32>(device, &[ids.len(), 1, rows, cols], &[ids.len()], |px, lb| {
            fill_batch(self.split, ids, IMAGE_NORMALIZATION, px, lb).map_err(|e| Error::invalid(e.to_string()))
        })
    }
}

/// Windows of `context + 1` tokens of a text: inputs are the first `context`, targets the last
/// `context` (each position predicts the next token). Ids are start offsets.
pub struct TextWindows<'a> {
    pub tokens: &'a [u32],
    pub context: usize,
    /// Windows a training epoch draws (at random positions).
    pub per_epoch: usize,
}

impl<'a> TextWindows<'a> {
    /// Training windows: an epoch draws as many windows as fit the text end to end.
    pub fn train(tokens: &'a [u32], context: usize) -> Self {
        TextWindows { tokens, context, per_epoch: tokens.len() / (context + 1) }
    }

    /// Evaluation windows: the ones that cover the text once ([`eval_window_starts`]).
    pub fn eval(tokens: &'a [u32], context: usize) -> Self {
        TextWindows { tokens, context, per_epoch: eval_window_starts(tokens.len(), context).len() }
    }
}

impl Samples for TextWindows<'_> {
    fn len(&self) -> usize {
        self.per_epoch
    }
    fn epoch_ids(&self, seed: u64, epoch: usize) -> Vec<usize> {
        random_window_starts(self.tokens.len(), self.context, self.per_epoch, seed, epoch as u64)
    }
    fn eval_ids(&self) -> Vec<usize> {
        eval_window_starts(self.tokens.len(), self.context)
    }
    fn to_device(&self, device: &Device, ids: &[usize]) -> Result<(Tensor, Tensor)> {
        let shape = [ids.len(), self.context];
        batch_tensors::<i64>(device, &shape, &shape, |x, y| {
            fill_windows(self.tokens, ids, self.context, x, y).map_err(|e| Error::invalid(e.to_string()))
        })
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
    fn to_device(&self, device: &Device, ids: &[usize]) -> Result<(Tensor, Tensor)> {
        let [c, h, w] = self.shape;
        let size = c * h * w;
        batch_tensors::<f32>(device, &[ids.len(), c, h, w], &[ids.len()], |pixels, labels| {
            for (row, &i) in ids.iter().enumerate() {
                let mut rng = Rng::derive(self.seed, i as u64);
                labels[row] = rng.gen_index(self.classes) as i64;
                for p in &mut pixels[row * size..(row + 1) * size] {
                    *p = rng.next_f32() * 2.0 - 1.0;
                }
            }
            Ok(())
        })
    }
}

/// Random token windows (`context` inputs and `context` targets below `vocab`), sample i a function of
/// (seed, i) only: the token counterpart of [`SyntheticSamples`].
pub struct SyntheticTokens {
    pub len: usize,
    pub vocab: usize,
    pub context: usize,
    pub seed: u64,
}

impl Samples for SyntheticTokens {
    fn len(&self) -> usize {
        self.len
    }
    fn to_device(&self, device: &Device, ids: &[usize]) -> Result<(Tensor, Tensor)> {
        let shape = [ids.len(), self.context];
        batch_tensors::<i64>(device, &shape, &shape, |x, y| {
            for (row, &i) in ids.iter().enumerate() {
                let mut rng = Rng::derive(self.seed, i as u64);
                let span = row * self.context..(row + 1) * self.context;
                for (a, b) in x[span.clone()].iter_mut().zip(&mut y[span]) {
                    *a = rng.gen_index(self.vocab) as i64;
                    *b = rng.gen_index(self.vocab) as i64;
                }
            }
            Ok(())
        })
    }
}

/// `len` random samples shaped like what `spec`'s model eats, for planning and benchmarks.
pub fn synthetic(spec: &ModelSpec, len: usize, seed: u64) -> Box<dyn Samples> {
    match spec.input_kind() {
        ModelInput::Image { shape, classes } => Box::new(SyntheticSamples { len, shape, classes, seed }),
        ModelInput::Tokens { vocab, context } => Box::new(SyntheticTokens { len, vocab, context, seed }),
    }
}
