//! The kernels of the shape changes: none for the views (`Reshape`, `Narrow`), a copy for
//! `Transpose` and `Pad`.

use snug_graph::ops::{Narrow, Pad, Reshape, Transpose};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Reshape {
    fn run(&self, _k: &Kernel<'_>) {}
}

impl CpuKernel for Narrow {
    fn run(&self, _k: &Kernel<'_>) {}
}

impl CpuKernel for Pad {
    fn run(&self, k: &Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let row: usize = k.in_shape(0)[1..].iter().product();
        y.fill(0.0);
        y[self.start * row..self.start * row + x.len()].copy_from_slice(x);
    }
}

impl CpuKernel for Transpose {
    fn run(&self, k: &Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let in_shape = k.in_shape(0);
        let out_shape = k.out_shape(0);
        let rank = in_shape.len();
        let mut in_strides = vec![1; rank];
        for i in (0..rank.saturating_sub(1)).rev() {
            in_strides[i] = in_strides[i + 1] * in_shape[i + 1];
        }
        // Output axis d reads input axis perm[d].
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(self.dim0, self.dim1);
        crate::par::elems_mut(
            y,
            #[inline(always)]
            |start, out| {
                for (j, o) in out.iter_mut().enumerate() {
                    let mut rem = start + j;
                    let mut src = 0;
                    for d in (0..rank).rev() {
                        src += (rem % out_shape[d]) * in_strides[perm[d]];
                        rem /= out_shape[d];
                    }
                    *o = x[src];
                }
            },
        );
    }
}
