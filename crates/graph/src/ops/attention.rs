//! Fused causal self-attention over a packed `qkv` tensor. Heads are read in place with strided
//! GEMMs (no split); only keys (and, in the backward, values) are laid out transposed once per
//! head, for the products against them. The forward keeps only the output and each row's
//! log-sum-exp, and the backward recomputes the probabilities from them, as FlashAttention does.
//! Scores for one head at a time live in a per-thread workspace, so no `[B, H, T, T]` tensor
//! ever exists.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Input `qkv [B, T, 3C]` (queries, keys, values side by side, heads of width `C / n_head`);
/// outputs `[y [B, T, C], lse [B, n_head, T]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CausalAttention {
    pub n_head: usize,
}

/// Batch, sequence, width and head size of a packed qkv shape.
fn dims(op: &'static str, qkv: &[usize], n_head: usize) -> Result<(usize, usize, usize, usize)> {
    if qkv.len() != 3 || !qkv[2].is_multiple_of(3) {
        return Err(shape_err(
            op,
            format!("qkv must be [B, T, 3C], got {qkv:?}"),
        ));
    }
    let c = qkv[2] / 3;
    if n_head == 0 || !c.is_multiple_of(n_head) {
        return Err(shape_err(
            op,
            format!("width {c} is not divisible by {n_head} heads"),
        ));
    }
    Ok((qkv[0], qkv[1], c, c / n_head))
}

impl OpRule for CausalAttention {
    fn name(&self) -> &'static str {
        "causal_attention"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 1)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let (b, t, c, _) = dims(self.name(), &inputs[0].shape, self.n_head)?;
        let mut y = OutSpec::f32(vec![b, t, c]);
        y.dtype = dtype;
        Ok(vec![y, OutSpec::f32(vec![b, self.n_head, t]).named("lse")])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if let Some(dy) = ctx.grad_out(0) {
            let ins = [ctx.input(0), ctx.output(0), ctx.output(1), dy];
            let dqkv = ctx.apply1(
                CausalAttentionBackward {
                    n_head: self.n_head,
                },
                &ins,
            )?;
            ctx.set_grad(0, dqkv);
        }
        Ok(())
    }

    /// One head's scratch per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        dims(self.name(), &inputs[0].shape, self.n_head)
            .map_or(0, |(_, t, _, d)| threads * forward_scratch(t, d))
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match dims(self.name(), &inputs[0].shape, self.n_head) {
            // QKᵀ and PV over the blocked causal pairs.
            Ok((b, t, c, _)) => 4 * (b * score_pairs(t) * c) as u64,
            Err(_) => 0,
        }
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let Ok((b, t, c, d)) = dims(self.name(), k.in_shape(0), self.n_head) else {
            unreachable!("shape rule checked at build time")
        };
        let qkv = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let y = SendPtr(k.out_f32(0).as_mut_ptr());
        let lse = SendPtr(k.out_f32(1).as_mut_ptr());
        let h = self.n_head;
        let scale = 1.0 / (d as f32).sqrt();
        for_each_head(k.workspace(), forward_scratch(t, d), b * h, |item, s| {
            let (bi, hi) = (item / h, item % h);
            // SAFETY: every pointer below stays inside its tensor; each (b, h) writes only its
            // own columns of y and its own row of lse.
            unsafe {
                let q = qkv.get().add(bi * t * 3 * c + hi * d);
                let rows = |ptr, stride| Rows { ptr, stride };
                let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                head_forward(
                    (t, d, scale),
                    [
                        rows(q, 3 * c),
                        rows(q.add(c), 3 * c),
                        rows(q.add(2 * c), 3 * c),
                    ],
                    rows(y.get().add(bi * t * c + hi * d), c),
                    s,
                    lse_row,
                );
            }
        });
    }
}

/// Inputs `[qkv, y, lse, dy]`; output `dqkv [B, T, 3C]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CausalAttentionBackward {
    pub n_head: usize,
}

impl OpRule for CausalAttentionBackward {
    fn name(&self) -> &'static str {
        "causal_attention_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 4)?;
        let (b, t, c, _) = dims(self.name(), &inputs[0].shape, self.n_head)?;
        if inputs[1].shape != [b, t, c] || inputs[3].shape != [b, t, c] {
            return Err(shape_err(self.name(), "y and dy must be [B, T, C]"));
        }
        if inputs[2].shape != [b, self.n_head, t] {
            return Err(shape_err(self.name(), "lse must be [B, n_head, T]"));
        }
        Ok(vec![
            OutSpec::f32(inputs[0].shape.clone()).with_dtype(inputs[0].dtype)
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "causal_attention_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One head's scratch per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        dims(self.name(), &inputs[0].shape, self.n_head)
            .map_or(0, |(_, t, _, d)| threads * backward_scratch(t, d))
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match dims(self.name(), &inputs[0].shape, self.n_head) {
            // Recomputed QKᵀ, then dV, dP, dQ, dK.
            Ok((b, t, c, _)) => 10 * (b * score_pairs(t) * c) as u64,
            Err(_) => 0,
        }
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let Ok((b, t, c, d)) = dims(self.name(), k.in_shape(0), self.n_head) else {
            unreachable!("shape rule checked at build time")
        };
        let qkv = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let y = SendPtr(k.in_f32(1).as_ptr() as *mut f32);
        let lse = k.in_f32(2);
        let dy = SendPtr(k.in_f32(3).as_ptr() as *mut f32);
        let dqkv = SendPtr(k.out_f32(0).as_mut_ptr());
        let h = self.n_head;
        let scale = 1.0 / (d as f32).sqrt();
        for_each_head(k.workspace(), backward_scratch(t, d), b * h, |item, ws| {
            let (bi, hi) = (item / h, item % h);
            // SAFETY: as in the forward; each (b, h) writes only its own columns of dqkv.
            unsafe {
                let q = qkv.get().add(bi * t * 3 * c + hi * d);
                let dq = dqkv.get().add(bi * t * 3 * c + hi * d);
                let (yb, dyb) = (
                    y.get().add(bi * t * c + hi * d),
                    dy.get().add(bi * t * c + hi * d),
                );
                let r3 = |ptr| Rows { ptr, stride: 3 * c };
                let rc = |ptr| Rows { ptr, stride: c };
                let head = HeadGrads {
                    q: r3(q),
                    k: r3(q.add(c)),
                    v: r3(q.add(2 * c)),
                    y: rc(yb),
                    dy: rc(dyb),
                    dq: r3(dq),
                    dk: r3(dq.add(c)),
                    dv: r3(dq.add(2 * c)),
                };
                head_backward(
                    (t, d, scale),
                    &head,
                    &lse[item * t..(item + 1) * t],
                    ws,
                    false,
                );
            }
        });
    }
}

#[cfg(feature = "cpu")]
use super::par::{for_each_item as for_each_head, SendPtr};

/// One head's rows inside a strided tensor: the first element and the distance between rows.
#[cfg(feature = "cpu")]
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub ptr: *mut f32,
    pub stride: usize,
}

/// A head's forward inputs and outputs and their gradients, for [`head_backward`].
#[cfg(feature = "cpu")]
pub(super) struct HeadGrads {
    pub q: Rows,
    pub k: Rows,
    pub v: Rows,
    pub y: Rows,
    pub dy: Rows,
    pub dq: Rows,
    pub dk: Rows,
    pub dv: Rows,
}

/// A product's right operand as [`head_gemm`] reads it: strips of 64 columns `strip` floats
/// apart, each strip's rows `rs` apart and contiguous.
#[cfg(feature = "cpu")]
#[derive(Clone, Copy)]
struct Right {
    ptr: *const f32,
    rs: usize,
    strip: usize,
}

#[cfg(feature = "cpu")]
impl Right {
    /// A head's rows read in place (copying them contiguous first measured no faster).
    fn rows(x: Rows) -> Right {
        Right {
            ptr: x.ptr,
            rs: x.stride,
            strip: 64,
        }
    }

    /// The same operand from row `r` on.
    unsafe fn down(self, r: usize) -> Right {
        Right {
            ptr: unsafe { self.ptr.add(r * self.rs) },
            ..self
        }
    }
}

/// `c (+)= scale · op(a) · b` on one head's matrices, `op` transposing with `ta`.
///
/// # Safety
/// Every pointer must be valid for the rows its shape and stride reach.
#[cfg(feature = "cpu")]
#[allow(clippy::too_many_arguments)]
unsafe fn head_gemm(
    (m, n, k): (usize, usize, usize),
    c: Rows,
    a: Rows,
    ta: bool,
    b: Right,
    scale: f32,
    acc: bool,
) {
    let (a_rs, a_cs) = if ta { (1, a.stride) } else { (a.stride, 1) };
    #[cfg(target_arch = "x86_64")]
    if let Some((small_gemm, _)) = super::gemm_blocked::head_kernels() {
        // SAFETY: the CPU was checked; the caller vouches for the operands.
        unsafe {
            small_gemm(
                (m, n, k),
                (c.ptr, c.stride),
                (a.ptr, a_rs, a_cs),
                (b.ptr, b.rs, b.strip),
                scale,
                acc,
            )
        };
        return;
    }
    for j0 in (0..n).step_by(64) {
        // SAFETY: strip `j0 / 64` of `b` and columns `j0..` of `c`, as the caller vouched.
        unsafe {
            super::matmul::gemm_raw(
                (m, (n - j0).min(64), k),
                (c.ptr.add(j0), c.stride as isize, 1),
                (a.ptr, a_rs as isize, a_cs as isize),
                (b.ptr.add(j0 / 64 * b.strip), b.rs as isize, 1),
                scale,
                acc,
                gemm::Parallelism::None,
            )
        };
    }
}

/// Floats of one head's operand laid out with its `t` rows across, in strips of 64.
fn across_len(t: usize, d: usize) -> usize {
    t.next_multiple_of(64) * d
}

/// Scratch floats one head's forward needs: its scores and its keys laid across.
pub(super) fn forward_scratch(t: usize, d: usize) -> usize {
    t * t + across_len(t, d)
}

/// Scratch floats one head's backward needs: probabilities and their gradient, and keys and
/// values laid across.
pub(super) fn backward_scratch(t: usize, d: usize) -> usize {
    2 * t * t + 2 * across_len(t, d)
}

/// `x`'s `t` rows of `d` transposed (`[d, t]`), in strips of 64 of them ([`across_len`] floats),
/// for products whose columns are `x`'s rows (scores against keys).
///
/// # Safety
/// `x` must be valid for `t` rows of `d` elements at its stride.
#[cfg(feature = "cpu")]
unsafe fn rows_across(x: Rows, (t, d): (usize, usize), out: &mut [f32]) -> Right {
    let out = &mut out[..across_len(t, d)];
    for (strip, o) in out.chunks_exact_mut(64 * d).enumerate() {
        let (r0, rows) = (strip * 64, (t - strip * 64).min(64));
        // SAFETY: rows `r0..r0 + rows` of `x`, as the caller vouched.
        let x = unsafe { x.down(r0) };
        #[cfg(target_arch = "x86_64")]
        if let Some((_, transpose)) = super::gemm_blocked::head_kernels() {
            // SAFETY: the CPU was checked; `o` holds d rows of 64.
            unsafe { transpose((x.ptr, x.stride), (rows, d), (o.as_mut_ptr(), 64)) };
            continue;
        }
        for r in 0..rows {
            // SAFETY: as above.
            let row = unsafe { std::slice::from_raw_parts(x.ptr.add(r * x.stride), d) };
            for (p, &v) in row.iter().enumerate() {
                o[p * 64 + r] = v;
            }
        }
    }
    Right {
        ptr: out.as_ptr(),
        rs: 64,
        strip: 64 * d,
    }
}

/// Query rows handled together. Row block `[r0, r1)` only needs keys `[0, r1)`, so working in
/// blocks skips most of the masked upper triangle (about 40% of the work at T = 256).
const ROW_BLOCK: usize = 64;

#[cfg(feature = "cpu")]
impl Rows {
    /// The same rows starting `r` rows further down.
    unsafe fn down(self, r: usize) -> Rows {
        Rows {
            ptr: self.ptr.add(r * self.stride),
            stride: self.stride,
        }
    }
}

/// Query-key pairs the blocked kernels compute per head: each row block against every key up
/// to its end.
pub(super) fn score_pairs(t: usize) -> usize {
    row_blocks(t).map(|(r0, r1)| (r1 - r0) * r1).sum()
}

/// Row blocks `(r0, r1)` covering `0..t`.
fn row_blocks(t: usize) -> impl DoubleEndedIterator<Item = (usize, usize)> {
    (0..t)
        .step_by(ROW_BLOCK)
        .map(move |r0| (r0, (r0 + ROW_BLOCK).min(t)))
}

/// One (batch, head) of causal attention: `y = softmax(scale·QKᵀ, causal) · V`, recording each
/// row's log-sum-exp; `s` is [`forward_scratch`] floats.
///
/// # Safety
/// The pointers must be valid for `t` rows of `d` elements at their strides.
#[cfg(feature = "cpu")]
pub(super) unsafe fn head_forward(
    (t, d, scale): (usize, usize, f32),
    [q, k, v]: [Rows; 3],
    y: Rows,
    s: &mut [f32],
    lse: &mut [f32],
) {
    let (s, kt) = s.split_at_mut(t * t);
    let (kt, v) = (rows_across(k, (t, d), kt), Right::rows(v));
    let s_rows = Rows {
        ptr: s.as_mut_ptr(),
        stride: t,
    };
    for (r0, r1) in row_blocks(t) {
        let (m, s_blk) = (r1 - r0, s_rows.down(r0));
        head_gemm((m, r1, d), s_blk, q.down(r0), false, kt, scale, false);
        for i in r0..r1 {
            softmax_causal_row(i, &mut s[i * t..i * t + r1], &mut lse[i]);
        }
        head_gemm((m, d, r1), y.down(r0), s_blk, false, v, 1.0, false);
    }
}

/// Gradients of one (batch, head), recomputing the probabilities from `lse`; `ws` is
/// [`backward_scratch`] floats. With `accumulate_kv`, `dk` and `dv` are added to (several query heads sharing a
/// key/value head) instead of overwritten.
///
/// # Safety
/// The pointers must be valid for `t` rows of `d` elements at their strides.
#[cfg(feature = "cpu")]
pub(super) unsafe fn head_backward(
    (t, d, scale): (usize, usize, f32),
    h: &HeadGrads,
    lse: &[f32],
    ws: &mut [f32],
    accumulate_kv: bool,
) {
    let (p, rest) = ws.split_at_mut(t * t);
    let (dp, rest) = rest.split_at_mut(t * t);
    let (kt, vt) = rest.split_at_mut(across_len(t, d));
    let (kt, vt) = (rows_across(h.k, (t, d), kt), rows_across(h.v, (t, d), vt));
    let (k, q, dy) = (Right::rows(h.k), Right::rows(h.q), Right::rows(h.dy));
    let (p_rows, dp_rows) = (
        Rows {
            ptr: p.as_mut_ptr(),
            stride: t,
        },
        Rows {
            ptr: dp.as_mut_ptr(),
            stride: t,
        },
    );
    // Every row block adds into dK and dV rows 0..r1: the last block, which reaches every row,
    // goes first and writes them, so they need no zeroing.
    for (r0, r1) in row_blocks(t).rev() {
        let kv_acc = accumulate_kv || r1 < t;
        let m = r1 - r0;
        let (p_blk, dp_blk) = (p_rows.down(r0), dp_rows.down(r0));
        // P = exp(scale·QKᵀ − lse), zero above the diagonal.
        head_gemm((m, r1, d), p_blk, h.q.down(r0), false, kt, scale, false);
        for i in r0..r1 {
            let (live, masked) = p[i * t..i * t + r1].split_at_mut(i + 1);
            let l = lse[i];
            for x in live.iter_mut() {
                *x = super::math::exp(*x - l);
            }
            masked.fill(0.0);
        }
        // dV[0..r1] += Pᵀ · dY ;  dP = dY · Vᵀ
        head_gemm((r1, d, m), h.dv, p_blk, true, dy.down(r0), 1.0, kv_acc);
        head_gemm((m, r1, d), dp_blk, h.dy.down(r0), false, vt, 1.0, false);
        // dS = P ⊙ (dP − rowsum(dY ⊙ Y))
        for i in r0..r1 {
            let dy_row = std::slice::from_raw_parts(h.dy.ptr.add(i * h.dy.stride), d);
            let y_row = std::slice::from_raw_parts(h.y.ptr.add(i * h.y.stride), d);
            let di = super::math::dot(dy_row, y_row);
            let (pr, dpr) = (&p[i * t..i * t + r1], &mut dp[i * t..i * t + r1]);
            for (g, &pv) in dpr.iter_mut().zip(pr) {
                *g = pv * (*g - di);
            }
        }
        // dQ = scale · dS · K ;  dK[0..r1] += scale · dSᵀ · Q
        head_gemm((m, d, r1), h.dq.down(r0), dp_blk, false, k, scale, false);
        head_gemm((r1, d, m), h.dk, dp_blk, true, q.down(r0), scale, kv_acc);
    }
}

/// Row `i` of scores (only its first `r1 ≥ i + 1` columns are read later) becomes causal
/// probabilities in place; records the row's log-sum-exp.
#[cfg(feature = "cpu")]
fn softmax_causal_row(i: usize, row: &mut [f32], lse: &mut f32) {
    let (live, masked) = row.split_at_mut(i + 1);
    let max = super::math::max(live);
    // Exponentials first, then their sum: one loop doing both stays scalar.
    for x in live.iter_mut() {
        *x = super::math::exp(*x - max);
    }
    let sum = super::math::sum(live);
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|x| *x *= inv);
    masked.fill(0.0);
    *lse = max + sum.ln();
}
