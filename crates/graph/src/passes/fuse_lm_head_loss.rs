//! Finds `cross_entropy(matmul(x, head), targets[, mask, divisor])` where the logits feed nothing else, and
//! replaces the pair by one [`LmHeadLoss`] that materialises logits a tile at a time.
//! Run it on the forward graph, before autodiff: the fused op brings its own gradient.

use super::{rewrite, Rewritten};
use crate::ops::{LmHeadLoss, Op};
use crate::{DType, Graph, Result, TensorId};

/// Bytes of logits materialised at once: 32 MiB, 4,096 tokens × 2,048 entries at GPT-2's size.
pub const DEFAULT_CHUNK_BYTES: usize = 32 << 20;

/// Fewest vocabulary entries per tile before a tile spans fewer tokens: a block of the head
/// narrower than this makes thin GEMMs.
const MIN_COLS: usize = 1024;

/// The `(rows, cols)` tile of `chunk_bytes` of f32 logits for `tokens × vocab`: every token
/// in one tile when that leaves at least `MIN_COLS` entries (or the whole vocabulary).
pub fn lm_head_tile(chunk_bytes: usize, tokens: usize, vocab: usize) -> (usize, usize) {
    let elems = (chunk_bytes / 4).max(1);
    let rows = (elems / vocab.clamp(1, MIN_COLS)).clamp(1, tokens.max(1));
    let cols = (elems / rows).clamp(1, vocab.max(1));
    (rows, cols)
}

/// The graph with every LM-head + cross-entropy pair fused, and how many pairs there were.
pub fn fuse_lm_head_loss(g: &Graph, chunk_bytes: usize) -> Result<(Rewritten, usize)> {
    let mut readers = vec![0usize; g.tensors().len()];
    for n in g.nodes() {
        for &t in &n.inputs {
            readers[t.index()] += 1;
        }
    }
    let mut skip = vec![false; g.nodes().len()];
    // CE node -> (x, head, transposed, tile)
    type Fused = (TensorId, TensorId, bool, (usize, usize));
    let mut fuse: Vec<Option<Fused>> = vec![None; g.nodes().len()];
    for (i, n) in g.nodes().iter().enumerate() {
        if !matches!(n.op, Op::CrossEntropy(_)) {
            continue;
        }
        let logits = n.inputs[0];
        let Some(p) = g.producer(logits) else {
            continue;
        };
        let Op::MatMul(mm) = &g.node(p).op else {
            continue;
        };
        let (x, w) = (g.node(p).inputs[0], g.node(p).inputs[1]);
        let fusable = !mm.ta
            && !mm.bias
            && readers[logits.index()] == 1
            && !g.outputs().contains(&logits)
            && g.tensor(x).rank() == 2
            && g.tensor(w).rank() == 2
            && g.tensor(x).dtype == DType::F32
            && g.tensor(w).dtype == DType::F32;
        if fusable {
            let (rows, vocab) = (g.tensor(x).shape[0], g.tensor(logits).shape[1]);
            skip[p.index()] = true;
            fuse[i] = Some((x, w, mm.tb, lm_head_tile(chunk_bytes, rows, vocab)));
        }
    }
    let count = fuse.iter().flatten().count();
    let rewritten = rewrite(
        g,
        |new, i, lookup| {
            let Some((x, w, tb, (rows, cols))) = fuse[i] else {
                return Ok(None);
            };
            let ce = g.node(crate::NodeId(i as u32));
            // The loss mask and its divisor, when the loss has them, follow the targets.
            let ins: Vec<TensorId> = [x, w]
                .into_iter()
                .chain(ce.inputs[1..].iter().copied())
                .map(lookup)
                .collect();
            let outs = new.apply(
                LmHeadLoss {
                    tb,
                    rows,
                    cols,
                    bf16: false,
                },
                &ins,
            )?;
            let old_loss = g.tensor(ce.outputs[0]);
            new.rename(outs[0], old_loss.name.clone());
            new.set_role(outs[0], old_loss.role);
            new.rename(outs[1], format!("{}.lse", old_loss.name));
            Ok(Some(vec![Some(outs[0])]))
        },
        &skip,
        None,
    )?;
    Ok((rewritten, count))
}
