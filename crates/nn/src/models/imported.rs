//! A user's PyTorch model, exported by `torch.export` and run by `memfit-import`: a [`Model`] whose
//! parameters and buffers keep their `state_dict` names and whose forward pass is the exported graph's
//! ops, each the memfit op of its meaning. Its task comes from its signature ([`image_task`]).

use super::{Model, ModelKind};
use memfit_import::{Archive, Program, FLOAT32};
use memfit_tensor::{Device, Error, Result, Tensor};
use std::sync::Arc;

/// The image-classification task of `archive`'s signature: one float32 input [N, C, H, W] (N the
/// exported batch dimension) and one output [N, K]; the input (C, H, W) and K classes.
pub fn image_task(archive: &Archive) -> std::result::Result<([usize; 3], usize), String> {
    let supported = "memfit trains an exported image classifier: one float32 input [N, C, H, W] and one \
                     output [N, K] (export with torch.export.export(model.train(), (x,), \
                     dynamic_shapes=({0: Dim(\"batch\")},)))";
    let inputs = archive.user_inputs();
    let [input] = inputs[..] else {
        return Err(format!("the program takes {} inputs; {supported}", inputs.len()));
    };
    let [output] = &archive.outputs[..] else {
        return Err(format!("the program returns {} outputs; {supported}", archive.outputs.len()));
    };
    let meta = |name: &str| archive.value(name).ok_or_else(|| format!("the graph does not describe {name}"));
    let (x, y) = (meta(input)?, meta(output)?);
    let image = match x.sizes[..] {
        [_, Some(c), Some(h), Some(w)] if x.dtype == FLOAT32 && c * h * w > 0 => [c, h, w],
        _ => return Err(format!("its input {input} has dtype code {} and sizes {:?}; {supported}", x.dtype, x.sizes)),
    };
    let classes = match y.sizes[..] {
        [_, Some(k)] if k > 0 => k,
        _ => return Err(format!("its output {output} has sizes {:?}; {supported}", y.sizes)),
    };
    Ok((image, classes))
}

/// An exported program as a trainable model.
pub struct Imported {
    program: Program,
}

impl Imported {
    /// The program's weights on `device`.
    pub fn new(archive: Arc<Archive>, device: &Device) -> Result<Self> {
        let program = Program::new(archive, device).map_err(|e| Error::invalid(e.to_string()))?;
        Ok(Imported { program })
    }
}

impl Model for Imported {
    fn kind(&self) -> ModelKind {
        ModelKind::Imported
    }

    /// Batch norm by the batch's statistics (moving the running ones) when `train`, else by the
    /// running ones, as PyTorch's `model.train()` and `model.eval()`.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.program.forward(x, train)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.program.parameters().to_vec()
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        self.program.buffers().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfit_import::{GraphInput, ValueMeta, INT64};

    fn archive(input: ValueMeta, output: ValueMeta) -> Archive {
        Archive {
            name: "m".into(),
            inputs: vec![GraphInput::User { value: input.name.clone() }],
            nodes: vec![],
            outputs: vec![output.name.clone()],
            values: vec![input, output],
            weights: vec![],
        }
    }

    fn value(name: &str, dtype: u64, sizes: &[Option<usize>]) -> ValueMeta {
        ValueMeta { name: name.into(), dtype, sizes: sizes.to_vec() }
    }

    #[test]
    fn an_image_classifier_s_signature_gives_its_input_and_classes() {
        let a =
            archive(value("x", FLOAT32, &[None, Some(3), Some(32), Some(32)]), value("y", FLOAT32, &[None, Some(7)]));
        assert_eq!(image_task(&a), Ok(([3, 32, 32], 7)));
    }

    #[test]
    fn another_signature_is_refused_with_what_memfit_trains() {
        let tokens = archive(value("x", INT64, &[None, Some(16)]), value("y", FLOAT32, &[None, Some(16), Some(50)]));
        let e = image_task(&tokens).unwrap_err();
        assert!(e.contains("its input x") && e.contains("float32 input [N, C, H, W]"), "{e}");
        let images_to_maps = archive(
            value("x", FLOAT32, &[None, Some(1), Some(8), Some(8)]),
            value("y", FLOAT32, &[None, Some(2), Some(8)]),
        );
        let e = image_task(&images_to_maps).unwrap_err();
        assert!(e.contains("its output y"), "{e}");
    }
}
