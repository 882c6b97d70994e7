//! Products whose operands are bf16 activations or gradients read from their 16-bit storage
//! (`snug_graph::ops::HalfIo`): each value is widened to f32 as the blocked kernel packs it
//! (exactly, as a bf16 → f32 cast would have written it), so on the f32 tiles the product is
//! bitwise the one on the cast's f32 copy, which is never made. `a` is widened by
//! [`HalfA::pack_a`]; `b` is a [`QuantB`] of base bf16, the path frozen bf16 weights take.
//!
//! On a CPU with AVX512-BF16 these products run in bf16 arithmetic instead
//! ([`super::avx512bf16`]): the panels are rounded to bf16 pairs once packed (an f32 operand,
//! a weight, then rounded too, as bf16 autocast does) and summed in f32.

// Only our x86-64 tiles pack a bf16 operand; elsewhere `gemm_half` widens copies.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]

use snug_graph::ops::QuantizeBase;

use super::quantized::QuantB;
use super::Layout;

/// f32 from bf16 bits: exact.
#[inline(always)]
pub(crate) fn widen(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// bf16 bits of `v`: nearest even, NaN kept NaN (quieted), as the cast kernel and
/// `VCVTNEPS2BF16` round.
#[inline(always)]
pub(crate) fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        ((b >> 16) | 0x40) as u16
    } else {
        (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// `v` rounded to the nearest bf16 value ([`bf16_bits`]), as f32.
#[inline(always)]
pub(crate) fn round_to_bf16(v: f32) -> f32 {
    widen(bf16_bits(v))
}

/// A bf16 `a`: element `(i, p)` at `bits[i·rs + p·cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HalfA<'a> {
    pub bits: &'a [u16],
    pub rs: usize,
    pub cs: usize,
}

impl HalfA<'_> {
    /// Packs `kc` columns of up to `mr` rows from `(i0, p0)` as `out[p·mr_tile + i]`, zero
    /// rows past `mr`: a tile's `pack_a`, widening as it goes.
    ///
    /// # Safety
    /// `out` must hold `mr_tile · kc` floats; the rows and columns must lie inside `bits`.
    #[inline(always)]
    pub(crate) unsafe fn pack_a(
        &self,
        mr_tile: usize,
        (kc, mr): (usize, usize),
        (i0, p0): (usize, usize),
        out: *mut f32,
    ) {
        // SAFETY: the panel holds `mr_tile · kc` floats, as the caller vouched.
        let panel = unsafe { std::slice::from_raw_parts_mut(out, mr_tile * kc) };
        let (rs, cs) = (self.rs, self.cs);
        for (p, col) in panel.chunks_exact_mut(mr_tile).enumerate() {
            let at = i0 * rs + (p0 + p) * cs;
            for (i, v) in col[..mr].iter_mut().enumerate() {
                *v = widen(self.bits[at + i * rs]);
            }
            col[mr..].fill(0.0);
        }
    }
}

/// A product's operand: f32, or bf16 widened as it is read.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Operand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> Operand<'a> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Operand::F32(x) => x.len(),
            Operand::Bf16(x) => x.len(),
        }
    }

    /// The elements in `range`.
    pub(crate) fn rows(&self, range: std::ops::Range<usize>) -> Operand<'a> {
        match *self {
            Operand::F32(x) => Operand::F32(&x[range]),
            Operand::Bf16(x) => Operand::Bf16(&x[range]),
        }
    }

    /// The operand in f32: borrowed, or widened into `buf`.
    pub(crate) fn widened<'b>(&'b self, buf: &'b mut Vec<f32>) -> &'b [f32] {
        match self {
            Operand::F32(x) => x,
            Operand::Bf16(x) => {
                buf.clear();
                buf.extend(x.iter().map(|&h| widen(h)));
                buf
            }
        }
    }
}

/// [`super::gemm_fused`] with either operand in bf16: `a` widened as our kernel packs it (then
/// through `fused`'s prologue), `b` decoded as its panels are packed; in bf16 arithmetic where
/// the CPU has AVX512-BF16 ([`super::choose_tile`]). Returns `false`, doing
/// nothing, where our kernel does not run the product; the caller then widens them itself.
///
/// # Safety
/// As [`super::gemm_fused`].
pub(crate) unsafe fn gemm_fused_half(
    layout: Layout,
    (a, b): (Operand<'_>, Operand<'_>),
    c: &mut [f32],
    par: ::gemm::Parallelism,
    fused: super::Fused<'_>,
) -> bool {
    let Layout { m, n, k, .. } = layout;
    let bf16_operand = matches!(a, Operand::Bf16(_))
        || matches!(b, Operand::Bf16(_))
        || fused.arith == super::Arith::Bf16;
    let (cpu, math) = (
        crate::isa::CpuFeatures::host(),
        crate::isa::Bf16Math::current(),
    );
    let tile = super::choose_tile(cpu, math, (m, n, k), 1, bf16_operand);
    // SAFETY: `choose_tile` checked the CPU; the caller vouches for the rest.
    unsafe { gemm_fused_half_on(tile, layout, (a, b), c, par, fused) }
}

/// [`gemm_fused_half`] on `tile` (`None`: not run, `false`).
///
/// # Safety
/// As [`super::gemm_fused`]; the CPU must have `tile`'s instructions.
unsafe fn gemm_fused_half_on(
    tile: Option<super::OwnTile>,
    layout: Layout,
    (a, b): (Operand<'_>, Operand<'_>),
    c: &mut [f32],
    par: ::gemm::Parallelism,
    fused: super::Fused<'_>,
) -> bool {
    let Layout { m, n, k, .. } = layout;
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    debug_assert!(fused.half_a.is_none() && fused.quant_b.is_none());
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = tile {
        let ((a_rs, a_cs), (b_rs, b_cs)) = layout.strides();
        let none = std::ptr::NonNull::<f32>::dangling().as_ptr() as *const f32;
        let (a_ptr, a_s, half_a) = match a {
            Operand::F32(x) => (x.as_ptr(), (a_rs, a_cs), None),
            Operand::Bf16(bits) => {
                let (rs, cs) = (a_rs as usize, a_cs as usize);
                (none, (0, 0), Some(HalfA { bits, rs, cs }))
            }
        };
        let (b_ptr, b_s, quant_b) = match b {
            Operand::F32(x) => (x.as_ptr(), (b_rs, b_cs), None),
            Operand::Bf16(halves) => {
                let cols = if layout.tb { k } else { n };
                let q = QuantB::of(QuantizeBase::Bf16, (&[], halves, &[]), cols, layout.tb);
                (none, (0, 0), Some(q))
            }
        };
        let product = super::Product {
            dims: (m, n, k),
            c: (c.as_mut_ptr(), n as isize, 1),
            a: (a_ptr, a_s.0, a_s.1),
            b: (b_ptr, b_s.0, b_s.1),
            scale: 1.0,
            accumulate: false,
        };
        let fused = super::Fused {
            half_a,
            quant_b,
            ..fused
        };
        // SAFETY: the caller checked the CPU and vouches for the operands; the packing reads
        // a bf16 operand from its bits only.
        return unsafe { super::own_gemm(tile, product, par, fused) };
    }
    let _ = (tile, a, b, c, par, fused);
    false
}

/// `c = op(a) · op(b) (+ bias)` in `arith` with either operand bf16: on our blocked kernel,
/// widening as it packs, where it runs the product; elsewhere (another CPU, its packing
/// space in use) on f32 copies of the bf16 operands made here.
pub(crate) fn gemm_half(
    layout: Layout,
    (a, b): (Operand<'_>, Operand<'_>),
    c: &mut [f32],
    bias: Option<&[f32]>,
    par: ::gemm::Parallelism,
    arith: super::Arith,
) {
    let Layout { ta, tb, m, n, k } = layout;
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    assert!(bias.is_none_or(|bias| bias.len() >= n));
    let fused = super::Fused {
        bias,
        arith,
        ..super::Fused::NONE
    };
    // SAFETY: the lengths were checked above.
    if unsafe { gemm_fused_half(layout, (a, b), c, par, fused) } {
        return;
    }
    let (mut wa, mut wb) = (Vec::new(), Vec::new());
    let (a, b) = (a.widened(&mut wa), b.widened(&mut wb));
    if let Some(bias) = bias {
        for row in c[..m * n].chunks_exact_mut(n) {
            row.copy_from_slice(&bias[..n]);
        }
    }
    // SAFETY: the lengths were checked above.
    unsafe {
        super::gemm_strided(
            Layout::new((ta, tb), (m, n, k)),
            a,
            b,
            c,
            bias.is_some(),
            par,
            arith,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::test_support::{assert_product, values};

    /// bf16 bits of `x`, rounded to nearest even (as the Cast kernel rounds).
    fn bf16(x: &[f32]) -> Vec<u16> {
        x.iter()
            .map(|v| {
                let b = v.to_bits();
                ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
            })
            .collect()
    }

    /// Every layout, either operand or both in bf16, with and without a bias, on one thread
    /// and two: the product is bitwise the f32 product of the widened operands (the path the
    /// up-cast took), and within f32 rounding of an f64 product of the bf16 values. Shapes
    /// big enough for our kernel (with partial register tiles and several depth blocks) and
    /// too small for it (the widened copies on the gemm crate).
    #[test]
    fn bf16_operands_give_the_widened_product_in_every_layout() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let shapes = [(67, 130, 517), (301, 45, 700), (5, 20, 9), (40, 8, 33)];
        for (m, n, k) in shapes {
            let (a16, b16) = (bf16(&values(m * k, 11)), bf16(&values(k * n, 12)));
            let (a, b): (Vec<f32>, Vec<f32>) = (
                a16.iter().map(|&h| widen(h)).collect(),
                b16.iter().map(|&h| widen(h)).collect(),
            );
            let bias = values(n, 13);
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for halves in [0b01, 0b10, 0b11] {
                    for (with_bias, threads) in [(false, 1), (true, 2), (true, 1), (false, 2)] {
                        let layout = Layout::new((ta, tb), (m, n, k));
                        let par = if threads > 1 {
                            ::gemm::Parallelism::Rayon(threads)
                        } else {
                            ::gemm::Parallelism::None
                        };
                        let bias = with_bias.then_some(&bias[..]);
                        let operand = |half: bool, h: &'static str| {
                            let _ = h;
                            half
                        };
                        let a_op = if operand(halves & 1 != 0, "a") {
                            Operand::Bf16(&a16)
                        } else {
                            Operand::F32(&a)
                        };
                        let b_op = if operand(halves & 2 != 0, "b") {
                            Operand::Bf16(&b16)
                        } else {
                            Operand::F32(&b)
                        };
                        let mut got = vec![f32::NAN; m * n];
                        let f32_arith = crate::gemm::Arith::F32;
                        pool.install(|| {
                            gemm_half(layout, (a_op, b_op), &mut got, bias, par, f32_arith)
                        });
                        let mut want = vec![f32::NAN; m * n];
                        pool.install(|| {
                            gemm_half(
                                layout,
                                (Operand::F32(&a), Operand::F32(&b)),
                                &mut want,
                                bias,
                                par,
                                f32_arith,
                            )
                        });
                        let label = format!(
                            "{m}×{k}×{n} ta {ta} tb {tb} halves {halves:02b} bias {with_bias} \
                             threads {threads}"
                        );
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(x, y)| x.to_bits() == y.to_bits());
                        // Where the CPU has AVX512-BF16 our tile computes in bf16 arithmetic
                        // (its own test below): the same values, summed in another order.
                        let (cpu, math) = (
                            crate::isa::CpuFeatures::host(),
                            crate::isa::Bf16Math::current(),
                        );
                        let bf16_arithmetic =
                            crate::gemm::choose_tile(cpu, math, (m, n, k), 1, true)
                                != crate::gemm::choose_tile(cpu, math, (m, n, k), 1, false);
                        assert!(
                            same || bf16_arithmetic,
                            "{label}: not the widened f32 product"
                        );
                        let at = |x: &[f32], rows: usize, cols: usize, t: bool| {
                            let x = x.to_vec();
                            move |i: usize, j: usize| {
                                if t {
                                    x[j * rows + i]
                                } else {
                                    x[i * cols + j]
                                }
                            }
                        };
                        let mut base = vec![0.0f32; m * n];
                        if let Some(bias) = bias {
                            for row in base.chunks_exact_mut(n) {
                                row.copy_from_slice(bias);
                            }
                        }
                        assert_product(
                            (m, n, k),
                            (at(&a, m, k, ta), at(&b, k, n, tb)),
                            (1.0, true),
                            (&base, &got),
                            1e-5 * k as f64,
                            &label,
                        );
                    }
                }
            }
        }
    }

    /// bf16 bits of `x`, as [`Operand::Bf16`] storage.
    fn rounded(x: &[f32]) -> Vec<f32> {
        bf16(x).iter().map(|&h| widen(h)).collect()
    }

    /// The AVX512-BF16 tile, on this CPU where it has the instructions and else on an emulated
    /// Sapphire Rapids core (`snug_testkit::emulate`).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_bf16_tile_matches_an_f64_product_of_the_bf16_values() {
        use crate::gemm::avx512bf16::Avx512Bf16;
        use crate::gemm::blocked::{reserve_pack, Tile};
        let native = Avx512Bf16::available();
        let emulated = snug_testkit::emulate::Model::SapphireRapids;
        let reserve = reserve_pack::<Avx512Bf16>;
        check_bf16_arithmetic(crate::gemm::OwnTile::Avx512Bf16, native, emulated, reserve);
    }

    /// AMX's tile on the modelled tile registers (`amx::Modelled`): its packing, blocking, short
    /// last depth blocks and configurations, on this CPU where it has AVX512-BF16 (which the
    /// packing uses) and else on an emulated Sapphire Rapids core. The tile instructions
    /// themselves run only on a CPU with AMX, which checks them before use (`amx::usable`).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_amx_tile_matches_an_f64_product_of_the_bf16_values() {
        use crate::gemm::amx::{Amx, Modelled, TileUnit};
        use crate::gemm::blocked::reserve_pack;
        let native = Modelled::available();
        let emulated = snug_testkit::emulate::Model::SapphireRapids;
        let reserve = reserve_pack::<Amx<Modelled>>;
        check_bf16_arithmetic(crate::gemm::OwnTile::AmxModel, native, emulated, reserve);
        // The instructions themselves, where this CPU has them.
        if crate::gemm::amx::usable() {
            use crate::gemm::amx::Hardware;
            let reserve = reserve_pack::<Amx<Hardware>>;
            check_bf16_arithmetic(crate::gemm::OwnTile::Amx, true, emulated, reserve);
        } else {
            eprintln!("the AMX tiles themselves: not on this CPU (the modelled ones ran)");
        }
    }

    /// `SNUG_BF16_MATH=model`'s tiles give the same numbers as the AVX512-BF16 one: AVX2's
    /// where this CPU has it, AVX-512's natively or on an emulated Tiger Lake core.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_modelled_bf16_tiles_match_an_f64_product_of_the_bf16_values() {
        use snug_testkit::emulate::Model;

        use crate::gemm::avx2::Avx2;
        use crate::gemm::avx512::Avx512;
        use crate::gemm::bf16_model::Rounded;
        use crate::gemm::blocked::{reserve_pack, Tile};
        use crate::gemm::OwnTile;
        if Avx2::available() {
            let reserve = reserve_pack::<Rounded<Avx2>>;
            check_bf16_arithmetic(OwnTile::Avx2Model, true, Model::TigerLake, reserve);
        } else {
            eprintln!("skipped the modelled AVX2 tile: this CPU has no AVX2 and FMA");
        }
        let reserve = reserve_pack::<Rounded<Avx512>>;
        let native = Avx512::available();
        check_bf16_arithmetic(OwnTile::Avx512Model, native, Model::TigerLake, reserve);
    }

    /// Runs `tile` (on this CPU where `native`, else on an emulated `emulated` core, after
    /// `reserve` made its packing space) in every layout, with `a`, `b` or both in bf16 (the
    /// f32 one then rounded to bf16, as the tile packs it), with and without a bias, at partial
    /// register tiles, odd depths and two depth blocks: each element must be within f32
    /// summation error of an f64 product of the bf16 values.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn check_bf16_arithmetic(
        tile: crate::gemm::OwnTile,
        native: bool,
        emulated: snug_testkit::emulate::Model,
        reserve: fn(),
    ) {
        use crate::gemm::test_support::{run_on, EmuJob};
        use crate::gemm::{Fused, OwnTile};

        struct Case<'a> {
            layout: Layout,
            a: Operand<'a>,
            b: Operand<'a>,
            bias: Option<&'a [f32]>,
            /// The operands' values as the tile multiplies them, and the label.
            values: (&'a [f32], &'a [f32]),
            label: String,
        }
        struct Job<'a> {
            tile: OwnTile,
            cases: &'a [Case<'a>],
            out: &'a mut [Vec<f32>],
            ran: &'a mut [bool],
        }
        /// Every case on the job's tile, one thread; no allocation, no panic, no I/O.
        impl EmuJob for Job<'_> {
            unsafe fn run(&mut self) {
                for ((case, c), ran) in self
                    .cases
                    .iter()
                    .zip(self.out.iter_mut())
                    .zip(self.ran.iter_mut())
                {
                    let fused = Fused {
                        bias: case.bias,
                        ..Fused::NONE
                    };
                    // SAFETY: the CPU (real or emulated) has the tile's instructions; the operands
                    // cover the product and `c` holds `m · n`.
                    *ran = unsafe {
                        gemm_fused_half_on(
                            Some(self.tile),
                            case.layout,
                            (case.a, case.b),
                            c,
                            ::gemm::Parallelism::None,
                            fused,
                        )
                    };
                }
            }
        }

        let shapes = [(67, 130, 517), (21, 45, 700)];
        let data: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(s, &(m, n, k))| {
                let (a, b) = (values(m * k, 21 + s as u64), values(k * n, 31 + s as u64));
                let (a16, b16) = (bf16(&a), bf16(&b));
                let (ra, rb) = (rounded(&a), rounded(&b));
                (a, b, a16, b16, ra, rb, values(n, 41 + s as u64))
            })
            .collect();
        let mut cases = Vec::new();
        for (&(m, n, k), (a, b, a16, b16, ra, rb, bias)) in shapes.iter().zip(&data) {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for halves in [0b01, 0b10, 0b11] {
                    let a_op = if halves & 1 != 0 {
                        Operand::Bf16(a16)
                    } else {
                        Operand::F32(a)
                    };
                    let b_op = if halves & 2 != 0 {
                        Operand::Bf16(b16)
                    } else {
                        Operand::F32(b)
                    };
                    let with_bias = halves == 0b11;
                    cases.push(Case {
                        layout: Layout::new((ta, tb), (m, n, k)),
                        a: a_op,
                        b: b_op,
                        bias: with_bias.then_some(&bias[..]),
                        values: (ra, rb),
                        label: format!(
                            "{m}×{k}×{n} ta {ta} tb {tb} halves {halves:02b} bias {with_bias}"
                        ),
                    });
                }
            }
        }
        let mut out: Vec<Vec<f32>> = cases
            .iter()
            .map(|c| vec![f32::NAN; c.layout.m * c.layout.n])
            .collect();
        let mut ran = vec![false; cases.len()];
        let mut job = Job {
            tile,
            cases: &cases,
            out: &mut out,
            ran: &mut ran,
        };
        reserve();
        // SAFETY: the tile runs where its instructions are, natively or emulated; the job
        // makes no system call (its packing space is reserved) and touches only itself.
        if !unsafe { run_on(native, emulated, &mut job) } {
            return;
        }
        for ((case, c), ran) in cases.iter().zip(&out).zip(&ran) {
            assert!(ran, "{tile:?} {}: the tile did not run", case.label);
            let Layout { ta, tb, m, n, k } = case.layout;
            let (a, b) = case.values;
            let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
            let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|p| f64::from(at(i, p)) * f64::from(bt(p, j)));
                    let base = case.bias.map_or(0.0, |bias| f64::from(bias[j]));
                    let want = base + terms.clone().sum::<f64>();
                    // Sequential f32 summation: at most k roundings of partial sums, each
                    // bounded by the sum of magnitudes.
                    let bound = terms.map(f64::abs).sum::<f64>() + base.abs();
                    let tol = (k + 1) as f64 * f64::from(f32::EPSILON) / 2.0 * bound;
                    let got = f64::from(c[i * n + j]);
                    assert!(
                        (got - want).abs() <= tol,
                        "{tile:?} {} at ({i}, {j}): {got} vs {want} (tolerance {tol:e})",
                        case.label
                    );
                }
            }
        }
    }

    /// Widening is exact: every bf16 value, normal, subnormal, infinite or NaN, becomes the f32
    /// with the same sign, exponent and leading mantissa bits.
    #[test]
    fn widening_is_exact() {
        for h in 0..=u16::MAX {
            let w = widen(h);
            assert_eq!(w.to_bits() >> 16, u32::from(h));
            assert_eq!(w.to_bits() & 0xffff, 0);
        }
    }
}
