//! `snug plan --inference` predicts sampling: its peak is the plan `snug sample` then holds and
//! the allocator's measured peak, for a checkpoint trained with the same flags.

mod common;

use std::path::Path;
use std::process::Output;

use common::{ok, snug};
use serde_json::Value;

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
                "--full-window",
                "--json",
            ],
        ));
        // Sampling holds the context the request needs: the prompt (token 0 when empty) and
        // the tokens asked for, below the model's.
        let whole = json(&ok(
            cwd,
            &[&["plan", "--inference", "--json"][..], &common].concat(),
        ));
        let m = &whole["model"];
        let max_seq = m["block_size"].as_u64().or(m["max_seq"].as_u64()).unwrap();
        assert_eq!(whole["window"].as_u64(), Some(max_seq), "{flags:?}");
        let prompt = sampled["prompt_ids"].as_array().unwrap().len().max(1) as u64;
        let context = sampled["context"].as_u64().unwrap();
        assert_eq!(context, (prompt + 5).min(max_seq), "{flags:?}");
        assert!(
            context < max_seq,
            "{flags:?}: the test should hold less than the model's"
        );
        let context = context.to_string();
        let mut plan = vec!["plan", "--inference", "--json", "--context", &context];
        plan.extend(&common);
        let planned = json(&ok(cwd, &plan));
        assert!(
            planned["peak_bytes"].as_u64() < whole["peak_bytes"].as_u64(),
            "{flags:?}"
        );
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
        assert_eq!(planned["window"], sampled["context"], "{flags:?}");

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

/// With `--kv-cache`, `snug plan --inference` plans the decode step `snug sample` runs by
/// default, and the prefill of a whole window beside it: sampling measures the decode plan
/// exactly, and its prefills (of shorter prompts) stay under the whole window's.
#[test]
fn plan_kv_cache_equals_what_sample_plans_and_measures() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    for flags in [
        &["--batch", "2"][..],
        &["--preset", "llama-tiny", "--batch", "2"],
    ] {
        let run = format!("run-{}", flags.len());
        let common = [&["--threads", "1"][..], flags].concat();
        let mut train = vec!["train", "--steps", "1", "--eval-every", "0", "--json"];
        train.extend(["--out", &run]);
        train.extend(&common);
        ok(cwd, &train);
        let sample = [
            "sample",
            "--checkpoint",
            &run,
            "--tokens",
            "40",
            "--threads",
            "1",
            "--json",
        ];
        let sampled = json(&ok(cwd, &sample));
        assert_eq!(sampled["mode"], "kv_cache");
        let context = sampled["context"].to_string();
        let mut plan = vec!["plan", "--inference", "--kv-cache", "--json"];
        plan.extend(["--context", &context]);
        plan.extend(&common);
        let planned = json(&ok(cwd, &plan));
        assert_eq!(planned["kv_cache"], true);
        assert_eq!(planned["window"], sampled["context"]);
        let decode = &sampled["kv_cache"]["decode"];
        assert_eq!(
            decode["planned_peak_bytes"], planned["peak_bytes"],
            "{flags:?}"
        );
        assert_eq!(
            decode["measured_peak_bytes"], planned["peak_bytes"],
            "{flags:?}"
        );
        let prefill = &sampled["kv_cache"]["prefill"];
        assert_eq!(
            prefill["planned_peak_bytes"],
            prefill["measured_peak_bytes"]
        );
        let window_prefill = planned["prefill_window_peak_bytes"].as_u64().unwrap();
        assert!(prefill["planned_peak_bytes"].as_u64().unwrap() <= window_prefill);
        // The most sample holds, whatever the prompt: neither phase above it.
        let most = planned["sample_peak_bytes"].as_u64().unwrap();
        assert_eq!(
            most,
            window_prefill.max(planned["peak_bytes"].as_u64().unwrap())
        );
        for phase in [prefill, decode] {
            assert!(
                phase["measured_peak_bytes"].as_u64().unwrap() <= most,
                "{flags:?}"
            );
        }
        // The caches are their own part of the plan; the whole-window plan has none.
        assert!(planned["breakdown"]["kv_cache"].as_u64().unwrap() > 0);
        let mut full = vec!["plan", "--inference", "--json"];
        full.extend(&common);
        let full = json(&ok(cwd, &full));
        assert!(full["breakdown"].get("kv_cache").is_none());
        assert_eq!(full["sample_peak_bytes"], full["peak_bytes"]);
    }
    // Without --inference it is a usage error.
    let o = snug(cwd, &["plan", "--kv-cache"]);
    assert_eq!(o.status.code(), Some(2));
}

/// Sampling reads the data for its vocabulary alone: a model whose context (here 131,072
/// positions, a Llama 3's) is longer than the built-in data's splits plans for sampling, at
/// its whole context and at `--context N`, while a training step that long is refused.
#[test]
fn a_context_longer_than_the_data_plans_for_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 131072}"#,
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let base = ["plan", "--hf-config", config, "--threads", "1", "--json"];
    let whole = json(&ok(
        dir.path(),
        &[&base[..], &["--inference", "--kv-cache"]].concat(),
    ));
    let short = json(&ok(
        dir.path(),
        &[
            &base[..],
            &["--inference", "--kv-cache", "--context", "1024"],
        ]
        .concat(),
    ));
    let (whole, short) = (&whole["peak_bytes"], &short["peak_bytes"]);
    assert!(whole.as_u64() > short.as_u64(), "{whole} against {short}");
    common::fails_with(dir.path(), &base, &["too few for one sequence"]);
}
