//! `suggest_config`: the least-communicating ZeRO stage whose planned per-rank peak fits, and
//! a model given by its parameter count.

use snug_compile::{compile_sharded, StepConfig, StepShape};
use snug_fit::{llama_of_size, suggest_config, FitError, Lever, Levers};
use snug_graph::{CpuGemm, Sharding, Target};
use snug_nn::ModelConfig;
use snug_plan::{plan, PlanOptions};

fn peak(model: &ModelConfig, devices: usize, stage: u8) -> usize {
    peak_of(model, devices, stage, &StepConfig::default())
}

fn peak_of(model: &ModelConfig, devices: usize, stage: u8, step: &StepConfig) -> usize {
    let shape = StepShape {
        micro_batch: 1,
        block: model.max_seq().min(1024),
    };
    let c = compile_sharded(
        model,
        shape,
        Target::cpu(1, CpuGemm::Portable),
        step,
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
    let roomy = suggest_config(&model, 4, 1 << 40, &Levers::all()).unwrap();
    assert_eq!((roomy.shard, roomy.micro_batch), (0, 64));
    // Just under stage 0's peak at micro-batch 1: some sharding, fitting the budget.
    let tight = suggest_config(&model, 4, p0 - 1, &Levers::none()).unwrap();
    assert!(
        tight.shard > 0
            || tight.precision != snug_graph::DType::F32
            || tight.remat != snug_compile::Remat::None
    );
    assert!(tight.per_device_peak_bytes < p0);
    assert!(tight.comm.sent_bytes > 0);
    assert!(roomy.levers.is_empty() && tight.levers.is_empty());
    // Nothing fits a kilobyte.
    assert!(matches!(
        suggest_config(&model, 4, 1024, &Levers::all()),
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

/// Where no stage, remat or precision fits, an allowed lever does, and the answer names it
/// with its cost; a lever not allowed is never used.
#[test]
fn a_lever_is_suggested_only_when_allowed_and_needed() {
    use snug_compile::Remat;
    use snug_graph::DType;
    let model = ModelConfig::preset("tiny").unwrap();
    let mut smallest = usize::MAX;
    for stage in 0..=3 {
        for remat in [Remat::None, Remat::Blocks { blocks: 1 }] {
            for precision in [DType::F32, DType::BF16] {
                let step = StepConfig {
                    remat,
                    precision,
                    ..StepConfig::default()
                };
                smallest = smallest.min(peak_of(&model, 1, stage, &step));
            }
        }
    }
    let lora = Levers::of(&[Lever::Lora]);
    let with_lora = peak_of(&model, 1, 0, &lora.apply(&StepConfig::default()));
    assert!(with_lora < smallest, "{with_lora} vs {smallest}");
    assert!(matches!(
        suggest_config(&model, 1, with_lora, &Levers::none()),
        Err(FitError::NothingFitsDevices { .. })
    ));
    let c = suggest_config(&model, 1, with_lora, &lora).unwrap();
    assert_eq!(c.levers, lora);
    assert_eq!(c.lever_costs.len(), 1);
    assert_eq!(c.lever_costs[0].lever, Lever::Lora);
    assert!(c.per_device_peak_bytes <= with_lora);
}
