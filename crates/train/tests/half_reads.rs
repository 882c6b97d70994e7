//! Products reading bf16 activations and gradients themselves ([`HalfRead`], the CPU's
//! `half_reads`) against reading each through an f32 up-cast: over whole bf16 steps of GPT and
//! Llama (plain, per-block and selective remat, fused updates, 8-bit AdamW, LoRA), the loss
//! and updated parameters are bitwise the up-casting step's, each step holds exactly its plan,
//! and the up-casts that only products read are gone.

use snug_cpu::CpuSession;
use snug_graph::ops::{Cast, HalfRead, Op};
use snug_graph::{DType, StepGraph, Target, TensorId};
use snug_nn::{LlamaConfig, ModelConfig};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

/// Deterministic values in [-0.1, 0.1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

/// Models whose linear layers are big enough for our GEMM (`m·n·k ≥ 2²²` at 256 tokens).
fn models() -> [ModelConfig; 2] {
    let mut llama = LlamaConfig::preset("llama-tiny").unwrap();
    llama.n_layer = 2;
    llama.hidden = 128;
    llama.n_head = 4;
    llama.n_kv_head = 2;
    llama.intermediate = 320;
    llama.vocab_size = 96;
    llama.max_seq = 64;
    let gpt = snug_nn::GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 128,
        block_size: 64,
        vocab_size: 96,
    };
    [ModelConfig::Llama(llama), ModelConfig::Gpt(gpt)]
}

const SHAPE: snug_compile::StepShape = snug_compile::StepShape {
    micro_batch: 4,
    block: 64,
};

fn compiled(
    model: &ModelConfig,
    config: &snug_compile::StepConfig,
    halves: bool,
) -> snug_compile::CompiledStep {
    let mut target = Target::cpu(2, snug_graph::CpuGemm::host());
    target.fusions.half_reads = halves;
    snug_compile::compile_exactly(model, SHAPE, target, config).unwrap()
}

/// bf16 steps: plain, with per-block and selective remat, with updates fused into the
/// backward (whose up-casts wait for their readers), with 8-bit AdamW, and with LoRA.
fn configs(llama: bool) -> Vec<(&'static str, snug_compile::StepConfig)> {
    use snug_compile::{OptimizerKind, Remat, StepConfig};
    let bf16 = StepConfig {
        precision: DType::BF16,
        ..Default::default()
    };
    let mut out = vec![
        ("plain", bf16.clone()),
        (
            "remat block",
            StepConfig {
                remat: Remat::Blocks { blocks: 1 },
                ..bf16.clone()
            },
        ),
    ];
    if llama {
        out.extend([
            (
                "remat selective",
                StepConfig {
                    remat: Remat::Selective,
                    ..bf16.clone()
                },
            ),
            (
                "fused update",
                StepConfig {
                    fused_update: true,
                    clip_mode: snug_graph::ClipMode::Tensor,
                    ..bf16.clone()
                },
            ),
            (
                "adamw8bit",
                StepConfig {
                    optimizer: OptimizerKind::AdamW8bit,
                    ..bf16.clone()
                },
            ),
            (
                "lora",
                StepConfig {
                    lora: Some(snug_nn::LoraConfig {
                        rank: 8,
                        alpha: 16.0,
                        targets: snug_nn::LoraTargets::AllLinear,
                    }),
                    ..bf16
                },
            ),
        ]);
    }
    out
}

/// Up-casts of bf16 tensors in `step`, and how many of them only products our GEMM runs read
/// (directly or through a reshape).
fn up_casts(step: &StepGraph) -> (usize, usize) {
    use snug_graph::ops::quantized_read::own_gemm_runs;
    let g = &step.graph;
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); g.tensors().len()];
    for (i, n) in g.nodes().iter().enumerate() {
        for &t in &n.inputs {
            readers[t.index()].push(i);
        }
    }
    let ours = |i: usize| {
        let n = &g.nodes()[i];
        let Op::MatMul(mm) = &n.op else { return false };
        let (a, b) = (g.tensor(n.inputs[0]), g.tensor(n.inputs[1]));
        mm.dims(&a.shape, &b.shape).is_ok_and(|d| {
            d.batch == 1 && own_gemm_runs(snug_graph::CpuGemm::host(), (d.m, d.n, d.k))
        })
    };
    let ups: Vec<TensorId> = g
        .nodes()
        .iter()
        .filter(|n| {
            matches!(n.op, Op::Cast(Cast { to: DType::F32 }))
                && g.tensor(n.inputs[0]).dtype == DType::BF16
        })
        .map(|n| n.outputs[0])
        .collect();
    let only_products = ups
        .iter()
        .filter(|u| {
            readers[u.index()].iter().all(|&r| {
                let n = &g.nodes()[r];
                if matches!(n.op, Op::Reshape(_)) {
                    readers[n.outputs[0].index()].iter().all(|&x| ours(x))
                } else {
                    ours(r)
                }
            })
        })
        .count();
    (ups.len(), only_products)
}

/// After one step: the loss, the gradient norm and every updated parameter, as bits.
fn one_step(c: &snug_compile::CompiledStep, label: &str) -> (Vec<u32>, usize) {
    let step = &c.step;
    let p = plan(step, &PlanOptions::default()).unwrap();
    let peak = p.peak_bytes();
    let alloc = Allocator::default();
    let mut s = CpuSession::new(step.graph.clone(), p, alloc.clone(), 2).unwrap();
    for (i, param) in step.params.iter().enumerate() {
        let n = step.graph.tensor(param.param).numel();
        s.write_f32(param.param, &values(n, i as u64 + 1)).unwrap();
    }
    for (i, f) in step.frozen.iter().enumerate() {
        let n = step.graph.tensor(f.param).numel();
        s.write_f32(f.param, &values(n, i as u64 + 101)).unwrap();
    }
    let tokens = SHAPE.micro_batch * SHAPE.block;
    let ids = |a: usize, b: usize| {
        (0..tokens)
            .map(|i| ((i * a + b) % 96) as i32)
            .collect::<Vec<_>>()
    };
    s.write_i32(c.tokens, &ids(13, 5), 96).unwrap();
    s.write_i32(c.targets, &ids(7, 2), 96).unwrap();
    s.run(ExecCtx::step(1e-2, 1)).unwrap();
    assert_eq!(alloc.peak_bytes(), peak, "{label}: planned == measured");
    let mut v = vec![s.read_f32(step.loss).unwrap()[0].to_bits()];
    for param in &step.params {
        v.extend(s.read_f32(param.param).unwrap().iter().map(|x| x.to_bits()));
    }
    (v, peak)
}

#[test]
fn reading_bf16_in_products_is_bitwise_the_up_casting_step() {
    let ours = snug_graph::CpuGemm::host() != snug_graph::CpuGemm::Portable;
    for (m, model) in models().iter().enumerate() {
        for (name, config) in configs(m == 0) {
            let label = format!("{} {name}", model.summary());
            let [widening, reading] = [false, true].map(|h| compiled(model, &config, h));
            let halves = |c: &snug_compile::CompiledStep| {
                c.step
                    .graph
                    .nodes()
                    .iter()
                    .filter(|n| matches!(n.op, Op::HalfRead(_)))
                    .count()
            };
            assert_eq!(halves(&widening), 0, "{label}");
            if !ours {
                // Without our GEMM (no AVX2 + FMA, no AVX-512) no product reads bf16.
                assert_eq!(halves(&reading), 0, "{label}");
                continue;
            }
            // At least the attention projection's forward and weight gradient in each layer
            // (GPT's other products are fused with their norm or GELU).
            assert!(
                halves(&reading) >= 2 * 2,
                "{label}: {} bf16 products",
                halves(&reading)
            );
            let (before, only) = up_casts(&widening.step);
            let (after, left) = up_casts(&reading.step);
            assert!(only > 0, "{label}");
            assert_eq!(left, 0, "{label}: an up-cast only products read is left");
            assert_eq!(
                after,
                before - only,
                "{label}: up-casts others read are kept"
            );
            let (w, _) = one_step(&widening, &label);
            let (r, _) = one_step(&reading, &label);
            assert_eq!(w.len(), r.len());
            assert!(w == r, "{label}: loss and updated parameters differ");
        }
    }
}

/// The pass only reads: a product it would fold stays whole on a GPU target, which fuses
/// nothing, and the shape rule refuses a bf16 input it does not flag and an f32 one it does.
#[test]
fn half_reads_are_a_cpu_fusion_with_a_checked_shape_rule() {
    let model = &models()[0];
    let target = Target::gpu(snug_graph::MemoryLayout::CPU);
    let config = snug_compile::StepConfig {
        precision: DType::BF16,
        ..Default::default()
    };
    let gpu = snug_compile::compile_exactly(model, SHAPE, target, &config).unwrap();
    assert!(!gpu
        .step
        .graph
        .nodes()
        .iter()
        .any(|n| matches!(n.op, Op::HalfRead(_))));

    let mut g = snug_graph::Graph::new();
    let x = g.input("x", &[8, 4], DType::BF16).unwrap();
    let w = g.parameter("w", &[4, 3]).unwrap();
    let mm = snug_graph::ops::MatMul::default();
    assert!(g.apply1(HalfRead::matmul(mm, 0b01), &[x, w]).is_ok());
    let err = g.apply1(HalfRead::matmul(mm, 0b10), &[x, w]).unwrap_err();
    assert!(
        matches!(
            err,
            snug_graph::GraphError::DType { .. } | snug_graph::GraphError::Shape { .. }
        ),
        "{err}"
    );
    let err = g.apply1(HalfRead::matmul(mm, 0b11), &[x, w]).unwrap_err();
    assert!(matches!(err, snug_graph::GraphError::Shape { .. }), "{err}");
    let err = g.apply1(HalfRead::matmul(mm, 0b100), &[x, w]).unwrap_err();
    assert!(
        matches!(err, snug_graph::GraphError::Invalid { .. }),
        "{err}"
    );
    // A batch of products (attention's shape) is not one it reads.
    let q = g.input("q", &[2, 8, 4], DType::BF16).unwrap();
    let k = g.input("k", &[2, 4, 8], DType::F32).unwrap();
    let err = g.apply1(HalfRead::matmul(mm, 0b01), &[q, k]).unwrap_err();
    assert!(matches!(err, snug_graph::GraphError::Shape { .. }), "{err}");
}
