//! Rotary position embedding (RoPE) in the Llama / Hugging Face "rotate half" layout: within each
//! head of width `D`, element `i` and element `i + D/2` form a pair rotated by the angle
//! `t · f_i`, where `t` is the position along axis 1 and `f_i = θ^(−2i/D)` (or its Llama 3 rescaling,
//! [`RopeScaling`]). The cosines and sines are computed in the kernel (angle in f64, then rounded
//! to f32): no table is stored.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::Result;

/// Input `x [B, T, n_head · head_dim]`; output the same shape, each head's pairs rotated.
///
/// With `inverse` the rotation runs the other way (angle `−t · θ^(−2i/D)`): it undoes the
/// forward, and since a rotation is orthogonal it is also the forward's gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub n_head: usize,
    pub head_dim: usize,
    /// Base of the frequencies (10 000 in Llama 2, 500 000 in Llama 3).
    pub theta: f32,
    pub inverse: bool,
    /// How the frequencies are rescaled for a longer context; `None`: `θ^(−2i/D)` as they are.
    pub scaling: Option<RopeScaling>,
}

/// A rescaling of the rotary frequencies, as a Hugging Face `rope_scaling` names it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Llama 3.1's: wavelengths longer than `original_max_position / low_freq_factor` are
    /// slowed by `factor`, those shorter than `original_max_position / high_freq_factor` kept,
    /// and those between blended smoothly (transformers' `_compute_llama3_parameters`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
}

impl RopeScaling {
    /// Why these parameters cannot scale frequencies (`None` when they can).
    pub fn check(&self) -> Option<String> {
        match *self {
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let positive = |v: f32| v.is_finite() && v > 0.0;
                if !(positive(factor) && positive(low_freq_factor) && positive(high_freq_factor)) {
                    Some(format!(
                        "llama3 factors must be positive and finite, got factor {factor}, \
                         low_freq_factor {low_freq_factor}, high_freq_factor {high_freq_factor}"
                    ))
                } else if high_freq_factor <= low_freq_factor {
                    Some(format!(
                        "llama3 high_freq_factor ({high_freq_factor}) must exceed \
                         low_freq_factor ({low_freq_factor})"
                    ))
                } else if original_max_position == 0 {
                    Some("llama3 original_max_position_embeddings must be at least 1".into())
                } else {
                    None
                }
            }
        }
    }
}

impl Rope {
    /// The forward rotation.
    pub fn new(n_head: usize, head_dim: usize, theta: f32) -> Self {
        Rope {
            n_head,
            head_dim,
            theta,
            inverse: false,
            scaling: None,
        }
    }

    /// The frequency of pair `i` (of `head_dim / 2`), in radians per position. Every backend
    /// takes its frequencies from here, so they agree with each other.
    pub fn inv_freq(&self, i: usize) -> f64 {
        let base = (self.theta as f64).powf(-((2 * i) as f64) / self.head_dim as f64);
        match self.scaling {
            None => base,
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            }) => {
                let (factor, low, high) = (
                    factor as f64,
                    low_freq_factor as f64,
                    high_freq_factor as f64,
                );
                let old = original_max_position as f64;
                let wavelen = std::f64::consts::TAU / base;
                if wavelen < old / high {
                    base
                } else if wavelen > old / low {
                    base / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * base / factor + smooth * base
                }
            }
        }
    }
}

/// Batch, sequence and width of `x`, after checking it against the op's head layout.
pub fn dims(op: &Rope, x: &[usize]) -> Result<(usize, usize, usize)> {
    let name = op.name();
    if op.head_dim == 0 || !op.head_dim.is_multiple_of(2) {
        return Err(shape_err(
            name,
            format!("head_dim must be even and positive, got {}", op.head_dim),
        ));
    }
    if !(op.theta.is_finite() && op.theta > 0.0) {
        return Err(shape_err(
            name,
            format!("theta must be positive, got {}", op.theta),
        ));
    }
    if let Some(why) = op.scaling.as_ref().and_then(RopeScaling::check) {
        return Err(shape_err(name, why));
    }
    let width = op.n_head * op.head_dim;
    if x.len() != 3 || op.n_head == 0 || x[2] != width {
        return Err(shape_err(
            name,
            format!(
                "x must be [B, T, {} heads × {}], got {x:?}",
                op.n_head, op.head_dim
            ),
        ));
    }
    Ok((x[0], x[1], width))
}

impl OpRule for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let dtype = float_dtype(self.name(), inputs)?;
        dims(self, &inputs[0].shape)?;
        let mut y = OutSpec::f32(inputs[0].shape.clone());
        y.dtype = dtype;
        Ok(vec![y])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let inverse = Rope {
                inverse: !self.inverse,
                ..*self
            };
            let dx = ctx.apply1(inverse, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }

    /// One position's cosines and sines (`head_dim / 2` each) per thread.
    fn workspace_elems(&self, _inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        // The GPU kernel computes each angle where it uses it.
        if target.is_gpu() {
            return 0;
        }
        let threads = target.threads();
        threads.max(1).saturating_mul(self.head_dim)
    }

    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        3 * outputs[0].numel() as u64
    }
}
