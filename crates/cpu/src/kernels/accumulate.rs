//! The kernel of [`AccumulateGrad`]: sums a micro-batch's gradient into its accumulator, and on
//! the last micro-batch writes the total.

use snug_graph::ops::AccumulateGrad;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for AccumulateGrad {
    fn run(&self, k: &Kernel<'_>) {
        let (acc, g) = (k.in_mut_f32(0), k.in_f32(1));
        if k.ctx.is_last_micro() {
            let out = k.out_f32(0);
            crate::par::elems_mut(
                out,
                #[inline(always)]
                |start, out| {
                    let n = out.len();
                    for ((o, &a), &gi) in
                        out.iter_mut().zip(&acc[start..start + n]).zip(&g[start..])
                    {
                        *o = a + gi;
                    }
                },
            );
        } else if k.ctx.micro == 0 {
            acc.copy_from_slice(g);
        } else {
            crate::par::elems_mut(
                acc,
                #[inline(always)]
                |start, acc| {
                    for (a, &gi) in acc.iter_mut().zip(&g[start..]) {
                        *a += gi;
                    }
                },
            );
        }
    }
}
