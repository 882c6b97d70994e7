//! 8-bit AdamW (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022): the
//! update of [`AdamW`](super::AdamW), with both moments stored as one byte per element.
//!
//! Each moment is cut into blocks of [`BLOCK`] elements; a block keeps one f32, its largest
//! magnitude (absmax), and each element's index into a 256-entry code book of values in
//! [-1, 1] (the nearest entry to `x / absmax`). The code books are the paper's *dynamic*
//! (non-linear) quantization, as `bitsandbytes.functional.create_dynamic_map` builds them: for
//! `i` in `0..7`, the decade `10^(i-6)` times the midpoints of `linspace(0.1, 1, k + 1)`,
//! with `k = 2^i` (signed book, both signs) or `k = 2^(i+1)` (unsigned book), plus 0 and 1.
//! The first moment uses the signed book (254 entries ±, 0, 1), the second, never negative,
//! the unsigned one (254 positive entries, 0, 1), which spends the sign bit on precision.
//! Small magnitudes get many codes (down to 5.5e-7 of the block's absmax), large ones few.
//!
//! The master weights stay f32. Each step dequantizes a block's moments, runs AdamW on them
//! in f32, updates the weights with the new f32 moments, and requantizes them with the new
//! block absmax.

use super::{expect_dtype, shape_err, AdamW, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Elements per quantization block: one f32 absmax each (the paper's and bitsandbytes'
/// block size for 8-bit optimizers).
pub const BLOCK: usize = 2048;

/// Parameters with fewer elements keep f32 moments under 8-bit AdamW, as bitsandbytes'
/// `min_8bit_size` default: biases and norm gains, whose state is a few kilobytes in all, and
/// whose one block would share a single absmax across values of very different sizes.
pub const MIN_8BIT_SIZE: usize = 4096;

/// Blocks of a tensor of `numel` elements (the last one may be partial).
pub fn blocks(numel: usize) -> usize {
    numel.div_ceil(BLOCK)
}

/// The dynamic code book, sorted ascending: signed (for the first moment) or unsigned (for
/// the second). See the module's documentation for its definition.
pub fn dynamic_code(signed: bool) -> [f32; 256] {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let k = if signed {
            1usize << i
        } else {
            1usize << (i + 1)
        };
        // linspace(0.1, 1, k + 1) and the midpoints of its k intervals.
        let b = |j: usize| 0.1 + 0.9 * j as f64 / k as f64;
        let decade = 10f64.powi(i - 6);
        for j in 0..k {
            let mid = (b(j) + b(j + 1)) / 2.0;
            data.push(decade * mid);
            if signed {
                data.push(-decade * mid);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.sort_by(f64::total_cmp);
    let mut code = [0f32; 256];
    for (c, d) in code.iter_mut().zip(&data) {
        *c = *d as f32;
    }
    code
}

/// The index of the code-book entry nearest `x` (ties to the lower entry); `code` ascending.
pub fn nearest_code(code: &[f32; 256], x: f32) -> u8 {
    // The first entry ≥ x, then the closer of it and the one below.
    let hi = code.partition_point(|&c| c < x);
    if hi == 0 {
        return 0;
    }
    if hi == 256 {
        return 255;
    }
    let lo = hi - 1;
    if x - code[lo] <= code[hi] - x {
        lo as u8
    } else {
        hi as u8
    }
}

/// [`nearest_code`] through a table over the top 16 bits of `x` (sign, exponent and 7 bits
/// of mantissa): the nearest code is monotone in `x`, so where both ends of a bucket have the
/// same code every value in it does, and only the buckets that straddle a midpoint between
/// two codes search. Bitwise [`nearest_code`]'s answer, without the search per element
/// that dominated an 8-bit step.
#[derive(Debug, Clone)]
pub struct CodeIndex {
    code: [f32; 256],
    /// The codes of each bucket's two ends, by bit pattern.
    ends: Box<[[u8; 2]]>,
}

impl CodeIndex {
    pub fn new(code: &[f32; 256]) -> CodeIndex {
        let ends = (0..=u16::MAX as u32)
            .map(|b| {
                let low = f32::from_bits(b << 16);
                let high = f32::from_bits((b << 16) | 0xFFFF);
                [nearest_code(code, low), nearest_code(code, high)]
            })
            .collect();
        CodeIndex { code: *code, ends }
    }

    #[inline]
    pub fn nearest(&self, x: f32) -> u8 {
        let [a, b] = self.ends[(x.to_bits() >> 16) as usize];
        if a == b {
            a
        } else {
            nearest_code(&self.code, x)
        }
    }
}

/// Quantizes `x` into `q` block by block, writing each block's absmax to `absmax`
/// (`absmax.len() == blocks(x.len())`). A block of zeros has absmax 0 and codes of 0.
pub fn quantize(code: &[f32; 256], x: &[f32], q: &mut [u8], absmax: &mut [f32]) {
    let index = CodeIndex::new(code);
    for ((x, q), a) in x.chunks(BLOCK).zip(q.chunks_mut(BLOCK)).zip(absmax) {
        *a = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if *a > 0.0 { 1.0 / *a } else { 0.0 };
        for (q, &v) in q.iter_mut().zip(x) {
            *q = index.nearest(v * inv);
        }
    }
}

/// The values `q` and `absmax` stand for, block by block.
pub fn dequantize(code: &[f32; 256], q: &[u8], absmax: &[f32], x: &mut [f32]) {
    for ((x, q), &a) in x.chunks_mut(BLOCK).zip(q.chunks(BLOCK)).zip(absmax) {
        for (x, &q) in x.iter_mut().zip(q) {
            *x = code[q as usize] * a;
        }
    }
}

/// Inputs `[param, grad, m, v, m_absmax, v_absmax]` and optionally a scalar `[scale]` the
/// gradient is multiplied by (as [`AdamW`]); `m` and `v` are u8 codes shaped as the
/// parameter, the absmaxes f32 `[blocks(numel)]`. Writes the parameter, the codes and the
/// absmaxes. Runs on the last micro-batch only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW8bit {
    pub adamw: AdamW,
}

impl OpRule for AdamW8bit {
    fn name(&self) -> &'static str {
        "adamw8bit"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        super::check_update_inputs(self.name(), inputs, 6)?;
        for (i, dtype) in [
            (0, DType::F32),
            (2, DType::U8),
            (3, DType::U8),
            (4, DType::F32),
            (5, DType::F32),
        ] {
            expect_dtype(self.name(), inputs, i, dtype)?;
        }
        let nb = blocks(inputs[0].numel());
        for i in [4, 5] {
            if inputs[i].shape != [nb] {
                return Err(shape_err(
                    self.name(),
                    format!(
                        "absmax input {i} has shape {:?}, expected [{nb}] (one per {BLOCK} elements)",
                        inputs[i].shape
                    ),
                ));
            }
        }
        super::check_persistent("adamw8bit", inputs, self.mutates_inputs().iter().copied())?;
        Ok(vec![])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "adamw8bit",
            detail: "an optimizer update has no gradient".into(),
        })
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[0, 2, 3, 4, 5]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        // AdamW's 12, two dequantizations, two absmaxes and two searches of 8 comparisons.
        32 * inputs[0].numel() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries from the published definition, computed by hand.
    #[test]
    fn code_books_hold_the_published_entries() {
        let s = dynamic_code(true);
        let u = dynamic_code(false);
        for c in [&s, &u] {
            assert!(c.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
            assert_eq!(c[255], 1.0);
        }
        // Signed: the largest below 1 is the midpoint of the last interval of
        // linspace(0.1, 1, 65): (0.1 + 0.9·63/64 + 1) / 2 = 0.99296875.
        assert_eq!(s[254], 0.99296875);
        // The most negative is its mirror; 1 has none.
        assert_eq!(s[0], -0.99296875);
        // Zero sits between the 127 negatives and the smallest positive, 1e-6 · 0.55.
        assert_eq!(s[127], 0.0);
        assert_eq!(s[128], 0.55e-6);
        // Unsigned: zero first, then 1e-6 · midpoints of linspace(0.1, 1, 3): 0.325, 0.775.
        assert_eq!(u[0], 0.0);
        assert_eq!(u[1], 0.325e-6);
        assert_eq!(u[2], 0.775e-6);
        // The largest below 1: (0.1 + 0.9·127/128 + 1) / 2.
        assert_eq!(u[254], ((0.1 + 0.9 * 127.0 / 128.0 + 1.0) / 2.0) as f32);
    }

    #[test]
    fn the_code_index_is_the_search_bit_for_bit() {
        // splitmix64: no generator crate for one test.
        let mut state = 8u64;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        for signed in [true, false] {
            let code = dynamic_code(signed);
            let index = CodeIndex::new(&code);
            // Every code, its neighbours in bits, every midpoint and its neighbours, random
            // values over the scaled range and beyond, and the special values.
            let mut xs: Vec<f32> = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
            for w in code.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                for v in [w[0], mid] {
                    xs.extend([v, v.next_up(), v.next_down()]);
                }
            }
            xs.extend(
                (0..200_000).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 3.0 - 1.5),
            );
            xs.extend((0..20_000).map(|_| f32::from_bits(next() as u32)));
            for x in xs {
                assert_eq!(index.nearest(x), nearest_code(&code, x), "{x:e}");
            }
        }
    }

    #[test]
    fn nearest_code_picks_the_closer_neighbour() {
        let s = dynamic_code(true);
        assert_eq!(nearest_code(&s, 0.0), 127);
        assert_eq!(nearest_code(&s, 1.0), 255);
        assert_eq!(nearest_code(&s, -1.0), 0);
        assert_eq!(nearest_code(&s, 2.0), 255);
        // Just above the midpoint of s[253] and s[254] rounds up, just below rounds down.
        let mid = (s[253] + s[254]) / 2.0;
        assert_eq!(nearest_code(&s, mid + 1e-4), 254);
        assert_eq!(nearest_code(&s, mid - 1e-4), 253);
    }

    /// Two blocks and a partial third: each block's absmax, and every value back within half
    /// the gap between its neighbouring entries (times the absmax).
    #[test]
    fn round_trip_per_block_with_a_partial_last_block() {
        let s = dynamic_code(true);
        let n = 2 * BLOCK + 5;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.37).sin()) * if i < BLOCK { 3.0 } else { 0.01 })
            .collect();
        let mut q = vec![0u8; n];
        let mut a = vec![0f32; blocks(n)];
        assert_eq!(a.len(), 3);
        quantize(&s, &x, &mut q, &mut a);
        for (b, chunk) in x.chunks(BLOCK).enumerate() {
            assert_eq!(a[b], chunk.iter().fold(0f32, |m, v| m.max(v.abs())));
        }
        // The element holding a block's absmax maps to ±1 or the top entry below it.
        let mut back = vec![0f32; n];
        dequantize(&s, &q, &a, &mut back);
        for i in 0..n {
            let blk = a[i / BLOCK];
            let k = q[i] as usize;
            let gap_lo = if k > 0 { s[k] - s[k - 1] } else { 0.0 };
            let gap_hi = if k < 255 { s[k + 1] - s[k] } else { 0.0 };
            let err = (back[i] - x[i]).abs();
            assert!(
                err <= gap_lo.max(gap_hi) / 2.0 * blk * 1.0001,
                "{i}: {} -> {}",
                x[i],
                back[i]
            );
        }
        // Hand-computed: x = absmax maps to code 255 (1.0) and comes back exactly.
        let x = [0.5f32, -0.25, 0.0];
        let mut q = [0u8; 3];
        let mut a = [0f32; 1];
        quantize(&s, &x, &mut q, &mut a);
        assert_eq!(a[0], 0.5);
        assert_eq!(q, [255, nearest_code(&s, -0.5), 127]);
        // -0.5 lies between -0.50078125 and -0.48671875 (the midpoints of linspace(0.1, 1, 65)
        // at 0.1 + 0.9·28.5/64 and 0.1 + 0.9·27.5/64): nearer the first.
        assert_eq!(s[q[1] as usize], -0.50078125);
        let mut back = [0f32; 3];
        dequantize(&s, &q, &a, &mut back);
        assert_eq!(back, [0.5, -0.50078125 * 0.5, 0.0]);
        // A block of zeros: absmax 0, all zero codes, zeros back.
        let mut q = [9u8; 4];
        let mut a = [7f32; 1];
        quantize(&s, &[0.0; 4], &mut q, &mut a);
        assert_eq!((q, a), ([127; 4], [0.0]));
    }
}
