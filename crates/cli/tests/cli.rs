//! The `snug` binary end to end: the demo trains, `plan` reports, and bad input gives a named
//! error with a non-zero exit and no panic.

use std::path::Path;
use std::process::{Command, Output};

fn snug(args: &[&str]) -> Output {
    snug_with(args, &[])
}

fn snug_with(args: &[&str], env: &[(&str, &std::path::Path)]) -> Output {
    // Runs without --out save under ./runs: keep them out of the source tree.
    let cwd = tempfile::tempdir().expect("a scratch directory");
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(cwd.path())
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
    let kinds: Vec<&str> = lines.iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds.len(),
        42,
        "40 steps, the final evaluation and a summary"
    );
    assert_eq!(
        (kinds[39], kinds[40], kinds[41]),
        ("step", "eval", "summary")
    );
    let summary = &lines[41];
    assert_eq!(summary["val_loss"], lines[40]["val_loss"]);
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
    // A plan for another machine may name more threads than this one has, but not past what
    // its scratch sizes are counted for (4,611,686,018,427,387,904 threads planned as 4).
    fails_with(&["plan", "--threads", "5000"], &["threads", "5000", "4096"]);
    for cmd in ["plan", "fit"] {
        let o = snug(&[
            cmd,
            "--devices",
            "1099511627776",
            "--batch",
            "1099511627776",
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("--devices"), "{}", stderr(&o));
    }
    fails_with(
        &["train", "--eval-batches", "1000000000000"],
        &["eval_batches", "1000000000000"],
    );
    // Past its bound a usage error (exit 2), never a count that wraps.
    let o = snug(&["profile", "--steps", "18446744073709551615"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--steps"), "{}", stderr(&o));
    fails_with(&["sample", "--threads", "0"], &["threads", "at least 1"]);
    fails_with(&["sample", "--threads", "100000"], &["threads", "100000"]);
    // A training budget beyond this machine would choose a batch it cannot hold.
    fails_with(
        &[
            "train",
            "--preset",
            "tiny",
            "--memory",
            "1000000TiB",
            "--batch",
            "auto",
        ],
        &["--memory 1000000TiB", "more than this machine's memory"],
    );
    // A micro-batch fits the budget, but the step's batch (prepared outside the plan) is
    // beyond any machine: refused before a buffer is allocated (this aborted the process),
    // and found without scanning 10^12 micro-batch sizes (which took minutes).
    let huge = [
        "--batch",
        "1000000000000",
        "--memory",
        "4GiB",
        "--steps",
        "1",
    ];
    fails_with(
        &[&["train", "--preset", "tiny", "--no-save"][..], &huge].concat(),
        &[
            "1000000000000 sequences",
            "too large to prepare",
            "lower --batch",
        ],
    );
    // Past the demo model's context of 128.
    fails_with(&["train", "--block", "129"], &["block", "129"]);
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

/// A negative size is a bad value of its flag, named with the value, whether written
/// `--flag -1GiB` or `--flag=-1GiB` (clap took `-1GiB` for an unknown flag `-1`).
#[test]
fn negative_sizes_are_refused_naming_the_flag() {
    let cases: [(&[&str], &str, &str); 7] = [
        (&["train", "--no-save"], "--memory", "-1GiB"),
        (&["train", "--no-save"], "--memory-limit", "-1GiB"),
        (&["train", "--no-save"], "--lower-memory-at", "-3:1GiB"),
        (&["fit"], "--memory", "-1.5GiB"),
        (&["fit", "--memory", "1GiB"], "--device-memory", "-2GiB"),
        (&["report", "--preset", "tiny"], "--device-memory", "-1GiB"),
        (&["devices"], "--device-memory", "-1GiB"),
    ];
    for (command, flag, value) in cases {
        let joined = format!("{flag}={value}");
        for spelling in [vec![flag, value], vec![joined.as_str()]] {
            fails_with(&[command, &spelling[..]].concat(), &[flag, value]);
        }
    }
}

/// `bench --warmup` and `--steps` whose sum overflows are refused by name before the probe or
/// any case runs (the sum wrapped, no step was timed, and the error was a JSON parse error).
#[test]
fn bench_step_counts_that_overflow_are_named() {
    let max = u64::MAX.to_string();
    for (warmup, steps) in [(max.as_str(), "2"), ("2", max.as_str())] {
        let args = [
            "bench",
            "--cases",
            "tiny",
            "--threads",
            "1",
            "--warmup",
            warmup,
            "--steps",
            steps,
        ];
        let o = snug(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        for needle in ["--warmup", "--steps", &max] {
            assert!(stderr(&o).contains(needle), "{needle}: {}", stderr(&o));
        }
        assert!(
            o.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
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
    assert_eq!(
        stdout.lines().count(),
        5,
        "3 steps, an evaluation and a summary"
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(summary["tokens_per_step"].as_u64(), Some(4 * 16));
}

/// The model named twice is refused, not half-ignored: `--preset` with `--hf-config` on every
/// command taking both (the Qwen2 model was planned and called `tiny`), a file naming both, and
/// a flag naming the model beside a file's shape keys, which the flag's model would drop. A
/// flag naming the model over the file's `preset` alone overrides it, as flags do.
#[test]
fn a_model_named_two_ways_is_refused() {
    let qwen2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/tests/fixtures/hf/qwen2");
    let qwen2 = qwen2.to_str().unwrap();
    for command in [
        &["plan"][..],
        &["fit", "--memory", "1GiB"],
        &["train", "--no-save"],
        &["profile"],
        &["report"],
    ] {
        let args = [command, &["--preset", "tiny", "--hf-config", qwen2]].concat();
        let o = snug(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("--preset") && stderr(&o).contains("--hf-config"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("run.toml");
    let config = toml.to_str().unwrap();
    std::fs::write(
        &toml,
        "[model]\npreset = \"tiny\"\nn_layer = 1\nn_embd = 64\n",
    )
    .unwrap();
    for command in [
        &["plan"][..],
        &["fit", "--memory", "1GiB"],
        &["train", "--no-save"],
    ] {
        for flag in [["--preset", "gpt2"], ["--hf-config", qwen2]] {
            let args = [command, &["--config", config], &flag].concat();
            let named = flag.join(" ");
            fails_with(&args, &[&named, config, "n_layer = 1", "n_embd = 64"]);
        }
    }
    // Flags that do not name the model keep the file's keys.
    let plan = |args: &[&str]| -> serde_json::Value {
        let o = snug(&[&["plan", "--json"][..], args].concat());
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let kept = plan(&["--config", config, "--vocab", "70"]);
    assert_eq!(
        kept["model"]["n_layer"].as_u64(),
        Some(1),
        "{}",
        kept["model"]
    );
    // The file's preset alone is overridden by the flag's.
    std::fs::write(&toml, "[model]\npreset = \"tiny\"\n").unwrap();
    assert_eq!(
        plan(&["--config", config, "--preset", "gpt2"])["preset"],
        "gpt2"
    );
    std::fs::write(
        &toml,
        format!("[model]\npreset = \"tiny\"\nhf_config = {qwen2:?}\n"),
    )
    .unwrap();
    fails_with(
        &["plan", "--config", config],
        &[config, "preset", "hf_config"],
    );
}

/// A remat mode left out because it leaves the peak as it was says so, not that it would
/// raise the peak "from 11.30 MiB to 11.30 MiB".
#[test]
fn a_remat_that_changes_nothing_is_not_said_to_raise_the_peak() {
    let o = snug(&["plan", "--remat", "block:99"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("remat block:99 left out"))
        .unwrap_or_else(|| panic!("no line on the remat left out in:\n{stdout}"));
    assert!(line.contains("would not lower the peak"), "{line}");
    assert!(!line.contains("raise"), "{line}");
}

#[test]
fn profile_times_every_op_kind() {
    let o = snug(&[
        // GPT's kernels (the demo default is a Llama).
        "profile", "--preset", "tiny", "--steps", "1", "--batch", "2", "--block", "16", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    for op in [
        "causal_attention",
        "causal_attention_backward",
        "layer_norm",
        "layer_norm_linear",
        "layer_norm_linear_backward",
        "gelu_linear",
        "gelu_linear_backward",
        "adamw",
        "lm_head_loss",
        "lm_head_loss_backward",
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
        &["--memory-limit lots", "not a byte size"],
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
    // Mixed precision keeps f32 master weights beside the two f32 Adam moments.
    assert_eq!(
        a["breakdown"]["parameters"].as_u64().unwrap() * 2,
        a["breakdown"]["optimizer_state"].as_u64().unwrap()
    );
    assert!(a["arena_over_lower_bound"].as_f64().unwrap() < 1.05);
    // Clipping holds every gradient until the norm is known; without it, scheduling each
    // update as soon as its gradient is complete lowers the peak.
    let unclipped = snug(&[&args[..], &["--preset", "llama-70b", "--grad-clip", "0"]].concat());
    let c: serde_json::Value = serde_json::from_slice(&unclipped.stdout).unwrap();
    assert!(
        c["peak_bytes"].as_u64() < c["program_order_peak_bytes"].as_u64(),
        "scheduling lowered the peak"
    );
    assert!(c["peak_bytes"].as_u64() < a["peak_bytes"].as_u64());

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

/// `prepare --force` never writes over its own input: given as `DIR/train.bin`, through a
/// symlink, as a hard link, through a symlinked `--out`, or as JSONL. Each is refused naming
/// the input and the file it would become, and the corpus keeps its bytes.
#[cfg(unix)]
#[test]
fn prepare_never_overwrites_its_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    std::fs::create_dir(&out).unwrap();
    let text = shakespeare_like();
    let corpus = out.join("train.bin");
    std::fs::write(&corpus, &text).unwrap();
    // `input`, given as `--input`, is refused as `target`, and the corpus at `kept` is whole.
    let refused = |input: &Path, out: &Path, target: &Path, kept: &Path, extra: &[&str]| {
        let mut args = vec![
            "prepare",
            "--input",
            input.to_str().unwrap(),
            "--tokenizer",
            "char",
            "--out",
            out.to_str().unwrap(),
            "--force",
        ];
        args.extend(extra);
        let needles = [
            input.to_str().unwrap(),
            target.to_str().unwrap(),
            "overwrite",
        ];
        fails_with(&args, &needles);
        assert_eq!(std::fs::read_to_string(kept).unwrap(), text, "{args:?}");
    };
    refused(&corpus, &out, &corpus, &corpus, &[]);
    let jsonl = ["--format", "jsonl", "--tokenizer", "gpt2"];
    refused(&corpus, &out, &corpus, &corpus, &jsonl);
    let link = dir.path().join("corpus-link.txt");
    std::os::unix::fs::symlink(&corpus, &link).unwrap();
    refused(&link, &out, &corpus, &corpus, &[]);
    let hard = dir.path().join("corpus-hard.txt");
    std::fs::hard_link(&corpus, &hard).unwrap();
    refused(&hard, &out, &corpus, &corpus, &[]);
    let out_link = dir.path().join("data-link");
    std::os::unix::fs::symlink(&out, &out_link).unwrap();
    refused(
        &corpus,
        &out_link,
        &out_link.join("train.bin"),
        &corpus,
        &[],
    );
    // The corpus as val.bin is refused too.
    let val_bin = out.join("val.bin");
    std::fs::rename(&corpus, &val_bin).unwrap();
    refused(&val_bin, &out, &val_bin, &val_bin, &[]);

    // A train.bin that is a symlink to the corpus is replaced as a link: the corpus is kept.
    let elsewhere = tempfile::tempdir().unwrap();
    let kept = elsewhere.path().join("corpus.txt");
    std::fs::write(&kept, &text).unwrap();
    let out2 = elsewhere.path().join("data");
    std::fs::create_dir(&out2).unwrap();
    std::os::unix::fs::symlink(&kept, out2.join("train.bin")).unwrap();
    let o = snug(&[
        "prepare",
        "--input",
        kept.to_str().unwrap(),
        "--tokenizer",
        "char",
        "--out",
        out2.to_str().unwrap(),
        "--force",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), text);
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
    // A tokenizer file of another name is named as given, not as tokenizer.json.
    let broken = dir.path().join("my-tokenizer.json");
    std::fs::write(&broken, "{\"model\":").unwrap();
    fails(
        prepare(input_s, broken.to_str().unwrap(), out_s),
        &["my-tokenizer.json", "not a tokenizer"],
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

/// One thread, no evaluation, JSON lines: small runs whose losses tests compare.
const QUIET_TRAIN: [&str; 5] = ["--threads", "1", "--eval-every", "0", "--json"];

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn step_losses(lines: &[serde_json::Value]) -> Vec<(u64, f64)> {
    lines
        .iter()
        .filter(|l| l["kind"] == "step")
        .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
        .collect()
}

/// `--out` saves checkpoints and metrics; `--resume` continues with the same losses as an
/// uninterrupted run; a bad resume path is a named error.
#[test]
fn resume_from_a_run_directory_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let common = [&QUIET_TRAIN[..], &["--batch", "4"]].concat();
    let mut straight_args = vec!["train", "--steps", "12"];
    straight_args.extend(&common);
    let straight = snug(&straight_args);
    assert!(straight.status.success(), "{}", stderr(&straight));

    // The same 12-step run, saving at 6; resuming from that save (as after a crash at step
    // 6) must redo steps 7..12 exactly.
    let mut first_args = vec!["train", "--steps", "12", "--out", out_s];
    first_args.extend(&common);
    first_args.extend(["--checkpoint-every", "6"]);
    let first = snug(&first_args);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(out.join("ckpt-00000006.safetensors").exists());
    assert!(out.join("ckpt-00000012.safetensors").exists());
    std::fs::remove_file(out.join("ckpt-00000012.safetensors")).unwrap();

    let mut resume_args = vec!["train", "--resume", out_s];
    resume_args.extend(&common);
    let resumed = snug(&resume_args);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let resumed_lines = json_lines(&resumed);
    let tail = step_losses(&resumed_lines);
    assert_eq!(tail.first().map(|s| s.0), Some(7));
    assert_eq!(&step_losses(&json_lines(&straight))[6..], &tail[..]);
    // The metrics file reads as one run: steps 1..12, once each.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["kind"] == "step")
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=12).collect::<Vec<_>>());

    fails_with(
        &[
            "train",
            "--resume",
            dir.path().join("nope").to_str().unwrap(),
        ],
        &["nope"],
    );
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"junk").unwrap();
    fails_with(
        &["train", "--resume", junk.to_str().unwrap()],
        &["junk.safetensors"],
    );
}

/// `snug train ARGS --json --out OUT`, its output read until a step line `until` accepts:
/// the child, and its output from there on.
#[cfg(unix)]
fn train_until(
    args: &[&str],
    out: &std::path::Path,
    until: impl Fn(u64) -> bool,
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_snug"))
        .arg("train")
        .args(args)
        .args(["--json", "--out", out.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let step = match reader.read_line(&mut line) {
            Ok(n) if n > 0 => serde_json::from_str::<serde_json::Value>(&line)
                .ok()
                .filter(|v| v["kind"] == "step")
                .and_then(|v| v["step"].as_u64()),
            _ => {
                let status = child.wait();
                panic!("snug exited early: {status:?}");
            }
        };
        if step.is_some_and(&until) {
            return (child, reader);
        }
    }
}

/// Ctrl-C (SIGINT), a scheduler's SIGTERM and a closed terminal's SIGHUP during training: the
/// step in flight finishes, a checkpoint is saved and loads, and the process ends as that signal's
/// status (128 + its number), so `&&` or a scheduler does not take the run for finished.
#[cfg(unix)]
#[test]
fn a_stop_signal_saves_a_loadable_checkpoint_and_exits_as_the_signal() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let args = ["--steps", "100000", "--threads", "1", "--eval-every", "0"];
        // Wait until training is under way.
        let (mut child, mut reader) = train_until(&args, &out, |step| step >= 3);
        // SAFETY: sending a signal to our own child process.
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(
            status.code(),
            Some(128 + signal),
            "signal {signal}: {status}"
        );
        let summary: serde_json::Value =
            serde_json::from_str(rest.lines().last().expect("a summary line")).unwrap();
        assert_eq!(summary["kind"], "summary");
        assert_eq!(summary["interrupted"], true);
        let step = summary["steps"].as_u64().unwrap();
        assert!((3..100000).contains(&step));
        let (_, ckpt) = snug_train::checkpoint::load(&out).unwrap();
        assert_eq!(ckpt.step, step, "signal {signal}");
    }
}

/// GNU `timeout` sends its TERM to the process and then to its group: the same signal twice
/// at once is one stop, which saves (it was taken for a second signal and aborted unsaved,
/// in half of such runs).
#[cfg(unix)]
#[test]
fn a_signal_delivered_twice_at_once_is_one_stop_and_saves() {
    for round in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        // Steps long enough that both signals arrive while one is in flight.
        let args = [
            "--preset",
            "char-small",
            "--batch",
            "4",
            "--block",
            "256",
            "--steps",
            "100000",
            "--threads",
            "1",
            "--eval-every",
            "0",
        ];
        let (mut child, mut reader) = train_until(&args, &out, |_| true);
        for _ in 0..2 {
            // SAFETY: sending a signal to our own child process.
            assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
        }
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(
            status.code(),
            Some(128 + libc::SIGTERM),
            "{round}: {status}"
        );
        let (_, ckpt) = snug_train::checkpoint::load(&out)
            .unwrap_or_else(|e| panic!("round {round}: nothing saved ({e}): {rest}"));
        assert!(ckpt.step >= 1);
    }
}

/// A signal during an evaluation (here of 200,000 batches a split, minutes of work) abandons
/// it: the run saves the step it finished and exits as the signal at once, before a
/// scheduler's grace period runs out, with no evaluation reported for that step.
#[cfg(unix)]
#[test]
fn a_stop_signal_during_an_evaluation_abandons_it_and_saves() {
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = ["--steps", "100", "--threads", "1", "--eval-every", "1"];
    // The first step's line comes just before its evaluation starts.
    let (mut child, mut reader) = train_until(
        &[&args[..], &["--eval-batches", "200000"]].concat(),
        &out,
        |step| {
            assert_eq!(step, 1);
            true
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    let status = child.wait().unwrap();
    // The whole evaluation takes minutes; abandoning it, well under one.
    assert!(
        sent.elapsed() < Duration::from_secs(30),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    let lines: Vec<serde_json::Value> = rest
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.iter().all(|l| l["kind"] != "eval"), "{rest}");
    let summary = lines.last().expect("a summary line");
    assert_eq!(summary["kind"], "summary");
    assert_eq!(summary["interrupted"], true);
    assert_eq!(summary["steps"], 1);
    let (_, ckpt) = snug_train::checkpoint::load(&out).unwrap();
    assert_eq!(ckpt.step, 1);
}

/// A signal before the loop starts (during a long setup: a search, a large model's load) ends
/// the process at once, as by default: nothing is trained yet, so nothing is saved, and the
/// directory takes a fresh run afterwards.
#[cfg(unix)]
#[test]
fn a_stop_signal_during_setup_ends_the_process_at_once() {
    use std::os::unix::process::ExitStatusExt;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("runs/run");
    let out_s = out.to_str().unwrap();
    let mut args = vec!["train", "--steps", "2", "--out", out_s];
    args.extend(QUIET_TRAIN);
    let mut child = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(&args)
        .env("SNUG_SETUP_DELAY_MS", "20000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let sent = Instant::now();
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status}");
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "it waited for the setup"
    );
    assert!(
        snug_train::checkpoint::load(&out).is_err(),
        "nothing trained, nothing saved"
    );
    // The directories the run made held only its lock: removed, as for a refused run.
    assert!(!dir.path().join("runs").exists(), "left behind");
    let again = snug(&args);
    assert!(again.status.success(), "{}", stderr(&again));
}

/// Train, sample from the checkpoint, export it in Hugging Face's layout, and start a new run
/// from the exported weights.
#[test]
fn sample_export_and_init_from_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    // Export writes GPT-2's layout, so a GPT (the demo default is a Llama).
    let common = [&QUIET_TRAIN[..], &["--batch", "8", "--preset", "tiny"]].concat();
    let mut args = vec!["train", "--steps", "60", "--out", run_s];
    args.extend(&common);
    let trained = snug(&args);
    assert!(trained.status.success(), "{}", stderr(&trained));
    let trained_lines = json_lines(&trained);
    let first_loss = trained_lines[0]["loss"].as_f64().unwrap();
    let final_loss = trained_lines.last().unwrap()["final_loss"]
        .as_f64()
        .unwrap();

    let sample_args = [
        "sample",
        "--checkpoint",
        run_s,
        "--prompt",
        "12+34=",
        "--tokens",
        "20",
        "--seed",
        "3",
        "--json",
        "--threads",
        "1",
    ];
    let o = snug(&sample_args);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["tokens"], 20);
    assert_eq!(report["text"].as_str().unwrap().chars().count(), 20);
    assert_eq!(report["planned_peak_bytes"], report["measured_peak_bytes"]);
    let again = snug(&sample_args);
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(report["text"], again["text"], "seeded sampling repeats");

    let hf = dir.path().join("hf");
    let o = snug(&[
        "export",
        "--checkpoint",
        run_s,
        "--out",
        hf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(hf.join("config.json").exists());
    let weights = hf.join("model.safetensors");
    let mut args = vec![
        "train",
        "--steps",
        "1",
        "--init-from",
        weights.to_str().unwrap(),
    ];
    args.extend(&common);
    let o = snug(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    // Its tokenizer is not known: the run says what it takes on trust.
    assert!(
        stderr(&o).contains("a lone weights file names no tokenizer"),
        "{}",
        stderr(&o)
    );
    let loss = json_lines(&o)[0]["loss"].as_f64().unwrap();
    assert!(
        (loss - final_loss).abs() < (first_loss - final_loss) / 2.0,
        "starts from the trained weights: {loss} (trained {first_loss} -> {final_loss})"
    );

    fails_with(
        &[
            "sample",
            "--checkpoint",
            dir.path().join("none").to_str().unwrap(),
        ],
        &["none"],
    );
    fails_with(
        &["sample", "--checkpoint", run_s, "--prompt", "hello"],
        &["prompt"],
    );
    fails_with(
        &["sample", "--checkpoint", run_s, "--temperature", "-1"],
        &["temperature"],
    );
    let mut args = vec![
        "train",
        "--steps",
        "1",
        "--preset",
        "char-small",
        "--init-from",
    ];
    args.push(weights.to_str().unwrap());
    fails_with(&args, &["model.safetensors", "has shape"]);
}

/// `plan --passes/--remat` reports each pass's saving, measured by planning with and without it.
#[test]
fn plan_reports_what_passes_save() {
    let args = [
        "plan", "--preset", "gpt2", "--batch", "4", "--block", "1024", "--json",
    ];
    let peak = |extra: &[&str]| -> serde_json::Value {
        let o = snug(&[&args[..], extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let plain = peak(&["--passes", "none"]);
    // The defaults are fused-ce and inplace.
    assert_eq!(
        peak(&[])["peak_bytes"],
        peak(&["--passes", "fused-ce,inplace"])["peak_bytes"]
    );
    let fused = peak(&["--passes", "fused-ce"]);
    let saving = &fused["passes"][0];
    assert_eq!(saving["pass"], "fused-ce");
    assert_eq!(saving["peak_before_bytes"], plain["peak_bytes"]);
    assert_eq!(saving["peak_after_bytes"], fused["peak_bytes"]);
    // At least the 4096 × 50257 f32 logits.
    assert!(saving["saved_bytes"].as_i64().unwrap() > 4096 * 50257 * 4);
    let block = peak(&["--passes", "fused-ce", "--remat", "block"]);
    assert!(block["peak_bytes"].as_u64() < fused["peak_bytes"].as_u64());
    // Every stage in one list, cumulatively: each row starts where the previous ended, and
    // the last ends at the reported peak.
    let all = peak(&[
        "--passes",
        "fused-ce,inplace,precision=bf16,remat=selective",
    ]);
    let rows = all["passes"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["pass"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["fused-ce", "inplace", "precision=bf16", "remat=selective"]
    );
    for w in rows.windows(2) {
        assert_eq!(w[0]["peak_after_bytes"], w[1]["peak_before_bytes"]);
    }
    assert_eq!(rows[3]["peak_after_bytes"], all["peak_bytes"]);
    assert_eq!(all["precision"], "bf16");
    let saved = |i: usize| rows[i]["saved_bytes"].as_i64().unwrap();
    // In-place finds little at GPT-2's peak now that GELU is fused into its down-projection;
    // train's `in_place_lowers_the_peak_of_an_elementwise_chain` checks what it saves.
    // bf16 halves most saved activations: well over a quarter of a GiB at this size.
    assert!(saved(2) > 1 << 28, "precision saved {}", saved(2));
    // With the norms and GELU fused into their GEMMs, GPT stores only matmul and attention
    // outputs and the residual stream: selective remat finds nothing it may drop, and must
    // not raise the peak.
    assert!(
        saved(3) >= 0,
        "selective remat raised the peak by {}",
        -saved(3)
    );
    // An untied LM head (Llama's) is read only by the matmul the fusion replaces.
    let llama = snug(&[
        "plan",
        "--preset",
        "llama-tiny",
        "--batch",
        "4",
        "--vocab",
        "5000",
        "--passes",
        "fused-ce",
        "--json",
    ]);
    assert!(llama.status.success(), "{}", stderr(&llama));
    let llama: serde_json::Value = serde_json::from_slice(&llama.stdout).unwrap();
    assert!(llama["passes"][0]["saved_bytes"].as_i64().unwrap() > 0);
    fails_with(&["plan", "--passes", "precision=i32"], &["passes", "i32"]);
    fails_with(&["plan", "--remat", "sometimes"], &["remat", "sometimes"]);
    fails_with(
        &[&args[..7], &["--remat", "budget:1MB"]].concat(),
        &[
            "budget of 976.56 KiB (1000000 bytes)",
            "the least peak any recomputation reaches is",
        ],
    );
    fails_with(&["plan", "--passes", "magic"], &["passes", "magic"]);
}

/// A cache directory holding a calibration for `threads`, so `fit` does not measure the machine
/// (which takes half a minute) in tests; its figures are nominal.
fn calibrated_cache(threads: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut p = snug_fit::MachineProfile::nominal(threads);
    p.cpu = snug_train::calibration::cpu_name();
    let path = dir.path().join(format!("machine-{threads}t.json"));
    snug_train::calibration::save_profile(&path, &p).unwrap();
    dir
}

fn snug_cached(args: &[&str], cache: &tempfile::TempDir) -> Output {
    snug_with(args, &[("SNUG_CACHE_DIR", cache.path())])
}

/// Under `--json` stdout is JSON alone (one object for fit, JSON lines for train): what
/// `--batch auto` chose, said in words, goes to stderr.
#[test]
fn json_stdout_holds_nothing_but_json() {
    let cache = calibrated_cache(1);
    let auto = [
        "--preset",
        "tiny",
        "--threads",
        "1",
        "--memory",
        "20MiB",
        "--batch",
        "auto",
        "--json",
    ];
    let o = snug_cached(
        &[&["train", "--steps", "1", "--no-save"][..], &auto].concat(),
        &cache,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    for line in stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("train --json printed `{line}`, not JSON: {e}"));
        assert!(v["kind"].is_string(), "{line}");
    }
    assert!(stdout.contains(r#""kind":"summary""#), "{stdout}");
    assert!(stderr(&o).contains("--batch auto: "), "{}", stderr(&o));
    let o = snug_cached(&[&["fit"][..], &auto].concat(), &cache);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("fit --json's stdout is one JSON object");
    assert!(report["effective_batch"].as_u64() >= Some(1), "{report}");
}

#[test]
fn fit_chooses_what_fits_and_train_holds_to_it() {
    let cache = calibrated_cache(1);
    let base = [
        "--batch",
        "16",
        "--block",
        "64",
        "--threads",
        "1",
        "--vocab",
        "13",
    ];
    let plan = snug(&[&["plan", "--json"][..], &base].concat());
    assert!(plan.status.success(), "{}", stderr(&plan));
    let plain: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let plain = plain["peak_bytes"].as_u64().unwrap();
    let budget = (plain * 6 / 10).to_string();

    let o = snug_cached(
        &[&["fit", "--json", "--memory", &budget][..], &base].concat(),
        &cache,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let chosen = &report["candidates"][report["chosen"].as_u64().unwrap() as usize];
    assert_eq!(chosen["verdict"], "chosen");
    let peak = chosen["peak_bytes"].as_u64().unwrap();
    assert!(peak <= plain * 6 / 10, "{peak} over {budget}");
    let c = &chosen["config"];
    assert_eq!(
        c["micro_batch"].as_u64().unwrap() * c["accumulation"].as_u64().unwrap(),
        16
    );
    // f32 does not fit as it is, so bf16 competes; unless the user pinned the precision.
    let precisions = |r: &serde_json::Value| -> Vec<String> {
        r["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["config"]["precision"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(precisions(&report).iter().any(|p| p == "bf16"));
    let o = snug_cached(
        &[
            &["fit", "--json", "--precision", "f32", "--memory", &budget][..],
            &base,
        ]
        .concat(),
        &cache,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let pinned: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(precisions(&pinned).iter().all(|p| p == "f32"));

    // Training with --memory uses that choice, and its measured peak stays under the budget.
    let o = snug_cached(
        &[
            &[
                "train",
                "--json",
                "--steps",
                "3",
                "--eval-every",
                "0",
                "--memory",
                &budget,
            ][..],
            &base,
        ]
        .concat(),
        &cache,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    assert_eq!(lines[0]["kind"], "fit");
    assert_eq!(lines[0]["chosen"], report["chosen"]);
    let summary = lines.last().unwrap();
    assert_eq!(summary["predicted_peak_bytes"].as_u64(), Some(peak));
    assert_eq!(summary["measured_peak_bytes"].as_u64(), Some(peak));

    // A budget below the parameters and optimizer state: a clear error, exit 1.
    let o = snug_cached(&[&["fit", "--memory", "1MB"][..], &base].concat(), &cache);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("nothing fits in 976.56 KiB (1000000 bytes)"),
        "{}",
        stderr(&o)
    );
    fails_with(
        &["fit", "--memory", "lots"],
        &["--memory lots", "not a byte size"],
    );
}

#[test]
fn memory_lowered_mid_run_is_recovered_without_losing_a_step() {
    let cache = calibrated_cache(1);
    let args = [
        "train",
        "--json",
        "--steps",
        "5",
        "--eval-every",
        "0",
        "--batch",
        "16",
        "--block",
        "64",
        "--threads",
        "1",
    ];
    let plan = snug(&[
        "plan",
        "--json",
        "--batch",
        "16",
        "--block",
        "64",
        "--threads",
        "1",
    ]);
    let plain: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let lowered = format!("3:{}", plain["peak_bytes"].as_u64().unwrap() / 2);
    let o = snug_cached(
        &[&args[..], &["--lower-memory-at", &lowered]].concat(),
        &cache,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    let recovery: Vec<_> = lines.iter().filter(|l| l["kind"] == "recovery").collect();
    assert_eq!(recovery.len(), 1);
    assert_eq!(recovery[0]["step"], 3);
    assert!(recovery[0]["to_peak_bytes"].as_u64() <= recovery[0]["failure"]["limit"].as_u64());
    // Recovery changes how the step runs, never what it trains: the f32 run stays f32 (a
    // bf16 step may plan smaller and faster, but would round every activation from here on).
    for key in ["precision", "levers"] {
        assert_eq!(recovery[0]["to"][key], recovery[0]["from"][key], "{key}");
    }
    let steps: Vec<u64> = step_losses(&lines).iter().map(|s| s.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
    // The summary measures the plan the run switched to, exactly, under the lowered limit;
    // the run's own peak was the first plan's.
    let summary = lines.last().unwrap();
    assert_eq!(summary["kind"], "summary");
    assert_eq!(
        summary["predicted_peak_bytes"],
        recovery[0]["to_peak_bytes"]
    );
    assert_eq!(summary["measured_peak_bytes"], recovery[0]["to_peak_bytes"]);
    assert_eq!(
        summary["memory_limit_bytes"],
        recovery[0]["failure"]["limit"]
    );
    assert_eq!(summary["run_peak_bytes"], plain["peak_bytes"]);
    // The first two steps are those of an undisturbed run.
    let undisturbed = snug(&args);
    let undisturbed = step_losses(&json_lines(&undisturbed));
    assert_eq!(step_losses(&lines)[..2], undisturbed[..2]);
}

/// With no calibration (none cached, and the budget too small to measure this machine), fit
/// ranks candidates by nominal figures: the summary then claims no predicted step time.
#[test]
fn nominal_figures_are_not_reported_as_a_prediction() {
    let empty = tempfile::tempdir().unwrap();
    let o = snug_cached(
        &[
            "train",
            "--json",
            "--steps",
            "2",
            "--memory",
            "12MiB",
            "--threads",
            "1",
            "--no-save",
        ],
        &empty,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("predictions are nominal"),
        "{}",
        stderr(&o)
    );
    let lines = json_lines(&o);
    let summary = lines.last().unwrap();
    assert_eq!(summary["kind"], "summary");
    assert!(summary["predicted_step_ms"].is_null(), "{summary}");
}

/// Memory lowered just before an evaluation: the evaluation runs out, switches to a smaller
/// configuration as a step would, and runs again; the run goes on with it, every step and
/// every evaluation reported, the new plan measured exactly.
#[test]
fn memory_lowered_before_an_evaluation_is_recovered() {
    let cache = calibrated_cache(1);
    let shape = ["--batch", "16", "--block", "64", "--threads", "1"];
    let plan = snug(&[&["plan", "--json"][..], &shape].concat());
    let plain: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    // Lowered before step 3: after step 2's line, so in the evaluation that follows it.
    let lowered = format!("3:{}", plain["peak_bytes"].as_u64().unwrap() / 2);
    let args = [
        &["train", "--json", "--steps", "4", "--eval-every", "1"][..],
        &["--eval-batches", "2", "--lower-memory-at", &lowered],
        &shape,
    ]
    .concat();
    let o = snug_cached(&args, &cache);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    let recovery: Vec<_> = lines.iter().filter(|l| l["kind"] == "recovery").collect();
    assert_eq!(recovery.len(), 1, "{lines:?}");
    assert_eq!(recovery[0]["step"], 2);
    assert_eq!(recovery[0]["evaluation"], true);
    assert!(recovery[0]["to_peak_bytes"].as_u64() <= recovery[0]["failure"]["limit"].as_u64());
    let steps: Vec<u64> = step_losses(&lines).iter().map(|s| s.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
    let evals: Vec<_> = lines
        .iter()
        .filter(|l| l["kind"] == "eval")
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, vec![1, 2, 3, 4]);
    // Each evaluation, before the switch and after, covers 2 batches of 16 windows of 64.
    for e in lines.iter().filter(|l| l["kind"] == "eval") {
        assert_eq!(e["val_loss_tokens"], 2 * 16 * 64, "{e}");
    }
    let micro = recovery[0]["to"]["micro_batch"]
        .as_u64()
        .expect("the new micro-batch");
    assert!(micro < 16, "{}", recovery[0]);
    let summary = lines.last().unwrap();
    assert_eq!(
        summary["predicted_peak_bytes"],
        recovery[0]["to_peak_bytes"]
    );
    assert_eq!(summary["measured_peak_bytes"], recovery[0]["to_peak_bytes"]);
}

/// f16 training with a loss scale so large that every scaled gradient overflows: each step is
/// reported skipped with the scale it ran at, the scale halves each time, and the run ends
/// normally; bf16 trains with no scale.
#[test]
fn f16_overflow_skips_steps_and_halves_the_loss_scale() {
    let o = snug(&[
        "train",
        "--steps",
        "3",
        "--precision",
        "f16",
        "--loss-scale",
        "1e30",
        "--eval-every",
        "0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let steps: Vec<serde_json::Value> = json_lines(&o)
        .into_iter()
        .filter(|l| l["kind"] == "step")
        .collect();
    assert_eq!(steps.len(), 3);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["skipped"], true, "step {i}");
        let scale = s["loss_scale"].as_f64().unwrap() as f32;
        assert_eq!(scale, 1e30f32 / 2f32.powi(i as i32), "step {i}");
    }
    let o = snug(&[
        "train",
        "--steps",
        "2",
        "--precision",
        "bf16",
        "--eval-every",
        "0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first = &json_lines(&o)[0];
    assert_eq!(first["skipped"], false);
    assert!(first["loss_scale"].is_null());
    fails_with(
        &["train", "--precision", "f16", "--loss-scale", "0.5"],
        &["loss_scale", "0.5"],
    );
}

/// `bench --json`: a GEMM probe line, then one line per case whose figures agree with each
/// other (tokens/s and FLOP/s from the median, MFU from the probes, measured peak = planned).
#[test]
fn bench_reports_step_times_mfu_and_memory() {
    let o = snug(&[
        "bench",
        "--cases",
        "tiny",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 2);
    let (probe, case) = (&lines[0], &lines[1]);
    assert_eq!(
        (probe["kind"].as_str(), case["kind"].as_str()),
        (Some("probe"), Some("case"))
    );
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    let peak = f(probe, "gflop_per_s") * 1e9;
    assert!(peak > 1e8, "a GEMM runs faster than 0.1 GFLOP/s: {peak}");
    assert_eq!(case["case"], "tiny");
    assert_eq!(case["steps"], 3);
    let (median, min, max) = (
        f(case, "median_step_ms"),
        f(case, "min_step_ms"),
        f(case, "max_step_ms"),
    );
    assert!(min <= median && median <= max && min > 0.0);
    let tokens = f(case, "batch") * f(case, "block");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    assert!(close(f(case, "tokens_per_s"), tokens / (median / 1e3)));
    assert!(close(
        f(case, "model_flops_per_s"),
        f(case, "model_flops_per_step") / (median / 1e3)
    ));
    // MFU is taken against the faster of the probe before the cases and the case's own after
    // its steps.
    let after = f(case, "probe_after_gflop_per_s") * 1e9;
    assert!(after > 1e8, "a GEMM runs faster than 0.1 GFLOP/s: {after}");
    assert!(close(
        f(case, "mfu"),
        f(case, "model_flops_per_s") / peak.max(after)
    ));
    assert_eq!(case["measured_peak_bytes"], case["predicted_peak_bytes"]);
    // Which bf16 arithmetic ran is said only of bf16 cases.
    assert!(case["bf16_products"].is_null(), "{case}");
    assert!(case["peak_rss_bytes"].as_u64() > case["measured_peak_bytes"].as_u64());
    assert!(f(case, "final_loss").is_finite());
    // The steal share, where Linux reports it, is a fraction of the CPU time.
    if std::path::Path::new("/proc/stat").exists() {
        for line in [probe, case] {
            let steal = f(line, "steal");
            assert!((0.0..=1.0).contains(&steal), "steal share {steal}");
        }
    }
    fails_with(&["bench", "--cases", "resnet"], &["resnet", "char-small"]);
    fails_with(&["bench", "--steps", "0"], &["--steps"]);
    // Refused before the probe starts threads (100,000 of them hung it).
    fails_with(&["bench", "--threads", "0"], &["threads", "at least 1"]);
    fails_with(&["bench", "--threads", "100000"], &["threads", "100000"]);
}

/// A bench stopped by a signal takes its case's process with it: a case left training would
/// skew whatever is timed next.
#[cfg(target_os = "linux")]
#[test]
fn a_stopped_bench_leaves_no_case_running() {
    use std::time::{Duration, Instant};

    let mut parent = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(["bench", "--cases", "tiny", "--steps", "1000000"])
        .args(["--warmup", "0", "--threads", "1", "--json"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = parent.id();
    let children = format!("/proc/{pid}/task/{pid}/children");
    let started = Instant::now();
    let case: u32 = loop {
        let listed = std::fs::read_to_string(&children).unwrap_or_default();
        if let Some(c) = listed.split_whitespace().next() {
            break c.parse().unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the case's process never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let status = parent.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM)
    );
    let alive = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            // A zombie (state Z) has ended; it waits only for init to reap it.
            .is_ok_and(|stat| {
                stat.rsplit(')')
                    .next()
                    .is_some_and(|s| !s.trim_start().starts_with('Z'))
            })
    };
    let stopped = Instant::now();
    while alive(case) && stopped.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = alive(case);
    if left {
        // SAFETY: ending the orphan this test made.
        unsafe { libc::kill(case as i32, libc::SIGKILL) };
    }
    assert!(!left, "the case's process {case} outlived its bench");
}

/// Without a terminal, `--dashboard` says so and trains with progress lines; with `--json` it is
/// refused (the two cannot share the terminal).
#[test]
fn dashboard_falls_back_without_a_terminal_and_refuses_json() {
    let o = snug(&["train", "--dashboard", "--steps", "3", "--no-save"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("--dashboard needs a terminal"), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("done: steps 0..3"), "{out}");

    let o = snug(&[
        "train",
        "--dashboard",
        "--json",
        "--steps",
        "3",
        "--no-save",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--json") && !err.contains("panicked"), "{err}");
}

/// On a terminal (a pseudo-terminal from util-linux's `script`), the view takes the alternate
/// screen, draws the run's figures, and gives the terminal back before the summary prints.
#[test]
fn dashboard_draws_on_a_terminal_and_gives_it_back() {
    if Command::new("script").arg("--version").output().is_err() {
        snug_testkit::skip_or_fail("util-linux's `script` (a pseudo-terminal) is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("typescript");
    let cmd = format!(
        "stty cols 120 rows 36; '{}' train --dashboard --steps 4 --eval-every 2 --no-save",
        env!("CARGO_BIN_EXE_snug")
    );
    let o = Command::new("script")
        .args(["-q", "-e", "-c", &cmd])
        .arg(&log)
        .current_dir(dir.path())
        .output()
        .expect("script runs");
    let screen = String::from_utf8_lossy(&std::fs::read(&log).unwrap()).into_owned();
    assert!(o.status.success(), "{}\n{screen}", stderr(&o));
    let enter = screen
        .find("\x1b[?1049h")
        .expect("the alternate screen is entered");
    let leave = screen
        .find("\x1b[?1049l")
        .expect("the terminal is given back");
    let done = screen.find("done: steps 0..4").expect("the summary prints");
    assert!(enter < leave && leave < done, "{screen}");
    // ratatui writes only the cells that change, so look for figures that appear whole.
    let view = &screen[enter..leave];
    for want in ["snug", "loss", "memory", "events", "0/4", "eval", "MiB"] {
        assert!(view.contains(want), "`{want}` not drawn:\n{view}");
    }
    assert!(!screen.contains("--dashboard needs a terminal"), "{screen}");
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let o = snug(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("plan --json is one JSON object")
}

/// `plan --devices N --shard S` plans one rank: its batch is the step's over N, its peak is the
/// plan's, ZeRO-3 holds less than replication, it sends what it receives, and the text names
/// the model's whole parameter count beside the rank's shards.
#[test]
fn plan_for_one_rank_of_several_devices() {
    let base = ["plan", "--preset", "tiny", "--batch", "8", "--json"];
    let single = plan_json(&base);
    assert!(single.get("distributed").is_none(), "{single}");
    let mut peaks = Vec::new();
    for stage in ["0", "1", "2", "3"] {
        let mut args = base.to_vec();
        args.extend(["--devices", "4", "--shard", stage, "--link", "10"]);
        let p = plan_json(&args);
        let d = &p["distributed"];
        assert_eq!(d["devices"], 4, "{d}");
        assert_eq!(d["per_rank_batch"], 2, "{d}");
        assert_eq!(d["per_rank_peak_bytes"], p["peak_bytes"], "{d}");
        let sent = d["comm"]["sent_bytes"].as_f64().unwrap();
        assert!(
            sent > 0.0 && d["comm"]["received_bytes"].as_f64() == Some(sent),
            "{d}"
        );
        // 10 GB/s each way: the time is the bytes over the link.
        let ms = d["predicted_comm_ms"].as_f64().unwrap();
        assert!((ms - sent / 10e9 * 1e3).abs() < 1e-9, "{d}");
        peaks.push(p["peak_bytes"].as_u64().unwrap());
    }
    assert!(
        peaks[3] < peaks[0],
        "ZeRO-3 {} vs replicated {}",
        peaks[3],
        peaks[0]
    );

    let o = snug(&[
        "plan",
        "--preset",
        "tiny",
        "--batch",
        "8",
        "--devices",
        "4",
        "--shard",
        "3",
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    let total = single["parameters"].as_u64().unwrap();
    assert!(
        text.contains(&format!("{total} parameters")) && text.contains("this rank holds"),
        "{text}"
    );

    fails_with(
        &["plan", "--preset", "tiny", "--batch", "8", "--devices", "3"],
        &["does not split over 3 devices"],
    );
    fails_with(
        &["plan", "--preset", "tiny", "--shard", "2"],
        &["--shard", "--devices N"],
    );
    fails_with(
        &[
            "plan",
            "--preset",
            "tiny",
            "--batch",
            "8",
            "--devices",
            "2",
            "--link",
            "0",
        ],
        &["--link 0"],
    );
}
