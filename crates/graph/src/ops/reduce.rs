//! Reductions over one axis (sum, mean, max), and the pair that moves between a shape and its
//! broadcast: `SumTo` (the gradient of broadcasting) and `BroadcastTo` (the gradient of summing).

use super::broadcast::broadcasts_to;
use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec, Reshape, Scale};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
}

/// Reduces `axis`, keeping it as a size-1 axis when `keepdim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reduce {
    pub kind: ReduceKind,
    pub axis: usize,
    pub keepdim: bool,
}

/// `[outer, n, inner]` view of a shape around `axis`.
pub fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product();
    (outer, shape[axis], inner)
}

impl Reduce {
    fn kept_shape(shape: &[usize], axis: usize) -> Vec<usize> {
        let mut s = shape.to_vec();
        s[axis] = 1;
        s
    }
}

impl OpRule for Reduce {
    fn name(&self) -> &'static str {
        match self.kind {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
            ReduceKind::Max => "max",
        }
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let shape = &inputs[0].shape;
        if self.axis >= shape.len() {
            return Err(shape_err(
                self.name(),
                format!("axis {} out of range for shape {shape:?}", self.axis),
            ));
        }
        let out = if self.keepdim {
            Self::kept_shape(shape, self.axis)
        } else {
            let mut s = shape.clone();
            s.remove(self.axis);
            s
        };
        let mut spec = OutSpec::f32(out);
        spec.dtype = dtype;
        Ok(vec![spec])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        let x_shape = ctx.input_shape(0);
        let dx = match self.kind {
            ReduceKind::Sum | ReduceKind::Mean => {
                let kept = Self::kept_shape(&x_shape, self.axis);
                let dy = ctx.apply1(Reshape { shape: kept }, &[dy])?;
                let dx = ctx.apply1(
                    BroadcastTo {
                        shape: x_shape.clone(),
                    },
                    &[dy],
                )?;
                if self.kind == ReduceKind::Mean {
                    let n = x_shape[self.axis] as f32;
                    ctx.apply1(Scale { factor: 1.0 / n }, &[dx])?
                } else {
                    dx
                }
            }
            ReduceKind::Max => {
                let x = ctx.input(0);
                ctx.apply1(MaxBackward { axis: self.axis }, &[x, dy])?
            }
        };
        ctx.set_grad(0, dx);
        Ok(())
    }
}

/// Gradient of a max reduction: `dy` flows to the first maximal element along `axis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxBackward {
    pub axis: usize,
}

impl OpRule for MaxBackward {
    fn name(&self) -> &'static str {
        "max_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        let x = &inputs[0].shape;
        let (outer, _, inner) = split_axis(x, self.axis);
        if inputs[1].numel() != outer * inner {
            return Err(shape_err(
                self.name(),
                format!("dy {:?} does not match x {x:?}", inputs[1].shape),
            ));
        }
        Ok(vec![OutSpec::f32(x.clone()).with_dtype(inputs[0].dtype)])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(crate::GraphError::Invalid {
            op: "max_backward",
            detail: "second derivatives are not supported".into(),
        })
    }
}

/// Sums `x` down to `shape`, which must broadcast to `x`'s shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SumTo {
    pub shape: Vec<usize>,
}

impl OpRule for SumTo {
    fn name(&self) -> &'static str {
        "sum_to"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let dtype = float_dtype(self.name(), inputs)?;
        if !broadcasts_to(&self.shape, &inputs[0].shape) {
            return Err(shape_err(
                self.name(),
                format!(
                    "{:?} does not broadcast to {:?}",
                    self.shape, inputs[0].shape
                ),
            ));
        }
        let mut spec = OutSpec::f32(self.shape.clone());
        spec.dtype = dtype;
        Ok(vec![spec])
    }

    /// One partial sum per worker when summing over rows (a bias gradient).
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        let n: usize = self.shape.iter().product();
        let rows = inputs[0].numel() / n.max(1);
        if threads > 1 && rows >= 2 * threads && n * rows >= super::MIN_PAR_ELEMS {
            threads.saturating_mul(n)
        } else {
            0
        }
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let shape = ctx.input_shape(0);
            let dx = ctx.apply1(BroadcastTo { shape }, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
}

/// Repeats `x` along the axes where it has size 1 (or is missing) to reach `shape`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BroadcastTo {
    pub shape: Vec<usize>,
}

impl OpRule for BroadcastTo {
    fn name(&self) -> &'static str {
        "broadcast_to"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let dtype = float_dtype(self.name(), inputs)?;
        if !broadcasts_to(&inputs[0].shape, &self.shape) {
            return Err(shape_err(
                self.name(),
                format!(
                    "{:?} does not broadcast to {:?}",
                    inputs[0].shape, self.shape
                ),
            ));
        }
        let mut spec = OutSpec::f32(self.shape.clone());
        spec.dtype = dtype;
        Ok(vec![spec])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let shape = ctx.input_shape(0);
            let dx = ctx.apply1(SumTo { shape }, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }
}
