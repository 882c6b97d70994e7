//! What would fit when nothing in the search space does: the changes to the run itself that
//! snug can make (a lighter optimizer, no global clipping, 16-bit activations, a shorter
//! sequence, a lever the user did not allow), each planned at its smallest configuration, so
//! the user hears which of them reaches the budget instead of only that nothing did. A change
//! whose parameters and optimizer state alone exceed the budget ([`crate::floor`]) is not
//! planned: no configuration of it can fit. A change whose step cannot be built with the rest
//! of the run (fused updates under f16's loss scaling) is not suggested: the search lists such
//! a candidate as failed, and the advice names only what the user could run.

use serde::Serialize;
use snug_compile::{compile_exactly, OptimizerKind, Pass, Remat, StepConfig, StepShape};
use snug_graph::{DType, Sharding, Target};
use snug_plan::{plan, PlanOptions};

use crate::floor::state_floor;
use crate::levers::{ladder, Levers};
use crate::search::FitModel;
use crate::FitError;

/// One change to the run and the least it needs: the smallest planned peak it reaches
/// (micro-batch 1 with the rest of the batch accumulated, the cheapest remat, every memory
/// pass), or where its parameters and
/// optimizer state alone exceed the budget, those bytes, unplanned.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suggestion {
    /// As the user would type it, e.g. `--optimizer sgd --block 128`.
    pub change: String,
    /// Its smallest planned peak; `None` where it was not planned (its state alone is over).
    pub peak_bytes: Option<usize>,
    /// The least it needs: the planned peak, else its parameters and optimizer state.
    pub least_bytes: usize,
    pub fits: bool,
}

impl Suggestion {
    /// `change` with `step` at `shape`: refused by its state where that alone is over
    /// `budget`, else planned; `None` where its step cannot be built or planned (it is no
    /// change the user could make).
    fn of(
        change: String,
        model: &FitModel,
        shape: StepShape,
        step: &StepConfig,
        target: Target,
        budget: usize,
    ) -> Option<Suggestion> {
        if let Some(floor) = floor_over(model, step, target, budget) {
            return Some(Suggestion {
                change,
                peak_bytes: None,
                least_bytes: floor,
                fits: false,
            });
        }
        let peak = smallest_peak(model, shape, step, target).ok()?;
        Some(Suggestion {
            change,
            peak_bytes: Some(peak),
            least_bytes: peak,
            fits: peak <= budget,
        })
    }
}

/// `step`'s parameters and optimizer state on one device, where they alone exceed `budget`
/// (at any sequence length or micro-batch). A bound that does not compile says nothing: the
/// plan it would spare then names the error.
fn floor_over(model: &FitModel, step: &StepConfig, target: Target, budget: usize) -> Option<usize> {
    state_floor(&model.model, model.block, step, target, &Sharding::SINGLE)
        .ok()
        .filter(|&floor| floor > budget)
}

/// The smallest peak of `model` at `shape` on `target` under `step` (its accumulation
/// kept), with and without per-block remat, every pass that lowers memory.
pub fn smallest_peak(
    model: &FitModel,
    shape: StepShape,
    step: &StepConfig,
    target: Target,
) -> Result<usize, FitError> {
    let mut passes = step.passes.clone();
    for p in [Pass::FusedCrossEntropy, Pass::InPlace] {
        if !passes.contains(&p) {
            passes.push(p);
        }
    }
    let mut best = usize::MAX;
    // Remat compiled exactly: `compile_step` would plan it, and plan the step without it
    // again, to drop a remat that does not lower the peak; the smaller of the two is all
    // this needs, and both are planned here once.
    for remat in [Remat::None, Remat::Blocks { blocks: 1 }] {
        let config = StepConfig {
            remat,
            passes: passes.clone(),
            ..step.clone()
        };
        let c = compile_exactly(&model.model, shape, target, &config)?;
        best = best.min(plan(&c.step.graph, &PlanOptions::default())?.peak_bytes());
    }
    Ok(best)
}

/// Each change snug can make that lowers `model`'s peak, alone and all together, with the
/// peak it reaches for the `sequences` a device trains each step (one at a time, the rest
/// accumulated: a run of several holds gradient sums that a run of one does not); those that
/// fit `budget` first. A change whose step does not build with the run's other settings is
/// left out, not an error: one such rung (a lever f16 cannot take) must not cost the user
/// every other suggestion.
pub fn what_would_fit(
    model: &FitModel,
    budget: usize,
    target: Target,
    sequences: usize,
) -> Vec<Suggestion> {
    let one = |block: usize| StepShape {
        micro_batch: 1,
        block,
    };
    let base = StepConfig {
        accumulation: sequences.max(1),
        ..lowest_allowed(model)
    };
    let mut changes: Vec<(String, StepConfig)> = Vec::new();
    let mut all = base.clone();
    let mut all_flags = Vec::new();
    if base.optimizer == OptimizerKind::AdamW {
        let c = StepConfig {
            optimizer: OptimizerKind::Sgd,
            ..base.clone()
        };
        changes.push(("--optimizer sgd (no moments)".into(), c));
        all.optimizer = OptimizerKind::Sgd;
        all_flags.push("--optimizer sgd");
    }
    if base.grad_clip > 0.0 {
        let c = StepConfig {
            grad_clip: 0.0,
            ..base.clone()
        };
        changes.push((
            "--grad-clip 0 (each gradient freed after its update)".into(),
            c,
        ));
        all.grad_clip = 0.0;
        all_flags.push("--grad-clip 0");
    }
    if base.precision == DType::F32 {
        let c = StepConfig {
            precision: DType::BF16,
            ..base.clone()
        };
        changes.push(("--precision bf16".into(), c));
        all.precision = DType::BF16;
        all_flags.push("--precision bf16");
    }
    let mut out = Vec::new();
    for (change, step) in &changes {
        out.extend(Suggestion::of(
            change.clone(),
            model,
            one(model.block),
            step,
            target,
            budget,
        ));
    }
    // The longest sequence that fits, as it is and with every change above; none does where
    // the state alone is over, whatever the sequence.
    let mut runs = vec![(Vec::new(), base.clone())];
    // With no change to make, "every change" is the run as it is: its length is said once.
    if !all_flags.is_empty() {
        runs.push((all_flags.clone(), all.clone()));
    }
    for (flags, step) in runs {
        if floor_over(model, &step, target, budget).is_some() {
            continue;
        }
        let mut block = model.block / 2;
        while block >= 8 {
            // A length the step does not build at is not one to suggest.
            let peak = smallest_peak(model, one(block), &step, target).ok();
            if let Some(peak) = peak.filter(|&p| p <= budget) {
                let mut change = flags.join(" ");
                if !change.is_empty() {
                    change.push(' ');
                }
                change.push_str(&format!("--block {block}"));
                out.push(Suggestion {
                    change,
                    peak_bytes: Some(peak),
                    least_bytes: peak,
                    fits: true,
                });
                break;
            }
            block /= 2;
        }
    }
    // Levers change what is trained, so they are only named, with what they would reach.
    for rung in ladder(&Levers::all()) {
        let step = rung.apply(&base);
        // Allowed already (and tried), or what the user set anyway.
        if rung.iter().all(|l| model.levers.contains(l)) || step == base {
            continue;
        }
        out.extend(Suggestion::of(
            format!("--allow {rung}"),
            model,
            one(model.block),
            &step,
            target,
            budget,
        ));
    }
    if all_flags.len() > 1 {
        out.extend(Suggestion::of(
            all_flags.join(" "),
            model,
            one(model.block),
            &all,
            target,
            budget,
        ));
    }
    out.sort_by_key(|s| (!s.fits, s.least_bytes));
    out
}

/// The user's step settings in the lowest precision fit may choose for them.
pub fn lowest_allowed(model: &FitModel) -> StepConfig {
    StepConfig {
        precision: match model.low_precision {
            Some(low) if model.step.precision == DType::F32 => low,
            _ => model.step.precision,
        },
        ..model.step.clone()
    }
}

/// The largest micro-batch (at most `most`) whose smallest peak fits `budget`, if 1 does:
/// as the run is, else with the lightest lever the model allows that lets one sequence fit
/// (the search then chooses among the levers for that batch).
pub fn largest_micro_batch(
    model: &FitModel,
    budget: usize,
    most: usize,
    target: Target,
) -> Result<Option<usize>, FitError> {
    // One micro-batch: no accumulation.
    let step = StepConfig {
        accumulation: 1,
        ..lowest_allowed(model)
    };
    if let Some(b) = largest_micro_batch_of(model, &step, budget, most, target)? {
        return Ok(Some(b));
    }
    for rung in ladder(&model.levers) {
        let with = rung.apply(&step);
        // A rung f16 cannot build, say, is one fewer to try.
        if let Ok(Some(b)) = largest_micro_batch_of(model, &with, budget, most, target) {
            return Ok(Some(b));
        }
    }
    Ok(None)
}

fn largest_micro_batch_of(
    model: &FitModel,
    step: &StepConfig,
    budget: usize,
    most: usize,
    target: Target,
) -> Result<Option<usize>, FitError> {
    let step = step.clone();
    let shape = |micro_batch: usize| StepShape {
        micro_batch,
        block: model.block,
    };
    // A size the planner refuses (an overflow) does not fit.
    let fits = |b: usize| smallest_peak(model, shape(b), &step, target).is_ok_and(|p| p <= budget);
    if floor_over(model, &step, target, budget).is_some() || !fits(1) {
        return Ok(None);
    }
    let (mut good, mut bad) = (1usize, None);
    while bad.is_none() && good < most {
        let next = (good * 2).min(most);
        if fits(next) {
            good = next;
        } else {
            bad = Some(next);
        }
    }
    let mut bad = bad.unwrap_or(most + 1);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(Some(good))
}
