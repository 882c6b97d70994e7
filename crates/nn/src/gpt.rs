//! GPT in the GPT-2 / nanoGPT shape: token and learned position embeddings, pre-LayerNorm blocks
//! (causal multi-head attention, 4× GELU MLP), a final LayerNorm, and an LM head tied to the
//! token embedding. Parameter names and layouts follow Hugging Face's GPT-2 (`Conv1D` weights are
//! stored `[in, out]`).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};
use snug_graph::ops::{
    Binary, CausalAttention, CrossEntropy, Embedding, Gelu, GeluApprox, LayerNorm, MatMul, Narrow,
    Reshape,
};
use snug_graph::passes::fuse_for_target;
use snug_graph::{DType, Graph, GraphError, Role, TensorId};

use crate::ModelConfig;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum NnError {
    /// A LoRA configuration this model cannot take (the detail names the field and value).
    #[error("LoRA: {detail}")]
    Lora { detail: String },
    /// A PEFT adapter directory that cannot be read or does not fit the model.
    #[error("{path}: {detail}")]
    Adapter { path: String, detail: String },
    #[error("unknown preset `{name}` (known: {known})")]
    UnknownPreset { name: String, known: String },
    #[error("model config: `{field}` {detail}")]
    Config { field: &'static str, detail: String },
    /// A Hugging Face `config.json` that cannot be read, or that asks for what snug does not
    /// build (the error names the field and its value).
    #[error("{path}: {error}")]
    HfConfig {
        path: String,
        error: crate::hf_config::HfConfigError,
    },
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// Reading or writing a weights file failed (I/O), or it is not a safetensors file
    /// (bad header, truncated data).
    #[error("{path}: {detail}")]
    WeightsFile { path: String, detail: String },
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor { path: String, name: String },
    #[error("{path}: unexpected tensor `{name}` (not a parameter of this model)")]
    UnexpectedTensor { path: String, name: String },
    #[error("{path}: tensor `{name}` appears twice")]
    DuplicateTensor { path: String, name: String },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        path: String,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: tensor `{name}` has dtype {dtype}, supported: F32, F16, BF16, F64")]
    TensorDType {
        path: String,
        name: String,
        dtype: String,
    },
    #[error("{path}: `lm_head.weight` differs from `wte.weight`, but snug's GPT ties the LM head to the token embedding")]
    UntiedHead { path: String },
    /// A tied model's checkpoint holds an LM head whose values are not the embedding's.
    #[error("{path}: `{head}` differs from `{embedding}`, but the configuration ties the LM head to the token embedding (tie_word_embeddings)")]
    HeadNotTied {
        path: String,
        head: String,
        embedding: String,
    },
    /// A sharded checkpoint's `model.safetensors.index.json` disagrees with its shards.
    #[error("{path}: tensor `{name}` {detail}")]
    IndexEntry {
        path: String,
        name: String,
        detail: String,
    },
    /// Caught at load: otherwise it surfaces steps later as a NaN loss.
    #[error("{path}: tensor `{name}` holds {value} at index {index}: weights must be finite (a damaged file, or saved from a diverged run)")]
    NonFiniteWeight {
        path: String,
        name: String,
        index: usize,
        value: f32,
    },
}

/// Most tensors a training step may have. Planning time grows with the square of the step
/// graph (a 1000-layer `tiny`, about 93,000 tensors, takes three minutes to plan), so the cap,
/// about 800 layers, is six times the deepest model snug is asked to plan (126 layers,
/// 405B-shaped) and refuses what would run for many minutes or until memory runs out.
pub const MAX_STEP_TENSORS: usize = 1 << 17;
/// An upper estimate of a training step's tensors per layer (forward, backward, AdamW and
/// rematerialized copies): measured 93 for GPT, 143 for Llama with block remat.
const STEP_TENSORS_PER_LAYER: usize = 160;
/// Most layers a model may have: [`MAX_STEP_TENSORS`] at [`STEP_TENSORS_PER_LAYER`].
pub const MAX_LAYERS: usize = MAX_STEP_TENSORS / STEP_TENSORS_PER_LAYER;
/// Most parameters a model may have: trained in f32 with AdamW (weight, gradient, two moments:
/// 16 bytes each) that is 2^50 bytes, a pebibyte, far past any machine yet well inside 64-bit
/// byte counts, so nothing downstream overflows.
pub const MAX_PARAMETERS: u128 = 1 << 46;

/// One part of a model's parameter count, with the configuration field that drives it.
pub(crate) struct ParameterTerm {
    pub field: &'static str,
    pub value: usize,
    /// Saturating: a count past `u128` is as refused as one past the cap.
    pub count: u128,
}

/// Refuses, before anything is built, a model whose step graph or parameter count is too large
/// to plan: `layers` is the layer-count field and its value, `terms` the parts of the parameter
/// count. The error names the field that makes the model too large.
pub(crate) fn check_model_size(
    layers: (&'static str, usize),
    terms: &[ParameterTerm],
) -> Result<(), NnError> {
    let (field, n) = layers;
    if n > MAX_LAYERS {
        return Err(NnError::Config {
            field,
            detail: format!(
                "{n} layers make a training step of about {} graph tensors; snug plans at most \
                 {MAX_STEP_TENSORS} (about {MAX_LAYERS} layers)",
                n.saturating_mul(STEP_TENSORS_PER_LAYER)
            ),
        });
    }
    let total = terms
        .iter()
        .fold(0u128, |sum, t| sum.saturating_add(t.count));
    if total > MAX_PARAMETERS {
        // The largest part names the field to lower.
        let worst = terms.iter().max_by_key(|t| t.count);
        let (field, value) = worst.map_or(("-", 0), |t| (t.field, t.value));
        let count = if total == u128::MAX {
            "more than 2^128".to_string()
        } else {
            total.to_string()
        };
        return Err(NnError::Config {
            field,
            detail: format!(
                "{value} gives the model {count} parameters; snug plans at most 2^46 = \
                 {MAX_PARAMETERS} (a pebibyte to train in f32 with AdamW)"
            ),
        });
    }
    Ok(())
}

/// `a · b`, saturating (a count this large is refused anyway).
pub(crate) fn mul(a: usize, b: usize) -> u128 {
    (a as u128).saturating_mul(b as u128)
}

/// Shape of a GPT model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Longest sequence (rows of the position embedding).
    pub block_size: usize,
    pub vocab_size: usize,
}

/// Named configurations. `char-small` is the benchmarks' model "A" (nanoGPT shakespeare-char).
pub const PRESETS: &[(&str, GptConfig)] = &[
    (
        "tiny",
        GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            vocab_size: 65,
        },
    ),
    (
        "char-small",
        GptConfig {
            n_layer: 6,
            n_head: 6,
            n_embd: 384,
            block_size: 256,
            vocab_size: 65,
        },
    ),
    (
        "gpt2",
        GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50257,
        },
    ),
    (
        "gpt2-medium",
        GptConfig {
            n_layer: 24,
            n_head: 16,
            n_embd: 1024,
            block_size: 1024,
            vocab_size: 50257,
        },
    ),
    (
        "gpt2-large",
        GptConfig {
            n_layer: 36,
            n_head: 20,
            n_embd: 1280,
            block_size: 1024,
            vocab_size: 50257,
        },
    ),
    (
        "gpt2-xl",
        GptConfig {
            n_layer: 48,
            n_head: 25,
            n_embd: 1600,
            block_size: 1024,
            vocab_size: 50257,
        },
    ),
];

/// A model's graph: its inputs, its loss, and its parameters by Hugging Face name.
#[derive(Debug, Clone)]
pub struct ModelGraph {
    pub graph: Graph,
    /// `[batch, seq]` token ids.
    pub tokens: TensorId,
    /// `[batch · seq]` next-token ids.
    pub targets: TensorId,
    pub loss: TensorId,
    pub params: Vec<(String, TensorId)>,
    /// The loss mask's inputs, when the graph was built with one.
    pub loss_mask: Option<LossMask>,
    /// The LoRA adapters the graph carries (none without LoRA); adapters and base weights are
    /// all among `params`.
    pub lora: Vec<snug_graph::passes::LoraLayer>,
}

/// A loss graph's mask inputs: which targets count, and what their losses are averaged by.
/// The loss is `Σ mask·ce / divisor`: a trainer feeds a 0/1 mask and the counted tokens of the
/// whole optimizer step per micro-batch, so that accumulated micro-batches average over every
/// counted token of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossMask {
    /// `[batch · seq]` f32: the weight of each target's loss (1 counts, 0 does not).
    pub mask: TensorId,
    /// `[]` f32: the loss's divisor (0: nothing counted, a loss of 0).
    pub divisor: TensorId,
}

impl LossMask {
    /// The same inputs after a graph pass.
    pub fn rewritten(self, r: &snug_graph::passes::Rewritten) -> Result<LossMask, GraphError> {
        Ok(LossMask {
            mask: r.map(self.mask)?,
            divisor: r.map(self.divisor)?,
        })
    }
}

impl ModelGraph {
    /// The same model after a graph pass (the pass's map gives the new ids).
    pub fn rewritten(self, r: snug_graph::passes::Rewritten) -> Result<ModelGraph, NnError> {
        Ok(ModelGraph {
            tokens: r.map(self.tokens)?,
            targets: r.map(self.targets)?,
            loss: r.map(self.loss)?,
            loss_mask: self.loss_mask.map(|m| m.rewritten(&r)).transpose()?,
            params: self
                .params
                .into_iter()
                .map(|(name, id)| Ok((name, r.map(id)?)))
                .collect::<Result<_, NnError>>()?,
            lora: self.lora,
            graph: r.graph,
        })
    }
}

/// A forward-only graph whose output is the logits (no targets, loss or gradients).
#[derive(Debug, Clone)]
pub struct InferenceGraph {
    pub graph: Graph,
    /// `[batch, seq]` token ids.
    pub tokens: TensorId,
    /// `[batch · seq, vocab]`: row `b · seq + t` scores the token after position `t` of
    /// sequence `b`. Marked as a graph output, so it can be read after a run.
    pub logits: TensorId,
    pub params: Vec<(String, TensorId)>,
}

/// The model body that training and inference share: embeddings through the final norm.
pub(crate) struct Trunk {
    /// Final hidden states `[batch, seq, C]`.
    pub hidden: TensorId,
    /// The LM head weight; `head_transposed` when it is stored `[vocab, C]` (tied to the
    /// token embedding) and read transposed.
    pub head: TensorId,
    pub head_transposed: bool,
    pub params: Vec<(String, TensorId)>,
}

impl GptConfig {
    pub fn preset(name: &str) -> Result<GptConfig, NnError> {
        PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| c.clone())
            .ok_or_else(|| NnError::UnknownPreset {
                name: name.to_string(),
                known: PRESETS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    pub fn validate(&self) -> Result<(), NnError> {
        let positive = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(NnError::Config {
                    field,
                    detail: "must be at least 1".into(),
                });
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(NnError::Config {
                field: "n_head",
                detail: format!("({}) must divide n_embd ({})", self.n_head, self.n_embd),
            });
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(NnError::Config {
                field: "vocab_size",
                detail: "must fit in i32 token ids".into(),
            });
        }
        check_model_size(("n_layer", self.n_layer), &self.parameter_terms())
    }

    /// The parts of [`GptConfig::parameter_count`], by the field that drives each.
    fn parameter_terms(&self) -> [ParameterTerm; 3] {
        let c = self.n_embd;
        // Per layer: two LayerNorms (2c each), QKV (3c² + 3c), output (c² + c), MLP (8c² + 5c).
        let per_layer = mul(c, c).saturating_mul(12).saturating_add(mul(13, c));
        [
            ParameterTerm {
                field: "n_embd",
                value: c,
                // The final LayerNorm with the layers.
                count: per_layer
                    .saturating_mul(self.n_layer as u128)
                    .saturating_add(mul(2, c)),
            },
            ParameterTerm {
                field: "vocab_size",
                value: self.vocab_size,
                count: mul(self.vocab_size, c),
            },
            ParameterTerm {
                field: "block_size",
                value: self.block_size,
                count: mul(self.block_size, c),
            },
        ]
    }

    /// Every parameter's Hugging Face name and shape, in checkpoint order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let c = self.n_embd;
        let mut v = vec![
            ("wte.weight".to_string(), vec![self.vocab_size, c]),
            ("wpe.weight".to_string(), vec![self.block_size, c]),
        ];
        for i in 0..self.n_layer {
            let p = |s: &str| format!("h.{i}.{s}");
            v.extend([
                (p("ln_1.weight"), vec![c]),
                (p("ln_1.bias"), vec![c]),
                (p("attn.c_attn.weight"), vec![c, 3 * c]),
                (p("attn.c_attn.bias"), vec![3 * c]),
                (p("attn.c_proj.weight"), vec![c, c]),
                (p("attn.c_proj.bias"), vec![c]),
                (p("ln_2.weight"), vec![c]),
                (p("ln_2.bias"), vec![c]),
                (p("mlp.c_fc.weight"), vec![c, 4 * c]),
                (p("mlp.c_fc.bias"), vec![4 * c]),
                (p("mlp.c_proj.weight"), vec![4 * c, c]),
                (p("mlp.c_proj.bias"), vec![c]),
            ]);
        }
        v.push(("ln_f.weight".to_string(), vec![c]));
        v.push(("ln_f.bias".to_string(), vec![c]));
        v
    }

    /// Trainable parameters (the LM head shares `wte`), counted without listing them, so an
    /// unvalidated configuration costs nothing (saturating at `usize::MAX`).
    pub fn parameter_count(&self) -> usize {
        let total = self
            .parameter_terms()
            .iter()
            .fold(0u128, |sum, t| sum.saturating_add(t.count));
        usize::try_from(total).unwrap_or(usize::MAX)
    }

    /// Bytes of weights, gradients and AdamW moments at `dtype` (master weights and moments
    /// are f32 regardless), before any activation.
    pub fn training_state_bytes(&self, dtype: DType) -> usize {
        let n = self.parameter_count();
        n * dtype.size_bytes() + n * dtype.size_bytes() + 2 * n * 4
    }

    /// Model FLOPs per token of a training step, as nanoGPT and PaLM count them: `6N` for the
    /// weights plus `12·L·C·T` for attention.
    pub fn flops_per_token(&self, seq: usize) -> u64 {
        ModelConfig::Gpt(self.clone()).flops_per_token(seq)
    }

    /// Builds the forward graph and loss for `batch` sequences of `seq` tokens, with the
    /// fusions `target` offers applied.
    pub fn build(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
    ) -> Result<ModelGraph, NnError> {
        self.build_with_dtype(batch, seq, target, DType::F32)
    }

    /// [`GptConfig::build`] with parameters and activations stored as `dtype` (bf16/f16 graphs
    /// are planned; the CPU runtime executes f32).
    pub fn build_with_dtype(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: DType,
    ) -> Result<ModelGraph, NnError> {
        self.build_loss(batch, seq, target, dtype, false)
    }

    /// [`GptConfig::build_with_dtype`], with the loss mask's inputs when `masked`.
    pub fn build_loss(
        &self,
        batch: usize,
        seq: usize,
        target: impl Into<snug_graph::Target>,
        dtype: DType,
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
        dtype: DType,
        masked: bool,
        lora: Option<(&crate::LoraConfig, &crate::ModelConfig)>,
    ) -> Result<ModelGraph, NnError> {
        self.validate()?;
        check_batch_seq(batch, seq, self.block_size, "block_size")?;
        loss_graph(batch, seq, target.into(), masked, lora, |g, tokens| {
            self.trunk(g, tokens, dtype, None)
        })
    }

    /// Adds the model from `tokens [batch, seq]` to the final LayerNorm.
    pub(crate) fn trunk(
        &self,
        g: &mut Graph,
        tokens: TensorId,
        dtype: DType,
        kv: Option<&KvInputs>,
    ) -> Result<Trunk, NnError> {
        let seq = g.tensor(tokens).shape.last().copied().unwrap_or(1);
        let batch = g.tensor(tokens).shape.first().copied().unwrap_or(1);
        let c = self.n_embd;
        let mut params = Vec::new();
        let mut param =
            |g: &mut Graph, name: String, shape: &[usize]| -> Result<TensorId, GraphError> {
                let id = g.add_leaf(name.clone(), shape, dtype, Role::Parameter)?;
                params.push((name, id));
                Ok(id)
            };
        let wte = param(g, "wte.weight".into(), &[self.vocab_size, c])?;
        let wpe = param(g, "wpe.weight".into(), &[self.block_size, c])?;

        g.set_scope("embed");
        let tok = g.apply1(Embedding, &[wte, tokens])?;
        let pos = match kv {
            None => g.apply1(Narrow { start: 0, len: seq }, &[wpe])?,
            Some(kv) => g.apply1(Embedding, &[wpe, kv.positions.unwrap_or(tokens)])?,
        };
        let mut x = g.apply1(Binary::add(), &[tok, pos])?;

        let linear = MatMul {
            ta: false,
            tb: false,
            bias: true,
        };
        for i in 0..self.n_layer {
            let mut p =
                |g: &mut Graph, s: &str, shape: &[usize]| param(g, format!("h.{i}.{s}"), shape);
            let ln1w = p(g, "ln_1.weight", &[c])?;
            let ln1b = p(g, "ln_1.bias", &[c])?;
            let wqkv = p(g, "attn.c_attn.weight", &[c, 3 * c])?;
            let bqkv = p(g, "attn.c_attn.bias", &[3 * c])?;
            let wo = p(g, "attn.c_proj.weight", &[c, c])?;
            let bo = p(g, "attn.c_proj.bias", &[c])?;
            let ln2w = p(g, "ln_2.weight", &[c])?;
            let ln2b = p(g, "ln_2.bias", &[c])?;
            let wfc = p(g, "mlp.c_fc.weight", &[c, 4 * c])?;
            let bfc = p(g, "mlp.c_fc.bias", &[4 * c])?;
            let wp = p(g, "mlp.c_proj.weight", &[4 * c, c])?;
            let bp = p(g, "mlp.c_proj.bias", &[c])?;

            // The layer count is bounded by `MAX_LAYERS` (validated).
            x = g.in_block(i as u32, |g| -> Result<TensorId, GraphError> {
                g.set_scope(format!("h.{i}.attn"));
                let h = g.apply(LayerNorm::default(), &[x, ln1w, ln1b])?[0];
                let qkv = g.apply1(linear, &[h, wqkv, bqkv])?;
                let a = match kv {
                    None => {
                        let attn = CausalAttention {
                            n_head: self.n_head,
                        };
                        g.apply(attn, &[qkv])?[0]
                    }
                    Some(kv) => {
                        let [kc, vc] = kv.caches(g, &format!("h.{i}.attn"), batch, c, dtype)?;
                        let attn = snug_graph::ops::KvAttention {
                            n_head: self.n_head,
                            n_kv_head: self.n_head,
                            packed: true,
                        };
                        g.apply1(attn, &[qkv, kc, vc, kv.pos])?
                    }
                };
                let proj = g.apply1(linear, &[a, wo, bo])?;
                let x = g.apply1(Binary::add(), &[x, proj])?;

                g.set_scope(format!("h.{i}.mlp"));
                let h = g.apply(LayerNorm::default(), &[x, ln2w, ln2b])?[0];
                let f = g.apply1(linear, &[h, wfc, bfc])?;
                let gelu = Gelu {
                    approx: GeluApprox::Tanh,
                };
                let f = g.apply1(gelu, &[f])?;
                let m = g.apply1(linear, &[f, wp, bp])?;
                g.apply1(Binary::add(), &[x, m])
            })?;
        }
        let lnfw = param(g, "ln_f.weight".into(), &[c])?;
        let lnfb = param(g, "ln_f.bias".into(), &[c])?;
        g.set_scope("head");
        let xf = g.apply(LayerNorm::default(), &[x, lnfw, lnfb])?[0];
        // The head is tied to the token embedding, stored [vocab, C]: read it transposed.
        Ok(Trunk {
            hidden: xf,
            head: wte,
            head_transposed: true,
            params,
        })
    }

    /// GPT-2's initialisation: weights N(0, 0.02), residual projections N(0, 0.02/√(2L)),
    /// biases zero, LayerNorm gains one. Deterministic in `seed`.
    pub fn init_parameters(&self, seed: u64) -> Vec<(String, Vec<f32>)> {
        self.init_parameters_iter(seed).collect()
    }

    /// [`Self::init_parameters`] one tensor at a time, so a caller can store each and drop
    /// it before the next is made.
    pub fn init_parameters_iter(&self, seed: u64) -> impl Iterator<Item = (String, Vec<f32>)> + '_ {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let std = 0.02f32;
        let proj_std = std / (2.0 * self.n_layer as f32).sqrt();
        self.parameter_shapes()
            .into_iter()
            .map(move |(name, shape)| {
                let n: usize = shape.iter().product();
                let values = if name.ends_with("ln_1.weight")
                    || name.ends_with("ln_2.weight")
                    || name == "ln_f.weight"
                {
                    vec![1.0; n]
                } else if name.ends_with(".bias") {
                    vec![0.0; n]
                } else {
                    let s = if name.ends_with("c_proj.weight") {
                        proj_std
                    } else {
                        std
                    };
                    // A positive, finite standard deviation cannot fail.
                    let normal = Normal::new(0.0, s).unwrap_or_else(|_| unreachable!());
                    (0..n).map(|_| normal.sample(&mut rng)).collect()
                };
                (name, values)
            })
    }
}

/// Batch and sequence checks shared by every model builder.
pub(crate) fn check_batch_seq(
    batch: usize,
    seq: usize,
    max_seq: usize,
    max_name: &str,
) -> Result<(), NnError> {
    if batch == 0 {
        return Err(NnError::Config {
            field: "batch",
            detail: "must be at least 1".into(),
        });
    }
    if seq == 0 || seq > max_seq {
        return Err(NnError::Config {
            field: "block",
            detail: format!("{seq} must be between 1 and the model's {max_name} {max_seq}"),
        });
    }
    Ok(())
}

/// The training graph: `tokens` and `targets` inputs, a model trunk, and the mean
/// cross-entropy of the logits against `targets`, named `loss`; with the fusions `target`
/// offers applied. When `masked`, the loss also reads the inputs `loss_mask` and
/// `loss_divisor` ([`LossMask`]), made after every other input, so an unmasked graph is the
/// same graph with or without this option.
pub(crate) fn loss_graph(
    batch: usize,
    seq: usize,
    target: snug_graph::Target,
    masked: bool,
    lora: Option<(&crate::LoraConfig, &crate::ModelConfig)>,
    trunk: impl FnOnce(&mut Graph, TensorId) -> Result<Trunk, NnError>,
) -> Result<ModelGraph, NnError> {
    let mut g = Graph::new().with_target(target);
    let tokens = g.input("tokens", &[batch, seq], DType::I32)?;
    let targets = g.input("targets", &[batch * seq], DType::I32)?;
    let t = trunk(&mut g, tokens)?;
    let logits = head_logits(&mut g, &t)?;
    let loss_mask = if masked {
        Some(LossMask {
            mask: g.input("loss_mask", &[batch * seq], DType::F32)?,
            divisor: g.input("loss_divisor", &[], DType::F32)?,
        })
    } else {
        None
    };
    let loss = match loss_mask {
        Some(m) => g.apply1(CrossEntropy, &[logits, targets, m.mask, m.divisor])?,
        None => g.apply1(CrossEntropy, &[logits, targets])?,
    };
    g.set_scope("");
    g.rename(loss, "loss");
    let mut model = ModelGraph {
        graph: g,
        tokens,
        targets,
        loss,
        params: t.params,
        loss_mask,
        lora: Vec::new(),
    };
    if let Some((config, family)) = lora {
        // Before the fusions: a norm whose output the adapter also reads stays unfused.
        let layers = config.layers(family)?;
        let (r, made) = snug_graph::passes::add_lora(&model.graph, &config.spec(), &|name| {
            config.selects(family, name)
        })?;
        let names = |v: &[snug_graph::passes::LoraLayer]| {
            let mut n: Vec<String> = v.iter().map(|l| l.weight.clone()).collect();
            n.sort();
            n
        };
        if names(&made) != names(&layers) {
            return Err(NnError::Lora {
                detail: format!(
                    "{} layer(s) selected, {} adapted in the graph",
                    layers.len(),
                    made.len()
                ),
            });
        }
        model = model.rewritten(r)?;
        for l in &made {
            for name in [&l.lora_a, &l.lora_b] {
                let id = model
                    .graph
                    .tensors()
                    .iter()
                    .position(|t| &t.name == name)
                    .map(|i| TensorId(i as u32));
                if let Some(id) = id {
                    model.params.push((name.clone(), id));
                }
            }
        }
        model.lora = made;
    }
    let (fused, _) = fuse_for_target(&model.graph, &target)?;
    model.rewritten(fused)
}

/// What a trunk built for sampling with a key/value cache reads besides its tokens.
pub(crate) struct KvInputs {
    /// i32 `[1]`: the position of the first token fed.
    pub pos: TensorId,
    /// i32 `[B, T]`: each token's position (`pos + t`), for GPT's learned position embedding.
    pub positions: Option<TensorId>,
    /// Rows of each cache: the model's window.
    pub window: usize,
}

impl KvInputs {
    /// A layer's key and value caches `[batch, window, width]`, named under `scope`.
    pub fn caches(
        &self,
        g: &mut Graph,
        scope: &str,
        batch: usize,
        width: usize,
        dtype: DType,
    ) -> Result<[TensorId; 2], GraphError> {
        let shape = [batch, self.window, width];
        Ok([
            g.add_leaf(format!("{scope}.k_cache"), &shape, dtype, Role::KvCache)?,
            g.add_leaf(format!("{scope}.v_cache"), &shape, dtype, Role::KvCache)?,
        ])
    }
}

/// A graph for sampling with a key/value cache: `T` new tokens at positions `pos .. pos + T`
/// go in, their keys and values join the caches, and the logits of the last of them come out.
/// A prefill is this graph with `T` the prompt's length (fed at `pos` 0); a decode step, with
/// `T` 1. Both have the same parameters and caches (by name and size), so one session switches
/// between them keeping the weights and the cached keys and values in place.
#[derive(Debug, Clone)]
pub struct KvGraph {
    pub graph: Graph,
    /// i32 `[1, T]` token ids.
    pub tokens: TensorId,
    /// i32 `[1]`: the position of the first token; `pos + T` must not pass the window.
    pub pos: TensorId,
    /// i32 `[1, T]`: `pos, pos + 1, ..`, for a model with learned positions (GPT).
    pub positions: Option<TensorId>,
    /// `[1, vocab]`: scores of the token after the last one fed. A graph output.
    pub logits: TensorId,
    pub params: Vec<(String, TensorId)>,
    /// Every layer's key and value caches `[1, window, kv width]`, in layer order.
    pub caches: Vec<TensorId>,
}

/// [`KvGraph`] of `new_tokens` tokens for a model whose trunk `trunk` builds.
pub(crate) fn kv_logits_graph(
    new_tokens: usize,
    window: usize,
    learned_positions: bool,
    target: snug_graph::Target,
    trunk: impl FnOnce(&mut Graph, TensorId, &KvInputs) -> Result<Trunk, NnError>,
) -> Result<KvGraph, NnError> {
    let mut g = Graph::new().with_target(target);
    let tokens = g.input("tokens", &[1, new_tokens], DType::I32)?;
    let pos = g.input("pos", &[1], DType::I32)?;
    let positions = if learned_positions {
        Some(g.input("positions", &[1, new_tokens], DType::I32)?)
    } else {
        None
    };
    let kv = KvInputs {
        pos,
        positions,
        window,
    };
    let mut t = trunk(&mut g, tokens, &kv)?;
    // Only the last position's logits are wanted: the rest of a prefill's rows stop at the
    // final norm instead of costing a row of the head each.
    let c = g.tensor(t.hidden).shape.last().copied().unwrap_or(1);
    let rows = g.apply1(
        Reshape {
            shape: vec![new_tokens, c],
        },
        &[t.hidden],
    )?;
    t.hidden = g.apply1(
        Narrow {
            start: new_tokens - 1,
            len: 1,
        },
        &[rows],
    )?;
    let logits = head_logits(&mut g, &t)?;
    g.set_scope("");
    g.rename(logits, "logits");
    g.mark_output(logits);
    let caches: Vec<TensorId> = (0..g.tensors().len() as u32)
        .map(TensorId)
        .filter(|&id| g.tensor(id).role == Role::KvCache)
        .collect();
    let (r, _) = fuse_for_target(&g, &target)?;
    Ok(KvGraph {
        tokens: r.map(tokens)?,
        pos: r.map(pos)?,
        positions: positions.map(|p| r.map(p)).transpose()?,
        logits: r.map(logits)?,
        params: t
            .params
            .into_iter()
            .map(|(name, id)| Ok((name, r.map(id)?)))
            .collect::<Result<_, GraphError>>()?,
        caches: caches
            .into_iter()
            .map(|id| r.map(id))
            .collect::<Result<_, GraphError>>()?,
        graph: r.graph,
    })
}

/// The inference graph: a `tokens` input, a model trunk, and its logits as the graph output;
/// with the fusions `target` offers applied.
pub(crate) fn logits_graph(
    batch: usize,
    seq: usize,
    target: snug_graph::Target,
    trunk: impl FnOnce(&mut Graph, TensorId) -> Result<Trunk, NnError>,
) -> Result<InferenceGraph, NnError> {
    let mut g = Graph::new().with_target(target);
    let tokens = g.input("tokens", &[batch, seq], DType::I32)?;
    let t = trunk(&mut g, tokens)?;
    let logits = head_logits(&mut g, &t)?;
    g.set_scope("");
    g.rename(logits, "logits");
    g.mark_output(logits);
    let (r, _) = fuse_for_target(&g, &target)?;
    Ok(InferenceGraph {
        tokens: r.map(tokens)?,
        logits: r.map(logits)?,
        params: t
            .params
            .into_iter()
            .map(|(name, id)| Ok((name, r.map(id)?)))
            .collect::<Result<_, GraphError>>()?,
        graph: r.graph,
    })
}

/// Logits `[B·T, vocab]` of the trunk's final hidden states `[B, T, C]` against its head.
fn head_logits(g: &mut Graph, t: &Trunk) -> Result<TensorId, NnError> {
    let shape = g.tensor(t.hidden).shape.clone();
    let c = shape.last().copied().unwrap_or(1);
    let rows = shape.iter().product::<usize>() / c.max(1);
    let x = g.apply1(
        Reshape {
            shape: vec![rows, c],
        },
        &[t.hidden],
    )?;
    let matmul = MatMul {
        ta: false,
        tb: t.head_transposed,
        bias: false,
    };
    Ok(g.apply1(matmul, &[x, t.head])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_published_sizes() {
        // nanoGPT's count for the shakespeare-char model (peers/README: 10,770,816 with biases).
        assert_eq!(
            GptConfig::preset("char-small").unwrap().parameter_count(),
            10_770_816
        );
        // Hugging Face GPT-2 sizes (tied head): 124,439,808 / 354,823,168 / 774,030,080 / 1,557,611,200.
        let expect = [
            ("gpt2", 124_439_808),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
        ];
        for (name, n) in expect {
            assert_eq!(
                GptConfig::preset(name).unwrap().parameter_count(),
                n,
                "{name}"
            );
        }
    }

    /// Sizes whose step graph or parameters could not be planned are refused before anything
    /// is built, naming the field; the largest presets still pass.
    #[test]
    fn sizes_past_the_planning_bounds_name_the_field() {
        let tiny = GptConfig::preset("tiny").unwrap();
        let refused = |cfg: GptConfig, want: &str| match cfg.validate() {
            Err(NnError::Config { field, detail }) => {
                assert_eq!(field, want, "{detail}");
                detail
            }
            other => panic!("{cfg:?}: {other:?}"),
        };
        let d = refused(
            GptConfig {
                n_layer: 1_000_000_000,
                ..tiny.clone()
            },
            "n_layer",
        );
        assert!(d.contains("1000000000 layers"), "{d}");
        refused(
            GptConfig {
                n_layer: MAX_LAYERS + 1,
                ..tiny.clone()
            },
            "n_layer",
        );
        assert!(GptConfig {
            n_layer: MAX_LAYERS,
            ..tiny.clone()
        }
        .validate()
        .is_ok());
        let d = refused(
            GptConfig {
                n_embd: usize::MAX / 4 * 4,
                ..tiny.clone()
            },
            "n_embd",
        );
        assert!(d.contains("more than 2^128"), "{d}");
        refused(
            GptConfig {
                n_embd: 1 << 24,
                ..tiny.clone()
            },
            "n_embd",
        );
        refused(
            GptConfig {
                block_size: 1 << 50,
                ..tiny.clone()
            },
            "block_size",
        );
        refused(
            GptConfig {
                vocab_size: i32::MAX as usize,
                n_embd: 1 << 16,
                n_head: 1,
                ..tiny.clone()
            },
            "vocab_size",
        );
        for (name, cfg) in PRESETS {
            assert!(cfg.validate().is_ok(), "{name}");
        }
    }

    #[test]
    fn graph_parameters_follow_the_shape_table() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let g = cfg.build(2, 16, 1).unwrap();
        let shapes = cfg.parameter_shapes();
        assert_eq!(g.params.len(), shapes.len());
        for ((name, id), (want_name, want_shape)) in g.params.iter().zip(&shapes) {
            assert_eq!(name, want_name);
            assert_eq!(&g.graph.tensor(*id).shape, want_shape);
        }
        assert!(g.graph.tensor(g.loss).shape.is_empty());
    }

    /// Every node a layer's loop emits is marked with the layer's block (what remat segments
    /// by), in both families; the embeddings, the head and the loss are in none.
    #[test]
    fn layers_are_marked_as_blocks() {
        for name in ["tiny", "llama-tiny"] {
            let model = ModelConfig::preset(name).unwrap();
            let g = model.build(1, 8, 1, DType::F32).unwrap().graph;
            let mut seen = std::collections::BTreeSet::new();
            for n in g.nodes() {
                let out = &g.tensor(n.outputs[0]).name;
                let layer = ["h.", "model.layers."].iter().find_map(|p| {
                    let rest = out.strip_prefix(p)?;
                    rest.split('.').next()?.parse::<u32>().ok()
                });
                assert_eq!(n.block, layer, "{name}: {out}");
                seen.extend(n.block);
            }
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), [0, 1], "{name}");
        }
    }

    #[test]
    fn bad_configs_are_named_errors() {
        assert!(matches!(
            GptConfig::preset("gpt5"),
            Err(NnError::UnknownPreset { .. })
        ));
        let mut cfg = GptConfig::preset("tiny").unwrap();
        assert!(matches!(
            cfg.build(0, 8, 1),
            Err(NnError::Config { field: "batch", .. })
        ));
        assert!(matches!(
            cfg.build(1, 65, 1),
            Err(NnError::Config { field: "block", .. })
        ));
        cfg.n_head = 3;
        assert!(matches!(
            cfg.build(1, 8, 1),
            Err(NnError::Config {
                field: "n_head",
                ..
            })
        ));
    }
}
