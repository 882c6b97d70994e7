//! No run loses its work: a run directory holds one run at a time (a lock, and a check of what
//! is already there), and a run that stops on an error after a completed step saves it. The
//! commands that write where a user says (`export`, `prepare`, `report`, `profile --trace`)
//! replace nothing unless told to (`--force`), and never write over a run or a checkpoint.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn snug_cmd(args: &[&str], cwd: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_snug"));
    c.args(args).current_dir(cwd);
    c
}

fn snug(args: &[&str], cwd: &Path) -> Output {
    snug_cmd(args, cwd).output().expect("the snug binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const QUICK: [&str; 8] = [
    "--threads",
    "1",
    "--eval-every",
    "0",
    "--batch",
    "4",
    "--block",
    "16",
];

fn train(cwd: &Path, extra: &[&str]) -> Output {
    snug(&[&["train"], &QUICK[..], extra].concat(), cwd)
}

/// Every file in `dir` with its bytes, to show nothing was touched.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("the run directory")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).expect("a readable file");
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

fn checkpoint_steps(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .expect("the run directory")
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            name.strip_prefix("ckpt-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort();
    steps
}

#[test]
fn a_fresh_run_never_takes_a_directory_holding_another_run() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    let run_s = run.to_str().expect("a UTF-8 path");
    let first = train(
        tmp.path(),
        &["--steps", "4", "--checkpoint-every", "2", "--out", run_s],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(checkpoint_steps(&run), vec![2, 4]);
    let before = snapshot(&run);

    // A new, shorter run would have kept the old run's higher steps and deleted its own.
    let second = train(tmp.path(), &["--steps", "2", "--seed", "7", "--out", run_s]);
    assert!(!second.status.success());
    let err = stderr(&second);
    assert!(
        err.contains(run_s) && err.contains("--resume") && err.contains("step 4"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(snapshot(&run), before, "the old run's files changed");

    // Resuming from an older checkpoint while a newer one is there would fork the history.
    let older = run.join("ckpt-00000002.safetensors");
    let fork = snug(
        &[
            &[
                "train",
                "--steps",
                "6",
                "--resume",
                older.to_str().expect("UTF-8"),
            ],
            &QUICK[..],
        ]
        .concat(),
        tmp.path(),
    );
    assert!(!fork.status.success());
    assert!(
        stderr(&fork).contains("newer checkpoint (step 4)"),
        "{}",
        stderr(&fork)
    );
    assert_eq!(snapshot(&run), before, "the old run's files changed");

    // Continuing the run itself is fine, and keeps its history.
    let resumed = snug(
        &[&["train", "--steps", "6", "--resume", run_s], &QUICK[..]].concat(),
        tmp.path(),
    );
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(checkpoint_steps(&run), vec![2, 4, 6]);
}

#[test]
fn with_no_out_each_run_gets_its_own_directory_and_sample_reads_it() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    for _ in 0..2 {
        let o = train(tmp.path(), &["--steps", "2"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(text.contains("run directory: runs/llama-tiny-"), "{text}");
    }
    let runs = tmp.path().join("runs");
    for n in [1, 2] {
        assert_eq!(
            checkpoint_steps(&runs.join(format!("llama-tiny-{n}"))),
            vec![2]
        );
    }
    let sample = snug(
        &[
            "sample",
            "--checkpoint",
            "runs/llama-tiny-2",
            "--prompt",
            "1+1=",
            "--tokens",
            "4",
        ],
        tmp.path(),
    );
    assert!(sample.status.success(), "{}", stderr(&sample));
    let o = train(tmp.path(), &["--steps", "1", "--no-save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!runs.join("llama-tiny-3").exists());
}

#[cfg(unix)]
#[test]
fn a_second_run_on_a_locked_directory_is_refused() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    let run_s = run.to_str().expect("a UTF-8 path");
    let mut first = snug_cmd(
        &[
            &["train", "--json", "--steps", "100000", "--out", run_s],
            &QUICK[..],
        ]
        .concat(),
        tmp.path(),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .expect("the snug binary runs");
    let mut lines = BufReader::new(first.stdout.take().expect("a pipe")).lines();
    // Training is under way once the first step is printed.
    while let Some(Ok(line)) = lines.next() {
        if line.contains("\"kind\":\"step\"") {
            break;
        }
    }
    let second = train(tmp.path(), &["--steps", "2", "--out", run_s]);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(first.id() as i32, libc::SIGKILL) };
    let _ = first.wait();
    assert!(!second.status.success());
    let err = stderr(&second);
    assert!(err.contains("in use by another snug process"), "{err}");
    assert!(
        checkpoint_steps(&run).is_empty(),
        "the second run saved into the first's"
    );
}

#[test]
fn a_failed_recovery_saves_the_last_completed_step() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    let run_s = run.to_str().expect("a UTF-8 path");
    // 1 KiB fits no configuration: the recovery at step 3 fails.
    let o = train(
        tmp.path(),
        &[
            "--steps",
            "10",
            "--out",
            run_s,
            "--memory-limit",
            "1GiB",
            "--strict",
            "--lower-memory-at",
            "3:1KiB",
        ],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("the state after step 2 is saved") && err.contains("--resume"),
        "{err}"
    );
    assert_eq!(checkpoint_steps(&run), vec![2]);
    let resumed = snug(
        &[&["train", "--steps", "3", "--resume", run_s], &QUICK[..]].concat(),
        tmp.path(),
    );
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(checkpoint_steps(&run), vec![2, 3]);
}

/// A `--lower-memory-at` step outside the steps a run trains is refused before the run claims
/// its directory: none is made for a fresh run, and a resumed one's is left as it was.
#[test]
fn a_lowered_limit_outside_the_run_is_refused_before_its_directory_is_claimed() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    let run_s = run.to_str().expect("a UTF-8 path");
    let o = train(
        tmp.path(),
        &[
            "--steps",
            "3",
            "--out",
            run_s,
            "--lower-memory-at",
            "4:1GiB",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("this run trains steps 1 to 3"),
        "{}",
        stderr(&o)
    );
    assert!(!run.exists(), "no directory made for a refused run");
    let o = train(tmp.path(), &["--steps", "2", "--out", run_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    let listing = || std::fs::read_dir(&run).unwrap().count();
    let before = listing();
    let resume = [&["train", "--steps", "4", "--resume", run_s], &QUICK[..]].concat();
    let o = snug(
        &[&resume[..], &["--lower-memory-at", "2:1GiB"]].concat(),
        tmp.path(),
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("this run trains steps 3 to 4"),
        "{}",
        stderr(&o)
    );
    assert_eq!(checkpoint_steps(&run), vec![2]);
    assert_eq!(listing(), before, "no lock or other file left");
}

#[test]
fn a_limit_lowered_before_step_one_bites_at_step_one() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let o = train(
        tmp.path(),
        &[
            "--steps",
            "2",
            "--no-save",
            "--json",
            "--memory-limit",
            "1GiB",
            "--strict",
            "--lower-memory-at",
            "1:1KiB",
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("step 1"), "{}", stderr(&o));
    let zero = train(tmp.path(), &["--no-save", "--lower-memory-at", "0:1MiB"]);
    assert!(!zero.status.success());
    assert!(
        stderr(&zero).contains("steps count from 1"),
        "{}",
        stderr(&zero)
    );
}

#[cfg(target_os = "linux")]
#[test]
fn a_failing_metrics_write_stops_the_run_with_its_state_saved() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    std::fs::create_dir(&run).expect("a run directory");
    // Every write to /dev/full fails with "no space left on device".
    std::os::unix::fs::symlink("/dev/full", run.join("metrics.jsonl")).expect("a symlink");
    let o = train(
        tmp.path(),
        &[
            "--steps",
            "5",
            "--checkpoint-every",
            "0",
            "--out",
            run.to_str().expect("UTF-8"),
        ],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("metrics.jsonl") && err.contains("step 1"),
        "{err}"
    );
    assert_eq!(checkpoint_steps(&run), vec![1]);
}

#[cfg(unix)]
#[test]
fn a_closed_stdout_stops_the_run_with_its_state_saved() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    let mut child = snug_cmd(
        &[
            &[
                "train",
                "--steps",
                "100000",
                "--log-every",
                "1",
                "--out",
                run.to_str().expect("UTF-8"),
            ],
            &QUICK[..],
        ]
        .concat(),
        tmp.path(),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("the snug binary runs");
    {
        let mut lines = BufReader::new(child.stdout.take().expect("a pipe")).lines();
        while let Some(Ok(line)) = lines.next() {
            if line.starts_with("step ") {
                break;
            }
        }
        // The reader goes away, as `snug train | head` does.
    }
    let o = child.wait_with_output().expect("the run ends");
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("standard output closed"), "{err}");
    let steps = checkpoint_steps(&run);
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert!(steps[0] >= 1);
}

#[test]
fn flags_a_run_cannot_honour_are_named() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let o = train(tmp.path(), &["--steps", "1", "--threads", "100000"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("`threads` 100000 is more than"), "{err}");
    assert!(
        !tmp.path().join("runs").exists(),
        "a refused run made a directory"
    );
    let o = train(tmp.path(), &["--steps", "1", "--out", ""]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("'--out <DIR>'"), "{}", stderr(&o));
    let toml = tmp.path().join("run.toml");
    std::fs::write(&toml, "[train]\nout = \"\"\n").expect("a config file");
    let o = train(
        tmp.path(),
        &["--steps", "1", "--config", toml.to_str().expect("UTF-8")],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("`out` is an empty path"),
        "{}",
        stderr(&o)
    );
}

/// A finished two-step run in `cwd/run`, its only checkpoint `ckpt-00000002.safetensors`.
fn finished_run(cwd: &Path) -> PathBuf {
    let o = train(cwd, &["--steps", "2", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = cwd.join("run");
    assert_eq!(checkpoint_steps(&run), vec![2]);
    run
}

const CHECKPOINT: &str = "run/ckpt-00000002.safetensors";

#[test]
fn export_replaces_a_directory_only_when_forced_and_never_a_run() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let run_files = snapshot(&run);
    let hf = cwd.join("hf");
    common::ok(cwd, &["export", "--checkpoint", "run", "--out", "hf"]);
    let exported = snapshot(&hf);

    // The user's own file, export's files spoiled, and an earlier export's chat template
    // (this run's tokenizer has none): refused whole without --force.
    std::fs::write(hf.join("notes.txt"), "mine").expect("a file");
    std::fs::write(hf.join("config.json"), "spoiled").expect("a file");
    std::fs::write(hf.join("tokenizer.json"), "stale").expect("a file");
    std::fs::write(hf.join("chat_template.jinja"), "stale").expect("a file");
    // An earlier model's files export never writes but loaders read with the new one.
    let earlier = ["generation_config.json", "merges.txt", "vocab.json"];
    for name in earlier {
        std::fs::write(hf.join(name), "earlier").expect("a file");
    }
    let before = snapshot(&hf);
    common::fails_with(
        cwd,
        &["export", "--checkpoint", "run", "--out", "hf"],
        &["hf: is not empty", "--force"],
    );
    assert_eq!(
        snapshot(&hf),
        before,
        "a refused export changed the directory"
    );

    // Forced: export's files replaced, the stale one removed, the user's kept.
    let o = common::ok(
        cwd,
        &["export", "--checkpoint", "run", "--out", "hf", "--force"],
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("removed hf/chat_template.jinja"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    for name in earlier {
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(&format!("removed hf/{name}")),
            "{name}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    let mut want = exported.clone();
    want.push((hf.join("notes.txt"), b"mine".to_vec()));
    want.sort();
    assert_eq!(snapshot(&hf), want);

    // A run directory, a checkpoint and the model being exported: never, even forced.
    common::fails_with(
        cwd,
        &["export", "--checkpoint", "hf", "--out", "run", "--force"],
        &[
            "run: is a run directory",
            "checkpoints, up to step 2",
            "even with --force",
        ],
    );
    common::fails_with(
        cwd,
        &[
            "export",
            "--checkpoint",
            "hf",
            "--out",
            CHECKPOINT,
            "--force",
        ],
        &[CHECKPOINT, "is a snug checkpoint"],
    );
    common::fails_with(
        cwd,
        &["export", "--checkpoint", "hf", "--out", "hf", "--force"],
        &["--out hf", "is the model being exported"],
    );
    assert_eq!(snapshot(&run), run_files, "the run's files changed");
    assert_eq!(snapshot(&hf), want);
}

/// An export killed at any moment leaves the directory it replaces holding one model whole:
/// the earlier export or the new one, never new weights beside the earlier adapter. The files
/// are written into a staging directory and moved in together.
#[cfg(unix)]
#[test]
fn an_export_killed_at_any_moment_leaves_one_model_whole() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    for (out, seed) in [("a", "1"), ("b", "2")] {
        let o = train(
            cwd,
            &["--steps", "2", "--lora", "4", "--seed", seed, "--out", out],
        );
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let hf = cwd.join("hf");
    let export = |from: &str| {
        let mut c = snug_cmd(
            &["export", "--checkpoint", from, "--out", "hf", "--force"],
            cwd,
        );
        c.stdout(Stdio::null()).stderr(Stdio::null());
        c
    };
    let run = |from: &str| {
        let status = export(from).status().expect("the snug binary runs");
        assert!(status.success(), "export --checkpoint {from} failed");
        snapshot(&hf)
    };
    let new = run("b");
    let old = run("a");
    assert_ne!(old, new);
    // Each file, and which export's it is.
    let names = |files: &[(PathBuf, Vec<u8>)]| {
        let names: Vec<_> = files
            .iter()
            .map(|f| {
                let whose = if old.contains(f) {
                    "earlier"
                } else if new.contains(f) {
                    "new"
                } else {
                    "neither"
                };
                format!("{} ({whose})", f.0.display())
            })
            .collect();
        names.join(", ")
    };
    let mut interrupted = 0;
    for delay_ms in (0..60).step_by(3) {
        let mut child = export("b").spawn().expect("the snug binary runs");
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        let status = child.wait().expect("the export ends");
        interrupted += usize::from(!status.success());
        let now = snapshot(&hf);
        assert!(
            now == old || now == new,
            "killed after {delay_ms} ms, the directory holds neither export whole: {}",
            names(&now)
        );
        if now != old {
            assert_eq!(run("a"), old);
        }
    }
    assert!(interrupted > 0, "every export ended before its kill");
    // What the killed exports left is not taken for output.
    assert_eq!(run("b"), new);
}

#[test]
fn a_lora_export_into_sharded_weights_writes_nothing() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let o = train(cwd, &["--steps", "2", "--lora", "4", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let hf = cwd.join("hf");
    std::fs::create_dir(&hf).expect("a directory");
    std::fs::write(hf.join("model.safetensors.index.json"), "{}").expect("a file");
    std::fs::write(hf.join("adapter_config.json"), "an earlier adapter's").expect("a file");
    let before = snapshot(&hf);
    // Refused before the adapter, which is written ahead of the base weights, replaced the
    // earlier one.
    common::fails_with(
        cwd,
        &["export", "--checkpoint", "run", "--out", "hf", "--force"],
        &["hf: holds a sharded checkpoint"],
    );
    assert_eq!(
        snapshot(&hf),
        before,
        "a refused export changed the directory"
    );
}

#[test]
fn prepare_replaces_token_files_only_when_forced_and_never_in_a_run() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let run_files = snapshot(&run);
    let data = cwd.join("data");
    std::fs::create_dir(&data).expect("a directory");
    // The corpus beside its token files is no reason to refuse.
    std::fs::write(
        data.join("corpus.txt"),
        "to be or not to be, that is the question\n".repeat(40),
    )
    .expect("a corpus");
    let prepare = |extra: &[&'static str]| {
        [
            &[
                "prepare",
                "--input",
                "data/corpus.txt",
                "--tokenizer",
                "char",
            ][..],
            extra,
        ]
        .concat()
    };
    common::ok(cwd, &prepare(&["--out", "data"]));
    let prepared = snapshot(&data);

    std::fs::write(data.join("val.bin"), "spoiled").expect("a file");
    let before = snapshot(&data);
    common::fails_with(
        cwd,
        &prepare(&["--out", "data"]),
        &["data/train.bin: already exists", "--force"],
    );
    assert_eq!(
        snapshot(&data),
        before,
        "a refused prepare changed the directory"
    );
    common::ok(cwd, &prepare(&["--out", "data", "--force"]));
    assert_eq!(
        snapshot(&data),
        prepared,
        "--force wrote the token files again"
    );

    common::fails_with(
        cwd,
        &prepare(&["--out", "run", "--force"]),
        &["run: is a run directory", "even with --force"],
    );
    common::fails_with(
        cwd,
        &prepare(&["--out", CHECKPOINT, "--force"]),
        &[CHECKPOINT, "is a snug checkpoint"],
    );
    assert_eq!(snapshot(&run), run_files, "the run's files changed");
}

#[test]
fn report_replaces_a_page_only_when_forced_and_never_a_checkpoint() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let page = cwd.join("page.html");
    std::fs::write(&page, "mine").expect("a file");
    common::fails_with(
        cwd,
        &["report", "--run", "run", "-o", "page.html"],
        &["page.html: already exists", "--force"],
    );
    assert_eq!(std::fs::read(&page).expect("the page"), b"mine");
    common::ok(
        cwd,
        &["report", "--run", "run", "-o", "page.html", "--force"],
    );
    let html = std::fs::read_to_string(&page).expect("the page");
    assert!(
        html.starts_with("<!DOCTYPE html>"),
        "not replaced: {html:.40}"
    );

    // A new page may go beside the run's files; the run's files never, nor a checkpoint under
    // another name (known by its header).
    common::ok(cwd, &["report", "--run", "run", "-o", "run/report.html"]);
    std::fs::remove_file(run.join("report.html")).expect("the page");
    let run_files = snapshot(&run);
    std::fs::copy(cwd.join(CHECKPOINT), cwd.join("weights.bin")).expect("a copy");
    for (target, why) in [
        (CHECKPOINT, "is a snug checkpoint"),
        ("weights.bin", "is a snug checkpoint"),
        ("run/metrics.jsonl", "is a run's own file"),
    ] {
        common::fails_with(
            cwd,
            &["report", "--run", "run", "-o", target, "--force"],
            &[target, why, "even with --force"],
        );
    }
    assert_eq!(snapshot(&run), run_files, "the run's files changed");
    assert_eq!(
        std::fs::read(cwd.join("weights.bin")).expect("the copy"),
        std::fs::read(cwd.join(CHECKPOINT)).expect("the checkpoint")
    );
}

#[test]
fn profile_replaces_a_trace_only_when_forced_and_never_a_checkpoint() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let run_files = snapshot(&run);
    let profile = |extra: &[&'static str]| {
        [
            &[
                "profile",
                "--steps",
                "1",
                "--threads",
                "1",
                "--batch",
                "4",
                "--block",
                "16",
            ][..],
            extra,
        ]
        .concat()
    };
    let trace = cwd.join("trace.json");
    std::fs::write(&trace, "mine").expect("a file");
    common::fails_with(
        cwd,
        &profile(&["--trace", "trace.json"]),
        &["trace.json: already exists", "--force"],
    );
    assert_eq!(std::fs::read(&trace).expect("the trace"), b"mine");
    common::ok(cwd, &profile(&["--trace", "trace.json", "--force"]));
    let text = std::fs::read_to_string(&trace).expect("the trace");
    assert!(text.contains("traceEvents"), "not replaced: {text:.40}");

    common::fails_with(
        cwd,
        &profile(&["--trace", CHECKPOINT, "--force"]),
        &[CHECKPOINT, "is a snug checkpoint", "even with --force"],
    );
    assert_eq!(snapshot(&run), run_files, "the run's files changed");
}

/// A run refused after its directory is claimed (here by its memory budget) leaves no
/// directory behind: none holding only a lock file that later commands take for a run's,
/// and no run number used up. A directory that was there before stays.
#[test]
fn a_refused_run_leaves_no_directory_it_made() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    for _ in 0..2 {
        let o = train(cwd, &["--steps", "1", "--memory", "1MiB"]);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(stderr(&o).contains("1.00 MiB"), "{}", stderr(&o));
    }
    // Nor `runs/`, which the first claim made.
    assert!(!cwd.join("runs").exists(), "runs/ left behind");
    let o = train(cwd, &["--steps", "1", "--memory", "1MiB", "--out", "a/b/c"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(!cwd.join("a").exists(), "a/b/ left behind");
    // The next run takes the first number.
    let o = train(cwd, &["--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let made: Vec<_> = std::fs::read_dir(cwd.join("runs"))
        .expect("runs/")
        .map(|e| e.expect("an entry").file_name())
        .collect();
    assert_eq!(made.len(), 1, "{made:?}");
    assert!(made[0].to_string_lossy().ends_with("-1"), "{made:?}");
    // Given with --out and there already (empty): refused, and kept as it was, without the
    // lock file the claim made, which `export` would take for a run's.
    let mine = cwd.join("mine");
    std::fs::create_dir(&mine).expect("a directory");
    let o = train(cwd, &["--steps", "1", "--memory", "1MiB", "--out", "mine"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(mine.is_dir());
    let left: Vec<_> = std::fs::read_dir(&mine)
        .expect("mine/")
        .map(|e| e.expect("an entry").file_name())
        .collect();
    assert!(left.is_empty(), "a refused run left {left:?}");
    // A lock file that was there before stays: it may be another claim's.
    std::fs::write(mine.join(snug_train::run_dir::LOCK_FILE), b"").expect("a lock file");
    let o = train(cwd, &["--steps", "1", "--memory", "1MiB", "--out", "mine"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(mine.join(snug_train::run_dir::LOCK_FILE).exists());
}

/// Resuming a run past the steps asked for trains nothing and is refused, leaving its
/// checkpoint as it was rather than saved again under a step count the run has passed. (As
/// many steps as done trains nothing and writes nothing: see
/// `resuming_a_complete_run_writes_nothing_into_its_directory`.)
#[test]
fn resuming_past_the_steps_asked_for_is_refused_and_changes_nothing() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let before = snapshot(&run);
    let o = snug(
        &["train", "--resume", "run", "--steps", "1", "--lr", "0.05"],
        cwd,
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("already at step 2, past the 1 asked for"),
        "{err}"
    );
    assert!(err.contains("--steps above 2"), "{err}");
    assert_eq!(snapshot(&run), before, "a refused resume changed the run");
}

/// Every entry of `dir` (hidden ones too) with its bytes and modification time, and the
/// directory's own modification time, which a file made and removed again changes.
#[allow(clippy::type_complexity)]
fn entries_and_times(
    dir: &Path,
) -> (
    std::time::SystemTime,
    Vec<(PathBuf, Vec<u8>, std::time::SystemTime)>,
) {
    let modified = |p: &Path| {
        std::fs::symlink_metadata(p)
            .and_then(|m| m.modified())
            .expect("a modification time")
    };
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("the run directory")
        .map(|e| e.expect("an entry").path())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_default();
            let time = modified(&p);
            (p, bytes, time)
        })
        .collect();
    files.sort();
    (modified(dir), files)
}

/// A resume with no step left to train (the checkpoint at `--steps`, given or saved) writes
/// nothing into the run directory, whatever else it is given (another `--lr` would have been
/// saved as the run's configuration): no checkpoint, no metrics, no lock file made and
/// removed. It says the run is complete (`already_complete` in `--json`) and succeeds; the run
/// still samples, and a raised `--steps` trains on.
#[test]
fn resuming_a_complete_run_writes_nothing_into_its_directory() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let before = entries_and_times(&run);
    let o = snug(
        &[
            "train", "--resume", "run", "--steps", "2", "--lr", "0.05", "--json",
        ],
        cwd,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().expect("a summary line");
    let summary: serde_json::Value = serde_json::from_str(last).expect("JSON");
    assert_eq!(summary["kind"], "summary", "{out}");
    assert_eq!(summary["already_complete"], true, "{out}");
    assert_eq!(summary["steps"], 2, "{out}");
    assert_eq!(
        entries_and_times(&run),
        before,
        "a complete run's resume wrote"
    );
    // From the checkpoint file, in words, the steps the run saved (2).
    let o = snug(
        &[
            "train",
            "--resume",
            CHECKPOINT,
            "--lr",
            "0.05",
            "--warmup-steps",
            "7",
        ],
        cwd,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("already complete") && said.contains("--steps above 2"),
        "{said}"
    );
    assert_eq!(
        entries_and_times(&run),
        before,
        "a complete run's resume wrote"
    );
    let o = snug(&["sample", "--checkpoint", "run", "--tokens", "3"], cwd);
    assert!(o.status.success(), "{}", stderr(&o));
    // More steps: trained, and saved with the flags given.
    let o = snug(&["train", "--resume", "run", "--steps", "3", "--json"], cwd);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(out.lines().last().expect("a summary line")).expect("JSON");
    assert_eq!(summary["already_complete"], false, "{out}");
    assert_eq!(checkpoint_steps(&run), vec![2, 3]);
}

/// `--init-from` starts a run from other weights; with `--resume` it is refused as such,
/// before the checkpoint or the weights are read.
#[test]
fn resume_and_init_from_together_are_refused_by_name() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let run = finished_run(cwd);
    let before = snapshot(&run);
    let o = snug(
        &[
            "train",
            "--resume",
            "run",
            "--steps",
            "4",
            "--init-from",
            "elsewhere",
        ],
        cwd,
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("--init-from elsewhere"), "{err}");
    assert!(err.contains("resumed run"), "{err}");
    // Or from a configuration file.
    std::fs::write(cwd.join("c.toml"), "[train]\ninit_from = \"elsewhere\"\n").expect("a file");
    let o = snug(
        &[
            "train", "--resume", "run", "--steps", "4", "--config", "c.toml",
        ],
        cwd,
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("init_from: a resumed run"),
        "{}",
        stderr(&o)
    );
    assert_eq!(snapshot(&run), before);
}

/// A resumed run keeps its precision when `--memory` makes fit choose again: fit may change
/// how it runs (micro-batches, remat), not what it trains. (Unpinned, fit takes bf16 here.)
#[test]
fn a_resumed_run_fitted_to_memory_keeps_its_precision() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let shape = [
        "--preset",
        "tiny",
        "--threads",
        "1",
        "--block",
        "64",
        "--batch",
        "8",
    ];
    let o = snug(
        &[&["train"][..], &shape, &["--steps", "1", "--out", "run"]].concat(),
        cwd,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let chosen = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(o));
        let fit: serde_json::Value = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON lines"))
            .find(|l| l["kind"] == "fit")
            .expect("a fit line");
        let i = fit["chosen"].as_u64().expect("a choice") as usize;
        fit["candidates"][i]["config"].clone()
    };
    let budget = ["--memory", "9MiB", "--json"];
    let fresh = snug(
        &[
            &["train"][..],
            &shape,
            &["--steps", "1", "--no-save"],
            &budget,
        ]
        .concat(),
        cwd,
    );
    assert_eq!(chosen(&fresh)["precision"], "bf16", "the budget tempts fit");
    let resumed = snug(
        &[&["train", "--resume", "run", "--steps", "2"][..], &budget].concat(),
        cwd,
    );
    assert_eq!(chosen(&resumed)["precision"], "f32");
}

/// A run's relative data path is saved absolute: resumed from another directory that holds a
/// different file of the same name, the run reads its own file (the other one's characters
/// are outside its tokenizer, so reading it would fail), and so does a resume from where it
/// started.
#[test]
fn a_relative_data_path_means_the_same_file_from_anywhere() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let start = tmp.path().join("start");
    std::fs::create_dir(&start).expect("a directory");
    std::fs::write(start.join("text.txt"), "to be or not to be\n".repeat(50)).expect("a file");
    std::fs::write(tmp.path().join("text.txt"), "XYZ QWV\n".repeat(50)).expect("a file");
    let o = train(
        &start,
        &["--steps", "1", "--data", "text.txt", "--out", "run"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = snug(
        &["train", "--resume", "start/run", "--steps", "2"],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = snug(&["train", "--resume", "run", "--steps", "3"], &start);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Resumed on data its checkpoint's tokenizer cannot encode, the error names the data file and
/// the checkpoint the tokenizer came from (it named neither the file nor where the 13-symbol
/// tokenizer was from).
#[test]
fn resuming_on_data_the_runs_tokenizer_cannot_encode_names_both() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    finished_run(tmp.path());
    std::fs::write(tmp.path().join("shakes.txt"), "First Citizen:\n".repeat(50)).expect("a file");
    let o = snug(
        &[
            "train",
            "--resume",
            "run",
            "--steps",
            "3",
            "--data",
            "shakes.txt",
        ],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    for needle in [
        "shakes.txt",
        "tokenizer saved in its checkpoint",
        CHECKPOINT,
    ] {
        assert!(stderr(&o).contains(needle), "{needle}: {}", stderr(&o));
    }
}

/// A run that fails before its first checkpoint (out of memory at step 1) leaves what it found:
/// a directory that was there keeps its own files alone (no lock file, no empty metrics file,
/// which `prepare` would take for a run's), and one it made goes with the parents it made.
#[test]
fn a_run_that_fails_before_saving_leaves_what_it_found() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let fail = ["--steps", "3", "--lower-memory-at", "1:1KiB"];
    let mine = cwd.join("mine");
    std::fs::create_dir(&mine).expect("a directory");
    std::fs::write(mine.join("notes.txt"), b"keep").expect("a file");
    let before = snapshot(&mine);
    let o = train(cwd, &[&fail[..], &["--out", "mine"]].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(snapshot(&mine), before, "the directory changed");
    let names: Vec<_> = std::fs::read_dir(&mine)
        .expect("mine/")
        .map(|e| e.expect("an entry").file_name())
        .collect();
    assert_eq!(names, ["notes.txt"], "left behind");
    std::fs::write(cwd.join("text.txt"), "some text to prepare\n".repeat(50)).expect("text");
    let o = snug(
        &[
            "prepare",
            "--input",
            "text.txt",
            "--tokenizer",
            "char",
            "--out",
            "mine",
        ],
        cwd,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = train(cwd, &[&fail[..], &["--out", "p/q/d"]].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(!cwd.join("p").exists(), "p/q/d left behind");
}

/// Two runs started at once in one directory, each numbering its own run directory, both
/// train: the one that finds its number claimed takes the next.
#[test]
fn runs_started_at_once_number_their_directories_apart() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let start = || {
        snug_cmd(&[&["train"], &QUICK[..], &["--steps", "3"]].concat(), cwd)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the snug binary runs")
    };
    let (a, b) = (start(), start());
    for child in [a, b] {
        let o = child.wait_with_output().expect("the run ends");
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let mut made: Vec<String> = std::fs::read_dir(cwd.join("runs"))
        .expect("runs/")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    made.sort();
    assert_eq!(made.len(), 2, "{made:?}");
    assert!(
        made[0].ends_with("-1") && made[1].ends_with("-2"),
        "{made:?}"
    );
}

/// A lock file that is a link is refused by name, and nothing is made where it points.
#[cfg(unix)]
#[test]
fn a_lock_file_that_is_a_link_is_refused() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let cwd = tmp.path();
    let dir = cwd.join("linked");
    std::fs::create_dir(&dir).expect("a directory");
    std::os::unix::fs::symlink("../elsewhere", dir.join(".snug.lock")).expect("a link");
    let o = train(cwd, &["--steps", "1", "--out", "linked"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(".snug.lock is not a plain file"),
        "{}",
        stderr(&o)
    );
    assert!(!cwd.join("elsewhere").exists(), "made through the link");
    assert!(dir.join(".snug.lock").is_symlink(), "the link was removed");
}

/// The evaluations in a run directory's metrics, by step, with their losses.
fn evaluations(run: &Path) -> Vec<(u64, String, String)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("the run's metrics");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "eval")
        .map(|v| {
            let step = v["step"].as_u64().expect("a step");
            (step, v["train_loss"].to_string(), v["val_loss"].to_string())
        })
        .collect()
}

/// A stop during the evaluation after a step saves that step with the evaluation cut short
/// (here: its line taken out of the metrics); the resumed run evaluates it first, to the
/// figures the uninterrupted run had, also where it was the final one. An evaluation the
/// metrics hold is not run again.
#[test]
fn a_resumed_run_makes_up_the_evaluation_a_stop_cut_short() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let run = tmp.path().join("run");
    let run_s = run.to_str().expect("a UTF-8 path");
    let args = |steps: &'static str| -> Vec<&str> {
        let mut a = vec!["train", "--steps", steps, "--threads", "1", "--batch", "4"];
        a.extend(["--block", "16", "--eval-every", "2", "--eval-batches", "2"]);
        a.extend(["--checkpoint-every", "2", "--json"]);
        a
    };
    let o = snug(&[&args("4")[..], &["--out", run_s]].concat(), tmp.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let whole = evaluations(&run);
    assert_eq!(whole.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4]);
    let drop_eval_at = |step: u64| {
        let path = run.join("metrics.jsonl");
        let text = std::fs::read_to_string(&path).expect("the run's metrics");
        let kept: Vec<&str> = text
            .lines()
            .filter(|l| {
                !(l.contains("\"kind\":\"eval\"") && l.contains(&format!("\"step\":{step},")))
            })
            .collect();
        assert_eq!(kept.len() + 1, text.lines().count(), "one line taken out");
        std::fs::write(&path, kept.join("\n") + "\n").expect("the metrics rewritten");
    };
    // The final evaluation cut short: resuming at the last step evaluates, and says so.
    drop_eval_at(4);
    let o = snug(&["train", "--resume", run_s, "--json"], tmp.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(evaluations(&run), whole);
    let summary: serde_json::Value = serde_json::from_str(
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .last()
            .expect("a summary"),
    )
    .expect("a JSON summary");
    let as_f32 = |v: &str| v.parse::<f64>().expect("a loss") as f32;
    assert_eq!(
        as_f32(&summary["val_loss"].to_string()),
        as_f32(&whole[1].2)
    );
    // Held already: resuming again runs no evaluation.
    let o = snug(&["train", "--resume", run_s, "--json"], tmp.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("\"kind\":\"eval\""));
    assert_eq!(evaluations(&run), whole);
    // One cut short mid-run, resumed from that step's checkpoint to the end.
    std::fs::remove_file(run.join("ckpt-00000004.safetensors")).expect("the last checkpoint");
    drop_eval_at(2);
    let o = snug(&["train", "--resume", run_s, "--json"], tmp.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(evaluations(&run), whole);
}

/// A run killed before its first checkpoint (here: its checkpoint taken away) leaves metrics
/// and nothing to resume: resuming it and starting over in it are both refused, saying so.
#[test]
fn a_run_stopped_before_its_first_checkpoint_is_named_as_such() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let o = train(tmp.path(), &["--steps", "3", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = tmp.path().join("run");
    std::fs::remove_file(run.join("ckpt-00000003.safetensors")).expect("the checkpoint");
    let before = snapshot(&run);
    for args in [
        vec!["train", "--resume", "run"],
        vec!["train", "--steps", "3", "--out", "run"],
    ] {
        let o = snug(&args, tmp.path());
        assert!(!o.status.success(), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.contains("stopped before its first checkpoint")
                && err.contains("3 step(s)")
                && err.contains("new `--out` directory"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(snapshot(&run), before, "the run's files changed");
}

/// A run still training before its first checkpoint is not one that stopped: resuming it, or
/// sampling from it, says a run is training there, not to remove its metrics.
#[test]
fn a_run_training_before_its_first_checkpoint_is_not_called_stopped() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let o = train(tmp.path(), &["--steps", "3", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = tmp.path().join("run");
    std::fs::remove_file(run.join("ckpt-00000003.safetensors")).expect("the checkpoint");
    // This process holds the run's lock, as the live run would.
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(run.join(".snug.lock"))
        .expect("the lock file");
    lock.lock().expect("locked");
    let before = snapshot(&run);
    for args in [
        vec!["train", "--resume", "run"],
        vec!["sample", "--checkpoint", "run", "--prompt", "1+1="],
    ] {
        let o = snug(&args, tmp.path());
        assert!(!o.status.success(), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.contains("a run is training there now") && !err.contains("remove that file"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(snapshot(&run), before, "the run's files changed");
    drop(lock);
}

/// `snug prepare` of `data/corpus.txt` by characters into `data`, in `cwd`.
fn prepare_char(cwd: &Path, extra: &[&str]) -> Output {
    let args = [
        "prepare",
        "--input",
        "data/corpus.txt",
        "--tokenizer",
        "char",
        "--out",
        "data",
    ];
    snug(&[&args[..], extra].concat(), cwd)
}

/// A prepare killed mid-write leaves its temporary token file (as large as the tokens); the
/// next one into that directory removes it, but never one of a process still running or one
/// written to within the hour.
#[cfg(target_os = "linux")]
#[test]
fn prepare_removes_what_a_killed_one_left() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).expect("a directory");
    std::fs::write(data.join("corpus.txt"), "a few words of text\n".repeat(50)).expect("text");
    // PIDs stop below 2^22: 4,000,000,000 was never a process.
    let stale = data.join(".train.bin.4000000000.0.tmp");
    let live = data.join(format!(".val.bin.{}.0.tmp", std::process::id()));
    let recent = data.join(".train.bin.4000000001.0.tmp");
    for f in [&stale, &live, &recent] {
        std::fs::write(f, b"partial").expect("a file");
        if f != &recent {
            common::untouched_for_two_hours(f);
        }
    }
    let o = prepare_char(tmp.path(), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(data.join("train.bin").exists() && data.join("val.bin").exists());
    assert!(!stale.exists());
    assert!(live.exists() && recent.exists());
}

/// A `train.bin` and a `val.bin` written by two different prepares (one stopped between
/// replacing them) are refused by name, not trained on as one corpus.
#[test]
fn token_files_of_two_prepares_are_refused_as_a_pair() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).expect("a directory");
    let prepare = |text: &str| {
        std::fs::write(data.join("corpus.txt"), text.repeat(40)).expect("a corpus");
        let o = prepare_char(tmp.path(), &["--force"]);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    prepare("to be or not to be\n");
    let old_val = std::fs::read(data.join("val.bin")).expect("val.bin");
    // The same characters, another corpus: the tokenizers agree.
    prepare("not to be or to be\n");
    let train = |cwd: &Path| {
        snug(
            &[
                "train",
                "--data",
                "data",
                "--steps",
                "1",
                "--no-save",
                "--batch",
                "2",
                "--block",
                "8",
                "--threads",
                "1",
                "--eval-every",
                "0",
            ],
            cwd,
        )
    };
    let o = train(tmp.path());
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(data.join("val.bin"), old_val).expect("the earlier val.bin");
    let o = train(tmp.path());
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("val.bin") && stderr(&o).contains("another `snug prepare`"),
        "{}",
        stderr(&o)
    );
}

/// Every tensor of the newest checkpoint in `run`, as bits, with its step.
fn final_state(run: &Path) -> (u64, Vec<(String, Vec<u32>)>) {
    let (_, ckpt) = snug_train::checkpoint::load(run).expect("a checkpoint loads");
    let mut tensors: Vec<(String, Vec<u32>)> = ckpt
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect();
    tensors.sort();
    (ckpt.step, tensors)
}

/// Each training step's loss in `run`'s metrics, in the order written.
fn step_losses(run: &Path) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("the run's metrics");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("every line whole"))
        .filter(|v| v["kind"] == "step")
        .map(|v| (v["step"].as_u64().expect("a step"), v["loss"].to_string()))
        .collect()
}

/// SIGKILL (nothing to catch, no save on the way out) at moments spread over a run that saves
/// every step, so some land inside a save; after each, `--resume` goes on. The run ends with
/// the state, and the metrics, of a run never stopped: every step's loss once, bit for bit.
#[cfg(unix)]
#[test]
fn a_run_killed_at_any_moment_resumes_to_the_state_of_one_never_stopped() {
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let args = ["--steps", "30", "--checkpoint-every", "1"];
    let straight = dir.path().join("straight");
    let o = train(
        dir.path(),
        &[&args[..], &["--out", straight.to_str().unwrap()]].concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));

    let run = dir.path().join("killed");
    let run_arg = run.to_str().unwrap();
    let newest = || match run.exists() {
        true => checkpoint_steps(&run).last().copied().unwrap_or(0),
        false => 0,
    };
    let mut kills = 0;
    // Delays after the first checkpoint appears, in ms: from at once to most of a run.
    for delay in [0u64, 3, 11, 17, 29, 41, 60, 90, 150] {
        let mut cmd = if kills == 0 {
            snug_cmd(
                &[&["train"], &QUICK[..], &args[..], &["--out", run_arg]].concat(),
                dir.path(),
            )
        } else {
            snug_cmd(&["train", "--resume", run_arg], dir.path())
        };
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        let before = newest();
        // A new checkpoint (or the run's end) first, so each run makes progress.
        while newest() <= before && child.try_wait().unwrap().is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no checkpoint came"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(delay));
        if child.try_wait().unwrap().is_some() {
            break; // finished before the kill
        }
        // SAFETY: signalling our own child.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
        if child.wait().unwrap().success() {
            break; // finished between the check and the signal
        }
        kills += 1;
    }
    assert!(kills >= 3, "only {kills} kills landed mid-run");
    // To the end.
    let o = snug(&["train", "--resume", run_arg], dir.path());
    let err = stderr(&o);
    assert!(
        o.status.success() || err.contains("past"),
        "the last resume: {err}"
    );
    assert_eq!(final_state(&run), final_state(&straight));
    assert_eq!(step_losses(&run), step_losses(&straight));
}

/// A resumed run whose every save fails (a full disk) stops at its first checkpoint, saying
/// the checkpoint it resumed from is the run's state, which is as it was; no temporary file
/// is left.
#[test]
fn a_resumed_run_that_cannot_save_names_the_checkpoint_it_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_arg = run.to_str().unwrap();
    let o = train(dir.path(), &["--steps", "2", "--out", run_arg]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = snapshot(&run);
    let o = snug_cmd(
        &[
            "train",
            "--resume",
            run_arg,
            "--steps",
            "4",
            "--checkpoint-every",
            "1",
        ],
        dir.path(),
    )
    .env("SNUG_FULL_DISK", "1")
    .output()
    .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("nothing saved since step 2, the checkpoint this run resumed")
            && err.contains(&format!("snug train --resume {run_arg}"))
            && err.contains("no space left on device"),
        "{err}"
    );
    // The checkpoint is as it was; the metrics have step 3's line beside it.
    let after = snapshot(&run);
    let ckpt = |s: &[(PathBuf, Vec<u8>)]| {
        s.iter()
            .filter(|(p, _)| p.extension().is_some_and(|e| e == "safetensors"))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(ckpt(&after), ckpt(&before));
    assert_eq!(checkpoint_steps(&run), [2]);
    let names: Vec<String> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
}

/// A checkpoint of another run copied into a run's directory is not resumed as if it were the
/// run's: the directory mixes two runs, which `--resume DIR` refuses, naming the other's file,
/// and nothing there changes. Resumed from its file into a new directory, it continues.
#[test]
fn a_directory_mixing_two_runs_checkpoints_is_not_resumed() {
    let tmp = tempfile::tempdir().expect("a scratch directory");
    let ok = |o: Output| assert!(o.status.success(), "{}", stderr(&o));
    ok(train(
        tmp.path(),
        &["--steps", "2", "--checkpoint-every", "1", "--out", "mine"],
    ));
    ok(train(
        tmp.path(),
        &["--steps", "3", "--preset", "tiny", "--out", "theirs"],
    ));
    let mine = tmp.path().join("mine");
    let copied = mine.join("ckpt-00000003.safetensors");
    std::fs::copy(tmp.path().join("theirs/ckpt-00000003.safetensors"), &copied).expect("copied");
    let before = snapshot(&mine);
    let o = snug(&["train", "--resume", "mine", "--steps", "5"], tmp.path());
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("mixes two runs") && err.contains("ckpt-00000001.safetensors"),
        "{err}"
    );
    assert_eq!(snapshot(&mine), before, "the run's files changed");
    let copied = copied.to_str().expect("a UTF-8 path");
    let o = snug(
        &[
            "train", "--resume", copied, "--steps", "4", "--out", "again",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
}
