//! Fused causal self-attention over a packed `qkv` tensor. Heads are read in place with strided
//! GEMMs (no split, no transpose copies); the forward keeps only the output and each row's
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

    /// One `T × T` score matrix per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], threads: usize) -> usize {
        let t = inputs[0].shape.get(1).copied().unwrap_or(0);
        threads * t * t
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match dims(self.name(), &inputs[0].shape, self.n_head) {
            // QKᵀ and PV, full square (the causal half is computed and masked).
            Ok((b, t, c, _)) => 4 * (b * t * t * c) as u64,
            Err(_) => 0,
        }
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let Ok((b, t, c, d)) = dims(self.name(), k.in_shape(0), self.n_head) else {
            unreachable!("shape rule checked at build time")
        };
        let qkv = k.in_f32(0).as_ptr();
        let y = SendPtr(k.out_f32(0).as_mut_ptr());
        let lse = SendPtr(k.out_f32(1).as_mut_ptr());
        let h = self.n_head;
        let scale = 1.0 / (d as f32).sqrt();
        let qkv = SendPtr(qkv as *mut f32);
        for_each_head(k.workspace(), t * t, b * h, |item, s| {
            let (bi, hi) = (item / h, item % h);
            let s3 = 3 * c as isize;
            // SAFETY: every pointer below stays inside its tensor; each (b, h) writes only its
            // own columns of y and its own row of lse.
            unsafe {
                let q = qkv.get().add(bi * t * 3 * c + hi * d);
                let kk = q.add(c);
                let v = q.add(2 * c);
                scores(t, d, q, kk, s3, scale, s);
                let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                softmax_causal(t, s, lse_row);
                let yb = y.get().add(bi * t * c + hi * d);
                super::matmul::gemm_raw(
                    (t, d, t),
                    (yb, c as isize, 1),
                    (s.as_ptr(), t as isize, 1),
                    (v, s3, 1),
                    1.0,
                    false,
                    gemm::Parallelism::None,
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

    /// Probabilities and their gradient, `T × T` each, per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], threads: usize) -> usize {
        let t = inputs[0].shape.get(1).copied().unwrap_or(0);
        2 * threads * t * t
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match dims(self.name(), &inputs[0].shape, self.n_head) {
            // Recomputed QKᵀ, then dV, dP, dQ, dK.
            Ok((b, t, c, _)) => 10 * (b * t * t * c) as u64,
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
        for_each_head(k.workspace(), 2 * t * t, b * h, |item, ws| {
            let (bi, hi) = (item / h, item % h);
            let (p, dp) = ws.split_at_mut(t * t);
            let s3 = 3 * c as isize;
            let ci = c as isize;
            let none = gemm::Parallelism::None;
            // SAFETY: as in the forward; each (b, h) writes only its own columns of dqkv.
            unsafe {
                let q = qkv.get().add(bi * t * 3 * c + hi * d);
                let kk = q.add(c);
                let v = q.add(2 * c);
                let dq = dqkv.get().add(bi * t * 3 * c + hi * d);
                let dk = dq.add(c);
                let dv = dq.add(2 * c);
                let yb = y.get().add(bi * t * c + hi * d);
                let dyb = dy.get().add(bi * t * c + hi * d);
                // P = exp(scale·QKᵀ − lse), zero above the diagonal.
                scores(t, d, q, kk, s3, scale, p);
                let lse_row = &lse[item * t..(item + 1) * t];
                for i in 0..t {
                    let row = &mut p[i * t..(i + 1) * t];
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = if j <= i {
                            super::math::exp(*x - lse_row[i])
                        } else {
                            0.0
                        };
                    }
                }
                // dV = Pᵀ · dY
                super::matmul::gemm_raw(
                    (t, d, t),
                    (dv, s3, 1),
                    (p.as_ptr(), 1, t as isize),
                    (dyb, ci, 1),
                    1.0,
                    false,
                    none,
                );
                // dP = dY · Vᵀ
                super::matmul::gemm_raw(
                    (t, t, d),
                    (dp.as_mut_ptr(), t as isize, 1),
                    (dyb, ci, 1),
                    (v, 1, s3),
                    1.0,
                    false,
                    none,
                );
                // dS = P ⊙ (dP − rowsum(dY ⊙ Y))
                for i in 0..t {
                    let mut di = 0.0;
                    for e in 0..d {
                        di += *dyb.add(i * c + e) * *yb.add(i * c + e);
                    }
                    let (pr, dpr) = (&p[i * t..(i + 1) * t], &mut dp[i * t..(i + 1) * t]);
                    for (g, &pv) in dpr.iter_mut().zip(pr) {
                        *g = pv * (*g - di);
                    }
                }
                // dQ = scale · dS · K ;  dK = scale · dSᵀ · Q
                super::matmul::gemm_raw(
                    (t, d, t),
                    (dq, s3, 1),
                    (dp.as_ptr(), t as isize, 1),
                    (kk, s3, 1),
                    scale,
                    false,
                    none,
                );
                super::matmul::gemm_raw(
                    (t, d, t),
                    (dk, s3, 1),
                    (dp.as_ptr(), 1, t as isize),
                    (q, s3, 1),
                    scale,
                    false,
                    none,
                );
            }
        });
    }
}

#[cfg(feature = "cpu")]
use super::par::{for_each_item as for_each_head, SendPtr};

/// `s = scale · Q · Kᵀ` for one head (rows of Q and K `row_stride` apart).
///
/// # Safety
/// `q` and `k` must be valid for `t` rows of `d` elements at `row_stride`.
#[cfg(feature = "cpu")]
unsafe fn scores(
    t: usize,
    d: usize,
    q: *const f32,
    k: *const f32,
    row_stride: isize,
    scale: f32,
    s: &mut [f32],
) {
    super::matmul::gemm_raw(
        (t, t, d),
        (s.as_mut_ptr(), t as isize, 1),
        (q, row_stride, 1),
        (k, 1, row_stride),
        scale,
        false,
        gemm::Parallelism::None,
    );
}

/// Turns each row of scores into causal probabilities in place and records its log-sum-exp.
#[cfg(feature = "cpu")]
pub(super) fn softmax_causal(t: usize, s: &mut [f32], lse: &mut [f32]) {
    for i in 0..t {
        let row = &mut s[i * t..(i + 1) * t];
        let (live, masked) = row.split_at_mut(i + 1);
        let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for x in live.iter_mut() {
            *x = super::math::exp(*x - max);
            sum += *x;
        }
        let inv = 1.0 / sum;
        live.iter_mut().for_each(|x| *x *= inv);
        masked.fill(0.0);
        lse[i] = max + sum.ln();
    }
}
