//! The SwiGLU gate of Llama's MLP, fused: `silu(gate) · up` in one pass, no `silu(gate)` tensor.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Inputs `[gate, up]` of one shape; output `silu(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SwiGlu;

impl OpRule for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        let dtype = float_dtype(self.name(), inputs)?;
        if inputs[0].shape != inputs[1].shape {
            return Err(shape_err(
                self.name(),
                format!(
                    "gate {:?} and up {:?} differ in shape",
                    inputs[0].shape, inputs[1].shape
                ),
            ));
        }
        let mut spec = OutSpec::f32(inputs[0].shape.clone());
        spec.dtype = dtype;
        Ok(vec![spec])
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        let ins = [ctx.input(0), ctx.input(1), dy];
        let g = ctx.apply(SwiGluBackward, &ins)?;
        for (i, &t) in g.iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, t);
            }
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        6 * outputs[0].numel() as u64
    }
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0, 1]
    }
}

/// Inputs `[gate, up, dy]`; outputs `[dgate, dup]`:
/// `dgate = dy · up · silu'(gate)`, `dup = dy · silu(gate)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SwiGluBackward;

impl OpRule for SwiGluBackward {
    fn name(&self) -> &'static str {
        "swiglu_backward"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        let shape = &inputs[0].shape;
        if &inputs[1].shape != shape || &inputs[2].shape != shape {
            return Err(shape_err(self.name(), "gate, up and dy differ in shape"));
        }
        Ok(vec![
            OutSpec::f32(shape.clone()).with_dtype(inputs[0].dtype),
            OutSpec::f32(shape.clone()).with_dtype(inputs[1].dtype),
        ])
    }
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "swiglu_backward",
            detail: "second derivatives are not supported".into(),
        })
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        6 * outputs.iter().map(|t| t.numel() as u64).sum::<u64>()
    }
}
