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
}
