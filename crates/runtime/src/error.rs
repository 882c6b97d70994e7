use snug_graph::{DType, GraphError};
use snug_plan::PlanError;

use crate::OutOfMemory;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(
        "the CPU backend's kernels compute in f32; tensor `{name}` is {dtype} and read or \
         written by an op other than a cast or a view (use the mixed-precision pass)"
    )]
    UnsupportedDType { name: String, dtype: DType },
    #[error("tensor `{name}` holds {expected} elements, got {got}")]
    SizeMismatch {
        name: String,
        expected: usize,
        got: usize,
    },
    #[error("tensor `{name}` is {found}, not {expected}")]
    WrongDType {
        name: String,
        expected: DType,
        found: DType,
    },
    #[error("tensor `{name}` is not readable after the step (only persistent tensors and graph outputs are)")]
    NotReadable { name: String },
    #[error("tensor `{name}` lived in the step's arena, which was released after the step: read it before releasing")]
    Released { name: String },
    #[error("tensor `{name}` is not an input or persistent tensor and cannot be written")]
    NotWritable { name: String },
    #[error("value {value} at position {index} of `{name}` is outside 0..{bound}")]
    OutOfRange {
        name: String,
        index: usize,
        value: i32,
        bound: usize,
    },
    #[error("could not start {threads} worker threads: {reason}")]
    Threads { threads: usize, reason: String },
    /// The device has no kernel for an op of the graph (or not for its shapes): refused
    /// before anything is allocated.
    #[error("{device} cannot run `{op}`: {detail}")]
    UnsupportedOp {
        device: String,
        op: &'static str,
        detail: String,
    },
    /// The device failed: lost (driver reset, removal), or an error its driver reported.
    #[error("{device}: {detail}")]
    Device {
        device: String,
        lost: bool,
        detail: String,
    },
}
