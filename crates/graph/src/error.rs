use crate::{DType, TensorId};

/// Everything that can go wrong while building or differentiating a graph.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum GraphError {
    #[error("{op}: expected {expected} inputs, got {got}")]
    Arity {
        op: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: input {index} has dtype {found}, expected {expected}")]
    DType {
        op: &'static str,
        index: usize,
        expected: DType,
        found: DType,
    },
    #[error("tensor `{name}` with shape {shape:?} overflows a 64-bit byte count")]
    Overflow { name: String, shape: Vec<usize> },
    #[error("tensor `{name}` has a zero-sized dimension in shape {shape:?}")]
    ZeroSized { name: String, shape: Vec<usize> },
    #[error("unknown tensor id {0:?}")]
    UnknownTensor(TensorId),
    #[error("gradient requested for `{0}`, which is not a scalar")]
    NonScalarLoss(String),
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
}

pub type Result<T> = std::result::Result<T, GraphError>;
