//! Passes over a graph: each is a pure function from a graph to a new graph. What a pass saves
//! is measured by planning the step before and after it (`snug plan --passes ...`), not
//! estimated here.
//!
//! - [`fuse_for_target`]: the fusions the target's kernels offer, each its own pass:
//!   [`fuse_layernorm_linear`] and [`fuse_gelu_linear`] fold a LayerNorm or a GELU into the
//!   linear layer that reads it, so its output is never stored.
//! - [`fuse_lm_head_loss`]: the LM head and its cross-entropy as one tiled op, so the
//!   `tokens × vocab` logits and their gradient never exist.
//! - [`eliminate_common_subexpressions`], [`eliminate_dead_code`]: duplicate and unread nodes.
//! - [`rematerialize`]: activation checkpointing on the step graph (per block, or selective).
//! - [`mixed_precision`], [`recast_saved`]: activations and their gradients rounded to and
//!   stored in bf16 or f16, with f32 master weights.
//! - [`write_in_place`]: ops write over an input that dies at them (runs last).
//! - [`add_lora`]: low-rank adapters beside chosen linear layers, whose weights then freeze.
//! - [`quantize_frozen`]: frozen weights stored in bf16, int8 or NF4, dequantized per reader.

mod cse;
mod dce;
mod fuse;
mod fuse_gelu_linear;
mod fuse_layernorm_linear;
mod fuse_lm_head_loss;
mod inplace;
mod lora;
mod precision;
mod quantize;
mod remat;

pub use cse::eliminate_common_subexpressions;
pub use dce::eliminate_dead_code;
pub use fuse::fuse_for_target;
pub use fuse_gelu_linear::fuse_gelu_linear;
pub use fuse_layernorm_linear::fuse_layernorm_linear;
pub use fuse_lm_head_loss::{fuse_lm_head_loss, DEFAULT_CHUNK_BYTES};
pub use inplace::write_in_place;
pub use lora::{add_lora, lora_names, LoraLayer, LoraSpec};
pub use precision::{fold_half_casts, mixed_precision, recast_saved};
pub use quantize::{absmax_name, quantize_frozen, quantize_weights};
pub use remat::{
    remat_candidates, rematerialize, rematerialize_dropping, RematCandidate, RematPolicy,
};

use crate::{Graph, GraphError, Result, Role, TensorId};

/// A graph rebuilt by a pass, with the map from the old graph's tensors to the new one's.
#[derive(Debug, Clone)]
pub struct Rewritten {
    pub graph: Graph,
    pub(crate) map: Vec<Option<TensorId>>,
    /// Which old nodes were copied (not skipped).
    pub(crate) kept: Vec<bool>,
}

impl Rewritten {
    /// The new id of `old`, or an error when the pass removed it.
    pub fn map(&self, old: TensorId) -> Result<TensorId> {
        self.map
            .get(old.index())
            .copied()
            .flatten()
            .ok_or_else(|| GraphError::Invalid {
                op: "pass",
                detail: format!("tensor {old:?} was removed by the pass"),
            })
    }

    /// Maps `old` to wherever `to` went (a merged duplicate).
    pub(crate) fn alias(&mut self, old: TensorId, to: TensorId) {
        self.map[old.index()] = self.map[to.index()];
    }

    /// How many of the old graph's first `forward_nodes` nodes survive: the forward count of
    /// a graph whose pass only removed nodes.
    pub fn surviving(&self, forward_nodes: usize) -> usize {
        self.kept[..forward_nodes].iter().filter(|&&k| k).count()
    }
}

/// Re-applies `node` of `old` in `new` on `inputs`, waiting on `control`, keeping its outputs'
/// names and roles and its block.
pub(crate) fn copy_node(
    new: &mut Graph,
    old: &Graph,
    node: &crate::Node,
    inputs: &[TensorId],
    control: &[TensorId],
) -> Result<Vec<TensorId>> {
    let prev = new.set_block(node.block);
    let outs = new.apply(node.op.clone(), inputs);
    new.set_block(prev);
    let outs = outs?;
    let id = crate::NodeId(new.nodes().len() as u32 - 1);
    for &c in control {
        new.add_control(id, c);
    }
    for (&o, &n) in node.outputs.iter().zip(&outs) {
        let m = old.tensor(o);
        new.rename(n, m.name.clone());
        // A view has its base's role (as `apply` gave it). A view of a persistent tensor that
        // the copy computes instead (a narrowed weight now read from its quantized codes)
        // is an activation: kept as a parameter, it was planned, saved and loaded as one.
        let role = match (m.view_of, new.tensor(n).view_of) {
            (_, Some(_)) => new.tensor(n).role,
            (Some(_), None) => crate::Role::Activation,
            (None, None) => m.role,
        };
        new.set_role(n, role);
    }
    Ok(outs)
}

/// [`copy_node`] inside a [`rewrite`]'s `replace`: `node` re-applied on `inputs` (already in
/// the new graph), waiting on its control dependencies as `lookup` maps them.
pub(crate) fn copy_reading(
    new: &mut Graph,
    old: &Graph,
    node: &crate::Node,
    inputs: &[TensorId],
    lookup: &dyn Fn(TensorId) -> TensorId,
) -> Result<Vec<TensorId>> {
    let control: Vec<TensorId> = node.control.iter().map(|&c| lookup(c)).collect();
    copy_node(new, old, node, inputs, &control)
}

/// Copies `old` into a new graph node by node; `replace(node index, mapped inputs)` may emit
/// different nodes for a node (returning the new ids of that node's outputs, positionally) or
/// `None` to copy it as it is. Names and roles of copied tensors are kept.
pub(crate) fn rewrite(
    old: &Graph,
    mut replace: impl FnMut(
        &mut Graph,
        usize,
        &dyn Fn(TensorId) -> TensorId,
    ) -> Result<Option<Vec<Option<TensorId>>>>,
    skip: &[bool],
    same: Option<&[TensorId]>,
) -> Result<Rewritten> {
    let mut new = Graph::new().with_target(old.target());
    let mut map: Vec<Option<TensorId>> = vec![None; old.tensors().len()];
    let copy_leaf =
        |new: &mut Graph, map: &mut Vec<Option<TensorId>>, t: TensorId| -> Result<TensorId> {
            if let Some(id) = map[t.index()] {
                return Ok(id);
            }
            let m = old.tensor(t);
            let id = new.add_leaf(m.name.clone(), &m.shape, m.dtype, m.role)?;
            map[t.index()] = Some(id);
            Ok(id)
        };
    for (i, node) in old.nodes().iter().enumerate() {
        if skip[i] {
            // A parameter read only by a node that a fusion skips (an untied LM head) is still
            // the fused node's input.
            for &t in &node.inputs {
                if old.producer(t).is_none() && old.tensor(t).role == Role::Parameter {
                    copy_leaf(&mut new, &mut map, t)?;
                }
            }
            continue;
        }
        for &t in &node.inputs {
            if old.producer(t).is_none() {
                copy_leaf(&mut new, &mut map, t)?;
            }
        }
        let replaced = {
            let lookup = |t: TensorId| map[t.index()].expect("inputs are mapped before use");
            // What a pass emits in place of a node belongs to that node's block.
            let prev = new.set_block(node.block);
            let replaced = replace(&mut new, i, &lookup);
            new.set_block(prev);
            replaced?
        };
        if let Some(outs) = replaced {
            for (&o, n) in node.outputs.iter().zip(outs) {
                map[o.index()] = n;
            }
            continue;
        }
        // Inputs read through `same` (a merged duplicate's twin) when given.
        let via = |t: TensorId| same.map_or(t, |s| s[t.index()]);
        let inputs: Vec<TensorId> = node
            .inputs
            .iter()
            .map(|&t| map[via(t).index()].expect("inputs are mapped before use"))
            .collect();
        let control: Vec<TensorId> = node
            .control
            .iter()
            .filter_map(|&c| map[via(c).index()])
            .collect();
        let outs = copy_node(&mut new, old, node, &inputs, &control)?;
        for (&o, &n) in node.outputs.iter().zip(&outs) {
            map[o.index()] = Some(n);
        }
    }
    // Leaves no node reads (an unused parameter) still belong to the model.
    for t in 0..old.tensors().len() {
        let t = TensorId(t as u32);
        if old.producer(t).is_none() && old.tensor(t).view_of.is_none() {
            copy_leaf(&mut new, &mut map, t)?;
        }
    }
    for &o in old.outputs() {
        let o = same.map_or(o, |s| s[o.index()]);
        if let Some(n) = map[o.index()] {
            new.mark_output(n);
        }
    }
    let kept = skip.iter().map(|&s| !s).collect();
    Ok(Rewritten {
        graph: new,
        map,
        kept,
    })
}
