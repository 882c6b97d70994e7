//! Frozen weights stored quantized, and [`Dequantize`], which gives their f32 values to the op
//! that reads them. Only weights that never train are stored this way (LoRA's base, QLoRA's
//! NF4 base, Dettmers et al. 2023): nothing writes them after the session loads them.
//!
//! - bf16: each value rounded to nearest even; read through a [`super::Cast`].
//! - int8: per output channel (a column of the `[in, out]` weight), `code · absmax / 127` with
//!   `code = round(x · 127 / absmax)` in −127..=127.
//! - NF4: blocks of [`NF4_BLOCK`] consecutive values (row-major), each `NF4[code] · absmax` of
//!   its block, the code the nearest of the 16 NormalFloat4 values; two codes a byte, the
//!   first in the high nibble (as bitsandbytes packs them).
//! - NF4 with double quantization (QLoRA's, bitsandbytes' `compress_statistics`): the blocks'
//!   absmax constants are themselves stored in 8 bits. Their mean (the offset) is taken out,
//!   and what is left is quantized in blocks of [`DQ_BLOCK`] with the signed dynamic code book
//!   of 8-bit AdamW ([`super::adamw8bit::dynamic_code`]), one f32 scale a block: a block's
//!   absmax is `DQ[code] · scale + offset`. The absmax codes follow the NF4 codes in the same
//!   u8 tensor; the f32 "absmax" tensor holds the scales, then the offset.

use super::{expect_arity, expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, Result};

/// Values per NF4 block (one absmax each).
pub const NF4_BLOCK: usize = 64;

/// NF4 absmax constants per block of double quantization (one f32 scale each; QLoRA's 256).
pub const DQ_BLOCK: usize = 256;

/// The code book of double-quantized absmax constants: the signed dynamic map, ascending.
pub fn dq_code() -> &'static [f32; 256] {
    static CODE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    CODE.get_or_init(|| super::adamw8bit::dynamic_code(true))
}

/// The NormalFloat4 code book of QLoRA (Dettmers et al. 2023, appendix E; bitsandbytes'
/// `create_normal_map(0.9677083)`): the quantiles of N(0, 1) normalised to [−1, 1], eight on
/// the positive side, seven on the negative, and an exact zero.
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// How frozen weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantizeBase {
    Bf16,
    Int8,
    Nf4,
    /// NF4 with its absmax constants double-quantized (`--quantize-base nf4 --double-quant`).
    #[serde(rename = "nf4-dq")]
    Nf4Dq,
}

impl QuantizeBase {
    pub fn name(self) -> &'static str {
        match self {
            QuantizeBase::Bf16 => "bf16",
            QuantizeBase::Int8 => "int8",
            QuantizeBase::Nf4 => "nf4",
            QuantizeBase::Nf4Dq => "nf4-dq",
        }
    }

    /// The scheme of the codes and scales, for the two that have them.
    pub fn scheme(self) -> Option<QuantScheme> {
        match self {
            QuantizeBase::Bf16 => None,
            QuantizeBase::Int8 => Some(QuantScheme::Int8),
            QuantizeBase::Nf4 => Some(QuantScheme::Nf4),
            QuantizeBase::Nf4Dq => Some(QuantScheme::Nf4Dq),
        }
    }

    /// The stored tensors of a weight of `shape`: the codes' dtype and shape, and the absmax
    /// scales' shape (f32), if any.
    pub fn storage(self, shape: &[usize]) -> (DType, Vec<usize>, Option<Vec<usize>>) {
        match self.scheme() {
            None => (DType::BF16, shape.to_vec(), None),
            Some(s) => (DType::U8, s.codes_shape(shape), Some(s.absmax_shape(shape))),
        }
    }

    /// `values` (a weight of `shape`, row-major) as stored: the codes' bytes (bf16 as
    /// little-endian pairs) and the scales (empty for bf16).
    pub fn quantize(self, values: &[f32], shape: &[usize]) -> (Vec<u8>, Vec<f32>) {
        match self.scheme() {
            None => (
                values
                    .iter()
                    .flat_map(|&v| bf16_bits(v).to_le_bytes())
                    .collect(),
                Vec::new(),
            ),
            Some(s) => s.quantize(values, shape),
        }
    }

    /// The f32 values of a weight of `shape` stored as `codes` and `absmax`: what the step's
    /// ops read.
    pub fn dequantize(self, codes: &[u8], absmax: &[f32], shape: &[usize]) -> Vec<f32> {
        match self.scheme() {
            None => codes
                .chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
                .collect(),
            Some(s) => {
                let mut out = vec![0.0; shape.iter().product()];
                s.dequantize_range(
                    codes,
                    absmax,
                    shape.last().copied().unwrap_or(1),
                    0,
                    &mut out,
                );
                out
            }
        }
    }
}

impl std::fmt::Display for QuantizeBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for QuantizeBase {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(QuantizeBase::Bf16),
            "int8" => Ok(QuantizeBase::Int8),
            "nf4" => Ok(QuantizeBase::Nf4),
            other => Err(format!(
                "unknown base quantization `{other}` (expected bf16, int8 or nf4)"
            )),
        }
    }
}

/// bf16 bits of `x`, rounded to nearest even (NaN stays NaN).
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The byte-coded schemes: codes in `u8` plus f32 absmax scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    Int8,
    Nf4,
    Nf4Dq,
}

impl QuantScheme {
    pub fn codes_shape(self, shape: &[usize]) -> Vec<usize> {
        let numel: usize = shape.iter().product();
        match self {
            QuantScheme::Int8 => shape.to_vec(),
            QuantScheme::Nf4 => vec![numel.div_ceil(2)],
            // The absmax codes follow the values' codes.
            QuantScheme::Nf4Dq => vec![numel.div_ceil(2) + numel.div_ceil(NF4_BLOCK)],
        }
    }

    pub fn absmax_shape(self, shape: &[usize]) -> Vec<usize> {
        let numel: usize = shape.iter().product();
        match self {
            QuantScheme::Int8 => vec![shape.last().copied().unwrap_or(1)],
            QuantScheme::Nf4 => vec![numel.div_ceil(NF4_BLOCK)],
            // One scale per block of absmax codes, then the offset.
            QuantScheme::Nf4Dq => vec![numel.div_ceil(NF4_BLOCK).div_ceil(DQ_BLOCK) + 1],
        }
    }

    fn quantize(self, values: &[f32], shape: &[usize]) -> (Vec<u8>, Vec<f32>) {
        match self {
            QuantScheme::Int8 => {
                let cols = shape.last().copied().unwrap_or(1).max(1);
                let mut absmax = vec![0f32; cols];
                for row in values.chunks(cols) {
                    for (a, &v) in absmax.iter_mut().zip(row) {
                        *a = a.max(v.abs());
                    }
                }
                let codes = values
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        let a = absmax[i % cols];
                        let q = if a > 0.0 {
                            (v * 127.0 / a).round()
                        } else {
                            0.0
                        };
                        q.clamp(-127.0, 127.0) as i8 as u8
                    })
                    .collect();
                (codes, absmax)
            }
            QuantScheme::Nf4Dq => {
                let (mut codes, absmax) = QuantScheme::Nf4.quantize(values, shape);
                let (absmax_codes, stats) = double_quantize(&absmax);
                codes.extend(absmax_codes);
                (codes, stats)
            }
            QuantScheme::Nf4 => {
                let mut codes = vec![0u8; values.len().div_ceil(2)];
                let mut absmax = Vec::with_capacity(values.len().div_ceil(NF4_BLOCK));
                for (b, block) in values.chunks(NF4_BLOCK).enumerate() {
                    let a = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                    absmax.push(a);
                    for (j, &v) in block.iter().enumerate() {
                        let c = nf4_code(if a > 0.0 { v / a } else { 0.0 });
                        let i = b * NF4_BLOCK + j;
                        codes[i / 2] |= if i.is_multiple_of(2) { c << 4 } else { c };
                    }
                }
                (codes, absmax)
            }
        }
    }

    /// Dequantizes the values `start..start + out.len()` of a weight with `cols` columns
    /// (row-major) into `out`; for NF4, `start` is a multiple of two.
    pub fn dequantize_range(
        self,
        codes: &[u8],
        absmax: &[f32],
        cols: usize,
        start: usize,
        out: &mut [f32],
    ) {
        match self {
            QuantScheme::Int8 => {
                let cols = cols.max(1);
                for (j, o) in out.iter_mut().enumerate() {
                    let i = start + j;
                    *o = int8_value(codes[i], absmax[i % cols]);
                }
            }
            QuantScheme::Nf4 => {
                for (j, o) in out.iter_mut().enumerate() {
                    let i = start + j;
                    let byte = codes[i / 2];
                    let c = if i.is_multiple_of(2) {
                        byte >> 4
                    } else {
                        byte & 0xf
                    };
                    *o = NF4[c as usize] * absmax[i / NF4_BLOCK];
                }
            }
            QuantScheme::Nf4Dq => {
                let dq = DoubleQuant::of(codes, absmax, dq_values_len(codes.len()));
                for (j, o) in out.iter_mut().enumerate() {
                    let i = start + j;
                    let byte = codes[i / 2];
                    let c = if i.is_multiple_of(2) {
                        byte >> 4
                    } else {
                        byte & 0xf
                    };
                    *o = NF4[c as usize] * dq.absmax(i / NF4_BLOCK);
                }
            }
        }
    }
}

/// How many of a double-quantized weight's `len` bytes of codes are its values' (the rest
/// are its absmax codes, one per 32 of those bytes): `len = h + ceil(h / 32)`, which grows
/// with `h`, so `len` alone gives `h`.
pub fn dq_values_len(len: usize) -> usize {
    // h + h/32 ≤ len, so h ≤ 32·len/33: count down from there.
    let mut h = len / 33 * 32 + (len % 33) * 32 / 33;
    while h > 0 && h + h.div_ceil(32) > len {
        h -= 1;
    }
    h
}

/// A double-quantized weight's absmax constants: their codes (after the values' `half`
/// bytes of codes) and the f32 scales, then the offset.
#[derive(Debug, Clone, Copy)]
pub struct DoubleQuant<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    pub offset: f32,
}

impl<'a> DoubleQuant<'a> {
    /// The absmax codes of `codes` past its first `half` bytes, and `stats` split into the
    /// scales and the offset.
    pub fn of(codes: &'a [u8], stats: &'a [f32], half: usize) -> DoubleQuant<'a> {
        let (scales, offset) = stats.split_at(stats.len().saturating_sub(1));
        DoubleQuant {
            codes: &codes[half..],
            scales,
            offset: offset.first().copied().unwrap_or(0.0),
        }
    }

    /// The absmax of NF4 block `b`.
    #[inline(always)]
    pub fn absmax(&self, b: usize) -> f32 {
        dq_code()[self.codes[b] as usize] * self.scales[b / DQ_BLOCK] + self.offset
    }
}

/// QLoRA's double quantization of NF4's absmax constants: their codes, and the
/// scales of their blocks of [`DQ_BLOCK`] followed by the offset (their mean, summed in f64
/// and rounded to f32). A code is the nearest entry of [`dq_code`] to `(absmax - offset) /
/// scale` (computed as a product with the scale's reciprocal, as 8-bit AdamW computes it); a
/// block of constants all equal to the offset has scale 0 and codes of that book's zero.
pub fn double_quantize(absmax: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let code = dq_code();
    let offset = if absmax.is_empty() {
        0.0
    } else {
        (absmax.iter().map(|&a| a as f64).sum::<f64>() / absmax.len() as f64) as f32
    };
    let mut codes = Vec::with_capacity(absmax.len());
    let mut stats = Vec::with_capacity(absmax.len().div_ceil(DQ_BLOCK) + 1);
    for block in absmax.chunks(DQ_BLOCK) {
        let centered: Vec<f32> = block.iter().map(|&a| a - offset).collect();
        let scale = centered.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        codes.extend(
            centered
                .iter()
                .map(|&v| super::adamw8bit::nearest_code(code, v * inv)),
        );
        stats.push(scale);
    }
    stats.push(offset);
    (codes, stats)
}

/// The value of an int8 code in a channel of absmax `a`.
#[inline]
pub fn int8_value(code: u8, a: f32) -> f32 {
    code as i8 as f32 * (a / 127.0)
}

/// The NF4 code nearest `x` (in [−1, 1]); a tie takes the lower code.
pub fn nf4_code(x: f32) -> u8 {
    let mut c = 0;
    while c < 15 && x > 0.5 * (NF4[c] + NF4[c + 1]) {
        c += 1;
    }
    c as u8
}

/// A frozen weight's f32 values from its int8 or NF4 codes (input 0, u8) and absmax scales
/// (input 1, f32): `[.., out]` of `shape`. Made just before each op that reads the weight,
/// so the f32 copy lives only as long as that op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dequantize {
    pub scheme: QuantScheme,
    pub shape: Vec<usize>,
}

impl OpRule for Dequantize {
    fn name(&self) -> &'static str {
        "dequantize"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 2)?;
        expect_dtype(self.name(), inputs, 0, DType::U8)?;
        expect_dtype(self.name(), inputs, 1, DType::F32)?;
        let codes = self.scheme.codes_shape(&self.shape);
        let absmax = self.scheme.absmax_shape(&self.shape);
        if inputs[0].shape != codes || inputs[1].shape != absmax {
            return Err(shape_err(
                self.name(),
                format!(
                    "a {:?} weight stored as {:?} takes codes {codes:?} and absmax {absmax:?}, \
                     got {:?} and {:?}",
                    self.shape, self.scheme, inputs[0].shape, inputs[1].shape
                ),
            ));
        }
        Ok(vec![OutSpec::f32(self.shape.clone())])
    }

    /// Only frozen weights are stored quantized: nothing asks for their gradient.
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if ctx.grad_out(0).is_some() {
            return Err(crate::GraphError::Invalid {
                op: "dequantize",
                detail: "a quantized weight is frozen and has no gradient".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Φ⁻¹ by bisection on Φ(x) = ½ + ∫₀ˣ φ, the integral by Simpson's rule (error far below
    /// f32's resolution).
    fn normal_ppf(p: f64) -> f64 {
        let cdf = |x: f64| {
            let n = 20_000;
            let h = x / n as f64;
            let phi = |t: f64| (-t * t / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let mut s = phi(0.0) + phi(x);
            for i in 1..n {
                s += phi(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
            }
            0.5 + s * h / 3.0
        };
        let (mut lo, mut hi) = (-10.0, 10.0);
        for _ in 0..80 {
            let mid = 0.5 * (lo + hi);
            if cdf(mid) < p {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    }

    /// bitsandbytes' `create_normal_map(offset=0.9677083, use_extra_value=True)`: eight
    /// positive quantiles of `linspace(offset, 0.5, 9)[:-1]`, seven negative of
    /// `linspace(offset, 0.5, 8)[:-1]`, zero, all over the largest (linspace in f32, as torch).
    #[test]
    fn nf4_code_book_is_rebuilt_from_its_definition() {
        let offset = 0.967_708_3_f32;
        let linspace = |n: usize| -> Vec<f64> {
            let step = (0.5 - offset) / (n - 1) as f32;
            (0..n - 1)
                .map(|i| (offset + step * i as f32) as f64)
                .collect()
        };
        let mut v: Vec<f64> = linspace(9).into_iter().map(normal_ppf).collect();
        v.extend(linspace(8).into_iter().map(|p| -normal_ppf(p)));
        v.push(0.0);
        v.sort_by(f64::total_cmp);
        let max = v[15];
        for (i, (&want, got)) in NF4.iter().zip(v.iter().map(|x| x / max)).enumerate() {
            assert!(
                (want as f64 - got).abs() < 1e-6,
                "NF4[{i}]: published {want}, rebuilt {got}"
            );
        }
    }

    #[test]
    fn int8_round_trip_against_hand_computed_values() {
        // [3, 2]: column absmax 1.0 and 0.5.
        let w = [1.0, 0.5, -0.5, -0.25, 0.25, 0.1];
        let (codes, absmax) = QuantizeBase::Int8.quantize(&w, &[3, 2]);
        assert_eq!(absmax, vec![1.0, 0.5]);
        // -0.5·127 = -63.5 rounds away from zero; 0.1·254 = 25.4.
        let want: [i8; 6] = [127, 127, -64, -64, 32, 25];
        assert_eq!(codes, want.map(|c| c as u8).to_vec());
        let back = QuantizeBase::Int8.dequantize(&codes, &absmax, &[3, 2]);
        let exact = [
            127.0 * (1.0 / 127.0),
            127.0 * (0.5 / 127.0),
            -64.0 * (1.0 / 127.0),
            -64.0 * (0.5 / 127.0),
            32.0 * (1.0 / 127.0),
            25.0 * (0.5 / 127.0),
        ];
        assert_eq!(back, exact.to_vec());
    }

    #[test]
    fn nf4_round_trip_against_hand_computed_values() {
        // One full block (absmax 2) and a partial one of three values (absmax 0.5).
        let mut w = vec![0.0f32; 67];
        w[0] = -2.0; // -1 → code 0
        w[1] = 1.0; // 0.5: between 0.4407 and 0.5626, nearer 0.4407 → code 12
        w[2] = 0.1; // 0.05: between 0 and 0.0796, nearer 0.0796 → code 8
        w[64] = 0.5; // 1 → code 15
        w[65] = -0.2; // -0.4: nearest -0.3949 → code 3
        w[66] = 0.0; // code 7
        let (codes, absmax) = QuantizeBase::Nf4.quantize(&w, &[67]);
        assert_eq!(absmax, vec![2.0, 0.5]);
        assert_eq!(codes.len(), 34);
        assert_eq!(codes[0], 0x0c);
        assert_eq!(codes[1], 0x87);
        assert_eq!(codes[32], 0xf3);
        assert_eq!(codes[33], 0x70);
        let back = QuantizeBase::Nf4.dequantize(&codes, &absmax, &[67]);
        assert_eq!(back[0], -2.0);
        assert_eq!(back[1], NF4[12] * 2.0);
        assert_eq!(back[2], NF4[8] * 2.0);
        assert_eq!(back[3], 0.0);
        assert_eq!(back[64], 0.5);
        assert_eq!(back[65], NF4[3] * 0.5);
        assert_eq!(back[66], 0.0);
        // Quantizing the dequantized values again gives the same codes.
        assert_eq!(QuantizeBase::Nf4.quantize(&back, &[67]), (codes, absmax));
    }

    #[test]
    fn double_quantized_nf4_round_trip_against_hand_computed_values() {
        // Three NF4 blocks with absmax 3, 2 and 1: offset 2 (their mean), centered 1, 0, -1,
        // one block of constants with scale 1; codes the book's 1 (255), 0 (127) and its
        // most negative entry (0), -(1 + b) / 2 with b = 0.1 + 0.9 · 63/64.
        let mut w = vec![0.0f32; 192];
        w[0] = 3.0; // code 15
        w[64] = -2.0; // code 0
        w[128] = 1.0; // code 15
        w[129] = 0.5; // 0.5 of absmax 1: code 12
        let dq = QuantizeBase::Nf4Dq;
        let (c4, a4) = QuantizeBase::Nf4.quantize(&w, &[192]);
        assert_eq!(a4, vec![3.0, 2.0, 1.0]);
        let (absmax_codes, stats) = double_quantize(&a4);
        let mut codes = c4.clone();
        codes.extend(absmax_codes);
        assert_eq!(codes.len(), 96 + 3);
        assert_eq!(QuantScheme::Nf4Dq.codes_shape(&[192]), vec![99]);
        assert_eq!(QuantScheme::Nf4Dq.absmax_shape(&[192]), vec![2]);
        assert_eq!((codes[0], codes[32], codes[64]), (0xf7, 0x07, 0xfc));
        assert_eq!(&codes[96..], &[255, 127, 0]);
        assert_eq!(stats, vec![1.0, 2.0]);
        let book = dq_code();
        assert_eq!((book[255], book[127]), (1.0, 0.0));
        assert!((book[0] as f64 + (1.0 + 0.1 + 0.9 * 63.0 / 64.0) / 2.0).abs() < 1e-7);
        let back = dq.dequantize(&codes, &stats, &[192]);
        let a2 = book[0] * 1.0 + 2.0;
        assert_eq!(back[0], 3.0);
        assert_eq!(back[64], -2.0);
        assert_eq!(back[128], a2);
        assert_eq!(back[129], NF4[12] * a2);
        assert!(back
            .iter()
            .enumerate()
            .all(|(i, &v)| [0, 64, 128, 129].contains(&i) || v == 0.0));
        // Quantized whole, the same codes and statistics.
        assert_eq!(dq.quantize(&w, &[192]), (codes.clone(), stats.clone()));
    }

    #[test]
    fn double_quantization_blocks_of_256_scales_and_the_split_of_the_codes() {
        // 300 blocks of constants: two blocks of scales, the second partial.
        let absmax: Vec<f32> = (0..300).map(|i| 0.5 + (i % 17) as f32 * 0.25).collect();
        let (codes, stats) = double_quantize(&absmax);
        let offset = (absmax.iter().map(|&a| a as f64).sum::<f64>() / 300.0) as f32;
        assert_eq!(stats.len(), 3);
        assert_eq!(stats[2], offset);
        for (b, block) in absmax.chunks(DQ_BLOCK).enumerate() {
            let scale = block.iter().fold(0f32, |m, &a| m.max((a - offset).abs()));
            assert_eq!(stats[b], scale);
        }
        // Each constant comes back within half the book's widest gap (1/64 near ±1) times
        // its block's scale.
        let dq = DoubleQuant {
            codes: &codes,
            scales: &stats[..2],
            offset,
        };
        for (i, &a) in absmax.iter().enumerate() {
            let tol = stats[i / DQ_BLOCK] * (0.9 / 128.0) + 1e-6;
            assert!(
                (dq.absmax(i) - a).abs() <= tol,
                "{i}: {} vs {a}",
                dq.absmax(i)
            );
        }
        for numel in (1..5000usize).chain([1 << 20, (1 << 20) + 63]) {
            let half = numel.div_ceil(2);
            assert_eq!(
                dq_values_len(half + numel.div_ceil(NF4_BLOCK)),
                half,
                "{numel}"
            );
        }
    }

    #[test]
    fn bf16_round_trip_rounds_to_nearest_even() {
        let w = [1.0f32, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -3.5];
        let (codes, absmax) = QuantizeBase::Bf16.quantize(&w, &[4]);
        assert!(absmax.is_empty());
        let back = QuantizeBase::Bf16.dequantize(&codes, &[], &[4]);
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: even is 1; 1 + 3·2⁻⁸ goes up to 1 + 2⁻⁶.
        assert_eq!(back, vec![1.0, 1.0, 1.0 + 4.0 / 256.0, -3.5]);
    }

    #[test]
    fn dequantize_checks_its_inputs() {
        let op = Dequantize {
            scheme: QuantScheme::Nf4,
            shape: vec![8, 16],
        };
        let meta = |shape: &[usize], dtype| TensorMeta {
            name: "w".into(),
            shape: shape.to_vec(),
            dtype,
            role: crate::Role::Parameter,
            view_of: None,
        };
        let (c, a) = (meta(&[64], DType::U8), meta(&[2], DType::F32));
        assert_eq!(op.infer(&[&c, &a]).unwrap()[0].shape, vec![8, 16]);
        let short = meta(&[63], DType::U8);
        assert!(matches!(
            op.infer(&[&short, &a]),
            Err(crate::GraphError::Shape { .. })
        ));
        let f = meta(&[64], DType::F32);
        assert!(matches!(
            op.infer(&[&f, &a]),
            Err(crate::GraphError::DType { .. })
        ));
    }
}
