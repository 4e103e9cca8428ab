//! The parts of an imported graph that can run with activation checkpointing, found from the modules
//! each node was called from.
//!
//! Note [Imported segments]
//! memfit's own models name their checkpointable segments (each GPT block, each ResNet stage); an
//! imported graph's come from its nodes' module paths (`nn_module_stack`). A segment is one module's
//! nodes, chosen as a user would: the top-level modules (`conv1`, `layer1`, `fc`), except that a
//! module holding more than half of the graph's nodes stands for its children instead, recursively
//! (`features` -> `features.0` ... `features.12`; `encoder` -> `encoder.layers` ->
//! `encoder.layers.encoder_layer_0` ...). A module qualifies when running its nodes apart gives the same
//! values: they are consecutive in the graph, read exactly one value made before them (the segment's
//! input; sizes, attention masks and aliases of buffers made before are carried in as they are), make
//! exactly one value read after them (its output; sizes they make are handed out too), write over nothing made before them but buffers (no in-place op on the input),
//! fuse nothing across their edges (Note [Fused pairs]), and read at least one parameter. Others are
//! not segments (the rest of the graph runs as it is).

use crate::archive::{Archive, Node, BOOL};
use memfit_tensor::Tensor;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// One checkpointable part of a graph.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    /// The module's path: `layer1`, `features.3`.
    pub name: String,
    pub nodes: Range<usize>,
    /// The one value made before the segment that it reads.
    pub input: String,
    /// The one value it makes that is read after it.
    pub output: String,
    /// Sizes, masks and buffers' aliases made before it that it reads (carried into a re-run as
    /// they were).
    pub captured: Vec<String>,
    /// Sizes it makes that are read after it (handed out by its forward run).
    pub exports: Vec<String>,
    /// The weights it reads.
    pub weights: Vec<String>,
}

/// The checkpointable segments of `archive`'s graph (Note [Imported segments]), in graph order.
pub(crate) fn find(
    archive: &Archive,
    weights: &[(String, Tensor)],
    output: &str,
    fused: &[Option<usize>],
) -> Vec<Segment> {
    let nodes = &archive.nodes;
    let weight_names: HashSet<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
    let parameters: HashSet<&str> =
        weights.iter().filter(|(_, t)| t.requires_grad()).map(|(n, _)| n.as_str()).collect();
    let (carried, symbols) = carried_values(archive, &weight_names, &parameters);
    let mut defined_at: HashMap<&str, usize> = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        for out in &node.outputs {
            defined_at.insert(out.as_str(), i);
        }
    }
    let mut segments = Vec::new();
    for module in chosen_modules(nodes) {
        let members: Vec<usize> = (0..nodes.len()).filter(|&i| nodes[i].modules.iter().any(|m| *m == module)).collect();
        let (Some(&start), Some(&last)) = (members.first(), members.last()) else { continue };
        let range = start..last + 1;
        if members.len() != range.len() {
            continue; // not consecutive
        }
        let inside = |i: usize| range.contains(&i);
        let made_inside = |name: &str| defined_at.get(name).is_some_and(|&i| inside(i));
        let mut external: Vec<&str> = Vec::new();
        let mut read_weights: Vec<String> = Vec::new();
        let mut in_place_on_external = false;
        for i in range.clone() {
            for name in nodes[i].reads().chain(nodes[i].size_reads()) {
                if weight_names.contains(name) {
                    if !read_weights.iter().any(|w| w == name) {
                        read_weights.push(name.to_string());
                    }
                } else if !made_inside(name) && !external.contains(&name) {
                    external.push(name);
                }
            }
            if in_place(&nodes[i].target) {
                let written = nodes[i].reads().next();
                // A buffer's update (batch norm's counter) is the pass's to make, segment or not.
                in_place_on_external |= written.is_some_and(|w| !made_inside(w) && !weight_names.contains(w));
            }
        }
        let (captured, values): (Vec<&str>, Vec<&str>) = external.iter().partition(|n| carried.contains(**n));
        let [segment_input] = values[..] else { continue };
        // Values made inside and read after it (or the graph's output): one tensor, and sizes.
        let mut escaping: Vec<&str> = Vec::new();
        for node in &nodes[range.end..] {
            for name in node.reads().chain(node.size_reads()) {
                if made_inside(name) && !escaping.contains(&name) {
                    escaping.push(name);
                }
            }
        }
        if made_inside(output) && !escaping.contains(&output) {
            escaping.push(output);
        }
        let (sizes, tensors): (Vec<&str>, Vec<&str>) = escaping.iter().partition(|n| symbols.contains(**n));
        let [segment_output] = tensors[..] else { continue };
        let fuses_across = range.clone().any(|i| fused[i].is_some_and(|j| !inside(j)))
            || (0..nodes.len()).filter(|&i| !inside(i)).any(|i| fused[i].is_some_and(inside));
        let reads_parameter = read_weights.iter().any(|w| parameters.contains(w.as_str()));
        if in_place_on_external || fuses_across || !reads_parameter || carried.contains(segment_output) {
            continue;
        }
        segments.push(Segment {
            name: module,
            nodes: range,
            input: segment_input.to_string(),
            output: segment_output.to_string(),
            captured: captured.iter().map(|n| n.to_string()).collect(),
            exports: sizes.iter().map(|n| n.to_string()).collect(),
            weights: read_weights,
        });
    }
    segments
}

/// The modules whose nodes are the candidate segments: the top-level ones, a module holding more
/// than half of the nodes replaced by its children (Note [Imported segments]).
fn chosen_modules(nodes: &[Node]) -> Vec<String> {
    let mut count: HashMap<&str, usize> = HashMap::new();
    // Each module's children, in the order the graph first calls them.
    let mut children: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut top: Vec<&str> = Vec::new();
    for node in nodes {
        for (depth, m) in node.modules.iter().enumerate() {
            *count.entry(m.as_str()).or_default() += 1;
            match depth {
                0 if !top.contains(&m.as_str()) => top.push(m),
                0 => {}
                _ => {
                    let list = children.entry(node.modules[depth - 1].as_str()).or_default();
                    if !list.contains(&m.as_str()) {
                        list.push(m);
                    }
                }
            }
        }
    }
    let big = nodes.len() / 2;
    let mut chosen: Vec<&str> = Vec::new();
    let mut stack: Vec<&str> = top.into_iter().rev().collect();
    while let Some(m) = stack.pop() {
        match children.get(m) {
            Some(kids) if count[m] > big => stack.extend(kids.iter().rev()),
            _ => chosen.push(m),
        }
    }
    chosen.into_iter().map(str::to_string).collect()
}

/// Values a segment takes from before it as they are, not as its input (and the sizes among them):
/// sizes (`sym_size` and arithmetic on them), aliases of buffers, and the attention masks built from
/// a boolean one (`zeros_like` of a bool, its `masked_fill_`, their `unsqueeze`), which the pass keeps
/// apart.
fn carried_values<'a>(
    archive: &'a Archive,
    weights: &HashSet<&str>,
    parameters: &HashSet<&str>,
) -> (HashSet<&'a str>, HashSet<&'a str>) {
    let (mut carried, mut sizes): (HashSet<&str>, HashSet<&str>) = (HashSet::new(), HashSet::new());
    for node in &archive.nodes {
        let op = node.target.as_str();
        let first = node.reads().next();
        let size =
            matches!(op, "torch.ops.aten.sym_size.int" | "_operator.mul" | "_operator.add" | "_operator.floordiv");
        let is_carried = size
            || match op {
                "torch.ops.aten.alias.default" => first.is_some_and(|n| weights.contains(n) && !parameters.contains(n)),
                "torch.ops.aten.zeros_like.default" => {
                    first.and_then(|n| archive.value(n)).is_some_and(|v| v.dtype == BOOL)
                }
                "torch.ops.aten.masked_fill_.Scalar" | "torch.ops.aten.unsqueeze.default" => {
                    first.is_some_and(|n| carried.contains(n))
                }
                _ => false,
            };
        if is_carried {
            for out in &node.outputs {
                carried.insert(out.as_str());
                if size {
                    sizes.insert(out.as_str());
                }
            }
            // An in-place fill changes its input too.
            if op == "torch.ops.aten.masked_fill_.Scalar" {
                if let Some(n) = first {
                    carried.insert(n);
                }
            }
        }
    }
    (carried, sizes)
}

/// Whether `target` writes over its first input: ATen's trailing `_`.
pub(crate) fn in_place(target: &str) -> bool {
    target.rsplit('.').nth(1).is_some_and(|op| op.ends_with('_'))
}
