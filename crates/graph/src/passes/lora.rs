//! LoRA (Hu et al., 2021) as a rewrite of the forward graph: each linear layer whose weight
//! `select` names gains a low-rank branch, `y = x·W (+ b) + (alpha / r)·(x·Aᵀ)·Bᵀ`, with A
//! `[r, in]` and B `[out, r]` stored as PEFT stores them (`lora_A.weight`, `lora_B.weight`), so
//! an adapter is exported by renaming alone. Run it before the target's fusions: a LayerNorm
//! (or GELU) whose output the branch also reads is then left unfused, as it must be. The
//! caller freezes the base ([`crate::StepGraph::build_frozen`]).

use super::{copy_reading, rewrite, Rewritten};
use crate::ops::{Binary, MatMul, Op, Scale};
use crate::{Graph, GraphError, Result, Role, TensorId};

/// The adapters' rank and scale numerator (the branch is scaled by `alpha / rank`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f32,
}

impl LoraSpec {
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }
}

/// One adapted layer, by its tensors' names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraLayer {
    /// The frozen base weight, `[in, out]` as the layer reads it.
    pub weight: String,
    /// `[rank, in]`.
    pub lora_a: String,
    /// `[out, rank]`.
    pub lora_b: String,
    pub in_features: usize,
    pub out_features: usize,
}

/// The names of a weight's adapters: `p.weight` → `p.lora_A.weight`, `p.lora_B.weight`.
pub fn lora_names(weight: &str) -> (String, String) {
    let prefix = weight.strip_suffix(".weight").unwrap_or(weight);
    (
        format!("{prefix}.lora_A.weight"),
        format!("{prefix}.lora_B.weight"),
    )
}

/// `g` with a LoRA branch on every plain linear layer (`x · W (+ b)`, W a 2-D parameter read
/// untransposed) whose weight's name `select` accepts, and the layers adapted, in graph
/// order. A weight read by several such layers gets one adapter, shared. A rank of zero or
/// above the layer's smaller side is an error naming the layer.
pub fn add_lora(
    g: &Graph,
    spec: &LoraSpec,
    select: &dyn Fn(&str) -> bool,
) -> Result<(Rewritten, Vec<LoraLayer>)> {
    if !(spec.alpha.is_finite() && spec.alpha > 0.0) {
        return Err(GraphError::Invalid {
            op: "lora",
            detail: format!("alpha must be a positive number, got {}", spec.alpha),
        });
    }
    let adapted = |i: usize| -> Option<TensorId> {
        let n = &g.nodes()[i];
        let Op::MatMul(mm) = &n.op else { return None };
        let w = *n.inputs.get(1)?;
        let meta = g.tensor(w);
        let plain = !mm.ta && !mm.tb && g.producer(w).is_none();
        (plain && meta.role == Role::Parameter && meta.rank() == 2 && select(&meta.name))
            .then_some(w)
    };
    let mut layers: Vec<LoraLayer> = Vec::new();
    // Adapters of weights already seen, in the new graph.
    let mut made: Vec<(TensorId, TensorId, TensorId)> = Vec::new();
    let skip = vec![false; g.nodes().len()];
    let r = rewrite(
        g,
        |new, i, lookup| {
            let Some(w) = adapted(i) else { return Ok(None) };
            let node = &g.nodes()[i];
            let inputs: Vec<TensorId> = node.inputs.iter().map(|&t| lookup(t)).collect();
            let base = copy_reading(new, g, node, &inputs, lookup)?[0];
            let meta = g.tensor(w);
            let (n_in, n_out) = (meta.shape[0], meta.shape[1]);
            let (a, b) = match made.iter().find(|m| m.0 == w) {
                Some(&(_, a, b)) => (a, b),
                None => {
                    if spec.rank == 0 || spec.rank > n_in.min(n_out) {
                        return Err(GraphError::Invalid {
                            op: "lora",
                            detail: format!(
                                "rank {} for `{}` ({n_in} in, {n_out} out): the rank must be \
                                 at least 1 and at most {}",
                                spec.rank,
                                meta.name,
                                n_in.min(n_out)
                            ),
                        });
                    }
                    let (a_name, b_name) = lora_names(&meta.name);
                    let a = new.add_leaf(
                        a_name.clone(),
                        &[spec.rank, n_in],
                        meta.dtype,
                        Role::Parameter,
                    )?;
                    let b = new.add_leaf(
                        b_name.clone(),
                        &[n_out, spec.rank],
                        meta.dtype,
                        Role::Parameter,
                    )?;
                    made.push((w, a, b));
                    layers.push(LoraLayer {
                        weight: meta.name.clone(),
                        lora_a: a_name,
                        lora_b: b_name,
                        in_features: n_in,
                        out_features: n_out,
                    });
                    (a, b)
                }
            };
            let prev = new.scope().to_string();
            let prefix = meta.name.strip_suffix(".weight").unwrap_or(&meta.name);
            new.set_scope(format!("{prefix}.lora"));
            let tb = MatMul {
                tb: true,
                ..MatMul::default()
            };
            // Scaling the rank-wide product costs `r` columns, not `out`.
            let down = new.apply1(tb, &[inputs[0], a])?;
            let down = new.apply1(
                Scale {
                    factor: spec.scale(),
                },
                &[down],
            )?;
            let up = new.apply1(tb, &[down, b])?;
            let y = new.apply1(Binary::add(), &[base, up]);
            new.set_scope(prev);
            let y = y?;
            new.rename(y, g.tensor(node.outputs[0]).name.clone());
            Ok(Some(vec![Some(y)]))
        },
        &skip,
        None,
    )?;
    Ok((r, layers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn linear() -> (Graph, TensorId) {
        let mut g = Graph::new();
        let x = g.input("x", &[2, 3, 8], DType::F32).unwrap();
        let w = g.parameter("layer.q_proj.weight", &[8, 6]).unwrap();
        let v = g.parameter("layer.v_proj.weight", &[8, 6]).unwrap();
        let y = g.apply1(MatMul::default(), &[x, w]).unwrap();
        let z = g.apply1(MatMul::default(), &[x, v]).unwrap();
        let s = g.apply1(Binary::add(), &[y, z]).unwrap();
        g.mark_output(s);
        (g, s)
    }

    #[test]
    fn adds_a_branch_to_selected_layers_only() {
        let (g, out) = linear();
        let spec = LoraSpec {
            rank: 2,
            alpha: 4.0,
        };
        let (r, layers) = add_lora(&g, &spec, &|n| n.contains("q_proj")).unwrap();
        assert_eq!(layers.len(), 1);
        assert_eq!(layers[0].lora_a, "layer.q_proj.lora_A.weight");
        assert_eq!(layers[0].lora_b, "layer.q_proj.lora_B.weight");
        let ng = &r.graph;
        let shape_of = |name: &str| {
            ng.tensors()
                .iter()
                .find(|t| t.name == name)
                .map(|t| (t.shape.clone(), t.role))
        };
        assert_eq!(
            shape_of("layer.q_proj.lora_A.weight"),
            Some((vec![2, 8], Role::Parameter))
        );
        assert_eq!(
            shape_of("layer.q_proj.lora_B.weight"),
            Some((vec![6, 2], Role::Parameter))
        );
        assert!(shape_of("layer.v_proj.lora_A.weight").is_none());
        // Two matmuls, a scale and an add more than before.
        assert_eq!(ng.nodes().len(), g.nodes().len() + 4);
        assert_eq!(ng.tensor(r.map(out).unwrap()).shape, vec![2, 3, 6]);
    }

    #[test]
    fn rank_zero_or_above_the_layer_is_refused_by_name() {
        let (g, _) = linear();
        for rank in [0, 7] {
            let err = add_lora(&g, &LoraSpec { rank, alpha: 1.0 }, &|_| true).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains("layer.q_proj.weight") && text.contains("at most 6"),
                "{text}"
            );
        }
    }
}
