//! Measuring this machine for fit's cost model: every kernel class the model builders emit is
//! timed on one-layer probe models at the shapes snug's presets use (a GPT at width 384 and
//! 768, sequence 256 and 1024, vocabulary 65 and 50,257, the fused and the plain LM head, and
//! a Llama block), plus a memory-bandwidth probe. The result is cached as JSON under the user's
//! cache directory (`$SNUG_CACHE_DIR`, else e.g. `~/.cache/snug`), one file per thread count.
//! Predictions are only as steady as the machine: on a shared host, other load moves kernel
//! times by tens of percent in spells of minutes. So a calibration keeps the rate of one fixed
//! GEMM (the drift probe) beside its samples, and a cached profile is used rescaled by that
//! probe's rate now over its rate then ([`cached_now`]); `--recalibrate` measures everything
//! again.

use std::path::PathBuf;
use std::time::Instant;

use snug_compile::{compile_step, CompiledStep, Pass, StepConfig, StepShape};
use snug_cpu::CpuSession;
use snug_fit::{node_work, MachineProfile, Sample, PROFILE_VERSION};
use snug_graph::ops::MatMul;
use snug_graph::{DType, Graph, Role, Target};
use snug_nn::ModelConfig;
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

use crate::TrainError;

/// The cache file for `threads` worker threads.
pub fn cache_path(threads: usize) -> Option<PathBuf> {
    let dir = match std::env::var_os("SNUG_CACHE_DIR") {
        Some(d) => PathBuf::from(d),
        None => dirs::cache_dir()?.join("snug"),
    };
    Some(dir.join(format!("machine-{threads}t.json")))
}

/// This machine's CPU model, as the OS names it.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// The cached profile for `threads`, if one was measured by this version on this CPU.
pub fn cached(threads: usize) -> Option<MachineProfile> {
    load_profile(&cache_path(threads)?, threads)
}

/// Why a cache file's profile is not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// No file, or one from another version of snug or another CPU: measured again, as
    /// expected after an upgrade or a move.
    Stale,
    /// A file that cannot be trusted (unreadable, not a profile, or figures no machine has):
    /// the field and what is wrong with it.
    Invalid(snug_fit::ProfileError),
}

/// The profile in `path` if it is readable, from this version of snug, for `threads` threads
/// on this CPU; anything else means "measure again". A file that is there but invalid is
/// named in a warning with its field (fit then measures again and replaces it).
pub fn load_profile(path: &std::path::Path, threads: usize) -> Option<MachineProfile> {
    match read_profile(path, threads) {
        Ok(p) => Some(p),
        Err(Unusable::Stale) => None,
        Err(Unusable::Invalid(e)) => {
            tracing::warn!(
                "the calibration cache {} is ignored: {e}; a calibration (`snug fit`, or \
                 `snug fit --recalibrate`) measures this machine again and replaces it",
                path.display()
            );
            None
        }
    }
}

/// [`load_profile`]'s verdict on `path`, with why it is not used.
pub fn read_profile(path: &std::path::Path, threads: usize) -> Result<MachineProfile, Unusable> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Unusable::Stale),
        Err(e) => {
            return Err(Unusable::Invalid(snug_fit::ProfileError {
                field: "(file)".into(),
                detail: format!("cannot be read: {e}"),
            }))
        }
    };
    // Another version's samples may mean something else, and may not even parse as this
    // one's: the version is read first, from the bare JSON.
    let version = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("version")?.as_u64());
    if version.is_some_and(|v| v != u64::from(PROFILE_VERSION)) {
        return Err(Unusable::Stale);
    }
    let p = MachineProfile::from_json(&text).map_err(Unusable::Invalid)?;
    if p.cpu != cpu_name() {
        return Err(Unusable::Stale);
    }
    // The file is named for its thread count: another count inside is not a measurement of
    // this file's.
    if p.threads != threads {
        return Err(Unusable::Invalid(snug_fit::ProfileError {
            field: "threads".into(),
            detail: format!("is {}, in the cache file for {threads} threads", p.threads),
        }));
    }
    Ok(p)
}

/// Where a machine profile came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Calibration {
    /// The cache, rescaled by a drift probe now.
    Cached,
    /// The cache as it is: the drift probe alone would hold more than the budget.
    CachedUnscaled,
    /// Measured now (and cached).
    Measured,
    /// Nominal figures: measuring would hold `needs_bytes`, more than the budget.
    Nominal { needs_bytes: usize },
}

/// The cached profile, or a fresh measurement (saved to the cache) when there is none or
/// `recalibrate` is set. With a `budget`, nothing is measured that would hold more than it:
/// the calibration's own planned peak is checked first, and nominal figures stand in.
pub fn machine_profile(
    threads: usize,
    recalibrate: bool,
    budget: Option<usize>,
) -> Result<(MachineProfile, Calibration), TrainError> {
    let within = |bytes: usize| budget.is_none_or(|b| bytes <= b);
    if !recalibrate {
        if within(drift_probe_bytes()) {
            if let Some(p) = cached_now(threads)? {
                return Ok((p, Calibration::Cached));
            }
        } else if let Some(p) = cached(threads) {
            return Ok((p, Calibration::CachedUnscaled));
        }
    }
    let needs_bytes = calibration_peak_bytes(threads)?;
    if !within(needs_bytes) {
        return Ok((
            MachineProfile::nominal(threads),
            Calibration::Nominal { needs_bytes },
        ));
    }
    tracing::info!(
        "calibrating this machine's kernels for {threads} thread(s): once, about a minute, holding up to {} (cached at {})",
        snug_plan::memory_plan::human_bytes(needs_bytes),
        cache_path(threads).map_or_else(|| "-".into(), |p| p.display().to_string())
    );
    let p = calibrate_with(threads, |done, total| {
        tracing::info!("calibration: {done} of {total} probe models timed")
    })?;
    if let Some(path) = cache_path(threads) {
        save_profile(&path, &p)?;
    }
    Ok((p, Calibration::Measured))
}

/// Bytes the drift probe's GEMM holds (its three f32 operands).
fn drift_probe_bytes() -> usize {
    let (m, k, n) = DRIFT_PROBE;
    (m * k + k * n + m * n) * 4
}

/// The most memory a calibration holds at once, planned without running anything: the
/// largest probe model's planned peak, the drift probe, or the bandwidth probe's buffers.
pub fn calibration_peak_bytes(threads: usize) -> Result<usize, TrainError> {
    let mut most = drift_probe_bytes().max(BANDWIDTH_BYTES * 2);
    for probe in PROBES {
        let (_, compiled, memory_plan) = probe_step(probe, threads)?;
        drop(compiled);
        most = most.max(memory_plan.peak_bytes());
    }
    Ok(most)
}

/// Writes `p` to `path` atomically (creating the directory).
pub fn save_profile(path: &std::path::Path, p: &MachineProfile) -> Result<(), TrainError> {
    let io = |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    // Written aside and renamed, so a reader never sees half a file.
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, p.to_json()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

struct Probe {
    preset: &'static str,
    layers: usize,
    heads: usize,
    width: usize,
    block: usize,
    vocab: usize,
    /// Sequences per micro-batch.
    batch: usize,
    accumulation: usize,
    fused: bool,
    /// Activation precision: bf16 probes measure the casts mixed precision adds.
    bf16: bool,
    runs: usize,
}

#[rustfmt::skip]
const PROBES: &[Probe] = &[
    // char-small's shapes, at two batch sizes, one with accumulation.
    Probe { preset: "gpt2", layers: 1, heads: 6, width: 384, block: 256, vocab: 65, batch: 4, accumulation: 2, fused: false, bf16: false, runs: 3 },
    Probe { preset: "gpt2", layers: 1, heads: 6, width: 384, block: 256, vocab: 65, batch: 16, accumulation: 1, fused: false, bf16: false, runs: 3 },
    Probe { preset: "gpt2", layers: 1, heads: 6, width: 384, block: 256, vocab: 65, batch: 8, accumulation: 1, fused: true, bf16: false, runs: 3 },
    // GPT-2 small's shapes, with the fused and the plain LM head; the block's kernels also at
    // 4 × 1024 tokens (a small head keeps that probe cheap): tensors that outgrow the caches
    // run slower per byte than a line through small sizes says.
    Probe { preset: "gpt2", layers: 1, heads: 12, width: 768, block: 1024, vocab: 50257, batch: 1, accumulation: 1, fused: true, bf16: false, runs: 2 },
    Probe { preset: "gpt2", layers: 1, heads: 12, width: 768, block: 1024, vocab: 50257, batch: 2, accumulation: 1, fused: false, bf16: false, runs: 2 },
    Probe { preset: "gpt2", layers: 1, heads: 12, width: 768, block: 1024, vocab: 65, batch: 4, accumulation: 1, fused: false, bf16: false, runs: 2 },
    // Mixed precision's casts, at both widths; at GPT-2's, also on 4 × 1024 tokens.
    Probe { preset: "gpt2", layers: 1, heads: 6, width: 384, block: 256, vocab: 65, batch: 8, accumulation: 1, fused: false, bf16: true, runs: 3 },
    Probe { preset: "gpt2", layers: 1, heads: 12, width: 768, block: 1024, vocab: 50257, batch: 1, accumulation: 1, fused: true, bf16: true, runs: 2 },
    Probe { preset: "gpt2", layers: 1, heads: 12, width: 768, block: 1024, vocab: 65, batch: 4, accumulation: 1, fused: false, bf16: true, runs: 2 },
    // The Llama block's kernels (RMSNorm, RoPE, SwiGLU, grouped-query attention).
    Probe { preset: "llama-tiny", layers: 1, heads: 0, width: 0, block: 256, vocab: 512, batch: 8, accumulation: 1, fused: false, bf16: false, runs: 3 },
];

/// The GEMM the drift probe times (char-small's MLP up-projection), and how many runs it
/// takes the best of: a fraction of a second, enough to ride out one descheduled run.
const DRIFT_PROBE: (usize, usize, usize) = (4096, 384, 1536);
const DRIFT_RUNS: usize = 8;

/// How many times as fast as at `p`'s calibration this machine runs now, by the drift probe
/// (1 when `p` has no probe rate).
pub fn speed_now(p: &MachineProfile, threads: usize) -> Result<f64, TrainError> {
    if p.probe_flops <= 0.0 {
        return Ok(1.0);
    }
    Ok(gemm_rate(threads, DRIFT_PROBE, DRIFT_RUNS)? / p.probe_flops)
}

/// The cached profile rescaled to this machine's speed now (the drift probe): what `fit`,
/// `plan` and `profile` predict with. Not for the middle of an out-of-memory recovery: the
/// probe allocates.
pub fn cached_now(threads: usize) -> Result<Option<MachineProfile>, TrainError> {
    match cached(threads) {
        Some(p) => Ok(Some(p.rescaled(speed_now(&p, threads)?))),
        None => Ok(None),
    }
}

/// Follows this machine's speed through a run, for `snug train --track-speed`: the drift
/// probe runs before the first step and after every step, so each step's prediction is the
/// cost model's at the mean of the speeds measured just before and just after it. On a shared
/// host whose speed moves in spells, that tells a slow step of the machine from a slow
/// configuration; the probes run between steps and are not in the steps' times.
pub struct SpeedTracker {
    profile: MachineProfile,
    /// The step's predicted seconds at the calibration's speed.
    base_seconds: f64,
    threads: usize,
    /// Speed (times the calibration's) measured before the next step.
    before: f64,
}

/// One step's prediction at the machine's speed around it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepSpeed {
    pub step: u64,
    /// Mean of the drift probe's speed before and after the step, times the calibration's.
    pub speed: f64,
    pub predicted_step_ms: f64,
    pub measured_step_ms: f64,
    /// `(measured − predicted) / predicted`.
    pub error: f64,
}

impl SpeedTracker {
    /// Starts tracking a step the uncorrected `profile` predicts at `base_seconds`: times the
    /// drift probe once.
    pub fn start(
        profile: MachineProfile,
        base_seconds: f64,
        threads: usize,
    ) -> Result<SpeedTracker, TrainError> {
        let before = speed_now(&profile, threads)?;
        Ok(SpeedTracker::with_speed(
            profile,
            base_seconds,
            threads,
            before,
        ))
    }

    fn with_speed(
        profile: MachineProfile,
        base_seconds: f64,
        threads: usize,
        before: f64,
    ) -> SpeedTracker {
        SpeedTracker {
            profile,
            base_seconds,
            threads,
            before,
        }
    }

    /// Times the drift probe after step `step`, which took `measured_ms`.
    pub fn after_step(&mut self, step: u64, measured_ms: f64) -> Result<StepSpeed, TrainError> {
        let after = speed_now(&self.profile, self.threads)?;
        Ok(self.record(step, measured_ms, after))
    }

    fn record(&mut self, step: u64, measured_ms: f64, after: f64) -> StepSpeed {
        let speed = (self.before + after) / 2.0;
        self.before = after;
        let predicted_step_ms = self.base_seconds * 1e3 / speed.max(1e-9);
        StepSpeed {
            step,
            speed,
            predicted_step_ms,
            measured_step_ms: measured_ms,
            error: (measured_ms - predicted_step_ms) / predicted_step_ms,
        }
    }
}

/// Times every probe (one warm-up run, then `runs` timed ones, every node separately) and the
/// memory bandwidth. The drift probe runs before the first probe model and after each one, and
/// each model's samples are brought to one reference speed, the median of those rates: a spell
/// of slowness during one model would otherwise stay in its kernels' times for good. The
/// reference is what later drift probes are compared with.
pub fn calibrate(threads: usize) -> Result<MachineProfile, TrainError> {
    calibrate_with(threads, |_, _| {})
}

/// [`calibrate`], calling `progress(done, total)` after each probe model.
pub fn calibrate_with(
    threads: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<MachineProfile, TrainError> {
    let mut rates = vec![gemm_rate(threads, DRIFT_PROBE, DRIFT_RUNS)?];
    let mut measured = Vec::new();
    for (i, probe) in PROBES.iter().enumerate() {
        let samples = run_probe(probe, threads)?;
        rates.push(gemm_rate(threads, DRIFT_PROBE, DRIFT_RUNS)?);
        measured.push(samples);
        progress(i + 1, PROBES.len());
    }
    // The peak MFU is reported against is the best rate actually seen, before normalising: a
    // fast call between two slow drift probes would otherwise come out above the hardware's.
    let gemm_peak_flops = measured
        .iter()
        .flatten()
        .filter(|s| s.class.starts_with("matmul"))
        .map(|s| s.work / s.seconds)
        .fold(0.0, f64::max);
    let reference = median(&rates);
    tracing::debug!(
        ?rates,
        reference,
        "drift probe around each calibration model"
    );
    let samples = normalized(measured, &rates, reference);
    let mut secs: Vec<f64> = samples.iter().map(|s| s.seconds).collect();
    secs.sort_by(f64::total_cmp);
    let overhead = secs.get(secs.len() / 20).copied().unwrap_or(5e-6);
    Ok(MachineProfile::new(
        threads,
        cpu_name(),
        gemm_peak_flops,
        bandwidth(),
        overhead,
        samples,
    )
    .with_probe(reference))
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Each probe model's samples (`measured[i]`, taken between drift-probe rates `rates[i]` and
/// `rates[i + 1]`) at the `reference` rate: a model measured while the machine ran at 0.6× the
/// reference has its times multiplied by 0.6.
fn normalized(measured: Vec<Vec<Sample>>, rates: &[f64], reference: f64) -> Vec<Sample> {
    measured
        .into_iter()
        .enumerate()
        .flat_map(|(i, samples)| {
            let around = (rates[i] + rates[i + 1]) / 2.0;
            let factor = if around > 0.0 && reference > 0.0 {
                around / reference
            } else {
                1.0
            };
            samples.into_iter().map(move |s| Sample {
                seconds: s.seconds * factor,
                ..s
            })
        })
        .collect()
}

/// FLOP/s of snug's f32 matmul on `[m, k] · [k, n]`, best of `runs` after one warm-up.
pub fn gemm_rate(
    threads: usize,
    (m, k, n): (usize, usize, usize),
    runs: usize,
) -> Result<f64, TrainError> {
    let mut g = Graph::new().with_threads(threads);
    let a = g.add_leaf("a", &[m, k], DType::F32, Role::Parameter)?;
    let b = g.add_leaf("b", &[k, n], DType::F32, Role::Parameter)?;
    let c = g.apply1(MatMul::default(), &[a, b])?;
    g.mark_output(c);
    let p = plan(&g, &PlanOptions::default())?;
    let mut s = CpuSession::new(g, p, Allocator::default(), threads)?;
    let fill = |len: usize| -> Vec<f32> { (0..len).map(|i| (i % 17) as f32 * 0.01).collect() };
    s.write_f32(a, &fill(m * k))?;
    s.write_f32(b, &fill(k * n))?;
    let mut best = f64::INFINITY;
    for i in 0..=runs {
        let t = Instant::now();
        s.run(ExecCtx::default())?;
        if i > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (m * k * n) as f64 / best.max(1e-12))
}

/// A probe's model, compiled step and plan.
fn probe_step(
    p: &Probe,
    threads: usize,
) -> Result<(ModelConfig, CompiledStep, snug_plan::MemoryPlan), TrainError> {
    let mut model = ModelConfig::preset(p.preset)?;
    let shape = |v: usize| (v > 0).then_some(v);
    model.override_shape(
        Some(p.layers),
        shape(p.heads),
        shape(p.width),
        Some(p.block.max(model.max_seq())),
    );
    model.set_vocab_size(p.vocab);
    let step_config = StepConfig {
        accumulation: p.accumulation,
        passes: if p.fused {
            vec![Pass::FusedCrossEntropy]
        } else {
            Vec::new()
        },
        precision: if p.bf16 { DType::BF16 } else { DType::F32 },
        ..StepConfig::default()
    };
    let shape = StepShape {
        micro_batch: p.batch,
        block: p.block,
    };
    let compiled = compile_step(&model, shape, Target::host(threads), &step_config)?;
    let memory_plan = plan(&compiled.step.graph, &PlanOptions::default())?;
    Ok((model, compiled, memory_plan))
}

fn run_probe(p: &Probe, threads: usize) -> Result<Vec<Sample>, TrainError> {
    let (model, compiled, memory_plan) = probe_step(p, threads)?;
    let schedule = memory_plan.schedule.clone();
    let mut session = CpuSession::new(
        compiled.step.graph.clone(),
        memory_plan,
        Allocator::new(snug_runtime::Device::Cpu),
        threads,
    )?;
    for (name, values) in model.init_parameters(1) {
        if let Some(slot) = compiled.step.params.iter().find(|s| s.name == name) {
            session.write_f32(slot.param, &values)?;
        }
    }
    let n = p.batch * p.block;
    let ids: Vec<i32> = (0..n).map(|i| ((i * 7919 + 13) % p.vocab) as i32).collect();
    session.write_i32(compiled.tokens, &ids, p.vocab)?;
    session.write_i32(compiled.targets, &ids, p.vocab)?;
    let mut samples = Vec::new();
    for run in 0..=p.runs {
        for micro in 0..p.accumulation {
            let ctx = ExecCtx {
                lr: 1e-4,
                step: run as u64 + 1,
                micro: micro as u32,
                micro_steps: p.accumulation as u32,
            };
            let times = session.run_profiled(ctx)?;
            let last = micro + 1 == p.accumulation;
            // The first run warms caches and pages; optimizer kernels count on the last micro.
            if run == 0 {
                continue;
            }
            for (&node, t) in schedule.iter().zip(times) {
                let w = node_work(&compiled.step.graph, node);
                let is_update = matches!(w.class.as_str(), "adamw" | "sgd");
                if w.work > 0.0 && (last || !is_update) {
                    samples.push(Sample {
                        class: w.class,
                        family: w.family,
                        work: w.work,
                        seconds: t,
                    });
                }
            }
        }
    }
    Ok(samples)
}

/// Bytes of each of the bandwidth probe's two buffers.
const BANDWIDTH_BYTES: usize = 128 << 20;

/// Bytes per second copying 128 MiB (read and write both counted), best of five.
fn bandwidth() -> f64 {
    let n = BANDWIDTH_BYTES / std::mem::size_of::<f32>();
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(start.elapsed().as_secs_f64());
        std::hint::black_box(&mut dst);
    }
    (2 * n * std::mem::size_of::<f32>()) as f64 / best.max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(threads: usize) -> MachineProfile {
        MachineProfile::new(
            threads,
            cpu_name(),
            1e11,
            1e10,
            1e-6,
            vec![Sample {
                class: "matmul".into(),
                family: "384|1536".into(),
                work: 1e9,
                seconds: 0.01,
            }],
        )
    }

    #[test]
    fn each_probe_model_is_brought_to_the_reference_speed() {
        let sample = |seconds| Sample {
            class: "matmul".into(),
            family: "f".into(),
            work: 1e9,
            seconds,
        };
        // Rates 200, 100, 200, 300 around three models: the reference is their median, 200.
        let rates = [200.0, 100.0, 200.0, 300.0];
        assert_eq!(median(&rates), 200.0);
        let out = normalized(
            vec![vec![sample(0.04)], vec![sample(0.02), sample(0.03)], vec![]],
            &rates,
            200.0,
        );
        // The first model ran at 150 (0.75×) and the second at 150 too; the third had none.
        let secs: Vec<f64> = out.iter().map(|s| s.seconds).collect();
        assert_eq!(secs, vec![0.04 * 0.75, 0.02 * 0.75, 0.03 * 0.75]);
        let out = normalized(vec![vec![sample(0.1)]], &[0.0, 0.0], 0.0);
        assert_eq!(out[0].seconds, 0.1);
    }

    #[test]
    fn the_speed_tracker_predicts_each_step_at_the_speed_around_it() {
        // A 2 s step at calibration speed; the machine runs at 0.5× before step 1, 1.5× after
        // it and 1× after step 2.
        let mut t = SpeedTracker::with_speed(profile(1), 2.0, 1, 0.5);
        let s1 = t.record(1, 2500.0, 1.5);
        assert_eq!((s1.step, s1.speed, s1.predicted_step_ms), (1, 1.0, 2000.0));
        assert!((s1.error - 0.25).abs() < 1e-12);
        let s2 = t.record(2, 1600.0, 1.0);
        assert_eq!((s2.speed, s2.predicted_step_ms), (1.25, 1600.0));
        assert_eq!(s2.error, 0.0);
    }

    #[test]
    fn the_drift_probe_compares_now_with_the_calibration() {
        // A profile whose probe rate is 10 PFLOP/s was calibrated on a far faster machine:
        // this one runs at a small fraction of it, never more.
        let s = speed_now(&profile(1).with_probe(1e16), 1).unwrap();
        assert!(s > 0.0 && s < 0.01, "speed {s}");
        // Without a probe rate there is nothing to compare: as calibrated.
        assert_eq!(speed_now(&profile(1), 1).unwrap(), 1.0);
        // The probe rate survives the cache round trip.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("machine-1t.json");
        save_profile(&path, &profile(1).with_probe(2e11)).unwrap();
        assert_eq!(load_profile(&path, 1).map(|p| p.probe_flops), Some(2e11));
    }

    #[test]
    fn profiles_round_trip_and_stale_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested").join("machine-2t.json");
        save_profile(&path, &profile(2)).unwrap();
        assert_eq!(load_profile(&path, 2), Some(profile(2)));
        // Another thread count, another CPU or another version: measure again.
        assert_eq!(load_profile(&path, 4), None);
        let mut other = profile(2);
        other.cpu = "another cpu".into();
        save_profile(&path, &other).unwrap();
        assert_eq!(load_profile(&path, 2), None);
        let mut old = profile(2);
        old.version = PROFILE_VERSION - 1;
        save_profile(&path, &old).unwrap();
        assert_eq!(load_profile(&path, 2), None);
        std::fs::write(&path, "{ not json").unwrap();
        assert_eq!(load_profile(&path, 2), None);
    }

    /// A cache whose JSON is valid but whose figures no machine has (0, negative, NaN
    /// written as null, 1e300 FLOP/s, a sample table without the GEMM or missing a field, no
    /// threads) is refused by its field, never used: the cost model divides by these.
    #[test]
    fn absurd_caches_are_refused_by_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("machine-2t.json");
        let valid: serde_json::Value =
            serde_json::from_str(&profile(2).with_probe(1e11).to_json()).unwrap();
        use serde_json::Value;
        // What is spoiled, where (a JSON pointer), its new value (`None`: removed), and the
        // field the refusal must name.
        let cases: Vec<(&str, &str, Option<Value>, &str)> = vec![
            (
                "gemm 0",
                "/gemm_peak_flops",
                Some(0.0.into()),
                "gemm_peak_flops",
            ),
            (
                "gemm 1e300",
                "/gemm_peak_flops",
                Some(1e300.into()),
                "gemm_peak_flops",
            ),
            (
                "bandwidth < 0",
                "/bandwidth",
                Some((-1e9).into()),
                "bandwidth",
            ),
            ("overhead NaN", "/overhead", Some(Value::Null), "overhead"),
            ("overhead 1e9 s", "/overhead", Some(1e9.into()), "overhead"),
            (
                "probe 1e300",
                "/probe_flops",
                Some(1e300.into()),
                "probe_flops",
            ),
            (
                "probe < 0",
                "/probe_flops",
                Some((-5.0).into()),
                "probe_flops",
            ),
            ("threads 0", "/threads", Some(0.into()), "threads"),
            (
                "a time NaN",
                "/samples/0/seconds",
                Some(Value::Null),
                "samples[0].seconds",
            ),
            (
                "a time 0",
                "/samples/0/seconds",
                Some(0.0.into()),
                "samples[0].seconds",
            ),
            (
                "a time 1e-300",
                "/samples/0/seconds",
                Some(1e-300.into()),
                "samples[0].seconds",
            ),
            (
                "a work < 0",
                "/samples/0/work",
                Some((-1.0).into()),
                "samples[0].work",
            ),
            (
                "no samples",
                "/samples",
                Some(serde_json::json!([])),
                "samples",
            ),
            (
                "no GEMM samples",
                "/samples/0/class",
                Some("gelu".into()),
                "samples",
            ),
            (
                "a sample missing its time",
                "/samples/0/seconds",
                None,
                "(structure)",
            ),
            ("a rate missing", "/bandwidth", None, "(structure)"),
        ];
        for (what, pointer, value, field) in cases {
            let mut v = valid.clone();
            match value {
                Some(x) => *v.pointer_mut(pointer).unwrap() = x,
                None => {
                    let (parent, key) = pointer.rsplit_once('/').unwrap();
                    let parent = v.pointer_mut(parent).and_then(Value::as_object_mut);
                    parent.unwrap().remove(key);
                }
            }
            std::fs::write(&path, v.to_string()).unwrap();
            match read_profile(&path, 2) {
                Err(Unusable::Invalid(e)) => {
                    assert_eq!(e.field, field, "{what}: {e}");
                    if field == "(structure)" {
                        assert!(e.detail.contains("missing field"), "{what}: {e}");
                    }
                }
                other => panic!("{what}: expected the cache refused, got {other:?}"),
            }
            assert_eq!(load_profile(&path, 2), None, "{what}");
        }
        // Not JSON at all, and a file for other threads: refused by name too.
        std::fs::write(&path, "{ not json").unwrap();
        assert!(matches!(read_profile(&path, 2), Err(Unusable::Invalid(e)) if e.field == "(file)"));
        std::fs::write(&path, valid.to_string()).unwrap();
        assert!(
            matches!(read_profile(&path, 4), Err(Unusable::Invalid(e)) if e.field == "threads")
        );
        // The untouched profile loads; another version is stale, not invalid, even where it
        // would fail this version's checks.
        assert!(read_profile(&path, 2).is_ok());
        let mut old = valid.clone();
        old["version"] = (PROFILE_VERSION - 1).into();
        old["gemm_peak_flops"] = 0.0.into();
        std::fs::write(&path, old.to_string()).unwrap();
        assert_eq!(read_profile(&path, 2), Err(Unusable::Stale));
        assert_eq!(
            read_profile(&dir.path().join("absent.json"), 2),
            Err(Unusable::Stale)
        );
    }
}
