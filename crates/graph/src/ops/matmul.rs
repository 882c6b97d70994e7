//! Matrix multiply with transposed operands read in place (strides, never a materialised
//! transpose), an optional fused bias, and either a shared 2-D right operand (weights) or a
//! batch of right operands.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec, Reshape, SumTo};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::Result;

/// `op(a) · op(b) (+ bias)`, where `op` transposes the last two axes when its flag is set.
///
/// With a 2-D `b`, every leading axis of `a` is folded into the rows (a linear layer).
/// With a batched `b`, `a` and `b` share their leading axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatMul {
    pub ta: bool,
    pub tb: bool,
    pub bias: bool,
}

/// Sizes of one matmul as `batch` independent `[m,k]·[k,n]` products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatMulDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// `b` is one matrix shared by the whole batch.
    pub shared_b: bool,
}

impl MatMul {
    pub const NAME: &'static str = "matmul";

    pub fn dims(&self, a: &[usize], b: &[usize]) -> Result<MatMulDims> {
        let op = Self::NAME;
        if a.len() < 2 || b.len() < 2 {
            return Err(shape_err(
                op,
                format!("operands must be at least 2-D, got {a:?} and {b:?}"),
            ));
        }
        let (ar, ac) = (a[a.len() - 2], a[a.len() - 1]);
        let (br, bc) = (b[b.len() - 2], b[b.len() - 1]);
        let (mut m, ka) = if self.ta { (ac, ar) } else { (ar, ac) };
        let (kb, n) = if self.tb { (bc, br) } else { (br, bc) };
        if ka != kb {
            return Err(shape_err(
                op,
                format!(
                    "inner dimensions differ: {a:?}{} · {b:?}{}",
                    t(self.ta),
                    t(self.tb)
                ),
            ));
        }
        let a_batch: usize = a[..a.len() - 2].iter().product();
        let (batch, shared_b) = if b.len() == 2 {
            if self.ta && a.len() > 2 {
                return Err(shape_err(
                    op,
                    "a transposed, batched left operand needs a batched right operand",
                ));
            }
            m *= a_batch;
            (1, true)
        } else {
            if a[..a.len() - 2] != b[..b.len() - 2] {
                return Err(shape_err(
                    op,
                    format!("batch dimensions differ: {a:?} vs {b:?}"),
                ));
            }
            (a_batch, false)
        };
        Ok(MatMulDims {
            batch,
            m,
            k: ka,
            n,
            shared_b,
        })
    }
}

fn t(flag: bool) -> &'static str {
    if flag {
        "ᵀ"
    } else {
        ""
    }
}

impl OpRule for MatMul {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(Self::NAME, inputs, 2 + self.bias as usize)?;
        let dtype = float_dtype(Self::NAME, inputs)?;
        let (a, b) = (&inputs[0].shape, &inputs[1].shape);
        let d = self.dims(a, b)?;
        if self.bias && inputs[2].shape != [d.n] {
            return Err(shape_err(
                Self::NAME,
                format!("bias has shape {:?}, expected [{}]", inputs[2].shape, d.n),
            ));
        }
        let mut shape = a[..a.len() - 2].to_vec();
        shape.push(if self.ta {
            a[a.len() - 1]
        } else {
            a[a.len() - 2]
        });
        shape.push(d.n);
        let mut spec = OutSpec::f32(shape);
        spec.dtype = dtype;
        Ok(vec![spec])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dc) = ctx.grad_out(0) else {
            return Ok(());
        };
        let (a, b) = (ctx.input(0), ctx.input(1));
        let (ta, tb) = (self.ta, self.tb);
        if ctx.wants(0) {
            let da = if !ta {
                // dA = dC · op(B)ᵀ
                ctx.apply1(
                    MatMul {
                        ta: false,
                        tb: !tb,
                        bias: false,
                    },
                    &[dc, b],
                )?
            } else {
                // A is stored transposed: dAᵀ = op(B) · dCᵀ
                ctx.apply1(
                    MatMul {
                        ta: tb,
                        tb: true,
                        bias: false,
                    },
                    &[b, dc],
                )?
            };
            ctx.set_grad(0, da);
        }
        if ctx.wants(1) {
            let b_rank = ctx.input_shape(1).len();
            let (a2, dc2) = if b_rank == 2 {
                // A shared weight sums over every row of the batch: fold leading axes (views).
                let a_shape = ctx.input_shape(0);
                let dc_shape = ctx.graph().tensor(dc).shape.clone();
                (flatten2(ctx, a, &a_shape)?, flatten2(ctx, dc, &dc_shape)?)
            } else {
                (a, dc)
            };
            let db = if !tb {
                // dB = op(A)ᵀ · dC
                ctx.apply1(
                    MatMul {
                        ta: !ta,
                        tb: false,
                        bias: false,
                    },
                    &[a2, dc2],
                )?
            } else {
                // B is stored transposed: dBᵀ = dCᵀ · op(A)
                ctx.apply1(
                    MatMul {
                        ta: true,
                        tb: ta,
                        bias: false,
                    },
                    &[dc2, a2],
                )?
            };
            ctx.set_grad(1, db);
        }
        if self.bias && ctx.wants(2) {
            let n = ctx.input_shape(2);
            let dbias = ctx.apply1(SumTo { shape: n }, &[dc])?;
            ctx.set_grad(2, dbias);
        }
        Ok(())
    }

    /// On a GPU, a product split along its depth (see [`gpu_depth_splits`]) sums each slice
    /// into its own `m × n` of the workspace.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        match self.dims(&inputs[0].shape, &inputs[1].shape) {
            Ok(d) if target.is_gpu() => match gpu_depth_splits(&d) {
                1 => 0,
                s => s * d.m * d.n,
            },
            _ => 0,
        }
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match self.dims(&inputs[0].shape, &inputs[1].shape) {
            Ok(d) => super::flops_of(2, &[d.batch, d.m, d.n, d.k]),
            Err(_) => 0,
        }
    }
}

fn flatten2(ctx: &mut GradCtx<'_>, x: crate::TensorId, shape: &[usize]) -> Result<crate::TensorId> {
    if shape.len() == 2 {
        return Ok(x);
    }
    let cols = shape[shape.len() - 1];
    let rows: usize = shape[..shape.len() - 1].iter().product();
    ctx.apply1(
        Reshape {
            shape: vec![rows, cols],
        },
        &[x],
    )
}

/// Slices of the depth a GPU's product is split into (1: not split). A weight's gradient has
/// few output tiles and thousands of rows to sum over (char-small's 384 × 384 over 4096:
/// 36 workgroups of 64 × 64, which an H200 ran at 1.0–1.3 TFLOP/s where the wide products ran
/// at 8–10). Split, each slice's workgroups sum their part of the depth into the workspace,
/// and a second pass adds the slices in order: enough slices to give about 256 workgroups,
/// each at least 256 deep, at most 16. Only single products (a batch of 1) are split.
pub fn gpu_depth_splits(d: &MatMulDims) -> usize {
    const TILE: usize = 64;
    const WORKGROUPS: usize = 256;
    const MIN_DEPTH: usize = 256;
    const MAX_SPLITS: usize = 16;
    if d.batch != 1 {
        return 1;
    }
    let tiles = d.m.div_ceil(TILE) * d.n.div_ceil(TILE);
    if tiles == 0 || tiles >= WORKGROUPS {
        return 1;
    }
    WORKGROUPS
        .div_ceil(tiles)
        .min(d.k / MIN_DEPTH)
        .clamp(1, MAX_SPLITS)
}
