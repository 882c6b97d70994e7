use serde::{Deserialize, Serialize};

use crate::{DType, GraphError, Result};

/// Index of a tensor in its [`Graph`](crate::Graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorId(pub u32);

impl TensorId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a tensor is for. The planner's breakdown and the runtime's placement follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Trainable weights: persistent across steps.
    Parameter,
    /// Gradients with respect to parameters.
    Gradient,
    /// Optimizer moments: persistent across steps.
    OptimizerState,
    /// Gradient sums carried between the micro-batches of one step: persistent.
    GradAccumulator,
    /// Forward values (some are saved for the backward pass).
    Activation,
    /// Backward intermediates and op workspaces.
    Temporary,
    /// Data fed into the step (token ids, targets).
    Input,
    /// Keys and values an inference graph keeps between runs (sampling with a KV cache):
    /// persistent, written by the graph itself, never trained.
    KvCache,
}

impl Role {
    pub const ALL: [Role; 8] = [
        Role::Parameter,
        Role::Gradient,
        Role::OptimizerState,
        Role::GradAccumulator,
        Role::Activation,
        Role::Temporary,
        Role::Input,
        Role::KvCache,
    ];

    /// Persistent tensors live in their own buffers across steps; the rest live in the arena.
    pub fn is_persistent(self) -> bool {
        matches!(
            self,
            Role::Parameter | Role::OptimizerState | Role::GradAccumulator | Role::KvCache
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Parameter => "parameters",
            Role::Gradient => "gradients",
            Role::OptimizerState => "optimizer state",
            Role::GradAccumulator => "gradient accumulators",
            Role::Activation => "activations",
            Role::Temporary => "temporaries",
            Role::Input => "inputs",
            Role::KvCache => "key/value caches",
        }
    }
}

/// A view shares its base tensor's storage, starting `offset_elems` elements in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewOf {
    pub base: TensorId,
    pub offset_elems: usize,
}

/// Everything known about a tensor before it exists: the planner works on these alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub role: Role,
    /// Set for tensors that alias another tensor's storage (reshape, row slices).
    pub view_of: Option<ViewOf>,
}

impl TensorMeta {
    pub fn numel(&self) -> usize {
        // Checked when the tensor was added to the graph.
        self.shape.iter().product()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

/// Element count of `shape`, with an error instead of wrapping past 64-bit byte counts.
pub fn checked_numel(name: &str, shape: &[usize], dtype: DType) -> Result<usize> {
    let mut n: usize = 1;
    for &d in shape {
        if d == 0 {
            return Err(GraphError::ZeroSized {
                name: name.to_string(),
                shape: shape.to_vec(),
            });
        }
        n = n.checked_mul(d).ok_or_else(|| GraphError::Overflow {
            name: name.to_string(),
            shape: shape.to_vec(),
        })?;
    }
    n.checked_mul(dtype.size_bytes())
        .ok_or_else(|| GraphError::Overflow {
            name: name.to_string(),
            shape: shape.to_vec(),
        })?;
    Ok(n)
}
