//! The search: compile every candidate configuration (nothing allocated), plan it for its exact
//! peak, predict its step time, and keep the fastest that fits.
//!
//! The space is micro-batch (every divisor of the effective batch, the rest made up by
//! accumulation) × rematerialization (none; and where none does not fit: selective, per block,
//! every two blocks, and the least recompute that fits the budget) × the fused LM head +
//! cross-entropy pass (on, or as the user set it) × precision: where the model allows a 16-bit
//! type ([`FitModel::low_precision`]), every f32 candidate over budget gets a mixed-precision
//! twin, which then competes on predicted time like any other.
//!
//! Over several devices ([`Search::devices`]) the same space is searched for one rank of a
//! data-parallel run at each ZeRO stage, 0 to 3, all competing on predicted time (with the
//! communication over [`Search::link`] added where it is given); ties go to the lower stage.
//!
//! Levers that change what is trained ([`crate::levers`]) come last, only where the user
//! allowed them and nothing with the user's own math fits: each rung of the ladder is the
//! whole space again with its levers applied, and the first rung where anything fits ends the
//! search.
//!
//! A space whose parameters and optimizer state alone exceed the budget ([`crate::floor`])
//! is listed without planning any of it: each of its candidates is
//! [`Verdict::OverLowerBound`], with that bound.
//!
//! Every row is what `plan` and `train` run with its flags: a fixed remat mode that does not
//! lower the peak of the same step without remat is left out there, so its row holds that
//! step's peak and time, and says so ([`Candidate::remat_dropped`]).

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use snug_compile::{
    compile_exactly_sharded, CompileError, Pass, Remat, RematDropped, StepConfig, StepShape,
};
use snug_graph::{DType, Sharding, Target};
use snug_nn::ModelConfig;

use crate::cost_model::{MachineProfile, StepWork};
use crate::floor::state_floor;
use crate::levers::{ladder, Levers};
use crate::FitError;

/// The model being fitted: its architecture, sequence length and the user's step settings
/// (optimizer, clipping, passes), which the search varies only where it must.
#[derive(Debug, Clone)]
pub struct FitModel {
    pub model: ModelConfig,
    pub block: usize,
    pub step: StepConfig,
    /// A 16-bit type the search may train activations in (mixed precision, f32 master
    /// weights) where the user's f32 does not fit as it is; `None` keeps `step.precision`.
    pub low_precision: Option<DType>,
    /// The levers the search may add where nothing fits without them.
    pub levers: Levers,
}

impl FitModel {
    /// The user's settings, searched in their own precision only.
    pub fn new(model: ModelConfig, block: usize, step: StepConfig) -> FitModel {
        FitModel {
            model,
            block,
            step,
            low_precision: None,
            levers: Levers::none(),
        }
    }

    /// Lets the search lower the precision to `low` (ignored unless the step runs in f32).
    pub fn allowing(mut self, low: Option<DType>) -> FitModel {
        self.low_precision = low;
        self
    }

    /// Lets the search add these levers where nothing fits without them.
    pub fn allowing_levers(mut self, levers: Levers) -> FitModel {
        self.levers = levers;
        self
    }
}

/// The knobs one candidate sets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitConfig {
    pub micro_batch: usize,
    pub accumulation: usize,
    #[serde(serialize_with = "display")]
    pub remat: Remat,
    pub passes: Vec<Pass>,
    pub precision: DType,
    /// The levers this candidate adds to the user's settings.
    pub levers: Levers,
    /// Over several devices: the ZeRO stage (0 replicates everything; `micro_batch` is then
    /// per rank).
    pub shard: u8,
}

fn display<S: serde::Serializer, T: std::fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl FitConfig {
    /// The user's step settings with this candidate's levers and knobs applied.
    pub fn apply(&self, base: &StepConfig) -> StepConfig {
        StepConfig {
            accumulation: self.accumulation,
            remat: self.remat,
            passes: self.passes.clone(),
            precision: self.precision,
            ..self.levers.apply(base)
        }
    }

    /// The knobs of a running configuration.
    pub fn of(step: &StepConfig, batch: usize) -> FitConfig {
        FitConfig {
            micro_batch: batch / step.accumulation.max(1),
            accumulation: step.accumulation.max(1),
            remat: step.remat,
            passes: step.passes.clone(),
            precision: step.precision,
            levers: Levers::none(),
            shard: 0,
        }
    }
}

impl FitConfig {
    /// What sets its parameters and optimizer state: its levers and ZeRO stage.
    fn state_label(&self) -> String {
        let levers = if self.levers.is_empty() {
            "without levers".to_string()
        } else {
            format!("levers {}", self.levers)
        };
        match self.shard {
            0 => levers,
            stage => format!("ZeRO-{stage}, {levers}"),
        }
    }
}

impl std::fmt::Display for FitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "micro-batch {} × {}, remat {}",
            self.micro_batch, self.accumulation, self.remat
        )?;
        let passes: Vec<&str> = self.passes.iter().map(|p| p.name()).collect();
        if !passes.is_empty() {
            write!(f, ", passes {}", passes.join(","))?;
        }
        write!(f, ", {}", self.precision)?;
        if self.shard > 0 {
            write!(f, ", ZeRO-{}", self.shard)?;
        }
        if !self.levers.is_empty() {
            write!(f, ", levers {}", self.levers)?;
        }
        Ok(())
    }
}

/// Why a candidate was or was not chosen.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    Chosen,
    /// Its planned peak exceeds the budget.
    OverBudget,
    /// Not planned: its parameters and optimizer state alone, which every plan of it holds
    /// throughout, exceed the budget ([`crate::floor`]).
    OverLowerBound {
        lower_bound_bytes: usize,
    },
    /// It fits, but the chosen one is predicted faster by this factor.
    Slower {
        ratio: f64,
    },
    /// It could not be compiled or planned.
    Failed {
        reason: String,
    },
}

/// One configuration considered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub config: FitConfig,
    pub peak_bytes: Option<usize>,
    pub predicted_seconds: Option<f64>,
    #[serde(flatten)]
    pub verdict: Verdict,
    /// A fixed remat mode (`selective`, `block`, `block:K`) that does not lower the peak of
    /// the same candidate without remat: `plan` and `train` leave it out with these flags and
    /// run without it (`snug_compile::compile_step`), so `peak_bytes` and `predicted_seconds`
    /// are that step's, and this holds the peak without and with the mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remat_dropped: Option<RematDropped>,
    /// What `predicted_seconds` is made of, to time it on another machine.
    #[serde(skip)]
    timing: Option<Timing>,
}

/// A candidate's step work and its communication time (which no machine profile changes).
#[derive(Debug, Clone, PartialEq)]
struct Timing {
    work: Arc<StepWork>,
    comm_seconds: f64,
}

impl Timing {
    /// Predicted seconds per step on `machine`, communication included.
    fn seconds(&self, machine: &MachineProfile) -> f64 {
        machine.work_seconds(&self.work) + self.comm_seconds
    }
}

impl Candidate {
    /// Refused unplanned: it needs at least `lower_bound_bytes`, more than the budget.
    fn over_lower_bound(config: FitConfig, lower_bound_bytes: usize) -> Candidate {
        Candidate {
            config,
            peak_bytes: None,
            predicted_seconds: None,
            verdict: Verdict::OverLowerBound { lower_bound_bytes },
            remat_dropped: None,
            timing: None,
        }
    }

    /// What it is known to need at least: its planned peak, or the bound it was refused by.
    pub fn least_bytes(&self) -> Option<usize> {
        match self.verdict {
            Verdict::OverLowerBound { lower_bound_bytes } => Some(lower_bound_bytes),
            _ => self.peak_bytes,
        }
    }
}

/// Everything the search considered, and what it chose.
#[derive(Debug, Clone, Serialize)]
pub struct FitReport {
    pub budget: usize,
    pub effective_batch: usize,
    /// Devices the effective batch is spread over (each candidate plans one rank).
    pub devices: usize,
    /// The link's bandwidth (GB/s each way) whose communication time the predictions
    /// include; `None`: communication not timed.
    pub link_gb_per_s: Option<f64>,
    pub block: usize,
    /// Whether predictions come from this machine's calibration (else nominal figures).
    pub calibrated: bool,
    /// The machine's speed now over its speed at calibration, which the predictions assume
    /// (see [`MachineProfile::rescaled`]).
    pub machine_speed: f64,
    pub candidates: Vec<Candidate>,
    /// Index into `candidates`.
    pub chosen: Option<usize>,
    pub search_seconds: f64,
}

impl FitReport {
    pub fn chosen(&self) -> Option<&Candidate> {
        self.chosen.map(|i| &self.candidates[i])
    }

    /// The same search with its predictions made by `machine`. Which candidates a search
    /// compiles and their peaks depend on the budget, never on the machine, so this is
    /// [`Search::run`] with `machine`, to the bit, without compiling or planning anything
    /// again: each planned step's work is timed by the new profile, and the choice and
    /// verdicts are made anew.
    pub fn timed_by(&self, machine: &MachineProfile) -> FitReport {
        let start = Instant::now();
        let mut candidates = self.candidates.clone();
        for c in &mut candidates {
            if let Some(t) = &c.timing {
                c.predicted_seconds = Some(t.seconds(machine));
            }
        }
        let chosen = decide(&mut candidates, self.budget);
        FitReport {
            budget: self.budget,
            effective_batch: self.effective_batch,
            devices: self.devices,
            link_gb_per_s: self.link_gb_per_s,
            block: self.block,
            calibrated: machine.is_measured(),
            machine_speed: machine.speed,
            candidates,
            chosen,
            search_seconds: self.search_seconds + start.elapsed().as_secs_f64(),
        }
    }

    /// The error a caller reports when nothing fits: the least any candidate needs, its
    /// planned peak or, where it was refused unplanned, its lower bound.
    pub fn nothing_fits(&self) -> FitError {
        let smallest = self
            .candidates
            .iter()
            .filter_map(|c| Some((c.least_bytes()?, c)))
            .min_by_key(|(p, _)| *p);
        FitError::NothingFits {
            budget: self.budget,
            smallest: smallest.map_or(0, |(p, _)| p),
            config: smallest.map_or_else(
                || "none compiled".into(),
                |(_, c)| match c.verdict {
                    // Unplanned, it stands for its whole space: what sets the state is named.
                    Verdict::OverLowerBound { .. } => c.config.state_label(),
                    _ => c.config.to_string(),
                },
            ),
            planned: smallest.is_none_or(|(_, c)| c.peak_bytes.is_some()),
        }
    }
}

/// One search: a model, the target it runs on and a memory budget, with the effective batch
/// and a bound on the micro-batch as options.
#[derive(Debug, Clone)]
pub struct Search<'a> {
    model: &'a FitModel,
    target: Target,
    budget: usize,
    effective_batch: usize,
    max_micro_batch: Option<usize>,
    devices: usize,
    link: Option<f64>,
    /// Whether spaces over the budget by their state alone go unplanned (off only in tests,
    /// which check that pruning changes nothing but the time).
    prune: bool,
    /// Over several devices: the one ZeRO stage tried (None: every stage).
    stage: Option<u8>,
    /// Why the device cannot run a step graph, or `Ok`: a candidate it refuses is refused
    /// here, never chosen (None: it runs anything the compiler makes).
    runnable: Option<Runnable>,
}

/// A device's check of a compiled step graph: why it cannot run it, or `Ok`.
pub type Runnable = fn(&snug_graph::Graph) -> Result<(), String>;

impl<'a> Search<'a> {
    /// Candidates for `model` on `target` whose planned peak must fit `budget` bytes, one
    /// sequence per optimizer step until [`Search::effective_batch`] says otherwise.
    pub fn new(model: &'a FitModel, target: Target, budget: usize) -> Search<'a> {
        Search {
            model,
            target,
            budget,
            effective_batch: 1,
            max_micro_batch: None,
            devices: 1,
            link: None,
            prune: true,
            stage: None,
            runnable: None,
        }
    }

    /// Spreads the effective batch over `devices` data-parallel ranks: candidates plan one
    /// rank at each ZeRO stage, and the budget is per device.
    pub fn devices(mut self, devices: usize) -> Search<'a> {
        self.devices = devices;
        self
    }

    /// Over several devices, tries only ZeRO stage `stage` (a run's own: training and recovery
    /// keep the stage the user chose).
    pub fn stage(mut self, stage: u8) -> Search<'a> {
        self.stage = Some(stage);
        self
    }

    /// Refuses the candidates `check` says the device cannot run (a GPU backend's missing
    /// kernels), so none is chosen that would then fail to start.
    pub fn runnable(mut self, check: Runnable) -> Search<'a> {
        self.runnable = Some(check);
        self
    }

    /// Adds each candidate's communication time over a link of `gb_per_s` GB/s each way
    /// (nothing overlapped) to its prediction.
    pub fn link(mut self, gb_per_s: f64) -> Search<'a> {
        self.link = Some(gb_per_s);
        self
    }

    /// Sequences per optimizer step: every divisor is a micro-batch tried, accumulation makes
    /// up the rest.
    pub fn effective_batch(mut self, sequences: usize) -> Search<'a> {
        self.effective_batch = sequences;
        self
    }

    /// Tries no micro-batch larger than `sequences`.
    pub fn max_micro_batch(mut self, sequences: usize) -> Search<'a> {
        self.max_micro_batch = Some(sequences);
        self
    }

    /// The search for a configuration to carry on with from `current`: the same effective
    /// batch, micro-batches no larger than now (recovery never grows them). With equal
    /// predictions the search order decides: smaller micro-batch with more accumulation before
    /// more remat, before lower precision (where the model allows it).
    pub fn recovering_from(self, current: &FitConfig) -> Search<'a> {
        self.effective_batch(current.micro_batch * current.accumulation)
            .max_micro_batch(current.micro_batch)
    }

    /// The fastest configuration whose planned peak fits the budget; an error names the
    /// smallest peak reachable when nothing fits.
    pub fn choose(&self, machine: &MachineProfile) -> Result<FitReport, FitError> {
        let report = self.run(machine)?;
        match report.chosen {
            Some(_) => Ok(report),
            None => Err(report.nothing_fits()),
        }
    }

    /// The whole table, whether or not anything fits.
    pub fn run(&self, machine: &MachineProfile) -> Result<FitReport, FitError> {
        search(self, machine)
    }

    /// This search (target, budget, batch, devices, link, stage, device check) for `model`.
    pub(crate) fn with_model<'b>(&self, model: &'b FitModel) -> Search<'b> {
        Search {
            model,
            target: self.target,
            budget: self.budget,
            effective_batch: self.effective_batch,
            max_micro_batch: self.max_micro_batch,
            devices: self.devices,
            link: self.link,
            prune: self.prune,
            stage: self.stage,
            runnable: self.runnable,
        }
    }

    /// The model searched.
    pub fn model(&self) -> &'a FitModel {
        self.model
    }

    /// The budget every candidate must fit.
    pub fn budget(&self) -> usize {
        self.budget
    }
}

fn search(s: &Search<'_>, machine: &MachineProfile) -> Result<FitReport, FitError> {
    let start = Instant::now();
    if s.effective_batch == 0 {
        return Err(FitError::Invalid {
            field: "effective_batch",
            detail: "must be at least 1".into(),
        });
    }
    if s.devices == 0 || !s.effective_batch.is_multiple_of(s.devices) {
        return Err(FitError::Invalid {
            field: "devices",
            detail: format!(
                "{} devices do not divide the effective batch of {} sequences",
                s.devices, s.effective_batch
            ),
        });
    }
    if let Some(l) = s.link.filter(|l| !(l.is_finite() && *l > 0.0)) {
        return Err(FitError::Invalid {
            field: "link",
            detail: format!("{l}: a bandwidth in GB/s must be a positive number"),
        });
    }
    let stages: &[u8] = match &s.stage {
        Some(stage) => std::slice::from_ref(stage),
        None if s.devices > 1 => &[0, 1, 2, 3],
        None => &[0],
    };
    let fits = |c: &Candidate| c.peak_bytes.is_some_and(|p| p <= s.budget);
    let mut candidates = Vec::new();
    for &stage in stages {
        candidates.extend(space(s, s.model, stage, machine));
    }
    if !candidates.iter().any(fits) {
        for levers in ladder(&s.model.levers) {
            let with = FitModel {
                step: levers.apply(&s.model.step),
                levers: Levers::none(),
                ..s.model.clone()
            };
            let mut rung = Vec::new();
            for &stage in stages
                .iter()
                .filter(|&&st| levers.runs_sharded(s.devices, st))
            {
                rung.extend(space(s, &with, stage, machine));
            }
            for c in &mut rung {
                c.config.levers = levers.clone();
            }
            let any_fits = rung.iter().any(fits);
            candidates.extend(rung);
            if any_fits {
                break;
            }
        }
    }
    let budget = s.budget;
    let chosen = decide(&mut candidates, budget);
    Ok(FitReport {
        budget,
        effective_batch: s.effective_batch,
        devices: s.devices,
        link_gb_per_s: s.link,
        block: s.model.block,
        calibrated: machine.is_measured(),
        machine_speed: machine.speed,
        candidates,
        chosen,
        search_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Chooses the fastest candidate that fits `budget` and gives every other its verdict;
/// returns the chosen one's index.
fn decide(candidates: &mut [Candidate], budget: usize) -> Option<usize> {
    let fastest = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match (c.peak_bytes, c.predicted_seconds) {
            (Some(p), Some(t)) if p <= budget => Some((i, t)),
            _ => None,
        })
        // Ties (equal predictions) go to the earlier candidate: larger micro-batch, less remat,
        // lower stage.
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    for (i, c) in candidates.iter_mut().enumerate() {
        if matches!(
            c.verdict,
            Verdict::Failed { .. } | Verdict::OverLowerBound { .. }
        ) {
            continue;
        }
        c.verdict = match (fastest, c.peak_bytes, c.predicted_seconds) {
            (Some((f, _)), _, _) if f == i => Verdict::Chosen,
            (_, Some(p), _) if p > budget => Verdict::OverBudget,
            (Some((_, best)), _, Some(t)) => Verdict::Slower { ratio: t / best },
            _ => Verdict::OverBudget,
        };
    }
    fastest.map(|(i, _)| i)
}

/// The divisors of `n`, largest first, found in √n steps: a scan of 1..=n took minutes at
/// `--batch 1000000000000`, before any candidate was planned (and refused).
fn divisors_descending(n: usize) -> Vec<usize> {
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let mut i = 1;
    while i <= n / i {
        if n.is_multiple_of(i) {
            small.push(i);
            if i != n / i {
                large.push(n / i);
            }
        }
        i += 1;
    }
    large.into_iter().chain(small.into_iter().rev()).collect()
}

/// Every candidate of `model`'s space at ZeRO stage `shard` (0 on one device), evaluated, in
/// search order; verdicts are the caller's.
fn space(s: &Search<'_>, model: &FitModel, shard: u8, machine: &MachineProfile) -> Vec<Candidate> {
    let Search {
        target,
        budget,
        effective_batch,
        max_micro_batch,
        devices,
        link,
        ..
    } = *s;
    let per_rank = effective_batch / devices;
    let micro_batches: Vec<usize> = divisors_descending(per_rank)
        .into_iter()
        // Fused updates take the whole batch in one micro-batch: accumulation frees nothing.
        .filter(|&m| !model.step.fused_update || m == per_rank)
        .filter(|&m| max_micro_batch.is_none_or(|max| m <= max))
        .collect();
    let config = |micro_batch: usize, passes: &Vec<Pass>, remat: Remat| FitConfig {
        micro_batch,
        accumulation: per_rank / micro_batch,
        remat,
        passes: passes.clone(),
        precision: model.step.precision,
        levers: Levers::none(),
        shard,
    };
    let low = model
        .low_precision
        .filter(|l| model.step.precision == DType::F32 && *l != DType::F32);
    // One compile bounds the whole space; where even that is over the budget, the space is
    // still walked (every candidate listed, refused by the bound) but nothing is planned. A
    // bound that does not compile prunes nothing: the candidates then say why they fail.
    let refused_by = s
        .prune
        .then(|| {
            let sharding = Sharding::new(devices, shard).ok()?;
            state_floor(&model.model, model.block, &model.step, target, &sharding).ok()
        })
        .flatten()
        .filter(|&floor| floor > budget);
    let evaluate = |c: FitConfig| match refused_by {
        Some(floor) => Candidate::over_lower_bound(c, floor),
        None => evaluate(model, c, target, machine, (devices, link), s.runnable),
    };
    // No recomputation first; remat only where that does not fit.
    let largest = micro_batches.first().copied().unwrap_or(1);
    let mut pass_sets = vec![model.step.passes.clone()];
    let mut candidates = Vec::new();
    if !model.step.passes.contains(&Pass::FusedCrossEntropy) {
        let mut with = vec![Pass::FusedCrossEntropy];
        with.extend(model.step.passes.iter().copied());
        // Worth searching only where the logits matter (a large vocabulary): judged once, at
        // the largest micro-batch, whose two candidates then stay in the table.
        let (plain, fused) = rayon::join(
            || evaluate(config(largest, &pass_sets[0], Remat::None)),
            || evaluate(config(largest, &with, Remat::None)),
        );
        // Kept too where the plain step failed (a device that cannot run it) and this did not.
        let keep = match (fused.peak_bytes, plain.peak_bytes) {
            (Some(f), Some(p)) => f < p,
            (Some(_), None) => true,
            (None, _) => false,
        };
        candidates.push(plain);
        if keep {
            candidates.push(fused);
            pass_sets.push(with);
        }
    }
    let done = candidates.len();
    let plain: Vec<FitConfig> = micro_batches
        .iter()
        .flat_map(|&m| pass_sets.iter().map(move |p| (m, p)))
        .map(|(m, p)| config(m, p, Remat::None))
        .skip(done)
        .collect();
    candidates.extend(plain.into_par_iter().map(evaluate).collect::<Vec<_>>());
    let over = |c: &Candidate| c.least_bytes().is_some_and(|p| p > budget);
    // Lower precision only where f32 needs more than it is: recomputation or smaller
    // micro-batches then compete with it on time.
    if let Some(low) = low {
        let twins: Vec<FitConfig> = candidates
            .iter()
            .filter(|c| over(c))
            .map(|c| FitConfig {
                precision: low,
                ..c.config.clone()
            })
            .collect();
        candidates.extend(twins.into_par_iter().map(evaluate).collect::<Vec<_>>());
    }
    let with_remat = |c: &Candidate, r: Remat| FitConfig {
        remat: r,
        ..c.config.clone()
    };
    let fixed_remat = |c: &Candidate| {
        [
            Remat::Selective,
            Remat::Blocks { blocks: 2 },
            Remat::Blocks { blocks: 1 },
        ]
        .map(|r| with_remat(c, r))
    };
    let user_precision = |c: &Candidate| c.config.precision == model.step.precision;
    let fixed: Vec<FitConfig> = candidates
        .iter()
        .filter(|c| over(c) && user_precision(c))
        .flat_map(fixed_remat)
        .collect();
    candidates.extend(fixed.into_par_iter().map(evaluate).collect::<Vec<_>>());
    // The budgeted choice, the costliest to compile, only where selective remat (its cheapest
    // fixed competitor) does not fit: where it does, the budget search ends at it anyway.
    let budgeted: Vec<FitConfig> = candidates
        .iter()
        .filter(|c| c.config.remat == Remat::Selective && over(c))
        .map(|c| with_remat(c, Remat::Budget { bytes: budget }))
        .collect();
    candidates.extend(budgeted.into_par_iter().map(evaluate).collect::<Vec<_>>());
    // Remat in the lower precision, the last resort, only where nothing else fits: it reaches
    // the smallest peaks.
    let fits = |c: &Candidate| c.peak_bytes.is_some_and(|p| p <= budget);
    if !candidates.iter().any(fits) {
        let last: Vec<FitConfig> = candidates
            .iter()
            .filter(|c| c.config.remat == Remat::None && over(c) && !user_precision(c))
            .flat_map(fixed_remat)
            .collect();
        candidates.extend(last.into_par_iter().map(evaluate).collect::<Vec<_>>());
    }
    drop_remat_that_does_not_lower(&mut candidates);
    candidates
}

/// Each row made what `plan` and `train` run with its flags: they compile a fixed remat mode
/// (`selective`, `block`, `block:K`) only where it lowers the peak of the same step without
/// remat, and run that step otherwise (`snug_compile::compile_step`, the same comparison:
/// both compiled exactly, planned with the default options). The search compiles each mode
/// exactly, and every such candidate is made from its plain twin in the same space, planned
/// already, so the comparison costs nothing here: where the mode does not lower the twin's
/// peak, the row takes the twin's peak and timing, and says what was dropped. Listed at the
/// mode's own peak, such a row was a configuration no command runs (over budget, so never
/// chosen, but shown as what those flags would hold).
///
/// A twin that was not planned (failed, or refused by the device) leaves the row as it is:
/// what `plan` would do then cannot be told from the table.
fn drop_remat_that_does_not_lower(candidates: &mut [Candidate]) {
    let fixed = |r: Remat| matches!(r, Remat::Selective | Remat::Blocks { .. });
    for i in 0..candidates.len() {
        let c = &candidates[i];
        let (Some(with), Some(_)) = (c.peak_bytes, &c.timing) else {
            continue;
        };
        if !fixed(c.config.remat) || c.remat_dropped.is_some() {
            continue;
        }
        let plain = FitConfig {
            remat: Remat::None,
            ..c.config.clone()
        };
        let Some(twin) = candidates.iter().find(|t| t.config == plain) else {
            continue;
        };
        let (Some(without), Some(timing)) = (twin.peak_bytes, twin.timing.clone()) else {
            continue;
        };
        if with < without {
            continue;
        }
        let predicted = twin.predicted_seconds;
        let c = &mut candidates[i];
        c.remat_dropped = Some(RematDropped {
            remat: c.config.remat,
            peak_without_bytes: without,
            peak_with_bytes: with,
        });
        c.peak_bytes = Some(without);
        c.predicted_seconds = predicted;
        c.timing = Some(timing);
    }
}

fn evaluate(
    model: &FitModel,
    config: FitConfig,
    target: Target,
    machine: &MachineProfile,
    (devices, link): (usize, Option<f64>),
    runnable: Option<Runnable>,
) -> Candidate {
    let step_config = config.apply(&model.step);
    let shape = StepShape {
        micro_batch: config.micro_batch,
        block: model.block,
    };
    // Compiled exactly (each remat mode as given): where a fixed mode does not lower the peak,
    // `drop_remat_that_does_not_lower` makes the row what `plan` and `train` run instead.
    let result = Sharding::new(devices, config.shard)
        .map_err(|e| FitError::Compile(e.into()))
        .and_then(|sharding| {
            Ok(compile_exactly_sharded(
                &model.model,
                shape,
                target,
                &step_config,
                &sharding,
            )?)
        })
        .and_then(|mut c| {
            if let Some(check) = runnable {
                check(&c.step.graph).map_err(FitError::Unrunnable)?;
            }
            let p = c.take_plan()?;
            let comm_seconds = link.map_or(0.0, |l| {
                snug_graph::zero::comm_per_rank(&c.step.graph, c.step.micro_steps).seconds(l)
            });
            let timing = Timing {
                work: Arc::new(StepWork::of(&c.step, &p.schedule)),
                comm_seconds,
            };
            Ok((p.peak_bytes(), timing))
        });
    match result {
        Ok((peak, timing)) => Candidate {
            config,
            peak_bytes: Some(peak),
            predicted_seconds: Some(timing.seconds(machine)),
            verdict: Verdict::OverBudget,
            remat_dropped: None,
            timing: Some(timing),
        },
        // A budget no remat reaches is a plain "does not fit", with the smallest peak.
        Err(FitError::Compile(CompileError::RematBudget { smallest, .. })) => Candidate {
            config,
            peak_bytes: Some(smallest),
            predicted_seconds: None,
            verdict: Verdict::OverBudget,
            remat_dropped: None,
            timing: None,
        },
        Err(e) => Candidate {
            config,
            peak_bytes: None,
            predicted_seconds: None,
            verdict: Verdict::Failed {
                reason: e.to_string(),
            },
            remat_dropped: None,
            timing: None,
        },
    }
}

/// What failed: the allocator's limit and the request it refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryFailure {
    /// The limit that refused (`usize::MAX` when the system itself refused, under the limit;
    /// `null` in JSON).
    #[serde(serialize_with = "limit_or_null")]
    pub limit: usize,
    pub requested: usize,
    pub active: usize,
}

fn limit_or_null<S: serde::Serializer>(limit: &usize, s: S) -> Result<S::Ok, S::Error> {
    match *limit {
        usize::MAX => s.serialize_none(),
        l => s.serialize_u64(l as u64),
    }
}

impl MemoryFailure {
    /// What refused the memory, for a message: `under a limit of 2.00 GiB`, or the system.
    pub fn cause(&self) -> String {
        match self.limit {
            usize::MAX => "refused by the system".to_string(),
            l => format!(
                "under a limit of {}",
                snug_plan::memory_plan::human_bytes(l)
            ),
        }
    }

    /// The budget a configuration must meet to carry on after this failure of a plan peaking
    /// at `current_peak`: under the limit, or, when the system refused, under the current
    /// peak.
    pub fn budget(&self, current_peak: usize) -> usize {
        self.limit.min(current_peak.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::floor::state_floor;
    use crate::levers::Levers;

    #[test]
    fn divisors_come_largest_first_and_miss_none() {
        assert_eq!(divisors_descending(12), [12, 6, 4, 3, 2, 1]);
        assert_eq!(divisors_descending(36), [36, 18, 12, 9, 6, 4, 3, 2, 1]);
        assert_eq!(divisors_descending(1), [1]);
        assert!(divisors_descending(0).is_empty());
        for n in 1..300usize {
            let scan: Vec<usize> = (1..=n).rev().filter(|m| n % m == 0).collect();
            assert_eq!(divisors_descending(n), scan, "{n}");
        }
        // 2^12 · 5^12: 13 · 13 divisors, found without a scan to 10^12.
        let d = divisors_descending(1_000_000_000_000);
        assert_eq!(d.len(), 169);
        assert!(d.windows(2).all(|w| w[0] > w[1]));
        assert!(d.iter().all(|m| 1_000_000_000_000 % m == 0));
    }

    /// char-small over 64 characters, free to take bf16 and every lever.
    fn every_lever_allowed() -> FitModel {
        let mut m = ModelConfig::preset("char-small").unwrap();
        m.set_vocab_size(65);
        FitModel::new(m, 64, StepConfig::default())
            .allowing(Some(DType::BF16))
            .allowing_levers(Levers::all())
    }

    /// Refusing a space by its state changes nothing but what is planned: over budgets from
    /// under every space's parameters and optimizer state to roomy, with every lever and bf16
    /// allowed, on one device and on each ZeRO stage of two, the search with pruning chooses
    /// what the search without it chooses, with the same peak and prediction; every candidate
    /// it planned is the other's, verdict and all; no candidate that fits is refused; and a
    /// refused one is over the budget there too, by at least its bound.
    #[test]
    fn pruning_by_the_state_floor_changes_only_what_is_planned() {
        let fit = every_lever_allowed();
        let target = Target::host(1);
        let machine = MachineProfile::nominal(1);
        // A budget under and one over each space's state, plus one under all and a roomy one.
        let mut floors: Vec<usize> = std::iter::once(Levers::none())
            .chain(ladder(&Levers::all()))
            .map(|l| {
                state_floor(
                    &fit.model,
                    fit.block,
                    &l.apply(&fit.step),
                    target,
                    &Sharding::SINGLE,
                )
                .unwrap()
            })
            .collect();
        floors.sort();
        let mut budgets: Vec<usize> = floors.iter().flat_map(|&f| [f - 1, f + f / 4]).collect();
        budgets.extend([1 << 20, 1 << 40]);
        let (mut pruned_some, mut chose_past_a_pruned_space) = (false, false);
        for devices in [1, 2] {
            for &budget in &budgets {
                let search = Search::new(&fit, target, budget)
                    .effective_batch(4)
                    .devices(devices);
                let pruned = search.run(&machine).unwrap();
                let full = Search {
                    prune: false,
                    ..search
                }
                .run(&machine)
                .unwrap();
                let what = format!("{devices} devices, budget {budget}");
                let key = |c: &Candidate| {
                    c.peak_bytes
                        .zip(c.predicted_seconds)
                        .map(|(p, t)| (c.config.clone(), p, t.to_bits()))
                };
                assert_eq!(
                    pruned.chosen().and_then(key),
                    full.chosen().and_then(key),
                    "{what}"
                );
                let in_full = |c: &Candidate| full.candidates.iter().find(|f| f.config == c.config);
                for c in &pruned.candidates {
                    match c.verdict {
                        Verdict::OverLowerBound { lower_bound_bytes } => {
                            pruned_some = true;
                            assert!(lower_bound_bytes > budget, "{what}: {c:?}");
                            if let Some(f) = in_full(c) {
                                assert!(
                                    f.peak_bytes.is_none_or(|p| p >= lower_bound_bytes),
                                    "{what}: {c:?} planned as {f:?}"
                                );
                            }
                        }
                        _ => assert_eq!(Some(c), in_full(c), "{what}"),
                    }
                }
                for f in full
                    .candidates
                    .iter()
                    .filter(|f| f.peak_bytes.is_some_and(|p| p <= budget))
                {
                    let c = pruned.candidates.iter().find(|c| c.config == f.config);
                    assert_eq!(c, Some(f), "{what}: a candidate that fits");
                }
                let refused = pruned
                    .candidates
                    .iter()
                    .any(|c| matches!(c.verdict, Verdict::OverLowerBound { .. }));
                chose_past_a_pruned_space |= refused && pruned.chosen.is_some();
                if pruned.chosen.is_none() {
                    let (
                        FitError::NothingFits {
                            smallest: p,
                            planned,
                            ..
                        },
                        FitError::NothingFits { smallest: f, .. },
                    ) = (pruned.nothing_fits(), full.nothing_fits())
                    else {
                        panic!("{what}: both name what nothing fits");
                    };
                    // A planned smallest is the full search's; a bound is under it.
                    assert!(if planned { p == f } else { p <= f }, "{what}: {p} vs {f}");
                }
            }
        }
        assert!(pruned_some && chose_past_a_pruned_space);
    }

    /// A report timed by another machine is that machine's search, to the bit: the same
    /// candidates with the same peaks, predictions and verdicts, and the same choice, on one
    /// device and over two with a link, at budgets from under every plan to roomy.
    #[test]
    fn a_report_timed_by_another_machine_is_that_machines_search() {
        let fit = every_lever_allowed();
        let target = Target::host(1);
        let nominal = MachineProfile::nominal(1);
        // GEMMs far slower and copies far faster than the nominal figures.
        let sample = |class: &str, work: f64, seconds: f64| crate::Sample {
            class: class.into(),
            family: String::new(),
            work,
            seconds,
        };
        let other = MachineProfile::new(
            1,
            "other".into(),
            2e9,
            200e9,
            1e-5,
            vec![sample("matmul", 1e8, 0.05), sample("matmul", 1e9, 0.4)],
        );
        let state =
            state_floor(&fit.model, fit.block, &fit.step, target, &Sharding::SINGLE).unwrap();
        let mut peaks: Vec<usize> = Search::new(&fit, target, state + 1)
            .effective_batch(4)
            .run(&nominal)
            .unwrap()
            .candidates
            .iter()
            .filter_map(|c| c.peak_bytes)
            .collect();
        peaks.sort();
        let budgets = [
            state + 1,
            peaks[peaks.len() / 4],
            peaks[peaks.len() / 2],
            1 << 40,
        ];
        let mut retimed = 0;
        for (devices, link) in [(1, None), (2, Some(10.0))] {
            for budget in budgets {
                let mut search = Search::new(&fit, target, budget)
                    .effective_batch(4)
                    .devices(devices);
                if let Some(l) = link {
                    search = search.link(l);
                }
                let first = search.run(&nominal).unwrap();
                let direct = search.run(&other).unwrap();
                let timed = first.timed_by(&other);
                let what = format!("{devices} devices, budget {budget}");
                assert_eq!(timed.candidates, direct.candidates, "{what}");
                assert_eq!(timed.chosen, direct.chosen, "{what}");
                assert_eq!(
                    (timed.calibrated, timed.machine_speed),
                    (direct.calibrated, direct.machine_speed)
                );
                retimed += first
                    .candidates
                    .iter()
                    .zip(&timed.candidates)
                    .filter(|(a, b)| {
                        a.predicted_seconds.is_some() && a.predicted_seconds != b.predicted_seconds
                    })
                    .count();
            }
        }
        assert!(retimed > 0, "the other machine predicts other times");
    }
}
