//! Kernels reading bf16 activations and gradients themselves and writing some in bf16
//! ([`HalfIo`], the CPU's `half_io`: products, GPT's fused GELU-linear and attention, Llama's
//! RMSNorm, SwiGLU, RoPE and grouped-query attention) against going through f32 copies made
//! by casts: over whole bf16 steps of GPT and Llama (plain,
//! per-block and selective remat, fused updates, 8-bit AdamW, LoRA), the loss and updated
//! parameters are bitwise the casting step's, each step holds exactly its plan, and every cast
//! such a kernel can take in is gone.

use snug_cpu::CpuSession;
use snug_graph::ops::{Cast, HalfIo, Op};
use snug_graph::{DType, StepGraph, Target};
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
    target.fusions.half_io = halves;
    snug_compile::compile_exactly(model, SHAPE, target, config).unwrap()
}

/// bf16 steps: plain, with per-block and selective remat, with updates fused into the
/// backward (whose up-casts wait for their readers), with 8-bit AdamW, and with LoRA.
fn configs() -> Vec<(&'static str, snug_compile::StepConfig)> {
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
    out
}

/// Casts between bf16 and f32 in `step`, and how many of them a kernel could take in: up-casts
/// whose every reader reads bf16 (a product our GEMM runs, directly or through a reshape, an
/// op [`HalfIo::readable`] names, or a down-cast back), down-casts of an up-cast, and
/// down-casts that are the only reader of an output [`HalfIo::writable`] names.
fn casts(step: &StepGraph) -> (usize, usize) {
    use snug_graph::ops::quantized_read::own_gemm_runs;
    let g = &step.graph;
    let mut readers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.tensors().len()];
    for (i, n) in g.nodes().iter().enumerate() {
        for (k, &t) in n.inputs.iter().enumerate() {
            readers[t.index()].push((i, k));
        }
    }
    let is_up = |n: &snug_graph::Node| {
        matches!(n.op, Op::Cast(Cast { to: DType::F32 }))
            && g.tensor(n.inputs[0]).dtype == DType::BF16
    };
    // A down-cast of such an up-cast's output gives the bf16 tensor back.
    let round_trip = |i: usize| {
        let n = &g.nodes()[i];
        matches!(n.op, Op::Cast(Cast { to: DType::BF16 }))
            && g.producer(n.inputs[0]).is_some_and(|p| is_up(g.node(p)))
    };
    let reads_half = |(i, k): (usize, usize)| {
        if round_trip(i) {
            return true;
        }
        let n = &g.nodes()[i];
        match &n.op {
            Op::MatMul(mm) => {
                let (a, b) = (g.tensor(n.inputs[0]), g.tensor(n.inputs[1]));
                k < 2
                    && mm.dims(&a.shape, &b.shape).is_ok_and(|d| {
                        d.batch == 1 && own_gemm_runs(snug_graph::CpuGemm::host(), (d.m, d.n, d.k))
                    })
            }
            Op::LayerNormLinearBackward(_) => {
                let (x, w) = (g.tensor(n.inputs[0]), g.tensor(n.inputs[5]));
                let rows = x.numel() / x.shape.last().unwrap();
                let (k_, n_) = (w.shape[0], w.shape[1]);
                k == 6 && own_gemm_runs(snug_graph::CpuGemm::host(), (k_, n_, rows))
            }
            Op::Binary(_) => {
                g.tensor(n.inputs[0]).shape == g.tensor(n.inputs[1]).shape
                    && HalfIo::readable(&n.op) & (1 << k) != 0
            }
            op => HalfIo::readable(op) & (1 << k) != 0,
        }
    };
    let (mut all, mut foldable) = (0, 0);
    for (i, n) in g.nodes().iter().enumerate() {
        let Op::Cast(Cast { to }) = n.op else {
            continue;
        };
        let (x, y) = (n.inputs[0], n.outputs[0]);
        if to == DType::F32 && g.tensor(x).dtype == DType::BF16 {
            all += 1;
            foldable += readers[y.index()].iter().all(|&(r, k)| {
                let rn = &g.nodes()[r];
                if matches!(rn.op, Op::Reshape(_)) {
                    readers[rn.outputs[0].index()]
                        .iter()
                        .all(|&x| reads_half(x))
                } else {
                    reads_half((r, k))
                }
            }) as usize;
        } else if to == DType::BF16 && round_trip(i) {
            all += 1;
            foldable += 1;
        } else if to == DType::BF16 {
            all += 1;
            let producer = g.producer(x).map(|p| g.node(p));
            let writable = producer.is_some_and(|p| {
                let j = p.outputs.iter().position(|&o| o == x).unwrap_or(8);
                let broadcasts = matches!(p.op, Op::Binary(_))
                    && g.tensor(p.inputs[0]).shape != g.tensor(p.inputs[1]).shape;
                let inputs: Vec<_> = p.inputs.iter().map(|&t| g.tensor(t)).collect();
                let mask = HalfIo::writes_on(&p.op, &inputs, snug_graph::CpuGemm::host());
                j < 8 && !broadcasts && mask & (1 << j) != 0
            });
            foldable += (writable && readers[x.index()] == [(i, 0)]) as usize;
        }
    }
    (all, foldable)
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
fn folding_bf16_casts_into_kernels_is_bitwise_the_casting_step() {
    // bf16 widened to f32 in every product, as the casting graph computes them: on a CPU with
    // AVX512-BF16 the default is bf16 arithmetic, which rounds the f32 operand too.
    snug_cpu::isa::Bf16Math::Widen.set();
    let ours = snug_graph::CpuGemm::host() != snug_graph::CpuGemm::Portable;
    for model in models().iter() {
        let mut reading_peaks = Vec::new();
        for (name, config) in configs() {
            let label = format!("{} {name}", model.summary());
            let [widening, reading] = [false, true].map(|h| compiled(model, &config, h));
            let halves = |c: &snug_compile::CompiledStep, products: bool| {
                c.step
                    .graph
                    .nodes()
                    .iter()
                    .filter(|n| match &n.op {
                        Op::HalfIo(h) => !products || h.product().is_some(),
                        _ => false,
                    })
                    .count()
            };
            assert_eq!(halves(&widening, false), 0, "{label}");
            if ours {
                // At least the attention projection's forward and weight gradient in each
                // layer (GPT's other products are fused with their norm or GELU).
                let n = halves(&reading, true);
                assert!(n >= 2 * 2, "{label}: {n} bf16 products");
            } else {
                // Without our GEMM (no AVX2 + FMA, no AVX-512) no product reads bf16; the
                // other kernels still take their casts in.
                assert_eq!(halves(&reading, true), 0, "{label}");
                assert!(halves(&reading, false) > 0, "{label}");
            }
            if matches!(model, ModelConfig::Gpt(_)) && config.lora.is_none() {
                // Every kernel that takes casts in runs in GPT's step (LoRA unfuses the MLP).
                let names: std::collections::BTreeSet<&str> = reading
                    .step
                    .graph
                    .nodes()
                    .iter()
                    .filter(|n| matches!(n.op, Op::HalfIo(_)))
                    .map(|n| n.op.name())
                    .collect();
                let gemm_only = [
                    "half_matmul",
                    "half_layer_norm_linear",
                    "half_layer_norm_linear_backward",
                ];
                for want in [
                    "half_matmul",
                    "half_gelu_linear",
                    "half_gelu_linear_backward",
                    "half_causal_attention",
                    "half_causal_attention_backward",
                    "half_layer_norm_linear",
                    "half_layer_norm_linear_backward",
                    "half_sum_to",
                    "half_add",
                ] {
                    let expected = ours || !gemm_only.contains(&want);
                    assert_eq!(
                        names.contains(want),
                        expected,
                        "{label}: {want} in {names:?}"
                    );
                }
            }
            if matches!(model, ModelConfig::Llama(_)) {
                // Llama's norms, gate, rotations and attention take their casts in on any CPU.
                let names: std::collections::BTreeSet<&str> = reading
                    .step
                    .graph
                    .nodes()
                    .iter()
                    .filter(|n| matches!(n.op, Op::HalfIo(_)))
                    .map(|n| n.op.name())
                    .collect();
                for want in [
                    "half_rms_norm",
                    "half_rms_norm_backward",
                    "half_swiglu",
                    "half_swiglu_backward",
                    "half_rope",
                    "half_gqa_attention",
                    "half_gqa_attention_backward",
                ] {
                    assert!(names.contains(want), "{label}: {want} in {names:?}");
                }
            }
            let (before, only) = casts(&widening.step);
            let (after, left) = casts(&reading.step);
            assert!(only > 0, "{label}");
            assert_eq!(left, 0, "{label}: a cast a kernel could take in is left");
            assert_eq!(after, before - only, "{label}: the other casts are kept");
            let (w, _) = one_step(&widening, &label);
            let (r, peak) = one_step(&reading, &label);
            reading_peaks.push((name, peak));
            assert_eq!(w.len(), r.len());
            assert!(w == r, "{label}: loss and updated parameters differ");
        }
        if matches!(model, ModelConfig::Llama(_)) {
            // Selective remat recomputes Llama's norms, gate and rotations whether a cast or
            // the kernel itself rounds their outputs, so it holds less than no remat.
            let peak = |want: &str| reading_peaks.iter().find(|(n, _)| *n == want).map(|p| p.1);
            let (selective, plain) = (peak("remat selective"), peak("plain"));
            assert!(
                selective < plain,
                "{}: selective remat {selective:?} B, none {plain:?} B",
                model.summary()
            );
        }
    }
}

/// No cast is folded on a GPU target, which fuses nothing; the shape rule refuses a bf16 input
/// it does not flag, an f32 one it does, and an output or op whose kernel cannot write or read
/// bf16.
#[test]
fn half_io_is_a_cpu_fusion_with_a_checked_shape_rule() {
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
        .any(|n| matches!(n.op, Op::HalfIo(_))));

    let mut g = snug_graph::Graph::new();
    let x = g.input("x", &[8, 4], DType::BF16).unwrap();
    let w = g.parameter("w", &[4, 3]).unwrap();
    let mm = snug_graph::ops::MatMul::default();
    assert!(g.apply1(HalfIo::matmul(mm, 0b01), &[x, w]).is_ok());
    let err = g.apply1(HalfIo::matmul(mm, 0b10), &[x, w]).unwrap_err();
    assert!(
        matches!(
            err,
            snug_graph::GraphError::DType { .. } | snug_graph::GraphError::Shape { .. }
        ),
        "{err}"
    );
    let err = g.apply1(HalfIo::matmul(mm, 0b11), &[x, w]).unwrap_err();
    assert!(matches!(err, snug_graph::GraphError::Shape { .. }), "{err}");
    let err = g.apply1(HalfIo::matmul(mm, 0b100), &[x, w]).unwrap_err();
    assert!(
        matches!(err, snug_graph::GraphError::Invalid { .. }),
        "{err}"
    );
    // A batch of products (attention's shape) is not one it reads.
    let q = g.input("q", &[2, 8, 4], DType::BF16).unwrap();
    let k = g.input("k", &[2, 4, 8], DType::F32).unwrap();
    let err = g.apply1(HalfIo::matmul(mm, 0b01), &[q, k]).unwrap_err();
    assert!(matches!(err, snug_graph::GraphError::Shape { .. }), "{err}");

    // Writes: only the outputs the op's kernel can round, and only f32 ones.
    let gelu_bwd = |reads: u8, writes: u8| HalfIo {
        op: Box::new(Op::GeluLinearBackward(
            snug_graph::ops::GeluLinearBackward::default(),
        )),
        reads,
        writes,
    };
    let h = g.input("h", &[8, 4], DType::BF16).unwrap();
    let dy = g.input("dy", &[8, 3], DType::F32).unwrap();
    let outs = g.apply(gelu_bwd(0b1, 0b1), &[h, w, dy]).unwrap();
    assert_eq!(
        g.tensor(outs[0]).dtype,
        DType::BF16,
        "dh is written in bf16"
    );
    assert_eq!(g.tensor(outs[1]).dtype, DType::F32, "dw stays f32");
    for writes in [0b10, 0b100] {
        let err = g.apply(gelu_bwd(0b1, writes), &[h, w, dy]).unwrap_err();
        assert!(
            matches!(err, snug_graph::GraphError::Invalid { .. }),
            "{err}"
        );
    }
    let err = g.apply(gelu_bwd(0, 0), &[h, w, dy]).unwrap_err();
    assert!(
        matches!(err, snug_graph::GraphError::Invalid { .. }),
        "{err}"
    );
    let layer_norm = HalfIo {
        op: Box::new(Op::LayerNorm(snug_graph::ops::LayerNorm::default())),
        reads: 0b1,
        writes: 0,
    };
    let err = g.apply(layer_norm, &[h]).unwrap_err();
    assert!(
        matches!(err, snug_graph::GraphError::Invalid { .. }),
        "{err}"
    );
    // An add reads and writes bf16 element by element: equal shapes only.
    let add = || HalfIo {
        op: Box::new(Op::Binary(snug_graph::ops::Binary::add())),
        reads: 0b01,
        writes: 0b1,
    };
    let same = g.input("same", &[8, 4], DType::F32).unwrap();
    let sum = g.apply1(add(), &[h, same]).unwrap();
    assert_eq!(g.tensor(sum).dtype, DType::BF16);
    let row = g.input("row", &[4], DType::F32).unwrap();
    let err = g.apply1(add(), &[h, row]).unwrap_err();
    assert!(matches!(err, snug_graph::GraphError::Shape { .. }), "{err}");
}

/// bf16 bits of `x`, rounded to nearest even (as the cast kernel rounds finite values).
fn to_bf16(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|v| {
            let b = v.to_bits();
            ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
        })
        .collect()
}

/// Products written in bf16 a tile of rows at a time, on shapes of two tiles with a shorter
/// last one: bitwise the f32 product rounded by a cast, for a plain product (with a bias, `a`
/// read in bf16 or f32, `b` transposed or not), a LayerNorm-linear (its statistics too) and a
/// GELU-linear (its input in bf16 or f32). Each run holds exactly its plan, the f32 tile
/// included, and less than the casting graph, which holds the whole f32 output.
#[test]
fn products_written_in_bf16_tile_by_tile_are_the_rounded_f32_products() {
    // As in `folding_bf16_casts_into_kernels_is_bitwise_the_casting_step`.
    snug_cpu::isa::Bf16Math::Widen.set();
    use snug_graph::ops::half_io::write_tile_rows;
    use snug_graph::ops::{GeluApprox, GeluLinear, LayerNormLinear, MatMul};
    use snug_graph::{CpuGemm, Graph, Role};
    let (rows, k, n) = (601, 16, 2048);
    let tile = write_tile_rows(rows, n);
    assert!(
        tile < rows && rows % tile != 0,
        "two tiles, the last shorter"
    );
    let f32_in = |name: &str, shape: &[usize], seed: u64| {
        (name.to_string(), shape.to_vec(), DType::F32, seed)
    };
    let bf16_in = |name: &str, shape: &[usize], seed: u64| {
        (name.to_string(), shape.to_vec(), DType::BF16, seed)
    };
    let mm = |tb: bool| {
        Op::MatMul(MatMul {
            ta: false,
            tb,
            bias: true,
        })
    };
    let b_shape = |tb: bool| if tb { vec![n, k] } else { vec![k, n] };
    let cases = vec![
        (
            "matmul",
            mm(false),
            0b00,
            vec![
                f32_in("a", &[rows, k], 1),
                f32_in("b", &b_shape(false), 2),
                f32_in("bias", &[n], 3),
            ],
        ),
        (
            "matmul, a in bf16",
            mm(false),
            0b01,
            vec![
                bf16_in("a", &[rows, k], 1),
                f32_in("b", &b_shape(false), 2),
                f32_in("bias", &[n], 3),
            ],
        ),
        (
            "matmul, b transposed",
            mm(true),
            0b01,
            vec![
                bf16_in("a", &[rows, k], 1),
                f32_in("b", &b_shape(true), 2),
                f32_in("bias", &[n], 3),
            ],
        ),
        (
            "layer_norm_linear",
            Op::LayerNormLinear(LayerNormLinear::default()),
            0,
            vec![
                f32_in("x", &[rows, k], 4),
                f32_in("ln_w", &[k], 5),
                f32_in("ln_b", &[k], 6),
                f32_in("w", &[k, n], 7),
                f32_in("b", &[n], 8),
            ],
        ),
        (
            "gelu_linear",
            Op::GeluLinear(GeluLinear {
                approx: GeluApprox::Tanh,
            }),
            0,
            vec![
                f32_in("h", &[rows, k], 9),
                f32_in("w", &[k, n], 10),
                f32_in("b", &[n], 11),
            ],
        ),
        (
            "gelu_linear, h in bf16",
            Op::GeluLinear(GeluLinear {
                approx: GeluApprox::Exact,
            }),
            0b1,
            vec![
                bf16_in("h", &[rows, k], 9),
                f32_in("w", &[k, n], 10),
                f32_in("b", &[n], 11),
            ],
        ),
    ];
    let gemm = CpuGemm::host();
    for (label, op, reads, inputs) in cases {
        let metas: Vec<snug_graph::TensorMeta> = inputs
            .iter()
            .map(|(name, shape, _, _)| snug_graph::TensorMeta {
                name: name.clone(),
                shape: shape.clone(),
                dtype: DType::F32,
                role: Role::Input,
                view_of: None,
            })
            .collect();
        let refs: Vec<&snug_graph::TensorMeta> = metas.iter().collect();
        if gemm == CpuGemm::Portable {
            // Without our GEMM a tile's product may differ from the whole one's: not written.
            assert_eq!(HalfIo::writes_on(&op, &refs, gemm), 0, "{label}");
            continue;
        }
        assert_eq!(HalfIo::writes_on(&op, &refs, gemm), 0b1, "{label}");
        // The graph: fused (one HalfIo) or casting (casts around the op); `widen` appends an
        // exact cast of the bf16 output back to f32, which the session can read.
        let build = |fused: bool, widen: bool| {
            let mut g = Graph::new().with_target(Target::cpu(2, gemm));
            let mut leaves = Vec::new();
            let mut args = Vec::new();
            for (name, shape, dtype, _) in &inputs {
                let t = g
                    .add_leaf(name.clone(), shape, *dtype, Role::Input)
                    .unwrap();
                leaves.push(t);
                args.push(if *dtype == DType::BF16 && !fused {
                    g.apply1(Op::Cast(Cast { to: DType::F32 }), &[t]).unwrap()
                } else {
                    t
                });
            }
            let mut outs = if fused {
                let io = HalfIo {
                    op: Box::new(op.clone()),
                    reads,
                    writes: 0b1,
                };
                g.apply(Op::HalfIo(io), &args).unwrap()
            } else {
                let mut outs = g.apply(op.clone(), &args).unwrap();
                outs[0] = g
                    .apply1(Op::Cast(Cast { to: DType::BF16 }), &[outs[0]])
                    .unwrap();
                outs
            };
            assert_eq!(g.tensor(outs[0]).dtype, DType::BF16, "{label}");
            if widen {
                outs[0] = g
                    .apply1(Op::Cast(Cast { to: DType::F32 }), &[outs[0]])
                    .unwrap();
            }
            for &o in &outs {
                g.mark_output(o);
            }
            (g, leaves, outs)
        };
        let peak = |fused: bool| {
            let (g, ..) = build(fused, false);
            plan(&g, &PlanOptions::default()).unwrap().peak_bytes()
        };
        let (fused_peak, casting_peak) = (peak(true), peak(false));
        assert!(
            fused_peak < casting_peak,
            "{label}: {fused_peak} B held, the casting graph {casting_peak} B"
        );
        // Every output's bits (the bf16 one widened, exactly), after a run that held its plan.
        let run = |fused: bool| -> Vec<Vec<u32>> {
            let (g, leaves, outs) = build(fused, true);
            let memory = plan(&g, &PlanOptions::default()).unwrap();
            let peak = memory.peak_bytes();
            let alloc = Allocator::default();
            let mut s = CpuSession::new(g, memory, alloc.clone(), 2).unwrap();
            for (&t, (_, shape, dtype, seed)) in leaves.iter().zip(&inputs) {
                let v = values(shape.iter().product(), *seed);
                if *dtype == DType::BF16 {
                    let bytes: Vec<u8> = to_bf16(&v).iter().flat_map(|h| h.to_le_bytes()).collect();
                    s.write_bytes(t, &bytes).unwrap();
                } else {
                    s.write_f32(t, &v).unwrap();
                }
            }
            s.run(ExecCtx::default()).unwrap();
            assert_eq!(alloc.peak_bytes(), peak, "{label}: planned == measured");
            outs.iter()
                .map(|&o| s.read_f32(o).unwrap().iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        let (fused, casting) = (run(true), run(false));
        assert_eq!(fused.len(), casting.len(), "{label}");
        for (i, (a, b)) in fused.iter().zip(&casting).enumerate() {
            assert!(
                a == b,
                "{label}: output {i} differs from the casting graph's"
            );
        }
    }
}

/// The fused LM head of a bf16 step computes in bf16 arithmetic, as autocast's head does (its
/// kernel's test: `crates/cpu/tests/bf16_head.rs`); of an f32 or f16 step, in f32.
#[test]
fn only_a_bf16_steps_head_computes_in_bf16_arithmetic() {
    for model in models() {
        for precision in [DType::BF16, DType::F16, DType::F32] {
            let config = snug_compile::StepConfig {
                precision,
                ..Default::default()
            };
            let step = compiled(&model, &config, true).step;
            let heads: Vec<bool> = step
                .graph
                .nodes()
                .iter()
                .filter_map(|n| match &n.op {
                    Op::LmHeadLoss(op) => Some(op.bf16),
                    Op::LmHeadLossBackward(op) => Some(op.bf16),
                    _ => None,
                })
                .collect();
            assert_eq!(heads.len(), 2, "{precision}: the head and its backward");
            let want = precision == DType::BF16;
            assert!(heads.iter().all(|&b| b == want), "{precision}: {heads:?}");
        }
    }
}
