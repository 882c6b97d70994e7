//! Frozen weights stored in bf16, int8 or NF4 ([`crate::ops::dequantize`]) as a rewrite of the
//! step graph: each frozen 2-D f32 weight becomes its stored form (plus its absmax scales),
//! and every node that reads it, forward or backward, reads an f32 copy made just before it.
//! Runs after autodiff, so the backward's reads get copies of their own rather than holding
//! the forward's, and before rematerialization, which then recomputes them with their block.
//!
//! Where the target reads quantized weights from their codes ([`crate::Fusions::quantized_reads`],
//! the CPU), a reader that can ([`QuantizedRead::reads`]: products reading the weight as `b`,
//! the fused LM head and its backward, the embedding) becomes a [`QuantizedRead`] instead, and
//! no f32 copy of the weight is made for it.

use super::{copy_reading, rewrite, Rewritten};
use crate::ops::{Cast, Dequantize, Op, QuantizeBase, QuantizedRead};
use crate::{DType, Graph, Result, Role, StepGraph, TensorId};

/// The name of a quantized weight's absmax scales.
pub fn absmax_name(weight: &str) -> String {
    format!("{weight}.absmax")
}

/// `step` with every frozen 2-D f32 weight stored as `base` says; returns the rewrite, the new
/// number of forward nodes, and how many weights it stores so. Trained parameters are never
/// touched: only [`StepGraph::frozen`] is read.
pub fn quantize_frozen(step: &StepGraph, base: QuantizeBase) -> Result<(Rewritten, usize, usize)> {
    let frozen: Vec<TensorId> = step.frozen.iter().map(|f| f.param).collect();
    quantize_weights(&step.graph, &frozen, base, step.forward_nodes)
}

/// `graph` with those of `weights` that are 2-D f32 leaves stored as `base` says, each read
/// through a dequantization made just before its reader (an inference graph's weights, or a
/// step's frozen ones). `n_fwd`: the graph's forward nodes, returned counted anew with the
/// rewrite and how many weights it stores so.
pub fn quantize_weights(
    graph: &Graph,
    weights: &[TensorId],
    base: QuantizeBase,
    n_fwd: usize,
) -> Result<(Rewritten, usize, usize)> {
    let mut old = graph.clone();
    let n = old.tensors().len();
    // The f32 shape of each weight stored quantized.
    let mut shape_of: Vec<Option<Vec<usize>>> = vec![None; n];
    let mut count = 0;
    for &w in weights {
        let m = old.tensor(w);
        if m.rank() != 2
            || m.dtype != DType::F32
            || m.view_of.is_some()
            || old.producer(w).is_some()
        {
            continue;
        }
        let shape = m.shape.clone();
        let (dtype, codes, _) = base.storage(&shape);
        old.retype_leaf(w, &codes, dtype)?;
        shape_of[w.index()] = Some(shape);
        count += 1;
    }
    let mut absmax_of: Vec<Option<TensorId>> = vec![None; n];
    let mut forward_added = 0;
    let old = &old;
    let fuse = old.target().fusions.quantized_reads;
    let mut readers = vec![0usize; n];
    for node in old.nodes() {
        for &t in node.inputs.iter().chain(&node.control) {
            readers[t.index()] += 1;
        }
    }
    let r = rewrite(
        old,
        |new, i, lookup| {
            let node = &old.nodes()[i];
            if !node.inputs.iter().any(|t| shape_of[t.index()].is_some()) {
                return Ok(None);
            }
            let mut absmax = |new: &mut crate::Graph, t: TensorId, shape: &[usize]| {
                let Some(scheme) = base.scheme() else {
                    return Ok::<_, crate::GraphError>(None);
                };
                if let Some(a) = absmax_of[t.index()] {
                    return Ok(Some(a));
                }
                let a = new.add_leaf(
                    absmax_name(&old.tensor(t).name),
                    &scheme.absmax_shape(shape),
                    DType::F32,
                    Role::Parameter,
                )?;
                absmax_of[t.index()] = Some(a);
                Ok(Some(a))
            };
            let read = fuse.then(|| fused_read(old, node, &shape_of, &readers, base));
            if let Some(op) = read.flatten() {
                let w = node.inputs[op.weight];
                let mut inputs: Vec<TensorId> = Vec::with_capacity(node.inputs.len() + 1);
                for (k, &t) in node.inputs.iter().enumerate() {
                    inputs.push(lookup(t));
                    if k == op.weight {
                        inputs.extend(absmax(new, w, &op.shape)?);
                    }
                }
                let fused = crate::Node {
                    op: Op::QuantizedRead(op),
                    ..node.clone()
                };
                let outs = copy_reading(new, old, &fused, &inputs, lookup)?;
                // An output the fused op does not make (the frozen head's gradient) is
                // read by nothing.
                let mut mapped: Vec<Option<TensorId>> = outs.into_iter().map(Some).collect();
                mapped.resize(node.outputs.len(), None);
                return Ok(Some(mapped));
            }
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &t in &node.inputs {
                let Some(shape) = &shape_of[t.index()] else {
                    inputs.push(lookup(t));
                    continue;
                };
                let name = &old.tensor(t).name;
                let stored = lookup(t);
                let w = match (base.scheme(), absmax(new, t, shape)?) {
                    (Some(scheme), Some(a)) => {
                        let op = Dequantize {
                            scheme,
                            shape: shape.clone(),
                        };
                        new.apply1(op, &[stored, a])?
                    }
                    _ => new.apply1(Cast { to: DType::F32 }, &[stored])?,
                };
                new.rename(w, format!("{name}.dequant"));
                new.set_role(w, Role::Activation);
                if i < n_fwd {
                    forward_added += 1;
                }
                inputs.push(w);
            }
            let outs = copy_reading(new, old, node, &inputs, lookup)?;
            Ok(Some(outs.into_iter().map(Some).collect()))
        },
        &vec![false; old.nodes().len()],
        None,
    )?;
    Ok((r, n_fwd + forward_added, count))
}

/// The [`QuantizedRead`] `node` becomes, if it reads exactly one quantized weight and in a
/// way that can read it from its codes; outputs the fused op does not make must be unread.
fn fused_read(
    old: &Graph,
    node: &crate::Node,
    shape_of: &[Option<Vec<usize>>],
    readers: &[usize],
    base: QuantizeBase,
) -> Option<QuantizedRead> {
    let mut quantized = node
        .inputs
        .iter()
        .enumerate()
        .filter(|(_, t)| shape_of[t.index()].is_some());
    let (weight, &w) = quantized.next()?;
    if quantized.next().is_some() || !QuantizedRead::reads(&node.op, weight) {
        return None;
    }
    let op = QuantizedRead {
        base,
        shape: shape_of[w.index()].clone()?,
        weight,
        reader: Box::new(node.op.clone()),
    };
    let made = match &node.op {
        Op::LmHeadLossBackward(_) => 1,
        _ => node.outputs.len(),
    };
    let unread = node.outputs[made..]
        .iter()
        .all(|o| readers[o.index()] == 0 && !old.outputs().contains(o));
    unread.then_some(op)
}
