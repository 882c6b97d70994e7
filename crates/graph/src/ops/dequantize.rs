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

use super::{expect_arity, expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, Result};

/// Values per NF4 block (one absmax each).
pub const NF4_BLOCK: usize = 64;

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
}

impl QuantizeBase {
    pub fn name(self) -> &'static str {
        match self {
            QuantizeBase::Bf16 => "bf16",
            QuantizeBase::Int8 => "int8",
            QuantizeBase::Nf4 => "nf4",
        }
    }

    /// The scheme of the codes and scales, for the two that have them.
    pub fn scheme(self) -> Option<QuantScheme> {
        match self {
            QuantizeBase::Bf16 => None,
            QuantizeBase::Int8 => Some(QuantScheme::Int8),
            QuantizeBase::Nf4 => Some(QuantScheme::Nf4),
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
}

impl QuantScheme {
    pub fn codes_shape(self, shape: &[usize]) -> Vec<usize> {
        match self {
            QuantScheme::Int8 => shape.to_vec(),
            QuantScheme::Nf4 => vec![shape.iter().product::<usize>().div_ceil(2)],
        }
    }

    pub fn absmax_shape(self, shape: &[usize]) -> Vec<usize> {
        match self {
            QuantScheme::Int8 => vec![shape.last().copied().unwrap_or(1)],
            QuantScheme::Nf4 => vec![shape.iter().product::<usize>().div_ceil(NF4_BLOCK)],
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
        }
    }
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
