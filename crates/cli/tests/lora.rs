//! LoRA through the binary: `plan` shows what freezing the base saves, `train --lora` trains
//! with its planned peak, `export` writes the base and a PEFT adapter (or, with `--merge`, the
//! merged model), and `train --init-from` the exported directory continues the adapters.

mod common;

use common::{fails_with, ok};
use std::path::Path;
use std::process::Output;

fn lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

const LORA: [&str; 12] = [
    "--lora",
    "4",
    "--lora-targets",
    "all-linear",
    "--threads",
    "1",
    "--eval-every",
    "0",
    "--batch",
    "8",
    "--lr",
    "0.01",
];

#[test]
fn plan_shows_the_frozen_base_and_what_it_saves() {
    let dir = tempfile::tempdir().unwrap();
    let o = ok(
        dir.path(),
        &["plan", "--preset", "llama-tiny", "--lora", "8", "--json"],
    );
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // q_proj and v_proj of two layers: A [8, 64] and B [out, 8] each.
    let adapters = 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8);
    assert_eq!(plan["parameters"], adapters);
    assert_eq!(plan["lora"]["rank"], 8);
    assert_eq!(plan["lora"]["alpha"], 16.0);
    let lora = &plan["passes"][0];
    assert_eq!(lora["pass"], "lora r=8 q_proj,v_proj");
    assert!(lora["saved_bytes"].as_i64().unwrap() > 0, "{lora}");
    let full = ok(dir.path(), &["plan", "--preset", "llama-tiny", "--json"]);
    let full: serde_json::Value = serde_json::from_slice(&full.stdout).unwrap();
    assert_eq!(
        plan["frozen_parameters"].as_u64().unwrap(),
        full["parameters"].as_u64().unwrap()
    );
    assert!(full.get("lora").is_none() && full.get("frozen_parameters").is_none());

    fails_with(
        dir.path(),
        &[
            "plan",
            "--preset",
            "tiny",
            "--lora",
            "4",
            "--lora-targets",
            "q_proj",
        ],
        &["`q_proj` names no linear layer", "c_attn"],
    );
    fails_with(
        dir.path(),
        &["plan", "--preset", "llama-tiny", "--lora", "0"],
        &["lora", "at least 1"],
    );
    fails_with(
        dir.path(),
        &["plan", "--preset", "llama-tiny", "--lora", "65"],
        &["rank 65", "at most"],
    );
}

#[test]
fn train_export_merge_and_continue_from_the_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = vec![
        "train",
        "--steps",
        "30",
        "--json",
        "--out",
        run.to_str().unwrap(),
    ];
    args.extend(LORA);
    let trained = lines(&ok(dir.path(), &args));
    let summary = trained.last().unwrap();
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    let (first, last) = (
        summary["first_loss"].as_f64().unwrap(),
        summary["final_loss"].as_f64().unwrap(),
    );
    assert!(last < first - 0.1, "loss {first} -> {last}");

    // Base and adapter side by side.
    let out = dir.path().join("export");
    let o = ok(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--json",
        ],
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["adapter"]["tensors"], 2 * 2 * 7);
    for f in [
        "config.json",
        "model.safetensors",
        "adapter_model.safetensors",
        "adapter_config.json",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(config["target_modules"].as_array().unwrap().len(), 7);

    // Merged: the base weights change where adapters sat, and no adapter is left.
    let merged = dir.path().join("merged");
    ok(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
            "--merge",
        ],
    );
    assert!(!merged.join("adapter_model.safetensors").exists());
    let read = |p: &Path| std::fs::read(p.join("model.safetensors")).unwrap();
    let (base_bytes, merged_bytes) = (read(&out), read(&merged));
    let base = safetensors::SafeTensors::deserialize(&base_bytes).unwrap();
    let m = safetensors::SafeTensors::deserialize(&merged_bytes).unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_ne!(base.tensor(q).unwrap().data(), m.tensor(q).unwrap().data());
    let norm = "model.norm.weight";
    assert_eq!(
        base.tensor(norm).unwrap().data(),
        m.tensor(norm).unwrap().data()
    );

    // Sampled greedily, the run, its base with the adapter beside it and the merged model
    // say the same: the adapter is folded into the weights as they are read. The base alone
    // says something else.
    let sample = |from: &Path| {
        let o = ok(
            dir.path(),
            &[
                "sample",
                "--checkpoint",
                from.to_str().unwrap(),
                "--prompt",
                "12+34=",
                "--tokens",
                "8",
                "--temperature",
                "0",
                "--threads",
                "1",
                "--json",
            ],
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["text"].as_str().expect("the sampled text").to_string()
    };
    let from_run = sample(&run);
    assert_eq!(sample(&out), from_run);
    // Exported again, the model directory takes its adapter along.
    let again = dir.path().join("again");
    let args = [
        "export",
        "--checkpoint",
        out.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ];
    ok(dir.path(), &args);
    assert!(again.join("adapter_config.json").exists());
    assert_eq!(sample(&again), from_run);
    // A character the run's vocabulary lacks is refused by the exported tokenizer as by the
    // run's, not dropped, naming the prompt, the tokenizer and the character.
    let out_tokenizer = out.join("tokenizer.json");
    let refuses_x = |from: &Path, tokenizer: &str| {
        let args = [
            "sample",
            "--checkpoint",
            from.to_str().unwrap(),
            "--prompt",
            "1x2",
        ];
        let needles = [
            "encoding --prompt with",
            tokenizer,
            "'x' (U+0078, at byte 1)",
        ];
        fails_with(dir.path(), &args, &needles);
        let err = String::from_utf8_lossy(&common::snug(dir.path(), &args).stderr).to_string();
        assert!(!err.contains("Missing [UNK]"), "{err}");
    };
    refuses_x(&run, "the checkpoint's tokenizer");
    refuses_x(&out, out_tokenizer.to_str().unwrap());
    // The exported tokenizer.json declares no unknown token its vocabulary lacks.
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out_tokenizer).unwrap()).unwrap();
    let model = &tok["model"];
    if let Some(unk) = model["unk_token"].as_str() {
        assert!(model["vocab"].get(unk).is_some(), "{model}");
    }
    if let Some(id) = model["unk_id"].as_u64() {
        assert!(
            (id as usize) < model["vocab"].as_array().unwrap().len(),
            "{model}"
        );
    }
    // An earlier export's tokenizer.json (a WordLevel declaring `<unk>`, which its vocabulary
    // lacks): the same clear refusal, and exported again it is written as export writes one
    // now, with the same ids.
    let old = dir.path().join("old");
    std::fs::create_dir(&old).unwrap();
    for entry in std::fs::read_dir(&out).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, old.join(p.file_name().unwrap())).unwrap();
    }
    let chars: Vec<String> = match model["vocab"].as_array() {
        Some(pieces) => pieces
            .iter()
            .map(|p| p[0].as_str().unwrap().into())
            .collect(),
        None => panic!("a Unigram vocabulary: {model}"),
    };
    let mut old_tok = tok.clone();
    old_tok["model"] = serde_json::json!({
        "type": "WordLevel",
        "vocab": chars.iter().enumerate().map(|(i, c)| (c.clone(), i.into()))
            .collect::<serde_json::Map<String, serde_json::Value>>(),
        "unk_token": "<unk>"
    });
    std::fs::write(old.join("tokenizer.json"), old_tok.to_string()).unwrap();
    assert_eq!(sample(&old), from_run);
    refuses_x(&old, old.join("tokenizer.json").to_str().unwrap());
    let again_old = dir.path().join("again-old");
    let args = [
        "export",
        "--checkpoint",
        old.to_str().unwrap(),
        "--out",
        again_old.to_str().unwrap(),
    ];
    ok(dir.path(), &args);
    assert_eq!(
        std::fs::read(again_old.join("tokenizer.json")).unwrap(),
        std::fs::read(&out_tokenizer).unwrap()
    );
    assert_eq!(sample(&again_old), from_run);
    assert_eq!(sample(&merged), from_run);
    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(out.join(f), bare.join(f)).unwrap();
    }
    assert_ne!(sample(&bare), from_run);
    // The adapter's weights without its configuration are refused by name, not left unread
    // (which would sample, continue and export the bare base), and so is the converse.
    std::fs::copy(
        out.join("adapter_model.safetensors"),
        bare.join("adapter_model.safetensors"),
    )
    .unwrap();
    let bare_s = bare.to_str().unwrap();
    let half = |present: &str, missing: &str| {
        let needles = [bare_s, &format!("holds {present} but no {missing}")];
        let tokens = ["--tokens", "2", "--threads", "1"];
        let sample = [&["sample", "--checkpoint", bare_s][..], &tokens].concat();
        fails_with(dir.path(), &sample, &needles);
        let run = dir.path().join("half-run");
        let train = [
            "train",
            "--steps",
            "1",
            "--threads",
            "1",
            "--init-from",
            bare_s,
            "--out",
            run.to_str().unwrap(),
        ];
        fails_with(dir.path(), &train, &needles);
        let to = dir.path().join("half-export");
        let export = [
            "export",
            "--checkpoint",
            bare_s,
            "--out",
            to.to_str().unwrap(),
        ];
        fails_with(dir.path(), &export, &needles);
        assert!(!run.exists() && !to.exists());
    };
    half("adapter_model.safetensors", "adapter_config.json");
    std::fs::remove_file(bare.join("adapter_model.safetensors")).unwrap();
    std::fs::copy(
        out.join("adapter_config.json"),
        bare.join("adapter_config.json"),
    )
    .unwrap();
    half("adapter_config.json", "adapter_model.safetensors");
    // A damaged adapter is refused by name rather than left out.
    std::fs::copy(
        out.join("adapter_model.safetensors"),
        bare.join("adapter_model.safetensors"),
    )
    .unwrap();
    std::fs::write(bare.join("adapter_config.json"), r#"{"r": "x"}"#).unwrap();
    fails_with(
        dir.path(),
        &[
            "sample",
            "--checkpoint",
            bare.to_str().unwrap(),
            "--tokens",
            "2",
        ],
        &["adapter_config.json"],
    );

    // Continuing from the exported adapter starts where the run ended.
    let mut args = vec![
        "train",
        "--steps",
        "1",
        "--json",
        "--out",
        dir.path().join("run2").to_str().unwrap().to_string().leak(),
        "--init-from",
        out.to_str().unwrap(),
    ];
    args.extend(LORA);
    let cont = lines(&ok(dir.path(), &args));
    let loss = cont[0]["loss"].as_f64().unwrap();
    assert!(
        (loss - last).abs() < (first - last) / 2.0,
        "continues from the adapter: {loss} (trained {first} -> {last})"
    );
    let mut args = vec![
        "train",
        "--steps",
        "1",
        "--init-from",
        out.to_str().unwrap(),
        "--lora",
        "8",
        "--threads",
        "1",
    ];
    args.extend([
        "--out",
        dir.path().join("run3").to_str().unwrap().to_string().leak(),
    ]);
    fails_with(dir.path(), &args, &["rank is 4", "asks for 8"]);
    fails_with(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            merged.to_str().unwrap(),
            "--out",
            dir.path().join("x").to_str().unwrap(),
            "--merge",
        ],
        &["--merge", "no LoRA adapter"],
    );
}

/// A directory that is both a model (`config.json` and weights) and a run (checkpoints) is
/// read as neither: `sample` and `export` would have taken the pretrained weights and passed
/// over what the run trained. `train --out` the directory `--init-from` reads would make one,
/// and is refused. An adapter's `lora_dropout`, which snug does not apply, is warned of.
#[test]
fn a_directory_that_is_both_model_and_run_is_refused_and_dropout_is_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let (run, model) = (path("run"), path("model"));
    let mut args = vec!["train", "--steps", "2", "--out", &run];
    args.extend(LORA);
    ok(dir.path(), &args);
    ok(
        dir.path(),
        &["export", "--checkpoint", &run, "--out", &model],
    );
    let listing = |d: &str| {
        let mut names: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let before = listing(&model);
    let mut args = vec![
        "train",
        "--steps",
        "1",
        "--init-from",
        &model,
        "--out",
        &model,
    ];
    args.extend(LORA);
    fails_with(
        dir.path(),
        &args,
        &["is the model directory --init-from reads"],
    );
    #[cfg(unix)]
    std::os::unix::fs::symlink(&model, dir.path().join("link")).unwrap();
    for out in ["./model/.", "link"] {
        let mut args = vec!["train", "--steps", "1", "--init-from", &model, "--out", out];
        args.extend(LORA);
        if cfg!(unix) || out != "link" {
            fails_with(
                dir.path(),
                &args,
                &["is the model directory --init-from reads"],
            );
        }
    }
    assert_eq!(listing(&model), before, "the model directory as it was");

    let both = path("both");
    std::fs::create_dir(&both).unwrap();
    for f in before.iter().map(|n| n.to_str().unwrap()) {
        std::fs::copy(Path::new(&model).join(f), Path::new(&both).join(f)).unwrap();
    }
    let ckpt = "ckpt-00000002.safetensors";
    std::fs::copy(Path::new(&run).join(ckpt), Path::new(&both).join(ckpt)).unwrap();
    let needles = [both.as_str(), "holds both a Hugging Face model"];
    let sample = [
        "sample",
        "--checkpoint",
        &both,
        "--tokens",
        "2",
        "--threads",
        "1",
    ];
    fails_with(dir.path(), &sample, &needles);
    let to = path("exported");
    fails_with(
        dir.path(),
        &["export", "--checkpoint", &both, "--out", &to],
        &needles,
    );
    assert!(!Path::new(&to).exists());
    // The checkpoint named as a file is the run's, unambiguously.
    let file = format!("{both}/{ckpt}");
    ok(
        dir.path(),
        &[
            "sample",
            "--checkpoint",
            &file,
            "--tokens",
            "2",
            "--threads",
            "1",
        ],
    );

    let config = Path::new(&model).join("adapter_config.json");
    let mut c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    c["lora_dropout"] = serde_json::json!(0.05);
    std::fs::write(&config, c.to_string()).unwrap();
    let cont = path("cont");
    let mut args = vec![
        "train",
        "--steps",
        "1",
        "--init-from",
        &model,
        "--out",
        &cont,
    ];
    args.extend(LORA);
    let o = ok(dir.path(), &args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("`lora_dropout` is 0.05, but snug trains adapters without dropout"),
        "{err}"
    );
}
