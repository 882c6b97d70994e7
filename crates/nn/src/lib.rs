//! snug's models. Building a model emits graph nodes over tensor metadata only, so any preset —
//! up to GPT-2 XL — can be planned without allocating its weights.
//!
//! - [`gpt`]: GPT-2 / nanoGPT configuration, presets, the forward graph, initialisation.
//! - [`llama`]: the Llama family (Llama, Mistral, Qwen2): configuration, presets, the graph.
//! - [`model`]: either family, by preset or from a Hugging Face `config.json`.
//! - [`hf_config`]: Hugging Face `config.json` read (honouring or refusing every field that
//!   changes the function) and written.
//! - [`hf_checkpoint`]: Hugging Face model directories (one file or shards) in and out.
//! - [`hf_weights`]: GPT-2 weights to and from a single safetensors file, and `config.json`.
//! - [`lora`]: LoRA adapters: the layers a pattern names, PEFT's format in and out, merging.
//! - [`safetensors_file`]: safetensors parsing whose errors name the tensor at fault.

pub mod gpt;
pub mod hf_checkpoint;
pub mod hf_config;
pub mod hf_weights;
pub mod llama;
pub mod lora;
pub mod model;
pub mod safetensors_file;

pub use gpt::{GptConfig, InferenceGraph, KvGraph, LossMask, ModelGraph, NnError, PRESETS};
pub use hf_checkpoint::{
    config_missing_beside_weights, is_hf_dir, save_hf_model, save_hf_model_from, HfCheckpoint,
    HfExport,
};
pub use hf_config::HfConfigError;
pub use hf_weights::{
    check_gpt2_safetensors, hf_config_json, load_gpt2_safetensors, remove_stale_temporaries,
    save_gpt2_safetensors, temporary_beside, write_hf_config_json,
};
pub use llama::{LlamaArch, LlamaConfig, RopeScaling, LLAMA_PRESETS};
pub use lora::{LoraConfig, LoraTargets};
pub use model::ModelConfig;
