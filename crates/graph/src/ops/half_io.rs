//! [`HalfIo`]: an op that reads some of its inputs straight from their 16-bit (bf16) storage
//! and writes some of its outputs there, instead of through whole f32 copies made by casts.
//! Under mixed precision every activation and gradient is held in bf16 and each was read
//! through `cast(x16) -> f32` and stored through `cast(y) -> bf16`; a kernel that widens as it
//! reads (bf16 to f32 is exact) and rounds to nearest even as it stores (as the cast does)
//! computes bitwise the same step, and neither f32 copy exists (the CPU backend's bf16
//! arithmetic on AVX512-BF16, when on, rounds a product's f32 operand as well, so there the
//! step is PyTorch's autocast's rather than the casting graph's). Made after autodiff by
//! [`crate::passes::fold_half_casts`] where the target's kernels offer it
//! ([`crate::Fusions::half_io`]).

use super::quantized_read::own_gemm_runs;
use super::{
    attention, gqa_attention, linear_dims, shape_err, tile_rows, BinaryKind, MatMul, Op, OpRule,
    OutSpec,
};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{CpuGemm, DType, GraphError, Result, Target};

/// Elements of the f32 tile (4 MiB) a product's rows are made in before they are rounded
/// into its bf16 output: the whole f32 output is never held, only this much of it.
pub const WRITE_TILE_ELEMS: usize = 1 << 20;

/// Rows of a `[rows, n]` product output made at a time when it is written in bf16.
pub fn write_tile_rows(rows: usize, n: usize) -> usize {
    tile_rows(rows, n, WRITE_TILE_ELEMS)
}

/// `op` with the inputs `reads` flags (bit `i` for input `i`) held in bf16 and widened as it
/// reads them, and the outputs `writes` flags stored in bf16, rounded as it writes them.
#[derive(Debug, Clone, PartialEq)]
pub struct HalfIo {
    pub op: Box<Op>,
    pub reads: u8,
    pub writes: u8,
}

impl HalfIo {
    /// A matmul reading the operands `reads` flags in bf16.
    pub fn matmul(mm: MatMul, reads: u8) -> HalfIo {
        HalfIo {
            op: Box::new(Op::MatMul(mm)),
            reads,
            writes: 0,
        }
    }

    /// The product this runs, if its op is one.
    pub fn product(&self) -> Option<&MatMul> {
        match &*self.op {
            Op::MatMul(mm) => Some(mm),
            _ => None,
        }
    }

    /// Whether input `i` is read in bf16.
    pub fn reads(&self, i: usize) -> bool {
        i < 8 && self.reads & (1 << i) != 0
    }

    /// Whether output `i` is written in bf16.
    pub fn writes(&self, i: usize) -> bool {
        i < 8 && self.writes & (1 << i) != 0
    }

    /// The inputs of `op` its CPU kernel can read in bf16, as a mask: a product's operands
    /// (never its bias), the activation a fused GELU-linear reads, attention's packed `qkv`,
    /// output and output gradient, a fused norm-linear's output gradient, a sum's input (a
    /// bias gradient summed from that output gradient), an add's operands (the residual
    /// stream and its gradient; the pass folds adds of equal shapes only), and Llama's
    /// elementwise and row ops: RMSNorm's `x` (its backward's `dy` and `x`), SwiGLU's `gate`
    /// and `up` (its backward's and `dy`), RoPE's input, grouped-query attention's `q`, `k`,
    /// `v` (its backward's and `y`, `dy`).
    pub fn readable(op: &Op) -> u8 {
        match op {
            Op::MatMul(_) => 0b11,
            Op::LayerNormLinearBackward(_) => 1 << 6,
            Op::SumTo(_) => 0b1,
            Op::Binary(b) if b.kind == BinaryKind::Add => 0b11,
            Op::GeluLinear(_) | Op::GeluLinearBackward(_) => 0b1,
            Op::CausalAttention(_) => 0b1,
            Op::CausalAttentionBackward(_) => 0b1011,
            Op::SwiGlu(_) | Op::RmsNormBackward(_) => 0b11,
            Op::SwiGluBackward(_) | Op::GqaAttention(_) => 0b111,
            Op::RmsNorm(_) | Op::Rope(_) => 0b1,
            // `q`, `k`, `v`, `y` and `dy`; never the log-sum-exp, kept in f32.
            Op::GqaAttentionBackward(_) => 0b10_1111,
            _ => 0,
        }
    }

    /// The outputs of `op` its CPU kernel can write in bf16, as a mask: attention's output,
    /// the activation gradients of a fused GELU-linear's and of attention's backward, a sum's
    /// (the residual stream and its gradient), and the output of a product whose rows are its
    /// input's (a plain, LayerNorm- or GELU-fused linear layer, or an input gradient), made a
    /// tile of rows at a time in f32 and rounded ([`HalfIo::writes_on`] says which shapes),
    /// and Llama's: RMSNorm's output and its backward's `dx`, SwiGLU's output and both its
    /// backward's gradients, RoPE's output, grouped-query attention's output and its
    /// backward's `dq`, `dk`, `dv`.
    pub fn writable(op: &Op) -> u8 {
        match op {
            Op::CausalAttention(_) | Op::GeluLinearBackward(_) | Op::CausalAttentionBackward(_) => {
                0b1
            }
            Op::Binary(b) if b.kind == BinaryKind::Add => 0b1,
            Op::MatMul(_) | Op::LayerNormLinear(_) | Op::GeluLinear(_) => 0b1,
            Op::SwiGlu(_) | Op::RmsNorm(_) | Op::RmsNormBackward(_) | Op::Rope(_) => 0b1,
            Op::GqaAttention(_) => 0b1,
            Op::SwiGluBackward(_) => 0b11,
            Op::GqaAttentionBackward(_) => 0b111,
            _ => 0,
        }
    }

    /// `(rows, k, n)` of an op [`HalfIo::writable`] names as a product: one product (a
    /// shared `b`) whose output rows are its left operand's rows as stored (not transposed).
    pub fn product_rows(op: &Op, inputs: &[&TensorMeta]) -> Option<(usize, usize, usize)> {
        match op {
            Op::MatMul(mm) if !mm.ta => {
                let d = mm
                    .dims(&inputs.first()?.shape, &inputs.get(1)?.shape)
                    .ok()?;
                (d.batch == 1).then_some((d.m, d.k, d.n))
            }
            Op::LayerNormLinear(_) => linear_dims(
                "layer_norm_linear",
                &inputs.first()?.shape,
                &inputs.get(3)?.shape,
            )
            .ok(),
            Op::GeluLinear(_) => {
                linear_dims("gelu_linear", &inputs.first()?.shape, &inputs.get(1)?.shape).ok()
            }
            _ => None,
        }
    }

    /// [`HalfIo::writable`] for `op` over these inputs on a CPU with `gemm`. A product is
    /// written a tile of rows at a time, so it is only where our GEMM runs the whole product
    /// and each tile of it: the tiles' values are then bitwise the whole product's.
    pub fn writes_on(op: &Op, inputs: &[&TensorMeta], gemm: CpuGemm) -> u8 {
        let mask = Self::writable(op);
        if !matches!(
            op,
            Op::MatMul(_) | Op::LayerNormLinear(_) | Op::GeluLinear(_)
        ) {
            return mask;
        }
        match Self::product_rows(op, inputs) {
            Some((0, ..)) | None => 0,
            Some((rows, k, n)) => {
                let tile = write_tile_rows(rows, n);
                let last = rows - (rows.div_ceil(tile) - 1) * tile;
                let runs = |m: usize| own_gemm_runs(gemm, (m, n, k));
                if runs(rows) && runs(tile.min(rows)) && runs(last) {
                    mask
                } else {
                    0
                }
            }
        }
    }

    /// Floats of the f32 tile output 0 is made in, where it is written in bf16.
    fn write_tile(&self, inputs: &[&TensorMeta]) -> usize {
        match (self.writes(0), Self::product_rows(&self.op, inputs)) {
            (true, Some((rows, _, n))) => write_tile_rows(rows, n) * n,
            _ => 0,
        }
    }

    fn invalid(&self, what: &str, mask: u8) -> GraphError {
        GraphError::Invalid {
            op: "half_io",
            detail: format!("`{}` cannot {what} {mask:#b} in bf16", self.op.name()),
        }
    }

    /// The op's input metadata, each bf16 input seen as the f32 tensor it widens to.
    fn op_inputs(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>> {
        if self.reads | self.writes == 0 {
            return Err(self.invalid("read or write", 0));
        }
        if self.reads & !Self::readable(&self.op) != 0 {
            return Err(self.invalid("read inputs", self.reads));
        }
        if self.writes & !Self::writable(&self.op) != 0 {
            return Err(self.invalid("write outputs", self.writes));
        }
        inputs
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !self.reads(i) {
                    return Ok((*m).clone());
                }
                if m.dtype != DType::BF16 {
                    return Err(shape_err(
                        self.name(),
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

    /// Per-thread floats the kernel widens a head's bf16 operands into, or rounds its bf16
    /// gradients from, beside the head's own scratch: `[t, 3d]` for `qkv` (and `dqkv`),
    /// `[t, d]` for the output and its gradient; `[t, d]` for each bf16 input and output of
    /// grouped-query attention; a row for RoPE's bf16 input and output.
    fn head_staging(&self, inputs: &[&TensorMeta]) -> usize {
        if let (Op::Rope(_), Some(x)) = (&*self.op, inputs.first()) {
            // A row of `x` widened, and one of `y` before it is rounded.
            let c = x.shape.last().copied().unwrap_or(0);
            return (usize::from(self.reads(0)) + usize::from(self.writes(0))) * c;
        }
        let gqa = match &*self.op {
            Op::GqaAttention(a) => Some((a.n_head, a.n_kv_head)),
            Op::GqaAttentionBackward(a) => Some((a.n_head, a.n_kv_head)),
            _ => None,
        };
        if let (Some((n_head, n_kv_head)), [q, k, v, ..]) = (gqa, inputs) {
            // One head of each bf16 input and output, `[t, d]` apiece, per work item.
            let Ok(s) =
                gqa_attention::dims(self.name(), n_head, n_kv_head, &q.shape, &k.shape, &v.shape)
            else {
                return 0;
            };
            let halves = (self.reads.count_ones() + self.writes.count_ones()) as usize;
            return halves * s.t * s.d;
        }
        let n_head = match &*self.op {
            Op::CausalAttention(a) => a.n_head,
            Op::CausalAttentionBackward(a) => a.n_head,
            _ => return 0,
        };
        let Ok((_, t, _, d)) = attention::dims(self.name(), &inputs[0].shape, n_head) else {
            return 0;
        };
        let [r0, r1, r3, w0] =
            [self.reads(0), self.reads(1), self.reads(3), self.writes(0)].map(usize::from);
        let widths = match &*self.op {
            // `qkv` in, the output out.
            Op::CausalAttention(_) => 3 * r0 + w0,
            // `qkv`, the output and its gradient in, `dqkv` out.
            _ => 3 * r0 + r1 + r3 + 3 * w0,
        };
        widths * t * d
    }
}

impl OpRule for HalfIo {
    fn name(&self) -> &'static str {
        match &*self.op {
            Op::MatMul(_) => "half_matmul",
            Op::GeluLinear(_) => "half_gelu_linear",
            Op::GeluLinearBackward(_) => "half_gelu_linear_backward",
            Op::CausalAttention(_) => "half_causal_attention",
            Op::CausalAttentionBackward(_) => "half_causal_attention_backward",
            Op::LayerNormLinear(_) => "half_layer_norm_linear",
            Op::LayerNormLinearBackward(_) => "half_layer_norm_linear_backward",
            Op::SumTo(_) => "half_sum_to",
            Op::SwiGlu(_) => "half_swiglu",
            Op::SwiGluBackward(_) => "half_swiglu_backward",
            Op::RmsNorm(_) => "half_rms_norm",
            Op::RmsNormBackward(_) => "half_rms_norm_backward",
            Op::Rope(_) => "half_rope",
            Op::GqaAttention(_) => "half_gqa_attention",
            Op::GqaAttentionBackward(_) => "half_gqa_attention_backward",
            Op::Binary(_) => "half_add",
            _ => "half_io",
        }
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        let metas = self.op_inputs(inputs)?;
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        if let (Op::MatMul(mm), [a, b, ..]) = (&*self.op, &refs[..]) {
            // The kernel runs one product: a linear layer's, its input's or its weight's
            // gradient (a shared `b`, every leading axis of `a` folded into rows).
            if mm.dims(&a.shape, &b.shape).is_ok_and(|d| d.batch != 1) {
                return Err(shape_err(
                    self.name(),
                    format!(
                        "reads one product in bf16, not a batch of them: {:?} · {:?}",
                        a.shape, b.shape
                    ),
                ));
            }
        }
        if let (Op::Binary(_), [a, b]) = (&*self.op, &refs[..]) {
            // The kernel adds element by element: no broadcast.
            if a.shape != b.shape {
                return Err(shape_err(
                    self.name(),
                    format!(
                        "adds equal shapes only, not {:?} and {:?}",
                        a.shape, b.shape
                    ),
                ));
            }
        }
        if self.writes(0)
            && matches!(
                &*self.op,
                Op::MatMul(_) | Op::LayerNormLinear(_) | Op::GeluLinear(_)
            )
            && Self::product_rows(&self.op, &refs).is_none()
        {
            return Err(shape_err(
                self.name(),
                "writes a product in bf16 only where its rows are its input's rows as stored"
                    .to_string(),
            ));
        }
        let mut outs = self.op.infer(&refs)?;
        for (i, o) in outs.iter_mut().enumerate() {
            o.view_of_input = None;
            if self.writes(i) {
                if o.dtype != DType::F32 {
                    return Err(shape_err(
                        self.name(),
                        format!("output {i} is {}, so it cannot be written in bf16", o.dtype),
                    ));
                }
                o.dtype = DType::BF16;
            }
        }
        if (outs.len() as u32) < 8 - self.writes.leading_zeros() {
            return Err(self.invalid("write outputs", self.writes));
        }
        Ok(outs)
    }

    /// Made after autodiff, by a pass that keeps the values: no gradient rule of its own.
    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "half_io",
            detail: "made after autodiff; it has no gradient rule".into(),
        })
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], target: &Target) -> usize {
        match self.op_inputs(inputs) {
            Ok(metas) => {
                let refs: Vec<&TensorMeta> = metas.iter().collect();
                let staging = if target.is_gpu() {
                    0
                } else {
                    target.threads().saturating_mul(self.head_staging(inputs))
                };
                let tile = if target.is_gpu() {
                    0
                } else {
                    self.write_tile(&refs)
                };
                self.op
                    .workspace_elems(&refs, target)
                    .saturating_add(staging)
                    .saturating_add(tile)
            }
            Err(_) => 0,
        }
    }

    /// As the op's: its kernel reads each element of that input before writing the same
    /// element of output 0, whatever their width (the in-place pass also needs the two to
    /// share a dtype).
    fn inplace_inputs(&self) -> &'static [usize] {
        match &*self.op {
            // Their kernels stage runs of the inputs and write the outputs apart.
            Op::SwiGlu(_) | Op::SwiGluBackward(_) | Op::RmsNorm(_) | Op::RmsNormBackward(_) => &[],
            Op::Rope(_) => &[],
            op => op.inplace_inputs(),
        }
    }

    fn flops(&self, inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        match self.op_inputs(inputs) {
            Ok(metas) => {
                let refs: Vec<&TensorMeta> = metas.iter().collect();
                self.op.flops(&refs, outputs)
            }
            Err(_) => 0,
        }
    }
}
