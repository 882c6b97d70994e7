//! Every op in one place: its shape rule (`infer`), its gradient rule (`backward`), its scratch
//! and its cost sit side by side in the op's file. How a device runs an op lives in that
//! device's backend, in a file of the same name (the CPU's: `snug-cpu`'s `kernels/`).

mod accumulate;
mod adamw;
pub mod adamw8bit;
pub mod attention;
mod broadcast;
mod cast;
pub mod collective;
mod cross_entropy;
pub mod dequantize;
mod elementwise;
mod embedding;
mod fill;
mod gelu;
pub mod gelu_linear;
pub mod gqa_attention;
mod grad_norm;
pub mod half_io;
pub mod kv_attention;
mod layernorm;
pub mod layernorm_linear;
pub mod lm_head_loss;
mod matmul;
pub mod quantized_read;
pub mod reduce;
mod rmsnorm;
pub mod rope;
mod rope_at;
mod sgd;
mod silu;
mod softmax;
mod swiglu;
mod view;

pub use accumulate::AccumulateGrad;
pub use adamw::AdamW;
pub use adamw8bit::AdamW8bit;
pub use attention::{CausalAttention, CausalAttentionBackward};
pub use broadcast::{broadcast_shape, broadcasts_to};
pub use cast::Cast;
pub use collective::{
    shard_len, AllGather, AllReduce, Bucketed, CollectiveStart, CollectiveWait, ReduceScatter,
    ShardedAdamW,
};
pub use cross_entropy::{CrossEntropy, CrossEntropyBackward};
pub use dequantize::{Dequantize, QuantScheme, QuantizeBase};
pub use elementwise::{Binary, BinaryKind, Scale};
pub use embedding::{Embedding, EmbeddingBackward};
pub use fill::Fill;
pub use gelu::{Gelu, GeluApprox, GeluBackward};
pub use gelu_linear::{GeluLinear, GeluLinearBackward};
pub use gqa_attention::{GqaAttention, GqaAttentionBackward};
pub use grad_norm::{gpu_partial_sums, GradNorm, StoreSumSquares, SumSquares};
pub use half_io::HalfIo;
pub use kv_attention::KvAttention;
pub use layernorm::{LayerNorm, LayerNormBackward};
pub use layernorm_linear::{LayerNormLinear, LayerNormLinearBackward};
pub use lm_head_loss::{LmHeadLoss, LmHeadLossBackward};
pub use matmul::{gpu_depth_splits, MatMul, MatMulDims};
pub use quantized_read::QuantizedRead;
pub use reduce::{BroadcastTo, MaxBackward, Reduce, ReduceKind, SumTo};
pub use rmsnorm::{RmsNorm, RmsNormBackward};
pub use rope::{Rope, RopeScaling};
pub use rope_at::RopeAt;
pub use sgd::Sgd;
pub use silu::{Silu, SiluBackward};
pub use softmax::{LogSoftmax, LogSoftmaxBackward, Softmax, SoftmaxBackward};
pub use swiglu::{SwiGlu, SwiGluBackward};
pub use view::{Narrow, Pad, Reshape, Transpose};

use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{DType, Result};

/// What an op says about each output before anything runs.
#[derive(Debug, Clone, PartialEq)]
pub struct OutSpec {
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// `Some((input, offset))`: the output is a view of that input's storage (no copy).
    pub view_of_input: Option<(usize, usize)>,
    /// Name suffix for secondary outputs (`mean`, `rstd`, `lse`).
    pub suffix: Option<&'static str>,
}

impl OutSpec {
    pub fn f32(shape: Vec<usize>) -> Self {
        OutSpec {
            shape,
            dtype: DType::F32,
            view_of_input: None,
            suffix: None,
        }
    }

    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn named(mut self, suffix: &'static str) -> Self {
        self.suffix = Some(suffix);
        self
    }
}

/// The rule set every op implements.
pub trait OpRule {
    fn name(&self) -> &'static str;

    /// Shape rule: output shapes and dtypes from input metadata, or a shape error.
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>>;

    /// Gradient rule: given the gradients of the outputs, emit nodes computing the inputs'.
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()>;

    /// Scratch elements (f32) the kernel needs when run with `threads` workers.
    fn workspace_elems(&self, _inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        0
    }

    /// Inputs the op updates in place (optimizer steps); they must be persistent.
    fn mutates_inputs(&self) -> &'static [usize] {
        &[]
    }

    /// Inputs output 0 may be written over, in order of preference, when one has the output's
    /// shape and dtype and dies at this op: its kernel then reads that input through the
    /// output (the node records which, in [`crate::Node::inplace`]). Only for kernels that
    /// read each element of that input before they write the same element of the output.
    fn inplace_inputs(&self) -> &'static [usize] {
        &[]
    }

    /// Floating-point operations of one run; elementwise ops count one per output element.
    fn flops(&self, _inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        outputs.iter().map(|t| t.numel() as u64).sum()
    }
}

macro_rules! ops {
    ($($variant:ident),* $(,)?) => {
        /// The closed set of ops the IR knows; each variant's rules live in its own module.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Op { $($variant($variant)),* }

        $(impl From<$variant> for Op {
            fn from(op: $variant) -> Op { Op::$variant(op) }
        })*

        impl Op {
            fn rule(&self) -> &dyn OpRule {
                match self { $(Op::$variant(op) => op),* }
            }
        }

        /// Calls the macro `$m` with every variant of [`Op`](crate::ops::Op), so that a
        /// backend generates its dispatch from the op list: one arm per op, and an op the
        /// backend has no kernel for is a compile error there.
        #[macro_export]
        macro_rules! for_each_op {
            ($m:ident) => { $m!($($variant),*); };
        }
    };
}

ops!(
    MatMul,
    Binary,
    Scale,
    Reduce,
    SumTo,
    BroadcastTo,
    MaxBackward,
    Softmax,
    SoftmaxBackward,
    LogSoftmax,
    LogSoftmaxBackward,
    LayerNorm,
    LayerNormBackward,
    LayerNormLinear,
    LayerNormLinearBackward,
    Gelu,
    GeluBackward,
    GeluLinear,
    GeluLinearBackward,
    Embedding,
    EmbeddingBackward,
    Reshape,
    Narrow,
    Pad,
    Transpose,
    CausalAttention,
    CausalAttentionBackward,
    CrossEntropy,
    CrossEntropyBackward,
    Fill,
    AdamW,
    Sgd,
    RmsNorm,
    RmsNormBackward,
    Rope,
    Silu,
    SiluBackward,
    SwiGlu,
    SwiGluBackward,
    GqaAttention,
    GqaAttentionBackward,
    AccumulateGrad,
    SumSquares,
    GradNorm,
    LmHeadLoss,
    LmHeadLossBackward,
    Cast,
    KvAttention,
    RopeAt,
    AllReduce,
    ReduceScatter,
    AllGather,
    ShardedAdamW,
    AdamW8bit,
    StoreSumSquares,
    Dequantize,
    QuantizedRead,
    HalfIo,
    CollectiveStart,
    CollectiveWait,
);

impl Op {
    pub fn name(&self) -> &'static str {
        self.rule().name()
    }
    pub fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        self.rule().infer(inputs)
    }
    pub fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        self.rule().backward(ctx)
    }
    pub fn workspace_elems(&self, inputs: &[&TensorMeta], target: &crate::Target) -> usize {
        self.rule().workspace_elems(inputs, target)
    }
    pub fn mutates_inputs(&self) -> &'static [usize] {
        self.rule().mutates_inputs()
    }
    pub fn inplace_inputs(&self) -> &'static [usize] {
        self.rule().inplace_inputs()
    }
    pub fn flops(&self, inputs: &[&TensorMeta], outputs: &[&TensorMeta]) -> u64 {
        self.rule().flops(inputs, outputs)
    }
}

/// Shared checks for shape rules.
pub(crate) fn expect_arity(op: &'static str, inputs: &[&TensorMeta], n: usize) -> Result<()> {
    if inputs.len() != n {
        return Err(crate::GraphError::Arity {
            op,
            expected: n,
            got: inputs.len(),
        });
    }
    Ok(())
}

pub(crate) fn expect_dtype(
    op: &'static str,
    inputs: &[&TensorMeta],
    index: usize,
    expected: DType,
) -> Result<()> {
    let found = inputs[index].dtype;
    if found != expected {
        return Err(crate::GraphError::DType {
            op,
            index,
            expected,
            found,
        });
    }
    Ok(())
}

/// Below this many elements an elementwise kernel runs on one thread. Shape rules size their
/// per-thread workspaces by it too, so it lives here and the CPU kernels import it.
pub const MIN_PAR_ELEMS: usize = 1 << 15;

/// `(rows, k, n)` of `x: [.., k]` times `w: [k, n]` (a fused op's linear layer), or the shape
/// error naming `op`.
pub fn linear_dims(op: &'static str, x: &[usize], w: &[usize]) -> Result<(usize, usize, usize)> {
    if x.is_empty() || w.len() != 2 || x[x.len() - 1] != w[0] {
        return Err(shape_err(
            op,
            format!("input {x:?} and weight {w:?}: expected [.., k] and [k, n]"),
        ));
    }
    let k = w[0];
    Ok((x.iter().product::<usize>() / k.max(1), k, w[1]))
}

/// Rows per tile when an op streams `rows` rows of width `k` through a workspace of at most
/// `max_elems` elements: tiles of equal size (the last one no smaller than the others need be).
pub fn tile_rows(rows: usize, k: usize, max_elems: usize) -> usize {
    let most = (max_elems / k.max(1)).clamp(1, rows.max(1));
    rows.div_ceil(rows.div_ceil(most).max(1)).max(1)
}

/// [`tile_rows`] for an op that sums a weight gradient over its row tiles: where a tile holds
/// at least `block` rows (the target GEMM's depth block, [`crate::CpuGemm::depth_block`]), it holds a
/// whole number of them, so each tile's product is whole passes over the gradient (char-small's
/// MLP: eight tiles of 512 rows, 8 passes, rather than seven of 586, 14 passes).
pub(crate) fn tile_rows_in_blocks(rows: usize, k: usize, max_elems: usize, block: usize) -> usize {
    let most = max_elems / k.max(1);
    let most = if block > 0 && most >= block {
        most - most % block
    } else {
        most
    };
    tile_rows(rows, k, most * k.max(1))
}

pub(crate) fn shape_err(op: &'static str, detail: impl Into<String>) -> crate::GraphError {
    crate::GraphError::Shape {
        op,
        detail: detail.into(),
    }
}

/// An update's inputs: `[param, grad, state1, state2, …]`, `arity` of them and optionally a
/// scalar gradient scale after them, with the gradient and the first two states shaped as
/// the parameter.
pub(crate) fn check_update_inputs(
    op: &'static str,
    inputs: &[&TensorMeta],
    arity: usize,
) -> crate::Result<()> {
    if inputs.len() != arity + 1 {
        expect_arity(op, inputs, arity)?;
    }
    check_grad_scale(op, inputs, arity)?;
    let p = &inputs[0].shape;
    for (i, t) in inputs.iter().enumerate().take(4).skip(1) {
        if &t.shape != p {
            return Err(shape_err(
                op,
                format!("input {i} has shape {:?}, parameter {p:?}", t.shape),
            ));
        }
    }
    Ok(())
}

/// Inputs an op updates in place (`indices`) must be persistent: an arena tensor's bytes are
/// another tensor's once it dies.
pub(crate) fn check_persistent(
    op: &'static str,
    inputs: &[&TensorMeta],
    indices: impl IntoIterator<Item = usize>,
) -> crate::Result<()> {
    for i in indices {
        if !inputs[i].role.is_persistent() {
            return Err(crate::GraphError::Invalid {
                op,
                detail: format!(
                    "`{}` is updated in place and must be persistent",
                    inputs[i].name
                ),
            });
        }
    }
    Ok(())
}

/// An optimizer's optional gradient-scale input at `index` must be a scalar.
pub(crate) fn check_grad_scale(
    op: &'static str,
    inputs: &[&TensorMeta],
    index: usize,
) -> Result<()> {
    match inputs.get(index) {
        Some(s) if s.numel() != 1 => Err(shape_err(
            op,
            format!("gradient scale must be a scalar, got {:?}", s.shape),
        )),
        _ => Ok(()),
    }
}

/// Shape rule of a unary elementwise op: one float input, an output like it.
pub(crate) fn same_as_input(op: &'static str, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
    expect_arity(op, inputs, 1)?;
    let dtype = float_dtype(op, inputs)?;
    Ok(vec![OutSpec::f32(inputs[0].shape.clone()).with_dtype(dtype)])
}

/// Requires all float inputs to share one dtype and returns it.
pub(crate) fn float_dtype(op: &'static str, inputs: &[&TensorMeta]) -> Result<DType> {
    let dt = inputs[0].dtype;
    for (i, t) in inputs.iter().enumerate() {
        if t.dtype != dt || !t.dtype.is_float() {
            return Err(crate::GraphError::DType {
                op,
                index: i,
                expected: dt,
                found: t.dtype,
            });
        }
    }
    Ok(dt)
}

/// `k` times the product of `dims`, saturating: an absurd shape's FLOPs are past u64, and a
/// count that wrapped would rank it fast.
pub(crate) fn flops_of(k: u64, dims: &[usize]) -> u64 {
    dims.iter().fold(k, |f, &n| f.saturating_mul(n as u64))
}

#[cfg(test)]
mod tests {
    use super::{tile_rows, tile_rows_in_blocks};

    /// A workspace whose bytes cannot be counted (a per-thread partial of 2^60 floats on 4,096
    /// threads) is refused by name as the op is added, as an output would be, not wrapped
    /// into a small one.
    #[test]
    fn a_workspace_too_large_to_count_is_refused_by_name() {
        use crate::{CpuGemm, DType, Graph, GraphError, Target};
        let c = 1usize << 60;
        let mut g = Graph::new().with_target(Target::cpu(crate::MAX_THREADS, CpuGemm::Portable));
        let dy = g.input("dy", &[1, c], DType::F32).unwrap();
        let x = g.input("x", &[1, c], DType::F32).unwrap();
        let w = g.input("w", &[c], DType::F32).unwrap();
        let rstd = g.input("rstd", &[1], DType::F32).unwrap();
        match g.apply(super::RmsNormBackward, &[dy, x, w, rstd]) {
            Err(GraphError::Overflow { name, .. }) => assert!(name.contains("workspace"), "{name}"),
            other => panic!("expected an overflow naming the workspace, got {other:?}"),
        }
        // One thread's partial counts: the op is added.
        let mut g = Graph::new().with_target(Target::cpu(1, CpuGemm::Portable));
        let small = 1usize << 20;
        let dy = g.input("dy", &[1, small], DType::F32).unwrap();
        let x = g.input("x", &[1, small], DType::F32).unwrap();
        let w = g.input("w", &[small], DType::F32).unwrap();
        let rstd = g.input("rstd", &[1], DType::F32).unwrap();
        assert!(g.apply(super::RmsNormBackward, &[dy, x, w, rstd]).is_ok());
    }

    /// Equal tiles under the bound; where a tile holds a block of rows, a whole number of
    /// blocks (char-small's MLP backward at both tiles' blocks, and bounds under one block).
    #[test]
    fn row_tiles_hold_whole_depth_blocks() {
        // 2^20 / 1536 = 682 rows at most: seven tiles of 586 unblocked.
        assert_eq!(tile_rows(4096, 1536, 1 << 20), 586);
        assert_eq!(tile_rows_in_blocks(4096, 1536, 1 << 20, 512), 512);
        // 384-deep blocks: 682 -> 384, eleven tiles of 373 (each one pass, not 384 + 202).
        assert_eq!(tile_rows_in_blocks(4096, 1536, 1 << 20, 384), 373);
        // Room for two blocks: 1365 -> 1024, four tiles of 1024.
        assert_eq!(tile_rows_in_blocks(4096, 384, 1 << 19, 512), 1024);
        // Under one block, or no block: as `tile_rows`.
        assert_eq!(tile_rows_in_blocks(4096, 4096, 1 << 20, 512), 256);
        assert_eq!(tile_rows_in_blocks(4096, 1536, 1 << 20, 0), 586);
        // Fewer rows than a tile holds: one tile.
        assert_eq!(tile_rows_in_blocks(100, 1536, 1 << 20, 512), 100);
    }
}
