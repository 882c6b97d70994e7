//! Plain SGD with decoupled weight decay: no optimizer state at all.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Inputs `[param, grad]` and optionally a scalar `[scale]`; writes
/// `param ← param·(1 − lr·wd) − lr·scale·grad`, on the last micro-batch of a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sgd {
    pub weight_decay: f32,
}

impl OpRule for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.len() != 3 {
            expect_arity(self.name(), inputs, 2)?;
        }
        super::check_grad_scale(self.name(), inputs, 2)?;
        if inputs[0].shape != inputs[1].shape {
            return Err(shape_err(
                self.name(),
                format!(
                    "gradient {:?} differs from parameter {:?}",
                    inputs[1].shape, inputs[0].shape
                ),
            ));
        }
        super::check_persistent("sgd", inputs, [0])?;
        Ok(vec![])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "sgd",
            detail: "an optimizer update has no gradient".into(),
        })
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[0]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        3 * inputs[0].numel() as u64
    }
}
