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
}
