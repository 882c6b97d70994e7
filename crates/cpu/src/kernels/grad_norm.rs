//! The kernels of the global gradient norm: each gradient's sum of squares (in f64), and their
//! total's square root.

use snug_graph::ops::{GradNorm, StoreSumSquares, SumSquares};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for SumSquares {
    fn run(&self, k: &Kernel<'_>) {
        use rayon::prelude::*;
        if !k.ctx.is_last_micro() {
            return;
        }
        let x = k.in_f32(0);
        let sum: f64 = x
            .par_chunks(crate::par::MIN_PAR_ELEMS)
            .map(|c| {
                crate::isa::vectorized(
                    #[inline(always)]
                    || c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>(),
                )
            })
            .sum();
        k.out_f32(0)[0] = sum as f32;
    }
}

impl CpuKernel for GradNorm {
    fn run(&self, k: &Kernel<'_>) {
        if !k.ctx.is_last_micro() {
            return;
        }
        let n_sums = k.in_count() - usize::from(self.unscale);
        let total: f64 = (0..n_sums).map(|i| k.in_f32(i)[0] as f64).sum();
        let scale = if self.unscale {
            self.scale / k.in_f32(n_sums)[0]
        } else {
            self.scale
        };
        let norm = (total.sqrt() * scale as f64) as f32;
        let clip = if self.max_norm.is_finite() {
            (self.max_norm / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        k.out_f32(0)[0] = if self.unscale && !norm.is_finite() {
            f32::NAN
        } else {
            scale * clip
        };
        k.out_f32(1)[0] = norm;
    }
}

impl CpuKernel for StoreSumSquares {
    fn run(&self, k: &Kernel<'_>) {
        if !k.ctx.is_last_micro() {
            return;
        }
        let total: f64 = (1..k.in_count()).map(|i| k.in_f32(i)[0] as f64).sum();
        k.in_mut_f32(0)[0] = total as f32;
    }
}
