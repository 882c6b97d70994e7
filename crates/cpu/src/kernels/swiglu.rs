//! The kernels of the fused SwiGLU gate, `silu(gate) · up`, and its gradient.

use snug_graph::ops::{SwiGlu, SwiGluBackward};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for SwiGlu {
    fn run(&self, k: &Kernel<'_>) {
        crate::par::binary(k, |g, u| super::silu::silu(g) * u);
    }
}

impl CpuKernel for SwiGluBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (gate, up, dy) = (k.in_f32(0), k.in_f32(1), k.in_f32(2));
        let (dgate, dup) = (k.out_f32(0), k.out_f32(1));
        crate::par::rows_mut2(dgate, 1, dup, 1, |start, dg, du| {
            let n = dg.len();
            let (g, u, d) = (
                &gate[start..start + n],
                &up[start..start + n],
                &dy[start..start + n],
            );
            for i in 0..n {
                let s = super::silu::sigmoid(g[i]);
                let silu = g[i] * s;
                dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                du[i] = d[i] * silu;
            }
        });
    }
}
