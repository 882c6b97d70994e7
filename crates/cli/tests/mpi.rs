//! `snug train` over MPI: `mpirun -np 2 snug train` trains what one process does with
//! accumulation 2, rank 0 alone prints and saves, ranks started differently stop with the
//! keys named; and without mpirun, `--shard` and `--devices` are refused by name.
//!
//! The mpirun tests are skipped, with the reason printed, when snug was built without the
//! `mpi` feature or `mpirun` is missing (a failure under `SNUG_REQUIRE_ALL_TESTS=1`, as in CI).

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::fails_with;
use snug_train::checkpoint;

/// The tiny model on the built-in data, 5 steps of a batch of 4, one thread.
const RUN: [&str; 16] = [
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
    "0",
    "--warmup-steps",
    "2",
    "--json",
];

/// `mpirun` for `np` ranks of `snug`, or the reason this test cannot run.
fn mpirun() -> Result<Command, String> {
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

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The `kind` lines of a `--json` run's output.
fn lines(o: &Output, kind: &str) -> Vec<serde_json::Value> {
    text(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == kind)
        .collect()
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let (_, ckpt) = checkpoint::load(dir).expect("the run's checkpoint");
    ckpt.parameters()
}

#[test]
fn two_ranks_train_what_one_process_does_and_rank_0_alone_reports() {
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let single = common::ok(
        dir.path(),
        &[
            &RUN[..],
            &["--accumulation", "2", "--out", one.to_str().unwrap()],
        ]
        .concat(),
    );
    let exe = env!("CARGO_BIN_EXE_snug");
    let ranks = cmd
        .args(["-np", "2", exe])
        .args(RUN)
        .args(["--out", two.to_str().unwrap()])
        .current_dir(dir.path())
        .output()
        .expect("mpirun runs");
    assert!(ranks.status.success(), "mpirun: {}", text(&ranks.stderr));
    let (a, b) = (lines(&single, "step"), lines(&ranks, "step"));
    // Rank 0 alone prints: one line per step, one summary.
    assert_eq!(b.len(), 5, "{}", text(&ranks.stdout));
    assert_eq!(lines(&ranks, "summary").len(), 1);
    for (a, b) in a.iter().zip(&b) {
        // The loss over the whole batch, its four micro-batches summed in one order: bitwise.
        assert_eq!(a["loss"], b["loss"], "step {}", a["step"]);
        assert_eq!(a["tokens_seen"], b["tokens_seen"]);
    }
    // Each rank runs a micro-batch of 2 as one process does: the same plan, measured.
    let summary = &lines(&ranks, "summary")[0];
    assert_eq!(
        summary["measured_peak_bytes"],
        summary["predicted_peak_bytes"]
    );
    // Rank 0 saved the run; the weights agree with one process's within 1e-6 of each
    // tensor's largest value (its backward sums the two micro-batches' gradients inside
    // matrix products, two ranks add whole ones: the roundings differ).
    let (wa, wb) = (weights(&one), weights(&two));
    assert_eq!(wa.len(), wb.len());
    for ((name, x), (name_b, y)) in wa.iter().zip(&wb) {
        assert_eq!(name, name_b);
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            worst <= 1e-6 * scale,
            "`{name}` differs by {worst} ({scale})"
        );
    }
    // Nothing but the one run directory: rank 1 made none under ./runs.
    assert!(!dir.path().join("runs").exists());
}

#[test]
fn ranks_started_with_different_settings_stop_naming_the_keys() {
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let exe = env!("CARGO_BIN_EXE_snug");
    let start = Instant::now();
    // One rank each, with another learning rate and seed on rank 1.
    let o = cmd
        .args(["-np", "1", exe])
        .args(RUN)
        .args(["--no-save", "--lr", "0.01", ":", "-np", "1", exe])
        .args(RUN)
        .args(["--no-save", "--lr", "0.02", "--seed", "7"])
        .current_dir(dir.path())
        .output()
        .expect("mpirun runs");
    let err = text(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("rank 1 differs from rank 0 in lr, seed"),
        "the keys named: {err}"
    );
    assert!(lines(&o, "step").is_empty(), "no step ran");
    assert!(start.elapsed() < Duration::from_secs(60), "no rank hung");
}

#[test]
fn sharding_needs_ranks_and_saves_no_checkpoint_yet() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    // Alone (no mpirun): a stage or a world of several is refused by name, in any build.
    fails_with(
        dir.path(),
        &[&RUN[..], &["--shard", "1", "--no-save"]].concat(),
        &["`shard`", "mpirun -np N"],
    );
    fails_with(
        dir.path(),
        &[&RUN[..], &["--devices", "2", "--no-save"]].concat(),
        &["`devices`", "rank 0 of 1", "mpirun -np 2"],
    );
    fails_with(
        dir.path(),
        &[&RUN[..], &["--shard", "4", "--no-save"]].concat(),
        &["`shard`", "ZeRO stage 4 does not exist"],
    );
    assert!(!dir.path().join("runs").exists());
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    // Under mpirun, a sharded run that would save is refused before it trains.
    let o = cmd
        .args(["-np", "2", env!("CARGO_BIN_EXE_snug")])
        .args(RUN)
        .args(["--shard", "2"])
        .current_dir(dir.path())
        .output()
        .expect("mpirun runs");
    let err = text(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("--no-save"), "{err}");
    assert!(lines(&o, "step").is_empty());
}
