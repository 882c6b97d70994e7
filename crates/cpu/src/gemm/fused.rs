//! What a product takes in as our kernel packs and stores it: a transform of `a` (a LayerNorm
//! or GELU) and a bias, so the op feeding a GEMM never writes its output to memory.
// Only our x86-64 tiles read a prologue as they pack; on other CPUs `gemm_fused` declines and
// the caller materialises the prologue's output, so most of this is unread there.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

/// A transform of `a`'s elements made as they are packed, so that the elementwise op feeding a
/// GEMM never writes its output to memory: each element is transformed once per product (every
/// blocking packs each element of `a` once), by the thread that packs it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Prologue<'a> {
    None,
    /// LayerNorm from saved statistics, `(v - mean[t]) · rstd[t] · w[f] + b[f]` in the order
    /// the LayerNorm kernels round it, so the values are bitwise theirs. Element `(i, p)` of `a`
    /// is token `i`, feature `p` when `tokens_down`, else token `p`, feature `i` (`a` is the
    /// transposed activation of a weight gradient).
    LayerNorm {
        mean: &'a [f32],
        rstd: &'a [f32],
        w: &'a [f32],
        b: &'a [f32],
        tokens_down: bool,
    },
    /// GELU of every element, the scalar function vectorised, so bitwise its values.
    Gelu(snug_graph::ops::GeluApprox),
}

/// What a product fuses: a [`Prologue`] on `a`, and a bias (one per column of `c`) added where
/// the first block of the inner dimension is stored, instead of `c` being filled with it first;
/// and where `b` is a frozen weight stored quantized, its codes, decoded as `b` is packed (the
/// product's `b` pointer is then not read).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fused<'a> {
    pub prologue: Prologue<'a>,
    pub bias: Option<&'a [f32]>,
    pub quant_b: Option<super::quantized::QuantB<'a>>,
    /// `a` held in bf16, widened as it is packed (the product's `a` pointer is then not read).
    pub half_a: Option<super::half::HalfA<'a>>,
    /// The arithmetic the product computes in.
    pub arith: super::Arith,
}

impl Fused<'_> {
    pub(crate) const NONE: Fused<'static> = Fused {
        prologue: Prologue::None,
        bias: None,
        quant_b: None,
        half_a: None,
        arith: super::Arith::F32,
    };

    /// The bias from column `j` on, or null.
    pub(crate) fn bias_at(&self, j: usize) -> *const f32 {
        self.bias.map_or(std::ptr::null(), |b| b[j..].as_ptr())
    }
}
