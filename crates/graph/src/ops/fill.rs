//! A constant tensor (the loss gradient seed, zero gradients).

use super::{expect_arity, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct Fill {
    pub value: f32,
    pub shape: Vec<usize>,
}

impl OpRule for Fill {
    fn name(&self) -> &'static str {
        "fill"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 0)?;
        Ok(vec![OutSpec::f32(self.shape.clone())])
    }
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}
