//! The kernels of RMSNorm and its gradient, a row at a time; under
//! [`snug_graph::ops::HalfIo`], the rows read and written in bf16 as their dtypes say, each
//! staged in f32 (the same arithmetic on the same values, so the same bits as the casts').

use snug_graph::ops::{RmsNorm, RmsNormBackward};

use super::half_io::{Dst, Src};
use crate::kernel::{CpuKernel, Kernel};

fn rows_and_width(shape: &[usize]) -> (usize, usize) {
    let c = *shape.last().unwrap_or(&1);
    (shape.iter().product::<usize>() / c.max(1), c)
}

impl CpuKernel for RmsNorm {
    fn run(&self, k: &Kernel<'_>) {
        forward(self.eps, k);
    }
}

/// [`RmsNorm`] with `x` and `y` stored as their dtypes say.
pub(super) fn forward(eps: f32, k: &Kernel<'_>) {
    use rayon::prelude::*;
    let (x, w) = (Src::input(k, 0), k.in_f32(1));
    let (y, rstd) = (Dst::output(k, 0), k.out_f32(1));
    let (_, c) = rows_and_width(k.in_shape(0));
    if c == 0 {
        rstd.fill(1.0 / eps.sqrt());
        return;
    }
    let rows_per = (crate::par::MIN_PAR_ELEMS / c).max(1);
    let part = |p: usize, rstd: &mut [f32]| {
        let (mut bx, mut by) = (x.buffer(c), y.buffer(c));
        crate::isa::vectorized(
            #[inline(always)]
            || {
                for (r, s) in rstd.iter_mut().enumerate() {
                    let at = (p * rows_per + r) * c;
                    let xr = x.get((at, c), &mut bx);
                    // SAFETY: row `at / c` is written by this part only.
                    *s = unsafe {
                        y.with(
                            (at, c),
                            &mut by,
                            #[inline(always)]
                            |yr| norm_row(xr, w, eps, yr),
                        )
                    };
                }
            },
        )
    };
    // A few rows (a decode step's) run here, without the pool.
    if rstd.len() <= rows_per {
        part(0, rstd);
    } else {
        rstd.par_chunks_mut(rows_per)
            .enumerate()
            .for_each(|(p, rstd)| part(p, rstd));
    }
}

/// One row: `y = x · rstd · w`; returns rstd.
#[inline(always)]
fn norm_row(xr: &[f32], w: &[f32], eps: f32, yr: &mut [f32]) -> f32 {
    let c = xr.len();
    let ms = xr.iter().map(|&v| v * v).sum::<f32>() / c as f32;
    let s = 1.0 / (ms + eps).sqrt();
    for ((o, &v), &wv) in yr.iter_mut().zip(xr).zip(w) {
        *o = v * s * wv;
    }
    s
}

impl CpuKernel for RmsNormBackward {
    fn run(&self, k: &Kernel<'_>) {
        backward(k);
    }
}

/// [`RmsNormBackward`] with `dy`, `x` and `dx` stored as their dtypes say.
pub(super) fn backward(k: &Kernel<'_>) {
    use rayon::prelude::*;
    let (dy, x, w, rstd) = (Src::input(k, 0), Src::input(k, 1), k.in_f32(2), k.in_f32(3));
    let (dx, dw) = (Dst::output(k, 0), k.out_f32(1));
    let ws = k.workspace();
    let (rows, c) = rows_and_width(k.in_shape(1));
    dw.fill(0.0);
    if c == 0 || rows == 0 {
        return;
    }
    let parts = (ws.len() / c).max(1);
    let rows_per = rows.div_ceil(parts);
    let used = rows.div_ceil(rows_per);
    ws.par_chunks_mut(c)
        .take(used)
        .enumerate()
        .for_each(|(p, pdw)| {
            let (mut bdy, mut bx, mut bdx) = (dy.buffer(c), x.buffer(c), dx.buffer(c));
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    pdw.fill(0.0);
                    let first = p * rows_per;
                    let part = &rstd[first..((p + 1) * rows_per).min(rows)];
                    for (row, &s) in (first..).zip(part) {
                        let at = row * c;
                        let (dyr, xr) = (dy.get((at, c), &mut bdy), x.get((at, c), &mut bx));
                        // SAFETY: row `row` is written by this item only.
                        unsafe {
                            dx.with(
                                (at, c),
                                &mut bdx,
                                #[inline(always)]
                                |dxr| grad_row((dyr, xr, w, s), dxr, pdw),
                            )
                        };
                    }
                },
            )
        });
    for pdw in ws.chunks_exact(c).take(used) {
        dw.iter_mut().zip(pdw).for_each(|(a, b)| *a += b);
    }
}

/// One row of the gradient, `dx = s · (g − x̂ · mean(g ⊙ x̂))` with `g = dy ⊙ w` and
/// `x̂ = x · s`, adding the row's share of `dw` into `pdw`.
#[inline(always)]
fn grad_row((dyr, xr, w, s): (&[f32], &[f32], &[f32], f32), dxr: &mut [f32], pdw: &mut [f32]) {
    let c = xr.len();
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
