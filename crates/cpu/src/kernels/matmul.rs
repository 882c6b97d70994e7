//! The kernel of [`MatMul`]: one product per batch entry through [`crate::gemm`], the bias
//! fused where our GEMM runs the product.

use snug_graph::ops::MatMul;

use crate::gemm::{gemm_fused, gemm_strided, par_for, Arith, Fused, Layout, Prologue};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for MatMul {
    fn run(&self, k: &Kernel<'_>) {
        let Ok(d) = self.dims(k.in_shape(0), k.in_shape(1)) else {
            unreachable!("shape rule checked at build time")
        };
        let (a, b, c) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let threads = rayon::current_num_threads();
        if self.bias && d.batch == 1 {
            let fused = Fused {
                prologue: Prologue::None,
                bias: Some(k.in_f32(2)),
                quant_b: None,
                half_a: None,
                arith: Arith::F32,
            };
            let par = par_for(d.m, d.n, d.k, threads);
            // SAFETY: the shape rule sized `a`, `b`, `c` and the bias for these dimensions.
            let dims = (d.m, d.n, d.k);
            if unsafe { gemm_fused(Layout::new((self.ta, self.tb), dims), a, b, c, par, fused) } {
                return;
            }
        }
        if self.bias {
            let bias = k.in_f32(2);
            crate::par::rows_mut(
                c,
                d.n,
                #[inline(always)]
                |_, rows| {
                    for row in rows.chunks_exact_mut(d.n) {
                        row.copy_from_slice(bias);
                    }
                },
            );
        }
        let a_stride = d.m * d.k;
        let b_stride = if d.shared_b { 0 } else { d.k * d.n };
        let c_stride = d.m * d.n;
        let layout = Layout::new((self.ta, self.tb), (d.m, d.n, d.k));
        let run = |i: usize, c: &mut [f32], par: gemm::Parallelism| {
            let (a, b) = (&a[i * a_stride..], &b[i * b_stride..]);
            // SAFETY: the slices hold `m·k`, `k·n` and `m·n` elements at the strides below.
            unsafe { gemm_strided(layout, a, b, c, self.bias, par, Arith::F32) }
        };
        if d.batch >= threads && threads > 1 {
            use rayon::prelude::*;
            c.par_chunks_mut(c_stride)
                .enumerate()
                .for_each(|(i, c)| run(i, c, gemm::Parallelism::None));
        } else {
            for (i, c) in c.chunks_mut(c_stride).enumerate() {
                run(i, c, par_for(d.m, d.n, d.k, threads));
            }
        }
    }
}
