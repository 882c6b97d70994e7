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
        for t in (next_leaf..upto).map(|t| TensorId(t as u32)) {
            let m = old.tensor(t);
            if old.producer(t).is_none() && m.view_of.is_none() {
                map[t.index()] = Some(new.add_leaf(m.name.clone(), &m.shape, m.dtype, m.role)?);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{Binary, Gelu, GeluApprox, GeluLinear, LayerNorm, LayerNormLinear, MatMul};
    use crate::passes::{fuse_gelu_linear, fuse_layernorm_linear};
    use crate::{DType, Fusions};

    const LINEAR: MatMul = MatMul {
        ta: false,
        tb: false,
        bias: true,
    };

    /// Leaves of a `[4, 3, 8]` input through a LayerNorm and an `8 → 16` linear layer, then
    /// GELU and a `16 → 8` linear layer: the shape of a pre-norm MLP.
    struct Mlp {
        g: Graph,
        x: TensorId,
        ln: [TensorId; 2],
        up: [TensorId; 2],
        down: [TensorId; 2],
    }

    fn leaves() -> Mlp {
        let mut g = Graph::new();
        let x = g.input("x", &[4, 3, 8], DType::F32).unwrap();
        let mut p = |name: &str, shape: &[usize]| g.parameter(name, shape).unwrap();
        let ln = [p("ln.w", &[8]), p("ln.b", &[8])];
        let up = [p("up.w", &[8, 16]), p("up.b", &[16])];
        let down = [p("down.w", &[16, 8]), p("down.b", &[8])];
        Mlp { g, x, ln, up, down }
    }

    /// The MLP with plain ops, in block 2 and scope `mlp`; returns the graph and its output.
    fn plain() -> (Graph, TensorId) {
        let Mlp {
            mut g,
            x,
            ln,
            up,
            down,
        } = leaves();
        let y = g.in_block(2, |g| {
            g.set_scope("mlp");
            let h = g
                .apply(LayerNorm { eps: 1e-3 }, &[x, ln[0], ln[1]])
                .unwrap()[0];
            let f = g.apply1(LINEAR, &[h, up[0], up[1]]).unwrap();
            let f = g.apply1(Gelu::default(), &[f]).unwrap();
            g.apply1(LINEAR, &[f, down[0], down[1]]).unwrap()
        });
        g.mark_output(y);
        (g, y)
    }

    /// The same MLP as a builder emitting the fused ops writes it.
    fn fused_by_hand() -> Graph {
        let Mlp {
            mut g,
            x,
            ln,
            up,
            down,
        } = leaves();
        let y = g.in_block(2, |g| {
            g.set_scope("mlp");
            let norm = LayerNormLinear { eps: 1e-3 };
            let f = g.apply(norm, &[x, ln[0], ln[1], up[0], up[1]]).unwrap()[0];
            let gelu = GeluLinear {
                approx: GeluApprox::Tanh,
            };
            g.apply1(gelu, &[f, down[0], down[1]]).unwrap()
        });
        g.mark_output(y);
        g
    }

    fn op_names(g: &Graph) -> Vec<&'static str> {
        g.nodes().iter().map(|n| n.op.name()).collect()
    }

    /// Everything the planner sees: tensors (names, shapes, dtypes, roles) in id order, and
    /// nodes (op, inputs, outputs, workspace, block).
    fn layout(g: &Graph) -> String {
        let nodes: Vec<String> = g
            .nodes()
            .iter()
            .map(|n| {
                let (i, o, w, b) = (&n.inputs, &n.outputs, n.workspace, n.block);
                format!("{:?} {i:?} {o:?} {w:?} {b:?}", n.op)
            })
            .collect();
        format!("{:?}\n{nodes:?}\n{:?}", g.tensors(), g.outputs())
    }

    /// Both fusions give, tensor for tensor and name for name, the graph a builder emitting the
    /// fused ops makes (so plans cannot tell them apart), in the same block.
    #[test]
    fn fusing_the_plain_mlp_gives_the_hand_fused_graph() {
        let (g, y) = plain();
        let (r, n) = fuse_for_target(&g, &Target::default()).unwrap();
        assert_eq!(n, 2);
        assert_eq!(op_names(&r.graph), ["layer_norm_linear", "gelu_linear"]);
        assert_eq!(layout(&r.graph), layout(&fused_by_hand()));
        assert_eq!(r.graph.tensor(r.map(y).unwrap()).name, "mlp.gelu_linear#1");
        assert!(r.graph.nodes().iter().all(|n| n.block == Some(2)));
        // The norm's eps moved into the fused op.
        assert!(matches!(
            r.graph.nodes()[0].op,
            Op::LayerNormLinear(LayerNormLinear { eps }) if eps == 1e-3
        ));
        // The normalised rows are gone; the norm's statistics are the fused op's.
        let norm = g.node(NodeId(0));
        assert!(r.map(norm.outputs[0]).is_err());
        let mean = r.map(norm.outputs[1]).unwrap();
        assert_eq!(r.graph.tensor(mean).name, "mlp.layer_norm_linear#0.mean");
    }

    /// Each pass fuses its own pair only; the target chooses which run.
    #[test]
    fn each_fusion_is_its_own_pass_and_the_target_picks() {
        let (g, _) = plain();
        let (r, n) = fuse_layernorm_linear(&g).unwrap();
        assert_eq!(n, 1);
        assert_eq!(op_names(&r.graph), ["layer_norm_linear", "gelu", "matmul"]);
        let (r, n) = fuse_gelu_linear(&g).unwrap();
        assert_eq!(n, 1);
        assert_eq!(op_names(&r.graph), ["layer_norm", "matmul", "gelu_linear"]);
        let gelu_only = Fusions {
            layernorm_linear: false,
            gelu_linear: true,
            quantized_reads: false,
            half_io: false,
        };
        let target = Target::default().with_fusions(gelu_only);
        let (r, n) = fuse_for_target(&g, &target).unwrap();
        assert_eq!(
            (n, op_names(&r.graph)),
            (1, vec!["layer_norm", "matmul", "gelu_linear"])
        );
        let none = Target::default().with_fusions(Fusions::NONE);
        let (r, n) = fuse_for_target(&g, &none).unwrap();
        assert_eq!(n, 0);
        assert_eq!(layout(&r.graph), layout(&g));
    }

    /// A norm or GELU output something else also reads (a residual, the graph's outputs) must
    /// be stored anyway: the pair is left alone. So is a linear layer the fused kernels do not
    /// cover (transposed weight, no bias).
    #[test]
    fn pairs_whose_intermediate_is_needed_elsewhere_are_untouched() {
        // The norm's output also feeds a residual add.
        let Mlp { mut g, x, ln, .. } = leaves();
        let w = g.parameter("sq.w", &[8, 8]).unwrap();
        let b = g.parameter("sq.b", &[8]).unwrap();
        let h = g.apply(LayerNorm::default(), &[x, ln[0], ln[1]]).unwrap()[0];
        let f = g.apply1(LINEAR, &[h, w, b]).unwrap();
        let y = g.apply1(Binary::add(), &[f, h]).unwrap();
        g.mark_output(y);
        assert_eq!(fuse_layernorm_linear(&g).unwrap().1, 0);

        // The GELU output is a graph output.
        let Mlp { mut g, x, down, .. } = leaves();
        let h = g.apply1(Gelu::default(), &[x]).unwrap();
        let w = g.parameter("w", &[8, 8]).unwrap();
        let y = g.apply1(LINEAR, &[h, w, down[1]]).unwrap();
        g.mark_output(y);
        g.mark_output(h);
        assert_eq!(fuse_gelu_linear(&g).unwrap().1, 0);

        // Transposed weights and bias-free products have no fused kernel.
        for mm in [
            MatMul { tb: true, ..LINEAR },
            MatMul {
                bias: false,
                ..LINEAR
            },
        ] {
            let Mlp { mut g, x, .. } = leaves();
            let w = g.parameter("w", &[8, 8]).unwrap();
            let h = g.apply1(Gelu::default(), &[x]).unwrap();
            let ins = if mm.bias {
                vec![h, w, g.parameter("b", &[8]).unwrap()]
            } else {
                vec![h, w]
            };
            let y = g.apply1(mm, &ins).unwrap();
            g.mark_output(y);
            let (r, n) = fuse_gelu_linear(&g).unwrap();
            assert_eq!(n, 0, "{mm:?}");
            assert_eq!(layout(&r.graph), layout(&g));
        }
    }

    /// A name the builder set by hand (the loss, the logits) survives the renumbering.
    #[test]
    fn hand_set_names_are_kept() {
        let (mut g, y) = plain();
        g.rename(y, "out");
        let (r, _) = fuse_for_target(&g, &Target::default()).unwrap();
        assert_eq!(r.graph.tensor(r.map(y).unwrap()).name, "out");
        let x = r.map(TensorId(0)).unwrap();
        assert_eq!(r.graph.tensor(x).name, "x");
    }
}
