//! GELU, exact (erf) or with GPT-2's tanh approximation.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GeluApprox {
    /// `x · Φ(x)` with the error function.
    Exact,
    /// `0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))`, as GPT-2 was trained.
    #[default]
    Tanh,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Gelu {
    pub approx: GeluApprox,
}

#[cfg(feature = "cpu")]
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
#[cfg(feature = "cpu")]
const COEF: f32 = 0.044_715;
#[cfg(feature = "cpu")]
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
#[cfg(feature = "cpu")]
/// 1/√(2π)
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `u = √(2/π)·(x + 0.044715·x³)`, the argument of GPT-2's tanh.
#[cfg(feature = "cpu")]
#[inline(always)]
fn tanh_arg(x: f32) -> f32 {
    SQRT_2_OVER_PI * (x + COEF * x * x * x)
}

#[cfg(feature = "cpu")]
#[inline(always)]
pub(super) fn gelu(approx: GeluApprox, x: f32) -> f32 {
    match approx {
        // 0.5·(1 + tanh(u)) = σ(2u): one exp and one division, no sign juggling, and no
        // cancellation in 1 + tanh(u) for negative x.
        GeluApprox::Tanh => x / (1.0 + super::math::exp(-2.0 * tanh_arg(x))),
        GeluApprox::Exact => 0.5 * x * (1.0 + libm::erff(x * FRAC_1_SQRT_2)),
    }
}

/// `(gelu(x), gelu'(x))`, sharing the one tanh or erf between them.
#[cfg(feature = "cpu")]
#[inline(always)]
pub(super) fn gelu_and_grad(approx: GeluApprox, x: f32) -> (f32, f32) {
    match approx {
        GeluApprox::Tanh => {
            // With s = σ(2u) = 0.5·(1 + tanh(u)): gelu = x·s and gelu' = s + 2x·s(1 - s)·u'.
            let s = 1.0 / (1.0 + super::math::exp(-2.0 * tanh_arg(x)));
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x * x);
            (x * s, s + 2.0 * x * s * (1.0 - s) * du)
        }
        GeluApprox::Exact => {
            let cdf = 0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2));
            (
                x * cdf,
                cdf + x * INV_SQRT_2PI * super::math::exp(-0.5 * x * x),
            )
        }
    }
}

#[cfg(feature = "cpu")]
#[inline(always)]
fn gelu_grad(approx: GeluApprox, x: f32) -> f32 {
    gelu_and_grad(approx, x).1
}

impl OpRule for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        super::same_as_input(self.name(), inputs)
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let x = ctx.input(0);
            let dx = ctx.apply1(
                GeluBackward {
                    approx: self.approx,
                },
                &[x, dy],
            )?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        8 * outputs[0].numel() as u64
    }
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        // One loop per variant, so each vectorises on its own.
        match self.approx {
            GeluApprox::Tanh => super::par::unary(k, |v| gelu(GeluApprox::Tanh, v)),
            GeluApprox::Exact => super::par::unary(k, |v| gelu(GeluApprox::Exact, v)),
        }
    }
}

/// Inputs `[x, dy]`; output `dx = dy · gelu'(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GeluBackward {
    pub approx: GeluApprox,
}

impl OpRule for GeluBackward {
    fn name(&self) -> &'static str {
        "gelu_backward"
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
            op: "gelu_backward",
            detail: "second derivatives are not supported".into(),
        })
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        12 * outputs[0].numel() as u64
    }
    fn inplace_inputs(&self) -> &'static [usize] {
        &[1, 0]
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        match self.approx {
            GeluApprox::Tanh => super::par::binary(k, |v, g| g * gelu_grad(GeluApprox::Tanh, v)),
            GeluApprox::Exact => super::par::binary(k, |v, g| g * gelu_grad(GeluApprox::Exact, v)),
        }
    }
}

#[cfg(all(test, feature = "cpu"))]
mod tests {
    use super::*;

    /// Both variants and the tanh one's derivative against the textbook formulas in f64.
    #[test]
    fn values_and_slopes_match_the_formulas() {
        let mut x = -9.0f32;
        while x < 9.0 {
            let v = f64::from(x);
            let u = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
            let tanh_form = 0.5 * v * (1.0 + u.tanh());
            let du = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * v * v);
            let slope = 0.5 * (1.0 + u.tanh()) + 0.5 * v * (1.0 - u.tanh().powi(2)) * du;
            let exact = 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
            let close =
                |got: f32, want: f64| (f64::from(got) - want).abs() <= 2e-6 * (1.0 + want.abs());
            let (value, grad) = gelu_and_grad(GeluApprox::Tanh, x);
            assert!(
                close(gelu(GeluApprox::Tanh, x), tanh_form),
                "tanh gelu({x})"
            );
            assert!(
                close(value, tanh_form) && close(grad, slope),
                "tanh gelu'({x})"
            );
            assert!(close(gelu(GeluApprox::Exact, x), exact), "exact gelu({x})");
            x += 0.0173;
        }
    }
}
