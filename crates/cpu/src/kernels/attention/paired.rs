//! Causal attention's heads in bf16 arithmetic on AVX512-BF16, each head's operands paired
//! once ([`paired`](crate::gemm::avx512bf16::paired)). Every row block of a head reads all of
//! its keys and values (up to the block's end); through the tile's own packing each block
//! widened, transposed and paired them again. Here the queries, keys, values and output
//! gradients are paired straight from their bf16 bits (two neighbouring values of a row are
//! one 32-bit word, which is a pair as the tile reads it), keys and values once per head;
//! only the probabilities and score gradients, made in f32, are rounded as they are packed.
//! The numbers are [`head_forward`](super::head_forward)'s and
//! [`head_backward`](super::head_backward)'s on the same tile, up to the order of the sums.

use snug_graph::ops::attention::row_blocks;

use super::{softmax_causal_row, Rows};
use crate::gemm::avx512bf16::paired::{a_f32, a_len, a_words, b_len, b_rows, b_words, product};
use crate::gemm::Causal;

/// A head's rows in bf16: the first value and the distance between rows, in values.
#[derive(Clone, Copy)]
pub(in crate::kernels) struct Bits {
    pub ptr: *const u16,
    pub stride: usize,
}

impl Bits {
    /// The same rows from row `r` on.
    unsafe fn down(self, r: usize) -> Bits {
        Bits {
            // SAFETY: the caller keeps `r` inside the head.
            ptr: unsafe { self.ptr.add(r * self.stride) },
            ..self
        }
    }
}

/// Whether heads of `d` values, rows `stride` values apart from `base`, can be paired from
/// their words: `d` and the stride even and the bits 4-byte aligned, so every row starts on
/// a word.
pub(in crate::kernels) fn pairable(d: usize, stride: usize, base: *const u16) -> bool {
    d.is_multiple_of(2) && d > 0 && stride.is_multiple_of(2) && (base as usize).is_multiple_of(4)
}

/// The most rows a row block holds.
fn block_rows(t: usize) -> usize {
    row_blocks(t).map(|(r0, r1)| r1 - r0).max().unwrap_or(0)
}

/// The scratch pieces [`head_forward`] carves: a row block's scores, the keys across, the
/// values, and a block's queries, then its probabilities, as `a` panels (one at a time).
fn forward_pieces(t: usize, d: usize) -> [usize; 4] {
    let mb = block_rows(t);
    let a = a_len(mb, d).max(a_len(mb, t));
    [mb * t, b_len(d, t), b_len(t, d), a]
}

/// The scratch pieces [`head_backward`] carves: a row block's probabilities and their
/// gradients, the keys and values across, the keys, and a block's `b` panels (output
/// gradients, then queries) and `a` panels (queries, the probabilities transposed, output
/// gradients, score gradients, the score gradients transposed), each one at a time.
fn backward_pieces(t: usize, d: usize) -> [usize; 7] {
    let mb = block_rows(t);
    let a = a_len(mb, d).max(a_len(t, mb)).max(a_len(mb, t));
    [
        mb * t,
        mb * t,
        b_len(d, t),
        b_len(d, t),
        b_len(t, d),
        b_len(mb, d),
        a,
    ]
}

/// Floats of scratch a piece list needs, each piece starting 64-byte aligned.
fn carved_len(pieces: &[usize]) -> usize {
    pieces.iter().map(|n| n.next_multiple_of(16)).sum::<usize>() + 16
}

/// Floats of scratch [`head_forward`] needs for a head of `d` over `t`.
pub(in crate::kernels) fn forward_len(t: usize, d: usize) -> usize {
    carved_len(&forward_pieces(t, d))
}

/// Floats of scratch [`head_backward`] needs.
pub(in crate::kernels) fn backward_len(t: usize, d: usize) -> usize {
    carved_len(&backward_pieces(t, d))
}

/// `ws` cut into pieces of `lens` floats, each 64-byte aligned; `None` where it is too small.
fn carve<const N: usize>(ws: &mut [f32], lens: [usize; N]) -> Option<[*mut f32; N]> {
    if ws.len() < carved_len(&lens) {
        return None;
    }
    let skip = ws.as_ptr().align_offset(64).min(16);
    let mut at = skip;
    Some(lens.map(|n| {
        let piece = ws[at..].as_mut_ptr();
        at += n.next_multiple_of(16);
        piece
    }))
}

/// One (batch, head) of causal attention as [`super::head_forward`] computes it, in bf16
/// arithmetic from the bf16 `q`, `k` and `v`; `false`, doing nothing, where `ws` is smaller
/// than [`forward_len`].
///
/// # Safety
/// The rows must lie inside their tensors ([`pairable`] ones), `y` valid for `t` rows of `d`
/// f32 and apart from `ws`; the CPU must have AVX512-BF16, BW and VL.
pub(in crate::kernels) unsafe fn head_forward(
    (t, d, scale): (usize, usize, f32),
    [q, k, v]: [Bits; 3],
    y: Rows,
    ws: &mut [f32],
    lse: &mut [f32],
) -> bool {
    let Some([s, kt, vp, ap]) = carve(ws, forward_pieces(t, d)) else {
        return false;
    };
    // Not inlined into its caller's vectorised chunk: compiled for the level here.
    // SAFETY: the pieces are inside `ws` and apart; the rest as the caller vouched.
    crate::isa::vectorized(
        #[inline(always)]
        || unsafe {
            b_words(k.ptr, k.stride, (t, d), kt);
            b_rows(v.ptr, v.stride, (t, d), vp);
            for (r0, r1) in row_blocks(t) {
                // The block's scores in rows `t` apart (row `i` of the head at `i - r0`); its
                // queries, then its probabilities, in `ap`.
                let m = r1 - r0;
                a_words(q.down(r0).ptr, q.stride, (m, d), ap);
                product(
                    (m, r1, d),
                    (s, t),
                    (ap, d),
                    (kt, d),
                    (scale, false),
                    Causal::Columns(r0),
                );
                for (i, lse) in (r0..r1).zip(&mut lse[r0..r1]) {
                    let row = std::slice::from_raw_parts_mut(s.add((i - r0) * t), r1);
                    softmax_causal_row(i, row, lse);
                }
                a_f32(s, (t as isize, 1), (m, r1), ap);
                let y_blk = y.ptr.add(r0 * y.stride);
                let y_c = (y_blk, y.stride);
                product(
                    (m, d, r1),
                    y_c,
                    (ap, r1),
                    (vp, t),
                    (1.0, false),
                    Causal::Depth(r0),
                );
            }
        },
    );
    true
}

/// A head's bf16 inputs for [`head_backward`].
pub(in crate::kernels) struct HeadBits {
    pub q: Bits,
    pub k: Bits,
    pub v: Bits,
    pub y: Bits,
    pub dy: Bits,
}

/// Gradients of one (batch, head) as [`super::head_backward`] computes them, in bf16
/// arithmetic from the bf16 inputs, into the f32 `[dq, dk, dv]` (with `accumulate_kv`, `dk`
/// and `dv` added to); `false`, doing nothing, where `ws` is smaller than [`backward_len`].
///
/// # Safety
/// As [`head_forward`], for every input and output.
pub(in crate::kernels) unsafe fn head_backward(
    (t, d, scale): (usize, usize, f32),
    h: &HeadBits,
    [dq, dk, dv]: [Rows; 3],
    lse: &[f32],
    ws: &mut [f32],
    accumulate_kv: bool,
) -> bool {
    // `bp` and `ap` hold one block operand at a time.
    let Some([p, dp, kt, vt, kp, bp, ap]) = carve(ws, backward_pieces(t, d)) else {
        return false;
    };
    // SAFETY: as in the forward.
    crate::isa::vectorized(
        #[inline(always)]
        || unsafe {
            b_words(h.k.ptr, h.k.stride, (t, d), kt);
            b_words(h.v.ptr, h.v.stride, (t, d), vt);
            b_rows(h.k.ptr, h.k.stride, (t, d), kp);
            // Every row block adds into dK and dV rows 0..r1: the last block, which reaches
            // every row, goes first and writes them, so they need no zeroing.
            for (r0, r1) in row_blocks(t).rev() {
                let kv_acc = accumulate_kv || r1 < t;
                let m = r1 - r0;
                let (qb, dyb) = (h.q.down(r0), h.dy.down(r0));
                // The block's P and dP in rows `t` apart: row `i` of the head at `i - r0`.
                let row =
                    |x: *mut f32, i: usize| std::slice::from_raw_parts_mut(x.add((i - r0) * t), r1);
                // P = exp(scale·QKᵀ − lse), zero above the diagonal.
                a_words(qb.ptr, qb.stride, (m, d), ap);
                product(
                    (m, r1, d),
                    (p, t),
                    (ap, d),
                    (kt, d),
                    (scale, false),
                    Causal::Columns(r0),
                );
                for (i, &l) in (r0..r1).zip(&lse[r0..r1]) {
                    let (live, masked) = row(p, i).split_at_mut(i + 1);
                    for x in live.iter_mut() {
                        *x = crate::math::exp(*x - l);
                    }
                    masked.fill(0.0);
                }
                // dV[0..r1] (+)= Pᵀ · dY ;  dP = dY · Vᵀ
                a_f32(p, (1, t as isize), (r1, m), ap);
                b_rows(dyb.ptr, dyb.stride, (m, d), bp);
                let dv_c = (dv.ptr, dv.stride);
                product(
                    (r1, d, m),
                    dv_c,
                    (ap, m),
                    (bp, m),
                    (1.0, kv_acc),
                    Causal::DepthFrom(r0),
                );
                a_words(dyb.ptr, dyb.stride, (m, d), ap);
                product(
                    (m, r1, d),
                    (dp, t),
                    (ap, d),
                    (vt, d),
                    (1.0, false),
                    Causal::Columns(r0),
                );
                // dS = P ⊙ (dP − rowsum(dY ⊙ Y)); dP's tiles past the diagonal were left out,
                // and dS is zero there.
                for i in r0..r1 {
                    let bits = |x: Bits| std::slice::from_raw_parts(x.ptr.add(i * x.stride), d);
                    let di = dot_bits(bits(h.dy), bits(h.y));
                    let (live, masked) = row(dp, i).split_at_mut(i + 1);
                    for (g, &pv) in live.iter_mut().zip(row(p, i).iter()) {
                        *g = pv * (*g - di);
                    }
                    masked.fill(0.0);
                }
                // dQ = scale · dS · K ;  dK[0..r1] (+)= scale · dSᵀ · Q
                a_f32(dp, (t as isize, 1), (m, r1), ap);
                let dq_blk = dq.ptr.add(r0 * dq.stride);
                let dq_c = (dq_blk, dq.stride);
                product(
                    (m, d, r1),
                    dq_c,
                    (ap, r1),
                    (kp, t),
                    (scale, false),
                    Causal::Depth(r0),
                );
                a_f32(dp, (1, t as isize), (r1, m), ap);
                b_rows(qb.ptr, qb.stride, (m, d), bp);
                let dk_c = (dk.ptr, dk.stride);
                product(
                    (r1, d, m),
                    dk_c,
                    (ap, m),
                    (bp, m),
                    (scale, kv_acc),
                    Causal::DepthFrom(r0),
                );
            }
        },
    );
    true
}

/// Σ aᵢbᵢ of two bf16 rows, widened exactly, in 16 interleaved partial sums as
/// [`crate::math::dot`] sums.
#[inline(always)]
fn dot_bits(a: &[u16], b: &[u16]) -> f32 {
    let wide = |h: u16| f32::from_bits(u32::from(h) << 16);
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| wide(x) * wide(y))
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &u), &v) in acc.iter_mut().zip(x).zip(y) {
            *s += wide(u) * wide(v);
        }
    }
    acc.iter().sum::<f32>() + tail
}
