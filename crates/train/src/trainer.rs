//! One training run's state: compile the step graph once, plan it, load it into a CPU session,
//! then per step take the prefetched batch, run each micro-batch, and report. Evaluation,
//! checkpoint and restore work on the same session.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use snug_graph::ops::{AdamW, Sgd};
use snug_graph::{passes, OptimizerSpec, Role, StepGraph, StepOptions, TensorId};
use snug_nn::ModelConfig;
use snug_plan::{plan, MemoryPlan, PlanOptions};
use snug_runtime::{Allocator, CpuSession, ExecCtx};

use crate::checkpoint::{Checkpoint, CheckpointRef, SavedTensor};
use crate::config::{OptimizerKind, Pass, Remat};
use crate::data::{batch_starts, fill_batch, Prefetcher, Tokens};
use crate::{TokenDataset, TrainConfig, TrainError};

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
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    pub lr: f32,
    /// Global norm of the averaged gradient, before clipping.
    pub grad_norm: Option<f32>,
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
/// evaluations compare).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalStats {
    pub step: u64,
    pub train_loss: f32,
    pub val_loss: f32,
    pub ms: f64,
}

/// Mixed into the seed for evaluation batches, so they never coincide with training batches.
const EVAL_STREAM: u64 = 0xE7A1_0000_0000_0000;

/// A model being trained: its compiled step, plan, session and data.
pub struct Trainer {
    config: TrainConfig,
    model: ModelConfig,
    step_graph: StepGraph,
    session: CpuSession,
    data: Arc<TokenDataset>,
    tokens: TensorId,
    targets: TensorId,
    schedule: LrSchedule,
    step: u64,
    tokens_seen: u64,
    /// Nodes the loss depends on: the forward pass, run alone for evaluation.
    forward: Vec<bool>,
    /// Batches of the coming steps, drawn on a background thread.
    prefetch: Prefetcher,
}

/// Compiles the training step of `model` for micro-batches of `batch × block` tokens.
pub fn compile_step(
    model: &ModelConfig,
    batch: usize,
    block: usize,
    threads: usize,
    config: &TrainConfig,
) -> Result<(StepGraph, TensorId, TensorId), TrainError> {
    let mut g = model.build(batch, block, threads, config.precision)?;
    // Forward-graph passes run before autodiff (their ops bring their own gradients).
    for pass in &config.passes {
        if *pass == Pass::FusedCrossEntropy {
            let (r, _) = passes::fuse_lm_head_loss(&g.graph, passes::DEFAULT_CHUNK_BYTES)?;
            g = g.rewritten(r)?;
        }
    }
    let adamw = AdamW {
        beta1: config.beta1,
        beta2: config.beta2,
        eps: 1e-8,
        weight_decay: config.weight_decay,
    };
    let optimizer = match config.optimizer {
        OptimizerKind::AdamW => OptimizerSpec::AdamW(adamw),
        OptimizerKind::Sgd => OptimizerSpec::Sgd(Sgd {
            weight_decay: config.weight_decay,
        }),
    };
    let options = StepOptions {
        optimizer,
        micro_steps: config.accumulation,
        clip_grad_norm: (config.grad_clip > 0.0).then_some(config.grad_clip),
        grad_norm: true,
    };
    let mut step = StepGraph::build_with(g.graph, g.loss, &options)?;
    let (mut tokens, mut targets) = (g.tokens, g.targets);
    for pass in &config.passes {
        let (r, _) = match pass {
            Pass::FusedCrossEntropy => continue,
            Pass::Cse => passes::eliminate_common_subexpressions(&step.graph)?,
            Pass::Dce => passes::eliminate_dead_code(&step.graph)?,
        };
        (tokens, targets) = (r.map(tokens)?, r.map(targets)?);
        let forward = r.surviving(step.forward_nodes);
        step = step.rewritten(r, forward)?;
    }
    let policy = match config.remat {
        Remat::None => return Ok((step, tokens, targets)),
        Remat::Blocks { blocks } => passes::RematPolicy::Uniform {
            blocks_per_segment: blocks,
        },
        Remat::Selective => passes::RematPolicy::Selective,
        Remat::Budget { bytes } => {
            let chosen = snug_plan::remat_for_budget(&step, bytes, &PlanOptions::default())
                .map_err(|e| match e {
                    snug_plan::BudgetError::DoesNotFit { budget, smallest } => {
                        TrainError::RematBudget { budget, smallest }
                    }
                    snug_plan::BudgetError::Graph(e) => e.into(),
                    snug_plan::BudgetError::Plan(e) => e.into(),
                })?;
            // Inputs keep their positions in `StepGraph::inputs` through a rewrite.
            let find = |old: TensorId| {
                let i = step.inputs.iter().position(|&t| t == old)?;
                chosen.step.inputs.get(i).copied()
            };
            let (Some(tokens), Some(targets)) = (find(tokens), find(targets)) else {
                return Err(TrainError::Config {
                    field: "remat",
                    detail: "the budgeted rewrite lost the step's inputs".into(),
                });
            };
            return Ok((chosen.step, tokens, targets));
        }
    };
    let (r, _) = passes::rematerialize(&step, policy)?;
    let (tokens, targets) = (r.map(tokens)?, r.map(targets)?);
    let step = step.rewritten(r, step.forward_nodes)?;
    Ok((step, tokens, targets))
}

impl Trainer {
    pub fn new(config: TrainConfig, data: TokenDataset) -> Result<Trainer, TrainError> {
        Self::with_allocator(config, data, Allocator::default())
    }

    pub fn with_allocator(
        config: TrainConfig,
        data: TokenDataset,
        allocator: Allocator,
    ) -> Result<Trainer, TrainError> {
        data.check_block(config.block)?;
        let model = config.model_for_vocab(data.tokenizer.vocab_size())?;
        let (step_graph, tokens, targets) = compile_step(
            &model,
            config.micro_batch(),
            config.block,
            config.threads,
            &config,
        )?;
        let memory_plan = plan(&step_graph.graph, &PlanOptions::default())?;
        if let Some(limit) = config.memory_limit {
            allocator.set_memory_limit(limit, !config.strict_memory_limit);
        }
        let needed = memory_plan.peak_bytes();
        let session = CpuSession::new(
            step_graph.graph.clone(),
            memory_plan,
            allocator,
            config.threads,
        );
        let mut session = match session {
            Err(snug_runtime::RuntimeError::OutOfMemory(oom)) => {
                return Err(TrainError::DoesNotFit {
                    needed,
                    limit: oom.limit,
                });
            }
            other => other?,
        };
        let init: std::collections::HashMap<String, Vec<f32>> = match (&config.init_from, &model) {
            (None, _) => model.init_parameters(config.seed).into_iter().collect(),
            (Some(path), ModelConfig::Gpt(gpt)) => snug_nn::load_gpt2_safetensors(path, gpt)?
                .into_iter()
                .collect(),
            (Some(_), ModelConfig::Llama(_)) => {
                return Err(TrainError::Config {
                    field: "init_from",
                    detail: "Hugging Face weights load into GPT-2 models only".into(),
                })
            }
        };
        for slot in &step_graph.params {
            let values = init.get(&slot.name).ok_or_else(|| TrainError::Config {
                field: "model",
                detail: format!("no initial value for parameter `{}`", slot.name),
            })?;
            session.write_f32(slot.param, values)?;
        }
        let schedule = LrSchedule {
            lr: config.lr,
            min_lr: config.min_lr,
            warmup_steps: config.warmup_steps,
            total_steps: config.steps,
        };
        let forward = session.nodes_for(&[step_graph.loss]);
        let data = Arc::new(data);
        let prefetch = Prefetcher::new(data.clone(), config.seed, config.batch, config.block, 1);
        Ok(Trainer {
            config,
            model,
            step_graph,
            session,
            data,
            tokens,
            targets,
            schedule,
            step: 0,
            tokens_seen: 0,
            forward,
            prefetch,
        })
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
        // The checkpoint's weights replace any starting point the run was created from.
        let config = TrainConfig {
            init_from: None,
            ..config
        };
        let mut trainer = Self::with_allocator(config, data, allocator)?;
        trainer.restore(ckpt)?;
        Ok(trainer)
    }

    /// Every persistent tensor a checkpoint holds: parameters and optimizer state.
    fn saved_tensors(&self) -> impl Iterator<Item = TensorId> + '_ {
        let g = &self.step_graph.graph;
        (0..g.tensors().len() as u32)
            .map(TensorId)
            .filter(move |&t| {
                let m = g.tensor(t);
                m.view_of.is_none() && matches!(m.role, Role::Parameter | Role::OptimizerState)
            })
    }

    /// The training state after the steps run so far.
    pub fn checkpoint(&self) -> Result<Checkpoint, TrainError> {
        let g = &self.step_graph.graph;
        let tensors = self
            .saved_tensors()
            .map(|t| {
                Ok(SavedTensor {
                    name: g.tensor(t).name.clone(),
                    shape: g.tensor(t).shape.clone(),
                    data: self.session.read_f32(t)?.to_vec(),
                })
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        Ok(Checkpoint {
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: self.config.clone(),
            tokenizer: self.data.tokenizer.to_spec(),
            tensors,
        })
    }

    /// The training state borrowed from the session (nothing copied), for saving.
    pub fn checkpoint_ref(&self) -> Result<CheckpointRef<'_>, TrainError> {
        let g = &self.step_graph.graph;
        let tensors = self
            .saved_tensors()
            .map(|t| {
                let m = g.tensor(t);
                Ok((
                    m.name.as_str(),
                    m.shape.as_slice(),
                    self.session.read_f32(t)?,
                ))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        Ok(CheckpointRef {
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: &self.config,
            tokenizer: self.data.tokenizer.to_spec(),
            tensors,
        })
    }

    /// Loads `ckpt`'s parameters, optimizer state and position. Every tensor must match by
    /// name and shape, both ways.
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<(), TrainError> {
        let ids: Vec<TensorId> = self.saved_tensors().collect();
        let bad = |detail: String| TrainError::Checkpoint {
            path: PathBuf::from("<checkpoint>"),
            detail,
        };
        for &t in &ids {
            let meta = self.step_graph.graph.tensor(t).clone();
            let saved = ckpt
                .tensor(&meta.name)
                .ok_or_else(|| bad(format!("tensor `{}` is missing", meta.name)))?;
            if saved.shape != meta.shape {
                return Err(bad(format!(
                    "tensor `{}` has shape {:?}, the model expects {:?}",
                    meta.name, saved.shape, meta.shape
                )));
            }
            self.session.write_f32(t, &saved.data)?;
        }
        if let Some(extra) = ckpt.tensors.iter().find(|s| {
            !ids.iter()
                .any(|&t| self.step_graph.graph.tensor(t).name == s.name)
        }) {
            return Err(bad(format!(
                "tensor `{}` has no place in this model (a different model or optimizer?)",
                extra.name
            )));
        }
        self.step = ckpt.step;
        self.tokens_seen = ckpt.tokens_seen;
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
        let batch = self.prefetch.next()?;
        debug_assert_eq!(batch.step, step, "the prefetcher follows the trainer");
        let k = self.config.accumulation;
        let chunk = self.config.micro_batch() * self.config.block;
        let vocab = self.model.vocab_size();
        let lr = self.schedule.at(step);
        let start = Instant::now();
        let mut node_times: Vec<f64> = Vec::new();
        let mut loss_sum = 0.0f64;
        for micro in 0..k {
            let range = micro * chunk..(micro + 1) * chunk;
            let (x, y) = (&batch.x[range.clone()], &batch.y[range]);
            self.session
                .fill_i32(self.tokens, vocab, |out| out.copy_from_slice(x))?;
            self.session
                .fill_i32(self.targets, vocab, |out| out.copy_from_slice(y))?;
            let ctx = ExecCtx {
                lr,
                step,
                micro: micro as u32,
                micro_steps: k as u32,
            };
            if profile {
                let times = self.session.run_profiled(ctx);
                if node_times.is_empty() {
                    node_times = times;
                } else {
                    node_times.iter_mut().zip(times).for_each(|(a, b)| *a += b);
                }
            } else {
                self.session.run(ctx);
            }
            loss_sum += self.session.read_f32(self.step_graph.loss)?[0] as f64;
        }
        let secs = start.elapsed().as_secs_f64();
        let loss = (loss_sum / k as f64) as f32;
        if !loss.is_finite() {
            return Err(TrainError::NonFinite { step, loss });
        }
        let grad_norm = match self.step_graph.grad_norm {
            Some(t) => Some(self.session.read_f32(t)?[0]),
            None => None,
        };
        self.step = step;
        let tokens = (self.config.batch * self.config.block) as u64;
        self.tokens_seen += tokens;
        let mem = self.session.allocator().stats();
        let stats = StepStats {
            step,
            loss,
            lr,
            grad_norm,
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

    /// Mean loss over `eval_batches` fixed micro-batches of the training and the validation
    /// split, running the forward pass alone: parameters and optimizer state are untouched.
    pub fn evaluate(&mut self) -> Result<EvalStats, TrainError> {
        let start = Instant::now();
        let data = self.data.clone();
        let train_loss = self.mean_loss(&data.train)?;
        let val_loss = self.mean_loss(&data.val)?;
        Ok(EvalStats {
            step: self.step,
            train_loss,
            val_loss,
            ms: start.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn mean_loss(&mut self, split: &Tokens) -> Result<f32, TrainError> {
        let (mb, block) = (self.config.micro_batch(), self.config.block);
        let vocab = self.model.vocab_size();
        let (mut starts, mut x, mut y) = (Vec::new(), vec![0; mb * block], vec![0; mb * block]);
        let mut sum = 0.0f64;
        for i in 0..self.config.eval_batches {
            batch_starts(
                self.config.seed ^ EVAL_STREAM,
                i as u64,
                split.len(),
                mb,
                block,
                &mut starts,
            );
            fill_batch(split, &starts, block, &mut x, &mut y);
            self.session.write_i32(self.tokens, &x, vocab)?;
            self.session.write_i32(self.targets, &y, vocab)?;
            self.session.run_only(ExecCtx::default(), &self.forward);
            sum += self.session.read_f32(self.step_graph.loss)?[0] as f64;
        }
        Ok((sum / self.config.eval_batches as f64) as f32)
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

    pub fn session(&self) -> &CpuSession {
        &self.session
    }

    pub fn step_graph(&self) -> &StepGraph {
        &self.step_graph
    }

    pub fn data(&self) -> &TokenDataset {
        &self.data
    }

    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Current values of every parameter, by Hugging Face name.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
        self.step_graph
            .params
            .iter()
            .map(|p| Ok((p.name.clone(), self.session.read_f32(p.param)?.to_vec())))
            .collect()
    }
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
