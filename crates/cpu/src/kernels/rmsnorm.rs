//! The kernels of RMSNorm and its gradient, a row at a time.

use snug_graph::ops::{RmsNorm, RmsNormBackward};

use crate::kernel::{CpuKernel, Kernel};

fn rows_and_width(shape: &[usize]) -> (usize, usize) {
    let c = *shape.last().unwrap_or(&1);
    (shape.iter().product::<usize>() / c.max(1), c)
}

impl CpuKernel for RmsNorm {
    fn run(&self, k: &Kernel<'_>) {
        let (x, w) = (k.in_f32(0), k.in_f32(1));
        let (y, rstd) = (k.out_f32(0), k.out_f32(1));
        let (_, c) = rows_and_width(k.in_shape(0));
        if c == 0 {
            rstd.fill(1.0 / self.eps.sqrt());
            return;
        }
        let eps = self.eps;
        crate::par::rows_mut2(y, c, rstd, 1, |r0, y, rstd| {
            for (r, yr) in y.chunks_exact_mut(c).enumerate() {
                let xr = &x[(r0 + r) * c..(r0 + r + 1) * c];
                let ms = xr.iter().map(|&v| v * v).sum::<f32>() / c as f32;
                let s = 1.0 / (ms + eps).sqrt();
                for ((o, &v), &wv) in yr.iter_mut().zip(xr).zip(w) {
                    *o = v * s * wv;
                }
                rstd[r] = s;
            }
        });
    }
}

impl CpuKernel for RmsNormBackward {
    fn run(&self, k: &Kernel<'_>) {
        use rayon::prelude::*;
        let (dy, x, w, rstd) = (k.in_f32(0), k.in_f32(1), k.in_f32(2), k.in_f32(3));
        let (dx, dw) = (k.out_f32(0), k.out_f32(1));
        let ws = k.workspace();
        let (rows, c) = rows_and_width(k.in_shape(1));
        dw.fill(0.0);
        if c == 0 || rows == 0 {
            return;
        }
        let parts = (ws.len() / c).max(1);
        let rows_per = rows.div_ceil(parts);
        dx.par_chunks_mut(rows_per * c)
            .zip(ws.par_chunks_mut(c))
            .enumerate()
            .for_each(|(p, (dx, pdw))| {
                crate::isa::vectorized(|| {
                    pdw.fill(0.0);
                    let r0 = p * rows_per;
                    for (r, dxr) in dx.chunks_exact_mut(c).enumerate() {
                        let row = r0 + r;
                        let (xr, dyr) = (&x[row * c..(row + 1) * c], &dy[row * c..(row + 1) * c]);
                        let s = rstd[row];
                        // dx = s · (g − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ w and x̂ = x · s.
                        let mut sum_gx = 0.0;
                        for j in 0..c {
                            let xhat = xr[j] * s;
                            sum_gx += dyr[j] * w[j] * xhat;
                            pdw[j] += dyr[j] * xhat;
                        }
                        let mgx = sum_gx / c as f32;
                        for j in 0..c {
                            let xhat = xr[j] * s;
                            dxr[j] = s * (dyr[j] * w[j] - xhat * mgx);
                        }
                    }
                })
            });
        let used = rows.div_ceil(rows_per);
        for pdw in ws.chunks_exact(c).take(used) {
            dw.iter_mut().zip(pdw).for_each(|(a, b)| *a += b);
        }
    }
}
