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
fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
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

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let (outer, n, inner) = split_axis(k.in_shape(0), self.axis);
        let kind = self.kind;
        super::par::rows_mut(y, inner, |row0, rows| {
            for (r, out) in rows.chunks_exact_mut(inner).enumerate() {
                let o = row0 + r;
                let base = o * n * inner;
                let init = if kind == ReduceKind::Max {
                    f32::NEG_INFINITY
                } else {
                    0.0
                };
                out.fill(init);
                for j in 0..n {
                    let src = &x[base + j * inner..base + (j + 1) * inner];
                    for (acc, &v) in out.iter_mut().zip(src) {
                        *acc = if kind == ReduceKind::Max {
                            acc.max(v)
                        } else {
                            *acc + v
                        };
                    }
                }
                if kind == ReduceKind::Mean {
                    let inv = 1.0 / n as f32;
                    out.iter_mut().for_each(|v| *v *= inv);
                }
            }
        });
        debug_assert_eq!(y.len(), outer * inner);
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

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (x, dy, dx) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let (outer, n, inner) = split_axis(k.in_shape(0), self.axis);
        dx.fill(0.0);
        for o in 0..outer {
            for i in 0..inner {
                let mut best = 0;
                for j in 1..n {
                    if x[(o * n + j) * inner + i] > x[(o * n + best) * inner + i] {
                        best = j;
                    }
                }
                dx[(o * n + best) * inner + i] = dy[o * inner + i];
            }
        }
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
            threads * n
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

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use super::broadcast::Mapping;
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        match Mapping::new(&self.shape, k.in_shape(0)) {
            Mapping::Same => y.copy_from_slice(x),
            Mapping::Cycle(n) => {
                // A bias gradient: each worker sums a contiguous block of rows into its own
                // partial, and the partials are added in order (deterministic for a thread count).
                use rayon::prelude::*;
                let rows = x.len() / n;
                let ws = k.workspace();
                let parts = (ws.len() / n).clamp(1, rows.max(1));
                let rows_per = rows.div_ceil(parts);
                let sum_rows = |p: usize, acc: &mut [f32]| {
                    acc.fill(0.0);
                    for r in p * rows_per..((p + 1) * rows_per).min(rows) {
                        for (a, &v) in acc.iter_mut().zip(&x[r * n..(r + 1) * n]) {
                            *a += v;
                        }
                    }
                };
                if parts <= 1 {
                    sum_rows(0, y);
                    return;
                }
                ws.par_chunks_mut(n)
                    .take(parts)
                    .enumerate()
                    .for_each(|(p, acc)| sum_rows(p, acc));
                y.copy_from_slice(&ws[..n]);
                for part in ws.chunks_exact(n).take(parts).skip(1) {
                    y.iter_mut().zip(part).for_each(|(a, b)| *a += b);
                }
            }
            Mapping::Spread(n) => {
                super::par::rows_mut(y, 1, |o0, outs| {
                    for (j, out) in outs.iter_mut().enumerate() {
                        let o = o0 + j;
                        *out = x[o * n..(o + 1) * n].iter().sum();
                    }
                });
            }
            m @ Mapping::Strided { .. } => {
                y.fill(0.0);
                for (i, &v) in x.iter().enumerate() {
                    y[m.index(i)] += v;
                }
            }
        }
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

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let m = super::broadcast::Mapping::new(k.in_shape(0), &self.shape);
        super::par::elems_mut(y, |start, out| {
            for (j, o) in out.iter_mut().enumerate() {
                *o = x[m.index(start + j)];
            }
        });
    }
}
