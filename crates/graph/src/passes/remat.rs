//! Rematerialization (activation checkpointing) on the step graph: forward values the backward
//! reads are dropped after the forward pass and recomputed from kept values just before the
//! backward needs them.
//!
//! Segments are transformer blocks: the forward nodes the model builder marked with
//! [`Graph::in_block`] (a node's [`crate::Node::block`]), with the tensors they produce.
//! Within a segment, the policy says which tensors are kept; every other tensor the backward
//! reads is recomputed, with the forward nodes it needs, right before the first backward node
//! that reads a recomputed tensor of that segment. The recomputation waits (a control
//! dependency) for the gradients flowing into that backward node from later segments, so no
//! schedule can hoist it back into the forward pass. It runs the same kernels on the same
//! inputs, so losses and gradients are bitwise those of the step without it.

use super::{copy_reading, rewrite, Rewritten};
use crate::ops::Op;
use crate::{Graph, NodeId, Result, StepGraph, TensorId};

/// What to keep inside each segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RematPolicy {
    /// As `torch.utils.checkpoint` per block: keep only each segment's outputs (the residual
    /// stream between blocks); segments are `blocks_per_segment` consecutive blocks.
    Uniform { blocks_per_segment: usize },
    /// Keep the outputs of the expensive ops (matmuls, attention) and recompute the cheap
    /// ones (norms, activations, elementwise).
    Selective,
}

/// Tensors the backward pass reads, directly or through a view (both the view and the storage
/// it looks into are marked).
fn backward_reads(step: &StepGraph) -> Vec<bool> {
    let g = &step.graph;
    let mut read = vec![false; g.tensors().len()];
    for node in &g.nodes()[step.forward_nodes..] {
        for &t in &node.inputs {
            read[t.index()] = true;
            read[g.storage_root(t).index()] = true;
        }
    }
    read
}

/// A forward value the backward reads that rematerialization could drop, with what dropping it
/// saves and costs (see [`remat_candidates`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RematCandidate {
    pub tensor: TensorId,
    pub bytes: usize,
    /// FLOPs of the node that recomputes it.
    pub flops: u64,
}

/// Every value inside a block that the backward reads and no other block reads: what a
/// budgeted policy chooses among.
pub fn remat_candidates(step: &StepGraph) -> Vec<RematCandidate> {
    let g = &step.graph;
    let n_fwd = step.forward_nodes;
    let read_by_backward = backward_reads(step);
    let mut out = Vec::new();
    for node in &g.nodes()[..n_fwd] {
        let ins: Vec<&crate::TensorMeta> = node.inputs.iter().map(|&t| g.tensor(t)).collect();
        let outs: Vec<&crate::TensorMeta> = node.outputs.iter().map(|&t| g.tensor(t)).collect();
        let mut flops = node.op.flops(&ins, &outs);
        // Recomputing a 16-bit copy recomputes the value it rounds.
        if let Some(src) = node.inputs.first().and_then(|&x| g.producer(x)) {
            if matches!(node.op, Op::Cast(_)) && src.index() < n_fwd {
                let s = g.node(src);
                let ins: Vec<&crate::TensorMeta> = s.inputs.iter().map(|&t| g.tensor(t)).collect();
                let outs: Vec<&crate::TensorMeta> =
                    s.outputs.iter().map(|&t| g.tensor(t)).collect();
                flops += s.op.flops(&ins, &outs);
            }
        }
        for &o in &node.outputs {
            let m = g.tensor(o);
            if m.view_of.is_none()
                && read_by_backward[o.index()]
                && node.block.is_some()
                && !g.outputs().contains(&o)
            {
                out.push(RematCandidate {
                    tensor: o,
                    bytes: m.size_bytes(),
                    flops,
                });
            }
        }
    }
    out
}

/// [`rematerialize`] dropping exactly `drop` (of [`remat_candidates`]; values other blocks
/// read are kept whatever the list says).
pub fn rematerialize_dropping(step: &StepGraph, drop: &[TensorId]) -> Result<(Rewritten, usize)> {
    let g = &step.graph;
    // Kept: what the backward reads and is not dropped. Values the backward never reads are
    // free; if a recomputation needs one, it is recomputed too rather than held.
    let mut keep = backward_reads(step);
    for &t in drop {
        keep[t.index()] = false;
    }
    // A view is kept exactly when the storage it looks into is.
    remat_with(step, |t, _| keep[g.storage_root(t).index()], 1)
}

/// Whether selective remat keeps an op's outputs. A kernel reading or writing bf16 is the op
/// it runs (a norm that rounds its own output is as cheap to recompute as one a cast rounds
/// after), except a residual add: recomputing it would re-read its input through an up-cast
/// made anew, which the bf16 fold, run before remat, does not take in.
fn expensive(op: &Op) -> bool {
    match op {
        Op::HalfIo(h) => matches!(*h.op, Op::Binary(_)) || expensive(&h.op),
        op => matches!(
            op,
            Op::MatMul(_)
                | Op::GeluLinear(_)
                | Op::LayerNormLinear(_)
                | Op::CausalAttention(_)
                | Op::GqaAttention(_)
        ),
    }
}

/// `step` with `policy` applied; the count of forward nodes it recomputes is returned beside.
pub fn rematerialize(step: &StepGraph, policy: RematPolicy) -> Result<(Rewritten, usize)> {
    match policy {
        RematPolicy::Uniform { blocks_per_segment } => {
            remat_with(step, |_, _| false, blocks_per_segment.max(1))
        }
        RematPolicy::Selective => {
            let g = &step.graph;
            // The 16-bit copy of an expensive output is what mixed precision keeps of it.
            let keep = |t, op: &Op| {
                expensive(op) || super::precision::rounded_from(g, t).is_some_and(expensive)
            };
            remat_with(step, keep, 1)
        }
    }
}

/// Rematerialization keeping, inside segments of `blocks_per_segment` blocks, the values
/// `keep(tensor, producing op)` says (segment outputs are always kept).
fn remat_with(
    step: &StepGraph,
    keep: impl Fn(TensorId, &Op) -> bool,
    blocks_per_segment: usize,
) -> Result<(Rewritten, usize)> {
    let g = &step.graph;
    let n_fwd = step.forward_nodes;
    let n_tensors = g.tensors().len();
    // Segment of each forward-produced tensor.
    let mut segment: Vec<Option<usize>> = vec![None; n_tensors];
    for node in &g.nodes()[..n_fwd] {
        for &o in node.outputs.iter().chain(&node.workspace) {
            segment[o.index()] = node.block.map(|b| b as usize / blocks_per_segment);
        }
    }
    let read_by_backward = backward_reads(step);
    let mut read_outside = vec![false; n_tensors];
    for node in &g.nodes()[..n_fwd] {
        let here = node.outputs.first().and_then(|o| segment[o.index()]);
        for &t in &node.inputs {
            if segment[t.index()].is_some() && segment[t.index()] != here {
                read_outside[t.index()] = true;
                read_outside[g.storage_root(t).index()] = true;
            }
        }
    }
    // Kept: segment outputs, graph outputs, and what the policy keeps.
    let mut kept = vec![true; n_tensors];
    for node in &g.nodes()[..n_fwd] {
        for &o in &node.outputs {
            if segment[o.index()].is_none() {
                continue;
            }
            kept[o.index()] =
                read_outside[o.index()] || g.outputs().contains(&o) || keep(o, &node.op);
        }
    }
    // Views share their base's storage: keeping a forward view keeps its base. (A backward
    // view of a dropped tensor reads it like any other backward node and is redirected.)
    for t in 0..n_tensors {
        if kept[t] && segment[t].is_some() {
            if let Some(v) = g.tensors()[t].view_of {
                kept[g.storage_root(v.base).index()] = true;
            }
        }
    }
    // Forward nodes to re-run: producers of dropped tensors the backward reads, and of the
    // dropped tensors those need.
    let mut rerun = vec![false; g.nodes().len()];
    let mut stack: Vec<TensorId> = (0..n_tensors as u32)
        .map(TensorId)
        .filter(|t| read_by_backward[t.index()] && !kept[t.index()])
        .collect();
    while let Some(t) = stack.pop() {
        let Some(p) = g.producer(t) else { continue };
        if p.index() >= n_fwd || std::mem::replace(&mut rerun[p.index()], true) {
            continue;
        }
        for &i in &g.node(p).inputs {
            if !kept[i.index()] {
                stack.push(i);
            }
        }
    }
    let recomputed_nodes = rerun.iter().filter(|&&r| r).count();
    // Re-run nodes grouped by segment, in forward order.
    let mut by_segment: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for (i, &r) in rerun.iter().enumerate() {
        if r {
            let seg = g.nodes()[i]
                .outputs
                .iter()
                .find_map(|o| segment[o.index()])
                .unwrap_or(usize::MAX);
            by_segment.entry(seg).or_default().push(i);
        }
    }
    let dropped = |t: TensorId| -> Option<usize> {
        let p = g.producer(t)?;
        if rerun[p.index()] && !kept[t.index()] {
            segment[t.index()].or(Some(usize::MAX))
        } else {
            None
        }
    };
    // The segment whose recomputation a node's input needs (directly, or through a backward
    // view of a dropped tensor).
    let needs = |t: TensorId| dropped(t).or_else(|| dropped(g.storage_root(t)));
    // What each segment's recomputation waits for: the gradients entering the first backward
    // node that needs it, among those that do not themselves depend on that recomputation
    // (`tainted`, a bit per segment, would make a cycle).
    let bit = |s: usize| 1u128 << s.min(127);
    let mut tainted = vec![0u128; n_tensors];
    let mut triggers: std::collections::BTreeMap<usize, Vec<TensorId>> = Default::default();
    for node in &g.nodes()[n_fwd..] {
        let mut mask = 0u128;
        for &t in &node.inputs {
            mask |= tainted[t.index()] | needs(t).map_or(0, bit);
        }
        for &o in node.outputs.iter().chain(&node.workspace) {
            tainted[o.index()] |= mask;
        }
        for seg in node.inputs.iter().filter_map(|&t| needs(t)) {
            if triggers.contains_key(&seg) {
                continue;
            }
            let ready: Vec<TensorId> = node
                .inputs
                .iter()
                .copied()
                .filter(|&t| {
                    g.producer(t).is_some_and(|p| p.index() >= n_fwd)
                        && needs(t).is_none()
                        && tainted[t.index()] & bit(seg) == 0
                })
                .collect();
            if !ready.is_empty() {
                triggers.insert(seg, ready);
            }
        }
    }
    // New ids of recomputed tensors, per segment, once emitted.
    let mut again: Vec<Option<TensorId>> = vec![None; n_tensors];
    let mut emitted: std::collections::BTreeSet<usize> = Default::default();
    let rewritten = rewrite(
        g,
        |new: &mut Graph, i, lookup| {
            if i < n_fwd {
                return Ok(None);
            }
            let node = &g.nodes()[i];
            let segs: Vec<usize> = node.inputs.iter().filter_map(|&t| dropped(t)).collect();
            if segs.is_empty() {
                return Ok(None);
            }
            for seg in segs {
                if !emitted.insert(seg) {
                    continue;
                }
                // Only tensors already built (earlier in program order) can be waited on: a
                // trigger built later is replaced by the backward tensors it is made from.
                let mut waits = Vec::new();
                let mut todo: Vec<TensorId> = triggers.get(&seg).cloned().unwrap_or_default();
                while let Some(t) = todo.pop() {
                    match g.producer(t) {
                        Some(p) if p.index() < i => waits.push(lookup(t)),
                        Some(p) if p.index() >= n_fwd => todo.extend(
                            g.node(p)
                                .inputs
                                .iter()
                                .filter(|&&u| g.producer(u).is_some_and(|q| q.index() >= n_fwd)),
                        ),
                        _ => {}
                    }
                }
                for &f in &by_segment[&seg] {
                    let fnode = &g.nodes()[f];
                    let ins: Vec<TensorId> = fnode
                        .inputs
                        .iter()
                        .map(|&t| again[t.index()].unwrap_or_else(|| lookup(t)))
                        .collect();
                    // The recomputation belongs to the block it recomputes.
                    let prev = new.set_block(fnode.block);
                    let outs = new.apply(fnode.op.clone(), &ins);
                    new.set_block(prev);
                    let outs = outs?;
                    let id = NodeId(new.nodes().len() as u32 - 1);
                    for &t in &waits {
                        new.add_control(id, t);
                    }
                    for (&o, &n) in fnode.outputs.iter().zip(&outs) {
                        let m = g.tensor(o);
                        new.rename(n, format!("{}.remat", m.name));
                        if new.tensor(n).view_of.is_none() {
                            new.set_role(n, crate::Role::Temporary);
                        }
                        if !kept[o.index()] {
                            again[o.index()] = Some(n);
                        }
                    }
                }
            }
            let ins: Vec<TensorId> = node
                .inputs
                .iter()
                .map(|&t| again[t.index()].unwrap_or_else(|| lookup(t)))
                .collect();
            let outs = copy_reading(new, g, node, &ins, lookup)?;
            Ok(Some(outs.into_iter().map(Some).collect()))
        },
        &vec![false; g.nodes().len()],
        None,
    )?;
    Ok((rewritten, recomputed_nodes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{CrossEntropy, Gelu, MatMul};
    use crate::{DType, OptimizerSpec};

    /// Two linear layers with a GELU between, then a loss; the layers in block `block` when
    /// given. No name holds a digit, so only the node attribute can place them.
    fn step(block: Option<u32>) -> StepGraph {
        let mut g = Graph::new();
        let x = g.input("x", &[6, 4], DType::F32).unwrap();
        let targets = g.input("targets", &[6], DType::I32).unwrap();
        let w1 = g.parameter("w", &[4, 8]).unwrap();
        let w2 = g.parameter("v", &[8, 5]).unwrap();
        let layers = |g: &mut Graph| {
            g.set_scope("layer");
            let h = g.apply1(MatMul::default(), &[x, w1]).unwrap();
            let a = g.apply1(Gelu::default(), &[h]).unwrap();
            g.apply1(MatMul::default(), &[a, w2]).unwrap()
        };
        let logits = match block {
            Some(b) => g.in_block(b, layers),
            None => layers(&mut g),
        };
        g.set_scope("head");
        let loss = g.apply1(CrossEntropy, &[logits, targets]).unwrap();
        StepGraph::build(g, loss, OptimizerSpec::None).unwrap()
    }

    /// Remat recomputes what the builder put in a block, whatever the names say: the GELU
    /// output and the first product, which only the block reads, are recomputed; outside any
    /// block nothing is.
    #[test]
    fn blocks_come_from_the_node_attribute() {
        let blocked = step(Some(7));
        let fwd = &blocked.graph.nodes()[..blocked.forward_nodes];
        assert_eq!(
            fwd.iter().map(|n| n.block).collect::<Vec<_>>(),
            [Some(7), Some(7), Some(7), None]
        );
        // Each node's gradient belongs to its block.
        let bwd = &blocked.graph.nodes()[blocked.forward_nodes..];
        assert!(bwd.iter().any(|n| n.block == Some(7)));
        assert!(bwd.iter().any(|n| n.block.is_none()));

        let uniform = RematPolicy::Uniform {
            blocks_per_segment: 1,
        };
        let (r, recomputed) = rematerialize(&blocked, uniform).unwrap();
        assert_eq!(recomputed, 2, "the first product and the GELU");
        let again: Vec<&crate::Node> = r
            .graph
            .nodes()
            .iter()
            .filter(|n| r.graph.tensor(n.outputs[0]).name.ends_with(".remat"))
            .collect();
        assert_eq!(again.len(), 2);
        assert!(
            again.iter().all(|n| n.block == Some(7)),
            "recomputations keep the block"
        );
        let candidates: Vec<TensorId> = remat_candidates(&blocked)
            .iter()
            .map(|c| c.tensor)
            .collect();
        // The logits too: the block's output, which `Uniform` keeps, a budget may drop.
        assert_eq!(candidates.len(), 3);

        let open = step(None);
        assert_eq!(rematerialize(&open, uniform).unwrap().1, 0);
        assert!(remat_candidates(&open).is_empty());
    }
}
