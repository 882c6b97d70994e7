//! AdamW (decoupled weight decay, as `torch.optim.AdamW`), updating a parameter and its two
//! moments in place.

use super::{OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Inputs `[param, grad, m, v]` and optionally a scalar `[scale]` the gradient is multiplied by
/// (clipping, micro-batch averaging); writes `param`, `m` and `v`. The learning rate and step
/// count come from the runtime each step, so one compiled graph serves a whole schedule. With
/// gradient accumulation it runs on the last micro-batch only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl OpRule for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        super::check_update_inputs(self.name(), inputs, 4)?;
        super::check_persistent("adamw", inputs, [0, 2, 3])?;
        Ok(vec![])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "adamw",
            detail: "an optimizer update has no gradient".into(),
        })
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[0, 2, 3]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        12 * inputs[0].numel() as u64
    }
}
