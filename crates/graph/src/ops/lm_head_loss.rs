//! The language-model head and its cross-entropy, fused and tiled: logits for a tile of `rows`
//! tokens × `cols` vocabulary entries at a time live in the op's workspace, so the full
//! `tokens × vocab` logits tensor and its gradient never exist. At GPT-2's vocabulary and
//! 4,096 tokens that is 824 MB per logits-sized tensor.
//!
//! The forward walks each row's vocabulary in blocks with a running max and sum (an online
//! log-sum-exp, as in FlashAttention), so tiles can span every token: each block of the head
//! is then packed for the GEMM once per step rather than once per few hundred tokens, and the
//! head's gradient is written once per block. The backward recomputes each tile's logits (one
//! extra head GEMM) from the saved per-row log-sum-exp.

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
    /// Tokens per tile of logits.
    pub rows: usize,
    /// Vocabulary entries per tile of logits.
    pub cols: usize,
}

/// A tile of `rows × cols` logits, clamped to the problem's `n` tokens and `v` entries.
fn tile(rows: usize, cols: usize, n: usize, v: usize) -> (usize, usize) {
    (rows.clamp(1, n.max(1)), cols.clamp(1, v.max(1)))
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
            rows: self.rows,
            cols: self.cols,
        };
        let grads = ctx.apply(back, &ins)?;
        for (i, g) in grads.into_iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, g);
            }
        }
        Ok(())
    }

    /// One tile of logits, each tile row's running sum and target logit, and one loss per
    /// token (summed in a fixed order: bit-reproducible).
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        let (n, v) = (inputs[0].shape[0], head_vocab(self.tb, inputs[1]));
        let (rows, cols) = tile(self.rows, self.cols, n, v);
        rows * cols + 2 * rows + n
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
        let (rows, cols) = tile(self.rows, self.cols, n, v);
        let ws = k.workspace();
        let (logits, rest) = ws.split_at_mut(rows * cols);
        let (sums, rest) = rest.split_at_mut(rows);
        let (picked, losses) = rest.split_at_mut(rows);
        for r0 in (0..n).step_by(rows) {
            let m = rows.min(n - r0);
            // `lse` holds each row's running max until the block loop ends.
            let (maxes, sums, picked) = (&mut lse[r0..r0 + m], &mut sums[..m], &mut picked[..m]);
            maxes.fill(f32::NEG_INFINITY);
            sums.fill(0.0);
            for c0 in (0..v).step_by(cols) {
                let vb = cols.min(v - c0);
                let logits = &mut logits[..m * vb];
                block_logits(self.tb, x, w, (r0, m, c, v), (c0, vb), logits);
                logits
                    .par_chunks(vb)
                    .zip(maxes.par_iter_mut())
                    .zip(sums.par_iter_mut())
                    .zip(picked.par_iter_mut())
                    .zip(targets[r0..r0 + m].par_iter())
                    .for_each(|((((row, max), sum), picked), &t)| {
                        let new_max = max.max(super::math::max(row));
                        let block = super::math::sum_by(row, |l| super::math::exp(l - new_max));
                        *sum = *sum * super::math::exp(*max - new_max) + block;
                        *max = new_max;
                        let t = t.clamp(0, v as i32 - 1) as usize;
                        if (c0..c0 + vb).contains(&t) {
                            *picked = row[t - c0];
                        }
                    });
            }
            for (((lse, &sum), &picked), loss) in maxes
                .iter_mut()
                .zip(&*sums)
                .zip(&*picked)
                .zip(&mut losses[r0..r0 + m])
            {
                *lse += sum.ln();
                *loss = *lse - picked;
            }
        }
        let total: f64 = losses.iter().map(|&l| l as f64).sum();
        loss[0] = (total / n as f64) as f32;
    }
}

/// Inputs `[x, head, targets, lse, dloss]`; outputs `dx` and `dhead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmHeadLossBackward {
    pub tb: bool,
    pub rows: usize,
    pub cols: usize,
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

    /// One tile of logits; where a tile spans part of the vocabulary, also its rows' `dx`,
    /// summed over the vocabulary's blocks before it is written.
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        let (n, v) = (inputs[0].shape[0], head_vocab(self.tb, inputs[1]));
        let (rows, cols) = tile(self.rows, self.cols, n, v);
        rows * cols
            + if cols < v {
                rows * inputs[0].shape[1]
            } else {
                0
            }
    }

    /// `dx` may be written over `x`: a tile's rows of `x` are read (for its logits and the
    /// head's gradient) before its rows of `dx` are written.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
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
        // Run in place, `x` is read through `dx`.
        let x_in = (k.inplace() != Some(0)).then(|| k.in_f32(0));
        let (w, targets, lse, dloss) = (k.in_f32(1), k.in_i32(2), k.in_f32(3), k.in_f32(4));
        let (dx, dw) = (k.out_f32(0), k.out_f32(1));
        let (n, c) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let v = head_vocab_of(self.tb, k.in_shape(1));
        let (rows, cols) = tile(self.rows, self.cols, n, v);
        let g = dloss[0] / n as f32;
        let (logits, dx_tile) = k.workspace().split_at_mut(rows * cols);
        let dxp = dx.as_mut_ptr();
        let xp = x_in.map_or(dxp as *const f32, <[f32]>::as_ptr);
        let threads = rayon::current_num_threads();
        for r0 in (0..n).step_by(rows) {
            let m = rows.min(n - r0);
            // The tile's dx goes straight to its rows when one block spans the vocabulary.
            let dxt = if cols < v {
                dx_tile.as_mut_ptr()
            } else {
                // SAFETY: rows r0..r0+m lie inside dx.
                unsafe { dxp.add(r0 * c) }
            };
            for c0 in (0..v).step_by(cols) {
                let vb = cols.min(v - c0);
                let dlogits = &mut logits[..m * vb];
                // SAFETY: rows r0..r0+m of x lie inside it and are not yet written over.
                let xt = unsafe { std::slice::from_raw_parts(xp.add(r0 * c), m * c) };
                block_logits(self.tb, xt, w, (0, m, c, v), (c0, vb), dlogits);
                super::par::rows_mut(dlogits, vb, |i0, chunk| {
                    for (i, row) in chunk.chunks_exact_mut(vb).enumerate() {
                        let r = r0 + i0 + i;
                        let s = lse[r];
                        row.iter_mut()
                            .for_each(|l| *l = super::math::exp(*l - s) * g);
                        let t = targets[r].clamp(0, v as i32 - 1) as usize;
                        if (c0..c0 + vb).contains(&t) {
                            row[t - c0] -= g;
                        }
                    }
                });
                let (b, b_rs, b_cs) = head_block(self.tb, c, v, c0);
                // SAFETY: every matrix below lies inside its buffer (shapes checked by `infer`;
                // `head_block` stays inside the head); the tile's rows of x are read before
                // its rows of dx are written.
                unsafe {
                    // dB[:, c0..c0+vb] (+)= x[r0..r0+m]ᵀ · dlogits, in B's layout.
                    gemm_raw(
                        (c, vb, m),
                        (dw.as_mut_ptr().add(b), b_rs, b_cs),
                        (xp.add(r0 * c), 1, c as isize),
                        (dlogits.as_ptr(), vb as isize, 1),
                        1.0,
                        r0 > 0,
                        par_for(c, vb, m, threads),
                    );
                    // dx[r0..r0+m] (+)= dlogits · B[:, c0..c0+vb]ᵀ
                    gemm_raw(
                        (m, c, vb),
                        (dxt, c as isize, 1),
                        (dlogits.as_ptr(), vb as isize, 1),
                        (w.as_ptr().add(b), b_cs, b_rs),
                        1.0,
                        c0 > 0,
                        par_for(m, c, vb, threads),
                    );
                }
            }
            if cols < v {
                // SAFETY: rows r0..r0+m lie inside dx; the tile holds them.
                unsafe { std::ptr::copy_nonoverlapping(dx_tile.as_ptr(), dxp.add(r0 * c), m * c) };
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

/// Where columns `c0..` of the head read as `[C, V]` start, and that matrix's (row, column)
/// strides.
#[cfg(feature = "cpu")]
fn head_block(tb: bool, c: usize, v: usize, c0: usize) -> (usize, isize, isize) {
    if tb {
        (c0 * c, 1, c as isize)
    } else {
        (c0, v as isize, 1)
    }
}

/// `out [m, vb] = x[r0..r0+m] · B[:, c0..c0+vb]` for the head read as `[C, V]`.
#[cfg(feature = "cpu")]
fn block_logits(
    tb: bool,
    x: &[f32],
    w: &[f32],
    (r0, m, c, v): (usize, usize, usize, usize),
    (c0, vb): (usize, usize),
    out: &mut [f32],
) {
    use super::matmul::{gemm_raw, par_for};
    let (b, b_rs, b_cs) = head_block(tb, c, v, c0);
    // SAFETY: x holds rows r0..r0+m of width c, the head block lies inside w, out holds m·vb.
    unsafe {
        gemm_raw(
            (m, vb, c),
            (out.as_mut_ptr(), vb as isize, 1),
            (x.as_ptr().add(r0 * c), c as isize, 1),
            (w.as_ptr().add(b), b_rs, b_cs),
            1.0,
            false,
            par_for(m, vb, c, rayon::current_num_threads()),
        );
    }
}
