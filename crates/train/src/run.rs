//! The training loop around a [`Trainer`]: periodic evaluation, checkpoints, the metrics file,
//! and a clean stop when asked (Ctrl-C): the step in flight finishes, a checkpoint is saved,
//! and the run returns normally.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;

use crate::checkpoint::CheckpointDir;
use crate::trainer::{EvalStats, Recovery, StepStats, Trainer};
use crate::TrainError;

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

/// Trains until the configured step count or until `stop` is set, evaluating, logging and
/// checkpointing as the configuration says. With a run directory (`out`), the final state is
/// always saved, interrupted or not.
pub fn run(
    trainer: &mut Trainer,
    stop: &AtomicBool,
    mut on_event: impl FnMut(Event<'_>),
) -> Result<RunSummary, TrainError> {
    let cfg = trainer.config().clone();
    let (ckpt_dir, mut metrics) = match &cfg.out {
        Some(dir) => {
            let ckpt = CheckpointDir::create(dir)?;
            let metrics = MetricsFile::open(&dir.join(METRICS_FILE), trainer.steps_done())?;
            (Some(ckpt), Some(metrics))
        }
        None => (None, None),
    };
    let mut summary = RunSummary {
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
    let mut saved_at = None;
    while trainer.steps_done() < cfg.steps {
        if stop.load(Ordering::Relaxed) {
            summary.interrupted = true;
            on_event(Event::Stopping {
                step: trainer.steps_done(),
            });
            break;
        }
        let s = trainer.train_step()?;
        for r in trainer.take_recoveries() {
            if let Some(m) = &mut metrics {
                m.write("recovery", &r)?;
            }
            on_event(Event::Recovered(&r));
            summary.recoveries.push(r);
        }
        summary.first_loss.get_or_insert(s.loss);
        summary.final_loss = Some(s.loss);
        summary.step_ms.push(s.ms);
        summary.end_step = s.step;
        if let Some(m) = &mut metrics {
            m.write("step", &s)?;
        }
        on_event(Event::Step(&s));
        if cfg.eval_every > 0 && (s.step % cfg.eval_every == 0 || s.step == cfg.steps) {
            let e = trainer.evaluate()?;
            if let Some(m) = &mut metrics {
                m.write("eval", &e)?;
            }
            on_event(Event::Eval(&e));
            summary.last_eval = Some(e);
        }
        if let Some(dir) = &ckpt_dir {
            if cfg.checkpoint_every > 0 && s.step % cfg.checkpoint_every == 0 {
                let path = dir.save_ref(&trainer.checkpoint_ref()?, cfg.keep_checkpoints)?;
                on_event(Event::Checkpoint {
                    step: s.step,
                    path: &path,
                });
                saved_at = Some(s.step);
                summary.checkpoint = Some(path);
            }
        }
    }
    if let Some(dir) = &ckpt_dir {
        if saved_at != Some(trainer.steps_done()) {
            let path = dir.save_ref(&trainer.checkpoint_ref()?, cfg.keep_checkpoints)?;
            on_event(Event::Checkpoint {
                step: trainer.steps_done(),
                path: &path,
            });
            summary.checkpoint = Some(path);
        }
    }
    Ok(summary)
}

/// `metrics.jsonl`: one JSON object per step and per evaluation, each written with a single
/// `write` so a crash leaves whole lines.
struct MetricsFile {
    path: PathBuf,
    file: File,
}

#[derive(Serialize)]
struct Line<'a, T: Serialize> {
    kind: &'static str,
    #[serde(flatten)]
    data: &'a T,
}

impl MetricsFile {
    /// Opens for appending. Lines from steps after `resume_step` (run before a crash, then
    /// lost with their unsaved state) are dropped, so a resumed run's file reads as one run.
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
            });
        }
        if let Ok(text) = fs::read_to_string(path) {
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| s <= resume_step)
                })
                .flat_map(|l| [l, "\n"])
                .collect();
            if kept.len() != text.len() {
                let tmp = path.with_extension("jsonl.tmp");
                fs::write(&tmp, kept).map_err(io)?;
                fs::rename(&tmp, path).map_err(io)?;
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
