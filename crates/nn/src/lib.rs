//! snug's models. Building a model emits graph nodes over tensor metadata only, so any preset —
//! up to GPT-2 XL — can be planned without allocating its weights.
//!
//! - [`gpt`]: GPT-2 / nanoGPT configuration, presets, the forward graph, initialisation.
//! - [`hf_weights`]: GPT-2 weights to and from Hugging Face safetensors, and `config.json`.
//! - [`safetensors_file`]: safetensors parsing whose errors name the tensor at fault.

pub mod gpt;
pub mod hf_weights;
pub mod llama;
pub mod model;
pub mod safetensors_file;

pub use gpt::{GptConfig, InferenceGraph, LossMask, ModelGraph, NnError, PRESETS};
pub use hf_weights::{
    hf_config_json, load_gpt2_safetensors, save_gpt2_safetensors, write_hf_config_json,
};
pub use llama::{LlamaConfig, LLAMA_PRESETS};
pub use model::ModelConfig;
