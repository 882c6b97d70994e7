//! [`HalfRead`]: a product that reads 16-bit (bf16) activations straight from their storage,
//! instead of through a whole f32 copy made by an up-cast. Under mixed precision every
//! activation and gradient a linear layer reads is held in bf16, and each was read through
//! `cast(x16) -> f32`; the CPU's GEMM widens the bf16 values as it packs them instead (bf16 to
//! f32 is exact), so the product is bitwise the same, the f32 copy never exists, and the
//! packing reads half the bytes. Made after autodiff by [`crate::passes::read_halves`] where
//! the target's kernels offer it ([`crate::Fusions::half_reads`]) and its own GEMM runs the
//! product (no decode panel is planned).

use super::{shape_err, MatMul, Op, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, GraphError, Result, Target};

/// `reader` with the inputs `halves` flags (bit `i` for input `i`) held in bf16 and widened
/// as it reads them. Readers: a [`MatMul`] with one shared right operand (a linear layer, its
/// input's gradient and its weight's gradient), reading either operand or both so.
#[derive(Debug, Clone, PartialEq)]
pub struct HalfRead {
    pub reader: Box<Op>,
    pub halves: u8,
}

impl HalfRead {
    pub const NAME: &'static str = "half_matmul";

    /// A matmul reading the operands `halves` flags in bf16.
    pub fn matmul(mm: MatMul, halves: u8) -> HalfRead {
        HalfRead {
            reader: Box::new(Op::MatMul(mm)),
            halves,
        }
    }

    /// The product this reads for, if its reader is one.
    pub fn product(&self) -> Option<&MatMul> {
        match &*self.reader {
            Op::MatMul(mm) => Some(mm),
            _ => None,
        }
    }

    /// Whether input `i` is read in bf16.
    pub fn is_half(&self, i: usize) -> bool {
        i < 8 && self.halves & (1 << i) != 0
    }

    /// Whether `reader` can read input `i` in bf16: either operand of a product, never its
    /// bias.
    pub fn reads(reader: &Op, i: usize) -> bool {
        matches!(reader, Op::MatMul(_)) && i < 2
    }

    /// The reader's input metadata, each bf16 input seen as the f32 tensor it widens to.
    fn reader_inputs(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
        if self.halves == 0 || (0..8).any(|i| self.is_half(i) && !Self::reads(&self.reader, i)) {
            return Err(GraphError::Invalid {
                op: Self::NAME,
                detail: format!(
                    "`{}` cannot read inputs {:#b} in bf16",
                    self.reader.name(),
                    self.halves
                ),
            });
        }
        inputs
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !self.is_half(i) {
                    return Ok((*m).clone());
                }
                if m.dtype != DType::BF16 {
                    return Err(shape_err(
                        Self::NAME,
                        format!("input {i} `{}` must be bf16, got {}", m.name, m.dtype),
                    ));
                }
                Ok(TensorMeta {
                    dtype: DType::F32,
                    ..(*m).clone()
                })
            })
            .collect()
    }
}

impl OpRule for HalfRead {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        let metas = self.reader_inputs(inputs)?;
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        if let (Op::MatMul(mm), [a, b, ..]) = (&*self.reader, &refs[..]) {
            // The kernel runs one product: a linear layer's, its input's or its weight's
            // gradient (a shared `b`, every leading axis of `a` folded into rows).
            if mm.dims(&a.shape, &b.shape).is_ok_and(|d| d.batch != 1) {
                return Err(shape_err(
                    Self::NAME,
                    format!(
                        "reads one product in bf16, not a batch of them: {:?} · {:?}",
                        a.shape, b.shape
                    ),
                ));
            }
        }
        let mut outs = self.reader.infer(&refs)?;
        for o in &mut outs {
            o.view_of_input = None;
        }
        Ok(outs)
    }

    /// Made after autodiff, by a pass that keeps the values: no gradient rule of its own.
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: Self::NAME,
            detail: "made after autodiff; it has no gradient rule".into(),
        })
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &Target) -> usize {
        match self.reader_inputs(inputs) {
            Ok(metas) => {
                let refs: Vec<&TensorMeta> = metas.iter().collect();
                self.reader.workspace_elems(&refs, target)
            }
            Err(_) => 0,
        }
    }

    fn flops(&self, inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        match self.reader_inputs(inputs) {
            Ok(metas) => {
                let refs: Vec<&TensorMeta> = metas.iter().collect();
                self.reader.flops(&refs, outputs)
            }
            Err(_) => 0,
        }
    }
}
