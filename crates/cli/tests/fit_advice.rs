//! `snug fit`'s refusal and table, taken at their word: each change the refusal lists, given to
//! fit, is chosen at the peak the refusal named; and each table row with a fixed remat mode
//! holds the peak `plan` gives with those flags (which leaves out remat that does not lower
//! it).
#![cfg(unix)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use snug_testkit::bounded::{self, Ended, Limits};

fn snug(args: &[&str], cache: &Path) -> Ended {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    // An empty cache, and budgets under what calibrating holds: nothing is measured.
    cmd.args(args)
        .env("SNUG_CACHE_DIR", cache)
        .current_dir(cache);
    bounded::run(
        cmd,
        Limits {
            timeout: Duration::from_secs(60),
            kill_above_rss: 1 << 30,
        },
    )
}

/// The lines of a refusal's "these would fit:" list: each change's flags and its peak.
fn listed(stderr: &str) -> Vec<(Vec<String>, String)> {
    stderr
        .lines()
        .skip_while(|l| !l.contains("these would fit:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| {
            let (flags, peak) = l.rsplit_once(" (peak ").expect("a peak");
            let flags = flags.split('(').next().expect("flags");
            (
                flags.split_whitespace().map(String::from).collect(),
                peak.trim_end_matches(')').to_string(),
            )
        })
        .collect()
}

/// Each listed change, added to the refused `run`, is chosen by fit at the peak listed.
fn each_is_chosen_at_its_peak(run: &[&str], list: &[(Vec<String>, String)], cache: &Path) {
    for (change, peak) in list {
        let change: Vec<&str> = change.iter().map(String::as_str).collect();
        let taken = [run, &change].concat();
        let t = snug(&taken, cache);
        assert_eq!(t.code, Some(0), "{}: {}", taken.join(" "), t.stderr);
        let chosen = t
            .stdout
            .lines()
            .find(|l| l.starts_with("chosen: "))
            .expect("a choice");
        assert!(
            chosen.contains(&format!("(planned peak {peak},")),
            "{}: listed at {peak}, chosen as {chosen}",
            taken.join(" ")
        );
    }
}

/// The auditor's runs, tiny 2 × 8: under fused updates every lever had vanished from the
/// advice, which planned each change at one sequence with the rest accumulated (more than the
/// whole batch at once where the weights dominate): `--allow qlora` was said to miss budgets
/// it fits, and `--optimizer sgd` was left out where it fits. Now each listed change, taken,
/// is chosen at the peak the refusal named.
#[test]
fn each_listed_change_is_chosen_at_the_peak_the_refusal_names() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let base = [
        "fit",
        "--preset",
        "tiny",
        "--batch",
        "2",
        "--block",
        "8",
        "--threads",
        "1",
    ];
    let cases: [(&[&str], &str, &str); 4] = [
        (
            &["--optimizer", "sgd", "--fused-update", "--grad-clip", "0"],
            "1436556",
            "--allow qlora",
        ),
        (
            &[
                "--optimizer",
                "adamw8bit",
                "--fused-update",
                "--clip-mode",
                "tensor",
            ],
            "1436556",
            "--allow qlora",
        ),
        (&["--optimizer", "adamw8bit"], "1436556", "--allow qlora"),
        (&[], "4000000", "--optimizer sgd"),
    ];
    for (flags, budget, expected) in cases {
        let run = [&base[..], flags, &["--memory", budget]].concat();
        let e = snug(&run, cache.path());
        let what = run.join(" ");
        bounded::assert_refused(&e, &what, &["these would fit:"], 200 << 20);
        let list = listed(&e.stderr);
        assert!(
            list.iter().any(|(f, _)| f.join(" ") == expected),
            "{what}: `{expected}` not listed:\n{}",
            e.stderr
        );
        each_is_chosen_at_its_peak(&run, &list, cache.path());
    }
}

/// On a GPU the advice is fit's on that GPU: a change whose rows its backend cannot run
/// (fused updates, whose clipping there would take the previous step's norm) is not listed,
/// and every change listed is chosen at its peak by `fit --device gpu` with it.
#[test]
fn on_a_gpu_each_listed_change_is_one_fit_there_chooses() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let devices = snug(&["devices", "--json"], cache.path());
    let listed_gpus: serde_json::Value = serde_json::from_str(&devices.stdout).unwrap_or_default();
    if listed_gpus["gpus"].as_array().is_none_or(Vec::is_empty) {
        return snug_testkit::skip_or_fail("no GPU adapter");
    }
    let run = [
        "fit",
        "--device",
        "gpu",
        "--preset",
        "tiny",
        "--batch",
        "2",
        "--block",
        "8",
        "--threads",
        "1",
        "--memory",
        "4000000",
    ];
    let e = snug(&run, cache.path());
    let what = run.join(" ");
    bounded::assert_refused(&e, &what, &["these would fit:"], 200 << 20);
    let list = listed(&e.stderr);
    assert!(!list.is_empty(), "{what}: {}", e.stderr);
    each_is_chosen_at_its_peak(&run, &list, cache.path());
}

/// tiny 4 × 48 at 8,000,000 bytes: the table had listed selective and block remat at 2 × 2
/// above the plain row, where plan and train leave the remat out and run the plain step. Each
/// fixed-remat row in the user's own passes and precision is what `plan` gives with its flags.
#[test]
fn each_fixed_remat_row_is_what_plan_gives_with_its_flags() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let shape = [
        "--preset",
        "tiny",
        "--batch",
        "4",
        "--block",
        "48",
        "--threads",
        "1",
    ];
    let run = [&["fit"][..], &shape, &["--memory", "8000000", "--json"]].concat();
    let e = snug(&run, cache.path());
    // The plain 4 × 1 fits; the rows at 2 × 2 and 1 × 4 are over.
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let report: serde_json::Value = serde_json::from_str(&e.stdout).expect("the table as JSON");
    let mut checked = 0;
    let mut dropped = 0;
    for c in report["candidates"].as_array().expect("candidates") {
        let config = &c["config"];
        let remat = config["remat"].as_str().expect("a remat mode");
        let fixed = remat == "selective" || remat.starts_with("block");
        let as_run = config["precision"] == "f32"
            && config["passes"] == serde_json::json!(["fused-ce", "inplace"])
            && config["levers"] == serde_json::json!([]);
        if !fixed || !as_run || c["peak_bytes"].is_null() {
            continue;
        }
        let accumulation = config["accumulation"].to_string();
        let args = [
            &["plan"][..],
            &shape,
            &["--accumulation", &accumulation, "--remat", remat, "--json"],
        ]
        .concat();
        let p = snug(&args, cache.path());
        assert_eq!(p.code, Some(0), "{}: {}", args.join(" "), p.stderr);
        let plan: serde_json::Value = serde_json::from_str(&p.stdout).expect("the plan as JSON");
        assert_eq!(
            plan["peak_bytes"],
            c["peak_bytes"],
            "{}: {c}",
            args.join(" ")
        );
        assert_eq!(
            plan["remat_dropped"].is_null(),
            c.get("remat_dropped").is_none(),
            "{}: {c}",
            args.join(" ")
        );
        dropped += usize::from(c.get("remat_dropped").is_some());
        checked += 1;
    }
    assert!(
        checked >= 3 && dropped > 0,
        "{checked} rows, {dropped} dropped"
    );
    // The table says which rows run without their remat.
    let text = [&["fit"][..], &shape, &["--memory", "8000000"]].concat();
    let e = snug(&text, cache.path());
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let marked = e
        .stdout
        .lines()
        .filter(|l| l.contains("remat left out: it does not lower the peak"))
        .count();
    assert_eq!(marked, dropped, "{}", e.stdout);
}
