//! snug's graph: tensor metadata, the op IR and its builder, autodiff as a graph transformation,
//! and the training step graph (forward + backward + optimizer update).
//!
//! - [`tensor`]: shapes, dtypes and roles — all the planner needs to know about a tensor.
//! - [`graph`]: nodes in topological order, and the builder API ([`Graph::apply`]).
//! - [`ops`]: each op's shape rule, gradient rule, scratch and cost, one file per op family
//!   (kernels live in the backends, in files named as these).
//! - [`autodiff`]: [`backward`] appends the gradient nodes of a scalar loss.
//! - [`passes`]: graph → graph rewrites that save memory.
//! - [`step`]: [`StepGraph`] bundles a model's forward, backward and AdamW updates.
//! - [`target`]: the device a graph is planned for, as plain data ([`Target`]).
//! - [`zero`]: data parallelism and ZeRO sharding as graph rewrites, and the bytes a rank
//!   sends per step.

pub mod autodiff;
mod dtype;
mod error;
pub mod graph;
pub mod ops;
pub mod passes;
pub mod step;
pub mod target;
pub mod tensor;
pub mod zero;

pub use autodiff::{backward, backward_seeded, GradCtx};
pub use dtype::DType;
pub use error::{GraphError, Result};
pub use graph::{Graph, Node, NodeId};
pub use step::{
    ClipMode, FrozenParam, OptimizerSpec, ParamSlot, StepGraph, StepOptions, PREVIOUS_SUM_SQUARES,
};
pub use target::{CpuGemm, DeviceKind, Fusions, MemoryLayout, Target, MAX_THREADS};
pub use tensor::{Role, TensorId, TensorMeta};
pub use zero::{CommVolume, Sharding};
