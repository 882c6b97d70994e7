//! The kernels of LayerNorm and its gradient, a row at a time; the row helpers are shared
//! with [`LayerNormLinear`](snug_graph::ops::LayerNormLinear)'s kernels, so the values agree
//! bit for bit.

use snug_graph::ops::{LayerNorm, LayerNormBackward};

use crate::kernel::{CpuKernel, Kernel};

fn rows_and_width(shape: &[usize]) -> (usize, usize) {
    let c = *shape.last().unwrap_or(&1);
    (shape.iter().product::<usize>() / c.max(1), c)
}

impl CpuKernel for LayerNorm {
    fn run(&self, k: &Kernel<'_>) {
        use rayon::prelude::*;
        let (x, w, b) = (k.in_f32(0), k.in_f32(1), k.in_f32(2));
        let (y, mean, rstd) = (k.out_f32(0), k.out_f32(1), k.out_f32(2));
        let (_, c) = rows_and_width(k.in_shape(0));
        let eps = self.eps;
        let rows_per = (crate::par::MIN_PAR_ELEMS / c).max(1);
        y.par_chunks_mut(rows_per * c)
            .zip(mean.par_chunks_mut(rows_per))
            .zip(rstd.par_chunks_mut(rows_per))
            .enumerate()
            .for_each(|(chunk, ((y, mean), rstd))| {
                crate::isa::vectorized(
                    #[inline(always)]
                    || {
                        let r0 = chunk * rows_per;
                        for (r, yr) in y.chunks_exact_mut(c).enumerate() {
                            let xr = &x[(r0 + r) * c..(r0 + r + 1) * c];
                            (mean[r], rstd[r]) = normalize_row(xr, w, b, eps, yr);
                        }
                    },
                )
            });
    }
}

/// One row of the forward: writes `y` and returns the row's `(mean, rstd)`.
#[inline(always)]
pub(super) fn normalize_row(
    xr: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
    yr: &mut [f32],
) -> (f32, f32) {
    let (m, s) = row_stats(xr, eps);
    for (((o, &v), &wv), &bv) in yr.iter_mut().zip(xr).zip(w).zip(b) {
        *o = (v - m) * s * wv + bv;
    }
    (m, s)
}

/// A row's `(mean, rstd)`.
#[inline]
pub(super) fn row_stats(xr: &[f32], eps: f32) -> (f32, f32) {
    let c = xr.len() as f32;
    let m = crate::math::sum(xr) / c;
    let var = crate::math::sum_by(xr, |v| (v - m) * (v - m)) / c;
    (m, 1.0 / (var + eps).sqrt())
}

/// One row of the backward's first pass: adds the row's terms of `dw` and `db` to `pdw` and
/// `pdb`, and returns `(mean(g), mean(g·x̂))` of `g = dy·w`, which every `dx` of the row needs.
#[inline]
pub(super) fn backward_sums(
    dyr: &[f32],
    xr: &[f32],
    w: &[f32],
    (m, s): (f32, f32),
    pdw: &mut [f32],
    pdb: &mut [f32],
) -> (f32, f32) {
    let c = xr.len();
    let (mut sum_g, mut sum_gx) = (0.0, 0.0);
    for j in 0..c {
        let xhat = (xr[j] - m) * s;
        let g = dyr[j] * w[j];
        sum_g += g;
        sum_gx += g * xhat;
        pdw[j] += dyr[j] * xhat;
        pdb[j] += dyr[j];
    }
    (sum_g / c as f32, sum_gx / c as f32)
}

/// One element of `dx`, from the row's statistics and [`backward_sums`].
#[inline(always)]
pub(super) fn dx_value(dy: f32, x: f32, w: f32, (m, s): (f32, f32), (mg, mgx): (f32, f32)) -> f32 {
    let xhat = (x - m) * s;
    s * (dy * w - mg - xhat * mgx)
}

impl CpuKernel for LayerNormBackward {
    fn run(&self, k: &Kernel<'_>) {
        use rayon::prelude::*;
        let ip = k.inplace();
        // `None`: that input's rows are read from `dx`, which holds them on entry.
        let dy = (ip != Some(0)).then(|| k.in_f32(0));
        let x = (ip != Some(1)).then(|| k.in_f32(1));
        let (w, mean, rstd) = (k.in_f32(2), k.in_f32(3), k.in_f32(4));
        let (dx, dw, db) = (k.out_f32(0), k.out_f32(1), k.out_f32(2));
        let ws = k.workspace();
        let (rows, c) = rows_and_width(k.in_shape(1));
        let parts = ws.len() / (2 * c);
        let rows_per = rows.div_ceil(parts);
        dx.par_chunks_mut(rows_per * c)
            .zip(ws.par_chunks_mut(2 * c))
            .enumerate()
            .for_each(|(p, (dx, part))| {
                crate::isa::vectorized(
                    #[inline(always)]
                    || {
                        let (pdw, pdb) = part.split_at_mut(c);
                        pdw.fill(0.0);
                        pdb.fill(0.0);
                        let r0 = p * rows_per;
                        for (r, dxr) in dx.chunks_exact_mut(c).enumerate() {
                            let row = r0 + r;
                            let span = row * c..(row + 1) * c;
                            let (m, s) = (mean[row], rstd[row]);
                            let (mg, mgx) = {
                                let xr = x.map_or(&*dxr, |x| &x[span.clone()]);
                                let dyr = dy.map_or(&*dxr, |dy| &dy[span.clone()]);
                                backward_sums(dyr, xr, w, (m, s), pdw, pdb)
                            };
                            let dx_of =
                                |dy: f32, x: f32, w: f32| dx_value(dy, x, w, (m, s), (mg, mgx));
                            match (dy, x) {
                                (Some(dy), Some(x)) => {
                                    for (((o, &d), &v), &wj) in
                                        dxr.iter_mut().zip(&dy[span.clone()]).zip(&x[span]).zip(w)
                                    {
                                        *o = dx_of(d, v, wj);
                                    }
                                }
                                (None, Some(x)) => {
                                    for ((o, &v), &wj) in dxr.iter_mut().zip(&x[span]).zip(w) {
                                        *o = dx_of(*o, v, wj);
                                    }
                                }
                                (Some(dy), None) => {
                                    for ((o, &d), &wj) in dxr.iter_mut().zip(&dy[span]).zip(w) {
                                        *o = dx_of(d, *o, wj);
                                    }
                                }
                                (None, None) => unreachable!("one input at most is written over"),
                            }
                        }
                    },
                )
            });
        dw.fill(0.0);
        db.fill(0.0);
        let used = rows.div_ceil(rows_per);
        for part in ws.chunks_exact(2 * c).take(used) {
            let (pdw, pdb) = part.split_at(c);
            dw.iter_mut().zip(pdw).for_each(|(a, b)| *a += b);
            db.iter_mut().zip(pdb).for_each(|(a, b)| *a += b);
        }
    }
}
