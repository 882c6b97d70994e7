//! Llama-family models (Llama 2 / Llama 3, Mistral, Qwen2): RMSNorm, rotary position
//! embeddings (optionally with Llama 3's frequency scaling), grouped-query attention, a SwiGLU
//! MLP, optional projection biases (Qwen2's q/k/v, Llama's `attention_bias` and `mlp_bias`), and
//! an LM head separate from the token embedding or tied to it. Parameter names follow Hugging
//! Face's `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...), with linear
//! weights stored `[in, out]` (the transpose of HF's `nn.Linear` layout).

use serde::{Deserialize, Serialize};
pub use snug_graph::ops::RopeScaling;

use crate::NnError;

/// The Hugging Face architecture of a Llama-family model. All three build the same graph; they
/// differ in which biases they may carry and in the names their `config.json` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LlamaArch {
    #[default]
    Llama,
    Mistral,
    /// Always has q/k/v biases, never an output or MLP bias.
    Qwen2,
}

impl LlamaArch {
    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaArch::Llama => "llama",
            LlamaArch::Mistral => "mistral",
            LlamaArch::Qwen2 => "qwen2",
        }
    }

    /// `config.json`'s `architectures` entry (the causal-LM class).
    pub fn architecture(self) -> &'static str {
        match self {
            LlamaArch::Llama => "LlamaForCausalLM",
            LlamaArch::Mistral => "MistralForCausalLM",
            LlamaArch::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// Shape of a Llama model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub hidden: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate: usize,
    pub vocab_size: usize,
    pub max_seq: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// The Hugging Face architecture (what export names the model).
    #[serde(default, skip_serializing_if = "is_default")]
    pub arch: LlamaArch,
    /// The LM head is the token embedding, read transposed (SmolLM2, Llama 3.2 1B).
    #[serde(default, skip_serializing_if = "is_default")]
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub o_bias: bool,
    /// Biases on the MLP's gate, up and down projections (Llama's `mlp_bias`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub mlp_bias: bool,
    /// Rescaled rotary frequencies (Llama 3.1's `rope_scaling`); `None`: `θ^(−2i/D)`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub rope_scaling: Option<RopeScaling>,
}

/// Whether `v` is its type's default: such fields are left out when a configuration is
/// written, so a plain Llama's reads as it did before they existed.
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// A Llama with neither biases nor a tied head nor rope scaling; presets fill in the shape.
const PLAIN: LlamaConfig = LlamaConfig {
    n_layer: 0,
    n_head: 0,
    n_kv_head: 0,
    hidden: 0,
    intermediate: 0,
    vocab_size: 0,
    max_seq: 0,
    rms_eps: 1e-5,
    rope_theta: 10000.0,
    arch: LlamaArch::Llama,
    tie_word_embeddings: false,
    qkv_bias: false,
    o_bias: false,
    mlp_bias: false,
    rope_scaling: None,
};

/// Llama 2's published shapes (7B and 13B with full attention, 70B with 8 key/value heads).
pub const LLAMA_PRESETS: &[(&str, LlamaConfig)] = &[
    (
        "llama-tiny",
        LlamaConfig {
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            hidden: 64,
            intermediate: 172,
            vocab_size: 65,
            max_seq: 128,
            ..PLAIN
        },
    ),
    (
        "llama-7b",
        LlamaConfig {
            n_layer: 32,
            n_head: 32,
            n_kv_head: 32,
            hidden: 4096,
            intermediate: 11008,
            vocab_size: 32000,
            max_seq: 4096,
            ..PLAIN
        },
    ),
    (
        "llama-13b",
        LlamaConfig {
            n_layer: 40,
            n_head: 40,
            n_kv_head: 40,
            hidden: 5120,
            intermediate: 13824,
            vocab_size: 32000,
            max_seq: 4096,
            ..PLAIN
        },
    ),
    (
        "llama-70b",
        LlamaConfig {
            n_layer: 80,
            n_head: 64,
            n_kv_head: 8,
            hidden: 8192,
            intermediate: 28672,
            vocab_size: 32000,
            max_seq: 4096,
            ..PLAIN
        },
    ),
];

impl LlamaConfig {
    pub fn preset(name: &str) -> Option<LlamaConfig> {
        LLAMA_PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| c.clone())
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_head.max(1)
    }

    pub fn validate(&self) -> Result<(), NnError> {
        let positive = [
            ("num_hidden_layers", self.n_layer),
            ("num_attention_heads", self.n_head),
            ("num_key_value_heads", self.n_kv_head),
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_seq),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(NnError::Config {
                    field,
                    detail: "must be at least 1".into(),
                });
            }
        }
        if !self.hidden.is_multiple_of(self.n_head) || !self.head_dim().is_multiple_of(2) {
            return Err(NnError::Config {
                field: "num_attention_heads",
                detail: format!(
                    "({}) must divide hidden_size ({}) into even head widths",
                    self.n_head, self.hidden
                ),
            });
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(NnError::Config {
                field: "num_key_value_heads",
                detail: format!(
                    "({}) must divide num_attention_heads ({})",
                    self.n_kv_head, self.n_head
                ),
            });
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(NnError::Config {
                field: "vocab_size",
                detail: "must fit in i32 token ids".into(),
            });
        }
        // Zero, negative, NaN or infinite, these turn every loss into NaN steps later.
        for (field, v) in [
            ("rms_norm_eps", self.rms_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(NnError::Config {
                    field,
                    detail: format!("must be a positive finite number, got {v}"),
                });
            }
        }
        if let Some(why) = self.rope_scaling.as_ref().and_then(RopeScaling::check) {
            return Err(NnError::Config {
                field: "rope_scaling",
                detail: why,
            });
        }
        // Each architecture's own bias pattern: anything else has no Hugging Face name to
        // export under.
        let biases = (self.qkv_bias, self.o_bias, self.mlp_bias);
        let allowed = match self.arch {
            LlamaArch::Llama => self.qkv_bias == self.o_bias,
            LlamaArch::Mistral => biases == (false, false, false),
            LlamaArch::Qwen2 => biases == (true, false, false),
        };
        if !allowed {
            return Err(NnError::Config {
                field: "attention_bias",
                detail: format!(
                    "q/k/v bias {}, output bias {}, MLP bias {} is not a {} model (Llama: \
                     q/k/v and output biases together; Mistral: none; Qwen2: q/k/v only)",
                    self.qkv_bias,
                    self.o_bias,
                    self.mlp_bias,
                    self.arch.model_type()
                ),
            });
        }
        crate::gpt::check_model_size(("num_hidden_layers", self.n_layer), &self.parameter_terms())
    }

    /// The parts of [`LlamaConfig::parameter_count`], by the field that drives each.
    fn parameter_terms(&self) -> [crate::gpt::ParameterTerm; 3] {
        use crate::gpt::{mul, ParameterTerm};
        let (c, f) = (self.hidden, self.intermediate);
        let kv = self.n_kv_head.saturating_mul(self.head_dim());
        // Per layer: two RMSNorms (c each), attention (2c² + 2c·kv), MLP (3cf), and biases.
        let qkv_bias = if self.qkv_bias {
            mul(2, kv).saturating_add(c as u128)
        } else {
            0
        };
        let o_bias = if self.o_bias { c as u128 } else { 0 };
        let attention = mul(c, c)
            .saturating_add(mul(c, kv))
            .saturating_mul(2)
            .saturating_add(mul(2, c))
            .saturating_add(qkv_bias)
            .saturating_add(o_bias);
        let mlp_bias = if self.mlp_bias {
            mul(2, f).saturating_add(c as u128)
        } else {
            0
        };
        let mlp = mul(3, c).saturating_mul(f as u128).saturating_add(mlp_bias);
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        let layers = self.n_layer as u128;
        [
            ParameterTerm {
                field: "hidden_size",
                value: c,
                // The final norm with the layers.
                count: attention.saturating_mul(layers).saturating_add(c as u128),
            },
            ParameterTerm {
                field: "intermediate_size",
                value: f,
                count: mlp.saturating_mul(layers),
            },
            ParameterTerm {
                field: "vocab_size",
                value: self.vocab_size,
                // The embedding and the untied head.
                count: mul(self.vocab_size, c).saturating_mul(heads),
            },
        ]
    }

    /// Every parameter's Hugging Face name and snug shape, in checkpoint order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let c = self.hidden;
        let mut v = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, c],
        )];
        for i in 0..self.n_layer {
            for (name, shape) in self.layer_shapes() {
                v.push((format!("model.layers.{i}.{name}"), shape));
            }
        }
        v.push(("model.norm.weight".to_string(), vec![c]));
        if !self.tie_word_embeddings {
            v.push(("lm_head.weight".to_string(), vec![c, self.vocab_size]));
        }
        v
    }

    /// One layer's parameters (names under `model.layers.N.`) and shapes, in graph order: each
    /// projection's bias, where it has one, right after its weight.
    fn layer_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        let (c, f) = (self.hidden, self.intermediate);
        let kv = self.n_kv_head * self.head_dim();
        let mut v = vec![("input_layernorm.weight", vec![c])];
        let mut linear =
            |weight: &'static str, bias: &'static str, has_bias: bool, shape: [usize; 2]| {
                v.push((weight, shape.to_vec()));
                if has_bias {
                    v.push((bias, vec![shape[1]]));
                }
            };
        let (qkv, o, mlp) = (self.qkv_bias, self.o_bias, self.mlp_bias);
        linear(
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            qkv,
            [c, c],
        );
        linear(
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            qkv,
            [c, kv],
        );
        linear(
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
            qkv,
            [c, kv],
        );
        linear(
            "self_attn.o_proj.weight",
            "self_attn.o_proj.bias",
            o,
            [c, c],
        );
        v.push(("post_attention_layernorm.weight", vec![c]));
        let mut linear = |weight: &'static str, bias: &'static str, shape: [usize; 2]| {
            v.push((weight, shape.to_vec()));
            if mlp {
                v.push((bias, vec![shape[1]]));
            }
        };
        linear("mlp.gate_proj.weight", "mlp.gate_proj.bias", [c, f]);
        linear("mlp.up_proj.weight", "mlp.up_proj.bias", [c, f]);
        linear("mlp.down_proj.weight", "mlp.down_proj.bias", [f, c]);
        v
    }

    /// Counted without listing the parameters, so an unvalidated configuration costs nothing
    /// (saturating at `usize::MAX`).
    pub fn parameter_count(&self) -> usize {
        let total = self
            .parameter_terms()
            .iter()
            .fold(0u128, |sum, t| sum.saturating_add(t.count));
        usize::try_from(total).unwrap_or(usize::MAX)
    }
}

impl LlamaConfig {
    /// Builds the forward graph and loss for `batch` sequences of `seq` tokens, with parameters
    /// and activations stored as `dtype`.
    pub fn build(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: snug_graph::DType,
    ) -> Result<crate::ModelGraph, NnError> {
        self.build_loss(batch, seq, target, dtype, false)
    }

    /// [`LlamaConfig::build`], with the loss mask's inputs when `masked`.
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

    /// [`Self::build_loss`] with LoRA adapters (see [`crate::ModelConfig::build_loss_lora`]).
    pub(crate) fn build_loss_lora(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: snug_graph::DType,
        masked: bool,
        lora: Option<(&crate::LoraConfig, &crate::ModelConfig)>,
    ) -> Result<crate::ModelGraph, NnError> {
        self.validate()?;
        crate::gpt::check_batch_seq(batch, seq, self.max_seq, "max_position_embeddings")?;
        crate::gpt::loss_graph(batch, seq, target.into(), masked, lora, |g, tokens| {
            self.trunk(g, tokens, dtype, None)
        })
    }

    /// Adds the model from `tokens [batch, seq]` to the final RMSNorm.
    pub(crate) fn trunk(
        &self,
        g: &mut snug_graph::Graph,
        tokens: snug_graph::TensorId,
        dtype: snug_graph::DType,
        kv: Option<&crate::gpt::KvInputs>,
    ) -> Result<crate::gpt::Trunk, NnError> {
        use snug_graph::ops::{
            Binary, Embedding, GqaAttention, KvAttention, MatMul, RmsNorm, Rope, RopeAt, SwiGlu,
        };
        let batch = g.tensor(tokens).shape.first().copied().unwrap_or(1);
        use snug_graph::{Graph, GraphError, Role, TensorId};
        let (c, d) = (self.hidden, self.head_dim());
        let mut params = Vec::new();
        let mut param = |g: &mut Graph,
                         name: String,
                         shape: &[usize]|
         -> Result<snug_graph::TensorId, NnError> {
            let id = g.add_leaf(name.clone(), shape, dtype, Role::Parameter)?;
            params.push((name, id));
            Ok(id)
        };
        let embed = param(g, "model.embed_tokens.weight".into(), &[self.vocab_size, c])?;
        g.set_scope("embed");
        let mut x = g.apply1(Embedding, &[embed, tokens])?;
        let norm = RmsNorm { eps: self.rms_eps };
        let rope = |n_head| Rope {
            scaling: self.rope_scaling,
            ..Rope::new(n_head, d, self.rope_theta)
        };
        for i in 0..self.n_layer {
            // The layer's parameters by their name under `model.layers.N.`, in table order.
            let mut w = std::collections::HashMap::new();
            for (name, shape) in self.layer_shapes() {
                w.insert(name, param(g, format!("model.layers.{i}.{name}"), &shape)?);
            }
            // `x · W (+ b)`, with the bias when the table has one.
            let linear = |g: &mut Graph, x: TensorId, proj: &str| {
                let weight = w[format!("{proj}.weight").as_str()];
                match w.get(format!("{proj}.bias").as_str()) {
                    Some(&b) => g.apply1(
                        MatMul {
                            bias: true,
                            ..MatMul::default()
                        },
                        &[x, weight, b],
                    ),
                    None => g.apply1(MatMul::default(), &[x, weight]),
                }
            };

            // The layer count is bounded by `MAX_LAYERS` (validated).
            x = g.in_block(i as u32, |g| -> Result<TensorId, GraphError> {
                g.set_scope(format!("model.layers.{i}.self_attn"));
                let h = g.apply(norm, &[x, w["input_layernorm.weight"]])?[0];
                let q = linear(g, h, "self_attn.q_proj")?;
                let k = linear(g, h, "self_attn.k_proj")?;
                let v = linear(g, h, "self_attn.v_proj")?;
                let a = match kv {
                    None => {
                        let q = g.apply1(rope(self.n_head), &[q])?;
                        let k = g.apply1(rope(self.n_kv_head), &[k])?;
                        let attn = GqaAttention {
                            n_head: self.n_head,
                            n_kv_head: self.n_kv_head,
                        };
                        g.apply(attn, &[q, k, v])?[0]
                    }
                    Some(kv) => {
                        let rope_at = |n_head| RopeAt { rope: rope(n_head) };
                        let q = g.apply1(rope_at(self.n_head), &[q, kv.pos])?;
                        let k = g.apply1(rope_at(self.n_kv_head), &[k, kv.pos])?;
                        let scope = format!("model.layers.{i}.self_attn");
                        let width = self.n_kv_head * d;
                        let [kc, vc] = kv.caches(g, &scope, batch, width, dtype)?;
                        let attn = KvAttention {
                            n_head: self.n_head,
                            n_kv_head: self.n_kv_head,
                            packed: false,
                        };
                        g.apply1(attn, &[q, k, v, kc, vc, kv.pos])?
                    }
                };
                let o = linear(g, a, "self_attn.o_proj")?;
                let x = g.apply1(Binary::add(), &[x, o])?;

                g.set_scope(format!("model.layers.{i}.mlp"));
                let h = g.apply(norm, &[x, w["post_attention_layernorm.weight"]])?[0];
                let gate = linear(g, h, "mlp.gate_proj")?;
                let up = linear(g, h, "mlp.up_proj")?;
                let m = g.apply1(SwiGlu, &[gate, up])?;
                let down = linear(g, m, "mlp.down_proj")?;
                g.apply1(Binary::add(), &[x, down])
            })?;
        }
        let final_norm = param(g, "model.norm.weight".into(), &[c])?;
        // A tied head is the embedding, stored [vocab, C] and read transposed.
        let (head, head_transposed) = if self.tie_word_embeddings {
            (embed, true)
        } else {
            (
                param(g, "lm_head.weight".into(), &[c, self.vocab_size])?,
                false,
            )
        };
        g.set_scope("head");
        let xf = g.apply(norm, &[x, final_norm])?[0];
        Ok(crate::gpt::Trunk {
            hidden: xf,
            head,
            head_transposed,
            params,
        })
    }

    /// Llama's initialisation: linear weights and embeddings N(0, 0.02), biases zero, norm
    /// gains one.
    pub fn init_parameters(&self, seed: u64) -> Vec<(String, Vec<f32>)> {
        self.init_parameters_iter(seed).collect()
    }

    /// [`Self::init_parameters`] one tensor at a time, so a caller can store each and drop
    /// it before the next is made.
    pub fn init_parameters_iter(&self, seed: u64) -> impl Iterator<Item = (String, Vec<f32>)> + '_ {
        use rand::SeedableRng;
        use rand_distr::{Distribution, Normal};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        // A positive, finite standard deviation cannot fail.
        let normal = Normal::new(0.0f32, 0.02).unwrap_or_else(|_| unreachable!());
        self.parameter_shapes()
            .into_iter()
            .map(move |(name, shape)| {
                let n: usize = shape.iter().product();
                let values = if name.ends_with("norm.weight") {
                    vec![1.0; n]
                } else if name.ends_with(".bias") {
                    vec![0.0; n]
                } else {
                    (0..n).map(|_| normal.sample(&mut rng)).collect()
                };
                (name, values)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_published_sizes() {
        // Llama 2: 6,738,415,616 / 13,015,864,320 / 68,976,648,192 parameters.
        let expect = [
            ("llama-7b", 6_738_415_616),
            ("llama-13b", 13_015_864_320),
            ("llama-70b", 68_976_648_192),
        ];
        for (name, n) in expect {
            assert_eq!(
                LlamaConfig::preset(name).unwrap().parameter_count(),
                n,
                "{name}"
            );
        }
    }

    fn refused(cfg: &LlamaConfig, want: &str) -> String {
        match cfg.validate() {
            Err(NnError::Config { field, detail }) => {
                assert_eq!(field, want, "{detail}");
                detail
            }
            other => panic!("{cfg:?}: {other:?}"),
        }
    }

    #[test]
    fn nonsense_floats_name_the_field() {
        let tiny = LlamaConfig::preset("llama-tiny").unwrap();
        for bad in [-1e-5, 0.0, f32::NAN, f32::INFINITY] {
            let d = refused(
                &LlamaConfig {
                    rms_eps: bad,
                    ..tiny.clone()
                },
                "rms_norm_eps",
            );
            assert!(d.contains(&bad.to_string()), "{d}");
            refused(
                &LlamaConfig {
                    rope_theta: bad,
                    ..tiny.clone()
                },
                "rope_theta",
            );
        }
    }

    /// Huge sizes are refused before anything is built, naming the field; Llama 3 405B's
    /// shape (126 layers, 16384 wide, vocab 128256) still passes.
    #[test]
    fn sizes_past_the_planning_bounds_name_the_field() {
        let tiny = LlamaConfig::preset("llama-tiny").unwrap();
        let d = refused(
            &LlamaConfig {
                n_layer: 100_000,
                ..tiny.clone()
            },
            "num_hidden_layers",
        );
        assert!(d.contains("100000 layers"), "{d}");
        refused(
            &LlamaConfig {
                intermediate: usize::MAX,
                ..tiny.clone()
            },
            "intermediate_size",
        );
        refused(
            &LlamaConfig {
                hidden: 1 << 40,
                n_head: 1 << 20,
                n_kv_head: 1 << 20,
                ..tiny.clone()
            },
            "hidden_size",
        );
        refused(
            &LlamaConfig {
                vocab_size: i32::MAX as usize,
                hidden: 1 << 16,
                ..tiny.clone()
            },
            "vocab_size",
        );
        let llama_405b = LlamaConfig {
            n_layer: 126,
            n_head: 128,
            n_kv_head: 8,
            hidden: 16384,
            intermediate: 53248,
            vocab_size: 128256,
            max_seq: 131072,
            rope_theta: 500000.0,
            ..PLAIN
        };
        assert!(llama_405b.validate().is_ok());
        for (name, cfg) in LLAMA_PRESETS {
            assert!(cfg.validate().is_ok(), "{name}");
        }
    }
}
