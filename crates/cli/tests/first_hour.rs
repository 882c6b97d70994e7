//! A newcomer's first commands: `snug train` with defaults saves a run and scores the demo's
//! task, and `snug sample` right after samples from that run without being told where it is.

use std::path::Path;
use std::process::{Command, Output};

fn snug(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the snug binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn train(cwd: &Path) -> serde_json::Value {
    let o = snug(cwd, &["train", "--steps", "5", "--threads", "1", "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    text(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "summary")
        .expect("a summary line")
}

#[test]
fn sample_right_after_train_uses_the_newest_run() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let summary = train(dir.path());
    // The demo reports its task's score, a fraction of held-out problems.
    let accuracy = summary["addition_accuracy"]
        .as_f64()
        .expect("addition_accuracy on the built-in data");
    assert!((0.0..=1.0).contains(&accuracy), "{summary}");
    assert_eq!(summary["addition"]["problems"], 200);

    let o = snug(dir.path(), &["sample", "--tokens", "4"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("runs/llama-tiny-1"),
        "names the run it used: {}",
        text(&o.stderr)
    );
    // No --prompt on a model of the built-in data: a held-out problem to answer.
    let out = text(&o.stdout);
    let question = out.split('=').next().unwrap_or_default();
    let (a, b) = question
        .split_once('+')
        .unwrap_or_else(|| panic!("{out:?}"));
    assert!(
        a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok(),
        "{out:?}"
    );

    // A second run is newer: sample follows it.
    train(dir.path());
    let o = snug(dir.path(), &["sample", "--tokens", "2", "--prompt", "1+1="]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("runs/llama-tiny-2"),
        "{}",
        text(&o.stderr)
    );
    assert!(text(&o.stdout).starts_with("1+1="), "{}", text(&o.stdout));
}

#[test]
fn sample_without_a_run_says_how_to_get_one() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let expect_refusal = |why: &str| {
        let o = snug(dir.path(), &["sample", "--tokens", "4"]);
        assert!(!o.status.success(), "{why}");
        let err = text(&o.stderr);
        assert!(
            err.contains("no run under ./runs")
                && err.contains("snug train")
                && err.contains("--checkpoint"),
            "{why}: {err}"
        );
    };
    expect_refusal("no ./runs");
    std::fs::create_dir_all(dir.path().join("runs/tiny-1")).expect("a run directory");
    expect_refusal("a run directory without a checkpoint");
}

/// Where the process may use fewer CPUs than the machine has (`taskset`, a Slurm job's or a
/// container's cpuset), `snug train` with no `--threads` runs on the cores it may use (it
/// refused its own default, the machine's core count, before), and `plan` plans for them.
#[cfg(target_os = "linux")]
#[test]
fn the_default_threads_fit_a_process_held_to_one_cpu() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().expect("a scratch directory");
    let on_cpu_0 = |args: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
        cmd.args(args).current_dir(dir.path());
        // SAFETY: only async-signal-safe calls between fork and exec: the set is built on
        // this stack and `sched_setaffinity` is a system call.
        unsafe {
            cmd.pre_exec(|| {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut set);
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.output().expect("the snug binary runs")
    };
    let o = on_cpu_0(&["train", "--steps", "1", "--no-save", "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = on_cpu_0(&["plan", "--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).expect("plan's JSON");
    assert_eq!(plan["threads"], 1, "{plan}");
}

/// Ranks that mpirun started on one machine without binding them (`--bind-to none`) share its
/// cores by default rather than each taking them all (the environment Open MPI gives a rank
/// says how many share the machine).
#[test]
fn unbound_ranks_on_one_machine_default_to_their_share_of_its_cores() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let threads = |local: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
        cmd.args(["plan", "--json"]).current_dir(dir.path());
        if let Some(n) = local {
            cmd.env("OMPI_COMM_WORLD_LOCAL_SIZE", n);
        }
        let o = cmd.output().expect("the snug binary runs");
        assert!(o.status.success(), "{}", text(&o.stderr));
        let plan: serde_json::Value = serde_json::from_slice(&o.stdout).expect("plan's JSON");
        plan["threads"].as_u64().expect("threads")
    };
    let alone = threads(None);
    assert_eq!(threads(Some("1")), alone);
    assert_eq!(threads(Some("2")), (alone / 2).max(1));
    assert_eq!(threads(Some("64")), 1);
}

/// Under a strict `--memory`, the demo's scoring keeps to the limit too: a QLoRA run whose
/// training fits but whose scoring (the weights merged to f32) does not is not scored, and
/// says why; under a limit that holds it, it is scored.
#[test]
fn the_demos_scoring_keeps_to_the_memory_limit() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let summary = |memory: &str| {
        let o = snug(
            dir.path(),
            &[
                "train",
                "--preset",
                "char-small",
                "--batch",
                "1",
                "--block",
                "8",
                "--threads",
                "1",
                "--lora",
                "2",
                "--quantize-base",
                "nf4",
                "--steps",
                "2",
                "--eval-every",
                "0",
                "--no-save",
                "--json",
                "--memory",
                memory,
            ],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["kind"] == "summary")
            .expect("a summary line")
    };
    let tight = summary("12000000");
    assert!(
        tight["measured_peak_bytes"].as_u64() <= Some(12_000_000),
        "{tight}"
    );
    assert!(tight["addition_accuracy"].is_null(), "{tight}");
    let why = tight["addition_skipped"].as_str().unwrap_or_default();
    assert!(
        why.contains("not scored") && why.contains("memory limit"),
        "{tight}"
    );
    let roomy = summary("300MB");
    assert!(roomy["addition_accuracy"].is_f64(), "{roomy}");
    assert!(roomy.get("addition_skipped").is_none(), "{roomy}");
}
