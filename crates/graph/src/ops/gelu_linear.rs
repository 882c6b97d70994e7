//! `gelu(h) · w + b`: GELU fused into the linear layer that reads it (a transformer MLP's
//! down-projection).
//!
//! The GELU output is made a tile of rows at a time in the kernel's workspace, read by the GEMM
//! while it is still in cache, and never stored: the step keeps only `h`. The backward makes it
//! again, tile by tile, in the same pass that turns `dy · wᵀ` into `dh`, so the recomputation
//! reads nothing an unfused backward would not (the unfused GELU backward reads `h` too).
//! Per MLP that is one `rows × 4·width` activation less to hold and two passes over it less.

use super::{
    expect_arity, float_dtype, linear_dims, shape_err, tile_rows, tile_rows_in_blocks, GeluApprox,
    OpRule, OutSpec, SumTo,
};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Elements of GELU output the forward makes at once where our GEMM cannot take GELU as it
/// packs: 8 MiB, so the tile stays in the last-level cache between its GELU and its GEMM.
pub const TILE_ELEMS: usize = 1 << 21;
/// The backward's tile (at most 4 MiB): it is live beside nearly every saved activation of the
/// step (the last block's MLP runs its backward first), so it is smaller, at the cost of
/// revisiting the weight gradient a few more times (char-small: eight tiles of 512 rows).
const BACKWARD_TILE_ELEMS: usize = 1 << 20;

/// Rows of the backward's tile on a target whose GEMM sums `depth_block` at a time: the
/// weight gradient is summed over tiles.
fn backward_tile_rows(rows: usize, k: usize, depth_block: usize) -> usize {
    tile_rows_in_blocks(rows, k, BACKWARD_TILE_ELEMS, depth_block)
}

/// Inputs `[h, w, b]` with `h: [.., k]`, `w: [k, n]`, `b: [n]`; output `[.., n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GeluLinear {
    pub approx: GeluApprox,
}

impl OpRule for GeluLinear {
    fn name(&self) -> &'static str {
        "gelu_linear"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let (h, w) = (&inputs[0].shape, &inputs[1].shape);
        let (_, _, n) = linear_dims(self.name(), h, w)?;
        if inputs[2].shape != [n] {
            return Err(shape_err(
                self.name(),
                format!("bias has shape {:?}, expected [{n}]", inputs[2].shape),
            ));
        }
        let mut shape = h.clone();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        Ok(vec![OutSpec::f32(shape).with_dtype(dtype)])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        if ctx.wants(0) || ctx.wants(1) {
            let (h, w) = (ctx.input(0), ctx.input(1));
            let g = ctx.apply(
                GeluLinearBackward {
                    approx: self.approx,
                },
                &[h, w, dy],
            )?;
            for (i, &grad) in g.iter().enumerate() {
                if ctx.wants(i) {
                    ctx.set_grad(i, grad);
                }
            }
        }
        if ctx.wants(2) {
            let shape = ctx.input_shape(2);
            let db = ctx.apply1(SumTo { shape }, &[dy])?;
            ctx.set_grad(2, db);
        }
        Ok(())
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        linear_dims(self.name(), &inputs[0].shape, &inputs[1].shape)
            .map_or(0, |(rows, k, _)| tile_rows(rows, k, TILE_ELEMS) * k)
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        linear_dims(self.name(), &inputs[0].shape, &inputs[1].shape).map_or(0, |(rows, k, n)| {
            super::flops_of(2, &[rows, k, n]).saturating_add(super::flops_of(8, &[rows, k]))
        })
    }
}

/// Inputs `[h, w, dy]`; outputs `[dh, dw]` of `y = gelu(h) · w + b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GeluLinearBackward {
    pub approx: GeluApprox,
}

impl OpRule for GeluLinearBackward {
    fn name(&self) -> &'static str {
        "gelu_linear_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let (h, w, dy) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
        let (_, _, n) = linear_dims(self.name(), h, w)?;
        if dy.len() != h.len() || dy[..dy.len() - 1] != h[..h.len() - 1] || dy[dy.len() - 1] != n {
            return Err(shape_err(
                self.name(),
                format!("dy {dy:?} does not match h {h:?} and w {w:?}"),
            ));
        }
        Ok(vec![
            OutSpec::f32(h.clone()).with_dtype(dtype),
            OutSpec::f32(w.clone()),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "gelu_linear_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        linear_dims(self.name(), &inputs[0].shape, &inputs[1].shape).map_or(0, |(rows, k, _)| {
            backward_tile_rows(rows, k, target.depth_block()) * k
        })
    }

    /// `dh` may be written over `h`: the kernel reads each element of `h` before writing it.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        linear_dims(self.name(), &inputs[0].shape, &inputs[1].shape).map_or(0, |(rows, k, n)| {
            super::flops_of(4, &[rows, k, n]).saturating_add(super::flops_of(20, &[rows, k]))
        })
    }
}

// Called inside the kernels' loops with the const parameter, so that each loop is compiled for
// one variant and vectorises (a captured runtime value would leave a branch in the loop).
