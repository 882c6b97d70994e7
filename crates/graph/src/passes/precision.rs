//! Mixed precision: activations and their gradients rounded to a 16-bit float (bf16 or f16)
//! at every op boundary and stored at that width, while parameters stay f32 (the master
//! weights the optimizer updates) and kernels compute in f32.
//!
//! Rounding a matmul's operands to bf16 and accumulating in f32 is exactly what a bf16 GEMM
//! with f32 accumulation computes (the product of two bf16 values is exact in f32), so the
//! numbers are those of autocast-style bf16 compute; norms, softmax and the loss read the
//! rounded values in f32, as autocast runs them in f32.
//!
//! Two steps:
//! - [`mixed_precision`] (forward graph, before autodiff): each op's main float output `y` is
//!   followed by `y16 = cast(y)`, and its consumers read `cast(y16) -> f32`, made just before
//!   the first of them and named after it, so rematerialization counts it in the consumer's
//!   block (views look into `y16` directly). Autodiff then sends every gradient back through
//!   the opposite casts, so gradients are rounded at the same boundaries (and summed in f32).
//! - [`recast_saved`] (step graph, after autodiff): a backward node that reads a forward
//!   up-cast reads a fresh one made just before it, so between the passes only the 16-bit
//!   copy is held: that is where the memory goes down. Both casts of `y16` give the same bits.
//!   A backward that reads its op's own output (attention reads `O`) reads the rounded one
//!   too, as a bf16 kernel's backward would.

use super::{copy_reading, rewrite, Rewritten};
use crate::ops::quantized_read::own_gemm_runs;
use crate::ops::{Cast, HalfIo, LmHeadLoss, Op};
use crate::{DType, Graph, GraphError, Result, Role, StepGraph, TensorId};

/// An up-cast: f32 from a 16-bit float.
fn is_up_cast(g: &Graph, node: &crate::Node) -> bool {
    matches!(node.op, Op::Cast(Cast { to: DType::F32 }))
        && g.tensor(node.inputs[0]).dtype.size_bytes() == 2
}

/// The forward graph with every activation rounded to and stored as `low`; returns how many
/// activations it rounds.
pub fn mixed_precision(graph: &Graph, low: DType) -> Result<(Rewritten, usize)> {
    if !matches!(low, DType::BF16 | DType::F16) {
        return Err(GraphError::Invalid {
            op: "mixed_precision",
            detail: format!("the low precision must be bf16 or f16, got {low}"),
        });
    }
    let old = graph;
    // The 16-bit copy (in the new graph) of each old tensor that has one.
    let mut low_of: Vec<Option<TensorId>> = vec![None; old.tensors().len()];
    // Its f32 up-cast, once a consumer has made it.
    let mut up_of: Vec<Option<TensorId>> = vec![None; old.tensors().len()];
    let mut rounded = 0;
    let r = rewrite(
        old,
        |new, i, lookup| {
            let node = &old.nodes()[i];
            let view = old.is_view(node);
            let consumer = node
                .outputs
                .first()
                .map_or("", |&o| old.tensor(o).name.as_str());
            let mut inputs = Vec::with_capacity(node.inputs.len());
            let mut changed = false;
            for (k, &t) in node.inputs.iter().enumerate() {
                match low_of[t.index()] {
                    // A view looks into the 16-bit storage itself.
                    Some(c) if view => {
                        inputs.push(c);
                        changed = true;
                    }
                    Some(c) => {
                        let up = match up_of[t.index()] {
                            Some(up) => up,
                            None => {
                                let up = new.apply1(Cast { to: DType::F32 }, &[c])?;
                                new.rename(up, format!("{consumer}.up{k}"));
                                new.set_role(up, Role::Activation);
                                up_of[t.index()] = Some(up);
                                up
                            }
                        };
                        inputs.push(up);
                        changed = true;
                    }
                    None => inputs.push(lookup(t)),
                }
            }
            // The fused head's products compute as autocast's head does: in bf16 arithmetic.
            let head = match node.op {
                Op::LmHeadLoss(op) if low == DType::BF16 => Some(crate::Node {
                    op: Op::LmHeadLoss(LmHeadLoss { bf16: true, ..op }),
                    ..node.clone()
                }),
                _ => None,
            };
            if !changed && head.is_none() && (view || !eligible(old, node)) {
                return Ok(None);
            }
            let outs = copy_reading(new, old, head.as_ref().unwrap_or(node), &inputs, lookup)?;
            if view {
                // Views of a 16-bit tensor are 16-bit; their readers up-cast them.
                for (&o, &n) in node.outputs.iter().zip(&outs) {
                    if new.tensor(n).dtype == low {
                        low_of[o.index()] = Some(n);
                    }
                }
            } else if eligible(old, node) {
                let y = outs[0];
                let c = new.apply1(Cast { to: low }, &[y])?;
                new.rename(c, format!("{}.{low}", old.tensor(node.outputs[0]).name));
                new.set_role(c, Role::Activation);
                low_of[node.outputs[0].index()] = Some(c);
                rounded += 1;
            }
            Ok(Some(outs.into_iter().map(Some).collect()))
        },
        &vec![false; old.nodes().len()],
        None,
    )?;
    Ok((r, rounded))
}

/// Whether a node's main output is rounded: an f32 activation with more than one element that
/// is not read after the graph runs (the loss), nor a view, nor a cast already.
fn eligible(g: &Graph, node: &crate::Node) -> bool {
    let Some(&y) = node.outputs.first() else {
        return false;
    };
    let m = g.tensor(y);
    m.dtype == DType::F32
        && m.role == Role::Activation
        && m.view_of.is_none()
        && m.numel() > 1
        && !g.outputs().contains(&y)
        && !matches!(node.op, Op::Cast(_))
}

/// `step` with every backward read of a forward up-cast replaced by a fresh up-cast made right
/// before the reading node; returns how many it made.
pub fn recast_saved(step: &StepGraph) -> Result<(Rewritten, usize)> {
    let g = &step.graph;
    let n_fwd = step.forward_nodes;
    // For each forward tensor whose value is held in 16 bits: that 16-bit copy.
    let mut held: Vec<Option<TensorId>> = vec![None; g.tensors().len()];
    for node in &g.nodes()[..n_fwd] {
        if is_up_cast(g, node) {
            held[node.outputs[0].index()] = Some(node.inputs[0]);
        } else if let Op::Cast(Cast {
            to: DType::BF16 | DType::F16,
        }) = node.op
        {
            held[node.inputs[0].index()] = Some(node.outputs[0]);
        }
    }
    let mut made = 0;
    let r = rewrite(
        g,
        |new, i, lookup| {
            let node = &g.nodes()[i];
            if i < n_fwd || !node.inputs.iter().any(|t| held[t.index()].is_some()) {
                return Ok(None);
            }
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &t in &node.inputs {
                if let Some(src) = held[t.index()] {
                    let fresh = new.apply1(Cast { to: DType::F32 }, &[lookup(src)])?;
                    new.rename(fresh, format!("{}.again", g.tensor(t).name));
                    new.set_role(fresh, Role::Temporary);
                    inputs.push(fresh);
                    made += 1;
                } else {
                    inputs.push(lookup(t));
                }
            }
            let outs = copy_reading(new, g, node, &inputs, lookup)?;
            Ok(Some(outs.into_iter().map(Some).collect()))
        },
        &vec![false; g.nodes().len()],
        None,
    )?;
    Ok((r, made))
}

/// `graph` with the bf16 casts that kernels can take in removed ([`HalfIo`]):
/// - an up-cast whose every reader can read bf16 itself (directly, or through a reshape made
///   anew over the 16-bit tensor, as a weight gradient reads its flattened operand) goes, and
///   those readers read the 16-bit tensor;
/// - a down-cast that is the only reader of an output its producer can write in bf16 goes,
///   and the producer writes the 16-bit tensor;
/// - a down-cast of an up-cast (a gradient passed through an add) goes, its readers reading
///   the bf16 tensor the up-cast widened.
///
/// The values are bitwise the same (bf16 widens to f32 exactly, and the kernels round as the
/// cast does), and the f32 copies never exist; except where a CPU backend computes products
/// that read bf16 in bf16 arithmetic (AVX512-BF16, by default where the CPU has it), which
/// rounds their f32 operand too. Only where the target offers it
/// ([`crate::Fusions::half_io`]); a product only where its own GEMM runs it. An up-cast any
/// other node reads is kept whole. `n_fwd`: the forward nodes, returned counted anew beside
/// the rewrite and how many casts it removed.
pub fn fold_half_casts(graph: &Graph, n_fwd: usize) -> Result<(Rewritten, usize, usize)> {
    let g = graph;
    let n_nodes = g.nodes().len();
    if !g.target().fusions.half_io {
        let r = rewrite(g, |_, _, _| Ok(None), &vec![false; n_nodes], None)?;
        return Ok((r, n_fwd, 0));
    }
    let gemm = g.target().cpu_gemm().unwrap_or(crate::CpuGemm::Portable);
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); g.tensors().len()];
    let mut held_by_control = vec![false; g.tensors().len()];
    for (i, node) in g.nodes().iter().enumerate() {
        for &t in &node.inputs {
            readers[t.index()].push(i);
        }
        for &t in &node.control {
            held_by_control[t.index()] = true;
        }
    }
    let viewed: Vec<bool> = {
        let mut v = vec![false; g.tensors().len()];
        for t in g.tensors() {
            if let Some(view) = t.view_of {
                v[view.base.index()] = true;
            }
        }
        v
    };
    let private = |t: TensorId| !held_by_control[t.index()] && !g.outputs().contains(&t);
    // The inputs a node reads in bf16 if their up-casts go, or none.
    let readable = |i: usize| -> u8 {
        let node = &g.nodes()[i];
        match &node.op {
            Op::MatMul(mm) => {
                let (a, b) = (g.tensor(node.inputs[0]), g.tensor(node.inputs[1]));
                match mm.dims(&a.shape, &b.shape) {
                    Ok(d) if d.batch == 1 && own_gemm_runs(gemm, (d.m, d.n, d.k)) => 0b11,
                    _ => 0,
                }
            }
            // The weight gradient's product reads `dy` as our GEMM packs it; elsewhere the
            // kernel would widen a whole copy the plan does not hold.
            Op::LayerNormLinearBackward(_) => {
                let (x, w) = (g.tensor(node.inputs[0]), g.tensor(node.inputs[5]));
                match crate::ops::linear_dims("layer_norm_linear_backward", &x.shape, &w.shape) {
                    Ok((rows, k, n)) if own_gemm_runs(gemm, (k, n, rows)) => {
                        HalfIo::readable(&node.op)
                    }
                    _ => 0,
                }
            }
            // Adds of equal shapes only (the kernel does not broadcast).
            Op::Binary(_) => {
                let (a, b) = (g.tensor(node.inputs[0]), g.tensor(node.inputs[1]));
                if a.shape == b.shape {
                    HalfIo::readable(&node.op)
                } else {
                    0
                }
            }
            op => HalfIo::readable(op),
        }
    };
    // Down-casts of an up-cast of a bf16 tensor (a gradient passed through an add): rounding
    // a widened bf16 value gives it back, so they read that tensor instead.
    let round_trip = |i: usize| -> Option<TensorId> {
        let node = &g.nodes()[i];
        if !is_down_cast(node) || !private(node.outputs[0]) {
            return None;
        }
        let up = g.node(g.producer(node.inputs[0])?);
        let x16 = up.inputs[0];
        (is_up_cast(g, up) && g.tensor(x16).dtype == DType::BF16 && private(node.inputs[0]))
            .then_some(x16)
    };
    // Every read node `i` makes of `t` may be in bf16.
    let reads_half = |i: usize, t: TensorId| {
        if round_trip(i).is_some() {
            return true;
        }
        let node = &g.nodes()[i];
        let mask = readable(i);
        node.inputs
            .iter()
            .enumerate()
            .filter(|&(_, &x)| x == t)
            .all(|(k, _)| k < 8 && mask & (1 << k) != 0)
    };
    // Each removable cast (by node), and each reshape of an up-cast it takes with it.
    let mut skip = vec![false; n_nodes];
    // For a removed up-cast's output (or a reshape of one): the bf16 tensor, and the reshape
    // to make anew over it.
    let mut source: Vec<Option<(TensorId, Option<usize>)>> = vec![None; g.tensors().len()];
    let mut write_mask = vec![0u8; n_nodes];
    let mut removed = 0;
    let mut removed_fwd = 0;
    // What each tensor is read as: itself, or for a removed down-cast's output, the bf16
    // tensor that replaces it.
    let mut same: Vec<TensorId> = (0..g.tensors().len()).map(|t| TensorId(t as u32)).collect();
    for (i, node) in g.nodes().iter().enumerate() {
        if let Some(x16) = round_trip(i) {
            skip[i] = true;
            same[node.outputs[0].index()] = same[x16.index()];
            removed += 1;
            removed_fwd += (i < n_fwd) as usize;
            continue;
        }
        if is_down_cast(node) {
            let (y, y16) = (node.inputs[0], node.outputs[0]);
            let Some(p) = g.producer(y) else { continue };
            let producer = &g.nodes()[p.index()];
            let Some(j) = producer.outputs.iter().position(|&o| o == y) else {
                continue;
            };
            let only_reader = readers[y.index()] == [i];
            let broadcasts = matches!(producer.op, Op::Binary(_))
                && g.tensor(producer.inputs[0]).shape != g.tensor(producer.inputs[1]).shape;
            let inputs: Vec<&crate::TensorMeta> =
                producer.inputs.iter().map(|&t| g.tensor(t)).collect();
            if j < 8
                && !broadcasts
                && HalfIo::writes_on(&producer.op, &inputs, gemm) & (1 << j) != 0
                && only_reader
                && private(y)
                && private(y16)
                && !viewed[y.index()]
                && g.tensor(y).view_of.is_none()
                && g.tensor(y16).dtype == DType::BF16
            {
                skip[i] = true;
                same[y16.index()] = y;
                write_mask[p.index()] |= 1 << j;
                removed += 1;
                removed_fwd += (i < n_fwd) as usize;
            }
            continue;
        }
        if !is_up_cast(g, node) || g.tensor(node.inputs[0]).dtype != DType::BF16 {
            continue;
        }
        let u = node.outputs[0];
        if !private(u) || readers[u.index()].is_empty() {
            continue;
        }
        let mut views = Vec::new();
        let all = readers[u.index()].iter().all(|&r| {
            let rn = &g.nodes()[r];
            if matches!(rn.op, Op::Reshape(_)) && g.is_view(rn) {
                let v = rn.outputs[0];
                let ok = private(v)
                    && !readers[v.index()].is_empty()
                    && readers[v.index()].iter().all(|&x| reads_half(x, v));
                views.push(r);
                ok
            } else {
                reads_half(r, u)
            }
        });
        if !all {
            continue;
        }
        skip[i] = true;
        source[u.index()] = Some((node.inputs[0], None));
        for r in views {
            skip[r] = true;
            source[g.nodes()[r].outputs[0].index()] = Some((node.inputs[0], Some(r)));
            removed_fwd += (r < n_fwd) as usize;
        }
        removed += 1;
        removed_fwd += (i < n_fwd) as usize;
    }
    let mut added_fwd = 0;
    let r = rewrite(
        g,
        |new, i, lookup| {
            let node = &g.nodes()[i];
            let reads = node
                .inputs
                .iter()
                .enumerate()
                .filter(|(_, t)| source[t.index()].is_some())
                .fold(0u8, |m, (k, _)| m | 1 << k);
            let writes = write_mask[i];
            if reads | writes == 0 {
                return Ok(None);
            }
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &t in &node.inputs {
                inputs.push(match source[t.index()] {
                    None => lookup(same[t.index()]),
                    Some((h, None)) => lookup(same[h.index()]),
                    Some((h, Some(view))) => {
                        let op = g.nodes()[view].op.clone();
                        let v = new.apply1(op, &[lookup(same[h.index()])])?;
                        new.rename(v, format!("{}.bf16", g.tensor(t).name));
                        added_fwd += (i < n_fwd) as usize;
                        v
                    }
                });
            }
            let fused = crate::Node {
                op: Op::HalfIo(HalfIo {
                    op: Box::new(node.op.clone()),
                    reads,
                    writes,
                }),
                ..node.clone()
            };
            let outs = copy_reading(new, g, &fused, &inputs, lookup)?;
            for (j, (&o, &n)) in node.outputs.iter().zip(&outs).enumerate() {
                if writes & (1 << j) != 0 {
                    // Named as the 16-bit tensor it replaces.
                    let y16 = g.nodes()[readers[o.index()][0]].outputs[0];
                    new.rename(n, g.tensor(y16).name.clone());
                }
            }
            Ok(Some(outs.into_iter().map(Some).collect()))
        },
        &skip,
        Some(&same),
    )?;
    Ok((r, n_fwd + added_fwd - removed_fwd, removed))
}

/// A down-cast: bf16 from f32.
fn is_down_cast(node: &crate::Node) -> bool {
    matches!(node.op, Op::Cast(Cast { to: DType::BF16 }))
}

/// The value a forward 16-bit copy holds was produced by `op` (for remat policies that keep
/// the outputs of expensive ops: keeping the rounded copy keeps that output).
pub(crate) fn rounded_from(g: &Graph, t: TensorId) -> Option<&Op> {
    let node = g.node(g.producer(t)?);
    match node.op {
        Op::Cast(Cast {
            to: DType::BF16 | DType::F16,
        }) => Some(&g.node(g.producer(node.inputs[0])?).op),
        _ => None,
    }
}
