//! Training configuration. Defaults, then a TOML file (`[model]` and `[train]` sections), then
//! command-line flags: each layer overrides the one before. Every flag has a TOML key of the
//! same name.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use snug_compile::StepShape;
use snug_graph::{DType, Sharding, Target};
use snug_nn::ModelConfig;

pub use snug_compile::{OptimizerKind, Pass, Remat, StepConfig};
use snug_graph::ops::QuantizeBase;

pub use crate::device::DeviceSpec;
use crate::{DataSource, TrainError};

/// `[model]`: a preset and optional overrides of its fields. With the `clap` feature, also the
/// flags that set them (`--preset`, `--vocab`, `--hf-config`); the shape overrides are TOML
/// keys only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Model preset: tiny, char-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-tiny,
    /// llama-7b, llama-13b, llama-70b.
    #[cfg_attr(feature = "clap", arg(long))]
    pub preset: Option<String>,
    #[cfg_attr(feature = "clap", arg(skip))]
    pub n_layer: Option<usize>,
    #[cfg_attr(feature = "clap", arg(skip))]
    pub n_head: Option<usize>,
    #[cfg_attr(feature = "clap", arg(skip))]
    pub n_embd: Option<usize>,
    #[cfg_attr(feature = "clap", arg(skip))]
    pub block_size: Option<usize>,
    /// Override the model's vocabulary size.
    #[cfg_attr(feature = "clap", arg(long = "vocab", value_name = "VOCAB"))]
    pub vocab_size: Option<usize>,
    /// A Hugging Face config.json (GPT-2, Llama, Mistral or Qwen2), or a model directory
    /// holding one, instead of a preset.
    #[cfg_attr(feature = "clap", arg(long, value_name = "CONFIG_JSON"))]
    pub hf_config: Option<PathBuf>,
    /// The text of `hf_config` as read when the run was set up: a checkpoint carries its model,
    /// so resuming, sampling or exporting it never needs that directory again.
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_config_text: Option<String>,
}

/// Declares every `[train]` key once, in the order the TOML errors list them: its type, its
/// documentation (which is also its flag's `--help`), and the commands that take it as a flag:
/// `#[flag(step, ...)]` every command that compiles a step (`plan`, `fit`, `profile`, `train`),
/// `#[flag(run, ...)]` only `train`, `#[key]` none (the `...` are the flag's clap attributes).
/// Expands to [`TrainSection`] and, with the `clap` feature, to [`StepFlags`] and [`RunFlags`].
macro_rules! train_keys {
    // Sorts each key, as `{ [docs] [flag attributes] field: type }`, into the section and the
    // flags that declare it.
    (@sort [$($key:tt)*] [$($step:tt)*] [$($run:tt)*]
        $(#[doc = $doc:literal])* #[flag(step $(, $arg:meta)*)] $field:ident: $ty:ty,
        $($rest:tt)*) => {
        train_keys!(@sort
            [$($key)* { [$(#[doc = $doc])*] [] $field: $ty }]
            [$($step)* { [$(#[doc = $doc])*] [$($arg),*] $field: $ty }]
            [$($run)*]
            $($rest)*);
    };
    (@sort [$($key:tt)*] [$($step:tt)*] [$($run:tt)*]
        $(#[doc = $doc:literal])* #[flag(run $(, $arg:meta)*)] $field:ident: $ty:ty,
        $($rest:tt)*) => {
        train_keys!(@sort
            [$($key)* { [$(#[doc = $doc])*] [] $field: $ty }]
            [$($step)*]
            [$($run)* { [$(#[doc = $doc])*] [$($arg),*] $field: $ty }]
            $($rest)*);
    };
    (@sort [$($key:tt)*] [$($step:tt)*] [$($run:tt)*]
        $(#[doc = $doc:literal])* #[key] $field:ident: $ty:ty,
        $($rest:tt)*) => {
        train_keys!(@sort
            [$($key)* { [$(#[doc = $doc])*] [] $field: $ty }]
            [$($step)*]
            [$($run)*]
            $($rest)*);
    };
    (@sort
        [$({ [$(#[$kdoc:meta])*] [] $kfield:ident: $kty:ty })*]
        [$({ [$(#[$sdoc:meta])*] [$($sarg:meta),*] $sfield:ident: $sty:ty })*]
        [$({ [$(#[$rdoc:meta])*] [$($rarg:meta),*] $rfield:ident: $rty:ty })*]) => {
        /// `[train]`: every key is optional; missing keys keep their defaults.
        // The docs are also `--help`, which shows placeholders such as `<step>` as they are.
        #[allow(rustdoc::invalid_html_tags)]
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct TrainSection {
            $($(#[$kdoc])* pub $kfield: Option<$kty>,)*
        }

        /// The flags of every command that compiles a training step, each setting the
        /// [`TrainSection`] key of its name.
        #[cfg(feature = "clap")]
        #[derive(Debug, Clone, Default, clap::Args)]
        pub struct StepFlags {
            $($(#[$sdoc])* #[arg($($sarg),*)] pub $sfield: Option<$sty>,)*
        }

        /// The flags only `snug train` adds, each setting the [`TrainSection`] key of its name.
        #[cfg(feature = "clap")]
        #[allow(rustdoc::invalid_html_tags)]
        #[derive(Debug, Clone, Default, clap::Args)]
        pub struct RunFlags {
            $($(#[$rdoc])* #[arg($($rarg),*)] pub $rfield: Option<$rty>,)*
        }

        #[cfg(feature = "clap")]
        impl TrainSection {
            /// The keys `step` and `run` set; the others unset.
            pub fn from_flags(step: StepFlags, run: RunFlags) -> TrainSection {
                TrainSection {
                    $($sfield: step.$sfield,)*
                    $($rfield: run.$rfield,)*
                    ..TrainSection::default()
                }
            }
        }
    };
    ($($keys:tt)*) => {
        train_keys!(@sort [] [] [] $($keys)*);
    };
}

train_keys! {
    /// Text file, or directory prepared by `snug prepare`, to train on (default: built-in
    /// generated addition data).
    #[flag(step, long)]
    data: PathBuf,
    /// Optimizer steps to run (in all, counting steps before a resume).
    #[flag(run, long)]
    steps: u64,
    /// Sequences per optimizer step. (The command line's `--batch` also takes `auto`.)
    #[key]
    batch: usize,
    /// Tokens per sequence (default: the model's block size).
    #[flag(step, long)]
    block: usize,
    /// Peak learning rate (default 3e-3).
    #[flag(run, long, allow_negative_numbers = true)]
    lr: f32,
    /// Learning rate at the end of the cosine decay (default: a tenth of `lr`).
    #[flag(run, long, allow_negative_numbers = true)]
    min_lr: f32,
    /// Steps of linear warmup (default 20), from lr/warmup at step 1 to lr at this step; a
    /// cosine decay to --min-lr at the last step follows.
    #[flag(run, long)]
    warmup_steps: u64,
    /// AdamW's first-moment decay (default 0.9).
    #[key]
    beta1: f32,
    /// AdamW's second-moment decay (default 0.95).
    #[key]
    beta2: f32,
    /// Decoupled weight decay (default 0.1; weights and embeddings only).
    #[flag(run, long, allow_negative_numbers = true)]
    weight_decay: f32,
    /// Seed for initialisation and batch sampling.
    #[flag(run, long)]
    seed: u64,
    /// Worker threads (default: the physical cores this process may run on).
    #[flag(step, long)]
    threads: usize,
    /// Device to train on: cpu (default), gpu (the first GPU), or gpu:N (the adapter
    /// `snug devices` lists at N).
    #[flag(step, long, value_name = "DEVICE")]
    device: String,
    /// Memory of the GPU `device` names (e.g. 12GiB), for `fit` and `train --memory auto` to
    /// plan against where it cannot be read from the device (`snug devices` says where it
    /// can); `fit` and `train` also take it as --device-memory.
    #[key]
    device_memory: String,
    /// Print a line every this many steps (default: every step on a terminal, every 10th when
    /// the output goes to a file or pipe).
    #[flag(run, long)]
    log_every: u64,
    /// Cap on the memory snug holds, e.g. 1.5GiB or 800MB (relaxed: exceeded only when
    /// freeing cached buffers cannot make room, and reported).
    #[flag(run, long, value_name = "SIZE")]
    memory_limit: String,
    /// Make --memory-limit strict: an allocation over it fails with an out-of-memory error.
    #[flag(run, long = "strict", requires = "memory_limit", num_args = 0, default_missing_value = "true")]
    strict_memory_limit: bool,
    /// Mixed precision: f32 (default), bf16 or f16. Activations and their gradients are
    /// rounded to and stored in 16 bits; weights and optimizer state stay f32; f16 scales the
    /// loss dynamically.
    #[flag(step, long)]
    precision: String,
    /// Initial loss scale for --precision f16 (default 65536): halved when the scaled
    /// gradients overflow (that step's update is skipped), doubled after 2000 good steps.
    #[flag(run, long)]
    loss_scale: f32,
    /// Good steps in a row before the loss scale doubles. Default 2000.
    #[key]
    loss_scale_interval: u32,
    /// Optimizer: adamw (default), adamw8bit (moments quantized to 8 bits in blocks of 2048,
    /// a quarter of the memory) or sgd.
    #[flag(step, long)]
    optimizer: String,
    /// Micro-batches per step (gradient accumulation); --batch is the whole step's batch.
    #[flag(step, long)]
    accumulation: usize,
    /// Clip the global gradient norm to this value (0: off; default 1). Clipping needs every
    /// gradient before the first update, so they are all alive at once.
    #[flag(step, long, allow_negative_numbers = true)]
    grad_clip: f32,
    /// The norm --grad-clip bounds: global (default; every gradient's, so all are held until
    /// the first update), tensor (each gradient's own) or previous (the previous step's
    /// global norm, kept in the checkpoint; the first step is not clipped). Tensor and
    /// previous take one micro-batch (--accumulation 1), no f16 loss scaling and one device.
    #[flag(step, long, value_name = "MODE")]
    clip_mode: String,
    /// Update each parameter as soon as its gradient is complete and free the gradient, so
    /// the gradients are never all held at once. Needs --clip-mode tensor or previous (or
    /// --grad-clip 0), one micro-batch (--accumulation 1) and no f16 loss scaling.
    #[flag(step, long, num_args = 0, default_missing_value = "true")]
    fused_update: bool,
    /// Evaluate train and validation loss every this many steps and at the end (0: never).
    #[flag(run, long)]
    eval_every: u64,
    /// Batches (of the step's `batch` windows) per evaluation.
    #[flag(run, long)]
    eval_batches: usize,
    /// Run directory: checkpoints (ckpt-<step>.safetensors) and metrics.jsonl. The final
    /// state is saved there, also on Ctrl-C and when the run stops on an error. Default: a new
    /// directory runs/<model>-<N> under the current directory.
    #[flag(run, long, value_name = "DIR")]
    out: PathBuf,
    /// Save a checkpoint every this many steps (0: only at the end and on Ctrl-C).
    #[flag(run, long)]
    checkpoint_every: u64,
    /// Checkpoints to keep in the run directory.
    #[flag(run, long)]
    keep_checkpoints: usize,
    /// Start from pretrained weights instead of a random initialisation: a Hugging Face model
    /// directory (config.json and model.safetensors or shards; GPT-2, Llama, Mistral, Qwen2),
    /// whose configuration is then the model's and whose tokenizer.json, if any, encodes text
    /// data (token files must have been prepared with it); or a GPT-2 model.safetensors file
    /// (e.g. from `snug export`). `plan` and `fit` take it too, to plan the run it starts.
    #[flag(step, long, value_name = "FILE")]
    init_from: PathBuf,
    /// Graph passes, comma-separated: fused-ce (LM head + cross-entropy in tiles, no logits
    /// tensor), cse (common subexpressions), dce (dead code), inplace (ops write over an input
    /// that dies at them), none (no pass); remat=MODE and precision=TYPE set those options.
    /// Default: fused-ce,inplace.
    #[flag(step, long, value_name = "LIST")]
    passes: String,
    /// Activation checkpointing: none, block (every block), block:K (every K blocks),
    /// selective (keep matmul and attention outputs, recompute the rest), budget:SIZE (the
    /// least recomputation whose planned peak fits SIZE, e.g. budget:3GiB).
    #[flag(step, long, value_name = "MODE")]
    remat: String,
    /// LoRA: train adapters of this rank beside the layers --lora-targets names, the rest of
    /// the model frozen (no gradient, no optimizer state). 0: off (default).
    #[flag(step, long, value_name = "RANK")]
    lora: usize,
    /// LoRA's scale numerator: the adapters' output is scaled by alpha / rank (default: twice
    /// the rank).
    #[flag(step, long, value_name = "ALPHA")]
    lora_alpha: f32,
    /// The layers LoRA adapts: all-linear, or module names, comma-separated (Llama: q_proj,
    /// k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2: c_attn, c_proj, c_fc).
    /// Default: q_proj,v_proj (GPT-2: c_attn).
    #[flag(step, long, value_name = "PATTERN")]
    lora_targets: String,
    /// How the frozen base weights are stored: bf16, int8 (per output channel) or nf4 (QLoRA's
    /// NormalFloat4, blocks of 64); decoded as each op reads them. Needs --lora. Default:
    /// f32.
    #[flag(step, long, value_name = "TYPE")]
    quantize_base: String,
    /// Also quantize the NF4 base's block scales (QLoRA's double quantization): 8-bit codes
    /// around their mean, in blocks of 256 with one f32 scale each. Needs --quantize-base nf4.
    #[flag(step, long, num_args = 0, default_missing_value = "true")]
    double_quant: bool,
    /// Levers fit may use where nothing fits without them, as `fit --allow` and `train
    /// --memory ... --allow` take them: fused-update, adam8bit, lora, qlora (comma-separated),
    /// or all, or none (default).
    #[key]
    allow: String,
    /// Ranks the run spans: those `mpirun -np N` (or `srun`) started; given, it must be their
    /// number. --batch is the whole step's batch, split evenly over the ranks.
    #[flag(run, long, value_name = "N")]
    devices: usize,
    /// ZeRO stage over the ranks: 0 (every rank holds everything), 1 (optimizer state
    /// sharded), 2 (also gradients), 3 (also parameters). Needs a run under mpirun.
    #[flag(run, long, value_name = "STAGE")]
    shard: u8,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    model: ModelSection,
    #[serde(default)]
    train: TrainSection,
}

/// A complete, validated training configuration. Fields missing from a saved configuration
/// (a checkpoint from an older snug) take their defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub data: DataSourceConfig,
    pub steps: u64,
    pub batch: usize,
    pub block: usize,
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
    pub seed: u64,
    pub threads: usize,
    /// Where the step runs (planned for that device's memory layout).
    pub device: DeviceSpec,
    /// The GPU's memory as the user gave it (`device_memory`), for budgets on a device
    /// whose memory cannot be read.
    pub device_memory: Option<usize>,
    pub log_every: u64,
    pub memory_limit: Option<usize>,
    pub strict_memory_limit: bool,
    pub precision: DType,
    /// Whether the user chose `precision` (flag, TOML or `precision=` in the passes): fit
    /// may lower an f32 it picked itself to bf16, never one the user asked for.
    pub precision_pinned: bool,
    /// Initial dynamic loss scale (f16 only).
    pub loss_scale: f32,
    pub loss_scale_interval: u32,
    pub optimizer: OptimizerKind,
    pub accumulation: usize,
    pub grad_clip: f32,
    pub clip_mode: snug_graph::ClipMode,
    pub fused_update: bool,
    pub eval_every: u64,
    pub eval_batches: usize,
    pub out: Option<PathBuf>,
    pub checkpoint_every: u64,
    pub keep_checkpoints: usize,
    pub init_from: Option<PathBuf>,
    pub passes: Vec<Pass>,
    pub remat: Remat,
    /// The step takes a loss mask ([`StepConfig::loss_mask`]). Not a user's setting: set from
    /// the data (token files written with a mask, see [`TrainConfig::load_data_and_model`] and
    /// [`crate::Trainer::new`]), or by a library caller who feeds masks of its own through
    /// [`crate::Trainer::step_on`]. Not saved: a resumed run takes it from its data again.
    #[serde(skip)]
    pub loss_mask: bool,
    /// LoRA's rank (0: no LoRA), alpha (default twice the rank) and targets (set to the
    /// family's default when the configuration is resolved).
    pub lora: usize,
    pub lora_alpha: Option<f32>,
    pub lora_targets: Option<snug_nn::LoraTargets>,
    /// Levers fit may add when choosing this run's configuration. Not saved: a resumed run
    /// keeps what was chosen (e.g. its LoRA rank), and recovery never adds a lever.
    #[serde(skip)]
    pub allow: snug_fit::Levers,
    /// How the frozen weights are stored (None: f32). Checkpoints say which; the base a run
    /// started from is never rewritten.
    pub quantize_base: Option<snug_graph::ops::QuantizeBase>,
    /// Ranks the step's batch is split over (the MPI world's size), and the ZeRO stage.
    pub devices: usize,
    pub shard: u8,
    /// Names the run its checkpoints belong to: minted when a trainer starts a run (the same on
    /// every rank), kept through resumes. Retention deletes only its own run's checkpoints.
    /// Not a user's setting; `None` in checkpoints saved before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// CRC-32 of the tokens the run trains and evaluates on ([`crate::TokenDataset::fingerprint`]),
    /// recorded when a trainer starts: a resume on data that changed since (a corpus edited or
    /// prepared again under the same name) is refused, unless `data` is given again. Not a
    /// user's setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_crc32: Option<u32>,
    /// The GPU adapter the run trained on last (its label, `name (backend, type)`), recorded
    /// when a trainer opens one: `report --run` on a machine whose adapter of that index is
    /// another says it plans with that one's layout. Not a user's setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
}

/// Serializable form of [`DataSource`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSourceConfig {
    Addition,
    File(PathBuf),
}

impl From<&DataSourceConfig> for DataSource {
    fn from(d: &DataSourceConfig) -> DataSource {
        match d {
            DataSourceConfig::Addition => DataSource::Addition,
            // A directory is prepared token files (`snug prepare`), a file is text.
            DataSourceConfig::File(p) => DataSource::from_path(p),
        }
    }
}

impl Default for TrainConfig {
    /// The demo: `llama-tiny` learning two-digit addition (the README has its measured time
    /// and accuracy). Tuned, not arbitrary: rotary positions find digits by their
    /// relative place, the units digit needs about 2,000 steps of 1,024 tokens to click, and
    /// carrying about 3,000 (at 2,500 the held-out accuracy still swung from 48 to 86 % with
    /// the seed and the last bits of rounding).
    fn default() -> Self {
        TrainConfig {
            model: ModelSection {
                preset: Some("llama-tiny".into()),
                ..Default::default()
            },
            data: DataSourceConfig::Addition,
            steps: 3000,
            batch: 8,
            // llama-tiny's context; set from the model unless given (see `resolve_over`).
            block: 128,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 20,
            beta1: 0.9,
            beta2: 0.95,
            weight_decay: 0.1,
            seed: 1337,
            threads: default_threads(),
            device: DeviceSpec::Cpu,
            device_memory: None,
            log_every: 0,
            memory_limit: None,
            strict_memory_limit: false,
            precision: DType::F32,
            precision_pinned: false,
            loss_scale: 65536.0,
            loss_scale_interval: 2000,
            optimizer: OptimizerKind::AdamW,
            accumulation: 1,
            grad_clip: 1.0,
            clip_mode: snug_graph::ClipMode::Global,
            fused_update: false,
            eval_every: 500,
            eval_batches: 8,
            out: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            init_from: None,
            passes: Pass::DEFAULT.to_vec(),
            remat: Remat::None,
            loss_mask: false,
            lora: 0,
            lora_alpha: None,
            lora_targets: None,
            allow: snug_fit::Levers::none(),
            quantize_base: None,
            devices: 1,
            shard: 0,
            run_id: None,
            data_crc32: None,
            adapter: None,
        }
    }
}

impl TrainConfig {
    /// Defaults, then `file` (if any), then `model` and `train` overrides, validated.
    pub fn resolve(
        file: Option<&Path>,
        model: &ModelSection,
        train: &TrainSection,
    ) -> Result<TrainConfig, TrainError> {
        Self::resolve_over(TrainConfig::default(), false, file, model, train)
    }

    /// `base` (a checkpoint's configuration), then `file` and the overrides, validated: the
    /// configuration of a resumed run. Overrides that would change what the saved state
    /// computes (a lever: LoRA's rank, alpha or layers, the base's storage, the optimizer) are
    /// refused, naming the field ([`TrainConfig::check_resumes`]).
    pub fn resolve_resumed(
        base: TrainConfig,
        file: Option<&Path>,
        model: &ModelSection,
        train: &TrainSection,
    ) -> Result<TrainConfig, TrainError> {
        Self::resolve_over(base, true, file, model, train)
    }

    fn resolve_over(
        mut cfg: TrainConfig,
        block_fixed: bool,
        file: Option<&Path>,
        model: &ModelSection,
        train: &TrainSection,
    ) -> Result<TrainConfig, TrainError> {
        // A resumed run's checkpoint configuration, which its levers must keep.
        let saved = block_fixed.then(|| cfg.clone());
        let mut block_set = block_fixed || train.block.is_some();
        // A resumed run keeps its model; a fresh one may name it here or in the file.
        let mut model_set = block_fixed || model.preset.is_some() || model.hf_config.is_some();
        let mut threads_set = train.threads.is_some();
        let mut lr_set = train.lr.is_some();
        let mut min_lr_set = train.min_lr.is_some();
        let data_before = cfg.data.clone();
        let data_given = train.data.is_some();
        if let Some(path) = file {
            let text = crate::user_file::read_text(
                path,
                crate::user_file::MAX_CONFIG_BYTES,
                "a configuration",
            )?;
            let parsed: FileConfig = toml::from_str(&text).map_err(|e| TrainError::ConfigFile {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            // The run's record of its model's config.json, written into checkpoints, not a
            // setting: a file names the config by `hf_config`.
            if parsed.model.hf_config_text.is_some() {
                return Err(TrainError::ConfigFile {
                    path: path.to_path_buf(),
                    message: "`hf_config_text` is not a [model] key: give the config.json's path \
                              as `hf_config`"
                        .into(),
                });
            }
            block_set |= parsed.train.block.is_some();
            model_set |= parsed.model.preset.is_some() || parsed.model.hf_config.is_some();
            threads_set |= parsed.train.threads.is_some();
            lr_set |= parsed.train.lr.is_some();
            min_lr_set |= parsed.train.min_lr.is_some();
            cfg.apply(&parsed.model, &parsed.train)?;
        }
        cfg.apply(model, train)?;
        // Data named again by flag, or other data named by a file: trained on as it is now,
        // whatever the run trained on before (a file a resume is given again names its data
        // again without asking for that).
        let data_given = data_given || cfg.data != data_before;
        if data_given {
            cfg.data_crc32 = None;
        }
        if data_given {
            if let DataSourceConfig::File(p) = &mut cfg.data {
                // Saved with the run as an absolute path: a resume from another directory
                // reads this file, never one of the same name there.
                if let Ok(abs) = std::path::absolute(&*p) {
                    *p = abs;
                }
            }
        }
        if lr_set && !min_lr_set {
            // The decay's floor follows a learning rate given without one: `--lr 1e-4` alone
            // must not fail against the default floor (3e-4, the demo's `lr` over ten).
            cfg.min_lr = cfg.lr / 10.0;
        }
        if let (false, Some(dir)) = (model_set, cfg.hf_init_dir()) {
            // Pretrained weights bring their model: its config.json, not the default preset.
            cfg.model.hf_config = Some(dir.to_path_buf());
            cfg.model.preset = None;
        }
        if let (Some(path), None) = (&cfg.model.hf_config, &cfg.model.hf_config_text) {
            // Kept with the run (see `hf_config_text`); one that cannot be read is named by
            // `base_model` below.
            cfg.model.hf_config_text = crate::user_file::read_text(
                &ModelConfig::hf_config_file(path),
                crate::user_file::MAX_CONFIG_BYTES,
                "a model configuration",
            )
            .ok();
        }
        if let (None, Some(_)) = (cfg.model.vocab_size, cfg.hf_init_dir()) {
            // Pretrained weights fix the vocabulary, also once the run is resumed (when the
            // weights come from its checkpoint): a tokenizer may have fewer entries than the
            // embedding it indexes.
            cfg.model.vocab_size = Some(cfg.base_model()?.vocab_size());
        }
        if let Some(dir) = cfg.adapter_init_dir() {
            cfg.take_adapter_settings(&dir)?;
        }
        if cfg.lora > 0 && cfg.lora_targets.is_none() {
            let model = cfg.base_model()?;
            cfg.lora_targets = Some(snug_nn::LoraConfig::new(&model, cfg.lora, None, None).targets);
        }
        if block_fixed && !threads_set {
            // A resumed run keeps its configuration, but not another machine's core count.
            cfg.threads = cfg.threads.min(default_threads());
        }
        if !block_set {
            // Without an explicit block, train on the model's full context.
            cfg.block = cfg.base_model()?.max_seq();
        }
        // Before validation, whose advice (add --lora to quantize the base) a resume cannot take.
        if let Some(saved) = &saved {
            cfg.check_resumes(saved)?;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    fn apply(&mut self, m: &ModelSection, t: &TrainSection) -> Result<(), TrainError> {
        if m.preset.is_some() || m.hf_config.is_some() {
            // A new preset replaces the default one and its overrides.
            self.model = ModelSection::default();
        }
        macro_rules! set {
            ($dst:expr, $src:expr) => {
                if let Some(v) = $src.clone() {
                    $dst = Some(v);
                }
            };
        }
        set!(self.model.preset, m.preset);
        set!(self.model.n_layer, m.n_layer);
        set!(self.model.n_head, m.n_head);
        set!(self.model.n_embd, m.n_embd);
        set!(self.model.block_size, m.block_size);
        set!(self.model.vocab_size, m.vocab_size);
        set!(self.model.hf_config, m.hf_config);
        if let Some(p) = &t.data {
            self.data = DataSourceConfig::File(p.clone());
        }
        macro_rules! take {
            ($($f:ident),*) => { $(if let Some(v) = t.$f { self.$f = v; })* };
        }
        take!(
            steps,
            batch,
            block,
            lr,
            min_lr,
            warmup_steps,
            beta1,
            beta2,
            weight_decay,
            seed,
            threads,
            log_every,
            accumulation,
            grad_clip,
            fused_update,
            eval_every,
            eval_batches,
            checkpoint_every,
            keep_checkpoints,
            devices,
            shard
        );
        if let Some(m) = &t.clip_mode {
            self.clip_mode =
                m.to_ascii_lowercase()
                    .parse()
                    .map_err(|detail| TrainError::Config {
                        field: "clip_mode",
                        detail,
                    })?;
        }
        if let Some(d) = &t.device {
            self.device = d.parse().map_err(|detail| TrainError::Config {
                field: "device",
                detail,
            })?;
        }
        if let Some(o) = &t.out {
            self.out = Some(o.clone());
        }
        if let Some(r) = t.lora {
            if r == 0 {
                return Err(TrainError::Config {
                    field: "lora",
                    detail: "the rank must be at least 1 (leave lora out to train every \
                             parameter)"
                        .into(),
                });
            }
            self.lora = r;
        }
        if let Some(a) = t.lora_alpha {
            self.lora_alpha = Some(a);
        }
        if let Some(p) = &t.lora_targets {
            self.lora_targets = Some(p.parse().map_err(|detail| TrainError::Config {
                field: "lora_targets",
                detail,
            })?);
        }
        // `f32`, the default the help names, stores the base as it is.
        if let Some(q) = t.quantize_base.as_deref().filter(|q| *q != "f32") {
            let q: QuantizeBase = q.parse().map_err(|detail| TrainError::Config {
                field: "quantize_base",
                detail: format!("{detail}, or f32 for none"),
            })?;
            // NF4 named again keeps the double quantization an earlier layer asked for.
            let kept = q == QuantizeBase::Nf4 && self.quantize_base == Some(QuantizeBase::Nf4Dq);
            self.quantize_base = Some(if kept { QuantizeBase::Nf4Dq } else { q });
        } else if t.quantize_base.is_some() {
            self.quantize_base = None;
        }
        if let Some(dq) = t.double_quant {
            self.quantize_base = match (self.quantize_base, dq) {
                (Some(QuantizeBase::Nf4 | QuantizeBase::Nf4Dq), true) => Some(QuantizeBase::Nf4Dq),
                (Some(QuantizeBase::Nf4Dq), false) => Some(QuantizeBase::Nf4),
                (other, false) => other,
                (other, true) => {
                    return Err(TrainError::Config {
                        field: "double_quant",
                        detail: format!(
                            "double quantization compresses NF4's block scales, so it needs \
                             --quantize-base nf4 (the base is {})",
                            other.map_or("f32", QuantizeBase::name)
                        ),
                    })
                }
            };
        }
        if let Some(a) = &t.allow {
            self.allow = a
                .parse()
                .map_err(|e: snug_fit::UnknownLever| TrainError::Config {
                    field: "allow",
                    detail: e.to_string(),
                })?;
        }
        if let Some(p) = &t.init_from {
            self.init_from = Some(p.clone());
        }
        if let Some(r) = &t.remat {
            self.remat = r.parse().map_err(|detail| TrainError::Config {
                field: "remat",
                detail,
            })?;
        }
        if let Some(list) = &t.passes {
            let mut passes = Vec::new();
            // `none` alone turns the default passes off.
            for s in list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty() && *s != "none")
            {
                let bad = |detail: String| TrainError::Config {
                    field: "passes",
                    detail,
                };
                // `remat=MODE` and `precision=TYPE` in the list set those options.
                if let Some(mode) = s.strip_prefix("remat=") {
                    self.remat = mode.parse().map_err(bad)?;
                } else if let Some(p) = s.strip_prefix("precision=") {
                    self.precision_pinned = true;
                    self.precision = match p.parse::<DType>() {
                        Ok(d) if d.is_float() => d,
                        _ => return Err(bad(format!("`{p}` is not one of f32, bf16, f16"))),
                    };
                } else {
                    passes.push(Pass::ALL.into_iter().find(|p| p.name() == s).ok_or_else(
                        || {
                            bad(format!(
                                "`{s}` is not a pass (known: {}, remat=MODE, precision=TYPE)",
                                Pass::ALL.map(Pass::name).join(", ")
                            ))
                        },
                    )?);
                }
            }
            self.passes = passes;
        }
        if let Some(size) = &t.device_memory {
            let bytes = snug_runtime::parse_bytes(size).map_err(|e| TrainError::Config {
                field: "device_memory",
                detail: e.to_string(),
            })?;
            self.device_memory = Some(bytes);
        }
        if let Some(limit) = &t.memory_limit {
            let bytes = snug_runtime::parse_bytes(limit).map_err(|e| TrainError::Config {
                field: "memory_limit",
                detail: e.to_string(),
            })?;
            self.memory_limit = Some(bytes);
        }
        if let Some(s) = t.loss_scale {
            self.loss_scale = s;
        }
        if let Some(n) = t.loss_scale_interval {
            self.loss_scale_interval = n;
        }
        if let Some(strict) = t.strict_memory_limit {
            self.strict_memory_limit = strict;
        }
        if let Some(o) = &t.optimizer {
            self.optimizer = match o.to_ascii_lowercase().as_str() {
                "adamw" => OptimizerKind::AdamW,
                "sgd" => OptimizerKind::Sgd,
                "adamw8bit" => OptimizerKind::AdamW8bit,
                _ => {
                    return Err(TrainError::Config {
                        field: "optimizer",
                        detail: format!("`{o}` is not one of adamw, adamw8bit, sgd"),
                    })
                }
            };
        }
        if let Some(p) = &t.precision {
            self.precision_pinned = true;
            self.precision = match p.parse::<DType>() {
                Ok(d) if d.is_float() => d,
                _ => {
                    return Err(TrainError::Config {
                        field: "precision",
                        detail: format!("`{p}` is not one of f32, bf16, f16"),
                    })
                }
            };
        }
        Ok(())
    }

    pub(crate) fn validate(&self) -> Result<(), TrainError> {
        let err = |field: &'static str, detail: String| Err(TrainError::Config { field, detail });
        if self.steps == 0 {
            return err("steps", "must be at least 1".into());
        }
        if self.batch == 0 {
            return err("batch", "must be at least 1".into());
        }
        if self.block == 0 {
            return err("block", "must be at least 1".into());
        }
        if self.threads == 0 {
            return err("threads", "must be at least 1".into());
        }
        // Also where planning for another machine: sizes per thread are counted up to it.
        if self.threads > snug_graph::MAX_THREADS {
            return err(
                "threads",
                format!(
                    "{} is more than {} (no machine runs one step on more)",
                    self.threads,
                    snug_graph::MAX_THREADS
                ),
            );
        }
        if self.devices == 0 {
            return err("devices", "must be at least 1".into());
        }
        if self.devices > MAX_DEVICES {
            return err(
                "devices",
                format!(
                    "{} is more than {MAX_DEVICES} (the shards' padding and traffic are counted \
                     up to it)",
                    self.devices
                ),
            );
        }
        if self.shard > 3 {
            return err(
                "shard",
                format!("ZeRO stage {} does not exist: 0, 1, 2 or 3", self.shard),
            );
        }
        if !self.batch.is_multiple_of(self.devices) {
            return err(
                "batch",
                format!(
                    "{} does not split over {} ranks: each rank trains batch / devices \
                     sequences, so the batch must be a multiple of {}",
                    self.batch, self.devices, self.devices
                ),
            );
        }
        let per_rank = self.batch / self.devices;
        if self.accumulation == 0 || !per_rank.is_multiple_of(self.accumulation) {
            return err(
                "accumulation",
                format!(
                    "must be at least 1 and divide the batch of each rank ({per_rank}: --batch {} \
                     over {} rank(s)), got {}{}",
                    self.batch,
                    self.devices,
                    self.accumulation,
                    match (1..=per_rank)
                        .rev()
                        .find(|a| per_rank.is_multiple_of(*a) && *a <= self.accumulation)
                    {
                        Some(a) if self.accumulation > 0 => {
                            format!(" (--accumulation {a} divides it)")
                        }
                        _ => String::new(),
                    }
                ),
            );
        }
        if !(self.loss_scale.is_finite() && self.loss_scale >= 1.0) {
            return err(
                "loss_scale",
                format!(
                    "must be a finite number of at least 1, got {}",
                    self.loss_scale
                ),
            );
        }
        if self.loss_scale_interval == 0 {
            return err("loss_scale_interval", "must be at least 1".into());
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return err(
                "grad_clip",
                format!("must be 0 (off) or positive, got {}", self.grad_clip),
            );
        }
        if self.clip_mode != snug_graph::ClipMode::Global && self.grad_clip > 0.0 {
            if self.accumulation > 1 {
                return err(
                    "clip_mode",
                    format!(
                        "{} clipping takes one micro-batch (accumulation 1)",
                        self.clip_mode.name()
                    ),
                );
            }
            if self.precision == DType::F16 {
                return err(
                    "clip_mode",
                    format!(
                        "{} clipping does not combine with f16 loss scaling: use bf16",
                        self.clip_mode.name()
                    ),
                );
            }
        }
        if self.fused_update {
            if self.accumulation > 1 {
                return err(
                    "fused_update",
                    "accumulation keeps every gradient in its accumulator across micro-batches, \
                     so fusing the update frees nothing: use --accumulation 1"
                        .into(),
                );
            }
            if self.grad_clip > 0.0 && self.clip_mode == snug_graph::ClipMode::Global {
                return err(
                    "fused_update",
                    "global-norm clipping needs every gradient before the first update: add \
                     --clip-mode tensor or --clip-mode previous, or --grad-clip 0"
                        .into(),
                );
            }
            if self.precision == DType::F16 {
                return err(
                    "fused_update",
                    "f16 loss scaling skips the update when any gradient overflows, known only \
                     once all are complete: use --precision bf16"
                        .into(),
                );
            }
        }
        if self.eval_batches == 0 {
            return err("eval_batches", "must be at least 1".into());
        }
        if self.eval_batches > MAX_EVAL_BATCHES {
            return err(
                "eval_batches",
                format!(
                    "{} is more than {MAX_EVAL_BATCHES}: each is a forward pass at every evaluation, \
                     so the run would never get past its first",
                    self.eval_batches
                ),
            );
        }
        if self.keep_checkpoints == 0 {
            return err("keep_checkpoints", "must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return err("lr", format!("must be a positive number, got {}", self.lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return err(
                "min_lr",
                format!(
                    "must be between 0 and lr ({}), got {}",
                    self.lr, self.min_lr
                ),
            );
        }
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return err(field, format!("must be in [0, 1), got {b}"));
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return err(
                "weight_decay",
                format!("must be non-negative, got {}", self.weight_decay),
            );
        }
        for (field, path) in [
            ("out", self.out.as_deref()),
            ("init_from", self.init_from.as_deref()),
        ] {
            if path.is_some_and(|p| p.as_os_str().is_empty()) {
                return err(field, "is an empty path".into());
            }
        }
        if matches!(&self.data, DataSourceConfig::File(p) if p.as_os_str().is_empty()) {
            return err("data", "is an empty path".into());
        }
        let model = self.base_model()?;
        if let Some(lora) = self.lora_config() {
            lora.layers(&model).map_err(|e| TrainError::Config {
                field: "lora",
                detail: e.to_string(),
            })?;
        } else if self.lora_alpha.is_some() || self.lora_targets.is_some() {
            return err(
                "lora",
                "lora_alpha and lora_targets need a LoRA rank (--lora RANK)".into(),
            );
        }
        if let (Some(q), None) = (self.quantize_base, self.lora_config()) {
            return err(
                "quantize_base",
                format!(
                    "{q}: only frozen weights are stored quantized, and without LoRA every \
                     weight trains (add --lora RANK)"
                ),
            );
        }
        self.device.target(self.threads)?;
        Ok(())
    }

    /// The LoRA adapters this run trains, if any.
    pub fn lora_config(&self) -> Option<snug_nn::LoraConfig> {
        (self.lora > 0).then(|| snug_nn::LoraConfig {
            rank: self.lora,
            alpha: self.lora_alpha.unwrap_or(2.0 * self.lora as f32),
            targets: self
                .lora_targets
                .clone()
                .unwrap_or(snug_nn::LoraTargets::AllLinear),
        })
    }

    /// Refuses this configuration for continuing a run saved under `saved` (its checkpoint's
    /// configuration) where it would change what the saved state means or computes: the
    /// optimizer (whose moments the checkpoint holds), the LoRA adapters (rank, alpha, the
    /// layers they adapt), how the frozen base is stored (`quantize_base`, `double_quant`),
    /// and whether the state keeps the previous step's gradient norm (`clip_mode` previous,
    /// `grad_clip` above 0). A resumed run never adds, drops or changes a lever; the error
    /// names the field and both values, before anything is set up. The rest (steps, learning
    /// rate, precision, how the step runs) a resume may change.
    pub fn check_resumes(&self, saved: &TrainConfig) -> Result<(), TrainError> {
        let refuse =
            |field: &'static str, detail: String| Err(TrainError::Config { field, detail });
        // The moments of one optimizer mean nothing to another (8-bit codes are not f32).
        let (was, now) = (saved.optimizer, self.optimizer);
        if was != now {
            return refuse(
                "optimizer",
                format!(
                    "the checkpoint's optimizer state is {}'s and this run uses {}: its moments \
                     cannot be reinterpreted; resume with --optimizer {}",
                    was.name(),
                    now.name(),
                    was.name()
                ),
            );
        }
        match (saved.lora, self.lora) {
            (was, now) if was == now => {}
            (0, now) => {
                return refuse(
                    "lora",
                    format!(
                        "the checkpoint's run trains every weight and this run asks for LoRA \
                         adapters of rank {now}: a resumed run never adds a lever (from here it \
                         would train other weights than it did); resume without --lora"
                    ),
                )
            }
            (was, 0) => {
                return refuse(
                    "lora",
                    format!(
                        "the checkpoint's run trains LoRA adapters of rank {was} and this run \
                         trains every weight: a resumed run never drops a lever; resume with \
                         --lora {was}"
                    ),
                )
            }
            (was, now) => {
                return refuse(
                    "lora",
                    format!(
                        "the checkpoint's LoRA adapters are of rank {was} and this run asks for \
                         rank {now}: the saved adapters cannot take another shape; resume with \
                         --lora {was}"
                    ),
                )
            }
        }
        if let (Some(was), Some(now)) = (saved.lora_config(), self.lora_config()) {
            if was.alpha != now.alpha {
                return refuse(
                    "lora_alpha",
                    format!(
                        "the checkpoint's LoRA adapters were trained at alpha {} (their output \
                         scaled by alpha / rank = {}) and this run asks for alpha {}: the scale \
                         multiplies what the adapters add to every output, so the saved weights \
                         would compute another model; resume with --lora-alpha {}",
                        was.alpha,
                        was.alpha / was.rank as f32,
                        now.alpha,
                        was.alpha
                    ),
                );
            }
            // Two spellings of the same layers (`all-linear` and every module by name) adapt
            // the same weights.
            let layers = |c: &TrainConfig, lora: &snug_nn::LoraConfig| {
                let model = c.base_model().ok()?;
                let layers = lora.layers(&model).ok()?;
                Some(layers.into_iter().map(|l| l.weight).collect::<Vec<_>>())
            };
            if was.targets != now.targets
                && (layers(saved, &was).is_none() || layers(saved, &was) != layers(self, &now))
            {
                return refuse(
                    "lora_targets",
                    format!(
                        "the checkpoint's LoRA adapters sit beside the layers `{}` names and this \
                         run asks for `{}`: adapters would be added or dropped, so the saved \
                         weights would not compute what they did; resume with --lora-targets {}",
                        was.targets, now.targets, was.targets
                    ),
                );
            }
        }
        if saved.quantize_base != self.quantize_base {
            use QuantizeBase::{Nf4, Nf4Dq};
            let stored = |q: Option<QuantizeBase>| match q {
                None => "f32".to_string(),
                Some(Nf4Dq) => "nf4 with its block scales double-quantized".to_string(),
                Some(q) => q.name().to_string(),
            };
            let again = "its frozen weights would be stored again from the values the \
                         checkpoint holds, so they (and what the saved adapters were trained \
                         over) would change";
            return match (saved.quantize_base, self.quantize_base) {
                (Some(Nf4), Some(Nf4Dq)) => refuse(
                    "double_quant",
                    format!(
                        "the checkpoint's base is stored as nf4 with f32 block scales and this \
                         run asks to double-quantize them: {again}; resume without \
                         --double-quant"
                    ),
                ),
                (Some(Nf4Dq), Some(Nf4)) => refuse(
                    "double_quant",
                    format!(
                        "the checkpoint's base is stored as {} and this run asks for f32 block \
                         scales: {again}; resume with --double-quant",
                        stored(saved.quantize_base)
                    ),
                ),
                (was, now) => refuse(
                    "quantize_base",
                    format!(
                        "the checkpoint's base is stored as {} and this run asks for {}: {again}; \
                         resume {}",
                        stored(was),
                        stored(now),
                        match was {
                            None => "without --quantize-base".to_string(),
                            Some(Nf4Dq) => "with --quantize-base nf4 --double-quant".to_string(),
                            Some(q) => format!("with --quantize-base {q}"),
                        }
                    ),
                ),
            };
        }
        // Clipping by the previous step's norm keeps that norm in the checkpoint.
        let keeps_norm =
            |c: &TrainConfig| c.clip_mode == snug_graph::ClipMode::Previous && c.grad_clip > 0.0;
        if keeps_norm(saved) != keeps_norm(self) {
            let clipping = |c: &TrainConfig| {
                if c.grad_clip > 0.0 {
                    format!("clips by the {} norm", c.clip_mode.name())
                } else {
                    "does not clip (grad_clip 0)".to_string()
                }
            };
            let (field, flag) = if saved.clip_mode != self.clip_mode {
                (
                    "clip_mode",
                    format!("--clip-mode {}", saved.clip_mode.name()),
                )
            } else {
                ("grad_clip", format!("--grad-clip {}", saved.grad_clip))
            };
            let detail = if keeps_norm(saved) {
                format!(
                    "the checkpoint's run clips by the previous step's gradient norm, which its \
                     state keeps, and this run {}: the kept norm would be dropped; resume with \
                     {flag}",
                    clipping(self)
                )
            } else {
                format!(
                    "the checkpoint's run {} and this run asks to clip by the previous step's \
                     gradient norm, which the checkpoint does not keep; resume with {flag}",
                    clipping(saved)
                )
            };
            return refuse(field, detail);
        }
        Ok(())
    }

    /// Refuses a thread count this machine cannot run ([`check_threads_here`]).
    pub fn check_threads_here(&self) -> Result<(), TrainError> {
        check_threads_here(self.threads)
    }

    /// The step-level settings (optimizer, accumulation, clipping, passes, remat, precision).
    pub fn step_config(&self) -> StepConfig {
        StepConfig {
            precision: self.precision,
            optimizer: self.optimizer,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            accumulation: self.accumulation,
            grad_clip: self.grad_clip,
            clip_mode: self.clip_mode,
            fused_update: self.fused_update,
            passes: self.passes.clone(),
            remat: self.remat,
            loss_mask: self.loss_mask,
            lora: self.lora_config(),
            quantize_base: self.quantize_base,
        }
    }

    /// What fit searches for this run: `model` at this block and step settings, allowed to
    /// lower the precision to bf16 unless the user set it, and to add the levers in `allow`.
    pub fn fit_model(&self, model: ModelConfig) -> snug_fit::FitModel {
        snug_fit::FitModel::new(model, self.block, self.step_config())
            .allowing((!self.precision_pinned).then_some(DType::BF16))
            .allowing_levers(self.allow.clone())
    }

    /// Sets the knobs and levers fit chose (the batch stays: `micro_batch × accumulation` is
    /// it).
    pub fn apply_fit(&mut self, fit: &snug_fit::FitConfig) {
        let step = fit.apply(&self.step_config());
        self.accumulation = step.accumulation;
        self.remat = step.remat;
        self.passes = step.passes;
        self.precision = step.precision;
        self.optimizer = step.optimizer;
        self.clip_mode = step.clip_mode;
        self.fused_update = step.fused_update;
        if let Some(lora) = step.lora {
            self.lora = lora.rank;
            self.lora_alpha = Some(lora.alpha);
            self.lora_targets = Some(lora.targets);
        }
        self.quantize_base = step.quantize_base;
        if self.devices > 1 {
            self.shard = fit.shard;
        }
    }

    /// Sequences per forward/backward pass (of one rank).
    pub fn micro_batch(&self) -> usize {
        self.batch / self.devices / self.accumulation
    }

    /// How the step spreads over the ranks: [`Sharding::SINGLE`] for one process.
    pub fn sharding(&self) -> Result<Sharding, TrainError> {
        if self.devices == 1 && self.shard == 0 {
            return Ok(Sharding::SINGLE);
        }
        Sharding::new(self.devices, self.shard).map_err(|e| TrainError::Config {
            field: "shard",
            detail: e.to_string(),
        })
    }

    /// One micro-batch's shape.
    pub fn step_shape(&self) -> StepShape {
        StepShape {
            micro_batch: self.micro_batch(),
            block: self.block,
        }
    }

    /// The device this run compiles for: this machine's CPU with the run's threads, or the
    /// GPU `device` names (its limits; [`snug_gpu::DEFAULT_LAYOUT`] where this machine has no
    /// adapter).
    pub fn target(&self) -> Target {
        // `validate` refused a device whose target cannot be known.
        self.device
            .target(self.threads)
            .unwrap_or(Target::gpu(snug_gpu::DEFAULT_LAYOUT))
    }

    /// `init_from` when it is a PEFT adapter directory: the run continues its adapters, on the
    /// base model stored beside them (as `snug export` writes a LoRA run).
    pub fn adapter_init_dir(&self) -> Option<PathBuf> {
        self.init_from
            .as_deref()
            .filter(|p| snug_nn::lora::is_adapter_dir(p))
            .map(Path::to_path_buf)
    }

    /// LoRA settings from the adapter in `dir`: taken where the run leaves them unset, and
    /// refused where it sets them otherwise.
    fn take_adapter_settings(&mut self, dir: &Path) -> Result<(), TrainError> {
        let bad = |detail: String| TrainError::Config {
            field: "init_from",
            detail,
        };
        if !snug_nn::is_hf_dir(dir) {
            return Err(bad(format!(
                "{}: a LoRA adapter continues on its base model, and this directory holds no \
                 config.json and model weights beside the adapter (`snug export` of a LoRA \
                 run writes both; or copy the base model's files there)",
                dir.display()
            )));
        }
        let model = self.base_model()?;
        let (lora, _) = snug_nn::lora::read_adapter_config(dir, &model)?;
        let mismatch = |field: &str, run: String, adapter: String| {
            bad(format!(
                "{}: the adapter's {field} is {adapter}, the run asks for {run}",
                dir.display()
            ))
        };
        if self.lora != 0 && self.lora != lora.rank {
            return Err(mismatch(
                "rank",
                self.lora.to_string(),
                lora.rank.to_string(),
            ));
        }
        if let Some(a) = self.lora_alpha.filter(|&a| a != lora.alpha) {
            return Err(mismatch(
                "lora_alpha",
                a.to_string(),
                lora.alpha.to_string(),
            ));
        }
        if let Some(t) = self.lora_targets.as_ref().filter(|&t| {
            lora.layers(&model).ok()
                != snug_nn::LoraConfig {
                    targets: t.clone(),
                    ..lora.clone()
                }
                .layers(&model)
                .ok()
        }) {
            return Err(mismatch(
                "target_modules",
                t.to_string(),
                lora.targets.to_string(),
            ));
        }
        self.lora = lora.rank;
        self.lora_alpha = Some(lora.alpha);
        self.lora_targets = Some(lora.targets);
        Ok(())
    }

    /// Checks that the run can start from `init_from` on `model`, as the trainer will read it,
    /// reading headers alone (no weight is decoded). Loading the data and model does it, so
    /// `plan` and `fit` refuse what `train` refuses; the trainer does it again before
    /// allocating its step, for a library caller that loaded neither.
    pub fn check_init_from(&self, model: &ModelConfig) -> Result<(), TrainError> {
        self.open_init_from(model).map(drop)
    }

    /// [`TrainConfig::check_init_from`], returning a Hugging Face directory's checkpoint
    /// (opened, its headers read) for the caller to read the weights from.
    pub fn open_init_from(
        &self,
        model: &ModelConfig,
    ) -> Result<Option<snug_nn::HfCheckpoint>, TrainError> {
        let Some(path) = &self.init_from else {
            return Ok(None);
        };
        if let Some(dir) = self.hf_init_dir() {
            let ckpt = snug_nn::HfCheckpoint::open(dir)?;
            ckpt.check_model(model)?;
            return Ok(Some(ckpt));
        }
        if let Some(why) = snug_nn::config_missing_beside_weights(path) {
            return Err(TrainError::Config {
                field: "init_from",
                detail: why,
            });
        }
        match model {
            ModelConfig::Gpt(gpt) => Ok(snug_nn::check_gpt2_safetensors(path, gpt).map(|()| None)?),
            ModelConfig::Llama(_) => Err(lone_weights_for_llama(path)),
        }
    }

    /// `init_from` when it is a Hugging Face model directory (not a lone weights file).
    pub fn hf_init_dir(&self) -> Option<&Path> {
        self.init_from.as_deref().filter(|p| snug_nn::is_hf_dir(p))
    }

    /// The preset (or Hugging Face config) with the `[model]` overrides applied; `vocab_size`
    /// may still change to fit the data (see [`TrainConfig::model_for_vocab`]).
    pub fn base_model(&self) -> Result<ModelConfig, TrainError> {
        let m = &self.model;
        let mut cfg = match (&m.hf_config, &m.hf_config_text) {
            (Some(path), Some(text)) => {
                ModelConfig::from_hf_json(text).map_err(|error| snug_nn::NnError::HfConfig {
                    // Named as the file it was read from.
                    path: ModelConfig::hf_config_file(path).display().to_string(),
                    error,
                })?
            }
            (Some(path), None) => ModelConfig::from_hf_file(path)?,
            (None, _) => ModelConfig::preset(m.preset.as_deref().unwrap_or("tiny"))?,
        };
        cfg.override_shape(m.n_layer, m.n_head, m.n_embd, m.block_size);
        if let Some(v) = m.vocab_size {
            cfg.set_vocab_size(v);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The data this configuration trains on and the model it trains; data with a loss mask
    /// sets [`TrainConfig::loss_mask`]. `plan`, `fit` and `train` all resolve a run through
    /// here, so the step planned is the step that runs.
    ///
    /// With pretrained weights from a Hugging Face directory, a text file is encoded with the
    /// directory's `tokenizer.json` (when it has one), and the weights are checked against the
    /// model here, before a run directory is made for them.
    pub fn load_data_and_model(
        &mut self,
    ) -> Result<(crate::TokenDataset, ModelConfig), TrainError> {
        self.load_data_and_model_with(None)
    }

    /// [`TrainConfig::load_data_and_model`], a text file encoded with `tokenizer` when given
    /// (a resumed run's own, from its checkpoint).
    pub fn load_data_and_model_with(
        &mut self,
        tokenizer: Option<&crate::Tokenizer>,
    ) -> Result<(crate::TokenDataset, ModelConfig), TrainError> {
        let loaded = self.load_data_and_model_unchecked(tokenizer)?;
        loaded.0.check_block(self.block)?;
        Ok(loaded)
    }

    /// [`TrainConfig::load_data_and_model`] for sampling, which reads the data for its
    /// vocabulary alone: a split shorter than `block` (a long-context model's default, on
    /// the built-in data) is no reason to refuse it.
    pub fn load_data_and_model_for_sampling(
        &mut self,
    ) -> Result<(crate::TokenDataset, ModelConfig), TrainError> {
        self.load_data_and_model_unchecked(None)
    }

    fn load_data_and_model_unchecked(
        &mut self,
        tokenizer: Option<&crate::Tokenizer>,
    ) -> Result<(crate::TokenDataset, ModelConfig), TrainError> {
        let source = DataSource::from(&self.data);
        let hf_tokenizer = self
            .hf_init_dir()
            .map(|d| d.join(crate::hf_tokenizer::TOKENIZER_FILE))
            .filter(|p| p.exists());
        let data = match (&source, tokenizer, hf_tokenizer) {
            (DataSource::File(path), Some(t), _) => {
                crate::TokenDataset::from_file_with(path, t.clone())?
            }
            (DataSource::File(path), None, Some(tok)) => {
                let tokenizer = crate::Tokenizer::Hf(crate::HfTokenizer::from_file(&tok)?);
                crate::TokenDataset::from_file_with(path, tokenizer)?
            }
            (_, _, Some(tok)) => {
                // Token files carry their own tokenizer: another's ids would mean other tokens
                // to the pretrained weights, and train without complaint.
                let data = crate::TokenDataset::load(&source)?;
                let model = crate::Tokenizer::Hf(crate::HfTokenizer::from_file(&tok)?);
                if !data.tokenizer.same_ids(&model) {
                    return Err(TrainError::Config {
                        field: "data",
                        detail: format!(
                            "its {} tokenizer (vocabulary {}) differs from {}, the tokenizer of \
                             the weights it would train: prepare the text with `snug prepare \
                             --tokenizer {}`",
                            data.tokenizer.name(),
                            data.tokenizer.vocab_size(),
                            tok.display(),
                            tok.display()
                        ),
                    });
                }
                data
            }
            _ => crate::TokenDataset::load(&source)?,
        };
        self.loss_mask |= data.has_loss_mask();
        let model = self.model_for_vocab(data.tokenizer.vocab_size())?;
        self.check_init_from(&model)?;
        // Pretrained weights beside no tokenizer: a character tokenizer made from the data
        // would number its characters as the weights never saw them, and train silently.
        // (The built-in data is a toy whatever its ids; a resume keeps the run's tokenizer.)
        if let (None, Some(dir), crate::Tokenizer::Char(_), DataSourceConfig::File(_)) =
            (tokenizer, self.hf_init_dir(), &data.tokenizer, &self.data)
        {
            return Err(TrainError::Config {
                field: "data",
                detail: format!(
                    "{} has no {}, so its weights' token ids are unknown; the data's character \
                     tokenizer (vocabulary {}) would give them ids that mean other tokens to \
                     them: put the model's {} beside its weights, or give token files `snug \
                     prepare` made with its tokenizer",
                    dir.display(),
                    crate::hf_tokenizer::TOKENIZER_FILE,
                    data.tokenizer.vocab_size(),
                    crate::hf_tokenizer::TOKENIZER_FILE
                ),
            });
        }
        Ok((data, model))
    }

    /// The model for data with `data_vocab` symbols. Data with a tokenizer of its own (a text
    /// file's characters, prepared token files) sets the vocabulary unless `vocab_size` was
    /// set; the built-in data keeps the model's own (so `snug plan --preset llama-70b` plans
    /// the real model). Either way it must cover the data's symbols.
    pub fn model_for_vocab(&self, data_vocab: usize) -> Result<ModelConfig, TrainError> {
        let mut cfg = self.base_model()?;
        let (vocab, field) = match (self.model.vocab_size, &self.data) {
            (Some(v), _) => (v, "vocab_size"),
            (None, DataSourceConfig::Addition) => (cfg.vocab_size(), "model"),
            (None, DataSourceConfig::File(_)) => (data_vocab, "vocab_size"),
        };
        if vocab < data_vocab {
            return Err(TrainError::Config {
                field,
                detail: format!(
                    "the model's vocabulary of {vocab} is smaller than the {data_vocab} ids of the \
                     data's tokenizer"
                ),
            });
        }
        cfg.set_vocab_size(vocab);
        if self.block > cfg.max_seq() {
            return Err(TrainError::Config {
                field: "block",
                detail: format!(
                    "{} exceeds the model's block_size {}",
                    self.block,
                    cfg.max_seq()
                ),
            });
        }
        Ok(cfg)
    }
}

/// The most ranks a run may span (a plan for a larger cluster included).
pub const MAX_DEVICES: usize = 1 << 20;

/// The most batches one evaluation runs per split.
pub const MAX_EVAL_BATCHES: usize = 1_000_000;

/// The default worker count: the physical cores this process may run on, shared with the
/// other ranks of its machine (`OMPI_COMM_WORLD_LOCAL_SIZE`, or MPICH's `MPI_LOCALNRANKS`)
/// that run on the same CPUs. Which those are is judged from this rank's share of the CPUs it
/// could run on: all of them (`mpirun --bind-to none`), every rank shares them; a part (ranks
/// bound to a package each, or to a core), as many ranks as such parts fit in the pool.
pub fn default_threads() -> usize {
    (snug_cpu::physical_cores() / snug_cpu::ranks_sharing_cpus()).max(1)
}

/// `cores` shared by the `local` ranks of one machine, each allowed `allowed` of a `pool` of
/// CPUs ([`snug_cpu::ranks_sharing`]).
#[cfg(test)]
fn threads_for(cores: usize, local: usize, allowed: usize, pool: usize) -> usize {
    (cores / snug_cpu::ranks_sharing(local, allowed, pool)).max(1)
}

/// Refuses a thread count this machine cannot run: each thread is a real OS thread, and more
/// of them than CPUs only take turns (100,000 hung a run). Planning for another machine may
/// name more; zero is refused where the configuration is checked.
pub fn check_threads_here(threads: usize) -> Result<(), TrainError> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads > cpus {
        return Err(TrainError::Config {
            field: "threads",
            detail: format!(
                "{threads} is more than the {cpus} CPUs this process may use (use at most {cpus}; the default is the {} physical cores among them)",
                snug_cpu::physical_cores()
            ),
        });
    }
    Ok(())
}

/// A lone weights file given to start a Llama-family model, which starts from a directory.
pub(crate) fn lone_weights_for_llama(path: &Path) -> TrainError {
    TrainError::Config {
        field: "init_from",
        detail: format!(
            "{}: a Llama-family model starts from a Hugging Face model directory (config.json \
             beside model.safetensors or its shards), not a lone weights file; a lone GPT-2 \
             model.safetensors (as `snug export` writes one) needs its shape: --preset gpt2 (or \
             tiny, char-small, ...) or --hf-config",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_flags_override_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(
            &path,
            "[model]\npreset = \"char-small\"\nn_layer = 2\n[train]\nsteps = 7\nbatch = 3\n",
        )
        .unwrap();
        let flags = TrainSection {
            batch: Some(5),
            ..Default::default()
        };
        let cfg = TrainConfig::resolve(Some(&path), &ModelSection::default(), &flags).unwrap();
        assert_eq!((cfg.steps, cfg.batch), (7, 5));
        let model = cfg.base_model().unwrap();
        let snug_nn::ModelConfig::Gpt(model) = model else {
            panic!("char-small is a GPT")
        };
        assert_eq!((model.n_layer, model.n_embd), (2, 384));
    }

    #[test]
    fn an_accumulation_that_does_not_divide_names_one_that_does() {
        let flags = TrainSection {
            batch: Some(6),
            accumulation: Some(4),
            ..Default::default()
        };
        let err = TrainConfig::resolve(None, &ModelSection::default(), &flags)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--batch 6 over 1 rank(s)") && err.contains("--accumulation 3 divides it"),
            "{err}"
        );
    }

    #[test]
    fn min_lr_follows_an_lr_given_without_it() {
        let m = ModelSection::default();
        let flags = |lr: Option<f32>, min_lr: Option<f32>| TrainSection {
            lr,
            min_lr,
            ..Default::default()
        };
        let cfg = TrainConfig::resolve(None, &m, &flags(Some(1e-4), None)).unwrap();
        assert_eq!((cfg.lr, cfg.min_lr), (1e-4, 1e-4 / 10.0));
        let cfg = TrainConfig::resolve(None, &m, &flags(Some(1e-4), Some(0.0))).unwrap();
        assert_eq!(cfg.min_lr, 0.0);
        let default = TrainConfig::default();
        let cfg = TrainConfig::resolve(None, &m, &flags(None, None)).unwrap();
        assert_eq!((cfg.lr, cfg.min_lr), (default.lr, default.min_lr));
        // A floor the file gives stays when the flags change only `lr`.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "[train]\nlr = 1e-3\nmin_lr = 5e-5\n").unwrap();
        let cfg = TrainConfig::resolve(Some(&path), &m, &flags(Some(2e-4), None)).unwrap();
        assert_eq!((cfg.lr, cfg.min_lr), (2e-4, 5e-5));
        // A floor above the learning rate, given, is still refused.
        assert!(matches!(
            TrainConfig::resolve(None, &m, &flags(Some(1e-4), Some(1e-3))),
            Err(TrainError::Config {
                field: "min_lr",
                ..
            })
        ));
    }

    #[test]
    fn malformed_and_unknown_keys_name_the_file_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "[train]\nstepz = 3\n").unwrap();
        let resolve = || {
            TrainConfig::resolve(
                Some(&path),
                &ModelSection::default(),
                &TrainSection::default(),
            )
        };
        let msg = resolve().unwrap_err().to_string();
        assert!(msg.contains("bad.toml") && msg.contains("stepz"), "{msg}");
        std::fs::write(&path, "[train\nsteps = ").unwrap();
        assert!(matches!(resolve(), Err(TrainError::ConfigFile { .. })));
        // The run's record of its model is no key of a file.
        std::fs::write(&path, "[model]\nhf_config_text = \"{}\"\n").unwrap();
        let msg = resolve().unwrap_err().to_string();
        assert!(
            msg.contains("bad.toml") && msg.contains("hf_config_text"),
            "{msg}"
        );
    }

    #[test]
    fn remat_and_passes_parse_or_name_the_field() {
        let m = ModelSection::default();
        let with = |remat: &str, passes: &str| {
            TrainConfig::resolve(
                None,
                &m,
                &TrainSection {
                    remat: Some(remat.into()),
                    passes: Some(passes.into()),
                    ..Default::default()
                },
            )
        };
        let cfg = with("block:2", "fused-ce").unwrap();
        assert_eq!(cfg.remat, Remat::Blocks { blocks: 2 });
        assert_eq!(cfg.passes, vec![Pass::FusedCrossEntropy]);
        assert_eq!(with("selective", "").unwrap().remat, Remat::Selective);
        assert_eq!(
            with("budget:2KiB", "cse,dce").unwrap().remat,
            Remat::Budget { bytes: 2048 }
        );
        assert_eq!(Remat::Blocks { blocks: 3 }.to_string(), "block:3");
        for bad in ["block:0", "blocks", "all", "budget:lots"] {
            assert!(matches!(
                with(bad, ""),
                Err(TrainError::Config { field: "remat", .. })
            ));
        }
        assert!(matches!(
            with("none", "fused-ce,magic"),
            Err(TrainError::Config {
                field: "passes",
                ..
            })
        ));
    }

    #[test]
    fn invalid_values_are_named() {
        let m = ModelSection::default();
        let zero_batch = TrainSection {
            batch: Some(0),
            ..Default::default()
        };
        assert!(matches!(
            TrainConfig::resolve(None, &m, &zero_batch),
            Err(TrainError::Config { field: "batch", .. })
        ));
        let bad_lr = TrainSection {
            lr: Some(-1.0),
            ..Default::default()
        };
        assert!(matches!(
            TrainConfig::resolve(None, &m, &bad_lr),
            Err(TrainError::Config { field: "lr", .. })
        ));
        let unknown = ModelSection {
            preset: Some("gpt9".into()),
            ..Default::default()
        };
        assert!(matches!(
            TrainConfig::resolve(None, &unknown, &TrainSection::default()),
            Err(TrainError::Model(snug_nn::NnError::UnknownPreset { .. }))
        ));
        let cfg = TrainConfig::resolve(
            None,
            &m,
            &TrainSection {
                block: Some(1000),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(matches!(
            cfg.model_for_vocab(13),
            Err(TrainError::Config { field: "block", .. })
        ));
    }

    #[test]
    fn ranks_on_one_machine_share_the_cores_they_run_on() {
        // One process: its cores.
        assert_eq!(threads_for(16, 1, 32, 32), 16);
        // Four unbound ranks on a 16-core machine: a quarter each.
        assert_eq!(threads_for(16, 4, 32, 32), 4);
        assert_eq!(threads_for(16, 3, 32, 32), 5);
        // More ranks than cores: one thread each, never none.
        assert_eq!(threads_for(2, 4, 2, 2), 1);
        // Eight ranks bound to one of two packages each: four share a package's 16 cores.
        assert_eq!(threads_for(16, 8, 32, 64), 4);
        // Ranks bound to a core each, or given CPUs of their own (a Slurm task's cpuset).
        assert_eq!(threads_for(1, 2, 1, 2), 1);
        assert_eq!(threads_for(8, 8, 8, 64), 8);
        assert_eq!(threads_for(0, 1, 0, 0), 1);
    }
}
