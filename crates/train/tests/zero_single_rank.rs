//! ZeRO stages 0–3 run in a world of one rank (the collectives' kernels are copies there):
//! every stage trains the same weights, bit for bit, as the plain step, with or without LoRA
//! adapters (the frozen base is sharded and gathered like any weight), and the allocator's
//! measured peak is each stage's planned peak.

use std::collections::HashMap;

use snug_compile::{compile_sharded, StepConfig, StepShape};
use snug_cpu::CpuSession;
use snug_graph::zero::Sharding;
use snug_graph::{CpuGemm, Target};
use snug_nn::{GptConfig, ModelConfig};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

fn model() -> ModelConfig {
    ModelConfig::Gpt(GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: 8,
        vocab_size: 13,
    })
}

fn ids(n: usize, salt: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((i * 7 + salt * 3 + 1) % 13) as i32)
        .collect()
}

/// Trained weights by name after 3 steps of 2 micro-batches, the losses, and the measured
/// and planned peaks.
fn train(sharding: &Sharding) -> (HashMap<String, Vec<f32>>, Vec<f32>, usize, usize) {
    train_with(sharding, None)
}

fn train_with(
    sharding: &Sharding,
    lora: Option<snug_nn::LoraConfig>,
) -> (HashMap<String, Vec<f32>>, Vec<f32>, usize, usize) {
    let m = model();
    let config = StepConfig {
        accumulation: 2,
        lora,
        ..StepConfig::default()
    };
    let shape = StepShape::per_rank(4, 8, sharding.ranks, 2).unwrap();
    let target = Target::cpu(1, CpuGemm::Portable);
    let c = compile_sharded(&m, shape, target, &config, sharding).unwrap();
    let p = plan(&c.step.graph, &PlanOptions::default()).unwrap();
    let planned = p.peak_bytes();
    let allocator = Allocator::default();
    let mut s = CpuSession::new(c.step.graph.clone(), p, allocator.clone(), 1).unwrap();
    let init: HashMap<String, Vec<f32>> = m.init_parameters(3).into_iter().collect();
    let name = |n: &str| n.trim_end_matches(".shard").to_string();
    // Adapters get small values of their own, B not zero, so both A and B move.
    let value = |n: &str, len: usize| {
        init.get(n).cloned().unwrap_or_else(|| {
            (0..len)
                .map(|i| ((i * 37 + n.len() * 11) % 17) as f32 * 0.01 - 0.08)
                .collect()
        })
    };
    let slots = c.step.params.iter().map(|p| (p.param, p.name.as_str()));
    let frozen = c.step.frozen.iter().map(|f| (f.param, f.name.as_str()));
    for (t, n) in slots.chain(frozen) {
        let len = s.read_f32(t).unwrap().len();
        let full = value(
            &name(n),
            snug_graph::zero::unsharded_shape(&c.step.graph, t)
                .iter()
                .product(),
        );
        s.write_f32(t, &full[..len]).unwrap();
    }
    let mut losses = Vec::new();
    for step in 1..=3u64 {
        for micro in 0..2u32 {
            let salt = (step as usize) * 2 + micro as usize;
            s.write_i32(c.tokens, &ids(16, salt), 13).unwrap();
            s.write_i32(c.targets, &ids(16, salt + 1), 13).unwrap();
            s.run(ExecCtx {
                lr: 0.01,
                step,
                micro,
                micro_steps: 2,
            })
            .unwrap();
            losses.push(s.read_f32(c.step.loss).unwrap()[0]);
        }
    }
    let weights = c
        .step
        .params
        .iter()
        .map(|slot| (name(&slot.name), s.read_f32(slot.param).unwrap().to_vec()))
        .collect();
    (weights, losses, allocator.peak_bytes(), planned)
}

#[test]
fn every_stage_trains_the_plain_steps_weights_in_its_planned_peak() {
    let (plain, plain_losses, measured, planned) = train(&Sharding::SINGLE);
    assert_eq!(measured, planned);
    for stage in 1..=3u8 {
        let (w, losses, measured, planned) = train(&Sharding::new(1, stage).unwrap());
        assert_eq!(measured, planned, "stage {stage}: measured peak == planned");
        assert_eq!(losses, plain_losses, "stage {stage} losses");
        assert_eq!(w.len(), plain.len());
        for (name, v) in &plain {
            assert_eq!(&w[name], v, "stage {stage}: `{name}`");
        }
    }
    // The weights moved: the comparison is not of untouched initial values.
    let init: HashMap<String, Vec<f32>> = model().init_parameters(3).into_iter().collect();
    assert!(plain.iter().any(|(n, v)| &init[n] != v));
}

#[test]
fn with_lora_every_stage_trains_the_same_adapters_in_its_planned_peak() {
    let lora = snug_nn::LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: snug_nn::LoraTargets::AllLinear,
    };
    let (plain, plain_losses, measured, planned) =
        train_with(&Sharding::SINGLE, Some(lora.clone()));
    assert_eq!(measured, planned);
    assert!(
        !plain.is_empty() && plain.keys().all(|n| n.contains("lora")),
        "{:?}",
        plain.keys()
    );
    for stage in 1..=3u8 {
        let (w, losses, measured, planned) =
            train_with(&Sharding::new(1, stage).unwrap(), Some(lora.clone()));
        assert_eq!(measured, planned, "stage {stage}: measured peak == planned");
        assert_eq!(losses, plain_losses, "stage {stage} losses");
        assert_eq!(w, plain, "stage {stage}: the adapters");
    }
}

/// A step compiled for more ranks than this process's world (one, without a transport) is
/// refused when the session loads, naming the collective and both sizes, before anything runs.
#[test]
fn a_step_for_another_world_size_is_refused_at_load() {
    let m = model();
    let sharding = Sharding::new(2, 1).unwrap();
    let shape = StepShape::per_rank(4, 8, 2, 1).unwrap();
    let target = Target::cpu(1, CpuGemm::Portable);
    let c = compile_sharded(&m, shape, target, &StepConfig::default(), &sharding).unwrap();
    let p = plan(&c.step.graph, &PlanOptions::default()).unwrap();
    let err = CpuSession::new(c.step.graph, p, Allocator::default(), 1)
        .err()
        .expect("a 2-rank step in a world of 1 is refused");
    match err {
        snug_runtime::RuntimeError::UnsupportedOp { op, detail, .. } => {
            assert!(
                [
                    "all_reduce",
                    "reduce_scatter",
                    "all_gather",
                    "sharded_adamw",
                    "all_reduce_start",
                    "reduce_scatter_start",
                ]
                .contains(&op),
                "{op}"
            );
            assert!(
                detail.contains("2 ranks") && detail.contains("has 1"),
                "{detail}"
            );
        }
        other => panic!("expected UnsupportedOp, got {other}"),
    }
}
