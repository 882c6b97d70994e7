//! Mean cross-entropy of logits against integer targets, and its gradient.

use super::{expect_arity, expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Inputs `[logits [N, V], targets [N] (i32)]`; output the scalar mean loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrossEntropy;

fn check(op: &'static str, logits: &TensorMeta, targets: &TensorMeta) -> Result<()> {
    if logits.shape.len() != 2 || targets.shape != logits.shape[..1] {
        return Err(shape_err(
            op,
            format!(
                "logits {:?} and targets {:?} must be [N, V] and [N]",
                logits.shape, targets.shape
            ),
        ));
    }
    Ok(())
}

impl OpRule for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        expect_dtype(self.name(), inputs, 1, DType::I32)?;
        check(self.name(), inputs[0], inputs[1])?;
        Ok(vec![OutSpec::f32(vec![])])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let (Some(dl), true) = (ctx.grad_out(0), ctx.wants(0)) {
            let ins = [ctx.input(0), ctx.input(1), dl];
            let dlogits = ctx.apply1(CrossEntropyBackward, &ins)?;
            ctx.set_grad(0, dlogits);
        }
        Ok(())
    }

    /// One loss per row, summed in a fixed order so that runs are bit-reproducible.
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        inputs[0].shape[0]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        3 * inputs[0].numel() as u64
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (logits, targets, loss) = (k.in_f32(0), k.in_i32(1), k.out_f32(0));
        let v = k.in_shape(0)[1];
        let rows = k.workspace();
        super::par::rows_mut(rows, 1, |r0, out| {
            for (r, o) in out.iter_mut().enumerate() {
                let row = &logits[(r0 + r) * v..(r0 + r + 1) * v];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = row.iter().map(|&x| super::math::exp(x - max)).sum();
                let t = targets[r0 + r].clamp(0, v as i32 - 1) as usize;
                *o = max + sum.ln() - row[t];
            }
        });
        let total: f64 = rows.iter().map(|&x| x as f64).sum();
        loss[0] = (total / rows.len() as f64) as f32;
    }
}

/// Inputs `[logits, targets, dloss]`; output `dlogits = (softmax − onehot) · dloss / N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrossEntropyBackward;

impl OpRule for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        expect_dtype(self.name(), inputs, 1, DType::I32)?;
        check(self.name(), inputs[0], inputs[1])?;
        Ok(vec![
            OutSpec::f32(inputs[0].shape.clone()).with_dtype(inputs[0].dtype)
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "cross_entropy_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        4 * inputs[0].numel() as u64
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (logits, targets, dloss, dl) = (k.in_f32(0), k.in_i32(1), k.in_f32(2), k.out_f32(0));
        let (n, v) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let g = dloss[0] / n as f32;
        super::par::rows_mut(dl, v, |r0, rows| {
            for (r, out) in rows.chunks_exact_mut(v).enumerate() {
                let row = &logits[(r0 + r) * v..(r0 + r + 1) * v];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = super::math::exp(x - max);
                    sum += *o;
                }
                let inv = g / sum;
                out.iter_mut().for_each(|o| *o *= inv);
                let t = targets[r0 + r].clamp(0, v as i32 - 1) as usize;
                out[t] -= g;
            }
        });
    }
}
