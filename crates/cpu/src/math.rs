//! Branch-free `exp` and `tanh` that the compiler vectorises (libm's are scalar calls, and
//! made GELU alone a third of a training step). Relative error below 1e-6 over f32's range.
//! Also GELU's scalar function, shared by its kernels and the GEMM prologue that applies it.

use std::f32::consts::LOG2_E;

use snug_graph::ops::GeluApprox;

/// `a·b + c`, rounded twice: the same bits at every [`crate::isa`] level, in every context.
/// (A fused `mul_add` is one instruction only where the caller is compiled with FMA; called
/// from code compiled for plain x86-64 it is a C library call per element, which made
/// attention 4× slower in a portable build.)
#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    a * b + c
}

/// e^x, flushing to 0 below -87 and saturating above 88.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest without a libm call: adding 1.5·2^23 pushes the fraction out.
    const SHIFT: f32 = 12_582_912.0;
    let r = fma(x, LOG2_E, SHIFT);
    let n = r - SHIFT;
    // Cody–Waite: subtract n·ln2 in two parts so that y keeps full precision for large |x|.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // |y| ≤ ln2 / 2.
    let y = fma(n, -LN2_LO, fma(n, -LN2_HI, x));
    // Taylor series of e^y to degree 7 (truncation error < 6e-9 on |y| ≤ 0.347), by Horner.
    const TAYLOR: [f32; 7] = [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    let mut p = 1.0 / 5040.0;
    for c in TAYLOR {
        p = fma(p, y, c);
    }
    // r's low mantissa bits hold n (|n| < 2^22): move them into the exponent field directly,
    // since a float-to-int `as` (saturating) does not vectorise.
    let k = r.to_bits().wrapping_sub(SHIFT.to_bits());
    let scale = f32::from_bits(k.wrapping_add(127) << 23);
    p * scale
}

/// tanh(x) from e^{-2|x|}: no branch, and no cancellation blow-up near 0 (absolute error
/// stays below 1e-7 there).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let e = exp(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// Lanes of independent partial results in [`sum`] and [`max`]: one AVX-512 register, so the
/// loop vectorises (a single running f32 sum is a serial dependency the compiler must keep).
const LANES: usize = 16;

/// Σ x, summed in 16 interleaved partial sums.
#[inline]
pub fn sum(x: &[f32]) -> f32 {
    sum_by(x, |v| v)
}

/// Σ f(x), summed in 16 interleaved partial sums.
#[inline(always)]
pub fn sum_by(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Σ aᵢbᵢ over the shorter of the two, in 16 interleaved partial sums.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &u), &v) in acc.iter_mut().zip(x).zip(y) {
            *s += u * v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest element (−∞ for an empty slice); NaNs are ignored, like `f32::max`.
#[inline]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    acc.iter().copied().fold(tail, f32::max)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π)
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `u = √(2/π)·(x + 0.044715·x³)`, the argument of GPT-2's tanh.
#[inline(always)]
fn tanh_arg(x: f32) -> f32 {
    SQRT_2_OVER_PI * (x + COEF * x * x * x)
}

/// GELU of `x`, the variant `approx` names: the kernels' and the GEMM prologue's one scalar
/// function, so that their values agree bit for bit.
#[inline(always)]
pub fn gelu(approx: GeluApprox, x: f32) -> f32 {
    match approx {
        // 0.5·(1 + tanh(u)) = σ(2u): one exp and one division, no sign juggling, and no
        // cancellation in 1 + tanh(u) for negative x.
        GeluApprox::Tanh => x / (1.0 + exp(-2.0 * tanh_arg(x))),
        GeluApprox::Exact => 0.5 * x * (1.0 + libm::erff(x * FRAC_1_SQRT_2)),
    }
}

/// `(gelu(x), gelu'(x))`, sharing the one tanh or erf between them.
#[inline(always)]
pub fn gelu_and_grad(approx: GeluApprox, x: f32) -> (f32, f32) {
    match approx {
        GeluApprox::Tanh => {
            // With s = σ(2u) = 0.5·(1 + tanh(u)): gelu = x·s and gelu' = s + 2x·s(1 - s)·u'.
            let s = 1.0 / (1.0 + exp(-2.0 * tanh_arg(x)));
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x * x);
            (x * s, s + 2.0 * x * s * (1.0 - s) * du)
        }
        GeluApprox::Exact => {
            let cdf = 0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2));
            (x * cdf, cdf + x * INV_SQRT_2PI * exp(-0.5 * x * x))
        }
    }
}

/// gelu'(x).
#[inline(always)]
pub fn gelu_grad(approx: GeluApprox, x: f32) -> f32 {
    gelu_and_grad(approx, x).1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_1e6_relative() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            assert!(((a - b) / b).abs() < 1e-6, "exp({x}) = {a}, std {b}");
            x += 0.0137;
        }
        assert_eq!(exp(-200.0), (-87.0f32).exp().max(exp(-87.0)));
    }

    #[test]
    fn lane_sum_and_max_match_serial() {
        for n in [0, 1, 15, 16, 17, 100, 257] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37) % 23) as f32 * 0.25 - 2.0)
                .collect();
            let serial: f32 = x.iter().sum();
            assert!(
                (sum(&x) - serial).abs() <= 1e-5 * (1.0 + serial.abs()),
                "n = {n}"
            );
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&x), m, "n = {n}");
            let serial: f32 = x.iter().map(|v| v * v).sum();
            assert!(
                (dot(&x, &x) - serial).abs() <= 1e-5 * (1.0 + serial),
                "n = {n}"
            );
        }
    }

    #[test]
    fn tanh_matches_std() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let (a, b) = (tanh(x), x.tanh());
            assert!(
                (a - b).abs() < 2e-7 + 1e-6 * b.abs(),
                "tanh({x}) = {a}, std {b}"
            );
            x += 0.001;
        }
    }

    /// Both variants and the tanh one's derivative against the textbook formulas in f64.
    #[test]
    fn values_and_slopes_match_the_formulas() {
        let mut x = -9.0f32;
        while x < 9.0 {
            let v = f64::from(x);
            let u = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
            let tanh_form = 0.5 * v * (1.0 + u.tanh());
            let du = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * v * v);
            let slope = 0.5 * (1.0 + u.tanh()) + 0.5 * v * (1.0 - u.tanh().powi(2)) * du;
            let exact = 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
            let close =
                |got: f32, want: f64| (f64::from(got) - want).abs() <= 2e-6 * (1.0 + want.abs());
            let (value, grad) = gelu_and_grad(GeluApprox::Tanh, x);
            assert!(
                close(gelu(GeluApprox::Tanh, x), tanh_form),
                "tanh gelu({x})"
            );
            assert!(
                close(value, tanh_form) && close(grad, slope),
                "tanh gelu'({x})"
            );
            assert!(close(gelu(GeluApprox::Exact, x), exact), "exact gelu({x})");
            x += 0.0173;
        }
    }
}
