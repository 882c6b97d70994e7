//! Running the `snug` binary from the CLI's integration tests: each test file takes the helpers
//! it needs (hence the allowance: no file uses them all).
#![allow(dead_code)]

pub mod mpi;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A Hugging Face fixture directory made by `scripts/hf_fixtures/make_fixtures.py`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../nn/tests/fixtures/hf")
        .join(name)
}

/// Runs `snug args` in `cwd` (`snug train` without `--out` saves under ./runs there).
pub fn snug(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the snug binary runs")
}

/// [`snug`], which must succeed.
pub fn ok(cwd: &Path, args: &[&str]) -> Output {
    let o = snug(cwd, args);
    assert!(
        o.status.success(),
        "snug {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// [`snug`], which must fail with exit code 1 (an error, not a panic or a usage error) and an
/// error naming each of `needles`.
pub fn fails_with(cwd: &Path, args: &[&str], needles: &[&str]) {
    let o = snug(cwd, args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` missing from: {err}");
    }
}

/// Dates `path` (a file or a directory) two hours back, as if no writer had touched it since:
/// what snug takes for a killed writer's leftovers once no process holds them.
pub fn untouched_for_two_hours(path: &Path) {
    let then = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::open(path)
        .and_then(|f| f.set_modified(then))
        .expect("an older modification time");
}
