//! The Hugging Face tokenizer and the JSONL examples against the fixtures transformers made
//! (`crates/nn/tests/fixtures/hf/tokenizer`, written by `scripts/hf_fixtures/make_fixtures.py`).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use snug_train::examples::{parse_jsonl, tokenize_example, tokenize_jsonl};
use snug_train::token_file::TokenFile;
use snug_train::{
    Example, HfTokenizer, HfTokenizerFiles, PackedExamples, TokenizedExample, Tokenizer,
    TokenizerSpec, TrainError,
};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/tests/fixtures/hf/tokenizer")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn fixture() -> HfTokenizer {
    HfTokenizer::from_dir(&fixture_dir()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

fn files() -> HfTokenizerFiles {
    fixture().files().clone()
}

/// A tokenizer from the fixture's files with `config` (a JSON edit) as its config.
fn with_config(
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> Result<HfTokenizer, TrainError> {
    let mut f = files();
    let mut config: serde_json::Map<String, Value> =
        serde_json::from_str(f.tokenizer_config_json.as_deref().unwrap()).unwrap();
    edit(&mut config);
    f.tokenizer_config_json = Some(serde_json::to_string(&config).unwrap());
    HfTokenizer::from_files(f, Path::new("edited"))
}

fn check_encodings(t: &HfTokenizer) {
    let exp = expected();
    let encodings = exp["encodings"].as_array().unwrap();
    assert_eq!(encodings.len(), 12);
    for e in encodings {
        let text = e["text"].as_str().unwrap();
        let ids = ids_of(&e["ids"]);
        assert_eq!(t.encode(text, false).unwrap(), ids, "{text:?}");
        // `encode_add_special_tokens`: this tokenizer's post-processor adds nothing.
        assert_eq!(t.encode(text, true).unwrap(), ids, "{text:?}");
        let tokens: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
        let want: Vec<&str> = e["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        assert_eq!(tokens, want, "{text:?}");
        assert_eq!(t.decode(&ids, false), e["decoded"].as_str().unwrap());
        assert_eq!(
            t.decode(&ids, true),
            e["decoded_skip_special"].as_str().unwrap()
        );
    }
}

#[test]
fn ids_tokens_and_decoded_text_match_transformers() {
    check_encodings(&fixture());
}

/// Real SmolLM2 files store merges as `"a b"` strings, the fixture as pairs: both read the same.
#[test]
fn merges_as_strings_tokenize_identically() {
    let mut f = files();
    let mut json: Value = serde_json::from_str(&f.tokenizer_json).unwrap();
    let merges = json["model"]["merges"].as_array_mut().unwrap();
    assert!(merges[0].is_array());
    for m in merges.iter_mut() {
        let pair = m.as_array().unwrap();
        *m = Value::String(format!(
            "{} {}",
            pair[0].as_str().unwrap(),
            pair[1].as_str().unwrap()
        ));
    }
    f.tokenizer_json = serde_json::to_string(&json).unwrap();
    check_encodings(&HfTokenizer::from_files(f, Path::new("")).unwrap());
}

#[test]
fn special_tokens_and_vocabulary() {
    let t = fixture();
    let exp = expected();
    assert_eq!(t.vocab_size(), 320);
    let s = t.special_tokens();
    let pair = |tok: &Option<snug_train::hf_tokenizer::SpecialToken>| {
        tok.as_ref().map(|t| (t.text.clone(), t.id))
    };
    assert_eq!(pair(&s.bos), Some(("<|im_start|>".into(), 1)));
    assert_eq!(pair(&s.eos), Some(("<|im_end|>".into(), 2)));
    assert_eq!(pair(&s.pad), Some(("<|im_end|>".into(), 2)));
    assert_eq!(pair(&s.unk), Some(("<|endoftext|>".into(), 0)));
    assert_eq!(exp["special_tokens"]["<|im_end|>"], 2);
    let tok = Tokenizer::Hf(t);
    assert_eq!(
        (tok.name(), tok.vocab_size(), tok.eos_id()),
        ("hf", 320, Some(2))
    );
    // Ids outside the vocabulary decode to U+FFFD rather than vanishing.
    assert_eq!(tok.decode(&[42, 320, 71]), "H\u{FFFD}e");
    // The model's vocabulary may be larger (padded), never smaller.
    tok.check_model_vocab(320).unwrap();
    tok.check_model_vocab(384).unwrap();
    assert!(matches!(
        tok.check_model_vocab(319),
        Err(TrainError::VocabMismatch {
            tokenizer: 320,
            model: 319
        })
    ));
}

#[test]
fn chat_renders_and_ids_match_transformers() {
    let t = fixture();
    let exp = expected();
    let cases = exp["chat"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    let mut seen = std::collections::HashSet::new();
    for c in cases {
        let messages = c["messages"].as_array().unwrap();
        let agp = c["add_generation_prompt"].as_bool().unwrap();
        seen.insert((messages.len(), agp));
        let rendered = t.render_chat(messages, agp).unwrap();
        assert_eq!(rendered, c["rendered"].as_str().unwrap());
        assert_eq!(t.encode(&rendered, false).unwrap(), ids_of(&c["ids"]));
    }
    // Both conversations, with and without the generation prompt.
    assert_eq!(seen.len(), 4);
}

#[test]
fn a_template_that_raises_is_an_error_with_its_message() {
    let t = fixture();
    let exp = expected();
    let case = &exp["chat_error"];
    match t.render_chat(case["messages"].as_array().unwrap(), false) {
        Err(TrainError::ChatTemplate { path, message }) => {
            assert_eq!(message, case["error"].as_str().unwrap());
            assert_eq!(path, fixture_dir().join("tokenizer_config.json"));
        }
        other => panic!("expected a chat template error, got {other:?}"),
    }
}

#[test]
fn named_templates_take_default_and_chat_template_jinja_wins() {
    let msgs = [json!({"role": "user", "content": "hi"})];
    let want = fixture().render_chat(&msgs, true).unwrap();
    let listed = with_config(|c| {
        let t = c["chat_template"].clone();
        c["chat_template"] = json!([
            {"name": "tool_use", "template": "tools!"},
            {"name": "default", "template": t},
        ]);
    })
    .unwrap();
    assert_eq!(listed.render_chat(&msgs, true).unwrap(), want);
    let err = with_config(|c| c["chat_template"] = json!([{"name": "tool_use", "template": "x"}]))
        .unwrap_err();
    assert!(
        matches!(&err, TrainError::HfTokenizerFile { field: Some(f), .. } if f == "chat_template"),
        "{err}"
    );
    let mut f = files();
    f.chat_template_jinja = Some("{% for m in messages %}[{{ m.content }}]{% endfor %}".into());
    let t = HfTokenizer::from_files(f, Path::new("")).unwrap();
    assert_eq!(t.render_chat(&msgs, false).unwrap(), "[hi]");
}

#[test]
fn bad_files_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Missing tokenizer.json: an I/O error naming it.
    match HfTokenizer::from_dir(dir.path()) {
        Err(TrainError::Io { path, .. }) => assert_eq!(path, dir.path().join("tokenizer.json")),
        other => panic!("{other:?}"),
    }
    // Malformed tokenizer.json.
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    match HfTokenizer::from_dir(dir.path()) {
        Err(TrainError::HfTokenizerFile {
            path, field: None, ..
        }) => {
            assert_eq!(path, dir.path().join("tokenizer.json"))
        }
        other => panic!("{other:?}"),
    }
    // Malformed tokenizer_config.json beside a good tokenizer.json.
    std::fs::write(dir.path().join("tokenizer.json"), files().tokenizer_json).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let err = HfTokenizer::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, TrainError::HfTokenizerFile { path, .. } if *path == dir.path().join("tokenizer_config.json")),
        "{err}"
    );
    // Without a config: no special tokens, no template.
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    let bare = HfTokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    assert!(bare.special_tokens().eos.is_none() && !bare.has_chat_template());
    assert!(matches!(
        bare.render_chat(&[json!({"role": "user", "content": "x"})], false),
        Err(TrainError::HfTokenizerFile { field: Some(ref f), .. }) if f == "chat_template"
    ));
    // A special token outside the vocabulary, and a template that does not compile.
    let err = with_config(|c| c["eos_token"] = json!("<|nope|>")).unwrap_err();
    assert!(
        matches!(&err, TrainError::HfTokenizerFile { field: Some(f), .. } if f == "eos_token"),
        "{err}"
    );
    let err = with_config(|c| c["chat_template"] = json!("{% for m in messages %}")).unwrap_err();
    assert!(
        matches!(&err, TrainError::HfTokenizerFile { field: Some(f), .. } if f == "chat_template"),
        "{err}"
    );
    // An AddedToken object is read for its content.
    let t = with_config(|c| c["bos_token"] = json!({"content": "<|endoftext|>", "lstrip": false}))
        .unwrap();
    assert_eq!(t.special_tokens().bos.as_ref().map(|b| b.id), Some(0));
}

/// An edit of a `tokenizer_config.json`.
type ConfigEdit = dyn Fn(&mut serde_json::Map<String, Value>);

/// `special_tokens_map.json` as transformers 5.24 reads it (`AutoTokenizer.from_pretrained`
/// of the same files, `tokenizer_class` `PreTrainedTokenizerFast`, whose class names no
/// default tokens): only where `tokenizer_config.json` has no `added_tokens_decoder` or is
/// missing, and then each token it names replaces the config's, a null one included; a string
/// or an object with its `content`. The file is kept (in a token file's spec) only there.
#[test]
fn special_tokens_map_is_read_where_transformers_reads_it() {
    let base: serde_json::Map<String, Value> =
        serde_json::from_str(files().tokenizer_config_json.as_deref().unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let load = |name: &str, edit: Option<&ConfigEdit>, map: Value| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("tokenizer.json"), files().tokenizer_json).unwrap();
        if let Some(edit) = edit {
            let mut c = base.clone();
            c.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
            edit(&mut c);
            std::fs::write(
                d.join("tokenizer_config.json"),
                Value::Object(c).to_string(),
            )
            .unwrap();
        }
        std::fs::write(d.join("special_tokens_map.json"), map.to_string()).unwrap();
        HfTokenizer::from_dir(&d)
    };
    let texts = |t: &HfTokenizer| {
        let s = t.special_tokens();
        [&s.bos, &s.eos, &s.pad, &s.unk].map(|t| t.as_ref().map(|t| t.text.clone()))
    };
    let some = |s: &str| Some(s.to_string());
    // The config lacks the EOS: the map's fills it in, and the template sees it.
    let t = load(
        "fills",
        Some(&|c| {
            c.remove("added_tokens_decoder");
            c.remove("eos_token");
            c["chat_template"] = json!("{{ bos_token }}|{{ eos_token }}");
        }),
        json!({"eos_token": "<|im_end|>"}),
    )
    .unwrap();
    assert_eq!(
        texts(&t),
        [
            some("<|im_start|>"),
            some("<|im_end|>"),
            some("<|im_end|>"),
            some("<|endoftext|>")
        ]
    );
    assert_eq!(Tokenizer::Hf(t.clone()).eos_id(), Some(2));
    let user = [json!({"role": "user", "content": "x"})];
    assert_eq!(
        t.render_chat(&user, false).unwrap(),
        "<|im_start|>|<|im_end|>"
    );
    // It travels in the spec, and rebuilds the same tokens.
    assert!(t.files().special_tokens_map_json.is_some());
    let spec = serde_json::to_string(&Tokenizer::Hf(t.clone()).to_spec()).unwrap();
    let back = Tokenizer::from_spec(&serde_json::from_str(&spec).unwrap()).unwrap();
    assert_eq!(back.eos_id(), Some(2));
    // Its tokens replace the config's, as an object or null.
    let t = load(
        "replaces",
        Some(&|c| {
            c.remove("added_tokens_decoder");
        }),
        json!({"eos_token": {"content": "<|endoftext|>", "lstrip": false}, "pad_token": null}),
    )
    .unwrap();
    assert_eq!(
        texts(&t),
        [
            some("<|im_start|>"),
            some("<|endoftext|>"),
            None,
            some("<|endoftext|>")
        ]
    );
    // A config with `added_tokens_decoder` (transformers 4.34 and later): not read, not kept.
    let t = load(
        "ignored",
        Some(&|c| {
            c.remove("eos_token");
        }),
        json!({"eos_token": "<|im_end|>"}),
    )
    .unwrap();
    assert_eq!(t.special_tokens().eos, None);
    assert_eq!(t.files().special_tokens_map_json, None);
    // No config at all.
    let t = load(
        "alone",
        None,
        json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
    )
    .unwrap();
    assert_eq!(
        texts(&t),
        [some("<|im_start|>"), some("<|im_end|>"), None, None]
    );
    // A bad map is named.
    let missing = |c: &mut serde_json::Map<String, Value>| {
        c.remove("added_tokens_decoder");
    };
    let err = load("outside", Some(&missing), json!({"eos_token": "<|nope|>"})).unwrap_err();
    assert!(
        matches!(&err, TrainError::HfTokenizerFile { path, field: Some(f), .. }
            if f == "eos_token" && path.ends_with("special_tokens_map.json")),
        "{err}"
    );
    let err = load("list", Some(&missing), json!(["<|im_end|>"])).unwrap_err();
    assert!(err.to_string().contains("special_tokens_map.json"), "{err}");
}

#[test]
fn the_spec_rebuilds_the_same_tokenizer_and_survives_a_token_file() {
    let tok = Tokenizer::Hf(fixture());
    let spec = tok.to_spec();
    let json = serde_json::to_string(&spec).unwrap();
    assert!(
        json.starts_with(r#"{"kind":"hf","tokenizer_json":"#),
        "{}",
        &json[..40]
    );
    // No special_tokens_map.json beside it: the spec is what it was before snug read one,
    // and one written then reads back.
    assert!(!json.contains("special_tokens_map_json"));
    let back: TokenizerSpec = serde_json::from_str(&json).unwrap();
    let rebuilt = Tokenizer::from_spec(&back).unwrap();
    assert_eq!(rebuilt, tok);
    let Tokenizer::Hf(hf) = &rebuilt else {
        panic!()
    };
    assert_eq!(
        hf.files().tokenizer_json,
        std::fs::read_to_string(fixture_dir().join("tokenizer.json")).unwrap()
    );
    assert!(hf.has_chat_template());
    check_encodings(hf);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.bin");
    let ids = tok.encode("Hello, world!").unwrap();
    let mask: Vec<bool> = (0..ids.len()).map(|i| i % 3 == 1).collect();
    TokenFile::write_masked(&path, &tok, &ids, &mask).unwrap();
    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.tokenizer(), &tok);
    assert_eq!((f.to_vec(), f.mask_to_vec()), (ids, mask));
}

// ---- examples -------------------------------------------------------------------------------

fn hf() -> Tokenizer {
    Tokenizer::Hf(fixture())
}

/// `"Hello, world!"` (the fixture's ids) then `<|im_end|>` = 2; every target but the first.
#[test]
fn text_example_counts_every_target_but_its_first() {
    let ex = tokenize_example(&hf(), &Example::Text("Hello, world!".into())).unwrap();
    assert_eq!(ex.ids, [42, 71, 78, 78, 81, 14, 318, 81, 84, 78, 70, 3, 2]);
    let mut mask = vec![true; 13];
    mask[0] = false;
    assert_eq!(ex.mask, mask);
}

/// `"Hello,"` = 42 71 78 78 81 14 and `" world!"` = 318 81 84 78 70 3 (the fixture's tokens of
/// `"Hello, world!"`), tokenized apart: the prompt's six count for nothing.
#[test]
fn prompt_completion_counts_the_completion_and_its_eos() {
    let ex = tokenize_example(
        &hf(),
        &Example::PromptCompletion {
            prompt: "Hello,".into(),
            completion: " world!".into(),
        },
    )
    .unwrap();
    assert_eq!(ex.ids, [42, 71, 78, 78, 81, 14, 318, 81, 84, 78, 70, 3, 2]);
    let mask: Vec<bool> = (0..13).map(|i| i >= 6).collect();
    assert_eq!(ex.mask, mask);
    // An empty prompt: the completion's first token has nothing before it.
    let ex = tokenize_example(
        &hf(),
        &Example::PromptCompletion {
            prompt: String::new(),
            completion: "Hi".into(),
        },
    )
    .unwrap();
    assert!(!ex.mask[0]);
    assert!(ex.mask[1..].iter().all(|&m| m));
}

/// The fixture's second conversation: its one assistant turn, `"Paris.<|im_end|>\n"`, is ids
/// 53..60 of transformers' 84 (50 279 75 85 16 2 201). The rendering ends with `<|im_end|>`
/// (the EOS) and a line break, so no other EOS follows (`<|im_end|>\n<|im_end|>` was appended
/// before, which neither transformers nor TRL has).
#[test]
fn chat_example_counts_the_assistant_turn_only() {
    let exp = expected();
    let case = &exp["chat"][2];
    assert_eq!(case["add_generation_prompt"], false);
    let messages = case["messages"].as_array().unwrap().clone();
    let ex = tokenize_example(&hf(), &Example::Messages(messages)).unwrap();
    let ids = ids_of(&case["ids"]);
    assert_eq!(ids.len(), 84);
    assert_eq!(ex.ids, ids);
    let mask: Vec<bool> = (0..84).map(|i| (53..60).contains(&i)).collect();
    assert_eq!(ex.mask, mask);
    assert_eq!(&ex.ids[53..60], [50, 279, 75, 85, 16, 2, 201]);
    let Tokenizer::Hf(t) = hf() else { panic!() };
    assert_eq!(t.decode(&ex.ids[53..60], false), "Paris.<|im_end|>\n");

    // Two assistant turns both count; the user's turn between them does not.
    let msgs = vec![
        json!({"role": "user", "content": "a"}),
        json!({"role": "assistant", "content": "b"}),
        json!({"role": "user", "content": "c"}),
        json!({"role": "assistant", "content": "d"}),
    ];
    let ex = tokenize_example(&hf(), &Example::Messages(msgs)).unwrap();
    let counted: Vec<u32> = ex
        .ids
        .iter()
        .zip(&ex.mask)
        .filter(|(_, &m)| m)
        .map(|(&i, _)| i)
        .collect();
    assert_eq!(t.decode(&counted, false), "b<|im_end|>\nd<|im_end|>\n");
}

/// A template that ends an assistant turn one way when it is the last message and another
/// way when more follow: its end-of-turn here cannot be told, so the line is refused, naming
/// the message and why, not guessed. So is one that renders a content twice.
#[test]
fn a_turn_that_cannot_be_located_is_refused_with_the_reason() {
    let msgs = vec![
        json!({"role": "user", "content": "a"}),
        json!({"role": "assistant", "content": "b"}),
        json!({"role": "user", "content": "c"}),
    ];
    let refused = |template: &str| {
        let t = with_config(|c| c["chat_template"] = json!(template)).unwrap();
        tokenize_example(&Tokenizer::Hf(t), &Example::Messages(msgs.clone()))
            .unwrap_err()
            .to_string()
    };
    let err = refused(
        "{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}({{ m.content }}){% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
    );
    for needle in [
        "assistant message 1 cannot be located",
        "prefix",
        r#"ends it with "]" where it is the last message, but with ")" here"#,
        "end-of-turn",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let err = refused(
        "{{ messages | length }}{% for m in messages %}<{{ m.content }}|{{ m.content }}>{% endfor %}",
    );
    assert!(
        err.contains("assistant message 1") && err.contains("renders its content 2 times"),
        "{err}"
    );
}

/// The decoded text of `ex`'s counted tokens.
fn counted(t: &HfTokenizer, ex: &TokenizedExample) -> String {
    let ids: Vec<u32> = ex
        .ids
        .iter()
        .zip(&ex.mask)
        .filter(|(_, &m)| m)
        .map(|(&i, _)| i)
        .collect();
    t.decode(&ids, false)
}

/// Mistral-7B-Instruct-v0.3's chat template without its tool branches: the system message goes
/// into the last user turn, so no earlier turn renders as a prefix.
const MISTRAL_V03: &str = include_str!("../../nn/tests/fixtures/hf/mistral_v03.jinja");

/// transformers 5.24 with the fixture tokenizer and Mistral v0.3's template, its assistant
/// line wrapped in `{% generation %}` (`" " + content|trim + eos_token`) for
/// `return_assistant_tokens_mask`: the system message sits in the last user turn, and each
/// answer counts as its text and `<|im_end|>` (the fixture's EOS). snug finds the first answer
/// with content markers (prefixes do not hold for it) and the second by prefixes.
#[test]
fn mistral_v03_with_a_system_message_counts_each_answer_and_its_end() {
    let t = with_config(|c| c["chat_template"] = json!(MISTRAL_V03)).unwrap();
    let msgs = vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "2 + 2?"}),
        json!({"role": "assistant", "content": "4"}),
        json!({"role": "user", "content": "And 3 + 3?"}),
        json!({"role": "assistant", "content": " 6. "}),
    ];
    let ex = tokenize_example(&Tokenizer::Hf(t.clone()), &Example::Messages(msgs)).unwrap();
    let hf_ids = [
        1, 61, 43, 48, 53, 54, 63, 313, 223, 13, 313, 33, 61, 17, 43, 48, 53, 54, 63, 315, 2, 61,
        43, 48, 53, 54, 63, 223, 35, 80, 70, 314, 223, 13, 314, 33, 61, 17, 43, 48, 53, 54, 63,
        223, 24, 16, 2,
    ];
    let hf_mask = "00000000000000000001100000000000000000000001111";
    // The rendering ends with the EOS: nothing appended.
    assert_eq!(ex.ids, hf_ids);
    let mask: String = ex.mask.iter().map(|&m| if m { '1' } else { '0' }).collect();
    assert_eq!(mask, hf_mask);
    assert_eq!(counted(&t, &ex), " 4<|im_end|> 6.<|im_end|>");
}

/// A conversation that starts with an assistant turn: before it there is no conversation to
/// render (a template reading `messages[0]` fails on none; transformers refuses an empty one),
/// so it is found by its content. transformers 5.24's `assistant_masks` with the template's
/// assistant text and `<|im_end|>\n` in `{% generation %}`.
#[test]
fn a_conversation_may_start_with_the_assistant() {
    let template = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}{{- message.content + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}";
    let msgs = vec![
        json!({"role": "assistant", "content": "Hello."}),
        json!({"role": "user", "content": "Hi!"}),
        json!({"role": "assistant", "content": "Bye."}),
    ];
    let hf_ids = [
        1, 85, 91, 268, 71, 79, 201, 59, 81, 87, 223, 279, 71, 284, 261, 270, 91, 261, 71, 268,
        285, 81, 297, 78, 16, 2, 201, 1, 67, 85, 85, 75, 268, 263, 86, 201, 42, 71, 78, 78, 81, 16,
        2, 201, 1, 87, 85, 264, 201, 42, 75, 3, 2, 201, 1, 67, 85, 85, 75, 268, 263, 86, 201, 36,
        91, 71, 16, 2, 201,
    ];
    let hf_mask = "000000000000000000000000000000000000111111110000000000000000000111111";
    let t = with_config(|c| c["chat_template"] = json!(template)).unwrap();
    // The template cannot render an empty conversation: prefixes cannot start.
    assert!(t.render_chat(&[], true).is_err());
    let ex = tokenize_example(&Tokenizer::Hf(t.clone()), &Example::Messages(msgs.clone())).unwrap();
    assert_eq!(ex.ids, hf_ids);
    let mask: String = ex.mask.iter().map(|&m| if m { '1' } else { '0' }).collect();
    assert_eq!(mask, hf_mask);
    assert_eq!(counted(&t, &ex), "Hello.<|im_end|>\nBye.<|im_end|>\n");
    // The fixture's own template renders an empty conversation as the generation prompt
    // alone, which is no prefix of its default system turn: found by content too.
    let ex = tokenize_example(&hf(), &Example::Messages(msgs)).unwrap();
    assert_eq!(
        counted(&fixture(), &ex),
        "Hello.<|im_end|>\nBye.<|im_end|>\n"
    );
}

/// Templates that look ahead (the number of messages, the last message, `loop.last`) render
/// no earlier turn as a prefix; each turn is found by its content and counts as ChatML's
/// prefixes would count it.
#[test]
fn templates_that_look_ahead_are_located() {
    let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let msgs = vec![
        json!({"role": "user", "content": "a"}),
        json!({"role": "assistant", "content": "b"}),
        json!({"role": "user", "content": "c"}),
        json!({"role": "assistant", "content": "d"}),
        json!({"role": "user", "content": "e"}),
    ];
    for head in [
        "{{ messages | length }} messages\n",
        "{% if messages[-1].role == 'user' %}(asks){% endif %}",
        "{% for m in messages %}{% if loop.last %}{{ loop.length }}{% endif %}{% endfor %}",
    ] {
        let t = with_config(|c| c["chat_template"] = json!(format!("{head}{chatml}"))).unwrap();
        let ex = tokenize_example(&Tokenizer::Hf(t.clone()), &Example::Messages(msgs.clone()))
            .unwrap_or_else(|e| panic!("{head}: {e}"));
        assert_eq!(counted(&t, &ex), "b<|im_end|>\nd<|im_end|>\n", "{head}");
        assert_eq!(
            ex.ids,
            t.encode(&t.render_chat(&msgs, false).unwrap(), false)
                .unwrap()
        );
    }
}

/// EOS follows a chat unless its rendering ends with EOS, whitespace after it allowed.
#[test]
fn a_chat_gets_an_eos_unless_the_template_ended_it_with_one() {
    let msgs = vec![
        json!({"role": "user", "content": "hi"}),
        json!({"role": "assistant", "content": "yo"}),
    ];
    // EOS `<|endoftext|>` (0), the rendering ends `<|im_end|>\n`: appended, and not counted.
    let Tokenizer::Hf(t) = chatml_characters() else {
        unreachable!()
    };
    let ex = tokenize_example(&Tokenizer::Hf(t.clone()), &Example::Messages(msgs.clone())).unwrap();
    assert_eq!(
        ex.ids[ex.ids.len() - 3..],
        [2, t.encode("\n", false).unwrap()[0], 0]
    );
    assert_eq!(ex.mask[ex.mask.len() - 3..], [true, true, false]);
    // EOS `<|im_end|>` (2): the rendering's own ends the example.
    let ex = tokenize_example(&hf(), &Example::Messages(msgs.clone())).unwrap();
    assert_eq!(ex.ids[ex.ids.len() - 2..], [2, 201]);
    assert_eq!(counted(&fixture(), &ex), "yo<|im_end|>\n");
    // So does a user turn's.
    let mut asks = msgs;
    asks.push(json!({"role": "user", "content": "bye"}));
    let ex = tokenize_example(&hf(), &Example::Messages(asks)).unwrap();
    assert_eq!(ex.ids[ex.ids.len() - 2..], [2, 201]);
    assert_eq!(counted(&fixture(), &ex), "yo<|im_end|>\n");
}

#[test]
fn packing_keeps_boundaries_and_masks_predictions_across_them() {
    let a = TokenizedExample {
        ids: vec![5, 6, 2],
        mask: vec![false, true, true],
    };
    let b = TokenizedExample {
        ids: vec![7, 8, 9, 2],
        mask: vec![true, false, true, true],
    };
    let p = PackedExamples::pack([a.clone(), TokenizedExample::default(), b, a]);
    assert_eq!(p.ids, [5, 6, 2, 7, 8, 9, 2, 5, 6, 2]);
    assert_eq!(p.starts, [0, 3, 7]);
    // 7 would be predicted from the previous example's EOS: 0, whatever its example said.
    assert_eq!(
        p.mask,
        [false, true, true, false, false, true, true, false, true, true]
    );
    assert_eq!(p.loss_tokens(), 6);
    // 30% of 10 tokens: the boundary nearest to 7 tokens of training data is 7.
    let (train, val) = p.clone().split(0.3).unwrap();
    assert_eq!((train.ids.len(), train.starts.clone()), (7, vec![0, 3]));
    assert_eq!(
        (val.ids, val.mask, val.starts),
        (vec![5, 6, 2], vec![false, true, true], vec![0])
    );
    // At least one example on each side, and none to split with one example.
    let (train, val) = p.clone().split(0.99).unwrap();
    assert_eq!((train.starts.len(), val.starts.len()), (1, 2));
    assert!(PackedExamples::pack([TokenizedExample {
        ids: vec![1],
        mask: vec![true]
    }])
    .split(0.5)
    .is_none());
}

#[test]
fn jsonl_of_all_three_shapes_packs_into_one_stream() {
    let path = Path::new("data.jsonl");
    let text = concat!(
        r#"{"text": "Hello, world!", "id": 7}"#,
        "\n\n",
        r#"{"prompt": "Hello,", "completion": " world!"}"#,
        "\n",
        r#"{"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}"#,
        "\n"
    );
    let parsed = parse_jsonl(path, text).unwrap();
    assert_eq!(
        parsed.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
        [1, 3, 4]
    );
    let p = tokenize_jsonl(path, text, &hf()).unwrap();
    let singles: Vec<TokenizedExample> = parsed
        .iter()
        .map(|(_, e)| tokenize_example(&hf(), e).unwrap())
        .collect();
    assert_eq!(p.starts, [0, 13, 26]);
    assert_eq!(p, PackedExamples::pack(singles));
    // The chat ends as its template ends it: `<|im_end|>` (the EOS) and a line break.
    assert!(p.ids[12] == 2 && p.ids[25] == 2 && p.ids[p.len() - 2..] == [2, 201]);
}

#[test]
fn malformed_jsonl_lines_are_named_by_number() {
    let path = Path::new("bad.jsonl");
    let good = r#"{"text": "ok"}"#;
    let cases = [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (r#"{"id": 1}"#, "none of"),
        (r#"{"text": 3}"#, "`text` is a number"),
        (r#"{"prompt": "p"}"#, "`completion` is missing"),
        (r#"{"text": "t", "messages": []}"#, "mixes"),
        (r#"{"messages": []}"#, "empty"),
        (
            r#"{"messages": [{"content": "x"}]}"#,
            "`messages[0].role` is missing",
        ),
        (r#"{"messages": ["x"]}"#, "not an object"),
        (
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            "`messages[0].content` is a number",
        ),
    ];
    for (line, want) in cases {
        let text = format!("{good}\n\n{good}\n{line}\n{good}\n");
        match parse_jsonl(path, &text) {
            Err(TrainError::JsonlLine {
                path: p,
                line: 4,
                detail,
            }) => {
                assert_eq!(p, path);
                assert!(detail.contains(want), "{line}: {detail}");
            }
            other => panic!("{line}: {other:?}"),
        }
    }
    // A byte-order mark before the first line is not part of its JSON.
    let parsed = parse_jsonl(path, &format!("\u{feff}{good}\n{good}\n")).unwrap();
    assert_eq!(
        parsed,
        parse_jsonl(path, &format!("{good}\n{good}\n")).unwrap()
    );
    // A chat the template refuses: the line and the template's message.
    let text = format!(
        "{good}\n{}\n",
        r#"{"messages": [{"role": "tool", "content": "{}"}]}"#
    );
    match tokenize_jsonl(path, &text, &hf()) {
        Err(TrainError::JsonlExample {
            line: 2, problem, ..
        }) => match *problem {
            TrainError::ChatTemplate { message, .. } => assert_eq!(message, "Unknown role: tool"),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    // Chat needs a Hugging Face tokenizer; GPT-2 handles the other shapes.
    let chat = r#"{"messages": [{"role": "user", "content": "x"}]}"#;
    assert!(matches!(
        tokenize_jsonl(path, chat, &Tokenizer::gpt2()),
        Err(TrainError::JsonlExample { line: 1, .. })
    ));
    let p = tokenize_jsonl(path, good, &Tokenizer::gpt2()).unwrap();
    assert_eq!(p.ids, [482, 50256]);
}

/// `snug prepare` encodes a long corpus in pieces cut at line ends; through the public API the
/// ids are exactly those of one call.
#[test]
fn a_long_text_encodes_in_pieces_to_the_ids_of_one_call() {
    let t = fixture();
    assert_eq!(t.whole_text_reason(), None);
    let stanza = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\r\n  \n\tYou are all resolved rather to die than to famish?<|im_end|>\n";
    let text = stanza.repeat(700_000 / stanza.len());
    let whole = t.encode_with_offsets(&text, false).unwrap().0;
    assert_eq!(t.encode(&text, false).unwrap(), whole);
}

/// The mark `snug prepare` puts in a token file's tokenizer spec reads back for every kind of
/// tokenizer, leaving the tokenizer as it was; a file without one has none.
#[test]
fn a_prepare_mark_reads_back_beside_every_kind_of_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizers = [
        Tokenizer::Hf(fixture()),
        Tokenizer::gpt2(),
        Tokenizer::Char(snug_train::CharTokenizer::from_text("abc")),
    ];
    for (i, tok) in tokenizers.iter().enumerate() {
        let path = dir.path().join(format!("t{i}.bin"));
        TokenFile::stage(&path, tok, &[0, 1, 2], None, Some("p-1"))
            .unwrap()
            .commit()
            .unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.prepared(), Some("p-1"), "{}", tok.name());
        assert_eq!(f.tokenizer().to_spec(), tok.to_spec());
        // A reader of the spec alone (an older snug's) passes over the mark.
        let bytes = std::fs::read(&path).unwrap();
        let len = u32::from_le_bytes(bytes[21..25].try_into().unwrap()) as usize;
        let spec: TokenizerSpec = serde_json::from_slice(&bytes[25..25 + len]).unwrap();
        assert_eq!(spec, tok.to_spec());
        TokenFile::write(&path, tok, &[0, 1, 2]).unwrap();
        assert_eq!(TokenFile::open(&path).unwrap().prepared(), None);
    }
}

/// A character-level WordLevel tokenizer with no unknown token and ChatML's markers as added
/// special tokens: text outside its characters does not encode at all.
fn chatml_characters() -> Tokenizer {
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
                    {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    Tokenizer::Hf(characters_with_template(template))
}

/// [`chatml_characters`]'s tokenizer with another chat template.
fn characters_with_template(template: &str) -> HfTokenizer {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
    {
        vocab.insert(t.to_string(), json!(i));
    }
    for c in "abcdefghijklmnopqrstuvwxyz ,.!?\n".chars() {
        let id = vocab.len();
        vocab.insert(c.to_string(), json!(id));
    }
    let added: Vec<Value> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(id, t)| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated",
                          "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<missing>"}
    });
    let config = json!({"eos_token": "<|endoftext|>", "chat_template": template});
    let files = HfTokenizerFiles {
        tokenizer_json: tokenizer.to_string(),
        tokenizer_config_json: Some(config.to_string()),
        chat_template_jinja: None,
        special_tokens_map_json: None,
    };
    HfTokenizer::from_files(files, Path::new("chatml-characters")).unwrap()
}

/// The end-of-turn markers a chat prompt stops on are looked up in the tokenizer: one it
/// cannot encode (here `<|eot_id|>`, with no unknown token) is simply not its own, and the
/// prompt encodes as the template renders it.
#[test]
fn a_chat_prompt_encodes_with_a_tokenizer_that_has_no_unknown_token() {
    let t = chatml_characters();
    let messages = [json!({"role": "user", "content": "hi"})];
    let chat = snug_train::chat_prompt(&t, &messages).unwrap();
    assert_eq!(
        chat.text,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(chat.ids, t.encode(&chat.text).unwrap());
    assert_eq!(chat.ids[0], 1);
    // `<|endoftext|>` (its EOS) and `<|im_end|>`: the markers it has.
    assert_eq!(chat.stop, [0, 2]);
    // Text it cannot encode is still an error.
    let bad = [json!({"role": "user", "content": "HI"})];
    assert!(snug_train::chat_prompt(&t, &bad).is_err());
}

/// As transformers renders them (4.46 and 5.24 alike): objects keep their keys in the order
/// written, in `tojson` and `items()`, and a message's null field is left out (an assistant
/// turn of tool calls has `"content": null`), not printed as `None`.
#[test]
fn templates_see_keys_in_order_and_no_null_fields() {
    let t = characters_with_template(
        "{{ messages[0] | tojson }}|{% for k, v in messages[0].items() %}{{ k }}={{ v }};\
         {% endfor %}|{{ {\"b\": 1, \"a\": 2} | tojson }}|{% for m in messages %}\
         [{{ m.content }}{% if m.content is defined %}+{% endif %}]{% endfor %}",
    );
    let messages: Vec<Value> = serde_json::from_str(
        r#"[{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]"#,
    )
    .unwrap();
    // transformers' `apply_chat_template(messages, tokenize=False)` of the same template.
    assert_eq!(
        t.render_chat(&messages, false).unwrap(),
        r#"{"role": "user", "content": "hi"}|role=user;content=hi;|{"b": 1, "a": 2}|[hi+][]"#
    );
}

/// transformers' `{% generation %}` blocks (assistant-token marks) render their body, with
/// the tags' whitespace control, as transformers renders them.
#[test]
fn generation_blocks_render_as_transformers_renders_them() {
    let t = characters_with_template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == \"assistant\" %}\
         {% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}\
         {{ m.content }}<|im_end|>{% endif %}\n{%- generation -%}  {%- endgeneration %}\n\
         {% endfor %}",
    );
    let messages = [
        json!({"role": "user", "content": "hi"}),
        json!({"role": "assistant", "content": "yo"}),
    ];
    // transformers' `apply_chat_template(messages, tokenize=False)` of the same template.
    assert_eq!(
        t.render_chat(&messages, false).unwrap(),
        "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nyo<|im_end|>"
    );
}

/// Template features transformers 5.24 gives and snug now matches: `tojson`'s `sort_keys`,
/// `ensure_ascii` and `separators` (Python's `json.dumps`), `str.rsplit`, and `tools` and
/// `documents` defined as none. The expected text is transformers'
/// `apply_chat_template(messages, tokenize=False)` of the same template.
#[test]
fn tojson_options_rsplit_and_tools_render_as_transformers_renders_them() {
    let template = concat!(
        "{% set v = {'b': [1, 'é😀'], 'a': {'d': none, 'c': true}} %}",
        "{{ v | tojson(sort_keys=true) }}|{{ v | tojson(ensure_ascii=true) }}|",
        "{{ v | tojson(separators=(',', ':')) }}|",
        "{{ v | tojson(indent=1, sort_keys=true, separators=(',', ' = ')) }}|",
        "{{ '  a b  c '.rsplit() | join('/') }};{{ '  a b  c '.rsplit(none, 1) | join('/') }};",
        "{{ 'a,b,,c'.rsplit(',') | join('/') }};{{ 'a,b,,c'.rsplit(',', 2) | join('/') }};",
        "{{ 'x</think>y</think>z'.rsplit('</think>', 1)[-1] }};",
        "{{ ''.rsplit() | length }}{{ ''.rsplit(',') | length }};",
        "{{ 'a b'.rsplit(maxsplit=0) | join('/') }};",
        "{{ 'a\u{3000}b c'.rsplit(sep=none, maxsplit=1) | join('/') }}|",
        "{% if tools is defined and tools is none and documents is defined and documents is none %}none{% endif %}",
    );
    let t = with_config(|c| c["chat_template"] = json!(template)).unwrap();
    let rendered = t
        .render_chat(&[json!({"role": "user", "content": "hi"})], false)
        .unwrap();
    let want = concat!(
        r#"{"a": {"c": true, "d": null}, "b": [1, "é😀"]}|"#,
        r#"{"b": [1, "\u00e9\ud83d\ude00"], "a": {"d": null, "c": true}}|"#,
        r#"{"b":[1,"é😀"],"a":{"d":null,"c":true}}|"#,
        "{\n \"a\" = {\n  \"c\" = true,\n  \"d\" = null\n },\n \"b\" = [\n  1,\n  \"é😀\"\n ]\n}|",
        "a/b/c;  a b/c;a/b//c;a,b//c;z;01;a b;a\u{3000}b/c|none",
    );
    assert_eq!(rendered, want);
}
