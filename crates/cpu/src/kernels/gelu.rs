//! GELU and its gradient, elementwise, each written over its input where the plan allows.

use snug_graph::ops::{Gelu, GeluApprox, GeluBackward};

use crate::kernel::{CpuKernel, Kernel};
use crate::{math, par};

impl CpuKernel for Gelu {
    fn run(&self, k: &Kernel<'_>) {
        // One loop per variant, so each vectorises on its own.
        match self.approx {
            GeluApprox::Tanh => par::unary(k, |v| math::gelu(GeluApprox::Tanh, v)),
            GeluApprox::Exact => par::unary(k, |v| math::gelu(GeluApprox::Exact, v)),
        }
    }
}

impl CpuKernel for GeluBackward {
    fn run(&self, k: &Kernel<'_>) {
        match self.approx {
            GeluApprox::Tanh => par::binary(k, |v, g| g * math::gelu_grad(GeluApprox::Tanh, v)),
            GeluApprox::Exact => par::binary(k, |v, g| g * math::gelu_grad(GeluApprox::Exact, v)),
        }
    }
}
