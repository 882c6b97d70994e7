//! Dead-code elimination ("remove unused tensors"): nodes whose outputs nothing reads — not
//! another node, not the caller (graph outputs) — and that update nothing in place are dropped,
//! repeatedly, so whole dead chains go. Forward values the backward never reads need no pass:
//! the planner already frees every tensor after its last reader.

use super::{rewrite, Rewritten};
use crate::{Graph, Result};

/// The graph without dead nodes, and how many were removed.
pub fn eliminate_dead_code(g: &Graph) -> Result<(Rewritten, usize)> {
    let n = g.nodes().len();
    let mut live_tensor = vec![false; g.tensors().len()];
    for &o in g.outputs() {
        live_tensor[o.index()] = true;
        live_tensor[g.storage_root(o).index()] = true;
    }
    let mut skip = vec![true; n];
    for i in (0..n).rev() {
        let node = &g.nodes()[i];
        let live = !node.op.mutates_inputs().is_empty()
            || node.outputs.is_empty()
            || node.outputs.iter().any(|o| live_tensor[o.index()]);
        if live {
            skip[i] = false;
            for t in node.inputs.iter().chain(&node.control) {
                live_tensor[t.index()] = true;
                live_tensor[g.storage_root(*t).index()] = true;
            }
        }
    }
    let removed = skip.iter().filter(|&&s| s).count();
    Ok((rewrite(g, |_, _, _| Ok(None), &skip, None)?, removed))
}
