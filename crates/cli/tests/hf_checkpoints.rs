//! Hugging Face model directories wherever the CLI takes a checkpoint: `train --init-from`,
//! `sample --checkpoint`, `export --checkpoint`, `plan --hf-config`; and the directories it
//! refuses, with nothing written.

mod common;

use std::path::Path;
use std::process::Output;

use common::{fails_with, fixture, ok};
use safetensors::SafeTensors;

fn json(o: &Output) -> serde_json::Value {
    // One document, or one object per line (train) ending in the summary.
    let text = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(&text)
        .unwrap_or_else(|_| serde_json::from_str(text.lines().last().expect("a line")).unwrap())
}

/// A small English text whose words the fixture tokenizer knows.
fn write_text(path: &Path) {
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "hello",
    ];
    let text: Vec<&str> = (0..2000)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect();
    std::fs::write(path, text.join(" ")).unwrap();
}

/// Every tensor of a safetensors file as f32 values, by name.
fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{n}");
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (n, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// `train --init-from DIR` starts from the directory's weights (a run at a negligible
/// learning rate exports them back), encodes the text with its tokenizer, and the run and the
/// directory both sample; export writes the tokenizer's files beside the weights.
#[test]
fn train_sample_and_export_from_a_hugging_face_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    write_text(&cwd.join("text.txt"));
    let dir = fixture("llama_tied");
    let dir_s = dir.to_str().unwrap();
    let o = ok(
        cwd,
        &[
            "train",
            "--init-from",
            dir_s,
            "--data",
            "text.txt",
            "--steps",
            "3",
            "--batch",
            "2",
            "--block",
            "32",
            "--threads",
            "1",
            "--eval-every",
            "0",
            "--lr",
            "1e-9",
            "--min-lr",
            "0",
            "--weight-decay",
            "0",
            "--warmup-steps",
            "0",
            "--out",
            "run",
            "--json",
        ],
    );
    let summary = json(&o);
    assert_eq!(summary["parameters"], 28832);
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );

    let o = ok(
        cwd,
        &[
            "export",
            "--checkpoint",
            "run",
            "--out",
            "exported",
            "--json",
        ],
    );
    let report = json(&o);
    assert_eq!(report["tokenizer_files"].as_array().unwrap().len(), 2);
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(cwd.join("exported").join(file)).unwrap(),
            std::fs::read(dir.join(file)).unwrap(),
            "{file} written back as it was"
        );
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cwd.join("exported/config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["tie_word_embeddings"], true);
    // The token ids of the config.json the run started from, and an f32 setting written as
    // that file had it, not as the f64 nearest the f32.
    let original: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    for key in ["bos_token_id", "eos_token_id", "rms_norm_eps"] {
        assert_eq!(config[key], original[key], "{key}");
    }
    // And generation settings transformers reads, with the same ids.
    let generation: serde_json::Value = serde_json::from_slice(
        &std::fs::read(cwd.join("exported/generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (&generation["bos_token_id"], &generation["eos_token_id"]),
        (&original["bos_token_id"], &original["eos_token_id"])
    );
    // Three AdamW steps at lr 1e-9 move no weight by more than about 3e-9.
    let got = tensors(&cwd.join("exported/model.safetensors"));
    let want = tensors(&dir.join("model.safetensors"));
    assert_eq!(
        got.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        want.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        let worst = snug_testkit::worst(a.iter().zip(b).map(|(x, y)| (x - y).abs()));
        assert!(
            worst < 1e-6,
            "{name}: moved {worst} from the pretrained weights"
        );
    }

    for from in [dir_s, "run", "exported"] {
        let o = ok(
            cwd,
            &[
                "sample",
                "--checkpoint",
                from,
                "--prompt",
                "the cat",
                "--tokens",
                "6",
                "--temperature",
                "0",
                "--threads",
                "1",
                "--json",
            ],
        );
        let r = json(&o);
        assert_eq!(r["tokens"], 6, "{from}");
        assert_eq!(r["planned_peak_bytes"], r["measured_peak_bytes"], "{from}");
    }
    // The directory and its export are the same model: the same greedy text.
    let greedy = |from: &str| {
        let o = ok(
            cwd,
            &[
                "sample",
                "--checkpoint",
                from,
                "--prompt",
                "hello",
                "--tokens",
                "8",
                "--temperature",
                "0",
                "--threads",
                "1",
                "--json",
            ],
        );
        json(&o)["text"].clone()
    };
    ok(cwd, &["export", "--checkpoint", dir_s, "--out", "direct"]);
    assert_eq!(greedy(dir_s), greedy("direct"));

    // A sharded directory exports as one file, and a directory with no tokenizer cannot
    // encode a prompt.
    let sharded = fixture("llama_sharded");
    ok(
        cwd,
        &[
            "export",
            "--checkpoint",
            sharded.to_str().unwrap(),
            "--out",
            "joined",
        ],
    );
    assert_eq!(
        tensors(&cwd.join("joined/model.safetensors")),
        tensors(&fixture("llama").join("model.safetensors"))
    );
    fails_with(
        cwd,
        &["sample", "--checkpoint", "joined", "--prompt", "hi"],
        &["joined", "tokenizer.json"],
    );
}

/// `plan --hf-config` takes the directory as well as its config.json.
#[test]
fn plan_takes_a_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen2", "llama3_rope_scaling"] {
        let dir = fixture(name);
        let plan = |path: &Path| {
            let o = ok(
                tmp.path(),
                &[
                    "plan",
                    "--hf-config",
                    path.to_str().unwrap(),
                    "--batch",
                    "2",
                    "--block",
                    "16",
                    "--json",
                ],
            );
            json(&o)
        };
        let a = plan(&dir);
        let b = plan(&dir.join("config.json"));
        for key in ["model", "peak_bytes", "parameters", "breakdown"] {
            assert_eq!(a[key], b[key], "{name}: {key}");
        }
        assert!(a["peak_bytes"].as_u64().unwrap() > 0);
    }
}

fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// A refused configuration field, a truncated shard and a missing index entry each stop
/// `train`, `sample`, `export` and `plan` with an error naming the file and what is wrong,
/// before any run directory or export is written.
#[test]
fn bad_directories_are_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    write_text(&cwd.join("text.txt"));

    let gelu = cwd.join("gelu");
    copy_fixture("llama", &gelu);
    let config = gelu.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"silu\"", "\"gelu\"")).unwrap();

    let truncated = cwd.join("truncated");
    copy_fixture("llama_sharded", &truncated);
    let shard = truncated.join("model-00003-of-00003.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();

    let unlisted = cwd.join("unlisted");
    copy_fixture("llama_sharded", &unlisted);
    let index = unlisted.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.layers.1.mlp.up_proj.weight");
    std::fs::write(&index, v.to_string()).unwrap();

    let cases: [(&Path, &[&str]); 3] = [
        (
            &gelu,
            &["config.json", "hidden_act", "\"gelu\"", "not supported"],
        ),
        (
            &truncated,
            &["model-00003-of-00003.safetensors", "truncated"],
        ),
        (
            &unlisted,
            &[
                "model.safetensors.index.json",
                "model.layers.1.mlp.up_proj.weight",
                "no entry",
            ],
        ),
    ];
    for (dir, needles) in cases {
        let d = dir.to_str().unwrap();
        fails_with(
            cwd,
            &[
                "train",
                "--init-from",
                d,
                "--data",
                "text.txt",
                "--steps",
                "1",
                "--threads",
                "1",
                "--out",
                "run",
            ],
            needles,
        );
        assert!(!cwd.join("run").exists(), "{d}: a run directory was made");
        fails_with(
            cwd,
            &["sample", "--checkpoint", d, "--tokens", "2"],
            needles,
        );
        fails_with(cwd, &["export", "--checkpoint", d, "--out", "out"], needles);
        assert!(!cwd.join("out").exists(), "{d}: export wrote");
    }
    fails_with(
        cwd,
        &["plan", "--hf-config", gelu.to_str().unwrap()],
        &["hidden_act", "\"gelu\""],
    );
}

/// A model of a vast context (here 10^12 positions) samples a short request holding only the
/// caches the request fills, exactly as planned; a context beyond the machine is refused by
/// name before anything is allocated, and so is one beyond the model.
#[test]
fn a_long_context_model_samples_holding_only_the_request() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let dir = cwd.join("long");
    copy_fixture("llama", &dir);
    std::fs::copy(
        fixture("tokenizer").join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let long = text.replace(
        "\"max_position_embeddings\": 128",
        "\"max_position_embeddings\": 1000000000000",
    );
    assert_ne!(long, text);
    std::fs::write(&config, long).unwrap();
    let d = dir.to_str().unwrap();
    let sample = [
        "sample",
        "--checkpoint",
        d,
        "--prompt",
        "hello",
        "--tokens",
        "5",
    ];
    let common = ["--threads", "1", "--json"];
    let s = json(&ok(cwd, &[&sample[..], &common].concat()));
    let prompt = s["prompt_ids"].as_array().unwrap().len() as u64;
    assert_eq!(s["context"].as_u64(), Some(prompt + 5));
    assert_eq!(s["planned_peak_bytes"], s["measured_peak_bytes"]);
    // Weights of a few thousand parameters and caches of a few positions.
    assert!(s["planned_peak_bytes"].as_u64().unwrap() < 1 << 20, "{s}");
    // With the cache: planned, and refused against the machine. The whole window a token:
    // refused as the graph is built (its scores, 10^24 floats a head, cannot be counted).
    for (mode, needles) in [
        (
            &[][..],
            &[
                "context of 1000000000000 positions",
                "more than this machine has available",
            ][..],
        ),
        (
            &["--full-window"],
            &["1000000000000 positions", "beyond any machine's memory"],
        ),
    ] {
        fails_with(
            cwd,
            &[&sample[..], &common, mode, &["--context", "1000000000000"]].concat(),
            needles,
        );
    }
    fails_with(
        cwd,
        &[&sample[..], &common, &["--context", "1000000000001"]].concat(),
        &["--context 1000000000001", "1000000000000 positions"],
    );
}

/// A model directory without tokenizer.json samples with `--tokenizer`, exactly as it would
/// with that tokenizer beside it; one that does not cover the model's vocabulary is refused.
#[test]
fn a_directory_without_a_tokenizer_samples_with_one_given() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let bare = cwd.join("bare");
    copy_fixture("llama", &bare);
    assert!(!bare.join("tokenizer.json").exists());
    let beside = cwd.join("beside");
    copy_fixture("llama", &beside);
    let tokenizer = fixture("tokenizer").join("tokenizer.json");
    std::fs::copy(&tokenizer, beside.join("tokenizer.json")).unwrap();
    let t = tokenizer.to_str().unwrap();
    fn strs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let sample = |dir: &str, extra: &[&'static str]| -> Vec<String> {
        let mut a = vec![
            "sample",
            "--checkpoint",
            dir,
            "--prompt",
            "hello",
            "--tokens",
            "6",
        ];
        a.extend(["--seed", "3", "--threads", "1", "--json"]);
        a.extend(extra);
        a.into_iter().map(String::from).collect()
    };
    let bare_args = sample(bare.to_str().unwrap(), &[]);
    fails_with(
        cwd,
        &strs(&bare_args),
        &["bare: no tokenizer.json", "--tokenizer"],
    );
    let mut given = bare_args.clone();
    given.extend(["--tokenizer".to_string(), t.to_string()]);
    let with_flag = json(&ok(cwd, &strs(&given)));
    let with_file = json(&ok(cwd, &strs(&sample(beside.to_str().unwrap(), &[]))));
    for key in ["prompt_ids", "ids", "text"] {
        assert!(with_file.get(key).is_some(), "{key} in {with_file}");
        assert_eq!(with_flag[key], with_file[key], "{key}");
    }
    // GPT-2's 50,257 tokens index past this model's embedding.
    fails_with(
        cwd,
        &strs(&sample(bare.to_str().unwrap(), &["--tokenizer", "gpt2"])),
        &["--tokenizer gpt2"],
    );
}

/// `plan` and `fit` take `--init-from` and plan the run it starts, its text encoded with the
/// directory's tokenizer (plan = train, to the byte); token files prepared with another
/// tokenizer are refused, naming the model's, and those prepared with it train.
#[test]
fn init_from_plans_as_it_trains_and_refuses_data_of_another_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    write_text(&cwd.join("text.txt"));
    let dir = fixture("llama_tied");
    let d = dir.to_str().unwrap();
    let tok = dir.join("tokenizer.json");
    let step = [
        "--init-from",
        d,
        "--block",
        "16",
        "--batch",
        "2",
        "--threads",
        "1",
    ];
    let plan = json(&ok(
        cwd,
        &[&["plan"][..], &step, &["--data", "text.txt", "--json"]].concat(),
    ));
    let run = [
        &["train"][..],
        &step,
        &["--steps", "1", "--eval-every", "0", "--no-save", "--json"],
    ]
    .concat();
    let trained = json(&ok(cwd, &[&run[..], &["--data", "text.txt"]].concat()));
    assert_eq!(plan["peak_bytes"], trained["predicted_peak_bytes"]);
    assert_eq!(plan["peak_bytes"], trained["measured_peak_bytes"]);
    // fit plans the same step: at exactly that peak it keeps the configuration.
    let budget = plan["peak_bytes"].as_u64().unwrap().to_string();
    let fit = json(&ok(
        cwd,
        &[
            &["fit"][..],
            &step,
            &["--data", "text.txt", "--memory", &budget, "--json"],
        ]
        .concat(),
    ));
    let chosen = &fit["candidates"][fit["chosen"].as_u64().unwrap() as usize];
    assert_eq!(chosen["peak_bytes"], plan["peak_bytes"], "{fit}");
    assert_eq!(chosen["config"]["micro_batch"], 2, "{fit}");

    for (out, tokenizer) in [("chars", "char"), ("own", tok.to_str().unwrap())] {
        ok(
            cwd,
            &[
                "prepare",
                "--input",
                "text.txt",
                "--out",
                out,
                "--tokenizer",
                tokenizer,
            ],
        );
    }
    fails_with(
        cwd,
        &[&run[..], &["--data", "chars"]].concat(),
        &[
            "char tokenizer",
            "tokenizer.json",
            "snug prepare --tokenizer",
        ],
    );
    let own = json(&ok(cwd, &[&run[..], &["--data", "own"]].concat()));
    assert_eq!(own["predicted_peak_bytes"], own["measured_peak_bytes"]);
}

/// A run started from a model directory carries its model: once the directory has moved, the
/// run still samples, exports and resumes (it failed with the directory's "No such file").
#[test]
fn a_run_outlives_the_directory_it_started_from() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    write_text(&cwd.join("text.txt"));
    copy_fixture("llama_tied", &cwd.join("base"));
    let shape = [
        "--block",
        "16",
        "--batch",
        "2",
        "--threads",
        "1",
        "--eval-every",
        "0",
    ];
    let train = ["train", "--data", "text.txt", "--out", "run"];
    ok(
        cwd,
        &[&train[..], &shape, &["--init-from", "base", "--steps", "2"]].concat(),
    );
    std::fs::rename(cwd.join("base"), cwd.join("moved")).unwrap();
    ok(cwd, &["sample", "--checkpoint", "run", "--tokens", "3"]);
    ok(cwd, &["export", "--checkpoint", "run", "--out", "exported"]);
    assert_eq!(
        std::fs::read(cwd.join("exported/tokenizer.json")).unwrap(),
        std::fs::read(cwd.join("moved/tokenizer.json")).unwrap()
    );
    let resumed = json(&ok(
        cwd,
        &["train", "--resume", "run", "--steps", "3", "--json"],
    ));
    assert_eq!(resumed["steps"], 3);
    assert_eq!(
        resumed["predicted_peak_bytes"],
        resumed["measured_peak_bytes"]
    );
}

/// Pretrained weights with no tokenizer.json beside them cannot train on text: a character
/// tokenizer made from the text would give ids that mean other tokens to them. `train` and
/// `plan` refuse it by name; the built-in data (a toy whatever its ids) still trains.
#[test]
fn text_for_weights_without_their_tokenizer_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    write_text(&cwd.join("text.txt"));
    let llama = fixture("llama");
    assert!(!llama.join("tokenizer.json").exists());
    let d = llama.to_str().unwrap();
    let shape = ["--batch", "2", "--block", "16", "--threads", "1"];
    for command in [&["train", "--steps", "1"][..], &["plan"]] {
        fails_with(
            cwd,
            &[command, &["--init-from", d, "--data", "text.txt"], &shape].concat(),
            &[
                "has no tokenizer.json",
                "character tokenizer",
                "other tokens",
            ],
        );
    }
    assert!(!cwd.join("runs").exists());
    let train = ["train", "--init-from", d, "--steps", "1", "--no-save"];
    ok(cwd, &[&train[..], &shape].concat());
}

/// A model directory whose config.json was left behind is named as such by every command
/// that reads one, rather than taken for a run directory without checkpoints or a lone
/// weights file.
#[test]
fn weights_without_their_config_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("llama_tied").join(f), model.join(f)).unwrap();
    }
    let m = model.to_str().unwrap();
    let out = dir.path().join("out");
    for args in [
        &["sample", "--checkpoint", m, "--tokens", "2"][..],
        &["export", "--checkpoint", m, "--out", out.to_str().unwrap()],
        &["train", "--init-from", m, "--steps", "1", "--no-save"],
        &["plan", "--init-from", m],
    ] {
        fails_with(dir.path(), args, &["no config.json beside them"]);
    }
    assert!(!out.exists());
}

/// An export killed mid-write leaves its staging directory beside the output (its files as
/// large as the model's weights), or an earlier version's temporary file inside it; the next
/// export into that directory removes them, but never one of a process still running or one
/// written to within the hour.
#[cfg(target_os = "linux")]
#[test]
fn an_export_removes_what_a_killed_one_left() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let staging = |pid: u32| dir.path().join(format!(".snug-staging.out.{pid}.0"));
    let (stale_dir, live_dir, recent_dir) = (
        staging(4_000_000_000),
        staging(std::process::id()),
        staging(4_000_000_001),
    );
    for d in [&stale_dir, &live_dir, &recent_dir] {
        std::fs::create_dir(d).unwrap();
        let f = d.join("model.safetensors");
        std::fs::write(&f, b"partial").unwrap();
        if d != &recent_dir {
            common::untouched_for_two_hours(&f);
            common::untouched_for_two_hours(d);
        }
    }
    // PIDs stop below 2^22: 4,000,000,000 was never a process.
    let stale = out.join(".model.safetensors.4000000000.0.tmp");
    let live = out.join(format!(".model.safetensors.{}.0.tmp", std::process::id()));
    // A writer this machine cannot see (another container) keeps writing to its file.
    let recent = out.join(".model.safetensors.4000000001.0.tmp");
    let other = out.join(".model.safetensors.4000000000.0.tmp.keep");
    for f in [&stale, &live, &recent, &other] {
        std::fs::write(f, b"partial").unwrap();
        if f != &recent {
            common::untouched_for_two_hours(f);
        }
    }
    let from = fixture("llama_tied");
    ok(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            from.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--force",
        ],
    );
    assert!(out.join("model.safetensors").exists());
    assert!(!stale.exists() && !stale_dir.exists());
    assert!(live.exists() && recent.exists() && other.exists());
    assert!(live_dir.exists() && recent_dir.exists());
}

/// Export takes each token id from the model's config.json where it names it and from its
/// tokenizer where it does not, and keeps the directory's own generation settings.
#[test]
fn export_fills_token_ids_the_config_lacks_from_the_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let model = cwd.join("model");
    std::fs::create_dir(&model).unwrap();
    let from = fixture("llama_tied");
    for entry in std::fs::read_dir(&from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, model.join(path.file_name().unwrap())).unwrap();
    }
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let mut config = read(&model.join("config.json"));
    let eos = config.as_object_mut().unwrap().remove("eos_token_id");
    assert_eq!(eos, Some(serde_json::json!(2)));
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    ok(
        cwd,
        &["export", "--checkpoint", "model", "--out", "exported"],
    );
    let exported = read(&cwd.join("exported/config.json"));
    // bos and pad (null, as the config says) from the config; eos (`<|im_end|>`, 2) from
    // tokenizer_config.json.
    assert_eq!(exported["bos_token_id"], 1);
    assert_eq!(exported["eos_token_id"], 2);
    assert_eq!(exported.get("pad_token_id"), Some(&serde_json::Value::Null));
    assert_eq!(
        std::fs::read(cwd.join("exported/generation_config.json")).unwrap(),
        std::fs::read(from.join("generation_config.json")).unwrap()
    );
}

/// `special_tokens_map.json` goes out with the tokenizer it came with: a model directory's is
/// exported as it is (here beside a config with `added_tokens_decoder`, which transformers reads
/// instead), and is written, not removed as an earlier model's, by `--force` into that export;
/// a run keeps one where transformers reads it (a config without `added_tokens_decoder`) and
/// exports it byte for byte. A model without one still clears an earlier one away.
#[test]
fn special_tokens_map_json_is_exported_with_its_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let map = "{\n  \"bos_token\": \"<|im_start|>\",\n  \"eos_token\": \"<|im_end|>\"\n}\n";
    let model = cwd.join("model");
    copy_fixture("llama_tied", &model);
    std::fs::write(model.join("special_tokens_map.json"), map).unwrap();
    let read_map =
        |dir: &str| std::fs::read_to_string(cwd.join(dir).join("special_tokens_map.json"));
    let export = ["export", "--checkpoint", "model", "--out", "exported"];
    let report = json(&ok(cwd, &[&export[..], &["--json"]].concat()));
    assert_eq!(read_map("exported").unwrap(), map);
    assert!(
        report["tokenizer_files"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().ends_with("special_tokens_map.json")),
        "{report}"
    );
    ok(cwd, &[&export[..], &["--force"]].concat());
    assert_eq!(read_map("exported").unwrap(), map, "removed by --force");
    let bare = fixture("llama_tied");
    let bare = [
        "export",
        "--checkpoint",
        bare.to_str().unwrap(),
        "--out",
        "exported",
    ];
    ok(cwd, &[&bare[..], &["--force"]].concat());
    assert!(
        read_map("exported").is_err(),
        "an earlier model's map stayed"
    );

    // A config transformers reads the map beside: the run keeps it, and its export has it.
    let config = model.join("tokenizer_config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("added_tokens_decoder");
    std::fs::write(&config, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    write_text(&cwd.join("text.txt"));
    ok(
        cwd,
        &[
            "train",
            "--init-from",
            "model",
            "--data",
            "text.txt",
            "--steps",
            "1",
            "--block",
            "16",
            "--batch",
            "2",
            "--threads",
            "1",
            "--eval-every",
            "0",
            "--out",
            "run",
        ],
    );
    std::fs::remove_dir_all(&model).unwrap();
    ok(cwd, &["export", "--checkpoint", "run", "--out", "from-run"]);
    assert_eq!(read_map("from-run").unwrap(), map);
}
