//! The training loop: compile the step graph once, plan it, load it into a CPU session, then
//! per step sample a batch, run, and report.

use std::time::Instant;

use crate::config::OptimizerKind;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use snug_graph::ops::{AdamW, Sgd};
use snug_graph::{OptimizerSpec, StepGraph, TensorId};
use snug_nn::ModelConfig;
use snug_plan::{plan, MemoryPlan, PlanOptions};
use snug_runtime::{Allocator, CpuSession, ExecCtx};

use crate::data::{fill_windows, sample_starts};
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
    pub loss: f32,
    pub lr: f32,
    pub ms: f64,
    pub tokens_per_s: f64,
    pub active_bytes: usize,
    pub peak_bytes: usize,
    pub cache_bytes: usize,
    /// The process's resident set as the OS reports it, beside the allocator's figures.
    pub rss_bytes: Option<usize>,
}

/// A model being trained: its compiled step, plan, session and data.
pub struct Trainer {
    config: TrainConfig,
    model: ModelConfig,
    step_graph: StepGraph,
    session: CpuSession,
    data: TokenDataset,
    tokens: TensorId,
    targets: TensorId,
    rng: ChaCha8Rng,
    schedule: LrSchedule,
    step: u64,
    /// Window starts of the current batch (the batch itself is written straight into the
    /// session's input tensors, which the allocator accounts for).
    starts: Vec<usize>,
}

/// Compiles the training step of `model` for `batch × block` tokens.
pub fn compile_step(
    model: &ModelConfig,
    batch: usize,
    block: usize,
    threads: usize,
    config: &TrainConfig,
) -> Result<(StepGraph, TensorId, TensorId), TrainError> {
    let g = model.build(batch, block, threads, config.precision)?;
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
    let step = StepGraph::build(g.graph, g.loss, optimizer)?;
    Ok((step, g.tokens, g.targets))
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
        let (step_graph, tokens, targets) =
            compile_step(&model, config.batch, config.block, config.threads, &config)?;
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
        let init: std::collections::HashMap<String, Vec<f32>> =
            model.init_parameters(config.seed).into_iter().collect();
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
        Ok(Trainer {
            rng: ChaCha8Rng::seed_from_u64(config.seed ^ 0x5EED_DA7A),
            config,
            model,
            step_graph,
            session,
            data,
            tokens,
            targets,
            schedule,
            step: 0,
            starts: Vec::new(),
        })
    }

    /// Runs one optimizer step on a freshly sampled batch.
    pub fn train_step(&mut self) -> Result<StepStats, TrainError> {
        Ok(self.step_inner(false)?.0)
    }

    /// Like [`Trainer::train_step`], also timing every node (seconds, in schedule order).
    pub fn train_step_profiled(&mut self) -> Result<(StepStats, Vec<f64>), TrainError> {
        self.step_inner(true)
    }

    fn step_inner(&mut self, profile: bool) -> Result<(StepStats, Vec<f64>), TrainError> {
        let (batch, block) = (self.config.batch, self.config.block);
        let ids = &self.data.train;
        sample_starts(&mut self.rng, ids.len(), batch, block, &mut self.starts);
        let vocab = self.model.vocab_size();
        let starts = &self.starts;
        self.session.fill_i32(self.tokens, vocab, |out| {
            fill_windows(ids, starts, block, 0, out)
        })?;
        self.session.fill_i32(self.targets, vocab, |out| {
            fill_windows(ids, starts, block, 1, out)
        })?;
        let step = self.step + 1;
        let lr = self.schedule.at(step);
        let start = Instant::now();
        let ctx = ExecCtx { lr, step };
        let node_times = if profile {
            self.session.run_profiled(ctx)
        } else {
            self.session.run(ctx);
            Vec::new()
        };
        let secs = start.elapsed().as_secs_f64();
        let loss = self.session.read_f32(self.step_graph.loss)?[0];
        if !loss.is_finite() {
            return Err(TrainError::NonFinite { step, loss });
        }
        self.step = step;
        let mem = self.session.allocator().stats();
        let stats = StepStats {
            step,
            loss,
            lr,
            ms: secs * 1e3,
            tokens_per_s: (batch * block) as f64 / secs,
            active_bytes: mem.active_bytes,
            peak_bytes: mem.peak_bytes,
            cache_bytes: mem.cache_bytes,
            rss_bytes: snug_runtime::process::resident_set().map(|(rss, _)| rss),
        };
        Ok((stats, node_times))
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
