//! The AMX tile for our GEMM ([`blocked`](super::blocked)): bf16 arithmetic with f32
//! accumulation on Intel's matrix tiles (`TDPBF16PS`, Sapphire Rapids and later Xeons), for
//! the products AVX512-BF16's tile ([`super::avx512bf16`]) runs on CPUs without them.
//!
//! A 32 × 32 block of `c` is four 16 × 16 f32 tiles. Each step down the depth loads two `a`
//! tiles (16 rows of 32 bf16 values) and two `b` tiles (16 pairs of rows of 16 columns) and
//! issues four `TDPBF16PS` of 8,192 multiply-adds each. The blocking (`KC`, `MC`, `NC`) is the
//! AVX-512 tile's, so the plan and the packing space are the same as there.
//!
//! Panels. `b`'s are AVX512-BF16's pairs of rows, 32 columns wide: row `q` holds the pairs
//! `(b[2q][j], b[2q + 1][j])`, 128 bytes, which is what a `b` tile reads (16 columns of it,
//! rows 128 bytes apart). `a`'s are packed in f32 as the other tiles pack them (with the
//! prologue), rounded into pairs along the depth, then each block of 16 pairs is transposed so
//! that a row's pairs lie together, as an `a` tile reads them. A depth that is not a multiple
//! of 32 leaves a last, shorter block: the kernel multiplies it under a second tile
//! configuration, so no panel is padded past the space the other tiles use.
//!
//! The tile instructions sit behind [`TileUnit`]: [`Hardware`] issues them (inline assembly;
//! stable Rust has no AMX intrinsics) and the tests' `Modelled` computes what the Intrinsics Guide's pseudo-code for
//! each one says. The packing, blocking and configurations are tested through the model on
//! CPUs without AMX (none of this project's test machines has it, nor does the emulator the
//! other tiles' tests use), and a process checks the hardware against an f64 product before
//! its first product on the tiles ([`usable`]), falling back to AVX512-BF16 if they disagree.

use std::arch::x86_64::*;
use std::cell::Cell;
#[cfg(test)]
use std::cell::RefCell;
use std::marker::PhantomData;

use super::avx512bf16::{finish_b_pairs, pack_b_bf16_pairs, pack_b_pairs, to_pairs};
use super::blocked::{apply_prologue, pack_a_any, pack_a_half_panel, Tile};
use super::fused::{Fused, Prologue};

/// Rows of `c` one kernel call computes: two tiles of 16.
pub(super) const MR: usize = 32;
/// Columns of `c` one kernel call computes: two tiles of 16.
pub(super) const NR: usize = 32;
/// Pairs of depth a whole block holds: an `a` tile row's 64 bytes.
const PAIRS: usize = 16;
/// Bytes of one block of an `a` panel: `MR` rows of `PAIRS` pairs.
const A_BLOCK: usize = MR * PAIRS * 4;
/// Bytes of a row of pairs of a `b` panel, and of a row of the kernel's f32 block of `c`.
const ROW: usize = NR * 4;

/// The tile instructions the kernel issues, on this thread's tile registers. The kernel uses
/// tiles 0–3 for `c` (16 rows of 16 f32 each), 4 and 5 for `a` (16 rows of `pairs` pairs) and
/// 6 and 7 for `b` (`pairs` rows of 16 pairs), as [`Config`] lays them out.
///
/// # Safety
/// Every method needs a CPU with AMX-TILE and AMX-BF16 whose tile data this process may use
/// ([`Hardware`]), and every method but `configure` a configuration loaded on this thread.
pub(crate) trait TileUnit {
    /// Whether the tiles run here.
    fn available() -> bool;
    /// Makes the configuration for `pairs` pairs of depth (1–16) this thread's, unless this
    /// thread loaded it since its last [`TileUnit::release`]; loading one zeroes every tile.
    unsafe fn configure(pairs: usize);
    /// `TILERELEASE`: the tiles and their configuration back to their initial state.
    unsafe fn release();
    unsafe fn zero<const T: u8>();
    /// Loads tile `T`'s rows from `src`, `stride` bytes apart.
    unsafe fn load<const T: u8>(src: *const u8, stride: usize);
    /// Stores tile `T`'s rows to `dst`, `stride` bytes apart.
    unsafe fn store<const T: u8>(dst: *mut u8, stride: usize);
    /// `TDPBF16PS`: tile `C` += tile `A` · tile `B`, pairs of bf16 products summed in f32.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>();
}

/// A tile configuration (`LDTILECFG`'s 64 bytes, palette 1): tiles 0–3 hold 16 rows of 64
/// bytes (16 f32), 4 and 5 hold 16 rows of `4 · pairs` bytes, 6 and 7 `pairs` rows of 64.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Config([u8; 64]);

impl Config {
    const fn new(pairs: usize) -> Config {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        let mut t = 0;
        while t < 8 {
            let (rows, colsb) = match t {
                0..=3 => (16, 64),
                4 | 5 => (16, 4 * pairs),
                _ => (pairs, 64),
            };
            bytes[16 + 2 * t] = colsb as u8;
            bytes[17 + 2 * t] = (colsb >> 8) as u8;
            bytes[48 + t] = rows as u8;
            t += 1;
        }
        Config(bytes)
    }

    #[cfg(test)]
    fn rows(&self, t: usize) -> usize {
        usize::from(self.0[48 + t])
    }

    #[cfg(test)]
    fn colsb(&self, t: usize) -> usize {
        usize::from(u16::from_le_bytes([self.0[16 + 2 * t], self.0[17 + 2 * t]]))
    }
}

/// The CPU's own tiles. Each instruction is its own `asm!` block, and the tiles carry the
/// kernel's state from one block to the next without being declared: the compiler allocates
/// tile registers only for AMX intrinsics, which nothing in this crate uses, so between these
/// blocks nothing else touches them.
pub(crate) struct Hardware;

thread_local! {
    /// The depth in pairs of the configuration this thread loaded since its last release (0:
    /// none). Tile state is the thread's own, which the OS saves and restores, but the ABI
    /// makes it caller-saved: other code on the thread may change it between products. So it
    /// is trusted only within a stretch of our kernel calls, each of which ends in a release
    /// ([`Tile::done`]), which also leaves no tile data for the OS to save meanwhile.
    static LOADED: Cell<u8> = const { Cell::new(0) };
}

impl TileUnit for Hardware {
    fn available() -> bool {
        usable()
    }

    unsafe fn configure(pairs: usize) {
        LOADED.with(|loaded| {
            if usize::from(loaded.get()) != pairs {
                let cfg = Config::new(pairs);
                // SAFETY: the CPU has AMX, as the caller vouched; the configuration is valid.
                unsafe {
                    std::arch::asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly))
                };
                loaded.set(pairs as u8);
            }
        })
    }

    unsafe fn release() {
        // SAFETY: as the caller vouched.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
        LOADED.with(|loaded| loaded.set(0));
    }

    unsafe fn zero<const T: u8>() {
        // SAFETY: as the caller vouched.
        unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }

    unsafe fn load<const T: u8>(src: *const u8, stride: usize) {
        // SAFETY: as the caller vouched: the configured rows and bytes lie inside `src`.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm{t}, [{p} + {s} * 1]",
                t = const T,
                p = in(reg) src,
                s = in(reg) stride,
                options(nostack, readonly)
            )
        }
    }

    unsafe fn store<const T: u8>(dst: *mut u8, stride: usize) {
        // SAFETY: as the caller vouched: the configured rows and bytes lie inside `dst`.
        unsafe {
            std::arch::asm!(
                "tilestored [{p} + {s} * 1], tmm{t}",
                t = const T,
                p = in(reg) dst,
                s = in(reg) stride,
                options(nostack)
            )
        }
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
        // SAFETY: as the caller vouched.
        unsafe {
            std::arch::asm!(
                "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
                c = const C,
                a = const A,
                b = const B,
                options(nostack, nomem)
            )
        }
    }
}

/// The tiles as the Intrinsics Guide's pseudo-code defines them, in plain Rust on this
/// thread's copy: for testing everything but the instructions themselves on CPUs without AMX.
/// (The SDM's pseudo-code for `TDPBF16PS` sums a pair's two products before adding them to
/// `c`, which can differ in the last bit: the tests compare with f64 within f32 summation
/// error, so either order passes them, as the hardware's must.)
#[cfg(test)]
pub(crate) struct Modelled;

/// A thread's modelled tile registers: 8 tiles of 16 rows of 16 words, and the configuration.
#[cfg(test)]
struct TileFile {
    config: Option<Config>,
    tiles: [[[u32; 16]; 16]; 8],
}

#[cfg(test)]
thread_local! {
    static MODEL: RefCell<TileFile> = const {
        RefCell::new(TileFile {
            config: None,
            tiles: [[[0; 16]; 16]; 8],
        })
    };
}

#[cfg(test)]
impl TileFile {
    fn config(&self) -> Config {
        self.config
            .expect("a tile instruction before any configuration (#UD)")
    }
}

/// A bf16 value as f32, a subnormal as zero (`TDPBF16PS` takes them as zero).
#[cfg(test)]
fn bf16_daz(h: u32) -> f32 {
    let v = f32::from_bits(h << 16);
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// An f32 result, a subnormal flushed to zero.
#[cfg(test)]
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

#[cfg(test)]
impl TileUnit for Modelled {
    fn available() -> bool {
        // The packing around the tiles uses AVX512-BF16, which every AMX CPU has.
        crate::isa::CpuFeatures::host().bf16_arithmetic()
    }

    unsafe fn configure(pairs: usize) {
        MODEL.with(|m| {
            let mut m = m.borrow_mut();
            let cfg = Config::new(pairs);
            if m.config != Some(cfg) {
                *m = TileFile {
                    config: Some(cfg),
                    tiles: [[[0; 16]; 16]; 8],
                };
            }
        })
    }

    unsafe fn release() {
        MODEL.with(|m| {
            *m.borrow_mut() = TileFile {
                config: None,
                tiles: [[[0; 16]; 16]; 8],
            }
        });
    }

    unsafe fn zero<const T: u8>() {
        MODEL.with(|m| m.borrow_mut().tiles[usize::from(T)] = [[0; 16]; 16]);
    }

    unsafe fn load<const T: u8>(src: *const u8, stride: usize) {
        MODEL.with(|m| {
            let mut m = m.borrow_mut();
            let cfg = m.config();
            let t = usize::from(T);
            let (rows, words) = (cfg.rows(t), cfg.colsb(t) / 4);
            m.tiles[t] = [[0; 16]; 16];
            for r in 0..rows {
                for w in 0..words {
                    // SAFETY: the configured rows and bytes lie inside `src`, as the caller
                    // vouched.
                    let word =
                        unsafe { (src.add(r * stride + 4 * w) as *const u32).read_unaligned() };
                    m.tiles[t][r][w] = word;
                }
            }
        })
    }

    unsafe fn store<const T: u8>(dst: *mut u8, stride: usize) {
        MODEL.with(|m| {
            let m = m.borrow();
            let cfg = m.config();
            let t = usize::from(T);
            for r in 0..cfg.rows(t) {
                for w in 0..cfg.colsb(t) / 4 {
                    // SAFETY: the configured rows and bytes lie inside `dst`, as the caller
                    // vouched.
                    unsafe {
                        (dst.add(r * stride + 4 * w) as *mut u32).write_unaligned(m.tiles[t][r][w])
                    };
                }
            }
        })
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
        MODEL.with(|m| {
            let mut m = m.borrow_mut();
            let cfg = m.config();
            let (c, a, b) = (usize::from(C), usize::from(A), usize::from(B));
            // The shapes the instruction requires, else it faults.
            assert!(
                cfg.rows(c) == cfg.rows(a)
                    && cfg.colsb(c) == cfg.colsb(b)
                    && cfg.colsb(a) == 4 * cfg.rows(b),
                "TDPBF16PS on tiles of mismatched shapes (#UD)"
            );
            let (a_t, b_t) = (m.tiles[a], m.tiles[b]);
            let (rows, depth, cols) = (cfg.rows(c), cfg.colsb(a) / 4, cfg.colsb(c) / 4);
            for (a_row, c_row) in a_t.iter().zip(m.tiles[c].iter_mut()).take(rows) {
                for (&pair, b_row) in a_row.iter().zip(&b_t).take(depth) {
                    for (acc, &other) in c_row.iter_mut().zip(b_row).take(cols) {
                        let mut tmp = f32::from_bits(*acc);
                        tmp = ftz(tmp + bf16_daz(pair & 0xffff) * bf16_daz(other & 0xffff));
                        tmp = ftz(tmp + bf16_daz(pair >> 16) * bf16_daz(other >> 16));
                        *acc = tmp.to_bits();
                    }
                }
            }
        })
    }
}

/// Whether this process runs products on the CPU's AMX tiles: the CPU has AMX-TILE, AMX-BF16
/// and AVX512-BF16, the OS manages tile state and grants this process its use (Linux's
/// `ARCH_REQ_XCOMP_PERM`), and the tiles agree with an f64 product on a check that covers
/// partial tiles and a short last depth block. Found once per process, the first time it is
/// asked, and only under `SNUG_BF16_MATH=native` (the default); a disagreement is reported on
/// standard error and the products run on AVX512-BF16.
pub(crate) fn usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        // Under any other setting the tiles are never touched, not even checked: the way out
        // should a CPU or hypervisor list AMX and fault on it.
        if crate::isa::Bf16Math::current() != crate::isa::Bf16Math::Native {
            return false;
        }
        if !(has_tiles() && permitted()) {
            return false;
        }
        let agrees = agrees::<Hardware>();
        if !agrees {
            eprintln!(
                "snug: this CPU's AMX tiles disagree with an f64 product on a check; bf16 \
                 products run on AVX512-BF16 instead"
            );
        }
        agrees
    })
}

/// CPUID's AMX-TILE and AMX-BF16, AVX512-BF16 (the packing's), and the OS enabling tile state
/// in XCR0.
fn has_tiles() -> bool {
    // CPUID leaf 7 is read only where leaf 0 lists it.
    let max = __cpuid(0).eax;
    let leaf1 = __cpuid(1);
    let leaf7 = if max >= 7 { __cpuid_count(7, 0).edx } else { 0 };
    let xcr0 = || {
        // SAFETY: only called where CPUID says OSXSAVE, under which XGETBV runs.
        unsafe { xgetbv0() }
    };
    // Not through `CpuFeatures::host`, whose `amx` is what this finds (a re-entrant call of
    // `usable`'s initialisation would wait on itself).
    let packing = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16");
    packing && tiles_listed((max, leaf1.ecx, leaf7), xcr0)
}

/// Whether CPUID (`max` leaf, leaf 1's ECX, leaf 7's EDX) lists AMX-BF16 (bit 22) and
/// AMX-TILE (bit 24) and OSXSAVE (bit 27), and the OS enables tile state in XCR0 (XTILECFG,
/// bit 17, and XTILEDATA, bit 18); `xcr0` is read only where OSXSAVE is listed.
fn tiles_listed((max, leaf1_ecx, leaf7_edx): (u32, u32, u32), xcr0: impl FnOnce() -> u64) -> bool {
    let bit = |word: u32, at: u32| word >> at & 1 == 1;
    let listed = max >= 0xd && bit(leaf7_edx, 22) && bit(leaf7_edx, 24) && bit(leaf1_ecx, 27);
    listed && xcr0() >> 17 & 0b11 == 0b11
}

/// # Safety
/// The CPU must have XSAVE with OSXSAVE set.
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    _xgetbv(0)
}

/// Asks the OS for this process's use of tile data: Linux enables it per process, on request.
#[cfg(target_os = "linux")]
fn permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: the request takes two integers and changes only what this process may use.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// Elsewhere the tiles are not used: their permission is not something we can check here.
#[cfg(not(target_os = "linux"))]
fn permitted() -> bool {
    false
}

/// Whether `Amx<U>` computes a 40 × 50 product 90 deep (two whole depth blocks and a short
/// one, a whole and a partial tile each way) onto a bias, then adds it twice more, scaled and
/// unscaled (so every way a tile starts and ends: from zero, from the bias, from `c`), within
/// f32 summation error of the f64 product of the bf16-rounded operands.
pub(crate) fn agrees<U: TileUnit>() -> bool {
    use super::half::round_to_bf16;
    let (m, n, k) = (40, 50, 90);
    let value = |i: usize, salt: usize| ((i * 37 + salt * 11) % 101) as f32 / 50.0 - 1.0;
    let a: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
    let b: Vec<f32> = (0..k * n).map(|i| value(i, 2)).collect();
    let bias: Vec<f32> = (0..n).map(|j| value(j, 3)).collect();
    let mut c = vec![f32::NAN; m * n];
    let biased = Fused {
        bias: Some(&bias),
        ..Fused::NONE
    };
    let runs = [
        (1.0f32, false, biased),
        (0.75, true, Fused::NONE),
        (1.0, true, Fused::NONE),
    ];
    let scale: f32 = runs.iter().map(|r| r.0).sum();
    for (s, accumulate, fused) in runs {
        // SAFETY: the tiles run here (checked by the caller for the hardware; the model runs
        // anywhere AVX512-BF16 does); the operands cover the product.
        unsafe {
            super::blocked::sgemm_alone::<Amx<U>>(
                (m, n, k),
                (c.as_mut_ptr(), n as isize),
                (a.as_ptr(), k as isize, 1),
                (b.as_ptr(), n as isize, 1),
                s,
                accumulate,
                fused,
            )
        };
    }
    (0..m).all(|i| {
        (0..n).all(|j| {
            let terms = (0..k).map(|p| {
                f64::from(round_to_bf16(a[i * k + p])) * f64::from(round_to_bf16(b[p * n + j]))
            });
            let bound = f64::from(scale) * terms.clone().map(f64::abs).sum::<f64>();
            let want = f64::from(scale) * terms.sum::<f64>() + f64::from(bias[j]);
            let tol =
                3.0 * (k + 2) as f64 * f64::from(f32::EPSILON) * (bound + f64::from(bias[j]).abs());
            (f64::from(c[i * n + j]) - want).abs() <= tol
        })
    })
}

/// The 32 × 32 tile on unit `U`'s tiles.
pub(crate) struct Amx<U>(PhantomData<U>);

impl<U: TileUnit> Tile for Amx<U> {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = <super::avx512::Avx512 as Tile>::KC;
    const MC: usize = <super::avx512::Avx512 as Tile>::MC;
    const NC: usize = <super::avx512::Avx512 as Tile>::NC;

    fn available() -> bool {
        U::available()
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
        unsafe { pack_b_pairs::<NR>(kc, nc, b, strides, out) }
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

    unsafe fn finish_b(kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: as the caller vouched.
        unsafe { finish_b_pairs::<NR>(kc, nc, out) }
    }

    unsafe fn pack_b_bf16(kc: usize, nc: usize, rows: (&[u16], usize), out: *mut f32) -> bool {
        // SAFETY: as the caller vouched.
        unsafe { pack_b_bf16_pairs::<NR>(kc, nc, rows, out) }
    }

    unsafe fn done() {
        // SAFETY: as the caller vouched.
        unsafe { U::release() }
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
        unsafe { kernel::<U>(kc, panels, c, tile, scale_bias, accumulate) }
    }
}

/// Packs `kc` columns of up to 32 rows of `a` in f32 (`out[p·32 + i]`, rows past `mr` zero),
/// applies the prologue, then lays the panel out in bf16 blocks ([`to_blocks`]).
///
/// # Safety
/// As [`Tile::pack_a`]; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_a(
    kc: usize,
    mr: usize,
    a: *const f32,
    (rs, cs): (isize, isize),
    (out, i0, p0): (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    // SAFETY (all blocks): reads stay within `mr` rows and `kc` columns of `a`; writes within
    // the panel's `32·kc` floats.
    unsafe {
        if cs == 1 && matches!(prologue, Prologue::None) {
            // Rows along the depth, as an `a` tile reads them: straight to blocks.
            return rows_to_blocks(kc, mr, out, |i, p, live| {
                let src = a.offset(i as isize * rs).add(p);
                let lo = _mm512_maskz_loadu_ps(live as __mmask16, src);
                let hi = _mm512_maskz_loadu_ps((live >> 16) as __mmask16, src.add(16));
                let (lo, hi) = (bits16(lo), bits16(hi));
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
            });
        }
        if mr == MR && rs == 1 {
            // `a` read transposed (a weight gradient): each column's rows are contiguous.
            for p in 0..kc {
                let (src, dst) = (a.offset(p as isize * cs), out.add(p * MR));
                _mm512_storeu_ps(dst, _mm512_loadu_ps(src));
                _mm512_storeu_ps(dst.add(16), _mm512_loadu_ps(src.add(16)));
            }
        } else if cs == 1 && rs > 0 {
            if mr < MR {
                std::ptr::write_bytes(out, 0, MR * kc);
            }
            super::avx512::transpose((a, rs as usize), (mr, kc), (out, MR));
        } else {
            pack_a_any::<MR>(kc, mr, a, (rs, cs), out);
        }
        if !matches!(prologue, Prologue::None) {
            let panel = std::slice::from_raw_parts_mut(out, kc * MR);
            apply_prologue::<MR>(prologue, panel, mr, (i0, p0));
        }
        to_blocks(kc, out);
    }
}

/// [`Tile::pack_a_half`]: widened as the other tiles widen it, then the prologue, then laid
/// out in blocks.
///
/// # Safety
/// As [`Tile::pack_a_half`]; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_a_half(
    half: &super::half::HalfA<'_>,
    dims: (usize, usize),
    panel: (*mut f32, usize, usize),
    prologue: Prologue<'_>,
) {
    let (kc, mr) = dims;
    let (out, i0, p0) = panel;
    // The panel's last element lies inside the bits: every read below is inside them.
    let inside = kc > 0 && mr > 0 && (i0 + mr - 1) * half.rs + p0 + kc - 1 < half.bits.len();
    if half.cs == 1 && inside && matches!(prologue, Prologue::None) {
        // Rows along the depth, already bf16: their bits are an `a` tile's rows.
        let base = half.bits.as_ptr();
        // SAFETY: rows `i < mr` and depths `p + l < kc` (those in `live`) lie inside the bits
        // (checked); the panel holds `32·kc` floats, as the caller vouched.
        return unsafe {
            rows_to_blocks(kc, mr, out, |i, p, live| {
                _mm512_maskz_loadu_epi16(live, base.add((i0 + i) * half.rs + p0 + p) as *const i16)
            })
        };
    }
    let row_wise = match prologue {
        Prologue::LayerNorm { tokens_down, .. } => tokens_down,
        Prologue::Gelu(_) => true,
        Prologue::None => false,
    };
    if half.cs == 1 && inside && row_wise {
        // Rows along the depth, each element made as `apply_prologue` makes it (the same
        // expression, element by element), straight into the blocks: the panel of f32
        // columns, its pairing and its transposes back into rows are left out.
        let base = half.bits.as_ptr();
        // SAFETY: as above; the prologue's statistics and gains cover the panel's rows and
        // depths, as the caller vouched.
        return unsafe {
            rows_to_blocks(kc, mr, out, |i, p, live| {
                let src = base.add((i0 + i) * half.rs + p0 + p) as *const i16;
                let bits = _mm512_maskz_loadu_epi16(live, src);
                let mut x = [0f32; 2 * 16];
                let widen = |h: __m256i| {
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                };
                _mm512_storeu_ps(x.as_mut_ptr(), widen(_mm512_castsi512_si256(bits)));
                _mm512_storeu_ps(
                    x.as_mut_ptr().add(16),
                    widen(_mm512_extracti64x4_epi64::<1>(bits)),
                );
                let len = (kc - p).min(32);
                prologue_row(prologue, &mut x[..len], (i0 + i, p0 + p));
                let lo = bits16(_mm512_loadu_ps(x.as_ptr()));
                let hi = bits16(_mm512_loadu_ps(x.as_ptr().add(16)));
                // Lanes past the depth stay zero, as the panel's padding is.
                _mm512_maskz_mov_epi16(
                    live,
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                )
            })
        };
    }
    // SAFETY: as the caller vouched.
    unsafe {
        pack_a_half_panel::<MR>(half, dims, panel, prologue);
        to_blocks(kc, out);
    }
}

/// A row prologue on `x`, the elements of row `i` of `a` from depth `p` on: token `i`'s
/// LayerNorm over features `p..` (a LayerNorm with tokens down the rows), or GELU, each
/// element by the expression [`apply_prologue`] uses, so bitwise its values.
#[inline(always)]
fn prologue_row(prologue: Prologue<'_>, x: &mut [f32], (i, p): (usize, usize)) {
    match prologue {
        Prologue::None => {}
        Prologue::Gelu(approx) => {
            for v in x.iter_mut() {
                *v = crate::math::gelu(approx, *v);
            }
        }
        Prologue::LayerNorm {
            mean, rstd, w, b, ..
        } => {
            let (m, r) = (mean[i], rstd[i]);
            let (wk, bk) = (&w[p..p + x.len()], &b[p..p + x.len()]);
            for ((v, &wf), &bf) in x.iter_mut().zip(wk).zip(bk) {
                *v = (*v - m) * r * wf + bf;
            }
        }
    }
}

/// An `a` panel of `mr` rows, `kc` deep, laid out in blocks as [`to_blocks`] leaves one,
/// straight from rows: `row(i, p, live)` gives row `i`'s bf16 bits from depth `p`, lanes
/// outside `live` zero and unread. Rows past `mr`, and the last pair's upper half where `kc`
/// is odd, are zero.
///
/// # Safety
/// `row` must be sound for every `i < mr` and the lanes it is given; `out` must hold `32 · kc`
/// floats; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn rows_to_blocks(
    kc: usize,
    mr: usize,
    out: *mut f32,
    row: impl Fn(usize, usize, __mmask32) -> __m512i,
) {
    for p in (0..kc).step_by(2 * PAIRS) {
        let len = (2 * PAIRS).min(kc - p);
        let pairs = len.div_ceil(2);
        let live = (u64::MAX >> (64 - len)) as __mmask32;
        let words = (u32::MAX >> (32 - pairs)) as __mmask16;
        // SAFETY: block `p / 32` starts at word `16·p` (the blocks before it whole) and holds
        // `32·pairs` words, inside the panel; `row` is sound for these lanes, as the caller
        // vouched.
        unsafe {
            let block = (out as *mut u32).add(MR * p / 2);
            for i in 0..MR {
                let bits = if i < mr {
                    row(i, p, live)
                } else {
                    _mm512_setzero_si512()
                };
                _mm512_mask_storeu_epi32(block.add(i * pairs) as *mut i32, words, bits);
            }
        }
    }
}

/// Sixteen f32 values rounded to bf16 bits as [`to_pairs`] rounds them (`VCVTNEPS2BF16`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn bits16(x: __m512) -> __m256i {
    // SAFETY: `__m256bh` and `__m256i` are the same 256 bits.
    unsafe { std::mem::transmute(_mm512_cvtneps_pbh(x)) }
}

/// 64-byte-aligned room for a 32 × 32 f32 block (4 KiB), or an `a` block's words.
#[repr(C, align(64))]
struct Block([f32; MR * NR]);

/// Rounds an f32 `a` panel (`x[p·32 + i]`, `kc` deep) in place into bf16 pairs along the depth
/// ([`to_pairs`]: word `q·32 + i` holds row `i`'s pair `q`), then transposes each block of 16
/// pairs (the last block `r ≤ 16`) so that word `i·r + q'` holds row `i`'s pair `q'` of the
/// block: an `a` tile's rows, `4r` bytes apart. Each block keeps its place (`32·r` words).
///
/// # Safety
/// `panel` must hold `32 · kc` floats; the CPU must have AVX512-BF16, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn to_blocks(kc: usize, panel: *mut f32) {
    let pairs = kc.div_ceil(2);
    // Uninitialised: each block's rows are copied in before they are read.
    let mut scratch = std::mem::MaybeUninit::<Block>::uninit();
    let scratch = scratch.as_mut_ptr() as *mut f32;
    // SAFETY: each block's `32·r` words lie inside the panel's first `32·pairs`; the scratch
    // holds a whole block. Words are moved, never computed with.
    unsafe {
        to_pairs::<MR>(kc, panel);
        for q0 in (0..pairs).step_by(PAIRS) {
            let r = PAIRS.min(pairs - q0);
            let block = panel.add(q0 * MR);
            std::ptr::copy_nonoverlapping(block, scratch, r * MR);
            super::avx512::transpose((scratch, MR), (r, MR), (block, r));
        }
    }
}

/// One 32 × 32 tile over a blocked `a` panel and a paired `b` panel, `kc` deep: `c (+)= scale ·
/// a · b` (plus the bias where there is one and `c` is not accumulated into), its `mr × nr`
/// corner stored. An unscaled whole tile sums onto `c` or the bias in the tiles; otherwise
/// the sums are scaled and added as the AVX-512 tile adds them.
///
/// # Safety
/// The panels as [`pack_a`] and [`Tile::pack_b`] leave them, `kc` deep; the tile (and its
/// biases) inside `c` (and `bias`); the unit's tiles usable, and the CPU with AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn kernel<U: TileUnit>(
    kc: usize,
    (ap, bp): (*const f32, *const f32),
    (c, c_rs): (*mut f32, isize),
    (mr, nr): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    let pairs = kc.div_ceil(2);
    let (blocks, rest) = (pairs / PAIRS, pairs % PAIRS);
    let (a, b) = (ap as *const u8, bp as *const u8);
    // Uninitialised: the four tiles are stored over all of it before it is read (zeroing it
    // for every 32 × 32 tile was 2-5 % of a bf16 step's time in `memset`).
    let mut sums = std::mem::MaybeUninit::<Block>::uninit();
    let out = sums.as_mut_ptr() as *mut u8;
    // A whole tile, unscaled, with rows of `c` in order, goes to and from `c` itself: its
    // tiles start from `c` (accumulating), from the bias (each row the same 16 values: a
    // stride of 0) or from zero, and are stored straight into it, with no block of sums and
    // no pass over it (that pass was about a tenth of the kernel's time).
    let direct = scale == 1.0 && (mr, nr) == (MR, NR) && c_rs >= NR as isize;
    let c_row = (c_rs as usize) * 4;
    // SAFETY (all blocks): the panels hold `blocks` whole blocks and a last of `rest` pairs,
    // as the caller vouched; the block of sums holds the four `c` tiles, and a whole tile
    // lies inside `c` (and its 32 biases inside `bias`).
    unsafe {
        U::configure(PAIRS);
        if direct && accumulate {
            load_sums::<U>(c as *const u8, c_row);
        } else if direct && !bias.is_null() {
            let bias = bias as *const u8;
            U::load::<0>(bias, 0);
            U::load::<1>(bias.add(64), 0);
            U::load::<2>(bias, 0);
            U::load::<3>(bias.add(64), 0);
        } else {
            U::zero::<0>();
            U::zero::<1>();
            U::zero::<2>();
            U::zero::<3>();
        }
        for blk in 0..blocks {
            let (ab, bb) = (a.add(blk * A_BLOCK), b.add(blk * PAIRS * ROW));
            U::load::<4>(ab, 4 * PAIRS);
            U::load::<5>(ab.add(A_BLOCK / 2), 4 * PAIRS);
            U::load::<6>(bb, ROW);
            U::load::<7>(bb.add(64), ROW);
            U::dot::<0, 4, 6>();
            U::dot::<1, 4, 7>();
            U::dot::<2, 5, 6>();
            U::dot::<3, 5, 7>();
        }
        if rest > 0 {
            // The short block's own configuration, which zeroes the tiles: the sums go back in.
            store_sums::<U>(out, ROW);
            U::configure(rest);
            load_sums::<U>(out, ROW);
            let (ab, bb) = (a.add(blocks * A_BLOCK), b.add(blocks * PAIRS * ROW));
            U::load::<4>(ab, 4 * rest);
            U::load::<5>(ab.add(16 * 4 * rest), 4 * rest);
            U::load::<6>(bb, ROW);
            U::load::<7>(bb.add(64), ROW);
            U::dot::<0, 4, 6>();
            U::dot::<1, 4, 7>();
            U::dot::<2, 5, 6>();
            U::dot::<3, 5, 7>();
        }
        if direct {
            store_sums::<U>(c as *mut u8, c_row);
            return;
        }
        store_sums::<U>(out, ROW);
        store(
            sums.assume_init_ref(),
            (c, c_rs),
            (mr, nr),
            (scale, bias),
            accumulate,
        );
    }
}

/// The four `c` tiles into a 32 × 32 block of f32 rows, `row` bytes apart.
///
/// # Safety
/// As [`TileUnit::store`]; `out` holds 32 rows of 128 bytes, `row` apart.
#[inline(always)]
unsafe fn store_sums<U: TileUnit>(out: *mut u8, row: usize) {
    // SAFETY: as the caller vouched.
    unsafe {
        U::store::<0>(out, row);
        U::store::<1>(out.add(64), row);
        U::store::<2>(out.add(16 * row), row);
        U::store::<3>(out.add(16 * row + 64), row);
    }
}

/// The four `c` tiles from a 32 × 32 block of f32 rows, `row` bytes apart.
///
/// # Safety
/// As [`TileUnit::load`]; `src` holds 32 rows of 128 bytes, `row` apart.
#[inline(always)]
unsafe fn load_sums<U: TileUnit>(src: *const u8, row: usize) {
    // SAFETY: as the caller vouched.
    unsafe {
        U::load::<0>(src, row);
        U::load::<1>(src.add(64), row);
        U::load::<2>(src.add(16 * row), row);
        U::load::<3>(src.add(16 * row + 64), row);
    }
}

/// The `mr × nr` corner of the sums into `c`, as [`super::avx512::store_tile`] stores.
///
/// # Safety
/// The corner (and its biases) inside `c` (and `bias`); the CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn store(
    sums: &Block,
    (c, c_rs): (*mut f32, isize),
    (mr, nr): (usize, usize),
    (scale, bias): (f32, *const f32),
    accumulate: bool,
) {
    let s = _mm512_set1_ps(scale);
    // SAFETY: loads and stores are masked to the corner, as the caller vouched.
    unsafe {
        for i in 0..mr {
            let out = c.offset(i as isize * c_rs);
            for v in 0..NR / 16 {
                let left = nr.saturating_sub(v * 16).min(16);
                if left == 0 {
                    break;
                }
                let mask = (((1u32 << left) - 1) & 0xffff) as __mmask16;
                let dst = out.add(v * 16);
                let mut x = _mm512_mul_ps(_mm512_loadu_ps(sums.0.as_ptr().add(i * NR + v * 16)), s);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Tile `T` of the model, row by row.
    fn tile<const T: u8>() -> [[u32; 16]; 16] {
        MODEL.with(|m| m.borrow().tiles[usize::from(T)])
    }

    /// The model's `TDPBF16PS` against hand-computed sums: pairs multiplied as Intel's
    /// pseudo-code pairs them (low halves together, high halves together), a subnormal bf16
    /// input taken as zero, a short configuration's rows and columns alone touched.
    #[test]
    fn the_model_computes_tdpbf16ps_as_specified() {
        let bf = |v: f32| u32::from(super::super::half::bf16_bits(v));
        let pair = |lo: f32, hi: f32| bf(lo) | bf(hi) << 16;
        // Two pairs of depth: a 16 × 8-byte `a`, a 2 × 64-byte `b`.
        let mut a = [0u32; 16 * 2];
        let mut b = [0u32; 2 * 16];
        for r in 0..16 {
            a[r * 2] = pair(r as f32, 1.0);
            a[r * 2 + 1] = pair(0.5, -2.0);
        }
        for n in 0..16 {
            b[n] = pair(n as f32, 3.0);
            b[16 + n] = pair(4.0, f32::from_bits(0x0001_0000)); // a subnormal bf16: zero
        }
        let mut c = [[0u32; 16]; 16];
        for (r, row) in c.iter_mut().enumerate() {
            for (n, v) in row.iter_mut().enumerate() {
                *v = (100.0 * r as f32 + n as f32).to_bits();
            }
        }
        // SAFETY: the model runs anywhere; the buffers hold the configured rows.
        unsafe {
            Modelled::configure(2);
            Modelled::load::<0>(c.as_ptr() as *const u8, 64);
            Modelled::load::<4>(a.as_ptr() as *const u8, 8);
            Modelled::load::<6>(b.as_ptr() as *const u8, 64);
            Modelled::dot::<0, 4, 6>();
        }
        let got = tile::<0>();
        for (r, row) in got.iter().enumerate() {
            for (n, &v) in row.iter().enumerate() {
                let want = 100.0 * r as f32 + n as f32 + (r * n) as f32 + 3.0 + 0.5 * 4.0;
                assert_eq!(f32::from_bits(v), want, "row {r}, column {n}");
            }
        }
        // Loading a new configuration zeroes every tile, as `LDTILECFG` does.
        // SAFETY: as above.
        unsafe { Modelled::configure(16) };
        assert_eq!(tile::<0>(), [[0; 16]; 16]);
    }

    /// The tile at its edges, one thread: outputs narrower and shorter than a tile and just
    /// past one, depths of one value, of a short block alone, of whole blocks, whole blocks and
    /// a short one, and past `KC`; every layout, scaling and accumulating. Each element within
    /// f32 summation error of the f64 product of the bf16-rounded operands.
    #[test]
    fn the_modelled_tile_matches_an_f64_product_at_every_edge() {
        if !Modelled::available() {
            eprintln!("skipped the AMX tile's edges: the packing needs AVX512-BF16");
            return;
        }
        edges::<Modelled>();
        // The instructions themselves, where this CPU has them.
        if usable() {
            edges::<Hardware>();
        }
    }

    /// The edge cases above on unit `U`.
    fn edges<U: TileUnit>() {
        use super::super::blocked::sgemm;
        use super::super::half::round_to_bf16;
        use super::super::test_support::values;
        let shapes = [
            (1, 1, 1),
            (7, 5, 3),
            (32, 32, 32),
            (33, 31, 33),
            (31, 33, 64),
            (5, 40, 15),
            (40, 5, 16),
            (64, 70, 1030),
        ];
        for (m, n, k) in shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                // Unscaled whole tiles start from zero, the bias or `c` and are stored
                // straight into `c`; scaled ones go through a block of sums.
                let runs = [
                    (1.0f32, false, false),
                    (1.0, false, true),
                    (1.0, true, false),
                    (0.5, true, false),
                    (0.5, false, true),
                ];
                for (scale, accumulate, biased) in runs {
                    let (a, b) = (values(m * k, 51), values(k * n, 52));
                    let start = values(m * n, 53);
                    let bias = values(n, 54);
                    let fused = if biased {
                        Fused {
                            bias: Some(&bias),
                            ..Fused::NONE
                        }
                    } else {
                        Fused::NONE
                    };
                    let mut c = start.clone();
                    let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
                    let (b_rs, b_cs) = if tb { (1, k as isize) } else { (n as isize, 1) };
                    // SAFETY: the packing's features were checked; the strides stay inside
                    // the vectors.
                    let done = unsafe {
                        sgemm::<Amx<U>>(
                            (m, n, k),
                            (c.as_mut_ptr(), n as isize),
                            (a.as_ptr(), a_rs, a_cs),
                            (b.as_ptr(), b_rs, b_cs),
                            scale,
                            accumulate,
                            fused,
                        )
                    };
                    assert!(done);
                    // The product gave its tile state up when it ended.
                    assert_eq!(MODEL.with(|m| m.borrow().config), None, "left configured");
                    assert_eq!(LOADED.with(Cell::get), 0, "left configured");
                    let at = |x: &[f32], (rs, cs): (isize, isize), r: usize, col: usize| {
                        f64::from(round_to_bf16(
                            x[(r as isize * rs + col as isize * cs) as usize],
                        ))
                    };
                    for i in 0..m {
                        for j in 0..n {
                            let terms = (0..k)
                                .map(|p| at(&a, (a_rs, a_cs), i, p) * at(&b, (b_rs, b_cs), p, j));
                            let base = if accumulate {
                                f64::from(start[i * n + j])
                            } else if biased {
                                f64::from(bias[j])
                            } else {
                                0.0
                            };
                            let s = f64::from(scale);
                            let want = base + s * terms.clone().sum::<f64>();
                            let bound = s * terms.map(f64::abs).sum::<f64>() + base.abs();
                            let tol = (k + 2) as f64 * f64::from(f32::EPSILON) * bound;
                            let got = f64::from(c[i * n + j]);
                            assert!(
                                (got - want).abs() <= tol,
                                "{m}×{k}×{n} ta={ta} tb={tb} scale={scale} acc={accumulate} \
                                 bias={biased} at ({i}, {j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A bf16 `a` with its LayerNorm (tokens down the rows) or GELU made as it is packed is
    /// bitwise the product of the same prologue made first in f32 and rounded to bf16: the
    /// row-wise packing makes each element as the panel's does. Depths odd and even, one
    /// block and several, partial tiles.
    #[test]
    fn a_prologue_made_along_bf16_rows_is_bitwise_the_materialised_one() {
        if !Modelled::available() {
            eprintln!("skipped the AMX tile's row prologue: the packing needs AVX512-BF16");
            return;
        }
        check_row_prologue::<Modelled>();
        if usable() {
            check_row_prologue::<Hardware>();
        }
    }

    fn check_row_prologue<U: TileUnit>() {
        use super::super::blocked::apply_prologue;
        use super::super::half::{bf16_bits, widen, HalfA};
        use super::super::test_support::values;
        use snug_graph::ops::GeluApprox;
        for (m, n, k) in [(40, 50, 90), (33, 64, 71), (32, 32, 32), (5, 7, 3)] {
            let bits: Vec<u16> = values(m * k, 61)
                .iter()
                .map(|&v| bf16_bits(4.0 * v))
                .collect();
            let b = values(k * n, 62);
            let (mean, rstd) = (values(m, 63), values(m, 64));
            let rstd: Vec<f32> = rstd.iter().map(|r| 1.5 + r).collect();
            let (w, bias) = (values(k, 65), values(k, 66));
            let prologues = [
                Prologue::LayerNorm {
                    mean: &mean,
                    rstd: &rstd,
                    w: &w,
                    b: &bias,
                    tokens_down: true,
                },
                Prologue::Gelu(GeluApprox::Tanh),
                Prologue::Gelu(GeluApprox::Exact),
            ];
            for (prologue, label) in prologues.into_iter().zip(["layer norm", "tanh", "erf"]) {
                // The prologue made first: one row-major panel of the whole `a`, token `i`
                // per row, through the panel function itself.
                let mut made = vec![0f32; m * k];
                for i in 0..m {
                    let mut col: Vec<f32> = (0..k).map(|p| widen(bits[i * k + p])).collect();
                    // A panel of one row: `k` columns of 1 (MR = 1).
                    apply_prologue::<1>(prologue, &mut col, 1, (i, 0));
                    made[i * k..(i + 1) * k].copy_from_slice(&col);
                }
                let mut want = vec![f32::NAN; m * n];
                let mut got = vec![f32::NAN; m * n];
                let fused = Fused {
                    prologue,
                    half_a: Some(HalfA {
                        bits: &bits,
                        rs: k,
                        cs: 1,
                    }),
                    ..Fused::NONE
                };
                // SAFETY: the packing's features were checked; the operands cover the product.
                unsafe {
                    super::super::blocked::sgemm_alone::<Amx<U>>(
                        (m, n, k),
                        (want.as_mut_ptr(), n as isize),
                        (made.as_ptr(), k as isize, 1),
                        (b.as_ptr(), n as isize, 1),
                        1.0,
                        false,
                        Fused::NONE,
                    );
                    super::super::blocked::sgemm_alone::<Amx<U>>(
                        (m, n, k),
                        (got.as_mut_ptr(), n as isize),
                        (std::ptr::null(), 0, 0),
                        (b.as_ptr(), n as isize, 1),
                        1.0,
                        false,
                        fused,
                    );
                }
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{m}×{k}×{n} {label}: not bitwise the materialised product"
                );
            }
        }
    }

    /// CPUID and XCR0 as a Sapphire Rapids core under Linux reports them list the tiles; each
    /// missing bit (the instructions, OSXSAVE, either tile state, a CPUID without leaf 0xd)
    /// is a CPU or OS without them, and XCR0 is not read where OSXSAVE is not listed.
    #[test]
    fn the_tiles_are_found_from_cpuid_and_xcr0() {
        // Leaf 7's EDX: AMX-BF16 (22), AMX-TILE (24), AMX-INT8 (25); leaf 1's ECX: OSXSAVE
        // (27), among others; XCR0: x87, SSE, AVX, the AVX-512 states, XTILECFG, XTILEDATA.
        let (max, ecx, edx) = (0x20, 0x7ffa_fbff, 0x0743_4010 | 1 << 22 | 1 << 24 | 1 << 25);
        let xcr0 = 0x6_02e7;
        assert!(tiles_listed((max, ecx, edx), || xcr0));
        assert!(
            !tiles_listed((max, ecx, edx & !(1 << 22)), || xcr0),
            "no AMX-BF16"
        );
        assert!(
            !tiles_listed((max, ecx, edx & !(1 << 24)), || xcr0),
            "no AMX-TILE"
        );
        assert!(
            !tiles_listed((max, ecx, edx), || xcr0 & !(1 << 18)),
            "no XTILEDATA"
        );
        assert!(
            !tiles_listed((max, ecx, edx), || xcr0 & !(1 << 17)),
            "no XTILECFG"
        );
        assert!(!tiles_listed((0xc, ecx, edx), || xcr0), "no leaf 0xd");
        let unread = || -> u64 { panic!("XCR0 read without OSXSAVE") };
        assert!(!tiles_listed((max, ecx & !(1 << 27), edx), unread));
    }

    /// A tile instruction on tiles whose configured shapes do not multiply faults.
    #[test]
    #[should_panic(expected = "mismatched shapes")]
    fn the_model_refuses_mismatched_tiles() {
        // SAFETY: the model runs anywhere.
        unsafe {
            Modelled::configure(4);
            // `a`'s 16 bytes a row against `c` as `b`: 16 rows, not 4.
            Modelled::dot::<1, 4, 0>();
        }
    }

    /// The configuration bytes are `LDTILECFG`'s: palette 1, then each tile's bytes per row
    /// (16-bit, little-endian, from byte 16) and rows (from byte 48).
    #[test]
    fn configurations_lay_out_the_tiles_the_kernel_uses() {
        for pairs in 1..=16 {
            let cfg = Config::new(pairs);
            assert_eq!((cfg.0[0], cfg.0[1]), (1, 0));
            for t in 0..4 {
                assert_eq!((cfg.rows(t), cfg.colsb(t)), (16, 64));
            }
            for t in [4, 5] {
                assert_eq!((cfg.rows(t), cfg.colsb(t)), (16, 4 * pairs));
            }
            for t in [6, 7] {
                assert_eq!((cfg.rows(t), cfg.colsb(t)), (pairs, 64));
            }
            assert!(cfg.0[2..16]
                .iter()
                .chain(&cfg.0[32..48])
                .chain(&cfg.0[56..])
                .all(|&b| b == 0));
        }
    }

    /// The check a process runs before using the tiles passes the model and fails a unit that
    /// drops the high half of every pair.
    #[test]
    fn the_tiles_check_accepts_the_model_and_refuses_a_wrong_unit() {
        if !Modelled::available() {
            eprintln!("skipped the AMX tiles' check: the packing needs AVX512-BF16");
            return;
        }
        /// The model, but each `b` pair's high half taken as zero.
        struct Dropping;
        impl TileUnit for Dropping {
            fn available() -> bool {
                true
            }
            unsafe fn configure(pairs: usize) {
                unsafe { Modelled::configure(pairs) }
            }
            unsafe fn release() {
                unsafe { Modelled::release() }
            }
            unsafe fn zero<const T: u8>() {
                unsafe { Modelled::zero::<T>() }
            }
            unsafe fn load<const T: u8>(src: *const u8, stride: usize) {
                unsafe { Modelled::load::<T>(src, stride) };
                if T >= 6 {
                    MODEL.with(|m| {
                        for row in m.borrow_mut().tiles[usize::from(T)].iter_mut() {
                            row.iter_mut().for_each(|w| *w &= 0xffff);
                        }
                    });
                }
            }
            unsafe fn store<const T: u8>(dst: *mut u8, stride: usize) {
                unsafe { Modelled::store::<T>(dst, stride) }
            }
            unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
                unsafe { Modelled::dot::<C, A, B>() }
            }
        }
        assert!(agrees::<Modelled>());
        assert!(!agrees::<Dropping>());
    }
}
