//! A run directory claimed by one run: an OS lock held for the run's life, and a check that the
//! checkpoints already there belong to this run's history, so no run deletes another's work
//! (retention keeps the newest checkpoints, whichever run wrote them).

use std::fs::{self, File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::checkpoint::{Checkpoint, CheckpointDir};
use crate::run::METRICS_FILE;
use crate::TrainError;

/// The lock file inside a run directory. A claim that made it removes it again where the run
/// leaves nothing else of its own there (a refused run); a claim checks that the file it locked
/// is still the one at this path, so removing a lock file while holding it cannot let two
/// runs hold the directory.
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
    if let Some(shard) = crate::shards::unnamed_shard(dir) {
        return Some(format!(
            "it holds a checkpoint shard no manifest names ({shard}): the unfinished save of a \
             run, which only its resume may clear away"
        ));
    }
    if present(LOCK_FILE) {
        return Some(format!("it holds a run's lock file, {LOCK_FILE}"));
    }
    // An empty one holds nothing to keep, and `train` takes the directory too.
    if fs::metadata(dir.join(METRICS_FILE)).is_ok_and(|m| m.len() > 0) {
        return Some(format!("it holds a run's {METRICS_FILE}"));
    }
    None
}

/// Whether a run holds `dir` now (its lock file is locked by a live process). A probe, for
/// what an error should say: it takes a shared lock for an instant, so it is asked only where
/// something is already refused.
pub fn held_by_a_run(dir: &Path) -> bool {
    File::open(dir.join(LOCK_FILE))
        .is_ok_and(|f| matches!(f.try_lock_shared(), Err(TryLockError::WouldBlock)))
}

/// Whether `file` is the file at `path` now (on Unix, the same device and inode; elsewhere,
/// where lock files are never removed, always).
fn is_at(file: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), fs::symlink_metadata(path)) {
            (Ok(held), Ok(named)) => held.dev() == named.dev() && held.ino() == named.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (file, path);
        true
    }
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
    /// This claim made the lock file: in a directory that was there before, it is removed
    /// again where the run left no checkpoint and no metrics, so the directory is not taken
    /// for a run's by the commands that refuse to write into one.
    made_lock: bool,
    /// The directory held no metrics file when claimed: an empty one the run left (it ended
    /// before logging a step) is removed with the lock.
    no_metrics_before: bool,
    /// The checkpoints and the metrics file's length when claimed: a claim that changed
    /// neither (refused, or stopped before its first step) removes the lock it made, also
    /// where the directory holds another run's files.
    found: (Vec<(u64, PathBuf)>, Option<u64>),
}

/// The checkpoints in `dir` and the length of its metrics file.
fn contents(checkpoints: &CheckpointDir) -> (Vec<(u64, PathBuf)>, Option<u64>) {
    let metrics = checkpoints.path().join(METRICS_FILE);
    (
        checkpoints.list().unwrap_or_default(),
        fs::metadata(metrics).ok().map(|m| m.len()),
    )
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let dir = self.checkpoints.path();
        let metrics = dir.join(METRICS_FILE);
        let metrics_empty = fs::metadata(&metrics).ok().map(|m| m.len() == 0);
        let nothing_saved = self.checkpoints.list().is_ok_and(|saved| saved.is_empty())
            && metrics_empty != Some(false);
        if !nothing_saved {
            if self.made_lock && cfg!(unix) && contents(&self.checkpoints) == self.found {
                // Best effort, while the lock is still held (see `LOCK_FILE`).
                let _ = fs::remove_file(dir.join(LOCK_FILE));
            }
            return;
        }
        if self.no_metrics_before && metrics_empty == Some(true) {
            let _ = fs::remove_file(&metrics);
        }
        if !self.created {
            if self.made_lock && cfg!(unix) {
                // Best effort, while the lock is still held (see `LOCK_FILE`).
                let _ = fs::remove_file(dir.join(LOCK_FILE));
            }
            return;
        }
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
        let io = |source| TrainError::Io {
            path: lock_path.clone(),
            source,
        };
        let found = fs::symlink_metadata(&lock_path).ok();
        if found.as_ref().is_some_and(|m| !m.is_file()) {
            return Err(TrainError::RunDirTaken {
                dir: dir.to_path_buf(),
                detail: format!(
                    "its {LOCK_FILE} is not a plain file (a link or a directory), which a run's \
                     lock never is: remove it, or give another `--out`"
                ),
            });
        }
        let made_lock = found.is_none();
        let no_metrics_before = fs::symlink_metadata(dir.join(METRICS_FILE)).is_err();
        let mut attempts = 0;
        let lock = loop {
            let mut options = OpenOptions::new();
            options.create(true).truncate(false).write(true);
            // Never through a link made after the check above.
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
            let lock = options.open(&lock_path).map_err(io)?;
            match lock.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(TrainError::RunDirBusy {
                        dir: dir.to_path_buf(),
                    })
                }
                Err(TryLockError::Error(source)) => return Err(io(source)),
            }
            // A claim that held the file removed it before we locked what we had opened: the
            // lock is on a file no other claim will find. Lock the one at the path now.
            if is_at(&lock, &lock_path) {
                break lock;
            }
            attempts += 1;
            if attempts == 3 {
                return Err(TrainError::RunDirBusy {
                    dir: dir.to_path_buf(),
                });
            }
        };
        let found = contents(&checkpoints);
        let run_dir = RunDir {
            checkpoints,
            _lock: lock,
            created,
            made_parents,
            made_lock,
            no_metrics_before,
            found,
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
                // One directory, one run: a checkpoint of another run beside the one resumed
                // (copied in) would have the two histories' files and metrics mixed.
                let resumed = saved.iter().find(|(s, _)| s == step);
                if let Some(id) = resumed.and_then(|(_, p)| crate::checkpoint::run_id_in(p)) {
                    let other = saved.iter().find(|(s, p)| {
                        s != step && crate::checkpoint::run_id_in(p).is_some_and(|o| o != id)
                    });
                    if let Some((s, p)) = other {
                        return Err(taken(format!(
                            "its checkpoint of step {s} ({}) is another run's than the one of step {step} resumed: the directory mixes two runs; resume the one you mean from its file into a new `--out` directory (`--resume FILE --out NEW`)",
                            p.display()
                        )));
                    }
                }
                for (s, path) in saved.iter().filter(|(s, _)| s > step) {
                    // A newer file that does not load is why an older one was resumed: move
                    // it aside (kept, never deleted) so retention cannot mistake it for ours.
                    // (A sharded checkpoint's shard files go aside with its manifest.)
                    let loaded = Checkpoint::load(path);
                    if let Err(e @ TrainError::CheckpointTooNew { .. }) = loaded {
                        return Err(e);
                    }
                    if loaded.is_err() {
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
                // A new run's first save clears away shards no manifest names: never another's.
                if let Some(shard) = crate::shards::unnamed_shard(dir) {
                    return Err(taken(format!(
                        "it holds a checkpoint shard no manifest names ({shard}), the unfinished \
                         save of another run: give a new `--out` directory, or move it away"
                    )));
                }
                let metrics = dir.join(METRICS_FILE);
                if fs::metadata(&metrics).is_ok_and(|m| m.len() > 0) {
                    let what = match crate::run::last_recorded_step(dir) {
                        Some(step) => format!(
                            "the {METRICS_FILE} of a run that stopped before its first checkpoint \
                             ({step} step(s) recorded, nothing to resume)"
                        ),
                        None => format!("another run's {METRICS_FILE}"),
                    };
                    return Err(taken(format!(
                        "it holds {what}: give a new `--out` directory, or remove that file"
                    )));
                }
                Ok(())
            }
        }
    }

    /// Whether this claim made the lock file (see [`RunDir`]'s drop).
    pub fn made_lock(&self) -> bool {
        self.made_lock
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim's lock is on the file at the path only while that file is the same one: one
    /// removed and made again (as by a claim that removed its lock file) is another.
    #[cfg(unix)]
    #[test]
    fn a_lock_file_made_again_is_not_the_one_held() {
        let tmp = tempfile::tempdir().expect("a scratch directory");
        let path = tmp.path().join(LOCK_FILE);
        let held = File::create(&path).expect("a lock file");
        assert!(is_at(&held, &path));
        fs::remove_file(&path).expect("removed");
        assert!(!is_at(&held, &path), "a removed file");
        File::create(&path).expect("made again");
        assert!(!is_at(&held, &path), "a file made again");
    }

    /// An empty metrics file is no run's: `train` takes its directory, and so do the commands
    /// that refuse a run's; one with a line in it is a run's.
    #[test]
    fn an_empty_metrics_file_is_no_evidence_of_a_run() {
        let tmp = tempfile::tempdir().expect("a scratch directory");
        fs::write(tmp.path().join(METRICS_FILE), b"").expect("metrics");
        assert_eq!(run_evidence(tmp.path()), None);
        fs::write(tmp.path().join(METRICS_FILE), b"{}\n").expect("metrics");
        assert!(run_evidence(tmp.path()).is_some_and(|why| why.contains(METRICS_FILE)));
    }

    /// A file, or a link to one or to nothing, where the run's directory belongs is named as
    /// not a directory, and left as it was.
    #[test]
    fn a_file_where_the_run_directory_belongs_is_named_as_such() {
        let tmp = tempfile::tempdir().expect("a scratch directory");
        let file = tmp.path().join("notes.txt");
        fs::write(&file, b"mine").expect("a file");
        let mut paths = vec![file.clone()];
        #[cfg(unix)]
        {
            let dangling = tmp.path().join("dangling");
            std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).expect("a link");
            let to_file = tmp.path().join("to-file");
            std::os::unix::fs::symlink(&file, &to_file).expect("a link");
            paths.extend([dangling, to_file]);
        }
        for path in paths {
            match RunDir::claim(&path, &Claim::Fresh) {
                Err(TrainError::RunDirTaken { detail, .. }) => {
                    assert!(detail.contains("not a directory"), "{detail}")
                }
                other => panic!("{}: {:?}", path.display(), other.map(|_| ())),
            }
        }
        assert_eq!(fs::read(&file).expect("kept"), b"mine");
        assert!(!tmp.path().join("nowhere").exists());
    }

    /// A shard file no manifest names is some run's unfinished save: a new run's first save
    /// would clear it away, so a new run refuses the directory and leaves it.
    #[test]
    fn a_new_run_refuses_a_directory_with_a_shard_no_manifest_names() {
        let tmp = tempfile::tempdir().expect("a scratch directory");
        let shard = tmp
            .path()
            .join("ckpt-00000500.0000002a.shard-0-of-2.safetensors");
        fs::write(&shard, b"someone's").expect("a shard");
        match RunDir::claim(tmp.path(), &Claim::Fresh) {
            Err(TrainError::RunDirTaken { detail, .. }) => {
                assert!(detail.contains("shard-0-of-2"), "{detail}")
            }
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
        assert_eq!(fs::read(&shard).expect("kept"), b"someone's");
        assert!(run_evidence(tmp.path()).is_some_and(|why| why.contains("shard")));
    }

    /// A claim in a directory that was there removes the lock file it made when the run
    /// leaves nothing, keeps it once the run has saved, and never removes one it found.
    #[cfg(unix)]
    #[test]
    fn a_claim_removes_only_the_lock_file_it_made_and_only_for_a_run_that_left_nothing() {
        let tmp = tempfile::tempdir().expect("a scratch directory");
        let dir = tmp.path().join("run");
        fs::create_dir(&dir).expect("a directory");
        let lock = dir.join(LOCK_FILE);
        drop(RunDir::claim(&dir, &Claim::Fresh).expect("claimed"));
        assert!(!lock.exists(), "the lock file of a run that left nothing");
        {
            let claimed = RunDir::claim(&dir, &Claim::Fresh).expect("claimed");
            fs::write(claimed.path().join(METRICS_FILE), b"{}\n").expect("metrics");
        }
        assert!(lock.exists(), "the lock file of a run that wrote metrics");
        fs::remove_file(dir.join(METRICS_FILE)).expect("removed");
        drop(RunDir::claim(&dir, &Claim::Fresh).expect("claimed"));
        assert!(lock.exists(), "a lock file the claim found");
    }
}
