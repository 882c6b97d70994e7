//! LoRA adapters for snug's models: which linear layers a pattern names, the adapters'
//! initialisation (as PEFT's), the PEFT adapter format in and out (`adapter_model.safetensors`
//! with PEFT's key names, and `adapter_config.json`), and merging an adapter into its base.
//! The graph rewrite itself is [`snug_graph::passes::add_lora`].

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use snug_graph::passes::{lora_names, LoraLayer, LoraSpec};

use crate::{ModelConfig, NnError};

/// The adapter's weights, as PEFT names the file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The adapter's configuration, as PEFT names the file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The most an `adapter_config.json` may hold: real ones are a kilobyte.
const MAX_ADAPTER_CONFIG_BYTES: u64 = 1 << 20;

/// The linear layers of the Llama family, by module name.
pub const LLAMA_LINEAR: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];
/// GPT-2's linear layers (`Conv1D`), by module name; `c_proj` is both the attention's output
/// projection and the MLP's.
pub const GPT_LINEAR: [&str; 3] = ["c_attn", "c_proj", "c_fc"];

/// Which linear layers get adapters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTargets {
    /// Every linear layer of every block (not the LM head), as PEFT's `all-linear`.
    AllLinear,
    /// Layers by module name (`q_proj`, `c_attn`, ...).
    Modules(Vec<String>),
}

impl std::str::FromStr for LoraTargets {
    type Err = String;

    fn from_str(s: &str) -> Result<LoraTargets, String> {
        let s = s.trim();
        if s == "all-linear" {
            return Ok(LoraTargets::AllLinear);
        }
        let mut names = Vec::new();
        for part in s.split(',').map(str::trim) {
            let ok =
                !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !ok {
                return Err(format!(
                    "`{s}` is not all-linear or a comma-separated list of module names \
                     (such as q_proj,v_proj)"
                ));
            }
            if !names.iter().any(|n| n == part) {
                names.push(part.to_string());
            }
        }
        Ok(LoraTargets::Modules(names))
    }
}

impl std::fmt::Display for LoraTargets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoraTargets::AllLinear => f.write_str("all-linear"),
            LoraTargets::Modules(m) => f.write_str(&m.join(",")),
        }
    }
}

/// A LoRA run's adapters: rank, scale numerator and the layers they sit beside.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    /// The branch is scaled by `alpha / rank`.
    pub alpha: f32,
    pub targets: LoraTargets,
}

impl LoraConfig {
    /// Rank `rank` with the defaults for what is not given: alpha twice the rank (torchtune's
    /// recipes), and PEFT's default targets for the family (`q_proj,v_proj`; GPT-2's
    /// `c_attn`).
    pub fn new(
        model: &ModelConfig,
        rank: usize,
        alpha: Option<f32>,
        targets: Option<LoraTargets>,
    ) -> LoraConfig {
        let targets = targets.unwrap_or_else(|| {
            let default: &[&str] = match model {
                ModelConfig::Gpt(_) => &["c_attn"],
                ModelConfig::Llama(_) => &["q_proj", "v_proj"],
            };
            LoraTargets::Modules(default.iter().map(|s| s.to_string()).collect())
        });
        LoraConfig {
            rank,
            alpha: alpha.unwrap_or(2.0 * rank as f32),
            targets,
        }
    }

    pub fn spec(&self) -> LoraSpec {
        LoraSpec {
            rank: self.rank,
            alpha: self.alpha,
        }
    }

    pub fn scale(&self) -> f32 {
        self.spec().scale()
    }

    /// Whether the weight `name` of `model` gets an adapter.
    pub fn selects(&self, model: &ModelConfig, name: &str) -> bool {
        let Some(module) = module_of(name) else {
            return false;
        };
        match &self.targets {
            LoraTargets::AllLinear => linear_modules(model).contains(&module),
            LoraTargets::Modules(m) => {
                linear_modules(model).contains(&module) && m.iter().any(|t| t == module)
            }
        }
    }

    /// The layers of `model` this configuration adapts, in parameter order; an error names
    /// what is wrong (a module the model does not have, a rank of zero or wider than a layer,
    /// a non-positive alpha) before anything is built.
    pub fn layers(&self, model: &ModelConfig) -> Result<Vec<LoraLayer>, NnError> {
        let bad = |detail: String| NnError::Lora { detail };
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(bad(format!(
                "lora_alpha must be a positive number, got {}",
                self.alpha
            )));
        }
        let known = linear_modules(model);
        if let LoraTargets::Modules(m) = &self.targets {
            if let Some(missing) = m.iter().find(|t| !known.contains(&t.as_str())) {
                return Err(bad(format!(
                    "lora_targets: `{missing}` names no linear layer of this model (its \
                     linear layers: {}; or all-linear)",
                    known.join(", ")
                )));
            }
            if m.is_empty() {
                return Err(bad("lora_targets names no layer".into()));
            }
        }
        let mut layers = Vec::new();
        for (name, shape) in model.parameter_shapes() {
            if shape.len() != 2 || !self.selects(model, &name) {
                continue;
            }
            let (n_in, n_out) = (shape[0], shape[1]);
            if self.rank == 0 || self.rank > n_in.min(n_out) {
                return Err(bad(format!(
                    "rank {} for `{name}` ({n_in} in, {n_out} out): the rank must be at least \
                     1 and at most {}",
                    self.rank,
                    n_in.min(n_out)
                )));
            }
            let (lora_a, lora_b) = lora_names(&name);
            layers.push(LoraLayer {
                weight: name,
                lora_a,
                lora_b,
                in_features: n_in,
                out_features: n_out,
            });
        }
        if layers.is_empty() {
            return Err(bad(format!(
                "lora_targets `{}` matches no layer of this model",
                self.targets
            )));
        }
        Ok(layers)
    }

    /// The module names adapted, in the order PEFT's `target_modules` lists them.
    fn module_names(&self, model: &ModelConfig) -> Vec<String> {
        linear_modules(model)
            .iter()
            .filter(|m| match &self.targets {
                LoraTargets::AllLinear => true,
                LoraTargets::Modules(t) => t.iter().any(|t| t == *m),
            })
            .map(|m| m.to_string())
            .collect()
    }
}

fn linear_modules(model: &ModelConfig) -> &'static [&'static str] {
    match model {
        ModelConfig::Gpt(_) => &GPT_LINEAR,
        ModelConfig::Llama(_) => &LLAMA_LINEAR,
    }
}

/// `h.0.attn.c_attn.weight` → `c_attn`.
fn module_of(weight: &str) -> Option<&str> {
    weight.strip_suffix(".weight")?.rsplit('.').next()
}

/// Adapter initialisation as PEFT's: A Kaiming-uniform with `a = √5` (uniform within
/// `±1/√in`), B zero, so the adapted model starts as its base.
pub fn init_adapters(layers: &[LoraLayer], rank: usize, seed: u64) -> Vec<(String, Vec<f32>)> {
    use rand::{Rng, SeedableRng};
    // Its own stream, so the base's initialisation is the same with and without adapters.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x104A_0000_0000_0000);
    let mut out = Vec::with_capacity(2 * layers.len());
    for l in layers {
        let bound = 1.0 / (l.in_features as f32).sqrt();
        let a = (0..rank * l.in_features)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        out.push((l.lora_a.clone(), a));
        out.push((l.lora_b.clone(), vec![0.0; l.out_features * rank]));
    }
    out
}

/// The key PEFT gives snug's tensor `name` in `adapter_model.safetensors`: under
/// `base_model.model.`, with GPT-2's `transformer.` prefix.
pub fn peft_key(model: &ModelConfig, name: &str) -> String {
    match model {
        ModelConfig::Gpt(_) => format!("base_model.model.transformer.{name}"),
        ModelConfig::Llama(_) => format!("base_model.model.{name}"),
    }
}

/// `adapter_config.json` as PEFT writes it (the fields its `LoraConfig` reads).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PeftConfig {
    peft_type: String,
    #[serde(default)]
    task_type: Option<String>,
    r: usize,
    lora_alpha: f32,
    target_modules: serde_json::Value,
    #[serde(default)]
    lora_dropout: f32,
    #[serde(default = "none_bias")]
    bias: String,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    inference_mode: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    modules_to_save: Option<serde_json::Value>,
    /// PEFT's other fields, read only to refuse those that change what an adapter computes
    /// ([`REFUSED_FIELDS`]) where they are set.
    #[serde(flatten, skip_serializing)]
    other: serde_json::Map<String, serde_json::Value>,
}

/// Fields of PEFT's `LoraConfig` that change which layers carry adapters, their ranks or
/// scales, what they compute or what else is trained, each with what it does: an adapter with
/// any of them set computes something snug would not, so it is refused by name rather than
/// read as if they were unset. (`exclude_modules` is followed; the initialisation configs
/// `loftq_config`, `eva_config`, `corda_config` and `lora_ga_config` are read by PEFT only
/// when creating an adapter, and `megatron_core` and `qalora_group_size` only beside fields
/// refused here.)
const REFUSED_FIELDS: [(&str, &str); 16] = [
    (
        "alora_invocation_tokens",
        "activated LoRA, applied only from its invocation tokens on",
    ),
    ("alpha_pattern", "other scales for some layers"),
    ("rank_pattern", "other ranks for some layers"),
    ("layers_to_transform", "adapters in some layers only"),
    (
        "layers_pattern",
        "where `layers_to_transform` counts layers (PEFT refuses it alone)",
    ),
    ("lora_bias", "a bias on `lora_B`"),
    (
        "target_parameters",
        "adapters on parameters rather than modules",
    ),
    (
        "layer_replication",
        "layers repeated, each copy with its own adapter",
    ),
    (
        "trainable_token_indices",
        "embedding rows trained beside the adapters",
    ),
    ("use_qalora", "QALoRA, over inputs pooled in groups"),
    ("use_bdlora", "block-diagonal factors"),
    ("megatron_config", "adapters on Megatron's parallel layers"),
    (
        "velora_config",
        "VeLoRA, trained through compressed activations with tensors of its own",
    ),
    ("monteclora_config", "Monte Carlo sampled adapters"),
    ("arrow_config", "Arrow's routing among adapters"),
    (
        "kasa_config",
        "KaSA, over a truncated base weight with singular values between A and B",
    ),
];

/// `task_type`s PEFT gives models with another head than a causal LM's (or none): their
/// adapters were trained for that head, and are written for its module names.
const OTHER_TASKS: [&str; 5] = [
    "SEQ_CLS",
    "SEQ_2_SEQ_LM",
    "TOKEN_CLS",
    "QUESTION_ANS",
    "FEATURE_EXTRACTION",
];

/// Whether a configuration value is set: not null, false, empty or an empty list or map.
fn is_set(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null | serde_json::Value::Bool(false) => false,
        serde_json::Value::String(s) => !s.is_empty(),
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

fn none_bias() -> String {
    "none".into()
}

/// What [`save_peft_adapter`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterExport {
    pub weights: PathBuf,
    pub config: PathBuf,
    pub tensors: usize,
    pub parameters: usize,
    pub bytes: u64,
}

/// Writes the adapters of `lora` on `model` into `dir` as PEFT stores them:
/// `adapter_model.safetensors` (f32, PEFT's key names) and `adapter_config.json` naming
/// `base` as the base model. `read` gives each adapter's values by snug name.
pub fn save_peft_adapter(
    dir: &Path,
    model: &ModelConfig,
    lora: &LoraConfig,
    base: Option<&str>,
    read: &dyn Fn(&str) -> Option<Vec<f32>>,
) -> Result<AdapterExport, NnError> {
    let layers = lora.layers(model)?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(2 * layers.len());
    let mut parameters = 0;
    for l in &layers {
        for (name, shape) in [
            (&l.lora_a, vec![lora.rank, l.in_features]),
            (&l.lora_b, vec![l.out_features, lora.rank]),
        ] {
            let values = read(name).ok_or_else(|| NnError::MissingTensor {
                path: dir.display().to_string(),
                name: name.clone(),
            })?;
            let numel: usize = shape.iter().product();
            if values.len() != numel {
                return Err(NnError::TensorShape {
                    path: dir.display().to_string(),
                    name: name.clone(),
                    expected: shape,
                    found: vec![values.len()],
                });
            }
            if let Some((index, value)) = crate::safetensors_file::first_non_finite(&values) {
                return Err(NnError::NonFiniteWeight {
                    path: dir.display().to_string(),
                    name: name.clone(),
                    index,
                    value,
                });
            }
            parameters += numel;
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((peft_key(model, name), shape, bytes));
        }
    }
    let views = tensors
        .iter()
        .map(|(key, shape, bytes)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .map(|v| (key.as_str(), v))
                .map_err(|e| NnError::WeightsFile {
                    path: dir.display().to_string(),
                    detail: format!("{key}: {e}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let config = PeftConfig {
        peft_type: "LORA".into(),
        task_type: Some("CAUSAL_LM".into()),
        r: lora.rank,
        lora_alpha: lora.alpha,
        target_modules: serde_json::json!(lora.module_names(model)),
        lora_dropout: 0.0,
        bias: none_bias(),
        // GPT-2's Conv1D stores its weight [in, out]: PEFT's merge transposes for it.
        fan_in_fan_out: matches!(model, ModelConfig::Gpt(_)),
        base_model_name_or_path: base.map(str::to_string),
        inference_mode: true,
        use_rslora: false,
        use_dora: false,
        modules_to_save: None,
        other: serde_json::Map::new(),
    };
    let text = serde_json::to_string_pretty(&config).map_err(|e| NnError::WeightsFile {
        path: dir.display().to_string(),
        detail: e.to_string(),
    })?;
    std::fs::create_dir_all(dir).map_err(|e| NnError::WeightsFile {
        path: dir.display().to_string(),
        detail: e.to_string(),
    })?;
    let weights = dir.join(ADAPTER_WEIGHTS_FILE);
    let config_path = dir.join(ADAPTER_CONFIG_FILE);
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    crate::hf_weights::write_atomically(&weights, |tmp| {
        safetensors::serialize_to_file(views, Some(metadata), tmp).map_err(|e| e.to_string())
    })?;
    crate::hf_weights::write_atomically(&config_path, |tmp| {
        std::fs::write(tmp, text.as_bytes()).map_err(|e| e.to_string())
    })?;
    let bytes = std::fs::metadata(&weights).map_or(0, |m| m.len());
    Ok(AdapterExport {
        weights,
        config: config_path,
        tensors: tensors.len(),
        parameters,
        bytes,
    })
}

/// Whether `path` is a PEFT adapter directory (it holds `adapter_config.json`).
/// [`check_adapter_files`] refuses a directory holding one of the adapter's files alone.
pub fn is_adapter_dir(path: &Path) -> bool {
    path.is_dir() && path.join(ADAPTER_CONFIG_FILE).exists()
}

/// Refuses a directory holding one of a PEFT adapter's two files without the other (a copy
/// that left one behind). Without its configuration the weights would go unread, and the
/// directory sample or train as its base model alone; without its weights nothing could be
/// applied. Either way the error names the directory and the missing file.
pub fn check_adapter_files(dir: &Path) -> Result<(), NnError> {
    let has = |f: &str| dir.join(f).exists();
    let (config, weights) = (has(ADAPTER_CONFIG_FILE), has(ADAPTER_WEIGHTS_FILE));
    let (present, missing, meaning) = match (config, weights) {
        (true, true) | (false, false) => return Ok(()),
        (false, true) => (
            ADAPTER_WEIGHTS_FILE,
            ADAPTER_CONFIG_FILE,
            "a LoRA adapter's weights without the configuration that says how to apply them, \
             which would leave the model its bare base",
        ),
        (true, false) => (
            ADAPTER_CONFIG_FILE,
            ADAPTER_WEIGHTS_FILE,
            "a LoRA adapter's configuration without its weights, so there is no adapter to apply",
        ),
    };
    Err(adapter_error(
        dir,
        format!(
            "holds {present} but no {missing} beside it: {meaning} (copy the adapter's \
             {missing} there, or remove {present} to use the base model)"
        ),
    ))
}

/// A PEFT adapter read from its directory. What its configuration sets that snug reads but
/// does not do is [`adapter_notes`]'.
#[derive(Debug, Clone)]
pub struct PeftAdapter {
    pub lora: LoraConfig,
    /// `base_model_name_or_path`, when the file names one.
    pub base: Option<String>,
    /// By snug name, PEFT's layout (`lora_A [r, in]`, `lora_B [out, r]`).
    pub tensors: Vec<(String, Vec<f32>)>,
}

fn adapter_error(path: &Path, detail: impl std::fmt::Display) -> NnError {
    NnError::Adapter {
        path: path.display().to_string(),
        detail: detail.to_string(),
    }
}

/// Reads only the configuration of the adapter in `dir`: its LoRA settings (as they apply
/// to `model`) and the base it names.
pub fn read_adapter_config(
    dir: &Path,
    model: &ModelConfig,
) -> Result<(LoraConfig, Option<String>), NnError> {
    let (path, c) = read_peft_config(dir)?;
    let lora = lora_config_of(&path, &c, model)?;
    Ok((lora, c.base_model_name_or_path))
}

/// What the configuration of the adapter in `dir` sets that snug reads but does not do, one
/// sentence each naming the file and field, for the caller to warn of: a `lora_dropout`
/// above zero (snug trains adapters without dropout; sampling and merging, as PEFT's
/// inference, use none either), and MiCA's initialisation (PEFT then trains `lora_A` alone;
/// snug trains both factors). Neither changes what the adapter computes as read. Empty for a
/// configuration snug follows in full.
pub fn adapter_notes(dir: &Path) -> Result<Vec<String>, NnError> {
    let (path, c) = read_peft_config(dir)?;
    let mut notes = Vec::new();
    if c.lora_dropout > 0.0 {
        notes.push(format!(
            "{}: `lora_dropout` is {}, but snug trains adapters without dropout: training \
             continues this adapter with none (sampling and merging, as PEFT's inference, use \
             none either)",
            path.display(),
            c.lora_dropout
        ));
    }
    if init_lora_weights(&c).is_some_and(|i| i.eq_ignore_ascii_case("mica")) {
        notes.push(format!(
            "{}: `init_lora_weights` is `mica`: PEFT keeps MiCA's `lora_B` frozen and trains \
             `lora_A` alone, but snug trains both: training continues this adapter with `lora_B` \
             trained too (sampling and merging compute what PEFT's do)",
            path.display()
        ));
    }
    Ok(notes)
}

/// `init_lora_weights`, where it names a method (`true` and `false` are PEFT's plain ones).
fn init_lora_weights(c: &PeftConfig) -> Option<&str> {
    c.other.get("init_lora_weights").and_then(|v| v.as_str())
}

/// `adapter_config.json` in `dir`, parsed: its path and fields.
fn read_peft_config(dir: &Path) -> Result<(PathBuf, PeftConfig), NnError> {
    use std::io::Read;
    let path = dir.join(ADAPTER_CONFIG_FILE);
    crate::model::regular_file_len(&path).map_err(|e| adapter_error(&path, e))?;
    let mut text = String::new();
    std::fs::File::open(&path)
        .and_then(|f| {
            f.take(MAX_ADAPTER_CONFIG_BYTES + 1)
                .read_to_string(&mut text)
        })
        .map_err(|e| adapter_error(&path, e))?;
    if text.len() as u64 > MAX_ADAPTER_CONFIG_BYTES {
        return Err(adapter_error(
            &path,
            "too large for an adapter configuration",
        ));
    }
    let c: PeftConfig = serde_json::from_str(&text).map_err(|e| adapter_error(&path, e))?;
    Ok((path, c))
}

/// The LoRA settings `c` (read from `path`) give `model`, or an error naming the field snug
/// cannot follow.
fn lora_config_of(path: &Path, c: &PeftConfig, model: &ModelConfig) -> Result<LoraConfig, NnError> {
    if c.peft_type != "LORA" {
        return Err(adapter_error(
            path,
            format!("`peft_type` is `{}`; snug reads LORA adapters", c.peft_type),
        ));
    }
    // Other strings, and none, PEFT reads with its plain `PeftModel`: the causal LM's.
    if let Some(task) = c.task_type.as_deref().filter(|t| OTHER_TASKS.contains(t)) {
        return Err(adapter_error(
            path,
            format!(
                "`task_type` is `{task}`: an adapter for a model with another head than a \
                 causal LM's, which snug's models are"
            ),
        ));
    }
    let refuse = |field: &str, what: &str| {
        adapter_error(
            path,
            format!("`{field}` is {what}, which snug does not train"),
        )
    };
    if c.use_dora {
        return Err(refuse("use_dora", "true (DoRA)"));
    }
    if c.bias != "none" {
        return Err(refuse("bias", &format!("`{}`", c.bias)));
    }
    if c.modules_to_save.as_ref().is_some_and(is_set) {
        return Err(refuse("modules_to_save", "set"));
    }
    // PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA start from base weights they changed: over the
    // original base the adapter computes something else (unless PEFT converted it on saving,
    // which then records the plain initialisation).
    if let Some(init) = init_lora_weights(c) {
        if ["pissa", "olora", "corda", "loftq", "lora_ga"]
            .iter()
            .any(|m| init.to_ascii_lowercase().starts_with(m))
        {
            return Err(refuse(
                "init_lora_weights",
                &format!("`{init}` (trained against base weights it changed)"),
            ));
        }
    }
    if let Some((field, why, value)) = REFUSED_FIELDS
        .iter()
        .find_map(|&(f, why)| Some((f, why, c.other.get(f).filter(|v| is_set(v))?)))
    {
        return Err(adapter_error(
            path,
            format!(
                "`{field}` is set ({value}): {why}, which snug does not do: it adapts the same \
                 modules in every layer with one rank and one scale, as plain LoRA"
            ),
        ));
    }
    // PEFT's nn.Dropout refuses a probability above one (at or below zero it adds none).
    if c.lora_dropout > 1.0 {
        return Err(adapter_error(
            path,
            format!(
                "`lora_dropout` is {}; a dropout probability is at most 1",
                c.lora_dropout
            ),
        ));
    }
    let target = ModuleSelector::target_modules(&c.target_modules);
    let exclude = c
        .other
        .get("exclude_modules")
        .filter(|v| is_set(v))
        .map(ModuleSelector::exclude_modules)
        .transpose();
    let targets = match (target, exclude) {
        (Ok(ModuleSelector::AllLinear), Ok(None)) => LoraTargets::AllLinear,
        (Ok(target), Ok(exclude)) => LoraTargets::Modules(
            peft_target_names(model, &target, exclude.as_ref())
                .map_err(|e| adapter_error(path, e))?,
        ),
        (Err(e), _) | (_, Err(e)) => return Err(adapter_error(path, e)),
    };
    let lora = LoraConfig {
        rank: c.r,
        // rsLoRA scales by alpha / √r; snug's scale is alpha / r, so the same scale is the
        // alpha √r (an export writes that alpha, with the plain scale).
        alpha: if c.use_rslora {
            c.lora_alpha * (c.r as f32).sqrt()
        } else {
            c.lora_alpha
        },
        targets,
    };
    lora.layers(model).map_err(|e| adapter_error(path, e))?;
    Ok(lora)
}

/// A PEFT module selector, `target_modules` or `exclude_modules`, as PEFT's
/// `check_target_module_exists` applies it to each module's path.
#[derive(Debug)]
enum ModuleSelector {
    /// `all-linear` (any case): every linear layer of every block, not the LM head.
    AllLinear,
    /// Module names or paths ([`peft_matches`]).
    Names(Vec<String>),
    /// Any other string: a regular expression the whole path must match (Python's
    /// `re.fullmatch`), kept as written to name it.
    Pattern(String, regex::Regex),
}

impl ModuleSelector {
    fn target_modules(v: &serde_json::Value) -> Result<ModuleSelector, String> {
        match v {
            serde_json::Value::String(s) if s.eq_ignore_ascii_case("all-linear") => {
                Ok(ModuleSelector::AllLinear)
            }
            _ => Self::read("target_modules", v),
        }
    }

    /// PEFT has no shorthand here: a string is a pattern.
    fn exclude_modules(v: &serde_json::Value) -> Result<ModuleSelector, String> {
        Self::read("exclude_modules", v)
    }

    fn read(field: &str, v: &serde_json::Value) -> Result<ModuleSelector, String> {
        match v {
            serde_json::Value::String(s) => Ok(ModuleSelector::Pattern(
                s.clone(),
                full_match_regex(field, s)?,
            )),
            serde_json::Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .map(ModuleSelector::Names)
                .ok_or_else(|| format!("`{field}` holds a non-string")),
            other => Err(format!(
                "`{field}` is {other}; snug reads a list of module names, all-linear or a \
                 regular expression"
            )),
        }
    }

    /// Whether the module at `path` is selected; `linear`: whether it is a block's linear
    /// layer.
    fn matches(&self, path: &str, linear: bool) -> bool {
        match self {
            ModuleSelector::AllLinear => linear,
            ModuleSelector::Names(n) => n.iter().any(|t| peft_matches(t, path)),
            ModuleSelector::Pattern(_, re) => re.is_match(path),
        }
    }

    /// The field as an error names it, with its pattern.
    fn describe(&self, field: &str) -> String {
        match self {
            ModuleSelector::Pattern(p, _) => format!("`{field}` `{p}`"),
            _ => format!("`{field}`"),
        }
    }
}

/// `pattern` compiled to match a whole module path, as Python's `re.fullmatch`, or an error
/// naming `field`, the pattern and what is wrong: syntax snug's `regex` cannot compile
/// (Python's look-arounds, back-references), or reads otherwise than Python
/// ([`read_otherwise_than_python`]).
fn full_match_regex(field: &str, pattern: &str) -> Result<regex::Regex, String> {
    if let Some(what) = read_otherwise_than_python(pattern) {
        return Err(format!(
            "`{field}` `{pattern}` holds {what}, which Python's `re` (PEFT's) reads otherwise \
             than snug's regular expressions: snug cannot match it as PEFT does"
        ));
    }
    // Compiled alone first, so an error points into the pattern as written, and one that
    // closes a group early cannot escape the anchors.
    regex::Regex::new(pattern)
        .and_then(|_| regex::Regex::new(&format!("^(?:{pattern})$")))
        .map_err(|e| {
            format!("`{field}` `{pattern}` is not a regular expression snug can read: {e}")
        })
}

/// The first construct of `pattern` that the `regex` crate and Python's `re` both accept but
/// read differently: `\<`, `\>` and `\b{...}` are word boundaries to `regex` but characters
/// to Python, and a `[`, `&&`, `--` or `~~` inside a class nests or combines classes
/// (`[[:alpha:]]`) to `regex` but is characters to Python.
fn read_otherwise_than_python(pattern: &str) -> Option<&'static str> {
    let c: Vec<char> = pattern.chars().collect();
    // Inside a class: where its members start (a `]` there is one).
    let mut class: Option<usize> = None;
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        match (c[i], class) {
            ('\\', None) if matches!(next, Some('<' | '>')) => {
                return Some("`\\<` or `\\>` (a word boundary)")
            }
            ('\\', None) if matches!(next, Some('b' | 'B')) && c.get(i + 2) == Some(&'{') => {
                return Some("`\\b{...}` (a word boundary)")
            }
            // The escaped character, whatever it is.
            ('\\', _) => i += 1,
            ('[', None) => {
                let first = if next == Some('^') { i + 2 } else { i + 1 };
                class = Some(first);
                i = first;
                continue;
            }
            (']', Some(first)) if i > first => class = None,
            ('[', Some(_)) => return Some("a `[` inside a character class (a nested class)"),
            (op @ ('&' | '-' | '~'), Some(_)) if next == Some(op) => {
                return Some("`&&`, `--` or `~~` inside a character class (a class operation)")
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The path Hugging Face gives the module of snug's weight `name`, which PEFT matches
/// `target_modules` against: `model.layers.0.self_attn.q_proj`, GPT-2's
/// `transformer.h.0.attn.c_attn`.
fn hf_module_path(model: &ModelConfig, name: &str) -> String {
    let key = peft_key(model, name.strip_suffix(".weight").unwrap_or(name));
    match key.strip_prefix("base_model.model.") {
        Some(path) => path.to_string(),
        None => key,
    }
}

/// Every module of `model` as transformers' `named_modules()` lists them (less the root),
/// which PEFT matches `target_modules` against: those holding parameters and their parents,
/// and those holding none (activations, dropouts, the rotary table, an LM head tied to the
/// embedding).
fn hf_modules(model: &ModelConfig) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    let mut add = |path: String| {
        if seen.insert(path.clone()) {
            out.push(path);
        }
    };
    for (name, _) in model.parameter_shapes() {
        let key = peft_key(model, &name);
        // `model.layers.0.input_layernorm.weight` (a weight, or a bias) → its module.
        let param = key.strip_prefix("base_model.model.").unwrap_or(&key);
        let module = param.rsplit_once('.').map_or(param, |(m, _)| m);
        for (i, _) in module.match_indices('.') {
            add(module[..i].to_string());
        }
        add(module.to_string());
    }
    let (layers, shared, per_layer): (usize, &[&str], &[&str]) = match model {
        ModelConfig::Gpt(g) => (
            g.n_layer,
            &["transformer.drop"],
            &[
                "transformer.h.{}.attn.attn_dropout",
                "transformer.h.{}.attn.resid_dropout",
                "transformer.h.{}.mlp.act",
                "transformer.h.{}.mlp.dropout",
            ],
        ),
        ModelConfig::Llama(l) => (
            l.n_layer,
            &["model.rotary_emb"],
            &["model.layers.{}.mlp.act_fn"],
        ),
    };
    for m in shared.iter().chain(&["lm_head"]) {
        add(m.to_string());
    }
    for i in 0..layers {
        for m in per_layer {
            add(m.replace("{}", &i.to_string()));
        }
    }
    out
}

/// Whether PEFT's `check_target_module_exists` matches module `path` to `target`: the same
/// path, or one ending in `.` and the target.
fn peft_matches(target: &str, path: &str) -> bool {
    path == target
        || path
            .strip_suffix(target)
            .is_some_and(|head| head.ends_with('.'))
}

/// The module names snug adapts (`q_proj`, ...), in [`linear_modules`]' order, for the
/// modules of `model` that PEFT adapts with `target` less `exclude`: PEFT matches each module
/// path of the model ([`hf_modules`]) to them. PEFT writes a list as module names, as the
/// paths of single modules (`all-linear` is saved as every linear layer's path) or as the
/// shortest suffixes that pick out the same modules (a long list); each of these must end in
/// one of the model's linear module names and match one of its layers. A pattern may match
/// anything, but must match a linear layer, and nothing else: PEFT would adapt an embedding
/// or the LM head, which snug does not, and refuses other modules. Together they must adapt
/// all of the model's layers of a name or none: snug adapts the same modules in every layer,
/// so a set that differs by layer is refused, naming a layer adapted and one of the same name
/// that is not. An empty list stays empty (refused by [`LoraConfig::layers`]).
fn peft_target_names(
    model: &ModelConfig,
    target: &ModuleSelector,
    exclude: Option<&ModuleSelector>,
) -> Result<Vec<String>, String> {
    let known = linear_modules(model);
    let all = LoraConfig {
        rank: 1,
        alpha: 1.0,
        targets: LoraTargets::AllLinear,
    };
    // Every layer that could carry an adapter: snug name, module path.
    let linear: Vec<(String, String)> = model
        .parameter_shapes()
        .into_iter()
        .filter(|(name, shape)| shape.len() == 2 && all.selects(model, name))
        .map(|(name, _)| {
            let path = hf_module_path(model, &name);
            (name, path)
        })
        .collect();
    let example = linear.first().map_or("", |(_, p)| p.as_str());
    if let ModuleSelector::Names(targets) = target {
        for t in targets {
            let last = t.rsplit('.').next().unwrap_or(t);
            if !known.contains(&last) || !linear.iter().any(|(_, p)| peft_matches(t, p)) {
                return Err(format!(
                    "`target_modules`: `{t}` names no linear layer of this model (its linear \
                     layers: {}, or paths to them such as `{example}`; or all-linear)",
                    known.join(", ")
                ));
            }
        }
    }
    let is_linear = |path: &str| linear.iter().any(|(_, p)| p == path);
    let excluded = |path: &str| exclude.is_some_and(|e| e.matches(path, is_linear(path)));
    let adapted = |path: &str| target.matches(path, is_linear(path)) && !excluded(path);
    if let Some(other) = hf_modules(model)
        .into_iter()
        .find(|p| !is_linear(p) && adapted(p))
    {
        let what = if other == "lm_head" {
            "the LM head, which PEFT would adapt"
        } else if ["embed_tokens", "wte", "wpe"].contains(&other.rsplit('.').next().unwrap_or("")) {
            "an embedding, which PEFT would adapt"
        } else {
            "no linear layer (PEFT refuses to adapt it)"
        };
        return Err(format!(
            "{} matches `{other}`, {what}: snug adapts only the linear layers of the blocks",
            target.describe("target_modules")
        ));
    }
    let kind = |name: &str| module_of(name).unwrap_or_default().to_string();
    let names: Vec<String> = known
        .iter()
        .map(|k| k.to_string())
        .filter(|k| linear.iter().any(|(n, p)| &kind(n) == k && adapted(p)))
        .collect();
    let empty_list = matches!(target, ModuleSelector::Names(t) if t.is_empty());
    if names.is_empty() && !empty_list {
        let exclude = exclude.filter(|_| linear.iter().any(|(_, p)| target.matches(p, true)));
        return Err(match exclude {
            Some(e) => format!(
                "{} excludes every layer {} adapts",
                e.describe("exclude_modules"),
                target.describe("target_modules")
            ),
            None => format!(
                "{} matches no linear layer of this model: PEFT matches it against a whole \
                 module path, such as `{example}` (its linear layers: {})",
                target.describe("target_modules"),
                known.join(", ")
            ),
        });
    }
    let left_out: Vec<&(String, String)> = linear
        .iter()
        .filter(|(n, p)| names.contains(&kind(n)) && !adapted(p))
        .collect();
    if let Some((name, path)) = left_out.first() {
        let name_kind = kind(name);
        let like = linear
            .iter()
            .find(|(n, p)| kind(n) == name_kind && adapted(p))
            .map_or("", |(_, p)| p.as_str());
        let more = match left_out.len() - 1 {
            0 => String::new(),
            n => format!(" (nor {n} more layers)"),
        };
        let less = match exclude {
            Some(e) => format!(" less {}", e.describe("exclude_modules")),
            None => String::new(),
        };
        return Err(format!(
            "{}{less} adapts `{like}` but not `{path}`{more}: snug adapts all of a model's \
             `{name_kind}` layers or none, the same modules in every layer, so it cannot apply \
             this adapter as PEFT does",
            target.describe("target_modules")
        ));
    }
    Ok(names)
}

/// Reads the PEFT adapter in `dir` for `model`: every adapter its configuration implies must
/// be there with its shape, and nothing else.
pub fn load_peft_adapter(dir: &Path, model: &ModelConfig) -> Result<PeftAdapter, NnError> {
    let (config_path, c) = read_peft_config(dir)?;
    let lora = lora_config_of(&config_path, &c, model)?;
    let base = c.base_model_name_or_path;
    let layers = lora.layers(model)?;
    let path = dir.join(ADAPTER_WEIGHTS_FILE);
    let len = crate::model::regular_file_len(&path).map_err(|e| adapter_error(&path, e))?;
    let bytes = std::fs::read(&path).map_err(|e| adapter_error(&path, e))?;
    if bytes.len() as u64 != len {
        return Err(adapter_error(&path, "changed while being read"));
    }
    let st = crate::safetensors_file::deserialize(&bytes).map_err(|e| adapter_error(&path, e))?;
    let mut expected: HashMap<String, (String, Vec<usize>)> = HashMap::new();
    for l in &layers {
        expected.insert(
            peft_key(model, &l.lora_a),
            (l.lora_a.clone(), vec![lora.rank, l.in_features]),
        );
        expected.insert(
            peft_key(model, &l.lora_b),
            (l.lora_b.clone(), vec![l.out_features, lora.rank]),
        );
    }
    let mut seen = BTreeSet::new();
    let mut tensors = Vec::with_capacity(expected.len());
    for (key, view) in st.tensors() {
        let Some((name, shape)) = expected.get(&key) else {
            return Err(NnError::UnexpectedTensor {
                path: path.display().to_string(),
                name: key,
            });
        };
        if view.shape() != shape.as_slice() {
            return Err(NnError::TensorShape {
                path: path.display().to_string(),
                name: key,
                expected: shape.clone(),
                found: view.shape().to_vec(),
            });
        }
        let Some(width) = crate::hf_weights::element_bytes(view.dtype()) else {
            return Err(NnError::TensorDType {
                path: path.display().to_string(),
                name: key,
                dtype: format!("{:?}", view.dtype()),
            });
        };
        let numel: usize = shape.iter().product();
        if view.data().len() != numel * width {
            return Err(adapter_error(&path, format!("tensor `{key}` is truncated")));
        }
        let mut values = vec![0f32; numel];
        crate::hf_weights::decode_into(view.dtype(), view.data(), &mut values);
        // Decoded values, so an f64 too large for f32 is caught as the infinity it became;
        // otherwise a NaN surfaces steps later as a diverged loss, or blamed on the base
        // weight it was merged into.
        if let Some((index, value)) = crate::safetensors_file::first_non_finite(&values) {
            return Err(NnError::NonFiniteWeight {
                path: path.display().to_string(),
                name: key,
                index,
                value,
            });
        }
        seen.insert(key);
        tensors.push((name.clone(), values));
    }
    if let Some(missing) = expected.keys().find(|k| !seen.contains(*k)) {
        return Err(NnError::MissingTensor {
            path: path.display().to_string(),
            name: missing.clone(),
        });
    }
    // Parameter order, whatever the file's.
    let order: HashMap<&str, usize> = layers
        .iter()
        .flat_map(|l| [l.lora_a.as_str(), l.lora_b.as_str()])
        .enumerate()
        .map(|(i, n)| (n, i))
        .collect();
    tensors.sort_by_key(|(n, _)| order.get(n.as_str()).copied().unwrap_or(usize::MAX));
    Ok(PeftAdapter {
        lora,
        base,
        tensors,
    })
}

/// Folds each adapter into its base weight, `W += scale · (B·A)ᵀ` (snug stores `W` as
/// `[in, out]`), and removes the adapters from `params`: the merged model computes what the
/// adapted one did, with no branch.
pub fn merge_adapters(
    model: &ModelConfig,
    lora: &LoraConfig,
    params: &mut Vec<(String, Vec<f32>)>,
) -> Result<(), NnError> {
    let layers = lora.layers(model)?;
    let scale = lora.scale();
    let r = lora.rank;
    let mut by_name: HashMap<String, Vec<f32>> = params.drain(..).collect();
    let missing = |name: &str| NnError::MissingTensor {
        path: "the adapted weights being merged".into(),
        name: name.to_string(),
    };
    for l in &layers {
        let a = by_name
            .remove(&l.lora_a)
            .ok_or_else(|| missing(&l.lora_a))?;
        let b = by_name
            .remove(&l.lora_b)
            .ok_or_else(|| missing(&l.lora_b))?;
        let w = by_name
            .get_mut(&l.weight)
            .ok_or_else(|| missing(&l.weight))?;
        let (n_in, n_out) = (l.in_features, l.out_features);
        if a.len() != r * n_in || b.len() != n_out * r || w.len() != n_in * n_out {
            return Err(NnError::Lora {
                detail: format!("`{}`'s adapters do not match its shape", l.weight),
            });
        }
        merge_layer(w, &a, &b, n_in, r, scale);
    }
    // Back in the model's parameter order.
    for (name, _) in model.parameter_shapes() {
        if let Some(v) = by_name.remove(&name) {
            params.push((name, v));
        }
    }
    if let Some(name) = by_name.keys().next() {
        return Err(NnError::UnexpectedTensor {
            path: "the adapted weights being merged".into(),
            name: name.clone(),
        });
    }
    Ok(())
}

/// A PEFT adapter ready to fold into its base one weight at a time, as a model is read from
/// its files: no copy of the whole model beside the one being loaded.
#[derive(Debug)]
pub struct AdapterFolds {
    scale: f32,
    rank: usize,
    /// By the base weight each adapts: its input width, `lora_A [r, in]`, `lora_B [out, r]`.
    by_weight: HashMap<String, (usize, Vec<f32>, Vec<f32>)>,
}

impl AdapterFolds {
    /// `adapter`'s layers (as [`load_peft_adapter`] read and checked them) by their weights.
    pub fn new(model: &ModelConfig, adapter: PeftAdapter) -> Result<AdapterFolds, NnError> {
        let mut tensors: HashMap<String, Vec<f32>> = adapter.tensors.into_iter().collect();
        let mut by_weight = HashMap::new();
        for l in adapter.lora.layers(model)? {
            let mut take = |name: &str| {
                tensors.remove(name).ok_or_else(|| NnError::MissingTensor {
                    path: "the adapter being folded".into(),
                    name: name.to_string(),
                })
            };
            let (a, b) = (take(&l.lora_a)?, take(&l.lora_b)?);
            by_weight.insert(l.weight, (l.in_features, a, b));
        }
        Ok(AdapterFolds {
            scale: adapter.lora.scale(),
            rank: adapter.lora.rank,
            by_weight,
        })
    }

    /// Folds the adapter of weight `name` into `w` (`[in, out]`), if it has one: `true` then.
    pub fn fold(&mut self, name: &str, w: &mut [f32]) -> Result<bool, NnError> {
        let Some((n_in, a, b)) = self.by_weight.remove(name) else {
            return Ok(false);
        };
        if w.len() != n_in * (b.len() / self.rank.max(1)) {
            return Err(NnError::Lora {
                detail: format!("`{name}`'s adapters do not match its shape"),
            });
        }
        merge_layer(w, &a, &b, n_in, self.rank, self.scale);
        Ok(true)
    }

    /// Every adapter was folded: one whose weight was never read would leave the model
    /// sampled without it.
    pub fn finish(self) -> Result<(), NnError> {
        match self.by_weight.keys().min() {
            Some(name) => Err(NnError::Lora {
                detail: format!("the adapter of `{name}` was not folded: no such weight was read"),
            }),
            None => Ok(()),
        }
    }
}

/// `w [in, out] += scale · (b [out, r] · a [r, in])ᵀ`.
fn merge_layer(w: &mut [f32], a: &[f32], b: &[f32], n_in: usize, r: usize, scale: f32) {
    let n_out = w.len() / n_in.max(1);
    for i in 0..n_in {
        for o in 0..n_out {
            let mut s = 0f32;
            for k in 0..r {
                s += b[o * r + k] * a[k * n_in + i];
            }
            w[i * n_out + o] += scale * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_adds_the_scaled_product_transposed() {
        // in 2, out 3, rank 2: B·A = [[1·1+2·3, 1·2+2·4], [0, 0], [-1·1+1·3, -1·2+1·4]]
        //                           = [[7, 10], [0, 0], [2, 2]]   ([out, in]).
        let a = [1.0, 2.0, 3.0, 4.0]; // [r, in]
        let b = [1.0, 2.0, 0.0, 0.0, -1.0, 1.0]; // [out, r]
        let mut w = [0.5, 0.5, 0.5, -1.0, -1.0, -1.0]; // [in, out]
        merge_layer(&mut w, &a, &b, 2, 2, 0.5);
        assert_eq!(w, [0.5 + 3.5, 0.5, 0.5 + 1.0, -1.0 + 5.0, -1.0, -1.0 + 1.0]);
    }

    #[test]
    fn merging_a_whole_model_folds_every_adapter_and_keeps_the_rest() {
        let model = ModelConfig::preset("llama-tiny").unwrap();
        let lora = LoraConfig::new(&model, 2, Some(4.0), Some("q_proj".parse().unwrap()));
        let layers = lora.layers(&model).unwrap();
        let mut params = model.init_parameters(1);
        let base = params.clone();
        let mut adapters = init_adapters(&layers, 2, 3);
        // B nonzero, so the merge changes something.
        for (name, v) in adapters.iter_mut() {
            if name.contains("lora_B") {
                v.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = i as f32 * 1e-3);
            }
        }
        params.extend(adapters.iter().cloned());
        merge_adapters(&model, &lora, &mut params).unwrap();
        let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        let want: Vec<(String, Vec<usize>)> = model.parameter_shapes();
        assert_eq!(
            names,
            want.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
        );
        let by: HashMap<&str, &Vec<f32>> = adapters.iter().map(|(n, v)| (n.as_str(), v)).collect();
        for ((name, merged), (_, orig)) in params.iter().zip(&base) {
            let Some(l) = layers.iter().find(|l| &l.weight == name) else {
                assert_eq!(merged, orig, "{name} untouched");
                continue;
            };
            let mut expect = orig.clone();
            merge_layer(
                &mut expect,
                by[l.lora_a.as_str()],
                by[l.lora_b.as_str()],
                l.in_features,
                2,
                2.0,
            );
            assert_eq!(merged, &expect);
            assert_ne!(merged, orig);
        }
        // Folded one weight at a time as a model is read: the same weights, bit for bit; a
        // weight never read leaves its adapter unfolded, which is an error.
        let adapter = || PeftAdapter {
            lora: lora.clone(),
            base: None,
            tensors: adapters.clone(),
        };
        let mut folds = AdapterFolds::new(&model, adapter()).unwrap();
        for ((name, merged), (_, orig)) in params.iter().zip(&base) {
            let mut w = orig.clone();
            folds.fold(name, &mut w).unwrap();
            assert_eq!(&w, merged, "{name}");
        }
        folds.finish().unwrap();
        let mut folds = AdapterFolds::new(&model, adapter()).unwrap();
        let mut w = base[0].1.clone();
        folds.fold(&base[0].0, &mut w).unwrap();
        assert!(matches!(folds.finish(), Err(NnError::Lora { .. })));
    }

    /// Fields that change what an adapter computes are refused by name where they are set,
    /// and read as PEFT writes them unset (null, false, `{}`).
    #[test]
    fn adapter_configs_with_fields_snug_does_not_train_are_refused_by_name() {
        let model = ModelConfig::preset("llama-tiny").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let base = serde_json::json!({
            "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "alpha_pattern": {}, "rank_pattern": {}, "layers_to_transform": null,
            "exclude_modules": null, "lora_bias": false, "target_parameters": null,
            "layer_replication": null, "trainable_token_indices": null, "use_qalora": false,
            "layers_pattern": null, "use_dora": false, "use_rslora": false,
        });
        let read = |config: &serde_json::Value| {
            std::fs::write(dir.path().join(ADAPTER_CONFIG_FILE), config.to_string()).unwrap();
            read_adapter_config(dir.path(), &model)
        };
        let (lora, _) = read(&base).unwrap();
        assert_eq!((lora.rank, lora.alpha), (4, 8.0));
        // rsLoRA's scale, 8 / √4 = 4, is snug's alpha / r with alpha 16.
        let mut rs = base.clone();
        rs["use_rslora"] = true.into();
        let (lora, _) = read(&rs).unwrap();
        assert_eq!((lora.rank, lora.alpha), (4, 16.0));
        // Initialisations that leave the base as it was read as usual.
        for init in [serde_json::json!(true), serde_json::json!("gaussian")] {
            let mut config = base.clone();
            config["init_lora_weights"] = init;
            read(&config).unwrap();
        }
        for (field, value) in [
            ("alpha_pattern", serde_json::json!({"v_proj": 32})),
            ("rank_pattern", serde_json::json!({"v_proj": 2})),
            ("layers_to_transform", serde_json::json!([1])),
            ("lora_bias", serde_json::json!(true)),
            ("target_parameters", serde_json::json!(["mlp.experts"])),
            ("layer_replication", serde_json::json!([[0, 1]])),
            ("trainable_token_indices", serde_json::json!([0])),
            ("use_qalora", serde_json::json!(true)),
            ("alora_invocation_tokens", serde_json::json!([5, 6])),
            ("init_lora_weights", serde_json::json!("pissa_niter_4")),
            ("init_lora_weights", serde_json::json!("olora")),
            ("use_dora", serde_json::json!(true)),
            ("bias", serde_json::json!("all")),
            ("modules_to_save", serde_json::json!(["lm_head"])),
        ] {
            let mut config = base.clone();
            config[field] = value;
            match read(&config) {
                Err(NnError::Adapter { path, detail }) => {
                    assert!(path.ends_with(ADAPTER_CONFIG_FILE), "{path}");
                    assert!(detail.contains(&format!("`{field}`")), "{field}: {detail}");
                }
                other => panic!("{field}: expected a refusal, got {other:?}"),
            }
        }
    }

    #[test]
    fn targets_parse_and_name_their_layers() {
        let llama = ModelConfig::preset("llama-tiny").unwrap();
        let gpt = ModelConfig::preset("tiny").unwrap();
        let q = LoraConfig::new(&llama, 4, None, None);
        assert_eq!(q.alpha, 8.0);
        assert_eq!(q.targets.to_string(), "q_proj,v_proj");
        assert!(q.selects(&llama, "model.layers.3.self_attn.v_proj.weight"));
        assert!(!q.selects(&llama, "model.layers.3.self_attn.k_proj.weight"));
        let all = LoraConfig::new(&gpt, 4, None, Some("all-linear".parse().unwrap()));
        let names: Vec<String> = all
            .layers(&gpt)
            .unwrap()
            .into_iter()
            .map(|l| l.weight)
            .collect();
        assert_eq!(
            &names[..4],
            [
                "h.0.attn.c_attn.weight",
                "h.0.attn.c_proj.weight",
                "h.0.mlp.c_fc.weight",
                "h.0.mlp.c_proj.weight"
            ]
        );
        assert!(!all.selects(&gpt, "wte.weight"));
        assert!("q_proj, v_proj".parse::<LoraTargets>().is_ok());
        assert!("q_proj;v".parse::<LoraTargets>().is_err());
        assert!("".parse::<LoraTargets>().is_err());
    }
}
