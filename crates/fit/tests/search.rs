//! The search over configurations: what fits is chosen by planned peak, the fastest predicted
//! wins, and what cannot fit is a typed error naming the smallest peak.

use snug_compile::{compile_step, Remat, StepConfig, StepShape};
use snug_fit::{FitError, FitModel, MachineProfile, MemoryFailure, Search, Verdict};
use snug_graph::{DType, Target};
use snug_nn::ModelConfig;
use snug_plan::{plan, PlanOptions};

fn model() -> FitModel {
    let mut m = ModelConfig::preset("char-small").unwrap();
    m.set_vocab_size(65);
    FitModel::new(m, 256, StepConfig::default())
}

/// This machine with one thread.
fn cpu() -> Target {
    Target::host(1)
}

fn shape(fit: &FitModel, micro_batch: usize) -> StepShape {
    StepShape {
        micro_batch,
        block: fit.block,
    }
}

/// A budget over `fit`'s parameters and optimizer state but under every plan of it: nothing
/// fits, and nothing is refused unplanned.
fn under_every_plan(fit: &FitModel) -> usize {
    let single = snug_graph::Sharding::SINGLE;
    snug_fit::state_floor(&fit.model, fit.block, &fit.step, cpu(), &single).unwrap() + 1
}

fn peak_of(fit: &FitModel, micro: usize, step: &StepConfig) -> usize {
    let c = compile_step(&fit.model, shape(fit, micro), cpu(), step).unwrap();
    plan(&c.step.graph, &PlanOptions::default())
        .unwrap()
        .peak_bytes()
}

#[test]
fn with_room_to_spare_the_plain_configuration_wins() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    let plain = peak_of(&fit, 16, &fit.step);
    let report = Search::new(&fit, cpu(), plain)
        .effective_batch(16)
        .choose(&machine)
        .unwrap();
    let chosen = report.chosen().unwrap();
    assert_eq!(chosen.config.micro_batch, 16);
    assert_eq!(chosen.config.remat, Remat::None);
    assert_eq!(chosen.peak_bytes, Some(plain));
    // No remat was even compiled: nothing needed it.
    assert!(report
        .candidates
        .iter()
        .all(|c| c.config.remat == Remat::None));
}

#[test]
fn under_a_tight_budget_the_fastest_fitting_candidate_is_chosen() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    let plain = peak_of(&fit, 16, &fit.step);
    let budget = plain * 6 / 10;
    let report = Search::new(&fit, cpu(), budget)
        .effective_batch(16)
        .choose(&machine)
        .unwrap();
    let chosen = report.chosen().unwrap().clone();
    let peak = chosen.peak_bytes.unwrap();
    assert!(peak <= budget);
    // Its planned peak is the plan of exactly that configuration.
    assert_eq!(
        peak,
        peak_of(
            &fit,
            chosen.config.micro_batch,
            &chosen.config.apply(&fit.step)
        )
    );
    assert_eq!(
        chosen.config.micro_batch * chosen.config.accumulation,
        16,
        "the effective batch is kept"
    );
    let best = chosen.predicted_seconds.unwrap();
    for c in &report.candidates {
        match (&c.verdict, c.peak_bytes, c.predicted_seconds) {
            (Verdict::OverBudget, Some(p), _) => assert!(p > budget, "{c:?}"),
            (Verdict::Slower { ratio }, Some(p), Some(t)) => {
                assert!(p <= budget && t >= best && (ratio - t / best).abs() < 1e-12)
            }
            (Verdict::Chosen, ..) => assert_eq!(c, &chosen),
            other => panic!("unexpected candidate {other:?}"),
        }
    }
    // Per-block checkpointing at the full micro-batch was among them.
    assert!(report
        .candidates
        .iter()
        .any(|c| c.config.micro_batch == 16 && c.config.remat == Remat::Blocks { blocks: 1 }));
}

#[test]
fn nothing_fits_names_the_smallest_peak() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    // Over the parameters and optimizer state, under every plan: planned, the smallest peak
    // named.
    let tight = under_every_plan(&fit);
    let state = tight - 1;
    let report = Search::new(&fit, cpu(), tight)
        .effective_batch(16)
        .run(&machine)
        .unwrap();
    assert!(report.chosen.is_none());
    assert!(report.candidates.iter().all(|c| c.peak_bytes.is_some()));
    let smallest = report
        .candidates
        .iter()
        .filter_map(|c| c.peak_bytes)
        .min()
        .unwrap();
    match report.nothing_fits() {
        FitError::NothingFits {
            budget,
            smallest: s,
            planned,
            ..
        } => {
            assert_eq!(budget, tight);
            assert_eq!((s, planned), (smallest, true));
        }
        other => panic!("expected NothingFits, got {other:?}"),
    }
    // Under the state itself: nothing is planned, and the state is what is named.
    match Search::new(&fit, cpu(), 1 << 20)
        .effective_batch(16)
        .choose(&machine)
    {
        Err(e @ FitError::NothingFits { .. }) => {
            let FitError::NothingFits {
                budget,
                smallest: s,
                planned,
                ..
            } = &e
            else {
                unreachable!()
            };
            assert_eq!((*budget, *s, *planned), (1 << 20, state, false));
            assert!(
                e.to_string()
                    .contains("parameters and optimizer state alone"),
                "{e}"
            );
        }
        other => panic!("expected NothingFits, got {other:?}"),
    }
}

#[test]
fn the_effective_batch_is_checked() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    assert!(matches!(
        Search::new(&fit, cpu(), usize::MAX)
            .effective_batch(0)
            .choose(&machine),
        Err(FitError::Invalid {
            field: "effective_batch",
            ..
        })
    ));
}

#[test]
fn recovery_fits_under_the_limit_without_growing_the_micro_batch() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    let current = snug_fit::FitConfig::of(
        &StepConfig {
            accumulation: 2,
            ..StepConfig::default()
        },
        16,
    );
    let current_peak = peak_of(&fit, 8, &current.apply(&fit.step));
    let failure = MemoryFailure {
        limit: current_peak * 8 / 10,
        requested: 0,
        active: 0,
    };
    let report = Search::new(&fit, cpu(), failure.budget(current_peak))
        .recovering_from(&current)
        .choose(&machine)
        .unwrap();
    let to = report.chosen().unwrap();
    assert!(to.peak_bytes.unwrap() <= failure.limit);
    assert!(to.config.micro_batch <= 8);
    assert_eq!(to.config.micro_batch * to.config.accumulation, 16);
    // The system refusing: anything below the current plan.
    let system = MemoryFailure {
        limit: usize::MAX,
        ..failure
    };
    let report = Search::new(&fit, cpu(), system.budget(current_peak))
        .recovering_from(&current)
        .choose(&machine)
        .unwrap();
    assert!(report.chosen().unwrap().peak_bytes.unwrap() < current_peak);
}

#[test]
fn lower_precision_is_searched_only_where_allowed_and_needed() {
    let pinned = model();
    let fit = model().allowing(Some(DType::BF16));
    let machine = MachineProfile::nominal(1);
    let low = |micro: usize, remat: Remat| {
        let step = StepConfig {
            precision: DType::BF16,
            accumulation: 16 / micro,
            remat,
            ..StepConfig::default()
        };
        peak_of(&fit, micro, &step)
    };
    let bf16 = |r: &snug_fit::FitReport| {
        r.candidates
            .iter()
            .filter(|c| c.config.precision == DType::BF16)
            .count()
    };

    // f32 fits as it is: precision stays.
    let plain = peak_of(&fit, 16, &fit.step);
    let report = Search::new(&fit, cpu(), plain)
        .effective_batch(16)
        .choose(&machine)
        .unwrap();
    assert_eq!(bf16(&report), 0);

    // Just under it, the bf16 twin at full micro-batch is a candidate, with its own plan's peak.
    let budget = plain - 1;
    let twin = low(16, Remat::None);
    assert!(twin < budget);
    let report = Search::new(&fit, cpu(), budget)
        .effective_batch(16)
        .choose(&machine)
        .unwrap();
    let c = report
        .candidates
        .iter()
        .find(|c| c.config.precision == DType::BF16 && c.config.micro_batch == 16)
        .expect("a bf16 twin");
    assert_eq!((c.config.remat, c.peak_bytes), (Remat::None, Some(twin)));
    assert!(matches!(
        c.verdict,
        Verdict::Chosen | Verdict::Slower { .. }
    ));
    // Pinned, none.
    let report = Search::new(&pinned, cpu(), budget)
        .effective_batch(16)
        .choose(&machine)
        .unwrap();
    assert_eq!(bf16(&report), 0);

    // Where nothing fits, bf16 with recomputation is tried too, as the last resort, and the
    // error names the smallest peak of all.
    let report = Search::new(&fit, cpu(), under_every_plan(&fit))
        .effective_batch(16)
        .run(&machine)
        .unwrap();
    assert!(report.candidates.iter().any(
        |c| c.config.precision == DType::BF16 && c.config.remat == Remat::Blocks { blocks: 1 }
    ));
    let smallest = report.candidates.iter().filter_map(|c| c.peak_bytes).min();
    match report.nothing_fits() {
        FitError::NothingFits { smallest: s, .. } => assert_eq!(Some(s), smallest),
        other => panic!("expected NothingFits, got {other:?}"),
    }
}

/// Selective remat lands a recomputed value at char-small 8 × 256's peak: the search, which
/// compiles candidates exactly, never chooses a remat mode that does not lower the peak of its
/// plain twin, and `compile_step` leaves such a mode out.
#[test]
fn no_remat_mode_that_raises_the_peak_is_chosen_or_compiled() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    let plain = peak_of(&fit, 8, &fit.step);
    let selective = StepConfig {
        remat: Remat::Selective,
        ..fit.step.clone()
    };
    let exact =
        snug_compile::compile_exactly(&fit.model, shape(&fit, 8), cpu(), &selective).unwrap();
    let raised = plan(&exact.step.graph, &PlanOptions::default())
        .unwrap()
        .peak_bytes();
    assert!(raised > plain, "this shape no longer shows the problem");
    let kept = compile_step(&fit.model, shape(&fit, 8), cpu(), &selective).unwrap();
    let dropped = kept.remat_dropped.expect("selective left out");
    assert_eq!(
        (dropped.peak_without_bytes, dropped.peak_with_bytes),
        (plain, raised)
    );
    assert_eq!(peak_of(&fit, 8, &selective), plain);
    for budget in [
        plain / 2,
        plain * 3 / 4,
        plain - 1,
        plain,
        raised,
        raised * 2,
    ] {
        let report = Search::new(&fit, cpu(), budget)
            .effective_batch(8)
            .run(&machine)
            .unwrap();
        let Some(chosen) = report.chosen() else {
            continue;
        };
        if chosen.config.remat != Remat::None {
            let twin = StepConfig {
                remat: Remat::None,
                ..chosen.config.apply(&fit.step)
            };
            assert!(
                chosen.peak_bytes < Some(peak_of(&fit, chosen.config.micro_batch, &twin)),
                "budget {budget}: chose {} which does not lower the peak",
                chosen.config
            );
        }
    }
}

/// `--batch auto`: the largest micro-batch whose smallest configuration fits, and no larger.
#[test]
fn the_largest_micro_batch_fits_and_one_more_does_not() {
    let fit = model();
    let at =
        |b: usize| snug_fit::advice::smallest_peak(&fit, shape(&fit, b), &fit.step, cpu()).unwrap();
    let budget = at(5) + (at(6) - at(5)) / 2;
    assert_eq!(
        snug_fit::largest_micro_batch(&fit, budget, 1 << 20, cpu()).unwrap(),
        Some(5)
    );
    assert_eq!(
        snug_fit::largest_micro_batch(&fit, at(1) - 1, 1 << 20, cpu()).unwrap(),
        None
    );
    assert_eq!(
        snug_fit::largest_micro_batch(&fit, usize::MAX, 64, cpu()).unwrap(),
        Some(64)
    );
}

/// When nothing fits, each suggested change is searched: a change marked as fitting reaches a
/// peak under the budget (the peak of what fit with it chooses), and one that does not, over
/// it.
#[test]
fn what_would_fit_plans_each_change() {
    let fit = model();
    let sgd = StepConfig {
        optimizer: snug_compile::OptimizerKind::Sgd,
        ..fit.step.clone()
    };
    let with_sgd = snug_fit::advice::smallest_peak(&fit, shape(&fit, 1), &sgd, cpu()).unwrap();
    let as_is = snug_fit::advice::smallest_peak(&fit, shape(&fit, 1), &fit.step, cpu()).unwrap();
    assert!(with_sgd < as_is);
    let budget = with_sgd + (as_is - with_sgd) / 2;
    let advice = snug_fit::what_would_fit(&fit, budget, cpu(), 1);
    let s = advice
        .iter()
        .find(|s| s.change.starts_with("--optimizer sgd ("))
        .expect("sgd suggested");
    let with = FitModel {
        step: sgd,
        ..fit.clone()
    };
    let chosen = Search::new(&with, cpu(), budget)
        .choose(&MachineProfile::nominal(1))
        .unwrap()
        .chosen()
        .map(|c| c.peak_bytes);
    assert_eq!((Some(s.peak_bytes), s.fits), (chosen, true));
    for s in &advice {
        assert_eq!(s.fits, s.least_bytes <= budget, "{s:?}");
        assert!(s.peak_bytes.is_none_or(|p| p == s.least_bytes), "{s:?}");
    }
    assert!(
        advice.first().is_some_and(|s| s.fits),
        "fitting changes come first"
    );
}

/// Planning asks the target, not the host: the GELU + linear backward's tile holds whole
/// depth blocks of the target's GEMM, so an AVX-512 target (512 deep, as AVX2's) and the
/// portable one (no depth blocks) plan different scratch on any machine, and each target's
/// plan is the same wherever it is made.
#[test]
fn planned_bytes_follow_the_target_not_the_host() {
    use snug_graph::CpuGemm;
    let fit = model();
    let scratch = |gemm: CpuGemm| {
        let target = Target::cpu(1, gemm);
        let c = compile_step(&fit.model, shape(&fit, 10), target, &fit.step).unwrap();
        let g = &c.step.graph;
        assert_eq!(g.target(), target);
        let node = g
            .nodes()
            .iter()
            .find(|n| n.op.name() == "gelu_linear_backward")
            .expect("the MLP's fused backward");
        let ws = node.workspace.expect("a tile of workspace");
        let peak = plan(g, &PlanOptions::default()).unwrap().peak_bytes();
        (g.tensor(ws).size_bytes(), peak)
    };
    // 10 × 256 = 2560 rows of width 4 · 384 = 1536 through at most 2^20 elements (682 rows):
    // AVX-512 and AVX2 sum 512 deep, so 5 tiles of 512 rows; the portable path has no depth
    // blocks: 4 tiles of 640.
    let (avx512, peak512) = scratch(CpuGemm::Avx512);
    let (portable, peak_portable) = scratch(CpuGemm::Portable);
    assert_eq!(avx512, 512 * 1536 * 4);
    assert_eq!(scratch(CpuGemm::Avx2).0, avx512);
    assert_eq!(portable, 640 * 1536 * 4);
    assert_ne!(peak512, peak_portable);
    assert_eq!(scratch(CpuGemm::Avx512), (avx512, peak512), "repeatable");
}

/// Levers change what is trained: the search uses one only where the user allowed it and
/// nothing with the user's own math fits, and then the chosen candidate's peak is the plan of
/// exactly the step it names.
#[test]
fn levers_are_used_only_when_allowed_and_only_where_nothing_fits_without_them() {
    use snug_fit::{Lever, Levers};
    let fit = model();
    let machine = MachineProfile::nominal(1);
    let lora = Levers::of(&[Lever::Lora]);
    let with_lora = lora.apply(&fit.step);
    let budget = peak_of(&fit, 1, &with_lora);
    let full_smallest =
        snug_fit::advice::smallest_peak(&fit, shape(&fit, 1), &fit.step, cpu()).unwrap();
    assert!(budget < full_smallest, "{budget} vs {full_smallest}");

    // Not allowed: nothing fits, no candidate uses a lever, and the advice names it.
    let report = Search::new(&fit, cpu(), budget).run(&machine).unwrap();
    assert!(report.chosen.is_none());
    assert!(report.candidates.iter().all(|c| c.config.levers.is_empty()));
    assert!(matches!(
        Search::new(&fit, cpu(), budget).choose(&machine),
        Err(FitError::NothingFits { .. })
    ));
    let advice = snug_fit::what_would_fit(&fit, budget, cpu(), 1);
    let s = advice
        .iter()
        .find(|s| s.change == "--allow lora")
        .expect("the lever is suggested");
    assert!(s.fits && s.least_bytes <= budget, "{s:?}");

    // Allowed: the lever is chosen, and its candidate is exactly the LoRA step's plan.
    let allowed = fit.clone().allowing_levers(lora.clone());
    let report = Search::new(&allowed, cpu(), budget)
        .choose(&machine)
        .unwrap();
    let chosen = report.chosen().unwrap();
    assert_eq!(chosen.config.levers, lora);
    let step = chosen.config.apply(&allowed.step);
    assert_eq!(step.lora.as_ref().map(|l| l.rank), Some(16));
    assert_eq!(
        chosen.peak_bytes,
        Some(peak_of(&fit, chosen.config.micro_batch, &step))
    );
    assert!(chosen.peak_bytes.unwrap() <= budget);
    // Every candidate without the lever was tried first and is over the budget.
    for c in report
        .candidates
        .iter()
        .filter(|c| c.config.levers.is_empty())
    {
        assert!(c.peak_bytes.is_none_or(|p| p > budget), "{c:?}");
    }

    // Where the user's own math fits, an allowed lever is not even tried.
    let roomy = Search::new(&allowed, cpu(), full_smallest * 4)
        .choose(&machine)
        .unwrap();
    assert!(roomy.candidates.iter().all(|c| c.config.levers.is_empty()));
}

/// Over several devices each candidate plans one rank at its ZeRO stage: its peak is that
/// rank's plan, every stage is searched, a link adds exactly the communication time, and
/// devices that do not divide the batch are refused by name.
#[test]
fn over_devices_each_stage_plans_one_rank() {
    use snug_compile::compile_sharded;
    use snug_graph::Sharding;
    let fit = model();
    let machine = MachineProfile::nominal(1);
    let rank_plan = |c: &snug_fit::Candidate| {
        let sharding = Sharding::new(4, c.config.shard).unwrap();
        let step = c.config.apply(&fit.step);
        let compiled = compile_sharded(
            &fit.model,
            shape(&fit, c.config.micro_batch),
            cpu(),
            &step,
            &sharding,
        )
        .unwrap();
        let p = plan(&compiled.step.graph, &PlanOptions::default()).unwrap();
        let comm = snug_graph::zero::comm_per_rank(&compiled.step.graph, compiled.step.micro_steps);
        (p.peak_bytes(), comm)
    };
    let roomy = Search::new(&fit, cpu(), 1 << 40)
        .effective_batch(8)
        .devices(4)
        .choose(&machine)
        .unwrap();
    assert_eq!(roomy.devices, 4);
    for stage in 0..=3u8 {
        assert!(
            roomy.candidates.iter().any(|c| c.config.shard == stage),
            "stage {stage}"
        );
    }
    for c in roomy
        .candidates
        .iter()
        .filter(|c| c.config.remat == Remat::None)
    {
        assert_eq!(
            c.config.micro_batch * c.config.accumulation,
            2,
            "per-rank batch"
        );
        assert_eq!(c.peak_bytes, Some(rank_plan(c).0), "{}", c.config);
    }
    // Just under the smallest stage-0 peak: a higher stage (or remat) is chosen, and fits.
    let stage0 = roomy
        .candidates
        .iter()
        .filter(|c| c.config.shard == 0)
        .filter_map(|c| c.peak_bytes)
        .min()
        .unwrap();
    let tight = Search::new(&fit, cpu(), stage0 - 1)
        .effective_batch(8)
        .devices(4)
        .choose(&machine)
        .unwrap();
    let chosen = tight.chosen().unwrap();
    assert!(
        chosen.config.shard > 0 || chosen.config.remat != Remat::None,
        "{}",
        chosen.config
    );
    assert!(chosen.peak_bytes.unwrap() < stage0);

    // A link adds each candidate's communication time, exactly.
    let linked = Search::new(&fit, cpu(), 1 << 40)
        .effective_batch(8)
        .devices(4)
        .link(10.0)
        .run(&machine)
        .unwrap();
    assert_eq!(linked.link_gb_per_s, Some(10.0));
    for (a, b) in roomy.candidates.iter().zip(&linked.candidates) {
        assert_eq!(a.config, b.config);
        let comm = rank_plan(a).1.seconds(10.0);
        assert!(comm > 0.0);
        let (ta, tb) = (a.predicted_seconds.unwrap(), b.predicted_seconds.unwrap());
        assert!(
            ((tb - ta) - comm).abs() <= 1e-9 * tb,
            "{}: {ta} + {comm} vs {tb}",
            a.config
        );
    }

    let err = Search::new(&fit, cpu(), 1 << 40)
        .effective_batch(6)
        .devices(4)
        .run(&machine)
        .unwrap_err();
    assert!(
        matches!(
            err,
            FitError::Invalid {
                field: "devices",
                ..
            }
        ),
        "{err}"
    );
}

/// With every lever allowed, the cheapest rung of the ladder that fits is taken: at any budget
/// the plain space does not reach, every candidate of an earlier rung is over it, and the
/// chosen one is the plan of exactly the step its levers make.
#[test]
fn the_cheapest_rung_that_fits_is_taken() {
    use snug_fit::levers::ladder;
    use snug_fit::Levers;
    let fit = model().allowing_levers(Levers::all());
    let machine = MachineProfile::nominal(1);
    let rungs = ladder(&Levers::all());
    // The least the plain space reaches: its search at a budget nothing meets.
    let plain_smallest = Search::new(&model(), cpu(), under_every_plan(&model()))
        .run(&machine)
        .unwrap()
        .candidates
        .iter()
        .filter_map(|c| c.peak_bytes)
        .min()
        .unwrap();
    let lora_peak = peak_of(
        &fit,
        1,
        &Levers::of(&[snug_fit::Lever::Lora]).apply(&fit.step),
    );
    let mut taken = Vec::new();
    for k in 0..6 {
        let budget = lora_peak + (plain_smallest - 1 - lora_peak) * k / 5;
        let report = Search::new(&fit, cpu(), budget).choose(&machine).unwrap();
        let chosen = report.chosen().unwrap();
        let rung = rungs
            .iter()
            .position(|r| *r == chosen.config.levers)
            .expect("a rung of the ladder");
        for c in &report.candidates {
            let earlier = c.config.levers.is_empty()
                || rungs.iter().position(|r| *r == c.config.levers) < Some(rung);
            if earlier {
                assert!(c.peak_bytes.is_none_or(|p| p > budget), "{}", c.config);
            }
        }
        let step = chosen.config.apply(&fit.step);
        assert_eq!(
            chosen.peak_bytes,
            Some(peak_of(&fit, chosen.config.micro_batch, &step))
        );
        taken.push(rung);
    }
    // Tighter budgets never take a cheaper rung, and more than one rung was exercised.
    assert!(taken.windows(2).all(|w| w[0] >= w[1]), "{taken:?}");
    taken.dedup();
    assert!(taken.len() > 1, "{taken:?}");
}

/// The optimizer update runs once per optimizer step, whichever optimizer: with accumulation
/// its predicted time is not multiplied by the micro-batches, while a forward node's is.
#[test]
fn updates_are_timed_once_per_step() {
    use snug_graph::ops::Op;
    let fit = model();
    let machine = MachineProfile::nominal(1);
    for optimizer in [
        snug_compile::OptimizerKind::AdamW,
        snug_compile::OptimizerKind::AdamW8bit,
        snug_compile::OptimizerKind::Sgd,
    ] {
        let step = StepConfig {
            optimizer,
            accumulation: 3,
            ..fit.step.clone()
        };
        let c = compile_step(&fit.model, shape(&fit, 1), cpu(), &step).unwrap();
        let g = &c.step.graph;
        let mut updates = 0;
        for (i, node) in g.nodes().iter().enumerate() {
            let id = snug_graph::NodeId(i as u32);
            let once = machine.node_seconds(g, id);
            let per_step = machine.node_step_seconds(g, id, 3);
            if matches!(node.op, Op::AdamW(_) | Op::AdamW8bit(_) | Op::Sgd(_)) {
                updates += 1;
                assert_eq!(per_step, once, "{optimizer:?}");
            } else if matches!(node.op, Op::MatMul(_)) {
                assert_eq!(per_step, 3.0 * once);
            }
        }
        assert!(updates > 0, "{optimizer:?}");
        // A step is its nodes summed in schedule order, to the bit.
        let order: Vec<snug_graph::NodeId> = (0..g.nodes().len() as u32)
            .map(snug_graph::NodeId)
            .collect();
        let summed: f64 = order
            .iter()
            .map(|&n| machine.node_step_seconds(g, n, c.step.micro_steps))
            .sum();
        assert_eq!(machine.step_seconds(&c.step, &order), summed);
    }
}

/// A search pinned to one ZeRO stage plans only that stage, so nothing fits names only a
/// candidate of it; a device's check refuses the candidates it cannot run, which are then
/// never chosen, and the fastest it can run is.
#[test]
fn a_pinned_stage_and_a_devices_check_bound_the_choice() {
    let fit = model();
    let machine = MachineProfile::nominal(1);
    for stage in 0..=3u8 {
        let report = Search::new(&fit, cpu(), 1 << 40)
            .effective_batch(8)
            .devices(4)
            .stage(stage)
            .choose(&machine)
            .unwrap();
        assert!(report.candidates.iter().all(|c| c.config.shard == stage));
        assert_eq!(report.chosen().unwrap().config.shard, stage);
    }
    // Under every plan of stage 3 (the smallest per rank): nothing fits, and the error's
    // candidate is of stage 0, the stage searched.
    let floor3 = {
        let sharding = snug_graph::Sharding::new(4, 3).unwrap();
        snug_fit::state_floor(&fit.model, fit.block, &fit.step, cpu(), &sharding).unwrap()
    };
    let pinned = Search::new(&fit, cpu(), floor3 + 1)
        .effective_batch(8)
        .devices(4)
        .stage(0)
        .run(&machine)
        .unwrap();
    assert!(pinned.chosen().is_none());
    match pinned.nothing_fits() {
        FitError::NothingFits { config, .. } => assert!(!config.contains("ZeRO"), "{config}"),
        other => panic!("expected nothing fits, got {other}"),
    }

    // A device that cannot run an unfused cross-entropy: every candidate with it is refused
    // by the check, and the chosen one has the fused pass.
    fn no_unfused_cross_entropy(g: &snug_graph::Graph) -> Result<(), String> {
        match g.nodes().iter().find(|n| n.op.name() == "cross_entropy") {
            Some(_) => Err("no unfused cross-entropy here".into()),
            None => Ok(()),
        }
    }
    let unfused = FitModel {
        step: StepConfig {
            passes: vec![],
            ..fit.step.clone()
        },
        ..fit.clone()
    };
    let free = Search::new(&unfused, cpu(), 1 << 40)
        .effective_batch(4)
        .choose(&machine)
        .unwrap();
    assert!(
        free.chosen().unwrap().config.passes.is_empty(),
        "unchecked, the first wins"
    );
    let checked = Search::new(&unfused, cpu(), 1 << 40)
        .effective_batch(4)
        .runnable(no_unfused_cross_entropy)
        .choose(&machine)
        .unwrap();
    let chosen = checked.chosen().unwrap();
    assert!(!chosen.config.passes.is_empty(), "{:?}", chosen.config);
    let refused: Vec<_> = checked
        .candidates
        .iter()
        .filter(|c| matches!(&c.verdict, Verdict::Failed { reason } if reason.contains("no unfused cross-entropy here")))
        .collect();
    assert!(!refused.is_empty());
    assert!(refused.iter().all(|c| c.config.passes.is_empty()));
}

/// f16 scales its loss, which fused updates (and clipping by the previous step's norm) cannot
/// take: the advice leaves those levers out instead of failing as a whole (it named none), and
/// what it lists is searched: a lever it says fits is chosen by the search under the budget,
/// at the peak the advice names.
#[test]
fn f16_advice_leaves_out_the_levers_it_cannot_build() {
    use snug_fit::{Lever, Levers};
    let f16 = StepConfig {
        precision: DType::F16,
        ..StepConfig::default()
    };
    let fit = FitModel::new(model().model, 256, f16);
    let fused = Levers::of(&[Lever::FusedUpdate]).apply(&fit.step);
    assert!(
        snug_fit::advice::smallest_peak(&fit, shape(&fit, 1), &fused, cpu()).is_err(),
        "fused updates under loss scaling do not build"
    );
    let lora = Levers::of(&[Lever::Lora]).apply(&fit.step);
    let with_lora = snug_fit::advice::smallest_peak(&fit, shape(&fit, 1), &lora, cpu()).unwrap();
    let as_is = snug_fit::advice::smallest_peak(&fit, shape(&fit, 1), &fit.step, cpu()).unwrap();
    assert!(with_lora < as_is, "{with_lora} vs {as_is}");
    let budget = with_lora + (as_is - with_lora) / 2;

    let advice = snug_fit::what_would_fit(&fit, budget, cpu(), 1);
    assert!(advice.iter().any(|s| s.fits), "{advice:?}");
    for s in &advice {
        assert!(!s.change.contains("fused-update"), "{s:?}");
        assert_eq!(s.fits, s.least_bytes <= budget, "{s:?}");
    }
    let s = advice
        .iter()
        .find(|s| s.fits && s.change.starts_with("--allow "))
        .expect("a lever that fits");
    let levers: Levers = s.change["--allow ".len()..].parse().unwrap();
    let report = Search::new(&fit.clone().allowing_levers(levers), cpu(), budget)
        .effective_batch(1)
        .choose(&MachineProfile::nominal(1))
        .unwrap();
    let chosen = report.chosen().unwrap();
    assert!(chosen.peak_bytes.is_some_and(|p| p <= budget), "{chosen:?}");
    assert_eq!(
        s.peak_bytes, chosen.peak_bytes,
        "the peak of the step it names"
    );
}

/// A bf16 run's products and fused ops are classes of their own in the cost model: measured
/// at four times f32's rate (as AMX runs them), its step is predicted at well under f32's.
/// Pooled with f32's samples under one class, each family had two rates and the bf16 step was
/// predicted near f32's.
#[test]
fn a_bf16_runs_products_are_timed_apart_from_f32_ones() {
    use snug_fit::{node_work, Sample};
    let fit = model();
    let compiled = |precision| {
        let step = StepConfig {
            precision,
            ..StepConfig::default()
        };
        let c = compile_step(&fit.model, shape(&fit, 4), cpu(), &step).unwrap();
        let p = plan(&c.step.graph, &PlanOptions::default()).unwrap();
        (c, p.schedule)
    };
    let (f32_step, bf16_step) = (compiled(DType::F32), compiled(DType::BF16));
    let works = |(c, schedule): &(snug_compile::CompiledStep, Vec<snug_graph::NodeId>)| {
        schedule
            .iter()
            .map(|&n| node_work(&c.step.graph, n))
            .filter(|w| w.work > 0.0)
            .collect::<Vec<_>>()
    };
    let (plain, half) = (works(&f32_step), works(&bf16_step));
    assert!(plain.iter().all(|w| !w.class.starts_with("half_")));
    for class in [
        "half_matmul",
        "half_layer_norm_linear",
        "half_gelu_linear_backward",
    ] {
        assert!(half.iter().any(|w| w.class == class), "{class}");
    }
    // Every call measured: f32's at 100 G units of work a second, bf16's own four times that.
    let samples: Vec<Sample> = plain
        .iter()
        .chain(&half)
        .map(|w| {
            let rate = if w.class.starts_with("half_") {
                4e11
            } else {
                1e11
            };
            Sample {
                class: w.class.clone(),
                family: w.family.clone(),
                work: w.work,
                seconds: w.work / rate,
            }
        })
        .collect();
    let profile = MachineProfile::new(1, "test".into(), 1e11, 1e11, 1e-6, samples);
    let predict = |(c, schedule): &(snug_compile::CompiledStep, Vec<snug_graph::NodeId>)| {
        profile.step_seconds(&c.step, schedule)
    };
    let (f, b) = (predict(&f32_step), predict(&bf16_step));
    assert!(b < 0.5 * f, "bf16 {b} s against f32 {f} s");
}
