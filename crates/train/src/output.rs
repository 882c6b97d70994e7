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

/// Whether `input` (followed through symlinks) is the entry `target` names (not followed: the
/// entry a rename replaces). The same device and inode, so a hard link counts too. Either
/// missing is not the same file; a missing input is named where it is read.
#[cfg(unix)]
pub fn same_file(input: &Path, target: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(input), std::fs::symlink_metadata(target)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Without inodes, the same resolved path (a hard link goes unnoticed).
#[cfg(not(unix))]
pub fn same_file(input: &Path, target: &Path) -> bool {
    let is_link = std::fs::symlink_metadata(target).is_ok_and(|m| m.file_type().is_symlink());
    match (std::fs::canonicalize(input), std::fs::canonicalize(target)) {
        (Ok(a), Ok(b)) => !is_link && a == b,
        _ => false,
    }
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
        // Another command's staging directory is not an earlier output.
        let mut held: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with(STAGING_PREFIX))
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

/// [`check_file`] for a file a command writes on its own (a report's page, a profile's trace),
/// which is never a model's weights either: those are replaced only by `export`, which writes
/// a model.
pub fn check_document_file(path: &Path, force: bool) -> Result<(), TrainError> {
    check_file(path, force)?;
    if fs::symlink_metadata(path).is_ok() && crate::checkpoint::is_weights_file(path) {
        return Err(refused(
            path,
            "holds a model's weights (safetensors); snug never writes a page or a trace over \
             them, even with --force: give another path",
        ));
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

/// The name a staging directory starts with: inside the output directory, then `PID.N`;
/// beside it, the output's name, then `.PID.N`.
const STAGING_PREFIX: &str = ".snug-staging.";

/// Files a command writes together (a model's weights, configuration, adapter and tokenizer),
/// written first into a hidden staging directory and moved into the output directory only
/// once every one is complete, so an error or a kill while they are written leaves the
/// earlier output whole rather than new weights beside an old adapter.
///
/// The staging directory lies beside the output where it can (the same file system, the
/// output not a link): then a new output directory appears whole with one rename, and one
/// holding nothing but files the command writes is exchanged for the staging directory in one
/// step (Linux's `RENAME_EXCHANGE`), so no moment shows a mix. Where the output also holds
/// other files, which are left as they are, or the staging directory has to lie inside it,
/// the files are moved in one rename each, nothing written between them.
///
/// Dropped before [`StagedDir::commit`], the staged files are removed (and an output
/// directory made for them, if still empty); a killed process's are removed by a later
/// staging in the same place once an hour has passed.
pub struct StagedDir {
    dir: PathBuf,
    staging: Option<PathBuf>,
    /// The staging directory is the output's sibling, on its file system.
    beside: bool,
    /// The output directory was made for this output.
    created: bool,
}

impl StagedDir {
    /// An empty staging directory for the output directory `dir`.
    pub fn new(dir: &Path) -> Result<StagedDir, TrainError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TrainError::Io { path, source }
        };
        let unique = || {
            format!(
                "{}.{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            )
        };
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|_| sibling_possible(dir, parent));
        if let Some(name) = name {
            let prefix = format!("{STAGING_PREFIX}{name}.");
            if fs::create_dir_all(parent).is_ok() {
                snug_nn::remove_stale_temporaries(parent, &prefix, "");
                let staging = parent.join(format!("{prefix}{}", unique()));
                if fs::create_dir(&staging).is_ok() {
                    return Ok(StagedDir {
                        dir: dir.to_path_buf(),
                        staging: Some(staging),
                        beside: true,
                        created: false,
                    });
                }
            }
        }
        // Inside the output: its parent is not writable, or another file system.
        let created = !dir.exists();
        fs::create_dir_all(dir).map_err(io(dir))?;
        snug_nn::remove_stale_temporaries(dir, STAGING_PREFIX, "");
        let staging = dir.join(format!("{STAGING_PREFIX}{}", unique()));
        fs::create_dir(&staging).map_err(io(&staging))?;
        Ok(StagedDir {
            dir: dir.to_path_buf(),
            staging: Some(staging),
            beside: false,
            created,
        })
    }

    /// Where the files are written until [`StagedDir::commit`].
    pub fn path(&self) -> &Path {
        self.staging.as_deref().unwrap_or(&self.dir)
    }

    /// Where a file written at `staged` ends up.
    pub fn final_path(&self, staged: &Path) -> PathBuf {
        match staged.file_name() {
            Some(name) => self.dir.join(name),
            None => staged.to_path_buf(),
        }
    }

    /// Moves every staged file into the output directory and makes it durable. An output
    /// directory holding nothing but names among `replaceable` is replaced whole, so what it
    /// held goes with it; otherwise each file is renamed over its namesake and the rest is
    /// left. Returns the files' final paths.
    pub fn commit(self, replaceable: &[&str]) -> Result<Vec<PathBuf>, TrainError> {
        self.commit_replacing(replaceable, &[], &[])
    }

    /// [`StagedDir::commit`], with the earlier output's `stale` files (ones this output does
    /// not write, which would be read with it) removed, and `markers` (a model's
    /// `config.json` and an adapter's `adapter_config.json`, without which nothing loads
    /// either) as the commit point where the files are moved one by one: the earlier markers
    /// go first, then the stale files, then the new files, the new markers last. A kill or an
    /// error part-way then leaves a directory without them, which loaders refuse, never new
    /// weights beside an old adapter.
    pub fn commit_replacing(
        mut self,
        replaceable: &[&str],
        stale: &[PathBuf],
        markers: &[&str],
    ) -> Result<Vec<PathBuf>, TrainError> {
        let Some(staging) = self.staging.take() else {
            return Ok(Vec::new());
        };
        let io = |path: &Path, source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        let names = staged_names(&staging).map_err(|e| io(&staging, e));
        let names = match names {
            Ok(n) => n,
            Err(e) => {
                let _ = fs::remove_dir_all(&staging);
                return Err(e);
            }
        };
        let finals: Vec<PathBuf> = names.iter().map(|n| self.dir.join(n)).collect();
        let whole = if self.beside {
            match fs::symlink_metadata(&self.dir) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    Some(fs::rename(&staging, &self.dir))
                }
                Ok(m) if m.is_dir() && holds_only(&self.dir, replaceable) => {
                    // The directory that takes the output's place keeps its permissions.
                    let _ = fs::set_permissions(&staging, m.permissions());
                    exchange(&staging, &self.dir)
                }
                _ => None,
            }
        } else {
            None
        };
        let result = match whole {
            Some(Ok(())) => {
                sync_dir(self.dir.parent().unwrap_or(Path::new(".")));
                Ok(())
            }
            Some(Err(e)) => Err(io(&self.dir, e)),
            None => {
                let is_marker =
                    |n: &std::ffi::OsString| markers.iter().any(|m| n.as_os_str() == *m);
                let remove = |p: &Path| match fs::remove_file(p) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(p, e)),
                    _ => Ok(()),
                };
                let moved = (|| {
                    if !markers.is_empty() {
                        markers.iter().try_for_each(|m| remove(&self.dir.join(m)))?;
                        sync_dir(&self.dir);
                    }
                    stale.iter().try_for_each(|p| remove(p))?;
                    let (last, first): (Vec<_>, Vec<_>) =
                        names.iter().zip(&finals).partition(|(n, _)| is_marker(n));
                    first.into_iter().chain(last).try_for_each(|(n, to)| {
                        fs::rename(staging.join(n), to).map_err(|e| io(to, e))
                    })
                })();
                sync_dir(&self.dir);
                moved
            }
        };
        // After an exchange, the earlier output's files; otherwise what is left unmoved.
        let _ = fs::remove_dir_all(&staging);
        result.map(|()| finals)
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if let Some(staging) = self.staging.take() {
            let _ = fs::remove_dir_all(staging);
            if self.created {
                // Only if still empty: nothing another process put there is removed.
                let _ = fs::remove_dir(&self.dir);
            }
        }
    }
}

/// Whether a staging directory beside `dir` (in `parent`) can take its place with a rename:
/// `dir` is not a link, and is on `parent`'s file system (or does not exist yet).
fn sibling_possible(dir: &Path, parent: &Path) -> bool {
    match fs::symlink_metadata(dir) {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(m) if !m.is_dir() => false,
        #[cfg(unix)]
        Ok(m) => {
            use std::os::unix::fs::MetadataExt;
            fs::metadata(parent).is_ok_and(|p| p.dev() == m.dev())
        }
        #[cfg(not(unix))]
        Ok(_) => false,
    }
}

/// The regular files in a staging directory, by name, sorted.
fn staged_names(staging: &Path) -> std::io::Result<Vec<std::ffi::OsString>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(staging)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            names.push(entry.file_name());
        }
    }
    names.sort();
    Ok(names)
}

/// Whether every entry of `dir` is named in `names` (and is no directory).
fn holds_only(dir: &Path, names: &[&str]) -> bool {
    fs::read_dir(dir).is_ok_and(|entries| {
        entries.into_iter().all(|e| {
            e.is_ok_and(|e| {
                e.file_type().is_ok_and(|t| !t.is_dir())
                    && e.file_name().to_str().is_some_and(|n| names.contains(&n))
            })
        })
    })
}

/// Swaps two directories in one step; `None` where the system cannot.
fn exchange(a: &Path, b: &Path) -> Option<std::io::Result<()>> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).ok();
        let (Some(a), Some(b)) = (c(a), c(b)) else {
            return None;
        };
        // SAFETY: both paths are NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc == 0 {
            return Some(Ok(()));
        }
        let err = std::io::Error::last_os_error();
        // A file system or kernel without the exchange: the renames one by one instead.
        match err.raw_os_error() {
            Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EXDEV) => None,
            _ => Some(Err(err)),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        None
    }
}

/// Makes renames in `dir` durable. Not every file system syncs a directory; the files' data
/// is already synced, so a failure loses nothing but the names.
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
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

    fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| {
                let bytes = fs::read(e.path()).unwrap_or_default();
                (e.file_name().to_string_lossy().into_owned(), bytes)
            })
            .collect();
        files.sort();
        files
    }

    #[test]
    fn staged_files_replace_the_old_ones_together_or_not_at_all() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("model");
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("weights"), "old weights").unwrap();
        fs::write(dir.join("adapter"), "old adapter").unwrap();
        let before = listing(&dir);
        let parent = listing(tmp.path());
        let names = ["weights", "adapter", "config"];

        // Dropped part-way (an error after the first file): nothing changes.
        let staged = StagedDir::new(&dir).unwrap();
        fs::write(staged.path().join("weights"), "new weights").unwrap();
        drop(staged);
        assert_eq!(listing(&dir), before);
        assert_eq!(listing(tmp.path()), parent, "a staging directory stayed");

        // Holding only the command's files, the directory is replaced whole: the earlier
        // adapter, not written this time, goes with it; the directory's permissions stay.
        #[cfg(unix)]
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o750)).unwrap();
            || fs::metadata(&dir).unwrap().permissions().mode() & 0o777
        };
        let staged = StagedDir::new(&dir).unwrap();
        let w = staged.path().join("weights");
        fs::write(&w, "new weights").unwrap();
        fs::write(staged.path().join("config"), "new config").unwrap();
        assert_eq!(staged.final_path(&w), dir.join("weights"));
        let moved = staged.commit(&names).unwrap();
        assert_eq!(moved, vec![dir.join("config"), dir.join("weights")]);
        let want = |files: &[(&str, &str)]| -> Vec<(String, Vec<u8>)> {
            files
                .iter()
                .map(|(n, b)| (n.to_string(), b.as_bytes().to_vec()))
                .collect()
        };
        assert_eq!(
            listing(&dir),
            want(&[("config", "new config"), ("weights", "new weights")])
        );
        #[cfg(unix)]
        assert_eq!(mode(), 0o750);
        assert_eq!(listing(tmp.path()), parent, "a staging directory stayed");

        // Beside a file of the user's, each file is moved in and the rest left.
        fs::write(dir.join("notes.txt"), "mine").unwrap();
        fs::write(dir.join("adapter"), "old adapter").unwrap();
        let staged = StagedDir::new(&dir).unwrap();
        fs::write(staged.path().join("weights"), "newer weights").unwrap();
        staged.commit(&names).unwrap();
        assert_eq!(
            listing(&dir),
            want(&[
                ("adapter", "old adapter"),
                ("config", "new config"),
                ("notes.txt", "mine"),
                ("weights", "newer weights")
            ])
        );
    }

    /// Moved in one by one (beside a user's file), the earlier marker goes first and the new
    /// one comes last, the stale files before any new file: a move that fails part-way leaves
    /// no marker, so nothing reads new weights beside the old adapter.
    #[test]
    fn files_moved_one_by_one_leave_no_marker_until_all_are_in() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        fs::create_dir(&dir).unwrap();
        for (n, b) in [
            ("config", "old config"),
            ("adapter", "old adapter"),
            ("notes.txt", "mine"),
        ] {
            fs::write(dir.join(n), b).unwrap();
        }
        // `weights` cannot be renamed over: a directory holding a file stands there.
        fs::create_dir(dir.join("weights")).unwrap();
        fs::write(dir.join("weights").join("x"), "x").unwrap();
        let staged = StagedDir::new(&dir).unwrap();
        fs::write(staged.path().join("config"), "new config").unwrap();
        fs::write(staged.path().join("weights"), "new weights").unwrap();
        let names = ["config", "weights", "adapter"];
        let stale = [dir.join("adapter")];
        assert!(staged
            .commit_replacing(&names, &stale, &["config"])
            .is_err());
        assert!(!dir.join("config").exists(), "a marker beside a mix");
        assert!(!dir.join("adapter").exists(), "the stale adapter stayed");
        assert_eq!(fs::read(dir.join("notes.txt")).unwrap(), b"mine");
        // Once the obstacle is gone, the next commit puts the whole output in.
        fs::remove_dir_all(dir.join("weights")).unwrap();
        let staged = StagedDir::new(&dir).unwrap();
        fs::write(staged.path().join("config"), "new config").unwrap();
        fs::write(staged.path().join("weights"), "new weights").unwrap();
        staged.commit_replacing(&names, &[], &["config"]).unwrap();
        assert_eq!(fs::read(dir.join("config")).unwrap(), b"new config");
        assert_eq!(fs::read(dir.join("weights")).unwrap(), b"new weights");
    }

    #[test]
    fn a_new_output_directory_appears_whole_or_not_at_all() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("new");
        let staged = StagedDir::new(&dir).unwrap();
        fs::write(staged.path().join("weights"), "w").unwrap();
        assert!(
            !dir.exists(),
            "the output showed before its files were complete"
        );
        drop(staged);
        assert!(
            listing(tmp.path()).is_empty(),
            "a failed write left something"
        );

        let staged = StagedDir::new(&dir).unwrap();
        fs::write(staged.path().join("weights"), "w").unwrap();
        staged.commit(&[]).unwrap();
        assert_eq!(listing(&dir), vec![("weights".to_string(), b"w".to_vec())]);
        assert_eq!(listing(tmp.path()).len(), 1, "a staging directory stayed");
    }

    #[cfg(unix)]
    #[test]
    fn through_a_link_the_files_are_staged_inside_and_the_link_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("weights"), "old").unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let staged = StagedDir::new(&link).unwrap();
        assert!(staged.path().starts_with(&link));
        // Another command's staging in progress is not earlier output.
        assert!(check_dir(&link, &["other"], DirContents::Nothing, false).is_err());
        fs::remove_file(target.join("weights")).unwrap();
        assert!(check_dir(&link, &["weights"], DirContents::Nothing, false).is_ok());
        fs::write(staged.path().join("weights"), "new").unwrap();
        staged.commit(&["weights"]).unwrap();
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            listing(&target),
            vec![("weights".to_string(), b"new".to_vec())]
        );
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
        // Any model's weights, by name or by their safetensors header: a page or a trace
        // never goes over them.
        let weights = dir.path().join("model.safetensors");
        fs::write(&weights, b"not even a header").unwrap();
        assert!(
            check_file(&weights, true).is_ok(),
            "export replaces its own"
        );
        assert!(refused_(check_document_file(&weights, true)));
        let unnamed = dir.path().join("weights.bin");
        let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0; 4]);
        fs::write(&unnamed, &bytes).unwrap();
        assert!(refused_(check_document_file(&unnamed, true)));
        let page = dir.path().join("page.html");
        fs::write(&page, b"<html>").unwrap();
        assert!(check_document_file(&page, true).is_ok());
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
