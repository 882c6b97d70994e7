//! Every row of fit's table is what `plan` and `train` run with its flags: its peak is the plan
//! of `compile_step` (which leaves out a fixed remat mode that does not lower the peak) for
//! that configuration, and a row whose remat was left out says so.

use snug_compile::{compile_sharded, StepConfig, StepShape};
use snug_fit::{FitModel, Levers, MachineProfile, Search};
use snug_graph::{DType, Sharding, Target};
use snug_nn::ModelConfig;

fn cpu() -> Target {
    Target::host(1)
}

/// Checks every planned row of `fit`'s search at `budget` over `batch` sequences on
/// `devices`; returns how many rows were planned, and how many had their remat left out.
fn rows_are_plans(fit: &FitModel, budget: usize, batch: usize, devices: usize) -> (usize, usize) {
    let report = Search::new(fit, cpu(), budget)
        .effective_batch(batch)
        .devices(devices)
        .run(&MachineProfile::nominal(1))
        .unwrap();
    let mut dropped = 0;
    let mut planned = 0;
    for c in &report.candidates {
        // Rows not planned: refused by their state, failed, or a remat budget none reaches.
        let (Some(peak), Some(_)) = (c.peak_bytes, c.predicted_seconds) else {
            continue;
        };
        let what = format!("budget {budget}, {} × {devices}: {}", batch, c.config);
        let step: StepConfig = c.config.apply(&fit.step);
        let shape = StepShape {
            micro_batch: c.config.micro_batch,
            block: fit.block,
        };
        let sharding = Sharding::new(devices, c.config.shard).unwrap();
        let mut compiled = compile_sharded(&fit.model, shape, cpu(), &step, &sharding).unwrap();
        let p = compiled.take_plan().unwrap();
        assert_eq!(peak, p.peak_bytes(), "{what}");
        assert_eq!(c.remat_dropped, compiled.remat_dropped, "{what}");
        if let Some(d) = c.remat_dropped {
            assert!(d.peak_with_bytes >= d.peak_without_bytes, "{what}: {d:?}");
            // Its time is the plain twin's too: the same step.
            let twin = report
                .candidates
                .iter()
                .find(|t| {
                    t.config
                        == snug_fit::FitConfig {
                            remat: snug_compile::Remat::None,
                            ..c.config.clone()
                        }
                })
                .expect("a plain twin");
            assert_eq!(
                (twin.peak_bytes, twin.predicted_seconds),
                (c.peak_bytes, c.predicted_seconds),
                "{what}"
            );
            dropped += 1;
        }
        planned += 1;
    }
    (planned, dropped)
}

/// tiny 4 × 48 (fit's table had listed selective and block remat at 2 × 2 above the plain
/// row, where plan and train drop the remat), char-small 4 × 64, and tiny with every lever
/// allowed under its state, on one device and two: every row over budgets from the auditor's
/// to fractions of the plain step's peak.
#[test]
fn every_row_is_the_plan_of_its_flags() {
    let (mut planned, mut dropped) = (0, 0);
    let mut add = |(p, d): (usize, usize)| {
        planned += p;
        dropped += d;
    };
    for (preset, block, batch) in [("tiny", 48, 4), ("char-small", 64, 4)] {
        let fit = FitModel::new(
            ModelConfig::preset(preset).unwrap(),
            block,
            StepConfig::default(),
        )
        .allowing(Some(DType::BF16));
        let roomy = Search::new(&fit, cpu(), usize::MAX)
            .effective_batch(batch)
            .choose(&MachineProfile::nominal(1))
            .unwrap();
        let plain = roomy.chosen().unwrap().peak_bytes.unwrap();
        let mut budgets = vec![plain / 2, plain * 3 / 4, plain * 9 / 10, plain - 1];
        if preset == "tiny" {
            budgets.push(8_000_000);
        }
        for budget in budgets {
            add(rows_are_plans(&fit, budget, batch, 1));
        }
        add(rows_are_plans(&fit, plain * 3 / 4, batch, 2));
    }
    // Levers: rows of each rung, under the run's own state.
    let fit = FitModel::new(
        ModelConfig::preset("tiny").unwrap(),
        48,
        StepConfig::default(),
    )
    .allowing(Some(DType::BF16))
    .allowing_levers(Levers::all());
    let state = snug_fit::state_floor(&fit.model, 48, &fit.step, cpu(), &Sharding::SINGLE).unwrap();
    add(rows_are_plans(&fit, state - 1, 4, 1));
    assert!(planned > 100, "{planned} rows planned");
    assert!(
        dropped > 0,
        "no row had its remat left out: the sweep shows nothing"
    );
}
