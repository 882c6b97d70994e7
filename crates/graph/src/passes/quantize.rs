//! Frozen weights stored in bf16, int8 or NF4 ([`crate::ops::dequantize`]) as a rewrite of the
//! step graph: each frozen 2-D f32 weight becomes its stored form (plus its absmax scales),
//! and every node that reads it, forward or backward, reads an f32 copy made just before it.
//! Runs after autodiff, so the backward's reads get copies of their own rather than holding
//! the forward's, and before rematerialization, which then recomputes them with their block.

use super::{copy_reading, rewrite, Rewritten};
use crate::ops::{Cast, Dequantize, QuantizeBase};
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
    let r = rewrite(
        old,
        |new, i, lookup| {
            let node = &old.nodes()[i];
            if !node.inputs.iter().any(|t| shape_of[t.index()].is_some()) {
                return Ok(None);
            }
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &t in &node.inputs {
                let Some(shape) = &shape_of[t.index()] else {
                    inputs.push(lookup(t));
                    continue;
                };
                let name = &old.tensor(t).name;
                let stored = lookup(t);
                let w = match base.scheme() {
                    None => new.apply1(Cast { to: DType::F32 }, &[stored])?,
                    Some(scheme) => {
                        let a = match absmax_of[t.index()] {
                            Some(a) => a,
                            None => {
                                let a = new.add_leaf(
                                    absmax_name(name),
                                    &scheme.absmax_shape(shape),
                                    DType::F32,
                                    Role::Parameter,
                                )?;
                                absmax_of[t.index()] = Some(a);
                                a
                            }
                        };
                        let op = Dequantize {
                            scheme,
                            shape: shape.clone(),
                        };
                        new.apply1(op, &[stored, a])?
                    }
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
