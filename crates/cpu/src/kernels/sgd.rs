//! The kernel of [`Sgd`]: one pass over a parameter, updated in place.

use snug_graph::ops::Sgd;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Sgd {
    fn run(&self, k: &Kernel<'_>) {
        if !k.ctx.is_last_micro() {
            return;
        }
        let scale = super::grad_scale(k, 2).unwrap_or(1.0);
        if !scale.is_finite() {
            return; // an overflow under loss scaling: the step is skipped
        }
        let (p, g) = (k.in_mut_f32(0), k.in_f32(1));
        let decay = 1.0 - k.ctx.lr * self.weight_decay;
        let lr = k.ctx.lr * scale;
        crate::par::elems_mut(
            p,
            #[inline(always)]
            |start, out| {
                let n = out.len();
                for (w, &gi) in out.iter_mut().zip(&g[start..start + n]) {
                    *w = *w * decay - lr * gi;
                }
            },
        );
    }
}
