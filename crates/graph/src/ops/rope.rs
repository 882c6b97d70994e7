//! Rotary position embedding (RoPE) in the Llama / Hugging Face "rotate half" layout: within each
//! head of width `D`, element `i` and element `i + D/2` form a pair rotated by the angle
//! `t · θ^(−2i/D)`, where `t` is the position along axis 1. The cosines and sines are computed in
//! the kernel (angle in f64, then rounded to f32): no table is stored.

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
}

impl Rope {
    /// The forward rotation.
    pub fn new(n_head: usize, head_dim: usize, theta: f32) -> Self {
        Rope {
            n_head,
            head_dim,
            theta,
            inverse: false,
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
        threads.max(1) * self.head_dim
    }

    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        3 * outputs[0].numel() as u64
    }
}
