//! Fused causal attention with grouped-query heads (GQA, as in Llama 2 70B and Llama 3) over
//! separate `q`, `k`, `v` tensors: `n_head` query heads share `n_kv_head` key/value heads,
//! query head `h` reading kv head `h / (n_head / n_kv_head)`. Same design as
//! [`super::CausalAttention`]: heads are read in place with strided GEMMs, the forward keeps only
//! the output and each row's log-sum-exp, the backward recomputes the probabilities, and scores
//! live in a per-thread `T × T` workspace.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

use super::attention::{backward_scratch, forward_scratch};
#[cfg(feature = "cpu")]
use super::attention::{head_backward, head_forward, HeadGrads, Rows};

/// Inputs `[q [B, T, n_head·D], k [B, T, n_kv_head·D], v [B, T, n_kv_head·D]]`; outputs
/// `[y [B, T, n_head·D], lse [B, n_head, T]]`. With `n_kv_head == n_head` it is ordinary
/// multi-head attention; with `n_kv_head == 1`, multi-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaAttention {
    pub n_head: usize,
    pub n_kv_head: usize,
}

/// Sizes of one attention: batch, sequence, query heads, kv heads, head width.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cpu"), allow(dead_code))]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    kh: usize,
    d: usize,
}

impl Dims {
    /// Query heads per kv head.
    #[cfg(feature = "cpu")]
    fn group(&self) -> usize {
        self.h / self.kh
    }
}

fn dims(
    op: &'static str,
    n_head: usize,
    n_kv_head: usize,
    q: &[usize],
    k: &[usize],
    v: &[usize],
) -> Result<Dims> {
    if n_head == 0 || n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
        return Err(shape_err(
            op,
            format!("{n_head} query heads cannot be grouped over {n_kv_head} kv heads"),
        ));
    }
    if q.len() != 3 || q[2] == 0 || !q[2].is_multiple_of(n_head) {
        return Err(shape_err(
            op,
            format!("q must be [B, T, n_head·D] with {n_head} heads, got {q:?}"),
        ));
    }
    let (b, t, d) = (q[0], q[1], q[2] / n_head);
    let kv = [b, t, n_kv_head * d];
    if k != kv || v != kv {
        return Err(shape_err(
            op,
            format!("k {k:?} and v {v:?} must be {kv:?} ({n_kv_head} kv heads of width {d})"),
        ));
    }
    Ok(Dims {
        b,
        t,
        h: n_head,
        kh: n_kv_head,
        d,
    })
}

impl OpRule for GqaAttention {
    fn name(&self) -> &'static str {
        "gqa_attention"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 3)?;
        let dtype = float_dtype(self.name(), inputs)?;
        let s = dims(
            self.name(),
            self.n_head,
            self.n_kv_head,
            &inputs[0].shape,
            &inputs[1].shape,
            &inputs[2].shape,
        )?;
        let mut y = OutSpec::f32(inputs[0].shape.clone());
        y.dtype = dtype;
        Ok(vec![y, OutSpec::f32(vec![s.b, s.h, s.t]).named("lse")])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dy) = ctx.grad_out(0) else {
            return Ok(());
        };
        let ins = [
            ctx.input(0),
            ctx.input(1),
            ctx.input(2),
            ctx.output(0),
            ctx.output(1),
            dy,
        ];
        let g = ctx.apply(
            GqaAttentionBackward {
                n_head: self.n_head,
                n_kv_head: self.n_kv_head,
            },
            &ins,
        )?;
        for (i, &t) in g.iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, t);
            }
        }
        Ok(())
    }

    /// One head's scratch per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        let (q, k, v) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
        dims(self.name(), self.n_head, self.n_kv_head, q, k, v)
            .map_or(0, |s| threads.max(1) * forward_scratch(s.t, s.d))
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        // QKᵀ and PV per query head over the blocked causal pairs.
        let t = inputs[0].shape.get(1).copied().unwrap_or(1).max(1);
        4 * (inputs[0].numel() / t * super::attention::score_pairs(t)) as u64
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use super::par::SendPtr;
        let shapes = (k.in_shape(0), k.in_shape(1), k.in_shape(2));
        let Ok(s) = dims(
            self.name(),
            self.n_head,
            self.n_kv_head,
            shapes.0,
            shapes.1,
            shapes.2,
        ) else {
            unreachable!("shape rule checked at build time")
        };
        let (t, d, h, group) = (s.t, s.d, s.h, s.group());
        let (cq, ckv) = (s.h * d, s.kh * d);
        let q = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let kk = SendPtr(k.in_f32(1).as_ptr() as *mut f32);
        let v = SendPtr(k.in_f32(2).as_ptr() as *mut f32);
        let y = SendPtr(k.out_f32(0).as_mut_ptr());
        let lse = SendPtr(k.out_f32(1).as_mut_ptr());
        let scale = 1.0 / (d as f32).sqrt();
        super::par::for_each_item(k.workspace(), forward_scratch(t, d), s.b * h, |item, sc| {
            let (bi, hi) = (item / h, item % h);
            let kvh = hi / group;
            // SAFETY: every pointer below stays inside its tensor; each (b, h) writes only its
            // own columns of y and its own row of lse.
            unsafe {
                let rows = |ptr, stride| Rows { ptr, stride };
                let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                head_forward(
                    (t, d, scale),
                    [
                        rows(q.get().add(bi * t * cq + hi * d), cq),
                        rows(kk.get().add(bi * t * ckv + kvh * d), ckv),
                        rows(v.get().add(bi * t * ckv + kvh * d), ckv),
                    ],
                    rows(y.get().add(bi * t * cq + hi * d), cq),
                    sc,
                    lse_row,
                );
            }
        });
    }
}

/// Inputs `[q, k, v, y, lse, dy]`; outputs `[dq, dk, dv]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaAttentionBackward {
    pub n_head: usize,
    pub n_kv_head: usize,
}

impl OpRule for GqaAttentionBackward {
    fn name(&self) -> &'static str {
        "gqa_attention_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(self.name(), inputs, 6)?;
        let s = dims(
            self.name(),
            self.n_head,
            self.n_kv_head,
            &inputs[0].shape,
            &inputs[1].shape,
            &inputs[2].shape,
        )?;
        let q = &inputs[0].shape;
        if &inputs[3].shape != q || &inputs[5].shape != q {
            return Err(shape_err(self.name(), "y and dy must have q's shape"));
        }
        if inputs[4].shape != [s.b, s.h, s.t] {
            return Err(shape_err(self.name(), "lse must be [B, n_head, T]"));
        }
        Ok(vec![
            OutSpec::f32(q.clone()).with_dtype(inputs[0].dtype),
            OutSpec::f32(inputs[1].shape.clone()).with_dtype(inputs[1].dtype),
            OutSpec::f32(inputs[2].shape.clone()).with_dtype(inputs[2].dtype),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "gqa_attention_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One head's scratch per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let threads = target.threads();
        let (q, k, v) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
        dims(self.name(), self.n_head, self.n_kv_head, q, k, v)
            .map_or(0, |s| threads.max(1) * backward_scratch(s.t, s.d))
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        // Recomputed QKᵀ, then dV, dP, dQ, dK, per query head.
        let t = inputs[0].shape.get(1).copied().unwrap_or(1).max(1);
        10 * (inputs[0].numel() / t * super::attention::score_pairs(t)) as u64
    }

    /// One work item per (batch, kv head): it runs that kv head's query heads one after the
    /// other, the first writing `dk`/`dv` and the rest accumulating into them, so no two
    /// threads ever write the same gradient element.
    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use super::par::SendPtr;
        let shapes = (k.in_shape(0), k.in_shape(1), k.in_shape(2));
        let Ok(s) = dims(
            self.name(),
            self.n_head,
            self.n_kv_head,
            shapes.0,
            shapes.1,
            shapes.2,
        ) else {
            unreachable!("shape rule checked at build time")
        };
        let (t, d, h, kh, group) = (s.t, s.d, s.h, s.kh, s.group());
        let (cq, ckv) = (h * d, kh * d);
        let q = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let kk = SendPtr(k.in_f32(1).as_ptr() as *mut f32);
        let v = SendPtr(k.in_f32(2).as_ptr() as *mut f32);
        let y = SendPtr(k.in_f32(3).as_ptr() as *mut f32);
        let lse = k.in_f32(4);
        let dy = SendPtr(k.in_f32(5).as_ptr() as *mut f32);
        let dq = SendPtr(k.out_f32(0).as_mut_ptr());
        let dk = SendPtr(k.out_f32(1).as_mut_ptr());
        let dv = SendPtr(k.out_f32(2).as_mut_ptr());
        let scale = 1.0 / (d as f32).sqrt();
        super::par::for_each_item(
            k.workspace(),
            backward_scratch(t, d),
            s.b * kh,
            |item, ws| {
                let (bi, kvh) = (item / kh, item % kh);
                // SAFETY: every pointer stays inside its tensor; this (b, kv head) item alone writes
                // its kv head's columns of dk and dv, and its query heads' columns of dq.
                unsafe {
                    let kv_off = bi * t * ckv + kvh * d;
                    let (rq, rkv) = (
                        |ptr| Rows { ptr, stride: cq },
                        |ptr| Rows { ptr, stride: ckv },
                    );
                    for j in 0..group {
                        let hi = kvh * group + j;
                        let off = bi * t * cq + hi * d;
                        let head = HeadGrads {
                            q: rq(q.get().add(off)),
                            k: rkv(kk.get().add(kv_off)),
                            v: rkv(v.get().add(kv_off)),
                            y: rq(y.get().add(off)),
                            dy: rq(dy.get().add(off)),
                            dq: rq(dq.get().add(off)),
                            dk: rkv(dk.get().add(kv_off)),
                            dv: rkv(dv.get().add(kv_off)),
                        };
                        let lse_row = &lse[(bi * h + hi) * t..(bi * h + hi + 1) * t];
                        // The first query head of the group writes dk/dv, the rest add to them.
                        head_backward((t, d, scale), &head, lse_row, ws, j > 0);
                    }
                }
            },
        );
    }
}
