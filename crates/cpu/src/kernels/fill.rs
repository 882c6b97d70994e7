//! The kernel of [`Fill`].

use snug_graph::ops::Fill;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Fill {
    fn run(&self, k: &Kernel<'_>) {
        k.out_f32(0).fill(self.value);
    }
}
