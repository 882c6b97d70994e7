//! `suggest_config`: the least-communicating ZeRO stage whose planned per-rank peak fits, and
//! a model given by its parameter count.

use snug_compile::{compile_sharded, StepConfig, StepShape};
use snug_fit::{llama_of_size, suggest_config, FitError};
use snug_graph::{CpuGemm, Sharding, Target};
use snug_nn::ModelConfig;
use snug_plan::{plan, PlanOptions};

fn peak(model: &ModelConfig, devices: usize, stage: u8) -> usize {
    let shape = StepShape {
        micro_batch: 1,
        block: model.max_seq().min(1024),
    };
    let c = compile_sharded(
        model,
        shape,
        Target::cpu(1, CpuGemm::Portable),
        &StepConfig::default(),
        &Sharding::new(devices, stage).unwrap(),
    )
    .unwrap();
    plan(&c.step.graph, &PlanOptions::default())
        .unwrap()
        .peak_bytes()
}

#[test]
fn the_least_sharding_that_fits_is_chosen() {
    let model = ModelConfig::preset("tiny").unwrap();
    let (p0, p3) = (peak(&model, 4, 0), peak(&model, 4, 3));
    assert!(p3 < p0);
    // Room for everything: plain data parallelism, with the largest micro-batch that fits.
    let roomy = suggest_config(&model, 4, 1 << 40).unwrap();
    assert_eq!((roomy.shard, roomy.micro_batch), (0, 64));
    // Just under stage 0's peak at micro-batch 1: some sharding, fitting the budget.
    let tight = suggest_config(&model, 4, p0 - 1).unwrap();
    assert!(
        tight.shard > 0
            || tight.precision != snug_graph::DType::F32
            || tight.remat != snug_compile::Remat::None
    );
    assert!(tight.per_device_peak_bytes < p0);
    assert!(tight.comm.sent_bytes > 0);
    // Nothing fits a kilobyte.
    assert!(matches!(
        suggest_config(&model, 4, 1024),
        Err(FitError::NothingFitsDevices {
            devices: 4,
            budget: 1024,
            ..
        })
    ));
}

#[test]
fn a_parameter_count_gets_a_llama_of_that_size() {
    let seven = ModelConfig::preset("llama-7b").unwrap();
    let shaped = llama_of_size(seven.parameter_count()).unwrap();
    assert_eq!(shaped, seven, "Llama-2's proportions give llama-7b back");
    let one_b = llama_of_size(1_000_000_000).unwrap();
    let n = one_b.parameter_count() as f64;
    assert!((n / 1e9 - 1.0).abs() < 0.15, "{n}");
    assert!(matches!(
        llama_of_size(0),
        Err(FitError::NoLlamaShape { .. })
    ));
}
