//! The kernels of the fused SwiGLU gate, `silu(gate) · up`, and its gradient; under
//! [`snug_graph::ops::HalfIo`], each input read and output written in bf16 as its dtype says,
//! a run of elements at a time.

use snug_graph::ops::{SwiGlu, SwiGluBackward};

use super::half_io::{staged_runs, Dst, Src, STAGE};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for SwiGlu {
    fn run(&self, k: &Kernel<'_>) {
        crate::par::binary(k, gate);
    }
}

/// One element of the forward.
#[inline(always)]
fn gate(g: f32, u: f32) -> f32 {
    super::silu::silu(g) * u
}

/// One element of the gradient: `(dgate, dup)`.
#[inline(always)]
fn gate_grad(g: f32, u: f32, d: f32) -> (f32, f32) {
    let s = super::silu::sigmoid(g);
    let silu = g * s;
    (d * u * s * (1.0 + g * (1.0 - s)), d * silu)
}

/// [`SwiGlu`] with each input and the output stored as their dtypes say (never in place: the
/// shape rule gives it no in-place input).
pub(super) fn forward_io(k: &Kernel<'_>) {
    let (g, u, y) = (Src::input(k, 0), Src::input(k, 1), Dst::output(k, 0));
    staged_runs(
        k.in_shape(0).iter().product(),
        #[inline(always)]
        |at, n| {
            let ([mut bg, mut bu], mut by) = ([[0.0f32; STAGE]; 2], [0.0f32; STAGE]);
            let (g, u) = (g.get((at, n), &mut bg), u.get((at, n), &mut bu));
            // SAFETY: each run is written by one thread.
            unsafe {
                y.with(
                    (at, n),
                    &mut by,
                    #[inline(always)]
                    |y| {
                        for ((o, &g), &u) in y.iter_mut().zip(g).zip(u) {
                            *o = gate(g, u);
                        }
                    },
                )
            }
        },
    );
}

impl CpuKernel for SwiGluBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (gate, up, dy) = (k.in_f32(0), k.in_f32(1), k.in_f32(2));
        let (dgate, dup) = (k.out_f32(0), k.out_f32(1));
        crate::par::rows_mut2(
            dgate,
            1,
            dup,
            1,
            #[inline(always)]
            |start, dg, du| {
                let n = dg.len();
                let (g, u, d) = (
                    &gate[start..start + n],
                    &up[start..start + n],
                    &dy[start..start + n],
                );
                for i in 0..n {
                    (dg[i], du[i]) = gate_grad(g[i], u[i], d[i]);
                }
            },
        );
    }
}

/// [`SwiGluBackward`] with each input and output stored as their dtypes say.
pub(super) fn backward_io(k: &Kernel<'_>) {
    let ins = [0, 1, 2].map(|i| Src::input(k, i));
    let (dg, du) = (Dst::output(k, 0), Dst::output(k, 1));
    staged_runs(
        k.in_shape(0).iter().product(),
        #[inline(always)]
        |at, n| {
            let mut b = [[0.0f32; STAGE]; 5];
            let [bg, bu, bd, bdg, bdu] = &mut b;
            let (g, u, d) = (
                ins[0].get((at, n), bg),
                ins[1].get((at, n), bu),
                ins[2].get((at, n), bd),
            );
            // SAFETY: each run is written by one thread.
            unsafe {
                dg.with(
                    (at, n),
                    bdg,
                    #[inline(always)]
                    |dg| {
                        du.with(
                            (at, n),
                            bdu,
                            #[inline(always)]
                            |du| {
                                for i in 0..n {
                                    (dg[i], du[i]) = gate_grad(g[i], u[i], d[i]);
                                }
                            },
                        )
                    },
                )
            }
        },
    );
}
