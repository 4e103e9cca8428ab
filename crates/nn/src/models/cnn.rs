//! The tutorials' two CNNs, with their fully connected layer sized from the input shape.
//! - [`SimpleCnn`]: `conv1 = Conv2d(C, 16, 3, padding=1)`, `max_pool2d(relu(conv1(x)), 2)`, flatten,
//!   `fc = Linear(16 * (H/2) * (W/2), classes)`.
//! - [`DeepCnn`]: `c1, c2, c3 = Conv2d(C, 32, 3, p1), Conv2d(32, 64, 3, p1), Conv2d(64, 128, 3, p1)`, each
//!   followed by relu and `max_pool2d(2)`; `fc = Linear(128 * (H/8) * (W/8), classes)` with floor
//!   division after every pool (3x64x64 gives 128*8*8 = 8192; 1x28x28 gives 128*3*3).

use super::{check_image_input, check_image_spec, Model, ModelKind};
use crate::checkpointing::Checkpointing;
use crate::init::Initializer;
use crate::layers::{window_output_size, Conv2d, Linear, Module};
use memfit_tensor::ops::{self, Conv2dParams, Pool2dParams};
use memfit_tensor::{Error, Result, Tensor};
use std::sync::Arc;

/// `Conv2d(.., 3, padding=1)`.
fn same_padding() -> Conv2dParams {
    Conv2dParams { padding: [1, 1], ..Default::default() }
}

/// The spatial size after `max_pool2d(2)`, or an error naming the model and the pooling stage.
fn pooled(kind: ModelKind, input: [usize; 3], stage: usize, size: [usize; 2]) -> Result<[usize; 2]> {
    let p = Pool2dParams::square(2);
    match (
        window_output_size(size[0], p.kernel[0], p.stride[0], p.padding[0], p.dilation[0]),
        window_output_size(size[1], p.kernel[1], p.stride[1], p.padding[1], p.dilation[1]),
    ) {
        (Some(h), Some(w)) => Ok([h, w]),
        _ => Err(Error::invalid(format!(
            "{}: input {}x{}x{} is too small: pooling stage {stage} gets a {}x{} feature map, smaller than \
             its 2x2 window",
            kind.name(),
            input[0],
            input[1],
            input[2],
            size[0],
            size[1]
        ))),
    }
}

/// A module's parameter tensors.
fn tensors(m: &dyn Module) -> Vec<Tensor> {
    m.parameters().into_iter().map(|(_, t)| t).collect()
}

fn conv_relu_pool(conv: &Conv2d, x: &Tensor) -> Result<Tensor> {
    ops::max_pool2d(&conv.forward(x)?.relu()?, Pool2dParams::square(2))
}

pub struct SimpleCnn {
    input: [usize; 3],
    conv1: Arc<Conv2d>,
    fc: Linear,
    /// Segments: the one conv stage (`conv1`, relu, pool).
    checkpointing: Checkpointing,
}

impl SimpleCnn {
    pub fn new(init: &Initializer, input: [usize; 3], num_classes: usize) -> Result<Self> {
        let kind = ModelKind::SimpleCnn;
        check_image_spec(kind, input, num_classes)?;
        let conv1 = Conv2d::new(init, "conv1", input[0], 16, [3, 3], same_padding(), true)?;
        let [h, w] = pooled(kind, input, 1, conv1.output_size([input[1], input[2]])?)?;
        let fc = Linear::new(init, "fc", 16 * h * w, num_classes, true)?;
        Ok(SimpleCnn { input, conv1: Arc::new(conv1), fc, checkpointing: Checkpointing::new(vec!["conv1".into()]) })
    }

    pub fn fc(&self) -> &Linear {
        &self.fc
    }
}

impl Model for SimpleCnn {
    fn kind(&self) -> ModelKind {
        ModelKind::SimpleCnn
    }

    fn forward(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        check_image_input(self.kind(), self.input, x)?;
        let conv = self.conv1.clone();
        let h = self.checkpointing.run(0, x, || tensors(&*self.conv1), move |x, _| conv_relu_pool(&conv, x))?;
        self.fc.forward(&h.flatten_from(1)?)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = self.conv1.parameters();
        out.extend(self.fc.parameters());
        out
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn checkpointing(&self) -> Option<&Checkpointing> {
        Some(&self.checkpointing)
    }
}

pub struct DeepCnn {
    input: [usize; 3],
    convs: [Arc<Conv2d>; 3],
    fc: Linear,
    /// Segments: the three conv stages (`c1`..`c3`, each with its relu and pool).
    checkpointing: Checkpointing,
}

impl DeepCnn {
    pub fn new(init: &Initializer, input: [usize; 3], num_classes: usize) -> Result<Self> {
        let kind = ModelKind::DeepCnn;
        check_image_spec(kind, input, num_classes)?;
        let convs = [
            Conv2d::new(init, "c1", input[0], 32, [3, 3], same_padding(), true)?,
            Conv2d::new(init, "c2", 32, 64, [3, 3], same_padding(), true)?,
            Conv2d::new(init, "c3", 64, 128, [3, 3], same_padding(), true)?,
        ];
        let mut size = [input[1], input[2]];
        for (i, conv) in convs.iter().enumerate() {
            size = pooled(kind, input, i + 1, conv.output_size(size)?)?;
        }
        let fc = Linear::new(init, "fc", 128 * size[0] * size[1], num_classes, true)?;
        let checkpointing = Checkpointing::new(vec!["c1".into(), "c2".into(), "c3".into()]);
        Ok(DeepCnn { input, convs: convs.map(Arc::new), fc, checkpointing })
    }

    pub fn fc(&self) -> &Linear {
        &self.fc
    }
}

impl Model for DeepCnn {
    fn kind(&self) -> ModelKind {
        ModelKind::DeepCnn
    }

    fn forward(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        check_image_input(self.kind(), self.input, x)?;
        let mut h = x.clone();
        for (i, conv) in self.convs.iter().enumerate() {
            let c = conv.clone();
            h = self.checkpointing.run(i, &h, || tensors(&**conv), move |x, _| conv_relu_pool(&c, x))?;
        }
        self.fc.forward(&h.flatten_from(1)?)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<_> = self.convs.iter().flat_map(|c| c.parameters()).collect();
        out.extend(self.fc.parameters());
        out
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn checkpointing(&self) -> Option<&Checkpointing> {
        Some(&self.checkpointing)
    }
}
