//! `snug fit` under budgets: nothing that does not fit is measured, a calibration never holds
//! more than the budget, the refusal says what would fit, `--batch auto` finds the largest
//! batch, and flags given bad numbers are named.
#![cfg(unix)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use snug_testkit::bounded::{self, Ended, Limits};

fn snug(args: &[&str], cache: &Path) -> Ended {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    // An empty cache: fit would calibrate (a minute, over a gigabyte) if it measured at all.
    cmd.args(args)
        .env("SNUG_CACHE_DIR", cache)
        .current_dir(cache);
    bounded::run(
        cmd,
        Limits {
            timeout: Duration::from_secs(30),
            kill_above_rss: 1 << 30,
        },
    )
}

fn no_calibration_cached(cache: &Path) -> bool {
    std::fs::read_dir(cache)
        .expect("the cache directory")
        .all(|e| {
            !e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .starts_with("machine-")
        })
}

#[test]
fn a_budget_nothing_fits_is_refused_before_measuring_and_says_what_would() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let e = snug(&["fit", "--memory", "100KB"], cache.path());
    bounded::assert_refused(
        &e,
        "fit --memory 100KB",
        &[
            "nothing fits in 97.66 KiB",
            "no change snug can make reaches it",
        ],
        100 << 20,
    );
    assert!(e.seconds < 10.0, "{} s", e.seconds);
    assert!(no_calibration_cached(cache.path()));

    // char-small 8 × 256 at a budget only a lighter optimizer reaches: the suggestion is
    // listed, and taking it fits.
    let base = [
        "--preset",
        "char-small",
        "--batch",
        "8",
        "--block",
        "256",
        "--threads",
        "1",
    ];
    let e = snug(
        &[&["fit", "--memory", "80MiB"][..], &base].concat(),
        cache.path(),
    );
    bounded::assert_refused(&e, "fit --memory 80MiB", &["these would fit:"], 100 << 20);
    let first = listed(&e.stderr).into_iter().next().expect("a suggestion");
    taken_fits("80MiB", &base, first, cache.path());
}

/// The lines of a refusal's "these would fit:" list.
fn listed(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .skip_while(|l| !l.contains("these would fit:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect()
}

/// The suggestion `line` (its flags, before the peak), taken: fit then chooses within `budget`.
fn taken_fits(budget: &str, base: &[&str], line: &str, cache: &Path) {
    let flags: Vec<&str> = line
        .split('(')
        .next()
        .expect("flags")
        .split_whitespace()
        .collect();
    let taken = snug(
        &[&["fit", "--memory", budget][..], base, &flags].concat(),
        cache,
    );
    assert_eq!(taken.code, Some(0), "{flags:?}: {}", taken.stderr);
}

/// f16 scales its loss, which the fused-update levers cannot take: the refusal still lists
/// what would fit (it listed nothing, behind the compiler's error for that one rung), each
/// under the budget, without internal error text; and each, taken, fits.
#[test]
fn an_f16_refusal_lists_what_would_fit_without_the_levers_it_cannot_build() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let base = ["--preset", "tiny", "--precision", "f16", "--threads", "1"];
    let e = snug(
        &[&["fit", "--memory", "4MiB"][..], &base].concat(),
        cache.path(),
    );
    bounded::assert_refused(
        &e,
        "fit --precision f16 --memory 4MiB",
        &["nothing fits in 4.00 MiB", "these would fit:"],
        100 << 20,
    );
    assert!(!e.stderr.contains("failed"), "{}", e.stderr);
    assert!(!e.stderr.contains("fused-update"), "{}", e.stderr);
    let listed = listed(&e.stderr);
    assert!(!listed.is_empty(), "{}", e.stderr);
    for line in &listed {
        let peak = line
            .rsplit_once("(peak ")
            .and_then(|(_, p)| p.strip_suffix(" MiB)"))
            .and_then(|p| p.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("a peak in MiB: {line}"));
        assert!(peak <= 4.0, "{line}");
    }
    // Each, taken at the run's batch (8 sequences: planned with gradient sums a batch of 1
    // does not hold; `--optimizer sgd --grad-clip 0 --block 32` was listed at 3.22 MiB, and
    // needed 4.25), fits.
    for line in &listed {
        taken_fits("4MiB", &base, line, cache.path());
    }
}

/// fit chooses micro-batch × accumulation and remat itself: an `--accumulation` or `--remat`
/// it does not keep is named, not dropped silently.
#[test]
fn an_accumulation_fit_does_not_keep_is_named() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let args = [
        "fit",
        "--preset",
        "tiny",
        "--batch",
        "8",
        "--accumulation",
        "4",
        "--remat",
        "block",
        "--threads",
        "1",
        "--memory",
        "12MiB",
    ];
    let e = snug(&args, cache.path());
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    assert!(
        e.stderr
            .contains("--accumulation 4 and --remat block not kept"),
        "{}",
        e.stderr
    );
    // `train --memory` chooses through fit, and says the same, for flags and a file alike.
    let train = [&["train"][..], &args[1..], &["--steps", "1", "--no-save"]].concat();
    let e = snug(&train, cache.path());
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    assert!(
        e.stderr
            .contains("--accumulation 4 and --remat block not kept"),
        "{}",
        e.stderr
    );
    let file = cache.path().join("c.toml");
    std::fs::write(&file, "[train]\naccumulation = 4\nremat = \"block\"\n").expect("a file");
    let from_file = [
        &["train", "--config", file.to_str().expect("a path")][..],
        &[
            "--preset",
            "tiny",
            "--batch",
            "8",
            "--threads",
            "1",
            "--memory",
            "12MiB",
        ],
        &["--steps", "1", "--no-save"],
    ]
    .concat();
    let e = snug(&from_file, cache.path());
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    assert!(
        e.stderr
            .contains("--accumulation 4 and --remat block not kept"),
        "{}",
        e.stderr
    );
}

/// A model whose weights alone are far over the budget is refused without planning a
/// candidate (it planned 162, for about a minute): the refusal names the least state any
/// configuration holds, and the suggestions are bounded the same way.
#[test]
fn a_model_over_budget_by_its_weights_alone_is_refused_unplanned() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let args = [
        "fit",
        "--preset",
        "llama-70b",
        "--memory",
        "1GiB",
        "--allow",
        "all",
    ];
    let e = snug(&args, cache.path());
    bounded::assert_refused(
        &e,
        "fit --preset llama-70b --memory 1GiB --allow all",
        &[
            "nothing fits in 1.00 GiB",
            "(levers qlora) holds",
            "of parameters and optimizer state alone",
            "no change snug can make reaches it",
        ],
        100 << 20,
    );
    assert!(no_calibration_cached(cache.path()));
}

#[test]
fn a_calibration_never_holds_more_than_the_budget() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let budget = 200u64 << 20;
    let e = snug(
        &["fit", "--memory", "200MiB", "--threads", "1", "--json"],
        cache.path(),
    );
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    assert!(e.stderr.contains("predictions are nominal"), "{}", e.stderr);
    assert!(e.max_rss_bytes < budget, "{} MB", e.max_rss_bytes >> 20);
    assert!(no_calibration_cached(cache.path()));
    let report: serde_json::Value = serde_json::from_str(&e.stdout).expect("fit's JSON");
    assert_eq!(report["calibrated"], false);
}

#[test]
fn batch_auto_trains_the_largest_batch_that_fits() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let args = [
        "--batch",
        "auto",
        "--memory",
        "40MiB",
        "--threads",
        "1",
        "--json",
    ];
    let fit = snug(&[&["fit"][..], &args].concat(), cache.path());
    assert_eq!(fit.code, Some(0), "{}", fit.stderr);
    let report: serde_json::Value = serde_json::from_str(&fit.stdout).expect("fit's JSON");
    let batch = report["effective_batch"].as_u64().expect("a batch");
    assert!(batch > 1, "{report}");
    let train = snug(
        &[
            &["train", "--steps", "1", "--eval-every", "0", "--no-save"][..],
            &args,
        ]
        .concat(),
        cache.path(),
    );
    assert_eq!(train.code, Some(0), "{}", train.stderr);
    let summary: serde_json::Value = train
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["kind"] == "summary")
        .expect("a summary");
    let block = report["block"].as_u64().expect("a block");
    assert_eq!(summary["tokens_per_step"].as_u64(), Some(batch * block));
    assert!(summary["measured_peak_bytes"].as_u64() <= Some(40 << 20));
    let plan = snug(&["plan", "--batch", "auto"], cache.path());
    bounded::assert_refused(&plan, "plan --batch auto", &["--memory"], 100 << 20);
}

#[test]
fn negative_numbers_are_bad_values_of_their_flag() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    for (args, flag) in [
        (&["train", "--steps", "-1"][..], "--steps"),
        (&["plan", "--batch", "-3"][..], "--batch"),
        (
            &["fit", "--memory", "1GiB", "--threads", "-2"][..],
            "--threads",
        ),
    ] {
        let e = snug(args, cache.path());
        assert_eq!(e.code, Some(2), "{args:?}: {}", e.stderr);
        assert!(
            e.stderr.contains("invalid value '-") && e.stderr.contains(flag),
            "{args:?}: {}",
            e.stderr
        );
    }
}

/// `--allow lora`: where nothing with the user's math fits, fit chooses LoRA and says so, and
/// `train --memory --allow` trains it within the budget, planned == measured. Without the
/// flag the lever is only suggested.
#[test]
fn an_allowed_lever_is_chosen_only_where_needed_and_trained() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let base = [
        "--preset",
        "char-small",
        "--batch",
        "8",
        "--block",
        "256",
        "--threads",
        "1",
        "--memory",
        "80MiB",
    ];
    let refused = snug(&[&["fit"][..], &base].concat(), cache.path());
    bounded::assert_refused(&refused, "fit --memory 80MiB", &["--allow lora"], 100 << 20);

    let fit = snug(
        &[&["fit", "--allow", "lora", "--json"][..], &base].concat(),
        cache.path(),
    );
    assert_eq!(fit.code, Some(0), "{}", fit.stderr);
    let report: serde_json::Value = serde_json::from_str(&fit.stdout).expect("fit's JSON");
    let chosen = &report["candidates"][report["chosen"].as_u64().expect("a choice") as usize];
    assert_eq!(chosen["config"]["levers"], serde_json::json!(["lora"]));
    for c in report["candidates"].as_array().expect("candidates") {
        if c["config"]["levers"]
            .as_array()
            .is_some_and(|l| l.is_empty())
        {
            // char-small's weights and AdamW's moments alone are over 80 MiB: listed with
            // that bound, unplanned.
            assert_eq!(c["verdict"], "over_lower_bound", "{c}");
            assert!(c["lower_bound_bytes"].as_u64() > Some(80 << 20), "{c}");
            assert!(c["peak_bytes"].is_null(), "{c}");
        }
    }

    let train = snug(
        &[
            &[
                "train",
                "--allow",
                "lora",
                "--steps",
                "2",
                "--eval-every",
                "0",
                "--no-save",
                "--json",
            ][..],
            &base,
        ]
        .concat(),
        cache.path(),
    );
    assert_eq!(train.code, Some(0), "{}", train.stderr);
    let lines: Vec<serde_json::Value> = train
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let fit_line = lines
        .iter()
        .find(|l| l["kind"] == "fit")
        .expect("fit's choice");
    let chosen = &fit_line["candidates"][fit_line["chosen"].as_u64().expect("a choice") as usize];
    assert_eq!(chosen["config"]["levers"], serde_json::json!(["lora"]));
    let summary = lines
        .iter()
        .find(|l| l["kind"] == "summary")
        .expect("a summary");
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    assert_eq!(summary["predicted_peak_bytes"], chosen["peak_bytes"]);
    assert!(summary["measured_peak_bytes"].as_u64() <= Some(80 << 20));

    // An unknown lever is named.
    let bad = snug(
        &[&["fit", "--allow", "lora,galore"][..], &base].concat(),
        cache.path(),
    );
    bounded::assert_refused(
        &bad,
        "fit --allow lora,galore",
        &["galore", "lora"],
        100 << 20,
    );
}

/// `fit --devices N`: one rank of N is searched at every ZeRO stage, the budget per device;
/// devices that do not divide the batch are named.
#[test]
fn fit_over_devices_searches_every_stage_per_rank() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let base = ["fit", "--batch", "8", "--threads", "1", "--json"];
    let fit = snug(
        &[
            &base[..],
            &["--devices", "4", "--link", "10", "--memory", "1GiB"],
        ]
        .concat(),
        cache.path(),
    );
    assert_eq!(fit.code, Some(0), "{}", fit.stderr);
    let report: serde_json::Value = serde_json::from_str(&fit.stdout).expect("fit's JSON");
    assert_eq!(report["devices"], 4);
    assert_eq!(report["link_gb_per_s"], 10.0);
    let candidates = report["candidates"].as_array().expect("candidates");
    for stage in 0..=3 {
        assert!(
            candidates.iter().any(|c| c["config"]["shard"] == stage),
            "stage {stage}"
        );
    }
    for c in candidates {
        let per_rank = c["config"]["micro_batch"].as_u64().unwrap()
            * c["config"]["accumulation"].as_u64().unwrap();
        assert_eq!(per_rank, 2, "{c}");
    }
    let bad = snug(
        &[&base[..], &["--devices", "3", "--memory", "1GiB"]].concat(),
        cache.path(),
    );
    bounded::assert_refused(&bad, "fit --devices 3", &["devices", "divide"], 100 << 20);
}

/// `--batch auto` with levers allowed: where one sequence fits only with a lever, the batch is
/// the most one micro-batch holds with the lightest such lever, and fit chooses among the
/// levers for it (it said nothing fits, naming a configuration that did).
#[test]
fn batch_auto_takes_the_levers_allowed() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let base = [
        "fit",
        "--preset",
        "tiny",
        "--block",
        "16",
        "--batch",
        "auto",
        "--threads",
        "1",
        "--memory",
        "3MiB",
        "--json",
    ];
    let refused = snug(&base, cache.path());
    assert_eq!(refused.code, Some(1), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("--allow qlora"),
        "{}",
        refused.stderr
    );
    let e = snug(&[&base[..], &["--allow", "qlora"]].concat(), cache.path());
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    let report: serde_json::Value = serde_json::from_str(&e.stdout).expect("JSON");
    let chosen = &report["candidates"][report["chosen"].as_u64().expect("a choice") as usize];
    assert!(chosen["peak_bytes"].as_u64() <= Some(3 << 20), "{chosen}");
    assert_eq!(
        chosen["config"]["levers"],
        serde_json::json!(["qlora"]),
        "{chosen}"
    );
    assert!(report["effective_batch"].as_u64() >= Some(1), "{report}");
}

/// `--memory auto` in a container or batch job: a control group's memory limit that is
/// tighter than the machine's available memory is the budget's base (a made-up cgroup v2
/// hierarchy: a job limited to 1 GiB, holding 256 MiB of which 128 MiB is inactive file cache).
#[test]
fn memory_auto_keeps_within_a_control_groups_limit() {
    let cache = tempfile::tempdir().expect("a scratch directory");
    let cgroups = tempfile::tempdir().expect("a scratch directory");
    let job = cgroups.path().join("job_42");
    std::fs::create_dir(&job).expect("the job's group");
    std::fs::write(cgroups.path().join("cgroup"), "0::/job_42\n").expect("the cgroup file");
    std::fs::write(job.join("memory.max"), format!("{}\n", 1u64 << 30)).expect("memory.max");
    std::fs::write(job.join("memory.current"), format!("{}\n", 256u64 << 20))
        .expect("memory.current");
    std::fs::write(
        job.join("memory.stat"),
        format!("anon 1\ninactive_file {}\n", 128u64 << 20),
    )
    .expect("memory.stat");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    cmd.args(["fit", "--preset", "tiny", "--memory", "auto", "--json"])
        .env("SNUG_CACHE_DIR", cache.path())
        .env("SNUG_TEST_CGROUP_ROOT", cgroups.path())
        .current_dir(cache.path());
    let ended = bounded::run(
        cmd,
        Limits {
            timeout: Duration::from_secs(30),
            kill_above_rss: 1 << 30,
        },
    );
    assert_eq!(ended.code, Some(0), "{}", ended.stderr);
    let report: serde_json::Value = serde_json::from_str(&ended.stdout).expect("fit's JSON");
    // 1 GiB less the 128 MiB held, less the reserve (a tenth, at least 512 MiB).
    let room = (1u64 << 30) - (128 << 20);
    assert_eq!(report["budget"].as_u64(), Some(room - (512 << 20)));
}
