//! `layer_norm(x) · w + b`: LayerNorm fused into the linear layer that reads it (a pre-norm
//! transformer's QKV and MLP up-projections).
//!
//! The normalised rows are made a tile at a time in the kernel's workspace and fed to the GEMM;
//! they are never stored. The step keeps `x` (the residual stream, which the unfused LayerNorm
//! backward reads anyway) and each row's mean and reciprocal standard deviation, so per norm one
//! `rows × width` activation less is held from the forward to the backward. The backward remakes
//! each tile's normalised rows from the saved statistics, bit for bit those of the forward, for
//! the weight gradient, then runs the LayerNorm backward on the same tile while it is in cache.

use super::{expect_arity, float_dtype, linear_dims, shape_err, tile_rows, OpRule, OutSpec, SumTo};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Elements of normalised rows made at once (2 MiB): the backward's tile is live beside nearly
/// every saved activation of the step (its last block's norms run first), so it is kept small.
pub const TILE_ELEMS: usize = 1 << 19;
/// The forward's tile (8 MiB): it sits beside only the activations saved so far, and each tile
/// costs every thread a packing of the whole weight, which at 2^19 elements took a tenth of
/// the forward's time.
pub const FORWARD_TILE_ELEMS: usize = 1 << 21;

/// One tile of at most `max` elements of normalised rows (`inputs` start with `x`; `w` is
/// input `w_at`).
fn tile_elems(inputs: &[&TensorMeta], w_at: usize, max: usize) -> usize {
    linear_dims("layer_norm_linear", &inputs[0].shape, &inputs[w_at].shape)
        .map_or(0, |(rows, k, _)| tile_rows(rows, k, max) * k)
}

/// Inputs `[x, ln_w, ln_b, w, b]` with `x: [.., k]`, `ln_w, ln_b: [k]`, `w: [k, n]`, `b: [n]`;
/// outputs `[y: [.., n], mean, rstd]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormLinear {
    pub eps: f32,
}

impl Default for LayerNormLinear {
    fn default() -> Self {
        LayerNormLinear { eps: 1e-5 }
    }
}

impl OpRule for LayerNormLinear {
    fn name(&self) -> &'static str {
        "layer_norm_linear"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 5)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let (x, w) = (&inputs[0].shape, &inputs[3].shape);
        let (_, k, n) = linear_dims(self.name(), x, w)?;
        for (i, what, len) in [(1, "norm weight", k), (2, "norm bias", k), (4, "bias", n)] {
            if inputs[i].shape != [len] {
                return Err(shape_err(
                    self.name(),
                    format!("{what} has shape {:?}, expected [{len}]", inputs[i].shape),
                ));
            }
        }
        let mut y = x.clone();
        if let Some(last) = y.last_mut() {
            *last = n;
        }
        let stats = x[..x.len() - 1].to_vec();
        Ok(vec![
            OutSpec::f32(y).with_dtype(dtype),
            OutSpec::f32(stats.clone()).named("mean"),
            OutSpec::f32(stats).named("rstd"),
        ])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        if (0..4).any(|i| ctx.wants(i)) {
            let ins = [
                ctx.input(0),
                ctx.input(1),
                ctx.input(2),
                ctx.output(1),
                ctx.output(2),
                ctx.input(3),
                dy,
            ];
            let g = ctx.apply(LayerNormLinearBackward, &ins)?;
            for (i, &grad) in g.iter().enumerate() {
                if ctx.wants(i) {
                    ctx.set_grad(i, grad);
                }
            }
        }
        if ctx.wants(4) {
            let shape = ctx.input_shape(4);
            let db = ctx.apply1(SumTo { shape }, &[dy])?;
            ctx.set_grad(4, db);
        }
        Ok(())
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        tile_elems(inputs, 3, FORWARD_TILE_ELEMS)
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        linear_dims(self.name(), &inputs[0].shape, &inputs[3].shape).map_or(0, |(rows, k, n)| {
            super::flops_of(2, &[rows, k, n]).saturating_add(super::flops_of(8, &[rows, k]))
        })
    }
}

/// Inputs `[x, ln_w, ln_b, mean, rstd, w, dy]`; outputs `[dx, d_ln_w, d_ln_b, dw]` of
/// `y = layer_norm(x) · w + b` (the bias gradient is `dy` summed over rows, made apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerNormLinearBackward;

impl OpRule for LayerNormLinearBackward {
    fn name(&self) -> &'static str {
        "layer_norm_linear_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 7)?;
        // The statistics are f32 whatever the activations' type.
        let (x_w_dy, stats_in) = (
            [inputs[0], inputs[1], inputs[2], inputs[5], inputs[6]],
            [inputs[3], inputs[4]],
        );
        let dtype = float_dtype(self.name(), &x_w_dy)?;
        float_dtype(self.name(), &stats_in)?;
        let (x, w, dy) = (&inputs[0].shape, &inputs[5].shape, &inputs[6].shape);
        let (_, k, n) = linear_dims(self.name(), x, w)?;
        let stats = &x[..x.len() - 1];
        let fits = dy.len() == x.len()
            && dy[..dy.len() - 1] == *stats
            && dy[dy.len() - 1] == n
            && inputs[1].shape == [k]
            && inputs[2].shape == [k]
            && inputs[3].shape == stats
            && inputs[4].shape == stats;
        if !fits {
            return Err(shape_err(
                self.name(),
                format!(
                    "x {x:?}, norm weight {:?}, norm bias {:?}, mean {:?}, rstd {:?}, w {w:?} \
                     and dy {dy:?} do not agree",
                    inputs[1].shape, inputs[2].shape, inputs[3].shape, inputs[4].shape
                ),
            ));
        }
        Ok(vec![
            OutSpec::f32(x.clone()).with_dtype(dtype),
            OutSpec::f32(vec![k]).with_dtype(inputs[1].dtype),
            OutSpec::f32(vec![k]).with_dtype(inputs[2].dtype),
            OutSpec::f32(w.clone()).with_dtype(inputs[5].dtype),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "layer_norm_linear_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One tile of rows (the norm's output gradient, and where our GEMM does not run the
    /// weight gradient, the normalised rows before it), then one partial `d_ln_w` and
    /// `d_ln_b` per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        tile_elems(inputs, 5, TILE_ELEMS) + 2 * threads.max(1) * inputs[1].numel()
    }

    /// `dx` may be written over `x`: each row of `x` is read (for the weight gradient, then
    /// for its own LayerNorm backward) before that row of `dx` is written.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        linear_dims(self.name(), &inputs[0].shape, &inputs[5].shape)
            .map_or(0, |(rows, k, n)| (4 * rows * k * n + 20 * rows * k) as u64)
    }
}
