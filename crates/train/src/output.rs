//! Paths a user names for a command to write (`export --out`, `prepare --out`, `report -o`,
//! `profile --trace`): whether the command may write there. What is already there is kept
//! unless the user asks for it to be replaced (`force`, the commands' `--force`), and a run
//! directory, a run's own files and checkpoints are never written over, asked or not: that
//! would lose a run's work. Checked before anything is computed or written; the files are then
//! written atomically (a temporary file beside each, renamed over it), so an interrupted write
//! leaves the old file whole.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};

use crate::checkpoint::{is_checkpoint_file, PREFIX};
use crate::run::METRICS_FILE;
use crate::run_dir::{run_evidence, LOCK_FILE};
use crate::user_file::irregular_kind;
use crate::TrainError;

/// What a directory a command writes into may already hold when it is not told to replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirContents {
    /// Nothing: the directory is the command's output alone (a model export, whose files are
    /// read as one model).
    Nothing,
    /// Anything but the files the command writes (prepare's `train.bin` and `val.bin` beside
    /// the corpus).
    AnythingElse,
}

fn refused(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::OutputRefused {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// Whether a file named `name` in a run directory is the run's: a checkpoint (or a sharded
/// one's manifest or shard), its metrics or its lock.
fn is_run_file(name: &OsStr) -> bool {
    name.to_str()
        .is_some_and(|n| n.starts_with(PREFIX) || n == METRICS_FILE || n == LOCK_FILE)
}

/// Checks that the file `path` may be written. A path that does not exist may; one that does
/// only with `force`, and never a checkpoint, a run's metrics or lock file, a directory or a
/// device (replacing `/dev/null` would remove the device).
pub fn check_file(path: &Path, force: bool) -> Result<(), TrainError> {
    let Some(name) = path.file_name() else {
        return Err(refused(path, "is not a file path: give one"));
    };
    let existing = match fs::symlink_metadata(path) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(source) => {
            return Err(TrainError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    // What the path leads to, through a symbolic link (a broken link leads nowhere).
    if let Some(meta) = existing.then(|| fs::metadata(path).ok()).flatten() {
        if meta.is_dir() {
            return Err(refused(path, "is a directory: give a file path"));
        }
        if let Some(kind) = irregular_kind(meta.file_type()) {
            return Err(refused(
                path,
                format!("is {kind}, not a regular file: give a file path"),
            ));
        }
        if is_checkpoint_file(path) {
            return Err(refused(
                path,
                "is a snug checkpoint; snug never writes over one, even with --force: give \
                 another path",
            ));
        }
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if is_run_file(name) {
        if let Some(evidence) = run_evidence(dir) {
            return Err(refused(
                path,
                format!(
                    "is a run's own file ({} is a run directory: {evidence}); snug never \
                     writes over a run's files, even with --force: give another path",
                    dir.display()
                ),
            ));
        }
    }
    if !existing || force {
        return Ok(());
    }
    Err(TrainError::OutputExists {
        path: path.to_path_buf(),
        detail: "already exists: pass --force to replace it, or give another path".into(),
    })
}

/// Checks that the directory `dir` may take the `files` a command writes into it (creating it
/// if missing). Never a run directory or a path that is not a directory; without `force`, a
/// directory holding anything ([`DirContents::Nothing`]) or holding one of `files`
/// ([`DirContents::AnythingElse`]) is refused. Each file is then checked as [`check_file`].
pub fn check_dir(
    dir: &Path,
    files: &[&str],
    contents: DirContents,
    force: bool,
) -> Result<(), TrainError> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(TrainError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
        Ok(_) => {}
    }
    if !fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Err(if is_checkpoint_file(dir) {
            refused(
                dir,
                "is a snug checkpoint, not a directory; snug never writes over one, even with \
                 --force: give another directory",
            )
        } else {
            refused(dir, "is not a directory: give a directory")
        });
    }
    if let Some(evidence) = run_evidence(dir) {
        return Err(refused(
            dir,
            format!(
                "is a run directory ({evidence}); snug never writes into one, even with \
                 --force: give another directory"
            ),
        ));
    }
    if contents == DirContents::Nothing && !force {
        let entries = fs::read_dir(dir).map_err(|source| TrainError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut held: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        if !held.is_empty() {
            held.sort();
            let more = if held.len() > 3 { ", …" } else { "" };
            held.truncate(3);
            return Err(TrainError::OutputExists {
                path: dir.to_path_buf(),
                detail: format!(
                    "is not empty (it holds {}{more}): pass --force to replace the files \
                     written there (the others are left as they are), or give another directory",
                    held.join(", ")
                ),
            });
        }
    }
    for name in files {
        check_file(&dir.join(name), force)?;
    }
    Ok(())
}

/// The files among `files` in `dir` that a forced write left from what it replaced, by path:
/// an earlier output's files this one did not write (`written`), which would otherwise be read
/// with the new ones (an old adapter beside a merged model, an old tokenizer beside a model
/// that has none). Only names of `files` are considered; nothing else in `dir` is touched.
pub fn stale_files(dir: &Path, files: &[&str], written: &[PathBuf]) -> Vec<PathBuf> {
    files
        .iter()
        .map(|name| dir.join(name))
        // A link (a Hugging Face cache snapshot's) is removed, never what it points to.
        .filter(|p| {
            !written.contains(p)
                && fs::symlink_metadata(p).is_ok_and(|m| m.is_file() || m.file_type().is_symlink())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(r: Result<(), TrainError>) -> bool {
        matches!(r, Err(TrainError::OutputExists { .. }))
    }

    fn refused_(r: Result<(), TrainError>) -> bool {
        matches!(r, Err(TrainError::OutputRefused { .. }))
    }

    #[test]
    fn an_existing_file_is_replaced_only_when_forced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("page.html");
        assert!(check_file(&path, false).is_ok());
        fs::write(&path, "old").unwrap();
        let err = check_file(&path, false).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with(&path.display().to_string()), "{msg}");
        assert!(msg.contains("--force"), "{msg}");
        assert!(check_file(&path, true).is_ok());
        assert!(refused_(check_file(dir.path(), true)));
        #[cfg(unix)]
        assert!(refused_(check_file(Path::new("/dev/null"), true)));
    }

    #[test]
    fn run_directories_and_their_files_are_never_written() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        fs::create_dir(&run).unwrap();
        fs::write(run.join(METRICS_FILE), "{}\n").unwrap();
        assert!(refused_(check_dir(&run, &[], DirContents::Nothing, true)));
        assert!(refused_(check_file(&run.join(METRICS_FILE), true)));
        // A new file of another name beside a run's is not the run's.
        assert!(check_file(&run.join("report.html"), false).is_ok());
        // A file named as a checkpoint is one, wherever it is.
        let ckpt = dir.path().join("ckpt-00000002.safetensors");
        fs::write(&ckpt, "x").unwrap();
        assert!(refused_(check_file(&ckpt, true)));
        assert!(refused_(check_dir(&ckpt, &[], DirContents::Nothing, true)));
    }

    #[test]
    fn a_directory_is_checked_whole_or_by_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        assert!(check_dir(&out, &["a"], DirContents::Nothing, false).is_ok());
        fs::create_dir(&out).unwrap();
        assert!(check_dir(&out, &["a"], DirContents::Nothing, false).is_ok());
        fs::write(out.join("corpus.txt"), "x").unwrap();
        assert!(exists(check_dir(&out, &["a"], DirContents::Nothing, false)));
        assert!(check_dir(&out, &["a"], DirContents::AnythingElse, false).is_ok());
        fs::write(out.join("a"), "x").unwrap();
        assert!(exists(check_dir(
            &out,
            &["a"],
            DirContents::AnythingElse,
            false
        )));
        assert!(check_dir(&out, &["a"], DirContents::AnythingElse, true).is_ok());
        assert!(check_dir(&out, &["a"], DirContents::Nothing, true).is_ok());
        assert_eq!(
            stale_files(&out, &["a", "b"], &[]),
            vec![out.join("a")],
            "only the named files"
        );
        assert!(stale_files(&out, &["a"], &[out.join("a")]).is_empty());
        // A link is stale as a file is (removing it leaves what it points to).
        #[cfg(unix)]
        {
            fs::write(dir.path().join("target"), "kept").unwrap();
            std::os::unix::fs::symlink(dir.path().join("target"), out.join("b")).unwrap();
            assert_eq!(
                stale_files(&out, &["b"], &[]),
                vec![out.join("b")],
                "a link"
            );
        }
    }
}
