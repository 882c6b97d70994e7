//! Fuzzing the Hugging Face formats snug reads: `model.safetensors` (byte flips, truncations,
//! random headers) and `config.json` (random values for every field, byte flips of the text).
//! Every input must give `Ok` or a typed error, never a panic; what loads must be sound.
//!
//! 64 cases per target by default, so the suite stays fast; `PROPTEST_CASES=N` runs more.

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{json, Value};
use snug_nn::{GptConfig, ModelConfig, NnError};
use snug_testkit::fuzz::{any_json, runner, safetensors_header_len};

fn tiny() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        block_size: 16,
        vocab_size: 11,
    }
}

/// A valid GPT-2 safetensors file for [`tiny`], made once.
fn valid_file() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let cfg = tiny();
        let params: Vec<(String, Vec<f32>)> = cfg
            .parameter_shapes()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n = shape.iter().product::<usize>();
                (name, (0..n).map(|j| (i * 31 + j) as f32 * 0.01).collect())
            })
            .collect();
        snug_nn::save_gpt2_safetensors(&path, &cfg, &params).unwrap();
        std::fs::read(&path).unwrap()
    })
}

/// Loads `bytes` as the weights of [`tiny`]: a typed error naming the file, or parameters
/// that are all finite and of the model's sizes.
fn check_weights(dir: &Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = dir.join("model.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let p = path.display().to_string();
    match snug_nn::load_gpt2_safetensors(&path, &tiny()) {
        Ok(params) => {
            let shapes = tiny().parameter_shapes();
            prop_assert_eq!(params.len(), shapes.len());
            for ((name, values), (want, shape)) in params.iter().zip(&shapes) {
                prop_assert_eq!(name, want);
                prop_assert_eq!(values.len(), shape.iter().product::<usize>());
                prop_assert!(values.iter().all(|v| v.is_finite()), "{}", name);
            }
        }
        Err(
            NnError::WeightsFile { path, .. }
            | NnError::MissingTensor { path, .. }
            | NnError::UnexpectedTensor { path, .. }
            | NnError::DuplicateTensor { path, .. }
            | NnError::TensorShape { path, .. }
            | NnError::TensorDType { path, .. }
            | NnError::UntiedHead { path }
            | NnError::NonFiniteWeight { path, .. },
        ) => prop_assert_eq!(path, p),
        Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
    }
    Ok(())
}

/// Byte positions weighted towards the header, where parsing happens.
fn position(len: usize, header: usize) -> impl Strategy<Value = usize> {
    prop_oneof![0..header, 0..len]
}

#[test]
fn safetensors_weights_with_flipped_bytes_or_truncated_never_panic() {
    let bytes = valid_file();
    let (len, header) = (bytes.len(), safetensors_header_len(bytes));
    let dir = tempfile::tempdir().unwrap();
    let flips = prop::collection::vec((position(len, header), 1u8..=255), 1..8);
    runner()
        .run(&(flips, 0..=len + 16), |(flips, cut)| {
            let mut b = bytes.to_vec();
            for (i, x) in flips {
                b[i] ^= x;
            }
            check_weights(dir.path(), &b)?;
            // Truncated, or with trailing bytes.
            let mut t = bytes.to_vec();
            t.resize(cut, 0);
            check_weights(dir.path(), &t)
        })
        .unwrap();
}

/// Every header entry of the valid file, with random JSON in place of some fields.
#[test]
fn safetensors_headers_with_random_fields_never_panic() {
    let bytes = valid_file();
    let n = safetensors_header_len(bytes);
    let header: Value = serde_json::from_slice(&bytes[8..n]).unwrap();
    let names: Vec<String> = header.as_object().unwrap().keys().cloned().collect();
    let dir = tempfile::tempdir().unwrap();
    let edits = prop::collection::vec(
        (
            prop::sample::select(names),
            prop::sample::select(vec!["dtype", "shape", "data_offsets", "format", ""]),
            any_json(),
        ),
        1..4,
    );
    runner()
        .run(&(edits, 0usize..64), |(edits, extra_data)| {
            let mut h = header.clone();
            for (name, field, value) in edits {
                if field.is_empty() {
                    h[&name] = value;
                } else if let Some(obj) = h[&name].as_object_mut() {
                    obj.insert(field.to_string(), value);
                }
            }
            let text = h.to_string();
            let mut b = (text.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(text.as_bytes());
            b.extend_from_slice(&bytes[n..]);
            b.extend(std::iter::repeat_n(0u8, extra_data));
            // The parser alone, then the whole load.
            let _ = snug_nn::safetensors_file::deserialize(&b);
            check_weights(dir.path(), &b)
        })
        .unwrap();
}

/// `from_hf_json` on `text`: an error naming a field, or a configuration that validates,
/// counts its parameters, and builds a training graph without panicking.
fn check_config(text: &str) -> Result<(), TestCaseError> {
    match ModelConfig::from_hf_json(text) {
        Ok(cfg) => {
            prop_assert!(cfg.validate().is_ok());
            let _ = cfg.parameter_count();
            let _ = cfg.flops_per_token(cfg.max_seq());
            // Small enough to build quickly, large enough to reach every op.
            if cfg.parameter_count() < 50_000_000 {
                let _ = cfg.build(1, cfg.max_seq().min(4), 1, snug_graph::DType::F32);
            }
        }
        Err(e) => {
            prop_assert!(!e.field().is_empty() && !e.to_string().is_empty());
        }
    }
    Ok(())
}

fn base_config(model_type: &str) -> Value {
    match model_type {
        "gpt2" => json!({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8,
            "n_positions": 16, "vocab_size": 11, "layer_norm_epsilon": 1e-5}),
        "mistral" | "qwen2" => {
            let mut v = base_config("llama");
            v["model_type"] = json!(model_type);
            v
        }
        _ => json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 65, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false}),
    }
}

const FIELDS: &[&str] = &[
    "model_type",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
    "n_ctx",
    "vocab_size",
    "layer_norm_epsilon",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "rope_scaling",
    "rope_parameters",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "head_dim",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "activation_function",
    "n_inner",
    "scale_attn_weights",
    "architectures",
    "torch_dtype",
];

#[test]
fn config_json_with_random_field_values_never_panics() {
    let edits = prop::collection::vec(
        (
            prop::sample::select(FIELDS),
            prop_oneof![
                any_json(),
                // Plausible sizes, so that many configurations validate and get built.
                prop::sample::select(vec![1u64, 2, 3, 4, 8, 16, 64, 128, 1 << 20, 1 << 40])
                    .prop_map(Value::from),
            ],
            any::<bool>(),
        ),
        0..5,
    );
    let model_type = prop::sample::select(vec!["gpt2", "llama", "mistral", "qwen2"]);
    runner()
        .run(&(model_type, edits), |(model_type, edits)| {
            let mut cfg = base_config(model_type);
            let obj = cfg.as_object_mut().unwrap();
            for (field, value, remove) in edits {
                if remove {
                    obj.remove(field);
                } else {
                    obj.insert(field.to_string(), value);
                }
            }
            check_config(&cfg.to_string())
        })
        .unwrap();
}

#[test]
fn config_json_text_with_flipped_bytes_never_panics() {
    let texts = [
        base_config("gpt2").to_string(),
        base_config("llama").to_string(),
    ];
    let longest = texts.iter().map(String::len).max().unwrap();
    let flips = prop::collection::vec((0..longest, 1u8..=255), 1..6);
    runner()
        .run(&(0..2usize, flips, 0..=longest), |(which, flips, cut)| {
            let mut b = texts[which].as_bytes().to_vec();
            for (i, x) in flips {
                let i = i % b.len();
                b[i] ^= x;
            }
            b.truncate(cut);
            // from_hf_json takes text: what is not UTF-8 never reaches it.
            if let Ok(text) = std::str::from_utf8(&b) {
                check_config(text)?;
            }
            Ok(())
        })
        .unwrap();
}
