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

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use snug_compile::{compile_exactly_sharded, CompileError, Pass, Remat, StepConfig, StepShape};
use snug_graph::{DType, Sharding, Target};
use snug_nn::ModelConfig;
use snug_plan::{plan, PlanOptions};

use crate::cost_model::MachineProfile;
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

    /// The error a caller reports when nothing fits: the smallest peak any candidate reached.
    pub fn nothing_fits(&self) -> FitError {
        let smallest = self
            .candidates
            .iter()
            .filter_map(|c| Some((c.peak_bytes?, c)))
            .min_by_key(|(p, _)| *p);
        FitError::NothingFits {
            budget: self.budget,
            smallest: smallest.map_or(0, |(p, _)| p),
            config: smallest.map_or_else(|| "none compiled".into(), |(_, c)| c.config.to_string()),
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
}

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
        }
    }

    /// Spreads the effective batch over `devices` data-parallel ranks: candidates plan one
    /// rank at each ZeRO stage, and the budget is per device.
    pub fn devices(mut self, devices: usize) -> Search<'a> {
        self.devices = devices;
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
    let stages: &[u8] = if s.devices > 1 { &[0, 1, 2, 3] } else { &[0] };
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
    let chosen = fastest.map(|(i, _)| i);
    for (i, c) in candidates.iter_mut().enumerate() {
        if matches!(c.verdict, Verdict::Failed { .. }) {
            continue;
        }
        c.verdict = match (fastest, c.peak_bytes, c.predicted_seconds) {
            (Some((f, _)), _, _) if f == i => Verdict::Chosen,
            (_, Some(p), _) if p > budget => Verdict::OverBudget,
            (Some((_, best)), _, Some(t)) => Verdict::Slower { ratio: t / best },
            _ => Verdict::OverBudget,
        };
    }
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
    let evaluate = |c: FitConfig| evaluate(model, c, target, machine, devices, link);
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
        let keep = matches!((fused.peak_bytes, plain.peak_bytes), (Some(f), Some(p)) if f < p);
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
    let over = |c: &Candidate| c.peak_bytes.is_some_and(|p| p > budget);
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
    candidates
}

fn evaluate(
    model: &FitModel,
    config: FitConfig,
    target: Target,
    machine: &MachineProfile,
    devices: usize,
    link: Option<f64>,
) -> Candidate {
    let step_config = config.apply(&model.step);
    let shape = StepShape {
        micro_batch: config.micro_batch,
        block: model.block,
    };
    // Each candidate is exactly what it says: a remat mode that raises the peak loses to its
    // plain twin on both peak and time, so the search never chooses it.
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
        .and_then(|c| {
            let p = match c.plan {
                Some(p) => p,
                None => plan(&c.step.graph, &PlanOptions::default())?,
            };
            let comm = link.map_or(0.0, |l| {
                snug_graph::zero::comm_per_rank(&c.step.graph, c.step.micro_steps).seconds(l)
            });
            Ok((
                p.peak_bytes(),
                machine.step_seconds(&c.step, &p.schedule) + comm,
            ))
        });
    match result {
        Ok((peak, seconds)) => Candidate {
            config,
            peak_bytes: Some(peak),
            predicted_seconds: Some(seconds),
            verdict: Verdict::OverBudget,
        },
        // A budget no remat reaches is a plain "does not fit", with the smallest peak.
        Err(FitError::Compile(CompileError::RematBudget { smallest, .. })) => Candidate {
            config,
            peak_bytes: Some(smallest),
            predicted_seconds: None,
            verdict: Verdict::OverBudget,
        },
        Err(e) => Candidate {
            config,
            peak_bytes: None,
            predicted_seconds: None,
            verdict: Verdict::Failed {
                reason: e.to_string(),
            },
        },
    }
}

/// What failed: the allocator's limit and the request it refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryFailure {
    /// The limit in force (`usize::MAX` when the system itself refused).
    pub limit: usize,
    pub requested: usize,
    pub active: usize,
}

impl MemoryFailure {
    /// The budget a configuration must meet to carry on after this failure of a plan peaking
    /// at `current_peak`: under the limit, or, when the system refused with no limit set,
    /// under the current peak.
    pub fn budget(&self, current_peak: usize) -> usize {
        self.limit.min(current_peak.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::divisors_descending;

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
}
