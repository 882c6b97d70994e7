//! `snug train`: compile, plan and run the training loop, reporting loss, speed and memory;
//! evaluate, checkpoint, resume, and stop cleanly on Ctrl-C.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;
use snug_runtime::process::resident_set;
use snug_runtime::Allocator;
use snug_train::addition::{self, AdditionScore};
use snug_train::calibration::{SpeedTracker, StepSpeed};
use snug_train::checkpoint;
use snug_train::config::DataSourceConfig;
use snug_train::{
    Claim, Event, RunDir, RunFlags, Sampler, TokenDataset, TrainConfig, TrainError, Trainer,
};

use crate::dashboard::{Dashboard, DashboardState};
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    run: RunFlags,
    /// Save nothing: no run directory, no checkpoint, no metrics file.
    #[arg(long, conflicts_with_all = ["out", "resume"])]
    no_save: bool,
    /// Also print the whole resolved configuration.
    #[arg(long, short)]
    verbose: bool,
    /// Continue the run saved in DIR (or a checkpoint file) exactly where it stopped; flags
    /// given here override its configuration (e.g. more --steps).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Train with the fastest configuration whose planned peak fits this budget (`snug fit`
    /// chooses micro-batch × accumulation, remat and passes; --batch stays the effective
    /// batch), and hold the run to it as a strict limit: a size (2GiB) or `auto`.
    #[arg(long, value_name = "SIZE|auto", conflicts_with = "memory_limit")]
    memory: Option<String>,
    /// With --memory: measure this machine's kernels again instead of using the cached
    /// calibration.
    #[arg(long, requires = "memory")]
    recalibrate: bool,
    /// With --memory: levers that change what is trained, which fit may use where nothing
    /// fits without them: fused-update, adam8bit, lora, qlora (as `snug fit --allow`), all,
    /// or none (default). Not on a resumed run.
    #[arg(
        long,
        value_name = "LEVERS",
        requires = "memory",
        conflicts_with = "resume"
    )]
    allow: Option<String>,
    /// The GPU's memory (e.g. 12GiB), for `--memory auto` where it cannot be read from the
    /// device. TOML key `device_memory`.
    #[arg(long, value_name = "SIZE")]
    device_memory: Option<String>,
    /// Simulate memory pressure: lower the strict memory limit to SIZE once step STEP-1 ends,
    /// so before any evaluation that follows it and before step STEP (the run recovers with a
    /// smaller configuration, redoing what ran out).
    #[arg(long, value_name = "STEP:SIZE")]
    lower_memory_at: Option<String>,
    /// After every step, time the cost model's 0.2 s GEMM probe and print the step's
    /// predicted time at the machine's speed around it beside the measured one (needs a
    /// cached calibration; the probe holds about 35 MB beside the run): on a shared machine,
    /// tells a slow spell from a slow configuration.
    #[arg(long)]
    track_speed: bool,
    /// One JSON object per step and evaluation, then a summary object.
    #[arg(long)]
    json: bool,
    /// When the run ends, write `report.html` into the run directory: the plan it trained
    /// with (its memory timeline by role), its curves, this machine's memory table. Not kept
    /// in the checkpoint: give it again with --resume (or run `snug report --run DIR`).
    #[arg(long, conflicts_with = "no_save")]
    report: bool,
    /// Show the run in a full-screen terminal view (loss and memory over steps, the planned
    /// peak, events) instead of progress lines; the summary prints when it ends.
    #[arg(long, conflicts_with = "json")]
    dashboard: bool,
}

#[derive(Serialize)]
struct Summary {
    /// Where the steps ran: `cpu`, or the GPU adapter's label.
    device: String,
    steps: u64,
    start_step: u64,
    interrupted: bool,
    first_loss: Option<f32>,
    final_loss: Option<f32>,
    train_loss: Option<f32>,
    val_loss: Option<f32>,
    median_step_ms: f64,
    /// fit's cost model for the configuration the run ended with (needs a cached calibration).
    predicted_step_ms: Option<f64>,
    /// With --track-speed: the median of the steady steps' predictions, each at the speed the
    /// probe measured around that step.
    tracked_predicted_step_ms: Option<f64>,
    min_step_ms: f64,
    max_step_ms: f64,
    tokens_per_step: usize,
    tokens_per_s: f64,
    model_flops_per_s: f64,
    /// The plan the run ended on (after any recovery, the one it switched to) and the
    /// allocator's peak under it.
    predicted_peak_bytes: usize,
    measured_peak_bytes: usize,
    /// The most held at once over the whole run, under every plan it ran.
    run_peak_bytes: usize,
    lower_bound_bytes: usize,
    arena_bytes: usize,
    peak_rss_bytes: Option<usize>,
    cache_bytes: usize,
    /// The limit at the end (`--lower-memory-at` lowers it).
    memory_limit_bytes: Option<usize>,
    limit_overruns: u64,
    /// Out-of-memory recoveries during the run (each also printed as it happened).
    recoveries: usize,
    parameters: usize,
    checkpoint: Option<PathBuf>,
    metrics: Option<PathBuf>,
    /// On the built-in data: the fraction of held-out additions answered exactly (greedy).
    addition_accuracy: Option<f64>,
    /// The held-out additions scored, their time and a few wrong answers.
    addition: Option<AdditionScore>,
    /// Why the held-out additions were not scored, where they were not (the scoring did not
    /// fit the memory limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    addition_skipped: Option<String>,
    /// The page `--report` wrote.
    report: Option<PathBuf>,
    /// True only for a resume that found nothing left to train (and so wrote nothing).
    already_complete: bool,
}

/// Standard output that may close under a run (`snug train | head`): a failed write stops the
/// run as Ctrl-C does, so its state is saved, instead of ending the process mid-step.
struct Stdout {
    broken: Option<std::io::Error>,
    stop: Arc<AtomicBool>,
}

impl Stdout {
    fn line(&mut self, args: std::fmt::Arguments<'_>) {
        use std::io::Write;
        if self.broken.is_some() {
            return;
        }
        let mut out = std::io::stdout().lock();
        let written = out
            .write_fmt(args)
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.flush());
        if let Err(e) = written {
            self.broken = Some(e);
            self.stop.store(true, Ordering::Relaxed);
        }
    }

    fn json<T: Serialize>(&mut self, kind: &str, value: &T) -> serde_json::Result<()> {
        let line = json_line(kind, value)?;
        self.line(format_args!("{line}"));
        Ok(())
    }
}

macro_rules! say {
    ($out:expr, $($arg:tt)*) => { $out.line(format_args!($($arg)*)) };
}

/// Claims `cfg.out` for a new run, if there is one. A directory snug numbered itself that
/// another run claimed first (two runs started at once both found it free) gives way to the
/// next number.
fn claim_fresh(cfg: &mut TrainConfig, numbered: bool) -> Result<Option<RunDir>> {
    let Some(mut dir) = cfg.out.clone() else {
        return Ok(None);
    };
    let mut tries = 0;
    loop {
        match RunDir::claim(&dir, &Claim::Fresh) {
            Err(TrainError::RunDirBusy { .. } | TrainError::RunDirTaken { .. })
                if numbered && tries < 100 =>
            {
                tries += 1;
                dir = default_run_dir(cfg);
                cfg.out = Some(dir.clone());
            }
            claimed => return Ok(Some(claimed?)),
        }
    }
}

/// `runs/<model>-<N>` for the smallest N not taken, under the current directory.
fn default_run_dir(cfg: &TrainConfig) -> PathBuf {
    let name = match (&cfg.model.hf_config, &cfg.model.preset) {
        (Some(_), _) => "hf".to_string(),
        (None, Some(p)) => p.clone(),
        (None, None) => "run".to_string(),
    };
    let runs = PathBuf::from("runs");
    (1u64..)
        .map(|n| runs.join(format!("{name}-{n}")))
        .find(|d| !d.exists())
        .unwrap_or_else(|| runs.join(name))
}

/// Refuses a training budget beyond the memory of the device the run is on: it would choose a
/// batch this machine cannot hold (`--batch auto` under 1,000,000 TiB chose a million
/// sequences). `snug fit` and `snug plan` plan for other machines and take any size.
fn check_budget_here(text: &str, budget: usize, cfg: &TrainConfig) -> Result<()> {
    let (has, what, of) = if let snug_train::DeviceSpec::Gpu(selector) = cfg.device {
        // A CPU driver's memory is the machine's, which a run cannot exceed whatever
        // --device-memory says; wgpu reports no other adapter's.
        let known = snug_gpu::adapter::find(selector)?
            .and_then(|a| Some((usize::try_from(a.memory_bytes?).ok()?, a.memory_source()?)));
        // `device_memory` is the flag's, the TOML key's, or a resumed run's saved value.
        match (cfg.device_memory, known) {
            (Some(given), Some((has, source))) if given > has => anyhow::bail!(
                "device memory {} (--device-memory, or the TOML key device_memory, or the \
                 resumed run's): is more than --device {}'s memory, {} of {source}; training \
                 runs here, so give at most that; `snug fit` plans for other machines",
                human_bytes(given),
                cfg.device,
                human_bytes(has)
            ),
            (Some(given), _) => (Some(given), "the device memory given", String::new()),
            (None, Some((has, source))) => {
                (Some(has), "the adapter's memory", format!(" of {source}"))
            }
            (None, None) => (None, "", String::new()),
        }
    } else {
        (
            snug_runtime::process::total_memory(),
            "this machine's memory",
            String::new(),
        )
    };
    match has {
        Some(has) if budget > has => anyhow::bail!(
            "--memory {text}: {} is more than {what}, {}{of}; training runs here, so give at \
             most that, or --memory auto (what is free now); `snug fit` plans for other machines",
            human_bytes(budget),
            human_bytes(has)
        ),
        _ => Ok(()),
    }
}

/// `--memory SIZE` given as a size (not `auto`, which is measured after the data is in
/// memory, so already leaves it out), in bytes.
fn explicit_budget(args: &TrainArgs, cfg: &TrainConfig) -> Result<Option<u64>> {
    match args.memory.as_deref() {
        Some(m) if m.trim() != "auto" => Ok(Some(crate::fit_cmd::parse_budget(m, cfg)? as u64)),
        _ => Ok(None),
    }
}

/// Under `--memory SIZE`, refuses before reading it a text `--data` file whose loading would
/// take the whole budget (the text and its ids live outside the plan).
fn check_text_data(args: &TrainArgs, cfg: &TrainConfig) -> Result<()> {
    if let (DataSourceConfig::File(p), Some(budget)) = (&cfg.data, explicit_budget(args, cfg)?) {
        if !p.is_dir() {
            snug_train::data::check_text_data_budget(p, budget)?;
        }
    }
    Ok(())
}

/// With `--memory`: runs fit and applies its choice, with the budget as a strict limit.
/// Returns the machine profile fit used.
fn fit_to_memory(
    args: &TrainArgs,
    cfg: &mut TrainConfig,
    model: snug_nn::ModelConfig,
    out: &mut Stdout,
) -> Result<Option<snug_fit::MachineProfile>> {
    crate::fit_cmd::apply_device_memory(cfg, args.device_memory.as_deref())?;
    let Some(memory) = &args.memory else {
        if args.model.batch_auto() {
            anyhow::bail!("--batch auto needs a memory budget: add --memory SIZE (or auto)");
        }
        return Ok(None);
    };
    let mut budget = crate::fit_cmd::parse_budget(memory, cfg)?;
    if memory.trim() == "auto" {
        // Ranks on one machine share its memory, and must plan alike.
        let host_memory =
            !matches!(cfg.device, snug_train::DeviceSpec::Gpu(_)) || cfg.device_memory.is_none();
        budget = snug_train::ranks::shared_auto_budget(budget, host_memory);
    }
    check_budget_here(memory, budget, cfg)?;
    if args.model.batch_auto() {
        if cfg.devices > 1 {
            anyhow::bail!(
                "--batch auto searches one device: give --batch for a run over {} ranks",
                cfg.devices
            );
        }
        cfg.batch = crate::fit_cmd::largest_batch(cfg, &model, budget)?;
        cfg.accumulation = 1;
        let said = format!(
            "--batch auto: {} sequences of {} tokens a step, the most one micro-batch holds in {} \
             (fit then chooses how to run them)",
            cfg.batch,
            cfg.block,
            human_bytes(budget)
        );
        // Under --json stdout is JSON lines alone; the batch is in the `fit` line too.
        if args.json {
            eprintln!("{said}");
        } else {
            say!(out, "{said}");
        }
    }
    let fit_model = cfg.fit_model(model.clone());
    let (report, machine) = crate::fit_cmd::fit_config(
        cfg,
        model,
        budget,
        cfg.batch,
        args.recalibrate,
        // Over ranks each plans one rank of its stage: the budget is each device's.
        crate::fit_cmd::Spread {
            devices: cfg.devices,
            link: None,
            stage: Some(cfg.shard),
        },
    )?;
    let Some(chosen) = report.chosen() else {
        if !args.json {
            crate::fit_cmd::print_table(&report);
        }
        return Err(crate::fit_cmd::nothing_fits(&report, &fit_model, cfg));
    };
    if args.json {
        out.json("fit", &report)?;
    } else {
        say!(
            out,
            "fit: {} for a budget of {} (planned peak {}, predicted {:.3} s per step; {} candidates in {:.2} s)",
            chosen.config,
            human_bytes(budget),
            chosen.peak_bytes.map_or("-".into(), human_bytes),
            chosen.predicted_seconds.unwrap_or(0.0),
            report.candidates.len(),
            report.search_seconds
        );
    }
    // Set by flag or file, as fit reads them; a resumed checkpoint's own settings fit may
    // change without a word.
    let fresh = args.resume.is_none();
    let set = (
        (args.model.step.accumulation.is_some() || (fresh && cfg.accumulation != 1))
            .then_some(cfg.accumulation),
        (args.model.step.remat.is_some() || (fresh && cfg.remat != snug_compile::Remat::None))
            .then_some(cfg.remat),
    );
    if let Some(note) = crate::fit_cmd::not_kept(set, &chosen.config) {
        tracing::warn!("{note}");
    }
    cfg.apply_fit(&chosen.config);
    cfg.memory_limit = Some(budget);
    cfg.strict_memory_limit = true;
    Ok(Some(machine))
}

/// On another number of ranks than the checkpoint's, a resume keeps the run's micro-batch
/// (sequences per rank per forward pass) by scaling the accumulation, unless it is given: each
/// step then sums the same per-micro-batch gradients in the same order, so the run continues
/// bit for bit (two ranks' micro-batches of 2 are one process's two of 2, not one of 4). Where
/// the micro-batch cannot be kept (more ranks than it has micro-batches), the resume warns
/// that the last bits of the losses may differ from an uninterrupted run's.
fn keep_micro_batch(
    train: &mut snug_train::TrainSection,
    saved: &TrainConfig,
    ranks: usize,
    config_file: bool,
) {
    if saved.devices == ranks || train.accumulation.is_some() || config_file {
        return;
    }
    let micro_batches = saved.devices * saved.accumulation;
    if micro_batches.is_multiple_of(ranks) {
        let accumulation = micro_batches / ranks;
        if accumulation != saved.accumulation {
            tracing::info!(
                "resuming a run of {} ranks on {ranks}: its micro-batch of {} sequences kept, \
                 accumulating {accumulation} a step",
                saved.devices,
                saved.micro_batch()
            );
            train.accumulation = Some(accumulation);
        }
    } else {
        tracing::warn!(
            "resuming a run of {} ranks on {ranks}: its {micro_batches} micro-batches of {} \
             sequences a step do not divide among {ranks} ranks, so the step sums its gradients \
             in other groups: the losses may differ from an uninterrupted run's in their last \
             bits",
            saved.devices,
            saved.micro_batch()
        );
    }
}

/// Refuses a `--lower-memory-at` step outside the steps a run starting after `done` trains,
/// before a run directory is claimed for it.
fn check_lower_at(lower_at: Option<(u64, usize)>, done: u64, steps: u64) -> Result<()> {
    match lower_at {
        Some((at, _)) if at <= done || at > steps => anyhow::bail!(
            "--lower-memory-at {at}: this run trains steps {} to {steps}",
            done + 1
        ),
        _ => Ok(()),
    }
}

/// `STEP:SIZE` of `--lower-memory-at`.
fn parse_lower_at(text: &str) -> Result<(u64, usize)> {
    let (step, size) = text
        .split_once(':')
        .with_context(|| format!("--lower-memory-at `{text}`: expected STEP:SIZE, e.g. 5:400MB"))?;
    let step: u64 = step
        .trim()
        .parse()
        .with_context(|| format!("--lower-memory-at `{text}`: step `{step}` is not a number"))?;
    if step == 0 {
        anyhow::bail!("--lower-memory-at `{text}`: steps count from 1 (1 lowers the limit before the first step)");
    }
    let size =
        snug_runtime::parse_bytes(size).with_context(|| format!("--lower-memory-at `{text}`"))?;
    Ok((step, size))
}

/// The signals that stop a run cleanly: Ctrl-C, a scheduler's or `timeout`'s TERM, and the
/// hang-up of a closed terminal or SSH session.
#[cfg(unix)]
const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];

/// How soon the same stop signal again counts as the first one delivered twice.
#[cfg(unix)]
const REPEAT_MS: u64 = 250;

/// Milliseconds of the monotonic clock, read in a signal handler.
#[cfg(unix)]
fn monotonic_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec; CLOCK_MONOTONIC always exists on Linux and macOS.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64).saturating_mul(1000) + t.tv_nsec as u64 / 1_000_000
}

/// Until the loop's handlers are installed: a stop signal during the setup removes the
/// directory the run's claim made (it holds only the lock then; a directory holding anything
/// else is not removed), or in a directory that was there, the lock file the claim made, and
/// ends the process as the signal would by default. Dropped, the actions are removed.
struct SetupGuard(Vec<signal_hook::SigId>);

impl Drop for SetupGuard {
    fn drop(&mut self) {
        for id in self.0.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

fn guard_setup(run_dir: Option<&RunDir>) -> Result<SetupGuard> {
    #[allow(unused_mut)]
    let mut ids = Vec::new();
    #[cfg(unix)]
    if let Some(dir) = run_dir.filter(|d| d.created() || d.made_lock()) {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).ok();
        let lock = c(&dir.path().join(snug_train::run_dir::LOCK_FILE));
        // The directory, then the parents the claim made, innermost first; none where the
        // directory was there before.
        let made = dir.created().then_some(dir.path());
        let dirs: Option<Vec<_>> = made
            .into_iter()
            .chain(dir.made_parents().iter().map(PathBuf::as_path))
            .map(c)
            .collect();
        if let (Some(lock), Some(dirs)) = (lock, dirs) {
            let (lock, dirs) = (Arc::new(lock), Arc::new(dirs));
            for sig in STOP_SIGNALS {
                let (lock, dirs) = (Arc::clone(&lock), Arc::clone(&dirs));
                let action = move || {
                    // SAFETY: unlink and rmdir are async-signal-safe; the paths were made
                    // before the handler was installed. rmdir fails on a directory that is
                    // not empty, which then stays, and so do its parents.
                    unsafe {
                        libc::unlink(lock.as_ptr());
                        for d in dirs.iter() {
                            if libc::rmdir(d.as_ptr()) != 0 {
                                break;
                            }
                        }
                    }
                    let _ = signal_hook::low_level::emulate_default_handler(sig);
                };
                // SAFETY: the action allocates and locks nothing (see above).
                let id = unsafe { signal_hook::low_level::register(sig, action) }
                    .context("installing the signal handler")?;
                ids.push(id);
            }
        }
    }
    Ok(SetupGuard(ids))
}

/// What a stop signal sets: the flag the run checks between steps, and which signal it was (0:
/// none), so the process can end as that signal's status once the state is saved.
struct StopFlag {
    stop: Arc<AtomicBool>,
    signal: Arc<AtomicUsize>,
}

impl StopFlag {
    fn new() -> StopFlag {
        StopFlag {
            stop: Arc::new(AtomicBool::new(false)),
            signal: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Installs the handlers, as the loop starts: before it there is no state to save, and a
    /// signal during setup (a long search or load) ends the process at once, as by default.
    /// Once installed, a second signal ends the process at once, with its status, except the
    /// same signal again within [`REPEAT_MS`]: GNU `timeout` sends its TERM to the process
    /// and then to its group, and a shell may pass a Ctrl-C on as well; taken for a second
    /// signal, that lost the run it meant to stop cleanly.
    fn install(&self) -> Result<()> {
        #[cfg(unix)]
        for sig in STOP_SIGNALS {
            let (stop, signal) = (Arc::clone(&self.stop), Arc::clone(&self.signal));
            let first_ms = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let handler = move || {
                let now = monotonic_ms();
                if stop.load(Ordering::SeqCst) {
                    let repeat = signal.load(Ordering::SeqCst) == sig as usize
                        && now.saturating_sub(first_ms.load(Ordering::SeqCst)) < REPEAT_MS;
                    if !repeat {
                        signal_hook::low_level::exit(128 + sig);
                    }
                    return;
                }
                first_ms.store(now, Ordering::SeqCst);
                signal.store(sig as usize, Ordering::SeqCst);
                stop.store(true, Ordering::SeqCst);
            };
            // SAFETY: the handler only reads the clock (clock_gettime is async-signal-safe),
            // touches atomics and may call `_exit`; it allocates and locks nothing.
            unsafe { signal_hook::low_level::register(sig, handler) }
                .context("installing the signal handler")?;
        }
        Ok(())
    }

    /// How the process ends after a run that finished or saved its state: 0, or, stopped by a
    /// signal, 128 + its number as a shell reports it, so a script or scheduler (`&&`, Slurm's
    /// requeue) does not take an interrupted run for a finished one.
    fn exit_code(&self) -> ExitCode {
        match self.signal.load(Ordering::Relaxed) {
            0 => ExitCode::SUCCESS,
            sig => ExitCode::from(u8::try_from(128 + sig).unwrap_or(u8::MAX)),
        }
    }
}

/// The run directory a checkpoint (or a sharded checkpoint's manifest) at `path` lies in.
fn run_dir_of(path: &Path) -> PathBuf {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Whether `a` and `b` are the same existing directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    matches!(
        (std::fs::canonicalize(a), std::fs::canonicalize(b)),
        (Ok(a), Ok(b)) if a == b
    )
}

/// What `--json` says of a resume that found nothing to train (`already_complete`).
#[derive(Serialize)]
struct Complete<'a> {
    already_complete: bool,
    steps: u64,
    start_step: u64,
    interrupted: bool,
    checkpoint: &'a Path,
}

/// Says that the run resumed from the checkpoint at `path` (in `dir`) is already at its last
/// step `step`, so nothing was trained and nothing written.
fn already_complete(
    out: &mut Stdout,
    json: bool,
    path: &Path,
    dir: &Path,
    step: u64,
    report: bool,
) -> Result<()> {
    if report {
        tracing::warn!(
            "--report: no page written, as nothing ran; `snug report --run {}` writes one",
            dir.display()
        );
    }
    if json {
        let done = Complete {
            already_complete: true,
            steps: step,
            start_step: step,
            interrupted: false,
            checkpoint: path,
        };
        out.json("summary", &done)?;
    } else {
        say!(
            out,
            "{}: the run is already complete (step {step} of --steps {step}); nothing trained, \
             nothing in {} written: give --steps above {step} to train further",
            path.display(),
            dir.display()
        );
    }
    match out.broken.take() {
        Some(e) => Err(anyhow::Error::new(e).context("standard output closed")),
        None => Ok(()),
    }
}

/// Trains; `Ok` carries the exit status (non-zero when a signal stopped the run after saving).
/// A warmup as long as the run (the default's 20 steps, say, in a short fine-tune) never
/// decays, and a longer one never reaches the peak learning rate: said before it starts.
fn warmup_note(cfg: &TrainConfig) -> Option<String> {
    let (warmup, steps) = (cfg.warmup_steps, cfg.steps);
    if steps == 0 || warmup < steps {
        return None;
    }
    let reached = if warmup == steps {
        format!("reaches --lr {:.3e} only at the last step", cfg.lr)
    } else {
        format!(
            "rises to {:.3e}, never reaching --lr {:.3e},",
            cfg.lr * steps as f32 / warmup as f32,
            cfg.lr
        )
    };
    Some(format!(
        "--warmup-steps {warmup} is not below --steps {steps}: the learning rate {reached} and \
         never decays (give a --warmup-steps below {steps})"
    ))
}

pub fn run(args: TrainArgs) -> Result<ExitCode> {
    // Parsed again where the run resolves, whose error names the TOML key, not the flag.
    if let Some(text) = &args.run.memory_limit {
        snug_runtime::parse_bytes(text).with_context(|| format!("--memory-limit {text}"))?;
    }
    // Checked before the run is set up, which may take long.
    let lower_at = args
        .lower_memory_at
        .as_deref()
        .map(parse_lower_at)
        .transpose()?;
    let (model, mut train) = args.model.sections(args.run.clone());
    let json = args.json;
    // Under mpirun the run spans the ranks it started; `--devices`, given, must say as many.
    let (rank, ranks) = snug_cpu::kernels::collective::world();
    // Said first: a batch that splits over the ranks asked for but not over those started
    // would otherwise be refused for the wrong reason.
    if let Some(devices) = train.devices.filter(|&d| d != ranks) {
        bail!(
            "--devices {devices}: this process is rank {rank} of {ranks}; launch the run with \
             `mpirun -np {devices} snug train …` (on a build with the `mpi` feature), or leave \
             --devices out"
        );
    }
    train.devices.get_or_insert(ranks);
    #[cfg(unix)]
    // SAFETY: changing one signal's disposition before any thread starts. A closed stdout
    // then fails the write (see `Stdout`) instead of killing the process mid-step.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let stop_flag = StopFlag::new();
    let stop = Arc::clone(&stop_flag.stop);
    let mut out = Stdout {
        broken: None,
        stop: Arc::clone(&stop),
    };
    let allocator = Allocator::cpu();
    let config_file = args.model.config.as_deref();
    let machine;
    // The run directory is claimed (locked, checked to hold no other run) before the setup's
    // work, so a refusal comes at once.
    let (cfg, data, mut trainer, run_dir, setup_guard) = match &args.resume {
        Some(from) => {
            if let Some(init) = &train.init_from {
                bail!(
                    "--init-from {}: a resumed run continues from its checkpoint's weights; \
                     --init-from starts a new run from others (give one of the two)",
                    init.display()
                );
            }
            let (path, ckpt) = checkpoint::load(from)?;
            // A sharded run's checkpoint consolidates, so one process continues it unsharded
            // unless told otherwise.
            if ranks == 1 && ckpt.config.shard > 0 && train.shard.is_none() {
                tracing::info!(
                    "resuming ZeRO stage {} over {} ranks in one process, unsharded",
                    ckpt.config.shard,
                    ckpt.config.devices
                );
                train.shard = Some(0);
            }
            keep_micro_batch(&mut train, &ckpt.config, ranks, config_file.is_some());
            if train.out.is_none() {
                // Keep saving where the run lives.
                train.out = Some(if from.is_dir() {
                    from.clone()
                } else {
                    from.parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .map_or_else(|| PathBuf::from("."), |p| p.to_path_buf())
                });
            }
            let mut cfg =
                TrainConfig::resolve_resumed(ckpt.config.clone(), config_file, &model, &train)?;
            // The flag is refused above; a configuration file's is refused here alike.
            if cfg.init_from != ckpt.config.init_from {
                bail!(
                    "init_from: a resumed run continues from its checkpoint's weights; a \
                     configuration's init_from starts a new run from others (leave it out to \
                     resume)"
                );
            }
            // Fewer steps than done: refused before the checkpoint is saved again under a step
            // count the run has passed.
            if cfg.steps < ckpt.step {
                bail!(
                    "{}: the run is already at step {}, past the {} asked for: give --steps \
                     above {} to train further",
                    path.display(),
                    ckpt.step,
                    cfg.steps,
                    ckpt.step
                );
            }
            // As many: nothing to train. Saved again into its own directory, the checkpoint
            // would record whatever flags were given here (a mistyped --lr), so the run is
            // left as it is, unless it owes the evaluation a stop cut short. Into another
            // `--out` it is saved as before: how a checkpoint moves between one process and
            // ranks, sharded or whole.
            let home = run_dir_of(&path);
            if cfg.steps == ckpt.step
                && cfg.out.as_deref().is_some_and(|out| same_dir(out, &home))
                && !snug_train::run::evaluation_owed(&cfg, &home, ckpt.step)
            {
                already_complete(&mut out, json, &path, &home, ckpt.step, args.report)?;
                return Ok(ExitCode::SUCCESS);
            }
            // A resumed run trains what it trained: fit (`--memory`) and recovery may change
            // how, never what; its precision changes only when asked (`--precision`).
            cfg.allow = snug_fit::Levers::none();
            cfg.precision_pinned = true;
            if rank != 0 {
                cfg.out = None; // rank 0 alone saves
            }
            check_lower_at(lower_at, ckpt.step, cfg.steps)?;
            if let (true, Some(dir)) = (args.report, &cfg.out) {
                crate::report_cmd::check_run_page(dir, cfg.run_id.as_deref())?;
            }
            let claim = Claim::Resume {
                from: from.clone(),
                step: ckpt.step,
            };
            let run_dir = cfg
                .out
                .as_deref()
                .map(|dir| RunDir::claim(dir, &claim))
                .transpose()?;
            let guard = guard_setup(run_dir.as_ref())?;
            let data_path = match &cfg.data {
                DataSourceConfig::File(p) => Some(p.clone()),
                DataSourceConfig::Addition => None,
            };
            // The checkpoint's weights and tokenizer replace the run's starting point: its
            // directory is not needed again (and may have moved).
            cfg.init_from = None;
            let tokenizer = snug_train::Tokenizer::from_spec(&ckpt.tokenizer)?;
            check_text_data(&args, &cfg)?;
            let (data, model) = cfg
                .load_data_and_model_with(Some(&tokenizer))
                .with_context(|| match &data_path {
                    // Saved as given, so relative to where the run started.
                    Some(p) if p.is_relative() && !p.exists() => format!(
                        "the run's data, {}, is named relative to the directory the run started \
                     in: resume from there, or give --data",
                        p.display()
                    ),
                    // The tokenizer is the checkpoint's, which other data may not fit.
                    Some(p) => format!(
                        "loading the run's data, {}, with the tokenizer saved in its checkpoint \
                         {} (a resumed run keeps the tokenizer it trained with)",
                        p.display(),
                        path.display()
                    ),
                    None => format!(
                        "loading the run's built-in data with the tokenizer saved in its \
                         checkpoint {}",
                        path.display()
                    ),
                })?;
            machine = fit_to_memory(&args, &mut cfg, model, &mut out)?;
            let summary = data_line(&data);
            let trainer = Trainer::resume(cfg.clone(), data, allocator.clone(), &ckpt)
                .with_context(|| format!("resuming from {}", path.display()))?;
            tracing::info!("resumed from {} at step {}", path.display(), ckpt.step);
            (cfg, summary, trainer, run_dir, guard)
        }
        None => {
            let mut cfg = args.model.resolve(&model, &train)?;
            crate::fit_cmd::set_allowed(&mut cfg, args.allow.as_deref())?;
            if let Some(note) = warmup_note(&cfg) {
                tracing::warn!("{note}");
            }
            // Whether snug numbered the run's directory itself.
            let mut numbered = false;
            if rank != 0 {
                cfg.out = None; // rank 0 alone saves
            } else if cfg.out.is_none() && !args.no_save {
                cfg.out = Some(default_run_dir(&cfg));
                numbered = true;
            }
            // Refused at once, before the data and weights load.
            check_lower_at(lower_at, 0, cfg.steps)?;
            if let (true, Some(dir)) = (args.report, &cfg.out) {
                crate::report_cmd::check_run_page(dir, None)?;
            }
            if let (Some(init), Some(out)) = (&cfg.init_from, &cfg.out) {
                let resolved = |p: &Path| std::fs::canonicalize(p).ok();
                if init.is_dir() && resolved(init).is_some() && resolved(init) == resolved(out) {
                    anyhow::bail!(
                        "--out {}: is the model directory --init-from reads; a run there would \
                         leave a directory that is both, which `sample` and `export` cannot \
                         tell apart: give the run a directory of its own",
                        out.display()
                    );
                }
            }
            // Bad data or flags are refused before a run directory is made for them.
            check_text_data(&args, &cfg)?;
            let (data, model) = cfg.load_data_and_model()?;
            cfg.check_threads_here()?;
            if let Some(file) = cfg.init_from.as_deref().filter(|p| p.is_file()) {
                // A model directory's tokenizer.json is checked against the data; a lone file
                // brings none, so ids the data gives another meaning would train silently.
                tracing::warn!(
                    "--init-from {}: a lone weights file names no tokenizer, so the data's token \
                     ids are taken to mean what they meant to these weights; give its model \
                     directory (with tokenizer.json) to have that checked",
                    file.display()
                );
            }
            if let Some(init) = cfg
                .init_from
                .as_deref()
                .filter(|p| snug_nn::lora::is_adapter_dir(p))
            {
                for note in snug_nn::lora::adapter_notes(init)? {
                    tracing::warn!("{note}");
                }
            }
            let run_dir = claim_fresh(&mut cfg, numbered)?;
            let guard = guard_setup(run_dir.as_ref())?;
            machine = fit_to_memory(&args, &mut cfg, model, &mut out)?;
            let summary = data_line(&data);
            let trainer = Trainer::with_allocator(cfg.clone(), data, allocator.clone())
                .context("setting up training")?;
            (cfg, summary, trainer, run_dir, guard)
        }
    };
    // The device's allocator: on a GPU the trainer's own, over device memory.
    let allocator = trainer.session().allocator().clone();
    // 0 (the default) picks a cadence: every step where a person watches, every 10th in a log.
    let log_every = match cfg.log_every {
        0 if std::io::IsTerminal::is_terminal(&std::io::stderr()) => 1,
        0 => 10,
        n => n,
    };
    if !json {
        if args.verbose {
            say!(out, "config: {}", serde_json::to_string(&cfg)?);
        }
        say!(out, "{data}");
        if let Some(dir) = &cfg.out {
            say!(out, "run directory: {}", dir.display());
        }
    }
    let plan = trainer.plan().clone();
    let params = trainer.step_graph().parameter_count();
    let tokens_per_step = cfg.batch.saturating_mul(cfg.block);
    let flops_per_step = trainer.model().flops_per_token(cfg.block) as f64 * tokens_per_step as f64;
    if !json && cfg.device.is_gpu() {
        say!(out, "device: {}", trainer.session().device_name());
    }
    if !json {
        say!(
            out,
            "model: {} parameters; step of {} tokens ({} micro-batch(es) of {}); predicted peak {} (persistent {}, arena {}, lower bound {})",
            params,
            tokens_per_step,
            cfg.accumulation,
            cfg.micro_batch(),
            human_bytes(plan.peak_bytes()),
            human_bytes(plan.persistent_bytes),
            human_bytes(plan.arena_bytes),
            human_bytes(plan.lower_bound_bytes)
        );
    }
    if !json && cfg.devices > 1 {
        say!(
            out,
            "ranks: {} (ZeRO stage {}), each training {} sequences of the batch; the peak is each rank's",
            cfg.devices,
            cfg.shard,
            cfg.batch / cfg.devices
        );
    }
    let lower = |step: u64| {
        if let Some((at, bytes)) = lower_at {
            if step + 1 == at {
                allocator.set_memory_limit(bytes, false);
                tracing::warn!(
                    "memory limit lowered to {} (strict) after step {step}, before step {at}",
                    human_bytes(bytes)
                );
            }
        }
    };
    lower(trainer.steps_done());
    // After the setup's long work, before the terminal is taken for the dashboard.
    drop(setup_guard);
    stop_flag.install()?;
    let bar = if json || args.dashboard {
        ProgressBar::hidden()
    } else {
        // Hidden automatically when stderr is not a terminal.
        let bar = ProgressBar::new(cfg.steps);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(trainer.steps_done());
        bar
    };
    let mut dash = if args.dashboard {
        let state = DashboardState {
            title: format!(
                "snug train: {params} parameters, {tokens_per_step} tokens a step{} (Ctrl-C stops after the step, saving)",
                cfg.out
                    .as_deref()
                    .map_or(String::new(), |d| format!(", run directory {}", d.display()))
            ),
            total_steps: cfg.steps,
            start_step: trainer.steps_done(),
            planned_peak_bytes: plan.peak_bytes(),
            ..DashboardState::default()
        };
        let view = Dashboard::open(state).context("opening the --dashboard view")?;
        if view.is_none() {
            tracing::warn!(
                "--dashboard needs a terminal on standard error; printing progress lines instead"
            );
        }
        view
    } else {
        None
    };
    // Lines printed during the run would scribble over the view.
    let quiet = dash.is_some();
    let mut tracker = if args.track_speed {
        match snug_train::calibration::cached(cfg.threads) {
            Some(profile) => {
                let base = profile.step_seconds(trainer.step_graph(), &trainer.plan().schedule);
                Some(SpeedTracker::start(profile, base, cfg.threads)?)
            }
            None => {
                tracing::warn!(
                    "--track-speed: no calibration for {} threads is cached (`snug fit --recalibrate` makes one); not tracking",
                    cfg.threads
                );
                None
            }
        }
    } else {
        None
    };
    let mut tracked: Vec<StepSpeed> = Vec::new();
    let mut out_err: Option<serde_json::Error> = None;
    let mut saved: Option<(u64, PathBuf)> = None;
    let started_at = trainer.steps_done();
    let mut print_event = |event: Event<'_>| match event {
        Event::Recovered(r) => {
            // The prediction was for the configuration the run started with.
            tracker = None;
            if json {
                if let Err(e) = out.json("recovery", r) {
                    out_err.get_or_insert(e);
                }
            } else if !quiet {
                let at = if r.evaluation {
                    format!("in the evaluation after step {}", r.step)
                } else {
                    format!("at step {} (micro-batch {})", r.step, r.micro)
                };
                bar.suspend(|| {
                    say!(
                        out,
                        "recovered {at}: out of memory {}; now {} (planned peak {}, was {} with {})",
                        r.failure.cause(),
                        r.to,
                        human_bytes(r.to_peak_bytes),
                        human_bytes(r.from_peak_bytes),
                        r.from
                    )
                });
            }
        }
        Event::Step(s) => {
            if let Some(t) = &mut tracker {
                match t.after_step(s.step, s.ms) {
                    Ok(sp) => {
                        if json {
                            if let Err(e) = out.json("speed", &sp) {
                                out_err.get_or_insert(e);
                            }
                        } else if !quiet
                            && (s.step % log_every == 0 || s.step == 1 || s.step == cfg.steps)
                        {
                            bar.suspend(|| {
                                say!(
                                    out,
                                    "step {:>5}: predicted {:.1} ms at {:.2}x the calibration's speed, measured {:.1} ms ({:+.0} %)",
                                    sp.step,
                                    sp.predicted_step_ms,
                                    sp.speed,
                                    sp.measured_step_ms,
                                    sp.error * 100.0
                                )
                            });
                        }
                        tracked.push(sp);
                    }
                    Err(e) => {
                        // A diagnostic: its failure must not fail the run it watches.
                        bar.suspend(|| tracing::warn!("--track-speed stopped: {e}"));
                        tracker = None;
                    }
                }
            }
            lower(s.step);
            bar.set_position(s.step);
            bar.set_message(format!(
                "loss {:.4} | lr {:.2e} | {:.0} tok/s | mem {}",
                s.loss,
                s.lr,
                s.tokens_per_s,
                human_bytes(s.active_bytes)
            ));
            if json {
                if let Err(e) = out.json("step", s) {
                    out_err.get_or_insert(e);
                }
            } else if !quiet && (s.step % log_every == 0 || s.step == 1 || s.step == cfg.steps) {
                bar.suspend(|| {
                    say!(
                        out,
                        "step {:>5}/{} | loss {:.4} | lr {:.2e} | norm {} | {:>8.0} tok/s | {:>7.1} ms | mem {} / peak {} / cache {}{}",
                        s.step,
                        cfg.steps,
                        s.loss,
                        s.lr,
                        s.grad_norm.map_or("-".into(), |n| format!("{n:.3}")),
                        s.tokens_per_s,
                        s.ms,
                        human_bytes(s.active_bytes),
                        human_bytes(s.peak_bytes),
                        human_bytes(s.cache_bytes),
                        match (s.skipped, s.loss_scale) {
                            (true, Some(scale)) => format!(
                                " | overflow: update skipped, loss scale {scale} -> {}",
                                scale / 2.0
                            ),
                            _ => String::new(),
                        }
                    )
                });
            }
        }
        Event::Eval(e) => {
            if json {
                if let Err(err) = out.json("eval", e) {
                    out_err.get_or_insert(err);
                }
            } else if !quiet {
                bar.suspend(|| {
                    say!(
                        out,
                        "eval  {:>5} | train loss {:.4} | val loss {:.4} | {:.0} ms",
                        e.step,
                        e.train_loss,
                        e.val_loss,
                        e.ms
                    )
                });
            }
        }
        Event::Checkpoint { step, path } => {
            saved = Some((step, path.to_path_buf()));
            if !quiet {
                bar.suspend(|| tracing::info!("saved checkpoint {} (step {step})", path.display()));
            }
        }
        Event::Stopping { step } if !quiet => {
            bar.suspend(|| tracing::warn!("interrupted: stopping after step {step}"));
        }
        Event::Stopping { .. } => {}
    };
    let result = snug_train::run(&mut trainer, run_dir, &stop, |event| {
        if let Some(view) = dash.as_mut() {
            match &event {
                Event::Step(s) => view.state.step(s),
                Event::Eval(e) => view.state.eval(e),
                Event::Recovered(r) => view.state.say(format!(
                    "step {}: out of memory {}; now {} (planned peak {})",
                    r.step,
                    r.failure.cause(),
                    r.to,
                    human_bytes(r.to_peak_bytes)
                )),
                Event::Checkpoint { step, path } => view
                    .state
                    .say(format!("step {step}: saved {}", path.display())),
                Event::Stopping { step } => view
                    .state
                    .say(format!("interrupted: stopping after step {step}")),
            }
            if let Err(e) = view.redraw(false) {
                tracing::warn!("--dashboard stopped: {e}");
                dash = None;
            }
        }
        print_event(event)
    });
    // The terminal comes back before the summary prints.
    drop(dash);
    bar.finish_and_clear();
    let resume_hint = |step: u64| match &cfg.out {
        Some(dir) => format!(
            "the state after step {step} is saved in {}: continue with `snug train --resume {}`",
            dir.display(),
            dir.display()
        ),
        None => format!("stopped after step {step}; nothing saved (no run directory)"),
    };
    let run = match result {
        Ok(run) => run,
        Err(e) => {
            return Err(match (saved, &args.resume) {
                (Some((step, _)), _) => anyhow::Error::new(e).context(resume_hint(step)),
                // A resumed run that saved nothing leaves the checkpoint it resumed from.
                (None, Some(from)) if started_at > 0 && cfg.out.is_some() => anyhow::Error::new(e)
                    .context(format!(
                        "nothing saved since step {started_at}, the checkpoint this run resumed: \
                     continue with `snug train --resume {}`",
                        from.display()
                    )),
                (None, _) => e.into(),
            });
        }
    };
    if let Some(e) = out.broken.take() {
        anyhow::bail!(
            "standard output closed ({e}); {}",
            resume_hint(run.end_step)
        );
    }
    if let Some(e) = out_err {
        return Err(e.into());
    }
    let tracked_predicted_step_ms = (!tracked.is_empty()).then(|| {
        let preds: Vec<f64> = tracked.iter().map(|t| t.predicted_step_ms).collect();
        let steady = if preds.len() > 1 {
            &preds[1..]
        } else {
            &preds[..]
        };
        stats(steady).0
    });
    // The first step pays for page faults and thread start-up: leave it out when there are more.
    let times = &run.step_ms;
    let steady: Vec<f64> = if times.len() > 1 {
        times[1..].to_vec()
    } else {
        times.clone()
    };
    let (median, min, max) = stats(&steady);
    let per_s = |x: f64| {
        if median > 0.0 {
            x / (median / 1e3)
        } else {
            0.0
        }
    };
    let mut summary = Summary {
        device: trainer.session().device_name(),
        steps: run.end_step,
        start_step: run.start_step,
        interrupted: run.interrupted,
        first_loss: run.first_loss,
        final_loss: run.final_loss,
        train_loss: run.last_eval.map(|e| e.train_loss),
        val_loss: run.last_eval.map(|e| e.val_loss),
        median_step_ms: median,
        // The calibration times this machine's CPU kernels.
        predicted_step_ms: machine
            // Nominal figures rank candidates; they do not predict this machine's time.
            .filter(|m| m.is_measured())
            .or_else(|| {
                snug_train::calibration::cached_now(cfg.threads)
                    .ok()
                    .flatten()
            })
            .filter(|_| !cfg.device.is_gpu())
            .map(|m| m.step_seconds(trainer.step_graph(), &trainer.plan().schedule) * 1e3),
        tracked_predicted_step_ms,
        min_step_ms: min,
        max_step_ms: max,
        tokens_per_step,
        tokens_per_s: per_s(tokens_per_step as f64),
        model_flops_per_s: per_s(flops_per_step),
        predicted_peak_bytes: trainer.plan().peak_bytes(),
        measured_peak_bytes: allocator.peak_bytes(),
        run_peak_bytes: trainer.run_peak_bytes(),
        lower_bound_bytes: trainer.plan().lower_bound_bytes,
        arena_bytes: trainer.plan().arena_bytes,
        peak_rss_bytes: resident_set().map(|(_, peak)| peak),
        cache_bytes: allocator.cache_bytes(),
        memory_limit_bytes: match allocator.memory_limit() {
            (usize::MAX, _) => None,
            (limit, _) => Some(limit),
        },
        limit_overruns: allocator.stats().limit_overruns,
        recoveries: run.recoveries.len(),
        parameters: params,
        checkpoint: run.checkpoint.clone(),
        metrics: run.metrics.clone(),
        addition_accuracy: None,
        addition: None,
        addition_skipped: None,
        report: None,
        already_complete: false,
    };
    // After the figures above, so the page's memory is in none of them.
    if let (true, Some(dir)) = (args.report, &cfg.out) {
        // Checked again: a page written there while the run trained (`snug report -o`) is
        // someone's, and a run that saved its state does not fail for want of a page.
        match crate::report_cmd::check_run_page(dir, trainer.config().run_id.as_deref()) {
            Ok(()) => summary.report = Some(crate::report_cmd::write_for_run(&trainer, &cfg, dir)?),
            Err(e) => tracing::warn!("{e:#}; no page written"),
        }
    }
    // After the step's figures above, so the scoring's memory is in none of them; the peak
    // RSS is the whole process's, scoring included.
    if cfg.data == DataSourceConfig::Addition && !run.interrupted {
        match addition_score(trainer, &allocator).context("scoring held-out additions")? {
            Ok(score) => {
                summary.addition_accuracy = Some(score.accuracy());
                summary.addition = Some(score);
            }
            Err(why) => summary.addition_skipped = Some(why),
        }
    }
    summary.peak_rss_bytes = resident_set().map(|(_, peak)| peak);
    if json {
        out.json("summary", &summary)?;
        return Ok(stop_flag.exit_code());
    }
    let fmt_loss = |l: Option<f32>| l.map_or("-".into(), |l| format!("{l:.4}"));
    say!(
        out,
        "done: steps {}..{}; loss {} -> {}; median step {:.1} ms (min {:.1}, max {:.1}), {:.0} tok/s, {:.1} model GFLOP/s",
        summary.start_step,
        summary.steps,
        fmt_loss(summary.first_loss),
        fmt_loss(summary.final_loss),
        median,
        min,
        max,
        summary.tokens_per_s,
        summary.model_flops_per_s / 1e9
    );
    if let Some(p) = summary.predicted_step_ms {
        say!(
            out,
            "predicted step {p:.1} ms by fit's cost model (calibrated on this machine)"
        );
    }
    if let Some(p) = summary.tracked_predicted_step_ms {
        say!(
        out,
            "predicted at the speed around each step: median {p:.1} ms against {median:.1} ms measured ({:+.0} %)",
            (median - p) / p * 100.0
        );
    }
    if let Some(e) = run.last_eval {
        say!(
            out,
            "eval at step {}: train loss {:.4}, val loss {:.4}",
            e.step,
            e.train_loss,
            e.val_loss
        );
    }
    say!(
        out,
        "memory: predicted peak {}, measured peak {} ({}), peak RSS {}",
        human_bytes(summary.predicted_peak_bytes),
        human_bytes(summary.measured_peak_bytes),
        if summary.predicted_peak_bytes == summary.measured_peak_bytes {
            "exact"
        } else {
            "MISMATCH: please report it"
        },
        summary.peak_rss_bytes.map_or("n/a".into(), human_bytes)
    );
    if summary.run_peak_bytes != summary.measured_peak_bytes {
        say!(
            out,
            "memory: the plan before the recovery held up to {}; the figures above are the plan the run switched to",
            human_bytes(summary.run_peak_bytes)
        );
    }
    if let Some(page) = &summary.report {
        say!(out, "report: {}", page.display());
    }
    if summary.limit_overruns > 0 {
        say!(
            out,
            "warning: {} allocation(s) exceeded the relaxed memory limit of {}",
            summary.limit_overruns,
            cfg.memory_limit.map_or("-".into(), human_bytes)
        );
    }
    if let Some(why) = &summary.addition_skipped {
        say!(out, "{why}");
    }
    if let Some(a) = &summary.addition {
        say!(
            out,
            "addition accuracy on {} held-out problems: {:.1} % ({} right, greedy decoding, {:.1} s){}",
            a.problems,
            a.accuracy() * 100.0,
            a.correct,
            a.ms / 1e3,
            if a.wrong.is_empty() {
                String::new()
            } else {
                format!("; e.g. {}", a.wrong.join(", "))
            }
        );
    }
    if let Some(path) = &summary.checkpoint {
        say!(out, "checkpoint: {}", path.display());
    }
    if run.interrupted {
        say!(out, "interrupted: {}", resume_hint(summary.steps));
    } else if let Some(dir) = &cfg.out {
        // `snug sample` alone picks the newest run under ./runs, which this one now is.
        let bare = if dir.parent() == Some(Path::new("runs")) {
            "`snug sample` or "
        } else {
            ""
        };
        say!(
            out,
            "sample from it with {bare}`snug sample --checkpoint {} --prompt TEXT`",
            dir.display()
        );
    }
    if let Some(e) = out.broken.take() {
        anyhow::bail!("standard output closed ({e}) after the run finished");
    }
    Ok(stop_flag.exit_code())
}

/// The trained weights' accuracy on held-out additions, on the inference plan (the training
/// step's figures stay its own), or why they were not scored. The trainer goes first, so its
/// memory is free for the scoring. On the CPU under `--memory`, the scoring keeps to the same
/// limit, its copy of the weights counted: where it needs more, it is left out, not run over
/// the budget.
fn addition_score(
    trainer: Trainer,
    allocator: &Allocator,
) -> Result<std::result::Result<AdditionScore, String>> {
    let model = trainer.model().clone();
    let tokenizer = trainer.data().tokenizer.clone();
    let threads = trainer.config().threads;
    let on_cpu = !trainer.config().device.is_gpu();
    let (limit, relaxed) = allocator.memory_limit();
    // Only the problems' context: a model's whole window (a Llama's is 131,072 positions)
    // would be caches no problem reads.
    let window = addition::SCORING_CONTEXT.min(model.max_seq());
    let placement = snug_train::Placement {
        context: Some(window),
        ..snug_train::Placement::CPU
    };
    let mode = snug_train::SampleMode::KvCache;
    // The weights as the sampler is made from them: every parameter in f32 (a QLoRA base
    // merged), a copy beside the trainer's memory until that is freed.
    let held = 4 * model.parameter_count();
    let limited = on_cpu && limit != usize::MAX;
    if limited {
        let planned =
            snug_train::sample::planned_peak(&model, mode, placement, threads, (window, window))?;
        let needed = (planned + held).max(allocator.active_bytes() + held);
        if needed > limit {
            return Ok(Err(format!(
                "held-out additions not scored: scoring needs {} (its plan {}, its f32 copy of \
                 the weights {}, and the trainer's memory while the copy is made), over the \
                 memory limit of {}",
                human_bytes(needed),
                human_bytes(planned),
                human_bytes(held),
                human_bytes(limit)
            )));
        }
    }
    let weights = trainer.model_weights()?;
    drop(trainer);
    let out_of_memory = |e: &snug_train::TrainError| {
        matches!(
            e,
            snug_train::TrainError::Runtime(snug_runtime::RuntimeError::OutOfMemory(_))
        )
    };
    // Planned within the limit above, so these never run out; if they do, the run that
    // trained is not failed for its scoring.
    let not_scored = |e: snug_train::TrainError| format!("held-out additions not scored: {e}");
    let on = if limited {
        allocator.clear_cache();
        allocator.set_memory_limit(limit - held, relaxed);
        allocator.clone()
    } else {
        Allocator::default()
    };
    let placed = Sampler::placed(&model, &weights, mode, placement, threads, on);
    if limited {
        allocator.set_memory_limit(limit, relaxed);
    }
    drop(weights);
    let mut sampler = match placed {
        Err(e) if out_of_memory(&e) => return Ok(Err(not_scored(e))),
        other => other?,
    };
    match addition::held_out_accuracy(&mut sampler, &tokenizer, addition::DEFAULT_PROBLEMS) {
        Err(e) if out_of_memory(&e) => Ok(Err(not_scored(e))),
        other => Ok(Ok(other?)),
    }
}

fn data_line(data: &TokenDataset) -> String {
    format!(
        "data: {} ({} train / {} val tokens, {} tokenizer, vocab {}{})",
        data.name,
        data.train.len(),
        data.val.len(),
        data.tokenizer.name(),
        data.tokenizer.vocab_size(),
        if data.has_loss_mask() {
            ", loss mask: only the targets it counts are trained on"
        } else {
            ""
        }
    )
}

/// One JSON line: `value`'s fields plus `"kind": kind`.
pub(crate) fn json_line<T: Serialize>(kind: &str, value: &T) -> serde_json::Result<String> {
    let mut v = serde_json::to_value(value)?;
    if let serde_json::Value::Object(map) = &mut v {
        map.insert("kind".into(), kind.into());
    }
    serde_json::to_string(&v)
}

/// Prints [`json_line`].
pub(crate) fn print_json<T: Serialize>(kind: &str, value: &T) -> serde_json::Result<()> {
    println!("{}", json_line(kind, value)?);
    Ok(())
}

/// Median, min and max of `v` (zeros when empty).
pub(crate) fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let median = if s.is_empty() {
        0.0
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (
        median,
        s.first().copied().unwrap_or(0.0),
        s.last().copied().unwrap_or(0.0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warmup_as_long_as_the_run_is_named_with_the_rate_it_reaches() {
        let mut cfg = TrainConfig {
            steps: 5,
            warmup_steps: 20,
            lr: 1e-3,
            ..TrainConfig::default()
        };
        let note = warmup_note(&cfg).expect("a note");
        // 5 of 20 warmup steps: a quarter of the peak.
        assert!(note.contains("rises to 2.500e-4"), "{note}");
        assert!(note.contains("below 5"), "{note}");
        cfg.warmup_steps = 5;
        let note = warmup_note(&cfg).expect("a note");
        assert!(
            note.contains("reaches --lr 1.000e-3 only at the last step"),
            "{note}"
        );
        cfg.warmup_steps = 4;
        assert_eq!(warmup_note(&cfg), None);
        cfg.steps = 0;
        assert_eq!(warmup_note(&cfg), None);
    }
}
