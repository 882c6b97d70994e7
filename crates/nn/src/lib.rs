//! snug's models. Building a model emits graph nodes over tensor metadata only, so any preset —
//! up to GPT-2 XL — can be planned without allocating its weights.
//!
//! - [`gpt`]: GPT-2 / nanoGPT configuration, presets, the forward graph, initialisation.

pub mod gpt;
pub mod llama;
pub mod model;

pub use gpt::{GptConfig, ModelGraph, NnError, PRESETS};
pub use llama::{LlamaConfig, LLAMA_PRESETS};
pub use model::ModelConfig;
