//! The AVX2 + FMA register tile for our GEMM (`gemm_blocked`), for x86-64 CPUs without
//! AVX-512 (AMD Zen 1–3, Intel before Skylake-SP and its client parts): 6 × 16, twelve ymm
//! accumulators, two for a row of `b` and one for the broadcast element of `a`, fifteen of the
//! sixteen registers; and its packing.
//!
//! Why our own here too: on those CPUs the gemm crate ran the char-small step's products at
//! about 102 GFLOP/s on 2 threads, where PyTorch's MKL reached up to 148, and only our kernel
//! fuses the LayerNorm or GELU feeding a product into its packing.

use std::arch::x86_64::*;

use super::gemm_blocked::{apply_prologue, pack_a_any, pack_b_any, Tile};
use super::matmul::Prologue;

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
    const KC: usize = 256;
    const MC: usize = 768;
    /// `KC × NC` floats (256 KiB) stay in a 512 KiB L2 (Zen 2 and 3) while `a`'s panels stream
    /// over them.
    const NC: usize = 256;

    fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    unsafe fn pack_a(
        kc: usize,
        mr: usize,
        a: *const f32,
        strides: (isize, isize),
        panel: (*mut f32, usize, usize),
        prologue: Prologue<'_>,
    ) {
        // SAFETY: as the caller vouched.
        unsafe { pack_a(kc, mr, a, strides, panel, prologue) }
    }

    unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, strides: (isize, isize), out: *mut f32) {
        // SAFETY: as the caller vouched.
        unsafe { pack_b(kc, nc, b, strides, out) }
    }

    unsafe fn tiles(
        kc: usize,
        panels: (*const f32, *const f32),
        c: (*mut f32, isize),
        block: (usize, usize),
        scale_bias: (f32, *const f32),
        accumulate: bool,
    ) {
        // SAFETY: as the caller vouched.
        unsafe { tiles(kc, panels, c, block, scale_bias, accumulate) }
    }
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

/// As [`Tile::tiles`], in 6 × 16 tiles.
#[target_feature(enable = "avx2,fma")]
unsafe fn tiles(
    kc: usize,
    (ap, bp): (*const f32, *const f32),
    (c, c_rs): (*mut f32, isize),
    (mc, nc): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    for ir in (0..mc).step_by(MR) {
        for jr in (0..nc).step_by(NR) {
            // SAFETY: the panels hold `kc` packed rows each and the tile lies inside `c` (and
            // its biases inside `bias`), as the caller vouched.
            unsafe {
                let bias = if bias.is_null() { bias } else { bias.add(jr) };
                kernel(
                    kc,
                    ap.add(ir * kc),
                    bp.add(jr * kc),
                    (c.offset(ir as isize * c_rs + jr as isize), c_rs),
                    (MR.min(mc - ir), NR.min(nc - jr)),
                    (scale, bias),
                    accumulate,
                )
            };
        }
    }
}

/// One 6 × 16 tile: `c (+)= scale · Σ_p a[p] ⊗ b[p]` over packed panels, storing `mr × nr`;
/// not accumulating, a non-null `bias` (the tile's `nr` columns) is added.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn kernel(
    kc: usize,
    ap: *const f32,
    bp: *const f32,
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
