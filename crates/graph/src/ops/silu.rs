//! SiLU (swish), `x · σ(x)`, the activation inside Llama's gated MLP.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// σ(x) = 1 / (1 + e^{−x}), with the vectorisable exp (saturates cleanly at both ends).
#[cfg(feature = "cpu")]
#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + super::math::exp(-x))
}

/// `silu(x) = x · σ(x)`.
#[cfg(feature = "cpu")]
#[inline(always)]
pub(super) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `silu'(x) = σ(x) · (1 + x · (1 − σ(x)))`.
#[cfg(feature = "cpu")]
#[inline(always)]
pub(super) fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// `y = x · σ(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Silu;

impl OpRule for Silu {
    fn name(&self) -> &'static str {
        "silu"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        super::same_as_input(self.name(), inputs)
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let x = ctx.input(0);
            let dx = ctx.apply1(SiluBackward, &[x, dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        5 * outputs[0].numel() as u64
    }
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        super::par::unary(k, silu);
    }
}

/// Inputs `[x, dy]`; output `dx = dy · silu'(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SiluBackward;

impl OpRule for SiluBackward {
    fn name(&self) -> &'static str {
        "silu_backward"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        if inputs[0].shape != inputs[1].shape {
            return Err(shape_err(self.name(), "x and dy differ in shape"));
        }
        Ok(vec![
            OutSpec::f32(inputs[0].shape.clone()).with_dtype(inputs[0].dtype)
        ])
    }
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "silu_backward",
            detail: "second derivatives are not supported".into(),
        })
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        8 * outputs[0].numel() as u64
    }
    fn inplace_inputs(&self) -> &'static [usize] {
        &[1, 0]
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        super::par::binary(k, |v, g| g * silu_grad(v));
    }
}
