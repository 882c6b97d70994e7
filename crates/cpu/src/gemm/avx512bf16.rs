//! The AVX512-BF16 register tile for our GEMM ([`blocked`](super::blocked)): bf16 arithmetic
//! with f32 accumulation, for products that read a bf16 operand on CPUs with `VDPBF16PS`
//! (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later).
//!
//! The tile is the AVX-512 one's 8 × 48 with its blocking, so the plan (depth block, packing
//! space) is the same on both. Panels are packed as the AVX-512 tile packs them (bf16 operands
//! widened, a prologue applied, in f32), then rounded in place to bf16 pairs along the depth:
//! 32 bits hold `(x[2q], x[2q + 1])`, half the bytes the kernel streams. Each `VDPBF16PS` then
//! adds two products per lane. Every product of two bf16 values is exact in f32, so the result
//! differs from the f32 tile's on the same (bf16-rounded) operands only in the order of the
//! f32 additions and in `VDPBF16PS` flushing subnormal inputs and results to zero (it ignores
//! MXCSR); and the f32 operand (a weight) is rounded to bf16 first: what PyTorch's bf16
//! autocast computes.

use std::arch::x86_64::*;

// The AVX-512 tile's packing, which `tile_entry_points!` calls by these names (AVX512-BF16
// CPUs have AVX-512F).
use super::avx512::{pack_a, pack_a_half, pack_b, store_tile, MR, NR};
use super::blocked::{tile_entry_points, Tile};
use super::fused::Prologue;
use super::half::bf16_bits;

/// Packed pairs of `b` the kernel prefetches ahead.
const PREFETCH: usize = 8;

/// The 8 × 48 tile in bf16 pairs, for CPUs with AVX512-BF16.
pub(crate) struct Avx512Bf16;

impl Tile for Avx512Bf16 {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = <super::avx512::Avx512 as Tile>::KC;
    const MC: usize = <super::avx512::Avx512 as Tile>::MC;
    const NC: usize = <super::avx512::Avx512 as Tile>::NC;

    fn available() -> bool {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }

    tile_entry_points!();

    unsafe fn finish_a(kc: usize, panel: *mut f32) {
        // SAFETY: the panel holds `MR · kc` floats, as the caller vouched.
        unsafe { to_pairs::<MR>(kc, panel) }
    }

    unsafe fn finish_b(kc: usize, nc: usize, out: *mut f32) {
        for jr in (0..nc).step_by(NR) {
            // SAFETY: each panel holds `NR · kc` floats, as the caller vouched.
            unsafe { to_pairs::<NR>(kc, out.add(jr * kc)) }
        }
    }
}

/// Rounds a packed panel of `W`-wide rows (`x[p·W + l]`, `kc` rows) in place into pairs of
/// rows: `u32[q·W + l] = bf16(x[2q·W + l]) | bf16(x[(2q + 1)·W + l]) << 16`, the last pair's
/// upper half zero when `kc` is odd. Pair `q` lands on row `q`, which pair `q / 2` has
/// already read, so going up in `q` never overwrites a value still to be read.
///
/// # Safety
/// `panel` must hold `W · kc` floats.
#[inline(always)]
unsafe fn to_pairs<const W: usize>(kc: usize, panel: *mut f32) {
    let words = panel as *mut u32;
    for q in 0..kc.div_ceil(2) {
        let mut pair = [0u32; W];
        for (l, v) in pair.iter_mut().enumerate() {
            // SAFETY: rows `2q` and `2q + 1 < kc` of the panel.
            unsafe {
                let lo = u32::from(bf16_bits(*panel.add(2 * q * W + l)));
                let hi = if 2 * q + 1 < kc {
                    u32::from(bf16_bits(*panel.add((2 * q + 1) * W + l)))
                } else {
                    0
                };
                *v = lo | hi << 16;
            }
        }
        // SAFETY: row `q ≤ 2q` of the panel, read already.
        unsafe { std::ptr::copy_nonoverlapping(pair.as_ptr(), words.add(q * W), W) };
    }
}

/// One 8 × 48 tile over panels of bf16 pairs (`kc` deep, `kc.div_ceil(2)` pairs): `c (+)=
/// scale · Σ_q a[q] · b[q]`, two products a lane an instruction, stored as the AVX-512 tile
/// stores.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn kernel(
    kc: usize,
    (ap, bp): (*const f32, *const f32),
    (c, c_rs): (*mut f32, isize),
    (mr, nr): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    let (ap, bp) = (ap as *const i32, bp as *const i32);
    let mut acc = [[_mm512_setzero_ps(); 3]; MR];
    // SAFETY (all blocks): the panels hold `kc.div_ceil(2)` packed pairs each, 64-byte aligned
    // for `b`; prefetches may point past them (a prefetch never faults).
    unsafe {
        for q in 0..kc.div_ceil(2) {
            let bq = bp.add(q * NR);
            let ahead = bq.wrapping_add(PREFETCH * NR) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128));
            let b: [__m512bh; 3] = std::array::from_fn(|v| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(
                    bq.add(16 * v) as *const __m512i
                ))
            });
            let aq = ap.add(q * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*aq.add(i)));
                for (r, b) in row.iter_mut().zip(b) {
                    *r = _mm512_dpbf16_ps(*r, x, b);
                }
            }
        }
        store_tile(&acc, (c, c_rs), (mr, nr), (scale, bias), accumulate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounding is the cast kernel's: nearest even, ties to even, NaN quieted, infinities
    /// kept.
    #[test]
    fn pairs_round_to_nearest_even_and_keep_order() {
        let rows = [
            1.0f32,
            f32::from_bits(0x3f80_8000), // a tie: stays at 1.0 (even)
            f32::from_bits(0x3f81_8000), // a tie: up to the even 0x3f82
            f32::from_bits(0x3f80_8001), // just past half: up
            -2.5,
            f32::INFINITY,
            f32::from_bits(0x7f80_0001), // a signalling NaN: quieted
        ];
        let want = [0x3f80, 0x3f80, 0x3f82, 0x3f81, 0xc020, 0x7f80, 0x7fc0];
        // One column (W = 1), 7 rows: three full pairs and a last half-pair.
        let mut panel = rows.to_vec();
        // SAFETY: the panel holds 1 · 7 floats.
        unsafe { to_pairs::<1>(7, panel.as_mut_ptr()) };
        let words: Vec<u32> = panel[..4].iter().map(|x| x.to_bits()).collect();
        for q in 0..4 {
            let lo = want[2 * q];
            let hi = if 2 * q + 1 < 7 { want[2 * q + 1] } else { 0 };
            assert_eq!(words[q], lo | hi << 16, "pair {q}");
        }
    }
}
