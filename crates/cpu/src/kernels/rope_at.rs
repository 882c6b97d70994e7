//! The kernel of [`RopeAt`]: [`Rope`](snug_graph::ops::Rope)'s, starting at the position input.

use snug_graph::ops::RopeAt;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for RopeAt {
    fn run(&self, k: &Kernel<'_>) {
        // The runtime range-checks the position when it is written; never negative here.
        let first = usize::try_from(k.in_i32(1)[0]).unwrap_or(0);
        super::rope::rotate(&self.rope, k, first);
    }
}
