//! `snug plan --inference` predicts sampling: its peak is the plan `snug sample` then holds and
//! the allocator's measured peak, for a checkpoint trained with the same flags.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// Runs `snug args` in `cwd` (`snug train` without `--out` saves under ./runs).
fn snug(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the snug binary runs")
}

fn ok(cwd: &Path, args: &[&str]) -> Output {
    let o = snug(cwd, args);
    assert!(
        o.status.success(),
        "snug {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).expect("one JSON object on stdout")
}

/// Text of a few hundred distinct lines: a character vocabulary of its own (not the built-in
/// data's), and enough tokens for any block these models take.
fn write_text(path: &Path) {
    let text: String = (0..400)
        .map(|i| format!("line {i}: the quick brown fox {} jumps.\n", i * 7 % 13))
        .collect();
    std::fs::write(path, text).unwrap();
}

#[test]
fn plan_inference_equals_what_sample_plans_and_measures() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    write_text(&cwd.join("text.txt"));
    // Model and data flags, given to train and to plan alike.
    let cases: [&[&str]; 3] = [
        &["--batch", "4"],
        &["--preset", "llama-tiny", "--batch", "2"],
        &["--data", "text.txt", "--batch", "4", "--precision", "bf16"],
    ];
    for (i, flags) in cases.iter().enumerate() {
        let run = format!("run{i}");
        let common = [&["--threads", "1"][..], flags].concat();
        let mut train = vec!["train", "--steps", "2", "--eval-every", "0", "--json"];
        train.extend(["--out", &run]);
        train.extend(&common);
        ok(cwd, &train);

        let mut plan = vec!["plan", "--inference", "--json"];
        plan.extend(&common);
        let planned = json(&ok(cwd, &plan));
        let sampled = json(&ok(
            cwd,
            &[
                "sample",
                "--checkpoint",
                &run,
                "--tokens",
                "5",
                "--threads",
                "1",
                "--json",
            ],
        ));
        let peak = planned["peak_bytes"].as_u64().unwrap();
        assert!(peak > 0, "{flags:?}");
        assert_eq!(
            Some(peak),
            sampled["planned_peak_bytes"].as_u64(),
            "{flags:?}"
        );
        assert_eq!(
            Some(peak),
            sampled["measured_peak_bytes"].as_u64(),
            "{flags:?}"
        );
        let b = &planned["breakdown"];
        assert_eq!(b["gradients"], 0, "{flags:?}");
        assert_eq!(b["optimizer_state"], 0, "{flags:?}");
        assert_eq!(planned["batch"], 1);
        assert_eq!(planned["kv_cache"], false);
        // The model's whole context: `block_size` (GPT) or `max_seq` (Llama).
        let m = &planned["model"];
        let context = m["block_size"].as_u64().or(m["max_seq"].as_u64());
        assert_eq!(planned["window"].as_u64(), context, "{flags:?}");

        // The training step of the same flags is another, larger plan.
        let mut train_plan = vec!["plan", "--json"];
        train_plan.extend(&common);
        let training = json(&ok(cwd, &train_plan))["peak_bytes"].as_u64().unwrap();
        assert!(
            peak < training,
            "{flags:?}: inference {peak}, training {training}"
        );
    }
}

/// Training-only flags change nothing: sampling runs batch 1, in f32, over the whole window.
#[test]
fn training_flags_do_not_change_the_inference_plan() {
    let dir = tempfile::tempdir().unwrap();
    let peak = |extra: &[&str]| {
        let mut args = vec!["plan", "--inference", "--json", "--threads", "1"];
        args.extend(extra);
        json(&ok(dir.path(), &args))["peak_bytes"].as_u64().unwrap()
    };
    let plain = peak(&[]);
    assert_eq!(
        plain,
        peak(&[
            "--batch",
            "64",
            "--block",
            "8",
            "--precision",
            "f16",
            "--remat",
            "block",
            "--optimizer",
            "sgd",
            "--passes",
            "none",
        ])
    );
    // The model's own flags do change it.
    assert!(peak(&["--preset", "char-small"]) > plain);
}

#[test]
fn plan_inference_text_is_in_human_units() {
    let dir = tempfile::tempdir().unwrap();
    let o = ok(dir.path(), &["plan", "--inference", "--threads", "1"]);
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "inference",
        "batch 1",
        "no KV cache",
        "predicted peak",
        "gradients",
        "optimizer state",
    ] {
        assert!(text.contains(needle), "`{needle}` missing from:\n{text}");
    }
    assert!(text.contains("KiB") || text.contains("MiB"), "{text}");
}

/// There is no KV cache to plan: the flag is refused with a reason, not answered with the
/// windowed plan.
#[test]
fn kv_cache_is_refused_until_the_sampler_has_one() {
    let dir = tempfile::tempdir().unwrap();
    let o = snug(dir.path(), &["plan", "--inference", "--kv-cache", "--json"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(o.stdout.is_empty());
    assert!(
        err.contains("--kv-cache") && err.contains("no KV cache"),
        "{err}"
    );
    assert!(err.contains("recomputes the whole window"), "{err}");
    // Without --inference it is a usage error.
    let o = snug(dir.path(), &["plan", "--kv-cache"]);
    assert_eq!(o.status.code(), Some(2));
}
