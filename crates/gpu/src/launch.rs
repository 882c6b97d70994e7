//! Each op of `snug-graph` mapped to its kernel's launcher: [`check`] says, before anything is
//! allocated, whether a node can run here, and [`record`] records a bound node's dispatches
//! into a step's encoder. Both match every op by name, so a new op must be placed here.

use snug_graph::ops::lm_head_loss::{head_vocab_of, tile};
use snug_graph::ops::reduce::split_axis;
use snug_graph::ops::{GeluApprox, Op, QuantScheme};
use snug_graph::{DType, Graph, Node};
use snug_runtime::ExecCtx;

use crate::backend::{Arg, GpuNode};
use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::kernels::accumulate::{accumulate, Accumulate};
use crate::kernels::adamw::{adamw, AdamWStep};
use crate::kernels::adamw8bit::{adamw8bit, Moments8bit};
use crate::kernels::attention::{
    attention_backward, attention_forward, AttentionLayout, AttentionShape,
};
use crate::kernels::cast::{from_half, to_half, Half};
use crate::kernels::cross_entropy::{cross_entropy, cross_entropy_backward};
use crate::kernels::dequantize::dequantize;
use crate::kernels::elementwise::{binary, scale, BinaryKind};
use crate::kernels::embedding::{embedding, embedding_backward};
use crate::kernels::gelu::{gelu, gelu_backward, GeluForm};
use crate::kernels::grad_norm::{grad_norm, sum_squares, GradNormRule};
use crate::kernels::kv_attention::{kv_attention, KvShape};
use crate::kernels::layernorm::{layer_norm, layer_norm_backward};
use crate::kernels::lm_head_loss::{lm_head_loss, lm_head_loss_backward, HeadShape};
use crate::kernels::matmul::{matmul, Gemm};
use crate::kernels::reduce::{broadcast_to, max_backward, reduce, sum_to, ReduceKind};
use crate::kernels::rmsnorm::{rms_norm, rms_norm_backward};
use crate::kernels::rope::rope;
use crate::kernels::rope_at::rope_at;
use crate::kernels::sgd::sgd;
use crate::kernels::silu::{silu, silu_backward};
use crate::kernels::softmax::{softmax, softmax_backward};
use crate::kernels::swiglu::{swiglu, swiglu_backward};
use crate::kernels::view::{pad, transpose};

/// The widest attention head and RoPE head the kernels take.
const MAX_HEAD_DIM: usize = 256;

/// Why double-quantized NF4 cannot run here.
pub(crate) const NF4_DQ: &str = "NF4 with double-quantized constants (--double-quant) has no \
     GPU kernel yet: use --quantize-base nf4 without --double-quant on the GPU";

/// The first op of `graph` the GPU backend cannot run, by name, and why: what a session on a
/// GPU would refuse, for a planner to refuse first (`snug plan --device gpu`), with no device.
pub fn check_graph(graph: &Graph) -> Result<(), (&'static str, String)> {
    for node in graph.nodes() {
        check(graph, node).map_err(|d| (node.op.name(), d))?;
    }
    Ok(())
}

/// Why `node` cannot run on the GPU, or `Ok`.
pub(crate) fn check(graph: &Graph, node: &Node) -> Result<(), String> {
    let shape = |i: usize| &graph.tensor(node.inputs[i]).shape;
    let view = graph.is_view(node);
    // 16-bit floats are storage: casts convert them, views look into them. u8 codes are
    // read by the ops made for them.
    let casts = match &node.op {
        Op::Cast(_) => true,
        _ => view,
    };
    let codes = view || matches!(node.op, Op::Dequantize(_) | Op::AdamW8bit(_));
    for &t in node.inputs.iter().chain(&node.outputs) {
        let m = graph.tensor(t);
        let ok = match m.dtype {
            DType::F32 | DType::I32 => true,
            DType::BF16 | DType::F16 => casts,
            DType::U8 if codes => continue,
            DType::U8 => {
                return Err(format!(
                    "tensor `{}` holds u8 codes, which only dequantize and adamw8bit read",
                    m.name
                ))
            }
        };
        if !ok {
            return Err(format!(
                "tensor `{}` is {}: the GPU kernels compute in f32, with bf16 and f16 as \
                 storage that casts convert",
                m.name, m.dtype
            ));
        }
        // Staged copies move whole words (a view at an odd 16-bit element cannot be).
        let offset = m.view_of.map_or(0, |v| v.offset_elems) * m.dtype.size_bytes();
        if !offset.is_multiple_of(4) {
            return Err(format!(
                "view `{}` starts {offset} bytes into its storage, not at a whole 4-byte word",
                m.name
            ));
        }
    }
    if view {
        return Ok(());
    }
    let head_dim = |d: usize| {
        if d == 0 || d > MAX_HEAD_DIM {
            Err(format!("heads of {d} (1 to {MAX_HEAD_DIM})"))
        } else {
            Ok(())
        }
    };
    match &node.op {
        Op::SumTo(_) | Op::BroadcastTo(_) | Op::Transpose(_) if shape(0).len() > 8 => {
            Err(format!("{} axes (at most 8)", shape(0).len()))
        }
        Op::CausalAttention(op) => {
            head_dim(shape(0).get(2).copied().unwrap_or(0) / 3 / op.n_head.max(1))
        }
        Op::CausalAttentionBackward(op) => {
            head_dim(shape(0).get(2).copied().unwrap_or(0) / 3 / op.n_head.max(1))
        }
        Op::GqaAttention(op) => head_dim(shape(0).get(2).copied().unwrap_or(0) / op.n_head.max(1)),
        Op::GqaAttentionBackward(op) => {
            head_dim(shape(0).get(2).copied().unwrap_or(0) / op.n_head.max(1))
        }
        Op::Dequantize(op) if op.scheme == QuantScheme::Nf4Dq => Err(NF4_DQ.into()),
        Op::Rope(op) if !op.head_dim.is_multiple_of(2) => {
            Err(format!("heads of {} (even)", op.head_dim))
        }
        Op::Rope(op) => head_dim(op.head_dim),
        Op::RopeAt(op) if !op.rope.head_dim.is_multiple_of(2) => {
            Err(format!("heads of {} (even)", op.rope.head_dim))
        }
        Op::RopeAt(op) => head_dim(op.rope.head_dim),
        Op::KvAttention(op) => {
            let shapes: Vec<&[usize]> = node
                .inputs
                .iter()
                .map(|&t| graph.tensor(t).shape.as_slice())
                .collect();
            let d = op.dims(&shapes).map_err(|e| e.to_string())?;
            head_dim(d.d)
        }
        Op::MatMul(_)
        | Op::Binary(_)
        | Op::Scale(_)
        | Op::LayerNorm(_)
        | Op::LayerNormBackward(_)
        | Op::Gelu(_)
        | Op::GeluBackward(_)
        | Op::Embedding(_)
        | Op::EmbeddingBackward(_)
        | Op::Reshape(_)
        | Op::Narrow(_)
        | Op::Pad(_)
        | Op::Transpose(_)
        | Op::CrossEntropy(_)
        | Op::CrossEntropyBackward(_)
        | Op::Fill(_)
        | Op::AdamW(_)
        | Op::Sgd(_)
        | Op::RmsNorm(_)
        | Op::RmsNormBackward(_)
        | Op::Silu(_)
        | Op::SiluBackward(_)
        | Op::SwiGlu(_)
        | Op::SwiGluBackward(_)
        | Op::AccumulateGrad(_)
        | Op::SumSquares(_)
        | Op::GradNorm(_)
        | Op::LmHeadLoss(_)
        | Op::LmHeadLossBackward(_)
        | Op::Reduce(_)
        | Op::SumTo(_)
        | Op::BroadcastTo(_)
        | Op::MaxBackward(_)
        | Op::Softmax(_)
        | Op::SoftmaxBackward(_)
        | Op::LogSoftmax(_)
        | Op::LogSoftmaxBackward(_)
        | Op::Dequantize(_)
        | Op::AdamW8bit(_) => Ok(()),
        Op::LayerNormLinear(_)
        | Op::LayerNormLinearBackward(_)
        | Op::GeluLinear(_)
        | Op::GeluLinearBackward(_)
        | Op::QuantizedRead(_)
        | Op::HalfIo(_) => Err(
            "a CPU fusion: plan for the GPU's target, which fuses nothing (Fusions::NONE)".into(),
        ),
        Op::AllReduce(_)
        | Op::ReduceScatter(_)
        | Op::AllGather(_)
        | Op::ShardedAdamW(_)
        | Op::CollectiveStart(_)
        | Op::CollectiveWait(_) => Err(format!(
            "`{}`: collectives across ranks run on the CPU over MPI (no GPU transport yet)",
            node.op.name()
        )),
        Op::StoreSumSquares(_) => Err(
            "`store_sum_squares` (clipping by the previous step's norm): no GPU kernel yet; \
             use --clip-mode global or tensor on the GPU"
                .into(),
        ),
        Op::Cast(op) => {
            let from = graph.tensor(node.inputs[0]).dtype;
            match (from, op.to) {
                (DType::F32, DType::BF16 | DType::F16) | (DType::BF16 | DType::F16, DType::F32) => {
                    Ok(())
                }
                (from, to) => Err(format!(
                    "no GPU cast from {from} to {to} (f32 ↔ bf16 and f32 ↔ f16 only)"
                )),
            }
        }
    }
}

fn gelu_form(a: GeluApprox) -> GeluForm {
    match a {
        GeluApprox::Tanh => GeluForm::Tanh,
        GeluApprox::Exact => GeluForm::Exact,
    }
}

fn last(a: &Arg) -> usize {
    a.shape.last().copied().unwrap_or(1)
}

/// Records `n`'s dispatches, with the copies of any tensor staged off its binding alignment
/// around them. Optimizer updates and the gradient norm run on the last micro-batch only, as
/// on every device.
pub(crate) fn record(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: &GpuNode,
    ctx: ExecCtx,
) -> Result<()> {
    let args = || n.inputs.iter().chain(&n.outputs);
    args().for_each(|a| a.stage(encoder, false));
    record_kernel(device, encoder, n, ctx)?;
    n.outputs.iter().for_each(|a| a.stage(encoder, true));
    for &i in n.op.mutates_inputs() {
        if let Some(a) = n.inputs.get(i) {
            a.stage(encoder, true);
        }
    }
    Ok(())
}

fn record_kernel(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: &GpuNode,
    ctx: ExecCtx,
) -> Result<()> {
    let e = encoder;
    let input = |i: usize| n.inputs[i].slice();
    let output = |i: usize| n.outputs[i].slice();
    let workspace = || {
        n.workspace
            .as_ref()
            .map(Arg::slice)
            .ok_or_else(|| GpuError::Unsupported {
                device: device.name().to_string(),
                kernel: "workspace",
                detail: format!("`{}` was planned without its workspace", n.op.name()),
            })
    };
    let (x0, y0) = (&n.inputs.first(), &n.outputs.first());
    let numel = |a: &Option<&Arg>| a.map_or(0, Arg::numel);
    let last_micro = ctx.is_last_micro();
    // A masked loss's `[mask, divisor]`, at inputs `at` and `at + 1` (the graph checked them).
    let loss_mask = |at: usize| (n.inputs.len() == at + 2).then(|| [input(at), input(at + 1)]);
    match &n.op {
        Op::MatMul(op) => {
            let d = op
                .dims(&n.inputs[0].shape, &n.inputs[1].shape)
                .map_err(|err| GpuError::Unsupported {
                    device: device.name().to_string(),
                    kernel: "matmul",
                    detail: err.to_string(),
                })?;
            let g = Gemm {
                batch: d.batch,
                m: d.m,
                n: d.n,
                k: d.k,
                ta: op.ta,
                tb: op.tb,
                shared_b: d.shared_b,
            };
            let bias = op.bias.then(|| input(2));
            // Present exactly where the plan split the product (`matmul` checks it).
            let ws = n.workspace.as_ref().map(Arg::slice);
            matmul(device, e, g, input(0), input(1), bias, output(0), ws)
        }
        Op::Binary(op) => {
            let kind = match op.kind {
                snug_graph::ops::BinaryKind::Add => BinaryKind::Add,
                snug_graph::ops::BinaryKind::Sub => BinaryKind::Sub,
                snug_graph::ops::BinaryKind::Mul => BinaryKind::Mul,
                snug_graph::ops::BinaryKind::Div => BinaryKind::Div,
            };
            binary(
                device,
                e,
                kind,
                (input(0), &n.inputs[0].shape),
                (input(1), &n.inputs[1].shape),
                (output(0), &n.outputs[0].shape),
            )
        }
        Op::Scale(op) => scale(device, e, op.factor, numel(y0), input(0), output(0)),
        Op::SumTo(op) => sum_to(
            device,
            e,
            (&n.inputs[0].shape, &op.shape),
            input(0),
            output(0),
        ),
        Op::Cast(op) => {
            let half = |d: DType| {
                if d == DType::F16 {
                    Half::F16
                } else {
                    Half::Bf16
                }
            };
            let from = n.inputs[0].dtype;
            if op.to == DType::F32 {
                from_half(device, e, half(from), numel(x0), input(0), output(0))
            } else {
                to_half(device, e, half(op.to), numel(x0), input(0), output(0))
            }
        }
        Op::Reduce(op) => {
            let kind = match op.kind {
                snug_graph::ops::ReduceKind::Sum => ReduceKind::Sum,
                snug_graph::ops::ReduceKind::Mean => ReduceKind::Mean,
                snug_graph::ops::ReduceKind::Max => ReduceKind::Max,
            };
            let dims = split_axis(&n.inputs[0].shape, op.axis);
            reduce(device, e, kind, dims, input(0), output(0))
        }
        Op::MaxBackward(op) => {
            let dims = split_axis(&n.inputs[0].shape, op.axis);
            max_backward(device, e, dims, [input(0), input(1)], output(0))
        }
        Op::BroadcastTo(op) => broadcast_to(
            device,
            e,
            (&n.inputs[0].shape, &op.shape),
            input(0),
            output(0),
        ),
        Op::Softmax(_) | Op::LogSoftmax(_) => {
            let v = last(&n.inputs[0]);
            let log = matches!(n.op, Op::LogSoftmax(_));
            softmax(
                device,
                e,
                log,
                (numel(x0) / v.max(1), v),
                input(0),
                output(0),
            )
        }
        Op::SoftmaxBackward(_) | Op::LogSoftmaxBackward(_) => {
            let v = last(&n.inputs[0]);
            let log = matches!(n.op, Op::LogSoftmaxBackward(_));
            softmax_backward(
                device,
                e,
                log,
                (numel(x0) / v.max(1), v),
                [input(0), input(1)],
                output(0),
            )
        }
        Op::LayerNorm(op) => {
            let c = n.inputs[1].numel();
            layer_norm(
                device,
                e,
                (numel(x0) / c.max(1), c, op.eps),
                [input(0), input(1), input(2)],
                [output(0), output(1), output(2)],
            )
        }
        Op::LayerNormBackward(_) => {
            let c = n.inputs[2].numel();
            layer_norm_backward(
                device,
                e,
                (numel(x0) / c.max(1), c),
                [input(0), input(1), input(2), input(3), input(4)],
                [output(0), output(1), output(2)],
            )
        }
        Op::Gelu(op) => gelu(
            device,
            e,
            gelu_form(op.approx),
            numel(y0),
            input(0),
            output(0),
        ),
        Op::GeluBackward(op) => gelu_backward(
            device,
            e,
            gelu_form(op.approx),
            numel(y0),
            input(0),
            input(1),
            output(0),
        ),
        Op::Embedding(_) => {
            let table = &n.inputs[0].shape;
            let (vocab, c) = (table[0], last(&n.inputs[0]));
            embedding(
                device,
                e,
                (n.inputs[1].numel(), vocab, c),
                [input(0), input(1)],
                output(0),
            )
        }
        Op::EmbeddingBackward(op) => embedding_backward(
            device,
            e,
            (numel(x0), op.vocab, last(&n.inputs[1])),
            [input(0), input(1)],
            output(0),
        ),
        Op::Reshape(_) | Op::Narrow(_) => Ok(()),
        Op::Pad(op) => {
            let x = &n.inputs[0];
            let rows = x.shape.first().copied().unwrap_or(0);
            let row = x.shape.iter().skip(1).product();
            pad(
                device,
                e,
                (op.start, rows, op.total, row),
                input(0),
                output(0),
            )
        }
        Op::Transpose(op) => transpose(
            device,
            e,
            &n.inputs[0].shape,
            (op.dim0, op.dim1),
            input(0),
            output(0),
        ),
        Op::CausalAttention(op) => {
            let s = packed_shape(&n.inputs[0].shape, op.n_head);
            let qkv = input(0);
            attention_forward(
                device,
                e,
                (s, AttentionLayout::packed(&s)),
                [qkv, qkv, qkv],
                [output(0), output(1)],
            )
        }
        Op::CausalAttentionBackward(op) => {
            let s = packed_shape(&n.inputs[0].shape, op.n_head);
            let (qkv, dqkv) = (input(0), output(0));
            attention_backward(
                device,
                e,
                (s, AttentionLayout::packed(&s)),
                [qkv, qkv, qkv, input(1), input(2), input(3)],
                [dqkv, dqkv, dqkv],
            )
        }
        Op::GqaAttention(op) => {
            let s = gqa_shape(&n.inputs[0].shape, op.n_head, op.n_kv_head);
            attention_forward(
                device,
                e,
                (s, AttentionLayout::separate(&s)),
                [input(0), input(1), input(2)],
                [output(0), output(1)],
            )
        }
        Op::GqaAttentionBackward(op) => {
            let s = gqa_shape(&n.inputs[0].shape, op.n_head, op.n_kv_head);
            attention_backward(
                device,
                e,
                (s, AttentionLayout::separate(&s)),
                [input(0), input(1), input(2), input(3), input(4), input(5)],
                [output(0), output(1), output(2)],
            )
        }
        Op::CrossEntropy(_) => {
            let v = last(&n.inputs[0]);
            cross_entropy(
                device,
                e,
                (numel(x0) / v.max(1), v),
                [input(0), input(1)],
                loss_mask(2),
                workspace()?,
                output(0),
            )
        }
        Op::CrossEntropyBackward(_) => {
            let v = last(&n.inputs[0]);
            cross_entropy_backward(
                device,
                e,
                (numel(x0) / v.max(1), v),
                [input(0), input(1), input(2)],
                loss_mask(3),
                output(0),
            )
        }
        Op::Fill(op) => super::kernels::fill::fill(device, e, op.value, numel(y0), output(0)),
        Op::AdamW(op) if last_micro => adamw(
            device,
            e,
            AdamWStep {
                beta1: op.beta1,
                beta2: op.beta2,
                eps: op.eps,
                weight_decay: op.weight_decay,
                lr: ctx.lr,
                step: ctx.step,
            },
            numel(x0),
            [input(0), input(1), input(2), input(3)],
            (n.inputs.len() > 4).then(|| input(4)),
        ),
        Op::Sgd(op) if last_micro => sgd(
            device,
            e,
            (ctx.lr, op.weight_decay),
            numel(x0),
            [input(0), input(1)],
            (n.inputs.len() > 2).then(|| input(2)),
        ),
        Op::AdamW8bit(op) if last_micro => adamw8bit(
            device,
            e,
            AdamWStep {
                beta1: op.adamw.beta1,
                beta2: op.adamw.beta2,
                eps: op.adamw.eps,
                weight_decay: op.adamw.weight_decay,
                lr: ctx.lr,
                step: ctx.step,
            },
            numel(x0),
            [input(0), input(1)],
            Moments8bit {
                m: n.inputs[2].bytes_slice(),
                v: n.inputs[3].bytes_slice(),
                m_absmax: input(4),
                v_absmax: input(5),
            },
            (n.inputs.len() > 6).then(|| input(6)),
        ),
        Op::AdamW(_) | Op::Sgd(_) | Op::AdamW8bit(_) => Ok(()),
        Op::Dequantize(op) => dequantize(
            device,
            e,
            op.scheme,
            (numel(y0), op.shape.last().copied().unwrap_or(1)),
            n.inputs[0].bytes_slice(),
            input(1),
            output(0),
        ),
        Op::RmsNorm(op) => {
            let c = n.inputs[1].numel();
            rms_norm(
                device,
                e,
                (numel(x0) / c.max(1), c, op.eps),
                [input(0), input(1)],
                [output(0), output(1)],
            )
        }
        Op::RmsNormBackward(_) => {
            let c = n.inputs[2].numel();
            rms_norm_backward(
                device,
                e,
                (numel(x0) / c.max(1), c),
                [input(0), input(1), input(2), input(3)],
                [output(0), output(1)],
            )
        }
        Op::Rope(op) => {
            let x = &n.inputs[0].shape;
            rope(device, e, *op, (x[0], x[1]), input(0), output(0))
        }
        Op::RopeAt(op) => {
            let x = &n.inputs[0].shape;
            rope_at(
                device,
                e,
                op.rope,
                (x[0], x[1]),
                [input(0), input(1)],
                output(0),
            )
        }
        Op::KvAttention(op) => {
            let shapes: Vec<&[usize]> = n.inputs.iter().map(|a| a.shape.as_slice()).collect();
            let d: KvShape = op.dims(&shapes).map_err(|err| GpuError::Unsupported {
                device: device.name().to_string(),
                kernel: "kv_attention",
                detail: err.to_string(),
            })?;
            let s = AttentionShape {
                batch: d.b,
                seq: d.t,
                heads: d.h,
                kv_heads: d.kh,
                head_dim: d.d,
            };
            let c = op.cache_input();
            let (layout, qkv) = if op.packed {
                (AttentionLayout::packed(&s), [input(0), input(0), input(0)])
            } else {
                (
                    AttentionLayout::separate(&s),
                    [input(0), input(1), input(2)],
                )
            };
            let [q, k, v] = qkv;
            kv_attention(
                device,
                e,
                (d, layout),
                [q, k, v, input(c), input(c + 1), input(c + 2)],
                output(0),
            )
        }
        Op::Silu(_) => silu(device, e, numel(y0), input(0), output(0)),
        Op::SiluBackward(_) => silu_backward(device, e, numel(y0), input(0), input(1), output(0)),
        Op::SwiGlu(_) => swiglu(device, e, numel(y0), input(0), input(1), output(0)),
        Op::SwiGluBackward(_) => swiglu_backward(
            device,
            e,
            numel(x0),
            [input(0), input(1), input(2)],
            [output(0), output(1)],
        ),
        Op::AccumulateGrad(_) => accumulate(
            device,
            e,
            Accumulate::of(ctx.micro, ctx.micro_steps),
            numel(y0),
            [input(0), input(1), output(0)],
        ),
        Op::SumSquares(_) if last_micro => {
            sum_squares(device, e, numel(x0), input(0), workspace()?, output(0))
        }
        Op::GradNorm(op) if last_micro => {
            let sums = n.inputs.len() - usize::from(op.unscale);
            let inputs: Vec<_> = (0..sums).map(input).collect();
            grad_norm(
                device,
                e,
                GradNormRule {
                    max_norm: op.max_norm,
                    scale: op.scale,
                },
                &inputs,
                op.unscale.then(|| input(sums)),
                workspace()?,
                [output(0), output(1)],
            )
        }
        Op::SumSquares(_) | Op::GradNorm(_) => Ok(()),
        Op::LmHeadLoss(op) => lm_head_loss(
            device,
            e,
            head_shape(&n.inputs, (op.tb, op.rows, op.cols)),
            [input(0), input(1), input(2)],
            loss_mask(3),
            workspace()?,
            [output(0), output(1)],
        ),
        Op::LmHeadLossBackward(op) => lm_head_loss_backward(
            device,
            e,
            head_shape(&n.inputs, (op.tb, op.rows, op.cols)),
            [input(0), input(1), input(2), input(3), input(4)],
            loss_mask(5),
            workspace()?,
            [output(0), output(1)],
        ),
        Op::LayerNormLinear(_)
        | Op::LayerNormLinearBackward(_)
        | Op::GeluLinear(_)
        | Op::GeluLinearBackward(_)
        | Op::QuantizedRead(_)
        | Op::HalfIo(_)
        | Op::AllReduce(_)
        | Op::ReduceScatter(_)
        | Op::AllGather(_)
        | Op::ShardedAdamW(_)
        | Op::CollectiveStart(_)
        | Op::CollectiveWait(_)
        | Op::StoreSumSquares(_) => Err(GpuError::Unsupported {
            device: device.name().to_string(),
            kernel: "launch",
            detail: format!("no GPU kernel for `{}`", n.op.name()),
        }),
    }
}

/// The fused head's sizes from its inputs `[x [N, C], head, ..]` and its tile.
fn head_shape(inputs: &[Arg], (tb, rows, cols): (bool, usize, usize)) -> HeadShape {
    let (n, c) = (inputs[0].shape[0], inputs[0].shape[1]);
    let v = head_vocab_of(tb, &inputs[1].shape);
    let (rows, cols) = tile(rows, cols, n, v);
    HeadShape {
        n,
        c,
        v,
        tb,
        rows,
        cols,
    }
}

/// GPT's packed `qkv [B, T, 3C]` as an attention's sizes.
fn packed_shape(qkv: &[usize], n_head: usize) -> AttentionShape {
    let c = qkv.get(2).copied().unwrap_or(0) / 3;
    AttentionShape {
        batch: qkv.first().copied().unwrap_or(0),
        seq: qkv.get(1).copied().unwrap_or(0),
        heads: n_head,
        kv_heads: n_head,
        head_dim: c / n_head.max(1),
    }
}

/// Separate `q [B, T, H·D]` (and `k`, `v` with `KH` heads) as an attention's sizes.
fn gqa_shape(q: &[usize], n_head: usize, n_kv_head: usize) -> AttentionShape {
    AttentionShape {
        batch: q.first().copied().unwrap_or(0),
        seq: q.get(1).copied().unwrap_or(0),
        heads: n_head,
        kv_heads: n_kv_head,
        head_dim: q.get(2).copied().unwrap_or(0) / n_head.max(1),
    }
}
