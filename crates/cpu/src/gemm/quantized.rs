//! Products whose `b` is a frozen weight stored quantized (bf16, int8 or NF4,
//! `snug_graph::ops::dequantize`), read from its codes: no f32 copy of the whole weight is made.
//! Where our blocked kernel runs the product, each panel of `b` is decoded as it is packed
//! ([`QuantB::pack_b`]), into exactly the floats [`Tile::pack_b`](super::blocked::Tile::pack_b)
//! would have packed from the dequantized weight, so the product is bitwise the same. Where it
//! does not (another CPU, a product too small or narrow), [`PANEL`] rows of `op(b)` at a time
//! are decoded into a workspace the planner sized, each a partial product on the gemm crate.

use snug_graph::ops::dequantize::{dq_values_len, int8_value, DoubleQuant, NF4, NF4_BLOCK};
use snug_graph::ops::quantized_read::PANEL;
use snug_graph::ops::QuantizeBase;

/// Evaluates `$body` with `$value(i)`, the weight's value at flat index `i`, decoding `$q`'s
/// scheme: each the expression the Dequantize and Cast kernels evaluate, so the values are
/// bitwise theirs. One copy of the body per scheme, each with its decoder inlined.
macro_rules! decoding {
    ($q:expr, |$value:ident| $body:expr) => {{
        let q = $q;
        let (codes, halves, absmax, cols) = (q.codes, q.halves, q.absmax, q.cols.max(1));
        match q.base {
            QuantizeBase::Bf16 => {
                let $value = |i: usize| f32::from_bits((halves[i] as u32) << 16);
                $body
            }
            QuantizeBase::Int8 => {
                let $value = |i: usize| int8_value(codes[i], absmax[i % cols]);
                $body
            }
            QuantizeBase::Nf4 => {
                let $value = |i: usize| {
                    let byte = codes[i / 2];
                    let c = if i.is_multiple_of(2) {
                        byte >> 4
                    } else {
                        byte & 0xf
                    };
                    NF4[c as usize] * absmax[i / NF4_BLOCK]
                };
                $body
            }
            QuantizeBase::Nf4Dq => {
                let dq = DoubleQuant::of(codes, absmax, dq_values_len(codes.len()));
                let $value = |i: usize| {
                    let byte = codes[i / 2];
                    let c = if i.is_multiple_of(2) {
                        byte >> 4
                    } else {
                        byte & 0xf
                    };
                    NF4[c as usize] * dq.absmax(i / NF4_BLOCK)
                };
                $body
            }
        }
    }};
}

/// A quantized weight read as a product's `b`: element `(p, j)` of `b` is the weight's value
/// at flat (row-major) index `origin + p·rs + j·cs`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuantB<'a> {
    pub base: QuantizeBase,
    /// int8's codes one a byte, NF4's two a byte (the first in the high nibble), double
    /// quantized followed by the absmax codes.
    pub codes: &'a [u8],
    /// bf16's values' bits.
    pub halves: &'a [u16],
    /// int8: one per column of the weight; NF4: one per block of 64 values; NF4 double
    /// quantized: the absmax codes' scales, then their offset; bf16: none.
    pub absmax: &'a [f32],
    /// Columns of the stored weight (int8's channels).
    pub cols: usize,
    pub origin: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> QuantB<'a> {
    /// `op(W)` of a stored `[rows, cols]` weight: `W` itself, or its transpose when `tb`.
    pub(crate) fn of(
        base: QuantizeBase,
        (codes, halves, absmax): (&'a [u8], &'a [u16], &'a [f32]),
        cols: usize,
        tb: bool,
    ) -> QuantB<'a> {
        let (rs, cs) = if tb { (1, cols) } else { (cols, 1) };
        QuantB {
            base,
            codes,
            halves,
            absmax,
            cols,
            origin: 0,
            rs,
            cs,
        }
    }

    /// `b` starting `(p0, j0)` into this one, with its rows and columns exchanged when
    /// `transposed`.
    pub(crate) fn at(self, (p0, j0): (usize, usize), transposed: bool) -> QuantB<'a> {
        let origin = self.origin + p0 * self.rs + j0 * self.cs;
        let (rs, cs) = if transposed {
            (self.cs, self.rs)
        } else {
            (self.rs, self.cs)
        };
        QuantB {
            origin,
            rs,
            cs,
            ..self
        }
    }

    /// Packs `kc` rows of `nc` columns of `b`, from `(p0, j0)`, into `nr`-column panels as a
    /// tile's `pack_b` does (`out[j·kc + p·nr + l]` for the panel at column `j`), zero columns
    /// past `nc`.
    ///
    /// # Safety
    /// `out` must hold `kc · nc.next_multiple_of(nr)` floats; the codes must cover the block.
    // Only our x86-64 tiles pack; elsewhere products decode panels (`decode_panel`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) unsafe fn pack_b(
        &self,
        nr: usize,
        (kc, nc): (usize, usize),
        (p0, j0): (usize, usize),
        out: *mut f32,
    ) {
        let (rs, cs) = (self.rs, self.cs);
        let first = self.origin + p0 * rs + j0 * cs;
        if self.base == QuantizeBase::Bf16 && cs == 1 {
            // bf16 rows read in order (a gradient or activation, or a stored weight): a
            // straight widening copy per panel row, compiled for the CPU's vector level.
            crate::isa::vectorized_loop(WidenPanels {
                halves: &self.halves[first..],
                rs,
                dims: (kc, nc, nr),
                out,
            });
            return;
        }
        // Not inlined into the tile's packing: compiled for the CPU's level here.
        crate::isa::vectorized(
            #[inline(always)]
            || {
                decoding!(self, |value| {
                    for j in (0..nc).step_by(nr) {
                        let w = nr.min(nc - j);
                        // SAFETY: panel `j` holds `kc · nr` floats inside `out`, as the caller vouched.
                        let panel =
                            unsafe { std::slice::from_raw_parts_mut(out.add(j * kc), kc * nr) };
                        let col0 = first + j * cs;
                        if cs <= rs {
                            // Rows of the weight run along the panel's columns: read them in order.
                            for (p, row) in panel.chunks_exact_mut(nr).enumerate() {
                                let at = col0 + p * rs;
                                for (l, v) in row[..w].iter_mut().enumerate() {
                                    *v = value(at + l * cs);
                                }
                                row[w..].fill(0.0);
                            }
                        } else {
                            // A transposed weight: each panel column is a run of one of its rows.
                            for l in 0..nr {
                                for p in 0..kc {
                                    panel[p * nr + l] = if l < w {
                                        value(col0 + l * cs + p * rs)
                                    } else {
                                        0.0
                                    };
                                }
                            }
                        }
                    }
                })
            },
        )
    }

    /// A bf16 `b` read in order from `(p0, j0)`: its values from there on, and its row
    /// stride; `None` for any other.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn bf16_rows(&self, (p0, j0): (usize, usize)) -> Option<(&'a [u16], usize)> {
        let first = self.origin + p0 * self.rs + j0 * self.cs;
        (self.base == QuantizeBase::Bf16 && self.cs == 1)
            .then(|| self.halves.get(first..).map(|h| (h, self.rs)))
            .flatten()
    }

    /// Decodes row `i` of `b` (`row.len()` columns) into `row`: an embedding's gather.
    pub(crate) fn decode_row(&self, i: usize, row: &mut [f32]) {
        let (first, cs) = (self.origin + i * self.rs, self.cs);
        decoding!(self, |value| row
            .iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = value(first + j * cs)))
    }

    /// Decodes `kb` rows of `b` from row `p0` into `out` in the orientation the weight's own
    /// strides have (row-major where its columns are contiguous, else column-major), so the
    /// gemm crate reads it as it would have read the dequantized weight; returns its strides.
    fn decode_panel(&self, (p0, kb): (usize, usize), n: usize, out: &mut [f32]) -> (isize, isize) {
        let first = self.origin + p0 * self.rs;
        let (rs, cs) = (self.rs, self.cs);
        decoding!(self, |value| {
            if cs <= rs {
                for (p, row) in out[..kb * n].chunks_exact_mut(n).enumerate() {
                    let at = first + p * rs;
                    row.iter_mut()
                        .enumerate()
                        .for_each(|(j, v)| *v = value(at + j * cs));
                }
                (n as isize, 1)
            } else {
                for (j, col) in out[..kb * n].chunks_exact_mut(kb).enumerate() {
                    let at = first + j * cs;
                    col.iter_mut()
                        .enumerate()
                        .for_each(|(p, v)| *v = value(at + p * rs));
                }
                (1, kb as isize)
            }
        })
    }
}

/// `c (+)= a · b (+ bias)` with `b` the quantized weight `w`, `a` and `c` strided as in
/// [`super::gemm_raw`] (`c`'s columns contiguous). The bias (`n` values) only without
/// `accumulate`. `workspace` is the planned panel ([`snug_graph::ops::quantized_read::panel_elems`]);
/// where it is short (a product planned for our kernel that finds its packing space in use, a
/// plan for another CPU) the panel is allocated here.
///
/// # Safety
/// `a` and `c` must be valid for the elements their strides reach; `w`'s codes must cover `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_quantized(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    w: QuantB<'_>,
    bias: Option<&[f32]>,
    accumulate: bool,
    par: ::gemm::Parallelism,
    workspace: &mut [f32],
) {
    debug_assert!(bias.is_none() || !accumulate);
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = super::own_kernel((m, n, k), 1, super::Arith::F32) {
        let product = super::Product {
            dims: (m, n, k),
            c: (c, c_rs, 1),
            a: (a, a_rs, a_cs),
            b: (std::ptr::NonNull::dangling().as_ptr(), 0, 0),
            scale: 1.0,
            accumulate,
        };
        let fused = super::Fused {
            prologue: super::Prologue::None,
            bias,
            quant_b: Some(w),
            half_a: None,
            arith: super::Arith::F32,
        };
        // SAFETY: `own_kernel` checked the CPU; the caller vouches for the operands, and the
        // packing reads `b` from the codes only.
        if unsafe { super::own_gemm(tile, product, par, fused) } {
            return;
        }
    }
    let mut acc = accumulate;
    if let Some(bias) = bias {
        for i in 0..m {
            // SAFETY: row `i` of `c` holds `n` floats, as the caller vouched.
            let row = unsafe { std::slice::from_raw_parts_mut(c.offset(i as isize * c_rs), n) };
            row.copy_from_slice(&bias[..n]);
        }
        acc = true;
    }
    let panel = PANEL.min(k).max(1);
    let mut own = Vec::new();
    let ws = if workspace.len() >= panel * n {
        &mut workspace[..panel * n]
    } else {
        own.resize(panel * n, 0.0);
        &mut own[..]
    };
    for p0 in (0..k).step_by(panel) {
        let kb = panel.min(k - p0);
        let (b_rs, b_cs) = w.decode_panel((p0, kb), n, ws);
        // SAFETY: columns p0..p0+kb of `a` lie inside it; the panel holds `kb × n`.
        unsafe {
            super::gemm_raw(
                (m, n, kb),
                (c, c_rs, 1),
                (a.offset(p0 as isize * a_cs), a_rs, a_cs),
                (ws.as_ptr(), b_rs, b_cs),
                1.0,
                acc || p0 > 0,
                par,
                super::Arith::F32,
            )
        };
    }
}

/// Panels of `nr` columns of a bf16 `b` whose rows are `rs` apart and columns contiguous,
/// widened into `out` (`kc · nr` floats a panel, zero columns past `nc`).
struct WidenPanels<'a> {
    halves: &'a [u16],
    rs: usize,
    dims: (usize, usize, usize),
    out: *mut f32,
}

impl crate::isa::Loop for WidenPanels<'_> {
    #[inline(always)]
    fn run(self) {
        let (kc, nc, nr) = self.dims;
        for j in (0..nc).step_by(nr) {
            let w = nr.min(nc - j);
            // SAFETY: panel `j` holds `kc · nr` floats inside `out`, as `pack_b`'s caller
            // vouched.
            let panel = unsafe { std::slice::from_raw_parts_mut(self.out.add(j * kc), kc * nr) };
            for (p, row) in panel.chunks_exact_mut(nr).enumerate() {
                let from = &self.halves[j + p * self.rs..][..w];
                for (v, &h) in row[..w].iter_mut().zip(from) {
                    *v = f32::from_bits((h as u32) << 16);
                }
                row[w..].fill(0.0);
            }
        }
    }
}
