//! Softmax and log-softmax over the last axis, with their gradients.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

fn last_axis_infer(op: &'static str, inputs: &[&TensorMeta], arity: usize) -> Result<Vec<OutSpec>> {
    expect_arity(op, inputs, arity)?;
    let dtype = float_dtype(op, inputs)?;
    let shape = &inputs[0].shape;
    if shape.is_empty() {
        return Err(shape_err(op, "needs at least one axis"));
    }
    for t in &inputs[1..] {
        if &t.shape != shape {
            return Err(shape_err(
                op,
                format!("{:?} differs from {shape:?}", t.shape),
            ));
        }
    }
    let mut spec = OutSpec::f32(shape.clone());
    spec.dtype = dtype;
    Ok(vec![spec])
}

fn no_second_order(op: &'static str) -> Result<()> {
    Err(GraphError::Invalid {
        op,
        detail: "second derivatives are not supported".into(),
    })
}

/// `exp(x - max) / Σ exp(x - max)` along the last axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Softmax;

impl OpRule for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        last_axis_infer(self.name(), inputs, 1)
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let y = ctx.output(0);
            let dx = ctx.apply1(SoftmaxBackward, &[y, dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        5 * outputs[0].numel() as u64
    }
}

/// `dx = y ⊙ (dy − Σ dy ⊙ y)` row by row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxBackward;

impl OpRule for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "softmax_backward"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        last_axis_infer(self.name(), inputs, 2)
    }
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        no_second_order(self.name())
    }
}

/// `x - max - log Σ exp(x - max)` along the last axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSoftmax;

impl OpRule for LogSoftmax {
    fn name(&self) -> &'static str {
        "log_softmax"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        last_axis_infer(self.name(), inputs, 1)
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let y = ctx.output(0);
            let dx = ctx.apply1(LogSoftmaxBackward, &[y, dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        5 * outputs[0].numel() as u64
    }
}

/// `dx = dy − exp(y) · Σ dy` row by row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSoftmaxBackward;

impl OpRule for LogSoftmaxBackward {
    fn name(&self) -> &'static str {
        "log_softmax_backward"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        last_axis_infer(self.name(), inputs, 2)
    }
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        no_second_order(self.name())
    }
}
