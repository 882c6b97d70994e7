//! What would fit, when nothing does: each change the advice names is taken as the user would
//! type it, and `fit` with it searched; the advice's figure is what that search chooses (or,
//! where nothing fits even so, the least it needs), and no lever is dropped without a reason.

use snug_compile::{OptimizerKind, StepConfig};
use snug_fit::{FitError, FitModel, Levers, MachineProfile, Search, Suggestion};
use snug_graph::{ClipMode, DType, Sharding, Target};
use snug_nn::ModelConfig;

fn cpu() -> Target {
    Target::host(1)
}

fn nominal() -> MachineProfile {
    MachineProfile::nominal(1)
}

/// `model` at `block` with `step`, as `snug fit` searches it: bf16 allowed (the precision
/// not set), no levers.
fn as_fit_searches(model: &str, block: usize, step: StepConfig) -> FitModel {
    FitModel::new(ModelConfig::preset(model).unwrap(), block, step).allowing(Some(DType::BF16))
}

fn state(fit: &FitModel) -> usize {
    snug_fit::state_floor(&fit.model, fit.block, &fit.step, cpu(), &Sharding::SINGLE).unwrap()
}

/// `fit` with `change` taken as the user would type it: the model it searches, and the levers
/// where the change allows some (they replace the run's own `--allow`).
fn taken(fit: &FitModel, change: &str) -> (FitModel, Option<Levers>) {
    let flags = change.split('(').next().unwrap();
    let words: Vec<&str> = flags.split_whitespace().collect();
    let mut m = fit.clone();
    let mut levers = None;
    for pair in words.chunks(2) {
        match pair {
            ["--optimizer", "sgd"] => m.step.optimizer = OptimizerKind::Sgd,
            ["--grad-clip", "0"] => m.step.grad_clip = 0.0,
            ["--precision", "bf16"] => m.step.precision = DType::BF16,
            ["--block", n] => m.block = n.parse().unwrap(),
            ["--allow", l] => {
                let l: Levers = l.parse().unwrap();
                m.levers = l.clone();
                levers = Some(l);
            }
            other => panic!("a flag the advice does not make: {other:?} in `{change}`"),
        }
    }
    (m, levers)
}

/// Checks every suggestion for `fit` at `budget` over `batch` sequences against the search of
/// `fit` with it taken, and that every lever rung is suggested or skipped with a reason;
/// returns the advice.
fn advice_is_fits_own(fit: &FitModel, budget: usize, batch: usize) -> Vec<Suggestion> {
    let machine = nominal();
    let search = Search::new(fit, cpu(), budget).effective_batch(batch);
    assert!(
        search.run(&machine).unwrap().chosen.is_none(),
        "advice is for a run nothing fits"
    );
    let advice = search.advice(&machine);
    assert_eq!(
        snug_fit::what_would_fit(fit, budget, cpu(), batch),
        advice.suggestions,
        "what_would_fit is the nominal advice"
    );
    for s in &advice.suggestions {
        let what = format!("budget {budget}, `{}`: {s:?}", s.change);
        assert_eq!(s.fits, s.least_bytes <= budget, "{what}");
        assert!(s.peak_bytes.is_none_or(|p| p == s.least_bytes), "{what}");
        let (m, levers) = taken(fit, &s.change);
        let report = Search::new(&m, cpu(), budget)
            .effective_batch(batch)
            .run(&machine)
            .unwrap();
        match report.chosen() {
            Some(chosen) => {
                assert!(s.fits, "{what}: fit chooses {chosen:?}");
                assert_eq!(s.peak_bytes, chosen.peak_bytes, "{what}");
                assert_eq!(s.config.as_ref(), Some(&chosen.config), "{what}");
                if let Some(l) = &levers {
                    assert_eq!(&chosen.config.levers, l, "{what}: fit chose another rung");
                }
            }
            None => {
                assert!(!s.fits, "{what}: fit chooses nothing");
                // A lever set's figure is its own candidates' least (the run as it is, tried
                // first, needs more, or it would have been chosen); a flag's, fit's refusal.
                let least = match &levers {
                    Some(l) => report
                        .candidates
                        .iter()
                        .filter(|c| &c.config.levers == l)
                        .filter_map(|c| c.least_bytes())
                        .min()
                        .unwrap(),
                    None => match report.nothing_fits() {
                        FitError::NothingFits { smallest, .. } => smallest,
                        other => panic!("{other:?}"),
                    },
                };
                assert_eq!(s.least_bytes, least, "{what}");
            }
        }
        // A length suggested is the longest that fits: twice it does not.
        if let Some(block) = s.change.split("--block ").nth(1) {
            let block: usize = block.trim().parse().unwrap();
            if block * 2 < fit.block {
                let (mut longer, _) = taken(fit, &s.change);
                longer.block = block * 2;
                let r = Search::new(&longer, cpu(), budget)
                    .effective_batch(batch)
                    .run(&machine)
                    .unwrap();
                assert!(r.chosen.is_none(), "{what}: {} tokens fit too", block * 2);
            }
        }
    }
    // No rung is dropped silently: each is suggested or skipped with its reason.
    for rung in snug_fit::levers::ladder(&Levers::all()) {
        let change = format!("--allow {rung}");
        let suggested = advice.suggestions.iter().any(|s| s.change == change);
        let skipped = advice
            .skipped
            .iter()
            .find(|s| s.change == change)
            .map(|s| s.reason.clone());
        assert!(
            suggested != skipped.is_some() && skipped.as_ref().is_none_or(|r| !r.is_empty()),
            "budget {budget}, {change}: suggested {suggested}, skipped {skipped:?}"
        );
    }
    advice.suggestions
}

fn named<'a>(advice: &'a [Suggestion], change: &str) -> &'a Suggestion {
    advice
        .iter()
        .find(|s| s.change == change)
        .unwrap_or_else(|| panic!("`{change}` not suggested: {advice:?}"))
}

/// The auditor's runs, tiny 2 × 8: with fused updates (which take no accumulation) every
/// lever rung had vanished, the advice planned at one sequence with the rest accumulated
/// (gradient sums the whole batch at once does not hold, which matters where the weights
/// dominate), and so said `--allow qlora` missed a budget it fits, and left out `--optimizer
/// sgd` where it fits. Each budget is given (not a figure expected), and one just under the
/// run's own parameters and optimizer state.
#[test]
fn each_changes_figure_is_what_fit_with_it_chooses() {
    let sgd_fused = StepConfig {
        optimizer: OptimizerKind::Sgd,
        fused_update: true,
        grad_clip: 0.0,
        ..StepConfig::default()
    };
    let eight_bit_fused = StepConfig {
        optimizer: OptimizerKind::AdamW8bit,
        fused_update: true,
        clip_mode: ClipMode::Tensor,
        ..StepConfig::default()
    };
    let eight_bit = StepConfig {
        optimizer: OptimizerKind::AdamW8bit,
        ..StepConfig::default()
    };
    let cases = [
        (sgd_fused, 1_436_556),
        (eight_bit_fused, 1_436_556),
        (eight_bit, 1_436_556),
        (StepConfig::default(), 4_000_000),
    ];
    for (i, (step, budget)) in cases.into_iter().enumerate() {
        let fit = as_fit_searches("tiny", 8, step);
        let advice = advice_is_fits_own(&fit, budget, 2);
        advice_is_fits_own(&fit, state(&fit) - 1, 2);
        match i {
            0..=2 => assert!(named(&advice, "--allow qlora").fits, "{advice:?}"),
            _ => assert!(
                named(&advice, "--optimizer sgd (no moments)").fits,
                "{advice:?}"
            ),
        }
        // Under fused updates, the rungs are there (they had all failed to build).
        if i < 2 {
            assert!(advice.iter().any(|s| s.change.starts_with("--allow ")));
        }
    }
}

/// A shorter sequence is suggested where it fits, at the longest length that does, with fit's
/// figure there: char-small 8 × 256 at 80 MiB (its AdamW state alone is over).
#[test]
fn a_shorter_sequence_is_the_longest_that_fits_at_fits_figure() {
    let fit = as_fit_searches("char-small", 256, StepConfig::default());
    let advice = advice_is_fits_own(&fit, 80 << 20, 8);
    assert!(
        advice
            .iter()
            .any(|s| s.fits && s.change.contains("--block ")),
        "{advice:?}"
    );
}

/// f16 scales its loss, which fused updates cannot take: those rungs are not suggested, and
/// the advice says why, naming the compiler's refusal.
#[test]
fn a_rung_that_cannot_be_built_is_skipped_with_its_reason() {
    let f16 = StepConfig {
        precision: DType::F16,
        ..StepConfig::default()
    };
    let fit = FitModel::new(ModelConfig::preset("tiny").unwrap(), 64, f16);
    let budget = 4 << 20;
    let machine = nominal();
    let advice_list = advice_is_fits_own(&fit, budget, 8);
    assert!(advice_list.iter().any(|s| s.fits), "{advice_list:?}");
    let advice = Search::new(&fit, cpu(), budget)
        .effective_batch(8)
        .advice(&machine);
    let fused = advice
        .skipped
        .iter()
        .find(|s| s.change == "--allow fused-update")
        .expect("skipped, with a reason");
    assert!(fused.reason.contains("does not build"), "{fused:?}");
    assert!(advice
        .suggestions
        .iter()
        .all(|s| !s.change.contains("fused-update")));
}
