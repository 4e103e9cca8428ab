//! A user's PyTorch model, exported by `torch.export` and run by `memfit-import`: a [`Model`] whose
//! parameters and buffers keep their `state_dict` names and whose forward pass is the exported graph's
//! ops, each the memfit op of its meaning. Its task comes from its signature ([`task_of`]).

use super::{Model, ModelKind};
use crate::checkpointing::Checkpointing;
use memfit_import::{Archive, Program, FLOAT32, INT64};
use memfit_tensor::{Device, Result, Tensor};
use std::sync::Arc;

/// What an exported program learns, from its signature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// A float32 input [N, C, H, W] and an output [N, K]: image classification.
    Image { input: [usize; 3], classes: usize },
    /// An int64 input [N, T] and an output [N, T, V]: next-token prediction over a vocabulary of V.
    Tokens { context: usize, vocab: usize },
}

/// The task of `archive`'s signature: one input and one output, N the exported batch dimension.
pub fn task_of(archive: &Archive) -> std::result::Result<Task, String> {
    let supported = "memfit trains an exported image classifier (one float32 input [N, C, H, W], one output \
                     [N, K]) or next-token predictor (one int64 input [N, T], one output [N, T, V]); export \
                     with torch.export.export(model.train(), (x,), dynamic_shapes=({0: Dim(\"batch\")},))";
    let inputs = archive.user_inputs();
    let [input] = inputs[..] else {
        return Err(format!("the program takes {} inputs; {supported}", inputs.len()));
    };
    let [output] = &archive.outputs[..] else {
        return Err(format!("the program returns {} outputs; {supported}", archive.outputs.len()));
    };
    let meta = |name: &str| archive.value(name).ok_or_else(|| format!("the graph does not describe {name}"));
    let (x, y) = (meta(input)?, meta(output)?);
    match (x.dtype, &x.sizes[..], &y.sizes[..]) {
        (FLOAT32, [_, Some(c), Some(h), Some(w)], [_, Some(k)]) if c * h * w > 0 && *k > 0 => {
            Ok(Task::Image { input: [*c, *h, *w], classes: *k })
        }
        (INT64, [_, Some(t)], [_, Some(t2), Some(v)]) if t == t2 && *t > 0 && *v > 0 => {
            Ok(Task::Tokens { context: *t, vocab: *v })
        }
        _ => Err(format!(
            "its input {input} has dtype code {} and sizes {:?}, its output {output} sizes {:?}; {supported}",
            x.dtype, x.sizes, y.sizes
        )),
    }
}

/// An exported program as a trainable model; its checkpointable segments are the program's
/// (module paths, Note [Imported segments] in `memfit-import`).
pub struct Imported {
    program: Program,
    checkpointing: Checkpointing,
}

impl Imported {
    /// The program's weights on `device`.
    pub fn new(archive: Arc<Archive>, device: &Device) -> Result<Self> {
        let program = Program::new(archive, device)?;
        let checkpointing = Checkpointing::new(program.segments());
        Ok(Imported { program, checkpointing })
    }
}

impl Model for Imported {
    fn kind(&self) -> ModelKind {
        ModelKind::Imported
    }

    /// Batch norm by the batch's statistics (moving the running ones) when `train`, else by the
    /// running ones, as PyTorch's `model.train()` and `model.eval()`.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.program.forward_checkpointed(x, train, &self.checkpointing.get())
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.program.parameters().to_vec()
    }

    fn buffers(&self) -> Vec<(String, Tensor)> {
        self.program.buffers().to_vec()
    }

    fn checkpointing(&self) -> Option<&Checkpointing> {
        Some(&self.checkpointing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfit_import::{GraphInput, ValueMeta};

    fn archive(input: ValueMeta, output: ValueMeta) -> Archive {
        Archive {
            path: "m.pt2".into(),
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
    fn a_signature_gives_an_image_classifier_or_a_next_token_predictor() {
        let a =
            archive(value("x", FLOAT32, &[None, Some(3), Some(32), Some(32)]), value("y", FLOAT32, &[None, Some(7)]));
        assert_eq!(task_of(&a), Ok(Task::Image { input: [3, 32, 32], classes: 7 }));
        let a = archive(value("x", INT64, &[None, Some(16)]), value("y", FLOAT32, &[None, Some(16), Some(50)]));
        assert_eq!(task_of(&a), Ok(Task::Tokens { context: 16, vocab: 50 }));
    }

    #[test]
    fn another_signature_is_refused_with_what_memfit_trains() {
        let float_tokens =
            archive(value("x", FLOAT32, &[None, Some(16)]), value("y", FLOAT32, &[None, Some(16), Some(50)]));
        let e = task_of(&float_tokens).unwrap_err();
        assert!(e.contains("its input x") && e.contains("int64 input [N, T]"), "{e}");
        let images_to_maps = archive(
            value("x", FLOAT32, &[None, Some(1), Some(8), Some(8)]),
            value("y", FLOAT32, &[None, Some(2), Some(8)]),
        );
        let e = task_of(&images_to_maps).unwrap_err();
        assert!(e.contains("its output y") && e.contains("float32 input [N, C, H, W]"), "{e}");
    }
}
