//! `snug fit`: the fastest configuration whose planned peak fits a memory budget, with the
//! table of every candidate considered. `snug train --memory` trains with it.

use anyhow::{Context, Result};
use clap::Args;
use snug_fit::{FitReport, Search, Verdict};
use snug_plan::memory_plan::human_bytes;
use snug_train::calibration::Calibration;
use snug_train::{RunFlags, TrainConfig};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct FitArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Memory budget: a size (2GiB, 800MB) or `auto` (the memory available to this process,
    /// within any container's or job's control-group limit, minus a reserve of 10%, at least
    /// 512 MiB; on a GPU, its memory minus 10%: see --device-memory).
    #[arg(long, value_name = "SIZE|auto")]
    memory: String,
    /// The GPU's memory (e.g. 12GiB), for `--memory auto` where it cannot be read from the
    /// device (`snug devices` shows where it can). TOML key `device_memory`.
    #[arg(long, value_name = "SIZE")]
    device_memory: Option<String>,
    /// Sequences per optimizer step to keep (default: --batch).
    #[arg(long)]
    effective_batch: Option<usize>,
    /// Measure this machine's kernels again instead of using the cached calibration.
    #[arg(long)]
    recalibrate: bool,
    /// Levers that change what is trained, which fit may use where nothing fits without them,
    /// comma-separated: fused-update (each update as its gradient completes; global clipping
    /// by the previous step's norm), adam8bit (8-bit AdamW moments), lora (rank-16 adapters
    /// on every linear layer, the base frozen), qlora (lora over an NF4 base); or all, or
    /// none (default).
    #[arg(long, value_name = "LEVERS")]
    allow: Option<String>,
    /// Search one rank of a data-parallel run over this many devices (the budget is per
    /// device; --batch is the whole step's): every ZeRO stage 0-3 competes.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=snug_train::config::MAX_DEVICES as u64))]
    devices: u64,
    /// With --devices: add each candidate's communication time over a link of this many GB/s
    /// each way to its prediction.
    #[arg(long, value_name = "GB/s", requires = "devices")]
    link: Option<f64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// `--device-memory SIZE` over the configuration's `device_memory`.
pub fn apply_device_memory(cfg: &mut TrainConfig, flag: Option<&str>) -> Result<()> {
    if let Some(text) = flag {
        cfg.device_memory = Some(
            snug_runtime::parse_bytes(text).with_context(|| format!("--device-memory {text}"))?,
        );
    }
    Ok(())
}

/// Bytes for a `--memory` value on the run's device. `auto` on the CPU reads the memory
/// available to this process: the host's, within any control-group (container, job) limit. On a GPU it takes the device's memory less 10% (its driver's own
/// allocations, the input staging ring): `--device-memory` (or `device_memory`) where given;
/// else a CPU driver's (lavapipe allocates from the host: the host's available memory, as on
/// the CPU); else it is refused, since wgpu reports no other device's memory.
pub fn parse_budget(text: &str, cfg: &TrainConfig) -> Result<usize> {
    let device = &cfg.device;
    if let (true, snug_train::DeviceSpec::Gpu(selector)) = (text.trim() == "auto", device) {
        if let Some(memory) = cfg.device_memory {
            return Ok(memory - memory / 10);
        }
        let adapter = snug_gpu::adapter::find(*selector)?;
        if adapter.as_ref().and_then(|a| a.memory_bytes).is_none() {
            anyhow::bail!(
                "--memory auto: the memory of --device {device}{} cannot be read through wgpu; \
                 give it with --device-memory SIZE (or the TOML key device_memory), or give the \
                 budget as a size (e.g. --memory 12GiB)",
                adapter.map_or(String::new(), |a| format!(" ({})", a.label()))
            );
        }
    }
    if text.trim() == "auto" {
        let available = snug_runtime::process::available_memory()
            .context("--memory auto: the OS does not report available memory here (give a size)")?;
        return Ok(snug_runtime::process::auto_budget(available));
    }
    snug_runtime::parse_bytes(text).with_context(|| format!("--memory {text}"))
}

/// The devices a run is spread over, the link between them, and the ZeRO stage when it is
/// the run's own (None: fit tries every stage).
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub devices: usize,
    pub link: Option<f64>,
    pub stage: Option<u8>,
}

/// Sets `cfg.allow` from `--allow` where given (over the TOML key).
pub fn set_allowed(cfg: &mut TrainConfig, allow: Option<&str>) -> Result<()> {
    if let Some(text) = allow {
        cfg.allow = text.parse().with_context(|| format!("--allow {text}"))?;
    }
    Ok(())
}

/// Runs the search for `cfg`'s model at `budget`. Every candidate is planned with nominal
/// timings first, so a budget nothing fits is refused before the machine is measured; then
/// the same candidates are timed by the cached (or a fresh) calibration, which never holds
/// more than the budget (peaks do not depend on the machine: nothing is planned twice).
pub fn fit_config(
    cfg: &TrainConfig,
    model: snug_nn::ModelConfig,
    budget: usize,
    effective_batch: usize,
    recalibrate: bool,
    spread: Spread,
) -> Result<(FitReport, snug_fit::MachineProfile)> {
    cfg.check_threads_here()?;
    let fit_model = cfg.fit_model(model);
    let mut search = Search::new(&fit_model, cfg.target(), budget)
        .effective_batch(effective_batch)
        .devices(spread.devices);
    if let Some(l) = spread.link {
        search = search.link(l);
    }
    if let Some(stage) = spread.stage {
        search = search.stage(stage);
    }
    if let Some(check) = cfg.device.runnable() {
        search = search.runnable(check);
    }
    let nominal = snug_fit::MachineProfile::nominal(cfg.threads);
    let first = search.run(&nominal)?;
    if first.chosen.is_none() {
        return Err(if spread.devices > 1 {
            first.nothing_fits().into()
        } else {
            nothing_fits(&first, &fit_model, cfg)
        });
    }
    if let snug_train::DeviceSpec::Gpu(selector) = cfg.device {
        let machine = gpu_profile(selector)?;
        return Ok((first.timed_by(&machine), machine));
    }
    let (machine, how) =
        snug_train::calibration::machine_profile(cfg.threads, recalibrate, Some(budget))?;
    match how {
        Calibration::Measured => tracing::info!(
            "calibrated this machine's kernels ({} samples, GEMM peak {:.1} GFLOP/s, copy {:.1} GB/s)",
            machine.samples.len(),
            machine.gemm_peak_flops / 1e9,
            machine.bandwidth / 1e9,
        ),
        Calibration::Nominal { needs_bytes } => {
            tracing::warn!(
                "predictions are nominal: measuring this machine holds up to {}, more than the budget of {}",
                human_bytes(needs_bytes),
                human_bytes(budget)
            );
            // The first search already ranked the candidates with these figures.
            return Ok((first, machine));
        }
        Calibration::CachedUnscaled => tracing::info!(
            "the cached calibration is used as it is: its drift probe holds more than the budget"
        ),
        Calibration::Cached => {}
    }
    Ok((first.timed_by(&machine), machine))
}

/// The GEMM shape of the GPU's probe: the CPU bench's, so the two rates compare.
const GPU_PROBE: (usize, usize, usize) = (4096, 384, 1536);

/// A timing model of the GPU `selector` names: its f32 GEMM rate and copy bandwidth, probed
/// now (a few submits; once per process), and no per-kernel samples. The CPU's calibration
/// says nothing about a GPU.
pub fn gpu_profile(selector: snug_gpu::Selector) -> Result<snug_fit::MachineProfile> {
    let device = snug_gpu::GpuDevice::open(selector)?;
    let gemm = snug_gpu::gemm_rate(&device, GPU_PROBE, 3)?;
    let copy = snug_gpu::copy_rate(&device, 64 << 20, 3)?;
    tracing::info!(
        "timing model of {}: f32 GEMM {:.1} GFLOP/s, copy {:.1} GB/s (probed now)",
        device.info().label(),
        gemm / 1e9,
        copy / 1e9
    );
    // A launch costs a few microseconds on any current GPU.
    Ok(snug_fit::MachineProfile::new(
        1,
        format!("{} (probed)", device.info().label()),
        gemm,
        copy,
        5e-6,
        Vec::new(),
    ))
}

/// With `--batch auto`: the largest batch some configuration trains in one micro-batch (no
/// accumulation) within `budget`. Peaks do not depend on timings: nothing is measured.
pub fn largest_batch(
    cfg: &TrainConfig,
    model: &snug_nn::ModelConfig,
    budget: usize,
) -> Result<usize> {
    let fit_model = cfg.fit_model(model.clone());
    // Far beyond any memory this decade; bounds the doubling.
    const MOST: usize = 1 << 20;
    match snug_fit::largest_micro_batch(&fit_model, budget, MOST, cfg.target())? {
        Some(b) => Ok(b),
        None => {
            let nominal = snug_fit::MachineProfile::nominal(cfg.threads);
            let report = Search::new(&fit_model, cfg.target(), budget).run(&nominal)?;
            Err(nothing_fits(&report, &fit_model, cfg))
        }
    }
}

/// The error when nothing fits: the smallest peak reached, and which changes to the run of
/// `cfg` would fit (or that none snug can make would).
pub fn nothing_fits(
    report: &FitReport,
    model: &snug_fit::FitModel,
    cfg: &TrainConfig,
) -> anyhow::Error {
    let base = report.nothing_fits();
    // Each device's share of the batch, as the search planned it.
    let sequences = report.effective_batch / report.devices.max(1);
    // The search fit ran, so each change is judged as `fit` with it would judge it: on a GPU
    // the rows its backend cannot run (fused updates' previous-norm clipping) are not offered.
    let mut search =
        Search::new(model, cfg.target(), report.budget).effective_batch(sequences.max(1));
    if let Some(check) = cfg.device.runnable() {
        search = search.runnable(check);
    }
    let suggestions = search
        .advice(&snug_fit::MachineProfile::nominal(cfg.threads))
        .suggestions;
    let fitting: Vec<String> = suggestions
        .iter()
        .filter(|s| s.fits)
        .map(|s| format!("  {} (peak {})", s.change, human_bytes(s.least_bytes)))
        .collect();
    let advice = if fitting.is_empty() {
        // The nearest miss, by what it needs at least (a planned peak, or its state alone).
        let closest = suggestions.iter().min_by_key(|s| s.least_bytes);
        format!(
            "no change snug can make reaches it{}: a smaller model, or more memory",
            closest.map_or(String::new(), |s| match s.peak_bytes {
                Some(p) => format!(" (the closest, {}, peaks at {})", s.change, human_bytes(p)),
                None => format!(
                    " (the closest, {}, holds {} of parameters and optimizer state alone)",
                    s.change,
                    human_bytes(s.least_bytes)
                ),
            })
        )
    } else {
        format!("these would fit:\n{}", fitting.join("\n"))
    };
    anyhow::anyhow!("{base}\n{advice}")
}

/// fit chooses micro-batch × accumulation and remat itself (only `--batch` is kept): the
/// accumulation and remat the run set (`set`), where `chosen` differs, named so the change is
/// not silent.
pub fn not_kept(
    set: (Option<usize>, Option<snug_compile::Remat>),
    chosen: &snug_fit::FitConfig,
) -> Option<String> {
    let mut dropped = Vec::new();
    if let Some(a) = set.0.filter(|&a| a != chosen.accumulation) {
        dropped.push(format!("--accumulation {a}"));
    }
    if let Some(r) = set.1.filter(|&r| r != chosen.remat) {
        dropped.push(format!("--remat {r}"));
    }
    (!dropped.is_empty()).then(|| {
        format!(
            "fit chooses micro-batch × accumulation and remat itself: {} not kept (chosen: \
             micro-batch {} × {}, remat {})",
            dropped.join(" and "),
            chosen.micro_batch,
            chosen.accumulation,
            chosen.remat
        )
    })
}

pub fn print_table(report: &FitReport) {
    println!(
        "budget {} for {} sequences of {} tokens per step; {}",
        human_bytes(report.budget),
        report.effective_batch,
        report.block,
        if report.calibrated {
            format!(
                "predictions calibrated on this machine, at {:.2}x the calibration's speed \
                 (a GEMM probe now)",
                report.machine_speed
            )
        } else {
            "nominal predictions (uncalibrated)".into()
        }
    );
    if report.devices > 1 {
        println!(
            "one rank of {} devices (micro-batch and peak per rank){}",
            report.devices,
            report.link_gb_per_s.map_or(String::new(), |l| format!(
                "; predictions include communication over {l} GB/s"
            ))
        );
    }
    println!(
        "{:>6} {:>4} {:>4}  {:<14} {:<16} {:<5} {:<8} {:>12} {:>11}  verdict",
        "micro", "acc", "zero", "remat", "passes", "prec", "levers", "peak", "predicted"
    );
    for c in &report.candidates {
        let passes: Vec<&str> = c.config.passes.iter().map(|p| p.name()).collect();
        let verdict = match &c.verdict {
            Verdict::Chosen => "CHOSEN".to_string(),
            Verdict::OverBudget => "over budget".to_string(),
            Verdict::OverLowerBound { .. } => {
                "over budget by its parameters + optimizer state (not planned)".to_string()
            }
            Verdict::Slower { ratio } => format!("fits, {ratio:.2}× slower"),
            Verdict::Failed { reason } => format!("failed: {reason}"),
        };
        // plan and train run such a row without its remat: say so, or it reads as a step
        // that holds the same as one without.
        let verdict = match &c.remat_dropped {
            Some(_) => format!("{verdict} (remat left out: it does not lower the peak)"),
            None => verdict,
        };
        println!(
            "{:>6} {:>4} {:>4}  {:<14} {:<16} {:<5} {:<8} {:>12} {:>11}  {}",
            c.config.micro_batch,
            c.config.accumulation,
            c.config.shard,
            match c.config.remat {
                snug_compile::Remat::Budget { .. } => "budget".to_string(),
                r => r.to_string(),
            },
            if passes.is_empty() {
                "-".to_string()
            } else {
                passes.join(",")
            },
            c.config.precision.to_string(),
            if c.config.levers.is_empty() {
                "-".to_string()
            } else {
                c.config.levers.to_string()
            },
            match (&c.verdict, c.peak_bytes) {
                (_, Some(p)) => human_bytes(p),
                // Not planned: what it holds at least.
                (Verdict::OverLowerBound { lower_bound_bytes }, None) => {
                    format!("≥{}", human_bytes(*lower_bound_bytes))
                }
                _ => "-".into(),
            },
            c.predicted_seconds
                .map_or("-".into(), |s| format!("{:.3} s", s)),
            verdict
        );
    }
    println!(
        "searched {} candidates in {:.3} s",
        report.candidates.len(),
        report.search_seconds
    );
}

pub fn run(args: FitArgs) -> Result<()> {
    let (model, train) = args.model.sections(RunFlags::default());
    let mut cfg = args.model.resolve(&model, &train)?;
    set_allowed(&mut cfg, args.allow.as_deref())?;
    apply_device_memory(&mut cfg, args.device_memory.as_deref())?;
    let (_, model) = cfg.load_data_and_model()?;
    let model_for_advice = model.clone();
    // Set by a flag, or to other than the default by the TOML: fit may choose otherwise.
    let set = (
        (args.model.step.accumulation.is_some() || cfg.accumulation != 1)
            .then_some(cfg.accumulation),
        (args.model.step.remat.is_some() || cfg.remat != snug_compile::Remat::None)
            .then_some(cfg.remat),
    );
    let budget = parse_budget(&args.memory, &cfg)?;
    if args.model.batch_auto() {
        if args.devices > 1 {
            anyhow::bail!("--batch auto searches one device: give --batch with --devices");
        }
        cfg.batch = largest_batch(&cfg, &model, budget)?;
        cfg.accumulation = 1;
        if !args.json {
            println!(
                "--batch auto: {} sequences of {} tokens a step, the most one micro-batch holds in {}",
                cfg.batch,
                cfg.block,
                human_bytes(budget)
            );
        }
    }
    let effective = args.effective_batch.unwrap_or(cfg.batch);
    let spread = Spread {
        devices: usize::try_from(args.devices)?,
        link: args.link,
        stage: None,
    };
    let (report, _) = fit_config(&cfg, model, budget, effective, args.recalibrate, spread)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    match report.chosen() {
        Some(c) => {
            if !args.json {
                println!(
                    "chosen: {} (planned peak {}, predicted {:.3} s per step)",
                    c.config,
                    c.peak_bytes.map_or("-".into(), human_bytes),
                    c.predicted_seconds.unwrap_or(0.0)
                );
                for cost in c.config.levers.costs() {
                    println!(
                        "  lever {}: quality: {}; recompute: {}; speed: {}",
                        cost.lever, cost.quality, cost.recompute, cost.speed
                    );
                }
            }
            if let Some(note) = not_kept(set, &c.config) {
                tracing::warn!("{note}");
            }
            Ok(())
        }
        None if args.devices > 1 => Err(report.nothing_fits().into()),
        None => Err(nothing_fits(
            &report,
            &cfg.fit_model(model_for_advice),
            &cfg,
        )),
    }
}
