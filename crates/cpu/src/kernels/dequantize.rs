//! The kernel of [`Dequantize`]: a quantized frozen weight's f32 values, in chunks on the pool.

use snug_graph::ops::Dequantize;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Dequantize {
    fn run(&self, k: &Kernel<'_>) {
        use rayon::prelude::*;
        // A multiple of the NF4 block, so no chunk starts inside a byte.
        const CHUNK: usize = crate::par::MIN_PAR_ELEMS;
        let (codes, absmax, y) = (k.in_u8(0), k.in_f32(1), k.out_f32(0));
        let cols = self.shape.last().copied().unwrap_or(1);
        y.par_chunks_mut(CHUNK).enumerate().for_each(|(c, y)| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    self.scheme
                        .dequantize_range(codes, absmax, cols, c * CHUNK, y)
                },
            )
        });
    }
}
