//! Gradient accumulation across micro-batches: one optimizer step sees the sum of the
//! gradients of several forward/backward passes, so a large effective batch fits in the memory
//! of a small one.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Inputs `[accumulator, grad]`, output the summed gradient.
///
/// On every micro-batch but the last the op writes `accumulator ← grad` (first) or
/// `accumulator + grad` and leaves its output untouched: only the optimizer reads the output,
/// and it runs on the last micro-batch alone. On the last one it writes `accumulator + grad`
/// to the output without touching the accumulator, so the sum never needs a second copy in
/// persistent memory.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AccumulateGrad;

impl OpRule for AccumulateGrad {
    fn name(&self) -> &'static str {
        "accumulate_grad"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        if inputs[0].shape != inputs[1].shape {
            return Err(shape_err(
                self.name(),
                format!(
                    "gradient {:?} differs from its accumulator {:?}",
                    inputs[1].shape, inputs[0].shape
                ),
            ));
        }
        if !inputs[0].role.is_persistent() {
            return Err(GraphError::Invalid {
                op: "accumulate_grad",
                detail: format!(
                    "`{}` carries sums between micro-batches and must be persistent",
                    inputs[0].name
                ),
            });
        }
        Ok(vec![
            OutSpec::f32(inputs[1].shape.clone()).with_dtype(inputs[1].dtype)
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "accumulate_grad",
            detail: "gradient accumulation has no gradient".into(),
        })
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[0]
    }
}
