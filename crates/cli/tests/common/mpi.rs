//! Running `snug` under `mpirun`, for the MPI tests (`mpi.rs`, `mpi_checkpoint.rs`).

use std::path::Path;
use std::process::{Command, Output};

/// The tiny model on the built-in data, 5 steps of a batch of 4, one thread, evaluated every
/// `eval_every` steps (0: never).
pub const fn run(eval_every: &'static str) -> [&'static str; 16] {
    [
        "train",
        "--preset",
        "tiny",
        "--steps",
        "5",
        "--batch",
        "4",
        "--block",
        "16",
        "--threads",
        "1",
        "--eval-every",
        eval_every,
        "--warmup-steps",
        "2",
        "--json",
    ]
}

/// `mpirun`, or the reason this test cannot run.
pub fn mpirun() -> Result<Command, String> {
    if !cfg!(feature = "mpi") {
        return Err(
            "snug was built without the `mpi` feature (cargo test -p snug-cli --features mpi)"
                .into(),
        );
    }
    let found = Command::new("mpirun").arg("--version").output();
    if !found.is_ok_and(|o| o.status.success()) {
        return Err(
            "`mpirun` is not on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)".into(),
        );
    }
    let mut cmd = Command::new("mpirun");
    cmd.args(["--bind-to", "none", "--oversubscribe"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    Ok(cmd)
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The `kind` lines of a `--json` run's output.
pub fn lines(o: &Output, kind: &str) -> Vec<serde_json::Value> {
    text(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == kind)
        .collect()
}

/// Checks that an mpirun job failed without a panic, its standard error holding `needle`;
/// returns that standard error.
pub fn refused(o: &Output, needle: &str) -> String {
    let err = text(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "`{needle}` missing from: {err}");
    err
}

/// Runs `snug args` as two ranks in `cwd`; they must succeed.
pub fn two_ranks(cwd: &Path, args: &[&str]) -> Output {
    let mut cmd = mpirun().expect("checked by the caller");
    let o = cmd
        .args(["-np", "2", env!("CARGO_BIN_EXE_snug")])
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("mpirun runs");
    assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    o
}

/// The process ids of `mpirun`'s children (the ranks), with their rank.
#[cfg(target_os = "linux")]
pub fn ranks_of(mpirun: u32) -> Vec<(u32, usize)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The parent's id is the second field after the parenthesised command name.
            let after = &stat[stat.rfind(')')? + 2..];
            let ppid: u32 = after.split(' ').nth(1)?.parse().ok()?;
            if ppid != mpirun {
                return None;
            }
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let rank = env
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(b"OMPI_COMM_WORLD_RANK="))?;
            Some((pid, std::str::from_utf8(rank).ok()?.parse().ok()?))
        })
        .collect()
}
