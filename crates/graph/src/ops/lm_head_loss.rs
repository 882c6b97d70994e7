//! The language-model head and its cross-entropy, fused and chunked over tokens: logits for
//! `chunk` rows at a time live in the op's workspace, so the full `tokens × vocab` logits
//! tensor and its gradient never exist. At GPT-2's vocabulary and 4,096 tokens that is 824 MB
//! per logits-sized tensor. The backward recomputes each chunk's logits (one extra head GEMM)
//! from the saved per-row log-sum-exp.

use super::{expect_arity, expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Inputs `[x [N, C], head, targets [N] (i32)]`, where `head` is `[V, C]` when `tb` (tied to
/// the embedding) and `[C, V]` otherwise. Outputs the mean loss `[]` and each row's
/// log-sum-exp `[N]` (kept for the backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmHeadLoss {
    pub tb: bool,
    /// Rows whose logits are materialised at once.
    pub chunk: usize,
}

/// `(N, C, V)` of valid inputs.
fn dims(op: &'static str, tb: bool, inputs: &[&TensorMeta]) -> Result<(usize, usize, usize)> {
    let (x, w, t) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
    if x.len() != 2 || w.len() != 2 || t.len() != 1 || t[0] != x[0] {
        return Err(shape_err(
            op,
            format!("x {x:?}, head {w:?} and targets {t:?} must be [N, C], 2-D and [N]"),
        ));
    }
    let (c, v) = if tb { (w[1], w[0]) } else { (w[0], w[1]) };
    if c != x[1] {
        return Err(shape_err(
            op,
            format!("x {x:?} does not match head {w:?} (transposed: {tb})"),
        ));
    }
    Ok((x[0], c, v))
}

impl LmHeadLoss {
    fn rows(&self, n: usize) -> usize {
        self.chunk.clamp(1, n.max(1))
    }
}

impl OpRule for LmHeadLoss {
    fn name(&self) -> &'static str {
        "lm_head_loss"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        expect_dtype(self.name(), inputs, 2, DType::I32)?;
        let (n, _, _) = dims(self.name(), self.tb, inputs)?;
        Ok(vec![
            OutSpec::f32(vec![]),
            OutSpec::f32(vec![n]).named("lse"),
        ])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dl) = ctx.grad_out(0) else {
            return Ok(());
        };
        if !(ctx.wants(0) || ctx.wants(1)) {
            return Ok(());
        }
        let ins = [ctx.input(0), ctx.input(1), ctx.input(2), ctx.output(1), dl];
        let back = LmHeadLossBackward {
            tb: self.tb,
            chunk: self.chunk,
        };
        let grads = ctx.apply(back, &ins)?;
        for (i, g) in grads.into_iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, g);
            }
        }
        Ok(())
    }

    /// One chunk of logits, and one loss per row (summed in a fixed order: bit-reproducible).
    fn workspace_elems(&self, inputs: &[&TensorMeta], _threads: usize) -> usize {
        let (n, v) = (inputs[0].shape[0], head_vocab(self.tb, inputs[1]));
        self.rows(n) * v + n
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        let (n, c) = (inputs[0].shape[0] as u64, inputs[0].shape[1] as u64);
        let v = head_vocab(self.tb, inputs[1]) as u64;
        2 * n * c * v + 3 * n * v
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use rayon::prelude::*;
        let (x, w, targets) = (k.in_f32(0), k.in_f32(1), k.in_i32(2));
        let (loss, lse) = (k.out_f32(0), k.out_f32(1));
        let (n, c) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let v = head_vocab_of(self.tb, k.in_shape(1));
        let rows = self.rows(n);
        let ws = k.workspace();
        let (logits, losses) = ws.split_at_mut(rows * v);
        for r0 in (0..n).step_by(rows) {
            let m = rows.min(n - r0);
            let logits = &mut logits[..m * v];
            chunk_logits(self.tb, x, w, (r0, m, c, v), logits);
            logits
                .par_chunks(v)
                .zip(lse[r0..r0 + m].par_iter_mut())
                .zip(losses[r0..r0 + m].par_iter_mut())
                .zip(targets[r0..r0 + m].par_iter())
                .for_each(|(((row, lse), loss), &t)| {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f32 = row.iter().map(|&l| super::math::exp(l - max)).sum();
                    let t = t.clamp(0, v as i32 - 1) as usize;
                    *lse = max + sum.ln();
                    *loss = *lse - row[t];
                });
        }
        let total: f64 = losses.iter().map(|&l| l as f64).sum();
        loss[0] = (total / n as f64) as f32;
    }
}

/// Inputs `[x, head, targets, lse, dloss]`; outputs `dx` and `dhead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmHeadLossBackward {
    pub tb: bool,
    pub chunk: usize,
}

impl OpRule for LmHeadLossBackward {
    fn name(&self) -> &'static str {
        "lm_head_loss_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 5)?;
        expect_dtype(self.name(), inputs, 2, DType::I32)?;
        let (n, _, _) = dims(self.name(), self.tb, inputs)?;
        if inputs[3].shape != [n] || inputs[4].numel() != 1 {
            return Err(shape_err(
                self.name(),
                format!(
                    "lse {:?} must be [{n}] and dloss {:?} a scalar",
                    inputs[3].shape, inputs[4].shape
                ),
            ));
        }
        Ok(vec![
            OutSpec::f32(inputs[0].shape.clone()).with_dtype(inputs[0].dtype),
            OutSpec::f32(inputs[1].shape.clone()).with_dtype(inputs[1].dtype),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "lm_head_loss_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], _threads: usize) -> usize {
        let n = inputs[0].shape[0];
        LmHeadLoss {
            tb: self.tb,
            chunk: self.chunk,
        }
        .rows(n)
            * head_vocab(self.tb, inputs[1])
    }

    /// The recomputed logits plus the two gradient GEMMs.
    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        let (n, c) = (inputs[0].shape[0] as u64, inputs[0].shape[1] as u64);
        let v = head_vocab(self.tb, inputs[1]) as u64;
        6 * n * c * v + 4 * n * v
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use super::matmul::{gemm_raw, par_for};
        let (x, w, targets, lse, dloss) = (
            k.in_f32(0),
            k.in_f32(1),
            k.in_i32(2),
            k.in_f32(3),
            k.in_f32(4),
        );
        let (dx, dw) = (k.out_f32(0), k.out_f32(1));
        let (n, c) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let v = head_vocab_of(self.tb, k.in_shape(1));
        let rows = LmHeadLoss {
            tb: self.tb,
            chunk: self.chunk,
        }
        .rows(n);
        let g = dloss[0] / n as f32;
        let logits = k.workspace();
        let threads = rayon::current_num_threads();
        // The head as the logical [C, V] matrix B: (row stride, column stride).
        let (b_rs, b_cs) = if self.tb {
            (1, c as isize)
        } else {
            (v as isize, 1)
        };
        for (chunk_index, r0) in (0..n).step_by(rows).enumerate() {
            let m = rows.min(n - r0);
            let dlogits = &mut logits[..m * v];
            chunk_logits(self.tb, x, w, (r0, m, c, v), dlogits);
            super::par::rows_mut(dlogits, v, |i0, chunk| {
                for (i, row) in chunk.chunks_exact_mut(v).enumerate() {
                    let r = r0 + i0 + i;
                    let s = lse[r];
                    row.iter_mut()
                        .for_each(|l| *l = super::math::exp(*l - s) * g);
                    let t = targets[r].clamp(0, v as i32 - 1) as usize;
                    row[t] -= g;
                }
            });
            // SAFETY: every matrix below lies inside its slice (shapes checked by `infer`).
            unsafe {
                // dx[r0..r0+m] = dlogits · Bᵀ
                gemm_raw(
                    (m, c, v),
                    (dx.as_mut_ptr().add(r0 * c), c as isize, 1),
                    (dlogits.as_ptr(), v as isize, 1),
                    (w.as_ptr(), b_cs, b_rs),
                    1.0,
                    false,
                    par_for(m, c, v, threads),
                );
                // dB += x[r0..r0+m]ᵀ · dlogits, in B's layout.
                gemm_raw(
                    (c, v, m),
                    (dw.as_mut_ptr(), b_rs, b_cs),
                    (x.as_ptr().add(r0 * c), 1, c as isize),
                    (dlogits.as_ptr(), v as isize, 1),
                    1.0,
                    chunk_index > 0,
                    par_for(c, v, m, threads),
                );
            }
        }
    }
}

fn head_vocab(tb: bool, head: &TensorMeta) -> usize {
    head_vocab_of(tb, &head.shape)
}

fn head_vocab_of(tb: bool, shape: &[usize]) -> usize {
    if tb {
        shape[0]
    } else {
        shape[1]
    }
}

/// `out [m, V] = x[r0..r0+m] · B` for the head read as `[C, V]`.
#[cfg(feature = "cpu")]
fn chunk_logits(
    tb: bool,
    x: &[f32],
    w: &[f32],
    (r0, m, c, v): (usize, usize, usize, usize),
    out: &mut [f32],
) {
    use super::matmul::{gemm_raw, par_for};
    let (b_rs, b_cs) = if tb { (1, c as isize) } else { (v as isize, 1) };
    // SAFETY: x holds rows r0..r0+m of width c, w holds c·v elements, out holds m·v.
    unsafe {
        gemm_raw(
            (m, v, c),
            (out.as_mut_ptr(), v as isize, 1),
            (x.as_ptr().add(r0 * c), c as isize, 1),
            (w.as_ptr(), b_rs, b_cs),
            1.0,
            false,
            par_for(m, v, c, rayon::current_num_threads()),
        );
    }
}
