//! Layer normalisation over the last axis with affine weight and bias. The forward saves each
//! row's mean and reciprocal standard deviation for the backward.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// `y = (x − mean) · rstd · w + b`; outputs `[y, mean, rstd]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    pub eps: f32,
}

impl Default for LayerNorm {
    fn default() -> Self {
        LayerNorm { eps: 1e-5 }
    }
}

#[cfg(feature = "cpu")]
fn rows_and_width(shape: &[usize]) -> (usize, usize) {
    let c = *shape.last().unwrap_or(&1);
    (shape.iter().product::<usize>() / c.max(1), c)
}

impl OpRule for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let x = &inputs[0].shape;
        let Some(&c) = x.last() else {
            return Err(shape_err(self.name(), "input must have at least one axis"));
        };
        for (i, what) in [(1, "weight"), (2, "bias")] {
            if inputs[i].shape != [c] {
                return Err(shape_err(
                    self.name(),
                    format!("{what} has shape {:?}, expected [{c}]", inputs[i].shape),
                ));
            }
        }
        let stats = x[..x.len() - 1].to_vec();
        let mut y = OutSpec::f32(x.clone());
        y.dtype = dtype;
        Ok(vec![
            y,
            OutSpec::f32(stats.clone()).named("mean"),
            OutSpec::f32(stats).named("rstd"),
        ])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        let ins = [dy, ctx.input(0), ctx.input(1), ctx.output(1), ctx.output(2)];
        let g = ctx.apply(LayerNormBackward, &ins)?;
        for (i, &t) in g.iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, t);
            }
        }
        Ok(())
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        8 * inputs[0].numel() as u64
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use rayon::prelude::*;
        let (x, w, b) = (k.in_f32(0), k.in_f32(1), k.in_f32(2));
        let (y, mean, rstd) = (k.out_f32(0), k.out_f32(1), k.out_f32(2));
        let (_, c) = rows_and_width(k.in_shape(0));
        let eps = self.eps;
        let rows_per = (super::par::MIN_PAR_ELEMS / c).max(1);
        y.par_chunks_mut(rows_per * c)
            .zip(mean.par_chunks_mut(rows_per))
            .zip(rstd.par_chunks_mut(rows_per))
            .enumerate()
            .for_each(|(chunk, ((y, mean), rstd))| {
                let r0 = chunk * rows_per;
                for (r, yr) in y.chunks_exact_mut(c).enumerate() {
                    let xr = &x[(r0 + r) * c..(r0 + r + 1) * c];
                    (mean[r], rstd[r]) = normalize_row(xr, w, b, eps, yr);
                }
            });
    }
}

/// One row of the forward: writes `y` and returns the row's `(mean, rstd)`.
#[cfg(feature = "cpu")]
#[inline]
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
#[cfg(feature = "cpu")]
#[inline]
pub(super) fn row_stats(xr: &[f32], eps: f32) -> (f32, f32) {
    let c = xr.len() as f32;
    let m = super::math::sum(xr) / c;
    let var = super::math::sum_by(xr, |v| (v - m) * (v - m)) / c;
    (m, 1.0 / (var + eps).sqrt())
}

/// One row of the backward's first pass: adds the row's terms of `dw` and `db` to `pdw` and
/// `pdb`, and returns `(mean(g), mean(g·x̂))` of `g = dy·w`, which every `dx` of the row needs.
#[cfg(feature = "cpu")]
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
#[cfg(feature = "cpu")]
#[inline(always)]
pub(super) fn dx_value(dy: f32, x: f32, w: f32, (m, s): (f32, f32), (mg, mgx): (f32, f32)) -> f32 {
    let xhat = (x - m) * s;
    s * (dy * w - mg - xhat * mgx)
}

/// Inputs `[dy, x, w, mean, rstd]`; outputs `[dx, dw, db]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerNormBackward;

impl OpRule for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer_norm_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 5)?;
        let x = &inputs[1].shape;
        if &inputs[0].shape != x {
            return Err(shape_err(self.name(), "dy and x differ in shape"));
        }
        let w = inputs[2].shape.clone();
        let (xt, wt) = (inputs[1].dtype, inputs[2].dtype);
        Ok(vec![
            OutSpec::f32(x.clone()).with_dtype(xt),
            OutSpec::f32(w.clone()).with_dtype(wt),
            OutSpec::f32(w).with_dtype(wt),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "layer_norm_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One partial `dw` and `db` per thread, summed at the end.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        2 * threads * inputs[2].numel()
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        12 * inputs[0].numel() as u64
    }

    /// `dx` may be written over `dy` or `x`: each row is read whole before it is written.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0, 1]
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
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
                    let dx_of = |dy: f32, x: f32, w: f32| dx_value(dy, x, w, (m, s), (mg, mgx));
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
