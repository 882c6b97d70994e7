//! What a training step is made of besides the model and its batch shape: precision,
//! optimizer, accumulation, clipping, graph passes, rematerialization and the loss mask.

use serde::{Deserialize, Serialize};
use snug_graph::DType;

/// Activation checkpointing mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Remat {
    #[default]
    None,
    /// Keep only the residual stream between segments of `blocks` blocks.
    Blocks { blocks: usize },
    /// Keep matmul and attention outputs; recompute norms, activations, elementwise ops.
    Selective,
    /// Recompute the values cheapest per byte, just enough for the step to fit `bytes`.
    Budget { bytes: usize },
}

impl std::str::FromStr for Remat {
    type Err = String;

    fn from_str(s: &str) -> Result<Remat, String> {
        let bad = || format!("`{s}` is not one of none, block, block:K, selective, budget:SIZE");
        if let Some(size) = s.trim().strip_prefix("budget:") {
            return snug_plan::parse_bytes(size)
                .map(|bytes| Remat::Budget { bytes })
                .map_err(|e| format!("`{s}`: {e}"));
        }
        match s.trim() {
            "none" => Ok(Remat::None),
            "block" => Ok(Remat::Blocks { blocks: 1 }),
            "selective" => Ok(Remat::Selective),
            other => match other.strip_prefix("block:").map(str::parse::<usize>) {
                Some(Ok(k)) if k >= 1 => Ok(Remat::Blocks { blocks: k }),
                _ => Err(bad()),
            },
        }
    }
}

impl std::fmt::Display for Remat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remat::None => f.write_str("none"),
            Remat::Blocks { blocks: 1 } => f.write_str("block"),
            Remat::Blocks { blocks } => write!(f, "block:{blocks}"),
            Remat::Selective => f.write_str("selective"),
            Remat::Budget { bytes } => write!(f, "budget:{bytes}"),
        }
    }
}

/// A graph pass applied when the step is compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Pass {
    /// LM head + cross-entropy fused and tiled: no `tokens × vocab` logits.
    #[serde(rename = "fused-ce")]
    FusedCrossEntropy,
    /// Common-subexpression elimination on the step graph.
    #[serde(rename = "cse")]
    Cse,
    /// Dead-code elimination on the step graph.
    #[serde(rename = "dce")]
    Dce,
    /// Ops write their output over an input that dies at them; runs after every other pass.
    #[serde(rename = "inplace")]
    InPlace,
}

impl Pass {
    pub const ALL: [Pass; 4] = [Pass::FusedCrossEntropy, Pass::Cse, Pass::Dce, Pass::InPlace];

    /// What a step runs unless told otherwise: both leave the numbers as they are (in-place
    /// bitwise; the fused head up to summation order) and only ever lower the peak.
    pub const DEFAULT: [Pass; 2] = [Pass::FusedCrossEntropy, Pass::InPlace];

    pub fn name(self) -> &'static str {
        match self {
            Pass::FusedCrossEntropy => "fused-ce",
            Pass::Cse => "cse",
            Pass::Dce => "dce",
            Pass::InPlace => "inplace",
        }
    }
}

/// The optimizer a step ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    AdamW,
    Sgd,
    /// AdamW with block-wise 8-bit moments (`adamw8bit`).
    AdamW8bit,
}

impl OptimizerKind {
    /// The name the configuration and the CLI use.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::AdamW8bit => "adamw8bit",
        }
    }
}

/// Everything about a training step besides the model and its batch shape.
#[derive(Debug, Clone, PartialEq)]
pub struct StepConfig {
    pub precision: DType,
    pub optimizer: OptimizerKind,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// Gradient-norm clip (0: off), over the norm `clip_mode` names.
    pub grad_clip: f32,
    pub clip_mode: snug_graph::ClipMode,
    /// Each parameter's update runs as soon as its gradient is complete
    /// ([`snug_graph::StepOptions::fused_update`]).
    pub fused_update: bool,
    pub passes: Vec<Pass>,
    pub remat: Remat,
    /// The loss takes a loss mask and its divisor as inputs ([`snug_nn::LossMask`]): only the
    /// targets the mask counts are averaged, over the whole optimizer step.
    pub loss_mask: bool,
    /// LoRA adapters on the layers it names; everything else is frozen (no gradient, no
    /// optimizer state).
    pub lora: Option<snug_nn::LoraConfig>,
    /// How the frozen weights are stored (bf16, int8 or NF4); only frozen weights can be, so
    /// this needs LoRA. None: f32.
    pub quantize_base: Option<snug_graph::ops::QuantizeBase>,
}

impl Default for StepConfig {
    fn default() -> Self {
        StepConfig {
            precision: DType::F32,
            optimizer: OptimizerKind::AdamW,
            beta1: 0.9,
            beta2: 0.95,
            weight_decay: 0.1,
            accumulation: 1,
            grad_clip: 1.0,
            clip_mode: snug_graph::ClipMode::Global,
            fused_update: false,
            passes: Pass::DEFAULT.to_vec(),
            remat: Remat::None,
            loss_mask: false,
            lora: None,
            quantize_base: None,
        }
    }
}
