//! The kernel of [`HalfIo`]: its op's kernel reading the bf16 inputs from their bits (widened
//! as a product packs them, or as a head or a row is staged) and writing the bf16 outputs
//! rounded to nearest even as it stores them (a product's a tile of rows at a time, made in
//! f32 in the workspace), bitwise the op on the casts' f32 copies.

use std::ops::Range;

use snug_graph::ops::half_io::write_tile_rows;
use snug_graph::ops::{HalfIo, Op};
use snug_graph::DType;

use crate::gemm::{gemm_half, par_for, widen, Arith, Layout, Operand};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for HalfIo {
    fn run(&self, k: &Kernel<'_>) {
        match &*self.op {
            Op::MatMul(_) => product(self, k),
            Op::GeluLinear(op) => {
                super::gelu_linear::forward_io(op.approx, k, (self.reads(0), self.writes(0)))
            }
            Op::LayerNormLinear(op) => super::layernorm_linear::forward_io(op.eps, k),
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
            Op::SwiGlu(_) => super::swiglu::forward_io(k),
            Op::SwiGluBackward(_) => super::swiglu::backward_io(k),
            Op::RmsNorm(op) => super::rmsnorm::forward(op.eps, k),
            Op::RmsNormBackward(_) => super::rmsnorm::backward(k),
            Op::Rope(op) => super::rope::rotate(op, k, 0),
            Op::GqaAttention(op) => super::gqa_attention::forward_io(
                op,
                k,
                [0, 1, 2].map(|i| self.reads(i)),
                self.writes(0),
            ),
            Op::GqaAttentionBackward(op) => super::gqa_attention::backward_io(
                op,
                k,
                [0, 1, 2, 3, 5].map(|i| self.reads(i)),
                [0, 1, 2].map(|i| self.writes(i)),
            ),
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
    let (a, b) = (operand(0), operand(1));
    let bias = mm.bias.then(|| k.in_f32(2));
    let par = par_for(d.m, d.n, d.k, rayon::current_num_threads());
    // The shape rule admits one product only (a shared `b`): `d.batch` is 1.
    if !io.writes(0) {
        let layout = Layout::new((mm.ta, mm.tb), (d.m, d.n, d.k));
        gemm_half(layout, (a, b), k.out_f32(0), bias, par, Arith::Bf16);
        return;
    }
    // Written in bf16, `a` is not transposed (the shape rule's condition): a tile of rows of
    // the output is the product of the same rows of `a`.
    write_rows(k, (d.m, d.n), k.workspace(), |rows, _, tile| {
        let layout = Layout::new((false, mm.tb), (rows.len(), d.n, d.k));
        let a = a.rows(rows.start * d.k..rows.end * d.k);
        gemm_half(layout, (a, b), tile, bias, par, Arith::Bf16);
    });
}

/// Output 0, `[rows, n]`, written in bf16: each tile of [`write_tile_rows`] rows made in f32
/// by `make(rows, own, tile)` in the last floats of `workspace` (where the op rule puts it,
/// after the op's own workspace, `own`), then rounded into the output as the cast rounds.
pub(super) fn write_rows(
    k: &Kernel<'_>,
    (rows, n): (usize, usize),
    workspace: &mut [f32],
    mut make: impl FnMut(Range<usize>, &mut [f32], &mut [f32]),
) {
    use rayon::prelude::*;
    let out = k.out_u16(0);
    let per = write_tile_rows(rows, n);
    let (own, tile) = workspace.split_at_mut(workspace.len() - per * n);
    for r0 in (0..rows).step_by(per) {
        let r1 = (r0 + per).min(rows);
        let t = &mut tile[..(r1 - r0) * n];
        make(r0..r1, own, t);
        let chunk = crate::par::MIN_PAR_ELEMS;
        out[r0 * n..r1 * n]
            .par_chunks_mut(chunk)
            .zip(t.par_chunks(chunk))
            .for_each(|(y, x)| {
                crate::isa::vectorized(
                    #[inline(always)]
                    || {
                        for (o, &v) in y.iter_mut().zip(x) {
                            *o = <u16 as Elem>::put(v);
                        }
                    },
                )
            });
    }
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

/// An input as stored, read in f32 a run at a time by kernels that stage their rows or
/// chunks: f32 borrowed as it is, bf16 widened into a buffer.
#[derive(Clone, Copy)]
pub(super) enum Src<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> Src<'a> {
    /// Input `i`, by its dtype.
    pub(super) fn input(k: &Kernel<'a>, i: usize) -> Src<'a> {
        if k.in_dtype(i) == DType::BF16 {
            Src::Bf16(k.in_u16(i))
        } else {
            Src::F32(k.in_f32(i))
        }
    }

    /// A buffer for runs of up to `n` elements: empty (no allocation) where the input is
    /// f32 and is read in place.
    pub(super) fn buffer(&self, n: usize) -> Vec<f32> {
        match self {
            Src::F32(_) => Vec::new(),
            Src::Bf16(_) => vec![0.0; n],
        }
    }

    /// Elements `at..at + n` in f32: the input's own where it is f32, else widened into
    /// `buf` (which holds at least `n`).
    #[inline(always)]
    pub(super) fn get<'b>(&'b self, (at, n): (usize, usize), buf: &'b mut [f32]) -> &'b [f32] {
        match self {
            Src::F32(x) => &x[at..at + n],
            Src::Bf16(x) => {
                let buf = &mut buf[..n];
                for (o, &h) in buf.iter_mut().zip(&x[at..at + n]) {
                    *o = widen(h);
                }
                buf
            }
        }
    }
}

/// An output as stored, written from f32 a run at a time by worker threads that write
/// disjoint runs: f32 in place, bf16 rounded from a buffer.
#[derive(Clone, Copy)]
pub(super) struct Dst {
    ptr: *mut u8,
    len: usize,
    half: bool,
}

// SAFETY: handed to worker threads that write disjoint runs of the output.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// Output `i`, by its dtype.
    pub(super) fn output(k: &Kernel<'_>, i: usize) -> Dst {
        if k.out_dtype(i) == DType::BF16 {
            let y = k.out_u16(i);
            Dst {
                ptr: y.as_mut_ptr().cast(),
                len: y.len(),
                half: true,
            }
        } else {
            let y = k.out_f32(i);
            Dst {
                ptr: y.as_mut_ptr().cast(),
                len: y.len(),
                half: false,
            }
        }
    }

    /// Whether the output is stored in bf16 (and so written through a buffer).
    pub(super) fn is_half(&self) -> bool {
        self.half
    }

    /// A buffer for runs of up to `n` elements: empty (no allocation) where the output is
    /// f32 and is written in place.
    pub(super) fn buffer(&self, n: usize) -> Vec<f32> {
        if self.half {
            vec![0.0; n]
        } else {
            Vec::new()
        }
    }

    /// Runs `f` on elements `at..at + n` as f32: the output's own where it is f32, else
    /// `buf` (which holds at least `n`), then rounded into the output as the cast rounds.
    ///
    /// # Safety
    /// No other thread reads or writes those elements meanwhile.
    #[inline(always)]
    pub(super) unsafe fn with<R>(
        &self,
        (at, n): (usize, usize),
        buf: &mut [f32],
        f: impl FnOnce(&mut [f32]) -> R,
    ) -> R {
        assert!(at + n <= self.len, "a run past the output's end");
        if self.half {
            let buf = &mut buf[..n];
            let r = f(buf);
            // SAFETY: inside the output (checked above), written by this thread only.
            let y = unsafe { std::slice::from_raw_parts_mut((self.ptr as *mut u16).add(at), n) };
            for (o, &v) in y.iter_mut().zip(buf.iter()) {
                *o = <u16 as Elem>::put(v);
            }
            r
        } else {
            // SAFETY: as above.
            f(unsafe { std::slice::from_raw_parts_mut((self.ptr as *mut f32).add(at), n) })
        }
    }
}

/// Elements a staged elementwise kernel widens and rounds at a time (on the stack).
pub(super) const STAGE: usize = 512;

/// `f(at, n)` over `0..len` in runs of at most [`STAGE`] elements, in parallel chunks, each
/// compiled for the current instruction set.
pub(super) fn staged_runs(len: usize, f: impl Fn(usize, usize) + Sync + Send) {
    use rayon::prelude::*;
    let chunk = crate::par::MIN_PAR_ELEMS.next_multiple_of(STAGE);
    (0..len.div_ceil(chunk)).into_par_iter().for_each(|c| {
        crate::isa::vectorized(
            #[inline(always)]
            || {
                let end = ((c + 1) * chunk).min(len);
                for at in (c * chunk..end).step_by(STAGE) {
                    f(at, STAGE.min(end - at));
                }
            },
        )
    });
}
