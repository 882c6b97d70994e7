//! Layer normalisation over the last axis with affine weight and bias. The forward saves each
//! row's mean and reciprocal standard deviation for the backward.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// `y = (x − mean) · rstd · w + b`; outputs `[y, mean, rstd]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    pub eps: f32,
}

impl Default for LayerNorm {
    fn default() -> Self {
        LayerNorm { eps: 1e-5 }
    }
}

impl OpRule for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let x = &inputs[0].shape;
        let Some(&c) = x.last() else {
            return Err(shape_err(self.name(), "input must have at least one axis"));
        };
        for (i, what) in [(1, "weight"), (2, "bias")] {
            if inputs[i].shape != [c] {
                return Err(shape_err(
                    self.name(),
                    format!("{what} has shape {:?}, expected [{c}]", inputs[i].shape),
                ));
            }
        }
        let stats = x[..x.len() - 1].to_vec();
        let mut y = OutSpec::f32(x.clone());
        y.dtype = dtype;
        Ok(vec![
            y,
            OutSpec::f32(stats.clone()).named("mean"),
            OutSpec::f32(stats).named("rstd"),
        ])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        let ins = [dy, ctx.input(0), ctx.input(1), ctx.output(1), ctx.output(2)];
        let g = ctx.apply(LayerNormBackward, &ins)?;
        for (i, &t) in g.iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, t);
            }
        }
        Ok(())
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        8 * inputs[0].numel() as u64
    }
}

/// Inputs `[dy, x, w, mean, rstd]`; outputs `[dx, dw, db]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerNormBackward;

impl OpRule for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer_norm_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 5)?;
        let x = &inputs[1].shape;
        if &inputs[0].shape != x {
            return Err(shape_err(self.name(), "dy and x differ in shape"));
        }
        let w = inputs[2].shape.clone();
        let (xt, wt) = (inputs[1].dtype, inputs[2].dtype);
        Ok(vec![
            OutSpec::f32(x.clone()).with_dtype(xt),
            OutSpec::f32(w.clone()).with_dtype(wt),
            OutSpec::f32(w).with_dtype(wt),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "layer_norm_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One partial `dw` and `db` per thread, summed at the end.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        // The GPU sums `dw` and `db` a column per thread, straight into the outputs.
        if target.is_gpu() {
            return 0;
        }
        let threads = target.threads();
        threads.saturating_mul(2).saturating_mul(inputs[2].numel())
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        12 * inputs[0].numel() as u64
    }

    /// `dx` may be written over `dy` or `x`: each row is read whole before it is written.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0, 1]
    }
}
