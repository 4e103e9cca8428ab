//! An archive's graph run on a memfit device: its weights as memfit tensors (parameters require
//! grad, under their `state_dict` names), and a forward pass that calls, node by node, the memfit op
//! of the ATen op's meaning. Arguments follow ATen's schemas, defaults included (`max_pool2d`'s stride
//! is its kernel when empty); an argument memfit does not honour (a `div` rounding mode, an `alpha`
//! other than 1) is refused when the program is made, naming the node.
//!
//! Training and evaluation: the graph was exported in training mode; [`Program::forward`]'s `train`
//! chooses, as PyTorch's `model.train()`/`model.eval()` would, whether batch norm normalizes by the
//! batch's statistics and moves its running ones (and counts `num_batches_tracked`), or uses them. A
//! device whose buffers are frozen (a checkpointed segment's re-run, a replayed micro-batch) moves
//! nothing.

use crate::archive::{Archive, Arg, GraphInput, Node, SymInt, WeightDtype};
use crate::segments::in_place;
use crate::{ImportError, Result};
use memfit_tensor::ops::{self, Conv2dParams, Pool2dParams};
use memfit_tensor::{Category, DType, Device, Error, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// The ATen ops memfit runs, as the graph names them.
pub const SUPPORTED_OPS: &[&str] = &[
    "_operator.add",
    "_operator.floordiv",
    "_operator.mul",
    "torch.ops.aten.abs.default",
    "torch.ops.aten.adaptive_avg_pool2d.default",
    "torch.ops.aten.add.Tensor",
    "torch.ops.aten.add_.Tensor",
    "torch.ops.aten.alias.default",
    "torch.ops.aten.arange.default",
    "torch.ops.aten.avg_pool2d.default",
    "torch.ops.aten.batch_norm.default",
    "torch.ops.aten.bernoulli_.float",
    "torch.ops.aten.bmm.default",
    "torch.ops.aten.cat.default",
    "torch.ops.aten.chunk.default",
    "torch.ops.aten.clamp.default",
    "torch.ops.aten.clamp_.default",
    "torch.ops.aten.clamp_max.default",
    "torch.ops.aten.clamp_min.default",
    "torch.ops.aten.constant_pad_nd.default",
    "torch.ops.aten.contiguous.default",
    "torch.ops.aten.conv2d.default",
    "torch.ops.aten.cos.default",
    "torch.ops.aten.div.Tensor",
    "torch.ops.aten.div_.Tensor",
    "torch.ops.aten.dropout.default",
    "torch.ops.aten.dropout_.default",
    "torch.ops.aten.embedding.default",
    "torch.ops.aten.empty.memory_format",
    "torch.ops.aten.eq.Scalar",
    "torch.ops.aten.eq.Tensor",
    "torch.ops.aten.exp.default",
    "torch.ops.aten.expand.default",
    "torch.ops.aten.fill_.Scalar",
    "torch.ops.aten.flatten.using_ints",
    "torch.ops.aten.ge.Scalar",
    "torch.ops.aten.ge.Tensor",
    "torch.ops.aten.gelu.default",
    "torch.ops.aten.gt.Scalar",
    "torch.ops.aten.gt.Tensor",
    "torch.ops.aten.hardsigmoid.default",
    "torch.ops.aten.hardswish.default",
    "torch.ops.aten.hardswish_.default",
    "torch.ops.aten.hardtanh.default",
    "torch.ops.aten.hardtanh_.default",
    "torch.ops.aten.index.Tensor",
    "torch.ops.aten.layer_norm.default",
    "torch.ops.aten.le.Scalar",
    "torch.ops.aten.le.Tensor",
    "torch.ops.aten.linear.default",
    "torch.ops.aten.log.default",
    "torch.ops.aten.log_softmax.int",
    "torch.ops.aten.lt.Scalar",
    "torch.ops.aten.lt.Tensor",
    "torch.ops.aten.masked_fill.Scalar",
    "torch.ops.aten.masked_fill_.Scalar",
    "torch.ops.aten.matmul.default",
    "torch.ops.aten.max_pool2d.default",
    "torch.ops.aten.mean.dim",
    "torch.ops.aten.mul.Tensor",
    "torch.ops.aten.mul_.Tensor",
    "torch.ops.aten.ne.Scalar",
    "torch.ops.aten.ne.Tensor",
    "torch.ops.aten.neg.default",
    "torch.ops.aten.new_zeros.default",
    "torch.ops.aten.pad.default",
    "torch.ops.aten.permute.default",
    "torch.ops.aten.pow.Tensor_Scalar",
    "torch.ops.aten.relu.default",
    "torch.ops.aten.relu6.default",
    "torch.ops.aten.relu_.default",
    "torch.ops.aten.reshape.default",
    "torch.ops.aten.roll.default",
    "torch.ops.aten.rsqrt.default",
    "torch.ops.aten.scaled_dot_product_attention.default",
    "torch.ops.aten.select.int",
    "torch.ops.aten.sigmoid.default",
    "torch.ops.aten.silu.default",
    "torch.ops.aten.silu_.default",
    "torch.ops.aten.sin.default",
    "torch.ops.aten.slice.Tensor",
    "torch.ops.aten.softmax.int",
    "torch.ops.aten.split.Tensor",
    "torch.ops.aten.split_with_sizes.default",
    "torch.ops.aten.sqrt.default",
    "torch.ops.aten.squeeze.dim",
    "torch.ops.aten.stack.default",
    "torch.ops.aten.sub.Tensor",
    "torch.ops.aten.sub_.Tensor",
    "torch.ops.aten.sum.dim_IntList",
    "torch.ops.aten.sym_size.int",
    "torch.ops.aten.tanh.default",
    "torch.ops.aten.transpose.int",
    "torch.ops.aten.unbind.int",
    "torch.ops.aten.unflatten.int",
    "torch.ops.aten.unsqueeze.default",
    "torch.ops.aten.view.default",
    "torch.ops.aten.where.ScalarOther",
    "torch.ops.aten.where.ScalarSelf",
    "torch.ops.aten.where.self",
    "torch.ops.aten.zeros_like.default",
];

/// An exported program on a device.
pub struct Program {
    graph: Arc<Graph>,
    /// `state_dict` name -> its tensor, parameters only, in the signature's order.
    parameters: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    input: String,
    output: String,
    /// The parts that can run checkpointed (Note [Imported segments]), in graph order.
    segments: Vec<crate::segments::Segment>,
}

/// What a pass over the graph reads: the archive, the weights, and what was worked out of the graph
/// once. Shared with the re-runs of checkpointed segments.
struct Graph {
    archive: Arc<Archive>,
    /// Graph value -> its tensor, for every parameter and buffer.
    weights: Vec<(String, Tensor)>,
    /// For each node, the values it reads for the last time: a pass lets go of them right after it,
    /// as PyTorch's eager execution does, so a value lives as long as its uses (and what autograd
    /// saved of it), not the whole forward pass.
    last_reads: Vec<Vec<String>>,
    /// For a node whose output only a `linear` reads, as its input, and that memfit runs fused into
    /// it (Note [Fused pairs]): that linear's index.
    fused: Vec<Option<usize>>,
}

/// What a pass holds between nodes, by graph name.
struct PassState<'g> {
    values: HashMap<&'g str, Tensor>,
    /// Symbolic sizes (`sym_size`: the batch), as this pass's inputs give them.
    symbols: HashMap<&'g str, i64>,
    /// Additive attention masks built from a boolean one (`zeros_like` then `masked_fill_(-inf)`, as
    /// `nn.MultiheadAttention` does): kept as the boolean mask memfit's attention takes.
    masks: HashMap<&'g str, Mask>,
    /// Outputs of fused producers, computed by the linear that reads them (Note [Fused pairs]).
    pending: HashMap<&'g str, &'g Node>,
    /// Stochastic depth's noise on its way (`empty`, then `bernoulli_`).
    blanks: HashMap<&'g str, Noise>,
}

impl<'g> PassState<'g> {
    /// The graph's weights and nothing else.
    fn new(graph: &'g Graph) -> Self {
        PassState {
            values: graph.weights.iter().map(|(v, t)| (v.as_str(), t.clone())).collect(),
            symbols: HashMap::new(),
            masks: HashMap::new(),
            pending: HashMap::new(),
            blanks: HashMap::new(),
        }
    }
}

impl Program {
    /// The archive's weights on `device` (parameters requiring grad, category `parameter`; buffers
    /// `other`). One user input and one user output, as memfit's tasks need.
    pub fn new(archive: Arc<Archive>, device: &Device) -> Result<Program> {
        let user = archive.user_inputs();
        let [input] = user[..] else {
            return Err(ImportError::Archive(format!(
                "{}: the program takes {} inputs; memfit feeds one (a batch of images or of token ids)",
                archive.name,
                user.len()
            )));
        };
        let [output] = &archive.outputs[..] else {
            return Err(ImportError::Archive(format!(
                "{}: the program returns {} outputs; memfit trains on one (the logits)",
                archive.name,
                archive.outputs.len()
            )));
        };
        let (input, output) = (input.to_string(), output.clone());
        let (mut weights, mut parameters, mut buffers) = (Vec::new(), Vec::new(), Vec::new());
        // Weights' bytes only where they are computed with (meta allocates, as the device would).
        let mut reader = if device.computes() { Some(archive.weight_reader()?) } else { None };
        for spec in &archive.inputs {
            let (value, name, trainable) = match spec {
                GraphInput::Parameter { value, name } => (value, name, true),
                GraphInput::Buffer { value, name } => (value, name, false),
                GraphInput::User { .. } => continue,
            };
            let w =
                archive.weights.iter().find(|w| &w.name == name).ok_or_else(|| {
                    ImportError::Archive(format!("{}: no weight {name} in the archive", archive.name))
                })?;
            let category = if trainable { Category::Parameter } else { Category::Other };
            let dtype = match w.dtype {
                WeightDtype::F32 => DType::F32,
                WeightDtype::I64 => DType::I64,
                WeightDtype::Bool => DType::Bool,
            };
            let t = Tensor::empty(device, &w.shape, dtype, category, "import")?;
            if let Some(reader) = reader.as_mut() {
                let bytes = reader.read(w)?;
                match w.dtype {
                    WeightDtype::F32 => t.overwrite_with::<f32>(|d| {
                        for (v, b) in d.iter_mut().zip(bytes.chunks_exact(4)) {
                            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                    })?,
                    WeightDtype::I64 => t.overwrite_with::<i64>(|d| {
                        for (v, b) in d.iter_mut().zip(bytes.chunks_exact(8)) {
                            *v = i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                        }
                    })?,
                    WeightDtype::Bool => t.overwrite_with::<bool>(|d| {
                        for (v, b) in d.iter_mut().zip(bytes) {
                            *v = *b != 0;
                        }
                    })?,
                }
            }
            let t = if trainable { t.set_requires_grad(true) } else { t };
            weights.push((value.clone(), t.clone()));
            if trainable {
                parameters.push((name.clone(), t));
            } else {
                buffers.push((name.clone(), t));
            }
        }
        let fused = fused_producers(&archive, &output);
        let last_reads = last_reads(&archive, &weights, &output, &fused);
        let segments = crate::segments::find(&archive, &weights, &output, &fused);
        let graph = Arc::new(Graph { archive, weights, last_reads, fused });
        let program = Program { graph, parameters, buffers, input, output, segments };
        program.check_arguments()?;
        Ok(program)
    }

    /// Each node's arguments, checked before anything runs: an argument memfit does not honour is an
    /// error naming the node, not a silently different model.
    fn check_arguments(&self) -> Result<()> {
        let name = &self.graph.archive.name;
        for node in &self.graph.archive.nodes {
            let op =
                describe(node).map_err(|e| ImportError::Archive(format!("{name}: {e} (from {})", node.location())))?;
            // An in-place add into a buffer is a counter's `+= 1` (batch norm's num_batches_tracked);
            // into an activation (a residual's `out += identity`), an add.
            if let Op::AddInPlace { a, b } = op {
                let buffer = self.graph.weights.iter().find(|(v, _)| v == a).map(|(_, t)| t);
                let counter = buffer.is_some_and(|t| t.dtype() == memfit_tensor::DType::I64);
                let fits = match b {
                    Operand::Number(c) => counter && c == 1.0,
                    Operand::Value(_) => buffer.is_none(),
                };
                if !fits {
                    return Err(ImportError::Archive(format!(
                        "{name}: {} adds into {a} in place; memfit honours that for an activation, or for an int64 \
                         buffer counting by 1 (batch norm's num_batches_tracked)",
                        node.target
                    )));
                }
            }
            // `fill_` writes where its view lies, into the tensor it views: honoured for a constant the
            // graph builds (views of a `new_zeros`, as Swin's attention mask), never for a value a
            // backward may have saved.
            if let Op::Fill { input, .. } = op {
                if !self.views_new_zeros(input) {
                    return Err(ImportError::Archive(format!(
                        "{name}: {} writes into {input} in place; memfit honours that only for views of a new_zeros \
                         (a constant mask the graph builds) (from {})",
                        node.target,
                        node.location()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Whether `value` is a `new_zeros` output or a view of one (through slices, selections, views
    /// and the like).
    fn views_new_zeros(&self, value: &str) -> bool {
        const VIEWS: [&str; 9] = [
            "torch.ops.aten.slice.Tensor",
            "torch.ops.aten.select.int",
            "torch.ops.aten.view.default",
            "torch.ops.aten.unsqueeze.default",
            "torch.ops.aten.squeeze.dim",
            "torch.ops.aten.transpose.int",
            "torch.ops.aten.permute.default",
            "torch.ops.aten.alias.default",
            "torch.ops.aten.expand.default",
        ];
        let nodes = &self.graph.archive.nodes;
        let mut current = value.to_string();
        // A graph is acyclic: at most one step per node.
        for _ in 0..=nodes.len() {
            let Some(node) = nodes.iter().find(|n| n.outputs.iter().any(|o| *o == current)) else { return false };
            if node.target == "torch.ops.aten.new_zeros.default" {
                return true;
            }
            match (VIEWS.contains(&node.target.as_str()), node.reads().next()) {
                (true, Some(source)) => current = source.to_string(),
                _ => return false,
            }
        }
        false
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
        &self.graph.archive
    }

    /// The names of the parts that can run checkpointed (module paths such as `layer1`,
    /// `features.3`, `encoder.layers.encoder_layer_0`), in forward order (Note [Imported segments]).
    pub fn segments(&self) -> Vec<String> {
        self.segments.iter().map(|s| s.name.clone()).collect()
    }

    /// The program's output for `x`, in training mode or not (see the module's documentation),
    /// recorded for autograd like any memfit ops. Errors are memfit's own (an out-of-memory stays
    /// one, so a trainer can recover from it).
    pub fn forward(&self, x: &Tensor, train: bool) -> memfit_tensor::Result<Tensor> {
        self.forward_checkpointed(x, train, &[])
    }

    /// [`Program::forward`] with the segments whose flag in `checkpointed` is set (one per
    /// [`Program::segments`]; missing flags are unset) run checkpointed: only their input is kept
    /// for backward, and they run again there. The same numbers, less memory.
    pub fn forward_checkpointed(
        &self,
        x: &Tensor,
        train: bool,
        checkpointed: &[bool],
    ) -> memfit_tensor::Result<Tensor> {
        let graph = &self.graph;
        let mut state = PassState::new(graph);
        state.values.insert(self.input.as_str(), x.clone());
        let mut i = 0;
        while i < graph.archive.nodes.len() {
            let segment = self
                .segments
                .iter()
                .enumerate()
                .find(|(k, s)| s.nodes.start == i && checkpointed.get(*k) == Some(&true));
            match segment {
                Some((_, segment)) => {
                    let (out, sizes) = self.run_checkpointed(segment, &state, train)?;
                    for done in graph.last_reads[segment.nodes.clone()].iter().flatten() {
                        state.values.remove(done.as_str());
                        state.masks.remove(done.as_str());
                    }
                    state.values.insert(segment.output.as_str(), out);
                    for (name, v) in segment.exports.iter().zip(sizes) {
                        if let Some(v) = v {
                            state.symbols.insert(name.as_str(), v);
                        }
                    }
                    i = segment.nodes.end;
                }
                None => {
                    graph.run(&mut state, i..i + 1, x.device(), train)?;
                    i += 1;
                }
            }
        }
        state
            .values
            .remove(self.output.as_str())
            .ok_or_else(|| Error::invalid(format!("the graph never makes its output {}", self.output)))
    }

    /// `segment` run checkpointed from `state` (its input, and what it carries in from before it):
    /// its output, and the sizes it makes for what comes after it.
    fn run_checkpointed(
        &self,
        segment: &crate::segments::Segment,
        state: &PassState<'_>,
        train: bool,
    ) -> memfit_tensor::Result<(Tensor, Vec<Option<i64>>)> {
        let input = state.values.get(segment.input.as_str()).cloned().ok_or_else(|| {
            Error::invalid(format!("segment {}: its input {} is not made yet", segment.name, segment.input))
        })?;
        let symbols: Vec<(String, i64)> =
            segment.captured.iter().filter_map(|n| state.symbols.get(n.as_str()).map(|&v| (n.clone(), v))).collect();
        let masks: Vec<(String, Mask)> = segment
            .captured
            .iter()
            .filter_map(|n| state.masks.get(n.as_str()).map(|m| (n.clone(), m.clone())))
            .collect();
        let constants: Vec<(String, Tensor)> = segment
            .captured
            .iter()
            .filter_map(|n| state.values.get(n.as_str()).map(|t| (n.clone(), t.clone())))
            .collect();
        // The sizes the segment makes for what comes after it, from its forward run.
        let exported = Arc::new(std::sync::Mutex::new(Vec::new()));
        let params: Vec<Tensor> = segment
            .weights
            .iter()
            .filter_map(|n| state.values.get(n.as_str()))
            .filter(|t| t.requires_grad())
            .cloned()
            .collect();
        let (graph, spec, sizes) = (self.graph.clone(), segment.clone(), exported.clone());
        let run = move |xs: &[Tensor], _: memfit_tensor::autograd::Pass| {
            let device = xs[0].device();
            let mut state = PassState::new(&graph);
            state.values.insert(spec.input.as_str(), xs[0].clone());
            state.values.extend(constants.iter().map(|(n, t)| (n.as_str(), t.clone())));
            state.symbols.extend(symbols.iter().map(|(n, v)| (n.as_str(), *v)));
            state.masks.extend(masks.iter().map(|(n, m)| (n.as_str(), m.clone())));
            graph.run(&mut state, spec.nodes.clone(), device, train)?;
            let made: Vec<Option<i64>> = spec.exports.iter().map(|n| state.symbols.get(n.as_str()).copied()).collect();
            *sizes.lock().unwrap_or_else(|e| e.into_inner()) = made;
            state
                .values
                .remove(spec.output.as_str())
                .ok_or_else(|| Error::invalid(format!("segment {} never makes its output {}", spec.name, spec.output)))
        };
        let out = memfit_tensor::autograd::checkpoint(&[&input], &params, Arc::new(run))?;
        let made = std::mem::take(&mut *exported.lock().unwrap_or_else(|e| e.into_inner()));
        Ok((out, made))
    }
}

impl Graph {
    /// Runs `nodes` of the graph over `state`, on `device`, in training mode or not.
    fn run<'g>(
        &'g self,
        state: &mut PassState<'g>,
        nodes: std::ops::Range<usize>,
        device: &memfit_tensor::Device,
        train: bool,
    ) -> memfit_tensor::Result<()> {
        let mode = Mode { train, update: train && !device.buffers_frozen() };
        let PassState { values, symbols, masks, pending, blanks } = state;
        for i in nodes {
            let node = &self.archive.nodes[i];
            let op = describe(node).map_err(Error::invalid)?;
            // A split defines its pieces (`pieces`); every other node one value.
            let name = match (&node.outputs[..], &op) {
                (_, Op::Split { .. }) => "",
                ([name], _) => name.as_str(),
                (names, _) => {
                    return Err(Error::invalid(format!(
                        "{} defines {} values; memfit expects one",
                        node.target,
                        names.len()
                    )))
                }
            };
            let mut pieces = Vec::new();
            let get = |name: &str| {
                values
                    .get(name)
                    .cloned()
                    .ok_or_else(|| Error::invalid(format!("the graph uses {name} before it is made")))
            };
            let out = match op {
                _ if self.fused[i].is_some() => {
                    pending.insert(name, node);
                    None
                }
                Op::Linear { input, weight, bias } if pending.contains_key(input) => {
                    let producer = pending.remove(input).expect("checked above");
                    let bias = bias.map(get).transpose()?;
                    Some(match describe(producer).map_err(Error::invalid)? {
                        Op::Unary { input: x, op: UnaryOp::Gelu } => {
                            ops::gelu_linear(&get(x)?, &get(weight)?, bias.as_ref())?
                        }
                        Op::LayerNorm { input: x, weight: Some(w), bias: Some(b), eps, .. } => {
                            ops::layer_norm_linear(&get(x)?, &get(w)?, &get(b)?, eps, &get(weight)?, bias.as_ref())?
                        }
                        // A layer norm read through a transpose: the pair runs first, the transpose after.
                        Op::Transpose { input: normed, dims } => {
                            let norm =
                                pending.remove(normed).ok_or_else(|| Error::invalid("internal: a lone transpose"))?;
                            let Op::LayerNorm { input: x, weight: Some(w), bias: Some(b), eps, .. } =
                                describe(norm).map_err(Error::invalid)?
                            else {
                                return Err(Error::invalid("internal: a transposed producer of another kind"));
                            };
                            let y = ops::layer_norm_linear(
                                &get(x)?,
                                &get(w)?,
                                &get(b)?,
                                eps,
                                &get(weight)?,
                                bias.as_ref(),
                            )?;
                            y.transpose(dims[0] as isize, dims[1] as isize)?
                        }
                        _ => return Err(Error::invalid("internal: a fused producer of another kind")),
                    })
                }
                Op::SymSize { input, dim } => {
                    let t = get(input)?;
                    let d = if dim < 0 { dim + t.rank() as i64 } else { dim };
                    let size = usize::try_from(d).ok().and_then(|d| t.shape().get(d).copied()).ok_or_else(|| {
                        Error::shape(format!("sym_size of dimension {dim} of a {:?} tensor", t.shape()))
                    })?;
                    symbols.insert(name, size as i64);
                    None
                }
                Op::Reshape { input, sizes } => Some(get(input)?.contiguous()?.reshape(&resolve(&sizes, &symbols)?)?),
                Op::Expand { input, sizes } => {
                    let x = get(input)?;
                    let sizes = resolve(sizes, &symbols)?;
                    // -1 keeps the input's size, aligned from the right as broadcasting aligns.
                    let lead = sizes
                        .len()
                        .checked_sub(x.rank())
                        .ok_or_else(|| Error::shape(format!("expand of a {:?} tensor to {sizes:?}", x.shape())))?;
                    let shape = sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &s)| match s {
                            -1 if i >= lead => Ok(x.shape()[i - lead]),
                            s => usize::try_from(s).map_err(|_| Error::shape(format!("expand to {sizes:?}"))),
                        })
                        .collect::<memfit_tensor::Result<Vec<usize>>>()?;
                    Some(x.expand(&shape)?)
                }
                Op::Slice { input, dim, start, end, step } => {
                    let x = get(input)?;
                    let d = if dim < 0 { dim + x.rank() as i64 } else { dim };
                    let size =
                        usize::try_from(d).ok().and_then(|d| x.shape().get(d).copied()).ok_or_else(|| {
                            Error::shape(format!("slice of dimension {dim} of a {:?} tensor", x.shape()))
                        })? as i64;
                    // Python's slice bounds: negative from the end, then clamped to the size.
                    let bound = |o: &SymOperand| {
                        let v = sym_value(o, &symbols)?;
                        Ok::<_, Error>((if v < 0 { v.saturating_add(size) } else { v }).clamp(0, size) as usize)
                    };
                    Some(x.slice_step(d as isize, bound(&start)?, bound(&end)?, step)?)
                }
                Op::Empty { sizes } => {
                    let shape = resolve(&sizes, &symbols)?
                        .into_iter()
                        .map(|d| usize::try_from(d).map_err(|_| Error::shape(format!("empty of size {d}"))))
                        .collect::<memfit_tensor::Result<Vec<usize>>>()?;
                    blanks.insert(name, Noise { shape, keep: None });
                    None
                }
                Op::Bernoulli { input, p } => {
                    let shape = match blanks.get(input) {
                        Some(Noise { shape, keep: None }) => shape.clone(),
                        _ => return Err(Error::invalid(format!("{}: {NOISE}", node.target))),
                    };
                    let noise = Noise { shape, keep: Some(p) };
                    blanks.insert(input, noise.clone());
                    blanks.insert(name, noise);
                    None
                }
                Op::Binary { a, b: Operand::Number(c), op: Elementwise::Div } if blanks.contains_key(a) => {
                    let shape = match blanks.get(a) {
                        Some(Noise { shape, keep: Some(p) }) if *p == c => shape.clone(),
                        _ => return Err(Error::invalid(format!("{}: {NOISE}", node.target))),
                    };
                    // A keep mask over the survival probability: dropout's values, by the pass's seed.
                    let ones = Tensor::full(device, &shape, 1.0, DType::F32, Category::Temporary)?;
                    let seed = device.random_seed() ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Some(ops::dropout(&ones, 1.0 - c, mode.train, seed)?)
                }
                Op::Split { input, dim, split } => {
                    let x = get(input)?;
                    let d = if dim < 0 { dim + x.rank() as i64 } else { dim };
                    let size = usize::try_from(d).ok().and_then(|d| x.shape().get(d).copied()).ok_or_else(|| {
                        Error::shape(format!("{} of dimension {dim} of a {:?} tensor", node.target, x.shape()))
                    })?;
                    let lengths = split.lengths(size).map_err(|e| Error::shape(format!("{}: {e}", node.target)))?;
                    if lengths.len() != node.outputs.len() {
                        return Err(Error::invalid(format!(
                            "{} makes {} pieces but the graph names {}",
                            node.target,
                            lengths.len(),
                            node.outputs.len()
                        )));
                    }
                    let mut start = 0;
                    for len in lengths {
                        let piece = x.narrow(d as isize, start, len)?;
                        // unbind's pieces lose the dimension.
                        pieces.push(if matches!(split, Split::Each) { piece.squeeze(d as isize)? } else { piece });
                        start += len;
                    }
                    None
                }
                Op::Cat { tensors, dim, stack } => {
                    let list = tensors.iter().map(|t| get(t)).collect::<memfit_tensor::Result<Vec<_>>>()?;
                    let rank = list.first().map_or(0, |t| t.rank() as i64) + stack as i64;
                    let d = if dim < 0 { dim + rank } else { dim };
                    let d = usize::try_from(d)
                        .ok()
                        .filter(|&d| (d as i64) < rank.max(1))
                        .ok_or_else(|| Error::shape(format!("{} along dimension {dim}", node.target)))?;
                    Some(match stack {
                        true => ops::stack(&list, d)?,
                        false => ops::cat(&list, d as isize)?,
                    })
                }
                Op::SymArith { a, b, op } => {
                    let (a, b) = (sym_value(&a, &symbols)?, sym_value(&b, &symbols)?);
                    let v = match op {
                        SymOp::Mul => a.checked_mul(b),
                        SymOp::Add => a.checked_add(b),
                        SymOp::FloorDiv => (b != 0).then(|| a.div_euclid(b)),
                    };
                    let v = v.ok_or_else(|| Error::invalid(format!("{}: size arithmetic overflows", node.target)))?;
                    symbols.insert(name, v);
                    None
                }
                Op::ZerosLike { input, dtype } => {
                    let t = get(input)?;
                    if t.dtype() == DType::Bool && dtype == Some(crate::FLOAT32) {
                        masks.insert(name, Mask::ZerosOf(t));
                        None
                    } else {
                        let dtype = match dtype {
                            None => t.dtype(),
                            Some(crate::FLOAT32) => DType::F32,
                            Some(code) => return Err(Error::dtype(format!("zeros_like to dtype code {code}"))),
                        };
                        Some(Tensor::zeros(t.device(), t.shape(), dtype, Category::Temporary)?)
                    }
                }
                Op::MaskedFill { input, mask, value } if !masks.contains_key(input) => {
                    let x = get(input)?;
                    let fill = Tensor::scalar(device, value, x.dtype(), Category::Temporary)?;
                    Some(ops::where_(&get(mask)?, &fill, &x)?)
                }
                Op::MaskedFill { input, mask, value } => {
                    let template = match masks.get(input) {
                        Some(Mask::ZerosOf(t)) if value == f64::NEG_INFINITY && t.same(&get(mask)?) => t.clone(),
                        _ => {
                            return Err(Error::invalid(format!(
                                "{}: masked_fill_ is imported only to turn a boolean attention mask into an \
                                 additive one (zeros_like, then -inf where the mask is True)",
                                node.target
                            )))
                        }
                    };
                    masks.insert(input, Mask::Hidden(template.clone()));
                    masks.insert(name, Mask::Hidden(template));
                    None
                }
                Op::Unsqueeze { input, dim } if masks.contains_key(input) => {
                    let Some(Mask::Hidden(m)) = masks.get(input) else {
                        return Err(Error::invalid(format!("{}: an unfinished attention mask", node.target)));
                    };
                    let d = if dim < 0 { dim + m.rank() as i64 + 1 } else { dim };
                    let m = m.unsqueeze(usize::try_from(d).map_err(|_| Error::shape(format!("unsqueeze({dim})")))?)?;
                    masks.insert(name, Mask::Hidden(m));
                    None
                }
                Op::Attention { q, k, v, mask, causal } => {
                    let hidden = match mask {
                        None => None,
                        Some(m) => match masks.get(m) {
                            Some(Mask::Hidden(h)) => Some(h.clone()),
                            _ => {
                                return Err(Error::invalid(format!(
                                    "{}: an attention mask that is not a boolean one made additive is not imported",
                                    node.target
                                )))
                            }
                        },
                    };
                    Some(ops::scaled_dot_product_attention(&get(q)?, &get(k)?, &get(v)?, causal, hidden.as_ref())?)
                }
                Op::Dropout { input, p, train } => {
                    let seed = device.random_seed() ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Some(ops::dropout(&get(input)?, p, train && mode.train, seed)?)
                }
                Op::Arange { start, end, step } => {
                    let values: Vec<i64> = (start..end).step_by(step as usize).collect();
                    Some(Tensor::from_slice(device, &values, &[values.len()], Category::Input)?)
                }
                op => Some(op.run(mode, &get)?),
            };
            for (piece, t) in node.outputs.iter().zip(pieces) {
                values.insert(piece.as_str(), t);
            }
            // A value (None: a size, a mask on its way, a fused producer's, all kept apart).
            if let Some(out) = out {
                // An in-place op (`relu_`, `add_`) changes its input for every later use: memfit
                // computes a new tensor and has the input's name stand for it from here on.
                if in_place(&node.target) {
                    if let Some(Arg::Tensor(input)) = node.arg("self") {
                        values.insert(input.as_str(), out.clone());
                    }
                }
                values.insert(name, out);
            }
            for done in &self.last_reads[i] {
                values.remove(done.as_str());
                masks.remove(done.as_str());
            }
        }
        Ok(())
    }
}

/// The fewest samples a training pass of `archive`'s graph can take: 2 where batch norm in training
/// normalizes a single value per channel per sample (a 1 x 1 map, or a [N, C] input), whose batch
/// variance one sample leaves undefined (PyTorch refuses it: "expected more than 1 value per
/// channel"); else 1.
pub fn smallest_batch(archive: &Archive) -> usize {
    let single = archive.nodes.iter().any(|node| match describe(node) {
        Ok(Op::BatchNorm { input, training: true, .. }) => {
            archive.value(input).is_some_and(|v| v.sizes.len() >= 2 && v.sizes[2..].iter().all(|d| *d == Some(1)))
        }
        _ => false,
    });
    if single {
        2
    } else {
        1
    }
}

// Note [Fused pairs]
// memfit's own GPT saves less for backward than PyTorch's eager modules by fusing a layer norm into
// the product after it and GELU into the product after it (`ops::layer_norm_linear`,
// `ops::gelu_linear`: backward keeps the norm's or GELU's input, not its output too; the values are
// the unfused ops'). An imported graph gets the same where it has the same pattern: a `layer_norm`
// over the last dimension with a weight and a bias, or an exact `gelu`, whose output nothing but one
// `linear` reads, as its input; or such a layer norm read by a linear through a transpose of two
// dimensions other than the last (`nn.MultiheadAttention` with batch_first: the product commutes with
// it, so the pair runs and the transpose follows). The producer is then not run on its own; the
// linear runs the pair.

/// For each node memfit fuses into the `linear` after it (Note [Fused pairs]), that linear's index.
fn fused_producers(archive: &Archive, output: &str) -> Vec<Option<usize>> {
    let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, node) in archive.nodes.iter().enumerate() {
        for name in node.reads() {
            readers.entry(name).or_default().push(i);
        }
    }
    let only_reader = |node: &Node| -> Option<usize> {
        let [out] = &node.outputs[..] else { return None };
        match readers.get(out.as_str()).map(Vec::as_slice) {
            Some(&[j]) if out != output => Some(j),
            _ => None,
        }
    };
    // `j` is a linear that takes `node`'s output as its input.
    let linear_of = |node: &Node, j: usize| {
        let r = &archive.nodes[j];
        r.target == "torch.ops.aten.linear.default"
            && r.arg("input") == node.outputs.first().cloned().map(Arg::Tensor).as_ref()
    };
    // A transpose of two dimensions other than the last, read only by a linear as its input: the
    // product commutes with it (the layer norm under it runs fused, the transpose after).
    let transposed_into_linear = |j: usize| -> Option<usize> {
        let t = &archive.nodes[j];
        let keeps_last = match describe(t) {
            Ok(Op::Transpose { dims: [a, b], .. }) => {
                let rank = t.outputs.first().and_then(|o| archive.value(o)).map_or(0, |v| v.sizes.len()) as i64;
                let last = |d: i64| d == -1 || d == rank - 1;
                rank > 0 && !last(a) && !last(b)
            }
            _ => false,
        };
        only_reader(t).filter(|&k| keeps_last && linear_of(t, k))
    };
    let mut fused: Vec<Option<usize>> = archive
        .nodes
        .iter()
        .map(|node| {
            let fusable = match describe(node) {
                Ok(Op::Unary { op: UnaryOp::Gelu, .. }) => true,
                Ok(Op::LayerNorm { shape, weight: Some(_), bias: Some(_), .. }) => shape.len() == 1,
                _ => false,
            };
            only_reader(node).filter(|&j| fusable && linear_of(node, j))
        })
        .collect();
    // nn.MultiheadAttention's layer norm: read through a transpose (batch_first) by the in-projection.
    for (i, node) in archive.nodes.iter().enumerate() {
        let is_norm = matches!(describe(node), Ok(Op::LayerNorm { ref shape, weight: Some(_), bias: Some(_), .. }) if shape.len() == 1);
        if let Some(j) = only_reader(node).filter(|_| is_norm && fused[i].is_none()) {
            if let Some(k) = transposed_into_linear(j) {
                fused[i] = Some(k);
                fused[j] = Some(k);
            }
        }
    }
    fused
}

/// For each node of `archive`, the values (not weights, not the output) it is the last to read. A fused
/// producer's reads happen at the linear that runs it (`fused`).
fn last_reads(
    archive: &Archive,
    weights: &[(String, Tensor)],
    output: &str,
    fused: &[Option<usize>],
) -> Vec<Vec<String>> {
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (i, node) in archive.nodes.iter().enumerate() {
        let at = fused[i].unwrap_or(i);
        for name in node.reads() {
            let slot = last.entry(name).or_insert(at);
            *slot = (*slot).max(at);
        }
    }
    let mut out = vec![Vec::new(); archive.nodes.len()];
    for (name, i) in last {
        if name != output && !weights.iter().any(|(v, _)| v == name) {
            out[i].push(name.to_string());
        }
    }
    out
}

/// Stochastic depth's noise before it is drawn: its shape, and the probability of keeping once
/// `bernoulli_` has named it.
#[derive(Clone)]
struct Noise {
    shape: Vec<usize>,
    keep: Option<f64>,
}

/// Why an `empty`, `bernoulli_` or division of them is refused.
const NOISE: &str = "empty, bernoulli_ and div_ are imported as stochastic depth's noise only: \
                     empty(sizes).bernoulli_(p).div_(p)";

/// What a boolean attention mask becomes on its way to being additive.
#[derive(Clone)]
enum Mask {
    /// `zeros_like(mask, float)`: not yet filled.
    ZerosOf(Tensor),
    /// -inf where the boolean mask is True: memfit's attention takes the boolean mask itself (True:
    /// not allowed).
    Hidden(Tensor),
}

#[derive(Clone, Debug)]
enum SymOperand {
    Int(i64),
    Name(String),
}

#[derive(Clone, Copy, Debug)]
enum SymOp {
    Mul,
    Add,
    FloorDiv,
}

/// An element-wise operand as a tensor: a value, or a number as a 0-d tensor of `like`'s dtype.
fn operand(
    o: &Operand,
    like: &Tensor,
    get: &dyn Fn(&str) -> memfit_tensor::Result<Tensor>,
) -> memfit_tensor::Result<Tensor> {
    match o {
        Operand::Value(v) => get(v),
        Operand::Number(c) => Tensor::scalar(like.device(), *c, like.dtype(), Category::Temporary),
    }
}

/// How `pad` fills what it adds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PadMode {
    /// A number.
    Constant,
    /// The elements mirrored about the edge, the edge itself not repeated.
    Reflect,
    /// The edge element repeated.
    Replicate,
    /// The other end's elements, as if the dimension wrapped around.
    Circular,
}

/// Padding made of `x`'s own elements (`mode` not constant), as PyTorch's `F.pad`: each padded
/// dimension (the last first) becomes a join of windows of `x`, so the gradient is theirs. Refused,
/// as PyTorch does, for a negative amount, and for reflection or wrapping by more than the
/// dimension holds.
fn pad_from_edges(x: &Tensor, pad: &[i64], mode: PadMode) -> memfit_tensor::Result<Tensor> {
    if pad.len() % 2 != 0 || pad.len() / 2 > x.rank() {
        return Err(Error::shape(format!("pad: {pad:?} is not pairs for at most {} dims", x.rank())));
    }
    let mut out = x.clone();
    for (k, pair) in pad.chunks_exact(2).enumerate() {
        let d = x.rank() - 1 - k;
        let n = out.shape()[d];
        let (lo, hi) = match (usize::try_from(pair[0]), usize::try_from(pair[1])) {
            (Ok(lo), Ok(hi)) => (lo, hi),
            _ => return Err(Error::shape(format!("pad {mode:?}: {pad:?} has a negative amount"))),
        };
        let limit = match mode {
            PadMode::Reflect => n.saturating_sub(1),
            PadMode::Circular => n,
            PadMode::Replicate | PadMode::Constant => usize::MAX,
        };
        if n == 0 || lo > limit || hi > limit {
            return Err(Error::shape(format!("pad {mode:?}: {pad:?} is more than dim {d}'s {n} elements allow")));
        }
        let at = |i: usize, len: usize| out.narrow(d as isize, i, len);
        let repeated = |i: usize, times: usize| -> memfit_tensor::Result<Tensor> {
            let mut shape = out.shape().to_vec();
            shape[d] = times;
            at(i, 1)?.expand(&shape)
        };
        let mut pieces = Vec::new();
        match mode {
            PadMode::Reflect => {
                for i in (1..=lo).rev() {
                    pieces.push(at(i, 1)?);
                }
                pieces.push(out.clone());
                for i in 1..=hi {
                    pieces.push(at(n - 1 - i, 1)?);
                }
            }
            PadMode::Replicate => {
                if lo > 0 {
                    pieces.push(repeated(0, lo)?);
                }
                pieces.push(out.clone());
                if hi > 0 {
                    pieces.push(repeated(n - 1, hi)?);
                }
            }
            PadMode::Circular | PadMode::Constant => {
                if lo > 0 {
                    pieces.push(at(n - lo, lo)?);
                }
                pieces.push(out.clone());
                if hi > 0 {
                    pieces.push(at(0, hi)?);
                }
            }
        }
        if pieces.len() > 1 {
            out = ops::cat(&pieces, d as isize)?;
        }
    }
    Ok(out)
}

/// A size operand's value: a number, or a symbol the pass knows by now.
fn sym_value(o: &SymOperand, symbols: &HashMap<&str, i64>) -> memfit_tensor::Result<i64> {
    match o {
        SymOperand::Int(v) => Ok(*v),
        SymOperand::Name(n) => symbols
            .get(n.as_str())
            .copied()
            .ok_or_else(|| Error::invalid(format!("the graph uses the size {n} before it is known"))),
    }
}

/// Sizes as numbers, symbols replaced by what the pass knows of them.
fn resolve(sizes: &[SymInt], symbols: &HashMap<&str, i64>) -> memfit_tensor::Result<Vec<isize>> {
    sizes
        .iter()
        .map(|s| match s {
            SymInt::Int(v) => Ok(*v as isize),
            SymInt::Name(n) => sym_value(&SymOperand::Name(n.clone()), symbols).map(|v| v as isize),
        })
        .collect()
}

/// How a split cuts its dimension.
#[derive(Clone, Debug)]
enum Split {
    /// `chunk`: this many pieces of the same length (the last shorter; fewer when they run out).
    Chunks(usize),
    /// `split`: pieces of this length (the last shorter).
    Length(usize),
    /// `split_with_sizes`: these lengths, adding up to the size.
    Lengths(Vec<usize>),
    /// `unbind`: every element its own piece.
    Each,
}

impl Split {
    /// The pieces' lengths for a dimension of `size`, as PyTorch cuts it.
    fn lengths(&self, size: usize) -> std::result::Result<Vec<usize>, String> {
        let of_length = |len: usize| {
            if len == 0 {
                return Err("pieces of length 0".to_string());
            }
            Ok((0..size.div_ceil(len)).map(|i| len.min(size - i * len)).collect())
        };
        match self {
            Split::Chunks(n) => of_length(size.div_ceil((*n).max(1)).max(1)),
            Split::Length(len) => of_length(*len),
            Split::Each => Ok(vec![1; size]),
            Split::Lengths(l) if l.iter().sum::<usize>() == size => Ok(l.clone()),
            Split::Lengths(l) => Err(format!("lengths {l:?} do not add up to the size {size}")),
        }
    }
}

/// How a forward pass runs: training (batch statistics) or evaluation (running ones), and whether the
/// buffers move.
#[derive(Clone, Copy)]
struct Mode {
    train: bool,
    update: bool,
}

/// One operand of an element-wise op: a graph value or a number.
#[derive(Clone, Copy)]
enum Operand<'a> {
    Value(&'a str),
    Number(f64),
}

#[derive(Clone, Copy)]
enum Elementwise {
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Clone, Copy)]
enum UnaryOp {
    Relu,
    Tanh,
    Sigmoid,
    Exp,
    Log,
    Neg,
    Gelu,
    GeluTanh,
    Silu,
    /// `min(max(x, 0), 6)`.
    Relu6,
    Hardsigmoid,
    Hardswish,
    Sqrt,
    Rsqrt,
    Cos,
    Sin,
    Abs,
}

/// A node as the memfit op it runs, its arguments read.
enum Op<'a> {
    Linear {
        input: &'a str,
        weight: &'a str,
        bias: Option<&'a str>,
    },
    Conv2d {
        input: &'a str,
        weight: &'a str,
        bias: Option<&'a str>,
        params: Conv2dParams,
    },
    MaxPool2d {
        input: &'a str,
        params: Pool2dParams,
    },
    AvgPool2d {
        input: &'a str,
        params: Pool2dParams,
        count_include_pad: bool,
    },
    AdaptiveAvgPool2d {
        input: &'a str,
        size: [usize; 2],
    },
    BatchNorm {
        input: &'a str,
        weight: Option<&'a str>,
        bias: Option<&'a str>,
        stats: Option<[&'a str; 2]>,
        training: bool,
        momentum: f64,
        eps: f64,
    },
    /// `a += b`: on an int64 buffer by 1, a counter (batch norm's `num_batches_tracked`, counted in
    /// training only); on an activation, an add.
    AddInPlace {
        a: &'a str,
        b: Operand<'a>,
    },
    Unary {
        input: &'a str,
        op: UnaryOp,
    },
    Binary {
        a: &'a str,
        b: Operand<'a>,
        op: Elementwise,
    },
    Flatten {
        input: &'a str,
        start: i64,
        end: i64,
    },
    /// `view`/`reshape` to sizes, numbers or symbols (run by [`Program::forward`], which knows them).
    Reshape {
        input: &'a str,
        sizes: Vec<SymInt>,
    },
    /// `clamp` (the gradient passes on the bounds) or `hardtanh` (strictly inside); a missing bound
    /// is infinite.
    Clamp {
        input: &'a str,
        lo: f64,
        hi: f64,
        hardtanh: bool,
    },
    /// `pow` by a number: 2, 3, 1, 0.5, -0.5 and -1 as the products, roots and quotient PyTorch
    /// computes them by; any other by memfit's pow.
    Pow {
        input: &'a str,
        exponent: f64,
    },
    /// A comparison, giving a bool tensor.
    Compare {
        a: &'a str,
        b: Operand<'a>,
        op: ops::Compare,
    },
    /// `where(condition, a, b)`.
    Where {
        condition: &'a str,
        a: Operand<'a>,
        b: Operand<'a>,
    },
    /// `masked_fill(input, mask, value)`: `value` where the mask is True.
    MaskedFillValue {
        input: &'a str,
        mask: &'a str,
        value: f64,
    },
    /// Padding, `pad` as ATen lists it (last dimension first, before and after): constant (negative
    /// numbers crop), or made of the input's own elements (`PadMode`).
    Pad {
        input: &'a str,
        pad: Vec<i64>,
        value: f64,
        mode: PadMode,
    },
    /// `empty(sizes)`: stochastic depth's noise to be (see [`Op::Bernoulli`]).
    Empty {
        sizes: Vec<SymInt>,
    },
    /// `bernoulli_(empty, p)`, to be divided by `p`: stochastic depth's noise (run as a dropout of
    /// ones with the pass's seed, none in evaluation).
    Bernoulli {
        input: &'a str,
        p: f64,
    },
    /// `new_zeros(self, size)`: zeros of `self`'s dtype (a mask a model builds).
    NewZeros {
        input: &'a str,
        sizes: Vec<i64>,
    },
    /// `fill_(self, value)`: in place, where `self` lies (a view writes into its base).
    Fill {
        input: &'a str,
        value: f64,
    },
    /// `roll(self, shifts, dims)`: cyclic shifts, one per dimension.
    Roll {
        input: &'a str,
        shifts: Vec<i64>,
        dims: Vec<i64>,
    },
    /// `self[index]` with one int64 index tensor on the first dimension (a table's rows: Swin's
    /// relative position bias), as an embedding lookup.
    IndexRows {
        table: &'a str,
        index: &'a str,
    },
    /// `expand` to sizes (-1 keeps a size), numbers or symbols.
    Expand {
        input: &'a str,
        sizes: &'a [SymInt],
    },
    /// `x[start:end:step]` along `dim`; the bounds may be symbols.
    Slice {
        input: &'a str,
        dim: i64,
        start: SymOperand,
        end: SymOperand,
        step: usize,
    },
    /// `chunk`, `split`, `split_with_sizes`, `unbind`: views of the pieces, the node's several values.
    Split {
        input: &'a str,
        dim: i64,
        split: Split,
    },
    /// `cat` (or `stack`, along a new dimension) of a list of values.
    Cat {
        tensors: &'a [String],
        dim: i64,
        stack: bool,
    },
    /// Arithmetic on symbolic sizes (`_operator.mul`: heads times the batch, for a view).
    SymArith {
        a: SymOperand,
        b: SymOperand,
        op: SymOp,
    },
    ZerosLike {
        input: &'a str,
        dtype: Option<u64>,
    },
    MaskedFill {
        input: &'a str,
        mask: &'a str,
        value: f64,
    },
    Unsqueeze {
        input: &'a str,
        dim: i64,
    },
    Squeeze {
        input: &'a str,
        dim: i64,
    },
    Transpose {
        input: &'a str,
        dims: [i64; 2],
    },
    Permute {
        input: &'a str,
        dims: Vec<i64>,
    },
    Select {
        input: &'a str,
        dim: i64,
        index: i64,
    },
    Unflatten {
        input: &'a str,
        dim: i64,
        sizes: Vec<i64>,
    },
    /// `contiguous` and `alias`: the same values.
    Same {
        input: &'a str,
        contiguous: bool,
    },
    Embedding {
        weight: &'a str,
        indices: &'a str,
    },
    Arange {
        start: i64,
        end: i64,
        step: i64,
    },
    LayerNorm {
        input: &'a str,
        shape: Vec<usize>,
        weight: Option<&'a str>,
        bias: Option<&'a str>,
        eps: f64,
    },
    Attention {
        q: &'a str,
        k: &'a str,
        v: &'a str,
        mask: Option<&'a str>,
        causal: bool,
    },
    /// `softmax` or `log_softmax` over `dim`.
    Softmax {
        input: &'a str,
        dim: i64,
        log: bool,
    },
    /// The mean or sum over `dims` (all of them when empty).
    Reduce {
        input: &'a str,
        dims: Vec<i64>,
        keepdim: bool,
        mean: bool,
    },
    /// `matmul`/`bmm` of operands of rank 2 or more (batch dims broadcast).
    Matmul {
        a: &'a str,
        b: &'a str,
    },
    /// Dropout with probability `p`, in training only; its mask drawn from the device's seed for the
    /// pass and the node (run by [`Program::forward`], which knows the node).
    Dropout {
        input: &'a str,
        p: f64,
        train: bool,
    },
    /// `sym_size`: a dimension of a tensor as a symbol, for the sizes of later views.
    SymSize {
        input: &'a str,
        dim: i64,
    },
}

impl Op<'_> {
    fn run(&self, mode: Mode, get: &dyn Fn(&str) -> memfit_tensor::Result<Tensor>) -> memfit_tensor::Result<Tensor> {
        let optional = |name: Option<&str>| name.map(get).transpose();
        match self {
            Op::Linear { input, weight, bias } => ops::linear(&get(input)?, &get(weight)?, optional(*bias)?.as_ref()),
            Op::Conv2d { input, weight, bias, params } => {
                ops::conv2d(&get(input)?, &get(weight)?, optional(*bias)?.as_ref(), *params)
            }
            Op::MaxPool2d { input, params } => ops::max_pool2d(&get(input)?, *params),
            Op::AvgPool2d { input, params, count_include_pad } => {
                ops::avg_pool2d(&get(input)?, *params, *count_include_pad)
            }
            Op::AdaptiveAvgPool2d { input, size } => ops::adaptive_avg_pool2d(&get(input)?, *size),
            Op::BatchNorm { input, weight, bias, stats, training, momentum, eps } => {
                let (weight, bias) = (optional(*weight)?, optional(*bias)?);
                let stats = stats.map(|[m, v]| Ok::<_, Error>([get(m)?, get(v)?])).transpose()?;
                // Batch statistics when training (the running ones move only when the buffers may);
                // the running ones otherwise, as `model.eval()` does.
                let batch = *training && mode.train;
                let running = match (&stats, batch) {
                    (Some(s), false) => Some(s),
                    (Some(s), true) if mode.update => Some(s),
                    _ => None,
                };
                if !batch && running.is_none() {
                    return Err(Error::invalid(
                        "batch_norm in evaluation needs running statistics (track_running_stats)",
                    ));
                }
                let (m, v) = (running.map(|s| &s[0]), running.map(|s| &s[1]));
                ops::batch_norm(&get(input)?, m, v, weight.as_ref(), bias.as_ref(), batch, *momentum, *eps)
            }
            Op::AddInPlace { a, b } => {
                let a = get(a)?;
                match b {
                    Operand::Value(b) => a.add(&get(b)?),
                    Operand::Number(_) => {
                        if mode.update {
                            a.count_up()?;
                        }
                        Ok(a)
                    }
                }
            }
            Op::Unary { input, op } => {
                let x = get(input)?;
                match op {
                    UnaryOp::Relu => x.relu(),
                    UnaryOp::Tanh => x.tanh(),
                    UnaryOp::Sigmoid => x.sigmoid(),
                    UnaryOp::Exp => x.exp(),
                    UnaryOp::Log => x.log(),
                    UnaryOp::Neg => x.neg(),
                    UnaryOp::Gelu => x.gelu(),
                    UnaryOp::GeluTanh => x.gelu_tanh(),
                    UnaryOp::Silu => x.silu(),
                    UnaryOp::Relu6 => x.relu6(),
                    UnaryOp::Hardsigmoid => x.hardsigmoid(),
                    UnaryOp::Hardswish => x.hardswish(),
                    UnaryOp::Sqrt => x.sqrt(),
                    UnaryOp::Rsqrt => x.rsqrt(),
                    UnaryOp::Cos => x.cos(),
                    UnaryOp::Sin => x.sin(),
                    UnaryOp::Abs => x.abs(),
                }
            }
            Op::Binary { a, b, op } => {
                let a = get(a)?;
                match (b, op) {
                    (Operand::Value(b), op) => {
                        let b = get(b)?;
                        match op {
                            Elementwise::Add => a.add(&b),
                            Elementwise::Sub => a.sub(&b),
                            Elementwise::Mul => a.mul(&b),
                            Elementwise::Div => a.div(&b),
                        }
                    }
                    (Operand::Number(c), Elementwise::Add) => a.affine(1.0, *c),
                    (Operand::Number(c), Elementwise::Sub) => a.affine(1.0, -c),
                    (Operand::Number(c), Elementwise::Mul) => a.mul_scalar(*c),
                    (Operand::Number(c), Elementwise::Div) => a.mul_scalar(1.0 / c),
                }
            }
            Op::Flatten { input, start, end } => {
                let x = get(input)?;
                let rank = x.rank() as i64;
                if rank == 0 {
                    return x.reshape(&[1]);
                }
                let dim = |d: i64| if d < 0 { d + rank } else { d };
                let (start, end) = (dim(*start), dim(*end));
                if !(0 <= start && start <= end && end < rank) {
                    return Err(Error::shape(format!("flatten({start}, {end}) of a rank-{rank} tensor")));
                }
                let shape = x.shape();
                let mut out: Vec<isize> = shape[..start as usize].iter().map(|&d| d as isize).collect();
                out.push(shape[start as usize..=end as usize].iter().product::<usize>() as isize);
                out.extend(shape[end as usize + 1..].iter().map(|&d| d as isize));
                x.reshape(&out)
            }
            Op::Unsqueeze { input, dim } => {
                let x = get(input)?;
                let d = if *dim < 0 { dim + x.rank() as i64 + 1 } else { *dim };
                x.unsqueeze(usize::try_from(d).map_err(|_| Error::shape(format!("unsqueeze({dim})")))?)
            }
            Op::Squeeze { input, dim } => {
                let x = get(input)?;
                // PyTorch's squeeze of a dimension that is not 1 changes nothing.
                let d = if *dim < 0 { dim + x.rank() as i64 } else { *dim };
                match usize::try_from(d).ok().and_then(|d| x.shape().get(d)) {
                    Some(1) => x.squeeze(*dim as isize),
                    _ => Ok(x),
                }
            }
            Op::Transpose { input, dims } => get(input)?.transpose(dims[0] as isize, dims[1] as isize),
            Op::Permute { input, dims } => {
                let x = get(input)?;
                let rank = x.rank() as i64;
                let dims = dims
                    .iter()
                    .map(|&d| usize::try_from(if d < 0 { d + rank } else { d }))
                    .collect::<std::result::Result<Vec<usize>, _>>()
                    .map_err(|_| Error::shape(format!("permute({dims:?}) of a rank-{rank} tensor")))?;
                x.permute(&dims)
            }
            Op::Select { input, dim, index } => {
                let x = get(input)?;
                let d = if *dim < 0 { dim + x.rank() as i64 } else { *dim };
                let size = usize::try_from(d).ok().and_then(|d| x.shape().get(d).copied()).unwrap_or(0) as i64;
                let i = if *index < 0 { index + size } else { *index };
                if !(0..size).contains(&i) {
                    return Err(Error::shape(format!("select({dim}, {index}) of a {:?} tensor", x.shape())));
                }
                x.narrow(d as isize, i as usize, 1)?.squeeze(d as isize)
            }
            Op::Unflatten { input, dim, sizes } => {
                let x = get(input)?;
                let rank = x.rank() as i64;
                let d = if *dim < 0 { dim + rank } else { *dim };
                if !(0..rank).contains(&d) {
                    return Err(Error::shape(format!("unflatten({dim}) of a rank-{rank} tensor")));
                }
                let d = d as usize;
                let mut shape: Vec<isize> = x.shape()[..d].iter().map(|&s| s as isize).collect();
                shape.extend(sizes.iter().map(|&s| s as isize));
                shape.extend(x.shape()[d + 1..].iter().map(|&s| s as isize));
                x.contiguous()?.reshape(&shape)
            }
            Op::Same { input, contiguous } => {
                let x = get(input)?;
                if *contiguous {
                    x.contiguous()
                } else {
                    Ok(x)
                }
            }
            Op::Softmax { input, dim, log } => {
                let x = get(input)?;
                match log {
                    true => ops::log_softmax(&x, *dim as isize),
                    false => ops::softmax(&x, *dim as isize),
                }
            }
            Op::Reduce { input, dims, keepdim, mean } => {
                let mut x = get(input)?;
                let rank = x.rank() as i64;
                let mut dims: Vec<i64> = match dims.is_empty() {
                    true => (0..rank).collect(),
                    false => dims.iter().map(|&d| if d < 0 { d + rank } else { d }).collect(),
                };
                // Highest first, so that the lower ones keep their places without keepdim.
                dims.sort_unstable_by(|a, b| b.cmp(a));
                dims.dedup();
                for d in dims {
                    x = match mean {
                        true => x.mean_dim(d as isize, *keepdim)?,
                        false => x.sum_dim(d as isize, *keepdim)?,
                    };
                }
                Ok(x)
            }
            Op::Matmul { a, b } => get(a)?.matmul(&get(b)?),
            Op::Clamp { input, lo, hi, hardtanh } => match hardtanh {
                true => get(input)?.hardtanh(*lo, *hi),
                false => get(input)?.clamp(*lo, *hi),
            },
            Op::Pow { input, exponent } => {
                let x = get(input)?;
                match *exponent {
                    1.0 => Ok(x),
                    2.0 => x.mul(&x),
                    3.0 => x.mul(&x)?.mul(&x),
                    0.5 => x.sqrt(),
                    -0.5 => x.rsqrt(),
                    -1.0 => Tensor::scalar(x.device(), 1.0, x.dtype(), Category::Temporary)?.div(&x),
                    e => x.pow_scalar(e),
                }
            }
            Op::Compare { a, b, op } => {
                let a = get(a)?;
                a.compare(*op, &operand(b, &a, get)?)
            }
            Op::Where { condition, a, b } => {
                let c = get(condition)?;
                let like = match (a, b) {
                    (Operand::Value(v), _) | (_, Operand::Value(v)) => get(v)?,
                    _ => return Err(Error::invalid("where of two numbers is not imported")),
                };
                ops::where_(&c, &operand(a, &like, get)?, &operand(b, &like, get)?)
            }
            Op::MaskedFillValue { input, mask, value } => {
                let x = get(input)?;
                ops::where_(&get(mask)?, &Tensor::scalar(x.device(), *value, x.dtype(), Category::Temporary)?, &x)
            }
            Op::Pad { input, pad, value, mode: PadMode::Constant } => ops::pad(&get(input)?, pad, *value),
            Op::Pad { input, pad, mode, .. } => pad_from_edges(&get(input)?, pad, *mode),
            Op::NewZeros { input, sizes } => {
                let like = get(input)?;
                let shape = sizes
                    .iter()
                    .map(|&d| usize::try_from(d).map_err(|_| Error::shape(format!("new_zeros of size {sizes:?}"))))
                    .collect::<memfit_tensor::Result<Vec<usize>>>()?;
                Tensor::zeros(like.device(), &shape, like.dtype(), Category::Temporary)
            }
            Op::Fill { input, value } => {
                let t = get(input)?;
                t.fill_(*value)?;
                Ok(t)
            }
            Op::Roll { input, shifts, dims } => {
                let mut x = get(input)?;
                for (&shift, &dim) in shifts.iter().zip(dims) {
                    x = ops::roll(&x, shift, dim as isize)?;
                }
                Ok(x)
            }
            Op::IndexRows { table, index } => ops::embedding(&get(index)?, &get(table)?),
            Op::Embedding { weight, indices } => ops::embedding(&get(indices)?, &get(weight)?),
            Op::LayerNorm { input, shape, weight, bias, eps } => {
                ops::layer_norm(&get(input)?, shape, optional(*weight)?.as_ref(), optional(*bias)?.as_ref(), *eps)
            }
            Op::SymSize { .. }
            | Op::Reshape { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::Split { .. }
            | Op::Cat { .. }
            | Op::Empty { .. }
            | Op::Bernoulli { .. }
            | Op::SymArith { .. }
            | Op::ZerosLike { .. }
            | Op::MaskedFill { .. }
            | Op::Attention { .. }
            | Op::Dropout { .. }
            | Op::Arange { .. } => Err(Error::invalid("internal: sizes are the pass's to resolve")),
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
    let float = |name: &str, default: f64| -> std::result::Result<f64, String> {
        match node.arg(name) {
            None => Ok(default),
            Some(Arg::Float(v)) => Ok(*v),
            Some(Arg::Int(v)) => Ok(*v as f64),
            other => Err(format!("{target}: argument {name} should be a number, got {other:?}")),
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
    let positive_kernel = |kernel: [usize; 2]| -> std::result::Result<[usize; 2], String> {
        match kernel.contains(&0) {
            true => Err(format!("{target}: kernel_size {kernel:?} must be positive")),
            false => Ok(kernel),
        }
    };
    let unary = |op| Ok::<_, String>(Op::Unary { input: tensor("self")?, op });
    let number_or_value = |name: &str| match node.arg(name) {
        Some(Arg::Tensor(t)) => Ok(Operand::Value(t.as_str())),
        Some(Arg::Float(v)) => Ok(Operand::Number(*v)),
        Some(Arg::Int(v)) => Ok(Operand::Number(*v as f64)),
        Some(Arg::Bool(v)) => Ok(Operand::Number(*v as u8 as f64)),
        other => Err(format!("{target}: argument {name} should be a tensor or a number, got {other:?}")),
    };
    let binary = |op| -> std::result::Result<Op<'_>, String> {
        let b = match node.arg("other") {
            Some(Arg::Tensor(t)) => Operand::Value(t.as_str()),
            Some(Arg::Float(v)) => Operand::Number(*v),
            Some(Arg::Int(v)) => Operand::Number(*v as f64),
            other => return Err(format!("{target}: argument other should be a tensor or a number, got {other:?}")),
        };
        if float("alpha", 1.0)? != 1.0 {
            return Err(format!("{target}: alpha other than 1 is not imported"));
        }
        if !matches!(node.arg("rounding_mode"), None | Some(Arg::None)) {
            return Err(format!("{target}: a rounding mode is not imported"));
        }
        Ok(Op::Binary { a: tensor("self")?, b, op })
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
            let kernel = positive_kernel(pair("kernel_size", [0, 0])?)?;
            let params = Pool2dParams {
                kernel,
                stride: pair("stride", kernel)?,
                padding: pair("padding", [0, 0])?,
                dilation: pair("dilation", [1, 1])?,
                ceil_mode: bool_arg("ceil_mode", false)?,
            };
            Op::MaxPool2d { input: tensor("self")?, params }
        }
        "torch.ops.aten.avg_pool2d.default" => {
            let kernel = positive_kernel(pair("kernel_size", [0, 0])?)?;
            if !matches!(node.arg("divisor_override"), None | Some(Arg::None)) {
                return Err(format!("{target}: divisor_override is not imported"));
            }
            let params = Pool2dParams {
                kernel,
                stride: pair("stride", kernel)?,
                padding: pair("padding", [0, 0])?,
                dilation: [1, 1],
                ceil_mode: bool_arg("ceil_mode", false)?,
            };
            Op::AvgPool2d { input: tensor("self")?, params, count_include_pad: bool_arg("count_include_pad", true)? }
        }
        "torch.ops.aten.adaptive_avg_pool2d.default" => {
            let size = pair("output_size", [0, 0])?;
            if size.contains(&0) {
                return Err(format!("{target}: output_size {size:?} must be positive"));
            }
            Op::AdaptiveAvgPool2d { input: tensor("self")?, size }
        }
        "torch.ops.aten.batch_norm.default" => {
            let (mean, var) = (optional_tensor("running_mean")?, optional_tensor("running_var")?);
            let stats = match (mean, var) {
                (Some(m), Some(v)) => Some([m, v]),
                (None, None) => None,
                _ => return Err(format!("{target}: a running mean without a running variance, or the reverse")),
            };
            Op::BatchNorm {
                input: tensor("input")?,
                weight: optional_tensor("weight")?,
                bias: optional_tensor("bias")?,
                stats,
                training: bool_arg("training", true)?,
                momentum: float("momentum", 0.1)?,
                eps: float("eps", 1e-5)?,
            }
        }
        "torch.ops.aten.add_.Tensor" => match binary(Elementwise::Add)? {
            Op::Binary { a, b, .. } => Op::AddInPlace { a, b },
            _ => unreachable!("binary makes a Binary"),
        },
        "torch.ops.aten.add.Tensor" => binary(Elementwise::Add)?,
        "torch.ops.aten.sub.Tensor" => binary(Elementwise::Sub)?,
        "torch.ops.aten.mul.Tensor" => binary(Elementwise::Mul)?,
        "torch.ops.aten.div.Tensor" | "torch.ops.aten.div_.Tensor" => binary(Elementwise::Div)?,
        "torch.ops.aten.mul_.Tensor" => binary(Elementwise::Mul)?,
        "torch.ops.aten.sub_.Tensor" => binary(Elementwise::Sub)?,
        "torch.ops.aten.relu.default" | "torch.ops.aten.relu_.default" => unary(UnaryOp::Relu)?,
        "torch.ops.aten.tanh.default" => unary(UnaryOp::Tanh)?,
        "torch.ops.aten.sigmoid.default" => unary(UnaryOp::Sigmoid)?,
        "torch.ops.aten.exp.default" => unary(UnaryOp::Exp)?,
        "torch.ops.aten.log.default" => unary(UnaryOp::Log)?,
        "torch.ops.aten.neg.default" => unary(UnaryOp::Neg)?,
        "torch.ops.aten.silu.default" | "torch.ops.aten.silu_.default" => unary(UnaryOp::Silu)?,
        "torch.ops.aten.relu6.default" => unary(UnaryOp::Relu6)?,
        "torch.ops.aten.hardsigmoid.default" => unary(UnaryOp::Hardsigmoid)?,
        "torch.ops.aten.hardswish.default" | "torch.ops.aten.hardswish_.default" => unary(UnaryOp::Hardswish)?,
        "torch.ops.aten.hardtanh.default" | "torch.ops.aten.hardtanh_.default" => {
            let (lo, hi) = (float("min_val", -1.0)?, float("max_val", 1.0)?);
            match (lo, hi) {
                // MobileNet's ReLU6 as hardtanh: memfit's relu6 (the same values and gradient).
                (0.0, 6.0) => unary(UnaryOp::Relu6)?,
                _ => Op::Clamp { input: tensor("self")?, lo, hi, hardtanh: true },
            }
        }
        "torch.ops.aten.clamp.default" | "torch.ops.aten.clamp_.default" => {
            let bound = |name: &str, default: f64| match node.arg(name) {
                None | Some(Arg::None) => Ok(default),
                _ => float(name, default),
            };
            let (lo, hi) = (bound("min", f64::NEG_INFINITY)?, bound("max", f64::INFINITY)?);
            Op::Clamp { input: tensor("self")?, lo, hi, hardtanh: false }
        }
        "torch.ops.aten.clamp_min.default" => {
            Op::Clamp { input: tensor("self")?, lo: float("min", 0.0)?, hi: f64::INFINITY, hardtanh: false }
        }
        "torch.ops.aten.clamp_max.default" => {
            Op::Clamp { input: tensor("self")?, lo: f64::NEG_INFINITY, hi: float("max", 0.0)?, hardtanh: false }
        }
        "torch.ops.aten.sqrt.default" => unary(UnaryOp::Sqrt)?,
        "torch.ops.aten.rsqrt.default" => unary(UnaryOp::Rsqrt)?,
        "torch.ops.aten.cos.default" => unary(UnaryOp::Cos)?,
        "torch.ops.aten.sin.default" => unary(UnaryOp::Sin)?,
        "torch.ops.aten.abs.default" => unary(UnaryOp::Abs)?,
        "torch.ops.aten.pow.Tensor_Scalar" => {
            let exponent = float("exponent", 1.0)?;
            if !exponent.is_finite() {
                return Err(format!("{target}: pow by {exponent} (a finite exponent)"));
            }
            Op::Pow { input: tensor("self")?, exponent }
        }
        "torch.ops.aten.gt.Scalar"
        | "torch.ops.aten.gt.Tensor"
        | "torch.ops.aten.lt.Scalar"
        | "torch.ops.aten.lt.Tensor"
        | "torch.ops.aten.ge.Scalar"
        | "torch.ops.aten.ge.Tensor"
        | "torch.ops.aten.le.Scalar"
        | "torch.ops.aten.le.Tensor"
        | "torch.ops.aten.eq.Scalar"
        | "torch.ops.aten.eq.Tensor"
        | "torch.ops.aten.ne.Scalar"
        | "torch.ops.aten.ne.Tensor" => {
            let op = match &target[15..17] {
                "gt" => ops::Compare::Gt,
                "lt" => ops::Compare::Lt,
                "ge" => ops::Compare::Ge,
                "le" => ops::Compare::Le,
                "eq" => ops::Compare::Eq,
                _ => ops::Compare::Ne,
            };
            Op::Compare { a: tensor("self")?, b: number_or_value("other")?, op }
        }
        "torch.ops.aten.where.self" | "torch.ops.aten.where.ScalarOther" | "torch.ops.aten.where.ScalarSelf" => {
            Op::Where { condition: tensor("condition")?, a: number_or_value("self")?, b: number_or_value("other")? }
        }
        "torch.ops.aten.masked_fill.Scalar" => {
            Op::MaskedFillValue { input: tensor("self")?, mask: tensor("mask")?, value: float("value", 0.0)? }
        }
        "torch.ops.aten.pad.default" | "torch.ops.aten.constant_pad_nd.default" => {
            let mode = match node.arg("mode") {
                None => PadMode::Constant,
                Some(Arg::Str(m)) => match m.as_str() {
                    "constant" => PadMode::Constant,
                    "reflect" => PadMode::Reflect,
                    "replicate" => PadMode::Replicate,
                    "circular" => PadMode::Circular,
                    other => {
                        return Err(format!("{target}: mode {other:?} (constant, reflect, replicate or circular)"))
                    }
                },
                other => return Err(format!("{target}: mode {other:?}")),
            };
            let pad = match node.arg("pad") {
                Some(Arg::Ints(v)) if v.len() % 2 == 0 => v.clone(),
                other => return Err(format!("{target}: pad {other:?} (pairs of numbers)")),
            };
            let value = match node.arg("value") {
                None | Some(Arg::None) => 0.0,
                _ => float("value", 0.0)?,
            };
            Op::Pad { input: tensor("self")?, pad, value, mode }
        }
        "torch.ops.aten.empty.memory_format" => {
            if !matches!(node.arg("dtype"), None | Some(Arg::None) | Some(Arg::ScalarType(crate::FLOAT32))) {
                return Err(format!("{target}: {NOISE} (float32)"));
            }
            match node.arg("size") {
                Some(Arg::SymInts(v)) => Op::Empty { sizes: v.clone() },
                Some(Arg::Ints(v)) => Op::Empty { sizes: v.iter().map(|&d| SymInt::Int(d)).collect() },
                other => return Err(format!("{target}: size {other:?}")),
            }
        }
        "torch.ops.aten.bernoulli_.float" => {
            let p = float("p", 0.5)?;
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{target}: p {p} is not a probability"));
            }
            Op::Bernoulli { input: tensor("self")?, p }
        }
        "torch.ops.aten.gelu.default" => match node.arg("approximate") {
            None => unary(UnaryOp::Gelu)?,
            Some(Arg::Str(a)) if a == "none" => unary(UnaryOp::Gelu)?,
            Some(Arg::Str(a)) if a == "tanh" => unary(UnaryOp::GeluTanh)?,
            other => return Err(format!("{target}: approximate {other:?} is not \"none\" or \"tanh\"")),
        },
        "torch.ops.aten.flatten.using_ints" => {
            Op::Flatten { input: tensor("self")?, start: int("start_dim", 0)?, end: int("end_dim", -1)? }
        }
        "torch.ops.aten.view.default" | "torch.ops.aten.reshape.default" => {
            let key = if target.contains("view") { "size" } else { "shape" };
            let sizes = match node.arg(key) {
                Some(Arg::SymInts(v)) => v.clone(),
                Some(Arg::Ints(v)) => v.iter().map(|&d| SymInt::Int(d)).collect(),
                other => return Err(format!("{target}: argument {key} should be sizes, got {other:?}")),
            };
            Op::Reshape { input: tensor("self")?, sizes }
        }
        "_operator.mul" | "_operator.add" | "_operator.floordiv" => {
            let operand = |name: &str| match node.arg(name) {
                Some(Arg::Int(v)) => Ok(SymOperand::Int(*v)),
                Some(Arg::Sym(n)) => Ok(SymOperand::Name(n.clone())),
                other => Err(format!("{target}: argument {name} should be a size, got {other:?}")),
            };
            let op = match target {
                "_operator.mul" => SymOp::Mul,
                "_operator.add" => SymOp::Add,
                _ => SymOp::FloorDiv,
            };
            Op::SymArith { a: operand("a")?, b: operand("b")?, op }
        }
        "torch.ops.aten.zeros_like.default" => {
            let dtype = match node.arg("dtype") {
                None | Some(Arg::None) => None,
                Some(Arg::ScalarType(code)) => Some(*code),
                other => return Err(format!("{target}: dtype {other:?}")),
            };
            Op::ZerosLike { input: tensor("self")?, dtype }
        }
        "torch.ops.aten.masked_fill_.Scalar" => {
            Op::MaskedFill { input: tensor("self")?, mask: tensor("mask")?, value: float("value", 0.0)? }
        }
        "torch.ops.aten.unsqueeze.default" => Op::Unsqueeze { input: tensor("self")?, dim: int("dim", 0)? },
        "torch.ops.aten.squeeze.dim" => Op::Squeeze { input: tensor("self")?, dim: int("dim", 0)? },
        "torch.ops.aten.transpose.int" => {
            Op::Transpose { input: tensor("self")?, dims: [int("dim0", 0)?, int("dim1", 1)?] }
        }
        "torch.ops.aten.permute.default" => match node.arg("dims") {
            Some(Arg::Ints(d)) => Op::Permute { input: tensor("self")?, dims: d.clone() },
            other => return Err(format!("{target}: dims {other:?}")),
        },
        "torch.ops.aten.select.int" => {
            Op::Select { input: tensor("self")?, dim: int("dim", 0)?, index: int("index", 0)? }
        }
        "torch.ops.aten.unflatten.int" => match node.arg("sizes") {
            Some(Arg::Ints(sizes)) if sizes.iter().all(|&s| s > 0) => {
                Op::Unflatten { input: tensor("self")?, dim: int("dim", 0)?, sizes: sizes.clone() }
            }
            other => return Err(format!("{target}: sizes {other:?} (each a positive number)")),
        },
        "torch.ops.aten.contiguous.default" => Op::Same { input: tensor("self")?, contiguous: true },
        "torch.ops.aten.alias.default" => Op::Same { input: tensor("self")?, contiguous: false },
        "torch.ops.aten.embedding.default" => {
            if int("padding_idx", -1)? != -1 || bool_arg("scale_grad_by_freq", false)? || bool_arg("sparse", false)? {
                return Err(format!("{target}: padding_idx, scale_grad_by_freq and sparse are not imported"));
            }
            Op::Embedding { weight: tensor("weight")?, indices: tensor("indices")? }
        }
        "torch.ops.aten.arange.default" => {
            if !matches!(node.arg("dtype"), None | Some(Arg::None) | Some(Arg::ScalarType(crate::INT64))) {
                return Err(format!("{target}: an arange of another dtype than int64 is not imported"));
            }
            let end = int("end", 0)?;
            // A position table, not data: refused before the host makes a vector of absurd length.
            if !(0..=1 << 24).contains(&end) {
                return Err(format!("{target}: arange of {end} values (memfit imports up to 2^24)"));
            }
            Op::Arange { start: 0, end, step: 1 }
        }
        "torch.ops.aten.layer_norm.default" => {
            let shape = match node.arg("normalized_shape") {
                Some(Arg::Ints(v)) if v.iter().all(|&d| d > 0) => v.iter().map(|&d| d as usize).collect(),
                other => return Err(format!("{target}: normalized_shape {other:?}")),
            };
            Op::LayerNorm {
                input: tensor("input")?,
                shape,
                weight: optional_tensor("weight")?,
                bias: optional_tensor("bias")?,
                eps: float("eps", 1e-5)?,
            }
        }
        "torch.ops.aten.scaled_dot_product_attention.default" => {
            if float("dropout_p", 0.0)? != 0.0 {
                return Err(format!("{target}: attention dropout is not imported"));
            }
            if !matches!(node.arg("scale"), None | Some(Arg::None)) {
                return Err(format!("{target}: a scale other than 1/sqrt(head size) is not imported"));
            }
            Op::Attention {
                q: tensor("query")?,
                k: tensor("key")?,
                v: tensor("value")?,
                mask: optional_tensor("attn_mask")?,
                causal: bool_arg("is_causal", false)?,
            }
        }
        "torch.ops.aten.softmax.int" | "torch.ops.aten.log_softmax.int" => {
            if !matches!(node.arg("dtype"), None | Some(Arg::None)) {
                return Err(format!("{target}: a dtype is not imported"));
            }
            Op::Softmax { input: tensor("self")?, dim: int("dim", -1)?, log: target.contains("log_softmax") }
        }
        "torch.ops.aten.mean.dim" | "torch.ops.aten.sum.dim_IntList" => {
            if !matches!(node.arg("dtype"), None | Some(Arg::None)) {
                return Err(format!("{target}: a dtype is not imported"));
            }
            let dims = match node.arg("dim") {
                Some(Arg::Ints(d)) => d.clone(),
                Some(Arg::Int(d)) => vec![*d],
                None | Some(Arg::None) => Vec::new(),
                other => return Err(format!("{target}: dim {other:?}")),
            };
            Op::Reduce {
                input: tensor("self")?,
                dims,
                keepdim: bool_arg("keepdim", false)?,
                mean: target.contains("mean"),
            }
        }
        "torch.ops.aten.matmul.default" => Op::Matmul { a: tensor("self")?, b: tensor("other")? },
        "torch.ops.aten.bmm.default" => Op::Matmul { a: tensor("self")?, b: tensor("mat2")? },
        "torch.ops.aten.dropout.default" | "torch.ops.aten.dropout_.default" => {
            let p = float("p", 0.5)?;
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{target}: p {p} is not a probability"));
            }
            // `dropout` names its tensor `input`, the in-place `dropout_` `self`.
            let input = tensor("input").or_else(|_| tensor("self"))?;
            Op::Dropout { input, p, train: bool_arg("train", true)? }
        }
        "torch.ops.aten.sym_size.int" => Op::SymSize { input: tensor("self")?, dim: int("dim", 0)? },
        "torch.ops.aten.new_zeros.default" => {
            if !matches!(node.arg("dtype"), None | Some(Arg::None)) {
                return Err(format!("{target}: a dtype of its own is not imported"));
            }
            match node.arg("size") {
                Some(Arg::Ints(v)) => Op::NewZeros { input: tensor("self")?, sizes: v.clone() },
                other => return Err(format!("{target}: size {other:?}")),
            }
        }
        "torch.ops.aten.fill_.Scalar" => Op::Fill { input: tensor("self")?, value: float("value", 0.0)? },
        "torch.ops.aten.roll.default" => match (node.arg("shifts"), node.arg("dims")) {
            (Some(Arg::Ints(shifts)), Some(Arg::Ints(dims))) if shifts.len() == dims.len() && !dims.is_empty() => {
                Op::Roll { input: tensor("self")?, shifts: shifts.clone(), dims: dims.clone() }
            }
            other => {
                return Err(format!(
                    "{target}: shifts and dims {other:?} (a roll of the flattened tensor is not imported)"
                ))
            }
        },
        "torch.ops.aten.index.Tensor" => match node.arg("indices") {
            Some(Arg::Tensors(list)) if list.len() == 1 => {
                Op::IndexRows { table: tensor("self")?, index: list[0].as_str() }
            }
            other => {
                return Err(format!(
                    "{target}: indices {other:?} (memfit imports one int64 index tensor on the first dimension)"
                ))
            }
        },
        "torch.ops.aten.expand.default" => match node.arg("size") {
            Some(Arg::SymInts(v)) => Op::Expand { input: tensor("self")?, sizes: v.as_slice() },
            other => return Err(format!("{target}: argument size should be sizes, got {other:?}")),
        },
        "torch.ops.aten.slice.Tensor" => {
            let bound = |name: &str, default: i64| match node.arg(name) {
                None | Some(Arg::None) => Ok(SymOperand::Int(default)),
                Some(Arg::Int(v)) => Ok(SymOperand::Int(*v)),
                Some(Arg::Sym(n)) => Ok(SymOperand::Name(n.clone())),
                other => Err(format!("{target}: argument {name} should be a size, got {other:?}")),
            };
            let step = usize::try_from(int("step", 1)?)
                .ok()
                .filter(|&s| s > 0)
                .ok_or_else(|| format!("{target}: step must be positive"))?;
            Op::Slice {
                input: tensor("self")?,
                dim: int("dim", 0)?,
                start: bound("start", 0)?,
                end: bound("end", i64::MAX)?,
                step,
            }
        }
        "torch.ops.aten.chunk.default"
        | "torch.ops.aten.split.Tensor"
        | "torch.ops.aten.split_with_sizes.default"
        | "torch.ops.aten.unbind.int" => {
            let positive = |v: i64| usize::try_from(v).ok().filter(|&v| v > 0);
            let split = match target {
                "torch.ops.aten.chunk.default" => Split::Chunks(
                    positive(int("chunks", 0)?).ok_or_else(|| format!("{target}: chunks must be positive"))?,
                ),
                "torch.ops.aten.split.Tensor" => Split::Length(
                    positive(int("split_size", 0)?).ok_or_else(|| format!("{target}: split_size must be positive"))?,
                ),
                "torch.ops.aten.unbind.int" => Split::Each,
                _ => match node.arg("split_sizes") {
                    Some(Arg::Ints(v)) => Split::Lengths(
                        v.iter()
                            .map(|&l| usize::try_from(l).map_err(|_| format!("{target}: a negative length in {v:?}")))
                            .collect::<std::result::Result<_, _>>()?,
                    ),
                    other => return Err(format!("{target}: split_sizes {other:?}")),
                },
            };
            Op::Split { input: tensor("self")?, dim: int("dim", 0)?, split }
        }
        "torch.ops.aten.cat.default" | "torch.ops.aten.stack.default" => match node.arg("tensors") {
            Some(Arg::Tensors(list)) if !list.is_empty() => {
                Op::Cat { tensors: list.as_slice(), dim: int("dim", 0)?, stack: target.contains("stack") }
            }
            other => return Err(format!("{target}: tensors should be a list of values, got {other:?}")),
        },
        other => return Err(format!("the graph calls {other}, which memfit does not import yet")),
    };
    Ok(op)
}
