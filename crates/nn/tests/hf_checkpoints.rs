//! Hugging Face checkpoints of every architecture snug imports, against the logits
//! `transformers` computed for them (`tests/fixtures/hf`, made by
//! `scripts/hf_fixtures/make_fixtures.py`): loading, the forward pass on the CPU backend,
//! export and import again, and checkpoints that do not match their configuration.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};
use serde_json::Value;
use snug_cpu::CpuSession;
use snug_graph::ops::Rope;
use snug_nn::{HfCheckpoint, ModelConfig, NnError};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

/// Every fixture checkpoint.
const FIXTURES: [&str; 8] = [
    "gpt2",
    "llama",
    "llama3_rope_scaling",
    "llama_tied",
    "mistral",
    "qwen2",
    "llama_bf16",
    "llama_sharded",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn expected(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The logits `[batch · seq, vocab]` of `ckpt`'s model for `ids` (`batch` rows of `seq`),
/// computed by the CPU backend on the model's inference graph.
fn logits(ckpt: &HfCheckpoint, ids: &[Vec<i32>]) -> Vec<f32> {
    let (batch, seq) = (ids.len(), ids[0].len());
    let model = ckpt.config();
    let g = model.build_inference(batch, seq, 1).unwrap();
    let memory_plan = plan(&g.graph, &PlanOptions::default()).unwrap();
    let mut session = CpuSession::new(g.graph, memory_plan, Allocator::default(), 1).unwrap();
    for (name, id) in &g.params {
        session.write_f32(*id, &ckpt.read(name).unwrap()).unwrap();
    }
    let flat: Vec<i32> = ids.concat();
    session
        .write_i32(g.tokens, &flat, model.vocab_size())
        .unwrap();
    session.run(ExecCtx::default()).unwrap();
    session.read_f32(g.logits).unwrap().into_owned()
}

fn input_ids(e: &Value) -> Vec<Vec<i32>> {
    e["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap() as i32)
                .collect()
        })
        .collect()
}

/// The logits of every architecture (GPT-2, Llama untied and tied, Llama 3 rope scaling,
/// Mistral, Qwen2 with q/k/v biases, bf16 and sharded files) are within 1e-5 of
/// transformers'.
#[test]
fn logits_match_transformers_for_every_architecture() {
    for name in FIXTURES {
        let e = expected(name);
        let ckpt = HfCheckpoint::open(&fixture(name)).unwrap();
        let got = logits(&ckpt, &input_ids(&e));
        let want = floats(&e["logits"]["data"]);
        assert_eq!(got.len(), want.len(), "{name}");
        let worst = snug_testkit::worst(got.iter().zip(&want).map(|(a, b)| (a - b).abs()));
        assert!(worst <= 1e-5, "{name}: max |snug − transformers| = {worst}");
    }
}

/// transformers 5's spelling (`rope_parameters`, `dtype`) reads as the same model as
/// transformers 4's (`rope_theta`, `rope_scaling`, `torch_dtype`).
#[test]
fn both_config_spellings_read_the_same_model() {
    for name in FIXTURES {
        let dir = fixture(name);
        let v4 = ModelConfig::from_hf_file(&dir.join("config.json")).unwrap();
        let v5 = ModelConfig::from_hf_file(&dir.join("config.transformers5.json")).unwrap();
        assert_eq!(v4, v5, "{name}");
        assert_eq!(
            ModelConfig::from_hf_file(&dir).unwrap(),
            v4,
            "{name}: the directory"
        );
    }
}

/// The rotary frequencies snug's kernel uses (Llama 3's scaling included) are transformers'.
#[test]
fn rope_frequencies_match_transformers() {
    for name in FIXTURES.iter().filter(|n| **n != "gpt2") {
        let e = expected(name);
        let ModelConfig::Llama(c) = HfCheckpoint::open(&fixture(name)).unwrap().config().clone()
        else {
            panic!("{name} is a Llama")
        };
        let rope = Rope {
            scaling: c.rope_scaling,
            ..Rope::new(c.n_head, c.head_dim(), c.rope_theta)
        };
        for (i, want) in floats(&e["rope_inv_freq"]).into_iter().enumerate() {
            let got = rope.inv_freq(i);
            let rel = ((got - want as f64) / want as f64).abs();
            assert!(rel < 1e-6, "{name} frequency {i}: {got} against {want}");
        }
    }
}

fn all_parameters(ckpt: &HfCheckpoint) -> Vec<(String, Vec<f32>)> {
    ckpt.parameter_shapes()
        .into_iter()
        .map(|(name, _)| {
            let v = ckpt.read(&name).unwrap();
            (name, v)
        })
        .collect()
}

fn bits(params: &[(String, Vec<f32>)]) -> Vec<(String, Vec<u32>)> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// Three shards hold `llama`'s weights bit for bit; the bf16 file holds them rounded to bf16.
#[test]
fn sharded_and_bf16_files_hold_the_same_weights() {
    let llama = all_parameters(&HfCheckpoint::open(&fixture("llama")).unwrap());
    let sharded = HfCheckpoint::open(&fixture("llama_sharded")).unwrap();
    assert_eq!(sharded.files().len(), 3);
    assert_eq!(bits(&all_parameters(&sharded)), bits(&llama));
    let bf16 = all_parameters(&HfCheckpoint::open(&fixture("llama_bf16")).unwrap());
    let rounded: Vec<(String, Vec<f32>)> = llama
        .iter()
        .map(|(n, v)| {
            let r = v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            (n.clone(), r)
        })
        .collect();
    assert_eq!(bits(&bf16), bits(&rounded));
    assert_ne!(
        bits(&bf16),
        bits(&llama),
        "bf16 rounding changed some weight"
    );
}

/// A tensor of a file as raw bytes.
#[derive(Clone)]
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn read_raw(path: &Path) -> Vec<(String, Raw)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Raw)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let raw = Raw {
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data: v.data().to_vec(),
            };
            (name, raw)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write_raw(path: &Path, tensors: Vec<(String, Raw)>) {
    std::fs::write(path, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

/// Export then import gives every parameter back bit for bit, for every architecture. For
/// the f32 fixtures the exported file holds exactly the tensors transformers saved (names,
/// shapes and bytes; GPT-2's without the `transformer.` prefix, as the `gpt2` repository).
#[test]
fn export_then_import_is_bit_exact_for_every_architecture() {
    for name in FIXTURES {
        let src = HfCheckpoint::open(&fixture(name)).unwrap();
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("export");
        let read = |n: &str, o: &mut [f32]| src.read_into(n, o);
        let report = snug_nn::save_hf_model(&dir, src.config(), &read).unwrap();
        assert_eq!(report.weights, dir.join("model.safetensors"));
        let back = HfCheckpoint::open(&dir).unwrap();
        assert_eq!(back.config(), src.config(), "{name}");
        assert_eq!(
            bits(&all_parameters(&back)),
            bits(&all_parameters(&src)),
            "{name}"
        );
        if name == "llama_bf16" || name == "llama_sharded" {
            continue;
        }
        let exported = read_raw(&report.weights);
        let original: Vec<(String, Raw)> = read_raw(&fixture(name).join("model.safetensors"))
            .into_iter()
            .map(|(n, r)| (n.trim_start_matches("transformer.").to_string(), r))
            .collect();
        assert_eq!(exported.len(), original.len(), "{name}");
        for ((n1, a), (n2, b)) in exported.iter().zip(&original) {
            assert_eq!(n1, n2, "{name}");
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{name}: {n1}");
            assert!(a.data == b.data, "{name}: {n1} differs");
        }
    }
}

/// A copy of fixture `name` in a temporary directory, to damage.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn open_err(dir: &Path) -> NnError {
    HfCheckpoint::open(dir).unwrap_err()
}

fn path_of(p: &Path) -> String {
    p.display().to_string()
}

/// Tensors that do not match the configuration, by name, shape and dtype: each an error of
/// its kind naming the file and the tensor.
#[test]
fn tensors_that_do_not_match_the_config_are_named() {
    let tmp = copy_fixture("llama");
    let file = tmp.path().join("model.safetensors");
    let good = read_raw(&file);

    // A tensor under another name: unexpected.
    let mut t = good.clone();
    let i = t
        .iter()
        .position(|(n, _)| n == "model.layers.1.mlp.up_proj.weight")
        .unwrap();
    t[i].0 = "model.layers.1.mlp.upper_proj.weight".into();
    write_raw(&file, t);
    assert_eq!(
        open_err(tmp.path()),
        NnError::UnexpectedTensor {
            path: path_of(&file),
            name: "model.layers.1.mlp.upper_proj.weight".into()
        }
    );

    // A tensor missing.
    let mut t = good.clone();
    t.retain(|(n, _)| n != "model.norm.weight");
    write_raw(&file, t);
    assert_eq!(
        open_err(tmp.path()),
        NnError::MissingTensor {
            path: path_of(&file),
            name: "model.norm.weight".into()
        }
    );

    // An unsupported dtype.
    let mut t = good.clone();
    let i = t
        .iter()
        .position(|(n, _)| n == "model.layers.0.input_layernorm.weight")
        .unwrap();
    t[i].1.dtype = Dtype::I32;
    write_raw(&file, t);
    assert_eq!(
        open_err(tmp.path()),
        NnError::TensorDType {
            path: path_of(&file),
            name: "model.layers.0.input_layernorm.weight".into(),
            dtype: "I32".into()
        }
    );

    // A configuration whose MLP is narrower than the weights: the first tensor (in name
    // order) whose shape differs is named, in the file's layout.
    write_raw(&file, good);
    let config = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"intermediate_size\": 64", "\"intermediate_size\": 48"),
    )
    .unwrap();
    assert_eq!(
        open_err(tmp.path()),
        NnError::TensorShape {
            path: path_of(&file),
            name: "model.layers.0.mlp.down_proj.weight".into(),
            expected: vec![32, 48],
            found: vec![32, 64],
        }
    );
}

/// A truncated shard, a tensor the index does not list or places in another shard, and an
/// index naming a shard that does not exist: each a named error.
#[test]
fn damaged_shards_and_indexes_are_named() {
    let index_text =
        std::fs::read_to_string(fixture("llama_sharded").join("model.safetensors.index.json"))
            .unwrap();
    let index: Value = serde_json::from_str(&index_text).unwrap();

    let tmp = copy_fixture("llama_sharded");
    let shard = tmp.path().join("model-00002-of-00003.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 100]).unwrap();
    match open_err(tmp.path()) {
        NnError::WeightsFile { path, detail } => {
            assert_eq!(path, path_of(&shard));
            assert!(detail.contains("truncated"), "{detail}");
        }
        other => panic!("{other:?}"),
    }

    let with_index = |edit: &dyn Fn(&mut Value)| {
        let tmp = copy_fixture("llama_sharded");
        let mut v = index.clone();
        edit(&mut v);
        std::fs::write(
            tmp.path().join("model.safetensors.index.json"),
            v.to_string(),
        )
        .unwrap();
        let err = open_err(tmp.path());
        (tmp, err)
    };
    let (tmp, err) = with_index(&|v| {
        v["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove("model.layers.0.self_attn.o_proj.weight");
    });
    assert_eq!(
        err,
        NnError::IndexEntry {
            path: path_of(&tmp.path().join("model.safetensors.index.json")),
            name: "model.layers.0.self_attn.o_proj.weight".into(),
            detail: "is in model-00001-of-00003.safetensors but has no entry".into(),
        }
    );
    let (_, err) = with_index(&|v| {
        v["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors".into();
    });
    assert!(
        matches!(&err, NnError::IndexEntry { name, detail, .. }
            if name == "model.norm.weight" && detail.contains("its entry names model-00001")),
        "{err:?}"
    );
    let (tmp, err) = with_index(&|v| {
        v["weight_map"]["model.norm.weight"] = "model-00004-of-00003.safetensors".into();
    });
    assert!(
        matches!(&err, NnError::WeightsFile { path, .. }
            if *path == path_of(&tmp.path().join("model-00004-of-00003.safetensors"))),
        "{err:?}"
    );
    let (_, err) = with_index(&|v| {
        v["weight_map"]["model.norm.weight"] = "../model.safetensors".into();
    });
    assert!(
        matches!(&err, NnError::WeightsFile { detail, .. } if detail.contains("not a file name")),
        "{err:?}"
    );
}

/// A tied model whose file also holds an LM head: accepted when it is the embedding,
/// refused by name when it is not.
#[test]
fn a_tied_head_must_be_the_embedding() {
    let tmp = copy_fixture("llama_tied");
    let file = tmp.path().join("model.safetensors");
    let mut t = read_raw(&file);
    let embed = t
        .iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap()
        .1
        .clone();
    t.push(("lm_head.weight".into(), embed.clone()));
    write_raw(&file, t.clone());
    let ckpt = HfCheckpoint::open(tmp.path()).unwrap();
    let want = HfCheckpoint::open(&fixture("llama_tied")).unwrap();
    assert_eq!(bits(&all_parameters(&ckpt)), bits(&all_parameters(&want)));

    let mut other = embed;
    other.data[5] ^= 1;
    t.last_mut().unwrap().1 = other;
    write_raw(&file, t);
    assert_eq!(
        open_err(tmp.path()),
        NnError::HeadNotTied {
            path: path_of(&file),
            head: "lm_head.weight".into(),
            embedding: "model.embed_tokens.weight".into()
        }
    );
}

/// A NaN weight is found when it is read, naming the tensor and its index in the file.
#[test]
fn non_finite_weights_are_named_on_read() {
    let tmp = copy_fixture("qwen2");
    let file = tmp.path().join("model.safetensors");
    let mut t = read_raw(&file);
    let (_, raw) = t
        .iter_mut()
        .find(|(n, _)| n == "model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    raw.data[4 * 37..4 * 38].copy_from_slice(&f32::NAN.to_le_bytes());
    write_raw(&file, t);
    let ckpt = HfCheckpoint::open(tmp.path()).unwrap();
    match ckpt.read("model.layers.1.self_attn.q_proj.weight") {
        Err(NnError::NonFiniteWeight { name, index, .. }) => {
            assert_eq!(
                (name.as_str(), index),
                ("model.layers.1.self_attn.q_proj.weight", 37)
            );
        }
        other => panic!("{other:?}"),
    }
    // Export refuses it before writing anything.
    let out = tmp.path().join("export");
    let read = |n: &str, o: &mut [f32]| ckpt.read_into(n, o);
    assert!(matches!(
        snug_nn::save_hf_model(&out, ckpt.config(), &read),
        Err(NnError::NonFiniteWeight { .. })
    ));
    assert!(!out.exists(), "nothing written");
}

/// Configuration fields the model cannot honour are refused when the directory is opened.
#[test]
fn refused_config_fields_stop_the_load() {
    let tmp = copy_fixture("mistral");
    let config = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"sliding_window\": null", "\"sliding_window\": 16"),
    )
    .unwrap();
    match open_err(tmp.path()) {
        NnError::HfConfig { path, error } => {
            assert_eq!(path, path_of(&config));
            assert!(
                matches!(&error, snug_nn::HfConfigError::Unsupported { field, value, .. }
                    if field == "sliding_window" && value == "16"),
                "{error:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// One file of a PEFT adapter beside the model without the other is refused when the
/// directory is opened, naming the directory and the missing file: weights alone would
/// otherwise go unread, and the model sample as its base.
#[test]
fn half_an_adapter_beside_the_model_is_refused_by_name() {
    use snug_nn::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
    let tmp = copy_fixture("llama");
    let dir = tmp.path();
    for (present, missing) in [
        (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE),
        (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE),
    ] {
        // The check is on presence alone: the contents are read (and checked) later.
        std::fs::write(dir.join(present), b"{}").unwrap();
        match open_err(dir) {
            NnError::Adapter { path, detail } => {
                assert_eq!(path, path_of(dir));
                assert!(
                    detail.contains(&format!("{present} but no {missing}")),
                    "{detail}"
                );
            }
            other => panic!("{present} alone: {other:?}"),
        }
        std::fs::remove_file(dir.join(present)).unwrap();
    }
    HfCheckpoint::open(dir).expect("no adapter at all");
}

/// A model whose parameters differ from the checkpoint's is refused naming the tensor.
#[test]
fn check_model_names_the_first_difference() {
    let ckpt = HfCheckpoint::open(&fixture("llama")).unwrap();
    assert!(ckpt.check_model(ckpt.config()).is_ok());
    let mut wider = ckpt.config().clone();
    wider.set_vocab_size(384);
    assert!(matches!(
        ckpt.check_model(&wider),
        Err(NnError::TensorShape { name, expected, found, .. })
            if name == "model.embed_tokens.weight" && expected == [384, 32] && found == [320, 32]
    ));
    let tied = HfCheckpoint::open(&fixture("llama_tied")).unwrap();
    assert!(matches!(
        tied.check_model(ckpt.config()),
        Err(NnError::MissingTensor { name, .. }) if name == "lm_head.weight"
    ));
}
