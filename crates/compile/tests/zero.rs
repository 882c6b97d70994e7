//! One rank's planned step under data parallelism and ZeRO stages 0–3: the persistent bytes
//! each stage holds per rank against DeepSpeed's formulas (parameters + gradients + optimizer
//! state, each divided by the rank count once its stage shards it), padding included.

use snug_compile::{compile_sharded, CompileError, StepConfig, StepShape};
use snug_graph::ops::{shard_len, Op};
use snug_graph::zero::{comm_per_rank, Sharding};
use snug_graph::{Role, Target};
use snug_nn::ModelConfig;
use snug_plan::{plan, PlanOptions};

const RANKS: usize = 3;

fn model() -> ModelConfig {
    ModelConfig::preset("tiny").expect("tiny is a preset")
}

/// Bytes of the step's tensors of `role` that own their storage.
fn bytes_of(step: &snug_graph::StepGraph, role: Role) -> usize {
    step.graph
        .tensors()
        .iter()
        .filter(|t| t.role == role && t.view_of.is_none())
        .map(|t| t.size_bytes())
        .sum()
}

fn cpu() -> Target {
    Target::cpu(1, snug_graph::CpuGemm::Portable)
}

#[test]
fn each_stage_divides_what_deepspeed_says() {
    let m = model();
    let shapes = m.parameter_shapes();
    // Whole and padded-shard element counts of every parameter.
    let whole: usize = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let shard: usize = shapes
        .iter()
        .map(|(_, s)| shard_len(s.iter().product(), RANKS))
        .sum();
    assert!(shard * RANKS > whole, "tiny over 3 ranks must need padding");
    let config = StepConfig {
        accumulation: 2,
        ..StepConfig::default()
    };
    let shape = StepShape::per_rank(12, 16, RANKS, 2).expect("12 splits over 3 ranks × 2");
    assert_eq!(shape.micro_batch, 2);
    // (parameters, gradient accumulators, optimizer state) in elements: f32 weights, f32
    // gradients, two f32 moments (snug keeps f32 master weights: 4 + 4 + 8 bytes a parameter
    // where DeepSpeed's mixed precision counts 2 + 2 + 12).
    let expected = [
        (whole, whole, 2 * whole),
        (whole, whole, 2 * shard),
        (whole, shard, 2 * shard),
        (shard, shard, 2 * shard),
    ];
    let mut peaks = Vec::new();
    for (stage, &(p, g, o)) in expected.iter().enumerate() {
        let sharding = Sharding::new(RANKS, stage as u8).unwrap();
        let c = compile_sharded(&m, shape, cpu(), &config, &sharding)
            .unwrap_or_else(|e| panic!("stage {stage}: {e}"));
        let step = &c.step;
        assert_eq!(
            bytes_of(step, Role::Parameter),
            4 * p,
            "stage {stage} parameters"
        );
        assert_eq!(
            bytes_of(step, Role::GradAccumulator),
            4 * g,
            "stage {stage} accumulators"
        );
        assert_eq!(
            bytes_of(step, Role::OptimizerState),
            4 * o,
            "stage {stage} optimizer state"
        );
        let planned = plan(&step.graph, &PlanOptions::default()).unwrap();
        // Each persistent buffer is its own allocation, rounded up to the 64-byte alignment.
        let aligned: usize = step
            .graph
            .tensors()
            .iter()
            .filter(|t| t.role.is_persistent() && t.view_of.is_none())
            .map(|t| t.size_bytes().div_ceil(64) * 64)
            .sum();
        assert_eq!(planned.persistent_bytes, aligned, "stage {stage}");
        assert!(aligned >= 4 * (p + g + o) && aligned < 4 * (p + g + o) + 64 * 4 * shapes.len());
        peaks.push(planned.peak_bytes());
        // Ring collectives: every gradient element crosses twice per step under stages 0
        // and 1 (all-reduce, or reduce-scatter then all-gather of the update); stage 2
        // scatters every micro-batch; stage 3 also gathers each weight for the forward and
        // the backward of every micro-batch.
        let comm = comm_per_rank(&step.graph, 2);
        assert_eq!(comm.sent_bytes, comm.received_bytes);
        let r = (RANKS - 1) as u64;
        let n = RANKS as u64;
        // Ring all-reduce of `b` bytes: 2(N-1)/N of them; a reduce-scatter or an all-gather
        // of shards: N-1 shards.
        let all_reduce = |b: u64| (2 * r * b).div_ceil(n);
        let shards = r * 4 * shard as u64;
        // Under sharding each rank squares its shards; the norm sums one scalar per weight.
        let norm = all_reduce(4 * shapes.len() as u64);
        match stage {
            // One bucket (tiny's gradients are under 25 MiB), once per step.
            0 => assert_eq!(comm.sent_bytes, all_reduce(4 * whole as u64)),
            // Scatter the summed gradients, gather the updated weights: once each.
            1 => assert_eq!(comm.sent_bytes, shards + shards + norm),
            // Scatter every micro-batch's gradients (2), gather the updated weights once.
            2 => assert_eq!(comm.sent_bytes, 2 * shards + shards + norm),
            _ => {
                let gathers = step
                    .graph
                    .nodes()
                    .iter()
                    .filter(|n| matches!(n.op, Op::AllGather(_)))
                    .count();
                assert!(
                    gathers > shapes.len(),
                    "the backward gathers block weights again"
                );
                // Scatter every micro-batch's gradients, gather every weight for each
                // micro-batch's forward, and block weights again for its backward.
                assert!(comm.sent_bytes > 2 * shards + 2 * shards + norm);
            }
        }
    }
    for w in peaks.windows(2) {
        assert!(
            w[1] < w[0],
            "each stage lowers the per-rank peak: {peaks:?}"
        );
    }
}

#[test]
fn a_batch_that_does_not_split_is_named() {
    assert!(matches!(
        StepShape::per_rank(10, 16, 3, 1),
        Err(CompileError::BatchNotDivisible {
            batch: 10,
            devices: 3
        })
    ));
    assert!(matches!(
        StepShape::per_rank(12, 16, 3, 3),
        Err(CompileError::AccumulationNotDivisible { per_rank: 4, .. })
    ));
}

#[test]
fn sgd_refuses_sharding_optimizer_state() {
    let config = StepConfig {
        optimizer: snug_compile::OptimizerKind::Sgd,
        ..StepConfig::default()
    };
    let shape = StepShape::per_rank(4, 16, 2, 1).unwrap();
    let err = compile_sharded(
        &model(),
        shape,
        cpu(),
        &config,
        &Sharding::new(2, 1).unwrap(),
    )
    .expect_err("stage 1 with SGD is refused");
    assert!(err.to_string().contains("SGD keeps none"), "{err}");
}

/// Gradient collectives (bucketed under stages 0–2, one per weight under stage 3) are split
/// into a start and a wait, and the schedule overlaps them with the backward: each starts as
/// soon as its last gradient exists (only other collectives between them), every one but the one
/// holding the backward's last gradients starts before the backward ends, its wait comes
/// after more of the backward has run, and what is in flight stays within
/// `MAX_IN_FLIGHT_BYTES`.
#[test]
fn bucketed_collectives_start_early_and_wait_late() {
    let m = model();
    for (stage, accumulation) in [
        (0u8, 1usize),
        (0, 2),
        (1, 1),
        (2, 1),
        (2, 2),
        (3, 1),
        (3, 2),
    ] {
        let config = StepConfig {
            accumulation,
            ..StepConfig::default()
        };
        let shape = StepShape::per_rank(4 * accumulation, 16, 2, accumulation).unwrap();
        // Small buckets, so that the tiny model's gradients fill several.
        let sharding = Sharding {
            bucket_bytes: 16 << 10,
            ..Sharding::new(2, stage).unwrap()
        };
        let c = compile_sharded(&m, shape, cpu(), &config, &sharding).unwrap();
        let graph = &c.step.graph;
        let planned = plan(graph, &PlanOptions::default()).unwrap();
        let o = snug_plan::overlap(graph, &planned.schedule, c.step.forward_nodes);
        let what = format!("stage {stage}, accumulation {accumulation}");
        assert!(
            o.collectives.len() >= 3,
            "{what}: {} buckets",
            o.collectives.len()
        );
        let end = o.backward_end.expect("a backward");
        let op = |p: usize| &graph.node(planned.schedule[p]).op;
        for (i, c) in o.collectives.iter().enumerate() {
            let ready = c.ready_at.expect("gradients computed in the step");
            assert!(
                (ready + 1..c.start)
                    .all(|p| matches!(op(p), Op::CollectiveStart(_) | Op::CollectiveWait(_))),
                "{what}: bucket {i} made at {ready}, started at {}",
                c.start
            );
            let wait = c.wait.expect("every start has its wait");
            assert!(wait > c.start);
            if i + 1 < o.collectives.len() {
                assert!(
                    c.start < end,
                    "{what}: bucket {i} starts at {} ≥ {end}",
                    c.start
                );
                assert!(
                    (c.start + 1..wait)
                        .any(|p| !matches!(op(p), Op::CollectiveStart(_) | Op::CollectiveWait(_))),
                    "{what}: bucket {i} waited for at once"
                );
            }
            // What was in flight when it started: within the bound, or a single collective.
            let before: Vec<usize> = o
                .collectives
                .iter()
                .filter(|d| d.start < c.start && d.wait.is_some_and(|w| w > c.start))
                .map(|d| d.in_flight_bytes)
                .collect();
            assert!(
                before.len() <= 1
                    || before.iter().sum::<usize>() <= snug_plan::schedule::MAX_IN_FLIGHT_BYTES,
                "{what}: {before:?} in flight at bucket {i}"
            );
        }
        assert_eq!(o.overlapped(), o.collectives.len() - 1, "{what}");
        // No gradient collective is left blocking (the all-reduce left sums one scalar per
        // weight for the norm).
        assert!(!graph
            .nodes()
            .iter()
            .any(|n| matches!(n.op, Op::ReduceScatter(_))));
    }
}

/// Under ZeRO-3 every weight's all-gather is ready when the step starts. A greedy order that
/// runs the ready node allocating least gathers every small weight before the embedding's
/// (the largest, read first), and so holds every layer's gathered weights at once; the plan
/// keeps the builder's order (its collectives still overlapped) wherever that peaks lower.
/// Here: an 8-layer Llama with a large vocabulary over 2 ranks, bf16 and per-block remat, as
/// a large run plans it. The greedy order holds more than two layers' gathered weights at
/// once (else this shows nothing); the plan holds at most two, and its collectives still
/// start before the backward ends.
#[test]
fn stage_3_gathers_weights_a_layer_at_a_time() {
    use snug_plan::schedule::memory_aware_order;
    let ModelConfig::Llama(mut l) = ModelConfig::preset("llama-tiny").unwrap() else {
        panic!("llama-tiny is a Llama");
    };
    l.n_layer = 8;
    l.vocab_size = 4096;
    let m = ModelConfig::Llama(l);
    let config = StepConfig {
        precision: snug_graph::DType::BF16,
        remat: snug_compile::Remat::Blocks { blocks: 1 },
        ..StepConfig::default()
    };
    let shape = StepShape::per_rank(2, 64, 2, 1).unwrap();
    let sharding = Sharding::new(2, 3).unwrap();
    let c = compile_sharded(&m, shape, cpu(), &config, &sharding).unwrap();
    let graph = &c.step.graph;
    // The most layers whose gathered weights are live at one position, over lifetimes.
    let most_layers = |lives: &[(String, usize, usize)]| {
        let end = lives.iter().map(|l| l.2).max().unwrap_or(0);
        (0..=end)
            .map(|p| {
                lives
                    .iter()
                    .filter(|(_, first, last)| *first <= p && p <= *last)
                    .map(|(name, _, _)| name.clone())
                    .collect::<std::collections::BTreeSet<String>>()
                    .len()
            })
            .max()
            .unwrap_or(0)
    };
    let layer_of = |name: &str| -> Option<String> {
        let rest = name.strip_suffix(".gathered")?.split("layers.").nth(1)?;
        Some(rest.split('.').next()?.to_string())
    };
    let greedy: Vec<(String, usize, usize)> =
        snug_plan::lifetimes(graph, &memory_aware_order(graph))
            .iter()
            .filter_map(|l| Some((layer_of(&graph.tensor(l.tensor).name)?, l.first, l.last)))
            .collect();
    assert!(most_layers(&greedy) > 2, "the greedy order alone");
    let planned = plan(graph, &PlanOptions::default()).unwrap();
    let kept: Vec<(String, usize, usize)> = planned
        .allocations
        .iter()
        .filter_map(|a| Some((layer_of(&a.name)?, a.first, a.last)))
        .collect();
    assert!(!kept.is_empty());
    let most = most_layers(&kept);
    assert!(
        most <= 2,
        "{most} layers' gathered weights live at once ({:?} order)",
        planned.schedule_kind
    );
    let o = snug_plan::overlap(graph, &planned.schedule, c.step.forward_nodes);
    assert!(o.collectives.len() >= 2);
    assert_eq!(o.overlapped(), o.collectives.len() - 1);
}
