//! The AVX-512F register tile for our GEMM ([`blocked`](super::blocked)): 8 × 48 (24 zmm accumulators;
//! `b` is the vector operand, `a` the broadcast one), its packing, and the unpacked
//! [`small_gemm`] and [`transpose`] attention uses on these CPUs.
//!
//! Why our own: at the training step's shapes on the 2-core AVX-512 host, interleaved with the
//! gemm crate in one process (2-thread slabs, median of 21), it ran 1.1–1.3× the crate's speed on
//! the weight-gradient products (left operand read transposed) and level (0.95–1.07) on the rest.

use std::arch::x86_64::*;

use super::blocked::{
    apply_prologue, pack_a_any, pack_a_half_panel, pack_b_any, tile_entry_points, Tile,
};
use super::fused::Prologue;

/// Rows of the register tile.
pub(super) const MR: usize = 8;
/// Columns of the register tile: three zmm vectors.
pub(super) const NR: usize = 48;
/// Packed rows of `b` the kernel prefetches ahead.
const PREFETCH: usize = 16;

/// The 8 × 48 tile, for CPUs with AVX-512F.
pub(crate) struct Avx512;

impl Tile for Avx512 {
    const MR: usize = MR;
    const NR: usize = NR;
    /// A 16 KiB `a` panel in L1. Against 384, a weight gradient 4096 rows deep loads and stores
    /// its output 8 times rather than 11, and a 1536-deep product 3 times rather than 4: with
    /// [`prefetch_tile`], the char-small f32 step 2.8 % faster, GPT-2 small's 1.6 %, bf16's
    /// level (paired whole processes, Zen 4); 768 measured level with 512 at char-small.
    const KC: usize = 512;
    /// 1.5 MiB of `a` at `KC`: a thread's slab of a fused op's tile (682 rows at char-small)
    /// packs `b` once.
    const MC: usize = 768;
    /// `KC × NC` floats (384 KiB) stay in a 1 MiB L2 beside `a`'s panels; twice as wide
    /// measured 20 % slower in the kernel alone (at a depth of 384).
    const NC: usize = 192;

    fn available() -> bool {
        is_x86_feature_detected!("avx512f")
    }

    tile_entry_points!();
}

/// Packs `kc` columns of up to 8 rows of `a` as `out[p·8 + i]`, zero rows past `mr`, then
/// applies the prologue; the panel's first element is `(i0, p0)` of the whole `a`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_a(
    kc: usize,
    mr: usize,
    a: *const f32,
    (rs, cs): (isize, isize),
    (out, i0, p0): (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    let src = |i: usize, p: usize| i as isize * rs + p as isize * cs;
    // SAFETY (all blocks): reads stay within `mr` rows and `kc` columns of `a`; writes within
    // the `8·kc` floats of the panel.
    unsafe {
        if mr == MR && rs == 1 {
            // `a` read transposed (a weight gradient): each column's 8 rows are contiguous.
            for p in 0..kc {
                _mm256_storeu_ps(out.add(p * MR), _mm256_loadu_ps(a.offset(src(0, p))));
            }
        } else if mr == MR && cs == 1 {
            let mut p = 0;
            while p + 16 <= kc {
                let r: [__m512; MR] = std::array::from_fn(|i| _mm512_loadu_ps(a.offset(src(i, p))));
                transpose_8x16(&r, out.add(p * MR), MR);
                p += 16;
            }
            for p in p..kc {
                for i in 0..MR {
                    *out.add(p * MR + i) = *a.offset(src(i, p));
                }
            }
        } else {
            pack_a_any::<MR>(kc, mr, a, (rs, cs), out);
        }
        if !matches!(prologue, Prologue::None) {
            let panel = std::slice::from_raw_parts_mut(out, kc * MR);
            apply_prologue::<MR>(prologue, panel, mr, (i0, p0));
        }
    }
}

/// As [`Tile::pack_a_half`]: widened from bf16 as it is packed (16 or 8 values a vector
/// where the panel's rows or columns are contiguous), then the prologue.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_a_half(
    half: &super::half::HalfA<'_>,
    (kc, mr): (usize, usize),
    (out, i0, p0): (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    let (rs, cs) = (half.rs, half.cs);
    let contiguous = mr == MR && (cs == 1 || rs == 1) && kc > 0;
    // The panel's last element lies inside the bits: every vector read below is inside it.
    if !contiguous || (i0 + MR - 1) * rs + (p0 + kc - 1) * cs >= half.bits.len() {
        // SAFETY: as the caller vouched.
        return unsafe { pack_a_half_panel::<MR>(half, (kc, mr), (out, i0, p0), prologue) };
    }
    // bf16 bits to f32 exactly, as `half::widen`: the bits in the upper half.
    let wide16 =
        |v: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)));
    let wide8 = |v: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)));
    let base = half.bits.as_ptr();
    let at = |i: usize, p: usize| (i0 + i) * rs + (p0 + p) * cs;
    // SAFETY (all blocks): reads stay within the panel's rows and columns of the bits (checked
    // above); writes within the `8·kc` floats of the panel.
    unsafe {
        if cs == 1 {
            let mut p = 0;
            while p + 16 <= kc {
                let r: [__m512; MR] = std::array::from_fn(|i| {
                    wide16(_mm256_loadu_si256(base.add(at(i, p)) as *const __m256i))
                });
                transpose_8x16(&r, out.add(p * MR), MR);
                p += 16;
            }
            for p in p..kc {
                for i in 0..MR {
                    *out.add(p * MR + i) = super::half::widen(*base.add(at(i, p)));
                }
            }
        } else {
            // `a` read transposed: each column's 8 rows are contiguous.
            for p in 0..kc {
                let col = _mm_loadu_si128(base.add(at(0, p)) as *const __m128i);
                _mm256_storeu_ps(out.add(p * MR), wide8(col));
            }
        }
        if !matches!(prologue, Prologue::None) {
            let panel = std::slice::from_raw_parts_mut(out, kc * MR);
            apply_prologue::<MR>(prologue, panel, mr, (i0, p0));
        }
    }
}

/// Packs `kc` rows of `nc` columns of `b` into 48-column panels (`out[j·kc + p·48 + l]` for
/// panel `j`), zero columns past `nc`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_b(
    kc: usize,
    nc: usize,
    b: *const f32,
    (rs, cs): (isize, isize),
    out: *mut f32,
) {
    for jr in (0..nc).step_by(NR) {
        let nr = NR.min(nc - jr);
        // SAFETY (all blocks): reads stay within `kc` rows and `nc` columns of `b`; `out` is
        // 64-byte aligned and every panel row starts at a multiple of 48 floats.
        unsafe {
            let dst = out.add(jr * kc);
            let src = b.offset(jr as isize * cs);
            if cs == 1 && nr == NR {
                for p in 0..kc {
                    let (s, d) = (src.offset(p as isize * rs), dst.add(p * NR));
                    _mm512_store_ps(d, _mm512_loadu_ps(s));
                    _mm512_store_ps(d.add(16), _mm512_loadu_ps(s.add(16)));
                    _mm512_store_ps(d.add(32), _mm512_loadu_ps(s.add(32)));
                }
            } else if rs == 1 {
                // `b` read transposed (an activation gradient's `dy · wᵀ`): each column is
                // contiguous, so 8 columns × 16 rows at a time go through the transpose.
                let mut l = 0;
                while l + 8 <= nr {
                    let col = |i: usize| src.offset((l + i) as isize * cs);
                    let mut p = 0;
                    while p + 16 <= kc {
                        let r: [__m512; 8] =
                            std::array::from_fn(|i| _mm512_loadu_ps(col(i).add(p)));
                        transpose_8x16(&r, dst.add(p * NR + l), NR);
                        p += 16;
                    }
                    for p in p..kc {
                        for i in 0..8 {
                            *dst.add(p * NR + l + i) = *col(i).add(p);
                        }
                    }
                    l += 8;
                }
                for l in l..nr {
                    let col = src.offset(l as isize * cs);
                    for p in 0..kc {
                        *dst.add(p * NR + l) = *col.add(p);
                    }
                }
                for l in nr..NR {
                    for p in 0..kc {
                        *dst.add(p * NR + l) = 0.0;
                    }
                }
            } else {
                pack_b_any::<NR>(kc, nr, src, (rs, cs), dst);
            }
        }
    }
}

/// One 8 × 48 tile: `c (+)= scale · Σ_p a[p] ⊗ b[p]` over packed panels, storing `mr × nr`;
/// not accumulating, a non-null `bias` (the tile's `nr` columns) is added.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn kernel(
    kc: usize,
    (ap, bp): (*const f32, *const f32),
    (c, c_rs): (*mut f32, isize),
    (mr, nr): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 3]; MR];
    // SAFETY (all blocks): the panels hold `kc` packed rows each; prefetches may point past
    // them (wrapping arithmetic, and a prefetch never faults); stores are masked to the tile.
    unsafe {
        prefetch_tile(c_rs, c, mr);
        for p in 0..kc {
            let bq = bp.add(p * NR);
            let ahead = bq.wrapping_add(PREFETCH * NR) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128));
            let b = [
                _mm512_load_ps(bq),
                _mm512_load_ps(bq.add(16)),
                _mm512_load_ps(bq.add(32)),
            ];
            let aq = ap.add(p * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*aq.add(i));
                for (r, b) in row.iter_mut().zip(b) {
                    *r = _mm512_fmadd_ps(x, b, *r);
                }
            }
        }
        store_tile(acc, (c, c_rs), (mr, nr), (scale, bias), accumulate);
    }
}

/// Asks for the tile's rows of `c` in L2 before its products, so that the loads and stores
/// at its end do not wait on memory: a weight gradient's `c` (2.4 MB at char-small), added to
/// once per depth block, does not stay in a 1 MiB L2 between its visits.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn prefetch_tile(c_rs: isize, c: *mut f32, mr: usize) {
    for i in 0..mr {
        let row = c.wrapping_offset(i as isize * c_rs) as *const i8;
        // 48 floats span at most four lines, whatever their alignment.
        for at in [0, 64, 128, 191] {
            _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(at));
        }
    }
}

/// Stores the `mr × nr` corner of a tile's accumulators: `c (+)= scale · acc`; not
/// accumulating, a non-null `bias` (the tile's `nr` columns) is added. Shared with the BF16
/// tile, whose accumulators are these.
///
/// The accumulators by value: behind a reference they were a stack array, zeroed by a
/// `memset` call on every tile (2 % of a bf16 step).
///
/// # Safety
/// The tile (and its biases) must lie inside `c` (and `bias`).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store_tile(
    acc: [[__m512; 3]; MR],
    (c, c_rs): (*mut f32, isize),
    (mr, nr): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    // SAFETY: stores are masked to the tile, as the caller vouched.
    unsafe {
        let s = _mm512_set1_ps(scale);
        for (i, row) in acc.iter().enumerate().take(mr) {
            let out = c.offset(i as isize * c_rs);
            for (v, r) in row.iter().enumerate() {
                let left = nr.saturating_sub(v * 16).min(16);
                if left == 0 {
                    break;
                }
                let mask = (((1u32 << left) - 1) & 0xffff) as __mmask16;
                let dst = out.add(v * 16);
                let mut x = _mm512_mul_ps(*r, s);
                if accumulate {
                    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, dst));
                } else if !bias.is_null() {
                    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, bias.add(v * 16)));
                }
                _mm512_mask_storeu_ps(dst, mask, x);
            }
        }
    }
}

/// Rows of [`small_gemm`]'s register tile; its columns are four zmm vectors (64 floats, one
/// attention head's width).
const SMALL_MR: usize = super::HEAD_TILE_ROWS;
/// Rows of `b` ahead that [`small_tile`] prefetches. A head's keys, values and output
/// gradients are rows of the token-major `qkv`, `3C` floats apart, a stride the L1
/// prefetcher does not follow: fetched 4 rows ahead, GPT-2's heads (t 1,024) ran 5–10 %
/// faster forward and backward and char-small's (t 256) 3–6 % (one thread, best of 16,
/// interleaved with no prefetch in one process); 2 to 6 ahead measured alike.
const SMALL_PREFETCH: usize = 4;

/// `c (+)= scale · a · b` for the small products of one attention head (tens to hundreds of
/// rows, columns and depth), nothing packed per product: `a`'s elements are broadcast from
/// wherever they lie (any strides, so `a` may be read transposed); `b` is read in strips of 64
/// columns, `b_strip` floats apart, each strip's rows `b_rs` apart and contiguous (the caller
/// lays each head's operands out once, so rows stream in order rather than thrash the cache's
/// sets from a wide tensor); `c`'s rows are contiguous.
///
/// # Safety
/// The CPU must have AVX-512F ([`Avx512::available`]); every pointer must be valid for the
/// elements its strides reach, and `c` must not overlap `a` or `b`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn small_gemm(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, usize),
    a: (*const f32, usize, usize),
    (b, b_rs, b_strip): (*const f32, usize, usize),
    scale: f32,
    accumulate: bool,
) {
    let scale_acc = (scale, accumulate);
    for j0 in (0..n).step_by(64) {
        let nr = (n - j0).min(64);
        let masks: [__mmask16; 4] = std::array::from_fn(|v| {
            let left = nr.saturating_sub(16 * v).min(16);
            (((1u32 << left) - 1) & 0xffff) as __mmask16
        });
        // SAFETY: each tile stays inside `c`, and reads inside `a` and `b`, as the caller
        // vouched; the masks stop loads and stores at column `n`.
        unsafe {
            let strip = (b.add(j0 / 64 * b_strip), c.add(j0));
            // Only the vectors the strip's columns reach: a causal block's scores stop at the
            // diagonal, and a head 32 wide is two.
            match nr.div_ceil(16) {
                1 => small_strip::<1>((m, k), strip, (c_rs, b_rs), a, masks, scale_acc),
                2 => small_strip::<2>((m, k), strip, (c_rs, b_rs), a, masks, scale_acc),
                3 => small_strip::<3>((m, k), strip, (c_rs, b_rs), a, masks, scale_acc),
                _ => small_strip::<4>((m, k), strip, (c_rs, b_rs), a, masks, scale_acc),
            }
        }
    }
}

/// Every row of one strip of [`small_gemm`], `V` vectors of it.
///
/// # Safety
/// As [`small_gemm`], for the strip at `(b, c)`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn small_strip<const V: usize>(
    (m, k): (usize, usize),
    (b, c): (*const f32, *mut f32),
    (c_rs, b_rs): (usize, usize),
    a: (*const f32, usize, usize),
    masks: [__mmask16; 4],
    run: (f32, bool),
) {
    let tile = (c, c_rs);
    let b = (b, b_rs);
    // SAFETY: as the caller vouched.
    unsafe {
        let mut i0 = 0;
        while i0 + SMALL_MR <= m {
            small_tile::<SMALL_MR, V>(k, i0, tile, a, b, masks, run);
            i0 += SMALL_MR;
        }
        match m - i0 {
            1 => small_tile::<1, V>(k, i0, tile, a, b, masks, run),
            2 => small_tile::<2, V>(k, i0, tile, a, b, masks, run),
            3 => small_tile::<3, V>(k, i0, tile, a, b, masks, run),
            4 => small_tile::<4, V>(k, i0, tile, a, b, masks, run),
            5 => small_tile::<5, V>(k, i0, tile, a, b, masks, run),
            _ => {}
        }
    }
}

/// Rows `i0..i0 + R` of one 64-column strip for [`small_gemm`], its first `V` vectors.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn small_tile<const R: usize, const V: usize>(
    k: usize,
    i0: usize,
    (c, c_rs): (*mut f32, usize),
    (a, a_rs, a_cs): (*const f32, usize, usize),
    (b, b_rs): (*const f32, usize),
    masks: [__mmask16; 4],
    (scale, accumulate): (f32, bool),
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    // SAFETY (all blocks): as `small_gemm`'s caller vouched; masked lanes are not touched.
    unsafe {
        let a = a.add(i0 * a_rs);
        for p in 0..k {
            let bq = b.add(p * b_rs);
            // A hint only: past the last row it fetches nothing the product reads.
            let ahead = bq.wrapping_add(SMALL_PREFETCH * b_rs);
            for v in 0..V {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * v) as *const i8);
            }
            let bv: [__m512; V] =
                std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], bq.wrapping_add(16 * v)));
            let aq = a.add(p * a_cs);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*aq.add(i * a_rs));
                for (r, b) in row.iter_mut().zip(bv) {
                    *r = _mm512_fmadd_ps(x, b, *r);
                }
            }
        }
        let s = _mm512_set1_ps(scale);
        for (i, row) in acc.iter().enumerate() {
            let out = c.add((i0 + i) * c_rs);
            for (v, (r, &mask)) in row.iter().zip(&masks).enumerate() {
                // Past column `n` the mask is empty and nothing is touched.
                let dst = out.wrapping_add(16 * v);
                let mut x = _mm512_mul_ps(*r, s);
                if accumulate {
                    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, dst));
                }
                _mm512_mask_storeu_ps(dst, mask, x);
            }
        }
    }
}

/// `out[p·out_rs + i] = x[i·x_rs + p]` for `rows × cols` of `x`: eight rows by sixteen columns
/// at a time through registers, so that both sides are read and written in runs (one element
/// at a time, the writes `out_rs` apart thrashed the cache's sets).
///
/// # Safety
/// The CPU must have AVX-512F; `x` must be valid for `rows` rows of `cols` at its stride, `out`
/// for `cols` rows of `rows` at its, and the two must not overlap.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose(
    (x, x_rs): (*const f32, usize),
    (rows, cols): (usize, usize),
    (out, out_rs): (*mut f32, usize),
) {
    // SAFETY (all blocks): inside the extents the caller vouched for.
    unsafe {
        let full = rows - rows % 8;
        for i0 in (0..full).step_by(8) {
            let mut p0 = 0;
            while p0 + 16 <= cols {
                let r: [__m512; 8] =
                    std::array::from_fn(|i| _mm512_loadu_ps(x.add((i0 + i) * x_rs + p0)));
                transpose_8x16(&r, out.add(p0 * out_rs + i0), out_rs);
                p0 += 16;
            }
            for p in p0..cols {
                for i in i0..i0 + 8 {
                    *out.add(p * out_rs + i) = *x.add(i * x_rs + p);
                }
            }
        }
        for i in full..rows {
            for p in 0..cols {
                *out.add(p * out_rs + i) = *x.add(i * x_rs + p);
            }
        }
    }
}

/// Eight rows of sixteen floats written column after column: `out[p·stride + i] = r[i][p]`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose_8x16(r: &[__m512; 8], out: *mut f32, stride: usize) {
    let pd = |x: __m512, idx: __m512i, y: __m512| {
        _mm512_castpd_ps(_mm512_permutex2var_pd(
            _mm512_castps_pd(x),
            idx,
            _mm512_castps_pd(y),
        ))
    };
    // Pairs of rows interleaved element by element: q[2t] holds rows 2t, 2t+1 at columns
    // 0..8, q[2t+1] at columns 8..16.
    let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let q: [__m512; 8] = std::array::from_fn(|j| {
        let (x, y) = (r[j & !1], r[j | 1]);
        _mm512_permutex2var_ps(x, if j % 2 == 0 { lo } else { hi }, y)
    });
    // Pairs of pairs: g[t] holds rows 0..4 at columns 4t..4t+4, h[t] rows 4..8.
    let lo64 = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    let hi64 = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    let g = [
        pd(q[0], lo64, q[2]),
        pd(q[0], hi64, q[2]),
        pd(q[1], lo64, q[3]),
        pd(q[1], hi64, q[3]),
    ];
    let h = [
        pd(q[4], lo64, q[6]),
        pd(q[4], hi64, q[6]),
        pd(q[5], lo64, q[7]),
        pd(q[5], hi64, q[7]),
    ];
    // Halves of a column side by side: each vector is two whole columns.
    let lo128 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    let hi128 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    // SAFETY: `out` holds 16 columns of 8 floats `stride` apart.
    unsafe {
        for t in 0..4 {
            for (half, idx) in [lo128, hi128].into_iter().enumerate() {
                let two = _mm512_castps_pd(pd(g[t], idx, h[t]));
                let p = 4 * t + 2 * half;
                if stride == 8 {
                    _mm512_storeu_pd(out.add(p * 8) as *mut f64, two);
                } else {
                    _mm256_storeu_pd(out.add(p * stride) as *mut f64, _mm512_castpd512_pd256(two));
                    _mm256_storeu_pd(
                        out.add((p + 1) * stride) as *mut f64,
                        _mm512_extractf64x4_pd::<1>(two),
                    );
                }
            }
        }
    }
}
