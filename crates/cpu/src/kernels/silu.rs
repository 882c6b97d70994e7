//! The kernels of SiLU and its gradient; `sigmoid` and `silu` are shared with SwiGLU's.

use snug_graph::ops::{Silu, SiluBackward};

use crate::kernel::{CpuKernel, Kernel};

/// σ(x) = 1 / (1 + e^{−x}), with the vectorisable exp (saturates cleanly at both ends).
#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + crate::math::exp(-x))
}

/// `silu(x) = x · σ(x)`.
#[inline(always)]
pub(super) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `silu'(x) = σ(x) · (1 + x · (1 − σ(x)))`.
#[inline(always)]
pub(super) fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

impl CpuKernel for Silu {
    fn run(&self, k: &Kernel<'_>) {
        crate::par::unary(k, silu);
    }
}

impl CpuKernel for SiluBackward {
    fn run(&self, k: &Kernel<'_>) {
        crate::par::binary(k, |v, g| g * silu_grad(v));
    }
}
