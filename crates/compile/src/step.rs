//! From a model and a step configuration to a planned-ready step graph: the forward graph, the
//! forward passes, autodiff with the optimizer, the step passes, and rematerialization. Pure
//! computation over shapes, so fit can compile many candidates without allocating a tensor.

use serde::Serialize;
use snug_graph::ops::Op;
use snug_graph::ops::{AdamW, Sgd};
use snug_graph::zero::{gather_parameters, Sharding};
use snug_graph::{passes, DType, OptimizerSpec, StepGraph, StepOptions, Target, TensorId};
use snug_nn::{LossMask, ModelConfig};
use snug_plan::{MemoryPlan, PlanOptions};

use crate::{remat_for_budget, CompileError, OptimizerKind, Pass, Remat, StepConfig};

/// A compiled training step and the inputs a trainer feeds.
#[derive(Debug, Clone)]
pub struct CompiledStep {
    pub step: StepGraph,
    pub tokens: TensorId,
    pub targets: TensorId,
    /// The loss mask's inputs, when [`StepConfig::loss_mask`] asked for them.
    pub loss_mask: Option<LossMask>,
    /// The step's plan with the default options, when compiling already made it (the budgeted
    /// remat plans its choice; a fixed remat mode is planned to see whether it lowers the peak).
    pub plan: Option<MemoryPlan>,
    /// A fixed remat mode (`block`, `block:K`, `selective`) that was asked for but left out
    /// because its planned peak was no lower than without it: recomputation that saves no
    /// memory only costs time. Holds the peak without and with it.
    pub remat_dropped: Option<RematDropped>,
}

impl CompiledStep {
    /// The step's plan with the default options: the one compiling made, taken, or a new one.
    pub fn take_plan(&mut self) -> Result<MemoryPlan, snug_plan::PlanError> {
        match self.plan.take() {
            Some(p) => Ok(p),
            None => snug_plan::plan(&self.step.graph, &PlanOptions::default()),
        }
    }
}

/// The peaks of a step without and with a remat mode that did not lower it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RematDropped {
    pub remat: Remat,
    pub peak_without_bytes: usize,
    pub peak_with_bytes: usize,
}

/// One micro-batch: `micro_batch` sequences of `block` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct StepShape {
    pub micro_batch: usize,
    pub block: usize,
}

impl StepShape {
    /// One rank's micro-batch when `devices` ranks share a step of `batch` sequences in
    /// `accumulation` micro-batches each: `batch / devices / accumulation`, or the named error
    /// when it does not divide.
    pub fn per_rank(
        batch: usize,
        block: usize,
        devices: usize,
        accumulation: usize,
    ) -> Result<StepShape, CompileError> {
        if devices == 0 || !batch.is_multiple_of(devices) {
            return Err(CompileError::BatchNotDivisible { batch, devices });
        }
        let per_rank = batch / devices;
        if accumulation == 0 || !per_rank.is_multiple_of(accumulation) || per_rank == 0 {
            return Err(CompileError::AccumulationNotDivisible {
                per_rank,
                devices,
                accumulation,
            });
        }
        Ok(StepShape {
            micro_batch: per_rank / accumulation,
            block,
        })
    }
}

/// Compiles the training step of `model` for micro-batches of `shape` on `target`. A fixed
/// remat mode that would not lower the planned peak is left out (see
/// [`CompiledStep::remat_dropped`]).
pub fn compile_step(
    model: &ModelConfig,
    shape: StepShape,
    target: Target,
    config: &StepConfig,
) -> Result<CompiledStep, CompileError> {
    compile_sharded(model, shape, target, config, &Sharding::SINGLE)
}

/// [`compile_step`] for one rank of `sharding`: `shape` is that rank's micro-batch.
pub fn compile_sharded(
    model: &ModelConfig,
    shape: StepShape,
    target: Target,
    config: &StepConfig,
    sharding: &Sharding,
) -> Result<CompiledStep, CompileError> {
    let compiled = compile_exactly_sharded(model, shape, target, config, sharding)?;
    if !matches!(config.remat, Remat::Blocks { .. } | Remat::Selective) {
        return Ok(compiled);
    }
    // Remat is offered as a memory saver: where a fixed mode would not lower the peak (a
    // recomputed value can land at the peak it was meant to relieve), the step runs without it.
    // The step returned keeps its plan, so a caller planning with the default options need
    // not plan it again.
    let options = PlanOptions::default();
    let with_plan = snug_plan::plan(&compiled.step.graph, &options)?;
    let with = with_plan.peak_bytes();
    let plain = StepConfig {
        remat: Remat::None,
        ..config.clone()
    };
    let mut without = compile_exactly_sharded(model, shape, target, &plain, sharding)?;
    let without_plan = snug_plan::plan(&without.step.graph, &options)?;
    let without_peak = without_plan.peak_bytes();
    if with < without_peak {
        return Ok(CompiledStep {
            plan: Some(with_plan),
            ..compiled
        });
    }
    without.plan = Some(without_plan);
    without.remat_dropped = Some(RematDropped {
        remat: config.remat,
        peak_without_bytes: without_peak,
        peak_with_bytes: with,
    });
    Ok(without)
}

/// [`compile_step`] with the remat mode applied as given, whatever it does to the peak.
pub fn compile_exactly(
    model: &ModelConfig,
    shape: StepShape,
    target: Target,
    config: &StepConfig,
) -> Result<CompiledStep, CompileError> {
    compile_exactly_sharded(model, shape, target, config, &Sharding::SINGLE)
}

/// [`compile_exactly`] for one rank of `sharding`.
pub fn compile_exactly_sharded(
    model: &ModelConfig,
    shape: StepShape,
    target: Target,
    config: &StepConfig,
    sharding: &Sharding,
) -> Result<CompiledStep, CompileError> {
    if let Some(base) = config.quantize_base {
        let refuse = |detail: &str| CompileError::QuantizeBase {
            base,
            detail: detail.into(),
        };
        if config.lora.is_none() {
            return Err(refuse(
                "only frozen weights can be stored quantized, and without LoRA every weight \
                 trains (add --lora RANK)",
            ));
        }
        if sharding.is_distributed() {
            return Err(refuse(
                "quantized frozen weights are not supported over several ranks yet, at any ZeRO \
                 stage (use one device)",
            ));
        }
    }
    // Parameters are f32 master weights whatever the precision: the precision pass rounds
    // activations and gradients.
    let mut g = model.build_loss_lora(
        shape.micro_batch,
        shape.block,
        target,
        DType::F32,
        config.loss_mask,
        config.lora.as_ref(),
    )?;
    // With adapters, they alone train.
    let adapters: std::collections::HashSet<String> = g
        .lora
        .iter()
        .flat_map(|l| [l.lora_a.clone(), l.lora_b.clone()])
        .collect();
    // Forward-graph passes run before autodiff (their ops bring their own gradients).
    if config.passes.contains(&Pass::FusedCrossEntropy) {
        let (r, _) = passes::fuse_lm_head_loss(&g.graph, passes::DEFAULT_CHUNK_BYTES)?;
        g = g.rewritten(r)?;
    }
    let low_precision = config.precision != DType::F32;
    if low_precision {
        let (r, _) = passes::mixed_precision(&g.graph, config.precision)?;
        g = g.rewritten(r)?;
    }
    let adamw = AdamW {
        beta1: config.beta1,
        beta2: config.beta2,
        eps: 1e-8,
        weight_decay: config.weight_decay,
    };
    let optimizer = match config.optimizer {
        OptimizerKind::AdamW => OptimizerSpec::AdamW(adamw),
        OptimizerKind::AdamW8bit => OptimizerSpec::AdamW8bit(adamw),
        OptimizerKind::Sgd => OptimizerSpec::Sgd(Sgd {
            weight_decay: config.weight_decay,
        }),
    };
    let options = StepOptions {
        optimizer,
        micro_steps: config.accumulation,
        clip_grad_norm: (config.grad_clip > 0.0).then_some(config.grad_clip),
        clip_mode: config.clip_mode,
        fused_update: config.fused_update,
        grad_norm: true,
        // bf16 keeps f32's exponent range; f16 gradients underflow without scaling.
        loss_scale: config.precision == DType::F16,
    };
    let stage3 = sharding.is_distributed() && sharding.stage == 3;
    if stage3 {
        let r = gather_parameters(&g.graph, sharding.ranks)?;
        g = g.rewritten(r)?;
    }
    // Under stage 3 a parameter is its shard, named after it.
    let frozen = |name: &str| {
        !adapters.is_empty() && !adapters.contains(snug_graph::zero::unsharded_name(name))
    };
    let mut step = StepGraph::build_sharded(g.graph, g.loss, &options, sharding, &frozen)?;
    let mut feeds = Feeds {
        tokens: g.tokens,
        targets: g.targets,
        loss_mask: g.loss_mask,
    };
    if stage3 {
        // The forward's gathered weights are dropped after their last forward read and
        // gathered again for the backward (FSDP), as rematerialization recomputes a value.
        let gathered: Vec<TensorId> = step.graph.nodes()[..step.forward_nodes]
            .iter()
            .filter(|n| matches!(n.op, Op::AllGather(_)))
            .flat_map(|n| n.outputs.iter().copied())
            .collect();
        let (r, _) = passes::rematerialize_dropping(&step, &gathered)?;
        feeds = feeds.rewritten(&r)?;
        step = step.rewritten(r, step.forward_nodes)?;
    }
    for pass in &config.passes {
        let (r, _) = match pass {
            Pass::FusedCrossEntropy | Pass::InPlace => continue,
            Pass::Cse => passes::eliminate_common_subexpressions(&step.graph)?,
            Pass::Dce => passes::eliminate_dead_code(&step.graph)?,
        };
        feeds = feeds.rewritten(&r)?;
        let forward = r.surviving(step.forward_nodes);
        step = step.rewritten(r, forward)?;
    }
    if low_precision {
        let (r, _) = passes::recast_saved(&step)?;
        feeds = feeds.rewritten(&r)?;
        step = step.rewritten(r, step.forward_nodes)?;
    }
    if let Some(base) = config.quantize_base {
        let (r, forward, _) = passes::quantize_frozen(&step, base)?;
        feeds = feeds.rewritten(&r)?;
        step = step.rewritten(r, forward)?;
    }
    if config.precision == DType::BF16 && step.graph.target().fusions.half_io {
        // Products read the bf16 activations and gradients themselves where the target's
        // GEMM can: the f32 copies the casts made go.
        let (r, forward, _) = passes::fold_half_casts(&step.graph, step.forward_nodes)?;
        feeds = feeds.rewritten(&r)?;
        step = step.rewritten(r, forward)?;
    }
    // What follows remat; a remat budget judges each candidate with it applied, so the peak it
    // weighs is the one that runs. Neither renumbers tensors: the inputs keep their ids.
    let in_place = config.passes.contains(&Pass::InPlace);
    let tie_casts = config.fused_update && low_precision;
    let finish = |step: &mut StepGraph| -> Result<(), snug_graph::GraphError> {
        if in_place {
            step.graph = passes::write_in_place(&step.graph)?.0;
        }
        if tie_casts {
            tie_up_casts(&mut step.graph, step.forward_nodes);
        }
        Ok(())
    };
    apply_remat(step, feeds, config.remat, finish)
}

/// Makes each backward up-cast of a saved 16-bit activation wait for the other computed
/// inputs of the one node reading it. Without the wait, the memory-aware schedule makes every
/// up-cast as soon as the backward starts (each allocates less than the node it would
/// otherwise pick), holding all saved activations in f32 at once; with fused updates that,
/// not the gradients, would set the peak.
fn tie_up_casts(graph: &mut snug_graph::Graph, forward_nodes: usize) {
    use snug_graph::ops::Cast;
    // An up-cast of a value the forward saved in 16 bits (not of a backward gradient).
    let saved_up_cast = |g: &snug_graph::Graph, n: &snug_graph::Node| {
        matches!(n.op, Op::Cast(Cast { to: DType::F32 }))
            && g.tensor(n.inputs[0]).dtype != DType::F32
            && g.producer(n.inputs[0])
                .is_none_or(|p| p.index() < forward_nodes)
    };
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); graph.tensors().len()];
    for (i, node) in graph.nodes().iter().enumerate() {
        for &t in &node.inputs {
            readers[t.index()].push(i);
        }
    }
    let mut ties = Vec::new();
    for (i, node) in graph.nodes().iter().enumerate().skip(forward_nodes) {
        if !saved_up_cast(graph, node) {
            continue;
        }
        // The reader, through views (a transpose before a weight-gradient product).
        let mut out = node.outputs[0];
        let reader = loop {
            let [r] = readers[out.index()][..] else {
                break None;
            };
            let n = &graph.nodes()[r];
            if graph.is_view(n) && n.outputs.len() == 1 {
                out = n.outputs[0];
            } else {
                break Some(r);
            }
        };
        let Some(reader) = reader else {
            continue;
        };
        for &t in &graph.nodes()[reader].inputs {
            // What the backward computed before the cast in program order (which stays a
            // valid order), other than another saved value's up-cast (casts waiting on each
            // other).
            let Some(p) = graph.producer(graph.storage_root(t)) else {
                continue;
            };
            if t != out
                && (forward_nodes..i).contains(&p.index())
                && graph.producer(t).is_some_and(|q| q.index() < i)
                && !saved_up_cast(graph, graph.node(p))
            {
                ties.push((snug_graph::NodeId(i as u32), t));
            }
        }
    }
    for (node, t) in ties {
        graph.add_control(node, t);
    }
}

/// The inputs a trainer feeds each micro-batch.
#[derive(Debug, Clone, Copy)]
struct Feeds {
    tokens: TensorId,
    targets: TensorId,
    loss_mask: Option<LossMask>,
}

impl Feeds {
    fn rewritten(self, r: &passes::Rewritten) -> Result<Feeds, CompileError> {
        Ok(Feeds {
            tokens: r.map(self.tokens)?,
            targets: r.map(self.targets)?,
            loss_mask: self.loss_mask.map(|m| m.rewritten(r)).transpose()?,
        })
    }

    fn compiled(self, step: StepGraph, plan: Option<MemoryPlan>) -> CompiledStep {
        CompiledStep {
            step,
            tokens: self.tokens,
            targets: self.targets,
            loss_mask: self.loss_mask,
            plan,
            remat_dropped: None,
        }
    }
}

/// `step` checkpointed as `remat` says, then `finish`ed, with its batch inputs' new ids.
fn apply_remat(
    mut step: StepGraph,
    feeds: Feeds,
    remat: Remat,
    finish: impl Fn(&mut StepGraph) -> Result<(), snug_graph::GraphError>,
) -> Result<CompiledStep, CompileError> {
    let policy = match remat {
        Remat::None => {
            finish(&mut step)?;
            return Ok(feeds.compiled(step, None));
        }
        Remat::Blocks { blocks } => passes::RematPolicy::Uniform {
            blocks_per_segment: blocks,
        },
        Remat::Selective => passes::RematPolicy::Selective,
        Remat::Budget { bytes } => {
            let chosen = remat_for_budget(&step, bytes, &PlanOptions::default(), finish)?;
            // Inputs keep their positions in `StepGraph::inputs` through a rewrite.
            let find = |old: TensorId| {
                let i = step.inputs.iter().position(|&t| t == old)?;
                chosen.step.inputs.get(i).copied()
            };
            let (Some(tokens), Some(targets)) = (find(feeds.tokens), find(feeds.targets)) else {
                return Err(CompileError::LostInputs);
            };
            let loss_mask = match feeds.loss_mask {
                Some(m) => match (find(m.mask), find(m.divisor)) {
                    (Some(mask), Some(divisor)) => Some(LossMask { mask, divisor }),
                    _ => return Err(CompileError::LostInputs),
                },
                None => None,
            };
            let feeds = Feeds {
                tokens,
                targets,
                loss_mask,
            };
            return Ok(feeds.compiled(chosen.step, Some(chosen.plan)));
        }
    };
    let (r, _) = passes::rematerialize(&step, policy)?;
    let feeds = feeds.rewritten(&r)?;
    let mut step = step.rewritten(r, step.forward_nodes)?;
    finish(&mut step)?;
    Ok(feeds.compiled(step, None))
}
