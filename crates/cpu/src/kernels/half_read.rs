//! The kernel of [`HalfRead`]: its product with the bf16 operands widened as the GEMM packs
//! them ([`crate::gemm::gemm_half`]), bitwise the product on their f32 up-casts.

use snug_graph::ops::HalfRead;
use snug_graph::DType;

use crate::gemm::{gemm_half, par_for, Layout, Operand};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for HalfRead {
    fn run(&self, k: &Kernel<'_>) {
        let Some(mm) = self.product() else {
            unreachable!("the shape rule admits products only")
        };
        let Ok(d) = mm.dims(k.in_shape(0), k.in_shape(1)) else {
            unreachable!("shape rule checked at build time")
        };
        let operand = |i: usize| {
            if self.is_half(i) && k.in_dtype(i) == DType::BF16 {
                Operand::Bf16(k.in_u16(i))
            } else {
                Operand::F32(k.in_f32(i))
            }
        };
        let (a, b, c) = (operand(0), operand(1), k.out_f32(0));
        let bias = mm.bias.then(|| k.in_f32(2));
        let layout = Layout::new((mm.ta, mm.tb), (d.m, d.n, d.k));
        let par = par_for(d.m, d.n, d.k, rayon::current_num_threads());
        // The shape rule admits one product only (a shared `b`): `d.batch` is 1.
        gemm_half(layout, (a, b), c, bias, par);
    }
}
