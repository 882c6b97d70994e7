//! Checkpoints and weights that are not regular files: a FIFO with no writer blocks `open`
//! forever and `/dev/zero` never ends. Every flag that reads a checkpoint or weights refuses
//! them by type, quickly, with the path in the error and exit 1 (no panic, no hang).
#![cfg(unix)]

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest any of these runs may take; the child is killed (and the test fails) after it.
const TIMEOUT: Duration = Duration::from_secs(20);

struct Ended {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `snug args` in `cwd`, killing it (and failing) after [`TIMEOUT`].
fn run(cwd: &Path, args: &[&str]) -> Ended {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the snug binary starts");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for snug") {
            break status;
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = err.join().unwrap();
            panic!("snug {args:?} still ran after {TIMEOUT:?}; stderr: {stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ended {
        code: status.code(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    let r = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(r, 0, "mkfifo: {}", std::io::Error::last_os_error());
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
