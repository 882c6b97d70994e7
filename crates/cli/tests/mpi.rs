//! `snug train` over MPI: `mpirun -np 2 snug train` trains what one process does with
//! accumulation 2, rank 0 alone prints and saves, ranks started differently stop with the
//! keys named; and without mpirun, `--shard` and `--devices` are refused by name. (Sharded
//! checkpoints: `mpi_checkpoint.rs`.)
//!
//! The mpirun tests are skipped, with the reason printed, when snug was built without the
//! `mpi` feature or `mpirun` is missing (a failure under `SNUG_REQUIRE_ALL_TESTS=1`, as in CI).

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::fails_with;
#[cfg(target_os = "linux")]
use common::mpi::ranks_of;
use common::mpi::{self, lines, mpirun, refused, text, two_ranks};
use snug_train::checkpoint;

/// The tiny model on the built-in data, 5 steps of a batch of 4, one thread, evaluated at the end.
const RUN: [&str; 16] = mpi::run("5");

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
    // The evaluation covers the same 8 batches of 4 windows: one process in micro-batches
    // of 2, each rank its half of every batch, summed over the ranks.
    let (ea, eb) = (lines(&single, "eval"), lines(&ranks, "eval"));
    assert_eq!((ea.len(), eb.len()), (1, 1), "{}", text(&ranks.stdout));
    for key in ["train_loss_tokens", "val_loss_tokens"] {
        assert_eq!(ea[0][key], 8 * 4 * 16, "{key}");
        assert_eq!(eb[0][key], ea[0][key], "{key}");
    }
    for key in ["train_loss", "val_loss"] {
        let (x, y) = (ea[0][key].as_f64().unwrap(), eb[0][key].as_f64().unwrap());
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{key}: {x} against {y}");
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
    // One rank each, with another learning rate (so another decay floor, a tenth of it) and
    // seed on rank 1.
    let o = cmd
        .args(["-np", "1", exe])
        .args(RUN)
        .args(["--no-save", "--lr", "0.01", ":", "-np", "1", exe])
        .args(RUN)
        .args(["--no-save", "--lr", "0.02", "--seed", "7"])
        .current_dir(dir.path())
        .output()
        .expect("mpirun runs");
    refused(&o, "rank 1 differs from rank 0 in lr, min_lr, seed");
    assert!(lines(&o, "step").is_empty(), "no step ran");
    assert!(start.elapsed() < Duration::from_secs(60), "no rank hung");
}

/// Both ranks refuse the step as they set it up, each writing its error as the other does.
/// Each error is one write: `eprintln!` wrote anyhow's causes one by one, and through
/// mpirun's one pipe the two ranks' pieces came out interleaved mid-sentence.
#[test]
fn each_ranks_error_reaches_the_terminal_whole() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let cause = "quantized frozen weights are not supported over several ranks yet";
    for _ in 0..3 {
        let mut cmd = mpirun().expect("checked above");
        let o = cmd
            .args(["-np", "2", env!("CARGO_BIN_EXE_snug")])
            .args(RUN)
            .args(["--no-save", "--lora", "2", "--quantize-base", "nf4"])
            .current_dir(dir.path())
            .output()
            .expect("mpirun runs");
        let err = refused(&o, cause);
        let errors: Vec<&str> = err.lines().filter(|l| l.contains("error: rank")).collect();
        assert!(!errors.is_empty(), "{err}");
        for line in errors {
            let whole = (0..2).any(|r| {
                line.starts_with(&format!("error: rank {r} of 2: setting up training: "))
                    && line.contains(cause)
                    && line.matches("error: rank").count() == 1
            });
            assert!(
                whole,
                "an error line broken by another's: {line:?} in {err}"
            );
        }
    }
}

#[test]
fn sharding_needs_ranks() {
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
        &["--devices 2", "rank 0 of 1", "mpirun -np 2"],
    );
    // RUN's batch of 4 does not split over 3: the ranks are what is wrong, and said first.
    fails_with(
        dir.path(),
        &[&RUN[..], &["--devices", "3", "--no-save"]].concat(),
        &["--devices 3", "rank 0 of 1", "mpirun -np 3"],
    );
    fails_with(
        dir.path(),
        &[&RUN[..], &["--shard", "4", "--no-save"]].concat(),
        &["`shard`", "ZeRO stage 4 does not exist"],
    );
    assert!(!dir.path().join("runs").exists());
}

#[test]
fn two_ranks_resume_bit_exact() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
    let s = straight.to_str().unwrap();
    // Five steps straight, saving after the third too.
    let all = two_ranks(
        dir.path(),
        &[&RUN[..], &["--out", s, "--checkpoint-every", "3"]].concat(),
    );
    // The third step's checkpoint alone in a run directory, resumed to the end.
    std::fs::create_dir(&resumed).unwrap();
    let name = "ckpt-00000003.safetensors";
    std::fs::copy(straight.join(name), resumed.join(name)).expect("the step-3 checkpoint");
    let rest = two_ranks(
        dir.path(),
        &["train", "--resume", resumed.to_str().unwrap(), "--json"],
    );
    let losses = |o: &Output| -> Vec<serde_json::Value> {
        lines(o, "step").iter().map(|l| l["loss"].clone()).collect()
    };
    assert_eq!(losses(&all)[3..], losses(&rest)[..], "steps 4 and 5");
    assert_eq!(weights(&straight), weights(&resumed));
}

#[cfg(target_os = "linux")]
#[test]
fn a_killed_rank_ends_the_job_within_seconds() {
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    // Output goes to files, never to pipes nobody reads until the end: a full pipe would
    // stall mpirun itself, and the test would time a blocked write instead of the abort.
    let log = dir.path().join("stderr.txt");
    let mut child = cmd
        .args(["-np", "2", env!("CARGO_BIN_EXE_snug")])
        .args(RUN)
        .args(["--steps", "100000", "--no-save"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("a log file"))
        .spawn()
        .expect("mpirun starts");
    // Wait for both ranks, then kill rank 1 as an out-of-memory killer would.
    let start = Instant::now();
    let victim = loop {
        let ranks = ranks_of(child.id());
        if ranks.len() == 2 {
            break ranks.into_iter().find(|&(_, r)| r == 1).map(|(pid, _)| pid);
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the ranks start");
        std::thread::sleep(Duration::from_millis(100));
    };
    let victim = victim.expect("rank 1's process");
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: signalling a process this test started (a child of its mpirun).
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let killed = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("mpirun's status") {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(30) {
            // Never leave a hung job behind.
            let _ = child.kill();
            panic!("the job still runs 30 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let err = std::fs::read_to_string(&log).expect("mpirun's standard error");
    assert!(!status.success());
    assert!(
        err.contains("rank 1") && err.contains("signal 9"),
        "the dead rank named: {err}"
    );
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "ended within seconds"
    );
}

/// The losses of a `--json` run's steps, by step.
fn step_losses(o: &Output) -> Vec<(u64, serde_json::Value)> {
    lines(o, "step")
        .iter()
        .map(|l| {
            (
                l["step"].as_u64().expect("a step number"),
                l["loss"].clone(),
            )
        })
        .collect()
}

/// Appended to a never-evaluated run (a flag given twice takes its last value): activations
/// enough that a smaller micro-batch or remat lowers the peak at ZeRO stage 0 (at RUN's shape
/// the persistent state sets it).
const OOM_SHAPE: [&str; 4] = ["--batch", "16", "--block", "64"];

#[test]
fn an_out_of_memory_on_one_rank_is_recovered_by_all_with_no_step_lost() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (hit, straight, direct) = (
        dir.path().join("hit"),
        dir.path().join("straight"),
        dir.path().join("direct"),
    );
    // Rank 1 alone runs out of memory taking step 3's memory (under a limit one byte below
    // its planned peak); rank 0's memory is fine.
    let mut cmd = mpirun().expect("checked above");
    let o = cmd
        .args([
            "-x",
            "SNUG_INJECT_OOM",
            "-np",
            "2",
            env!("CARGO_BIN_EXE_snug"),
        ])
        .args(mpi::run("0"))
        .args(OOM_SHAPE)
        .args(["--out", hit.to_str().unwrap()])
        .env("SNUG_INJECT_OOM", "1:3")
        .current_dir(dir.path())
        .output()
        .expect("mpirun runs");
    assert!(o.status.success(), "{}", text(&o.stderr));
    // No step lost: five steps, each once, and one recovery, at step 3, from rank 1's failure.
    let losses = step_losses(&o);
    assert_eq!(
        losses.iter().map(|l| l.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    let recoveries = lines(&o, "recovery");
    assert_eq!(recoveries.len(), 1, "{}", text(&o.stdout));
    let r = &recoveries[0];
    assert_eq!((r["step"].as_u64(), r["rank"].as_u64()), (Some(3), Some(1)));
    assert!(r["to_peak_bytes"].as_u64() < r["from_peak_bytes"].as_u64());
    // Recovery changes how the step runs (micro-batch and remat here), never what it trains.
    for key in ["passes", "precision", "shard", "levers"] {
        assert_eq!(r["to"][key], r["from"][key], "{key}");
    }
    let metrics = std::fs::read_to_string(hit.join("metrics.jsonl")).expect("rank 0's metrics");
    assert_eq!(
        metrics.matches("\"kind\":\"recovery\"").count(),
        1,
        "{metrics}"
    );
    // The same run without the failure, saved after step 2.
    let s = two_ranks(
        dir.path(),
        &[
            &mpi::run("0")[..],
            &OOM_SHAPE[..],
            &[
                "--out",
                straight.to_str().unwrap(),
                "--checkpoint-every",
                "2",
            ],
        ]
        .concat(),
    );
    assert_eq!(step_losses(&s)[..2], losses[..2]);
    // From that checkpoint, started directly in the configuration the ranks recovered to:
    // steps 3 to 5 and the final weights are bitwise those of the recovered run.
    std::fs::create_dir(&direct).unwrap();
    let name = "ckpt-00000002.safetensors";
    std::fs::copy(straight.join(name), direct.join(name)).expect("the step-2 checkpoint");
    let accumulation = r["to"]["accumulation"].to_string();
    let remat = r["to"]["remat"]
        .as_str()
        .expect("remat as text")
        .to_string();
    let d = two_ranks(
        dir.path(),
        &[
            "train",
            "--resume",
            direct.to_str().unwrap(),
            "--json",
            "--accumulation",
            &accumulation,
            "--remat",
            &remat,
        ],
    );
    assert!(lines(&d, "recovery").is_empty());
    assert_eq!(step_losses(&d)[..], losses[2..]);
    assert_eq!(weights(&direct), weights(&hit));
}

/// `mpirun -np 2 snug train --memory SIZE` fits each rank's step at the run's ZeRO stage to
/// SIZE: fit's chosen peak is the one each rank then plans and measures. Each case is one a
/// fuzz found wrong when fit sized the run as one device: a fitting budget refused, a budget
/// equal to the rank's own plan refused, and a micro-batch of 8 split into ranks of 0.
#[test]
fn memory_over_ranks_fits_each_ranks_step_at_its_stage() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let common = [
        "train",
        "--preset",
        "tiny",
        "--block",
        "64",
        "--threads",
        "1",
        "--devices",
        "2",
        "--steps",
        "2",
        "--no-save",
        "--eval-every",
        "0",
        "--json",
    ];
    for (flags, memory) in [
        (&["--batch", "16"][..], "11300000B"),
        (
            &[
                "--batch",
                "8",
                "--precision",
                "bf16",
                "--grad-clip",
                "0",
                "--shard",
                "3",
            ],
            "6148160B",
        ),
        (
            &[
                "--batch",
                "8",
                "--optimizer",
                "sgd",
                "--grad-clip",
                "0",
                "--shard",
                "3",
            ],
            "5370432B",
        ),
    ] {
        let o = two_ranks(
            dir.path(),
            &[&common[..], flags, &["--memory", memory]].concat(),
        );
        let budget = snug_plan::parse_bytes(memory).unwrap() as u64;
        let fit = &lines(&o, "fit")[0];
        let chosen = fit["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["verdict"] == "chosen")
            .expect("a chosen candidate");
        let stage = flags
            .iter()
            .position(|&f| f == "--shard")
            .map_or(0, |i| flags[i + 1].parse::<u64>().unwrap());
        assert_eq!(chosen["config"]["shard"].as_u64(), Some(stage), "{flags:?}");
        let summary = &lines(&o, "summary")[0];
        let peak = chosen["peak_bytes"].as_u64().unwrap();
        assert!(peak <= budget, "{flags:?}: {peak} over {budget}");
        assert_eq!(
            summary["predicted_peak_bytes"].as_u64(),
            Some(peak),
            "{flags:?}"
        );
        assert_eq!(
            summary["measured_peak_bytes"].as_u64(),
            Some(peak),
            "{flags:?}"
        );
    }
}

/// `--memory auto` over ranks on one machine: the ranks share its available memory, each
/// planning for its part (every rank the same budget), rather than each for nearly all of it.
#[cfg(target_os = "linux")]
#[test]
fn memory_auto_over_ranks_on_one_machine_shares_it() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let available = || -> u64 {
        let info = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
        let line = info
            .lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .expect("MemAvailable");
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let before = available();
    let o = two_ranks(
        dir.path(),
        &[&RUN[..], &["--no-save", "--memory", "auto"]].concat(),
    );
    let most = before.max(available());
    let fit = lines(&o, "fit");
    let budget = fit[0]["budget"].as_u64().expect("the budget");
    // Each rank's part: at most half of what is available, less snug's reserve.
    assert!(budget <= most / 2, "{budget} of {most} available");
    assert!(budget >= most / 4, "{budget} of {most} available");
    let summary = lines(&o, "summary");
    assert_eq!(summary[0]["memory_limit_bytes"].as_u64(), Some(budget));
}

/// Each rank started in its own directory with `--data corpus.txt`: the relative path names a
/// file in each rank's directory, so the paths differ and are not compared; the contents are.
#[test]
fn ranks_compare_their_data_by_contents_not_by_path() {
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let corpus: String = (0..400)
        .map(|i| format!("line {i} of the corpus\n"))
        .collect();
    // The same characters, as many of them, in another order: the same vocabulary and plan.
    let reordered: String = corpus.lines().rev().map(|l| format!("{l}\n")).collect();
    assert_eq!(corpus.len(), reordered.len());
    let exe = env!("CARGO_BIN_EXE_snug");
    let run = |cmd: &mut Command, b_text: &str| -> Output {
        for (d, t) in [(&a, corpus.as_str()), (&b, b_text)] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("corpus.txt"), t).unwrap();
        }
        let start = Instant::now();
        let o = cmd
            .args(["-np", "1", "-wdir", a.to_str().unwrap(), exe])
            .args(RUN)
            .args(["--data", "corpus.txt", "--no-save", ":"])
            .args(["-np", "1", "-wdir", b.to_str().unwrap(), exe])
            .args(RUN)
            .args(["--data", "corpus.txt", "--no-save"])
            .output()
            .expect("mpirun runs");
        assert!(start.elapsed() < Duration::from_secs(60), "no rank hung");
        o
    };
    let same = run(&mut cmd, &corpus);
    assert!(same.status.success(), "{}", text(&same.stderr));
    assert_eq!(lines(&same, "step").len(), 5, "rank 0 reports every step");

    let mut cmd = mpirun().expect("checked above");
    let other = run(&mut cmd, &reordered);
    refused(&other, "rank 1 differs from rank 0 in data");
    assert!(lines(&other, "step").is_empty(), "no step ran");
}
