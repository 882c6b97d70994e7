//! One training run's state: compile the step graph once, plan it for the configured device,
//! load it into a session there (the CPU's, or a GPU's), then per step take the prefetched
//! batch, run each micro-batch, and report. Evaluation, checkpoint and restore work on the
//! same session.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use snug_compile::{compile_sharded, CompiledStep};
use snug_cpu::kernels::collective::{installed as transport, world};
use snug_fit::{FitConfig, MachineProfile, MemoryFailure, Search};
use snug_graph::{Role, StepGraph, TensorId};
use snug_nn::{LossMask, ModelConfig};
use snug_plan::MemoryPlan;
use snug_runtime::{Allocator, ExecCtx, OutOfMemory, RuntimeError};

use crate::checkpoint::{Checkpoint, CheckpointRef, PerRankState, SavedBytes, SavedTensor};
use crate::data::{batch_starts, fill_batch, fill_mask, Batch, Prefetcher, Tokens};
use crate::device::StepSession;
use crate::shards::{owned_range, DType as ShardDType, Layout, ShardRef, TensorEntry};
use crate::{LossScaler, TokenDataset, TrainConfig, TrainError};

/// Where a persistent tensor goes in a checkpoint: its whole name and shape, and how the ranks
/// hold it.
type Placement = (String, Vec<usize>, Layout);

/// Linear warmup to `lr`, then cosine decay to `min_lr` at the last step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LrSchedule {
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl LrSchedule {
    /// Learning rate for 1-based `step`.
    pub fn at(&self, step: u64) -> f32 {
        if step <= self.warmup_steps {
            return self.lr * step as f32 / self.warmup_steps.max(1) as f32;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f32 / span as f32).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.min_lr + (self.lr - self.min_lr) * cosine
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepStats {
    pub step: u64,
    /// Mean loss over the step's counted targets (every target, without a loss mask).
    pub loss: f32,
    /// Targets the step's loss counted: those its loss mask keeps, or every target.
    pub loss_tokens: u64,
    pub lr: f32,
    /// Global norm of the averaged gradient, before clipping.
    pub grad_norm: Option<f32>,
    /// The loss scale the step ran with (f16 only).
    pub loss_scale: Option<f32>,
    /// The update was skipped: the scaled gradients overflowed (the scale is halved).
    pub skipped: bool,
    pub ms: f64,
    pub tokens_per_s: f64,
    pub tokens_seen: u64,
    pub active_bytes: usize,
    pub peak_bytes: usize,
    pub cache_bytes: usize,
    /// The process's resident set as the OS reports it, beside the allocator's figures.
    pub rss_bytes: Option<usize>,
}

/// Mean losses over fixed batches of each split (the same batches at every evaluation, so
/// evaluations compare), over the targets the split's loss mask counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalStats {
    pub step: u64,
    pub train_loss: f32,
    pub val_loss: f32,
    /// Targets each loss counted.
    pub train_loss_tokens: u64,
    pub val_loss_tokens: u64,
    pub ms: f64,
}

/// Mixed into the seed for evaluation batches, so they never coincide with training batches.
const EVAL_STREAM: u64 = 0xE7A1_0000_0000_0000;

/// A model being trained: its compiled step, plan, session and data.
pub struct Trainer {
    config: TrainConfig,
    model: ModelConfig,
    step_graph: StepGraph,
    session: StepSession,
    data: Arc<TokenDataset>,
    tokens: TensorId,
    targets: TensorId,
    /// The loss mask's inputs, when the step has them ([`TrainConfig::loss_mask`]).
    loss_mask: Option<LossMask>,
    /// The mask of one micro-batch as the step reads it (0 or 1 per target), reused.
    mask_buf: Vec<f32>,
    schedule: LrSchedule,
    step: u64,
    tokens_seen: u64,
    /// Nodes the loss depends on: the forward pass, run alone for evaluation.
    forward: Vec<bool>,
    /// Batches of the coming steps, drawn on a background thread.
    prefetch: Prefetcher,
    /// The batch of a step that failed, kept for the retry, or of the next step, drawn while
    /// the step before ran.
    pending: Option<Batch>,
    /// Inputs of the micro-batch written while the one before ran (a GPU): which one, and
    /// the arena chunks they were staged into.
    staged: Option<StagedInputs>,
    /// Whether the next micro-batch's inputs are written while the current one runs.
    input_prefetch: bool,
    /// Micro-batches that ran on inputs written while the one before ran.
    prefetched: u64,
    /// Kernel timings for the recovery search; loaded from the calibration cache when first
    /// needed, else nominal.
    machine: Option<MachineProfile>,
    /// Configuration changes made after out-of-memory, not yet taken by [`Trainer::take_recoveries`].
    recoveries: Vec<Recovery>,
    /// Dynamic loss scaling, when the step scales its loss (f16).
    scaler: Option<LossScaler>,
    /// The step of the checkpoint this trainer was restored from.
    resumed_at: Option<u64>,
    /// A failed step may have updated the weights (its update ran, then the loss was not
    /// finite, or a kernel failed in the last micro-batch): the state is no longer the one
    /// after `step` steps, and must not be saved as such.
    state_dirty: bool,
    /// The rank whose memory ran out in the failure being recovered from.
    oom_rank: usize,
    /// The last error was one every rank reached at the same point of the run: an
    /// out-of-memory they agreed on and could not recover from. Then they can still save a
    /// sharded checkpoint together.
    failed_together: bool,
    /// The allocator's peak under the plans before the last [`Trainer::reconfigure`], which
    /// resets it so that the peak measured is the running plan's.
    earlier_peak_bytes: usize,
    /// Whether `SNUG_INJECT_OOM` has fired (once a run).
    #[cfg(feature = "test-hooks")]
    oom_injected: bool,
}

/// A micro-batch's inputs, staged for the next launch while the micro-batch before ran.
#[derive(Debug, Clone, PartialEq)]
struct StagedInputs {
    step: u64,
    micro: usize,
    arena: Vec<usize>,
}

/// A change of configuration made to carry on after running out of memory mid-step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recovery {
    /// The step that was redone, and the micro-batch where the allocation failed.
    pub step: u64,
    pub micro: usize,
    /// The allocation failed in the evaluation after `step`, which then ran again; no step
    /// was redone.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub evaluation: bool,
    /// The rank whose memory ran out (0 in one process); every rank recovered with it.
    pub rank: usize,
    pub failure: MemoryFailure,
    pub from: FitConfig,
    pub to: FitConfig,
    pub from_peak_bytes: usize,
    pub to_peak_bytes: usize,
}

/// Recoveries tried within one step before giving up (each one lowers the planned peak, so
/// this is only reached when the memory keeps shrinking).
const MAX_RECOVERIES_PER_STEP: usize = 8;

impl Trainer {
    pub fn new(config: TrainConfig, data: TokenDataset) -> Result<Trainer, TrainError> {
        Self::with_allocator(config, data, Allocator::default())
    }

    /// A trainer on `data`, whose step takes a loss mask when `config.loss_mask` asks for one
    /// or the data carries one. On the CPU every byte comes from `allocator`; on a GPU
    /// (`config.device`) the device's own allocator takes `allocator`'s memory limit.
    pub fn with_allocator(
        mut config: TrainConfig,
        data: TokenDataset,
        allocator: Allocator,
    ) -> Result<Trainer, TrainError> {
        data.check_block(config.block)?;
        config.loss_mask |= data.has_loss_mask();
        config.check_threads_here()?;
        check_world(&config)?;
        let minted = mint_run_id();
        if config.run_id.is_none() {
            config.run_id = Some(minted);
        }
        let crc = data.fingerprint();
        match config.data_crc32 {
            Some(saved) if saved != crc => {
                return Err(TrainError::DataChanged {
                    data: data.name.clone(),
                    saved,
                    now: crc,
                })
            }
            _ => config.data_crc32 = Some(crc),
        }
        // `SNUG_SETUP_DELAY_MS=N` (tests only): a setup as slow as a large model's, so a test
        // can signal a run before its loop starts.
        #[cfg(feature = "test-hooks")]
        if let Some(ms) = std::env::var("SNUG_SETUP_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        let model = config.model_for_vocab(data.tokenizer.vocab_size())?;
        // A Hugging Face directory is then decoded one parameter at a time from its mapped
        // files.
        let hf = config.open_init_from(&model)?;
        let (compiled, memory_plan) = compile_planned(&config, &model)?;
        let CompiledStep {
            step: step_graph,
            tokens,
            targets,
            loss_mask,
            remat_dropped,
            ..
        } = compiled;
        if let Some(d) = remat_dropped {
            let (without, with) = (d.peak_without_bytes, d.peak_with_bytes);
            if with > without {
                tracing::warn!(
                    "remat {} left out: it would raise the planned peak from {without} to {with} bytes",
                    d.remat
                );
            } else {
                tracing::warn!(
                    "remat {} left out: it would not lower the planned peak of {without} bytes",
                    d.remat
                );
            }
        }
        crate::ranks::check_agreement(&config, &memory_plan, &data)?;
        if let Some(limit) = config.memory_limit {
            allocator.set_memory_limit(limit, !config.strict_memory_limit);
        }
        let needed = memory_plan.peak_bytes();
        let session = StepSession::new(
            config.device,
            step_graph.graph.clone(),
            memory_plan,
            allocator,
            config.threads,
        );
        let mut session = match session {
            Err(TrainError::Runtime(RuntimeError::OutOfMemory(oom))) => {
                return Err(TrainError::DoesNotFit {
                    needed,
                    limit: (oom.limit != usize::MAX).then_some(oom.limit),
                });
            }
            other => other?,
        };
        if config.device.is_gpu() {
            config.adapter = Some(session.device_name());
        }
        // Each tensor is written as it is made, so the arena (touched whole when the session
        // is made) never sits beside a second copy of every parameter.
        type Init<'a> = Box<dyn Iterator<Item = Result<(String, Vec<f32>), TrainError>> + 'a>;
        let init: Init = match (&config.init_from, &model, &hf) {
            (None, _, _) => Box::new(model.init_parameters_iter(config.seed).map(Ok)),
            (Some(_), _, Some(ckpt)) => {
                Box::new(ckpt.parameter_shapes().into_iter().map(|(name, _)| {
                    let values = ckpt.read(&name)?;
                    Ok((name, values))
                }))
            }
            (Some(path), ModelConfig::Gpt(gpt), None) => Box::new(
                snug_nn::load_gpt2_safetensors(path, gpt)?
                    .into_iter()
                    .map(Ok),
            ),
            (Some(path), ModelConfig::Llama(_), None) => {
                return Err(crate::config::lone_weights_for_llama(path))
            }
        };
        // LoRA adapters start from the adapter continued, or as PEFT initialises them.
        let adapters: Init = match (config.lora_config(), config.adapter_init_dir()) {
            (None, _) => Box::new(std::iter::empty()),
            (Some(_), Some(dir)) => Box::new(
                snug_nn::lora::load_peft_adapter(&dir, &model)?
                    .tensors
                    .into_iter()
                    .map(Ok),
            ),
            (Some(lora), None) => Box::new(
                snug_nn::lora::init_adapters(&lora.layers(&model)?, lora.rank, config.seed)
                    .into_iter()
                    .map(Ok),
            ),
        };
        let init: Init = Box::new(init.chain(adapters));
        // Under ZeRO stage 3 a parameter is its `NAME.shard`: this rank's equal block of it,
        // zero-padded.
        let slot_of: std::collections::HashMap<&str, (TensorId, bool)> = step_graph
            .params
            .iter()
            .map(|s| (s.name.as_str(), s.param))
            .chain(step_graph.frozen.iter().map(|f| (f.name.as_str(), f.param)))
            .map(
                |(name, t)| match name.strip_suffix(snug_graph::zero::SHARD_SUFFIX) {
                    Some(base) => (base, (t, true)),
                    None => (name, (t, false)),
                },
            )
            .collect();
        let mut written = std::collections::HashSet::new();
        for item in init {
            let (name, values) = item?;
            if let Some(&(t, sharded)) = slot_of.get(name.as_str()) {
                if sharded {
                    session.write_f32(t, &rank_shard(&values, config.devices))?;
                } else {
                    crate::quantized::write_param(&mut session, config.quantize_base, t, &values)?;
                }
                written.insert(t);
            }
        }
        if let Some((name, _)) = slot_of.iter().find(|(_, (t, _))| !written.contains(t)) {
            return Err(TrainError::Config {
                field: "model",
                detail: format!("no initial value for parameter `{name}`"),
            });
        }
        let schedule = LrSchedule {
            lr: config.lr,
            min_lr: config.min_lr,
            warmup_steps: config.warmup_steps,
            total_steps: config.steps,
        };
        let forward = session.nodes_for(&[step_graph.loss]);
        let scaler = step_graph
            .loss_scale
            .map(|_| LossScaler::new(config.loss_scale, config.loss_scale_interval));
        let data = Arc::new(data);
        let prefetch = Prefetcher::new(data.clone(), config.seed, config.batch, config.block, 1);
        // Every micro-batch takes the arena from the allocator, the first one too: a memory
        // limit lowered before step 1 then bites at step 1.
        session.release_arena()?;
        snug_runtime::process::return_free_heap();
        Ok(Trainer {
            config,
            model,
            step_graph,
            session,
            data,
            tokens,
            targets,
            loss_mask,
            mask_buf: Vec::new(),
            schedule,
            step: 0,
            tokens_seen: 0,
            forward,
            prefetch,
            pending: None,
            staged: None,
            input_prefetch: true,
            prefetched: 0,
            machine: None,
            recoveries: Vec::new(),
            scaler,
            resumed_at: None,
            state_dirty: false,
            oom_rank: 0,
            failed_together: false,
            earlier_peak_bytes: 0,
            #[cfg(feature = "test-hooks")]
            oom_injected: false,
        })
    }

    /// Switches to another configuration of the same model and batch (micro-batch and
    /// accumulation, remat, passes): the step is recompiled and re-planned, and the session
    /// keeps its parameters and optimizer state in place, and its loss mask. On an allocation
    /// failure nothing changes.
    pub fn reconfigure(&mut self, mut config: TrainConfig) -> Result<(), TrainError> {
        self.drop_staged();
        config.loss_mask = self.config.loss_mask;
        // The same run, on the same data, whatever configuration a caller built.
        config.run_id.clone_from(&self.config.run_id);
        config.data_crc32 = self.config.data_crc32;
        if config.batch != self.config.batch || config.block != self.config.block {
            return Err(TrainError::Config {
                field: "batch",
                detail: format!(
                    "a running trainer keeps its batch {} × {} (asked for {} × {})",
                    self.config.batch, self.config.block, config.batch, config.block
                ),
            });
        }
        config.validate()?;
        let (compiled, memory_plan) = compile_planned(&config, &self.model)?;
        let CompiledStep {
            step,
            tokens,
            targets,
            loss_mask,
            ..
        } = compiled;
        self.session.replan(step.graph.clone(), memory_plan)?;
        // From here the allocator's peak is the new plan's, to be measured against it.
        let allocator = self.session.allocator();
        self.earlier_peak_bytes = self.earlier_peak_bytes.max(allocator.peak_bytes());
        allocator.reset_peak();
        self.forward = self.session.nodes_for(&[step.loss]);
        if step.loss_scale.is_none() {
            self.scaler = None;
        } else if self.scaler.is_none() {
            self.scaler = Some(LossScaler::new(
                config.loss_scale,
                config.loss_scale_interval,
            ));
        }
        self.step_graph = step;
        self.tokens = tokens;
        self.targets = targets;
        self.loss_mask = loss_mask;
        self.config = config;
        Ok(())
    }

    /// Fills the session's arena with `byte` before the next step (tests prove with it that no
    /// kernel reads arena bytes it did not write). Only with the `test-hooks` feature, which
    /// snug's own tests turn on.
    #[cfg(feature = "test-hooks")]
    pub fn poison_arena_for_test(&mut self, byte: u8) -> Result<(), TrainError> {
        Ok(self.session.fill_arena(byte)?)
    }

    /// Uses `machine` to choose recovery configurations (instead of the cached calibration).
    pub fn set_machine_profile(&mut self, machine: MachineProfile) {
        self.machine = Some(machine);
    }

    /// Configuration changes made since the last call.
    pub fn take_recoveries(&mut self) -> Vec<Recovery> {
        std::mem::take(&mut self.recoveries)
    }

    /// After `oom` at micro-batch `micro` of `step`: the fastest configuration whose plan fits
    /// under the limit, switched to. The step is then redone from its first micro-batch.
    ///
    /// Over several ranks every rank calls this with the same failure (that of the lowest rank
    /// whose memory ran out, [`crate::ranks::first_out_of_memory`]) and chooses the same
    /// configuration from what they share: the configuration, the plan, and nominal kernel
    /// timings rather than each machine's calibration. The ZeRO stage stays.
    ///
    /// `micro` is `None` for the evaluation after `step`, which is run again instead.
    fn recover(
        &mut self,
        step: u64,
        micro: Option<usize>,
        oom: OutOfMemory,
    ) -> Result<(), TrainError> {
        self.drop_staged();
        let failure = MemoryFailure {
            limit: oom.limit,
            requested: oom.requested,
            active: oom.active,
        };
        let threads = self.config.threads;
        let devices = self.config.devices;
        let nominal;
        let machine = if devices > 1 {
            nominal = MachineProfile::nominal(1);
            &nominal
        } else {
            self.machine.get_or_insert_with(|| {
                crate::calibration::cached(threads)
                    .unwrap_or_else(|| MachineProfile::nominal(threads))
            })
        };
        let from = FitConfig {
            micro_batch: self.config.micro_batch(),
            shard: self.config.shard,
            ..FitConfig::of(&self.config.step_config(), self.config.batch)
        };
        // A lever or a lower precision mid-run would change what is being trained: recovery
        // adds neither, and changes only how the step runs (micro-batches, remat).
        let fit_model = self
            .config
            .fit_model(self.model.clone())
            .allowing(None)
            .allowing_levers(snug_fit::Levers::none());
        let from_peak_bytes = self.session.plan().peak_bytes();
        let unrecoverable = |e: snug_fit::FitError| TrainError::Unrecoverable {
            step,
            failure: oom.clone(),
            detail: e.to_string(),
        };
        // The search below is a function of what the ranks share (the configuration, the
        // agreed failure, nominal timings): where it finds nothing, it finds nothing on every
        // rank.
        self.failed_together = true;
        let mut search = Search::new(
            &fit_model,
            self.config.target(),
            failure.budget(from_peak_bytes),
        );
        if let Some(check) = self.config.device.runnable() {
            search = search.runnable(check);
        }
        let search = if devices > 1 {
            // One rank's step at this stage: the whole batch stays, spread as before.
            search
                .devices(devices)
                .stage(from.shard)
                .effective_batch(self.config.batch)
                .max_micro_batch(from.micro_batch)
        } else {
            search.recovering_from(&from)
        };
        // `choose` refuses where nothing is chosen.
        let report = search.choose(machine).map_err(unrecoverable)?;
        let Some(chosen) = report.chosen().cloned() else {
            return Err(report.nothing_fits().into());
        };
        self.failed_together = false;
        let to = chosen.config.clone();
        let to_peak_bytes = chosen.peak_bytes.unwrap_or(0);
        let mut config = self.config.clone();
        config.apply_fit(&to);
        self.reconfigure(config)?;
        // Ranks that chose differently would wait for each other's collectives for ever.
        crate::ranks::check_agreement(&self.config, self.session.plan(), &self.data)?;
        // Reported to the caller as a `Recovery`; logged here for debugging only, so a user
        // reads one message per event.
        tracing::debug!(
            "out of memory at step {step}, micro-batch {micro:?} ({oom}): running on with {to} (planned peak {to_peak_bytes} bytes, was {from_peak_bytes} with {from})"
        );
        self.recoveries.push(Recovery {
            step,
            micro: micro.unwrap_or(0),
            evaluation: micro.is_none(),
            rank: self.oom_rank,
            failure,
            from,
            to,
            from_peak_bytes,
            to_peak_bytes,
        });
        Ok(())
    }

    /// A trainer continuing from `ckpt` exactly where it stopped; `config` must describe the
    /// same model (the checkpoint's own configuration, possibly with a new step count).
    pub fn resume(
        config: TrainConfig,
        data: TokenDataset,
        allocator: Allocator,
        ckpt: &Checkpoint,
    ) -> Result<Trainer, TrainError> {
        if data.tokenizer.to_spec() != ckpt.tokenizer {
            return Err(TrainError::Config {
                field: "data",
                detail: format!(
                    "the data's {} tokenizer differs from the checkpoint's: resume on the data it was trained on",
                    data.tokenizer.name()
                ),
            });
        }
        // Refused before the step is set up: what the checkpoint's state computes is kept.
        config.check_resumes(&ckpt.config)?;
        // The checkpoint's weights replace any starting point the run was created from.
        let config = TrainConfig {
            init_from: None,
            ..config
        };
        let mut trainer = Self::with_allocator(config, data, allocator)?;
        trainer.restore(ckpt)?;
        Ok(trainer)
    }

    /// A whole checkpoint is one process's state: under ZeRO stage 1 or more over several
    /// ranks, each rank holds a shard of the optimizer state (and under 3 of the parameters),
    /// and saves its part of a sharded checkpoint ([`Trainer::shard_ref`]).
    fn check_state_is_whole(&self) -> Result<(), TrainError> {
        if self.saves_sharded() {
            return Err(TrainError::Config {
                field: "shard",
                detail: format!(
                    "ZeRO stage {} spreads the state over the ranks: each rank saves its part of \
                     a sharded checkpoint (`shard_ref`), which loading consolidates",
                    self.config.shard
                ),
            });
        }
        Ok(())
    }

    /// Whether this trainer's state is spread over its ranks (ZeRO stage 1 or more on several),
    /// so that each rank saves its part of a sharded checkpoint.
    pub fn saves_sharded(&self) -> bool {
        self.config.devices > 1 && self.config.shard > 0
    }

    /// Where each persistent tensor goes in a checkpoint: its whole name and shape, and how the
    /// ranks hold it. Tensors not listed are whole in a world of one or at stage 0, and each
    /// rank's own otherwise (8-bit AdamW's per-shard blocks, a rank's own gradient norm).
    fn placements(&self) -> std::collections::HashMap<TensorId, Placement> {
        use snug_graph::zero::{unsharded_name, UnshardedShapes};
        let g = &self.step_graph.graph;
        let unsharded = UnshardedShapes::of(g);
        let sharded_state = self.saves_sharded();
        let mut out = std::collections::HashMap::new();
        let slots = self
            .step_graph
            .params
            .iter()
            .map(|s| (s.name.as_str(), s.param, s.moments, s.moment_scales))
            .chain(
                self.step_graph
                    .frozen
                    .iter()
                    .map(|f| (f.name.as_str(), f.param, None, None)),
            );
        for (name, p, moments, scales) in slots {
            let whole = unsharded_name(name);
            let full = unsharded.shape(g, p).to_vec();
            let param = if whole != name {
                (whole.to_string(), full.clone(), Layout::Sharded)
            } else {
                let shape = crate::quantized::value_shape(g, p).to_vec();
                (name.to_string(), shape, Layout::Whole)
            };
            out.insert(p, param);
            // An f32 moment is shaped as its gradient: this rank's shard under stages 1–3.
            if let (Some((m, v)), None, true) = (moments, scales, sharded_state) {
                for t in [m, v] {
                    if let Some(suffix) = g.tensor(t).name.strip_prefix(name) {
                        out.insert(
                            t,
                            (format!("{whole}{suffix}"), full.clone(), Layout::Sharded),
                        );
                    }
                }
            }
        }
        out
    }

    /// The f32 moments this run keeps that `ckpt` holds as 8-bit codes. Until parameters of
    /// fewer than [`MIN_8BIT_SIZE`](snug_graph::ops::adamw8bit::MIN_8BIT_SIZE) elements kept
    /// f32 moments under 8-bit AdamW, every parameter's were quantized, so a run saved then
    /// resumes with those moments dequantized: the values its codes stood for, which the
    /// earlier version's next step would have read.
    fn legacy_moments(
        &self,
        ckpt: &Checkpoint,
        places: &std::collections::HashMap<TensorId, Placement>,
    ) -> Result<LegacyMoments, TrainError> {
        use snug_graph::ops::adamw8bit::{blocks, dequantize, dynamic_code};
        let mut out = LegacyMoments::default();
        if self.config.optimizer != crate::OptimizerKind::AdamW8bit {
            return Ok(out);
        }
        let bad = |detail: String| TrainError::CheckpointMismatch { detail };
        let g = &self.step_graph.graph;
        let f32_moments = self.step_graph.params.iter().filter_map(|s| match s {
            snug_graph::ParamSlot {
                moments: Some((m, v)),
                moment_scales: None,
                ..
            } => Some([
                (*m, ".adam_m", ".adam8_m", true),
                (*v, ".adam_v", ".adam8_v", false),
            ]),
            _ => None,
        });
        for (t, suffix, old_suffix, signed) in f32_moments.flatten() {
            let (name, shape, place) = self.placement(places, t);
            let held = ckpt.tensor(&name).is_some()
                || (ckpt.per_rank.iter())
                    .any(|p| p.tensors.iter().flatten().any(|s| s.name == name));
            let Some(stem) = g.tensor(t).name.strip_suffix(suffix) else {
                continue;
            };
            if held {
                continue;
            }
            let (codes_name, absmax_name) = (
                format!("{stem}{old_suffix}"),
                format!("{stem}{old_suffix}_absmax"),
            );
            let per_rank_codes = (ckpt.per_rank.iter())
                .any(|p| p.quantized.iter().flatten().any(|q| q.name == codes_name));
            if per_rank_codes {
                // Under ZeRO-3 they were each rank's shard's codes, from which the whole f32
                // moments this run saves are not remade here.
                return Err(bad(format!(
                    "tensor `{name}` is missing: the checkpoint holds `{codes_name}` per rank as \
                     8-bit codes, from a snug that quantized the moments of tensors under {} \
                     elements too; resume it with that version",
                    snug_graph::ops::adamw8bit::MIN_8BIT_SIZE
                )));
            }
            let codes = ckpt.quantized.iter().find(|q| q.name == codes_name);
            let (Some(codes), Some(absmax), Layout::Whole) =
                (codes, ckpt.tensor(&absmax_name), place)
            else {
                continue;
            };
            let numel: usize = shape.iter().product();
            if codes.data.len() != numel || absmax.data.len() != blocks(numel) {
                return Err(bad(format!(
                    "tensors `{codes_name}` and `{absmax_name}` hold {} codes and {} block \
                     scales; the model's `{name}` has {numel} elements, {} blocks of {}",
                    codes.data.len(),
                    absmax.data.len(),
                    blocks(numel),
                    snug_graph::ops::adamw8bit::BLOCK
                )));
            }
            let mut data = vec![0.0; numel];
            dequantize(&dynamic_code(signed), &codes.data, &absmax.data, &mut data);
            out.codes.insert(codes_name);
            out.tensors.insert(absmax_name);
            out.values.insert(name, data);
        }
        Ok(out)
    }

    /// The most bytes the allocator held at once over this trainer's whole life, under every
    /// plan it ran (its peak since the last reconfiguration is the running plan's alone).
    pub fn run_peak_bytes(&self) -> usize {
        self.earlier_peak_bytes
            .max(self.session.allocator().peak_bytes())
    }

    /// `t`'s entry of [`Trainer::placements`], or its default.
    fn placement(
        &self,
        places: &std::collections::HashMap<TensorId, Placement>,
        t: TensorId,
    ) -> Placement {
        places.get(&t).cloned().unwrap_or_else(|| {
            let g = &self.step_graph.graph;
            let m = g.tensor(t);
            let layout = if self.saves_sharded() {
                Layout::PerRank
            } else {
                Layout::Whole
            };
            let shape = crate::quantized::value_shape(g, t).to_vec();
            (m.name.clone(), shape, layout)
        })
    }

    /// This rank's part of a sharded checkpoint of the state after the steps run so far
    /// (borrowed from the session where it can be): every rank of a sharded run saves one, at
    /// the same step ([`crate::shards::save`]).
    pub fn shard_ref(&self) -> Result<ShardRef<'_>, TrainError> {
        let (rank, ranks) = (world().0, self.config.devices);
        let places = self.placements();
        let mut layout = Vec::new();
        let mut tensors = Vec::new();
        let mut quantized = Vec::new();
        let ids = self
            .saved_tensors(false)
            .map(|t| (t, false))
            .chain(self.saved_tensors(true).map(|t| (t, true)));
        for (t, codes) in ids {
            let (name, shape, place) = self.placement(&places, t);
            let dtype = if codes {
                ShardDType::U8
            } else {
                ShardDType::F32
            };
            layout.push(TensorEntry {
                name: name.clone(),
                shape: shape.clone(),
                dtype,
                layout: place,
            });
            match (place, codes) {
                (Layout::Whole, _) if rank != 0 => {}
                (_, true) => quantized.push((name, shape, self.session.read_u8(t)?)),
                (Layout::Sharded, false) => {
                    let numel: usize = shape.iter().product();
                    let own = owned_range(numel, rank, ranks).len();
                    let values = self.read_values(t)?;
                    if values.len() != snug_graph::ops::shard_len(numel, ranks) {
                        return Err(TrainError::Config {
                            field: "shard",
                            detail: format!(
                                "`{name}` holds {} values on rank {rank}, not a shard of {numel} \
                                 over {ranks} ranks",
                                values.len()
                            ),
                        });
                    }
                    // The padding past the tensor's end is no state: it stays out of the file.
                    let part = match values {
                        std::borrow::Cow::Borrowed(v) => std::borrow::Cow::Borrowed(&v[..own]),
                        std::borrow::Cow::Owned(mut v) => {
                            v.truncate(own);
                            std::borrow::Cow::Owned(v)
                        }
                    };
                    tensors.push((name, vec![own], part));
                }
                (_, false) => tensors.push((name, shape, self.read_values(t)?)),
            }
        }
        Ok(ShardRef {
            rank,
            ranks,
            stage: self.config.shard,
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: &self.config,
            tokenizer: self.data.tokenizer.to_spec(),
            loss_scale: self.scaler,
            layout,
            tensors,
            quantized,
        })
    }

    /// Every persistent tensor a checkpoint holds: parameters and optimizer state, as f32
    /// values (`quantized` false: a quantized frozen weight dequantized, its absmax scales
    /// with it) or as u8 codes (true: 8-bit AdamW's moments).
    fn saved_tensors(&self, quantized: bool) -> impl Iterator<Item = TensorId> + '_ {
        let g = &self.step_graph.graph;
        let absmax = crate::quantized::absmax_tensors(g);
        (0..g.tensors().len() as u32)
            .map(TensorId)
            .filter(move |&t| {
                let m = g.tensor(t);
                m.view_of.is_none()
                    && matches!(m.role, Role::Parameter | Role::OptimizerState)
                    && (m.dtype == snug_graph::DType::U8 && m.role == Role::OptimizerState)
                        == quantized
                    && !absmax.contains(&t)
            })
    }

    /// The f32 values of persistent tensor `t` (dequantized where it is stored quantized).
    fn read_values(&self, t: TensorId) -> Result<std::borrow::Cow<'_, [f32]>, TrainError> {
        let g = &self.step_graph.graph;
        if g.tensor(t).dtype == snug_graph::DType::F32 {
            return Ok(self.session.read_f32(t)?);
        }
        let base = self.config.quantize_base;
        Ok(crate::quantized::read_param(&self.session, g, base, t)?.into())
    }

    /// The training state after the steps run so far: [`Trainer::checkpoint_ref`]'s, copied.
    pub fn checkpoint(&self) -> Result<Checkpoint, TrainError> {
        let r = self.checkpoint_ref()?;
        Ok(Checkpoint {
            step: r.step,
            tokens_seen: r.tokens_seen,
            config: r.config.clone(),
            tokenizer: r.tokenizer,
            tensors: r
                .tensors
                .into_iter()
                .map(|(name, shape, data)| SavedTensor {
                    name: name.to_string(),
                    shape: shape.to_vec(),
                    data: data.into_owned(),
                })
                .collect(),
            quantized: r
                .quantized
                .into_iter()
                .map(|(name, shape, data)| SavedBytes {
                    name: name.into_owned(),
                    shape: shape.to_vec(),
                    data: data.into_owned(),
                })
                .collect(),
            loss_scale: r.loss_scale,
            per_rank: None,
        })
    }

    /// The training state borrowed from the session (nothing copied), for saving.
    pub fn checkpoint_ref(&self) -> Result<CheckpointRef<'_>, TrainError> {
        self.check_state_is_whole()?;
        let g = &self.step_graph.graph;
        let mut tensors = self
            .saved_tensors(false)
            .map(|t| {
                let m = g.tensor(t);
                Ok((
                    m.name.as_str(),
                    crate::quantized::value_shape(g, t),
                    self.read_values(t)?,
                ))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        let mut quantized = self
            .saved_tensors(true)
            .map(|t| {
                let m = g.tensor(t);
                Ok((
                    m.name.as_str().into(),
                    m.shape.as_slice(),
                    self.session.read_u8(t)?,
                ))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        for (t, stats) in crate::quantized::stored_forms(g, self.config.quantize_base)? {
            let (m, s) = (g.tensor(t), g.tensor(stats));
            let codes = self.session.read_u8(t)?;
            quantized.push((stored_codes_name(g, t).into(), m.shape.as_slice(), codes));
            let scales = self.session.read_f32(stats)?;
            tensors.push((s.name.as_str(), s.shape.as_slice(), scales));
        }
        Ok(CheckpointRef {
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: &self.config,
            tokenizer: self.data.tokenizer.to_spec(),
            tensors,
            quantized,
            loss_scale: self.scaler,
            shard: None,
        })
    }

    /// Loads `ckpt`'s parameters, optimizer state and position. Every tensor must match by
    /// name and shape, both ways. The checkpoint holds whole tensors (a sharded one is
    /// consolidated as it loads): a rank of a sharded run takes its own shard of each, so a
    /// run resumes on any number of ranks; state each rank held for itself
    /// ([`Checkpoint::per_rank`]) only on as many.
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<(), TrainError> {
        self.drop_staged();
        let bad = |detail: String| TrainError::CheckpointMismatch { detail };
        // The optimizer, the adapters and the base's storage are the checkpoint's.
        self.config.check_resumes(&ckpt.config)?;
        let (rank, ranks) = (world().0, self.config.devices);
        // Sought whole, held only per rank by the run that saved it.
        let missing = |name: &str| match &ckpt.per_rank {
            Some(p) => bad(format!(
                "tensor `{name}` is missing: the checkpoint holds its optimizer state per rank, \
                 for {} ranks at ZeRO stage {}: resume on {} ranks with --shard {}",
                p.ranks, p.stage, p.ranks, p.stage
            )),
            None => bad(format!("tensor `{name}` is missing")),
        };
        let per_rank = |name: &str| -> Result<&PerRankState, TrainError> {
            match &ckpt.per_rank {
                Some(p) if p.ranks == ranks => Ok(p),
                Some(p) => Err(bad(format!(
                    "tensor `{name}` is state each of the {} ranks that saved the checkpoint held \
                     for itself (8-bit AdamW's blocks, a rank's own gradient norm), which has no \
                     whole form to divide over {ranks}: resume on {} ranks",
                    p.ranks, p.ranks
                ))),
                None => Err(bad(format!(
                    "tensor `{name}` is state each rank holds for itself under ZeRO stage {}, and \
                     the checkpoint has none: resume on the ranks and stage it was saved with",
                    self.config.shard
                ))),
            }
        };
        let wrong_shape = |name: &str, saved: &[usize], want: &[usize]| {
            bad(format!(
                "tensor `{name}` has shape {saved:?}, the model expects {want:?}"
            ))
        };
        let places = self.placements();
        let codes: Vec<(TensorId, Placement)> = self
            .saved_tensors(true)
            .map(|t| (t, self.placement(&places, t)))
            .collect();
        let values: Vec<(TensorId, Placement)> = self
            .saved_tensors(false)
            .map(|t| (t, self.placement(&places, t)))
            .collect();
        let legacy = self.legacy_moments(ckpt, &places)?;
        let mut used: std::collections::HashSet<&str> =
            legacy.codes.iter().map(String::as_str).collect();
        // A double-quantized base as it was stored, where the checkpoint holds it (saved
        // before it did, the base is quantized again from its values).
        let g = &self.step_graph.graph;
        let mut stored = std::collections::HashMap::new();
        for (t, stats) in crate::quantized::stored_forms(g, self.config.quantize_base)? {
            let codes_name = stored_codes_name(g, t);
            let stats_name = &g.tensor(stats).name;
            let codes = ckpt.quantized.iter().find(|q| q.name == codes_name);
            match (codes, ckpt.tensor(stats_name)) {
                (Some(codes), Some(scales)) => {
                    used.insert(codes.name.as_str());
                    stored.insert(t, (stats, codes, scales));
                }
                (None, None) => {}
                (None, Some(_)) => return Err(missing(&codes_name)),
                (Some(_), None) => return Err(missing(stats_name)),
            }
        }
        for (t, (name, shape, place)) in &codes {
            let saved = if *place == Layout::PerRank {
                per_rank(name)?.quantized[rank]
                    .iter()
                    .find(|q| &q.name == name)
                    .ok_or_else(|| missing(name))?
            } else {
                used.insert(name.as_str());
                ckpt.quantized
                    .iter()
                    .find(|q| &q.name == name)
                    .ok_or_else(|| missing(name))?
            };
            if &saved.shape != shape {
                return Err(wrong_shape(name, &saved.shape, shape));
            }
            self.session.write_u8(*t, &saved.data)?;
        }
        if let Some(extra) = ckpt
            .quantized
            .iter()
            .find(|s| !used.contains(s.name.as_str()))
        {
            return Err(bad(format!(
                "tensor `{}` has no place in this model (a different model or optimizer?)",
                extra.name
            )));
        }
        used.clear();
        used.extend(legacy.tensors.iter().map(String::as_str));
        used.extend(stored.values().map(|(_, _, scales)| scales.name.as_str()));
        for (t, (name, shape, place)) in &values {
            let data: &[f32] = if let Some(data) = legacy.values.get(name) {
                data
            } else {
                let saved = if *place == Layout::PerRank {
                    per_rank(name)?.tensors[rank]
                        .iter()
                        .find(|q| &q.name == name)
                        .ok_or_else(|| missing(name))?
                } else {
                    used.insert(name.as_str());
                    ckpt.tensor(name).ok_or_else(|| missing(name))?
                };
                if &saved.shape != shape {
                    return Err(wrong_shape(name, &saved.shape, shape));
                }
                &saved.data
            };
            match place {
                Layout::Sharded => self.session.write_f32(*t, &rank_shard(data, ranks))?,
                Layout::PerRank => self.session.write_f32(*t, data)?,
                Layout::Whole => match stored.get(t) {
                    Some(&(stats, codes, scales)) => crate::quantized::write_stored(
                        &mut self.session,
                        *t,
                        stats,
                        codes,
                        scales,
                        data,
                    )?,
                    None => {
                        let base = self.config.quantize_base;
                        crate::quantized::write_param(&mut self.session, base, *t, data)?
                    }
                },
            }
        }
        if let Some(extra) = ckpt
            .tensors
            .iter()
            .find(|s| !used.contains(s.name.as_str()))
        {
            return Err(bad(format!(
                "tensor `{}` has no place in this model (a different model or optimizer?)",
                extra.name
            )));
        }
        self.step = ckpt.step;
        self.resumed_at = Some(ckpt.step);
        self.state_dirty = false;
        self.tokens_seen = ckpt.tokens_seen;
        if self.scaler.is_some() {
            self.scaler = ckpt.loss_scale.or(self.scaler);
        }
        self.pending = None;
        self.prefetch = Prefetcher::new(
            self.data.clone(),
            self.config.seed,
            self.config.batch,
            self.config.block,
            self.step + 1,
        );
        Ok(())
    }

    /// Runs one optimizer step: every micro-batch of the step's batch, then the update.
    pub fn train_step(&mut self) -> Result<StepStats, TrainError> {
        Ok(self.step_inner(false)?.0)
    }

    /// Like [`Trainer::train_step`], also timing every node (seconds, in schedule order, summed
    /// over micro-batches).
    pub fn train_step_profiled(&mut self) -> Result<(StepStats, Vec<f64>), TrainError> {
        self.step_inner(true)
    }

    fn step_inner(&mut self, profile: bool) -> Result<(StepStats, Vec<f64>), TrainError> {
        let step = self.step + 1;
        let batch = match self.pending.take() {
            Some(b) if b.step == step => b,
            _ => self.drawn_batch(step)?,
        };
        let result = self.run_batch(&batch, step, profile, true);
        if result.is_err() {
            // The step did not happen: its batch is the next one tried.
            self.pending = Some(batch);
        }
        result
    }

    /// Step `step`'s batch from the prefetcher, restarted there when steps run on batches a
    /// caller gave ([`Trainer::step_on`]) moved the trainer past the batches it drew.
    fn drawn_batch(&mut self, step: u64) -> Result<Batch, TrainError> {
        let batch = self.prefetch.next()?;
        if batch.step == step {
            return Ok(batch);
        }
        self.prefetch = Prefetcher::new(
            self.data.clone(),
            self.config.seed,
            self.config.batch,
            self.config.block,
            step,
        );
        self.prefetch.next()
    }

    /// Runs one optimizer step on `batch`, given by the caller instead of drawn from the
    /// trainer's data: `batch × block` token ids and targets, each below the model's
    /// vocabulary, and optionally a loss mask of as many entries, which the step must have
    /// been compiled for ([`TrainConfig::loss_mask`], set by data with a mask). Without a
    /// mask, a masked step counts every target. The loss averages over the counted targets.
    ///
    /// Errors: [`TrainError::BatchLength`], [`TrainError::BatchToken`],
    /// [`TrainError::BatchMask`], checked before anything runs; then as
    /// [`Trainer::train_step`].
    pub fn step_on(&mut self, batch: &Batch) -> Result<StepStats, TrainError> {
        self.check_batch(batch)?;
        // The staged inputs are the drawn batch's, not this one's.
        self.drop_staged();
        Ok(self.run_batch(batch, self.step + 1, false, false)?.0)
    }

    /// Whether the trainer writes the next micro-batch's inputs while the current one runs,
    /// where the device stages inputs (a GPU; on by default). Which batches train, and so every
    /// loss, is the same either way.
    pub fn set_input_prefetch(&mut self, on: bool) {
        self.input_prefetch = on;
        if !on {
            self.drop_staged();
        }
    }

    /// Micro-batches so far that ran on inputs written while the micro-batch before ran.
    pub fn prefetched_micro_batches(&self) -> u64 {
        self.prefetched
    }

    /// Forgets inputs staged for the next micro-batch, and drops their copies.
    fn drop_staged(&mut self) {
        if self.staged.take().is_some() {
            self.session.discard_staged_inputs();
        }
    }

    /// Each micro-batch's loss divisor for `batch`: its counted targets over the step's
    /// micro-batches, so the mean of their losses, and of their gradients, is the mean over
    /// every counted target of the step, however the counts fall between micro-batches.
    fn divisor(&self, batch: &Batch) -> f32 {
        let micro_batches = self.config.accumulation * self.config.devices;
        (batch.counted() as f64 / micro_batches as f64) as f32
    }

    /// Writes micro-batch `micro` of `batch` into the step's inputs (the loss scale apart).
    fn write_inputs(
        &mut self,
        batch: &Batch,
        divisor: f32,
        micro: usize,
    ) -> Result<(), TrainError> {
        let k = self.config.accumulation;
        let chunk = self.config.micro_batch() * self.config.block;
        let vocab = self.model.vocab_size();
        // This rank's slice of the step's batch: micro-batches `rank·k ..` of the batch one
        // process would split into `devices·k`.
        let first = world().0 * k + micro;
        let range = first * chunk..(first + 1) * chunk;
        let (x, y) = (&batch.x[range.clone()], &batch.y[range.clone()]);
        self.session
            .fill_i32(self.tokens, vocab, |out| out.copy_from_slice(x))?;
        self.session
            .fill_i32(self.targets, vocab, |out| out.copy_from_slice(y))?;
        let mask = batch.mask.as_ref().map(|m| &m[range]);
        self.write_loss_mask(mask, chunk, divisor)
    }

    /// While micro-batch `micro` of `step` runs: stages the inputs of the one after (the next
    /// micro-batch of `batch`, or the first of the next step's batch, drawn now and kept as
    /// pending). The data position is the step number, so a staged batch never used changes
    /// nothing. A failure here only leaves the next micro-batch to write its inputs itself.
    fn stage_next(&mut self, batch: &Batch, divisor: f32, step: u64, micro: usize) {
        let staged = if micro + 1 < self.config.accumulation {
            self.write_inputs(batch, divisor, micro + 1)
                .map(|()| (step, micro + 1))
        } else {
            let next = match self.pending.take() {
                Some(b) if b.step == step + 1 => Ok(b),
                _ => self.drawn_batch(step + 1),
            };
            next.and_then(|next| {
                let written = self.write_inputs(&next, self.divisor(&next), 0);
                self.pending = Some(next);
                written.map(|()| (step + 1, 0))
            })
        };
        match staged {
            Ok((step, micro)) => {
                self.staged = Some(StagedInputs {
                    step,
                    micro,
                    arena: self.session.bound_arena(),
                })
            }
            Err(_) => self.session.discard_staged_inputs(),
        }
    }

    /// Whether `batch` fits this trainer's step.
    fn check_batch(&self, batch: &Batch) -> Result<(), TrainError> {
        let expected = self.config.batch * self.config.block;
        let mask_len = batch.mask.as_ref().map(Vec::len);
        for (field, found) in [
            ("tokens", Some(batch.x.len())),
            ("targets", Some(batch.y.len())),
            ("mask", mask_len),
        ] {
            match found {
                Some(found) if found != expected => {
                    return Err(TrainError::BatchLength {
                        field,
                        expected,
                        found,
                        batch: self.config.batch,
                        block: self.config.block,
                    })
                }
                _ => {}
            }
        }
        let vocab = self.model.vocab_size();
        for (field, ids) in [("tokens", &batch.x), ("targets", &batch.y)] {
            if let Some(index) = ids.iter().position(|&t| t < 0 || t as usize >= vocab) {
                return Err(TrainError::BatchToken {
                    field,
                    index,
                    value: ids[index],
                    vocab,
                });
            }
        }
        if batch.mask.is_some() && self.loss_mask.is_none() {
            return Err(TrainError::BatchMask);
        }
        Ok(())
    }

    /// With `drawn`, `batch` is the data's own for `step`, and the next step's may be staged
    /// while its last micro-batch runs.
    fn run_batch(
        &mut self,
        batch: &Batch,
        step: u64,
        profile: bool,
        drawn: bool,
    ) -> Result<(StepStats, Vec<f64>), TrainError> {
        let lr = self.schedule.at(step);
        let loss_tokens = batch.counted();
        let start = Instant::now();
        let mut recoveries = 0;
        // An out-of-memory error comes before any kernel of its micro-batch runs, and the
        // update runs on the last micro-batch only: redoing the step from the first micro-batch
        // with a smaller plan loses nothing (the first micro-batch overwrites the gradient sums).
        let (losses, grad_norm, node_times, micro_batches) = 'attempt: loop {
            // Counted again on each attempt: a recovery may have changed the accumulation.
            let micro_batches = self.config.accumulation * self.config.devices;
            let divisor = self.divisor(batch);
            let k = self.config.accumulation;
            let mut node_times: Vec<f64> = Vec::new();
            let mut losses = Vec::with_capacity(k);
            let mut grad_norm = None;
            for micro in 0..k {
                let stage_next = drawn || micro + 1 < k;
                match self.micro_step(batch, divisor, (step, micro), lr, profile, stage_next) {
                    Ok((loss, norm, times)) => {
                        losses.push(loss);
                        grad_norm = grad_norm.or(norm);
                        if node_times.is_empty() {
                            node_times = times;
                        } else {
                            node_times.iter_mut().zip(times).for_each(|(a, b)| *a += b);
                        }
                    }
                    Err(TrainError::Runtime(RuntimeError::OutOfMemory(oom)))
                        if recoveries < MAX_RECOVERIES_PER_STEP =>
                    {
                        recoveries += 1;
                        self.recover(step, Some(micro), oom)?;
                        continue 'attempt;
                    }
                    Err(e) => {
                        // Out of memory comes before any kernel runs; anything else in the
                        // last micro-batch may have come after some of the update.
                        let oom = matches!(e, TrainError::Runtime(RuntimeError::OutOfMemory(_)));
                        if micro + 1 == k && !oom {
                            self.state_dirty = true;
                        }
                        // Every rank learns of an out-of-memory before the step's first
                        // collective, and counts the same recoveries.
                        self.failed_together = oom;
                        return Err(e);
                    }
                }
            }
            break (losses, grad_norm, node_times, micro_batches);
        };
        let secs = start.elapsed().as_secs_f64();
        // The mean over every micro-batch of every rank, summed in the order one process
        // running them all as accumulation steps would.
        let losses = all_ranks(&losses);
        let loss = (losses.iter().map(|&l| l as f64).sum::<f64>() / micro_batches as f64) as f32;
        if !loss.is_finite() {
            // The update ran with this loss's gradients.
            self.state_dirty = true;
            return Err(TrainError::NonFinite { step, loss });
        }
        self.step = step;
        let loss_scale = self.scaler.map(|s| s.scale);
        let skipped = match (&mut self.scaler, grad_norm) {
            (Some(s), Some(norm)) => s.update(norm),
            _ => false,
        };
        if skipped {
            // The step's stats say so (`skipped`); one message per event.
            tracing::debug!(
                "step {step}: the scaled gradients overflowed; update skipped, loss scale {} -> {}",
                loss_scale.unwrap_or(0.0),
                self.scaler.map_or(0.0, |s| s.scale)
            );
        }
        let tokens = (self.config.batch * self.config.block) as u64;
        self.tokens_seen += tokens;
        let mem = self.session.allocator().stats();
        let stats = StepStats {
            step,
            loss,
            loss_tokens: loss_tokens as u64,
            lr,
            grad_norm,
            loss_scale,
            skipped,
            ms: secs * 1e3,
            tokens_per_s: tokens as f64 / secs,
            tokens_seen: self.tokens_seen,
            active_bytes: mem.active_bytes,
            peak_bytes: mem.peak_bytes,
            cache_bytes: mem.cache_bytes,
            rss_bytes: snug_runtime::process::resident_set().map(|(rss, _)| rss),
        };
        Ok((stats, node_times))
    }

    /// One micro-batch of `step`: inputs in (the loss mask with `divisor`, when the step has
    /// one), forward and backward (and on the last micro-batch the update), loss and gradient
    /// norm out, arena given back.
    fn micro_step(
        &mut self,
        batch: &Batch,
        divisor: f32,
        (step, micro): (u64, usize),
        lr: f32,
        profile: bool,
        stage_next: bool,
    ) -> Result<(f32, Option<f32>, Vec<f64>), TrainError> {
        let k = self.config.accumulation;
        // Every rank takes its memory (and learns whether any rank ran out) exactly once per
        // micro-batch. Inputs staged while the micro-batch before ran land where this run
        // reads them only if it holds the arena they were staged into.
        let staged = self.staged.take();
        if let Err(e) = self.take_memory(step) {
            self.session.discard_staged_inputs();
            return Err(e);
        }
        let staged = staged.is_some_and(|s| {
            (s.step, s.micro) == (step, micro) && s.arena == self.session.bound_arena()
        });
        if staged {
            self.prefetched += 1;
        } else {
            self.session.discard_staged_inputs();
            self.write_inputs(batch, divisor, micro)?;
        }
        if let (Some(t), Some(s)) = (self.step_graph.loss_scale, self.scaler) {
            self.session.write_f32(t, &[s.scale])?;
        }
        let ctx = ExecCtx {
            lr,
            // Adam's bias correction counts the updates made, not the skipped steps.
            step: step - self.scaler.map_or(0, |s| s.skipped),
            micro: micro as u32,
            micro_steps: k as u32,
        };
        let times = if profile {
            self.session.run_profiled(ctx)?
        } else {
            self.session.run(ctx)?;
            Vec::new()
        };
        // The step is submitted and runs on its own (a GPU): the next micro-batch's inputs go
        // into the staging ring now, before the loss read waits for the step.
        if stage_next && !profile && self.input_prefetch && self.session.stages_inputs() {
            self.stage_next(batch, divisor, step, micro);
        }
        let loss = self.session.read_f32(self.step_graph.loss)?[0];
        let grad_norm = match self.step_graph.grad_norm {
            Some(t) if micro + 1 == k => Some(self.session.read_f32(t)?[0]),
            _ => None,
        };
        self.session.release_arena()?;
        Ok((loss, grad_norm, times))
    }

    /// Takes the memory of a micro-batch of `step`. Over several ranks, every rank then learns
    /// whether any rank's memory ran out, before the step's first collective (where the others
    /// would wait for the failed rank for ever): then each gives its memory back and fails
    /// with that rank's out-of-memory, and all recover together.
    fn take_memory(&mut self, step: u64) -> Result<(), TrainError> {
        let taken = self.session.acquire_arena();
        #[cfg(feature = "test-hooks")]
        let taken = self.inject_oom(step, taken);
        #[cfg(not(feature = "test-hooks"))]
        let _ = step;
        let mine = match taken {
            Ok(()) => None,
            Err(RuntimeError::OutOfMemory(oom)) => Some(oom),
            Err(e) => return Err(e.into()),
        };
        match crate::ranks::first_out_of_memory(mine.as_ref()) {
            None => Ok(()),
            Some((rank, oom)) => {
                self.session.release_arena()?;
                self.oom_rank = rank;
                Err(TrainError::Runtime(RuntimeError::OutOfMemory(oom)))
            }
        }
    }

    /// `SNUG_INJECT_OOM=RANK:STEP` (tests only): the first try of step `STEP` on rank `RANK`
    /// runs out of memory under a limit one byte below the planned peak, once a run.
    #[cfg(feature = "test-hooks")]
    fn inject_oom(
        &mut self,
        step: u64,
        taken: Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let spec = std::env::var("SNUG_INJECT_OOM").unwrap_or_default();
        let at = spec
            .split_once(':')
            .and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<u64>().ok()?)));
        if self.oom_injected || at != Some((world().0, step)) {
            return taken;
        }
        self.oom_injected = true;
        self.session.release_arena()?;
        let plan = self.session.plan();
        Err(RuntimeError::OutOfMemory(OutOfMemory {
            requested: plan.arena_bytes,
            limit: plan.peak_bytes().saturating_sub(1),
            active: plan.persistent_bytes,
            cached: 0,
            device: snug_runtime::Device::Cpu,
        }))
    }

    /// Writes the loss mask's inputs, when the step has them: `mask` as 0/1 weights (all ones
    /// without one) for `len` targets, and `divisor`.
    fn write_loss_mask(
        &mut self,
        mask: Option<&[bool]>,
        len: usize,
        divisor: f32,
    ) -> Result<(), TrainError> {
        let Some(m) = self.loss_mask else {
            return Ok(());
        };
        self.mask_buf.clear();
        match mask {
            Some(mask) => self
                .mask_buf
                .extend(mask.iter().map(|&c| if c { 1.0 } else { 0.0 })),
            None => self.mask_buf.resize(len, 1.0),
        }
        self.session.write_f32(m.mask, &self.mask_buf)?;
        self.session.write_f32(m.divisor, &[divisor])?;
        Ok(())
    }

    /// Mean loss over `eval_batches` fixed batches (of the step's `batch` windows) of the
    /// training and the validation split, running the forward pass alone: parameters and
    /// optimizer state are untouched. Under a loss mask, the mean over the targets it counts
    /// in all of them.
    pub fn evaluate(&mut self) -> Result<EvalStats, TrainError> {
        match self.evaluate_unless(&|| false)? {
            Some(e) => Ok(e),
            None => unreachable!("never asked to stop"),
        }
    }

    /// [`Trainer::evaluate`], abandoned (`None`) as soon as `stop()` says so between batches:
    /// a run told to stop saves without waiting for an evaluation of up to a million
    /// batches. In one process, running out of memory switches to a smaller configuration as
    /// a step does ([`Trainer::take_recoveries`] reports it) and evaluates again; over ranks
    /// it ends the run, as the ranks would have to agree mid-evaluation.
    pub fn evaluate_unless(
        &mut self,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<EvalStats>, TrainError> {
        let mut recoveries = 0;
        loop {
            match self.evaluate_once(stop) {
                Err(TrainError::Runtime(RuntimeError::OutOfMemory(oom)))
                    if self.config.devices == 1 && recoveries < MAX_RECOVERIES_PER_STEP =>
                {
                    recoveries += 1;
                    self.session.release_arena()?;
                    self.recover(self.step, None, oom)?;
                }
                Err(e @ TrainError::Runtime(RuntimeError::OutOfMemory(_)))
                    if self.config.devices > 1 =>
                {
                    // Agreed on over the ranks as a step's is (`take_memory`).
                    self.failed_together = true;
                    return Err(TrainError::EvaluationOutOfMemory {
                        step: self.step,
                        detail: e.to_string(),
                    });
                }
                result => return result,
            }
        }
    }

    fn evaluate_once(&mut self, stop: &dyn Fn() -> bool) -> Result<Option<EvalStats>, TrainError> {
        // Evaluation writes its own inputs over the staged ones.
        self.drop_staged();
        let start = Instant::now();
        let data = self.data.clone();
        let Some((train_loss, train_loss_tokens)) = self.mean_loss(&data.train, stop)? else {
            return Ok(None);
        };
        let Some((val_loss, val_loss_tokens)) = self.mean_loss(&data.val, stop)? else {
            return Ok(None);
        };
        Ok(Some(EvalStats {
            step: self.step,
            train_loss,
            val_loss,
            train_loss_tokens,
            val_loss_tokens,
            ms: start.elapsed().as_secs_f64() * 1e3,
        }))
    }

    /// The mean loss over a split's evaluation batches, and the targets it counted; `None`
    /// when `stop()` said so before a micro-batch.
    ///
    /// Evaluation batch `i` is `batch` windows drawn from `(seed, i)` alone, so every run of
    /// one `batch` evaluates the same windows however it runs its step: any micro-batch or
    /// accumulation, a configuration switched to after running out of memory, or ranks (each
    /// takes its equal share of every batch, in micro-batches, and the ranks then combine
    /// their sums). Each micro-batch averages over its own counted targets (all of them
    /// without a loss mask) and is weighed by them: the result is the mean over every
    /// counted target (0 when none is).
    fn mean_loss(
        &mut self,
        split: &Tokens,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<(f32, u64)>, TrainError> {
        let (mb, block, batch) = (
            self.config.micro_batch(),
            self.config.block,
            self.config.batch,
        );
        let share = batch / self.config.devices;
        let first = world().0 * share;
        let vocab = self.model.vocab_size();
        let n = mb * block;
        let (mut starts, mut x, mut y) = (Vec::new(), vec![0; n], vec![0; n]);
        let mut mask = vec![true; n];
        let (mut sum, mut counted) = (0.0f64, 0u64);
        for i in 0..self.config.eval_batches {
            batch_starts(
                self.config.seed ^ EVAL_STREAM,
                i as u64,
                split.len(),
                batch,
                block,
                &mut starts,
            );
            for chunk in starts[first..first + share].chunks_exact(mb) {
                if stop() {
                    self.session.release_arena()?;
                    return Ok(None);
                }
                fill_batch(split, chunk, block, &mut x, &mut y);
                let count = if self.loss_mask.is_some() {
                    fill_mask(split, chunk, block, &mut mask);
                    let count = mask.iter().filter(|&&c| c).count();
                    self.write_loss_mask(Some(&mask), n, count as f32)?;
                    count
                } else {
                    n
                };
                self.session.write_i32(self.tokens, &x, vocab)?;
                self.session.write_i32(self.targets, &y, vocab)?;
                self.session.run_only(ExecCtx::default(), &self.forward)?;
                let loss = self.session.read_f32(self.step_graph.loss)?[0] as f64;
                sum += loss * count as f64;
                counted += count as u64;
            }
        }
        self.session.release_arena()?;
        if self.config.devices > 1 {
            (sum, counted) = sum_over_ranks(sum, counted);
        }
        let mean = if counted == 0 {
            0.0
        } else {
            (sum / counted as f64) as f32
        };
        Ok(Some((mean, counted)))
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    pub fn plan(&self) -> &MemoryPlan {
        self.session.plan()
    }

    pub fn session(&self) -> &StepSession {
        &self.session
    }

    pub fn step_graph(&self) -> &StepGraph {
        &self.step_graph
    }

    /// The loss mask's inputs, when the step takes one.
    pub fn loss_mask(&self) -> Option<LossMask> {
        self.loss_mask
    }

    pub fn data(&self) -> &TokenDataset {
        &self.data
    }

    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The step of the checkpoint this trainer was restored from, if it was.
    pub fn resumed_at(&self) -> Option<u64> {
        self.resumed_at
    }

    /// Whether the parameters and optimizer state are those after [`Trainer::steps_done`]
    /// steps, so saving them makes a true checkpoint. False after a step failed once its
    /// update may have run.
    pub fn state_is_consistent(&self) -> bool {
        !self.state_dirty
    }

    /// Whether the error that ended the run stopped every rank at the same point (an
    /// out-of-memory they agreed on and could not recover from), so that they can save a
    /// sharded checkpoint together. One process saves its whole state after any error that
    /// leaves it consistent, and does not ask.
    pub fn failed_together(&self) -> bool {
        self.failed_together
    }

    /// The model's weights as inference reads them: with LoRA, the adapters folded into their
    /// base weights ([`snug_nn::lora::merge_adapters`]); otherwise [`Trainer::parameters`].
    pub fn model_weights(&self) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
        let mut params = self.parameters()?;
        if let Some(lora) = self.config.lora_config() {
            snug_nn::lora::merge_adapters(&self.model, &lora, &mut params)?;
        }
        Ok(params)
    }

    /// Current values of every parameter (trained and frozen), by Hugging Face name.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
        let graph = &self.step_graph.graph;
        let unsharded = snug_graph::zero::UnshardedShapes::of(graph);
        self.step_graph
            .params
            .iter()
            .map(|p| (&p.name, p.param))
            .chain(self.step_graph.frozen.iter().map(|f| (&f.name, f.param)))
            .map(
                |(name, t)| match name.strip_suffix(snug_graph::zero::SHARD_SUFFIX) {
                    Some(base) => {
                        let numel = unsharded.shape(graph, t).iter().product::<usize>();
                        let mut full = all_ranks(&self.session.read_f32(t)?);
                        full.truncate(numel);
                        Ok((base.to_string(), full))
                    }
                    None => Ok((name.clone(), self.read_values(t)?.into_owned())),
                },
            )
            .collect()
    }
}

/// The checkpoint name of quantized weight `t`'s stored codes (its values keep its own name).
fn stored_codes_name(g: &snug_graph::Graph, t: TensorId) -> String {
    format!(
        "{}{}",
        g.tensor(t).name,
        crate::quantized::STORED_CODES_SUFFIX
    )
}

/// What [`Trainer::legacy_moments`] found: f32 moments by saved name, and the names of the
/// checkpoint's codes and block scales they were made from.
#[derive(Default)]
struct LegacyMoments {
    values: std::collections::HashMap<String, Vec<f32>>,
    codes: std::collections::HashSet<String>,
    tensors: std::collections::HashSet<String>,
}

/// This rank's equal block of `values` over `ranks`, zero-padded to the block's length.
fn rank_shard(values: &[f32], ranks: usize) -> Vec<f32> {
    let s = snug_graph::ops::shard_len(values.len(), ranks);
    let rank = world().0;
    let (lo, hi) = (
        (rank * s).min(values.len()),
        ((rank + 1) * s).min(values.len()),
    );
    let mut out = vec![0.0; s];
    out[..hi - lo].copy_from_slice(&values[lo..hi]);
    out
}

/// Every rank's `values` (of one length on every rank), in rank order: `values` itself in a
/// world of one. Every rank must call it at the same point.
fn all_ranks(values: &[f32]) -> Vec<f32> {
    match transport() {
        Some(t) => {
            let mut out = vec![0.0; values.len() * t.size()];
            t.all_gather(values, &mut out);
            out
        }
        None => values.to_vec(),
    }
}

/// Every rank's loss sum and count of targets, summed in rank order (the same result on
/// every rank). The sums travel as f32 (a loss needs no more); the counts in 16-bit limbs,
/// each exact in an f32, so a count past 2^24 arrives whole.
fn sum_over_ranks(sum: f64, counted: u64) -> (f64, u64) {
    let limb = |k: u32| ((counted >> (16 * k)) & 0xFFFF) as f32;
    let mine = [sum as f32, limb(0), limb(1), limb(2), limb(3)];
    all_ranks(&mine)
        .chunks_exact(mine.len())
        .fold((0.0, 0), |(s, c), r| {
            let count = (0..4).fold(0u64, |acc, k| acc | ((r[k + 1] as u64) << (16 * k)));
            (s + r[0] as f64, c + count)
        })
}

/// `config`'s step of `model` on this rank, and the plan compiling it made.
fn compile_planned(
    config: &TrainConfig,
    model: &ModelConfig,
) -> Result<(CompiledStep, MemoryPlan), TrainError> {
    let mut compiled = compile_sharded(
        model,
        config.step_shape(),
        config.target(),
        &config.step_config(),
        &config.sharding()?,
    )?;
    let plan = compiled.take_plan()?;
    Ok((compiled, plan))
}

/// A fresh run's id: 100 random bits, rank 0's on every rank (summed with zeros from the
/// others; each f32 carries 20 bits exactly). Every rank calls it, whether or not its own
/// configuration already has an id, so the collective matches on every rank and ranks that
/// loaded different checkpoints reach `check_agreement`, which names the difference.
fn mint_run_id() -> String {
    let rank0 = world().0 == 0;
    let mut parts: [f32; 5] = std::array::from_fn(|_| {
        if rank0 {
            (rand::random::<u32>() & 0xF_FFFF) as f32
        } else {
            0.0
        }
    });
    if let Some(t) = transport() {
        t.all_reduce_sum(&mut parts);
    }
    parts.iter().map(|&p| format!("{:05x}", p as u32)).collect()
}

/// The configured ranks are the world this process runs in.
fn check_world(config: &TrainConfig) -> Result<(), TrainError> {
    let (rank, size) = world();
    if config.devices != size {
        return Err(TrainError::Config {
            field: "devices",
            detail: format!(
                "the run is set for {} ranks, but this process is rank {rank} of {size}: \
                 launch it with `mpirun -np {} snug train …` (on a build with the `mpi` feature)",
                config.devices, config.devices
            ),
        });
    }
    if config.shard > 0 && size == 1 {
        return Err(TrainError::Config {
            field: "shard",
            detail: format!(
                "ZeRO stage {} shards over several ranks, and this process runs alone: launch \
                 it with `mpirun -np N snug train …` (on a build with the `mpi` feature)",
                config.shard
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let s = LrSchedule {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.at(5) - 0.5).abs() < 1e-6);
        assert!((s.at(10) - 1.0).abs() < 1e-6);
        assert!((s.at(60) - 0.55).abs() < 1e-6);
        assert!((s.at(110) - 0.1).abs() < 1e-6);
    }
}
