//! What would fit when nothing in the search space does: the changes to the run itself that
//! snug can make (a lighter optimizer, no global clipping, 16-bit activations, a shorter
//! sequence, a lever the user did not allow), each searched as `fit` searches the run with
//! that change made, so the user hears which of them reaches the budget, and at what peak,
//! instead of only that nothing did.
//!
//! Each change's figure is what `fit` with that change reports: the peak of the configuration
//! it would choose where one fits (the fastest, at whatever micro-batch, remat and precision
//! the search finds, not a fixed one: one sequence at a time with the rest accumulated holds
//! gradient sums the whole batch at once does not, and fused updates take no accumulation at
//! all), else the least any of its candidates needs, a planned peak or, where its parameters
//! and optimizer state alone exceed the budget ([`crate::floor`]), those bytes, unplanned. A
//! change that cannot be built with the rest of the run (fused updates under f16's loss
//! scaling), or that would change nothing, is not suggested, and [`Advice::skipped`] says why.

use serde::Serialize;
use snug_compile::{compile_exactly, OptimizerKind, Pass, Remat, StepConfig, StepShape};
use snug_graph::{DType, Sharding, Target};
use snug_plan::{plan, PlanOptions};

use crate::cost_model::MachineProfile;
use crate::floor::state_floor;
use crate::levers::{ladder, Levers};
use crate::search::{FitConfig, FitModel, FitReport, Search, Verdict};
use crate::FitError;

/// One change to the run and what it reaches: the peak of what `fit` with the change would
/// choose, or, where nothing fits even so, the least it needs (a planned peak, or its
/// parameters and optimizer state, unplanned).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suggestion {
    /// As the user would type it, e.g. `--optimizer sgd --block 128`.
    pub change: String,
    /// The planned peak: of the configuration `fit` would choose where it fits, else of the
    /// candidate that needs least; `None` where that was not planned (its state alone is
    /// over).
    pub peak_bytes: Option<usize>,
    /// The least it needs: the planned peak, else its parameters and optimizer state.
    pub least_bytes: usize,
    pub fits: bool,
    /// The configuration behind the figure (with the levers it adds): `fit`'s choice where it
    /// fits, else the candidate that needs least; `None` where that was not planned.
    pub config: Option<FitConfig>,
}

/// A change the advice considered and does not suggest, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Skipped {
    pub change: String,
    pub reason: String,
}

/// What would fit: the changes searched, those that fit first, then by what they need; and
/// the changes left out, each with its reason.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Advice {
    pub suggestions: Vec<Suggestion>,
    pub skipped: Vec<Skipped>,
}

/// `change`'s figure from `report`, the search of the run with it made: `fit`'s choice, else
/// what [`FitReport::nothing_fits`] names (the same candidate); `Err` with the reason where no
/// candidate was planned or bounded (every one failed to build).
fn reached(change: String, report: &FitReport) -> Result<Suggestion, String> {
    if let Some((c, peak)) = report.chosen().and_then(|c| Some((c, c.peak_bytes?))) {
        return Ok(Suggestion {
            change,
            peak_bytes: Some(peak),
            least_bytes: peak,
            fits: true,
            config: Some(c.config.clone()),
        });
    }
    let least = report
        .candidates
        .iter()
        .filter_map(|c| Some((c.least_bytes()?, c)))
        .min_by_key(|(b, _)| *b);
    match least {
        Some((bytes, c)) => Ok(Suggestion {
            change,
            peak_bytes: c.peak_bytes,
            least_bytes: bytes,
            fits: false,
            config: c.peak_bytes.map(|_| c.config.clone()),
        }),
        None => Err(report
            .candidates
            .iter()
            .find_map(|c| match &c.verdict {
                Verdict::Failed { reason } => Some(format!("it does not build: {reason}")),
                _ => None,
            })
            .unwrap_or_else(|| "no configuration of it was tried".into())),
    }
}

impl Search<'_> {
    /// What would fit where this search finds nothing: each change snug can make that lowers
    /// the peak, alone and all together, searched as this search (its target, budget, batch,
    /// devices and device check) with the change made and timed by `machine`, so each figure
    /// is what `fit` with that change reports; those that fit first. One change that cannot be
    /// built (a lever f16 cannot take) is skipped with its reason, and costs the user no other
    /// suggestion.
    ///
    /// A lever set is searched alone (its own space): `fit --allow` it would try the run as it
    /// is first (which does not fit, or there would be no advice), then any cheaper rung of
    /// the ladder within it; where one of those fits, the set is skipped in its favour.
    pub fn advice(&self, machine: &MachineProfile) -> Advice {
        advise(self, machine)
    }
}

fn advise(search: &Search<'_>, machine: &MachineProfile) -> Advice {
    let model = search.model();
    let mut advice = Advice::default();
    // What `change` reaches: the search of `m`, the run with it made.
    let try_change = |advice: &mut Advice, change: String, m: &FitModel| match search
        .with_model(m)
        .run(machine)
        .map_err(|e| e.to_string())
        .and_then(|report| reached(change.clone(), &report))
    {
        Ok(s) => advice.suggestions.push(s),
        Err(reason) => advice.skipped.push(Skipped { change, reason }),
    };
    let with_step = |step: StepConfig| FitModel {
        step,
        ..model.clone()
    };
    let base = &model.step;
    let mut all = base.clone();
    let mut all_flags = Vec::new();
    let mut changes: Vec<(String, StepConfig)> = Vec::new();
    if base.optimizer != OptimizerKind::Sgd {
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
    // Where fit may lower the precision itself, it searched bf16 already.
    if lowest_allowed(model).precision == DType::F32 {
        let c = StepConfig {
            precision: DType::BF16,
            ..base.clone()
        };
        changes.push(("--precision bf16".into(), c));
        all.precision = DType::BF16;
        all_flags.push("--precision bf16");
    }
    for (change, step) in changes {
        try_change(&mut advice, change, &with_step(step));
    }
    // The longest sequence that fits, as it is and with every change above (said once where
    // there is no change to make).
    let mut runs = vec![(Vec::new(), base.clone())];
    if !all_flags.is_empty() {
        runs.push((all_flags.clone(), all.clone()));
    }
    for (flags, step) in runs {
        // Halved down to 8 tokens, longest first.
        let lengths: Vec<usize> = std::iter::successors(Some(model.block / 2), |b| Some(b / 2))
            .take_while(|&b| b >= 8)
            .collect();
        let at = |block: usize| {
            let m = FitModel {
                block,
                ..with_step(step.clone())
            };
            // A length the step does not build at is not one to suggest.
            search
                .with_model(&m)
                .run(machine)
                .ok()
                .filter(|r| r.chosen.is_some())
        };
        // A shorter sequence never needs more: where the shortest does not fit (the state and
        // gradients alone over, say), none does, and otherwise the longest that fits is found
        // by bisection, a search for each length tried.
        let Some(&shortest) = lengths.last() else {
            continue;
        };
        let Some(mut found) = at(shortest).map(|r| (shortest, r)) else {
            continue;
        };
        // lengths[hi] fits; the longest that fits is at or before it, after `lo`'s misses.
        let (mut lo, mut hi) = (0, lengths.len() - 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match at(lengths[mid]) {
                Some(r) => {
                    found = (lengths[mid], r);
                    hi = mid;
                }
                None => lo = mid + 1,
            }
        }
        let (block, report) = found;
        let mut change = flags.join(" ");
        if !change.is_empty() {
            change.push(' ');
        }
        change.push_str(&format!("--block {block}"));
        advice.suggestions.extend(reached(change, &report).ok());
    }
    // Levers change what is trained, so they are only named, with what they would reach.
    let mut fitting_rungs: Vec<Levers> = Vec::new();
    for rung in ladder(&Levers::all()) {
        let change = format!("--allow {rung}");
        let step = rung.apply(base);
        let skip = if rung.iter().all(|l| model.levers.contains(l)) {
            Some("allowed already: the search tried it".to_string())
        } else if step == *base {
            Some("it changes nothing in this run".to_string())
        } else {
            fitting_rungs
                .iter()
                .find(|r| r.iter().all(|l| rung.contains(l)))
                .map(|r| format!("`--allow {rung}` would choose `--allow {r}`, which fits"))
        };
        if let Some(reason) = skip {
            advice.skipped.push(Skipped { change, reason });
            continue;
        }
        // The rung's own space, as the search builds it: its levers applied, none to add.
        let m = FitModel {
            levers: Levers::none(),
            ..with_step(step)
        };
        let before = advice.suggestions.len();
        try_change(&mut advice, change, &m);
        if let Some(s) = advice.suggestions[before..].first_mut() {
            if let Some(c) = &mut s.config {
                c.levers = rung.clone();
            }
            if s.fits {
                fitting_rungs.push(rung.clone());
            }
        }
    }
    if all_flags.len() > 1 {
        try_change(&mut advice, all_flags.join(" "), &with_step(all));
    }
    advice.suggestions.sort_by_key(|s| (!s.fits, s.least_bytes));
    advice
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

/// [`Search::advice`] for `model` on `target` at `budget`, `sequences` a step on one device,
/// timed by the nominal profile of the target's threads (as `snug fit` ranks its candidates
/// before it measures the machine), the suggestions only.
pub fn what_would_fit(
    model: &FitModel,
    budget: usize,
    target: Target,
    sequences: usize,
) -> Vec<Suggestion> {
    Search::new(model, target, budget)
        .effective_batch(sequences.max(1))
        .advice(&MachineProfile::nominal(target.threads()))
        .suggestions
}

/// `step`'s parameters and optimizer state on one device, where they alone exceed `budget`
/// (at any sequence length or micro-batch). A bound that does not compile says nothing: the
/// plan it would spare then names the error.
fn floor_over(model: &FitModel, step: &StepConfig, target: Target, budget: usize) -> Option<usize> {
    state_floor(&model.model, model.block, step, target, &Sharding::SINGLE)
        .ok()
        .filter(|&floor| floor > budget)
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
