//! Graph passes keep the numbers and save the memory they claim, measured by planning.

use snug_graph::ops::AdamW;
use snug_graph::passes::fuse_lm_head_loss;
use snug_graph::{OptimizerSpec, StepGraph};
use snug_nn::{GptConfig, ModelGraph};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, CpuSession, ExecCtx};

fn gpt(vocab: usize) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: 16,
        vocab_size: vocab,
    }
}

/// Loss and every gradient of one step, for the model graph as given.
fn loss_and_grads(cfg: &GptConfig, g: ModelGraph, batch: usize) -> (f32, Vec<Vec<f32>>, usize) {
    let (tokens, targets) = (g.tokens, g.targets);
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::None).unwrap();
    let p = plan(&step, &PlanOptions::default()).unwrap();
    let peak = p.peak_bytes();
    let mut s = CpuSession::new(step.graph.clone(), p, Allocator::default(), 2).unwrap();
    for (slot, (_, v)) in step.params.iter().zip(cfg.init_parameters(9)) {
        s.write_f32(slot.param, &v).unwrap();
    }
    let n = batch * 16;
    let v = cfg.vocab_size;
    let ids: Vec<i32> = (0..n).map(|i| ((i * 31 + 7) % v) as i32).collect();
    let next: Vec<i32> = (0..n).map(|i| ((i * 17 + 3) % v) as i32).collect();
    s.write_i32(tokens, &ids, v).unwrap();
    s.write_i32(targets, &next, v).unwrap();
    s.run(ExecCtx::default());
    let loss = s.read_f32(step.loss).unwrap()[0];
    let grads = step
        .params
        .iter()
        .map(|slot| s.read_f32(slot.grad).unwrap().to_vec())
        .collect();
    (loss, grads, peak)
}

/// The fused LM head + cross-entropy gives the unfused step's loss and gradients (to f32
/// rounding: the sums run in another order, so not bitwise), and its planned peak is lower by
/// about the logits and their gradient.
#[test]
fn fused_lm_head_loss_keeps_the_numbers_and_saves_the_logits() {
    let cfg = gpt(500);
    let batch = 4;
    let plain = cfg.build(batch, 16, 2).unwrap();
    // Chunks of 8 rows: the 64 rows take 8 chunks.
    let (rewritten, fused) = fuse_lm_head_loss(&plain.graph, 8 * 500 * 4).unwrap();
    assert_eq!(fused, 1);
    let fused_graph = plain.clone().rewritten(rewritten).unwrap();
    assert!(fused_graph
        .graph
        .nodes()
        .iter()
        .all(|n| n.op.name() != "cross_entropy"));

    let (l0, g0, peak0) = loss_and_grads(&cfg, plain, batch);
    let (l1, g1, peak1) = loss_and_grads(&cfg, fused_graph, batch);
    assert!((l0 - l1).abs() <= 1e-6 * l0.abs(), "{l0} vs {l1}");
    for (a, b) in g0.iter().zip(&g1) {
        for (&x, &y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 + 1e-4 * x.abs(), "{x} vs {y}");
        }
    }
    let logits_bytes = batch * 16 * 500 * 4;
    assert!(
        peak0 - peak1 >= logits_bytes,
        "saved {} of at least {logits_bytes}",
        peak0 - peak1
    );
}

/// The rewritten graph keeps every parameter and builds into a full AdamW step that plans and
/// loads.
#[test]
fn fused_pass_applies_to_a_whole_training_step() {
    let cfg = gpt(64);
    let g = cfg.build(2, 16, 1).unwrap();
    let (r, _) = fuse_lm_head_loss(&g.graph, 1 << 20).unwrap();
    let g = g.rewritten(r).unwrap();
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::AdamW(AdamW::default())).unwrap();
    assert_eq!(step.params.len(), cfg.parameter_shapes().len());
    let p = plan(&step, &PlanOptions::default()).unwrap();
    assert!(CpuSession::new(step.graph.clone(), p, Allocator::default(), 1).is_ok());
}
