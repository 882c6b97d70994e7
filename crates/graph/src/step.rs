//! The training step as one graph: forward, backward, and the optimizer update of every
//! parameter. Parameters and optimizer state persist across steps; everything else lives and
//! dies inside the step.

use serde::{Deserialize, Serialize};

use crate::ops::{AdamW, Sgd};
use crate::{backward, DType, Graph, GraphError, Result, Role, TensorId};

/// Optimizer applied at the end of the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerSpec {
    /// AdamW; weight decay applies to parameters of rank ≥ 2 (weights and embeddings, not
    /// biases or norm gains), as in GPT-2 and nanoGPT. Moments are f32 whatever the weights'
    /// precision.
    AdamW(AdamW),
    /// Plain SGD (no optimizer state); weight decay as for AdamW.
    Sgd(Sgd),
    /// No update: gradients are kept alive to the end of the step so they can be read.
    None,
}

/// One trainable parameter and the tensors that belong to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamSlot {
    pub name: String,
    pub param: TensorId,
    pub grad: TensorId,
    /// Adam's first and second moments.
    pub moments: Option<(TensorId, TensorId)>,
}

/// A compiled-but-not-planned training step.
#[derive(Debug, Clone)]
pub struct StepGraph {
    pub graph: Graph,
    pub loss: TensorId,
    pub inputs: Vec<TensorId>,
    pub params: Vec<ParamSlot>,
}

impl StepGraph {
    /// Differentiates `loss` with respect to every parameter of `graph` and appends `optimizer`.
    pub fn build(mut graph: Graph, loss: TensorId, optimizer: OptimizerSpec) -> Result<StepGraph> {
        let params: Vec<TensorId> = (0..graph.tensors().len() as u32)
            .map(TensorId)
            .filter(|&t| {
                graph.tensor(t).role == Role::Parameter && graph.tensor(t).view_of.is_none()
            })
            .collect();
        if params.is_empty() {
            return Err(GraphError::Invalid {
                op: "step",
                detail: "the graph has no parameters to train".into(),
            });
        }
        let inputs: Vec<TensorId> = (0..graph.tensors().len() as u32)
            .map(TensorId)
            .filter(|&t| graph.tensor(t).role == Role::Input)
            .collect();
        graph.mark_output(loss);
        let grads = backward(&mut graph, loss, &params)?;
        let mut slots = Vec::with_capacity(params.len());
        graph.set_scope("optimizer");
        for (&p, &g) in params.iter().zip(&grads) {
            let meta = graph.tensor(p).clone();
            let moments = match optimizer {
                OptimizerSpec::AdamW(adamw) => {
                    let m = graph.add_leaf(
                        format!("{}.adam_m", meta.name),
                        &meta.shape,
                        DType::F32,
                        Role::OptimizerState,
                    )?;
                    let v = graph.add_leaf(
                        format!("{}.adam_v", meta.name),
                        &meta.shape,
                        DType::F32,
                        Role::OptimizerState,
                    )?;
                    let adamw = AdamW {
                        weight_decay: if meta.rank() >= 2 {
                            adamw.weight_decay
                        } else {
                            0.0
                        },
                        ..adamw
                    };
                    graph.apply(adamw, &[p, g, m, v])?;
                    Some((m, v))
                }
                OptimizerSpec::Sgd(sgd) => {
                    let sgd = Sgd {
                        weight_decay: if meta.rank() >= 2 {
                            sgd.weight_decay
                        } else {
                            0.0
                        },
                    };
                    graph.apply(sgd, &[p, g])?;
                    None
                }
                OptimizerSpec::None => {
                    graph.mark_output(g);
                    None
                }
            };
            slots.push(ParamSlot {
                name: meta.name,
                param: p,
                grad: g,
                moments,
            });
        }
        graph.set_scope("");
        Ok(StepGraph {
            graph,
            loss,
            inputs,
            params: slots,
        })
    }

    /// Bytes of every persistent tensor (parameters and optimizer state).
    pub fn persistent_bytes(&self) -> usize {
        self.graph
            .tensors()
            .iter()
            .filter(|t| t.role.is_persistent() && t.view_of.is_none())
            .map(|t| t.size_bytes())
            .sum()
    }

    pub fn parameter_count(&self) -> usize {
        self.params
            .iter()
            .map(|p| self.graph.tensor(p.param).numel())
            .sum()
    }
}

impl AsRef<Graph> for StepGraph {
    fn as_ref(&self) -> &Graph {
        &self.graph
    }
}
