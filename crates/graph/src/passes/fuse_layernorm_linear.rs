//! Finds `matmul(layer_norm(x), w) + b` where the normalised rows feed nothing else, and
//! replaces the pair by one [`LayerNormLinear`], which normalises rows a tile at a time as the
//! GEMM packs them: the normalised activation is never stored. Run it on the forward graph,
//! before autodiff: the fused op brings its own gradient.

use super::fuse::{fuse, private_producer, readers, Fusion};
use super::Rewritten;
use crate::ops::{LayerNormLinear, Op};
use crate::{Graph, NodeId, Result};

/// The graph with every LayerNorm + linear pair fused, and how many pairs there were.
pub fn fuse_layernorm_linear(g: &Graph) -> Result<(Rewritten, usize)> {
    let found = find(g, &readers(g));
    Ok((fuse(g, &found)?, found.len()))
}

/// The pairs to fuse: a linear layer (`[.., k] · [k, n] + b`, neither side transposed) whose
/// input is a LayerNorm's output that only it reads.
pub(super) fn find(g: &Graph, readers: &[usize]) -> Vec<Fusion> {
    let mut found = Vec::new();
    for (i, n) in g.nodes().iter().enumerate() {
        let Op::MatMul(mm) = &n.op else { continue };
        if mm.ta || mm.tb || !mm.bias {
            continue;
        }
        let (h, w, b) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let Some(p) = private_producer(g, readers, h) else {
            continue;
        };
        let norm = g.node(p);
        let Op::LayerNorm(ln) = &norm.op else {
            continue;
        };
        if g.tensor(w).rank() != 2 {
            continue;
        }
        found.push(Fusion {
            at: NodeId(i as u32),
            absorbed: p,
            op: LayerNormLinear { eps: ln.eps }.into(),
            inputs: vec![norm.inputs[0], norm.inputs[1], norm.inputs[2], w, b],
            // The norm's row statistics are the fused op's too.
            outputs: vec![n.outputs[0], norm.outputs[1], norm.outputs[2]],
        });
    }
    found
}
