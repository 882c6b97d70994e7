//! The kernels of reductions over one axis, and of `SumTo` / `BroadcastTo` and
//! `MaxBackward`.

use snug_graph::ops::{reduce::split_axis, BroadcastTo, MaxBackward, Reduce, ReduceKind, SumTo};

use super::half_io::Elem;
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Reduce {
    fn run(&self, k: &Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let (outer, n, inner) = split_axis(k.in_shape(0), self.axis);
        let kind = self.kind;
        crate::par::rows_mut(
            y,
            inner,
            #[inline(always)]
            |row0, rows| {
                for (r, out) in rows.chunks_exact_mut(inner).enumerate() {
                    let o = row0 + r;
                    let base = o * n * inner;
                    let init = if kind == ReduceKind::Max {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    };
                    out.fill(init);
                    for j in 0..n {
                        let src = &x[base + j * inner..base + (j + 1) * inner];
                        for (acc, &v) in out.iter_mut().zip(src) {
                            *acc = if kind == ReduceKind::Max {
                                acc.max(v)
                            } else {
                                *acc + v
                            };
                        }
                    }
                    if kind == ReduceKind::Mean {
                        let inv = 1.0 / n as f32;
                        out.iter_mut().for_each(|v| *v *= inv);
                    }
                }
            },
        );
        debug_assert_eq!(y.len(), outer * inner);
    }
}

impl CpuKernel for MaxBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (x, dy, dx) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let (outer, n, inner) = split_axis(k.in_shape(0), self.axis);
        dx.fill(0.0);
        for o in 0..outer {
            for i in 0..inner {
                let mut best = 0;
                for j in 1..n {
                    if x[(o * n + j) * inner + i] > x[(o * n + best) * inner + i] {
                        best = j;
                    }
                }
                dx[(o * n + best) * inner + i] = dy[o * inner + i];
            }
        }
    }
}

impl CpuKernel for SumTo {
    fn run(&self, k: &Kernel<'_>) {
        sum_to(self, k, k.in_f32(0));
    }
}

/// [`SumTo`]'s kernel under [`snug_graph::ops::HalfIo`]: `x` read in bf16 (a bias gradient
/// summed from the bf16 output gradient).
pub(super) fn sum_to_io(op: &SumTo, k: &Kernel<'_>) {
    sum_to(op, k, super::half_io::input::<u16>(k, 0));
}

/// `x`, stored as `X`, summed to the op's shape.
fn sum_to<X: Elem>(op: &SumTo, k: &Kernel<'_>, x: &[X]) {
    use super::broadcast::Mapping;
    let y = k.out_f32(0);
    match Mapping::new(&op.shape, k.in_shape(0)) {
        Mapping::Same => y.iter_mut().zip(x).for_each(|(o, v)| *o = v.get()),
        Mapping::Cycle(n) => {
            // A bias gradient: each worker sums a contiguous block of rows into its own
            // partial, and the partials are added in order (deterministic for a thread count).
            use rayon::prelude::*;
            let rows = x.len() / n;
            let ws = k.workspace();
            let parts = (ws.len() / n).clamp(1, rows.max(1));
            let rows_per = rows.div_ceil(parts);
            let sum_rows = |p: usize, acc: &mut [f32]| {
                acc.fill(0.0);
                for r in p * rows_per..((p + 1) * rows_per).min(rows) {
                    for (a, v) in acc.iter_mut().zip(&x[r * n..(r + 1) * n]) {
                        *a += v.get();
                    }
                }
            };
            if parts <= 1 {
                sum_rows(0, y);
                return;
            }
            ws.par_chunks_mut(n)
                .take(parts)
                .enumerate()
                .for_each(|(p, acc)| {
                    crate::isa::vectorized(
                        #[inline(always)]
                        || sum_rows(p, acc),
                    )
                });
            y.copy_from_slice(&ws[..n]);
            for part in ws.chunks_exact(n).take(parts).skip(1) {
                y.iter_mut().zip(part).for_each(|(a, b)| *a += b);
            }
        }
        Mapping::Spread(n) => {
            crate::par::rows_mut(
                y,
                1,
                #[inline(always)]
                |o0, outs| {
                    for (j, out) in outs.iter_mut().enumerate() {
                        let o = o0 + j;
                        *out = x[o * n..(o + 1) * n].iter().map(|v| v.get()).sum();
                    }
                },
            );
        }
        m @ Mapping::Strided { .. } => {
            y.fill(0.0);
            for (i, v) in x.iter().enumerate() {
                y[m.index(i)] += v.get();
            }
        }
    }
}

impl CpuKernel for BroadcastTo {
    fn run(&self, k: &Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let m = super::broadcast::Mapping::new(k.in_shape(0), &self.shape);
        crate::par::elems_mut(
            y,
            #[inline(always)]
            |start, out| {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = x[m.index(start + j)];
                }
            },
        );
    }
}
