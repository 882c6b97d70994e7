//! `snug sample` generating as transformers' `generate` does from a Hugging Face model
//! directory: it stops at every end-of-sequence id of the model's generation_config.json (or
//! config.json) and the tokenizer's, with or without --chat, unless --ignore-eos; a plain
//! prompt gets the tokenizer's BOS once, an empty one starts from the BOS; generation_config.json
//! gives the sampling defaults a flag does not; --top-p is checked by name; a prompt longer than
//! the context is cut with a warning. A snug run of a character vocabulary samples as before.

mod common;

use std::path::Path;

use common::{fails_with, fixture, snug};
use safetensors::SafeTensors;
use serde_json::Value;

/// The fixture Llama (vocabulary 320, 128 positions) with the fixture tokenizer (`<|im_end|>`,
/// id 2, its eos; `<|endoftext|>` id 0; `<|im_start|>` id 1 its bos) in `to`.
fn model_dir(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for (dir, file) in [
        ("llama", "config.json"),
        ("llama", "model.safetensors"),
        ("llama", "generation_config.json"),
        ("tokenizer", "tokenizer.json"),
        ("tokenizer", "tokenizer_config.json"),
    ] {
        std::fs::copy(fixture(dir).join(file), to.join(file)).unwrap();
    }
}

/// Rewrites the JSON file at `path` with `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// `snug sample --json --threads 1 args` in `cwd`, which must succeed: its report and stderr.
fn sample(cwd: &Path, args: &[&str]) -> (Value, String) {
    let all = [&["sample", "--json", "--threads", "1"][..], args].concat();
    let o = snug(cwd, &all);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{all:?}: {err}");
    (serde_json::from_slice(&o.stdout).unwrap(), err)
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("a list of ids: {v}"))
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect()
}

/// Makes `dir`'s model likely to emit `eos` where it made `ids[k]`: the LM head's row of
/// `eos` becomes 1.5 times that token's row, so `eos` wins wherever that token led with a
/// positive logit (at step `k` at the latest).
fn bias_towards(dir: &Path, eos: usize, ids: &[u64], k: usize) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let (_, shape, data) = tensors
        .iter_mut()
        .find(|t| t.0 == "lm_head.weight")
        .expect("an untied LM head");
    let width = shape[1] * 4;
    let from = ids[k] as usize * width;
    let row: Vec<u8> = data[from..from + width]
        .chunks_exact(4)
        .flat_map(|b| (f32::from_le_bytes(b.try_into().unwrap()) * 1.5).to_le_bytes())
        .collect();
    data[eos * width..(eos + 1) * width].copy_from_slice(&row);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (n.clone(), view)
        })
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// `dir`'s greedy answer to `args` run to its end (--ignore-eos), made to emit `eos` by step
/// `k` at the latest: returns the biased model's whole answer and where `eos` first is in it.
fn biased_answer(cwd: &Path, dir: &str, args: &[&str], eos: u64, k: usize) -> (Vec<u64>, usize) {
    let raw = [args, &["--ignore-eos"]].concat();
    let base = ids(&sample(cwd, &raw).0["ids"]);
    assert!(!base[..=k].contains(&eos), "{base:?}");
    bias_towards(&cwd.join(dir), eos as usize, &base, k);
    let (biased, _) = sample(cwd, &raw);
    assert_eq!(biased["finish_reason"], "length");
    assert_eq!(biased["stop_ids"], serde_json::json!([]));
    let biased = ids(&biased["ids"]);
    let at = biased
        .iter()
        .position(|&t| t == eos)
        .expect("the bias made the eos");
    assert!(at <= k, "{biased:?}");
    assert_eq!(biased[..at], base[..at]);
    (biased, at)
}

/// A second end-of-sequence id of generation_config.json's list (Llama 3's `<|eom_id|>` or
/// `<|end_of_text|>` beside the tokenizer's `<|eot_id|>`) ends a plain generation, which
/// transformers' `generate` stops at; config.json's list where there is no
/// generation_config.json; --ignore-eos runs on.
#[test]
fn generation_stops_at_every_eos_id_of_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let dir = cwd.join("model");
    model_dir(&dir);
    // `<|endoftext|>` (0) is an eos id of the model, not the tokenizer's eos (2).
    edit_json(&dir.join("generation_config.json"), |g| {
        g.insert("eos_token_id".into(), serde_json::json!([2, 0]));
    });
    let args = [
        "--checkpoint",
        "model",
        "--prompt",
        "hello",
        "--tokens",
        "12",
        "--temperature",
        "0",
    ];
    let (whole, at) = biased_answer(cwd, "model", &args, 0, 4);
    let (r, err) = sample(cwd, &args);
    assert_eq!(ids(&r["ids"]), whole[..=at], "stops right after the eos id");
    assert_eq!(r["tokens"], at as u64 + 1);
    assert_eq!(r["finish_reason"], "stop");
    assert_eq!(r["stop_token_id"], 0);
    assert_eq!(r["stop_token"], "<|endoftext|>");
    assert_eq!(ids(&r["stop_ids"]), [2, 0]);
    assert!(r.get("end_of_turn").is_none(), "only with --chat: {r}");
    // The text leaves the stop token out: the text of the tokens before it.
    let at_s = at.to_string();
    let shorter = [
        &args[..5],
        &[at_s.as_str(), "--temperature", "0", "--ignore-eos"],
    ]
    .concat();
    assert_eq!(r["text"], sample(cwd, &shorter).0["text"]);
    assert!(!r["text"].as_str().unwrap().contains("<|endoftext|>"));
    assert!(err.is_empty(), "{err}");
    // Without --json: the prompt and the text, and on stderr the token that stopped it.
    let o = snug(cwd, &[&["sample", "--threads", "1"][..], &args].concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("stopped at \"<|endoftext|>\" (0)"), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        out.trim_end(),
        format!("hello{}", r["text"].as_str().unwrap())
    );

    // Without generation_config.json: config.json's eos_token_id, one id.
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();
    edit_json(&dir.join("config.json"), |c| {
        c.insert("eos_token_id".into(), 0.into());
    });
    let (r, _) = sample(cwd, &args);
    assert_eq!(ids(&r["ids"]), whole[..=at]);
    assert_eq!(ids(&r["stop_ids"]), [0, 2]);
    assert_eq!(r["finish_reason"], "stop");
}

/// --chat stops at the model's eos ids too, not only at the tokenizer's eos and the known
/// end-of-turn tokens.
#[test]
fn chat_stops_at_the_models_eos_ids_too() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let dir = cwd.join("model");
    model_dir(&dir);
    edit_json(&dir.join("generation_config.json"), |g| {
        g.insert("eos_token_id".into(), serde_json::json!([0, 2]));
    });
    let args = [
        "--checkpoint",
        "model",
        "--chat",
        "--prompt",
        "hello",
        "--tokens",
        "12",
    ];
    let (whole, at) = biased_answer(cwd, "model", &args, 0, 3);
    let (r, _) = sample(cwd, &args);
    assert_eq!(ids(&r["ids"]), whole[..=at]);
    assert_eq!(r["end_of_turn"], true);
    assert_eq!(r["finish_reason"], "stop");
    assert_eq!(r["stop_token_id"], 0);
    // The model's ids, the tokenizer's eos (`<|im_end|>`, also the model's) and the template's
    // end-of-turn token, once each.
    assert_eq!(ids(&r["stop_ids"]), [0, 2]);
    let (raw, _) = sample(cwd, &[&args[..], &["--ignore-eos"]].concat());
    assert_eq!(raw["end_of_turn"], false);
    assert_eq!(raw["tokens"], 12);
}

/// The tokenizer whose post-processor puts `<|im_start|>` (1) first, as Llama's puts
/// `<|begin_of_text|>`.
fn add_bos_post_processor(dir: &Path) {
    edit_json(&dir.join("tokenizer.json"), |t| {
        t.insert(
            "post_processor".into(),
            serde_json::json!({
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}
                ],
                "pair": [
                    {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}
                ],
                "special_tokens": {
                    "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
                }
            }),
        );
    });
}

/// A plain prompt is encoded as transformers' `tokenizer(prompt)` encodes it, the BOS its
/// post-processor adds first, but one the prompt already begins with is not doubled; an empty
/// prompt starts from the BOS (as `generate` does without input), and one without any BOS to
/// start from is refused by name. A chat prompt is the template's alone.
#[test]
fn a_plain_prompt_gets_the_tokenizers_bos_once() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    model_dir(&cwd.join("plain"));
    model_dir(&cwd.join("bos"));
    add_bos_post_processor(&cwd.join("bos"));
    let run = |dir: &str, extra: &[&str]| {
        let args = [&["--checkpoint", dir, "--tokens", "3"][..], extra].concat();
        sample(cwd, &args)
    };
    let (plain, _) = run("plain", &["--prompt", "hello"]);
    let text_ids = ids(&plain["prompt_ids"]);
    assert_ne!(text_ids[0], 1);
    let (bos, err) = run("bos", &["--prompt", "hello"]);
    assert_eq!(ids(&bos["prompt_ids"]), [&[1], &text_ids[..]].concat());
    assert!(!err.contains("kept once"), "{err}");
    // Typed at the start: once, and said so.
    let (typed, err) = run("bos", &["--prompt", "<|im_start|>hello"]);
    assert_eq!(typed["prompt_ids"], bos["prompt_ids"]);
    assert!(
        err.contains("begins with <|im_start|>") && err.contains("kept once"),
        "{err}"
    );
    // Empty: the BOS alone, from the post-processor, or from config.json's bos_token_id.
    for dir in ["bos", "plain"] {
        let (empty, _) = run(dir, &["--prompt", ""]);
        assert_eq!(ids(&empty["prompt_ids"]), [1], "{dir}");
        assert_eq!(empty["tokens"], 3);
    }
    // A chat prompt is the template's text without special tokens added.
    let chat = |dir| run(dir, &["--chat", "--prompt", "hello"]).0["prompt_ids"].clone();
    assert_eq!(chat("bos"), chat("plain"));

    // Neither the model nor the tokenizer names a BOS: an empty prompt is refused.
    let none = cwd.join("plain");
    for file in ["config.json", "generation_config.json"] {
        edit_json(&none.join(file), |c| {
            c.remove("bos_token_id");
        });
    }
    edit_json(&none.join("tokenizer_config.json"), |c| {
        c.remove("bos_token");
    });
    let sample_none = |extra: &[&str]| -> Vec<String> {
        let base = ["sample", "--checkpoint", "plain", "--tokens", "3"];
        [&base[..], extra]
            .concat()
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let args = sample_none(&["--prompt", ""]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(
        cwd,
        &args,
        &["--prompt is empty", "beginning-of-sequence", "bos_token"],
    );
    let args = sample_none(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(cwd, &args, &["no --prompt", "give --prompt"]);
}

/// generation_config.json's `do_sample`, `temperature`, `top_k` and `top_p` are the defaults of
/// flags not given, as in transformers (no `do_sample`: greedy; sampling without a `top_k`:
/// 50); a flag overrides its setting; without the file, greedy as transformers' `generate`
/// (said in `--json`), unless a sampling flag asks to sample.
#[test]
fn generation_config_sets_the_sampling_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let dir = cwd.join("model");
    model_dir(&dir);
    let run = |extra: &[&str]| {
        let args = [
            &[
                "--checkpoint",
                "model",
                "--prompt",
                "the cat",
                "--tokens",
                "10",
            ][..],
            extra,
        ]
        .concat();
        sample(cwd, &args).0
    };
    let drawn = |r: &Value| {
        (
            r["temperature"].as_f64().unwrap(),
            r["top_k"].as_u64(),
            r["top_p"].as_f64(),
        )
    };
    // The fixture's generation_config.json names no do_sample: greedy.
    let greedy = run(&["--temperature", "0"]);
    let default = run(&[]);
    assert_eq!(drawn(&default), (0.0, None, None));
    assert_eq!(default["ids"], greedy["ids"]);
    assert!(default["generation_config"]
        .as_str()
        .unwrap()
        .ends_with("generation_config.json"));
    assert!(greedy.get("generation_config").is_none(), "{greedy}");

    edit_json(&dir.join("generation_config.json"), |g| {
        g.insert("do_sample".into(), true.into());
        g.insert("temperature".into(), 0.7.into());
        g.insert("top_p".into(), 0.9.into());
    });
    let warm = run(&["--seed", "3"]);
    let (t, k, p) = drawn(&warm);
    assert!(
        (t - 0.7).abs() < 1e-6 && (p.unwrap() - 0.9).abs() < 1e-6,
        "{warm}"
    );
    assert_eq!(k, Some(50), "transformers' top_k while sampling");
    assert_eq!(warm["ids"], run(&["--seed", "3"])["ids"], "seeded");
    // Flags override it: the same draws given as flags, greedy at --temperature 0.
    let flags = ["--temperature", "0.7", "--top-k", "50", "--top-p", "0.9"];
    let given = run(&[&flags[..], &["--seed", "3"]].concat());
    assert_eq!(given["ids"], warm["ids"]);
    assert!(given.get("generation_config").is_none(), "{given}");
    assert_eq!(run(&["--temperature", "0"])["ids"], greedy["ids"]);
    let all = run(&["--top-k", "0", "--top-p", "1"]);
    assert_eq!((drawn(&all).1, drawn(&all).2), (None, None));

    assert_eq!(default["greedy_without_generation_config"], false);

    // Without generation_config.json: greedy, as transformers' `generate` (do_sample false),
    // and said so; the same tokens as --temperature 0.
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();
    let bare = run(&[]);
    assert_eq!(drawn(&bare), (0.0, None, None), "{bare}");
    assert_eq!(bare["greedy_without_generation_config"], true, "{bare}");
    assert_eq!(bare["ids"], greedy["ids"]);
    assert!(bare.get("generation_config").is_none());
    // A sampling flag asks to sample: snug's 0.8 with it, no top-k.
    let asked = run(&["--top-p", "0.9"]);
    let (t, k, p) = drawn(&asked);
    assert!(
        (t - 0.8).abs() < 1e-6 && k.is_none() && (p.unwrap() - 0.9).abs() < 1e-6,
        "{asked}"
    );
    assert_eq!(asked["greedy_without_generation_config"], false, "{asked}");
    let given = run(&["--temperature", "0.5"]);
    assert!((drawn(&given).0 - 0.5).abs() < 1e-6, "{given}");
    assert_eq!(given["greedy_without_generation_config"], false);
}

/// --top-p outside (0, 1] is refused by name before anything loads; a tiny one keeps only the
/// most likely token (greedy), 1 draws as without it.
#[test]
fn top_p_is_checked_by_name_and_narrows_the_draw() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    model_dir(&cwd.join("model"));
    for bad in ["0", "1.5", "-0.5", "nan", "NaN", "inf"] {
        fails_with(
            cwd,
            &["sample", "--checkpoint", "model", "--top-p", bad],
            &["--top-p", "(0, 1]"],
        );
    }
    let run = |extra: &[&str]| {
        let args = [
            &[
                "--checkpoint",
                "model",
                "--prompt",
                "the cat",
                "--tokens",
                "10",
            ][..],
            extra,
        ]
        .concat();
        sample(cwd, &args).0["ids"].clone()
    };
    let warm = ["--temperature", "1.5", "--top-k", "0", "--seed", "7"];
    let greedy = run(&["--temperature", "0"]);
    assert_eq!(run(&[&warm[..], &["--top-p", "0.000001"]].concat()), greedy);
    assert_eq!(run(&[&warm[..], &["--top-p", "1"]].concat()), run(&warm));
    assert_ne!(run(&warm), greedy, "the seed samples away from greedy here");
}

/// A prompt longer than the context loses its first tokens with a warning naming how many,
/// and --json says so.
#[test]
fn a_prompt_longer_than_the_context_is_cut_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    model_dir(&cwd.join("model"));
    let long = "the cat sat on a mat ".repeat(40);
    let (r, err) = sample(
        cwd,
        &["--checkpoint", "model", "--prompt", &long, "--tokens", "2"],
    );
    let n = ids(&r["prompt_ids"]).len();
    assert!(n > 128, "{n} tokens");
    assert_eq!(r["context"], 128);
    assert_eq!(r["prompt_tokens_dropped"], n as u64 - 128);
    let needle = format!("its first {} tokens are dropped", n - 128);
    assert!(err.contains("warning") && err.contains(&needle), "{err}");
    assert!(
        err.contains("the model's context of 128 positions"),
        "{err}"
    );
    // Below the model's: --context names the limit.
    let (r, err) = sample(
        cwd,
        &[
            "--checkpoint",
            "model",
            "--prompt",
            "the cat sat on a mat",
            "--context",
            "4",
        ],
    );
    let n = ids(&r["prompt_ids"]).len();
    assert_eq!(r["prompt_tokens_dropped"], n as u64 - 4);
    assert!(err.contains("--context 4"), "{err}");
    // One that fits: nothing dropped, no warning.
    let (r, err) = sample(cwd, &["--checkpoint", "model", "--prompt", "the cat"]);
    assert_eq!(r["prompt_tokens_dropped"], 0);
    assert!(!err.contains("warning"), "{err}");
}

/// A snug run of a character vocabulary has no end-of-sequence token: it never stops early,
/// and an empty prompt starts from token 0 as before.
#[test]
fn a_character_run_samples_as_before() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
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
    let (r, _) = sample(
        cwd,
        &["--checkpoint", "run", "--prompt", "", "--tokens", "6"],
    );
    assert_eq!(r["prompt_ids"], serde_json::json!([]));
    assert_eq!(r["stop_ids"], serde_json::json!([]));
    assert_eq!(r["tokens"], 6);
    assert_eq!(r["finish_reason"], "length");
    assert!((r["temperature"].as_f64().unwrap() - 0.8).abs() < 1e-6);
    assert_eq!(r["greedy_without_generation_config"], false);
    // The built-in demo: a held-out sum, answered greedily.
    let (r, _) = sample(cwd, &["--checkpoint", "run", "--tokens", "4"]);
    assert_eq!(r["temperature"], 0.0);
    assert!(r["prompt"].as_str().unwrap().ends_with('='), "{r}");
}
