//! The kernel of [`HalfIo`]: its op's kernel reading the bf16 inputs from their bits (widened
//! as a product packs them, or as a head or a row is staged) and writing the bf16 outputs
//! rounded to nearest even as it stores them, bitwise the op on the casts' f32 copies.

use snug_graph::ops::{HalfIo, Op};
use snug_graph::DType;

use crate::gemm::{gemm_half, par_for, widen, Layout, Operand};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for HalfIo {
    fn run(&self, k: &Kernel<'_>) {
        match &*self.op {
            Op::MatMul(_) => product(self, k),
            Op::GeluLinear(op) => super::gelu_linear::forward_io(op.approx, k, self.reads(0)),
            Op::GeluLinearBackward(op) => {
                super::gelu_linear::backward_io(op.approx, k, (self.reads(0), self.writes(0)))
            }
            Op::CausalAttention(op) => {
                super::attention::forward_io(op, k, (self.reads(0), self.writes(0)))
            }
            Op::Binary(_) => super::elementwise::add_io(k),
            Op::CausalAttentionBackward(op) => super::attention::backward_io(
                op,
                k,
                [self.reads(0), self.reads(1), self.reads(3)],
                self.writes(0),
            ),
            Op::LayerNormLinearBackward(_) => {
                super::layernorm_linear::backward_io(k, self.reads(6))
            }
            Op::SumTo(op) if self.reads(0) => super::reduce::sum_to_io(op, k),
            op => unreachable!("the shape rule admits no `{}`", op.name()),
        }
    }
}

fn product(io: &HalfIo, k: &Kernel<'_>) {
    let Some(mm) = io.product() else {
        unreachable!("a product's kernel")
    };
    let Ok(d) = mm.dims(k.in_shape(0), k.in_shape(1)) else {
        unreachable!("shape rule checked at build time")
    };
    let operand = |i: usize| {
        if io.reads(i) && k.in_dtype(i) == DType::BF16 {
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

/// An element as stored: f32, or bf16 bits (widened exactly as read, rounded to nearest even
/// as written, as the cast kernel rounds).
pub(super) trait Elem: Copy + Send + Sync {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(v: f32) -> f32 {
        v
    }
}

impl Elem for u16 {
    #[inline(always)]
    fn get(self) -> f32 {
        widen(self)
    }
    /// Nearest even, NaN kept NaN (quieted), as `half`'s conversion in the cast kernel does,
    /// written as a select so the loops storing it vectorise.
    #[inline(always)]
    fn put(v: f32) -> u16 {
        let b = v.to_bits();
        let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
        let nan = (b >> 16) as u16 | 0x40;
        if b & 0x7fff_ffff > 0x7f80_0000 {
            nan
        } else {
            rounded
        }
    }
}

/// `x` as f32 when `H` is f32.
pub(super) fn as_f32<H: Elem>(x: &[H]) -> &[f32] {
    match as_bits(x) {
        None => {
            // SAFETY: `H` is f32 here (the only other `Elem` is u16).
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) }
        }
        Some(_) => unreachable!("bf16 bits are not f32"),
    }
}

/// `x` as bf16 bits when `H` is u16.
pub(super) fn as_bits<H: Elem>(x: &[H]) -> Option<&[u16]> {
    (std::mem::size_of::<H>() == 2).then(|| {
        // SAFETY: the only 2-byte `Elem` is u16.
        unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u16, x.len()) }
    })
}

/// Input `i` as stored: f32, or bf16 bits.
pub(super) fn input<'a, H: Elem>(kern: &Kernel<'a>, i: usize) -> &'a [H] {
    if std::mem::size_of::<H>() == 2 {
        let x = kern.in_u16(i);
        // SAFETY: the only 2-byte `Elem` is u16.
        unsafe { std::slice::from_raw_parts(x.as_ptr() as *const H, x.len()) }
    } else {
        let x = kern.in_f32(i);
        // SAFETY: the only 4-byte `Elem` is f32.
        unsafe { std::slice::from_raw_parts(x.as_ptr() as *const H, x.len()) }
    }
}

/// Output `i` as stored: f32, or bf16 bits.
pub(super) fn output<'a, D: Elem>(kern: &Kernel<'a>, i: usize) -> &'a mut [D] {
    if std::mem::size_of::<D>() == 2 {
        let x = kern.out_u16(i);
        // SAFETY: the only 2-byte `Elem` is u16.
        unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut D, x.len()) }
    } else {
        let x = kern.out_f32(i);
        // SAFETY: the only 4-byte `Elem` is f32.
        unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut D, x.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::Elem;
    use half::slice::HalfFloatSliceExt;

    /// A kernel's rounding store is the cast kernel's conversion bit for bit (nearest even,
    /// NaN kept NaN), and its widening load inverts it exactly, over every sign, exponent and
    /// a spread of mantissas, ties and NaN payloads included.
    #[test]
    fn stores_round_as_the_cast_does_and_loads_widen_exactly() {
        let mut xs: Vec<f32> = Vec::new();
        for hi in 0..=u16::MAX {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234, 0xc000] {
                xs.push(f32::from_bits((u32::from(hi) << 16) | lo));
            }
        }
        let mut cast = vec![half::bf16::ZERO; xs.len()];
        cast.convert_from_f32_slice(&xs);
        for (&x, c) in xs.iter().zip(&cast) {
            let ours = <u16 as Elem>::put(x);
            assert_eq!(ours, c.to_bits(), "{:#010x}", x.to_bits());
            let back = ours.get();
            assert_eq!(back.to_bits(), u32::from(ours) << 16);
        }
    }
}
