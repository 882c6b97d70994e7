//! f32 GEMM for x86-64 CPUs with AVX-512F: `c (+)= scale · a · b` with `c` row-major and `a`,
//! `b` at any strides, on one thread ([`sgemm`]) or on the rayon pool with work dealt by demand
//! ([`sgemm_threaded`]). `matmul::gemm_raw` keeps the gemm crate for other CPUs and for narrow
//! outputs.
//!
//! Why our own: at the training step's shapes on the 2-core AVX-512 host, interleaved with the
//! gemm crate in one process (2-thread slabs, median of 21), it ran 1.1–1.3× the crate's speed on
//! the weight-gradient products (left operand read transposed) and level (0.95–1.07) on the rest.
//!
//! Blocking, in the BLIS manner, named for row-major `c`: an 8 × 48 register tile (24 zmm
//! accumulators; `b` is the vector operand, `a` the broadcast one). For each block of `KC` of
//! the inner dimension, `MC` rows of `a` are packed into 8-row panels (the panel the kernel
//! broadcasts from stays in L1), and `NC` columns of `b` into 48-column panels, a block small
//! enough to stay in L2 while every row panel of `a` streams over it.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::gelu::{gelu, GeluApprox};
use super::matmul::{Fused, Prologue};
use super::par::SendPtr;

/// Rows of the register tile.
const MR: usize = 8;
/// Columns of the register tile: three zmm vectors.
const NR: usize = 48;
/// Inner-dimension block.
const KC: usize = 384;
/// Rows of `a` packed at a time (1.1 MiB at `KC`): a thread's slab of a fused op's tile (682 rows
/// at char-small) packs `b` once.
const MC: usize = 768;
/// Columns of `b` packed at a time: `KC × NC` floats (288 KiB) stay in a 1 MiB L2 beside `a`'s
/// panels; twice as wide measured 20 % slower in the kernel alone.
const NC: usize = 192;
/// Packed rows of `b` the kernel prefetches ahead.
const PREFETCH: usize = 16;

/// Floats of packing space one thread keeps: `b`'s block, `a`'s block, and slack to align.
const PACK_FLOATS: usize = KC * NC + MC * KC + 16;

thread_local! {
    static PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU runs [`sgemm`] (cached by the standard library after the first call).
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// `c (+)= scale · f(a) · b (+ bias)` for an `m × k` by `k × n` product, `f` and the bias as
/// `fused` says (the bias only without `accumulate`). Element `(i, j)` of each operand sits at
/// `i·rs + j·cs`; `c`'s columns are contiguous. Returns `false`, doing nothing, when the
/// thread's packing space is in use (a re-entrant call), so the caller can fall back.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]); every pointer must be valid for the elements its
/// strides reach, and `c` must not overlap `a` or `b`. A prologue's statistics must cover every
/// token and its weights every feature of `a`; a bias must hold `n` values.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    fused: Fused<'_>,
) -> bool {
    PACK.with(|pack| {
        let Ok(mut buf) = pack.try_borrow_mut() else {
            return false;
        };
        if buf.len() < PACK_FLOATS {
            buf.resize(PACK_FLOATS, 0.0);
        }
        let base = buf.as_mut_ptr();
        // SAFETY: the buffer holds 16 floats of slack for the alignment, then both blocks.
        unsafe {
            let bp = base.add(base.align_offset(64));
            let ap = bp.add(KC * NC);
            blocked(
                (m, n, k),
                (c, c_rs),
                (a, a_rs, a_cs),
                (b, b_rs, b_cs),
                (ap, bp),
                (scale, accumulate),
                fused,
            );
        }
        true
    })
}

/// Columns (or rows) of the operand the threads share, packed at a time: `KC × SHARED` floats
/// (3.4 MiB) on the calling thread, beside each worker's [`PACK_FLOATS`].
const SHARED: usize = 2304;

thread_local! {
    static SHARED_PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// [`sgemm`] on every thread of the current rayon pool, dealing work by demand rather than in
/// equal slabs. On a shared host one core often runs at 0.6× its speed while the other does
/// not (measured here: two pinned single-thread GEMM processes dip independently); equal slabs
/// then run at twice the slow core's speed, and dealt chunks at the sum of both. The operand
/// the chunks share (`b` when splitting rows, `a` when splitting columns) is packed once, by
/// all threads, instead of once per slab. Returns `false`, doing nothing, when the calling
/// thread's shared packing space is in use.
///
/// The result is bitwise that of [`sgemm`]: every element sums the same blocks in the same
/// order, whichever thread computes it.
///
/// # Safety
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_threaded(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    fused: Fused<'_>,
) -> bool {
    SHARED_PACK.with(|shared| {
        let Ok(mut buf) = shared.try_borrow_mut() else {
            return false;
        };
        if buf.len() < KC * SHARED + 16 {
            buf.resize(KC * SHARED + 16, 0.0);
        }
        let base = buf.as_mut_ptr();
        // SAFETY: the buffer holds 16 floats of slack for the alignment, then `KC × SHARED`;
        // the caller vouches for the operands.
        unsafe {
            let sp = base.add(base.align_offset(64));
            let ops = Operands {
                c: SendPtr(c),
                c_rs,
                a: SendPtr(a as *mut f32),
                a_s: (a_rs, a_cs),
                b: SendPtr(b as *mut f32),
                b_s: (b_rs, b_cs),
                fused,
            };
            if m >= n {
                by_rows((m, n, k), ops, SendPtr(sp), (scale, accumulate));
            } else {
                by_columns((m, n, k), ops, SendPtr(sp), (scale, accumulate));
            }
        }
        true
    })
}

#[derive(Clone, Copy)]
struct Operands<'a> {
    c: SendPtr,
    c_rs: isize,
    a: SendPtr,
    a_s: (isize, isize),
    b: SendPtr,
    b_s: (isize, isize),
    fused: Fused<'a>,
}

/// Runs `f(0..items)` on every thread of the current pool, each thread taking the next item
/// as it finishes one, and returns when all are done.
fn deal(items: usize, f: impl Fn(usize) + Sync) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    rayon::broadcast(|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= items {
            break;
        }
        f(i);
    });
}

/// Items of `align` elements each, about four per thread so that a slow core takes fewer,
/// at most `most` elements each.
fn chunk(len: usize, align: usize, most: usize) -> usize {
    let per = len.div_ceil(4 * rayon::current_num_threads().max(1));
    per.next_multiple_of(align).clamp(align, most)
}

/// Runs `f(ap, bp)` with this thread's packing space (a fresh one if it is in use).
fn with_pack(f: impl FnOnce(*mut f32, *mut f32)) {
    PACK.with(|pack| {
        let mut spare = Vec::new();
        let mut held = pack.try_borrow_mut();
        let buf = match held.as_mut() {
            Ok(b) => &mut **b,
            Err(_) => &mut spare,
        };
        if buf.len() < PACK_FLOATS {
            buf.resize(PACK_FLOATS, 0.0);
        }
        let base = buf.as_mut_ptr();
        // SAFETY: 16 floats of slack for the alignment, then `b`'s block and `a`'s.
        let bp = unsafe { base.add(base.align_offset(64)) };
        f(unsafe { bp.add(KC * NC) }, bp)
    })
}

/// Rows dealt to threads, `b` packed once per block of `KC × SHARED`.
#[target_feature(enable = "avx512f")]
unsafe fn by_rows(
    (m, n, k): (usize, usize, usize),
    o: Operands<'_>,
    sp: SendPtr,
    (scale, accumulate): (f32, bool),
) {
    let rows = chunk(m, MR, MC);
    for pc in (0..k).step_by(KC) {
        let kc = KC.min(k - pc);
        let acc = accumulate || pc > 0;
        for jg in (0..n).step_by(SHARED) {
            let gw = SHARED.min(n - jg);
            // SAFETY (both deals): as `sgemm_threaded`'s caller vouched; each item packs its
            // own panels of the shared block, then each row chunk writes its own rows of `c`.
            deal(gw.div_ceil(NC), |p| unsafe {
                let j = p * NC;
                let (rs, cs) = o.b_s;
                let src = o.b.get().offset(pc as isize * rs + (jg + j) as isize * cs);
                pack_b(kc, NC.min(gw - j), src, o.b_s, sp.get().add(j * kc));
            });
            deal(m.div_ceil(rows), |q| {
                with_pack(|ap, _| unsafe {
                    let i0 = q * rows;
                    let mc = rows.min(m - i0);
                    let (rs, cs) = o.a_s;
                    for ir in (0..mc).step_by(MR) {
                        let src = o.a.get().offset((i0 + ir) as isize * rs + pc as isize * cs);
                        let panel = (ap.add(ir * kc), i0 + ir, pc);
                        pack_a(kc, MR.min(mc - ir), src, o.a_s, panel, o.fused.prologue);
                    }
                    for jc in (0..gw).step_by(NC) {
                        let at = i0 as isize * o.c_rs + (jg + jc) as isize;
                        let panels = (ap as *const f32, sp.get().add(jc * kc) as *const f32);
                        let c = (o.c.get().offset(at), o.c_rs);
                        let bias = o.fused.bias_at(jg + jc);
                        tiles(kc, panels, c, (mc, NC.min(gw - jc)), (scale, bias), acc);
                    }
                })
            });
        }
    }
}

/// Columns dealt to threads, `a` packed once per block of `SHARED × KC`.
#[target_feature(enable = "avx512f")]
unsafe fn by_columns(
    (m, n, k): (usize, usize, usize),
    o: Operands<'_>,
    sp: SendPtr,
    (scale, accumulate): (f32, bool),
) {
    let cols = chunk(n, NR, NC);
    for pc in (0..k).step_by(KC) {
        let kc = KC.min(k - pc);
        let acc = accumulate || pc > 0;
        for ig in (0..m).step_by(SHARED) {
            let mg = SHARED.min(m - ig);
            // SAFETY (both deals): as in `by_rows`, with rows and columns exchanged.
            deal(mg.div_ceil(MR * 8), |p| unsafe {
                let (rs, cs) = o.a_s;
                for ir in (p * MR * 8..mg).step_by(MR).take(8) {
                    let src = o.a.get().offset((ig + ir) as isize * rs + pc as isize * cs);
                    let panel = (sp.get().add(ir * kc), ig + ir, pc);
                    pack_a(kc, MR.min(mg - ir), src, o.a_s, panel, o.fused.prologue);
                }
            });
            deal(n.div_ceil(cols), |q| {
                with_pack(|_, bp| unsafe {
                    let j0 = q * cols;
                    let nc = cols.min(n - j0);
                    let (rs, cs) = o.b_s;
                    let src = o.b.get().offset(pc as isize * rs + j0 as isize * cs);
                    pack_b(kc, nc, src, o.b_s, bp);
                    let at = ig as isize * o.c_rs + j0 as isize;
                    let panels = (sp.get() as *const f32, bp as *const f32);
                    tiles(
                        kc,
                        panels,
                        (o.c.get().offset(at), o.c_rs),
                        (mg, nc),
                        (scale, o.fused.bias_at(j0)),
                        acc,
                    );
                })
            });
        }
    }
}

#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn blocked(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    (ap, bp): (*mut f32, *mut f32),
    (scale, accumulate): (f32, bool),
    fused: Fused<'_>,
) {
    let at = |i: usize, p: usize| i as isize * a_rs + p as isize * a_cs;
    let bt = |p: usize, j: usize| p as isize * b_rs + j as isize * b_cs;
    for pc in (0..k).step_by(KC) {
        let kc = KC.min(k - pc);
        // Blocks after the first add to what the first wrote.
        let acc = accumulate || pc > 0;
        for ic in (0..m).step_by(MC) {
            let mc = MC.min(m - ic);
            for ir in (0..mc).step_by(MR) {
                // SAFETY (all blocks below): indices stay inside the operands' extents, and the
                // packed panels inside the buffers `sgemm` sized.
                unsafe {
                    pack_a(
                        kc,
                        MR.min(mc - ir),
                        a.offset(at(ic + ir, pc)),
                        (a_rs, a_cs),
                        (ap.add(ir * kc), ic + ir, pc),
                        fused.prologue,
                    )
                };
            }
            for jc in (0..n).step_by(NC) {
                let nc = NC.min(n - jc);
                unsafe { pack_b(kc, nc, b.offset(bt(pc, jc)), (b_rs, b_cs), bp) };
                unsafe {
                    let cp = c.offset(ic as isize * c_rs + jc as isize);
                    let bias = fused.bias_at(jc);
                    tiles(kc, (ap, bp), (cp, c_rs), (mc, nc), (scale, bias), acc);
                }
            }
        }
    }
}

/// Packs `kc` columns of up to 8 rows of `a` as `out[p·8 + i]`, zero rows past `mr`, then
/// applies the prologue; the panel's first element is `(i0, p0)` of the whole `a`.
#[target_feature(enable = "avx512f")]
unsafe fn pack_a(
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
            for p in 0..kc {
                for i in 0..MR {
                    *out.add(p * MR + i) = if i < mr { *a.offset(src(i, p)) } else { 0.0 };
                }
            }
        }
        if !matches!(prologue, Prologue::None) {
            let panel = std::slice::from_raw_parts_mut(out, kc * MR);
            apply_prologue(prologue, panel, mr, (i0, p0));
        }
    }
}

/// The prologue over one packed panel (`panel[p·8 + i]` holds `a[i0 + i, p0 + p]`), rows past
/// `mr` left as they are. Loops over whole 8-float columns where it can, so they vectorise.
#[inline(always)]
fn apply_prologue(prologue: Prologue<'_>, panel: &mut [f32], mr: usize, (i0, p0): (usize, usize)) {
    match prologue {
        Prologue::None => {}
        // Padded rows hold zeros, and GELU(0) = 0. One loop per variant, each vectorised.
        Prologue::Gelu(GeluApprox::Tanh) => {
            panel
                .iter_mut()
                .for_each(|x| *x = gelu(GeluApprox::Tanh, *x));
        }
        Prologue::Gelu(GeluApprox::Exact) => {
            panel
                .iter_mut()
                .for_each(|x| *x = gelu(GeluApprox::Exact, *x));
        }
        Prologue::LayerNorm {
            mean,
            rstd,
            w,
            b,
            tokens_down,
        } => {
            let kc = panel.len() / MR;
            if tokens_down {
                // Token per row of the panel, feature per column.
                let (m8, r8) = (&mean[i0..i0 + mr], &rstd[i0..i0 + mr]);
                let (wk, bk) = (&w[p0..p0 + kc], &b[p0..p0 + kc]);
                for ((col, &wf), &bf) in panel.chunks_exact_mut(MR).zip(wk).zip(bk) {
                    for ((v, &m), &r) in col.iter_mut().zip(m8).zip(r8) {
                        *v = (*v - m) * r * wf + bf;
                    }
                }
            } else {
                // Token per column of the panel, feature per row.
                let (w8, b8) = (&w[i0..i0 + mr], &b[i0..i0 + mr]);
                let (mk, rk) = (&mean[p0..p0 + kc], &rstd[p0..p0 + kc]);
                for ((col, &m), &r) in panel.chunks_exact_mut(MR).zip(mk).zip(rk) {
                    for ((v, &wf), &bf) in col.iter_mut().zip(w8).zip(b8) {
                        *v = (*v - m) * r * wf + bf;
                    }
                }
            }
        }
    }
}

/// Packs `kc` rows of `nc` columns of `b` into 48-column panels (`out[j·kc + p·48 + l]` for
/// panel `j`), zero columns past `nc`.
#[target_feature(enable = "avx512f")]
unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, (rs, cs): (isize, isize), out: *mut f32) {
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
                for l in 0..nr {
                    let col = src.offset(l as isize * cs);
                    for p in 0..kc {
                        *dst.add(p * NR + l) = *col.offset(p as isize * rs);
                    }
                }
                for l in nr..NR {
                    for p in 0..kc {
                        *dst.add(p * NR + l) = 0.0;
                    }
                }
            }
        }
    }
}

/// The `mc × nc` block of `c` at `c` from packed panels: `ap` holds `mc` rows in 8-row panels,
/// `bp` `nc` columns in 48-column panels, both `kc` deep. `bias` (null for none) holds the
/// block's `nc` columns' biases, added where `c` is not accumulated into.
#[target_feature(enable = "avx512f")]
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

/// One 8 × 48 tile: `c (+)= scale · Σ_p a[p] ⊗ b[p]` over packed panels, storing `mr × nr`;
/// not accumulating, a non-null `bias` (the tile's `nr` columns) is added.
#[target_feature(enable = "avx512f")]
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
    let mut acc = [[_mm512_setzero_ps(); 3]; MR];
    // SAFETY (all blocks): the panels hold `kc` packed rows each; prefetches may point past
    // them (wrapping arithmetic, and a prefetch never faults); stores are masked to the tile.
    unsafe {
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
const SMALL_MR: usize = 6;

/// `c (+)= scale · a · b` for the small products of one attention head (tens to hundreds of
/// rows, columns and depth), nothing packed per product: `a`'s elements are broadcast from
/// wherever they lie (any strides, so `a` may be read transposed); `b` is read in strips of 64
/// columns, `b_strip` floats apart, each strip's rows `b_rs` apart and contiguous (the caller
/// lays each head's operands out once, so rows stream in order rather than thrash the cache's
/// sets from a wide tensor); `c`'s rows are contiguous.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]); every pointer must be valid for the elements its
/// strides reach, and `c` must not overlap `a` or `b`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn small_gemm(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, usize),
    a: (*const f32, usize, usize),
    (b, b_rs, b_strip): (*const f32, usize, usize),
    scale: f32,
    accumulate: bool,
) {
    for j0 in (0..n).step_by(64) {
        let nr = (n - j0).min(64);
        let masks: [__mmask16; 4] = std::array::from_fn(|v| {
            let left = nr.saturating_sub(16 * v).min(16);
            (((1u32 << left) - 1) & 0xffff) as __mmask16
        });
        // SAFETY (all tiles): each stays inside `c`, and reads inside `a` and `b`, as the
        // caller vouched; the masks stop loads and stores at column `n`.
        unsafe {
            let (b, c) = (b.add(j0 / 64 * b_strip), c.add(j0));
            let mut i0 = 0;
            while i0 + SMALL_MR <= m {
                small_tile::<SMALL_MR>(k, i0, (c, c_rs), a, (b, b_rs), masks, (scale, accumulate));
                i0 += SMALL_MR;
            }
            let tile = (c, c_rs);
            let run = (scale, accumulate);
            match m - i0 {
                1 => small_tile::<1>(k, i0, tile, a, (b, b_rs), masks, run),
                2 => small_tile::<2>(k, i0, tile, a, (b, b_rs), masks, run),
                3 => small_tile::<3>(k, i0, tile, a, (b, b_rs), masks, run),
                4 => small_tile::<4>(k, i0, tile, a, (b, b_rs), masks, run),
                5 => small_tile::<5>(k, i0, tile, a, (b, b_rs), masks, run),
                _ => {}
            }
        }
    }
}

/// Rows `i0..i0 + R` of one 64-column strip for [`small_gemm`].
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn small_tile<const R: usize>(
    k: usize,
    i0: usize,
    (c, c_rs): (*mut f32, usize),
    (a, a_rs, a_cs): (*const f32, usize, usize),
    (b, b_rs): (*const f32, usize),
    masks: [__mmask16; 4],
    (scale, accumulate): (f32, bool),
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    // SAFETY (all blocks): as `small_gemm`'s caller vouched; masked lanes are not touched.
    unsafe {
        let a = a.add(i0 * a_rs);
        for p in 0..k {
            let bq = b.add(p * b_rs);
            let bv: [__m512; 4] =
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-0.5, 0.5) with no pattern a blocking bug could hide behind.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Threads dealing rows or columns compute bitwise what one thread computes, in every
    /// layout, with partial chunks, several `k` blocks, and shared blocks past `SHARED` in
    /// both directions; also on a pool of three, where chunks do not divide evenly.
    #[test]
    fn dealing_work_to_threads_changes_no_bit() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let shapes = [
            (2400, 2350, 40),
            (2330, 2345, 20),
            (50, 2400, 400),
            (700, 90, 385),
            (13, 100, 5),
        ];
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (m, n, k) in shapes {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let (a, b) = (values(m * k, 4), values(k * n, 5));
                    let start = values(m * n, 6);
                    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
                    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
                    let run = |c: &mut Vec<f32>| {
                        // SAFETY: the CPU was checked; the strides stay inside the vectors.
                        unsafe {
                            sgemm_threaded(
                                (m, n, k),
                                (c.as_mut_ptr(), n as isize),
                                (a.as_ptr(), a_rs, a_cs),
                                (b.as_ptr(), b_rs, b_cs),
                                0.5,
                                true,
                                Fused::NONE,
                            )
                        }
                    };
                    let (mut one, mut dealt) = (start.clone(), start.clone());
                    // SAFETY: as above.
                    let done = unsafe {
                        sgemm(
                            (m, n, k),
                            (one.as_mut_ptr(), n as isize),
                            (a.as_ptr(), a_rs, a_cs),
                            (b.as_ptr(), b_rs, b_cs),
                            0.5,
                            true,
                            Fused::NONE,
                        )
                    };
                    assert!(done && pool.install(|| run(&mut dealt)));
                    assert!(
                        one.iter()
                            .zip(&dealt)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{m}×{k}×{n} ta={ta} tb={tb} on {threads} threads"
                    );
                    assert_ne!(one, start, "{m}×{k}×{n}: the product was not added");
                }
            }
        }
    }

    /// A prologue made while packing, and a bias added while storing, give bitwise the product
    /// of the materialised `f(op(a))` with `c` filled with the bias first: on one thread and
    /// dealt (rows and columns), in both LayerNorm orientations, past `KC` and `MC`, with
    /// partial panels.
    #[test]
    fn fused_prologue_and_bias_are_bitwise_the_materialised_product() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for (m, n, k) in [(803, 70, 450), (45, 500, 390), (9, 20, 7)] {
            for ta in [false, true] {
                let (a, b) = (values(m * k, 7), values(k * n, 8));
                let bias = values(n, 9);
                // Tokens run along op(a)'s rows, or (a weight gradient's xᵀ) along its columns.
                let (tokens, features) = if ta { (k, m) } else { (m, k) };
                let mean = values(tokens, 10);
                let rstd: Vec<f32> = values(tokens, 11).iter().map(|v| v + 1.0).collect();
                let (lw, lb) = (values(features, 12), values(features, 13));
                let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
                let at = |i: usize, p: usize| (i as isize * a_rs + p as isize * a_cs) as usize;
                // The prologue, and what it makes of element (i, p) of op(a).
                type Made<'f> = &'f dyn Fn(usize, usize, f32) -> f32;
                let prologues: [(&str, Prologue, Made); 3] = [
                    (
                        "layer norm",
                        Prologue::LayerNorm {
                            mean: &mean,
                            rstd: &rstd,
                            w: &lw,
                            b: &lb,
                            tokens_down: !ta,
                        },
                        &|i, p, v| {
                            let (t, f) = if ta { (p, i) } else { (i, p) };
                            (v - mean[t]) * rstd[t] * lw[f] + lb[f]
                        },
                    ),
                    ("gelu", Prologue::Gelu(GeluApprox::Tanh), &|_, _, v| {
                        gelu(GeluApprox::Tanh, v)
                    }),
                    ("bias alone", Prologue::None, &|_, _, v| v),
                ];
                for (name, prologue, f) in prologues {
                    // op(a) made, row-major.
                    let mut made = vec![0.0; m * k];
                    for i in 0..m {
                        for p in 0..k {
                            made[i * k + p] = f(i, p, a[at(i, p)]);
                        }
                    }
                    let mut want: Vec<f32> = (0..m).flat_map(|_| bias.iter().copied()).collect();
                    let ptr = |c: &mut Vec<f32>| (c.as_mut_ptr(), n as isize);
                    let b_op = (b.as_ptr(), n as isize, 1);
                    // SAFETY (all three): the CPU was checked; the strides stay inside the
                    // vectors; the statistics and weights cover op(a).
                    let done = unsafe {
                        sgemm(
                            (m, n, k),
                            ptr(&mut want),
                            (made.as_ptr(), k as isize, 1),
                            b_op,
                            1.0,
                            true,
                            Fused::NONE,
                        )
                    };
                    let fused = Fused {
                        prologue,
                        bias: Some(&bias),
                    };
                    let a_op = (a.as_ptr(), a_rs, a_cs);
                    let (mut one, mut dealt) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    let one_done =
                        unsafe { sgemm((m, n, k), ptr(&mut one), a_op, b_op, 1.0, false, fused) };
                    let dealt_done = pool.install(|| unsafe {
                        let (a_op, b_op) = ((a.as_ptr(), a_rs, a_cs), (b.as_ptr(), n as isize, 1));
                        sgemm_threaded((m, n, k), ptr(&mut dealt), a_op, b_op, 1.0, false, fused)
                    });
                    assert!(done && one_done && dealt_done);
                    for (what, got) in [("one thread", &one), ("dealt", &dealt)] {
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{m}×{k}×{n} ta={ta} {name} on {what}"
                        );
                    }
                }
            }
        }
    }

    /// Every layout the step uses, and shapes that leave partial tiles and blocks in each
    /// dimension (m past `MC` and not a multiple of 8, n past `NC` and not of 48, k past `KC`
    /// and not of 16), against a plain triple loop in f64.
    #[test]
    fn matches_a_triple_loop_in_every_layout_and_at_every_edge() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let shapes = [
            (1, 1, 1),
            (7, 5, 3),
            (8, 48, 16),
            (13, 50, 17),
            (790, 203, 401),
            (9, 97, 800),
            (20, 61, 35),
        ];
        for (m, n, k) in shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for (scale, accumulate) in [(1.0f32, false), (0.5, true)] {
                    let (a, b) = (values(m * k, 1), values(k * n, 2));
                    let start = values(m * n, 3);
                    let mut c = start.clone();
                    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
                    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
                    // SAFETY: the CPU was checked; the strides stay inside the vectors.
                    let done = unsafe {
                        sgemm(
                            (m, n, k),
                            (c.as_mut_ptr(), n as isize),
                            (a.as_ptr(), a_rs, a_cs),
                            (b.as_ptr(), b_rs, b_cs),
                            scale,
                            accumulate,
                            Fused::NONE,
                        )
                    };
                    assert!(done);
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f64 = (0..k)
                                .map(|p| {
                                    let x = a[(i as isize * a_rs + p as isize * a_cs) as usize];
                                    let y = b[(p as isize * b_rs + j as isize * b_cs) as usize];
                                    f64::from(x) * f64::from(y)
                                })
                                .sum();
                            let base = if accumulate {
                                f64::from(start[i * n + j])
                            } else {
                                0.0
                            };
                            let want = base + f64::from(scale) * dot;
                            let got = f64::from(c[i * n + j]);
                            assert!(
                                (got - want).abs() <= 1e-5 * (k as f64).sqrt() + 1e-6,
                                "{m}×{k}×{n} ta={ta} tb={tb} scale={scale} at ({i}, {j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
