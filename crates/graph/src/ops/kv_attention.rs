//! Causal attention over a key/value cache, for sampling: the `T` new positions' keys and
//! values are written into the caches at rows `pos .. pos + T`, then query row `i` (absolute
//! position `pos + i`) attends over cache rows `0 ..= pos + i`. A prefill runs it once with the
//! prompt (`pos` 0, `T` its length); each decode step with one token at the next position. The
//! caches are persistent tensors the op updates in place, so they carry over between runs and
//! between the prefill and decode graphs of one session. Forward only.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result};

/// Separate inputs `[q [B, T, n_head·D], k [B, T, n_kv_head·D], v [B, T, n_kv_head·D],
/// k_cache [B, S, n_kv_head·D], v_cache [B, S, n_kv_head·D], pos i32 [1]]`, or with `packed`
/// GPT-2's fused projection `[qkv [B, T, 3·n_head·D], k_cache, v_cache, pos]` (then
/// `n_kv_head == n_head`). Output `y [B, T, n_head·D]`. `pos + T ≤ S` is the caller's to keep
/// (the runtime range-checks the position it writes); the kernel writes nothing past `S`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvAttention {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub packed: bool,
}

/// Sizes of one cached attention: batch, new positions, cache rows, query heads, kv heads,
/// head width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub h: usize,
    pub kh: usize,
    pub d: usize,
}

impl KvAttention {
    /// Index of the first cache input (the key cache).
    pub fn cache_input(&self) -> usize {
        if self.packed {
            1
        } else {
            3
        }
    }

    /// The sizes of valid inputs (shapes in input order), or the shape error.
    pub fn dims(&self, shapes: &[&[usize]]) -> Result<Dims> {
        let name = self.name();
        let (h, kh) = (self.n_head, self.n_kv_head);
        if h == 0 || kh == 0 || !h.is_multiple_of(kh) || (self.packed && kh != h) {
            return Err(shape_err(
                name,
                format!(
                    "{h} query heads cannot be grouped over {kh} kv heads{}",
                    if self.packed { " (packed: equal)" } else { "" }
                ),
            ));
        }
        let c = self.cache_input();
        if shapes.len() != c + 3 {
            return Err(GraphError::Arity {
                op: name,
                expected: c + 3,
                got: shapes.len(),
            });
        }
        let q = shapes[0];
        let parts = if self.packed { 3 * h } else { h };
        if q.len() != 3 || q[2] == 0 || !q[2].is_multiple_of(parts) {
            return Err(shape_err(
                name,
                format!("q must be [B, T, {parts} heads × D], got {q:?}"),
            ));
        }
        let (b, t, d) = (q[0], q[1], q[2] / parts);
        if !self.packed {
            let kv = [b, t, kh * d];
            if shapes[1] != kv || shapes[2] != kv {
                return Err(shape_err(
                    name,
                    format!(
                        "k {:?} and v {:?} must be {kv:?} ({kh} kv heads of width {d})",
                        shapes[1], shapes[2]
                    ),
                ));
            }
        }
        let (kc, vc) = (shapes[c], shapes[c + 1]);
        if kc.len() != 3 || kc[0] != b || kc[2] != kh * d || kc != vc {
            return Err(shape_err(
                name,
                format!("caches {kc:?} and {vc:?} must both be [{b}, S, {}]", kh * d),
            ));
        }
        let s = kc[1];
        if t == 0 || t > s {
            return Err(shape_err(
                name,
                format!("{t} new positions do not fit a cache of {s}"),
            ));
        }
        if shapes[c + 2] != [1] {
            return Err(shape_err(
                name,
                format!("pos must be [1], got {:?}", shapes[c + 2]),
            ));
        }
        Ok(Dims { b, t, s, h, kh, d })
    }
}

impl OpRule for KvAttention {
    fn name(&self) -> &'static str {
        "kv_attention"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        let c = self.cache_input();
        expect_arity(self.name(), inputs, c + 3)?;
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        let s = self.dims(&shapes)?;
        float_dtype(self.name(), &inputs[..c + 2])?;
        if inputs[0].dtype != DType::F32 {
            return Err(GraphError::DType {
                op: self.name(),
                index: 0,
                expected: DType::F32,
                found: inputs[0].dtype,
            });
        }
        super::expect_dtype(self.name(), inputs, c + 2, DType::I32)?;
        super::check_persistent(self.name(), inputs, [c, c + 1])?;
        Ok(vec![OutSpec::f32(vec![s.b, s.t, s.h * s.d])])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "kv_attention",
            detail: "attention over a key/value cache is for inference; it has no gradient".into(),
        })
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        if self.packed {
            &[1, 2]
        } else {
            &[3, 4]
        }
    }

    /// One row of scores (a cache's length) per thread.
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        self.dims(&shapes)
            .map_or(0, |s| target.threads().max(1).saturating_mul(s.s))
    }

    /// At the most the position can be: every query row against the whole cache.
    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        self.dims(&shapes)
            .map_or(0, |s| super::flops_of(4, &[s.b, s.t, s.h, s.d, s.s]))
    }
}
