//! The kernel of [`Cast`]: f32 to and from bf16 / f16, rounding to nearest even, in chunks on
//! the pool.

use snug_graph::ops::Cast;
use snug_graph::DType;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Cast {
    fn run(&self, k: &Kernel<'_>) {
        use half::slice::HalfFloatSliceExt;
        use half::{bf16, f16};
        use rayon::prelude::*;
        const CHUNK: usize = crate::par::MIN_PAR_ELEMS;
        // SAFETY (all four arms): bf16 and f16 are `repr(transparent)` over u16.
        match (k.in_dtype(0), self.to) {
            (DType::F32, to) => {
                let (x, y) = (k.in_f32(0), k.out_u16(0));
                y.par_chunks_mut(CHUNK)
                    .zip(x.par_chunks(CHUNK))
                    .for_each(|(y, x)| {
                        crate::isa::vectorized(
                            #[inline(always)]
                            || match to {
                                DType::BF16 => unsafe { &mut *(y as *mut [u16] as *mut [bf16]) }
                                    .convert_from_f32_slice(x),
                                _ => unsafe { &mut *(y as *mut [u16] as *mut [f16]) }
                                    .convert_from_f32_slice(x),
                            },
                        )
                    });
            }
            (from, _) => {
                let (x, y) = (k.in_u16(0), k.out_f32(0));
                y.par_chunks_mut(CHUNK)
                    .zip(x.par_chunks(CHUNK))
                    .for_each(|(y, x)| {
                        crate::isa::vectorized(
                            #[inline(always)]
                            || match from {
                                DType::BF16 => unsafe { &*(x as *const [u16] as *const [bf16]) }
                                    .convert_to_f32_slice(y),
                                _ => unsafe { &*(x as *const [u16] as *const [f16]) }
                                    .convert_to_f32_slice(y),
                            },
                        )
                    });
            }
        }
    }
}
