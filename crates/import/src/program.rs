//! An archive's graph run on a memfit device: its weights as memfit tensors (parameters require
//! grad, under their `state_dict` names), and a forward pass that calls, node by node, the memfit op
//! of the ATen op's meaning. Arguments follow ATen's schemas, defaults included (`max_pool2d`'s stride
//! is its kernel when empty).

use crate::archive::{Archive, Arg, GraphInput, Node};
use crate::{ImportError, Result};
use memfit_tensor::ops::{self, Conv2dParams, Pool2dParams};
use memfit_tensor::{Category, Device, Error, Tensor};
use std::collections::HashMap;

/// The ATen ops memfit runs, as the graph names them.
pub const SUPPORTED_OPS: &[&str] = &[
    "torch.ops.aten.conv2d.default",
    "torch.ops.aten.flatten.using_ints",
    "torch.ops.aten.linear.default",
    "torch.ops.aten.max_pool2d.default",
    "torch.ops.aten.relu.default",
    "torch.ops.aten.relu_.default",
];

/// An exported program on a device.
pub struct Program {
    archive: Archive,
    /// Graph value -> its tensor, for every parameter and buffer.
    weights: Vec<(String, Tensor)>,
    /// `state_dict` name -> its tensor, parameters only, in the signature's order.
    parameters: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    input: String,
    output: String,
}

impl Program {
    /// The archive's weights on `device` (parameters requiring grad, category `parameter`; buffers
    /// `other`). One user input and one user output, as memfit's tasks need.
    pub fn new(archive: Archive, device: &Device) -> Result<Program> {
        let user: Vec<&str> = archive
            .inputs
            .iter()
            .filter_map(|i| match i {
                GraphInput::User { value } => Some(value.as_str()),
                _ => None,
            })
            .collect();
        let [input] = user[..] else {
            return Err(ImportError(format!(
                "{}: the program takes {} inputs; memfit feeds one (a batch of images or of token ids)",
                archive.name,
                user.len()
            )));
        };
        let [output] = &archive.outputs[..] else {
            return Err(ImportError(format!(
                "{}: the program returns {} outputs; memfit trains on one (the logits)",
                archive.name,
                archive.outputs.len()
            )));
        };
        let (input, output) = (input.to_string(), output.clone());
        let (mut weights, mut parameters, mut buffers) = (Vec::new(), Vec::new(), Vec::new());
        for spec in &archive.inputs {
            let (value, name, trainable) = match spec {
                GraphInput::Parameter { value, name } => (value, name, true),
                GraphInput::Buffer { value, name } => (value, name, false),
                GraphInput::User { .. } => continue,
            };
            let w = archive
                .weights
                .iter()
                .find(|w| &w.name == name)
                .ok_or_else(|| ImportError(format!("{}: no weight {name} in the archive", archive.name)))?;
            let category = if trainable { Category::Parameter } else { Category::Other };
            let t = Tensor::from_slice(device, &w.values, &w.shape, category)?;
            let t = if trainable { t.set_requires_grad(true) } else { t };
            weights.push((value.clone(), t.clone()));
            if trainable {
                parameters.push((name.clone(), t));
            } else {
                buffers.push((name.clone(), t));
            }
        }
        let program = Program { archive, weights, parameters, buffers, input, output };
        program.check_arguments()?;
        Ok(program)
    }

    /// Each node's arguments, checked before anything runs: an argument memfit does not honour is an
    /// error naming the node, not a silently different model.
    fn check_arguments(&self) -> Result<()> {
        for node in &self.archive.nodes {
            describe(node).map_err(|e| ImportError(format!("{}: {e}", self.archive.name)))?;
        }
        Ok(())
    }

    /// Trainable weights under their `state_dict` names.
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.parameters
    }

    /// Buffers under their `state_dict` names.
    pub fn buffers(&self) -> &[(String, Tensor)] {
        &self.buffers
    }

    /// The archive this program runs.
    pub fn archive(&self) -> &Archive {
        &self.archive
    }

    /// The program's output for `x`, recorded for autograd like any memfit ops. Errors are memfit's
    /// own (an out-of-memory stays one, so a trainer can recover from it).
    pub fn forward(&self, x: &Tensor) -> memfit_tensor::Result<Tensor> {
        let mut values: HashMap<&str, Tensor> = self.weights.iter().map(|(v, t)| (v.as_str(), t.clone())).collect();
        values.insert(self.input.as_str(), x.clone());
        for node in &self.archive.nodes {
            let op = describe(node).map_err(Error::invalid)?;
            let out = op.run(&|name: &str| {
                values
                    .get(name)
                    .cloned()
                    .ok_or_else(|| Error::invalid(format!("the graph uses {name} before it is made")))
            })?;
            let [name] = &node.outputs[..] else {
                return Err(Error::invalid(format!(
                    "{} defines {} values; memfit expects one",
                    node.target,
                    node.outputs.len()
                )));
            };
            // An in-place op (`relu_`) changes its input for every later use: memfit computes a new
            // tensor and has the input's name stand for it from here on.
            if node.target.ends_with("_.default") {
                if let Some(Arg::Tensor(input)) = node.arg("self") {
                    values.insert(input.as_str(), out.clone());
                }
            }
            values.insert(name.as_str(), out);
        }
        values
            .remove(self.output.as_str())
            .ok_or_else(|| Error::invalid(format!("the graph never makes its output {}", self.output)))
    }
}

/// A node as the memfit op it runs, its arguments read.
enum Op<'a> {
    Linear { input: &'a str, weight: &'a str, bias: Option<&'a str> },
    Conv2d { input: &'a str, weight: &'a str, bias: Option<&'a str>, params: Conv2dParams },
    MaxPool2d { input: &'a str, params: Pool2dParams },
    Relu { input: &'a str },
    Flatten { input: &'a str, start: i64, end: i64 },
}

impl Op<'_> {
    fn run(&self, get: &dyn Fn(&str) -> memfit_tensor::Result<Tensor>) -> memfit_tensor::Result<Tensor> {
        match *self {
            Op::Linear { input, weight, bias } => {
                let bias = bias.map(get).transpose()?;
                ops::linear(&get(input)?, &get(weight)?, bias.as_ref())
            }
            Op::Conv2d { input, weight, bias, params } => {
                let bias = bias.map(get).transpose()?;
                ops::conv2d(&get(input)?, &get(weight)?, bias.as_ref(), params)
            }
            Op::MaxPool2d { input, params } => ops::max_pool2d(&get(input)?, params),
            Op::Relu { input } => get(input)?.relu(),
            Op::Flatten { input, start, end } => {
                let x = get(input)?;
                let rank = x.rank() as i64;
                let dim = |d: i64| if d < 0 { d + rank } else { d };
                let (start, end) = (dim(start), dim(end));
                if rank == 0 {
                    return x.reshape(&[1]);
                }
                if !(0 <= start && start <= end && end < rank) {
                    return Err(Error::shape(format!("flatten({start}, {end}) of a rank-{rank} tensor")));
                }
                let shape = x.shape();
                let mut out: Vec<isize> = shape[..start as usize].iter().map(|&d| d as isize).collect();
                out.push(shape[start as usize..=end as usize].iter().product::<usize>() as isize);
                out.extend(shape[end as usize + 1..].iter().map(|&d| d as isize));
                x.reshape(&out)
            }
        }
    }
}

/// Reads `node`'s arguments as ATen's schema for its op defines them (defaults where absent).
fn describe(node: &Node) -> std::result::Result<Op<'_>, String> {
    let target = node.target.as_str();
    let tensor = |name: &str| -> std::result::Result<&str, String> {
        match node.arg(name) {
            Some(Arg::Tensor(t)) => Ok(t.as_str()),
            other => Err(format!("{target}: argument {name} should be a tensor, got {other:?}")),
        }
    };
    let optional_tensor = |name: &str| -> std::result::Result<Option<&str>, String> {
        match node.arg(name) {
            Some(Arg::Tensor(t)) => Ok(Some(t.as_str())),
            None | Some(Arg::None) => Ok(None),
            other => Err(format!("{target}: argument {name} should be a tensor or None, got {other:?}")),
        }
    };
    let int = |name: &str, default: i64| -> std::result::Result<i64, String> {
        match node.arg(name) {
            None => Ok(default),
            Some(Arg::Int(v)) => Ok(*v),
            other => Err(format!("{target}: argument {name} should be an integer, got {other:?}")),
        }
    };
    let bool_arg = |name: &str, default: bool| -> std::result::Result<bool, String> {
        match node.arg(name) {
            None => Ok(default),
            Some(Arg::Bool(v)) => Ok(*v),
            other => Err(format!("{target}: argument {name} should be a bool, got {other:?}")),
        }
    };
    // A pair of non-negative integers (`[k]` stands for `[k, k]`); `default` when absent or empty.
    let pair = |name: &str, default: [usize; 2]| -> std::result::Result<[usize; 2], String> {
        let values = match node.arg(name) {
            None => return Ok(default),
            Some(Arg::Ints(v)) => v,
            Some(Arg::Int(v)) => &vec![*v],
            other => return Err(format!("{target}: argument {name} should be integers, got {other:?}")),
        };
        let non_negative = |v: i64| usize::try_from(v).map_err(|_| format!("{target}: {name} {values:?} is negative"));
        match values[..] {
            [] => Ok(default),
            [a] => Ok([non_negative(a)?; 2]),
            [a, b] => Ok([non_negative(a)?, non_negative(b)?]),
            _ => Err(format!("{target}: {name} {values:?} has more than two values")),
        }
    };
    let op = match target {
        "torch.ops.aten.linear.default" => {
            Op::Linear { input: tensor("input")?, weight: tensor("weight")?, bias: optional_tensor("bias")? }
        }
        "torch.ops.aten.conv2d.default" => {
            let groups = usize::try_from(int("groups", 1)?).map_err(|_| format!("{target}: negative groups"))?;
            let params = Conv2dParams {
                stride: pair("stride", [1, 1])?,
                padding: pair("padding", [0, 0])?,
                dilation: pair("dilation", [1, 1])?,
                groups,
            };
            Op::Conv2d { input: tensor("input")?, weight: tensor("weight")?, bias: optional_tensor("bias")?, params }
        }
        "torch.ops.aten.max_pool2d.default" => {
            let kernel = pair("kernel_size", [0, 0])?;
            if kernel.contains(&0) {
                return Err(format!("{target}: kernel_size {kernel:?} must be positive"));
            }
            let params = Pool2dParams {
                kernel,
                stride: pair("stride", kernel)?,
                padding: pair("padding", [0, 0])?,
                dilation: pair("dilation", [1, 1])?,
                ceil_mode: bool_arg("ceil_mode", false)?,
            };
            Op::MaxPool2d { input: tensor("self")?, params }
        }
        "torch.ops.aten.relu.default" | "torch.ops.aten.relu_.default" => Op::Relu { input: tensor("self")? },
        "torch.ops.aten.flatten.using_ints" => {
            Op::Flatten { input: tensor("self")?, start: int("start_dim", 0)?, end: int("end_dim", -1)? }
        }
        other => return Err(format!("the graph calls {other}, which memfit does not import yet")),
    };
    Ok(op)
}
