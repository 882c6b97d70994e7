//! The `snug` binary end to end: the demo trains, `plan` reports, and bad input gives a named
//! error with a non-zero exit and no panic.

use std::process::{Command, Output};

fn snug(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .output()
        .expect("the snug binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fails_with(args: &[&str], needles: &[&str]) {
    let o = snug(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "{args:?} succeeded");
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` missing from: {err}");
    }
}

#[test]
fn train_with_builtin_data_reports_falling_loss_and_exact_peak() {
    let o = snug(&["train", "--steps", "40", "--json", "--threads", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 41, "40 steps and a summary");
    let summary = &lines[40];
    let (first, last) = (
        summary["first_loss"].as_f64().unwrap(),
        summary["final_loss"].as_f64().unwrap(),
    );
    assert!(last < first - 0.2, "loss {first} -> {last}");
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    for (i, l) in lines[..40].iter().enumerate() {
        assert_eq!(l["step"].as_u64(), Some(i as u64 + 1));
    }
}

#[test]
fn plan_reports_a_breakdown_that_adds_up() {
    let o = snug(&[
        "plan", "--preset", "gpt2", "--batch", "4", "--block", "1024", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let b = &v["breakdown"];
    let sum: u64 = [
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
        "inputs",
        "fragmentation",
    ]
    .iter()
    .map(|k| b[k].as_u64().unwrap())
    .sum();
    assert_eq!(sum, v["peak_bytes"].as_u64().unwrap());
    assert_eq!(v["parameters"].as_u64(), Some(124_439_808));
    // Weights and both Adam moments, 4 bytes each, aligned per tensor.
    assert!(b["parameters"].as_u64().unwrap() >= 124_439_808 * 4);
    assert_eq!(
        b["optimizer_state"].as_u64().unwrap(),
        2 * b["parameters"].as_u64().unwrap()
    );
    assert!(v["arena_bytes"].as_u64() >= v["lower_bound_bytes"].as_u64());
}

#[test]
fn bad_input_is_a_named_error() {
    fails_with(&["plan", "--preset", "gpt5"], &["unknown preset `gpt5`"]);
    fails_with(&["train", "--preset", "gpt5"], &["gpt5"]);
    fails_with(&["train", "--batch", "0"], &["batch"]);
    fails_with(&["train", "--block", "0"], &["block"]);
    fails_with(&["train", "--steps", "0"], &["steps"]);
    fails_with(&["train", "--threads", "0"], &["threads"]);
    fails_with(&["train", "--block", "65"], &["block", "65"]);
    fails_with(&["train", "--lr", "-1"], &["lr"]);
    fails_with(
        &["train", "--data", "/nonexistent/corpus.txt"],
        &["/nonexistent/corpus.txt"],
    );

    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    fails_with(
        &["train", "--data", empty.to_str().unwrap()],
        &["empty.txt", "empty"],
    );
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "to be or not").unwrap();
    fails_with(
        &["train", "--data", short.to_str().unwrap()],
        &["short.txt", "too few"],
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[train]\nsteps = \"many\"\n").unwrap();
    fails_with(
        &["train", "--config", bad.to_str().unwrap()],
        &["bad.toml", "steps"],
    );
    std::fs::write(&bad, "[model]\npreset = \"tiny\"\nwidth = 3\n").unwrap();
    fails_with(
        &["plan", "--config", bad.to_str().unwrap()],
        &["bad.toml", "width"],
    );
    // A negative number is not a size: clap rejects it with its usage error (exit 2).
    let o = snug(&["train", "--batch", "-4"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!stderr(&o).contains("panicked"));
}

#[test]
fn config_file_trains_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(
        &cfg,
        "[model]\npreset = \"tiny\"\nn_layer = 1\n[train]\nsteps = 50\nbatch = 4\nblock = 16\n",
    )
    .unwrap();
    let o = snug(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--steps",
        "3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 4, "3 steps and a summary");
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(summary["tokens_per_step"].as_u64(), Some(4 * 16));
}

#[test]
fn profile_times_every_op_kind() {
    let o = snug(&[
        "profile", "--steps", "1", "--batch", "2", "--block", "16", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    for op in [
        "causal_attention",
        "causal_attention_backward",
        "layer_norm",
        "gelu",
        "adamw",
        "cross_entropy",
    ] {
        assert!(names.contains(&op), "{op} missing from {names:?}");
    }
    let share: f64 = rows.iter().map(|r| r["share"].as_f64().unwrap()).sum();
    assert!((share - 1.0).abs() < 1e-6);
}

#[test]
fn memory_limit_flags() {
    fails_with(
        &[
            "train",
            "--steps",
            "1",
            "--memory-limit",
            "10MB",
            "--strict",
        ],
        &["needs", "10000000"],
    );
    fails_with(
        &["train", "--steps", "1", "--memory-limit", "lots"],
        &["memory_limit", "lots"],
    );
    let o = snug(&["train", "--steps", "2", "--memory-limit", "10MB", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8(o.stdout).unwrap();
    let step: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    for key in ["active_bytes", "peak_bytes", "cache_bytes", "rss_bytes"] {
        assert!(step.get(key).is_some(), "{key} missing from {step}");
    }
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert!(
        summary["limit_overruns"].as_u64().unwrap() >= 1,
        "relaxed limit exceeded and reported"
    );
    assert_eq!(summary["memory_limit_bytes"].as_u64(), Some(10_000_000));
}

#[test]
fn plan_reads_hugging_face_configs_and_plans_llama_70b() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let args = [
        "plan",
        "--batch",
        "1",
        "--seq",
        "4096",
        "--precision",
        "bf16",
        "--optimizer",
        "adamw",
        "--json",
    ];
    let from_file = snug(&[&args[..], &["--hf-config", cfg.to_str().unwrap()]].concat());
    assert!(from_file.status.success(), "{}", stderr(&from_file));
    let preset = snug(&[&args[..], &["--preset", "llama-70b"]].concat());
    let (a, b): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(&from_file.stdout).unwrap(),
        serde_json::from_slice(&preset.stdout).unwrap(),
    );
    assert_eq!(a["peak_bytes"], b["peak_bytes"]);
    assert_eq!(a["parameters"].as_u64(), Some(68_976_648_192));
    // bf16 weights, f32 Adam moments.
    assert_eq!(
        a["breakdown"]["parameters"].as_u64().unwrap() * 4,
        a["breakdown"]["optimizer_state"].as_u64().unwrap()
    );
    assert!(a["arena_over_lower_bound"].as_f64().unwrap() < 1.05);
    assert!(
        a["peak_bytes"].as_u64() < a["program_order_peak_bytes"].as_u64(),
        "scheduling lowered the peak"
    );

    std::fs::write(&cfg, r#"{"model_type": "bert", "hidden_size": 8}"#).unwrap();
    fails_with(
        &["plan", "--hf-config", cfg.to_str().unwrap()],
        &["config.json", "model_type", "bert"],
    );
    std::fs::write(
        &cfg,
        r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "vocab_size": 10}"#,
    )
    .unwrap();
    fails_with(
        &["plan", "--hf-config", cfg.to_str().unwrap()],
        &["config.json", "n_embd"],
    );
    fails_with(
        &["plan", "--preset", "gpt2", "--precision", "fp8"],
        &["precision", "fp8"],
    );
    fails_with(
        &["plan", "--preset", "gpt2", "--optimizer", "lion"],
        &["optimizer", "lion"],
    );
    fails_with(
        &[
            "plan",
            "--preset",
            "gpt2",
            "--batch",
            "1000000000000000",
            "--block",
            "1024",
        ],
        &["overflow"],
    );
}

/// A few public-domain lines, repeated: enough tokens for a validation split of 16 + 1.
fn shakespeare_like() -> String {
    let passage = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
        All:\nSpeak, speak.\n\n\
        First Citizen:\nYou are all resolved rather to die than to famish?\n\n\
        All:\nResolved. resolved.\n\n\
        First Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n\n";
    passage.repeat(8)
}

fn prepare_json(args: &[&str]) -> serde_json::Value {
    let o = snug(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

#[test]
fn prepare_writes_token_files_that_train_reads() {
    let dir = tempfile::tempdir().unwrap();
    let text = shakespeare_like();
    let input = dir.path().join("corpus.txt");
    std::fs::write(&input, &text).unwrap();
    let input = input.to_str().unwrap();
    let distinct = text
        .chars()
        .collect::<std::collections::BTreeSet<_>>()
        .len() as u64;
    for (name, vocab) in [("char", distinct), ("gpt2", 50257)] {
        let out = dir.path().join(format!("{name}-data"));
        let out_s = out.to_str().unwrap();
        let v = prepare_json(&[
            "prepare",
            "--input",
            input,
            "--tokenizer",
            name,
            "--out",
            out_s,
            "--json",
        ]);
        assert_eq!(v["tokenizer"], name);
        assert_eq!(v["vocab_size"].as_u64(), Some(vocab), "{v}");
        assert_eq!(v["input_bytes"].as_u64(), Some(text.len() as u64));
        let (tokens, train, val) = (
            v["tokens"].as_u64().unwrap(),
            v["train_tokens"].as_u64().unwrap(),
            v["val_tokens"].as_u64().unwrap(),
        );
        assert_eq!(train + val, tokens);
        assert_eq!(val, (tokens as f64 * 0.1).round() as u64);
        // The files hold exactly the tokenizer's ids of the text, split at the reported place.
        let train_file = snug_train::TokenFile::open(&out.join("train.bin")).unwrap();
        let val_file = snug_train::TokenFile::open(&out.join("val.bin")).unwrap();
        assert_eq!(
            std::fs::metadata(out.join("train.bin")).unwrap().len(),
            v["train_bytes"].as_u64().unwrap()
        );
        let tokenizer = train_file.tokenizer().clone();
        assert_eq!(tokenizer.name(), name);
        let mut ids = train_file.to_vec();
        assert_eq!(ids.len() as u64, train);
        ids.extend(val_file.to_vec());
        assert_eq!(ids, tokenizer.encode(&text).unwrap());
        if name == "char" {
            assert_eq!(tokens, text.chars().count() as u64);
        }

        let o = snug(&[
            "train",
            "--data",
            out_s,
            "--steps",
            "2",
            "--preset",
            "tiny",
            "--batch",
            "2",
            "--block",
            "16",
            "--threads",
            "2",
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}\n{stdout}", stderr(&o));
        let expected = format!("{train} train / {val} val tokens, {name} tokenizer, vocab {vocab}");
        assert!(
            stdout.contains(&expected),
            "`{expected}` missing from:\n{stdout}"
        );
    }
    // Text output names the files it wrote.
    let out = dir.path().join("text-out");
    let o = snug(&[
        "prepare",
        "--input",
        input,
        "--tokenizer",
        "char",
        "--out",
        out.to_str().unwrap(),
        "--val-fraction",
        "0.25",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("train.bin") && stdout.contains("val.bin"),
        "{stdout}"
    );
}

#[test]
fn prepare_and_token_directory_errors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("corpus.txt");
    std::fs::write(&input, shakespeare_like()).unwrap();
    let input_s = input.to_str().unwrap();
    let out = dir.path().join("out");
    let out_s = out.to_str().unwrap();
    let prepare = |input: &str, tokenizer: &str, out: &str| {
        vec![
            "prepare".to_string(),
            "--input".into(),
            input.into(),
            "--tokenizer".into(),
            tokenizer.into(),
            "--out".into(),
            out.into(),
        ]
    };
    let fails = |args: Vec<String>, needles: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails_with(&args, needles);
    };
    fails(
        prepare("/nonexistent/corpus.txt", "char", out_s),
        &["/nonexistent/corpus.txt"],
    );
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    fails(
        prepare(empty.to_str().unwrap(), "gpt2", out_s),
        &["empty.txt", "empty"],
    );
    fails(
        prepare(input_s, "sentencepiece", out_s),
        &["--tokenizer", "sentencepiece"],
    );
    // An output "directory" below a regular file cannot be created.
    let blocked = input.join("sub");
    fails(
        prepare(input_s, "char", blocked.to_str().unwrap()),
        &["corpus.txt/sub"],
    );
    let mut args = prepare(input_s, "char", out_s);
    args.extend(["--val-fraction".into(), "1.5".into()]);
    fails(args, &["--val-fraction", "1.5"]);
    let tiny = dir.path().join("tiny.txt");
    std::fs::write(&tiny, "ab").unwrap();
    fails(
        prepare(tiny.to_str().unwrap(), "char", out_s),
        &["tiny.txt", "validation"],
    );
    assert!(!out.exists(), "failed runs wrote nothing");

    // Training from a directory: a missing split and a corrupt header are named.
    let o = snug(
        &prepare(input_s, "char", out_s)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let train_args = [
        "train", "--data", out_s, "--steps", "1", "--preset", "tiny", "--block", "16",
    ];
    std::fs::remove_file(out.join("val.bin")).unwrap();
    fails_with(&train_args, &["val.bin"]);
    std::fs::write(out.join("val.bin"), b"NOTSNUG!garbage and more garbage").unwrap();
    fails_with(&train_args, &["val.bin", "magic"]);
}
