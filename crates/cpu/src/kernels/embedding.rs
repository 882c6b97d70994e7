//! The kernels of embedding lookup (a gather of rows) and its gradient (a scatter-add).

use snug_graph::ops::{Embedding, EmbeddingBackward};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Embedding {
    fn run(&self, k: &Kernel<'_>) {
        let (table, ids, out) = (k.in_f32(0), k.in_i32(1), k.out_f32(0));
        let c = k.in_shape(0)[1];
        let vocab = k.in_shape(0)[0];
        crate::par::rows_mut(
            out,
            c,
            #[inline(always)]
            |r0, rows| {
                for (r, row) in rows.chunks_exact_mut(c).enumerate() {
                    let id = ids[r0 + r];
                    // Ids are range-checked when a batch is loaded; a stray one reads zeros.
                    match usize::try_from(id).ok().filter(|&i| i < vocab) {
                        Some(i) => row.copy_from_slice(&table[i * c..(i + 1) * c]),
                        None => row.fill(0.0),
                    }
                }
            },
        );
    }
}

impl CpuKernel for EmbeddingBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (ids, dy, dt) = (k.in_i32(0), k.in_f32(1), k.out_f32(0));
        let c = *k.in_shape(1).last().unwrap_or(&1);
        dt.fill(0.0);
        for (t, &id) in ids.iter().enumerate() {
            if let Some(i) = usize::try_from(id).ok().filter(|&i| i < self.vocab) {
                let (dst, src) = (&mut dt[i * c..(i + 1) * c], &dy[t * c..(t + 1) * c]);
                dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
            }
        }
    }
}
