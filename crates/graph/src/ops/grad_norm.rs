//! The global gradient norm, for logging and for clipping (`torch.nn.utils.clip_grad_norm_`).
//!
//! Each gradient's sum of squares is taken as soon as the gradient is complete, so without
//! clipping no gradient has to wait for the others; with clipping every update waits for the
//! coefficient, which needs them all (as in every framework).

use super::{OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// One input, output `[1]`: the sum of its squared elements (accumulated in f64).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SumSquares;

impl OpRule for SumSquares {
    fn name(&self) -> &'static str {
        "sum_squares"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        super::expect_arity(self.name(), inputs, 1)?;
        Ok(vec![OutSpec::f32(vec![1])])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient("sum_squares"))
    }

    /// The GPU sums in two stages, through one partial sum per workgroup.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        if target.is_gpu() {
            gpu_partial_sums(inputs[0].numel())
        } else {
            0
        }
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        2 * inputs[0].numel() as u64
    }
}

/// Partial sums a GPU's [`SumSquares`] of `n` elements writes before adding them: one per
/// 1,024 elements, at most 256 (what one workgroup of 256 threads adds in its second stage).
pub fn gpu_partial_sums(n: usize) -> usize {
    n.div_ceil(1024).clamp(1, 256)
}

/// Inputs: every gradient's [`SumSquares`]. Outputs `[coef]` and `[norm]`, where `norm` is
/// the global L2 norm of the gradients times `scale` (`1/micro-batches`: the mean gradient's
/// norm) and `coef = scale · min(1, max_norm / (norm + 1e-6))`, the factor the optimizer
/// multiplies each gradient by. `max_norm = ∞` means no clipping.
///
/// With `unscale`, the last input is the loss scale `S` the gradients carry: norm and coef are
/// divided by it, and a norm that is not finite (an overflow) makes `coef` NaN, which tells
/// the optimizers to skip the update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    pub max_norm: f32,
    pub scale: f32,
    pub unscale: bool,
}

impl OpRule for GradNorm {
    fn name(&self) -> &'static str {
        "grad_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.is_empty() || inputs.iter().any(|t| t.numel() != 1) {
            return Err(super::shape_err(
                self.name(),
                "expects one or more scalar sums of squares",
            ));
        }
        Ok(vec![
            OutSpec::f32(vec![1]).named("coef"),
            OutSpec::f32(vec![1]).named("norm"),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient("grad_norm"))
    }

    /// The GPU adds the sums as a (high, low) pair of floats, kept between its dispatches.
    fn workspace_elems(&self, _inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        if target.is_gpu() {
            2
        } else {
            0
        }
    }
}

/// Inputs `[state, sums…]`: writes the total of the sums of squares into the persistent
/// scalar `state`, where the next step reads it ([`GradNorm`] over `[state]`) to clip by the
/// previous step's global norm without waiting for this step's gradients.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StoreSumSquares;

impl OpRule for StoreSumSquares {
    fn name(&self) -> &'static str {
        "store_sum_squares"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.len() < 2 || inputs.iter().any(|t| t.numel() != 1) {
            return Err(super::shape_err(
                self.name(),
                "expects a scalar state and one or more scalar sums of squares",
            ));
        }
        if !inputs[0].role.is_persistent() {
            return Err(GraphError::Invalid {
                op: "store_sum_squares",
                detail: format!(
                    "`{}` is written in place and must be persistent",
                    inputs[0].name
                ),
            });
        }
        Ok(vec![])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient("store_sum_squares"))
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[0]
    }
}

fn no_gradient(op: &'static str) -> GraphError {
    GraphError::Invalid {
        op,
        detail: "a gradient statistic has no gradient".into(),
    }
}
