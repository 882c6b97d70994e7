//! The kernels of `gelu(h) · w + b` and its gradient: GELU taken in by the GEMM as it packs
//! `h` where our kernel runs the product, else made a tile of rows at a time in the
//! workspace; the backward remakes it tile by tile in the pass that forms `dh`.

use snug_graph::ops::{
    gelu_linear::TILE_ELEMS, linear_dims, tile_rows, GeluApprox, GeluLinear, GeluLinearBackward,
};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for GeluLinear {
    fn run(&self, kern: &Kernel<'_>) {
        match self.approx {
            GeluApprox::Tanh => forward::<true>(kern),
            GeluApprox::Exact => forward::<false>(kern),
        }
    }
}

impl CpuKernel for GeluLinearBackward {
    fn run(&self, kern: &Kernel<'_>) {
        match self.approx {
            GeluApprox::Tanh => backward::<true>(kern),
            GeluApprox::Exact => backward::<false>(kern),
        }
    }
}

#[inline(always)]
fn approx_of(tanh: bool) -> GeluApprox {
    if tanh {
        GeluApprox::Tanh
    } else {
        GeluApprox::Exact
    }
}

fn forward<const TANH: bool>(kern: &Kernel<'_>) {
    use crate::gemm::{gemm_fused, linear_rows, par_for, Fused, Layout, Prologue};
    let (h, w, bias) = (kern.in_f32(0), kern.in_f32(1), kern.in_f32(2));
    let Ok((rows, k, n)) = linear_dims("gelu_linear", kern.in_shape(0), kern.in_shape(1)) else {
        unreachable!("shape rule checked at build time")
    };
    let y = kern.out_f32(0);
    // Where our GEMM kernel runs the product, it takes GELU of `h` as it packs it.
    let fused = Fused {
        prologue: Prologue::Gelu(approx_of(TANH)),
        bias: Some(bias),
        quant_b: None,
        half_a: None,
    };
    let par = par_for(rows, n, k, rayon::current_num_threads());
    // SAFETY: `h` holds rows·k, `w` k·n and `y` rows·n elements.
    if unsafe {
        gemm_fused(
            Layout::new((false, false), (rows, n, k)),
            h,
            w,
            y,
            par,
            fused,
        )
    } {
        return;
    }
    let ws = kern.workspace();
    let tile = tile_rows(rows, k, TILE_ELEMS);
    for r0 in (0..rows).step_by(tile) {
        let r1 = (r0 + tile).min(rows);
        let g = &mut ws[..(r1 - r0) * k];
        crate::par::map(&h[r0 * k..r1 * k], g, |v| {
            crate::math::gelu(approx_of(TANH), v)
        });
        linear_rows(g, w, bias, &mut y[r0 * n..r1 * n], (r1 - r0, k, n));
    }
}

fn backward<const TANH: bool>(kern: &Kernel<'_>) {
    use crate::gemm::{gemm_strided, input_grad_rows, par_for, Layout};
    use rayon::prelude::*;
    // Run in place, `h` is read through `dh`: each element is read before it is written.
    let h = (kern.inplace() != Some(0)).then(|| kern.in_f32(0));
    let (w, dy) = (kern.in_f32(1), kern.in_f32(2));
    let Ok((rows, k, n)) = linear_dims("gelu_linear_backward", kern.in_shape(0), kern.in_shape(1))
    else {
        unreachable!("shape rule checked at build time")
    };
    let (dh, dw, ws) = (kern.out_f32(0), kern.out_f32(1), kern.workspace());
    let threads = rayon::current_num_threads();
    // The tile the plan sized the workspace for (on its target, not necessarily this CPU).
    let tile = (ws.len() / k.max(1)).clamp(1, rows.max(1));
    for r0 in (0..rows).step_by(tile) {
        let r1 = (r0 + tile).min(rows);
        let (t, dyt) = (&mut ws[..(r1 - r0) * k], &dy[r0 * n..r1 * n]);
        // dg = dy · wᵀ for this tile's rows.
        input_grad_rows(dyt, w, t, (r1 - r0, k, n));
        // One pass: dh = dg ⊙ gelu'(h), and the tile's dg is replaced by g = gelu(h).
        let dht = &mut dh[r0 * k..r1 * k];
        let chunk = crate::par::MIN_PAR_ELEMS;
        let step = |t: &mut f32, d: &mut f32, v: f32| {
            let (value, slope) = crate::math::gelu_and_grad(approx_of(TANH), v);
            *d = *t * slope;
            *t = value;
        };
        match h {
            Some(h) => t
                .par_chunks_mut(chunk)
                .zip(dht.par_chunks_mut(chunk))
                .zip(h[r0 * k..r1 * k].par_chunks(chunk))
                .for_each(|((t, d), x)| {
                    crate::isa::vectorized(|| {
                        for ((t, d), &v) in t.iter_mut().zip(d.iter_mut()).zip(x) {
                            step(t, d, v);
                        }
                    })
                }),
            None => t
                .par_chunks_mut(chunk)
                .zip(dht.par_chunks_mut(chunk))
                .for_each(|(t, d)| {
                    crate::isa::vectorized(|| {
                        for (t, d) in t.iter_mut().zip(d.iter_mut()) {
                            let v = *d;
                            step(t, d, v);
                        }
                    })
                }),
        }
        // dw (+)= gᵀ · dy over this tile's rows.
        // SAFETY: `t` holds (r1-r0)·k, `dyt` (r1-r0)·n and `dw` k·n elements.
        unsafe {
            gemm_strided(
                Layout::new((true, false), (k, n, r1 - r0)),
                t,
                dyt,
                dw,
                r0 > 0,
                par_for(k, n, r1 - r0, threads),
            )
        };
    }
}
