//! Every op's CPU kernel, in a file named as the op's file in `snug_graph::ops`: the op says
//! what it computes there, and how this CPU computes it here.

mod accumulate;
mod adamw;
mod adamw8bit;
mod attention;
mod broadcast;
mod cast;
pub mod collective;
mod cross_entropy;
mod dequantize;
mod elementwise;
mod embedding;
mod fill;
mod gelu;
mod gelu_linear;
mod gqa_attention;
mod grad_norm;
mod half_io;
mod kv_attention;
mod layernorm;
mod layernorm_linear;
mod lm_head_loss;
mod matmul;
mod quantized_read;
mod reduce;
mod rmsnorm;
mod rope;
mod rope_at;
mod sgd;
mod silu;
mod softmax;
mod swiglu;
mod view;

use snug_graph::ops::Op;

use crate::kernel::{CpuKernel, Kernel};

/// `pub fn run(op, k)`: one arm per op of the list, each calling that op's [`CpuKernel`].
macro_rules! dispatch {
    ($($variant:ident),* $(,)?) => {
        /// Runs `op`'s CPU kernel on the tensors `k` binds.
        pub fn run(op: &Op, k: &Kernel<'_>) {
            match op {
                $(Op::$variant(op) => crate::isa::vectorized(#[inline(always)] || <snug_graph::ops::$variant as CpuKernel>::run(op, k)),)*
            }
        }
    };
}

snug_graph::for_each_op!(dispatch);

/// The value of an optimizer's optional gradient-scale input.
fn grad_scale(k: &Kernel<'_>, index: usize) -> Option<f32> {
    (k.in_count() > index).then(|| k.in_f32(index)[0])
}
