//! `snug report`: one HTML page, readable offline, of a step's memory (from `snug plan --json`,
//! a run directory's checkpoint, or the model flags), fit's candidates (`snug fit --json`), a
//! run's `metrics.jsonl` and the table of a device's memory. An existing page is replaced only
//! with `--force`; a checkpoint or a run's own file never.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use snug_plan::memory_plan::human_bytes;
use snug_plan::{plan, PlanOptions};
use snug_report::{FitDocument, PlanDocument, Report, RunMetrics};
use snug_train::{TrainConfig, TrainError};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Model flags: the step is planned from them when neither --plan-json nor --run gives a
    /// plan.
    #[command(flatten)]
    model: ModelArgs,
    /// A plan written by `snug plan --json` (with its pass savings).
    #[arg(long, value_name = "FILE")]
    plan_json: Option<PathBuf>,
    /// fit's candidates, written by `snug fit --json`.
    #[arg(long, value_name = "FILE")]
    fit_json: Option<PathBuf>,
    /// A run directory: its metrics.jsonl, and (without --plan-json) the plan of its latest
    /// checkpoint's configuration.
    #[arg(long, value_name = "DIR")]
    run: Option<PathBuf>,
    /// The device's memory for the table (e.g. 12GiB; default: the planned run's device's:
    /// this machine's available memory on the CPU; on a GPU the memory the run was given, or
    /// the adapter's where it is known).
    #[arg(long, value_name = "SIZE")]
    device_memory: Option<String>,
    /// Where to write the page. An existing file is refused unless --force; a checkpoint, a
    /// run's metrics.jsonl or lock file always.
    #[arg(
        short = 'o',
        long,
        value_name = "FILE",
        default_value = "snug-report.html"
    )]
    output: PathBuf,
    /// Replace the file -o names if it exists (atomically: an interrupted write leaves the old
    /// page whole). Never a checkpoint or a run's own file.
    #[arg(long)]
    force: bool,
    /// Print the figures drawn, as JSON.
    #[arg(long)]
    json: bool,
}

/// JSON documents larger than this are refused rather than read.
const MAX_DOCUMENT_BYTES: u64 = 1 << 30;

fn read(path: &Path, what: &'static str) -> Result<String> {
    Ok(snug_train::user_file::read_text(
        path,
        MAX_DOCUMENT_BYTES,
        what,
    )?)
}

/// The plan of `cfg`'s step, as `snug plan` compiles it, without pass savings.
fn plan_of(cfg: &TrainConfig, model: &snug_nn::ModelConfig) -> Result<PlanDocument> {
    let step =
        snug_compile::compile_step(model, cfg.step_shape(), cfg.target(), &cfg.step_config())?.step;
    let p = plan(&step.graph, &PlanOptions::default())?;
    let mut doc = PlanDocument::from_plan(&p, &step.graph, step.forward_nodes);
    doc.preset = cfg.model.preset.clone().unwrap_or_default();
    doc.parameters = Some(step.parameter_count());
    doc.batch = Some(cfg.batch);
    doc.block = Some(cfg.block);
    doc.remat = Some(cfg.remat.to_string());
    Ok(doc)
}

/// `snug train --report`: the page of a run that just ended, from the plan it trained with (the
/// one its last recovery chose, if any) and its `metrics.jsonl`, written as `report.html` in
/// its directory. Returns the page's path.
pub fn write_for_run(
    trainer: &snug_train::Trainer,
    cfg: &TrainConfig,
    dir: &Path,
) -> Result<PathBuf> {
    let step = trainer.step_graph();
    let mut doc = PlanDocument::from_plan(trainer.plan(), &step.graph, step.forward_nodes);
    doc.preset = cfg.model.preset.clone().unwrap_or_default();
    doc.parameters = Some(step.parameter_count());
    doc.batch = Some(cfg.batch);
    doc.block = Some(cfg.block);
    doc.remat = Some(cfg.remat.to_string());
    let metrics = dir.join(snug_train::run::METRICS_FILE);
    let run = read_metrics(&metrics)?;
    let mut notes = vec![format!("plan: the step {} trained with", dir.display())];
    let device = run_device_memory(cfg, &mut notes);
    let report = Report {
        title: format!("snug report: {}", dir.display()),
        plan: Some(doc),
        fit: None,
        run,
        device,
        notes,
        run_id: trainer.config().run_id.clone(),
    };
    let path = dir.join(RUN_PAGE);
    snug_nn::hf_checkpoint::write_file_atomically(&path, report.html()?.as_bytes())?;
    Ok(path)
}

/// The page `snug train --report` writes into its run directory.
pub const RUN_PAGE: &str = "report.html";

/// Refuses, before a run starts, a `--report` whose page could not be written or would replace
/// a file that is not this run's own page (one an earlier `--report` of the run wrote, before
/// a resume): a file of yours named `report.html` in the run directory, a directory there.
/// `run_id` is the resumed run's; a fresh run (none) owns no page yet.
pub fn check_run_page(dir: &Path, run_id: Option<&str>) -> Result<()> {
    let path = dir.join(RUN_PAGE);
    snug_train::output::check_document_file(&path, true)?;
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => bail!("--report: {}: {e}", path.display()),
    };
    // The mark sits in the page's head, in its first few hundred bytes.
    let head = || -> std::io::Result<String> {
        use std::io::Read;
        let mut head = Vec::new();
        std::fs::File::open(&path)?
            .take(64 << 10)
            .read_to_end(&mut head)?;
        Ok(String::from_utf8_lossy(&head).into_owned())
    };
    let ours = meta.is_file()
        && run_id.is_some_and(|id| head().is_ok_and(|h| snug_report::is_page_of_run(&h, id)));
    if !ours {
        bail!(
            "--report: {} exists and is not a page of this run (a page of an older snug's, or \
             of `snug report -o`, counts as not): snug never writes over it; move it, or train \
             without --report and write the page elsewhere afterwards with `snug report --run \
             {} -o FILE`",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

/// The memory of the device `cfg` runs on, for the device table: on the CPU this machine's
/// available memory; on a GPU the memory given (`--device-memory`, or the run's saved
/// `device_memory`), else the adapter's where it is known (a CPU driver's is the machine's),
/// else none, with a note: the machine's memory says nothing of a GPU's.
fn run_device_memory(cfg: &TrainConfig, notes: &mut Vec<String>) -> Option<(String, usize)> {
    let snug_train::DeviceSpec::Gpu(selector) = cfg.device else {
        return snug_runtime::process::available_memory()
            .map(|b| ("this machine's available memory".to_string(), b));
    };
    if let Some(given) = cfg.device_memory {
        return Some((
            format!("--device {}, its device memory as given", cfg.device),
            given,
        ));
    }
    let adapter = snug_gpu::adapter::find(selector).ok().flatten();
    if let Some((bytes, source)) = adapter
        .as_ref()
        .and_then(|a| Some((usize::try_from(a.memory_bytes?).ok()?, a.memory_source()?)))
    {
        return Some((format!("--device {}, {source}", cfg.device), bytes));
    }
    notes.push(format!(
        "no device table: the memory of --device {} cannot be read through wgpu here (give \
         --device-memory SIZE)",
        cfg.device
    ));
    None
}

/// A run's metrics file: `None` where there is none (a run that has not logged yet); anything
/// else at its path (a directory) is an error naming it, not a page without the run.
fn read_metrics(path: &Path) -> Result<Option<RunMetrics>> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Ok(m) if m.is_file() => Ok(Some(RunMetrics::read(path)?)),
        Ok(_) => bail!("{}: not a file", path.display()),
        Err(e) => bail!("{}: {e}", path.display()),
    }
}

pub fn run(args: ReportArgs) -> Result<()> {
    snug_train::output::check_document_file(&args.output, args.force)?;
    // --force replaces an old page, never what this one is made from.
    for (flag, input) in [
        ("--plan-json", &args.plan_json),
        ("--fit-json", &args.fit_json),
    ] {
        if let Some(input) = input {
            if snug_train::output::same_file(input, &args.output) {
                bail!(
                    "-o {}: is the file {flag} reads; snug never writes over its input, even \
                     with --force: give another path",
                    args.output.display()
                );
            }
        }
    }
    let mut notes = Vec::new();
    // The configuration the plan came from, whose device the table is of.
    let mut planned_cfg: Option<TrainConfig> = None;
    let plan_doc = if let Some(path) = &args.plan_json {
        notes.push(format!("plan: {}", path.display()));
        Some(
            PlanDocument::from_json(&read(path, "a plan")?)
                .with_context(|| format!("reading the plan {}", path.display()))?,
        )
    } else if let Some(dir) = &args.run {
        match snug_train::checkpoint::load(dir) {
            Ok((path, ckpt)) => {
                notes.push(format!(
                    "plan: the configuration of {} (no pass savings: give --plan-json for them)",
                    path.display()
                ));
                if let snug_train::DeviceSpec::Gpu(selector) = ckpt.config.device {
                    match snug_gpu::adapter::find(selector) {
                        Ok(Some(here)) => {
                            if let Some(saved) =
                                ckpt.config.adapter.as_ref().filter(|&s| *s != here.label())
                            {
                                notes.push(format!(
                                    "the run trained on {saved}; --device {} here is {}: \
                                     planned with its layout (alignment, largest buffer), \
                                     which the run's adapter's may differ from",
                                    ckpt.config.device,
                                    here.label()
                                ));
                            }
                        }
                        _ => notes.push(format!(
                            "the run trained on --device {}, which this machine does not \
                             have: planned with the default GPU layout (alignment, largest \
                             buffer), which that adapter's may differ from",
                            ckpt.config.device
                        )),
                    }
                }
                let doc = plan_of(&ckpt.config, &ckpt.model()?)?;
                planned_cfg = Some(ckpt.config);
                Some(doc)
            }
            // Checkpoints that are there but do not load are an error, not an absent plan.
            Err(e @ TrainError::NoCheckpoint { .. })
                if snug_train::checkpoint::holds_checkpoints(dir) =>
            {
                return Err(e.into())
            }
            Err(TrainError::NoCheckpoint { .. }) => {
                notes.push(format!(
                    "no plan: {} holds no checkpoint (give --plan-json)",
                    dir.display()
                ));
                None
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        if args.model.batch_auto() {
            anyhow::bail!("--batch auto needs a memory budget: plan with `snug fit --memory SIZE` and report from `snug plan --json`");
        }
        let (model, train) = args.model.sections(snug_train::RunFlags::default());
        let mut cfg = args.model.resolve(&model, &train)?;
        let (_, gpt) = cfg.load_data_and_model()?;
        notes.push("plan: the model flags (no pass savings: give --plan-json for them)".into());
        let doc = plan_of(&cfg, &gpt)?;
        planned_cfg = Some(cfg);
        Some(doc)
    };
    let fit = match &args.fit_json {
        Some(path) => Some(
            FitDocument::from_json(&read(path, "a fit table")?)
                .with_context(|| format!("reading the fit table {}", path.display()))?,
        ),
        None => None,
    };
    let run = match &args.run {
        Some(dir) => {
            let path = dir.join(snug_train::run::METRICS_FILE);
            let run = read_metrics(&path)?;
            if run.is_none() {
                notes.push(format!("no run curves: {} not found", path.display()));
            }
            run
        }
        None => None,
    };
    let device = match &args.device_memory {
        Some(text) => Some((
            format!("--device-memory {text}"),
            snug_plan::parse_bytes(text).with_context(|| format!("--device-memory {text}"))?,
        )),
        None => match &planned_cfg {
            Some(cfg) => run_device_memory(cfg, &mut notes),
            None => snug_runtime::process::available_memory()
                .map(|b| ("this machine's available memory".to_string(), b)),
        },
    };
    let title = match plan_doc.as_ref().map(|p| p.preset.as_str()) {
        Some(preset) if !preset.is_empty() => format!("snug report: {preset}"),
        _ => "snug report".to_string(),
    };
    let report = Report {
        title,
        plan: plan_doc,
        fit,
        run,
        device,
        notes,
        run_id: None,
    };
    let html = report.html()?;
    snug_nn::hf_checkpoint::write_file_atomically(&args.output, html.as_bytes())?;
    let figures = report.figures();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&figures)?);
        return Ok(());
    }
    if let Some(p) = &figures.plan {
        println!(
            "planned peak {} at op {} ({})",
            human_bytes(p.peak_bytes),
            p.peak.position,
            p.peak.op
        );
    }
    if let Some(r) = &figures.run {
        println!(
            "run: {} steps, {} evaluations",
            r.steps.len(),
            r.evals.len()
        );
        for s in &r.skipped {
            println!("metrics.jsonl line {} skipped: {}", s.line, s.reason);
        }
    }
    // Where the figures came from, and what the page lacks and why (a run directory with no
    // checkpoint or metrics yet): the page says it, and so does the terminal.
    for n in &figures.notes {
        println!("note: {n}");
    }
    println!("wrote {}", args.output.display());
    Ok(())
}
