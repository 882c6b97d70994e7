//! The training loop around a [`Trainer`]: periodic evaluation, checkpoints, the metrics file,
//! and a clean stop when asked (Ctrl-C): the step in flight finishes, a checkpoint is saved,
//! and the run returns normally. Over several ranks, every rank stops after the same step, and
//! under ZeRO stages 1–3 every rank saves its part of each checkpoint ([`crate::shards`]).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;

use crate::checkpoint::CheckpointDir;
use crate::run_dir::{Claim, RunDir};
use crate::trainer::{EvalStats, Recovery, StepStats, Trainer};
use crate::{TrainConfig, TrainError};

/// Something the loop did, for progress display.
#[derive(Debug)]
pub enum Event<'a> {
    Step(&'a StepStats),
    /// Memory ran out during a step, which was redone with a smaller configuration.
    Recovered(&'a Recovery),
    Eval(&'a EvalStats),
    Checkpoint {
        step: u64,
        path: &'a Path,
    },
    /// The stop flag was seen; the loop saves and returns.
    Stopping {
        step: u64,
    },
}

/// What a call to [`run`] did.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The step the run started after (non-zero when resumed).
    pub start_step: u64,
    pub end_step: u64,
    pub first_loss: Option<f32>,
    pub final_loss: Option<f32>,
    /// Milliseconds of each step run, in order.
    #[serde(skip)]
    pub step_ms: Vec<f64>,
    pub last_eval: Option<EvalStats>,
    pub checkpoint: Option<PathBuf>,
    pub metrics: Option<PathBuf>,
    pub interrupted: bool,
    /// Configuration changes made after out-of-memory.
    pub recoveries: Vec<Recovery>,
}

/// Name of the metrics file in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// The last step a run directory's metrics record, if any: what a run that stopped before
/// its first checkpoint did (and lost).
pub(crate) fn last_recorded_step(dir: &Path) -> Option<u64> {
    let text = fs::read_to_string(dir.join(METRICS_FILE)).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .filter_map(|v| v["step"].as_u64())
        .max()
}

/// Whether an evaluation falls after `step` under `cfg` (`eval_every`, and the last step).
fn evaluation_due(cfg: &TrainConfig, step: u64) -> bool {
    cfg.eval_every > 0 && (step.is_multiple_of(cfg.eval_every) || step == cfg.steps)
}

/// Whether a run resumed in `dir` at `step` owes the evaluation after that step: one is due
/// there and the metrics hold none (a stop cut it short), so the resumed run makes it up
/// before anything else ([`run`]) and writes it into the metrics.
pub fn evaluation_owed(cfg: &TrainConfig, dir: &Path, step: u64) -> bool {
    if step == 0 || !evaluation_due(cfg, step) {
        return false;
    }
    let text = fs::read_to_string(dir.join(METRICS_FILE)).unwrap_or_default();
    !text.lines().any(|l| {
        serde_json::from_str::<serde_json::Value>(l)
            .is_ok_and(|v| v["kind"] == "eval" && v["step"].as_u64() == Some(step))
    })
}

/// Trains until the configured step count or until `stop` is set, evaluating, logging and
/// checkpointing as the configuration says. With a run directory (`out`; claimed here unless
/// the caller claimed it first, see [`RunDir::claim`]), the final state is always saved:
/// at the end, when interrupted, and when the run stops on an error after a completed step
/// (unless that error left the weights half-updated, see [`Trainer::state_is_consistent`]).
pub fn run(
    trainer: &mut Trainer,
    run_dir: Option<RunDir>,
    stop: &AtomicBool,
    mut on_event: impl FnMut(Event<'_>),
) -> Result<RunSummary, TrainError> {
    let cfg = trainer.config().clone();
    let run_dir = match (run_dir, &cfg.out) {
        (Some(d), _) => Some(d),
        (None, Some(dir)) => {
            let claim = match trainer.resumed_at() {
                Some(step) => Claim::Resume {
                    from: dir.clone(),
                    step,
                },
                None => Claim::Fresh,
            };
            Some(RunDir::claim(dir, &claim)?)
        }
        (None, None) => None,
    };
    let mut metrics = match &run_dir {
        Some(d) => Some(MetricsFile::open(
            &d.path().join(METRICS_FILE),
            trainer.steps_done(),
        )?),
        None => None,
    };
    let summary = RunSummary {
        start_step: trainer.steps_done(),
        end_step: trainer.steps_done(),
        first_loss: None,
        final_loss: None,
        step_ms: Vec::new(),
        last_eval: None,
        checkpoint: None,
        metrics: metrics.as_ref().map(|m| m.path.clone()),
        interrupted: false,
        recoveries: Vec::new(),
    };
    let ckpt_dir = run_dir.as_ref().map(RunDir::checkpoints);
    let saver = if trainer.saves_sharded() {
        // Rank 0 alone claimed the run directory; every rank writes its shard there.
        match crate::shards::agree_dir(ckpt_dir.map(CheckpointDir::path)) {
            Some(dir) => Saver::Sharded { dir, ckpt_dir },
            None => Saver::Nothing,
        }
    } else {
        ckpt_dir.map_or(Saver::Nothing, Saver::Whole)
    };
    let mut state = LoopState {
        cfg: &cfg,
        saver: &saver,
        metrics: metrics.take(),
        summary,
        saved_at: None,
    };
    let result = train_loop(trainer, &mut state, stop, &mut on_event);
    let LoopState {
        mut summary,
        saved_at,
        ..
    } = state;
    if matches!(saver, Saver::Nothing) {
        return result.map(|()| summary);
    }
    // After an error, save only a state some step of this run reached. A sharded save takes
    // every rank: after an error on one rank alone the others are elsewhere, and the last
    // checkpoint stands; after one they all reached together, they save together.
    let worth_saving = match &result {
        Ok(()) => true,
        Err(_) => {
            (!matches!(saver, Saver::Sharded { .. }) || trainer.failed_together())
                && trainer.steps_done() > summary.start_step
                && trainer.state_is_consistent()
        }
    };
    if worth_saving && saved_at != Some(trainer.steps_done()) {
        match saver.save(trainer, cfg.keep_checkpoints) {
            Ok(path) => {
                on_event(Event::Checkpoint {
                    step: trainer.steps_done(),
                    path: &path,
                });
                summary.checkpoint = Some(path);
            }
            // The run's own error says more than a failed save after it (a full disk, say).
            Err(e) if result.is_err() => {
                tracing::warn!(
                    "could not save the state after step {}: {e}",
                    trainer.steps_done()
                )
            }
            Err(e) => return Err(e),
        }
    }
    result.map(|()| summary)
}

/// Where this process's part of a checkpoint goes.
enum Saver<'a> {
    /// Nowhere: no run directory (`--no-save`), or a rank of a stage-0 run other than 0.
    Nothing,
    /// A whole checkpoint into this directory: one process, or rank 0 of a stage-0 run.
    Whole(&'a CheckpointDir),
    /// This rank's shard into `dir`, rank 0's run directory; rank 0 (which holds `ckpt_dir`)
    /// writes the manifest and retires old checkpoints.
    Sharded {
        dir: PathBuf,
        ckpt_dir: Option<&'a CheckpointDir>,
    },
}

impl Saver<'_> {
    /// Saves the trainer's state (every rank at once, when sharded); returns the checkpoint's
    /// path (a sharded one's manifest).
    fn save(&self, trainer: &Trainer, keep: usize) -> Result<PathBuf, TrainError> {
        match self {
            Saver::Nothing => Err(TrainError::Config {
                field: "out",
                detail: "no run directory to save into".into(),
            }),
            Saver::Whole(dir) => dir.save_ref(&trainer.checkpoint_ref()?, keep),
            Saver::Sharded { dir, ckpt_dir } => {
                crate::shards::save(dir, &trainer.shard_ref()?, ckpt_dir.map(|d| (d, keep)))
            }
        }
    }
}

/// Whether to stop before the next step: over several ranks, when any rank was asked, so all
/// stop after the same step (one stopping alone would leave the others waiting in the step's
/// collectives, and a sharded save needs them all).
fn stop_requested(stop: &AtomicBool) -> bool {
    let mine = stop.load(Ordering::Relaxed);
    match snug_cpu::kernels::collective::installed() {
        Some(t) if t.size() > 1 => {
            let mut any = [f32::from(u8::from(mine))];
            t.all_reduce_sum(&mut any);
            any[0] > 0.0
        }
        _ => mine,
    }
}

/// What the loop keeps between steps, and leaves for the final save.
struct LoopState<'a> {
    cfg: &'a TrainConfig,
    saver: &'a Saver<'a>,
    metrics: Option<MetricsFile>,
    summary: RunSummary,
    /// The step of the last checkpoint written.
    saved_at: Option<u64>,
}

fn train_loop(
    trainer: &mut Trainer,
    st: &mut LoopState<'_>,
    stop: &AtomicBool,
    on_event: &mut impl FnMut(Event<'_>),
) -> Result<(), TrainError> {
    let (cfg, saver) = (st.cfg, st.saver);
    let (metrics, summary) = (&mut st.metrics, &mut st.summary);
    let due = |step: u64| evaluation_due(cfg, step);
    // A stop during the evaluation after a step saves that step with the evaluation cut
    // short; the resumed run evaluates it then, so its metrics and result hold every one.
    let at = trainer.steps_done();
    if trainer.resumed_at().is_some()
        && at > 0
        && due(at)
        && metrics.as_ref().is_none_or(|m| m.evaluated != Some(at))
        && !stop_requested(stop)
    {
        evaluate(trainer, metrics, summary, stop, on_event)?;
    }
    while trainer.steps_done() < cfg.steps {
        if stop_requested(stop) {
            summary.interrupted = true;
            on_event(Event::Stopping {
                step: trainer.steps_done(),
            });
            break;
        }
        let s = trainer.train_step()?;
        report_recoveries(trainer, metrics, summary, on_event)?;
        summary.first_loss.get_or_insert(s.loss);
        summary.final_loss = Some(s.loss);
        summary.step_ms.push(s.ms);
        summary.end_step = s.step;
        if let Some(m) = metrics.as_mut() {
            m.write("step", &s)?;
        }
        on_event(Event::Step(&s));
        if due(s.step) {
            evaluate(trainer, metrics, summary, stop, on_event)?;
        }
        if !matches!(saver, Saver::Nothing)
            && cfg.checkpoint_every > 0
            && s.step % cfg.checkpoint_every == 0
        {
            let path = saver.save(trainer, cfg.keep_checkpoints)?;
            on_event(Event::Checkpoint {
                step: s.step,
                path: &path,
            });
            st.saved_at = Some(s.step);
            summary.checkpoint = Some(path);
        }
    }
    Ok(())
}

/// Evaluates, and records the result where the run's results go; abandoned for a stop, the
/// loop's next check ends the run and saves.
fn evaluate(
    trainer: &mut Trainer,
    metrics: &mut Option<MetricsFile>,
    summary: &mut RunSummary,
    stop: &AtomicBool,
    on_event: &mut impl FnMut(Event<'_>),
) -> Result<(), TrainError> {
    let e = trainer.evaluate_unless(&|| stop_requested(stop))?;
    report_recoveries(trainer, metrics, summary, on_event)?;
    if let Some(e) = e {
        if let Some(m) = metrics.as_mut() {
            m.write("eval", &e)?;
        }
        on_event(Event::Eval(&e));
        summary.last_eval = Some(e);
    }
    Ok(())
}

/// Hands on the configuration changes the trainer made to carry on after running out of
/// memory: to the metrics, the caller and the summary.
fn report_recoveries(
    trainer: &mut Trainer,
    metrics: &mut Option<MetricsFile>,
    summary: &mut RunSummary,
    on_event: &mut impl FnMut(Event<'_>),
) -> Result<(), TrainError> {
    for r in trainer.take_recoveries() {
        if let Some(m) = metrics.as_mut() {
            m.write("recovery", &r)?;
        }
        on_event(Event::Recovered(&r));
        summary.recoveries.push(r);
    }
    Ok(())
}

/// `metrics.jsonl`: one JSON object per step and per evaluation, each written with a single
/// `write` so a crash leaves whole lines.
struct MetricsFile {
    path: PathBuf,
    file: File,
    /// The step resumed from, where the file already holds its evaluation.
    evaluated: Option<u64>,
}

#[derive(Serialize)]
struct Line<'a, T: Serialize> {
    kind: &'static str,
    #[serde(flatten)]
    data: &'a T,
}

impl MetricsFile {
    /// Opens for appending. Lines from steps after `resume_step` (run before a crash, then
    /// lost with their unsaved state) are dropped, so a resumed run's file reads as one run;
    /// every other line (one without a step, or not JSON: a note of the user's) is kept.
    fn open(path: &Path, resume_step: u64) -> Result<MetricsFile, TrainError> {
        let io = |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        if resume_step == 0 {
            let file = File::create(path).map_err(io)?;
            return Ok(MetricsFile {
                path: path.to_path_buf(),
                file,
                evaluated: None,
            });
        }
        let mut evaluated = None;
        if let Ok(text) = fs::read_to_string(path) {
            // An unterminated last line that does not parse is a write a crash cut short: kept,
            // it would sit mid-file once this run appends.
            let torn = !text.ends_with('\n')
                && text
                    .lines()
                    .next_back()
                    .is_some_and(|l| serde_json::from_str::<serde_json::Value>(l).is_err());
            let whole = text.lines().count() - usize::from(torn);
            let kept: String = text
                .lines()
                .take(whole)
                .filter(|l| {
                    let v = serde_json::from_str::<serde_json::Value>(l).ok();
                    let step = v.as_ref().and_then(|v| v.get("step")?.as_u64());
                    if step == Some(resume_step) && v.as_ref().is_some_and(|v| v["kind"] == "eval")
                    {
                        evaluated = Some(resume_step);
                    }
                    step.is_none_or(|s| s <= resume_step)
                })
                .flat_map(|l| [l, "\n"])
                .collect();
            if kept.len() != text.len() {
                // A name no file of the user's has: the run directory's lock keeps other snug
                // processes out, and hidden, per-process names keep clear of anything else.
                let name = format!(".{METRICS_FILE}.{}.tmp", std::process::id());
                let tmp = path.with_file_name(name);
                // A full disk fails the write after the file is made: the temporary file is
                // ours to remove, or it stays behind in the run directory.
                if let Err(e) = fs::write(&tmp, kept).and_then(|()| fs::rename(&tmp, path)) {
                    let _ = fs::remove_file(&tmp);
                    return Err(io(e));
                }
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            file,
            evaluated,
        })
    }

    fn write<T: Serialize>(&mut self, kind: &'static str, data: &T) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(&Line { kind, data }).map_err(|e| TrainError::Io {
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|source| TrainError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resume that drops lines from the metrics rewrites the file through a temporary one;
    /// where that write fails (a full disk), the error names the metrics file, which is as it
    /// was, and the temporary file is gone.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_metrics_rewrite_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().expect("a scratch directory");
        let path = dir.path().join(METRICS_FILE);
        let lines = "{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"step\",\"step\":2}\n";
        fs::write(&path, lines).expect("metrics");
        // The temporary file's name, where every write fails with "no space left on device".
        let tmp = dir
            .path()
            .join(format!(".{METRICS_FILE}.{}.tmp", std::process::id()));
        std::os::unix::fs::symlink("/dev/full", &tmp).expect("a symlink");
        let err = match MetricsFile::open(&path, 1) {
            Err(e) => e,
            Ok(_) => panic!("a write to /dev/full succeeded"),
        };
        assert!(
            matches!(&err, TrainError::Io { path: p, .. } if *p == path),
            "{err:?}"
        );
        assert!(
            fs::symlink_metadata(&tmp).is_err(),
            "the temporary file stayed"
        );
        assert_eq!(fs::read_to_string(&path).expect("metrics"), lines);
    }

    #[test]
    fn an_evaluation_is_owed_only_where_due_and_missing() {
        let dir = tempfile::tempdir().expect("a scratch directory");
        let cfg = TrainConfig {
            steps: 4,
            eval_every: 3,
            ..TrainConfig::default()
        };
        // Due at 3 and at the last step, 4; never at 0 or 2.
        for (step, owed) in [(0, false), (2, false), (3, true), (4, true)] {
            assert_eq!(evaluation_owed(&cfg, dir.path(), step), owed, "{step}");
        }
        fs::write(
            dir.path().join(METRICS_FILE),
            "{\"kind\":\"step\",\"step\":4}\n{\"kind\":\"eval\",\"step\":4}\n",
        )
        .expect("metrics");
        assert!(!evaluation_owed(&cfg, dir.path(), 4));
        assert!(evaluation_owed(&cfg, dir.path(), 3));
        let never = TrainConfig {
            eval_every: 0,
            ..cfg
        };
        assert!(!evaluation_owed(&never, dir.path(), 3));
    }
}
