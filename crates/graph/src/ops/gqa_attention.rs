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
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub kh: usize,
    pub d: usize,
}

impl Dims {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.h / self.kh
    }
}

/// The sizes of valid `q`, `k` and `v`, or the shape error naming `op`.
pub fn dims(
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
    super::attention::check_scratch(op, t, d)?;
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
        // The GPU kernel keeps its tiles in workgroup memory.
        if target.is_gpu() {
            return 0;
        }
        let threads = target.threads();
        let (q, k, v) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
        dims(self.name(), self.n_head, self.n_kv_head, q, k, v).map_or(0, |s| {
            threads.max(1).saturating_mul(forward_scratch(s.t, s.d))
        })
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        // QKᵀ and PV per query head over the blocked causal pairs.
        let t = inputs[0].shape.get(1).copied().unwrap_or(1).max(1);
        super::flops_of(
            4,
            &[inputs[0].numel() / t, super::attention::score_pairs(t)],
        )
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
        // The GPU kernel keeps its tiles in workgroup memory.
        if target.is_gpu() {
            return 0;
        }
        let threads = target.threads();
        let (q, k, v) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
        dims(self.name(), self.n_head, self.n_kv_head, q, k, v).map_or(0, |s| {
            threads.max(1).saturating_mul(backward_scratch(s.t, s.d))
        })
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        // Recomputed QKᵀ, then dV, dP, dQ, dK, per query head.
        let t = inputs[0].shape.get(1).copied().unwrap_or(1).max(1);
        super::flops_of(
            10,
            &[inputs[0].numel() / t, super::attention::score_pairs(t)],
        )
    }
}
