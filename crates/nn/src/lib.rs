//! snug's models. Building a model emits graph nodes over tensor metadata only, so any preset —
//! up to GPT-2 XL — can be planned without allocating its weights.
//!
//! - [`gpt`]: GPT-2 / nanoGPT configuration, presets, the forward graph, initialisation.

pub mod gpt;

pub use gpt::{GptConfig, GptGraph, NnError, PRESETS};
