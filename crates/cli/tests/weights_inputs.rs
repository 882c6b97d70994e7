//! Checkpoints and weights that are not regular files: a FIFO with no writer blocks `open`
//! forever and `/dev/zero` never ends. Every flag that reads a checkpoint or weights refuses
//! them by type, quickly, with the path in the error and exit 1 (no panic, no hang).
#![cfg(unix)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use snug_testkit::bounded::{self, mkfifo, Ended};

/// Longest any of these runs may take; the child is killed (and the test fails) after it.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `snug args` in `cwd`, killing it (and failing) after [`TIMEOUT`].
fn run(cwd: &Path, args: &[&str]) -> Ended {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    cmd.args(args).current_dir(cwd);
    bounded::run_to_end(cmd, TIMEOUT, &format!("snug {args:?}"))
}

#[test]
fn fifos_and_devices_are_refused_as_checkpoints_and_weights() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let fifo = cwd.join("weights.pipe");
    mkfifo(&fifo);
    let fifo = fifo.to_str().unwrap();
    for (path, kind) in [
        (fifo, "a FIFO (named pipe)"),
        ("/dev/zero", "a character device"),
    ] {
        let cases: [Vec<&str>; 4] = [
            vec!["sample", "--checkpoint", path, "--tokens", "3"],
            vec!["export", "--checkpoint", path, "--out", "hf"],
            vec!["train", "--resume", path, "--steps", "1", "--threads", "1"],
            vec![
                "train",
                "--preset",
                "tiny",
                "--init-from",
                path,
                "--steps",
                "1",
                "--threads",
                "1",
                "--no-save",
            ],
        ];
        for args in cases {
            let e = run(cwd, &args);
            assert_eq!(e.code, Some(1), "snug {args:?}: {}", e.stderr);
            assert!(!e.stderr.contains("panicked"), "{args:?}: {}", e.stderr);
            for needle in [path, kind, "not a regular file"] {
                assert!(
                    e.stderr.contains(needle),
                    "snug {args:?}: `{needle}` missing from: {}",
                    e.stderr
                );
            }
        }
    }
    assert!(!cwd.join("hf").exists(), "export wrote before reading");
}

/// A FIFO named like a newer checkpoint in a run directory is skipped with a warning naming
/// it; the newest real checkpoint loads.
#[test]
fn a_fifo_among_checkpoints_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let trained = run(
        cwd,
        &[
            "train",
            "--steps",
            "2",
            "--batch",
            "2",
            "--threads",
            "1",
            "--eval-every",
            "0",
            "--json",
            "--out",
            "run",
        ],
    );
    assert_eq!(trained.code, Some(0), "{}", trained.stderr);
    let fifo = cwd.join("run").join("ckpt-00000099.safetensors");
    mkfifo(&fifo);
    let e = run(
        cwd,
        &[
            "sample",
            "--checkpoint",
            "run",
            "--tokens",
            "3",
            "--threads",
            "1",
            "--json",
        ],
    );
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let report: serde_json::Value = serde_json::from_str(&e.stdout).unwrap();
    assert_eq!(report["step"], 2);
    assert!(
        e.stderr.contains("ckpt-00000099.safetensors") && e.stderr.contains("FIFO"),
        "{}",
        e.stderr
    );
}
