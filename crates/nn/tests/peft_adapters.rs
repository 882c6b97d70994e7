//! PEFT adapters as PEFT writes them, read by `snug_nn::lora`: values that are not finite
//! are refused at load naming the file and tensor; `target_modules` as module paths (how
//! PEFT 0.21 saves `all-linear`, and its shortened suffixes) or as a regular expression
//! matched against whole module paths read as the module names they come to, less
//! `exclude_modules`, and refused by name where they adapt some layers of a name and not
//! others, match no linear layer or something else than one, or hold a pattern snug cannot
//! read as Python does; other `LoraConfig` fields that change what an adapter computes are
//! refused by name; a `lora_dropout` snug does not train is reported for the caller to warn
//! of. Every file is written here, as PEFT lays it out.

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
        assert!(adapter_notes(dir.path()).unwrap().is_empty());
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
/// adapters without dropout, and says so through [`adapter_notes`], naming the file and the
/// value, for the caller to warn. A probability above one, which PEFT refuses, is refused.
#[test]
fn lora_dropout_is_read_and_reported_for_a_warning() {
    let model = llama();
    let lora = LoraConfig::new(&model, RANK, Some(4.0), None);
    let dir = tempfile::tempdir().unwrap();
    write_adapter(dir.path(), &model, &lora, json!(["q_proj", "v_proj"]));
    let config_path = dir.path().join(ADAPTER_CONFIG_FILE).display().to_string();
    load_peft_adapter(dir.path(), &model).unwrap();
    assert!(adapter_notes(dir.path()).unwrap().is_empty());
    let mut c = config(json!(["q_proj", "v_proj"]), false);
    c["lora_dropout"] = json!(0.05);
    write_config(dir.path(), &c);
    let adapter = load_peft_adapter(dir.path(), &model).unwrap();
    assert_eq!(
        adapter.lora.layers(&model).unwrap(),
        lora.layers(&model).unwrap()
    );
    match adapter_notes(dir.path()).unwrap().as_slice() {
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

/// `adapter_config.json` exactly as PEFT 0.21.2 saved it for
/// `LoraConfig(r=2, lora_alpha=4, target_modules=targets)` on a `LlamaForCausalLM`: every
/// field its `LoraConfig` has, `task_type` unset.
fn peft_0_21_config(targets: Value) -> Value {
    json!({
        "alora_invocation_tokens": null, "alpha_pattern": {}, "arrow_config": null,
        "auto_mapping": {
            "base_model_class": "LlamaForCausalLM",
            "parent_library": "transformers.models.llama.modeling_llama"
        },
        "base_model_name_or_path": null, "bias": "none", "corda_config": null,
        "ensure_weight_tying": false, "eva_config": null, "exclude_modules": null,
        "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true,
        "kasa_config": null, "layer_replication": null, "layers_pattern": null,
        "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 4, "lora_bias": false,
        "lora_dropout": 0.0, "lora_ga_config": null, "megatron_config": null,
        "megatron_core": "megatron.core", "modules_to_save": null, "monteclora_config": null,
        "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 2,
        "rank_pattern": {}, "revision": null, "target_modules": targets,
        "target_parameters": null, "task_type": null, "trainable_token_indices": null,
        "use_bdlora": null, "use_dora": false, "use_qalora": false, "use_rslora": false,
        "velora_config": null
    })
}

/// A PEFT adapter whose `target_modules` is a string other than `all-linear` is a regular
/// expression PEFT matches against each module's whole path (`re.fullmatch`). PEFT 0.21
/// saved `r".*\.(q_proj|v_proj)"` on a Llama as the configuration above and these tensors
/// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...): it loads as the
/// list `["q_proj", "v_proj"]` does, with the same layers and tensors, as do other patterns
/// and `exclude_modules` (a pattern or a list, as PEFT reads it) that come to the same layers.
#[test]
fn regex_target_modules_as_peft_0_21_saves_them_load_as_the_list_form() {
    let model = llama();
    let q_v = LoraConfig::new(&model, RANK, Some(4.0), None);
    let list = tempfile::tempdir().unwrap();
    write_adapter(list.path(), &model, &q_v, json!(["q_proj", "v_proj"]));
    let want = load_peft_adapter(list.path(), &model).unwrap();
    let keys: Vec<String> = adapter_tensors(&model, &q_v)
        .into_iter()
        .map(|(k, ..)| k)
        .collect();
    assert_eq!(
        keys[..2],
        [
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
        ]
    );
    let dir = tempfile::tempdir().unwrap();
    write_adapter(dir.path(), &model, &q_v, json!("unused"));
    for (targets, exclude) in [
        (json!(r".*\.(q_proj|v_proj)"), json!(null)),
        (
            json!(r"model\.layers\.\d+\.self_attn\.[qv]_proj"),
            json!(null),
        ),
        (json!(r"(?i).*\.(Q|V)_PROJ"), json!(null)),
        (json!(r".*_proj"), json!(r".*\.(k|o|gate|up|down)_proj")),
        (
            json!(r".*_proj"),
            json!(["k_proj", "o_proj", "mlp.gate_proj", "up_proj", "down_proj"]),
        ),
        (json!("all-linear"), json!(r".*(k|o|gate|up|down)_proj")),
        // Less the LM head, the pattern adapts linear layers alone, as PEFT then does.
        (json!(r".*\.(q_proj|v_proj)|lm_head"), json!(["lm_head"])),
    ] {
        let mut c = peft_0_21_config(targets.clone());
        c["exclude_modules"] = exclude.clone();
        write_config(dir.path(), &c);
        let got = load_peft_adapter(dir.path(), &model)
            .unwrap_or_else(|e| panic!("{targets} less {exclude}: {e}"));
        assert_eq!(got.lora, want.lora, "{targets} less {exclude}");
        assert_eq!(got.tensors, want.tensors, "{targets} less {exclude}");
        assert_eq!(
            got.lora.layers(&model).unwrap(),
            q_v.layers(&model).unwrap()
        );
        assert!(adapter_notes(dir.path()).unwrap().is_empty());
    }
    // GPT-2: `c_proj` is the attention's and the MLP's, which a pattern adapts together.
    let gpt = gpt();
    let lora = LoraConfig::new(
        &gpt,
        RANK,
        Some(4.0),
        Some("c_attn,c_proj".parse().unwrap()),
    );
    write_adapter(
        dir.path(),
        &gpt,
        &lora,
        json!(r"transformer\.h\.\d+\..*\.c_(attn|proj)"),
    );
    let got = load_peft_adapter(dir.path(), &gpt).unwrap();
    assert_eq!(got.lora, lora);
    assert_eq!(got.tensors.len(), 2 * lora.layers(&gpt).unwrap().len());
}

/// The configuration's error, which must be a refusal naming the configuration file.
fn refused(dir: &Path, model: &ModelConfig, config: &Value) -> String {
    write_config(dir, config);
    match read_adapter_config(dir, model) {
        Err(NnError::Adapter { path, detail }) => {
            assert_eq!(path, dir.join(ADAPTER_CONFIG_FILE).display().to_string());
            detail
        }
        other => panic!("{config}: expected a refusal, got {other:?}"),
    }
}

/// A pattern that adapts a module in some layers and not others (PEFT's `layers_to_transform`
/// by another name) is refused as such a list is, naming a layer adapted and one left out;
/// so is a pattern or list less `exclude_modules` that does. A pattern that matches no linear
/// layer (a bare name: PEFT matches the whole path) is refused naming it, as is one that
/// `exclude_modules` leaves nothing of. A pattern that matches any other module is refused
/// naming it: PEFT adapts the LM head and embeddings, which snug does not, and refuses the
/// rest (norms, activations, the rotary table, the blocks themselves).
#[test]
fn regex_target_modules_that_differ_by_layer_or_match_no_linear_layer_or_more_are_refused() {
    let model = llama();
    let dir = tempfile::tempdir().unwrap();
    let with = |targets: Value, exclude: Value| {
        let mut c = peft_0_21_config(targets);
        c["exclude_modules"] = exclude;
        c
    };
    let pattern = r".*\.0\..*q_proj";
    let detail = refused(dir.path(), &model, &with(json!(pattern), json!(null)));
    assert!(
        detail.contains(&format!("`target_modules` `{pattern}` adapts"))
            && detail.contains("`model.layers.0.self_attn.q_proj` but not")
            && detail.contains("`model.layers.1.self_attn.q_proj`"),
        "{detail}"
    );
    let detail = refused(
        dir.path(),
        &model,
        &with(json!(["q_proj"]), json!(r"model\.layers\.1\..*")),
    );
    assert!(
        detail.contains(r"less `exclude_modules` `model\.layers\.1\..*` adapts")
            && detail.contains("`model.layers.0.self_attn.q_proj` but not")
            && detail.contains("`model.layers.1.self_attn.q_proj`"),
        "{detail}"
    );
    let gpt = gpt();
    let detail = refused(
        dir.path(),
        &gpt,
        &with(json!(r".*attn\.c_proj"), json!(null)),
    );
    assert!(
        detail.contains("`transformer.h.0.attn.c_proj` but not")
            && detail.contains("`transformer.h.0.mlp.c_proj`"),
        "{detail}"
    );
    for pattern in [
        "q_proj",
        r"model\.layers\.9\.self_attn\.q_proj",
        "all-linear.+",
    ] {
        let detail = refused(dir.path(), &model, &with(json!(pattern), json!(null)));
        assert!(
            detail.contains(&format!(
                "`target_modules` `{pattern}` matches no linear layer of this model"
            )) && detail.contains("`model.layers.0.self_attn.q_proj`"),
            "{detail}"
        );
    }
    let detail = refused(dir.path(), &model, &with(json!(".*q_proj"), json!(".*")));
    assert!(
        detail.contains("`exclude_modules` `.*` excludes every layer `target_modules` `.*q_proj`"),
        "{detail}"
    );
    for (pattern, module, what) in [
        (".*", "model", "no linear layer"),
        (r".*(q_proj|lm_head)", "lm_head", "the LM head"),
        (
            r".*(q_proj|embed_tokens)",
            "model.embed_tokens",
            "an embedding",
        ),
        (
            r".*(q_proj|norm)",
            "model.layers.0.input_layernorm",
            "no linear layer",
        ),
        (
            r".*(q_proj|act_fn)",
            "model.layers.0.mlp.act_fn",
            "no linear layer",
        ),
        (
            r".*(q_proj|rotary_emb)",
            "model.rotary_emb",
            "no linear layer",
        ),
        (
            r".*(q_proj|self_attn)",
            "model.layers.0.self_attn",
            "no linear layer",
        ),
    ] {
        let detail = refused(dir.path(), &model, &with(json!(pattern), json!(null)));
        assert!(
            detail.contains(&format!(
                "`target_modules` `{pattern}` matches `{module}`, {what}"
            )),
            "{detail}"
        );
    }
    let detail = refused(
        dir.path(),
        &gpt,
        &with(json!(r".*\.(c_attn|wpe)"), json!(null)),
    );
    assert!(
        detail.contains("matches `transformer.wpe`, an embedding"),
        "{detail}"
    );
}

/// A pattern is compiled by snug's `regex`, which lacks some of Python's syntax (look-arounds,
/// back-references) and reads a little of it otherwise (`\<` is a word boundary there, a `<`
/// in Python; `[[:alpha:]]` a class there, characters in Python): such a pattern, in
/// `target_modules` or `exclude_modules`, is refused naming the field, the pattern and what
/// is wrong, never matched otherwise than PEFT would, and never a panic.
#[test]
fn regex_patterns_snug_cannot_read_as_python_does_are_refused_naming_field_and_pattern() {
    let model = llama();
    let dir = tempfile::tempdir().unwrap();
    for (field, pattern, why) in [
        ("target_modules", r".*(?=q)q_proj", "look-around"),
        (
            "target_modules",
            r"(?P<a>.*)q_proj(?P=a)",
            "not a regular expression snug",
        ),
        (
            "target_modules",
            r".*q_proj)|(lm_head",
            "not a regular expression snug",
        ),
        ("target_modules", r".*\", "not a regular expression snug"),
        (
            "target_modules",
            r"(?:.{1000}){1000}",
            "not a regular expression snug",
        ),
        ("target_modules", r".*\<q_proj", "word boundary"),
        ("target_modules", r".*\b{start}q_proj", "word boundary"),
        ("target_modules", r".*[[:alpha:]]_proj", "nested class"),
        ("target_modules", r".*[a-z&&q]_proj", "class operation"),
        ("exclude_modules", r".*(?!q)_proj", "look-around"),
    ] {
        let mut c = peft_0_21_config(json!(["q_proj", "v_proj"]));
        c[field] = json!(pattern);
        let detail = refused(dir.path(), &model, &c);
        assert!(
            detail.contains(&format!("`{field}` `{pattern}`")) && detail.contains(why),
            "{field} {pattern}: {detail}"
        );
    }
    // `]` first in a class is a character in both, as are an escaped `[` and a `<` after an
    // escaped backslash.
    let lora = LoraConfig::new(&model, RANK, Some(4.0), None);
    write_adapter(dir.path(), &model, &lora, json!(null));
    for pattern in [
        r".*\.[]qv]_proj",
        r".*\.[^]a-p]_proj",
        r".*\.[\[qv]_proj(\\<)?",
    ] {
        write_config(dir.path(), &peft_0_21_config(json!(pattern)));
        let got = load_peft_adapter(dir.path(), &model).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.lora.targets, lora.targets, "{pattern}");
    }
}

/// Every other field of PEFT 0.21's `LoraConfig` that changes what an adapter computes, what
/// it applies to or what else is trained is refused by name where it is set: a head other
/// than a causal LM's, initialisations that changed the base weights, and LoRA variants snug
/// does not train. Fields that change none of that (metadata, runtime settings, settings
/// read only when creating an adapter, `fan_in_fan_out`, which PEFT sets by the layer's
/// kind) are read as unset. MiCA's initialisation loads, and is reported: PEFT trains its
/// `lora_A` alone.
#[test]
fn lora_config_fields_snug_cannot_follow_are_refused_by_name_and_the_rest_read() {
    let model = llama();
    let dir = tempfile::tempdir().unwrap();
    let lora = LoraConfig::new(&model, RANK, Some(4.0), None);
    write_adapter(dir.path(), &model, &lora, json!(null));
    let plain = || peft_0_21_config(json!(["q_proj", "v_proj"]));
    for (field, value, why) in [
        ("task_type", json!("SEQ_CLS"), "another head"),
        ("task_type", json!("FEATURE_EXTRACTION"), "another head"),
        ("layers_pattern", json!("layers"), "layers_to_transform"),
        (
            "megatron_config",
            json!({"tensor_model_parallel_size": 2}),
            "Megatron",
        ),
        ("velora_config", json!({"num_groups": 64}), "VeLoRA"),
        (
            "monteclora_config",
            json!({"num_samples": 4}),
            "Monte Carlo",
        ),
        ("arrow_config", json!({"top_k": 3}), "Arrow"),
        ("kasa_config", json!({}), "KaSA"),
        (
            "init_lora_weights",
            json!("lora_ga"),
            "base weights it changed",
        ),
    ] {
        let mut c = plain();
        c[field] = value.clone();
        // An empty sub-configuration is still one PEFT enables the variant with.
        if field == "kasa_config" {
            c[field] = json!({"svd_rank": 4});
        }
        let detail = refused(dir.path(), &model, &c);
        assert!(
            detail.contains(&format!("`{field}`")) && detail.contains(why),
            "{field} = {value}: {detail}"
        );
    }
    for (field, value) in [
        ("task_type", json!("CAUSAL_LM")),
        ("inference_mode", json!(false)),
        ("revision", json!("main")),
        (
            "base_model_name_or_path",
            json!("HuggingFaceTB/SmolLM2-135M"),
        ),
        ("fan_in_fan_out", json!(true)),
        ("megatron_core", json!("megatron.core")),
        ("qalora_group_size", json!(32)),
        ("loftq_config", json!({"loftq_bits": 4, "loftq_iter": 1})),
        ("eva_config", json!({"rho": 2.0})),
        ("corda_config", json!({"corda_method": "kpm"})),
        ("lora_ga_config", json!({"direction": "ArB2r"})),
        ("ensure_weight_tying", json!(true)),
        ("runtime_config", json!({"ephemeral_gpu_offload": true})),
        ("modules_to_save", json!([])),
        ("exclude_modules", json!([])),
        ("init_lora_weights", json!(false)),
        ("init_lora_weights", json!("orthogonal")),
        ("init_lora_weights", json!("eva")),
        ("init_lora_weights", json!("mica")),
    ] {
        let mut c = plain();
        c[field] = value.clone();
        write_config(dir.path(), &c);
        let got = load_peft_adapter(dir.path(), &model)
            .unwrap_or_else(|e| panic!("{field} = {value}: {e}"));
        assert_eq!(got.lora, lora, "{field} = {value}");
        let notes = adapter_notes(dir.path()).unwrap();
        if value == json!("mica") {
            match notes.as_slice() {
                [note] => assert!(
                    note.contains("`init_lora_weights` is `mica`")
                        && note.contains("snug trains both"),
                    "{note}"
                ),
                other => panic!("{other:?}"),
            }
        } else {
            assert!(notes.is_empty(), "{field} = {value}: {notes:?}");
        }
    }
}
