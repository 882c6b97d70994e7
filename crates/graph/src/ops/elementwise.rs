//! Binary arithmetic with broadcasting, and scaling by a constant.

use super::broadcast::broadcast_shape;
use super::{expect_arity, float_dtype, OpRule, OutSpec, SumTo};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{Result, TensorId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
}

/// `a ∘ b` elementwise, broadcasting NumPy-style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binary {
    pub kind: BinaryKind,
}

impl Binary {
    pub fn add() -> Self {
        Binary {
            kind: BinaryKind::Add,
        }
    }
    pub fn sub() -> Self {
        Binary {
            kind: BinaryKind::Sub,
        }
    }
    pub fn mul() -> Self {
        Binary {
            kind: BinaryKind::Mul,
        }
    }
    pub fn div() -> Self {
        Binary {
            kind: BinaryKind::Div,
        }
    }
}

/// Sums `g` back to `shape` when broadcasting stretched it.
fn unbroadcast(ctx: &mut GradCtx<'_>, g: TensorId, shape: Vec<usize>) -> Result<TensorId> {
    if ctx.graph().tensor(g).shape == shape {
        Ok(g)
    } else {
        ctx.apply1(SumTo { shape }, &[g])
    }
}

impl OpRule for Binary {
    fn name(&self) -> &'static str {
        match self.kind {
            BinaryKind::Add => "add",
            BinaryKind::Sub => "sub",
            BinaryKind::Mul => "mul",
            BinaryKind::Div => "div",
        }
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let shape = broadcast_shape(self.name(), &inputs[0].shape, &inputs[1].shape)?;
        let mut spec = OutSpec::f32(shape);
        spec.dtype = dtype;
        Ok(vec![spec])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dc) = ctx.grad_out(0) else {
            return Ok(());
        };
        let (a, b, c) = (ctx.input(0), ctx.input(1), ctx.output(0));
        let (sa, sb) = (ctx.input_shape(0), ctx.input_shape(1));
        let (ga, gb) = match self.kind {
            BinaryKind::Add => (Some(dc), Some(dc)),
            BinaryKind::Sub => {
                let gb = if ctx.wants(1) {
                    Some(ctx.apply1(Scale { factor: -1.0 }, &[dc])?)
                } else {
                    None
                };
                (Some(dc), gb)
            }
            BinaryKind::Mul => {
                let ga = if ctx.wants(0) {
                    Some(ctx.apply1(Binary::mul(), &[dc, b])?)
                } else {
                    None
                };
                let gb = if ctx.wants(1) {
                    Some(ctx.apply1(Binary::mul(), &[dc, a])?)
                } else {
                    None
                };
                (ga, gb)
            }
            BinaryKind::Div => {
                let ga = if ctx.wants(0) {
                    Some(ctx.apply1(Binary::div(), &[dc, b])?)
                } else {
                    None
                };
                let gb = if ctx.wants(1) {
                    // d(a/b)/db = -(a/b)/b = -c/b
                    let t = ctx.apply1(Binary::mul(), &[dc, c])?;
                    let t = ctx.apply1(Binary::div(), &[t, b])?;
                    Some(ctx.apply1(Scale { factor: -1.0 }, &[t])?)
                } else {
                    None
                };
                (ga, gb)
            }
        };
        if let (Some(g), true) = (ga, ctx.wants(0)) {
            let g = unbroadcast(ctx, g, sa)?;
            ctx.set_grad(0, g);
        }
        if let (Some(g), true) = (gb, ctx.wants(1)) {
            let g = unbroadcast(ctx, g, sb)?;
            ctx.set_grad(1, g);
        }
        Ok(())
    }

    fn inplace_inputs(&self) -> &'static [usize] {
        &[0, 1]
    }
}

/// `x · factor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub factor: f32,
}

impl OpRule for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        super::same_as_input(self.name(), inputs)
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let dx = ctx.apply1(*self, &[dy])?;
            ctx.set_grad(0, dx);
        }
        Ok(())
    }

    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
    }
}
