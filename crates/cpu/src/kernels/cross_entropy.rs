//! The kernels of cross-entropy and its gradient, a row of logits at a time, with the loss
//! mask's reduction that the fused LM-head loss shares.

use snug_graph::ops::{CrossEntropy, CrossEntropyBackward};

use crate::kernel::{CpuKernel, Kernel};

/// The loss mask and its divisor, when the node has them at inputs `at` and `at + 1`.
pub(crate) fn loss_mask<'a>(k: &Kernel<'a>, at: usize) -> Option<(&'a [f32], f32)> {
    (k.in_count() == at + 2).then(|| (k.in_f32(at), k.in_f32(at + 1)[0]))
}

/// The loss of the per-row losses `rows`: their mean, or under a loss mask
/// `Σ mask·row / divisor`. Rows weighted 0 are skipped (a non-finite loss there stays out),
/// and nothing counted (a divisor of 0) is a loss of 0.
pub(crate) fn reduce_loss(rows: &[f32], mask: Option<(&[f32], f32)>) -> f32 {
    let Some((weights, divisor)) = mask else {
        let total: f64 = rows.iter().map(|&x| x as f64).sum();
        return (total / rows.len() as f64) as f32;
    };
    if divisor == 0.0 {
        return 0.0;
    }
    let total: f64 = rows
        .iter()
        .zip(weights)
        .map(|(&l, &w)| if w == 0.0 { 0.0 } else { w as f64 * l as f64 })
        .sum();
    (total / divisor as f64) as f32
}

/// The gradient of each row's loss before its weight: `dloss / n`, or `dloss / divisor` (0
/// when the divisor is 0) under a loss mask.
pub(crate) fn grad_scale(dloss: f32, n: usize, mask: Option<(&[f32], f32)>) -> f32 {
    match mask {
        None => dloss / n as f32,
        Some((_, 0.0)) => 0.0,
        Some((_, divisor)) => dloss / divisor,
    }
}

/// Row `r`'s gradient scale: `g` times its weight; `None` for a row the mask drops, whose
/// gradient is zero.
pub(crate) fn row_scale(g: f32, mask: Option<(&[f32], f32)>, r: usize) -> Option<f32> {
    match mask {
        None => Some(g),
        Some((weights, _)) => {
            let gr = g * weights[r];
            (gr != 0.0).then_some(gr)
        }
    }
}

impl CpuKernel for CrossEntropy {
    fn run(&self, k: &Kernel<'_>) {
        let (logits, targets, loss) = (k.in_f32(0), k.in_i32(1), k.out_f32(0));
        let v = k.in_shape(0)[1];
        let rows = k.workspace();
        crate::par::rows_mut(
            rows,
            1,
            #[inline(always)]
            |r0, out| {
                for (r, o) in out.iter_mut().enumerate() {
                    let row = &logits[(r0 + r) * v..(r0 + r + 1) * v];
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f32 = row.iter().map(|&x| crate::math::exp(x - max)).sum();
                    let t = targets[r0 + r].clamp(0, v as i32 - 1) as usize;
                    *o = max + sum.ln() - row[t];
                }
            },
        );
        loss[0] = reduce_loss(rows, loss_mask(k, 2));
    }
}

impl CpuKernel for CrossEntropyBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (logits, targets, dloss, dl) = (k.in_f32(0), k.in_i32(1), k.in_f32(2), k.out_f32(0));
        let (n, v) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let mask = loss_mask(k, 3);
        let g = grad_scale(dloss[0], n, mask);
        crate::par::rows_mut(
            dl,
            v,
            #[inline(always)]
            |r0, rows| {
                for (r, out) in rows.chunks_exact_mut(v).enumerate() {
                    let Some(g) = row_scale(g, mask, r0 + r) else {
                        out.fill(0.0);
                        continue;
                    };
                    let row = &logits[(r0 + r) * v..(r0 + r + 1) * v];
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0;
                    for (o, &x) in out.iter_mut().zip(row) {
                        *o = crate::math::exp(x - max);
                        sum += *o;
                    }
                    let inv = g / sum;
                    out.iter_mut().for_each(|o| *o *= inv);
                    let t = targets[r0 + r].clamp(0, v as i32 - 1) as usize;
                    out[t] -= g;
                }
            },
        );
    }
}
