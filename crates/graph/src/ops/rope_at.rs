//! [`super::Rope`] starting at a position given at run time: inputs `[x [B, T, n_head·D],
//! pos i32 [1]]`, row `t` rotated as position `pos + t`. Sampling with a key/value cache feeds
//! one new token at a time, whose position is only known when it runs. Forward only.

use super::rope::{dims, Rope};
use super::{expect_arity, expect_dtype, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeAt {
    /// The rotation (heads, frequencies, scaling); its position 0 is `pos`.
    pub rope: Rope,
}

impl OpRule for RopeAt {
    fn name(&self) -> &'static str {
        "rope_at"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        let dtype = float_dtype(self.name(), &inputs[..1])?;
        dims(&self.rope, &inputs[0].shape)?;
        expect_dtype(self.name(), inputs, 1, DType::I32)?;
        if inputs[1].shape != [1] {
            return Err(shape_err(
                self.name(),
                format!("pos must be [1], got {:?}", inputs[1].shape),
            ));
        }
        Ok(vec![OutSpec::f32(inputs[0].shape.clone()).with_dtype(dtype)])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "rope_at",
            detail: "a rotation at a run-time position is for inference; it has no gradient".into(),
        })
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        self.rope.workspace_elems(&inputs[..1], target)
    }

    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        3 * outputs[0].numel() as u64
    }
}
