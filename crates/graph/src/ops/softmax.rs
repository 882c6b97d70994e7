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
    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        super::par::rows_mut(y, n, |r0, rows| {
            for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                let src = &x[(r0 + r) * n..(r0 + r + 1) * n];
                let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for (o, &v) in out.iter_mut().zip(src) {
                    *o = super::math::exp(v - max);
                    sum += *o;
                }
                let inv = 1.0 / sum;
                out.iter_mut().for_each(|o| *o *= inv);
            }
        });
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
    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (y, dy, dx) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        super::par::rows_mut(dx, n, |r0, rows| {
            for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                let range = (r0 + r) * n..(r0 + r + 1) * n;
                let (y, dy) = (&y[range.clone()], &dy[range]);
                let dot: f32 = y.iter().zip(dy).map(|(a, b)| a * b).sum();
                for ((o, &yv), &g) in out.iter_mut().zip(y).zip(dy) {
                    *o = yv * (g - dot);
                }
            }
        });
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
    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        super::par::rows_mut(y, n, |r0, rows| {
            for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                let src = &x[(r0 + r) * n..(r0 + r + 1) * n];
                let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = src.iter().map(|&v| super::math::exp(v - max)).sum();
                let lse = max + sum.ln();
                for (o, &v) in out.iter_mut().zip(src) {
                    *o = v - lse;
                }
            }
        });
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
    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (y, dy, dx) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        super::par::rows_mut(dx, n, |r0, rows| {
            for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                let range = (r0 + r) * n..(r0 + r + 1) * n;
                let (y, dy) = (&y[range.clone()], &dy[range]);
                let sum: f32 = dy.iter().sum();
                for ((o, &yv), &g) in out.iter_mut().zip(y).zip(dy) {
                    *o = g - super::math::exp(yv) * sum;
                }
            }
        });
    }
}
