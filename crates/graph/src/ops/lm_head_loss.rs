//! The language-model head and its cross-entropy, fused and tiled: logits for a tile of `rows`
//! tokens × `cols` vocabulary entries at a time live in the op's workspace, so the full
//! `tokens × vocab` logits tensor and its gradient never exist. At GPT-2's vocabulary and
//! 4,096 tokens that is 824 MB per logits-sized tensor.
//!
//! The forward walks each row's vocabulary in blocks with a running max and sum (an online
//! log-sum-exp, as in FlashAttention), so tiles can span every token: each block of the head
//! is then packed for the GEMM once per step rather than once per few hundred tokens, and the
//! head's gradient is written once per block. The backward recomputes each tile's logits (one
//! extra head GEMM) from the saved per-row log-sum-exp.

use super::cross_entropy::check_mask;
use super::{expect_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Inputs `[x [N, C], head, targets [N] (i32)]`, where `head` is `[V, C]` when `tb` (tied to
/// the embedding) and `[C, V]` otherwise; masked, also `mask [N] (f32), divisor [] (f32)`, as
/// [`super::CrossEntropy`] takes them. Outputs the loss `[]` (the mean, or `Σ mask·ce /
/// divisor`) and each row's log-sum-exp `[N]` (kept for the backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmHeadLoss {
    pub tb: bool,
    /// Tokens per tile of logits.
    pub rows: usize,
    /// Vocabulary entries per tile of logits.
    pub cols: usize,
    /// The head's products compute in bf16 arithmetic where the device has it (a bf16 run's,
    /// set by the precision pass: autocast computes the head's linear layer so); memory is
    /// the same either way.
    pub bf16: bool,
}

/// A tile of `rows × cols` logits, clamped to the problem's `n` tokens and `v` entries.
pub fn tile(rows: usize, cols: usize, n: usize, v: usize) -> (usize, usize) {
    (rows.clamp(1, n.max(1)), cols.clamp(1, v.max(1)))
}

/// `(N, C, V)` of valid inputs.
fn dims(op: &'static str, tb: bool, inputs: &[&TensorMeta]) -> Result<(usize, usize, usize)> {
    if inputs.len() < 3 {
        return Err(GraphError::Arity {
            op,
            expected: 3,
            got: inputs.len(),
        });
    }
    expect_dtype(op, inputs, 2, DType::I32)?;
    let (x, w, t) = (&inputs[0].shape, &inputs[1].shape, &inputs[2].shape);
    if x.len() != 2 || w.len() != 2 || t.len() != 1 || t[0] != x[0] {
        return Err(shape_err(
            op,
            format!("x {x:?}, head {w:?} and targets {t:?} must be [N, C], 2-D and [N]"),
        ));
    }
    let (c, v) = if tb { (w[1], w[0]) } else { (w[0], w[1]) };
    if c != x[1] {
        return Err(shape_err(
            op,
            format!("x {x:?} does not match head {w:?} (transposed: {tb})"),
        ));
    }
    Ok((x[0], c, v))
}

impl OpRule for LmHeadLoss {
    fn name(&self) -> &'static str {
        "lm_head_loss"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        let (n, _, _) = dims(self.name(), self.tb, inputs)?;
        check_mask(self.name(), inputs, 3, n)?;
        Ok(vec![
            OutSpec::f32(vec![]),
            OutSpec::f32(vec![n]).named("lse"),
        ])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dl) = ctx.grad_out(0) else {
            return Ok(());
        };
        if !(ctx.wants(0) || ctx.wants(1)) {
            return Ok(());
        }
        let mut ins = vec![ctx.input(0), ctx.input(1), ctx.input(2), ctx.output(1), dl];
        if ctx.input_count() == 5 {
            ins.extend([ctx.input(3), ctx.input(4)]);
        }
        let back = LmHeadLossBackward {
            tb: self.tb,
            rows: self.rows,
            cols: self.cols,
            bf16: self.bf16,
        };
        let grads = ctx.apply(back, &ins)?;
        for (i, g) in grads.into_iter().enumerate() {
            if ctx.wants(i) {
                ctx.set_grad(i, g);
            }
        }
        Ok(())
    }

    /// One tile of logits, each tile row's running sum and target logit, and one loss per
    /// token (summed in a fixed order: bit-reproducible).
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        let (n, v) = (inputs[0].shape[0], head_vocab(self.tb, inputs[1]));
        let (rows, cols) = tile(self.rows, self.cols, n, v);
        rows * cols + 2 * rows + n
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        let (n, c) = (inputs[0].shape[0], inputs[0].shape[1]);
        let v = head_vocab(self.tb, inputs[1]);
        super::flops_of(2, &[n, c, v]).saturating_add(super::flops_of(3, &[n, v]))
    }
}

/// Inputs `[x, head, targets, lse, dloss]`, and masked also `[mask, divisor]`; outputs `dx`
/// and `dhead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmHeadLossBackward {
    pub tb: bool,
    pub rows: usize,
    pub cols: usize,
    /// As [`LmHeadLoss::bf16`].
    pub bf16: bool,
}

impl OpRule for LmHeadLossBackward {
    fn name(&self) -> &'static str {
        "lm_head_loss_backward"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.len() < 5 {
            return Err(GraphError::Arity {
                op: self.name(),
                expected: 5,
                got: inputs.len(),
            });
        }
        let (n, _, _) = dims(self.name(), self.tb, inputs)?;
        check_mask(self.name(), inputs, 5, n)?;
        if inputs[3].shape != [n] || inputs[4].numel() != 1 {
            return Err(shape_err(
                self.name(),
                format!(
                    "lse {:?} must be [{n}] and dloss {:?} a scalar",
                    inputs[3].shape, inputs[4].shape
                ),
            ));
        }
        Ok(vec![
            OutSpec::f32(inputs[0].shape.clone()).with_dtype(inputs[0].dtype),
            OutSpec::f32(inputs[1].shape.clone()).with_dtype(inputs[1].dtype),
        ])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "lm_head_loss_backward",
            detail: "second derivatives are not supported".into(),
        })
    }

    /// One tile of logits; where a tile spans part of the vocabulary, also its rows' `dx`,
    /// summed over the vocabulary's blocks before it is written.
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        let (n, v) = (inputs[0].shape[0], head_vocab(self.tb, inputs[1]));
        let (rows, cols) = tile(self.rows, self.cols, n, v);
        rows * cols
            + if cols < v {
                rows * inputs[0].shape[1]
            } else {
                0
            }
    }

    /// `dx` may be written over `x`: a tile's rows of `x` are read (for its logits and the
    /// head's gradient) before its rows of `dx` are written.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[0]
    }

    /// The recomputed logits plus the two gradient GEMMs.
    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        let (n, c) = (inputs[0].shape[0] as u64, inputs[0].shape[1] as u64);
        let v = head_vocab(self.tb, inputs[1]) as u64;
        6 * n * c * v + 4 * n * v
    }
}

fn head_vocab(tb: bool, head: &TensorMeta) -> usize {
    head_vocab_of(tb, &head.shape)
}

/// The vocabulary size of a head of `shape`, `[V, C]` when `tb` (tied) else `[C, V]`.
pub fn head_vocab_of(tb: bool, shape: &[usize]) -> usize {
    if tb {
        shape[0]
    } else {
        shape[1]
    }
}
