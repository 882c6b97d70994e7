//! End-to-end checks of the engine through the trainer's public API: the plan's peak against the
//! allocator's, and learning on the built-in addition language (no corpus from outside the
//! repository). Whole-model gradients against finite differences are in the conformance suite
//! (`snug-conformance`), which every backend runs.

use std::path::PathBuf;

use snug_cpu::CpuSession;
use snug_graph::{OptimizerSpec, StepGraph};
use snug_nn::{GptConfig, ModelConfig};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};
use snug_train::{ModelSection, TokenDataset, TrainConfig, TrainSection, Trainer};

/// A text file of generated additions (the built-in language, 13 symbols) in a temporary
/// directory, so the text-file path is exercised without any corpus beside the repository.
fn addition_file(lines: usize) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("additions.txt");
    std::fs::write(&path, snug_train::data::addition_text(lines, 99)).unwrap();
    (dir, path)
}

/// A line of additions holds ln 10⁶ ≈ 13.8 nats of random operands in about 12.3 characters, so
/// no model goes below about 1.1 nats per character; one that has learned the format and some
/// of the sums sits well under ln 13 ≈ 2.56 (1.77 after 300 steps of the run below).
const LEARNED_LOSS: f32 = 2.0;

fn small_config(data: Option<PathBuf>, steps: u64) -> TrainConfig {
    let model = ModelSection {
        preset: Some("char-small".into()),
        n_layer: Some(2),
        n_head: Some(4),
        n_embd: Some(64),
        block_size: Some(64),
        ..Default::default()
    };
    let train = TrainSection {
        data,
        steps: Some(steps),
        batch: Some(32),
        block: Some(64),
        lr: Some(3e-3),
        min_lr: Some(3e-4),
        warmup_steps: Some(10),
        threads: Some(2),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

/// The allocator's measured peak after real steps equals the plan's prediction, byte for byte,
/// and the steps allocate nothing more: between steps the arena sits in the allocator's cache
/// and each micro-batch takes it back from there.
#[test]
fn measured_peak_equals_predicted_peak() {
    let (_dir, text) = addition_file(20_000);
    let cfg = small_config(Some(text.clone()), 3);
    let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
    let allocator = Allocator::default();
    let mut t = Trainer::with_allocator(cfg, data, allocator.clone()).unwrap();
    let before = allocator.allocation_count();
    for _ in 0..3 {
        // Everything a step touches persists in the session: active after == active before.
        allocator.check_leaks(|| t.train_step().unwrap()).unwrap();
    }
    let predicted = t.plan().peak_bytes();
    assert_eq!(allocator.peak_bytes(), predicted);
    assert_eq!(allocator.active_bytes(), t.plan().persistent_bytes);
    assert_eq!(allocator.cache_bytes(), t.plan().arena_bytes);
    assert_eq!(allocator.allocation_count(), before, "a step allocated");
    assert!(t.plan().arena_bytes >= t.plan().lower_bound_bytes);
    drop(t);
    assert_eq!(allocator.active_bytes(), 0, "session leaked");
    // Its memory waits in the cache, and a second trainer of the same shape reuses all of it.
    assert_eq!(allocator.cache_bytes(), predicted);
    let cfg = small_config(Some(text), 1);
    let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
    let misses = allocator.allocation_count();
    let t = Trainer::with_allocator(cfg, data, allocator.clone()).unwrap();
    assert_eq!(
        allocator.allocation_count(),
        misses,
        "served from the cache"
    );
    // Set up, it holds its persistent tensors; the arena waits in the cache for the first step.
    assert_eq!(
        (allocator.active_bytes(), allocator.cache_bytes()),
        (t.plan().persistent_bytes, t.plan().arena_bytes)
    );
    drop(t);
    allocator.clear_cache();
    assert_eq!(allocator.cache_bytes(), 0);
}

/// A strict memory limit below the plan stops before training, naming both figures; a relaxed
/// one trains and counts the overrun.
#[test]
fn memory_limits_apply_to_the_whole_session() {
    let mut cfg = small_config(None, 1);
    let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
    let needed = Trainer::new(cfg.clone(), data.clone())
        .unwrap()
        .plan()
        .peak_bytes();
    cfg.memory_limit = Some(needed - 1);
    cfg.strict_memory_limit = true;
    let allocator = Allocator::default();
    match Trainer::with_allocator(cfg.clone(), data.clone(), allocator.clone()) {
        Err(snug_train::TrainError::DoesNotFit { needed: n, limit }) => {
            assert_eq!((n, limit), (needed, Some(needed - 1)))
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!(
            "a step that needs {needed} bytes ran under a strict limit of {}",
            needed - 1
        ),
    }
    assert_eq!(
        allocator.active_bytes(),
        0,
        "the failed setup released what it took"
    );
    cfg.memory_limit = Some(needed);
    let mut t = Trainer::with_allocator(cfg.clone(), data.clone(), allocator.clone()).unwrap();
    t.train_step().unwrap();
    assert_eq!(
        allocator.stats().limit_overruns,
        0,
        "exactly the planned peak fits"
    );
    drop(t);
    cfg.memory_limit = Some(needed / 2);
    cfg.strict_memory_limit = false;
    let fresh = Allocator::default();
    let mut t = Trainer::with_allocator(cfg, data, fresh.clone()).unwrap();
    t.train_step().unwrap();
    assert!(fresh.stats().limit_overruns > 0);
}

/// A reduced char-small learns the built-in addition language: from ln 13 ≈ 2.56 to below
/// [`LEARNED_LOSS`].
#[test]
fn training_on_additions_lowers_the_loss() {
    let steps = 300;
    let mut cfg = small_config(None, steps);
    // The built-in data keeps the preset's vocabulary unless one is given.
    cfg.model.vocab_size = Some(13);
    let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
    assert_eq!(data.tokenizer.vocab_size(), 13);
    let mut t = Trainer::new(cfg, data).unwrap();
    let first = t.train_step().unwrap().loss;
    assert!((first - 13f32.ln()).abs() < 0.3, "initial loss {first}");
    let mut recent = Vec::new();
    for _ in 1..steps {
        recent.push(t.train_step().unwrap().loss);
    }
    let tail: f32 = recent[recent.len() - 10..].iter().sum::<f32>() / 10.0;
    println!("loss {first:.3} -> {tail:.3} (mean of the last 10 of {steps} steps)");
    assert!(
        tail < LEARNED_LOSS,
        "mean loss of the last 10 steps is {tail}"
    );
}

/// Same seed, same losses: runs are reproducible bit for bit.
#[test]
fn training_is_deterministic() {
    let run = || {
        let cfg = small_config(None, 5);
        let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
        let mut t = Trainer::new(cfg, data).unwrap();
        (0..5)
            .map(|_| t.train_step().unwrap().loss.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}

/// The memory-aware schedule is a valid order (inputs before use, in-place optimizer updates
/// after every other reader of the weight), lowers the peak where gradients dominate, and
/// computes bit-for-bit what the program order computes.
#[test]
fn memory_aware_schedule_is_valid_lower_and_exact() {
    use snug_graph::ops::AdamW;
    use snug_plan::ScheduleKind;
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        block_size: 16,
        vocab_size: 512,
    };
    let g = cfg.build(1, 8, 2).unwrap();
    let (tokens, targets) = (g.tokens, g.targets);
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::AdamW(AdamW::default())).unwrap();
    let program = plan(
        &step,
        &PlanOptions {
            schedule: ScheduleKind::Program,
            ..Default::default()
        },
    )
    .unwrap();
    let aware = plan(&step, &PlanOptions::default()).unwrap();
    assert_eq!(aware.schedule_kind, ScheduleKind::MemoryAware);
    assert!(
        aware.peak_bytes() < program.peak_bytes(),
        "{} vs {}",
        aware.peak_bytes(),
        program.peak_bytes()
    );
    assert_eq!(
        aware.program_order_peak_bytes,
        program.persistent_bytes + program.lower_bound_bytes
    );
    assert_eq!(
        *aware.timeline.iter().max().unwrap(),
        aware.persistent_bytes + aware.lower_bound_bytes
    );
    assert_eq!(aware.timeline.len(), step.graph.nodes().len());

    let graph = &step.graph;
    let mut position = vec![usize::MAX; graph.nodes().len()];
    for (pos, n) in aware.schedule.iter().enumerate() {
        position[n.index()] = pos;
    }
    for (i, node) in graph.nodes().iter().enumerate() {
        for &t in &node.inputs {
            if let Some(p) = graph.producer(t) {
                assert!(
                    position[p.index()] < position[i],
                    "{} runs before its input",
                    node.op.name()
                );
            }
        }
        for &k in node.op.mutates_inputs() {
            let root = graph.storage_root(node.inputs[k]);
            for (j, other) in graph.nodes().iter().enumerate() {
                if j != i && other.inputs.iter().any(|&t| graph.storage_root(t) == root) {
                    assert!(
                        position[j] < position[i],
                        "`{}` updated before a read",
                        graph.tensor(root).name
                    );
                }
            }
        }
    }

    let run = |memory_plan: snug_plan::MemoryPlan| {
        let mut s =
            CpuSession::new(step.graph.clone(), memory_plan, Allocator::default(), 2).unwrap();
        for (slot, (_, v)) in step.params.iter().zip(cfg.init_parameters(3)) {
            s.write_f32(slot.param, &v).unwrap();
        }
        let ids: Vec<i32> = (0..8).map(|i| i * 37 % 512).collect();
        let mut losses = Vec::new();
        for k in 1..=3 {
            s.write_i32(tokens, &ids, 512).unwrap();
            s.write_i32(targets, &ids, 512).unwrap();
            s.run(ExecCtx::step(1e-2, k)).unwrap();
            losses.push(s.read_f32(step.loss).unwrap()[0].to_bits());
        }
        let w: Vec<u32> = s
            .read_f32(step.params[2].param)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        (losses, w)
    };
    assert_eq!(run(program), run(aware));
}

/// A tiny Llama trains on CPU: its loss falls on the built-in addition language.
#[test]
fn tiny_llama_trains() {
    let model = ModelSection {
        preset: Some("llama-tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        data: None,
        steps: Some(60),
        batch: Some(8),
        block: Some(32),
        lr: Some(3e-3),
        warmup_steps: Some(5),
        threads: Some(2),
        ..Default::default()
    };
    let cfg = TrainConfig::resolve(None, &model, &train).unwrap();
    let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
    let mut t = Trainer::new(cfg, data).unwrap();
    let first = t.train_step().unwrap().loss;
    let mut last = first;
    for _ in 1..60 {
        last = t.train_step().unwrap().loss;
    }
    // 2.58 -> 1.97 when written.
    assert!(last < first - 0.4, "loss {first} -> {last}");
    assert_eq!(t.session().allocator().peak_bytes(), t.plan().peak_bytes());
}

/// SGD's update, checked by hand: p ← p·(1 − lr·wd) − lr·g, with decay on matrices only.
#[test]
fn sgd_step_updates_parameters_exactly() {
    use snug_graph::ops::Sgd;
    let cfg = GptConfig::preset("tiny").unwrap();
    let g = cfg.build(1, 4, 1).unwrap();
    let (tokens, targets) = (g.tokens, g.targets);
    // Gradients come from an identical graph without an update.
    let grads_step = StepGraph::build(g.graph.clone(), g.loss, OptimizerSpec::None).unwrap();
    let sgd_step = StepGraph::build(
        g.graph,
        g.loss,
        OptimizerSpec::Sgd(Sgd { weight_decay: 0.5 }),
    )
    .unwrap();
    let init = cfg.init_parameters(5);
    let ids = [1, 2, 3, 4];
    let session = |step: &StepGraph| {
        let p = plan(step, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(step.graph.clone(), p, Allocator::default(), 1).unwrap();
        for (slot, (_, v)) in step.params.iter().zip(&init) {
            s.write_f32(slot.param, v).unwrap();
        }
        s.write_i32(tokens, &ids, 65).unwrap();
        s.write_i32(targets, &ids, 65).unwrap();
        s.run(ExecCtx::step(0.1, 1)).unwrap();
        s
    };
    let (with_grads, updated) = (session(&grads_step), session(&sgd_step));
    for (k, (a, b)) in grads_step.params.iter().zip(&sgd_step.params).enumerate() {
        let grad = with_grads.read_f32(a.grad).unwrap();
        let wd = if grads_step.graph.tensor(a.param).rank() >= 2 {
            0.5
        } else {
            0.0
        };
        let after = updated.read_f32(b.param).unwrap();
        for ((&p0, &g), &p1) in init[k].1.iter().zip(grad.iter()).zip(after.iter()) {
            let expect = p0 * (1.0 - 0.1 * wd) - 0.1 * g;
            assert!(
                (p1 - expect).abs() <= 1e-6 * (1.0 + expect.abs()),
                "{}: {p1} vs {expect}",
                a.name
            );
        }
    }
    assert_eq!(
        updated.plan().persistent_bytes,
        with_grads.plan().persistent_bytes,
        "SGD holds no state"
    );
}

/// bf16 graphs plan (half the bytes of f32 for weights and activations) but the CPU runtime
/// refuses to run them, with a typed error.
#[test]
fn bf16_plans_but_does_not_run_on_cpu() {
    let cfg = ModelConfig::preset("char-small").unwrap();
    let build = |dtype| {
        let g = cfg.build(2, 64, 2, dtype).unwrap();
        StepGraph::build(g.graph, g.loss, OptimizerSpec::AdamW(Default::default())).unwrap()
    };
    let (f32_step, bf16_step) = (
        build(snug_graph::DType::F32),
        build(snug_graph::DType::BF16),
    );
    let (pf, pb) = (
        plan(&f32_step, &PlanOptions::default()).unwrap(),
        plan(&bf16_step, &PlanOptions::default()).unwrap(),
    );
    assert_eq!(pb.breakdown.parameters * 2, pf.breakdown.parameters);
    assert!(
        pb.arena_bytes < pf.arena_bytes * 6 / 10,
        "{} vs {}",
        pb.arena_bytes,
        pf.arena_bytes
    );
    let err = CpuSession::new(bf16_step.graph.clone(), pb, Allocator::default(), 1)
        .err()
        .unwrap();
    assert!(
        matches!(err, snug_runtime::RuntimeError::UnsupportedDType { .. }),
        "{err}"
    );
}
