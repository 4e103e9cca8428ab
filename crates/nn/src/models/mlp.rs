//! The MLP: `nn.Sequential(Linear(C*H*W, 1024), ReLU, Linear(1024, 1024), ReLU, Linear(1024, classes))`,
//! `state_dict` names `0.*`, `2.*`, `4.*`. Inputs [N, C, H, W] are flattened.

use super::{check_image_input, check_image_spec, Model, ModelKind};
use crate::init::Initializer;
use crate::layers::{Linear, Module};
use memfit_tensor::{Result, Tensor};

pub const HIDDEN: usize = 1024;

pub struct Mlp {
    input: [usize; 3],
    layers: [Linear; 3],
}

impl Mlp {
    pub fn new(init: &Initializer, input: [usize; 3], num_classes: usize) -> Result<Self> {
        check_image_spec(ModelKind::Mlp, input, num_classes)?;
        let in_features = input.iter().product();
        Ok(Mlp {
            input,
            layers: [
                Linear::new(init, "0", in_features, HIDDEN, true)?,
                Linear::new(init, "2", HIDDEN, HIDDEN, true)?,
                Linear::new(init, "4", HIDDEN, num_classes, true)?,
            ],
        })
    }
}

impl Model for Mlp {
    fn kind(&self) -> ModelKind {
        ModelKind::Mlp
    }

    fn forward(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        check_image_input(ModelKind::Mlp, self.input, x)?;
        let h = self.layers[0].forward(&x.flatten_from(1)?)?.relu()?;
        let h = self.layers[1].forward(&h)?.relu()?;
        self.layers[2].forward(&h)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.layers.iter().flat_map(|l| l.parameters()).collect()
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}
