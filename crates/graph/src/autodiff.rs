//! Reverse-mode autodiff as a graph transformation: the forward graph is extended with the nodes
//! that compute the gradient of a scalar loss with respect to chosen tensors.

use std::collections::HashMap;

use crate::ops::{Binary, BinaryKind, Fill, Op};
use crate::{Graph, GraphError, Result, Role, TensorId};

/// What an op's gradient rule sees: the forward node's tensors, the gradients of its outputs,
/// and the graph to emit backward nodes into.
pub struct GradCtx<'g> {
    graph: &'g mut Graph,
    inputs: Vec<TensorId>,
    outputs: Vec<TensorId>,
    grad_outputs: Vec<Option<TensorId>>,
    grad_inputs: Vec<Option<TensorId>>,
    needs_grad: Vec<bool>,
}

impl GradCtx<'_> {
    pub fn graph(&mut self) -> &mut Graph {
        self.graph
    }
    pub fn input(&self, i: usize) -> TensorId {
        self.inputs[i]
    }
    /// How many inputs the forward node has (ops with optional inputs branch on it).
    pub fn input_count(&self) -> usize {
        self.inputs.len()
    }
    pub fn output(&self, i: usize) -> TensorId {
        self.outputs[i]
    }
    pub fn input_shape(&self, i: usize) -> Vec<usize> {
        self.graph.tensor(self.inputs[i]).shape.clone()
    }
    /// Gradient of output `i`, if anything downstream depends on it.
    pub fn grad_out(&self, i: usize) -> Option<TensorId> {
        self.grad_outputs[i]
    }
    /// Whether input `i` needs a gradient (rules skip work for those that do not).
    pub fn wants(&self, i: usize) -> bool {
        self.needs_grad[i]
    }
    pub fn set_grad(&mut self, i: usize, grad: TensorId) {
        self.grad_inputs[i] = Some(grad);
    }
    /// Emits one op and returns its first output.
    pub fn apply1(&mut self, op: impl Into<Op>, inputs: &[TensorId]) -> Result<TensorId> {
        self.graph.apply1(op, inputs)
    }
    pub fn apply(&mut self, op: impl Into<Op>, inputs: &[TensorId]) -> Result<Vec<TensorId>> {
        self.graph.apply(op, inputs)
    }
}

/// Appends the backward pass of `loss` to `graph` and returns the gradient of each tensor in
/// `wrt` (in the same order). Parameter gradients get the `Gradient` role.
pub fn backward(graph: &mut Graph, loss: TensorId, wrt: &[TensorId]) -> Result<Vec<TensorId>> {
    backward_seeded(graph, loss, wrt, None)
}

/// [`backward`] with the loss's gradient read from `seed` (a tensor shaped like the loss, such
/// as a loss scale fed at run time) instead of ones.
pub fn backward_seeded(
    graph: &mut Graph,
    loss: TensorId,
    wrt: &[TensorId],
    seed: Option<TensorId>,
) -> Result<Vec<TensorId>> {
    let loss_meta = graph.try_tensor(loss)?;
    if loss_meta.numel() != 1 {
        return Err(GraphError::NonScalarLoss(loss_meta.name.clone()));
    }
    let n_tensors = graph.tensors().len();
    let n_forward = graph.nodes().len();

    // Forward sweep: which tensors depend on a `wrt` tensor.
    let mut needs = vec![false; n_tensors];
    for &w in wrt {
        graph.try_tensor(w)?;
        needs[w.index()] = true;
    }
    for node in graph.nodes() {
        if node.inputs.iter().any(|i| needs[i.index()]) {
            for o in &node.outputs {
                needs[o.index()] = true;
            }
        }
    }

    let prev_role = graph.set_build_role(Some(Role::Temporary));
    let prev_scope = graph.scope().to_string();
    graph.set_scope("grad");
    let prev_block = graph.set_block(None);
    let seed = match seed {
        Some(s) if graph.try_tensor(s)?.shape == graph.tensor(loss).shape => s,
        Some(s) => {
            return Err(GraphError::Invalid {
                op: "backward",
                detail: format!(
                    "seed `{}` is shaped {:?}, the loss {:?}",
                    graph.tensor(s).name,
                    graph.tensor(s).shape,
                    graph.tensor(loss).shape
                ),
            })
        }
        None => graph.apply1(
            Fill {
                value: 1.0,
                shape: graph.tensor(loss).shape.clone(),
            },
            &[],
        )?,
    };
    let mut grads: HashMap<TensorId, TensorId> = HashMap::new();
    grads.insert(loss, seed);

    for n in (0..n_forward).rev() {
        let node = graph.nodes()[n].clone();
        let grad_outputs: Vec<Option<TensorId>> =
            node.outputs.iter().map(|o| grads.get(o).copied()).collect();
        if grad_outputs.iter().all(Option::is_none) {
            continue;
        }
        let needs_grad: Vec<bool> = node.inputs.iter().map(|i| needs[i.index()]).collect();
        if !needs_grad.iter().any(|&b| b) {
            continue;
        }
        let scope = graph.tensor(node.outputs[0]).name.clone();
        graph.set_scope(format!("grad[{scope}]"));
        // A node's gradient belongs to its block.
        graph.set_block(node.block);
        let mut ctx = GradCtx {
            graph,
            inputs: node.inputs.clone(),
            outputs: node.outputs.clone(),
            grad_outputs,
            grad_inputs: vec![None; node.inputs.len()],
            needs_grad: needs_grad.clone(),
        };
        node.op.backward(&mut ctx)?;
        let grad_inputs = ctx.grad_inputs;
        for (k, g) in grad_inputs.into_iter().enumerate() {
            let (Some(g), true) = (g, needs_grad[k]) else {
                continue;
            };
            let input = node.inputs[k];
            let total = match grads.get(&input) {
                // Fan-out: contributions from several consumers are summed.
                Some(&prev) => graph.apply1(
                    Binary {
                        kind: BinaryKind::Add,
                    },
                    &[prev, g],
                )?,
                None => g,
            };
            grads.insert(input, total);
        }
    }
    graph.set_scope(prev_scope);
    graph.set_block(prev_block);
    graph.set_build_role(prev_role);

    let mut out = Vec::with_capacity(wrt.len());
    for &w in wrt {
        let g = match grads.get(&w) {
            Some(&g) => g,
            None => {
                // The loss does not depend on `w`: its gradient is zero.
                graph.set_build_role(Some(Role::Gradient));
                let z = graph.apply1(
                    Fill {
                        value: 0.0,
                        shape: graph.tensor(w).shape.clone(),
                    },
                    &[],
                )?;
                graph.set_build_role(prev_role);
                z
            }
        };
        if graph.tensor(w).role == Role::Parameter {
            let root = graph.storage_root(g);
            graph.set_role(root, Role::Gradient);
            graph.set_role(g, Role::Gradient);
            let name = format!("{}.grad", graph.tensor(w).name);
            graph.rename(g, name);
        }
        out.push(g);
    }
    Ok(out)
}
