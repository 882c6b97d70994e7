use serde::{Deserialize, Serialize};

use crate::ops::{Op, OutSpec};
use crate::tensor::{checked_numel, TensorMeta, ViewOf};
use crate::{DType, GraphError, Result, Role, TensorId};

/// Index of a node in its [`Graph`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One op application: reads `inputs`, writes `outputs`, and may use a private `workspace`.
#[derive(Debug, Clone)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    /// Scratch memory the kernel needs while it runs (a `Temporary` tensor, planned like any other).
    pub workspace: Option<TensorId>,
    /// Tensors that must exist before this node runs, though it does not read them: orders a
    /// recomputation after the backward pass reaches it (they do not extend lifetimes).
    pub control: Vec<TensorId>,
    /// `Some(i)`: output 0 is written over input `i`, whose storage it shares (set by
    /// [`crate::passes::write_in_place`]; a rewrite of the graph drops it).
    pub inplace: Option<usize>,
    /// The model block (transformer layer) the node belongs to, as the builder said with
    /// [`Graph::in_block`]; `None` outside blocks (embeddings, head, loss). Rewrites keep it, and
    /// a node a pass makes in place of another takes that node's. Rematerialization segments
    /// the forward pass by it.
    pub block: Option<u32>,
}

/// A static dataflow graph over tensor metadata. Nodes are stored in a valid topological order
/// (the builder only appends nodes whose inputs already exist).
#[derive(Debug, Clone, Default)]
pub struct Graph {
    tensors: Vec<TensorMeta>,
    nodes: Vec<Node>,
    producer: Vec<Option<NodeId>>,
    /// Tensors read after the graph has run (the loss): alive until the end of the schedule.
    outputs: Vec<TensorId>,
    scope: String,
    /// Block given to nodes while building (see [`Graph::in_block`]).
    block: Option<u32>,
    /// Role given to op outputs while building (activations in forward, temporaries in backward).
    build_role: Option<Role>,
    /// The device the graph is planned for (threads, its GEMM): sizes kernels' workspaces, so
    /// plans depend on it.
    target: crate::Target,
}

impl Graph {
    pub fn new() -> Self {
        Graph {
            target: crate::Target::host(1),
            ..Default::default()
        }
    }

    /// Sets the number of worker threads kernels partition their workspaces for.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.target = self.target.with_threads(threads);
        self
    }

    /// Plans for `target` (its threads and GEMM) instead of this machine.
    pub fn with_target(mut self, target: crate::Target) -> Self {
        self.target = target;
        self
    }

    pub fn threads(&self) -> usize {
        self.target.threads()
    }

    pub fn target(&self) -> crate::Target {
        self.target
    }

    pub fn tensors(&self) -> &[TensorMeta] {
        &self.tensors
    }

    pub fn tensor(&self, id: TensorId) -> &TensorMeta {
        &self.tensors[id.index()]
    }

    pub fn try_tensor(&self, id: TensorId) -> Result<&TensorMeta> {
        self.tensors
            .get(id.index())
            .ok_or(GraphError::UnknownTensor(id))
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn producer(&self, id: TensorId) -> Option<NodeId> {
        self.producer[id.index()]
    }

    pub fn outputs(&self) -> &[TensorId] {
        &self.outputs
    }

    /// Keeps `id` alive to the end of the step so that it can be read afterwards.
    pub fn mark_output(&mut self, id: TensorId) {
        if !self.outputs.contains(&id) {
            self.outputs.push(id);
        }
    }

    /// Whether `node` only makes views (reshape, row slices): every output looks into an
    /// input's storage and the node does not write in place, so its kernel touches no byte.
    pub fn is_view(&self, node: &Node) -> bool {
        node.inplace.is_none()
            && !node.outputs.is_empty()
            && node
                .outputs
                .iter()
                .all(|&o| self.tensors[o.index()].view_of.is_some())
    }

    /// The storage a tensor lives in: itself, or the base of the view chain it belongs to.
    pub fn storage_root(&self, mut id: TensorId) -> TensorId {
        while let Some(v) = self.tensors[id.index()].view_of {
            id = v.base;
        }
        id
    }

    /// Prefix for the names of tensors created from now on (for example `h.3.attn`).
    pub fn set_scope(&mut self, scope: impl Into<String>) {
        self.scope = scope.into();
    }

    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Runs `build` with every node it adds marked as belonging to model block `block`, the
    /// segments rematerialization checkpoints (blocks do not nest: the previous one is restored
    /// after).
    pub fn in_block<T>(&mut self, block: u32, build: impl FnOnce(&mut Graph) -> T) -> T {
        let prev = self.set_block(Some(block));
        let out = build(self);
        self.set_block(prev);
        out
    }

    /// The block nodes added now are marked with.
    pub fn block(&self) -> Option<u32> {
        self.block
    }

    /// Sets the block nodes added from now on are marked with; returns the previous one.
    pub(crate) fn set_block(&mut self, block: Option<u32>) -> Option<u32> {
        std::mem::replace(&mut self.block, block)
    }

    /// The scope the outputs of `node` were named under by [`Graph::apply`] (`""` where there
    /// was none), or `None` when a pass or the caller has renamed all of them.
    pub(crate) fn built_scope(&self, node: NodeId) -> Option<&str> {
        let n = &self.nodes[node.index()];
        let tag = node_tag(n, node);
        n.outputs
            .iter()
            .chain(&n.workspace)
            .find_map(|&t| generated_scope(&self.tensors[t.index()].name, &tag))
    }

    /// Whether `t` still has the name [`Graph::apply`] gave it.
    pub(crate) fn named_by_apply(&self, t: TensorId) -> bool {
        self.producer(t).is_some_and(|p| {
            generated_scope(&self.tensors[t.index()].name, &node_tag(self.node(p), p)).is_some()
        })
    }

    pub(crate) fn set_build_role(&mut self, role: Option<Role>) -> Option<Role> {
        std::mem::replace(&mut self.build_role, role)
    }

    pub fn set_role(&mut self, id: TensorId, role: Role) {
        self.tensors[id.index()].role = role;
    }

    pub fn rename(&mut self, id: TensorId, name: impl Into<String>) {
        self.tensors[id.index()].name = name.into();
    }

    /// Gives a leaf another storage (a frozen weight stored quantized), before a pass copies
    /// the graph.
    pub(crate) fn retype_leaf(
        &mut self,
        id: TensorId,
        shape: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let name = self.tensors[id.index()].name.clone();
        checked_numel(&name, shape, dtype)?;
        let m = &mut self.tensors[id.index()];
        m.shape = shape.to_vec();
        m.dtype = dtype;
        Ok(())
    }

    /// Adds a tensor with no producer: a parameter, optimizer state or input.
    pub fn add_leaf(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        dtype: DType,
        role: Role,
    ) -> Result<TensorId> {
        let name = name.into();
        checked_numel(&name, shape, dtype)?;
        Ok(self.push_tensor(TensorMeta {
            name,
            shape: shape.to_vec(),
            dtype,
            role,
            view_of: None,
        }))
    }

    pub fn parameter(&mut self, name: impl Into<String>, shape: &[usize]) -> Result<TensorId> {
        self.add_leaf(name, shape, DType::F32, Role::Parameter)
    }

    pub fn input(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        dtype: DType,
    ) -> Result<TensorId> {
        self.add_leaf(name, shape, dtype, Role::Input)
    }

    fn push_tensor(&mut self, meta: TensorMeta) -> TensorId {
        let id = TensorId(self.tensors.len() as u32);
        self.tensors.push(meta);
        self.producer.push(None);
        id
    }

    /// Applies `op` to `inputs`, checking the op's shape rule, and returns its outputs.
    pub fn apply(&mut self, op: impl Into<Op>, inputs: &[TensorId]) -> Result<Vec<TensorId>> {
        let op = op.into();
        for &i in inputs {
            self.try_tensor(i)?;
        }
        let metas: Vec<&TensorMeta> = inputs.iter().map(|&i| self.tensor(i)).collect();
        let specs = op.infer(&metas)?;
        let ws_elems = op.workspace_elems(&metas, &self.target);
        // Checked like any output: a scratch too large to count in bytes is refused by name,
        // never wrapped into a small one.
        if ws_elems.checked_mul(DType::F32.size_bytes()).is_none() {
            return Err(GraphError::Overflow {
                name: format!("{}'s workspace", op.name()),
                shape: vec![ws_elems],
            });
        }
        let node_id = NodeId(self.nodes.len() as u32);
        let role = self.build_role.unwrap_or(Role::Activation);
        let op_name = op.name();
        let mut outputs = Vec::with_capacity(specs.len());
        for (k, spec) in specs.into_iter().enumerate() {
            let OutSpec {
                shape,
                dtype,
                view_of_input,
                suffix,
            } = spec;
            let name = self.out_name(op_name, suffix, k);
            checked_numel(&name, &shape, dtype)?;
            let view_of = view_of_input.map(|(input, offset_elems)| ViewOf {
                base: inputs[input],
                offset_elems,
            });
            // A view of a persistent tensor keeps its role so that it is never placed in the arena.
            let role = match view_of {
                Some(v) => self.tensors[v.base.index()].role,
                None => role,
            };
            let id = self.push_tensor(TensorMeta {
                name,
                shape,
                dtype,
                role,
                view_of,
            });
            self.producer[id.index()] = Some(node_id);
            outputs.push(id);
        }
        let workspace = if ws_elems > 0 {
            let name = self.out_name(op_name, Some("workspace"), 0);
            let id = self.push_tensor(TensorMeta {
                name,
                shape: vec![ws_elems],
                dtype: DType::F32,
                role: Role::Temporary,
                view_of: None,
            });
            self.producer[id.index()] = Some(node_id);
            Some(id)
        } else {
            None
        };
        self.nodes.push(Node {
            op,
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
            workspace,
            control: Vec::new(),
            inplace: None,
            block: self.block,
        });
        Ok(outputs)
    }

    /// Makes `node` wait for `after` to be produced (a control dependency).
    pub fn add_control(&mut self, node: NodeId, after: TensorId) {
        let n = &mut self.nodes[node.index()];
        if !n.control.contains(&after) {
            n.control.push(after);
        }
    }

    /// Makes `node` write its output 0 over its input `input`: the output becomes a view of
    /// the input's storage. The caller (the in-place pass) has checked that nothing else reads
    /// that storage, in any schedule.
    pub(crate) fn set_inplace(&mut self, node: NodeId, input: usize) {
        let n = &mut self.nodes[node.index()];
        n.inplace = Some(input);
        let (base, out) = (n.inputs[input], n.outputs[0]);
        self.tensors[out.index()].view_of = Some(ViewOf {
            base,
            offset_elems: 0,
        });
    }

    /// Like [`Graph::apply`] for single-output ops.
    pub fn apply1(&mut self, op: impl Into<Op>, inputs: &[TensorId]) -> Result<TensorId> {
        Ok(self.apply(op, inputs)?[0])
    }

    /// `{scope}.{op}#{node}`, then `.{suffix}` or, past output 0, `.{k}` (see
    /// [`generated_scope`], its inverse).
    fn out_name(&self, op_name: &str, suffix: Option<&'static str>, k: usize) -> String {
        let base = if self.scope.is_empty() {
            format!("{op_name}#{}", self.nodes.len())
        } else {
            format!("{}.{op_name}#{}", self.scope, self.nodes.len())
        };
        match suffix {
            Some(s) => format!("{base}.{s}"),
            None if k == 0 => base,
            None => format!("{base}.{k}"),
        }
    }

    /// Total model FLOPs of one run of the graph (matmuls and attention dominate).
    pub fn flops(&self) -> u64 {
        self.nodes
            .iter()
            .map(|n| {
                let ins: Vec<&TensorMeta> = n.inputs.iter().map(|&i| self.tensor(i)).collect();
                let outs: Vec<&TensorMeta> = n.outputs.iter().map(|&i| self.tensor(i)).collect();
                n.op.flops(&ins, &outs)
            })
            // Saturating: `fit` plans candidates of absurd batches only to refuse them.
            .fold(0, u64::saturating_add)
    }
}

/// `{op}#{index}`: the part of a generated name that identifies its node.
fn node_tag(node: &Node, id: NodeId) -> String {
    format!("{}#{}", node.op.name(), id.index())
}

/// The scope of `name` when it is a name [`Graph::out_name`] made for the node tagged `tag`.
fn generated_scope<'n>(name: &'n str, tag: &str) -> Option<&'n str> {
    // Suffixes (`mean`, `1`, `workspace`) never hold a `#`: the last tag is the node's.
    let at = name.rfind(tag)?;
    let (scope, rest) = (&name[..at], &name[at + tag.len()..]);
    if !(rest.is_empty() || rest.starts_with('.')) {
        return None;
    }
    match scope.strip_suffix('.') {
        Some(s) if !s.is_empty() => Some(s),
        None if scope.is_empty() => Some(""),
        _ => None,
    }
}

impl AsRef<Graph> for Graph {
    fn as_ref(&self) -> &Graph {
        self
    }
}
