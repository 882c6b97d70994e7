//! Any model snug builds (GPT-2 or Llama family), by preset name or from a Hugging Face
//! `config.json`.

use std::path::Path;

use crate::hf_config::HfConfigError;
use crate::{GptConfig, LlamaConfig, NnError};

/// The most a `config.json` may hold: real ones are a few kilobytes.
const MAX_HF_CONFIG_BYTES: u64 = 16 << 20;

/// The text of the regular file `path`, at most [`MAX_HF_CONFIG_BYTES`]. The type is checked
/// before opening: opening a FIFO waits for a writer, and `/dev/zero` never ends.
fn read_config_text(path: &Path) -> Result<String, String> {
    use std::io::Read;
    regular_file_len(path)?;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_HF_CONFIG_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_HF_CONFIG_BYTES {
        return Err(format!(
            "larger than {MAX_HF_CONFIG_BYTES} bytes, too large for a model configuration"
        ));
    }
    Ok(text)
}

/// The size of `path` if it is a regular file (after symbolic links), else why not. Checked on
/// the path, before opening: opening a FIFO for reading waits for a writer, and a device such
/// as `/dev/zero` never ends. (snug-train's `user_file::check_regular` is the same check for
/// the files it reads; this crate cannot depend on it.)
pub(crate) fn regular_file_len(path: &Path) -> Result<u64, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err(format!("is {}, not a regular file", kind(meta.file_type())));
    }
    Ok(meta.len())
}

/// What a file that is not a regular file is, in words.
fn kind(t: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// A model snug knows how to build.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum ModelConfig {
    Gpt(GptConfig),
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json`, or the one in the model directory `path`. A field
    /// whose value snug cannot honour, an unknown architecture, or a missing or malformed field
    /// is an error naming the file, the field and the value.
    pub fn from_hf_file(path: &Path) -> Result<ModelConfig, NnError> {
        let file = Self::hf_config_file(path);
        let error = |error| NnError::HfConfig {
            path: file.display().to_string(),
            error,
        };
        let text = read_config_text(&file)
            .map_err(|detail| error(HfConfigError::Unreadable { detail }))?;
        Self::from_hf_json(&text).map_err(error)
    }

    /// The `config.json` that `path` names: the file itself, or the one in the model
    /// directory `path`.
    pub fn hf_config_file(path: &Path) -> std::path::PathBuf {
        if path.is_dir() {
            path.join(crate::hf_checkpoint::CONFIG_FILE)
        } else {
            path.to_path_buf()
        }
    }

    /// Parses the text of a `config.json` (see [`crate::hf_config`]).
    pub fn from_hf_json(text: &str) -> Result<ModelConfig, HfConfigError> {
        crate::hf_config::parse(text)
    }

    /// The text of a Hugging Face `config.json` describing this model.
    pub fn to_hf_json(&self) -> String {
        crate::hf_config::to_json(self)
    }

    pub fn validate(&self) -> Result<(), NnError> {
        match self {
            ModelConfig::Gpt(c) => c.validate(),
            ModelConfig::Llama(c) => c.validate(),
        }
    }

    pub fn parameter_count(&self) -> usize {
        match self {
            ModelConfig::Gpt(c) => c.parameter_count(),
            ModelConfig::Llama(c) => c.parameter_count(),
        }
    }

    /// Every parameter's Hugging Face name and snug shape, in graph order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            ModelConfig::Gpt(c) => c.parameter_shapes(),
            ModelConfig::Llama(c) => c.parameter_shapes(),
        }
    }

    /// A GPT or Llama preset by name.
    pub fn preset(name: &str) -> Result<ModelConfig, NnError> {
        if let Some(c) = LlamaConfig::preset(name) {
            return Ok(ModelConfig::Llama(c));
        }
        GptConfig::preset(name)
            .map(ModelConfig::Gpt)
            .map_err(|_| NnError::UnknownPreset {
                name: name.to_string(),
                known: crate::gpt::PRESETS
                    .iter()
                    .map(|(n, _)| *n)
                    .chain(crate::llama::LLAMA_PRESETS.iter().map(|(n, _)| *n))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// `12 layers, 12 heads, 768 wide, vocab 50257` (and key/value heads for Llama).
    pub fn summary(&self) -> String {
        match self {
            ModelConfig::Gpt(c) => format!(
                "GPT, {} layers, {} heads, {} wide, vocab {}",
                c.n_layer, c.n_head, c.n_embd, c.vocab_size
            ),
            ModelConfig::Llama(c) => format!(
                "{}, {} layers, {} heads ({} key/value), {} wide, MLP {}, vocab {}",
                match c.arch {
                    crate::LlamaArch::Llama => "Llama",
                    crate::LlamaArch::Mistral => "Mistral",
                    crate::LlamaArch::Qwen2 => "Qwen2",
                },
                c.n_layer,
                c.n_head,
                c.n_kv_head,
                c.hidden,
                c.intermediate,
                c.vocab_size
            ),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }

    pub fn set_vocab_size(&mut self, vocab: usize) {
        match self {
            ModelConfig::Gpt(c) => c.vocab_size = vocab,
            ModelConfig::Llama(c) => c.vocab_size = vocab,
        }
    }

    /// Longest sequence the model takes.
    pub fn max_seq(&self) -> usize {
        match self {
            ModelConfig::Gpt(c) => c.block_size,
            ModelConfig::Llama(c) => c.max_seq,
        }
    }

    /// Applies `[model]` overrides: layers, heads, width, context.
    pub fn override_shape(
        &mut self,
        n_layer: Option<usize>,
        n_head: Option<usize>,
        width: Option<usize>,
        max_seq: Option<usize>,
    ) {
        match self {
            ModelConfig::Gpt(c) => {
                c.n_layer = n_layer.unwrap_or(c.n_layer);
                c.n_head = n_head.unwrap_or(c.n_head);
                c.n_embd = width.unwrap_or(c.n_embd);
                c.block_size = max_seq.unwrap_or(c.block_size);
            }
            ModelConfig::Llama(c) => {
                c.n_layer = n_layer.unwrap_or(c.n_layer);
                if let Some(h) = n_head {
                    // Keep the grouping ratio when the head count changes.
                    let group = (c.n_head / c.n_kv_head.max(1)).max(1);
                    c.n_head = h;
                    c.n_kv_head = (h / group).max(1);
                }
                c.hidden = width.unwrap_or(c.hidden);
                c.max_seq = max_seq.unwrap_or(c.max_seq);
            }
        }
    }

    /// Model FLOPs per token of a training step: `6N` for the weights plus `12·L·C·T` for
    /// attention (nanoGPT's and PaLM's count).
    pub fn flops_per_token(&self, seq: usize) -> u64 {
        let (layers, width) = match self {
            ModelConfig::Gpt(c) => (c.n_layer, c.n_embd),
            ModelConfig::Llama(c) => (c.n_layer, c.hidden),
        };
        // Saturating: a count past u64 is meaningless, not worth a panic.
        let attention = [layers, width, seq]
            .iter()
            .fold(12u64, |n, &x| n.saturating_mul(x as u64));
        (self.parameter_count() as u64)
            .saturating_mul(6)
            .saturating_add(attention)
    }

    pub fn build(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: snug_graph::DType,
    ) -> Result<crate::ModelGraph, NnError> {
        self.build_loss(batch, seq, target, dtype, false)
    }

    /// [`ModelConfig::build`], with the loss mask's inputs ([`crate::LossMask`]) when `masked`:
    /// the graph a trainer builds for data whose targets do not all count.
    pub fn build_loss(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: snug_graph::DType,
        masked: bool,
    ) -> Result<crate::ModelGraph, NnError> {
        self.build_loss_lora(batch, seq, target, dtype, masked, None)
    }

    /// [`ModelConfig::build_loss`] with LoRA adapters beside the layers `lora` names
    /// ([`crate::ModelGraph::lora`]); the caller freezes the rest.
    pub fn build_loss_lora(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: snug_graph::DType,
        masked: bool,
        lora: Option<&crate::LoraConfig>,
    ) -> Result<crate::ModelGraph, NnError> {
        let lora = lora.map(|l| (l, self));
        match self {
            ModelConfig::Gpt(c) => c.build_loss_lora(batch, seq, target, dtype, masked, lora),
            ModelConfig::Llama(c) => c.build_loss_lora(batch, seq, target, dtype, masked, lora),
        }
    }

    /// The forward-only graph for `batch` sequences of `seq` tokens (f32), ending in the
    /// logits instead of the loss: the same trunk as [`ModelConfig::build`], with no targets.
    pub fn build_inference(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
    ) -> Result<crate::InferenceGraph, NnError> {
        self.validate()?;
        let dtype = snug_graph::DType::F32;
        match self {
            ModelConfig::Gpt(c) => {
                crate::gpt::check_batch_seq(batch, seq, c.block_size, "block_size")?;
                crate::gpt::logits_graph(batch, seq, target.into(), |g, t| {
                    c.trunk(g, t, dtype, None)
                })
            }
            ModelConfig::Llama(c) => {
                crate::gpt::check_batch_seq(batch, seq, c.max_seq, "max_position_embeddings")?;
                crate::gpt::logits_graph(batch, seq, target.into(), |g, t| {
                    c.trunk(g, t, dtype, None)
                })
            }
        }
    }

    /// The graph for sampling with a key/value cache that feeds `new_tokens` tokens at once
    /// (f32, batch 1; the caches hold the model's whole window): a prefill with the prompt's
    /// length, or a decode step with 1. See [`crate::KvGraph`].
    pub fn build_kv(
        &self,
        new_tokens: usize,
        target: impl Into<snug_graph::Target>,
    ) -> Result<crate::KvGraph, NnError> {
        self.build_kv_window(new_tokens, self.max_seq(), target)
    }

    /// [`Self::build_kv`] with caches of `window` positions (1 to the model's `max_seq`): a
    /// request that needs less context than the model takes holds only that much.
    pub fn build_kv_window(
        &self,
        new_tokens: usize,
        window: usize,
        target: impl Into<snug_graph::Target>,
    ) -> Result<crate::KvGraph, NnError> {
        self.validate()?;
        let dtype = snug_graph::DType::F32;
        let (max_name, max_seq) = match self {
            ModelConfig::Gpt(c) => ("block_size", c.block_size),
            ModelConfig::Llama(c) => ("max_position_embeddings", c.max_seq),
        };
        if window == 0 || window > max_seq {
            return Err(NnError::Config {
                field: "context",
                detail: format!("{window} must be between 1 and the model's {max_name} {max_seq}"),
            });
        }
        let target = target.into();
        match self {
            ModelConfig::Gpt(c) => {
                crate::gpt::check_batch_seq(1, new_tokens, window, "block_size")?;
                crate::gpt::kv_logits_graph(new_tokens, window, true, target, |g, t, kv| {
                    c.trunk(g, t, dtype, Some(kv))
                })
            }
            ModelConfig::Llama(c) => {
                crate::gpt::check_batch_seq(1, new_tokens, window, "max_position_embeddings")?;
                crate::gpt::kv_logits_graph(new_tokens, window, false, target, |g, t, kv| {
                    c.trunk(g, t, dtype, Some(kv))
                })
            }
        }
    }

    /// Initial parameter values by name, in the order of the built graph's parameters.
    pub fn init_parameters(&self, seed: u64) -> Vec<(String, Vec<f32>)> {
        self.init_parameters_iter(seed).collect()
    }

    /// The initial parameters one tensor at a time, in [`Self::init_parameters`]' order.
    pub fn init_parameters_iter(
        &self,
        seed: u64,
    ) -> Box<dyn Iterator<Item = (String, Vec<f32>)> + '_> {
        match self {
            ModelConfig::Gpt(c) => Box::new(c.init_parameters_iter(seed)),
            ModelConfig::Llama(c) => Box::new(c.init_parameters_iter(seed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every preset's parameter count, computed from the shapes' formulas, is the sum over
    /// its table of parameter shapes.
    #[test]
    fn parameter_count_is_the_shape_table_sum() {
        let gpt = crate::gpt::PRESETS
            .iter()
            .map(|(n, c)| (*n, ModelConfig::Gpt(c.clone())));
        let llama = crate::llama::LLAMA_PRESETS
            .iter()
            .map(|(n, c)| (*n, ModelConfig::Llama(c.clone())));
        for (name, cfg) in gpt.chain(llama) {
            let shapes = match &cfg {
                ModelConfig::Gpt(c) => c.parameter_shapes(),
                ModelConfig::Llama(c) => c.parameter_shapes(),
            };
            let sum: usize = shapes
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            assert_eq!(cfg.parameter_count(), sum, "{name}");
        }
    }

    #[test]
    fn reads_gpt2_and_llama_configs() {
        let gpt2 = r#"{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12, "n_head": 12,
            "n_embd": 768, "n_positions": 1024, "n_ctx": 1024, "vocab_size": 50257, "layer_norm_epsilon": 1e-05}"#;
        assert_eq!(
            ModelConfig::from_hf_json(gpt2).unwrap(),
            ModelConfig::Gpt(GptConfig::preset("gpt2").unwrap())
        );
        let llama = r#"{"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false}"#;
        assert_eq!(
            ModelConfig::from_hf_json(llama).unwrap(),
            ModelConfig::Llama(LlamaConfig::preset("llama-70b").unwrap())
        );
    }

    #[test]
    fn bad_configs_name_the_field() {
        let field = |text: &str| {
            ModelConfig::from_hf_json(text)
                .unwrap_err()
                .field()
                .to_string()
        };
        assert_eq!(field(r#"{"model_type": "bert"}"#), "model_type");
        assert_eq!(field(r#"{"n_layer": 2}"#), "model_type");
        assert_eq!(
            field(r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "vocab_size": 10}"#),
            "n_embd"
        );
        assert_eq!(
            field(
                r#"{"model_type": "gpt2", "n_layer": -2, "n_head": 2, "n_embd": 8, "vocab_size": 10}"#
            ),
            "n_layer"
        );
        assert_eq!(
            field(
                r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 3, "n_embd": 8, "vocab_size": 10}"#
            ),
            "n_head"
        );
        assert_eq!(field("not json"), "-");
        let llama = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 10}"#;
        assert_eq!(field(llama), "num_key_value_heads");
    }

    /// Floats that make no sense (zero, negative, beyond f32) and sizes past the planning
    /// bounds name the field and the value.
    #[test]
    fn nonsense_values_name_the_field_and_value() {
        let llama = |extra: &str| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10{extra}}}"#
            )
        };
        assert!(ModelConfig::from_hf_json(&llama("")).is_ok());
        let err = |text: &str| ModelConfig::from_hf_json(text).unwrap_err();
        for (extra, field, value) in [
            (r#", "rms_norm_eps": -1e-5"#, "rms_norm_eps", "-0.00001"),
            (r#", "rms_norm_eps": 0"#, "rms_norm_eps", "got 0"),
            (r#", "rms_norm_eps": 1e-60"#, "rms_norm_eps", "1e-60"),
            (r#", "rope_theta": -10000.0"#, "rope_theta", "-10000"),
            (r#", "rope_theta": 1e300"#, "rope_theta", "1e+300"),
            (
                r#", "num_hidden_layers": 100000"#,
                "num_hidden_layers",
                "100000 layers",
            ),
        ] {
            // A later duplicate key wins in serde_json, so `extra` overrides the base.
            let e = err(&llama(extra));
            let (f, detail) = (e.field(), e.to_string());
            assert_eq!(f, field, "{extra}: {detail}");
            assert!(detail.contains(value), "{extra}: {detail}");
        }
        let gpt2 = |eps: &str| {
            format!(
                r#"{{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8, "vocab_size": 10, "layer_norm_epsilon": {eps}}}"#
            )
        };
        assert!(ModelConfig::from_hf_json(&gpt2("1e-5")).is_ok());
        assert!(ModelConfig::from_hf_json(&gpt2("null")).is_ok());
        for eps in ["-1e-5", "0", "\"small\""] {
            assert_eq!(err(&gpt2(eps)).field(), "layer_norm_epsilon", "{eps}");
        }
    }
}
