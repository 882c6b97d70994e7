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
pub fn dims(
    op: &'static str,
    qkv: &[usize],
    n_head: usize,
) -> Result<(usize, usize, usize, usize)> {
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
        // The GPU kernel keeps its tiles in workgroup memory.
        if target.is_gpu() {
            return 0;
        }
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
        if target.is_gpu() {
            return 0;
        }
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
}

/// Floats of one head's operand laid out with its `t` rows across, in strips of 64.
pub fn across_len(t: usize, d: usize) -> usize {
    t.next_multiple_of(64) * d
}

/// Scratch floats one head's forward needs: its scores and its keys laid across.
pub fn forward_scratch(t: usize, d: usize) -> usize {
    t * t + across_len(t, d)
}

/// Scratch floats one head's backward needs: probabilities and their gradient, and keys and
/// values laid across.
pub fn backward_scratch(t: usize, d: usize) -> usize {
    2 * t * t + 2 * across_len(t, d)
}

/// Query rows handled together. Row block `[r0, r1)` only needs keys `[0, r1)`, so working in
/// blocks skips most of the masked upper triangle (about 40% of the work at T = 256).
const ROW_BLOCK: usize = 64;

/// Query-key pairs the blocked kernels compute per head: each row block against every key up
/// to its end.
pub(super) fn score_pairs(t: usize) -> usize {
    row_blocks(t).map(|(r0, r1)| (r1 - r0) * r1).sum()
}

/// Row blocks `(r0, r1)` covering `0..t`.
pub fn row_blocks(t: usize) -> impl DoubleEndedIterator<Item = (usize, usize)> {
    (0..t)
        .step_by(ROW_BLOCK)
        .map(move |r0| (r0, (r0 + ROW_BLOCK).min(t)))
}
