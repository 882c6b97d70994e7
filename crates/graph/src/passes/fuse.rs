//! Fusing an op into the linear layer that reads it, where the target's kernels offer the fused
//! op ([`crate::Fusions`]). Models emit plain ops; [`fuse_for_target`] runs the fusions the
//! target enables on the forward graph, before autodiff (a fused op brings its own gradient).
//!
//! A fused graph is the graph a builder emitting the fused ops itself would have made: the same
//! leaves in the same order, each fused op where the node it replaces was, and every name that
//! [`Graph::apply`] gave numbered by the new graph's nodes. So plans, whose reports name
//! tensors, do not tell the two apart.

use super::Rewritten;
use crate::ops::Op;
use crate::{Graph, GraphError, NodeId, Result, Target, TensorId};

/// One fusion found by a pass: node `at` becomes `op` on `inputs`, doing `absorbed`'s work too.
#[derive(Debug, Clone)]
pub(super) struct Fusion {
    /// The node the fused op replaces, and runs where.
    pub at: NodeId,
    /// The node folded into it, which no longer runs.
    pub absorbed: NodeId,
    pub op: Op,
    /// The fused op's inputs, as tensors of the old graph.
    pub inputs: Vec<TensorId>,
    /// The old tensor each output of the fused op stands for.
    pub outputs: Vec<TensorId>,
}

/// Reads of each tensor by nodes (inputs and control dependencies).
pub(super) fn readers(g: &Graph) -> Vec<usize> {
    let mut readers = vec![0usize; g.tensors().len()];
    for n in g.nodes() {
        for &t in n.inputs.iter().chain(&n.control) {
            readers[t.index()] += 1;
        }
    }
    readers
}

/// The producer of `t` when `t` is its output 0, read by exactly one node, not a graph output,
/// and the producer's other outputs are read by nothing: a value only its one reader needs,
/// which a fusion can make inside that reader.
pub(super) fn private_producer(g: &Graph, readers: &[usize], t: TensorId) -> Option<NodeId> {
    let p = g.producer(t)?;
    let outs = &g.node(p).outputs;
    let private = outs.first() == Some(&t)
        && readers[t.index()] == 1
        && outs[1..].iter().all(|o| readers[o.index()] == 0)
        && outs.iter().all(|o| !g.outputs().contains(o))
        && g.tensor(t).view_of.is_none();
    private.then_some(p)
}

/// The forward graph with the fusions `target.fusions` enables, and how many nodes were fused.
pub fn fuse_for_target(g: &Graph, target: &Target) -> Result<(Rewritten, usize)> {
    let readers = readers(g);
    let mut found = Vec::new();
    if target.fusions.layernorm_linear {
        found.extend(super::fuse_layernorm_linear::find(g, &readers));
    }
    if target.fusions.gelu_linear {
        found.extend(super::fuse_gelu_linear::find(g, &readers));
    }
    let count = found.len();
    Ok((fuse(g, &found)?, count))
}

/// Rebuilds `old` with `fusions` applied (see the module comment for what stays the same).
pub(super) fn fuse(old: &Graph, fusions: &[Fusion]) -> Result<Rewritten> {
    let n_nodes = old.nodes().len();
    let mut fused_at: Vec<Option<&Fusion>> = vec![None; n_nodes];
    let mut skip = vec![false; n_nodes];
    for f in fusions {
        fused_at[f.at.index()] = Some(f);
        skip[f.absorbed.index()] = true;
    }
    let mut new = Graph::new().with_target(old.target());
    let mut map: Vec<Option<TensorId>> = vec![None; old.tensors().len()];
    // Leaves are copied in their old order, each before the first node made after it.
    let mut next_leaf = 0;
    let mut copy_leaves = |new: &mut Graph, map: &mut [Option<TensorId>], upto: usize| {
        for t in next_leaf..upto {
            let m = &old.tensors()[t];
            if old.producer(TensorId(t as u32)).is_none() && m.view_of.is_none() {
                map[t] = Some(new.add_leaf(m.name.clone(), &m.shape, m.dtype, m.role)?);
            }
        }
        next_leaf = next_leaf.max(upto);
        Ok::<(), GraphError>(())
    };
    let lookup = |map: &[Option<TensorId>], t: TensorId| {
        map[t.index()].ok_or_else(|| GraphError::Invalid {
            op: "fuse",
            detail: format!(
                "`{}` is read before it is made (fuse before autodiff)",
                old.tensor(t).name
            ),
        })
    };
    for (i, node) in old.nodes().iter().enumerate() {
        if skip[i] {
            continue;
        }
        let first_out = node
            .outputs
            .iter()
            .chain(&node.workspace)
            .map(|t| t.index());
        copy_leaves(&mut new, &mut map, first_out.min().unwrap_or(0))?;
        let (op, inputs, outputs, control) = match fused_at[i] {
            Some(f) => {
                let absorbed = old.node(f.absorbed);
                let control: Vec<TensorId> = absorbed
                    .control
                    .iter()
                    .chain(&node.control)
                    .copied()
                    .collect();
                (f.op.clone(), &f.inputs[..], &f.outputs[..], control)
            }
            None => (
                node.op.clone(),
                &node.inputs[..],
                &node.outputs[..],
                node.control.clone(),
            ),
        };
        let inputs = inputs
            .iter()
            .map(|&t| lookup(&map, t))
            .collect::<Result<Vec<_>>>()?;
        new.set_scope(old.built_scope(NodeId(i as u32)).unwrap_or(""));
        new.set_block(node.block);
        let outs = new.apply(op, &inputs)?;
        let id = NodeId(new.nodes().len() as u32 - 1);
        for c in control {
            new.add_control(id, lookup(&map, c)?);
        }
        for (&o, &n) in outputs.iter().zip(&outs) {
            let m = old.tensor(o);
            // A name the builder chose (the loss) is kept; generated ones are renumbered.
            if !old.named_by_apply(o) {
                new.rename(n, m.name.clone());
            }
            new.set_role(n, m.role);
            map[o.index()] = Some(n);
        }
    }
    copy_leaves(&mut new, &mut map, old.tensors().len())?;
    for &o in old.outputs() {
        new.mark_output(lookup(&map, o)?);
    }
    new.set_scope(old.scope());
    new.set_block(old.block());
    Ok(Rewritten {
        graph: new,
        map,
        kept: skip.iter().map(|&s| !s).collect(),
    })
}
