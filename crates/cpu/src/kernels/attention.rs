//! The kernels of causal self-attention: per head, strided GEMMs over the packed `qkv` in
//! place (keys and values laid across once per head), scores in a per-thread workspace, a
//! row's log-sum-exp saved for the backward, which recomputes the probabilities from it.
//! The head functions are shared with [`GqaAttention`](snug_graph::ops::GqaAttention)'s kernels.

use snug_graph::ops::{
    attention::{across_len, backward_scratch, dims, forward_scratch, row_blocks},
    CausalAttention, CausalAttentionBackward, OpRule,
};

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for CausalAttention {
    fn run(&self, k: &Kernel<'_>) {
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

impl CpuKernel for CausalAttentionBackward {
    fn run(&self, k: &Kernel<'_>) {
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

use crate::par::{for_each_item as for_each_head, SendPtr};

/// One head's rows inside a strided tensor: the first element and the distance between rows.
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub ptr: *mut f32,
    pub stride: usize,
}

/// A head's forward inputs and outputs and their gradients, for [`head_backward`].
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
#[derive(Clone, Copy)]
struct Right {
    ptr: *const f32,
    rs: usize,
    strip: usize,
}

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
    if let Some((small_gemm, _)) = crate::gemm::head_kernels() {
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
            crate::gemm::gemm_raw(
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

/// `x`'s `t` rows of `d` transposed (`[d, t]`), in strips of 64 of them ([`across_len`] floats),
/// for products whose columns are `x`'s rows (scores against keys).
///
/// # Safety
/// `x` must be valid for `t` rows of `d` elements at its stride.
unsafe fn rows_across(x: Rows, (t, d): (usize, usize), out: &mut [f32]) -> Right {
    let out = &mut out[..across_len(t, d)];
    for (strip, o) in out.chunks_exact_mut(64 * d).enumerate() {
        let (r0, rows) = (strip * 64, (t - strip * 64).min(64));
        // SAFETY: rows `r0..r0 + rows` of `x`, as the caller vouched.
        let x = unsafe { x.down(r0) };
        #[cfg(target_arch = "x86_64")]
        if let Some((_, transpose)) = crate::gemm::head_kernels() {
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

impl Rows {
    /// The same rows starting `r` rows further down.
    unsafe fn down(self, r: usize) -> Rows {
        Rows {
            ptr: self.ptr.add(r * self.stride),
            stride: self.stride,
        }
    }
}

/// One (batch, head) of causal attention: `y = softmax(scale·QKᵀ, causal) · V`, recording each
/// row's log-sum-exp; `s` is [`forward_scratch`] floats.
///
/// # Safety
/// The pointers must be valid for `t` rows of `d` elements at their strides.
pub(super) unsafe fn head_forward(
    (t, d, scale): (usize, usize, f32),
    [q, k, v]: [Rows; 3],
    y: Rows,
    s: &mut [f32],
    lse: &mut [f32],
) {
    // Not inlined into its caller's vectorised chunk: compiled for the level here.
    // SAFETY: as the caller vouched.
    crate::isa::vectorized(|| unsafe { head_forward_body((t, d, scale), [q, k, v], y, s, lse) })
}

/// [`head_forward`]'s body.
///
/// # Safety
/// As [`head_forward`].
#[inline(always)]
unsafe fn head_forward_body(
    (t, d, scale): (usize, usize, f32),
    [q, k, v]: [Rows; 3],
    y: Rows,
    s: &mut [f32],
    lse: &mut [f32],
) {
    // SAFETY: as the caller vouched.
    unsafe {
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
}

/// Gradients of one (batch, head), recomputing the probabilities from `lse`; `ws` is
/// [`backward_scratch`] floats. With `accumulate_kv`, `dk` and `dv` are added to (several query heads sharing a
/// key/value head) instead of overwritten.
///
/// # Safety
/// The pointers must be valid for `t` rows of `d` elements at their strides.
pub(super) unsafe fn head_backward(
    (t, d, scale): (usize, usize, f32),
    h: &HeadGrads,
    lse: &[f32],
    ws: &mut [f32],
    accumulate_kv: bool,
) {
    // Not inlined into its caller's vectorised chunk: compiled for the level here.
    // SAFETY: as the caller vouched.
    crate::isa::vectorized(|| unsafe {
        head_backward_body((t, d, scale), h, lse, ws, accumulate_kv)
    })
}

/// [`head_backward`]'s body.
///
/// # Safety
/// As [`head_backward`].
#[inline(always)]
unsafe fn head_backward_body(
    (t, d, scale): (usize, usize, f32),
    h: &HeadGrads,
    lse: &[f32],
    ws: &mut [f32],
    accumulate_kv: bool,
) {
    // SAFETY: as the caller vouched.
    unsafe {
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
                    *x = crate::math::exp(*x - l);
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
                let di = crate::math::dot(dy_row, y_row);
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
}

/// Row `i` of scores (only its first `r1 ≥ i + 1` columns are read later) becomes causal
/// probabilities in place; records the row's log-sum-exp.
#[inline(always)]
fn softmax_causal_row(i: usize, row: &mut [f32], lse: &mut f32) {
    let (live, masked) = row.split_at_mut(i + 1);
    let max = crate::math::max(live);
    // Exponentials first, then their sum: one loop doing both stays scalar.
    for x in live.iter_mut() {
        *x = crate::math::exp(*x - max);
    }
    let sum = crate::math::sum(live);
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|x| *x *= inv);
    masked.fill(0.0);
    *lse = max + sum.ln();
}
