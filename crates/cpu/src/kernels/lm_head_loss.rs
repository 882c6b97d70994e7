//! The kernels of the fused language-model head and cross-entropy: tiles of logits in the
//! workspace, an online log-sum-exp per row, and the backward recomputing each tile's logits;
//! under a loss mask, the rows it drops get zero gradients.

use snug_graph::ops::{
    lm_head_loss::{head_vocab_of, tile},
    LmHeadLoss, LmHeadLossBackward,
};

use super::cross_entropy::{grad_scale, loss_mask, reduce_loss, row_scale};
use crate::gemm::{Arith, QuantB};
use crate::kernel::{CpuKernel, Kernel};

/// The head a kernel reads: its f32 values, or a frozen head's codes
/// ([`snug_graph::ops::QuantizedRead`]) with the panel its products decode into where our
/// blocked kernel does not run them.
pub(super) enum Head<'a> {
    F32(&'a [f32]),
    Quantized(QuantB<'a>, &'a mut [f32]),
}

/// Where the kernels find their inputs: the head's shape, and how far the inputs after it
/// moved (a quantized head is its codes and scales).
pub(super) struct HeadInputs<'a> {
    pub shape: &'a [usize],
    pub shift: usize,
}

impl CpuKernel for LmHeadLoss {
    fn run(&self, k: &Kernel<'_>) {
        let head = HeadInputs {
            shape: k.in_shape(1),
            shift: 0,
        };
        let ws = k.workspace();
        lm_head_loss(self, k, (Head::F32(k.in_f32(1)), head), ws);
    }
}

impl CpuKernel for LmHeadLossBackward {
    fn run(&self, k: &Kernel<'_>) {
        let head = HeadInputs {
            shape: k.in_shape(1),
            shift: 0,
        };
        let ws = k.workspace();
        lm_head_loss_backward(
            self,
            k,
            (Head::F32(k.in_f32(1)), head),
            ws,
            Some(k.out_f32(1)),
        );
    }
}

/// The forward over `head`, with `ws` at least the op's own workspace.
pub(super) fn lm_head_loss(
    op: &LmHeadLoss,
    k: &Kernel<'_>,
    (mut w, at): (Head<'_>, HeadInputs<'_>),
    ws: &mut [f32],
) {
    {
        use rayon::prelude::*;
        let (x, targets) = (k.in_f32(0), k.in_i32(2 + at.shift));
        let (loss, lse) = (k.out_f32(0), k.out_f32(1));
        let (n, c) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let v = head_vocab_of(op.tb, at.shape);
        let (rows, cols) = tile(op.rows, op.cols, n, v);
        let arith = arith_of(op.bf16);
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
                block_logits((op.tb, arith), x, &mut w, (r0, m, c, v), (c0, vb), logits);
                logits
                    .par_chunks(vb)
                    .zip(maxes.par_iter_mut())
                    .zip(sums.par_iter_mut())
                    .zip(picked.par_iter_mut())
                    .zip(targets[r0..r0 + m].par_iter())
                    .for_each(|((((row, max), sum), picked), &t)| {
                        crate::isa::vectorized(
                            #[inline(always)]
                            || {
                                let new_max = max.max(crate::math::max(row));
                                let block =
                                    crate::math::sum_by(row, |l| crate::math::exp(l - new_max));
                                *sum = *sum * crate::math::exp(*max - new_max) + block;
                                *max = new_max;
                                let t = t.clamp(0, v as i32 - 1) as usize;
                                if (c0..c0 + vb).contains(&t) {
                                    *picked = row[t - c0];
                                }
                            },
                        )
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
        loss[0] = reduce_loss(&losses[..n], loss_mask(k, 3 + at.shift));
    }
}

/// The backward over `head`, with `ws` at least the op's own workspace; the head's gradient
/// into `dw` where it is wanted (a frozen head has none).
pub(super) fn lm_head_loss_backward(
    op: &LmHeadLossBackward,
    k: &Kernel<'_>,
    (mut w, at): (Head<'_>, HeadInputs<'_>),
    ws: &mut [f32],
    mut dw: Option<&mut [f32]>,
) {
    {
        use crate::gemm::{gemm_raw, par_for};
        let arith = arith_of(op.bf16);
        // Run in place, `x` is read through `dx`.
        let x_in = (k.inplace() != Some(0)).then(|| k.in_f32(0));
        let s = at.shift;
        let (targets, lse, dloss) = (k.in_i32(2 + s), k.in_f32(3 + s), k.in_f32(4 + s));
        let dx = k.out_f32(0);
        let (n, c) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let v = head_vocab_of(op.tb, at.shape);
        let (rows, cols) = tile(op.rows, op.cols, n, v);
        let mask = loss_mask(k, 5 + s);
        let g = grad_scale(dloss[0], n, mask);
        let own = rows * cols + if cols < v { rows * c } else { 0 };
        let (logits, dx_tile) = ws[..own].split_at_mut(rows * cols);
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
                block_logits((op.tb, arith), xt, &mut w, (0, m, c, v), (c0, vb), dlogits);
                crate::par::rows_mut(
                    dlogits,
                    vb,
                    #[inline(always)]
                    |i0, chunk| {
                        for (i, row) in chunk.chunks_exact_mut(vb).enumerate() {
                            let r = r0 + i0 + i;
                            let Some(g) = row_scale(g, mask, r) else {
                                row.fill(0.0);
                                continue;
                            };
                            let s = lse[r];
                            row.iter_mut()
                                .for_each(|l| *l = crate::math::exp(*l - s) * g);
                            let t = targets[r].clamp(0, v as i32 - 1) as usize;
                            if (c0..c0 + vb).contains(&t) {
                                row[t - c0] -= g;
                            }
                        }
                    },
                );
                let (b, b_rs, b_cs) = head_block(op.tb, c, v, c0);
                // SAFETY: every matrix below lies inside its buffer (shapes checked by `infer`;
                // `head_block` stays inside the head); the tile's rows of x are read before
                // its rows of dx are written.
                unsafe {
                    match dw.as_deref_mut() {
                        // A tied head (`[V, C]`): its block's rows, dW[c0..c0+vb] (+)=
                        // dlogitsᵀ · x[r0..r0+m], row-major as our kernel writes them.
                        Some(dw) if op.tb => gemm_raw(
                            (vb, c, m),
                            (dw.as_mut_ptr().add(b), c as isize, 1),
                            (dlogits.as_ptr(), 1, vb as isize),
                            (xp.add(r0 * c), c as isize, 1),
                            1.0,
                            r0 > 0,
                            par_for(vb, c, m, threads),
                            arith,
                        ),
                        // dB[:, c0..c0+vb] (+)= x[r0..r0+m]ᵀ · dlogits, in B's layout.
                        Some(dw) => gemm_raw(
                            (c, vb, m),
                            (dw.as_mut_ptr().add(b), b_rs, b_cs),
                            (xp.add(r0 * c), 1, c as isize),
                            (dlogits.as_ptr(), vb as isize, 1),
                            1.0,
                            r0 > 0,
                            par_for(c, vb, m, threads),
                            arith,
                        ),
                        None => {}
                    }
                    // dx[r0..r0+m] (+)= dlogits · B[:, c0..c0+vb]ᵀ
                    let (dims, par) = ((m, c, vb), par_for(m, c, vb, threads));
                    let (cp, ap) = ((dxt, c as isize), (dlogits.as_ptr(), vb as isize, 1));
                    match &mut w {
                        Head::F32(w) => gemm_raw(
                            dims,
                            (cp.0, cp.1, 1),
                            ap,
                            (w.as_ptr().add(b), b_cs, b_rs),
                            1.0,
                            c0 > 0,
                            par,
                            arith,
                        ),
                        Head::Quantized(q, panel) => {
                            let q = q.at((0, c0), true);
                            crate::gemm::gemm_quantized(dims, cp, ap, q, None, c0 > 0, par, panel)
                        }
                    }
                }
            }
            if cols < v {
                // SAFETY: rows r0..r0+m lie inside dx; the tile holds them.
                unsafe { std::ptr::copy_nonoverlapping(dx_tile.as_ptr(), dxp.add(r0 * c), m * c) };
            }
        }
    }
}

/// Where columns `c0..` of the head read as `[C, V]` start, and that matrix's (row, column)
/// strides.
fn head_block(tb: bool, c: usize, v: usize, c0: usize) -> (usize, isize, isize) {
    if tb {
        (c0 * c, 1, c as isize)
    } else {
        (c0, v as isize, 1)
    }
}

/// The arithmetic of the head's products: bf16 where the op asks for it.
fn arith_of(bf16: bool) -> Arith {
    if bf16 {
        Arith::Bf16
    } else {
        Arith::F32
    }
}

/// `out [m, vb] = x[r0..r0+m] · B[:, c0..c0+vb]` in `arith` for the head read as `[C, V]`.
fn block_logits(
    (tb, arith): (bool, Arith),
    x: &[f32],
    w: &mut Head<'_>,
    (r0, m, c, v): (usize, usize, usize, usize),
    (c0, vb): (usize, usize),
    out: &mut [f32],
) {
    use crate::gemm::{gemm_raw, par_for};
    let (b, b_rs, b_cs) = head_block(tb, c, v, c0);
    let par = par_for(m, vb, c, rayon::current_num_threads());
    let a = (x[r0 * c..].as_ptr(), c as isize, 1);
    // SAFETY: x holds rows r0..r0+m of width c, the head block lies inside w, out holds m·vb.
    unsafe {
        match w {
            Head::F32(w) => gemm_raw(
                (m, vb, c),
                (out.as_mut_ptr(), vb as isize, 1),
                a,
                (w.as_ptr().add(b), b_rs, b_cs),
                1.0,
                false,
                par,
                arith,
            ),
            Head::Quantized(q, panel) => {
                let (q, c_out) = (q.at((0, c0), false), (out.as_mut_ptr(), vb as isize));
                crate::gemm::gemm_quantized((m, vb, c), c_out, a, q, None, false, par, panel)
            }
        }
    }
}
