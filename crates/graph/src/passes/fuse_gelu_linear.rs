//! Finds `matmul(gelu(h), w) + b` where the GELU output feeds nothing else, and replaces the
//! pair by one [`GeluLinear`], which applies GELU a tile at a time as the GEMM packs its input:
//! the activation is never stored. Run it on the forward graph, before autodiff: the fused op
//! brings its own gradient.

use super::fuse::{fuse, private_producer, readers, Fusion};
use super::Rewritten;
use crate::ops::{GeluLinear, Op};
use crate::{Graph, NodeId, Result};

/// The graph with every GELU + linear pair fused, and how many pairs there were.
pub fn fuse_gelu_linear(g: &Graph) -> Result<(Rewritten, usize)> {
    let found = find(g, &readers(g));
    Ok((fuse(g, &found)?, found.len()))
}

/// The pairs to fuse: a linear layer (`[.., k] · [k, n] + b`, neither side transposed) whose
/// input is a GELU's output that only it reads.
pub(super) fn find(g: &Graph, readers: &[usize]) -> Vec<Fusion> {
    let mut found = Vec::new();
    for (i, n) in g.nodes().iter().enumerate() {
        let Op::MatMul(mm) = &n.op else { continue };
        if mm.ta || mm.tb || !mm.bias {
            continue;
        }
        let (f, w, b) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let Some(p) = private_producer(g, readers, f) else {
            continue;
        };
        let gelu = g.node(p);
        let Op::Gelu(act) = &gelu.op else { continue };
        if g.tensor(w).rank() != 2 {
            continue;
        }
        found.push(Fusion {
            at: NodeId(i as u32),
            absorbed: p,
            op: GeluLinear { approx: act.approx }.into(),
            inputs: vec![gelu.inputs[0], w, b],
            outputs: vec![n.outputs[0]],
        });
    }
    found
}
