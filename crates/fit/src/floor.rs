//! A lower bound on a step's planned peak that needs no plan: its parameters and optimizer
//! state, persistent buffers every plan holds from the first op to the last. They depend on
//! the model, the optimizer, the levers and the ZeRO stage, not on the micro-batch, the
//! sequence length, remat, the passes or the precision (master weights stay f32), so one
//! compile at micro-batch 1, never planned, bounds a whole space of candidates: where the bound is over
//! the budget, none of them can fit, and planning each (seconds apiece for a
//! 70-billion-parameter model) would only say so again.

use snug_compile::{compile_exactly_sharded, Remat, StepConfig, StepShape};
use snug_graph::{Graph, Role, Sharding, Target, TensorId};
use snug_nn::ModelConfig;

use crate::FitError;

/// Bytes of `graph`'s parameters and optimizer state: the leaves the step starts from. A
/// frozen weight's dequantized copy is persistent too, but made by a node and sized by the
/// sequence (a narrowed position table): not counted, so the bound holds at any length.
pub fn state_bytes(graph: &Graph) -> usize {
    graph
        .tensors()
        .iter()
        .enumerate()
        .filter(|(i, t)| t.view_of.is_none() && graph.producer(TensorId(*i as u32)).is_none())
        .filter(|(_, t)| matches!(t.role, Role::Parameter | Role::OptimizerState))
        .fold(0usize, |sum, (_, t)| sum.saturating_add(t.size_bytes()))
}

/// The bytes every plan of `model` trained with `step` on one rank of `sharding` holds at
/// least, whatever its micro-batch, accumulation, sequence length, remat, passes or
/// precision: the [`state_bytes`] of that step compiled at micro-batch 1.
pub fn state_floor(
    model: &ModelConfig,
    block: usize,
    step: &StepConfig,
    target: Target,
    sharding: &Sharding,
) -> Result<usize, FitError> {
    // The cheapest compile of the space: its state is every other candidate's.
    let step = StepConfig {
        accumulation: 1,
        remat: Remat::None,
        ..step.clone()
    };
    let shape = StepShape {
        micro_batch: 1,
        block,
    };
    let c = compile_exactly_sharded(model, shape, target, &step, sharding)?;
    Ok(state_bytes(&c.step.graph))
}

#[cfg(test)]
mod tests {
    use super::*;
    use snug_compile::{compile_exactly_sharded, OptimizerKind, Pass};
    use snug_graph::DType;
    use snug_plan::{plan, PlanOptions};

    use crate::levers::{ladder, Levers};

    /// The bound is each candidate's own state and no plan peaks under it: across the knobs
    /// the search varies (micro-batch, accumulation, block, remat, passes, precision), the
    /// optimizers and every rung of levers, on a GPT and a Llama, one device and each ZeRO
    /// stage of four.
    #[test]
    fn the_state_floor_is_every_candidates_state_and_under_its_peak() {
        let target = Target::host(1);
        let mut gpt = ModelConfig::preset("char-small").unwrap();
        gpt.set_vocab_size(65);
        let llama = ModelConfig::preset("llama-tiny").unwrap();
        let mut steps = vec![
            StepConfig::default(),
            StepConfig {
                optimizer: OptimizerKind::Sgd,
                ..StepConfig::default()
            },
        ];
        steps.extend(
            ladder(&Levers::all())
                .iter()
                .map(|l| l.apply(&StepConfig::default())),
        );
        let fused = vec![Pass::FusedCrossEntropy];
        let fused_in_place = vec![Pass::FusedCrossEntropy, Pass::InPlace];
        let blocks = |blocks| Remat::Blocks { blocks };
        let knobs = [
            (4, 1, 64, Remat::None, vec![], DType::F32),
            (1, 2, 64, blocks(1), vec![], DType::BF16),
            (2, 2, 32, Remat::Selective, fused.clone(), DType::F32),
            (1, 4, 64, blocks(2), fused, DType::BF16),
            (2, 1, 64, Remat::None, vec![Pass::InPlace], DType::BF16),
            (
                4,
                2,
                48,
                Remat::Selective,
                fused_in_place.clone(),
                DType::BF16,
            ),
            (1, 1, 64, Remat::None, fused_in_place, DType::F32),
        ];
        let mut checked = 0;
        for model in [&gpt, &llama] {
            for step in &steps {
                for (devices, stage) in [(1, 0), (4, 0), (4, 1), (4, 2), (4, 3)] {
                    let sharding = Sharding::new(devices, stage).unwrap();
                    // A lever that cannot run sharded is refused by compiling, floor and all.
                    let Ok(floor) = state_floor(model, 64, step, target, &sharding) else {
                        continue;
                    };
                    for (micro_batch, accumulation, block, remat, passes, precision) in &knobs {
                        let config = StepConfig {
                            accumulation: *accumulation,
                            remat: *remat,
                            passes: passes.clone(),
                            precision: *precision,
                            ..step.clone()
                        };
                        let shape = StepShape {
                            micro_batch: *micro_batch,
                            block: *block,
                        };
                        // Fused updates take no accumulation: not a candidate.
                        let Ok(c) =
                            compile_exactly_sharded(model, shape, target, &config, &sharding)
                        else {
                            continue;
                        };
                        let what = format!("{config:?} {shape:?} {devices}/{stage}");
                        assert_eq!(state_bytes(&c.step.graph), floor, "{what}");
                        let p = plan(&c.step.graph, &PlanOptions::default()).unwrap();
                        assert!(p.persistent_bytes >= floor, "{what}");
                        assert!(p.peak_bytes() >= floor, "{what}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 200, "{checked} candidates checked");
    }
}
