//! A small ResNet for 28x28 / 32x32 images, with torchvision's `state_dict` names: a 3x3 stem
//! (`conv1`, `bn1`, relu), three stages `layer1..layer3` of [`BasicBlock`]s with 16, 32 and 64 channels
//! (stride 2 entering stages 2 and 3, where a 1x1 conv + batch norm `downsample` shortcut matches the
//! shapes), `adaptive_avg_pool2d(1)`, flatten, `fc`. Convolutions followed by batch norm have no bias.
//! Initialization is PyTorch's module default (see [`crate::init`]).

use super::{check_image_input, check_image_spec, Model, ModelKind};
use crate::checkpointing::Checkpointing;
use crate::init::Initializer;
use crate::layers::{BatchNorm2d, Conv2d, Linear, Module};
use memfit_tensor::ops::{self, Conv2dParams};
use memfit_tensor::{Error, Result, Tensor};
use std::sync::Arc;

/// Channels of the three stages.
pub const WIDTHS: [usize; 3] = [16, 32, 64];
/// BasicBlocks per stage built by [`crate::build_model`].
pub const DEFAULT_BLOCKS: [usize; 3] = [1, 1, 1];

fn conv(init: &Initializer, prefix: &str, cin: usize, cout: usize, k: usize, stride: usize) -> Result<Conv2d> {
    let params = Conv2dParams { stride: [stride, stride], padding: [k / 2, k / 2], ..Default::default() };
    Conv2d::new(init, prefix, cin, cout, [k, k], params, false)
}

/// torchvision's BasicBlock: `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`.
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    conv2: Conv2d,
    bn2: BatchNorm2d,
    downsample: Option<(Conv2d, BatchNorm2d)>,
}

impl BasicBlock {
    pub fn new(init: &Initializer, prefix: &str, cin: usize, cout: usize, stride: usize) -> Result<Self> {
        let p = |s: &str| format!("{prefix}.{s}");
        let downsample = if stride != 1 || cin != cout {
            Some((
                conv(init, &p("downsample.0"), cin, cout, 1, stride)?,
                BatchNorm2d::new(init, &p("downsample.1"), cout)?,
            ))
        } else {
            None
        };
        Ok(BasicBlock {
            conv1: conv(init, &p("conv1"), cin, cout, 3, stride)?,
            bn1: BatchNorm2d::new(init, &p("bn1"), cout)?,
            conv2: conv(init, &p("conv2"), cout, cout, 3, 1)?,
            bn2: BatchNorm2d::new(init, &p("bn2"), cout)?,
            downsample,
        })
    }

    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let out = self.bn1.forward(&self.conv1.forward(x)?, train)?.relu()?;
        let out = self.bn2.forward(&self.conv2.forward(&out)?, train)?;
        let identity = match &self.downsample {
            Some((c, bn)) => bn.forward(&c.forward(x)?, train)?,
            None => x.clone(),
        };
        out.add(&identity)?.relu()
    }

    /// The output [height, width] for an input of [height, width].
    fn output_size(&self, size: [usize; 2]) -> Result<[usize; 2]> {
        self.conv2.output_size(self.conv1.output_size(size)?)
    }

    fn modules(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.conv1, &self.bn1, &self.conv2, &self.bn2];
        if let Some((c, bn)) = &self.downsample {
            out.push(c);
            out.push(bn);
        }
        out
    }
}

pub struct ResNet {
    input: [usize; 3],
    conv1: Conv2d,
    bn1: BatchNorm2d,
    stages: Vec<Arc<Vec<BasicBlock>>>,
    fc: Linear,
    /// Segments: the stages `layer1..layer3`.
    checkpointing: Checkpointing,
}

impl ResNet {
    /// `blocks[i]` BasicBlocks in stage i (each at least 1).
    pub fn new(init: &Initializer, input: [usize; 3], num_classes: usize, blocks: [usize; 3]) -> Result<Self> {
        let kind = ModelKind::ResNet;
        check_image_spec(kind, input, num_classes)?;
        if blocks.contains(&0) {
            return Err(Error::invalid(format!("resnet: every stage needs at least one block, got {blocks:?}")));
        }
        let conv1 = conv(init, "conv1", input[0], WIDTHS[0], 3, 1)?;
        let bn1 = BatchNorm2d::new(init, "bn1", WIDTHS[0])?;
        let mut size = conv1.output_size([input[1], input[2]])?;
        let mut cin = WIDTHS[0];
        let mut stages = Vec::new();
        for (s, (&width, &n)) in WIDTHS.iter().zip(&blocks).enumerate() {
            let mut stage = Vec::new();
            for i in 0..n {
                let stride = if s > 0 && i == 0 { 2 } else { 1 };
                let block = BasicBlock::new(init, &format!("layer{}.{i}", s + 1), cin, width, stride)?;
                size = block.output_size(size)?;
                stage.push(block);
                cin = width;
            }
            stages.push(Arc::new(stage));
        }
        let fc = Linear::new(init, "fc", cin, num_classes, true)?;
        let checkpointing = Checkpointing::new((1..=stages.len()).map(|s| format!("layer{s}")).collect());
        Ok(ResNet { input, conv1, bn1, stages, fc, checkpointing })
    }

    fn modules(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.conv1, &self.bn1];
        for block in self.stages.iter().flat_map(|s| s.iter()) {
            out.extend(block.modules());
        }
        out.push(&self.fc);
        out
    }
}

impl Model for ResNet {
    fn kind(&self) -> ModelKind {
        ModelKind::ResNet
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        check_image_input(self.kind(), self.input, x)?;
        let mut h = self.bn1.forward(&self.conv1.forward(x)?, train)?.relu()?;
        for (i, stage) in self.stages.iter().enumerate() {
            let params =
                || stage.iter().flat_map(|b| b.modules()).flat_map(|m| m.parameters()).map(|(_, t)| t).collect();
            let stage = stage.clone();
            h = self.checkpointing.run(i, &h, params, move |x, _| {
                stage.iter().try_fold(x.clone(), |h, block| block.forward(&h, train))
            })?;
        }
        let pooled = ops::adaptive_avg_pool2d(&h, [1, 1])?;
        self.fc.forward(&pooled.flatten_from(1)?)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.modules().into_iter().flat_map(|m| m.parameters()).collect()
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        self.modules().into_iter().flat_map(|m| m.buffers()).collect()
    }

    fn checkpointing(&self) -> Option<&Checkpointing> {
        Some(&self.checkpointing)
    }
}
