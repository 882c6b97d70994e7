//! PEFT adapters as PEFT writes them, read by `snug_nn::lora`: values that are not finite
//! are refused at load naming the file and tensor; `target_modules` as module paths (how
//! PEFT 0.21 saves `all-linear`, and its shortened suffixes) read as the module names they
//! come to, and refused by name where they adapt some layers of a name and not others; a
//! `lora_dropout` snug does not train is reported for the caller to warn of. Every file is
//! written here, as PEFT lays it out.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};
use snug_nn::lora::{
    adapter_notes, init_adapters, load_peft_adapter, peft_key, read_adapter_config,
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, GPT_LINEAR, LLAMA_LINEAR,
};
use snug_nn::{LoraConfig, LoraTargets, ModelConfig, NnError};

const RANK: usize = 2;

fn llama() -> ModelConfig {
    ModelConfig::preset("llama-tiny").unwrap()
}

fn gpt() -> ModelConfig {
    ModelConfig::preset("tiny").unwrap()
}

fn all_linear(model: &ModelConfig) -> LoraConfig {
    LoraConfig::new(model, RANK, Some(4.0), Some(LoraTargets::AllLinear))
}

/// The path of every linear layer of `model` as Hugging Face names its module, the form
/// PEFT writes `all-linear` in: `model.layers.0.self_attn.q_proj`, `transformer.h.0.attn.c_attn`.
fn module_paths(model: &ModelConfig) -> Vec<String> {
    all_linear(model)
        .layers(model)
        .unwrap()
        .iter()
        .map(|l| {
            peft_key(model, l.weight.strip_suffix(".weight").unwrap())
                .strip_prefix("base_model.model.")
                .unwrap()
                .to_string()
        })
        .collect()
}

/// `adapter_config.json` as PEFT 0.21 writes it (the fields that matter here), with
/// `target_modules` as given.
fn config(targets: Value, fan_in_fan_out: bool) -> Value {
    json!({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 4.0,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": fan_in_fan_out, "inference_mode": true, "init_lora_weights": true,
        "alpha_pattern": {}, "rank_pattern": {}, "layers_to_transform": null,
        "layers_pattern": null, "exclude_modules": null, "lora_bias": false,
        "modules_to_save": null, "use_dora": false, "use_rslora": false,
    })
}

fn write_config(dir: &Path, config: &Value) {
    std::fs::write(
        dir.join(ADAPTER_CONFIG_FILE),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
}

/// `adapter_model.safetensors` holding `tensors` (PEFT key, shape, dtype, bytes).
fn write_weights(dir: &Path, tensors: &[(String, Vec<usize>, safetensors::Dtype, Vec<u8>)]) {
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(key, shape, dtype, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (key.as_str(), view)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &dir.join(ADAPTER_WEIGHTS_FILE)).unwrap();
}

/// PEFT's tensors for `lora`'s layers of `model`, f32, every value finite and B nonzero:
/// PEFT key, shape, values.
fn adapter_tensors(model: &ModelConfig, lora: &LoraConfig) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let layers = lora.layers(model).unwrap();
    let values: HashMap<String, Vec<f32>> = init_adapters(&layers, RANK, 7).into_iter().collect();
    let mut out = Vec::new();
    for l in &layers {
        let b: Vec<f32> = (0..l.out_features * RANK)
            .map(|i| i as f32 * 1e-3)
            .collect();
        out.push((
            peft_key(model, &l.lora_a),
            vec![RANK, l.in_features],
            values[&l.lora_a].clone(),
        ));
        out.push((peft_key(model, &l.lora_b), vec![l.out_features, RANK], b));
    }
    out
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A whole adapter for `lora` in `dir`: its tensors (f32) and a configuration naming
/// `targets`.
fn write_adapter(dir: &Path, model: &ModelConfig, lora: &LoraConfig, targets: Value) {
    let tensors: Vec<_> = adapter_tensors(model, lora)
        .into_iter()
        .map(|(k, s, v)| (k, s, safetensors::Dtype::F32, f32_bytes(&v)))
        .collect();
    write_weights(dir, &tensors);
    let gpt = matches!(model, ModelConfig::Gpt(_));
    write_config(dir, &config(targets, gpt));
}

/// A NaN or infinity in an adapter is refused when it is read, as in a base model's weights,
/// naming the adapter's file, the tensor by its key there and the index of the first such
/// value: otherwise training starts and diverges at its first step, sampling stops at logits
/// that are not finite, and a merged export blames the base weight it was folded into. An
/// f64 too large for f32 is caught as the infinity it becomes.
#[test]
fn an_adapter_holding_nan_or_inf_is_refused_at_load_naming_its_file_and_tensor() {
    let model = llama();
    let lora = LoraConfig::new(&model, RANK, Some(4.0), None);
    let tensors = adapter_tensors(&model, &lora);
    let a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let b_key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
    assert!(tensors.iter().any(|(k, ..)| k == a_key) && tensors.iter().any(|(k, ..)| k == b_key));
    for (key, index, value, f64_file) in [
        (a_key, 0, f32::NAN, false),
        (a_key, 5, f32::INFINITY, false),
        (b_key, 3, f32::NEG_INFINITY, false),
        // 1e39 is finite in the file, infinite once read as f32.
        (b_key, 1, 1e39f64 as f32, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let written: Vec<_> = tensors
            .iter()
            .map(|(k, shape, v)| {
                let mut v: Vec<f64> = v.iter().map(|&x| x as f64).collect();
                if k == key {
                    v[index] = if f64_file { 1e39 } else { value as f64 };
                }
                if f64_file && k == key {
                    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    (k.clone(), shape.clone(), safetensors::Dtype::F64, bytes)
                } else {
                    let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
                    (
                        k.clone(),
                        shape.clone(),
                        safetensors::Dtype::F32,
                        f32_bytes(&v),
                    )
                }
            })
            .collect();
        write_weights(dir.path(), &written);
        write_config(dir.path(), &config(json!(["q_proj", "v_proj"]), false));
        let weights = dir.path().join(ADAPTER_WEIGHTS_FILE).display().to_string();
        let e = load_peft_adapter(dir.path(), &model).unwrap_err();
        match &e {
            NnError::NonFiniteWeight {
                path,
                name,
                index: i,
                value: v,
            } => {
                assert_eq!(
                    (path.as_str(), name.as_str(), *i),
                    (weights.as_str(), key, index)
                );
                assert!(
                    v.is_nan() == value.is_nan() && (value.is_nan() || *v == value),
                    "{v} for {value}"
                );
            }
            other => panic!("{key}[{index}] = {value}: expected a refusal, got {other:?}"),
        }
        // As the error shows it: `NaN`, `inf`, `-inf`.
        let shown = value.to_string();
        let message = e.to_string();
        assert!(
            message.starts_with(&format!(
                "{weights}: tensor `{key}` holds {shown} at index {index}"
            )),
            "{message}"
        );
    }
}

/// PEFT 0.21 saves `target_modules="all-linear"` as the path of every linear layer of every
/// block (and a long list as the shortest suffixes that pick out the same modules): either
/// loads, adapting exactly the layers PEFT does, and reads as the module names it comes to.
/// PEFT matches a module to a target it equals or ends with after a `.`.
#[test]
fn target_modules_as_module_paths_for_every_layer_load_as_their_module_names() {
    for (model, linear) in [(llama(), &LLAMA_LINEAR[..]), (gpt(), &GPT_LINEAR[..])] {
        let all = all_linear(&model);
        let want_layers = all.layers(&model).unwrap();
        let names = |n: &[&str]| LoraTargets::Modules(n.iter().map(|s| s.to_string()).collect());
        // PEFT writes a set: in no particular order.
        let mut paths = module_paths(&model);
        paths.reverse();
        paths.rotate_left(3);
        let dir = tempfile::tempdir().unwrap();
        write_adapter(dir.path(), &model, &all, json!(paths));
        let adapter = load_peft_adapter(dir.path(), &model).unwrap();
        assert_eq!(adapter.lora.targets, names(linear));
        assert_eq!(adapter.lora.layers(&model).unwrap(), want_layers);
        assert_eq!(adapter.tensors.len(), 2 * want_layers.len());
        assert!(adapter.notes.is_empty(), "{:?}", adapter.notes);
        // The literal shorthand, as PEFT compares it (without case).
        for shorthand in ["all-linear", "ALL-LINEAR"] {
            write_config(
                dir.path(),
                &config(json!(shorthand), matches!(model, ModelConfig::Gpt(_))),
            );
            let adapter = load_peft_adapter(dir.path(), &model).unwrap();
            assert_eq!(adapter.lora.targets, LoraTargets::AllLinear);
            assert_eq!(adapter.lora.layers(&model).unwrap(), want_layers);
        }
    }
    // Partial paths, and full paths that together name a module in every layer.
    let model = llama();
    let q_v = LoraConfig::new(&model, RANK, Some(4.0), None);
    let dir = tempfile::tempdir().unwrap();
    for targets in [
        json!(["self_attn.q_proj", "v_proj"]),
        json!([
            "layers.0.self_attn.q_proj",
            "model.layers.1.self_attn.q_proj",
            "self_attn.v_proj"
        ]),
        json!([
            "model.layers.1.self_attn.v_proj",
            "model.layers.0.self_attn.v_proj",
            "q_proj"
        ]),
    ] {
        write_adapter(dir.path(), &model, &q_v, targets.clone());
        let adapter =
            load_peft_adapter(dir.path(), &model).unwrap_or_else(|e| panic!("{targets}: {e}"));
        assert_eq!(
            adapter.lora.targets,
            LoraTargets::Modules(vec!["q_proj".into(), "v_proj".into()]),
            "{targets}"
        );
        assert_eq!(
            adapter.lora.layers(&model).unwrap(),
            q_v.layers(&model).unwrap()
        );
    }
}

/// The configuration's error, which must be a refusal of `target_modules` naming its file.
fn refusal(dir: &Path, model: &ModelConfig, targets: Value) -> String {
    write_config(
        dir,
        &config(targets.clone(), matches!(model, ModelConfig::Gpt(_))),
    );
    match read_adapter_config(dir, model) {
        Err(NnError::Adapter { path, detail }) => {
            assert_eq!(path, dir.join(ADAPTER_CONFIG_FILE).display().to_string());
            assert!(detail.contains("`target_modules`"), "{targets}: {detail}");
            detail
        }
        other => panic!("{targets}: expected a refusal, got {other:?}"),
    }
}

/// snug adapts the same modules in every layer: paths that adapt a module in some layers and
/// not others (PEFT's `layers_to_transform` by another name) are refused naming a layer
/// adapted and one left out, as are GPT-2's `c_proj` of the MLP without the attention's (snug
/// adapts a module name's layers together). A path or name that matches none of the model's
/// linear layers is refused naming it.
#[test]
fn target_modules_paths_that_differ_by_layer_or_match_no_linear_layer_are_refused_by_name() {
    let model = llama();
    let dir = tempfile::tempdir().unwrap();
    let detail = refusal(
        dir.path(),
        &model,
        json!(["model.layers.0.self_attn.q_proj"]),
    );
    assert!(
        detail.contains("`model.layers.0.self_attn.q_proj`")
            && detail.contains("`model.layers.1.self_attn.q_proj`"),
        "{detail}"
    );
    // Every layer of q_proj, but v_proj in one.
    let detail = refusal(
        dir.path(),
        &model,
        json!(["q_proj", "model.layers.1.self_attn.v_proj"]),
    );
    assert!(
        detail.contains("`model.layers.1.self_attn.v_proj`")
            && detail.contains("`model.layers.0.self_attn.v_proj`"),
        "{detail}"
    );
    let gpt = gpt();
    let detail = refusal(dir.path(), &gpt, json!(["c_attn", "mlp.c_proj"]));
    assert!(
        detail.contains("`transformer.h.0.mlp.c_proj`")
            && detail.contains("`transformer.h.0.attn.c_proj`"),
        "{detail}"
    );
    for target in [
        "model.layers.99.self_attn.q_proj",
        "mlp.q_proj",
        "odel.layers.0.self_attn.q_proj",
        "lm_head",
        "model.layers.0.self_attn",
        "c_attn",
    ] {
        let detail = refusal(dir.path(), &model, json!(["q_proj", target]));
        assert!(
            detail.contains(&format!("`{target}` names no linear layer")),
            "{detail}"
        );
    }
    // A list naming the shorthand is a module name PEFT finds nowhere.
    let detail = refusal(dir.path(), &model, json!(["all-linear"]));
    assert!(
        detail.contains("`all-linear` names no linear layer"),
        "{detail}"
    );
}

/// A `lora_dropout` above zero (real adapters have 0.05) is read, not refused: snug trains
/// adapters without dropout, and says so through the loaded adapter's notes and
/// [`adapter_notes`], naming the file and the value, for the caller to warn. A probability
/// above one, which PEFT refuses, is refused.
#[test]
fn lora_dropout_is_read_and_reported_for_a_warning() {
    let model = llama();
    let lora = LoraConfig::new(&model, RANK, Some(4.0), None);
    let dir = tempfile::tempdir().unwrap();
    write_adapter(dir.path(), &model, &lora, json!(["q_proj", "v_proj"]));
    let config_path = dir.path().join(ADAPTER_CONFIG_FILE).display().to_string();
    assert!(load_peft_adapter(dir.path(), &model)
        .unwrap()
        .notes
        .is_empty());
    assert!(adapter_notes(dir.path()).unwrap().is_empty());
    let mut c = config(json!(["q_proj", "v_proj"]), false);
    c["lora_dropout"] = json!(0.05);
    write_config(dir.path(), &c);
    let adapter = load_peft_adapter(dir.path(), &model).unwrap();
    assert_eq!(
        adapter.lora.layers(&model).unwrap(),
        lora.layers(&model).unwrap()
    );
    assert_eq!(adapter.notes, adapter_notes(dir.path()).unwrap());
    match adapter.notes.as_slice() {
        [note] => assert!(
            note.starts_with(&config_path)
                && note.contains("`lora_dropout` is 0.05")
                && note.contains("without dropout"),
            "{note}"
        ),
        other => panic!("{other:?}"),
    }
    c["lora_dropout"] = json!(1.5);
    write_config(dir.path(), &c);
    match load_peft_adapter(dir.path(), &model) {
        Err(NnError::Adapter { path, detail }) => {
            assert_eq!(path, config_path);
            assert!(detail.contains("`lora_dropout` is 1.5"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}
