//! Reverse-mode autograd over a dynamic graph.
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

use crate::error::{Error, Result};
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
    backward: Mutex<Option<Box<dyn Backward>>>,
    edges: Vec<Option<Edge>>,
}

impl Node {
    pub fn name(&self) -> &'static str {
        self.name
    }
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
    let node = Node { id: out.device().next_id(), name, backward: Mutex::new(Some(Box::new(backward))), edges };
    out.with_grad_fn(Arc::new(node))
}

/// Back-propagates from a scalar `loss` (seed gradient 1).
pub fn backward(loss: &Tensor) -> Result<()> {
    if loss.numel() != 1 {
        return Err(Error::shape(format!(
            "backward() needs a scalar loss, got shape {:?}; pass a gradient with backward_with",
            loss.shape()
        )));
    }
    let seed = Tensor::full(loss.device(), loss.shape(), 1.0, loss.dtype(), Category::Temporary)?;
    backward_with(loss, seed)
}

/// Back-propagates `grad` (shaped like `out`) through the graph that produced `out`, then commits
/// leaf gradients into `.grad` (Note [Transactional backward]).
pub fn backward_with(out: &Tensor, grad: Tensor) -> Result<()> {
    if grad.shape() != out.shape() {
        return Err(Error::shape(format!("gradient {:?} does not match output {:?}", grad.shape(), out.shape())));
    }
    let device = out.device().clone();
    let _phase = device.enter_phase(Phase::Backward);
    let _no_grad = device.no_grad();
    let mut leaf_grads: Vec<(Tensor, Tensor)> = Vec::new();
    match out.grad_fn() {
        None if out.requires_grad() => leaf_grads.push((out.clone(), grad)),
        None => {
            return Err(Error::invalid(
                "backward() on a tensor that does not require grad: was the forward pass run under no_grad, \
                 or do no parameters require grad?",
            ))
        }
        Some(root) => run_graph(root, grad, &mut leaf_grads)?,
    }
    commit(leaf_grads)
}

fn accumulate(slot: &mut Option<Tensor>, grad: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => grad,
        Some(prev) => crate::ops::add_accumulate(prev, &grad)?,
    });
    Ok(())
}

fn run_graph(root: &Arc<Node>, grad: Tensor, leaf_grads: &mut Vec<(Tensor, Tensor)>) -> Result<()> {
    // Count, for every reachable node, how many edges point at it.
    let mut dependencies: HashMap<u64, usize> = HashMap::new();
    let mut stack = vec![root.clone()];
    let mut seen: HashMap<u64, ()> = HashMap::new();
    seen.insert(root.id, ());
    while let Some(node) = stack.pop() {
        for edge in node.edges.iter().flatten() {
            if let Edge::Node(next) = edge {
                *dependencies.entry(next.id).or_insert(0) += 1;
                if seen.insert(next.id, ()).is_none() {
                    stack.push(next.clone());
                }
            }
        }
    }
    // Run ready nodes newest first (PyTorch's order), which frees the deepest activations soonest.
    let mut pending: HashMap<u64, Option<Tensor>> = HashMap::new();
    let mut ready: BinaryHeap<(u64, ByAddress)> = BinaryHeap::new();
    pending.insert(root.id, Some(grad));
    ready.push((root.id, ByAddress(root.clone())));
    while let Some((_, ByAddress(node))) = ready.pop() {
        let grad = pending.remove(&node.id).flatten();
        let backward = node.backward.lock().unwrap_or_else(|e| e.into_inner()).take().ok_or_else(|| {
            Error::invalid(format!(
                "backward through the graph a second time ({}): its saved tensors were already freed",
                node.name
            ))
        })?;
        let needs: Vec<bool> = node.edges.iter().map(|e| e.is_some()).collect();
        let input_grads = match grad {
            Some(g) => backward.backward(g, &needs)?,
            None => vec![None; needs.len()],
        };
        if input_grads.len() != node.edges.len() {
            return Err(Error::invalid(format!("internal: {} returned the wrong number of gradients", node.name)));
        }
        for (edge, g) in node.edges.iter().zip(input_grads) {
            match edge {
                None => {}
                Some(Edge::Node(next)) => {
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
                Some(Edge::Leaf(leaf)) => {
                    if let Some(g) = g {
                        // Models have tens of leaves: a linear search is cheaper than hashing handles.
                        match leaf_grads.iter().position(|(l, _)| l.same(leaf)) {
                            Some(i) => {
                                let prev = leaf_grads[i].1.clone();
                                leaf_grads[i].1 = crate::ops::add_accumulate(prev, &g)?;
                            }
                            None => leaf_grads.push((leaf.clone(), g)),
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Moves or adds each leaf gradient into `.grad`. Never allocates unless a gradient is a view that
/// must be made contiguous before it can become `.grad`.
fn commit(leaf_grads: Vec<(Tensor, Tensor)>) -> Result<()> {
    // First make every incoming gradient an exclusively owned, contiguous tensor, so that the loop
    // below cannot fail halfway.
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
