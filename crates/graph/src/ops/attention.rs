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
    check_scratch(op, qkv[1], c / n_head)?;
    Ok((qkv[0], qkv[1], c, c / n_head))
}

/// Refuses a sequence whose per-head scratch (the scores, `t`² floats, for each of up to
/// [`crate::MAX_THREADS`] threads) cannot even be counted in bytes: such a step is beyond any
/// machine, and a count that wrapped would plan too little scratch for the kernel.
pub(super) fn check_scratch(op: &'static str, t: usize, d: usize) -> Result<()> {
    let bytes = checked_backward_scratch(t, d).and_then(|n| n.checked_mul(4 * crate::MAX_THREADS));
    if bytes.is_some_and(|b| b <= isize::MAX as usize) {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!(
                "a sequence of {t} positions: each head's attention scores ({t}² floats a \
                 thread) are beyond any machine's memory"
            ),
        ))
    }
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
        dims(self.name(), &inputs[0].shape, self.n_head).map_or(0, |(_, t, _, d)| {
            threads.saturating_mul(forward_scratch(t, d))
        })
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match dims(self.name(), &inputs[0].shape, self.n_head) {
            // QKᵀ and PV over the blocked causal pairs.
            Ok((b, t, c, _)) => super::flops_of(4, &[b, score_pairs(t), c]),
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
        dims(self.name(), &inputs[0].shape, self.n_head).map_or(0, |(_, t, _, d)| {
            threads.saturating_mul(backward_scratch(t, d))
        })
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match dims(self.name(), &inputs[0].shape, self.n_head) {
            // Recomputed QKᵀ, then dV, dP, dQ, dK.
            Ok((b, t, c, _)) => super::flops_of(10, &[b, score_pairs(t), c]),
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

/// [`backward_scratch`], `None` where it cannot be counted (the larger of the two scratches,
/// so this bounds the forward's too).
fn checked_backward_scratch(t: usize, d: usize) -> Option<usize> {
    let scores = t.checked_mul(t)?.checked_mul(2)?;
    let across = t
        .checked_next_multiple_of(64)?
        .checked_mul(d)?
        .checked_mul(2)?;
    scores.checked_add(across)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::GqaAttention;
    use crate::{DType, Graph};

    /// A sequence whose scores cannot be counted (2^32 positions: 2^64 floats a head) is a
    /// shape error as the graph is built, for both attentions; a model's long context (a
    /// Llama's 131,072) is not, and its FLOPs count saturates rather than wrapping.
    #[test]
    fn sequences_past_countable_scores_are_refused_at_build() {
        for (t, refused) in [(1usize << 32, true), (1 << 24 | 1, true), (131_072, false)] {
            let mut g = Graph::new();
            let qkv = g.input("qkv", &[1, t, 3 * 64], DType::F32).unwrap();
            let causal = g.apply(CausalAttention { n_head: 2 }, &[qkv]);
            let q = g.input("q", &[1, t, 64], DType::F32).unwrap();
            let kv = g.input("k", &[1, t, 32], DType::F32).unwrap();
            let gqa = g.apply(
                GqaAttention {
                    n_head: 2,
                    n_kv_head: 1,
                },
                &[q, kv, kv],
            );
            for (name, r) in [("causal", causal.map(|_| ())), ("gqa", gqa.map(|_| ()))] {
                match r {
                    Err(GraphError::Shape { detail, .. }) if refused => {
                        assert!(detail.contains(&format!("{t} positions")), "{detail}")
                    }
                    Ok(()) if !refused => {}
                    other => panic!("{name} at {t}: {other:?}"),
                }
            }
        }
        assert_eq!(
            crate::ops::flops_of(10, &[1 << 20, 1 << 40, 1 << 20]),
            u64::MAX
        );
    }
}
