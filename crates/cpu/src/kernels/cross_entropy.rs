//! The kernels of cross-entropy and its gradient, a row of logits at a time.

use snug_graph::ops::{CrossEntropy, CrossEntropyBackward};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for CrossEntropy {
    fn run(&self, k: &Kernel<'_>) {
        let (logits, targets, loss) = (k.in_f32(0), k.in_i32(1), k.out_f32(0));
        let v = k.in_shape(0)[1];
        let rows = k.workspace();
        crate::par::rows_mut(rows, 1, |r0, out| {
            for (r, o) in out.iter_mut().enumerate() {
                let row = &logits[(r0 + r) * v..(r0 + r + 1) * v];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = row.iter().map(|&x| crate::math::exp(x - max)).sum();
                let t = targets[r0 + r].clamp(0, v as i32 - 1) as usize;
                *o = max + sum.ln() - row[t];
            }
        });
        let total: f64 = rows.iter().map(|&x| x as f64).sum();
        loss[0] = (total / rows.len() as f64) as f32;
    }
}

impl CpuKernel for CrossEntropyBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (logits, targets, dloss, dl) = (k.in_f32(0), k.in_i32(1), k.in_f32(2), k.out_f32(0));
        let (n, v) = (k.in_shape(0)[0], k.in_shape(0)[1]);
        let g = dloss[0] / n as f32;
        crate::par::rows_mut(dl, v, |r0, rows| {
            for (r, out) in rows.chunks_exact_mut(v).enumerate() {
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
        });
    }
}
