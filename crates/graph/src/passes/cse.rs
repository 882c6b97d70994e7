//! Common-subexpression elimination ("prune duplicate connections"): a node computing the same
//! op on the same inputs as an earlier node is dropped and its readers use the earlier outputs.
//! Kernels are deterministic, so the values are bitwise the same.

use std::collections::HashMap;

use super::{rewrite, Rewritten};
use crate::{Graph, Result, TensorId};

/// The graph without duplicate nodes, and how many were removed.
pub fn eliminate_common_subexpressions(g: &Graph) -> Result<(Rewritten, usize)> {
    let mut skip = vec![false; g.nodes().len()];
    // Old output -> the equivalent output of the node kept in its place.
    let mut same: Vec<TensorId> = (0..g.tensors().len() as u32).map(TensorId).collect();
    let mut seen: HashMap<(&'static str, Vec<TensorId>), Vec<usize>> = HashMap::new();
    for (i, node) in g.nodes().iter().enumerate() {
        // In-place updates and ops without outputs have effects beyond their outputs.
        if node.outputs.is_empty() || !node.op.mutates_inputs().is_empty() {
            continue;
        }
        let inputs: Vec<TensorId> = node.inputs.iter().map(|t| same[t.index()]).collect();
        let candidates = seen.entry((node.op.name(), inputs)).or_default();
        let twin = candidates.iter().copied().find(|&j| {
            let other = &g.nodes()[j];
            other.op == node.op && other.control == node.control
        });
        match twin {
            Some(j) => {
                skip[i] = true;
                for (&o, &k) in node.outputs.iter().zip(&g.nodes()[j].outputs) {
                    same[o.index()] = k;
                }
            }
            None => candidates.push(i),
        }
    }
    let removed = skip.iter().filter(|&&s| s).count();
    let mut r = rewrite(g, |_, _, _| Ok(None), &skip, Some(&same))?;
    // Outputs of removed nodes resolve to their twins' new ids.
    for (t, &s) in same.iter().enumerate() {
        if s.index() != t {
            r.alias(TensorId(t as u32), s);
        }
    }
    Ok((r, removed))
}
