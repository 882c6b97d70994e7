//! The AVX2 + FMA register tile for our GEMM ([`blocked`](super::blocked)), for x86-64 CPUs without
//! AVX-512 (AMD Zen 1–3, Intel before Skylake-SP and its client parts): 6 × 16, twelve ymm
//! accumulators, two for a row of `b` and one for the broadcast element of `a`, fifteen of the
//! sixteen registers; and its packing.
//!
//! Why our own here too: on those CPUs the gemm crate ran the char-small step's products at
//! about 102 GFLOP/s on 2 threads, where PyTorch's MKL reached up to 148, and only our kernel
//! fuses the LayerNorm or GELU feeding a product into its packing.

use std::arch::x86_64::*;

use super::blocked::{
    apply_prologue, pack_a_any, pack_a_half_panel, pack_b_any, tile_entry_points, Tile,
};
use super::fused::Prologue;

/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile: two ymm vectors, one cache line.
const NR: usize = 16;
/// Packed rows of `b` the kernel prefetches ahead.
const PREFETCH: usize = 8;

/// The 6 × 16 tile, for CPUs with AVX2 and FMA.
pub(crate) struct Avx2;

impl Tile for Avx2 {
    const MR: usize = MR;
    const NR: usize = NR;
    /// Fewer passes over `c` for the weight gradients' deep products (k = 4,096 at
    /// char-small): the char-small step ran 2.5–7.4 % faster in each of 6 alternating
    /// profiles than at 384 × 192; 768 × 128 and 512 × 192 measured level with this.
    const KC: usize = 512;
    const MC: usize = 768;
    /// `KC × NC` floats (256 KiB) stay in a 512 KiB L2 (Zen 2 and 3) while `a`'s panels stream
    /// over them.
    const NC: usize = 128;

    fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    tile_entry_points!();
}

/// As [`Tile::pack_a`]: `kc` columns of up to 6 rows of `a` as `out[p·6 + i]`.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_a(
    kc: usize,
    mr: usize,
    a: *const f32,
    (rs, cs): (isize, isize),
    (out, i0, p0): (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    // SAFETY (all blocks): reads stay within `mr` rows and `kc` columns of `a`; writes within
    // the `6·kc` floats of the panel.
    unsafe {
        if mr == MR && rs == 1 {
            // `a` read transposed (a weight gradient): each column's 6 rows are contiguous.
            for p in 0..kc {
                std::ptr::copy_nonoverlapping(a.offset(p as isize * cs), out.add(p * MR), MR);
            }
        } else if mr == MR && cs == 1 {
            // Six rows read side by side, eight columns at a time through registers.
            let mut p = 0;
            while p + 8 <= kc {
                let r: [__m256; MR] =
                    std::array::from_fn(|i| _mm256_loadu_ps(a.offset(i as isize * rs).add(p)));
                let mut col = [[0f32; 8]; MR];
                for (c, v) in col.iter_mut().zip(r) {
                    _mm256_storeu_ps(c.as_mut_ptr(), v);
                }
                for q in 0..8 {
                    for (i, c) in col.iter().enumerate() {
                        *out.add((p + q) * MR + i) = c[q];
                    }
                }
                p += 8;
            }
            for p in p..kc {
                for i in 0..MR {
                    *out.add(p * MR + i) = *a.offset(i as isize * rs + p as isize);
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

/// As [`Tile::pack_a_half`]: widened from bf16 as it is packed, then the prologue.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_a_half(
    half: &super::half::HalfA<'_>,
    (kc, mr): (usize, usize),
    (out, i0, p0): (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    // SAFETY: as the caller vouched.
    unsafe { pack_a_half_panel::<MR>(half, (kc, mr), (out, i0, p0), prologue) }
}

/// As [`Tile::pack_b`]: 16-column panels.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, (rs, cs): (isize, isize), out: *mut f32) {
    for jr in (0..nc).step_by(NR) {
        let nr = NR.min(nc - jr);
        // SAFETY (all blocks): reads stay within `kc` rows and `nc` columns of `b`; `out` is
        // 64-byte aligned and every panel row starts at a multiple of 16 floats.
        unsafe {
            let dst = out.add(jr * kc);
            let src = b.offset(jr as isize * cs);
            if cs == 1 && nr == NR {
                for p in 0..kc {
                    let (s, d) = (src.offset(p as isize * rs), dst.add(p * NR));
                    _mm256_store_ps(d, _mm256_loadu_ps(s));
                    _mm256_store_ps(d.add(8), _mm256_loadu_ps(s.add(8)));
                }
            } else {
                // Read transposed (`rs == 1`), each column is contiguous, and this reads them
                // in runs.
                pack_b_any::<NR>(kc, nr, src, (rs, cs), dst);
            }
        }
    }
}

/// One 6 × 16 tile: `c (+)= scale · Σ_p a[p] ⊗ b[p]` over packed panels, storing `mr × nr`;
/// not accumulating, a non-null `bias` (the tile's `nr` columns) is added.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn kernel(
    kc: usize,
    (ap, bp): (*const f32, *const f32),
    (c, c_rs): (*mut f32, isize),
    (mr, nr): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    // SAFETY (all blocks): the panels hold `kc` packed rows each; a prefetch may point past
    // them (wrapping arithmetic, and a prefetch never faults); partial stores are masked to
    // the tile.
    unsafe {
        // Accumulating, `c`'s tile is read after the loop; a deep product's later passes
        // find it evicted, so its lines are asked for now (each row may span two).
        if accumulate {
            for i in 0..mr {
                let row = c.offset(i as isize * c_rs) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(row);
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(60));
            }
        }
        for p in 0..kc {
            let bq = bp.add(p * NR);
            _mm_prefetch::<_MM_HINT_T0>(bq.wrapping_add(PREFETCH * NR) as *const i8);
            let b = [_mm256_load_ps(bq), _mm256_load_ps(bq.add(8))];
            let aq = ap.add(p * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*aq.add(i));
                row[0] = _mm256_fmadd_ps(x, b[0], row[0]);
                row[1] = _mm256_fmadd_ps(x, b[1], row[1]);
            }
        }
        let s = _mm256_set1_ps(scale);
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (i, row) in acc.iter().enumerate().take(mr) {
            let out = c.offset(i as isize * c_rs);
            for (v, r) in row.iter().enumerate() {
                let left = nr.saturating_sub(v * 8).min(8);
                if left == 0 {
                    break;
                }
                let dst = out.add(v * 8);
                let mut x = _mm256_mul_ps(*r, s);
                if left == 8 {
                    if accumulate {
                        x = _mm256_add_ps(x, _mm256_loadu_ps(dst));
                    } else if !bias.is_null() {
                        x = _mm256_add_ps(x, _mm256_loadu_ps(bias.add(v * 8)));
                    }
                    _mm256_storeu_ps(dst, x);
                } else {
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left as i32), lanes);
                    if accumulate {
                        x = _mm256_add_ps(x, _mm256_maskload_ps(dst, mask));
                    } else if !bias.is_null() {
                        x = _mm256_add_ps(x, _mm256_maskload_ps(bias.add(v * 8), mask));
                    }
                    _mm256_maskstore_ps(dst, mask, x);
                }
            }
        }
    }
}

/// Rows of [`small_gemm`]'s register tile; its columns are two ymm vectors.
const SMALL_MR: usize = super::HEAD_TILE_ROWS;

/// As the AVX-512 `small_gemm`, for attention's per-head products on CPUs with AVX2 + FMA:
/// `c (+)= scale · a · b`, nothing packed; `a`'s elements are broadcast from any strides, `b` is
/// read in strips of 64 columns, `b_strip` floats apart, each strip's rows `b_rs` apart and
/// contiguous; `c`'s rows are contiguous. Each strip runs as four 16-column tiles.
///
/// # Safety
/// The CPU must have AVX2 and FMA; every pointer must be valid for the elements its strides
/// reach, and `c` must not overlap `a` or `b`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn small_gemm(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, usize),
    a: (*const f32, usize, usize),
    (b, b_rs, b_strip): (*const f32, usize, usize),
    scale: f32,
    accumulate: bool,
) {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for j0 in (0..n).step_by(16) {
        let nr = (n - j0).min(16);
        let masks: [__m256i; 2] = std::array::from_fn(|v| {
            let left = nr.saturating_sub(8 * v).min(8) as i32;
            _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lanes)
        });
        // SAFETY (all tiles): each stays inside `c`, and reads inside `a` and `b`, as the
        // caller vouched; the masks stop loads and stores at column `n`.
        unsafe {
            let b = b.add(j0 / 64 * b_strip + j0 % 64);
            let c = c.add(j0);
            let tile = (c, c_rs);
            let run = (scale, accumulate);
            // Masked loads and stores cost several times plain ones on AMD's cores: whole
            // tiles use plain ones.
            let full = if nr == 16 { None } else { Some(masks) };
            let mut i0 = 0;
            while i0 + SMALL_MR <= m {
                small_tile::<SMALL_MR>(k, i0, tile, a, (b, b_rs), full, run);
                i0 += SMALL_MR;
            }
            match m - i0 {
                1 => small_tile::<1>(k, i0, tile, a, (b, b_rs), full, run),
                2 => small_tile::<2>(k, i0, tile, a, (b, b_rs), full, run),
                3 => small_tile::<3>(k, i0, tile, a, (b, b_rs), full, run),
                4 => small_tile::<4>(k, i0, tile, a, (b, b_rs), full, run),
                5 => small_tile::<5>(k, i0, tile, a, (b, b_rs), full, run),
                _ => {}
            }
        }
    }
}

/// Rows `i0..i0 + R` of one 16-column tile for [`small_gemm`], its columns past `n` masked
/// off where `masks` are given.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn small_tile<const R: usize>(
    k: usize,
    i0: usize,
    (c, c_rs): (*mut f32, usize),
    (a, a_rs, a_cs): (*const f32, usize, usize),
    (b, b_rs): (*const f32, usize),
    masks: Option<[__m256i; 2]>,
    (scale, accumulate): (f32, bool),
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY (all blocks): as `small_gemm`'s caller vouched; masked lanes are not touched.
    unsafe {
        let load = |q: *const f32, v: usize| match masks {
            None => _mm256_loadu_ps(q.add(8 * v)),
            Some(m) => _mm256_maskload_ps(q.wrapping_add(8 * v), m[v]),
        };
        let a = a.add(i0 * a_rs);
        for p in 0..k {
            let bq = b.add(p * b_rs);
            let bv = [load(bq, 0), load(bq, 1)];
            let aq = a.add(p * a_cs);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*aq.add(i * a_rs));
                row[0] = _mm256_fmadd_ps(x, bv[0], row[0]);
                row[1] = _mm256_fmadd_ps(x, bv[1], row[1]);
            }
        }
        let s = _mm256_set1_ps(scale);
        for (i, row) in acc.iter().enumerate() {
            let out = c.add((i0 + i) * c_rs);
            for (v, r) in row.iter().enumerate() {
                let mut x = _mm256_mul_ps(*r, s);
                if accumulate {
                    x = _mm256_add_ps(x, load(out, v));
                }
                match masks {
                    None => _mm256_storeu_ps(out.add(8 * v), x),
                    // Past column `n` the mask is empty and nothing is touched.
                    Some(m) => _mm256_maskstore_ps(out.wrapping_add(8 * v), m[v], x),
                }
            }
        }
    }
}

/// `out[p·out_rs + i] = x[i·x_rs + p]` for `rows × cols` of `x`, eight by eight through
/// registers, so that both sides are read and written in runs.
///
/// # Safety
/// The CPU must have AVX2; `x` must be valid for `rows` rows of `cols` at its stride, `out` for
/// `cols` rows of `rows` at its, and the two must not overlap.
#[target_feature(enable = "avx2,fma")]
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
            while p0 + 8 <= cols {
                let r: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(x.add((i0 + i) * x_rs + p0)));
                for (p, col) in transpose_8x8(r).into_iter().enumerate() {
                    _mm256_storeu_ps(out.add((p0 + p) * out_rs + i0), col);
                }
                p0 += 8;
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

/// Eight rows of eight floats as eight columns: element `i` of output `p` is `r[i][p]`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn transpose_8x8(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then pairs of pairs: within each 128-bit half, `q[j]` holds
    // column `j` of rows 0..4 (of 4..8 in `q[4 + j]`), the half saying which four columns.
    let t: [__m256; 8] = std::array::from_fn(|j| {
        let (x, y) = (r[2 * (j / 2)], r[2 * (j / 2) + 1]);
        if j % 2 == 0 {
            _mm256_unpacklo_ps(x, y)
        } else {
            _mm256_unpackhi_ps(x, y)
        }
    });
    let q: [__m256; 8] = std::array::from_fn(|j| {
        let base = 4 * (j / 4);
        let (x, y) = (t[base + (j % 4) / 2], t[base + 2 + (j % 4) / 2]);
        if j % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(x, y)
        } else {
            _mm256_shuffle_ps::<0xEE>(x, y)
        }
    });
    std::array::from_fn(|p| {
        let (x, y) = (q[p % 4], q[4 + p % 4]);
        if p < 4 {
            _mm256_permute2f128_ps::<0x20>(x, y)
        } else {
            _mm256_permute2f128_ps::<0x31>(x, y)
        }
    })
}
