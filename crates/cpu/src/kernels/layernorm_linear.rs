//! The kernels of `layer_norm(x) · w + b` and its gradient: the normalisation taken in by the
//! GEMM as it packs `x` where our kernel runs the product, else made a tile at a time in the
//! workspace.

use snug_graph::ops::{
    layernorm_linear::{FORWARD_TILE_ELEMS, TILE_ELEMS},
    linear_dims, tile_rows, LayerNormLinear, LayerNormLinearBackward,
};

use crate::gemm::{Arith, Operand};
use crate::kernel::{CpuKernel, Kernel};

use super::layernorm::{backward_sums, dx_value, normalize_row, row_stats};

impl CpuKernel for LayerNormLinear {
    fn run(&self, kern: &Kernel<'_>) {
        forward(self.eps, kern);
    }
}

impl CpuKernel for LayerNormLinearBackward {
    fn run(&self, kern: &Kernel<'_>) {
        backward(kern, Operand::F32(kern.in_f32(6)), Arith::F32);
    }
}

/// [`LayerNormLinearBackward`]'s kernel under [`snug_graph::ops::HalfIo`], its products in
/// bf16 arithmetic: with `half_dy`, the output gradient is read in bf16 as the GEMMs pack it.
pub(super) fn backward_io(kern: &Kernel<'_>, half_dy: bool) {
    let dy = if half_dy {
        Operand::Bf16(kern.in_u16(6))
    } else {
        Operand::F32(kern.in_f32(6))
    };
    backward(kern, dy, Arith::Bf16);
}

/// Normalises rows `r0..r0 + tile.len() / k` of `x` into `tile`, in parallel over rows, storing
/// each row's mean and rstd.
fn normalize_tile(
    x: &[f32],
    (ln_w, ln_b, eps): (&[f32], &[f32], f32),
    r0: usize,
    tile: &mut [f32],
    (mean, rstd): (&mut [f32], &mut [f32]),
) {
    use rayon::prelude::*;
    let k = ln_w.len();
    let rows_per = (crate::par::MIN_PAR_ELEMS / k).max(1);
    tile.par_chunks_mut(rows_per * k)
        .zip(mean.par_chunks_mut(rows_per))
        .zip(rstd.par_chunks_mut(rows_per))
        .enumerate()
        .for_each(|(c, ((t, mean), rstd))| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    for (r, yr) in t.chunks_exact_mut(k).enumerate() {
                        let row = r0 + c * rows_per + r;
                        let xr = &x[row * k..(row + 1) * k];
                        (mean[r], rstd[r]) = normalize_row(xr, ln_w, ln_b, eps, yr);
                    }
                },
            )
        });
}

/// Rows `r0..r0 + m` of `layer_norm(x)` from the saved statistics, written transposed into
/// `out` (`[k, m]`): bit for bit the forward's values. Parallel over blocks of columns; rows
/// go 16 at a time, so each output row is written in runs and `x` is read in short strips.
fn normalize_tile_transposed(
    x: &[f32],
    ln_w: &[f32],
    ln_b: &[f32],
    (mean, rstd): (&[f32], &[f32]),
    r0: usize,
    m: usize,
    out: &mut [f32],
) {
    use rayon::prelude::*;
    const COLS: usize = 32;
    const ROWS: usize = 16;
    let k = ln_w.len();
    out[..k * m]
        .par_chunks_mut(COLS * m)
        .enumerate()
        .for_each(|(c, block)| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    let j0 = c * COLS;
                    for ra in (0..m).step_by(ROWS) {
                        let rb = (ra + ROWS).min(m);
                        for (jj, out_row) in block.chunks_exact_mut(m).enumerate() {
                            let j = j0 + jj;
                            let (wj, bj) = (ln_w[j], ln_b[j]);
                            for (o, r) in out_row[ra..rb].iter_mut().zip(r0 + ra..r0 + rb) {
                                *o = (x[r * k + j] - mean[r]) * rstd[r] * wj + bj;
                            }
                        }
                    }
                },
            )
        });
}

/// The GEMM prologue that normalises `x` (or, not `tokens_down`, `xᵀ`) from saved statistics.
fn norm_prologue<'a>(
    (mean, rstd): (&'a [f32], &'a [f32]),
    (w, b): (&'a [f32], &'a [f32]),
    tokens_down: bool,
) -> crate::gemm::Prologue<'a> {
    crate::gemm::Prologue::LayerNorm {
        mean,
        rstd,
        w,
        b,
        tokens_down,
    }
}

/// Each row's mean and rstd, in parallel over rows.
fn row_stats_all(x: &[f32], k: usize, eps: f32, mean: &mut [f32], rstd: &mut [f32]) {
    use rayon::prelude::*;
    let rows_per = (crate::par::MIN_PAR_ELEMS / k).max(1);
    x.par_chunks(rows_per * k)
        .zip(mean.par_chunks_mut(rows_per))
        .zip(rstd.par_chunks_mut(rows_per))
        .for_each(|((x, mean), rstd)| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    for ((xr, m), s) in x.chunks_exact(k).zip(mean).zip(rstd) {
                        (*m, *s) = row_stats(xr, eps);
                    }
                },
            )
        });
}

fn forward(eps: f32, kern: &Kernel<'_>) {
    let (mean, rstd) = (kern.out_f32(1), kern.out_f32(2));
    let rows = mean.len();
    forward_rows(
        eps,
        kern,
        kern.workspace(),
        (mean, rstd),
        (0..rows, kern.out_f32(0)),
        Arith::F32,
    );
}

/// [`LayerNormLinear`]'s kernel under [`snug_graph::ops::HalfIo`]: `y` written in bf16, a
/// tile of rows at a time, the product in bf16 arithmetic.
pub(super) fn forward_io(eps: f32, kern: &Kernel<'_>) {
    let (mean, rstd) = (kern.out_f32(1), kern.out_f32(2));
    let Ok((rows, _, n)) = linear_dims("layer_norm_linear", kern.in_shape(0), kern.in_shape(3))
    else {
        unreachable!("shape rule checked at build time")
    };
    super::half_io::write_rows(kern, (rows, n), kern.workspace(), |r, ws, y| {
        forward_rows(eps, kern, ws, (&mut *mean, &mut *rstd), (r, y), Arith::Bf16)
    });
}

/// Rows `rows` of `y` into `y` (those rows only), with their statistics; the product in
/// `arith`.
fn forward_rows(
    eps: f32,
    kern: &Kernel<'_>,
    ws: &mut [f32],
    (mean, rstd): (&mut [f32], &mut [f32]),
    (rows, y): (std::ops::Range<usize>, &mut [f32]),
    arith: Arith,
) {
    use crate::gemm::{gemm_fused, linear_rows, par_for, Fused, Layout};
    let (x, ln_w, ln_b) = (kern.in_f32(0), kern.in_f32(1), kern.in_f32(2));
    let (w, bias) = (kern.in_f32(3), kern.in_f32(4));
    let Ok((all_rows, k, n)) = linear_dims("layer_norm_linear", kern.in_shape(0), kern.in_shape(3))
    else {
        unreachable!("shape rule checked at build time")
    };
    let m = rows.len();
    let x = &x[rows.start * k..rows.end * k];
    let (mean, rstd) = (&mut mean[rows.clone()], &mut rstd[rows]);
    // Where our GEMM kernel runs the product, it normalises rows as it packs them: only the
    // statistics are made beforehand, and no normalised row is stored.
    row_stats_all(x, k, eps, mean, rstd);
    let fused = Fused {
        prologue: norm_prologue((mean, rstd), (ln_w, ln_b), true),
        bias: Some(bias),
        arith,
        ..Fused::NONE
    };
    let par = par_for(m, n, k, rayon::current_num_threads());
    // SAFETY: `x` holds m·k, `w` k·n and `y` m·n elements; the statistics cover every row
    // and the norm's weights every feature.
    if unsafe { gemm_fused(Layout::new((false, false), (m, n, k)), x, w, y, par, fused) } {
        return;
    }
    // The workspace holds a tile of the whole op's rows.
    let tile = tile_rows(all_rows, k, FORWARD_TILE_ELEMS);
    for r0 in (0..m).step_by(tile) {
        let r1 = (r0 + tile).min(m);
        let t = &mut ws[..(r1 - r0) * k];
        let stats = (&mut mean[r0..r1], &mut rstd[r0..r1]);
        normalize_tile(x, (ln_w, ln_b, eps), r0, t, stats);
        linear_rows(t, w, bias, &mut y[r0 * n..r1 * n], (r1 - r0, k, n), arith);
    }
}

fn backward(kern: &Kernel<'_>, dy: Operand<'_>, arith: Arith) {
    use crate::gemm::{
        gemm_fused_half, gemm_half, gemm_strided, input_grad_rows, par_for, Fused, Layout,
    };
    use rayon::prelude::*;
    // Run in place, `x` is read through `dx`: every read of a row comes before its write.
    let x_in = (kern.inplace() != Some(0)).then(|| kern.in_f32(0));
    let (ln_w, ln_b) = (kern.in_f32(1), kern.in_f32(2));
    let (mean, rstd, w) = (kern.in_f32(3), kern.in_f32(4), kern.in_f32(5));
    let Ok((rows, k, n)) = linear_dims(
        "layer_norm_linear_backward",
        kern.in_shape(0),
        kern.in_shape(5),
    ) else {
        unreachable!("shape rule checked at build time")
    };
    let (dx, d_ln_w, d_ln_b, dw) = (
        kern.out_f32(0),
        kern.out_f32(1),
        kern.out_f32(2),
        kern.out_f32(3),
    );
    let threads = rayon::current_num_threads();
    // dw = layer_norm(x)ᵀ · dy in one product over all rows where our GEMM kernel runs it,
    // normalising `x` as it packs it; otherwise a tile at a time below. Either way every row
    // of `x` is read for it before the row's `dx` is written.
    let fused = Fused {
        prologue: norm_prologue((mean, rstd), (ln_w, ln_b), false),
        arith,
        ..Fused::NONE
    };
    let par = par_for(k, n, rows, threads);
    // SAFETY: `x` holds rows·k, `dy` rows·n and `dw` k·n elements; the statistics cover every
    // row and the norm's weights every feature.
    let dw_done = unsafe {
        gemm_fused_half(
            Layout::new((true, false), (k, n, rows)),
            (Operand::F32(x_in.unwrap_or(&*dx)), dy),
            dw,
            par,
            fused,
        )
    };
    // Off our kernel a bf16 `dy` is widened once for the tile loop's products.
    let mut widened = Vec::new();
    let dy = match (dw_done, dy) {
        (false, Operand::Bf16(_)) => Operand::F32(dy.widened(&mut widened)),
        _ => dy,
    };
    let tile = tile_rows(rows, k, TILE_ELEMS);
    let (ws, partials) = kern.workspace().split_at_mut(tile * k);
    partials.fill(0.0);
    let parts = partials.len() / (2 * k);
    for r0 in (0..rows).step_by(tile) {
        let r1 = (r0 + tile).min(rows);
        let t = &mut ws[..(r1 - r0) * k];
        let dyt = dy.rows(r0 * n..r1 * n);
        if !dw_done {
            let Operand::F32(dyt) = dyt else {
                unreachable!("widened above")
            };
            // The normalised rows, remade transposed (`[k, rows]`): the weight gradient's GEMM
            // then reads its left operand plainly, which the gemm crate ran 5-14 % faster at
            // char-small's shapes.
            normalize_tile_transposed(
                x_in.unwrap_or(&*dx),
                ln_w,
                ln_b,
                (mean, rstd),
                r0,
                r1 - r0,
                t,
            );
            // dw (+)= layer_norm(x)ᵀ · dy over this tile's rows.
            // SAFETY: `t` holds k·(r1-r0), `dyt` (r1-r0)·n and `dw` k·n elements.
            unsafe {
                gemm_strided(
                    Layout::new((false, false), (k, n, r1 - r0)),
                    t,
                    dyt,
                    dw,
                    r0 > 0,
                    par_for(k, n, r1 - r0, threads),
                    arith,
                )
            };
        }
        // The LayerNorm's output gradient for the tile's rows, dy · wᵀ.
        let m = r1 - r0;
        match dyt {
            Operand::F32(dyt) => input_grad_rows(dyt, w, t, (m, k, n), arith),
            half => {
                let layout = Layout::new((false, true), (m, k, n));
                gemm_half(
                    layout,
                    (half, Operand::F32(w)),
                    t,
                    None,
                    par_for(m, k, n, threads),
                    arith,
                );
            }
        }
        // The LayerNorm backward into dx's rows. Part `p` always takes the same rows of a
        // tile, so the partial sums (and the result) do not depend on thread timing.
        let rows_per = (r1 - r0).div_ceil(parts);
        dx[r0 * k..r1 * k]
            .par_chunks_mut(rows_per * k)
            .zip(t.par_chunks(rows_per * k))
            .zip(partials.par_chunks_mut(2 * k))
            .enumerate()
            .for_each(|(p, ((dxp, tp), part))| {
                crate::isa::vectorized(
                    #[inline(always)]
                    || {
                        let (pdw, pdb) = part.split_at_mut(k);
                        for (r, (dxr, gr)) in
                            dxp.chunks_exact_mut(k).zip(tp.chunks_exact(k)).enumerate()
                        {
                            let row = r0 + p * rows_per + r;
                            let ms = (mean[row], rstd[row]);
                            match x_in {
                                Some(x) => {
                                    let xr = &x[row * k..(row + 1) * k];
                                    let sums = backward_sums(gr, xr, ln_w, ms, pdw, pdb);
                                    for (((o, &g), &v), &wj) in
                                        dxr.iter_mut().zip(gr).zip(xr).zip(ln_w)
                                    {
                                        *o = dx_value(g, v, wj, ms, sums);
                                    }
                                }
                                None => {
                                    let sums = backward_sums(gr, dxr, ln_w, ms, pdw, pdb);
                                    for ((o, &g), &wj) in dxr.iter_mut().zip(gr).zip(ln_w) {
                                        *o = dx_value(g, *o, wj, ms, sums);
                                    }
                                }
                            }
                        }
                    },
                )
            });
    }
    d_ln_w.fill(0.0);
    d_ln_b.fill(0.0);
    for part in partials.chunks_exact(2 * k) {
        let (pdw, pdb) = part.split_at(k);
        d_ln_w.iter_mut().zip(pdw).for_each(|(a, b)| *a += b);
        d_ln_b.iter_mut().zip(pdb).for_each(|(a, b)| *a += b);
    }
}
