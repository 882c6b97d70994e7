//! `snug sample --chat`: a conversation rendered through the tokenizer's chat template with the
//! generation prompt, generation that stops at the end of the model's turn, the prompt's and
//! the answer's ids in `--json`, and named errors for models that cannot chat and for messages
//! without a string role and content.

mod common;

use common::{fixture, snug};
use std::path::{Path, PathBuf};

fn ok(cwd: &Path, args: &[&str]) -> serde_json::Value {
    let o = snug(cwd, args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn fails_with(cwd: &Path, args: &[&str], needles: &[&str]) {
    let o = snug(cwd, args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` missing from: {err}");
    }
}

/// The fixture model `name` with the fixture tokenizer's files (all of them, or
/// `tokenizer.json` alone) in `to`.
fn model_dir(name: &str, to: &Path, with_template: bool) {
    std::fs::create_dir_all(to).unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixture(name))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.push(fixture("tokenizer").join("tokenizer.json"));
    if with_template {
        files.push(fixture("tokenizer").join("tokenizer_config.json"));
    }
    for p in files {
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// The fixture's transformers render of `messages` with the generation prompt.
fn expected_chat(messages: &serde_json::Value) -> (String, Vec<u64>) {
    let text = std::fs::read_to_string(fixture("tokenizer").join("expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let chat = expected["chat"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["add_generation_prompt"] == true && &c["messages"] == messages)
        .expect("the fixture renders this conversation");
    let ids = chat["ids"].as_array().unwrap();
    (
        chat["rendered"].as_str().unwrap().to_string(),
        ids.iter().map(|v| v.as_u64().unwrap()).collect(),
    )
}

#[test]
fn chat_renders_the_template_and_reports_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    model_dir("llama", &cwd.join("model"), true);
    let question = "What is 2 + 2?";
    let messages = serde_json::json!([{"role": "user", "content": question}]);
    let (rendered, ids) = expected_chat(&messages);
    let base = [
        "sample",
        "--checkpoint",
        "model",
        "--chat",
        "--temperature",
        "0",
        "--tokens",
        "40",
        "--threads",
        "1",
        "--json",
    ];
    let with = |extra: &[&str]| ok(cwd, &[&base[..], extra].concat());
    let a = with(&["--prompt", question]);
    assert_eq!(a["prompt"], rendered);
    let prompt_ids: Vec<u64> = a["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(prompt_ids, ids);
    // Ends with `<|im_start|>assistant\n`: the generation prompt.
    assert!(rendered.ends_with("<|im_start|>assistant\n"), "{rendered}");
    let answer: Vec<u64> = a["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(a["tokens"].as_u64(), Some(answer.len() as u64));
    // `<|im_end|>` (id 2) is the tokenizer's eos: it ends the turn, and only as the last id.
    let eot = 2;
    match a["end_of_turn"].as_bool() {
        Some(true) => {
            assert_eq!(answer.last(), Some(&eot));
            assert!(!answer[..answer.len() - 1].contains(&eot));
        }
        Some(false) => {
            assert_eq!(answer.len(), 40);
            assert!(!answer.contains(&eot));
        }
        None => panic!("--chat reports end_of_turn: {a}"),
    }

    // The same conversation from a file, as a list or under "messages"; the whole window
    // for every token gives the same answer.
    std::fs::write(cwd.join("list.json"), messages.to_string()).unwrap();
    let wrapped = serde_json::json!({ "messages": messages });
    std::fs::write(cwd.join("object.json"), wrapped.to_string()).unwrap();
    // Text parts are their joined text.
    let parts = serde_json::json!([{"role": "user", "content": [
        {"type": "text", "text": "What is "},
        {"type": "text", "text": "2 + 2?"},
    ]}]);
    std::fs::write(cwd.join("parts.json"), parts.to_string()).unwrap();
    for extra in [
        &["--messages", "list.json"][..],
        &["--messages", "object.json"],
        &["--messages", "parts.json"],
        &["--prompt", question, "--full-window"],
    ] {
        let b = with(extra);
        assert_eq!(b["prompt_ids"], a["prompt_ids"], "{extra:?}");
        assert_eq!(b["ids"], a["ids"], "{extra:?}");
        assert_eq!(b["text"], a["text"], "{extra:?}");
    }
    assert_eq!(
        with(&["--prompt", question, "--full-window"])["mode"],
        "full_window"
    );
    assert_eq!(a["mode"], "kv_cache");
}

#[test]
fn models_that_cannot_chat_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    model_dir("llama", &cwd.join("plain"), false);
    model_dir("llama", &cwd.join("model"), true);
    let chat = |dir: &'static str, extra: &[&'static str]| -> Vec<&'static str> {
        let mut v = vec!["sample", "--checkpoint", dir, "--chat", "--tokens", "3"];
        v.extend(extra);
        v
    };
    fails_with(
        cwd,
        &chat("plain", &["--prompt", "hi"]),
        &["no chat template"],
    );
    // A snug run with a character tokenizer.
    let train = [
        "train",
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--batch",
        "2",
        "--threads",
        "1",
        "--out",
        "run",
    ];
    assert!(snug(cwd, &train).status.success());
    fails_with(
        cwd,
        &chat("run", &["--prompt", "hi"]),
        &["char tokenizer", "no chat template"],
    );
    // A role the template refuses: its own message.
    std::fs::write(
        cwd.join("tool.json"),
        r#"[{"role": "tool", "content": "{}"}]"#,
    )
    .unwrap();
    fails_with(
        cwd,
        &chat("model", &["--messages", "tool.json"]),
        &["Unknown role: tool"],
    );
    // Files that hold no conversation, or messages without a string role and content.
    for (name, text, needle) in [
        ("empty.json", "[]", "no message"),
        (
            "norole.json",
            r#"[{"content": "x"}]"#,
            "`messages[0].role` is missing",
        ),
        (
            "nullrole.json",
            r#"[{"role": null, "content": "x"}]"#,
            "`messages[0].role` is null, not a string",
        ),
        // Content a template would render otherwise: "None", an empty turn, Python text.
        (
            "null.json",
            r#"{"messages": [{"role": "user", "content": null}]}"#,
            "`messages[0].content` is null, not a string",
        ),
        (
            "nocontent.json",
            r#"[{"role": "system", "content": "x"}, {"role": "user"}]"#,
            "`messages[1].content` is missing",
        ),
        (
            "number.json",
            r#"[{"role": "user", "content": 5}]"#,
            "`messages[0].content` is a number, not a string",
        ),
        (
            "image.json",
            r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]"#,
            r#"`messages[0].content[0]` is a part of type "image_url""#,
        ),
        ("bad.json", "{", "not JSON"),
        ("other.json", r#"{"turns": []}"#, "\"messages\""),
    ] {
        std::fs::write(cwd.join(name), text).unwrap();
        fails_with(cwd, &chat("model", &["--messages", name]), &[name, needle]);
    }
    // --messages belongs to --chat, and replaces --prompt.
    let o = snug(
        cwd,
        &[
            "sample",
            "--checkpoint",
            "model",
            "--messages",
            "empty.json",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let both = chat("model", &["--messages", "empty.json", "--prompt", "hi"]);
    assert_eq!(snug(cwd, &both).status.code(), Some(2));
}
