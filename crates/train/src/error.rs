use std::path::PathBuf;

use snug_graph::GraphError;
use snug_nn::NnError;
use snug_plan::PlanError;
use snug_runtime::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: the data file is empty")]
    EmptyData { path: PathBuf },
    #[error("{what}: {tokens} tokens is too few for a training split and a validation split of at least block + 1 = {needed} tokens each")]
    DataTooSmall {
        what: String,
        tokens: usize,
        needed: usize,
    },
    #[error("{path}: {message}")]
    ConfigFile { path: PathBuf, message: String },
    #[error("config: `{field}` {detail}")]
    Config { field: &'static str, detail: String },
    #[error("the training step needs {needed} bytes (planned peak) but the memory limit is {limit} bytes: lower the batch or block size")]
    DoesNotFit { needed: usize, limit: usize },
    #[error("loss is {loss} at step {step}: training diverged (lower the learning rate)")]
    NonFinite { step: u64, loss: f32 },
    #[error(transparent)]
    Model(#[from] NnError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}
