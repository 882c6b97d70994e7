//! Reading a Hugging Face `config.json` (GPT-2 and Llama families) into a snug model config.

use std::path::Path;

use serde_json::Value;

use crate::{GptConfig, LlamaConfig, NnError};

/// A model snug knows how to build.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Gpt(GptConfig),
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// Reads `config.json`; an unsupported `model_type` or a missing or malformed field is an
    /// error naming the file and the field.
    pub fn from_hf_file(path: &Path) -> Result<ModelConfig, NnError> {
        let text = std::fs::read_to_string(path).map_err(|e| NnError::HfConfig {
            path: path.display().to_string(),
            field: "-".into(),
            detail: e.to_string(),
        })?;
        Self::from_hf_json(&text).map_err(|(field, detail)| NnError::HfConfig {
            path: path.display().to_string(),
            field,
            detail,
        })
    }

    /// Parses the text of a `config.json`; errors are (field, detail).
    pub fn from_hf_json(text: &str) -> Result<ModelConfig, (String, String)> {
        let v: Value = serde_json::from_str(text).map_err(|e| ("-".to_string(), format!("not JSON: {e}")))?;
        let obj = v.as_object().ok_or(("-".to_string(), "not a JSON object".to_string()))?;
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or(("model_type".to_string(), "missing (expected \"gpt2\" or \"llama\")".to_string()))?;
        let int = |key: &str| -> Result<usize, (String, String)> {
            let x = obj.get(key).ok_or((key.to_string(), "missing".to_string()))?;
            x.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or((key.to_string(), format!("expected a non-negative integer, found {x}")))
        };
        let int_or = |key: &str, default: usize| if obj.contains_key(key) { int(key) } else { Ok(default) };
        let float_or = |key: &str, default: f32| -> Result<f32, (String, String)> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_f64().map(|f| f as f32).ok_or((key.to_string(), format!("expected a number, found {x}"))),
            }
        };
        let cfg = match model_type {
            "gpt2" => ModelConfig::Gpt(GptConfig {
                n_layer: int("n_layer")?,
                n_head: int("n_head")?,
                n_embd: int("n_embd")?,
                block_size: int_or("n_positions", int_or("n_ctx", 1024)?)?,
                vocab_size: int("vocab_size")?,
            }),
            "llama" => {
                let n_head = int("num_attention_heads")?;
                if let Some(true) = obj.get("tie_word_embeddings").and_then(Value::as_bool) {
                    return Err(("tie_word_embeddings".into(), "tied Llama heads are not supported yet".into()));
                }
                ModelConfig::Llama(LlamaConfig {
                    n_layer: int("num_hidden_layers")?,
                    n_head,
                    n_kv_head: int_or("num_key_value_heads", n_head)?,
                    hidden: int("hidden_size")?,
                    intermediate: int("intermediate_size")?,
                    vocab_size: int("vocab_size")?,
                    max_seq: int_or("max_position_embeddings", 4096)?,
                    rms_eps: float_or("rms_norm_eps", 1e-5)?,
                    rope_theta: float_or("rope_theta", 10000.0)?,
                })
            }
            other => {
                return Err((
                    "model_type".into(),
                    format!("`{other}` is not supported (supported: gpt2, llama)"),
                ))
            }
        };
        cfg.validate().map_err(|e| match e {
            NnError::Config { field, detail } => (field.to_string(), detail),
            other => ("-".to_string(), other.to_string()),
        })?;
        Ok(cfg)
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let field = |text: &str| ModelConfig::from_hf_json(text).unwrap_err().0;
        assert_eq!(field(r#"{"model_type": "bert"}"#), "model_type");
        assert_eq!(field(r#"{"n_layer": 2}"#), "model_type");
        assert_eq!(field(r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "vocab_size": 10}"#), "n_embd");
        assert_eq!(field(r#"{"model_type": "gpt2", "n_layer": -2, "n_head": 2, "n_embd": 8, "vocab_size": 10}"#), "n_layer");
        assert_eq!(field(r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 3, "n_embd": 8, "vocab_size": 10}"#), "n_head");
        assert_eq!(field("not json"), "-");
        let llama = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 10}"#;
        assert_eq!(field(llama), "num_key_value_heads");
    }
}
