//! Llama-family models (Llama 2 / Llama 3 shapes): RMSNorm, rotary position embeddings,
//! grouped-query attention, a SwiGLU MLP, and an LM head separate from the token embedding.
//! Parameter names follow Hugging Face's `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`,
//! ...), with linear weights stored `[in, out]` (the transpose of HF's `nn.Linear` layout).

use serde::{Deserialize, Serialize};

use crate::NnError;

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
}

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
            rms_eps: 1e-5,
            rope_theta: 10000.0,
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
            rms_eps: 1e-5,
            rope_theta: 10000.0,
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
            rms_eps: 1e-5,
            rope_theta: 10000.0,
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
            rms_eps: 1e-5,
            rope_theta: 10000.0,
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
        crate::gpt::check_model_size(("num_hidden_layers", self.n_layer), &self.parameter_terms())
    }

    /// The parts of [`LlamaConfig::parameter_count`], by the field that drives each.
    fn parameter_terms(&self) -> [crate::gpt::ParameterTerm; 3] {
        use crate::gpt::{mul, ParameterTerm};
        let (c, f) = (self.hidden, self.intermediate);
        let kv = self.n_kv_head.saturating_mul(self.head_dim());
        // Per layer: two RMSNorms (c each), attention (2c² + 2c·kv), MLP (3cf).
        let attention = mul(c, c)
            .saturating_add(mul(c, kv))
            .saturating_mul(2)
            .saturating_add(mul(2, c));
        let mlp = mul(3, c).saturating_mul(f as u128);
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
                count: mul(self.vocab_size, c).saturating_mul(2),
            },
        ]
    }

    /// Every parameter's Hugging Face name and snug shape, in checkpoint order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (c, f) = (self.hidden, self.intermediate);
        let kv = self.n_kv_head * self.head_dim();
        let mut v = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, c],
        )];
        for i in 0..self.n_layer {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            v.extend([
                (p("input_layernorm.weight"), vec![c]),
                (p("self_attn.q_proj.weight"), vec![c, c]),
                (p("self_attn.k_proj.weight"), vec![c, kv]),
                (p("self_attn.v_proj.weight"), vec![c, kv]),
                (p("self_attn.o_proj.weight"), vec![c, c]),
                (p("post_attention_layernorm.weight"), vec![c]),
                (p("mlp.gate_proj.weight"), vec![c, f]),
                (p("mlp.up_proj.weight"), vec![c, f]),
                (p("mlp.down_proj.weight"), vec![f, c]),
            ]);
        }
        v.push(("model.norm.weight".to_string(), vec![c]));
        v.push(("lm_head.weight".to_string(), vec![c, self.vocab_size]));
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
        self.validate()?;
        crate::gpt::check_batch_seq(batch, seq, self.max_seq, "max_position_embeddings")?;
        crate::gpt::loss_graph(batch, seq, target.into(), masked, |g, tokens| {
            self.trunk(g, tokens, dtype)
        })
    }

    /// Adds the model from `tokens [batch, seq]` to the final RMSNorm.
    pub(crate) fn trunk(
        &self,
        g: &mut snug_graph::Graph,
        tokens: snug_graph::TensorId,
        dtype: snug_graph::DType,
    ) -> Result<crate::gpt::Trunk, NnError> {
        use snug_graph::ops::{Binary, Embedding, GqaAttention, MatMul, RmsNorm, Rope, SwiGlu};
        use snug_graph::{Graph, GraphError, Role, TensorId};
        let (c, f, d) = (self.hidden, self.intermediate, self.head_dim());
        let kv = self.n_kv_head * d;
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
        let linear = MatMul::default();
        let norm = RmsNorm { eps: self.rms_eps };
        for i in 0..self.n_layer {
            let mut p = |g: &mut Graph, s: &str, shape: &[usize]| {
                param(g, format!("model.layers.{i}.{s}"), shape)
            };
            let ln1 = p(g, "input_layernorm.weight", &[c])?;
            let wq = p(g, "self_attn.q_proj.weight", &[c, c])?;
            let wk = p(g, "self_attn.k_proj.weight", &[c, kv])?;
            let wv = p(g, "self_attn.v_proj.weight", &[c, kv])?;
            let wo = p(g, "self_attn.o_proj.weight", &[c, c])?;
            let ln2 = p(g, "post_attention_layernorm.weight", &[c])?;
            let wg = p(g, "mlp.gate_proj.weight", &[c, f])?;
            let wu = p(g, "mlp.up_proj.weight", &[c, f])?;
            let wd = p(g, "mlp.down_proj.weight", &[f, c])?;

            // The layer count is bounded by `MAX_LAYERS` (validated).
            x = g.in_block(i as u32, |g| -> Result<TensorId, GraphError> {
                g.set_scope(format!("model.layers.{i}.self_attn"));
                let h = g.apply(norm, &[x, ln1])?[0];
                let q = g.apply1(linear, &[h, wq])?;
                let k = g.apply1(linear, &[h, wk])?;
                let v = g.apply1(linear, &[h, wv])?;
                let q = g.apply1(Rope::new(self.n_head, d, self.rope_theta), &[q])?;
                let k = g.apply1(Rope::new(self.n_kv_head, d, self.rope_theta), &[k])?;
                let attn = GqaAttention {
                    n_head: self.n_head,
                    n_kv_head: self.n_kv_head,
                };
                let a = g.apply(attn, &[q, k, v])?[0];
                let o = g.apply1(linear, &[a, wo])?;
                let x = g.apply1(Binary::add(), &[x, o])?;

                g.set_scope(format!("model.layers.{i}.mlp"));
                let h = g.apply(norm, &[x, ln2])?[0];
                let gate = g.apply1(linear, &[h, wg])?;
                let up = g.apply1(linear, &[h, wu])?;
                let m = g.apply1(SwiGlu, &[gate, up])?;
                let down = g.apply1(linear, &[m, wd])?;
                g.apply1(Binary::add(), &[x, down])
            })?;
        }
        let final_norm = param(g, "model.norm.weight".into(), &[c])?;
        let lm_head = param(g, "lm_head.weight".into(), &[c, self.vocab_size])?;
        g.set_scope("head");
        let xf = g.apply(norm, &[x, final_norm])?[0];
        Ok(crate::gpt::Trunk {
            hidden: xf,
            head: lm_head,
            head_transposed: false,
            params,
        })
    }

    /// Llama's initialisation: linear weights and embeddings N(0, 0.02), norm gains one.
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
            rms_eps: 1e-5,
            rope_theta: 500000.0,
        };
        assert!(llama_405b.validate().is_ok());
        for (name, cfg) in LLAMA_PRESETS {
            assert!(cfg.validate().is_ok(), "{name}");
        }
    }
}
