//! snug's models. Building a model emits graph nodes over tensor metadata only, so any preset —
//! up to GPT-2 XL — can be planned without allocating its weights.
//!
//! - [`gpt`]: GPT-2 / nanoGPT configuration, presets, the forward graph, initialisation.

pub mod gpt;
pub mod hf_config;
pub mod llama;

pub use gpt::{GptConfig, GptGraph, NnError, PRESETS};
pub use hf_config::ModelConfig;
pub use llama::{LlamaConfig, LLAMA_PRESETS};
