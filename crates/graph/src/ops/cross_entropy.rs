//! Mean cross-entropy of logits against integer targets, and its gradient; optionally with a
//! loss mask, so that only the targets it counts are averaged.

use super::{expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Inputs `[logits [N, V], targets [N] (i32)]`, output the scalar mean loss; or, masked,
/// `[logits, targets, mask [N] (f32), divisor [] (f32)]`, output `Σ mask·ce / divisor`.
///
/// The mask weighs each row's loss (0 or 1 for a loss mask; a row weighted 0 contributes
/// nothing, to the loss or to the gradient). The divisor is fed at run time, so a trainer can
/// average over every counted token of a whole optimizer step rather than of one micro-batch;
/// a divisor of 0 (nothing counted) gives a loss of 0 and zero gradients.
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

/// Checks the loss-mask inputs `inputs[at..at + 2]` (a mask `[n]` and a scalar divisor, both
/// f32), when there are `at + 2` inputs; `at` alone is unmasked. Shared with the fused
/// LM-head loss.
pub(crate) fn check_mask(
    op: &'static str,
    inputs: &[&TensorMeta],
    at: usize,
    n: usize,
) -> Result<bool> {
    match inputs.len() {
        l if l == at => Ok(false),
        l if l == at + 2 => {
            expect_dtype(op, inputs, at, DType::F32)?;
            expect_dtype(op, inputs, at + 1, DType::F32)?;
            if inputs[at].shape != [n] || inputs[at + 1].numel() != 1 {
                return Err(shape_err(
                    op,
                    format!(
                        "loss mask {:?} must be [{n}] and its divisor {:?} a scalar",
                        inputs[at].shape,
                        inputs[at + 1].shape
                    ),
                ));
            }
            Ok(true)
        }
        got => Err(GraphError::Arity {
            op,
            expected: at,
            got,
        }),
    }
}

impl OpRule for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.len() < 2 {
            return Err(GraphError::Arity {
                op: self.name(),
                expected: 2,
                got: inputs.len(),
            });
        }
        expect_dtype(self.name(), inputs, 1, DType::I32)?;
        check(self.name(), inputs[0], inputs[1])?;
        check_mask(self.name(), inputs, 2, inputs[0].shape[0])?;
        Ok(vec![OutSpec::f32(vec![])])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let (Some(dl), true) = (ctx.grad_out(0), ctx.wants(0)) {
            let mut ins = vec![ctx.input(0), ctx.input(1), dl];
            if ctx.input_count() == 4 {
                ins.extend([ctx.input(2), ctx.input(3)]);
            }
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

/// Inputs `[logits, targets, dloss]`, output `dlogits = (softmax − onehot) · dloss / N`; or,
/// masked, `[logits, targets, dloss, mask, divisor]`, output
/// `(softmax − onehot) · dloss · mask / divisor` (rows weighted 0, and every row when the
/// divisor is 0, are zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrossEntropyBackward;

impl OpRule for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.len() < 3 {
            return Err(GraphError::Arity {
                op: self.name(),
                expected: 3,
                got: inputs.len(),
            });
        }
        expect_dtype(self.name(), inputs, 1, DType::I32)?;
        check(self.name(), inputs[0], inputs[1])?;
        check_mask(self.name(), inputs, 3, inputs[0].shape[0])?;
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
