//! Our f32 GEMM, `c (+)= scale · f(a) · b (+ bias)` with `c` row-major and `a`, `b` at any
//! strides, on one thread ([`sgemm`]) or on the rayon pool with work dealt by demand
//! ([`sgemm_threaded`]); `f` (a LayerNorm or GELU made as `a` is packed) and the bias are what
//! [`Fused`] asks for. The blocking here is the same on every CPU; the register tile and
//! the packing that feeds it are a [`Tile`] per instruction set ([`avx512`](super::avx512), [`avx2`](super::avx2)).
//! [`gemm_raw`](super::gemm_raw) keeps the gemm crate for other CPUs and for narrow outputs.
//!
//! Blocking, in the BLIS manner, named for row-major `c`: an `MR × NR` register tile (`b` is the
//! vector operand, `a` the broadcast one). For each block of `KC` of the inner dimension, `MC`
//! rows of `a` are packed into `MR`-row panels (the panel the tile broadcasts from stays in
//! L1), and `NC` columns of `b` into `NR`-column panels, a block small enough to stay in L2
//! while every row panel of `a` streams over it.

use std::cell::RefCell;
use std::sync::{Mutex, TryLockError};

use snug_graph::ops::GeluApprox;

use super::fused::{Fused, Prologue};
use crate::math::gelu;
use crate::par::SendPtr;

/// A register tile and the packing that feeds it, for one instruction set, with the block
/// sizes that suit the caches of the CPUs that have it.
pub(crate) trait Tile {
    /// Rows of the register tile (`a`'s panels).
    const MR: usize;
    /// Columns of the register tile (`b`'s panels).
    const NR: usize;
    /// Inner-dimension block.
    const KC: usize;
    /// Rows of `a` packed at a time.
    const MC: usize;
    /// Columns of `b` packed at a time; a multiple of `NR` dividing [`SHARED`].
    const NC: usize;

    /// Whether this CPU runs the tile (cached by the standard library after the first call).
    fn available() -> bool;

    /// Packs `kc` columns of up to `MR` rows of `a` as `out[p·MR + i]`, zero rows past `mr`,
    /// then applies the prologue ([`apply_prologue`]); the panel's first element is `(i0, p0)`
    /// of the whole `a`.
    ///
    /// # Safety
    /// The CPU must have the instruction set; `a` must be valid for `mr` rows and `kc` columns
    /// at its strides, `out` for `MR · kc` floats.
    unsafe fn pack_a(
        kc: usize,
        mr: usize,
        a: *const f32,
        strides: (isize, isize),
        panel: (*mut f32, usize, usize),
        prologue: Prologue<'_>,
    );

    /// Packs `kc` rows of `nc` columns of `b` into `NR`-column panels (`out[j·kc + p·NR + l]`
    /// for panel `j`), zero columns past `nc`, in the form [`Tile::kernel`] reads.
    ///
    /// # Safety
    /// The CPU must have the instruction set; `b` must be valid for `kc` rows and `nc` columns
    /// at its strides; `out` must be 64-byte aligned and hold `kc · nc.next_multiple_of(NR)`.
    unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, strides: (isize, isize), out: *mut f32);

    /// [`Tile::pack_a`] from a bf16 `a`, widened as it is packed, then the prologue.
    ///
    /// # Safety
    /// The CPU must have the instruction set; the panel's rows and columns must lie inside
    /// `half`'s bits, `out` must hold `MR · kc` floats.
    unsafe fn pack_a_half(
        half: &super::half::HalfA<'_>,
        dims: (usize, usize),
        panel: (*mut f32, usize, usize),
        prologue: Prologue<'_>,
    );

    /// Turns a packed `a` panel (`MR · kc` floats, as [`Tile::pack_a`] leaves it) into the
    /// form [`Tile::kernel`] reads, in place. The f32 tiles read it as it is.
    ///
    /// # Safety
    /// The CPU must have the instruction set; `panel` must hold `MR · kc` floats.
    #[inline(always)]
    unsafe fn finish_a(kc: usize, panel: *mut f32) {
        let _ = (kc, panel);
    }

    /// Turns `b` panels decoded in f32 from a quantized or bf16 `b` (laid out as an f32
    /// tile's [`Tile::pack_b`] packs them) into the form [`Tile::kernel`] reads, in place. The
    /// f32 tiles read them as they are.
    ///
    /// # Safety
    /// As [`Tile::pack_b`]'s `out`.
    #[inline(always)]
    unsafe fn finish_b(kc: usize, nc: usize, out: *mut f32) {
        let _ = (kc, nc, out);
    }

    /// Packs `kc` rows of `nc` columns of a bf16 `b` whose rows start `rs` values apart in
    /// `halves` (columns contiguous) straight into the form [`Tile::kernel`] reads, where
    /// the tile reads bf16 as it is stored; `false`, doing nothing, where it does not (the
    /// caller then decodes the panels in f32 and finishes them).
    ///
    /// # Safety
    /// The CPU must have the instruction set; the rows and columns must lie inside `halves`;
    /// `out` as [`Tile::pack_b`]'s.
    #[inline(always)]
    unsafe fn pack_b_bf16(
        kc: usize,
        nc: usize,
        (halves, rs): (&[u16], usize),
        out: *mut f32,
    ) -> bool {
        let _ = (kc, nc, halves, rs, out);
        false
    }

    /// Called on a thread after its share of a product's tiles (a whole product on one
    /// thread, or one dealt range): where the tile keeps state in the CPU between kernel
    /// calls (AMX's tile configuration), it gives it up here.
    ///
    /// # Safety
    /// The CPU must have the instruction set.
    #[inline(always)]
    unsafe fn done() {}

    /// One `MR × NR` tile: `c (+)= scale · Σ_p a[p] ⊗ b[p]` over packed panels `kc` deep,
    /// storing its `mr × nr` corner; not accumulating, a non-null `bias` (the tile's `nr`
    /// columns) is added.
    ///
    /// # Safety
    /// The CPU must have the instruction set; the panels must hold `kc` packed rows, and the
    /// tile (and its biases) must lie inside `c` (and `bias`).
    unsafe fn kernel(
        kc: usize,
        panels: (*const f32, *const f32),
        c: (*mut f32, isize),
        tile: (usize, usize),
        scale_bias: (f32, *const f32),
        accumulate: bool,
    );
}

/// A tile's [`Tile::pack_a`], [`Tile::pack_b`] and [`Tile::kernel`], each calling the
/// instruction set's module-level function of the same name: a trait method cannot carry
/// `#[target_feature]` itself.
macro_rules! tile_entry_points {
    () => {
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

        unsafe fn pack_b(
            kc: usize,
            nc: usize,
            b: *const f32,
            strides: (isize, isize),
            out: *mut f32,
        ) {
            // SAFETY: as the caller vouched.
            unsafe { pack_b(kc, nc, b, strides, out) }
        }

        unsafe fn pack_a_half(
            half: &super::half::HalfA<'_>,
            dims: (usize, usize),
            panel: (*mut f32, usize, usize),
            prologue: Prologue<'_>,
        ) {
            // SAFETY: as the caller vouched.
            unsafe { pack_a_half(half, dims, panel, prologue) }
        }

        unsafe fn kernel(
            kc: usize,
            panels: (*const f32, *const f32),
            c: (*mut f32, isize),
            tile: (usize, usize),
            scale_bias: (f32, *const f32),
            accumulate: bool,
        ) {
            // SAFETY: as the caller vouched.
            unsafe { kernel(kc, panels, c, tile, scale_bias, accumulate) }
        }
    };
}
pub(super) use tile_entry_points;

/// Floats of packing space one thread keeps for tile `T`: `b`'s block, then `a`'s.
const fn pack_floats<T: Tile>() -> usize {
    T::KC * T::NC + T::MC * T::KC
}

thread_local! {
    static PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Grows this thread's packing space for `T` now, so that a product run later needs no
/// allocation: under emulation (`snug_testkit::emulate`) none can reach the kernel.
#[cfg(test)]
pub(super) fn reserve_pack<T: Tile>() {
    PACK.with(|pack| {
        aligned(&mut pack.borrow_mut(), pack_floats::<T>());
    });
}

/// Room for `floats` in `buf`, grown if need be, from a 64-byte boundary. It is capacity,
/// never initialised: packing writes every float a kernel reads, and pages no product packs
/// into are never touched, so they hold no resident memory.
fn aligned(buf: &mut Vec<f32>, floats: usize) -> *mut f32 {
    buf.reserve(floats + 16);
    let base = buf.as_mut_ptr();
    // SAFETY: the 16 floats of slack cover the offset to the boundary.
    unsafe { base.add(base.align_offset(64)) }
}

/// `c (+)= scale · f(a) · b (+ bias)` for an `m × k` by `k × n` product, `f` and the bias as
/// `fused` says (the bias only without `accumulate`). Element `(i, j)` of each operand sits at
/// `i·rs + j·cs`; `c`'s columns are contiguous. Returns `false`, doing nothing, when the
/// thread's packing space is in use (a re-entrant call), so the caller can fall back.
///
/// # Safety
/// The CPU must have `T`'s instruction set ([`Tile::available`]); every pointer must be valid
/// for the elements its strides reach, and `c` must not overlap `a` or `b`. A prologue's
/// statistics must cover every token and its weights every feature of `a`; a bias must hold
/// `n` values.
pub(crate) unsafe fn sgemm<T: Tile>(
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
        let bp = aligned(&mut buf, pack_floats::<T>());
        // SAFETY: the space holds both blocks.
        unsafe {
            let ap = bp.add(T::KC * T::NC);
            blocked::<T>(
                (m, n, k),
                (c, c_rs),
                (a, a_rs, a_cs),
                (b, b_rs, b_cs),
                (ap, bp),
                (scale, accumulate),
                fused,
            );
            T::done();
        }
        true
    })
}

/// [`sgemm`] that runs whatever this thread's packing space is doing, on a fresh one if it is
/// in use ([`with_pack`]): for a tile's check of itself, once per process.
///
/// # Safety
/// As [`sgemm`].
pub(crate) unsafe fn sgemm_alone<T: Tile>(
    dims: (usize, usize, usize),
    c: (*mut f32, isize),
    a: (*const f32, isize, isize),
    b: (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    fused: Fused<'_>,
) {
    // SAFETY: the space holds both blocks; the caller vouches for the rest.
    with_pack::<T>(|ap, bp| unsafe {
        blocked::<T>(dims, c, a, b, (ap, bp), (scale, accumulate), fused)
    });
}

/// Columns (or rows) of the operand the threads share, packed at a time: at most
/// `KC × SHARED` floats, beside each worker's packing space.
const SHARED: usize = 2304;

/// The shared operand's packing space. One for the process, as products run one at a time:
/// per thread, each rayon worker that happens to call a product would keep its own copy.
static SHARED_PACK: Mutex<Vec<f32>> = Mutex::new(Vec::new());

thread_local! {
    /// A thread's own, while another thread's product holds [`SHARED_PACK`] (sessions run
    /// side by side, as tests do): the same kernel runs, so the bits are the same.
    static OWN_SHARED_PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// [`sgemm`] on every thread of the current rayon pool, dealing work by demand rather than in
/// equal slabs. On a shared host one core often runs at 0.6× its speed while the other does
/// not (measured here: two pinned single-thread GEMM processes dip independently); equal slabs
/// then run at twice the slow core's speed, and dealt chunks at the sum of both. The operand
/// the chunks share (`b` when splitting rows, `a` when splitting columns) is packed once, by
/// all threads, instead of once per slab. Returns `false`, doing nothing, when both the
/// process's shared packing space and the calling thread's own are in use.
///
/// The result is bitwise that of [`sgemm`]: every element sums the same blocks in the same
/// order, whichever thread computes it.
///
/// # Safety
/// As [`sgemm`].
pub(crate) unsafe fn sgemm_threaded<T: Tile>(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    fused: Fused<'_>,
) -> bool {
    // The shared block is padded to whole panels, and never deeper than `k`.
    let width = if m >= n {
        n.next_multiple_of(T::NR)
    } else {
        m.next_multiple_of(T::MR)
    };
    let floats = T::KC.min(k) * width.min(SHARED);
    let run = |buf: &mut Vec<f32>| {
        let sp = aligned(buf, floats);
        // SAFETY: the space holds the shared block; the caller vouches for the operands.
        unsafe {
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
                by_rows::<T>((m, n, k), ops, SendPtr(sp), (scale, accumulate));
            } else {
                by_columns::<T>((m, n, k), ops, SendPtr(sp), (scale, accumulate));
            }
        }
    };
    match SHARED_PACK.try_lock() {
        Ok(mut buf) => run(&mut buf),
        // A product that panicked left nothing in the space that a new one reads.
        Err(TryLockError::Poisoned(p)) => run(&mut p.into_inner()),
        Err(TryLockError::WouldBlock) => {
            let done = OWN_SHARED_PACK.with(|own| own.try_borrow_mut().map(|mut b| run(&mut b)));
            return done.is_ok();
        }
    }
    true
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

/// Runs `f(0..items)` on the threads of the current pool, each thread taking the next item
/// as it finishes one, and returns when all are done.
fn deal(items: usize, f: impl Fn(usize) + Sync) {
    deal_ranges(items, 1, (1, 1), |i, _| f(i));
}

/// Runs `f(start, end)` over ranges covering `0..len` on the threads of the current pool,
/// guided: each claim takes a share of what is left (a quarter per thread, in multiples of
/// `align`, at least `least`), so the last ranges are short. With equal ranges the thread
/// that finished first waited, on average, half a range at the end of every deal (6.6 % of
/// the char-small step's GEMM time; 2.5 % guided). No range is longer than `most`, nor than
/// equal ranges four per thread would be, so a thread packs no more of its operand at once.
///
/// The calling thread claims ranges at once; the other workers join through jobs they may
/// steal, so a deal never waits for a worker the OS has not scheduled (another process on
/// its core): the caller runs an unstolen job itself, and it finds nothing left. A
/// broadcast, which every worker must enter, made each of a step's hundreds of deals wait
/// for the descheduled one: beside one busy process, char-small's f32 step took 3.7–4.1 s
/// (PyTorch's 3.4 s, alone 1.3 s for both kinds of deal).
fn deal_ranges(
    len: usize,
    align: usize,
    (least, most): (usize, usize),
    f: impl Fn(usize, usize) + Sync,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let share = 2 * rayon::current_num_threads().max(1);
    let most = most
        .min(len.div_ceil(2 * share).next_multiple_of(align))
        .max(least);
    let next = AtomicUsize::new(0);
    let work = || loop {
        let mut start = next.load(Ordering::Relaxed);
        let end = loop {
            if start >= len {
                return;
            }
            let size = (len - start)
                .div_ceil(share)
                .next_multiple_of(align)
                .clamp(least, most);
            let end = (start + size).min(len);
            match next.compare_exchange_weak(start, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break end,
                Err(now) => start = now,
            }
        };
        crate::isa::vectorized(
            #[inline(always)]
            || f(start, end),
        );
    };
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|_| work());
        }
        work();
    });
}

/// Runs `f(ap, bp)` with this thread's packing space for `T` (a fresh one if it is in use).
fn with_pack<T: Tile>(f: impl FnOnce(*mut f32, *mut f32)) {
    PACK.with(|pack| {
        let mut spare = Vec::new();
        let mut held = pack.try_borrow_mut();
        let buf = match held.as_mut() {
            Ok(b) => &mut **b,
            Err(_) => &mut spare,
        };
        let bp = aligned(buf, pack_floats::<T>());
        // SAFETY: the space holds `b`'s block, then `a`'s; the CPU has the tile's
        // instructions, as the product's caller vouched.
        unsafe {
            f(bp.add(T::KC * T::NC), bp);
            T::done();
        }
    })
}

/// Rows dealt to threads, `b` packed once per block of `KC × SHARED`.
unsafe fn by_rows<T: Tile>(
    (m, n, k): (usize, usize, usize),
    o: Operands<'_>,
    sp: SendPtr,
    (scale, accumulate): (f32, bool),
) {
    let most = T::MC - T::MC % T::MR;
    for pc in (0..k).step_by(T::KC) {
        let kc = T::KC.min(k - pc);
        let acc = accumulate || pc > 0;
        for jg in (0..n).step_by(SHARED) {
            let gw = SHARED.min(n - jg);
            // SAFETY (both deals): as `sgemm_threaded`'s caller vouched; each item packs its
            // own panels of the shared block, then each row range writes its own rows of `c`.
            deal(gw.div_ceil(2 * T::NR), |p| unsafe {
                let j = p * 2 * T::NR;
                let (rs, cs) = o.b_s;
                let src = o.b.get().offset(pc as isize * rs + (jg + j) as isize * cs);
                let (nc, out) = ((2 * T::NR).min(gw - j), sp.get().add(j * kc));
                pack_b::<T>(&o.fused, (kc, nc), (src, o.b_s), out, (pc, jg + j));
            });
            deal_ranges(m, T::MR, (8 * T::MR, most), |i0, i1| {
                with_pack::<T>(|ap, _| unsafe {
                    let mc = i1 - i0;
                    let (rs, cs) = o.a_s;
                    for ir in (0..mc).step_by(T::MR) {
                        let src = o.a.get().offset((i0 + ir) as isize * rs + pc as isize * cs);
                        let panel = (ap.add(ir * kc), i0 + ir, pc);
                        pack_a::<T>(&o.fused, (kc, T::MR.min(mc - ir)), (src, o.a_s), panel);
                    }
                    for jc in (0..gw).step_by(T::NC) {
                        let at = i0 as isize * o.c_rs + (jg + jc) as isize;
                        let panels = (ap as *const f32, sp.get().add(jc * kc) as *const f32);
                        let c = (o.c.get().offset(at), o.c_rs);
                        let bias = o.fused.bias_at(jg + jc);
                        tiles::<T>(kc, panels, c, (mc, T::NC.min(gw - jc)), (scale, bias), acc);
                    }
                })
            });
        }
    }
}

/// Columns dealt to threads, `a` packed once per block of `SHARED × KC`.
unsafe fn by_columns<T: Tile>(
    (m, n, k): (usize, usize, usize),
    o: Operands<'_>,
    sp: SendPtr,
    (scale, accumulate): (f32, bool),
) {
    for pc in (0..k).step_by(T::KC) {
        let kc = T::KC.min(k - pc);
        let acc = accumulate || pc > 0;
        for ig in (0..m).step_by(SHARED) {
            let mg = SHARED.min(m - ig);
            // SAFETY (both deals): as in `by_rows`, with rows and columns exchanged.
            deal(mg.div_ceil(T::MR * 8), |p| unsafe {
                let (rs, cs) = o.a_s;
                for ir in (p * T::MR * 8..mg).step_by(T::MR).take(8) {
                    let src = o.a.get().offset((ig + ir) as isize * rs + pc as isize * cs);
                    let panel = (sp.get().add(ir * kc), ig + ir, pc);
                    pack_a::<T>(&o.fused, (kc, T::MR.min(mg - ir)), (src, o.a_s), panel);
                }
            });
            deal_ranges(n, T::NR, (2 * T::NR, T::NC), |j0, j1| {
                with_pack::<T>(|_, bp| unsafe {
                    let nc = j1 - j0;
                    let (rs, cs) = o.b_s;
                    let src = o.b.get().offset(pc as isize * rs + j0 as isize * cs);
                    pack_b::<T>(&o.fused, (kc, nc), (src, o.b_s), bp, (pc, j0));
                    let at = ig as isize * o.c_rs + j0 as isize;
                    let panels = (sp.get() as *const f32, bp as *const f32);
                    tiles::<T>(
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

unsafe fn blocked<T: Tile>(
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
    let mc_most = T::MC - T::MC % T::MR;
    for pc in (0..k).step_by(T::KC) {
        let kc = T::KC.min(k - pc);
        // Blocks after the first add to what the first wrote.
        let acc = accumulate || pc > 0;
        for ic in (0..m).step_by(mc_most) {
            let mc = mc_most.min(m - ic);
            for ir in (0..mc).step_by(T::MR) {
                // SAFETY (all blocks below): indices stay inside the operands' extents, and the
                // packed panels inside the buffers `sgemm` sized.
                unsafe {
                    pack_a::<T>(
                        &fused,
                        (kc, T::MR.min(mc - ir)),
                        (a.offset(at(ic + ir, pc)), (a_rs, a_cs)),
                        (ap.add(ir * kc), ic + ir, pc),
                    )
                };
            }
            for jc in (0..n).step_by(T::NC) {
                let nc = T::NC.min(n - jc);
                let src = (b.offset(bt(pc, jc)), (b_rs, b_cs));
                unsafe { pack_b::<T>(&fused, (kc, nc), src, bp, (pc, jc)) };
                unsafe {
                    let cp = c.offset(ic as isize * c_rs + jc as isize);
                    let bias = fused.bias_at(jc);
                    tiles::<T>(kc, (ap, bp), (cp, c_rs), (mc, nc), (scale, bias), acc);
                }
            }
        }
    }
}

/// The `mc × nc` block of `c` at `c` from packed panels: `ap` holds `mc` rows in `MR`-row
/// panels, `bp` `nc` columns in `NR`-column panels, both `kc` deep. `bias` (null for none)
/// holds the block's `nc` columns' biases, added where `c` is not accumulated into.
///
/// # Safety
/// As [`Tile::kernel`], for every tile of the block.
unsafe fn tiles<T: Tile>(
    kc: usize,
    (ap, bp): (*const f32, *const f32),
    (c, c_rs): (*mut f32, isize),
    (mc, nc): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    for ir in (0..mc).step_by(T::MR) {
        for jr in (0..nc).step_by(T::NR) {
            // SAFETY: the panels hold `kc` packed rows each and the tile lies inside `c` (and
            // its biases inside `bias`), as the caller vouched.
            unsafe {
                let bias = if bias.is_null() { bias } else { bias.add(jr) };
                T::kernel(
                    kc,
                    (ap.add(ir * kc), bp.add(jr * kc)),
                    (c.offset(ir as isize * c_rs + jr as isize), c_rs),
                    (T::MR.min(mc - ir), T::NR.min(nc - jr)),
                    (scale, bias),
                    accumulate,
                )
            };
        }
    }
}

/// [`Tile::pack_a`] with `fused`'s prologue, or where `fused` holds a bf16 `a`, the same panel
/// widened from its bits (then the prologue); `panel`: where it goes, and its first element
/// `(i0, p0)` in the whole `a`.
///
/// # Safety
/// As [`Tile::pack_a`] (a bf16 `a`'s pointer is not read; its bits cover the product).
#[inline(always)]
unsafe fn pack_a<T: Tile>(
    fused: &Fused<'_>,
    (kc, mr): (usize, usize),
    (a, strides): (*const f32, (isize, isize)),
    panel: (*mut f32, usize, usize),
) {
    // SAFETY: as the caller vouched.
    unsafe {
        match &fused.half_a {
            None => T::pack_a(kc, mr, a, strides, panel, fused.prologue),
            Some(h) => T::pack_a_half(h, (kc, mr), panel, fused.prologue),
        }
        T::finish_a(kc, panel.0);
    }
}

/// [`Tile::pack_b`], or where `fused` holds a quantized `b`, the same panels decoded from its
/// codes; `(p0, j0)`: the block's first element in the whole `b`.
///
/// # Safety
/// As [`Tile::pack_b`] (a quantized `b`'s pointer is not read; its codes cover the product).
#[inline(always)]
unsafe fn pack_b<T: Tile>(
    fused: &Fused<'_>,
    (kc, nc): (usize, usize),
    (b, strides): (*const f32, (isize, isize)),
    out: *mut f32,
    at: (usize, usize),
) {
    // SAFETY: as the caller vouched.
    unsafe {
        match &fused.quant_b {
            None => T::pack_b(kc, nc, b, strides, out),
            Some(q) => {
                if !q
                    .bf16_rows(at)
                    .is_some_and(|rows| T::pack_b_bf16(kc, nc, rows, out))
                {
                    q.pack_b(T::NR, (kc, nc), at, out);
                    T::finish_b(kc, nc, out);
                }
            }
        }
    }
}

/// The prologue over one packed panel of `MR` rows (`panel[p·MR + i]` holds `a[i0 + i, p0 +
/// p]`), rows past `mr` left as they are. Loops over whole `MR`-float columns where it can, so
/// they vectorise; inlined into each tile's `pack_a`, it is compiled for that instruction set.
#[inline(always)]
pub(super) fn apply_prologue<const MR: usize>(
    prologue: Prologue<'_>,
    panel: &mut [f32],
    mr: usize,
    (i0, p0): (usize, usize),
) {
    match prologue {
        Prologue::None => {}
        // Padded rows hold zeros, and GELU(0) = 0. One loop per variant, each vectorised; plain
        // `for` loops, since `Iterator::for_each` is a function of its own that the inliner
        // left uninlined, compiled for the baseline.
        Prologue::Gelu(GeluApprox::Tanh) => {
            for x in panel.iter_mut() {
                *x = gelu(GeluApprox::Tanh, *x);
            }
        }
        Prologue::Gelu(GeluApprox::Exact) => {
            for x in panel.iter_mut() {
                *x = gelu(GeluApprox::Exact, *x);
            }
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

/// A tile's [`Tile::pack_a_half`]: the bf16 panel widened as it is packed, then the prologue;
/// inlined into each tile's function, so it is compiled for that instruction set.
///
/// # Safety
/// As [`Tile::pack_a_half`].
#[inline(always)]
pub(super) unsafe fn pack_a_half_panel<const MR: usize>(
    half: &super::half::HalfA<'_>,
    (kc, mr): (usize, usize),
    (out, i0, p0): (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    // SAFETY: the panel holds `MR · kc` floats and the rows and columns lie inside the bits,
    // as the caller vouched.
    unsafe {
        half.pack_a(MR, (kc, mr), (i0, p0), out);
        if !matches!(prologue, Prologue::None) {
            let panel = std::slice::from_raw_parts_mut(out, kc * MR);
            apply_prologue::<MR>(prologue, panel, mr, (i0, p0));
        }
    }
}

/// Packs `kc` columns of up to `MR` rows of `a` element by element (any strides), zero rows
/// past `mr`: the path for edges and strides a tile's vector packing does not cover.
///
/// # Safety
/// As [`Tile::pack_a`].
#[inline(always)]
pub(super) unsafe fn pack_a_any<const MR: usize>(
    kc: usize,
    mr: usize,
    a: *const f32,
    (rs, cs): (isize, isize),
    out: *mut f32,
) {
    for p in 0..kc {
        for i in 0..MR {
            // SAFETY: row `i < mr` and column `p < kc` of `a`; the panel holds `MR · kc`.
            unsafe {
                *out.add(p * MR + i) = if i < mr {
                    *a.offset(i as isize * rs + p as isize * cs)
                } else {
                    0.0
                };
            }
        }
    }
}

/// Packs `kc` rows of `nr ≤ NR` columns of `b` element by element (any strides) as one panel,
/// zero columns past `nr`: the path for edges and strides a tile's vector packing does not
/// cover.
///
/// # Safety
/// `b` must be valid for `kc` rows and `nr` columns at its strides, `out` for `NR · kc`.
#[inline(always)]
pub(super) unsafe fn pack_b_any<const NR: usize>(
    kc: usize,
    nr: usize,
    b: *const f32,
    (rs, cs): (isize, isize),
    out: *mut f32,
) {
    for l in 0..NR {
        for p in 0..kc {
            // SAFETY: column `l < nr` and row `p < kc` of `b`; the panel holds `NR · kc`.
            unsafe {
                *out.add(p * NR + l) = if l < nr {
                    *b.offset(l as isize * cs + p as isize * rs)
                } else {
                    0.0
                };
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::gemm::test_support::{assert_product, values};

    /// Runs `check::<T>()` for every tile this CPU has, and says which it skipped.
    macro_rules! for_each_tile {
        ($check:ident) => {{
            #[cfg(target_arch = "x86_64")]
            {
                use super::super::{avx2::Avx2, avx512::Avx512};
                if Avx512::available() {
                    $check::<Avx512>("avx512");
                } else {
                    eprintln!("skipped the AVX-512 tile: this CPU has no AVX-512F");
                }
                if Avx2::available() {
                    $check::<Avx2>("avx2");
                } else {
                    eprintln!("skipped the AVX2 tile: this CPU has no AVX2 and FMA");
                }
            }
        }};
    }

    /// [`for_each_tile`], then the tiles that round their panels to bf16: the modelled ones
    /// (`SNUG_BF16_MATH=model`) and AVX512-BF16's, where this CPU runs them. For the checks
    /// that compare two ways of running one tile bitwise, which hold for these too.
    macro_rules! for_each_tile_and_bf16 {
        ($check:ident) => {{
            for_each_tile!($check);
            #[cfg(target_arch = "x86_64")]
            {
                use super::super::avx512bf16::Avx512Bf16;
                use super::super::bf16_model::Rounded;
                use super::super::{avx2::Avx2, avx512::Avx512};
                if Avx512::available() {
                    $check::<Rounded<Avx512>>("avx512, modelled bf16");
                }
                if Avx2::available() {
                    $check::<Rounded<Avx2>>("avx2, modelled bf16");
                }
                if Avx512Bf16::available() {
                    use super::super::amx::{Amx, Hardware, Modelled};
                    $check::<Avx512Bf16>("avx512bf16");
                    $check::<Amx<Modelled>>("amx, modelled tiles");
                    if super::super::amx::usable() {
                        $check::<Amx<Hardware>>("amx");
                    }
                } else {
                    eprintln!(
                        "skipped the AVX512-BF16 tile and AMX's (modelled): this CPU has no \
                         AVX512-BF16"
                    );
                }
            }
        }};
    }

    /// With one of a pool's two workers held (the test holds it until the deal is over, as
    /// another process on its core would), a deal on the other covers every range alone and
    /// returns: it does not wait for the held worker (a broadcast waited until the hold
    /// timed out).
    #[test]
    fn a_deal_does_not_wait_for_a_busy_worker() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::mpsc;
        use std::time::Duration;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        let (started, is_busy) = mpsc::channel();
        let (release, wait) = mpsc::channel::<()>();
        let (outcome, freed) = mpsc::channel();
        // One worker held, as a core another process has taken holds it.
        pool.spawn(move || {
            started.send(()).expect("the test waits");
            outcome
                .send(wait.recv_timeout(Duration::from_secs(20)).is_ok())
                .expect("the test waits");
        });
        is_busy.recv().expect("the worker started");
        let covered = AtomicUsize::new(0);
        pool.install(|| {
            deal_ranges(1000, 4, (4, 64), |i0, i1| {
                covered.fetch_add(i1 - i0, Ordering::Relaxed);
            })
        });
        release.send(()).expect("the held worker waits");
        assert_eq!(
            covered.load(Ordering::Relaxed),
            1000,
            "every range dealt once"
        );
        assert!(
            freed.recv().expect("the held worker reports"),
            "the deal waited for the held worker until it timed out"
        );
    }

    /// Threads dealing rows or columns compute bitwise what one thread computes, in every
    /// layout, with partial chunks, several `k` blocks, and shared blocks past `SHARED` in
    /// both directions; also on a pool of three, where chunks do not divide evenly.
    #[test]
    fn dealing_work_to_threads_changes_no_bit() {
        fn check<T: Tile>(tile: &str) {
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
                                sgemm_threaded::<T>(
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
                            sgemm::<T>(
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
                            "{tile}: {m}×{k}×{n} ta={ta} tb={tb} on {threads} threads"
                        );
                        assert_ne!(one, start, "{tile}: {m}×{k}×{n}: the product was not added");
                    }
                }
            }
        }
        for_each_tile_and_bf16!(check);
    }

    /// A prologue made while packing, and a bias added while storing, give bitwise the product
    /// of the materialised `f(op(a))` with `c` filled with the bias first: on one thread and
    /// dealt (rows and columns), in both LayerNorm orientations, past `KC` and `MC`, with
    /// partial panels.
    #[test]
    fn fused_prologue_and_bias_are_bitwise_the_materialised_product() {
        fn check<T: Tile>(tile: &str) {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            for (m, n, k) in [(803, 70, 530), (45, 500, 390), (9, 20, 7)] {
                for ta in [false, true] {
                    let (a, b) = (values(m * k, 7), values(k * n, 8));
                    let bias = values(n, 9);
                    // Tokens run along op(a)'s rows, or (a weight gradient's xᵀ) along its
                    // columns.
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
                        let mut want: Vec<f32> =
                            (0..m).flat_map(|_| bias.iter().copied()).collect();
                        let ptr = |c: &mut Vec<f32>| (c.as_mut_ptr(), n as isize);
                        let b_op = (b.as_ptr(), n as isize, 1);
                        // SAFETY (all three): the CPU was checked; the strides stay inside the
                        // vectors; the statistics and weights cover op(a).
                        let done = unsafe {
                            sgemm::<T>(
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
                            ..Fused::NONE
                        };
                        let a_op = (a.as_ptr(), a_rs, a_cs);
                        let (mut one, mut dealt) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                        let one_done = unsafe {
                            sgemm::<T>((m, n, k), ptr(&mut one), a_op, b_op, 1.0, false, fused)
                        };
                        let dealt_done = pool.install(|| unsafe {
                            let (a_op, b_op) =
                                ((a.as_ptr(), a_rs, a_cs), (b.as_ptr(), n as isize, 1));
                            let c = ptr(&mut dealt);
                            sgemm_threaded::<T>((m, n, k), c, a_op, b_op, 1.0, false, fused)
                        });
                        assert!(done && one_done && dealt_done);
                        for (what, got) in [("one thread", &one), ("dealt", &dealt)] {
                            assert!(
                                got.iter()
                                    .zip(&want)
                                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                                "{tile}: {m}×{k}×{n} ta={ta} {name} on {what}"
                            );
                        }
                    }
                }
            }
        }
        for_each_tile_and_bf16!(check);
    }

    /// Every layout the step uses, and shapes that leave partial tiles and blocks in each
    /// dimension (m past `MC` and not a multiple of the tile's rows, n past `NC` and not of its
    /// columns, k past `KC` and not of 16), against a plain triple loop in f64.
    #[test]
    fn matches_a_triple_loop_in_every_layout_and_at_every_edge() {
        fn check<T: Tile>(tile: &str) {
            let shapes = [
                (1, 1, 1),
                (7, 5, 3),
                (8, 48, 16),
                (13, 50, 17),
                (790, 203, 401),
                (9, 97, 800),
                (20, 61, 35),
                (6, 16, 9),
                (1000, 300, 260),
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
                            sgemm::<T>(
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
                        let at = |x: &[f32], (rs, cs): (isize, isize), r: usize, col: usize| {
                            x[(r as isize * rs + col as isize * cs) as usize]
                        };
                        assert_product(
                            (m, n, k),
                            (
                                |i, p| at(&a, (a_rs, a_cs), i, p),
                                |p, j| at(&b, (b_rs, b_cs), p, j),
                            ),
                            (scale, accumulate),
                            (&start, &c),
                            1e-5 * (k as f64).sqrt() + 1e-6,
                            &format!("{tile}: {m}×{k}×{n} ta={ta} tb={tb} scale={scale}"),
                        );
                    }
                }
            }
        }
        for_each_tile!(check);
    }

    /// The AVX-512 tile where this CPU has no AVX-512: the triple-loop check above, each
    /// product run on an emulated Tiger Lake core (`snug_testkit::emulate`), with partial
    /// tiles, several depth and row blocks, every layout, scaling and accumulating.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_avx512_tile_matches_a_triple_loop_on_an_emulated_core() {
        use snug_testkit::emulate::Model;

        use super::super::avx512::Avx512;
        use super::super::test_support::{run_on, EmuJob};

        if Avx512::available() {
            return; // run natively by the test above
        }
        struct Case {
            dims: (usize, usize, usize),
            a: (Vec<f32>, isize, isize),
            b: (Vec<f32>, isize, isize),
            scale_acc: (f32, bool),
            start: Vec<f32>,
            c: Vec<f32>,
            done: bool,
        }
        struct Cases(Vec<Case>);
        /// Every case on the tile, one thread, nothing allocated.
        impl EmuJob for Cases {
            unsafe fn run(&mut self) {
                for case in self.0.iter_mut() {
                    let ((a, a_rs, a_cs), (b, b_rs, b_cs)) = (&case.a, &case.b);
                    // SAFETY: the (emulated) CPU has AVX-512F; the strides stay inside the vectors.
                    case.done = unsafe {
                        sgemm::<Avx512>(
                            case.dims,
                            (case.c.as_mut_ptr(), case.dims.1 as isize),
                            (a.as_ptr(), *a_rs, *a_cs),
                            (b.as_ptr(), *b_rs, *b_cs),
                            case.scale_acc.0,
                            case.scale_acc.1,
                            Fused::NONE,
                        )
                    };
                }
            }
        }
        let shapes = [
            (7, 5, 3),
            (13, 50, 17),
            (790, 203, 401),
            (9, 97, 800),
            (6, 16, 9),
        ];
        let mut cases = Vec::new();
        for (m, n, k) in shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for scale_acc in [(1.0f32, false), (0.5, true)] {
                    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
                    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
                    let start = values(m * n, 3);
                    cases.push(Case {
                        dims: (m, n, k),
                        a: (values(m * k, 1), a_rs, a_cs),
                        b: (values(k * n, 2), b_rs, b_cs),
                        scale_acc,
                        c: start.clone(),
                        start,
                        done: false,
                    });
                }
            }
        }
        reserve_pack::<Avx512>();
        let mut job = Cases(cases);
        // SAFETY: the job makes no system call (its packing space is reserved) and touches
        // only its cases.
        if !unsafe { run_on(false, Model::TigerLake, &mut job) } {
            return;
        }
        for case in &job.0 {
            let (m, n, k) = case.dims;
            let ((a, a_rs, a_cs), (b, b_rs, b_cs)) = (&case.a, &case.b);
            let at = |x: &[f32], (rs, cs): (isize, isize), r: usize, col: usize| {
                x[(r as isize * rs + col as isize * cs) as usize]
            };
            let label =
                format!("avx512 (emulated): {m}×{k}×{n} strides {a_rs},{a_cs} {b_rs},{b_cs}");
            assert!(case.done, "{label}: did not run");
            assert_product(
                (m, n, k),
                (
                    |i, p| at(a, (*a_rs, *a_cs), i, p),
                    |p, j| at(b, (*b_rs, *b_cs), p, j),
                ),
                case.scale_acc,
                (&case.start, &case.c),
                1e-5 * (k as f64).sqrt() + 1e-6,
                &label,
            );
        }
    }
}
