//! Shape changes. `Reshape` and `Narrow` (rows of the first axis) are views: they share their
//! input's storage and copy nothing. `Transpose` materialises; `Pad` is `Narrow`'s gradient.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::Result;

/// Same elements, new shape (a view).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reshape {
    pub shape: Vec<usize>,
}

impl OpRule for Reshape {
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let n: usize = self.shape.iter().product();
        if n != inputs[0].numel() {
            return Err(shape_err(
                self.name(),
                format!("cannot reshape {:?} to {:?}", inputs[0].shape, self.shape),
            ));
        }
        Ok(vec![OutSpec {
            shape: self.shape.clone(),
            dtype: inputs[0].dtype,
            view_of_input: Some((0, 0)),
            suffix: None,
        }])
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let shape = ctx.input_shape(0);
            let dx = ctx.apply1(Reshape { shape }, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// Rows `start .. start + len` of the first axis (a view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Narrow {
    pub start: usize,
    pub len: usize,
}

impl OpRule for Narrow {
    fn name(&self) -> &'static str {
        "narrow"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let shape = &inputs[0].shape;
        let Some(&rows) = shape.first() else {
            return Err(shape_err(self.name(), "input must have at least one axis"));
        };
        if self.len == 0 || self.start + self.len > rows {
            return Err(shape_err(
                self.name(),
                format!(
                    "rows {}..{} out of range for {shape:?}",
                    self.start,
                    self.start + self.len
                ),
            ));
        }
        let row: usize = shape[1..].iter().product();
        let mut out = shape.clone();
        out[0] = self.len;
        Ok(vec![OutSpec {
            shape: out,
            dtype: inputs[0].dtype,
            view_of_input: Some((0, self.start * row)),
            suffix: None,
        }])
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let total = ctx.input_shape(0)[0];
            let dx = ctx.apply1(
                Pad {
                    start: self.start,
                    total,
                },
                &[dy],
            )?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// Places the input at rows `start..` of a zero tensor with `total` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pad {
    pub start: usize,
    pub total: usize,
}

impl OpRule for Pad {
    fn name(&self) -> &'static str {
        "pad"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let shape = &inputs[0].shape;
        let Some(&rows) = shape.first() else {
            return Err(shape_err(self.name(), "input must have at least one axis"));
        };
        if self.start + rows > self.total {
            return Err(shape_err(
                self.name(),
                format!("{shape:?} does not fit in {} rows", self.total),
            ));
        }
        let mut out = shape.clone();
        out[0] = self.total;
        Ok(vec![OutSpec::f32(out).with_dtype(inputs[0].dtype)])
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let len = ctx.input_shape(0)[0];
            let dx = ctx.apply1(
                Narrow {
                    start: self.start,
                    len,
                },
                &[dy],
            )?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
}

/// Swaps two axes, copying into the new layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transpose {
    pub dim0: usize,
    pub dim1: usize,
}

impl OpRule for Transpose {
    fn name(&self) -> &'static str {
        "transpose"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let mut shape = inputs[0].shape.clone();
        if self.dim0 >= shape.len() || self.dim1 >= shape.len() {
            return Err(shape_err(
                self.name(),
                format!(
                    "axes {} and {} out of range for {shape:?}",
                    self.dim0, self.dim1
                ),
            ));
        }
        shape.swap(self.dim0, self.dim1);
        let mut spec = OutSpec::f32(shape);
        spec.dtype = inputs[0].dtype;
        Ok(vec![spec])
    }
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let dx = ctx.apply1(*self, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}
