//! A run directory claimed by one run: an OS lock held for the run's life, and a check that the
//! checkpoints already there belong to this run's history, so no run deletes another's work
//! (retention keeps the newest checkpoints, whichever run wrote them).

use std::fs::{self, File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::checkpoint::{Checkpoint, CheckpointDir};
use crate::run::METRICS_FILE;
use crate::TrainError;

/// The lock file inside a run directory; left in place (deleting a lock file races), except
/// where the claim made the directory and leaves it empty.
pub const LOCK_FILE: &str = ".snug.lock";

/// Why `dir` is a run's directory, if it is one: it holds checkpoints, a run's lock file or its
/// metrics. Commands that write where a user says (`export`, `prepare`, `report`, `profile`)
/// never write into one (see [`crate::output`]).
pub fn run_evidence(dir: &Path) -> Option<String> {
    let present = |name: &str| fs::symlink_metadata(dir.join(name)).is_ok();
    if let Some((step, _)) = CheckpointDir::open(dir)
        .and_then(|c| c.list())
        .ok()
        .and_then(|saved| saved.last().cloned())
    {
        return Some(format!("it holds a run's checkpoints, up to step {step}"));
    }
    if present(LOCK_FILE) {
        return Some(format!("it holds a run's lock file, {LOCK_FILE}"));
    }
    if present(METRICS_FILE) {
        return Some(format!("it holds a run's {METRICS_FILE}"));
    }
    None
}

/// How a run means to use its directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// A new run: the directory must hold no other run's checkpoints or metrics.
    Fresh,
    /// A run resumed from the checkpoint of step `step` found in `from`: when `from` is this
    /// directory, no checkpoint here may be newer (that would be another history); when it
    /// is elsewhere, this directory must hold no run.
    Resume { from: PathBuf, step: u64 },
}

/// A run directory this process holds the lock of.
#[derive(Debug)]
pub struct RunDir {
    checkpoints: CheckpointDir,
    /// Held open for the lock; released when the run directory is dropped or the process ends.
    _lock: File,
    /// This claim made the directory: dropped holding nothing but its lock (a run refused
    /// after the claim), it is removed again rather than left as an empty run's.
    created: bool,
    /// The parent directories the claim made too (`runs/` on a first run), innermost first:
    /// removed with it while empty.
    made_parents: Vec<PathBuf>,
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if !self.created {
            return;
        }
        let dir = self.checkpoints.path();
        let only_lock = fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .map(|e| e.map(|e| e.file_name()))
                .all(|name| name.is_ok_and(|n| n == LOCK_FILE))
        });
        if only_lock {
            // Best effort: a directory another claim has written into since is not empty,
            // and stays.
            let _ = fs::remove_file(dir.join(LOCK_FILE));
            if fs::remove_dir(dir).is_ok() {
                for parent in &self.made_parents {
                    if fs::remove_dir(parent).is_err() {
                        break;
                    }
                }
            }
        }
    }
}

impl RunDir {
    /// Creates `dir` if needed, locks it and checks it may take this run.
    pub fn claim(dir: &Path, claim: &Claim) -> Result<RunDir, TrainError> {
        if dir.as_os_str().is_empty() {
            return Err(TrainError::Config {
                field: "out",
                detail: "is empty: give a directory for the run".into(),
            });
        }
        let created = fs::symlink_metadata(dir).is_err();
        let made_parents: Vec<PathBuf> = dir
            .ancestors()
            .skip(1)
            .filter(|p| !p.as_os_str().is_empty())
            .take_while(|p| fs::symlink_metadata(p).is_err())
            .map(Path::to_path_buf)
            .collect();
        let checkpoints = CheckpointDir::create(dir)?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| TrainError::Io {
                path: lock_path.clone(),
                source,
            })?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(TrainError::RunDirBusy {
                    dir: dir.to_path_buf(),
                })
            }
            Err(TryLockError::Error(source)) => {
                return Err(TrainError::Io {
                    path: lock_path,
                    source,
                })
            }
        }
        let run_dir = RunDir {
            checkpoints,
            _lock: lock,
            created,
            made_parents,
        };
        run_dir.check(claim)?;
        Ok(run_dir)
    }

    fn check(&self, claim: &Claim) -> Result<(), TrainError> {
        let dir = self.checkpoints.path();
        let saved = self.checkpoints.list()?;
        let taken = |detail: String| TrainError::RunDirTaken {
            dir: dir.to_path_buf(),
            detail,
        };
        let same_dir = |from: &Path| match (fs::canonicalize(from), fs::canonicalize(dir)) {
            (Ok(a), Ok(b)) => a == b || a.parent() == Some(b.as_path()),
            _ => false,
        };
        match claim {
            Claim::Resume { from, step } if same_dir(from) => {
                for (s, path) in saved.iter().filter(|(s, _)| s > step) {
                    // A newer file that does not load is why an older one was resumed: move
                    // it aside (kept, never deleted) so retention cannot mistake it for ours.
                    // (A sharded checkpoint's shard files go aside with its manifest.)
                    if Checkpoint::load(path).is_err() {
                        let aside = self.checkpoints.move_aside(*s, path)?;
                        tracing::warn!(
                            "moved the damaged checkpoint of step {s} aside to {}",
                            aside.display()
                        );
                    } else {
                        return Err(taken(format!(
                            "it holds a newer checkpoint (step {s}) than the step {step} resumed from; resume from the newest (`--resume {}`), or continue this one into a new `--out` directory",
                            dir.display()
                        )));
                    }
                }
                Ok(())
            }
            _ => {
                if let Some((s, _)) = saved.last() {
                    return Err(taken(format!(
                        "it holds another run (checkpoints up to step {s}): continue it with `snug train --resume {}`, or give a new `--out` directory",
                        dir.display()
                    )));
                }
                let metrics = dir.join(METRICS_FILE);
                if fs::metadata(&metrics).is_ok_and(|m| m.len() > 0) {
                    return Err(taken(format!(
                        "it holds another run's {METRICS_FILE}: give a new `--out` directory, or remove that file"
                    )));
                }
                Ok(())
            }
        }
    }

    pub fn checkpoints(&self) -> &CheckpointDir {
        &self.checkpoints
    }

    /// Whether this claim made the directory (see [`RunDir`]'s drop).
    pub fn created(&self) -> bool {
        self.created
    }

    /// The parent directories the claim made too, innermost first.
    pub fn made_parents(&self) -> &[PathBuf] {
        &self.made_parents
    }

    pub fn path(&self) -> &Path {
        self.checkpoints.path()
    }
}
