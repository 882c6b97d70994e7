//! The kernels of softmax and log-softmax over the last axis, and their gradients.

use snug_graph::ops::{LogSoftmax, LogSoftmaxBackward, Softmax, SoftmaxBackward};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Softmax {
    fn run(&self, k: &Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        crate::par::rows_mut(
            y,
            n,
            #[inline(always)]
            |r0, rows| {
                for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                    let src = &x[(r0 + r) * n..(r0 + r + 1) * n];
                    let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0;
                    for (o, &v) in out.iter_mut().zip(src) {
                        *o = crate::math::exp(v - max);
                        sum += *o;
                    }
                    let inv = 1.0 / sum;
                    out.iter_mut().for_each(|o| *o *= inv);
                }
            },
        );
    }
}

impl CpuKernel for SoftmaxBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (y, dy, dx) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        crate::par::rows_mut(
            dx,
            n,
            #[inline(always)]
            |r0, rows| {
                for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                    let range = (r0 + r) * n..(r0 + r + 1) * n;
                    let (y, dy) = (&y[range.clone()], &dy[range]);
                    let dot: f32 = y.iter().zip(dy).map(|(a, b)| a * b).sum();
                    for ((o, &yv), &g) in out.iter_mut().zip(y).zip(dy) {
                        *o = yv * (g - dot);
                    }
                }
            },
        );
    }
}

impl CpuKernel for LogSoftmax {
    fn run(&self, k: &Kernel<'_>) {
        let (x, y) = (k.in_f32(0), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        crate::par::rows_mut(
            y,
            n,
            #[inline(always)]
            |r0, rows| {
                for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                    let src = &x[(r0 + r) * n..(r0 + r + 1) * n];
                    let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f32 = src.iter().map(|&v| crate::math::exp(v - max)).sum();
                    let lse = max + sum.ln();
                    for (o, &v) in out.iter_mut().zip(src) {
                        *o = v - lse;
                    }
                }
            },
        );
    }
}

impl CpuKernel for LogSoftmaxBackward {
    fn run(&self, k: &Kernel<'_>) {
        let (y, dy, dx) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let n = *k.in_shape(0).last().unwrap_or(&1);
        crate::par::rows_mut(
            dx,
            n,
            #[inline(always)]
            |r0, rows| {
                for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                    let range = (r0 + r) * n..(r0 + r + 1) * n;
                    let (y, dy) = (&y[range.clone()], &dy[range]);
                    let sum: f32 = dy.iter().sum();
                    for ((o, &yv), &g) in out.iter_mut().zip(y).zip(dy) {
                        *o = g - crate::math::exp(yv) * sum;
                    }
                }
            },
        );
    }
}
