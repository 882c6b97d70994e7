//! Root-mean-square normalisation over the last axis with an affine weight (no bias, no mean
//! subtraction), as in Llama. The forward saves each row's reciprocal RMS for the backward.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// `y = x · rstd · w` with `rstd = 1 / √(mean(x²) + eps)` per row; inputs `[x [..., C], w [C]]`,
/// outputs `[y, rstd [...]]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNorm {
    pub eps: f32,
}

impl Default for RmsNorm {
    fn default() -> Self {
        RmsNorm { eps: 1e-5 }
    }
}

impl OpRule for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let x = &inputs[0].shape;
        let Some(&c) = x.last() else {
            return Err(shape_err(self.name(), "input must have at least one axis"));
        };
        if inputs[1].shape != [c] {
            return Err(shape_err(
                self.name(),
                format!("weight has shape {:?}, expected [{c}]", inputs[1].shape),
            ));
        }
        let mut y = OutSpec::f32(x.clone());
        y.dtype = dtype;
        Ok(vec![
            y,
            OutSpec::f32(x[..x.len() - 1].to_vec()).named("rstd"),
        ])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        let ins = [dy, ctx.input(0), ctx.input(1), ctx.output(1)];
        let g = ctx.apply(RmsNormBackward, &ins)?;
        for (i, &t) in g.iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, t);
            }
        }
        Ok(())
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        4 * inputs[0].numel() as u64
    }
}

/// Inputs `[dy, x, w, rstd]`; outputs `[dx, dw]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RmsNormBackward;

impl OpRule for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rms_norm_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 4)?;
        let x = &inputs[1].shape;
        if &inputs[0].shape != x {
            return Err(shape_err(self.name(), "dy and x differ in shape"));
        }
        let Some(&c) = x.last() else {
            return Err(shape_err(self.name(), "input must have at least one axis"));
        };
        if inputs[2].shape != [c] {
            return Err(shape_err(self.name(), "weight must be [C]"));
        }
        if inputs[3].shape != x[..x.len() - 1] {
            return Err(shape_err(self.name(), "rstd must have x's leading axes"));
        }
        Ok(vec![
            OutSpec::f32(x.clone()).with_dtype(inputs[1].dtype),
            OutSpec::f32(inputs[2].shape.clone()).with_dtype(inputs[2].dtype),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "rms_norm_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One partial `dw` per thread, summed at the end.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        // The GPU sums `dw` a column per thread, straight into the output.
        if target.is_gpu() {
            return 0;
        }
        let threads = target.threads();
        threads.max(1).saturating_mul(inputs[2].numel())
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        8 * inputs[0].numel() as u64
    }
}
