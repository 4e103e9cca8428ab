//! Reverse-mode autograd over a dynamic graph: [`backward`] commits into `.grad`, [`grad`] returns
//! gradients and leaves `.grad` alone.
//!
//! Each differentiable op that runs with grad enabled on an input that requires grad attaches a
//! [`Node`] to its output. The node owns a [`Backward`] value: a plain struct whose fields are exactly
//! what the op saved for backward (countable, see Note [Saved tensors]). [`backward`] runs the nodes in
//! reverse order, consuming each node's saved state as it goes, and frees every intermediate gradient
//! once it has been passed on.
//!
//! Note [Saved tensors]: a saved tensor is a detached handle (no grad_fn, so no reference cycle through
//! the output's own node). Saving re-tags its storage from `temporary` to `activation`, so the allocator's
//! accounting shows what autograd keeps alive. The saved handles drop when the node's backward runs
//! (it takes `self: Box<Self>`), or when the graph is dropped unused.
//!
//! Note [Transactional backward]: gradients for leaves are held until the whole backward pass succeeded,
//! then committed into `.grad` (moved in, or added in place: committing never allocates). If anything
//! fails midway (an out-of-memory), `.grad` is exactly as before the call, so a trainer can drop the
//! attempt and re-run the same samples in smaller pieces without corrupting accumulated gradients.
//!
//! Note [Committing as complete]: accumulating a micro-batch into existing gradients, the
//! transactional pass holds a second whole set of parameter gradients until its end (`.grad` and the
//! pass's own). [`backward_as_complete`] instead commits each leaf's gradient the moment its last
//! contribution of the pass has arrived (every edge into the leaf is counted before the pass runs),
//! by the same move or in-place addition as the commit at the end, so `.grad` ends with the same bits
//! while the pass holds at most the gradients still being summed. The price is the transaction: a
//! pass that fails midway leaves `.grad` partly updated, so a caller that uses it must drop every
//! gradient it holds and re-run everything they came from (the pipeline re-runs its whole window on
//! any failure anyway: Note [Pipeline] in the train crate).
//!
//! Note [Gradient ownership]: a gradient flows as an owned `Tensor` value, and one value may reach
//! several places (`add` hands the same gradient to both inputs; `x + x` sends it twice to one leaf).
//! Writing over a gradient's memory (in-place backward, accumulation, committing into `.grad`) is
//! allowed only when `Tensor::owns_storage` holds: this is the one handle on the tensor and the tensor
//! the one user of its storage. A shared gradient is therefore read, never written, until every other
//! holder has let go; `.grad` of two leaves never share memory. The same rule lets a backward write an
//! input gradient over a saved activation it holds alone (the fused GELU-linear and layer-norm-linear
//! ops do). The decision depends only on who holds
//! what, never on data, so `meta` still allocates exactly what `cpu` does.

use crate::error::{Error, Result};
use crate::storage::CompactCopy;
use crate::tensor::Tensor;
use memfit_memory::{Category, Phase};
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

/// What an op saved, and how to turn the output's gradient into its inputs' gradients.
pub trait Backward: Send {
    /// Returns one gradient per input (None where `needs[i]` is false or the input gets none).
    /// Runs with grad disabled and the device in [`Phase::Backward`].
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>>;
}

pub(crate) enum Edge {
    Node(Arc<Node>),
    /// A leaf that wants a gradient (its handle, to commit `.grad` into).
    Leaf(Tensor),
}

/// A recorded op in the graph.
pub struct Node {
    id: u64,
    name: &'static str,
    /// The module in force when the op ran: its backward runs under it too (provenance).
    module: u32,
    backward: Mutex<Option<Box<dyn Backward>>>,
    edges: Vec<Option<Edge>>,
}

/// True when an op on `inputs` must record a node.
pub fn needs_grad(inputs: &[&Tensor]) -> bool {
    inputs.first().is_some_and(|t| t.device().grad_enabled()) && inputs.iter().any(|t| t.requires_grad())
}

/// Saves a tensor for backward: a detached handle, with its storage re-tagged as an activation when it
/// was a temporary (Note [Saved tensors]).
pub fn save(t: &Tensor) -> Tensor {
    let storage = t.storage();
    if storage.category() == Category::Temporary {
        storage.set_category(Category::Activation);
    }
    t.detach()
}

/// An activation saved for backward, possibly in a compact dtype ([`save_compact`]).
pub struct Compact {
    stored: Tensor,
    dtype: crate::DType,
}

impl Compact {
    /// The saved tensor in its own dtype: itself, or a converted copy (a temporary).
    pub fn restore(&self) -> Result<Tensor> {
        self.stored.to_dtype(self.dtype)
    }

    /// As [`Compact::restore`], giving up the saved handle: a tensor saved as it was comes back
    /// unshared, so backward may still write over it (Note [Gradient ownership]).
    pub fn into_tensor(self) -> Result<Tensor> {
        if self.stored.dtype() == self.dtype {
            return Ok(self.stored);
        }
        self.restore()
    }

    pub fn shape(&self) -> &[usize] {
        self.stored.shape()
    }

    /// The tensor as saved: itself, or its compact copy (in the saved dtype).
    pub(crate) fn stored(&self) -> &Tensor {
        &self.stored
    }
}

/// Saves a large activation for backward (Note [Half-precision storage]): in the device's saved
/// dtype ([`crate::Device::set_saved_dtype`]) when that is set, the tensor is f32 and its storage
/// is an op's output (a temporary or an activation: parameters and inputs live anyway, and a copy
/// would only add memory), outside a checkpointed segment's re-run; else as [`save`] does.
pub fn save_compact(t: &Tensor) -> Result<Compact> {
    let device = t.device();
    // A checkpointed segment's re-run saves what backward uses right away: converting it would only
    // add a copy.
    let compact = device.saved_dtype().filter(|_| {
        t.dtype() == crate::DType::F32
            && !device.recomputing()
            && matches!(t.storage().category(), Category::Temporary | Category::Activation)
    });
    let stored = match compact {
        Some(dtype) => shared_compact(t, dtype)?,
        None => save(t),
    };
    Ok(Compact { stored, dtype: t.dtype() })
}

/// `t` converted to `dtype` as a saved activation: the copy an earlier save of the same view made,
/// while some node still holds it, else a new one that later saves of the view will share.
fn shared_compact(t: &Tensor, dtype: crate::DType) -> Result<Tensor> {
    let source = t.storage();
    if let Some(c) = source.compact_copy().as_ref().filter(|c| c.source == *t.layout() && c.dtype == dtype) {
        if let Some(copy) = c.copy.upgrade() {
            return Ok(Tensor::from_parts(copy, c.layout.clone(), dtype));
        }
    }
    let _no_grad = t.device().no_grad();
    let half = t.contiguous()?.to_dtype(dtype)?;
    half.storage().set_category(Category::Activation);
    *source.compact_copy() = Some(CompactCopy {
        source: t.layout().clone(),
        copy: Arc::downgrade(half.storage()),
        layout: half.layout().clone(),
        dtype,
    });
    Ok(half)
}

// Note [Half-precision storage]
// With a saved dtype set on the device, the large activations ops keep for backward (inputs of
// matmul, linear and convolution, of element-wise and normalisation ops, attention's q/k/v) are
// stored in bf16 or f16, halving the activation memory; small or sensitive saved state (layer and
// batch norm statistics, attention's log-sum-exp, the logits of the loss, indices and masks) stays
// exact. Forward outputs and all arithmetic stay f32; backward converts a saved tensor back to f32
// (a temporary) just before it uses it. The conversion rounds to nearest even, as PyTorch's casts.
// Parameters, gradients and optimizer state are untouched, so the update is the f32 update computed
// from rounded activations. Conversions allocate the same on every device, so meta stays exact.

// Note [Shared compact copies]
// Two ops that save the same activation (attention saves its output for its D, and the linear
// after it saves it as its input) keep one compact copy: the first save converts and leaves a weak
// link on the source's storage (its view's layout and the dtype), and a later save of the same
// view, while the copy is still held, takes the copy. As with a tensor saved as it is, this
// assumes what is saved is not written before backward; no op writes over its forward inputs.

/// Attaches a node for `backward` to `out`, an op's result computed from `inputs`. Call only when
/// [`needs_grad`] is true.
pub fn record(out: Tensor, name: &'static str, inputs: &[&Tensor], backward: impl Backward + 'static) -> Tensor {
    let edges = inputs
        .iter()
        .map(|t| {
            if let Some(node) = t.grad_fn() {
                Some(Edge::Node(node.clone()))
            } else if t.requires_grad() {
                Some(Edge::Leaf((*t).clone()))
            } else {
                None
            }
        })
        .collect();
    let device = out.device();
    let node = Node {
        id: device.next_id(),
        name,
        module: device.module(),
        backward: Mutex::new(Some(Box::new(backward))),
        edges,
    };
    out.with_grad_fn(Arc::new(node))
}

/// Back-propagates from a scalar `loss` (seed gradient 1).
pub fn backward(loss: &Tensor) -> Result<()> {
    let seed = scalar_seed(loss, "backward")?;
    backward_with(loss, seed)
}

/// The gradient 1 of a scalar, or an error naming `what` for a non-scalar.
fn scalar_seed(out: &Tensor, what: &str) -> Result<Tensor> {
    if out.numel() != 1 {
        return Err(Error::shape(format!(
            "{what}() needs a scalar output, got shape {:?}; pass the output's gradient explicitly",
            out.shape()
        )));
    }
    Tensor::full(out.device(), out.shape(), 1.0, out.dtype(), Category::Temporary)
}

/// Back-propagates `grad` (shaped like `out`) through the graph that produced `out`, then commits
/// leaf gradients into `.grad` (Note [Transactional backward]).
pub fn backward_with(out: &Tensor, grad: Tensor) -> Result<()> {
    backward_into_leaves(out, grad, Completion::AtEnd)
}

/// [`backward_with`] (`grad` None: [`backward`]'s seed 1 of a scalar) committing each leaf's gradient
/// into `.grad` as soon as it is complete, not at the end: the same `.grad` bits without a second set
/// of gradients held by the pass, but not transactional (Note [Committing as complete]): after an
/// error, `.grad` must be dropped.
pub fn backward_as_complete(out: &Tensor, grad: Option<Tensor>) -> Result<()> {
    let grad = match grad {
        Some(g) => g,
        None => scalar_seed(out, "backward")?,
    };
    backward_into_leaves(out, grad, Completion::Commit)
}

/// Back-propagates from a scalar `loss`, handing each leaf's gradient to `on_complete` the moment
/// its last contribution of the pass has arrived (counted as [`backward_as_complete`] counts them),
/// instead of committing it: `.grad` is never touched, and the gradient is dropped when
/// `on_complete` returns. The optimizer step inside backward is built on it (Note [Step in
/// backward] in the train crate). A leaf no gradient reached is not handed over. Not
/// transactional: what `on_complete` did before an error stays done.
pub fn backward_handing_over(loss: &Tensor, on_complete: &mut dyn FnMut(&Tensor, Tensor) -> Result<()>) -> Result<()> {
    let seed = scalar_seed(loss, "backward")?;
    backward_into_leaves(loss, seed, Completion::Hand(on_complete))
}

fn backward_into_leaves(out: &Tensor, grad: Tensor, completion: Completion<'_>) -> Result<()> {
    let device = out.device().clone();
    let _phase = device.enter_phase(Phase::Backward);
    let _no_grad = device.no_grad();
    let mut sink = Sink::AllLeaves { held: Vec::new(), completion, arrivals: 0 };
    propagate(vec![(out.clone(), grad)], &mut sink)?;
    match sink {
        Sink::AllLeaves { mut held, .. } => {
            held.sort_by_key(|h| h.arrival);
            commit(held.into_iter().filter_map(|h| Some((h.leaf, h.grad?))).collect())
        }
        Sink::Inputs { .. } => unreachable!("backward collects leaves"),
    }
}

/// When a backward pass lets go of a leaf's gradient.
enum Completion<'a> {
    /// Commits every gradient into `.grad` when the whole pass succeeded (Note [Transactional
    /// backward]).
    AtEnd,
    /// Commits each into `.grad` as soon as it is complete (Note [Committing as complete]).
    Commit,
    /// Hands each to the caller as soon as it is complete ([`backward_handing_over`]).
    Hand(&'a mut dyn FnMut(&Tensor, Tensor) -> Result<()>),
}

/// The gradients of `outputs` (seeded with `grad_outputs`, one per output; None = 1 for a scalar)
/// with respect to `inputs` (leaves or intermediate tensors), without touching any `.grad`:
/// PyTorch's `torch.autograd.grad`. An input the outputs do not depend on gets None.
///
/// It consumes the graph between them (saved tensors are freed as it goes, like backward), runs
/// only the nodes that lead to an input, and is re-entrant: a [`Backward`] may call it on a graph it
/// recorded itself (activation checkpointing does), with grad enabled by [`Device::enable_grad`].
///
/// [`Device::enable_grad`]: crate::Device::enable_grad
pub fn grad(outputs: &[Tensor], grad_outputs: &[Option<Tensor>], inputs: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
    if outputs.is_empty() || outputs.len() != grad_outputs.len() {
        return Err(Error::invalid(format!(
            "grad(): {} outputs need as many gradients (None for a scalar), got {}",
            outputs.len(),
            grad_outputs.len()
        )));
    }
    let device = outputs[0].device().clone();
    let _phase = device.enter_phase(Phase::Backward);
    let _no_grad = device.no_grad();
    let mut seeds = Vec::with_capacity(outputs.len());
    for (out, g) in outputs.iter().zip(grad_outputs) {
        let g = match g {
            Some(g) => g.clone(),
            None => scalar_seed(out, "grad")?,
        };
        seeds.push((out.clone(), g));
    }
    let mut sink = Sink::Inputs { inputs: inputs.to_vec(), grads: vec![None; inputs.len()] };
    propagate(seeds, &mut sink)?;
    match sink {
        Sink::Inputs { grads, .. } => Ok(grads),
        Sink::AllLeaves { .. } => unreachable!("grad collects inputs"),
    }
}

/// A segment of a forward pass that [`checkpoint`] can re-run: takes the segment's inputs and which
/// run this is, returns its output. It must compute the same thing each time it is called with the
/// same values (on a [`Pass::Rerun`], the same graph and the same saved values).
pub type Segment = Arc<dyn Fn(&[Tensor], Pass) -> Result<Tensor> + Send + Sync>;

/// Which run of a checkpointed segment a [`Segment`] is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The forward pass: the output's values go on to the rest of the model.
    Forward,
    /// The re-run in backward: only the output's graph is used (its gradient flows back through
    /// it), never its values. An op at the segment's end whose backward needs none of its own output
    /// may record its node and allocate its output without computing it (e.g.
    /// [`crate::ops::gelu_linear_graph`]): the same bytes, less time.
    Rerun,
}

/// Activation checkpointing (PyTorch's `torch.utils.checkpoint`, non-reentrant): runs `segment` on
/// `inputs` keeping nothing for backward but the inputs themselves, and re-runs it in backward.
///
/// Forward runs the segment under no-grad, so none of its intermediate tensors outlive it; one
/// node records the inputs and `params` (the tensors the segment reads that may want gradients:
/// its module's parameters). Backward re-runs the segment with grad enabled on fresh leaves holding
/// the same inputs (the device is [`Device::recomputing`] meanwhile, so batch norm does not update
/// its running statistics a second time), then [`grad`] takes the gradients of the inputs and
/// parameters through that fresh graph without committing them: they flow into the outer pass like
/// any op's input gradients, so the whole backward stays transactional (Note [Transactional
/// backward]). The same kernels run on the same values, so the gradients equal the plain run's; the
/// segment is told it is a [`Pass::Rerun`], so work whose result nothing reads may be skipped.
/// On `meta` the re-run allocates exactly what cpu's does, so the checkpointed peak is predicted too.
///
/// Without grad (or when nothing requires grad) the segment simply runs.
///
/// [`Device::recomputing`]: crate::Device::recomputing
pub fn checkpoint(inputs: &[&Tensor], params: &[Tensor], segment: Segment) -> Result<Tensor> {
    if inputs.is_empty() {
        return Err(Error::invalid("checkpoint(): a segment needs at least one input tensor"));
    }
    let mut all: Vec<&Tensor> = inputs.to_vec();
    all.extend(params.iter());
    if !needs_grad(&all) {
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        return segment(&owned, Pass::Forward);
    }
    let device = inputs[0].device().clone();
    let out = {
        let _no_grad = device.no_grad();
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        segment(&detached, Pass::Forward)?
    };
    let back = CheckpointBack { inputs: inputs.iter().map(|t| save(t)).collect(), params: params.to_vec(), segment };
    Ok(record(out, "checkpoint", &all, back))
}

/// What a checkpointed segment keeps: its inputs (saved) and how to re-run it.
struct CheckpointBack {
    inputs: Vec<Tensor>,
    params: Vec<Tensor>,
    segment: Segment,
}

impl Backward for CheckpointBack {
    fn backward(self: Box<Self>, out_grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let CheckpointBack { inputs, params, segment } = *self;
        let device = out_grad.device().clone();
        let n = inputs.len();
        let leaves: Vec<Tensor> = inputs.iter().zip(needs).map(|(t, &need)| t.set_requires_grad(need)).collect();
        drop(inputs);
        let out = {
            let _grad = device.enable_grad();
            let _recompute = device.recompute();
            segment(&leaves, Pass::Rerun)?
        };
        // Gradients only for what the outer pass wants, in the node's input order.
        let wanted: Vec<usize> = (0..n + params.len()).filter(|&i| needs[i]).collect();
        let targets: Vec<Tensor> =
            wanted.iter().map(|&i| if i < n { leaves[i].clone() } else { params[i - n].clone() }).collect();
        drop(leaves);
        let mut grads = vec![None; n + params.len()];
        if targets.is_empty() || out.grad_fn().is_none() {
            return Ok(grads);
        }
        let found = grad(&[out], &[Some(out_grad)], &targets)?;
        drop(targets);
        for (i, g) in wanted.into_iter().zip(found) {
            grads[i] = g;
        }
        Ok(grads)
    }
}

/// Where the gradients that reach the graph's ends go.
enum Sink<'a> {
    /// Every leaf that requires grad, to commit into `.grad` (backward) or hand over: at the end, or
    /// each as soon as its last contribution arrived (`completion`, Note [Committing as complete]).
    AllLeaves { held: Vec<Held>, completion: Completion<'a>, arrivals: usize },
    /// Only these tensors' gradients, returned to the caller (grad).
    Inputs { inputs: Vec<Tensor>, grads: Vec<Option<Tensor>> },
}

/// A leaf's gradient so far in a backward pass, and how many of the pass's edges into the leaf have
/// yet to deliver theirs.
struct Held {
    leaf: Tensor,
    grad: Option<Tensor>,
    remaining: usize,
    /// When its first gradient arrived, in the pass's order (commits at the end go in this order).
    arrival: usize,
}

impl Sink<'_> {
    /// Counts an edge of the pass into `leaf` (before the pass runs; backward only).
    fn expect_leaf(&mut self, leaf: &Tensor) {
        if let Sink::AllLeaves { held, .. } = self {
            // Models have tens of leaves: a linear search is cheaper than hashing handles.
            match held.iter_mut().find(|h| h.leaf.same(leaf)) {
                Some(h) => h.remaining += 1,
                None => held.push(Held { leaf: leaf.clone(), grad: None, remaining: 1, arrival: usize::MAX }),
            }
        }
    }

    /// An edge into `leaf` delivered `g` (None: no gradient after all); adds it to the leaf's
    /// gradient when the sink wants it, and, when that was its last edge, commits the leaf or hands
    /// it over if the sink lets go of each gradient as soon as it is complete (`completion`).
    fn leaf(&mut self, leaf: &Tensor, g: Option<Tensor>) -> Result<()> {
        match self {
            Sink::AllLeaves { held, completion, arrivals } => {
                let i = held.iter().position(|h| h.leaf.same(leaf)).ok_or_else(|| {
                    Error::invalid("internal: a gradient reached a leaf the backward pass did not count")
                })?;
                if let Some(g) = g {
                    if held[i].grad.is_none() {
                        held[i].arrival = *arrivals;
                        *arrivals += 1;
                    }
                    accumulate_leaf(&mut held[i].grad, g)?;
                }
                held[i].remaining = held[i].remaining.saturating_sub(1);
                if held[i].remaining == 0 && !matches!(completion, Completion::AtEnd) {
                    let done = held.swap_remove(i);
                    match (done.grad, completion) {
                        (Some(grad), Completion::Hand(on_complete)) => on_complete(&done.leaf, grad)?,
                        (Some(grad), _) => commit(vec![(done.leaf, grad)])?,
                        (None, _) => {}
                    }
                }
                Ok(())
            }
            Sink::Inputs { inputs, grads } => match (inputs.iter().position(|t| t.same(leaf)), g) {
                (Some(i), Some(g)) => accumulate(&mut grads[i], g),
                _ => Ok(()),
            },
        }
    }

    /// Records the gradient arriving at `node` when an input was produced by it (grad only).
    fn node(&mut self, node: &Node, g: &Tensor) -> Result<()> {
        if let Sink::Inputs { inputs, grads } = self {
            for (t, slot) in inputs.iter().zip(grads.iter_mut()) {
                if t.grad_fn().is_some_and(|n| n.id == node.id) {
                    accumulate(slot, g.clone())?;
                }
            }
        }
        Ok(())
    }

    /// Whether anything behind `edge` can reach the sink (for pruning in grad).
    fn wants_leaf(&self, leaf: &Tensor) -> bool {
        match self {
            Sink::AllLeaves { .. } => true,
            Sink::Inputs { inputs, .. } => inputs.iter().any(|t| t.same(leaf)),
        }
    }

    fn wants_node(&self, node: &Node) -> bool {
        match self {
            Sink::AllLeaves { .. } => false,
            Sink::Inputs { inputs, .. } => inputs.iter().any(|t| t.grad_fn().is_some_and(|n| n.id == node.id)),
        }
    }
}

/// Adds a leaf's next contribution `g` to what it has so far (the first is kept as it is).
fn accumulate_leaf(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    match slot {
        None => *slot = Some(g),
        Some(prev) => {
            let prev = std::mem::replace(prev, g.clone());
            *slot = Some(crate::ops::add_accumulate(prev, &g)?);
        }
    }
    Ok(())
}

fn accumulate(slot: &mut Option<Tensor>, grad: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => grad,
        Some(prev) => crate::ops::add_accumulate(prev, &grad)?,
    });
    Ok(())
}

/// Runs the graph behind `seeds` (output, its gradient) newest node first, handing what reaches its
/// ends to `sink`. Gradients are owned values: a node's backward may reuse the memory of the gradient
/// it is given only when no other handle can see it (Note [Gradient ownership]).
fn propagate(seeds: Vec<(Tensor, Tensor)>, sink: &mut Sink<'_>) -> Result<()> {
    let mut roots = Vec::new();
    for (out, g) in seeds {
        if g.shape() != out.shape() {
            return Err(Error::shape(format!("gradient {:?} does not match output {:?}", g.shape(), out.shape())));
        }
        match out.grad_fn() {
            Some(node) => roots.push((node.clone(), g)),
            None if out.requires_grad() => {
                sink.expect_leaf(&out);
                sink.leaf(&out, Some(g))?
            }
            None => {
                return Err(Error::invalid(
                    "backward through a tensor that does not require grad: was the forward pass run under \
                     no_grad, or do no parameters require grad?",
                ))
            }
        }
    }
    // Which nodes lead to something the sink wants (all of them for backward).
    let mut useful: HashMap<u64, bool> = HashMap::new();
    for (root, _) in &roots {
        mark_useful(root, sink, &mut useful);
    }
    // Count, for every useful node, how many useful edges point at it.
    let mut dependencies: HashMap<u64, usize> = HashMap::new();
    let mut stack: Vec<Arc<Node>> = Vec::new();
    let mut seen: HashMap<u64, ()> = HashMap::new();
    for (root, _) in &roots {
        if seen.insert(root.id, ()).is_none() {
            stack.push(root.clone());
        }
    }
    while let Some(node) = stack.pop() {
        if !useful[&node.id] {
            continue;
        }
        for edge in node.edges.iter().flatten() {
            match edge {
                Edge::Node(next) => {
                    if !useful[&next.id] {
                        continue;
                    }
                    *dependencies.entry(next.id).or_insert(0) += 1;
                    if seen.insert(next.id, ()).is_none() {
                        stack.push(next.clone());
                    }
                }
                // Counted as the loop below will visit it: every edge of a useful node that the
                // sink wants, whether a gradient comes through it or not.
                Edge::Leaf(leaf) if sink.wants_leaf(leaf) => sink.expect_leaf(leaf),
                Edge::Leaf(_) => {}
            }
        }
    }
    // Run ready nodes newest first (PyTorch's order), which frees the deepest activations soonest.
    let mut pending: HashMap<u64, Option<Tensor>> = HashMap::new();
    let mut ready: BinaryHeap<(u64, ByAddress)> = BinaryHeap::new();
    for (root, g) in roots {
        if !useful[&root.id] {
            continue;
        }
        let slot = pending.entry(root.id).or_insert(None);
        accumulate(slot, g)?;
        if !dependencies.contains_key(&root.id) && !ready.iter().any(|(id, _)| *id == root.id) {
            ready.push((root.id, ByAddress(root.clone())));
        }
    }
    while let Some((_, ByAddress(node))) = ready.pop() {
        let grad = pending.remove(&node.id).flatten();
        if let Some(g) = &grad {
            sink.node(&node, g)?;
        }
        let needs: Vec<bool> = node
            .edges
            .iter()
            .map(|e| match e {
                None => false,
                Some(Edge::Node(next)) => useful[&next.id],
                Some(Edge::Leaf(leaf)) => sink.wants_leaf(leaf),
            })
            .collect();
        if !needs.contains(&true) {
            // An input's own node with nothing wanted behind it: its gradient was taken above.
            continue;
        }
        let backward = node.backward.lock().unwrap_or_else(|e| e.into_inner()).take().ok_or_else(|| {
            Error::invalid(format!(
                "backward through the graph a second time ({}): its saved tensors were already freed",
                node.name
            ))
        })?;
        let input_grads = match grad {
            Some(g) => {
                let device = g.device().clone();
                let _module = device.restore_module(node.module);
                let _op = device.op_scope(node.name);
                backward.backward(g, &needs)?
            }
            None => vec![None; needs.len()],
        };
        if input_grads.len() != node.edges.len() {
            return Err(Error::invalid(format!("internal: {} returned the wrong number of gradients", node.name)));
        }
        for ((edge, g), needed) in node.edges.iter().zip(input_grads).zip(needs) {
            match edge {
                Some(Edge::Node(next)) if needed => {
                    let slot = pending.entry(next.id).or_insert(None);
                    if let Some(g) = g {
                        accumulate(slot, g)?;
                    }
                    let left = dependencies.get_mut(&next.id).expect("counted above");
                    *left -= 1;
                    if *left == 0 {
                        ready.push((next.id, ByAddress(next.clone())));
                    }
                }
                Some(Edge::Leaf(leaf)) if needed => sink.leaf(leaf, g)?,
                _ => {}
            }
        }
    }
    Ok(())
}

/// Marks, for every node reachable from `root`, whether it leads to something `sink` wants.
/// Iterative post-order, so deep graphs cannot overflow the stack.
fn mark_useful(root: &Arc<Node>, sink: &Sink<'_>, useful: &mut HashMap<u64, bool>) {
    if useful.contains_key(&root.id) {
        return;
    }
    let mut stack: Vec<(Arc<Node>, bool)> = vec![(root.clone(), false)];
    while let Some((node, expanded)) = stack.pop() {
        if useful.contains_key(&node.id) && !expanded {
            continue;
        }
        if !expanded {
            stack.push((node.clone(), true));
            for edge in node.edges.iter().flatten() {
                if let Edge::Node(next) = edge {
                    if !useful.contains_key(&next.id) {
                        stack.push((next.clone(), false));
                    }
                }
            }
            continue;
        }
        let leads = sink.wants_node(&node)
            || node.edges.iter().flatten().any(|edge| match edge {
                Edge::Node(next) => useful.get(&next.id).copied().unwrap_or(false),
                Edge::Leaf(leaf) => sink.wants_leaf(leaf),
            });
        useful.insert(node.id, leads);
    }
}

/// Moves or adds each leaf gradient into `.grad`. Never allocates unless a gradient is a view, or is
/// shared with another leaf's, and must be copied before it can become `.grad`.
fn commit(leaf_grads: Vec<(Tensor, Tensor)>) -> Result<()> {
    // First make every incoming gradient an exclusively owned, contiguous tensor, so that the loop
    // below cannot fail halfway. A gradient two leaves share (`a + b`) is copied for the first and
    // moved into the second: dropping the shared handle as the copy replaces it makes the last one
    // exclusive.
    let mut ready = Vec::with_capacity(leaf_grads.len());
    for (leaf, grad) in leaf_grads {
        let grad = if leaf.grad().is_none() && !grad.owns_storage() { grad.contiguous_copy()? } else { grad };
        ready.push((leaf, grad));
    }
    for (leaf, grad) in ready {
        match leaf.grad() {
            None => {
                grad.storage().set_category(Category::Gradient);
                leaf.set_grad(Some(grad.detach()));
            }
            Some(existing) => crate::ops::add_into(&existing, &grad)?,
        }
    }
    Ok(())
}

/// Orders nodes in the ready heap by id only.
struct ByAddress(Arc<Node>);

impl PartialEq for ByAddress {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}
impl Eq for ByAddress {}
impl PartialOrd for ByAddress {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for ByAddress {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.id.cmp(&other.0.id)
    }
}
