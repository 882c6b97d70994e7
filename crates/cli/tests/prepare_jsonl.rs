//! `snug prepare --format jsonl` with the Hugging Face fixture tokenizer: token files with loss
//! masks, split between examples, and bad lines named by number with nothing written.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use snug_train::token_file::TokenFile;

fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/tests/fixtures/hf/tokenizer")
}

fn snug(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .output()
        .expect("the snug binary runs")
}

#[test]
fn jsonl_examples_become_masked_token_files() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chat.jsonl");
    // Three prompt/completion examples of 13 tokens each (6 prompt, 6 completion, EOS), then
    // a chat whose only assistant turn, "4<|im_end|>\n", is 3 tokens.
    let pc = r#"{"prompt": "Hello,", "completion": " world!"}"#;
    let chat = r#"{"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}"#;
    std::fs::write(&input, format!("{pc}\n{pc}\n{pc}\n{chat}\n")).unwrap();
    let out = dir.path().join("prepared");
    let tok_json = tokenizer_dir().join("tokenizer.json");
    for tokenizer in [tokenizer_dir(), tok_json] {
        let o = snug(&[
            "prepare",
            "--format",
            "jsonl",
            "--input",
            input.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--val-fraction",
            "0.2",
            "--json",
            // The second tokenizer's files replace the first's.
            "--force",
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{stderr}");
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["tokenizer"], "hf");
        assert_eq!(report["vocab_size"], 320);
        assert_eq!(report["examples"], 4);
        let train = TokenFile::open(&out.join("train.bin")).unwrap();
        let val = TokenFile::open(&out.join("val.bin")).unwrap();
        assert!(train.has_mask() && val.has_mask());
        // The chat (the last example) is the validation split: the boundary nearest 80%.
        assert_eq!(train.len(), 39);
        assert_eq!(report["train_tokens"], 39);
        let one: Vec<bool> = (0..13).map(|i| i >= 6).collect();
        assert_eq!(
            train.mask_to_vec(),
            [one.clone(), one.clone(), one].concat()
        );
        let val_ids = val.to_vec();
        let val_mask = val.mask_to_vec();
        let counted: Vec<u32> = val_ids
            .iter()
            .zip(&val_mask)
            .filter(|(_, &m)| m)
            .map(|(&i, _)| i)
            .collect();
        assert_eq!(val.tokenizer().decode(&counted), "4<|im_end|>\n");
        assert_eq!(report["loss_tokens"], 3 * 7 + 3);
        assert_eq!(val.tokenizer(), train.tokenizer());
    }
    // Training applies the mask: a step counts only the completions' targets.
    let o = snug(&[
        "train",
        "--data",
        out.to_str().unwrap(),
        "--block",
        "8",
        "--batch",
        "4",
        "--steps",
        "1",
        "--no-save",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let step = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "step")
        .expect("a step line");
    let counted = step["loss_tokens"].as_u64().expect("loss_tokens");
    assert!(counted > 0 && counted < 4 * 8, "{step}");
}

#[test]
fn a_malformed_line_is_named_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bad.jsonl");
    std::fs::write(&input, "{\"text\": \"a\"}\n\n{\"text\": 5}\n").unwrap();
    let out = dir.path().join("prepared");
    let base = [
        "prepare",
        "--format",
        "jsonl",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--tokenizer",
    ];
    let run = |tokenizer: &str| {
        let mut args = base.to_vec();
        args.push(tokenizer);
        let o = snug(&args);
        assert_eq!(o.status.code(), Some(1));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let err = run(tokenizer_dir().to_str().unwrap());
    assert!(
        err.contains("bad.jsonl: line 3: `text` is a number"),
        "{err}"
    );
    let err = run("char");
    assert!(err.contains("--tokenizer: char"), "{err}");
    let err = run("no-such-tokenizer");
    assert!(
        err.contains("--tokenizer") && err.contains("no-such-tokenizer"),
        "{err}"
    );
    assert!(!out.exists());
}

/// Chat content a template would render as something else (a missing content as an empty
/// turn, null as "None", a list of parts as its Python text) is refused by line and field;
/// a list of text parts trains as their joined text.
#[test]
fn chat_content_is_text_or_text_parts() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer_dir();
    let prepare = |name: &str, lines: &[&str]| {
        let input = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&input, lines.join("\n")).unwrap();
        let out = dir.path().join(name);
        let o = snug(&[
            "prepare",
            "--format",
            "jsonl",
            "--input",
            input.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        (o, out)
    };
    let good = r#"{"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}"#;
    for (name, line, needle) in [
        (
            "null",
            r#"{"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": null}]}"#,
            "null.jsonl: line 2: `messages[1].content` is null, not a string",
        ),
        (
            "missing",
            r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "4"}]}"#,
            "missing.jsonl: line 2: `messages[0].content` is missing",
        ),
        (
            "image",
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}, {"role": "assistant", "content": "4"}]}"#,
            r#"image.jsonl: line 2: `messages[0].content[0]` is a part of type "image_url""#,
        ),
        (
            "role",
            r#"{"messages": [{"role": null, "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}"#,
            "role.jsonl: line 2: `messages[0].role` is null, not a string",
        ),
    ] {
        let (o, out) = prepare(name, &[good, line, good]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(needle), "{name}: {err}");
        assert!(!out.exists(), "{name}");
    }
    // Text parts are the same example as their joined text; "" is an empty turn.
    let parts = r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "2 + "}, {"type": "text", "text": "2?"}]}, {"role": "assistant", "content": "4"}]}"#;
    let empty =
        r#"{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "4"}]}"#;
    let files = |name: &str, lines: &[&str]| {
        let (o, out) = prepare(name, lines);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        ["train.bin", "val.bin"].map(|f| {
            let t = TokenFile::open(&out.join(f)).unwrap();
            (t.to_vec(), t.mask_to_vec())
        })
    };
    assert_eq!(
        files("parts", &[good, parts]),
        files("strings", &[good, good])
    );
    let [_, (ids, _)] = files("empty", &[good, empty]);
    let text = TokenFile::open(&dir.path().join("empty/val.bin"))
        .unwrap()
        .tokenizer()
        .decode(&ids);
    assert!(text.contains("<|im_start|>user\n<|im_end|>"), "{text}");
}

/// A tokenizer with no end-of-sequence token is refused before the corpus is read, naming the
/// `tokenizer_config.json` by its path (the error named the file alone, not whose it was).
#[test]
fn a_tokenizer_without_eos_names_its_config_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let mine = dir.path().join("ex").join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::copy(
        tokenizer_dir().join("tokenizer.json"),
        mine.join("tokenizer.json"),
    )
    .unwrap();
    let config_text = std::fs::read_to_string(tokenizer_dir().join("tokenizer_config.json"));
    let mut config: serde_json::Value = serde_json::from_str(&config_text.unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("eos_token");
    let config_path = mine.join("tokenizer_config.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let input = dir.path().join("data.jsonl");
    std::fs::write(&input, "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n").unwrap();
    let out = dir.path().join("prepared");
    let prepare = |tokenizer: &Path| {
        snug(&[
            "prepare",
            "--format",
            "jsonl",
            "--input",
            input.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
    };
    for tokenizer in [mine.join("tokenizer.json"), mine.clone()] {
        let o = prepare(&tokenizer);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{stderr}");
        for needle in [
            config_path.to_str().unwrap(),
            "has no `eos_token`",
            "end-of-sequence",
        ] {
            assert!(stderr.contains(needle), "{needle}: {stderr}");
        }
    }
    // Without the file at all, it is named as missing.
    std::fs::remove_file(&config_path).unwrap();
    let o = prepare(&mine);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains(config_path.to_str().unwrap()) && stderr.contains("is missing"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing was written");
}

/// A tokenizer whose EOS only `special_tokens_map.json` names (its `tokenizer_config.json`,
/// as transformers saved it before 4.34, has no `added_tokens_decoder`): transformers finds
/// the EOS there, and so does prepare.
#[test]
fn an_eos_in_special_tokens_map_json_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("old");
    std::fs::create_dir_all(&tok).unwrap();
    std::fs::copy(
        tokenizer_dir().join("tokenizer.json"),
        tok.join("tokenizer.json"),
    )
    .unwrap();
    let text = std::fs::read_to_string(tokenizer_dir().join("tokenizer_config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let c = config.as_object_mut().unwrap();
    c.remove("eos_token");
    c.remove("added_tokens_decoder");
    std::fs::write(tok.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        tok.join("special_tokens_map.json"),
        r#"{"eos_token": {"content": "<|im_end|>", "lstrip": false}}"#,
    )
    .unwrap();
    let input = dir.path().join("data.jsonl");
    std::fs::write(&input, "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n").unwrap();
    let out = dir.path().join("prepared");
    let o = snug(&[
        "prepare",
        "--format",
        "jsonl",
        "--input",
        input.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--val-fraction",
        "0.5",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let train = TokenFile::open(&out.join("train.bin")).unwrap();
    assert_eq!(train.to_vec().last(), Some(&2), "ends with <|im_end|>");
    assert_eq!(train.tokenizer().eos_id(), Some(2));
}

/// A split in which no token counts in the loss (its conversations have no assistant turn) is
/// written, with a warning for that split on stderr and in `--json`: `train` would refuse it.
#[test]
fn a_split_with_nothing_to_learn_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let asks = r#"{"messages": [{"role": "user", "content": "2 + 2?"}]}"#;
    let pc = r#"{"prompt": "Hello,", "completion": " world!"}"#;
    let prepare = |name: &str, lines: &[&str]| {
        let input = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&input, lines.join("\n")).unwrap();
        let out = dir.path().join(name);
        let o = snug(&[
            "prepare",
            "--format",
            "jsonl",
            "--input",
            input.to_str().unwrap(),
            "--tokenizer",
            tokenizer_dir().to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--val-fraction",
            "0.25",
            "--json",
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}: {stderr}");
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (report, stderr, out)
    };
    let (report, stderr, out) = prepare("none", &[asks, asks, asks, asks]);
    assert_eq!(report["loss_tokens"], 0);
    let warnings = report["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 2, "{report}");
    for (w, split, file) in [
        (&warnings[0], "training split", "train.bin"),
        (&warnings[1], "validation split", "val.bin"),
    ] {
        let w = w.as_str().unwrap();
        assert!(w.contains(split) && w.contains(file), "{w}");
        assert!(stderr.contains(&format!("warning: {w}")), "{stderr}");
    }
    assert!(out.join("train.bin").exists() && out.join("val.bin").exists());
    // Only the validation split (the last example) has nothing to learn.
    let (report, stderr, _) = prepare("val", &[pc, pc, pc, asks]);
    let warnings = report["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 1, "{report}");
    assert!(warnings[0].as_str().unwrap().contains("validation split"));
    assert_eq!(stderr.matches("warning:").count(), 1, "{stderr}");
    // Nothing to warn about: no `warnings` key, nothing on stderr.
    let (report, stderr, _) = prepare("fine", &[pc, pc, pc, pc]);
    assert!(report.get("warnings").is_none(), "{report}");
    assert!(!stderr.contains("warning"), "{stderr}");
}
