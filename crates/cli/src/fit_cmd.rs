//! `snug fit`: the fastest configuration whose planned peak fits a memory budget, with the
//! table of every candidate considered. `snug train --memory` trains with it.

use anyhow::{bail, Context, Result};
use clap::Args;
use snug_fit::{Device, FitReport, Verdict};
use snug_plan::memory_plan::human_bytes;
use snug_train::TrainConfig;

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct FitArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Memory budget: a size (2GiB, 800MB) or `auto` (available RAM minus a reserve of 10%,
    /// at least 512 MiB).
    #[arg(long, value_name = "SIZE|auto")]
    memory: String,
    /// Sequences per optimizer step to keep (default: --batch).
    #[arg(long)]
    effective_batch: Option<usize>,
    /// Measure this machine's kernels again instead of using the cached calibration.
    #[arg(long)]
    recalibrate: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// Bytes for a `--memory` value.
pub fn parse_budget(text: &str) -> Result<usize> {
    if text.trim() == "auto" {
        let available = snug_runtime::process::available_memory()
            .context("--memory auto: the OS does not report available memory here (give a size)")?;
        let reserve = (available / 10).max(512 << 20);
        return Ok(available.saturating_sub(reserve));
    }
    snug_runtime::parse_bytes(text).with_context(|| format!("--memory {text}"))
}

/// Runs the search for `cfg`'s model at `budget`, with the cached (or a fresh) calibration.
pub fn fit_config(
    cfg: &TrainConfig,
    model: snug_nn::ModelConfig,
    budget: usize,
    effective_batch: usize,
    recalibrate: bool,
) -> Result<(FitReport, snug_fit::MachineProfile)> {
    let (machine, fresh) = snug_train::calibration::machine_profile(cfg.threads, recalibrate)?;
    if fresh {
        tracing::info!(
            "calibrated this machine's kernels ({} samples, GEMM peak {:.1} GFLOP/s, copy {:.1} GB/s); cached at {}",
            machine.samples.len(),
            machine.gemm_peak_flops / 1e9,
            machine.bandwidth / 1e9,
            snug_train::calibration::cache_path(cfg.threads)
                .map_or_else(|| "-".into(), |p| p.display().to_string())
        );
    }
    let fit_model = cfg.fit_model(model);
    let report = snug_fit::search(
        &fit_model,
        budget,
        &[Device::Cpu {
            threads: cfg.threads,
        }],
        effective_batch,
        &machine,
        None,
    )?;
    Ok((report, machine))
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
    println!(
        "{:>6} {:>4}  {:<14} {:<16} {:<5} {:>12} {:>11}  verdict",
        "micro", "acc", "remat", "passes", "prec", "peak", "predicted"
    );
    for c in &report.candidates {
        let passes: Vec<&str> = c.config.passes.iter().map(|p| p.name()).collect();
        let verdict = match &c.verdict {
            Verdict::Chosen => "CHOSEN".to_string(),
            Verdict::OverBudget => "over budget".to_string(),
            Verdict::Slower { ratio } => format!("fits, {ratio:.2}× slower"),
            Verdict::Failed { reason } => format!("failed: {reason}"),
        };
        println!(
            "{:>6} {:>4}  {:<14} {:<16} {:<5} {:>12} {:>11}  {}",
            c.config.micro_batch,
            c.config.accumulation,
            match c.config.remat {
                snug_fit::Remat::Budget { .. } => "budget".to_string(),
                r => r.to_string(),
            },
            if passes.is_empty() {
                "-".to_string()
            } else {
                passes.join(",")
            },
            c.config.precision.to_string(),
            c.peak_bytes.map_or("-".into(), human_bytes),
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
    let (model, train) = args.model.sections();
    let cfg = TrainConfig::resolve(args.model.config.as_deref(), &model, &train)?;
    let (_, model) = cfg.load_data_and_model()?;
    let budget = parse_budget(&args.memory)?;
    let effective = args.effective_batch.unwrap_or(cfg.batch);
    let (report, _) = fit_config(&cfg, model, budget, effective, args.recalibrate)?;
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
            }
            Ok(())
        }
        None => bail!(report.nothing_fits()),
    }
}
