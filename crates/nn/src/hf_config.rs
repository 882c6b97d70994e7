//! Hugging Face `config.json` to and from [`ModelConfig`]. Every field that changes the
//! function a checkpoint computes is either honoured or refused with an error naming the field
//! and its value; fields that do not (dropout rates, token ids, `use_cache`) are ignored, as
//! transformers ignores them at inference.
//!
//! Both spellings are read: transformers 4's `rope_theta` / `rope_scaling` / `torch_dtype`
//! (what downloaded checkpoints carry) and transformers 5's `rope_parameters` / `dtype`.

use serde_json::{json, Map, Value};

use crate::llama::{LlamaArch, RopeScaling};
use crate::{GptConfig, LlamaConfig, ModelConfig, NnError};

/// What is wrong with a `config.json`, naming the field (and its value where there is one).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HfConfigError {
    /// The file could not be read (missing, not a regular file, too large).
    #[error("{detail}")]
    Unreadable { detail: String },
    /// The text is not a JSON object.
    #[error("not a JSON object: {detail}")]
    Malformed { detail: String },
    #[error("`{field}` is missing")]
    Missing { field: String },
    /// A value of the wrong type, or one no model can have (a negative size, a zero ε).
    #[error("`{field}` = {value}: {detail}")]
    Invalid {
        field: String,
        value: String,
        detail: String,
    },
    /// A value that changes the model's function in a way snug does not implement.
    #[error("`{field}` = {value} is not supported: {reason}")]
    Unsupported {
        field: String,
        value: String,
        reason: String,
    },
    /// `model_type` or `architectures` names a model snug does not build.
    #[error("`{field}` = {value} is not an architecture snug builds (it builds {supported})")]
    UnknownArchitecture {
        field: String,
        value: String,
        supported: String,
    },
}

impl HfConfigError {
    /// The field at fault (`-` when the whole text is).
    pub fn field(&self) -> &str {
        match self {
            HfConfigError::Unreadable { .. } | HfConfigError::Malformed { .. } => "-",
            HfConfigError::Missing { field }
            | HfConfigError::Invalid { field, .. }
            | HfConfigError::Unsupported { field, .. }
            | HfConfigError::UnknownArchitecture { field, .. } => field,
        }
    }
}

type Result<T> = std::result::Result<T, HfConfigError>;

/// The `model_type`s snug builds, and each one's causal-LM class.
const ARCHITECTURES: [(&str, &str); 4] = [
    ("gpt2", "GPT2LMHeadModel"),
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
];

/// The fields of one `config.json`, with typed accessors whose errors name the field.
struct Fields<'a>(&'a Map<String, Value>);

fn unsupported(field: &str, value: &Value, reason: impl Into<String>) -> HfConfigError {
    HfConfigError::Unsupported {
        field: field.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn invalid(field: &str, value: &Value, detail: impl Into<String>) -> HfConfigError {
    HfConfigError::Invalid {
        field: field.to_string(),
        value: value.to_string(),
        detail: detail.into(),
    }
}

impl Fields<'_> {
    /// The value of `key`, with JSON `null` read as absent (transformers writes `null` for
    /// "the default").
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> Result<usize> {
        let x = self.get(key).ok_or_else(|| HfConfigError::Missing {
            field: key.to_string(),
        })?;
        as_int(key, x)
    }

    fn int_or(&self, key: &str, default: usize) -> Result<usize> {
        self.get(key).map_or(Ok(default), |x| as_int(key, x))
    }

    fn float_or(&self, key: &str, default: f32) -> Result<f32> {
        self.get(key).map_or(Ok(default), |x| as_f32(key, x))
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| invalid(key, x, "expected true or false")),
        }
    }

    /// Refuses `key` unless it is absent or `ok` accepts it.
    fn refuse_unless(
        &self,
        key: &str,
        ok: impl Fn(&Value) -> bool,
        reason: impl FnOnce() -> String,
    ) -> Result<()> {
        match self.get(key) {
            Some(v) if !ok(v) => Err(unsupported(key, v, reason())),
            _ => Ok(()),
        }
    }
}

fn as_int(key: &str, x: &Value) -> Result<usize> {
    x.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| invalid(key, x, "expected a non-negative integer"))
}

fn as_f32(key: &str, x: &Value) -> Result<f32> {
    let f = x
        .as_f64()
        .ok_or_else(|| invalid(key, x, "expected a number"))?;
    // f32 is what snug computes with: 1e-50 would become 0, 1e50 infinity.
    let g = f as f32;
    if (f != 0.0 && g == 0.0) || (f.is_finite() && !g.is_finite()) {
        return Err(invalid(
            key,
            x,
            format!("{x} is beyond f32's range, which snug computes in"),
        ));
    }
    Ok(g)
}

/// Parses the text of a `config.json`.
pub fn parse(text: &str) -> Result<ModelConfig> {
    let v: Value = serde_json::from_str(text).map_err(|e| HfConfigError::Malformed {
        detail: e.to_string(),
    })?;
    let obj = v.as_object().ok_or_else(|| HfConfigError::Malformed {
        detail: "the top level is not an object".into(),
    })?;
    let f = Fields(obj);
    let supported = || {
        ARCHITECTURES
            .iter()
            .map(|(t, _)| *t)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let model_type = match f.get("model_type") {
        None => {
            return Err(HfConfigError::Missing {
                field: "model_type".into(),
            })
        }
        Some(x) => x
            .as_str()
            .ok_or_else(|| invalid("model_type", x, "expected a string"))?,
    };
    let Some(&(_, class)) = ARCHITECTURES.iter().find(|(t, _)| *t == model_type) else {
        return Err(HfConfigError::UnknownArchitecture {
            field: "model_type".into(),
            value: json!(model_type).to_string(),
            supported: supported(),
        });
    };
    if let Some(list) = f.get("architectures") {
        let names = list
            .as_array()
            .ok_or_else(|| invalid("architectures", list, "expected a list of class names"))?;
        // A sequence classifier or a headless model has other weights and another output.
        if let Some(other) = names.iter().find(|n| n.as_str() != Some(class)) {
            return Err(HfConfigError::UnknownArchitecture {
                field: "architectures".into(),
                value: other.to_string(),
                supported: format!("{class} for model_type {model_type:?}"),
            });
        }
    }
    for key in ["torch_dtype", "dtype"] {
        // The storage precision: snug reads each of these into f32.
        f.refuse_unless(
            key,
            |v| {
                matches!(
                    v.as_str(),
                    Some("float32" | "float16" | "bfloat16" | "auto")
                )
            },
            || "snug loads float32, float16 and bfloat16 weights".into(),
        )?;
    }
    f.refuse_unless(
        "quantization_config",
        |_| false,
        || "quantized checkpoints are not loaded (snug quantizes with its own passes)".into(),
    )?;
    let cfg = match model_type {
        "gpt2" => ModelConfig::Gpt(gpt2(&f)?),
        _ => ModelConfig::Llama(llama(&f, model_type)?),
    };
    cfg.validate().map_err(|e| match e {
        NnError::Config { field, detail } => {
            // Named as the file names it: GPT-2's context is `n_positions` (or `n_ctx`).
            let key = match (model_type, field) {
                ("gpt2", "block_size") if f.get("n_positions").is_none() => "n_ctx",
                ("gpt2", "block_size") => "n_positions",
                _ => field,
            };
            HfConfigError::Invalid {
                field: key.to_string(),
                value: f.get(key).map_or("-".into(), Value::to_string),
                detail,
            }
        }
        other => HfConfigError::Invalid {
            field: "-".into(),
            value: "-".into(),
            detail: other.to_string(),
        },
    })?;
    Ok(cfg)
}

/// An ε that is zero, negative or NaN makes every loss NaN steps later.
fn positive(key: &str, v: f32) -> Result<f32> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(
            key,
            &json!(v),
            format!("must be a positive finite number, got {v}"),
        ))
    }
}

fn gpt2(f: &Fields) -> Result<GptConfig> {
    let n_embd = f.int("n_embd")?;
    let eps = positive(
        "layer_norm_epsilon",
        f.float_or("layer_norm_epsilon", 1e-5)?,
    )?;
    if let (true, Some(v)) = (eps != 1e-5, f.get("layer_norm_epsilon")) {
        return Err(unsupported(
            "layer_norm_epsilon",
            v,
            "snug's GPT-2 LayerNorm uses ε = 1e-5",
        ));
    }
    f.refuse_unless(
        "activation_function",
        |v| matches!(v.as_str(), Some("gelu_new" | "gelu_pytorch_tanh")),
        || "snug's GPT-2 MLP uses the tanh GELU (gelu_new)".into(),
    )?;
    let inner = (n_embd as u64).saturating_mul(4);
    f.refuse_unless(
        "n_inner",
        |v| v.as_u64() == Some(inner),
        || format!("snug's GPT-2 MLP is 4 × n_embd = {inner} wide"),
    )?;
    let bool_is = |want: bool| move |v: &Value| v.as_bool() == Some(want);
    f.refuse_unless("tie_word_embeddings", bool_is(true), || {
        "snug's GPT-2 LM head is the token embedding".into()
    })?;
    f.refuse_unless("scale_attn_weights", bool_is(true), || {
        "snug's attention scales scores by 1/√head_dim".into()
    })?;
    f.refuse_unless("scale_attn_by_inverse_layer_idx", bool_is(false), || {
        "snug's attention does not scale scores by layer".into()
    })?;
    f.refuse_unless("add_cross_attention", bool_is(false), || {
        "cross-attention (an encoder-decoder) is not built".into()
    })?;
    // `reorder_and_upcast_attn` only moves where rounding happens in half precision; snug's
    // attention computes in f32 either way.
    f.bool_or("reorder_and_upcast_attn", false)?;
    Ok(GptConfig {
        n_layer: f.int("n_layer")?,
        n_head: f.int("n_head")?,
        n_embd,
        block_size: f.int_or("n_positions", f.int_or("n_ctx", 1024)?)?,
        vocab_size: f.int("vocab_size")?,
    })
}

fn llama(f: &Fields, model_type: &str) -> Result<LlamaConfig> {
    let arch = match model_type {
        "mistral" => LlamaArch::Mistral,
        "qwen2" => LlamaArch::Qwen2,
        _ => LlamaArch::Llama,
    };
    let n_head = f.int("num_attention_heads")?;
    let hidden = f.int("hidden_size")?;
    if hidden == 0 {
        // Before `head_dim` is compared with it, which would then be named.
        return Err(invalid("hidden_size", &json!(0), "must be at least 1"));
    }
    let n_layer = f.int("num_hidden_layers")?;
    let max_seq = f.int_or("max_position_embeddings", 4096)?;
    f.refuse_unless(
        "hidden_act",
        |v| matches!(v.as_str(), Some("silu" | "swish")),
        || "snug's Llama MLP is SwiGLU (silu)".into(),
    )?;
    if let Some(v) = f.get("head_dim") {
        // `hidden_size / num_attention_heads` when it divides: a different width is checked
        // by `validate`.
        if n_head > 0 && as_int("head_dim", v)?.checked_mul(n_head) != Some(hidden) {
            return Err(unsupported(
                "head_dim",
                v,
                format!(
                    "snug's heads are hidden_size / num_attention_heads = {hidden} / {n_head} wide"
                ),
            ));
        }
    }
    f.refuse_unless(
        "partial_rotary_factor",
        |v| v.as_f64() == Some(1.0),
        || "snug rotates every dimension of a head".into(),
    )?;
    // Dropout only acts while training; transformers' inference ignores it.
    let (theta, scaling) = rope(f)?;
    let (qkv_bias, o_bias, mlp_bias) = match arch {
        LlamaArch::Llama => {
            let attention = f.bool_or("attention_bias", false)?;
            (attention, attention, f.bool_or("mlp_bias", false)?)
        }
        // Mistral's projections have no biases; Qwen2's q/k/v always have them.
        LlamaArch::Mistral => (false, false, false),
        LlamaArch::Qwen2 => (true, false, false),
    };
    sliding_window(f, arch, max_seq)?;
    Ok(LlamaConfig {
        n_layer,
        n_head,
        n_kv_head: f.int_or("num_key_value_heads", n_head)?,
        hidden,
        intermediate: f.int("intermediate_size")?,
        vocab_size: f.int("vocab_size")?,
        max_seq,
        // transformers' default for all three architectures.
        rms_eps: positive("rms_norm_eps", f.float_or("rms_norm_eps", 1e-6)?)?,
        rope_theta: theta,
        arch,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        qkv_bias,
        o_bias,
        mlp_bias,
        rope_scaling: scaling,
    })
}

/// Mistral's and Qwen2's sliding window, refused where it would hide a position the model
/// can see: snug's attention sees every earlier position.
fn sliding_window(f: &Fields, arch: LlamaArch, max_seq: usize) -> Result<()> {
    if let Some(v) = f.get("layer_types") {
        let list = v
            .as_array()
            .ok_or_else(|| invalid("layer_types", v, "expected a list"))?;
        if let Some(other) = list.iter().find(|t| t.as_str() != Some("full_attention")) {
            return Err(unsupported(
                "layer_types",
                other,
                "every layer of snug's model attends to all earlier positions (full_attention)",
            ));
        }
    }
    let used = match arch {
        LlamaArch::Llama => false,
        LlamaArch::Mistral => true,
        // Qwen2 slides only with `use_sliding_window`, and only from `max_window_layers` on.
        LlamaArch::Qwen2 => {
            f.bool_or("use_sliding_window", false)?
                && f.int_or("max_window_layers", 28)? < f.int("num_hidden_layers")?
        }
    };
    if let (true, Some(v)) = (used, f.get("sliding_window")) {
        let window = as_int("sliding_window", v)?;
        if window < max_seq {
            return Err(unsupported(
                "sliding_window",
                v,
                format!(
                    "it would apply below max_position_embeddings ({max_seq}), and snug's \
                     attention sees every earlier position"
                ),
            ));
        }
    }
    Ok(())
}

/// The rotary base and scaling, from transformers 5's `rope_parameters` or transformers 4's
/// `rope_theta` and `rope_scaling`.
fn rope(f: &Fields) -> Result<(f32, Option<RopeScaling>)> {
    let (key, params) = match (f.get("rope_parameters"), f.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, s) => ("rope_scaling", s),
    };
    let mut theta = f.float_or("rope_theta", 10000.0)?;
    let Some(params) = params else {
        return Ok((positive("rope_theta", theta)?, None));
    };
    let p = params
        .as_object()
        .ok_or_else(|| invalid(key, params, "expected an object"))?;
    let p = Fields(p);
    let name = |k: &str| format!("{key}.{k}");
    if p.get("rope_theta").is_some() {
        theta = p
            .float_or("rope_theta", theta)
            .map_err(|e| rename(e, &name("rope_theta")))?;
    }
    let theta = positive(&name("rope_theta"), theta)?;
    p.refuse_unless(
        "partial_rotary_factor",
        |v| v.as_f64() == Some(1.0),
        || "snug rotates every dimension of a head".into(),
    )
    .map_err(|e| rename(e, &name("partial_rotary_factor")))?;
    // transformers 4.4x wrote `type`; later versions `rope_type`.
    let (kind_key, kind) = match (p.get("rope_type"), p.get("type")) {
        (Some(t), _) => ("rope_type", t),
        (None, Some(t)) => ("type", t),
        (None, None) => {
            return Err(HfConfigError::Missing {
                field: name("rope_type"),
            })
        }
    };
    match kind.as_str() {
        Some("default") => Ok((theta, None)),
        Some("llama3") => {
            let float = |k: &str| -> Result<f32> {
                let v = p
                    .get(k)
                    .ok_or_else(|| HfConfigError::Missing { field: name(k) })?;
                as_f32(&name(k), v)
            };
            let original = p
                .get("original_max_position_embeddings")
                .ok_or_else(|| HfConfigError::Missing {
                    field: name("original_max_position_embeddings"),
                })
                .and_then(|v| as_int(&name("original_max_position_embeddings"), v))?;
            let scaling = RopeScaling::Llama3 {
                factor: float("factor")?,
                low_freq_factor: float("low_freq_factor")?,
                high_freq_factor: float("high_freq_factor")?,
                original_max_position: original,
            };
            if let Some(why) = scaling.check() {
                return Err(invalid(key, params, why));
            }
            Ok((theta, Some(scaling)))
        }
        _ => Err(unsupported(
            &name(kind_key),
            kind,
            "snug scales rotary frequencies as Llama 3 does (`llama3`) or not at all (`default`)",
        )),
    }
}

/// `e` naming `field` instead (a nested field by its path).
fn rename(e: HfConfigError, field: &str) -> HfConfigError {
    let field = field.to_string();
    match e {
        HfConfigError::Missing { .. } => HfConfigError::Missing { field },
        HfConfigError::Invalid { value, detail, .. } => HfConfigError::Invalid {
            field,
            value,
            detail,
        },
        HfConfigError::Unsupported { value, reason, .. } => HfConfigError::Unsupported {
            field,
            value,
            reason,
        },
        other => other,
    }
}

/// The text of a `config.json` for `cfg`, in transformers 4's spelling (which transformers 5
/// also reads): what `snug export` writes beside the weights.
pub fn to_json(cfg: &ModelConfig) -> String {
    let v = match cfg {
        ModelConfig::Gpt(c) => return crate::hf_weights::hf_config_json(c),
        ModelConfig::Llama(c) => llama_json(c),
    };
    // Serialising a `Value` cannot fail.
    let mut text = serde_json::to_string_pretty(&v).unwrap_or_else(|_| unreachable!());
    text.push('\n');
    text
}

fn llama_json(c: &LlamaConfig) -> Value {
    let rope_scaling = match c.rope_scaling {
        None => Value::Null,
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        }) => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position,
        }),
    };
    let mut v = json!({
        "model_type": c.arch.model_type(),
        "architectures": [c.arch.architecture()],
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq,
        "rms_norm_eps": shortest(c.rms_eps),
        "rope_theta": shortest(c.rope_theta),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "vocab_size": c.vocab_size,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": "float32",
    });
    let extra = match c.arch {
        LlamaArch::Llama => json!({
            "attention_bias": c.qkv_bias,
            "mlp_bias": c.mlp_bias,
            "pretraining_tp": 1,
        }),
        LlamaArch::Mistral => json!({ "sliding_window": null }),
        LlamaArch::Qwen2 => json!({
            "sliding_window": null,
            "use_sliding_window": false,
            "max_window_layers": c.n_layer,
        }),
    };
    if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
        v.extend(extra);
    }
    v
}

/// An f32 written as the shortest decimal that reads back as it (`1e-6`, not the f64 nearest
/// the f32, `9.999999974752427e-7`), as the config.json it came from most likely had it.
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_text(extra: &str) -> String {
        format!(
            r#"{{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 320, "max_position_embeddings": 128{extra}}}"#
        )
    }

    fn gpt2_text(extra: &str) -> String {
        format!(
            r#"{{"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32,
            "n_positions": 128, "vocab_size": 320{extra}}}"#
        )
    }

    /// Every refused field is an `Unsupported` error naming the field and the value.
    #[test]
    fn fields_that_change_the_function_are_refused_by_name_and_value() {
        let cases: &[(String, &str, &str)] = &[
            (
                gpt2_text(r#", "activation_function": "relu""#),
                "activation_function",
                "\"relu\"",
            ),
            (
                gpt2_text(r#", "layer_norm_epsilon": 1e-6"#),
                "layer_norm_epsilon",
                "1e-6",
            ),
            (
                gpt2_text(r#", "layer_norm_epsilon": 0.001"#),
                "layer_norm_epsilon",
                "0.001",
            ),
            (gpt2_text(r#", "n_inner": 100"#), "n_inner", "100"),
            (
                gpt2_text(r#", "tie_word_embeddings": false"#),
                "tie_word_embeddings",
                "false",
            ),
            (
                gpt2_text(r#", "scale_attn_weights": false"#),
                "scale_attn_weights",
                "false",
            ),
            (
                gpt2_text(r#", "scale_attn_by_inverse_layer_idx": true"#),
                "scale_attn_by_inverse_layer_idx",
                "true",
            ),
            (
                gpt2_text(r#", "add_cross_attention": true"#),
                "add_cross_attention",
                "true",
            ),
            (
                gpt2_text(r#", "torch_dtype": "int8""#),
                "torch_dtype",
                "\"int8\"",
            ),
            (
                gpt2_text(r#", "quantization_config": {"bits": 4}"#),
                "quantization_config",
                "{\"bits\":4}",
            ),
            (
                llama_text(r#", "hidden_act": "gelu""#),
                "hidden_act",
                "\"gelu\"",
            ),
            (llama_text(r#", "head_dim": 16"#), "head_dim", "16"),
            (
                llama_text(r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#),
                "rope_scaling.rope_type",
                "\"yarn\"",
            ),
            (
                llama_text(r#", "rope_scaling": {"type": "linear", "factor": 2.0}"#),
                "rope_scaling.type",
                "\"linear\"",
            ),
            (
                llama_text(r#", "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}"#),
                "rope_parameters.rope_type",
                "\"dynamic\"",
            ),
            (
                llama_text(r#", "partial_rotary_factor": 0.5"#),
                "partial_rotary_factor",
                "0.5",
            ),
            (
                llama_text(r#", "model_type": "mistral", "sliding_window": 64"#),
                "sliding_window",
                "64",
            ),
            (
                llama_text(
                    r#", "model_type": "qwen2", "use_sliding_window": true, "sliding_window": 64, "max_window_layers": 1"#,
                ),
                "sliding_window",
                "64",
            ),
            (
                llama_text(r#", "layer_types": ["full_attention", "sliding_attention"]"#),
                "layer_types",
                "\"sliding_attention\"",
            ),
            (
                llama_text(r#", "dtype": "float8_e4m3fn""#),
                "dtype",
                "\"float8_e4m3fn\"",
            ),
        ];
        for (text, field, value) in cases {
            match parse(text) {
                Err(HfConfigError::Unsupported {
                    field: f, value: v, ..
                }) => {
                    assert_eq!((f.as_str(), v.as_str()), (*field, *value), "{text}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    /// Values that are the default, or that do not change the function, are accepted.
    #[test]
    fn harmless_values_are_accepted() {
        for text in [
            gpt2_text(r#", "activation_function": "gelu_pytorch_tanh", "n_inner": 128"#),
            gpt2_text(r#", "reorder_and_upcast_attn": true, "attn_pdrop": 0.1, "n_inner": null"#),
            llama_text(r#", "sliding_window": 64"#),
            llama_text(r#", "model_type": "mistral", "sliding_window": 128"#),
            llama_text(r#", "model_type": "mistral", "sliding_window": null"#),
            llama_text(
                r#", "model_type": "qwen2", "use_sliding_window": false, "sliding_window": 4"#,
            ),
            llama_text(r#", "head_dim": 8, "pretraining_tp": 2, "attention_dropout": 0.1"#),
            llama_text(r#", "rope_scaling": {"rope_type": "default"}"#),
        ] {
            assert!(parse(&text).is_ok(), "{text}: {:?}", parse(&text));
        }
    }

    #[test]
    fn unknown_architectures_are_named() {
        let err = parse(&llama_text(r#", "model_type": "gemma""#)).unwrap_err();
        assert!(
            matches!(&err, HfConfigError::UnknownArchitecture { field, value, .. }
                if field == "model_type" && value == "\"gemma\""),
            "{err:?}"
        );
        let err = parse(&llama_text(
            r#", "architectures": ["LlamaForSequenceClassification"]"#,
        ))
        .unwrap_err();
        assert!(
            matches!(&err, HfConfigError::UnknownArchitecture { field, value, .. }
                if field == "architectures" && value == "\"LlamaForSequenceClassification\""),
            "{err:?}"
        );
        assert!(err.to_string().contains("LlamaForCausalLM"), "{err}");
    }

    /// The biases, tied head, scaling and ε each architecture implies.
    #[test]
    fn architectures_map_to_their_biases_and_rope() {
        let get = |text: &str| match parse(text).unwrap() {
            ModelConfig::Llama(c) => c,
            other => panic!("{other:?}"),
        };
        let c = get(&llama_text(
            r#", "attention_bias": true, "mlp_bias": true, "tie_word_embeddings": true"#,
        ));
        assert!(c.qkv_bias && c.o_bias && c.mlp_bias && c.tie_word_embeddings);
        assert_eq!(c.rms_eps, 1e-6, "transformers' default");
        let c = get(&llama_text(
            r#", "model_type": "qwen2", "rms_norm_eps": 1e-5"#,
        ));
        assert_eq!(
            (c.arch, c.qkv_bias, c.o_bias, c.rms_eps),
            (LlamaArch::Qwen2, true, false, 1e-5)
        );
        let c = get(&llama_text(
            r#", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}"#,
        ));
        assert_eq!(c.rope_theta, 5e5);
        assert_eq!(
            c.rope_scaling,
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 64
            })
        );
        let err = parse(&llama_text(
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}"#,
        ))
        .unwrap_err();
        assert_eq!(err.field(), "rope_scaling.original_max_position_embeddings");
    }

    /// What `to_json` writes reads back as the same model, for every architecture.
    #[test]
    fn written_configs_read_back() {
        let texts = [
            llama_text(
                r#", "attention_bias": true, "mlp_bias": true, "tie_word_embeddings": true"#,
            ),
            llama_text(r#", "model_type": "qwen2""#),
            llama_text(r#", "model_type": "mistral", "rope_theta": 1e6"#),
            llama_text(
                r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}"#,
            ),
            gpt2_text(""),
        ];
        for text in texts {
            let cfg = parse(&text).unwrap();
            assert_eq!(parse(&to_json(&cfg)).unwrap(), cfg, "{text}");
        }
    }

    /// A size the model refuses is named by the file's key and value, not snug's field.
    #[test]
    fn invalid_sizes_are_named_as_the_file_names_them() {
        let named = |text: &str| match parse(text) {
            Err(HfConfigError::Invalid { field, value, .. }) => (field, value),
            other => panic!("{text}: {other:?}"),
        };
        let gpt2 = |positions: &str| {
            format!(
                r#"{{"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32,
                {positions}, "vocab_size": 320}}"#
            )
        };
        assert_eq!(
            named(&gpt2(r#""n_positions": 0"#)),
            ("n_positions".into(), "0".into())
        );
        assert_eq!(named(&gpt2(r#""n_ctx": 0"#)), ("n_ctx".into(), "0".into()));
        let llama =
            llama_text("").replace(r#""hidden_size": 32"#, r#""hidden_size": 0, "head_dim": 8"#);
        assert_eq!(named(&llama), ("hidden_size".into(), "0".into()));
    }
}
