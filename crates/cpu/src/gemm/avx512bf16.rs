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
use super::avx512::{pack_a, pack_a_half, store_tile, MR, NR};
use super::blocked::{tile_entry_points, Tile};
use super::fused::Prologue;

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
        crate::isa::CpuFeatures::host().bf16_arithmetic()
    }

    tile_entry_points!();

    unsafe fn finish_a(kc: usize, panel: *mut f32) {
        // SAFETY: the panel holds `MR · kc` floats, as the caller vouched.
        unsafe { to_pairs::<MR>(kc, panel) }
    }

    unsafe fn pack_b_bf16(kc: usize, nc: usize, rows: (&[u16], usize), out: *mut f32) -> bool {
        // SAFETY: as the caller vouched.
        unsafe { pack_b_bf16_pairs::<NR>(kc, nc, rows, out) }
    }

    unsafe fn finish_b(kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: as the caller vouched.
        unsafe { finish_b_pairs::<NR>(kc, nc, out) }
    }
}

/// [`Tile::pack_b_bf16`] for a tile whose `b` panels are `W` columns of pairs (this one's,
/// AMX's): `false` where the block does not lie inside the bits.
///
/// # Safety
/// As [`Tile::pack_b_bf16`] for panels of `W`; the CPU must have AVX512-BF16, BW and VL.
pub(super) unsafe fn pack_b_bf16_pairs<const W: usize>(
    kc: usize,
    nc: usize,
    (halves, rs): (&[u16], usize),
    out: *mut f32,
) -> bool {
    // The block's last value lies inside the bits: every read below is inside them.
    if kc == 0 || nc == 0 || (kc - 1) * rs + nc > halves.len() {
        return false;
    }
    // SAFETY: the rows and columns lie inside `halves` (checked), `out` holds the panels, and
    // the CPU has the features, as the caller vouched.
    unsafe { pack_b_bits::<W>(kc, nc, (halves.as_ptr(), rs), out) };
    true
}

/// [`Tile::finish_b`] for a tile whose `b` panels are `W` columns of pairs: each panel decoded
/// in f32 paired in place.
///
/// # Safety
/// As [`Tile::finish_b`] for panels of `W`; the CPU must have AVX512-BF16, BW and VL.
pub(super) unsafe fn finish_b_pairs<const W: usize>(kc: usize, nc: usize, out: *mut f32) {
    for jr in (0..nc).step_by(W) {
        // SAFETY: each panel holds `W · kc` floats, as the caller vouched.
        unsafe { to_pairs::<W>(kc, out.add(jr * kc)) }
    }
}

/// Packs `kc` rows of `nc` columns of `b` as the AVX-512 tile does, then into bf16 pairs of
/// rows ([`to_pairs`]); a row-major `b` goes straight to pairs, two rows at a time, with the
/// same bits.
///
/// # Safety
/// As [`Tile::pack_b`]; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, strides: (isize, isize), out: *mut f32) {
    // SAFETY: as the caller vouched.
    unsafe { pack_b_pairs::<NR>(kc, nc, b, strides, out) }
}

/// [`pack_b`] into panels `W` columns wide (a multiple of 16, at most 48): the AVX-512 tile's
/// packing where `W` is its width, else [`avx512::transpose`](super::avx512::transpose) or
/// element by element, before pairing.
///
/// # Safety
/// As [`Tile::pack_b`] for panels of `W`; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn pack_b_pairs<const W: usize>(
    kc: usize,
    nc: usize,
    b: *const f32,
    (rs, cs): (isize, isize),
    out: *mut f32,
) {
    for jr in (0..nc).step_by(W) {
        let nr = W.min(nc - jr);
        // SAFETY (all blocks): reads stay within `kc` rows and `nc` columns of `b`, writes
        // within the panel's `kc · W` floats.
        unsafe {
            let dst = out.add(jr * kc);
            let src = b.offset(jr as isize * cs);
            if cs == 1 {
                pair_rows::<W>(kc, nr, dst, |p, l, m| {
                    bits16(_mm512_maskz_loadu_ps(m, src.offset(p as isize * rs).add(l)))
                });
            } else {
                if W == NR {
                    super::avx512::pack_b(kc, nr, src, (rs, cs), dst);
                } else if rs == 1 && cs > 0 {
                    // Each column of the panel runs down `b`'s memory: a transpose.
                    if nr < W {
                        std::ptr::write_bytes(dst, 0, W * kc);
                    }
                    super::avx512::transpose((src, cs as usize), (nr, kc), (dst, W));
                } else {
                    super::blocked::pack_b_any::<W>(kc, nr, src, (rs, cs), dst);
                }
                to_pairs::<W>(kc, dst);
            }
        }
    }
}

/// Packs `kc` rows of `nc` columns of a bf16 `b` (rows `rs` values apart from `b`, columns
/// contiguous) into pairs of rows, its bits as they are: what widening them and rounding
/// back gives, but that a NaN keeps its payload and a subnormal its bits (which `VDPBF16PS`
/// takes as zero either way).
///
/// # Safety
/// The rows and columns must lie inside the bits `b` points into; `out` must hold `kc ·
/// nc.next_multiple_of(NR)` floats; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_b_bits<const W: usize>(
    kc: usize,
    nc: usize,
    (b, rs): (*const u16, usize),
    out: *mut f32,
) {
    for jr in (0..nc).step_by(W) {
        // SAFETY: rows `p < kc` and columns `jr + l` (those in the mask) lie inside the bits,
        // and the panel inside `out`, as the caller vouched.
        unsafe {
            let src = b.add(jr);
            pair_rows::<W>(kc, W.min(nc - jr), out.add(jr * kc), |p, l, m| {
                _mm256_maskz_loadu_epi16(m, src.add(p * rs + l) as *const i16)
            });
        }
    }
}

/// One panel of `kc` rows of a row-major `b` in bf16 pairs of rows, its lanes past `nr`
/// zero: `load(p, l, mask)` gives row `p`'s 16 values from column `l` as bf16 bits, those
/// outside `mask` zero and unread.
///
/// # Safety
/// `dst` must hold `kc · W` floats (`W` a multiple of 16, at most 48); `load` must be sound for every row `p < kc`, the masked
/// lanes of the panel's first `nr` columns. The CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn pair_rows<const W: usize>(
    kc: usize,
    nr: usize,
    dst: *mut f32,
    load: impl Fn(usize, usize, __mmask16) -> __m256i,
) {
    let masks = lane_masks(nr);
    for q in 0..kc.div_ceil(2) {
        // SAFETY: row `q` of pairs lies inside the panel, as the caller vouched.
        let words = unsafe { dst.add(q * W) } as *mut __m512i;
        for (v, &m) in masks.iter().take(W / 16).enumerate() {
            let lo = load(2 * q, 16 * v, m);
            let hi = if 2 * q + 1 < kc {
                load(2 * q + 1, 16 * v, m)
            } else {
                _mm256_setzero_si256()
            };
            // SAFETY: as above.
            unsafe { _mm512_storeu_si512(words.add(v), zip16(lo, hi)) };
        }
    }
}

/// The 16-lane masks of a panel up to 48 wide: the lanes of its first `nr` columns.
fn lane_masks(nr: usize) -> [__mmask16; NR / 16] {
    std::array::from_fn(|v| {
        let live = nr.saturating_sub(16 * v).min(16);
        ((1u32 << live) - 1) as __mmask16
    })
}

/// Sixteen f32 values rounded to bf16 bits (nearest even; a subnormal to zero).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn bits16(x: __m512) -> __m256i {
    // SAFETY: `__m256bh` and `__m256i` are the same 256 bits.
    unsafe { std::mem::transmute(_mm512_cvtneps_pbh(x)) }
}

/// Sixteen pairs of bf16 bits: `lo[l] | hi[l] << 16`. (Rounding each half on its own and
/// zero-extending, rather than `VCVTNE2PS2BF16` and a word shuffle, which Bochs's Sapphire
/// Rapids model, the tests' emulated core, pairs wrongly.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn zip16(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_or_si512(
        _mm512_cvtepu16_epi32(lo),
        _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
    )
}

/// Sixteen pairs: `bf16(x[l]) | bf16(y[l]) << 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn pairs16(x: __m512, y: __m512) -> __m512i {
    zip16(bits16(x), bits16(y))
}

/// [`pairs16`] for eight.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn pairs8(x: __m256, y: __m256) -> __m256i {
    let bits8 = |v: __m256| -> __m128i {
        // SAFETY: `__m128bh` and `__m128i` are the same 128 bits.
        unsafe { std::mem::transmute(_mm256_cvtneps_pbh(v)) }
    };
    _mm256_or_si256(
        _mm256_cvtepu16_epi32(bits8(x)),
        _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits8(y))),
    )
}

/// Rounds a packed panel of `W`-wide rows (`x[p·W + l]`, `kc` rows) in place into pairs of
/// rows: `u32[q·W + l] = bf16(x[2q·W + l]) | bf16(x[(2q + 1)·W + l]) << 16`, the last pair's
/// upper half zero when `kc` is odd. Pair `q` lands on row `q`, which pair `q / 2` has
/// already read, so going up in `q` never overwrites a value still to be read (and within a
/// row, each chunk of columns is read before the same chunk is written).
///
/// `VCVTNEPS2BF16` rounds as [`bf16_bits`](super::half::bf16_bits) does (nearest even, NaN quieted) except that it
/// takes a subnormal input as zero: one that `VDPBF16PS` reads as zero anyway, unless it
/// rounds up to the least normal bf16 (within 2⁻¹³³ of it), where the tile then computes with
/// zero instead of 2⁻¹²⁶.
///
/// # Safety
/// `panel` must hold `W · kc` floats; `W` a multiple of 8; the CPU must have AVX512-BF16, BW
/// and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn to_pairs<const W: usize>(kc: usize, panel: *mut f32) {
    debug_assert!(W.is_multiple_of(8));
    let words = panel as *mut u32;
    // SAFETY: rows `2q` and `2q + 1 < kc` of the panel are read, row `q` written, all inside
    // its `W · kc` floats; the CPU has the features, as the caller vouched.
    unsafe {
        for q in 0..kc.div_ceil(2) {
            let lo = panel.add(2 * q * W);
            let hi = (2 * q + 1 < kc).then(|| panel.add((2 * q + 1) * W));
            let out = words.add(q * W);
            let mut l = 0;
            while l + 16 <= W {
                let x = _mm512_loadu_ps(lo.add(l));
                let y = hi.map_or(_mm512_setzero_ps(), |h| _mm512_loadu_ps(h.add(l)));
                _mm512_storeu_si512(out.add(l) as *mut __m512i, pairs16(x, y));
                l += 16;
            }
            if l < W {
                let x = _mm256_loadu_ps(lo.add(l));
                let y = hi.map_or(_mm256_setzero_ps(), |h| _mm256_loadu_ps(h.add(l)));
                _mm256_storeu_si256(out.add(l) as *mut __m256i, pairs8(x, y));
            }
        }
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
        store_tile(acc, (c, c_rs), (mr, nr), (scale, bias), accumulate);
    }
}

/// Attention's head products on operands paired once: every row block of a head reads all of
/// its keys and values, and through [`Tile`]'s packing each block paired them again (up to
/// `t / 64` times over). Here a head's keys and values are laid out as [`kernel`] reads them
/// once, and the products run tile by tile over the laid-out panels, at any depth (a head's
/// panels fit in L2, so no depth blocking).
///
/// Panel layouts: an `a` panel (`MR` rows, depth `k`) holds pair `q` of row `i` at word
/// `q·MR + i`, panels `MR·⌈k/2⌉` words apart; a `b` panel (`NR` columns) holds pair `q` of
/// column `l` at word `q·NR + l`, panels `NR·⌈k/2⌉` words apart, 64-byte aligned.
pub(crate) mod paired {
    use super::*;
    use crate::gemm::avx512::transpose;
    use crate::gemm::Causal;

    /// Words `a` panels of `m` rows, `k` deep, take (in f32 slots), with room for the last
    /// one to be packed in f32 before it is paired in place ([`a_f32`]).
    pub(crate) fn a_len(m: usize, k: usize) -> usize {
        (m.div_ceil(MR) + 1) * MR * k.div_ceil(2)
    }

    /// Words `b` panels of `n` columns, `k` deep, take.
    pub(crate) fn b_len(k: usize, n: usize) -> usize {
        n.div_ceil(NR) * NR * k.div_ceil(2)
    }

    /// `a` panels of the `m` rows of `k` bf16 values at `x` (rows `rs` values apart): pair
    /// `q` of a row is the row's word `q`, so the panels are those words transposed.
    ///
    /// # Safety
    /// `k` and `rs` even and `x` 4-byte aligned; the rows inside the bits `x` points into;
    /// `out` holds [`a_len`]`(m, k)` floats; the CPU has AVX512-BF16, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(crate) unsafe fn a_words(x: *const u16, rs: usize, (m, k): (usize, usize), out: *mut f32) {
        // SAFETY: as the caller vouched; each panel's writes stay in its `MR·k/2` words.
        unsafe { words_across::<MR>(x, rs, (m, k), (out, MR * k / 2)) }
    }

    /// `b` panels of `xᵀ` for the `n` rows of `k` bf16 values at `x`: column `j` of `b` is row
    /// `j` of `x`, paired along it as [`a_words`] pairs.
    ///
    /// # Safety
    /// As [`a_words`]; `out` holds [`b_len`]`(k, n)` floats, 64-byte aligned.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(crate) unsafe fn b_words(x: *const u16, rs: usize, (n, k): (usize, usize), out: *mut f32) {
        // SAFETY: as the caller vouched.
        unsafe { words_across::<NR>(x, rs, (n, k), (out, NR * k.div_ceil(2))) }
    }

    /// Rows `W` at a time, word `q` of row `i` to `q·W + i` of the panel (`stride` floats
    /// apart); lanes past the last row zero.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn words_across<const W: usize>(
        x: *const u16,
        rs: usize,
        (rows, k): (usize, usize),
        (out, stride): (*mut f32, usize),
    ) {
        debug_assert!(
            k.is_multiple_of(2) && rs.is_multiple_of(2) && (x as usize).is_multiple_of(4)
        );
        let words = x as *const f32;
        for (p, r0) in (0..rows).step_by(W).enumerate() {
            let live = W.min(rows - r0);
            // SAFETY: rows `r0..r0 + live` lie inside the bits and the panel inside `out`, as
            // the caller vouched; the words are moved, never computed with.
            unsafe {
                let dst = out.add(p * stride);
                if live < W {
                    std::ptr::write_bytes(dst, 0, W * k / 2);
                }
                transpose((words.add(r0 * rs / 2), rs / 2), (live, k / 2), (dst, W));
            }
        }
    }

    /// `b` panels of the `k` rows of `n` bf16 values at `x` itself (rows `rs` values apart,
    /// the depth down them): pairs of rows, as [`pack_b_bits`] makes them, panels
    /// [`b_len`]-packed.
    ///
    /// # Safety
    /// The rows inside the bits; `out` holds [`b_len`]`(k, n)` floats, 64-byte aligned; the
    /// CPU has AVX512-BF16, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(crate) unsafe fn b_rows(x: *const u16, rs: usize, (k, n): (usize, usize), out: *mut f32) {
        let stride = NR * k.div_ceil(2);
        for (p, j0) in (0..n).step_by(NR).enumerate() {
            // SAFETY: rows `< k`, columns `j0 + l` in the mask: inside the bits; the panel
            // inside `out`, as the caller vouched.
            unsafe {
                let src = x.add(j0);
                pair_rows::<NR>(k, NR.min(n - j0), out.add(p * stride), |q, l, m| {
                    _mm256_maskz_loadu_epi16(m, src.add(q * rs + l) as *const i16)
                });
            }
        }
    }

    /// `a` panels of an f32 `a` (`m` rows, `k` deep, any strides), each value rounded to bf16.
    /// Each panel is packed in f32 where it goes, over the next one's place (not yet
    /// written), then paired in place into its own.
    ///
    /// # Safety
    /// `a` valid for `m` rows and `k` columns at its strides; `out` holds [`a_len`]`(m, k)`
    /// floats; the CPU has AVX512-BF16, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(crate) unsafe fn a_f32(
        a: *const f32,
        (rs, cs): (isize, isize),
        (m, k): (usize, usize),
        out: *mut f32,
    ) {
        for (p, i0) in (0..m).step_by(MR).enumerate() {
            // SAFETY: rows `i0..` and `k` columns of `a`; the panel's `MR·k` floats from its
            // place in `out`, inside [`a_len`]'s.
            unsafe {
                let dst = out.add(p * MR * k.div_ceil(2));
                let src = a.offset(i0 as isize * rs);
                pack_a(
                    k,
                    MR.min(m - i0),
                    src,
                    (rs, cs),
                    (dst, 0, 0),
                    Prologue::None,
                );
                to_pairs::<MR>(k, dst);
            }
        }
    }

    /// `c (+)= scale · a · b`, `m × n`, `k` deep, over `a` panels packed `ka ≥ k` deep and `b`
    /// panels packed `kb ≥ k` deep (a product over the first `k` of their depth), leaving out
    /// what `causal` says; `c`'s columns contiguous, rows `c_rs` apart.
    ///
    /// # Safety
    /// The panels as laid out above, holding `m` rows and `n` columns; `c` valid for the
    /// block and apart from the panels; the CPU has AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn product(
        (m, n, k): (usize, usize, usize),
        (c, c_rs): (*mut f32, usize),
        (a, ka): (*const f32, usize),
        (b, kb): (*const f32, usize),
        (scale, accumulate): (f32, bool),
        causal: Causal,
    ) {
        debug_assert!(k <= ka && k <= kb && (b as usize).is_multiple_of(64));
        let (a_step, b_step) = (MR * ka.div_ceil(2), NR * kb.div_ceil(2));
        for (pa, i0) in (0..m).step_by(MR).enumerate() {
            let mr = MR.min(m - i0);
            let (cols, depth) = causal.extent((i0, mr), (n, k));
            // The depth from a whole pair: the half before the range is zero.
            let q0 = depth.start / 2;
            for (pb, j0) in (0..cols).step_by(NR).enumerate() {
                // SAFETY: panel `pa` of `a`, `pb` of `b` from pair `q0` and the tile of `c`,
                // as the caller vouched.
                unsafe {
                    kernel(
                        depth.end - 2 * q0,
                        (a.add(pa * a_step + q0 * MR), b.add(pb * b_step + q0 * NR)),
                        (c.add(i0 * c_rs + j0), c_rs as isize),
                        (mr, NR.min(n - j0)),
                        (scale, std::ptr::null()),
                        accumulate,
                    )
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::half::bf16_bits;
    use super::*;

    /// The rounding is the cast kernel's ([`bf16_bits`]: nearest even, ties to even, NaN
    /// quieted, infinities kept) and the pairs keep their order, for the 512-bit and 256-bit
    /// steps (24 columns: one of each) and an odd depth's last half-pair; a subnormal is
    /// taken as zero. Natively where the CPU has AVX512-BF16, else on an emulated Sapphire
    /// Rapids core.
    #[cfg(target_os = "linux")]
    #[test]
    fn pairs_round_to_nearest_even_and_keep_order() {
        use crate::gemm::test_support::{run_on, values, EmuJob};
        const W: usize = 24;
        const KC: usize = 7;
        let special = [
            1.0f32,
            f32::from_bits(0x3f80_8000), // a tie: stays at 1.0 (even)
            f32::from_bits(0x3f81_8000), // a tie: up to the even 0x3f82
            f32::from_bits(0x3f80_8001), // just past half: up
            -2.5,
            f32::INFINITY,
            f32::from_bits(0x7f80_0001), // a signalling NaN: quieted
            f32::from_bits(0x0000_1234), // subnormal: zero
            f32::from_bits(0x8040_0000), // negative subnormal: negative zero
        ];
        let mut rows = values(W * KC, 5);
        for (i, &v) in special.iter().enumerate() {
            // Spread over both steps' columns and both halves of pairs.
            rows[(i % KC) * W + (i * 5) % W] = v;
        }
        let want = |p: usize, l: usize| -> u32 {
            let v = rows[p * W + l];
            if v != 0.0 && v.is_subnormal() {
                u32::from(v.is_sign_negative()) << 15
            } else {
                u32::from(bf16_bits(v))
            }
        };
        /// A panel of `W · KC` floats (the test's `rows`), paired in place.
        struct Pairs(Vec<f32>);
        impl EmuJob for Pairs {
            unsafe fn run(&mut self) {
                // SAFETY: the panel holds W · KC floats; the CPU has the features, as `run`'s
                // caller vouches.
                unsafe { to_pairs::<W>(KC, self.0.as_mut_ptr()) }
            }
        }
        let mut pairs = Pairs(rows.clone());
        let native = crate::isa::CpuFeatures::host().bf16_arithmetic();
        let model = snug_testkit::emulate::Model::SapphireRapids;
        // SAFETY: the job makes no system call and touches only its panel.
        if !unsafe { run_on(native, model, &mut pairs) } {
            return;
        }
        let panel = pairs.0;
        for q in 0..KC.div_ceil(2) {
            for l in 0..W {
                let hi = if 2 * q + 1 < KC {
                    want(2 * q + 1, l)
                } else {
                    0
                };
                let expected = want(2 * q, l) | hi << 16;
                let got = panel[q * W + l].to_bits();
                assert_eq!(
                    got, expected,
                    "pair {q}, column {l}: {got:#x} vs {expected:#x}"
                );
            }
        }
    }
}
