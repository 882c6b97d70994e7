//! `snug plan` predicts the peak `snug train` then measures, for every way of giving a model
//! and its data: both resolve a run through one path, so they plan the same step.

use std::path::Path;
use std::process::{Command, Output};

fn snug(args: &[&str]) -> Output {
    // Runs without --out save under ./runs: keep them out of the source tree.
    let cwd = tempfile::tempdir().expect("a scratch directory");
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(cwd.path())
        .output()
        .expect("the snug binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Plan's peak, and train's predicted and measured peaks after one step, for the same flags.
fn plan_and_train(args: &[&str]) -> (u64, u64, u64) {
    // The thread count is part of the configuration (each thread has its own scratch).
    let plan = snug(&[&["plan", "--json", "--threads", "1"], args].concat());
    assert!(plan.status.success(), "plan {args:?}: {}", stderr(&plan));
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).expect("plan's JSON");
    let train = snug(
        &[
            &[
                "train",
                "--json",
                "--steps",
                "1",
                "--eval-every",
                "0",
                "--threads",
                "1",
            ],
            args,
        ]
        .concat(),
    );
    assert!(train.status.success(), "train {args:?}: {}", stderr(&train));
    let text = String::from_utf8_lossy(&train.stdout);
    let summary: serde_json::Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "summary")
        .expect("a summary line");
    let get = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k}"));
    (
        get(&plan, "peak_bytes"),
        get(&summary, "predicted_peak_bytes"),
        get(&summary, "measured_peak_bytes"),
    )
}

fn text_corpus() -> String {
    // Enough distinct words for a BPE vocabulary and splits of a few blocks each.
    (0..400)
        .map(|i| {
            format!(
                "line {i}: the quick brown fox {} jumps over the lazy dog.\n",
                i * 7919 % 1000
            )
        })
        .collect()
}

/// Prompt/completion examples for `snug prepare --format jsonl`: only completions count.
fn jsonl_examples() -> String {
    (0..120)
        .map(|i| {
            format!(
                "{{\"prompt\": \"Hello, {} and {}?\", \"completion\": \" world {}!\"}}\n",
                i * 7 % 50,
                i % 9,
                i * 13 % 100
            )
        })
        .collect()
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).expect("writing a test fixture");
}

#[test]
fn plan_predicts_what_train_measures_for_every_way_of_giving_a_run() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let p = |name: &str| dir.path().join(name);
    let s = |name: &str| p(name).to_string_lossy().into_owned();
    write(&p("corpus.txt"), &text_corpus());
    let prep = snug(&[
        "prepare",
        "--input",
        &s("corpus.txt"),
        "--tokenizer",
        "gpt2",
        "--out",
        &s("tokens"),
    ]);
    assert!(prep.status.success(), "{}", stderr(&prep));
    write(&p("chat.jsonl"), &jsonl_examples());
    let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/tests/fixtures/hf/tokenizer");
    let prep = snug(&[
        "prepare",
        "--format",
        "jsonl",
        "--input",
        &s("chat.jsonl"),
        "--tokenizer",
        &tokenizer.to_string_lossy(),
        "--out",
        &s("masked"),
    ]);
    assert!(prep.status.success(), "{}", stderr(&prep));
    write(
        &p("run.toml"),
        &format!(
            "[model]\npreset = \"tiny\"\nn_layer = 1\n[train]\ndata = {:?}\nbatch = 2\nblock = 32\n",
            s("tokens")
        ),
    );
    write(
        &p("gpt2.json"),
        r#"{"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
            "vocab_size": 300}"#,
    );
    write(
        &p("llama.json"),
        r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 300, "max_position_embeddings": 64, "rms_norm_eps": 1e-05}"#,
    );
    let corpus = s("corpus.txt");
    let tokens = s("tokens");
    let masked = s("masked");
    let config = s("run.toml");
    let gpt2 = s("gpt2.json");
    let llama = s("llama.json");
    let cases: Vec<Vec<&str>> = vec![
        // The defaults: the demo model on the built-in data.
        vec![],
        vec!["--preset", "char-small", "--batch", "2", "--block", "32"],
        // The data in the file gives the vocabulary (GPT-2 BPE here), not the preset.
        vec!["--config", &config],
        vec!["--config", &config, "--batch", "4", "--accumulation", "2"],
        vec!["--hf-config", &gpt2, "--data", &corpus, "--batch", "2"],
        vec!["--hf-config", &llama, "--data", &corpus, "--batch", "2"],
        vec![
            "--preset", "tiny", "--data", &tokens, "--batch", "2", "--block", "16",
        ],
        vec![
            "--preset",
            "llama-tiny",
            "--data",
            &corpus,
            "--batch",
            "2",
            "--block",
            "32",
            "--remat",
            "block",
            "--precision",
            "bf16",
        ],
        vec![
            "--data",
            &corpus,
            "--batch",
            "4",
            "--accumulation",
            "2",
            "--remat",
            "selective",
            "--passes",
            "cse,dce",
        ],
        vec!["--vocab", "40", "--batch", "2", "--optimizer", "sgd"],
        // The demo's shape in bf16: big enough that its products read bf16 themselves (on a
        // CPU with our GEMM), with selective remat recomputing some of them.
        vec![
            "--preset",
            "llama-tiny",
            "--batch",
            "8",
            "--block",
            "128",
            "--precision",
            "bf16",
            "--remat",
            "selective",
        ],
        // Token files with a loss mask: the step takes the mask and its divisor as inputs.
        vec![
            "--preset", "tiny", "--data", &masked, "--batch", "2", "--block", "16",
        ],
        vec![
            "--preset",
            "llama-tiny",
            "--data",
            &masked,
            "--batch",
            "4",
            "--block",
            "16",
            "--accumulation",
            "2",
            "--passes",
            "none",
            "--remat",
            "block",
        ],
    ];
    for args in &cases {
        let (planned, predicted, measured) = plan_and_train(args);
        assert_eq!(planned, predicted, "{args:?}: plan and train planned apart");
        assert_eq!(planned, measured, "{args:?}: the measured peak differs");
    }
    // The masked directory does make a masked step: it plans the mask's inputs, and a step
    // counts only the completions' targets.
    let masked_args = [
        "--preset", "tiny", "--data", &masked, "--batch", "2", "--block", "16",
    ];
    let json = |args: &[&str]| -> serde_json::Value {
        let o = snug(&[&["plan", "--json"], args].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).expect("plan's JSON")
    };
    let with_mask = json(&masked_args);
    // The same model and vocabulary on data without a mask (the fixture tokenizer's 320).
    let plain = json(&[
        "--preset", "tiny", "--vocab", "320", "--batch", "2", "--block", "16",
    ]);
    assert_eq!(with_mask["nodes"], plain["nodes"]);
    assert_eq!(
        with_mask["tensors"].as_u64(),
        plain["tensors"].as_u64().map(|t| t + 2),
        "the mask and its divisor are the masked step's extra tensors"
    );
    let train = snug(
        &[
            &[
                "train",
                "--json",
                "--steps",
                "2",
                "--eval-every",
                "0",
                "--no-save",
            ],
            &masked_args[..],
        ]
        .concat(),
    );
    assert!(train.status.success(), "{}", stderr(&train));
    let text = String::from_utf8_lossy(&train.stdout);
    let steps: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .collect();
    assert_eq!(steps.len(), 2, "{text}");
    for step in &steps {
        let counted = step["loss_tokens"].as_u64().expect("loss_tokens");
        assert!(counted > 0 && counted < 2 * 16, "{step}");
    }
}

#[test]
fn plan_with_no_arguments_plans_the_model_train_trains() {
    let plan = snug(&["plan", "--json"]);
    assert!(plan.status.success(), "{}", stderr(&plan));
    let v: serde_json::Value = serde_json::from_slice(&plan.stdout).expect("plan's JSON");
    // The demo model (llama-tiny) keeps its preset's vocabulary on the built-in data, as
    // `train` does.
    let tiny = snug(&["plan", "--json", "--preset", "llama-tiny"]);
    let t: serde_json::Value = serde_json::from_slice(&tiny.stdout).expect("plan's JSON");
    assert_eq!(v["model"], t["model"], "{v}");
    let train = snug(&[
        "train",
        "--json",
        "--steps",
        "1",
        "--no-save",
        "--eval-every",
        "0",
    ]);
    assert!(train.status.success(), "{}", stderr(&train));
    let text = String::from_utf8_lossy(&train.stdout);
    let summary: serde_json::Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["kind"] == "summary")
        .expect("a summary line");
    assert_eq!(summary["parameters"], v["parameters"]);
    assert_eq!(summary["predicted_peak_bytes"], v["peak_bytes"]);
}

#[test]
fn a_remat_mode_never_raises_the_planned_peak() {
    // Selective recomputation on this shape lands a recomputed value at the peak.
    let base = [
        "plan",
        "--json",
        "--preset",
        "char-small",
        "--batch",
        "8",
        "--block",
        "256",
    ];
    let peak = |extra: &[&str]| -> serde_json::Value {
        let o = snug(&[&base[..], extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).expect("plan's JSON")
    };
    let none = peak(&[])["peak_bytes"].as_u64().expect("a peak");
    for mode in ["selective", "block", "block:2", "block:3"] {
        let v = peak(&["--remat", mode]);
        let p = v["peak_bytes"].as_u64().expect("a peak");
        assert!(p <= none, "--remat {mode}: {p} > {none}");
        if let Some(d) = v["remat_dropped"].as_object() {
            assert!(d["peak_with_bytes"].as_u64() >= Some(none), "{v}");
            assert_eq!(p, none);
        }
    }
}

/// A remat budget holds for the step that runs: each candidate is judged after the rewrites
/// that follow remat (in-place writes; with fused updates in 16 bits, the casts' ties), and
/// every mode is tried before a budget is refused. Each case is one a fuzz of the levers
/// found wrong: the first two refused though `--remat block` (and, for the second, no remat
/// at all) met the budget; the third chosen and then over it by 38,819 bytes. The last two
/// were refused although dropping fewer values met them: the peak is not monotone in the
/// values dropped, and dropping all of them missed (each budget is the peak a larger budget
/// chose).
#[test]
fn a_remat_budget_holds_for_the_step_that_runs() {
    for case in [
        "--preset tiny --batch 8 --block 32 --remat budget:8027200",
        "--preset tiny --batch 16 --block 32 --precision bf16 --remat budget:9059840",
        "--preset tiny --remat budget:10.5MiB",
        "--preset tiny --accumulation 2 --precision bf16 --optimizer sgd --grad-clip 0 \
         --remat budget:6017717",
        "--preset llama-tiny --batch 4 --precision bf16 --clip-mode previous --fused-update \
         --lora 2 --lora-targets q_proj --quantize-base bf16 --remat budget:1950429",
    ] {
        let args: Vec<&str> = case.split_whitespace().collect();
        let budget = args[args.len() - 1].trim_start_matches("budget:");
        let budget = snug_plan::parse_bytes(budget).expect("a byte count") as u64;
        let (plan, predicted, measured) = plan_and_train(&args);
        assert_eq!((plan, predicted), (measured, measured), "{case}");
        assert!(measured <= budget, "{case}: {measured} over {budget}");
    }
}

/// Plan and fit check the weights a run would start from as train does (headers only), so
/// they never give a peak for a run train then refuses; and what train takes, plan plans.
#[test]
fn plan_and_fit_refuse_the_weights_train_refuses() {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let run = dir.path().join("run");
    let trained = snug(&[
        "train",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--threads",
        "1",
        "--out",
        run.to_str().unwrap(),
    ]);
    assert!(trained.status.success(), "{}", stderr(&trained));
    let export = dir.path().join("export");
    let exported = snug(&[
        "export",
        "--checkpoint",
        run.to_str().unwrap(),
        "--out",
        export.to_str().unwrap(),
    ]);
    assert!(exported.status.success(), "{}", stderr(&exported));
    let weights = export.join("model.safetensors");
    let weights = weights.to_str().unwrap();
    let missing = dir.path().join("missing.safetensors");
    let missing = missing.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--preset", "tiny", "--init-from", missing],
            "missing.safetensors",
        ),
        (
            &["--preset", "char-small", "--init-from", weights],
            "has shape",
        ),
        (&["--init-from", weights], "needs its shape"),
    ];
    for (args, needle) in cases {
        for cmd in [
            &["plan", "--threads", "1"][..],
            &["fit", "--memory", "1GiB", "--threads", "1"],
            &["train", "--steps", "1", "--no-save", "--threads", "1"],
        ] {
            let o = snug(&[cmd, args].concat());
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{cmd:?} {args:?}: {err}");
            assert!(
                err.contains(needle),
                "{cmd:?} {args:?}: `{needle}` in {err}"
            );
        }
    }
    let (plan, predicted, measured) = plan_and_train(&["--preset", "tiny", "--init-from", weights]);
    assert_eq!((plan, predicted), (predicted, measured));
}
