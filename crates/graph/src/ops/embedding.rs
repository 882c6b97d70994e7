//! Embedding lookup (a gather of rows) and its gradient (a scatter-add of rows).

use super::{expect_arity, expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Inputs `[table [V, C], ids (i32, any shape)]`; output `ids.shape + [C]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Embedding;

impl OpRule for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        expect_dtype(self.name(), inputs, 1, DType::I32)?;
        let table = &inputs[0].shape;
        if table.len() != 2 {
            return Err(shape_err(
                self.name(),
                format!("table must be [vocab, dim], got {table:?}"),
            ));
        }
        let mut shape = inputs[1].shape.clone();
        shape.push(table[1]);
        let mut spec = OutSpec::f32(shape);
        spec.dtype = inputs[0].dtype;
        Ok(vec![spec])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let (Some(dy), true) = (ctx.grad_out(0), ctx.wants(0)) {
            let vocab = ctx.input_shape(0)[0];
            let ids = ctx.input(1);
            let dt = ctx.apply1(EmbeddingBackward { vocab }, &[ids, dy])?;
            ctx.set_grad(0, dt);
        }
        Ok(())
    }

    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// Inputs `[ids, dy]`; output `[vocab, C]` with each `dy` row added into its id's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingBackward {
    pub vocab: usize,
}

impl OpRule for EmbeddingBackward {
    fn name(&self) -> &'static str {
        "embedding_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        expect_dtype(self.name(), inputs, 0, DType::I32)?;
        let dy = &inputs[1].shape;
        let Some(&c) = dy.last() else {
            return Err(shape_err(self.name(), "dy must have a feature axis"));
        };
        if dy[..dy.len() - 1] != inputs[0].shape[..] {
            return Err(shape_err(
                self.name(),
                format!("dy {dy:?} does not match ids {:?}", inputs[0].shape),
            ));
        }
        Ok(vec![
            OutSpec::f32(vec![self.vocab, c]).with_dtype(inputs[1].dtype)
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "embedding_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        inputs[1].numel() as u64
    }
}
