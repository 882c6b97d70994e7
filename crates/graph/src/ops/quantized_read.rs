//! [`QuantizedRead`]: an op that reads a frozen weight stored quantized straight from its codes
//! (bf16, int8 or NF4, [`super::dequantize`]), so no f32 copy of the whole weight exists. The
//! CPU's products decode each panel of the weight as the GEMM packs it (the register tile sees
//! the values a [`super::Dequantize`] would have written, so the product is bitwise the same);
//! the embedding's gather decodes only the rows it reads. Made after autodiff by
//! [`crate::passes::quantize_frozen`] where the target's kernels offer it
//! ([`crate::Fusions::quantized_reads`]); a target without it reads a [`super::Dequantize`]'s
//! copy instead.

use super::{shape_err, MatMul, Op, OpRule, OutSpec, QuantizeBase};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{CpuGemm, DType, GraphError, Result, Target};

/// Depth of the panel of a quantized weight decoded at a time where the CPU's own blocked
/// kernel does not run a product (the gemm crate's fallback, a CPU without AVX2): `PANEL` rows
/// of `op(W)` into a workspace of `PANEL × n`, one partial product each.
pub const PANEL: usize = 256;

/// `reader` run with its input `weight` (a 2-D f32 frozen weight of `shape`) stored as `base`
/// says: that input is replaced by the stored codes, followed by their absmax scales (f32) for
/// int8 and NF4. Readers: a [`MatMul`] reading the weight as `b`, the fused LM head and its
/// backward (which, the head being frozen, makes no gradient for it: only `dx` is an output),
/// the embedding's gather, and a slice of rows (GPT's positions), decoded into a tensor of its
/// own rather than viewed.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedRead {
    pub base: QuantizeBase,
    /// The weight's f32 shape.
    pub shape: Vec<usize>,
    /// The reader's input that is the weight.
    pub weight: usize,
    pub reader: Box<Op>,
}

impl QuantizedRead {
    /// Whether `reader` can read its input `weight` quantized.
    pub fn reads(reader: &Op, weight: usize) -> bool {
        match reader {
            Op::MatMul(_) | Op::LmHeadLoss(_) | Op::LmHeadLossBackward(_) => weight == 1,
            Op::Embedding(_) | Op::Narrow(_) => weight == 0,
            _ => false,
        }
    }

    /// Inputs the stored weight takes: the codes, and the scales where the scheme has them.
    pub fn stored_inputs(&self) -> usize {
        1 + self.base.scheme().is_some() as usize
    }

    /// The fused op's input that holds the reader's input `i` (not the weight).
    pub fn input_of(&self, i: usize) -> usize {
        if i < self.weight {
            i
        } else {
            i + self.stored_inputs() - 1
        }
    }

    /// The reader's input metadata, the weight's f32 meta in place of its stored tensors.
    fn reader_inputs<'a>(
        &self,
        inputs: &[&'a TensorMeta],
        weight: &'a TensorMeta,
    ) -> Result<Vec<&'a TensorMeta>> {
        let stored = self.stored_inputs();
        if inputs.len() < self.weight + stored {
            return Err(GraphError::Arity {
                op: self.name(),
                expected: self.weight + stored,
                got: inputs.len(),
            });
        }
        let (dtype, codes, absmax) = self.base.storage(&self.shape);
        let s = &inputs[self.weight..self.weight + stored];
        let absmax_ok = match &absmax {
            Some(a) => s[1].dtype == DType::F32 && s[1].shape == *a,
            None => true,
        };
        if s[0].dtype != dtype || s[0].shape != codes || !absmax_ok {
            return Err(shape_err(
                self.name(),
                format!(
                    "a {:?} weight stored as {} takes {dtype} codes {codes:?} and absmax \
                     {absmax:?}, got {} {:?}{}",
                    self.shape,
                    self.base,
                    s[0].dtype,
                    s[0].shape,
                    s.get(1)
                        .map(|a| format!(" and {} {:?}", a.dtype, a.shape))
                        .unwrap_or_default()
                ),
            ));
        }
        let mut out: Vec<&TensorMeta> = inputs[..self.weight].to_vec();
        out.push(weight);
        out.extend_from_slice(&inputs[self.weight + stored..]);
        Ok(out)
    }

    fn weight_meta(&self) -> TensorMeta {
        TensorMeta {
            name: "weight".into(),
            shape: self.shape.clone(),
            dtype: DType::F32,
            role: crate::Role::Parameter,
            view_of: None,
        }
    }
}

/// Whether the CPU's own blocked kernel runs an `m × k` by `k × n` product on a target with
/// `gemm` (`snug_cpu`'s dispatch, which a test there holds to this): AVX-512 or AVX2 tiles, at
/// least 16 output columns, and products big enough that packing pays.
pub fn own_gemm_runs(gemm: CpuGemm, (m, n, k): (usize, usize, usize)) -> bool {
    gemm != CpuGemm::Portable && n >= 16 && m * n * k >= 1 << 22
}

/// Floats of the panel a product of `op(W)` with `k` rows and `n` columns decodes at a time
/// where the own kernel does not run it.
pub fn panel_elems(k: usize, n: usize) -> usize {
    k.min(PANEL) * n
}

impl OpRule for QuantizedRead {
    fn name(&self) -> &'static str {
        match *self.reader {
            Op::MatMul(_) => "quantized_matmul",
            Op::LmHeadLoss(_) => "quantized_lm_head_loss",
            Op::LmHeadLossBackward(_) => "quantized_lm_head_loss_backward",
            Op::Embedding(_) => "quantized_embedding",
            Op::Narrow(_) => "quantized_narrow",
            _ => "quantized_read",
        }
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if !Self::reads(&self.reader, self.weight) || self.shape.len() != 2 {
            return Err(GraphError::Invalid {
                op: "quantized_read",
                detail: format!(
                    "`{}` cannot read its input {} ({:?}) from quantized codes",
                    self.reader.name(),
                    self.weight,
                    self.shape
                ),
            });
        }
        let w = self.weight_meta();
        let mut outs = self.reader.infer(&self.reader_inputs(inputs, &w)?)?;
        if matches!(*self.reader, Op::LmHeadLossBackward(_)) {
            // The frozen head's gradient is never made.
            outs.truncate(1);
        }
        // The rows are decoded, not viewed.
        for o in &mut outs {
            o.view_of_input = None;
        }
        Ok(outs)
    }

    /// Made after autodiff, for frozen weights only.
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "quantized_read",
            detail: "reads a frozen weight after autodiff; it has no gradient rule".into(),
        })
    }

    /// The reader's own, plus the decoded panels where the CPU's own kernel does not run its
    /// products: for a matmul one panel of its `op(W)`, for the LM head one of each of its two
    /// products with the head (a block of the vocabulary read `[C, vb]` and its transpose),
    /// reserved whatever the tile (a partial last tile may fall below the own kernel's size).
    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &Target) -> usize {
        let w = self.weight_meta();
        let Ok(ins) = self.reader_inputs(inputs, &w) else {
            return 0;
        };
        let own = self.reader.workspace_elems(&ins, target);
        let gemm = target.cpu_gemm().unwrap_or(CpuGemm::Portable);
        let decode = match &*self.reader {
            Op::MatMul(mm) => match mm.dims(&ins[0].shape, &ins[1].shape) {
                Ok(d) if !own_gemm_runs(gemm, (d.m, d.n, d.k)) => panel_elems(d.k, d.n),
                _ => 0,
            },
            Op::LmHeadLoss(h) => {
                let (n, c) = (ins[0].shape[0], ins[0].shape[1]);
                let v = super::lm_head_loss::head_vocab_of(h.tb, &self.shape);
                let (_, cols) = super::lm_head_loss::tile(h.rows, h.cols, n, v);
                panel_elems(c, cols)
            }
            Op::LmHeadLossBackward(h) => {
                let (n, c) = (ins[0].shape[0], ins[0].shape[1]);
                let v = super::lm_head_loss::head_vocab_of(h.tb, &self.shape);
                let (_, cols) = super::lm_head_loss::tile(h.rows, h.cols, n, v);
                // The logits' product reads the head `[C, vb]`, dx's its transpose.
                panel_elems(c, cols).max(panel_elems(cols, c))
            }
            _ => 0,
        };
        own + decode
    }

    fn inplace_inputs(&self) -> &'static [usize] {
        // The LM head's backward may write dx over x (input 0, before the weight).
        match *self.reader {
            Op::LmHeadLossBackward(_) => &[0],
            _ => &[],
        }
    }

    fn flops(&self, inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        let w = self.weight_meta();
        match self.reader_inputs(inputs, &w) {
            Ok(ins) => match &*self.reader {
                // The logits again and dx; no gradient for the head.
                Op::LmHeadLossBackward(h) => {
                    let (n, c) = (ins[0].shape[0] as u64, ins[0].shape[1] as u64);
                    let v = super::lm_head_loss::head_vocab_of(h.tb, &self.shape) as u64;
                    4 * n * c * v + 4 * n * v
                }
                reader => reader.flops(&ins, outputs),
            },
            Err(_) => 0,
        }
    }
}

impl QuantizedRead {
    /// A matmul reading `weight` as `b`, as the fusion makes it.
    pub fn matmul(mm: MatMul, base: QuantizeBase, shape: Vec<usize>) -> QuantizedRead {
        QuantizedRead {
            base,
            shape,
            weight: 1,
            reader: Box::new(Op::MatMul(mm)),
        }
    }
}
