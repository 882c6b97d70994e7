//! Conversion between f32 and the 16-bit floats (bf16, f16), rounding to nearest even. The
//! mixed-precision pass inserts these; no other kernel reads or writes 16-bit tensors.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, Result};

/// `x` converted to `to` (f32 from a 16-bit float, or a 16-bit float from f32). Values beyond
/// the target's range become ±inf, as in every framework's casts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cast {
    pub to: DType,
}

impl OpRule for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let from = inputs[0].dtype;
        let ok = matches!(
            (from, self.to),
            (DType::F32, DType::BF16 | DType::F16) | (DType::BF16 | DType::F16, DType::F32)
        );
        if !ok {
            return Err(shape_err(
                self.name(),
                format!("cannot cast {from} to {} (f32 <-> bf16/f16 only)", self.to),
            ));
        }
        Ok(vec![
            OutSpec::f32(inputs[0].shape.clone()).with_dtype(self.to)
        ])
    }

    /// The gradient goes back through the opposite cast, so it is rounded where the value was.
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let x = ctx.input(0);
            let from = ctx.graph().tensor(x).dtype;
            let dx = ctx.apply1(Cast { to: from }, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }

    /// Bandwidth, not arithmetic: timed by bytes like the views and copies.
    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}
