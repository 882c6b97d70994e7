//! The interface between the executor and a device. The [`Session`](crate::Session) is
//! written once against it; each device (the CPU, a GPU through wgpu) implements it in its
//! own crate.
//!
//! The contract, which `tests/backend_contract.rs` checks with a backend that records calls:
//! - The session allocates every buffer through [`Backend::allocator`] before it binds a node,
//!   and keeps those buffers alive, unmoved, for as long as any binding made from them.
//! - [`Backend::bind`] is called once per scheduled node whenever the arena is (re)acquired at
//!   a new buffer, in schedule order, with every tensor addressed as (buffer, byte offset,
//!   byte length): kernels never see a host slice unless their device is the host.
//! - [`Backend::launch`] runs bound nodes in schedule order and may return before the device
//!   has finished (a GPU records a whole step into command buffers and submits once).
//! - [`Backend::synchronize`] is called before any result is read back, before the host
//!   writes to memory a launched node may still use, and before the arena is released —
//!   except for a step's inputs on a backend that stages them ([`Backend::stages_inputs`]):
//!   those go through [`Backend::upload_input`] with no wait, and land before the next launch.

use snug_graph::{Graph, Node, Target, TensorMeta};

use crate::{Allocator, Buffer, Device, ExecCtx, RuntimeError};

/// A byte range of one device buffer.
#[derive(Debug, Clone, Copy)]
pub struct Slice<'a> {
    pub buffer: &'a Buffer,
    pub offset: usize,
    pub len: usize,
}

/// A tensor as a kernel is bound to it: where its bytes are, and what they hold.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    pub slice: Slice<'a>,
    pub meta: &'a TensorMeta,
}

/// Every tensor one node touches, in the op's order.
#[derive(Debug)]
pub struct NodeArgs<'a> {
    pub inputs: Vec<Binding<'a>>,
    pub outputs: Vec<Binding<'a>>,
    /// Scratch the plan gave the node (its op's `workspace_elems` on this target).
    pub workspace: Option<Binding<'a>>,
}

/// A device that runs planned graphs.
pub trait Backend: Send {
    /// A node bound to its buffers, launched again at every step without rebinding.
    type Bound: Send;

    fn device(&self) -> Device;

    /// What plans for this device must assume: the scratch its kernels need, its memory
    /// layout, its fusions.
    fn target(&self) -> Target;

    /// The device's allocator: every byte the session holds comes from it.
    fn allocator(&self) -> &Allocator;

    /// Refuses a graph with an op or a dtype the device does not run, before anything is
    /// allocated.
    fn check(&self, graph: &Graph) -> Result<(), RuntimeError>;

    /// Binds one node to its tensors' bytes.
    fn bind(
        &self,
        graph: &Graph,
        node: &Node,
        args: NodeArgs<'_>,
    ) -> Result<Self::Bound, RuntimeError>;

    /// Runs `nodes` in order, skipping those `selected` leaves out; with `times`, waits for
    /// each node and pushes its seconds (one entry per node run).
    fn launch(
        &self,
        nodes: &[Self::Bound],
        selected: Option<&[bool]>,
        ctx: ExecCtx,
        times: Option<&mut Vec<f64>>,
    ) -> Result<(), RuntimeError>;

    /// Waits until every launched node has finished.
    fn synchronize(&self) -> Result<(), RuntimeError>;

    /// Copies host bytes into device memory.
    fn upload(&self, dst: Slice<'_>, bytes: &[u8]) -> Result<(), RuntimeError>;

    /// Whether [`Backend::upload_input`] queues its copy behind what was launched, so a
    /// step's inputs may be written while the step before still runs (no synchronize first).
    fn stages_inputs(&self) -> bool {
        false
    }

    /// Writes one of a step's inputs for the next launch. A backend that stages inputs takes
    /// the bytes now and copies them to `dst` at the start of the next launch (the copy is
    /// ordered after every node launched before, so they still read the previous input).
    fn upload_input(&self, dst: Slice<'_>, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.upload(dst, bytes)
    }

    /// Drops the inputs staged for the next launch and not yet copied (a backend that stages
    /// inputs): their destination no longer holds the step's inputs.
    fn discard_staged_inputs(&self) {}

    /// Copies device memory into host bytes (`out.len() == src.len`).
    fn download(&self, src: Slice<'_>, out: &mut [u8]) -> Result<(), RuntimeError>;
}
