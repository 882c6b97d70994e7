//! The training step as one graph: forward, backward, and the optimizer update of every
//! parameter. Parameters and optimizer state persist across steps; everything else lives and
//! dies inside the step.

use serde::{Deserialize, Serialize};

use crate::ops::{
    adamw8bit, AccumulateGrad, AdamW, AdamW8bit, AllGather, AllReduce, Bucketed, CollectiveStart,
    CollectiveWait, GradNorm, ReduceScatter, Sgd, ShardedAdamW, StoreSumSquares, SumSquares,
};
use crate::zero::{Sharding, UnshardedShapes};
use crate::{backward_seeded, DType, Graph, GraphError, Result, Role, TensorId};

/// Optimizer applied at the end of the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerSpec {
    /// AdamW; weight decay applies to parameters of rank ≥ 2 (weights and embeddings, not
    /// biases or norm gains), as in GPT-2 and nanoGPT. Moments are f32 whatever the weights'
    /// precision.
    AdamW(AdamW),
    /// AdamW with both moments block-wise quantized to one byte per element
    /// ([`crate::ops::adamw8bit`]); weights stay f32 and weight decay is as for AdamW.
    /// Parameters of fewer than [`adamw8bit::MIN_8BIT_SIZE`] elements (whole, not a shard's)
    /// keep f32 moments and AdamW's update, as bitsandbytes' 8-bit optimizers do.
    AdamW8bit(AdamW),
    /// Plain SGD (no optimizer state); weight decay as for AdamW.
    Sgd(Sgd),
    /// No update: gradients are kept alive to the end of the step so they can be read.
    None,
}

/// What clipping's norm is taken over (`clip_grad_norm` gives the bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClipMode {
    /// This step's global norm (`torch.nn.utils.clip_grad_norm_`): every update waits for
    /// every gradient.
    #[default]
    Global,
    /// Each gradient by its own norm: an update waits for its own gradient alone.
    Tensor,
    /// The previous step's global norm, kept in a persistent scalar (its square,
    /// [`PREVIOUS_SUM_SQUARES`]); the first step is not clipped.
    Previous,
}

impl ClipMode {
    pub fn name(self) -> &'static str {
        match self {
            ClipMode::Global => "global",
            ClipMode::Tensor => "tensor",
            ClipMode::Previous => "previous",
        }
    }
}

impl std::str::FromStr for ClipMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "global" => Ok(ClipMode::Global),
            "tensor" => Ok(ClipMode::Tensor),
            "previous" => Ok(ClipMode::Previous),
            other => Err(format!("`{other}` is not one of global, tensor, previous")),
        }
    }
}

/// Name of the persistent scalar [`ClipMode::Previous`] keeps: the previous step's sum of
/// squared gradients.
pub const PREVIOUS_SUM_SQUARES: &str = "previous_grad_sum_squares";

/// How the step turns gradients into an update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOptions {
    pub optimizer: OptimizerSpec,
    /// Micro-batches whose gradients one update averages (1: no accumulation). Each needs its
    /// own run of the step; accumulators (one per parameter) carry the sums between runs.
    pub micro_steps: usize,
    /// Clip the gradient norm (taken as `clip_mode` says) to this value before the update.
    pub clip_grad_norm: Option<f32>,
    pub clip_mode: ClipMode,
    /// Promise that each parameter's update can run as soon as its gradient is complete, and
    /// free it (LOMO-style): refused with what needs every gradient at once (global-norm
    /// clipping, loss scaling, accumulation, collectives).
    pub fused_update: bool,
    /// Compute the global gradient norm (an output), for logging.
    pub grad_norm: bool,
    /// Seed the backward pass with a loss scale fed at run time ([`StepGraph::loss_scale`])
    /// and divide it out before the update, which is skipped when any gradient is not finite
    /// (f16 training, as PyTorch's GradScaler).
    pub loss_scale: bool,
}

impl StepOptions {
    pub fn new(optimizer: OptimizerSpec) -> Self {
        StepOptions {
            optimizer,
            micro_steps: 1,
            clip_grad_norm: None,
            clip_mode: ClipMode::Global,
            fused_update: false,
            grad_norm: false,
            loss_scale: false,
        }
    }
}

/// One trainable parameter and the tensors that belong to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamSlot {
    pub name: String,
    pub param: TensorId,
    pub grad: TensorId,
    /// Adam's first and second moments (f32, or u8 codes under 8-bit AdamW).
    pub moments: Option<(TensorId, TensorId)>,
    /// The per-block absmax of each quantized moment (8-bit AdamW only).
    #[serde(default)]
    pub moment_scales: Option<(TensorId, TensorId)>,
    /// The gradient sum carried between micro-batches.
    pub accumulator: Option<TensorId>,
}

/// A parameter the step reads but does not train (a LoRA base weight): it has no gradient,
/// no optimizer state and no accumulator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrozenParam {
    pub name: String,
    pub param: TensorId,
}

/// A compiled-but-not-planned training step.
#[derive(Debug, Clone)]
pub struct StepGraph {
    pub graph: Graph,
    pub loss: TensorId,
    pub inputs: Vec<TensorId>,
    pub params: Vec<ParamSlot>,
    /// Parameters read but not trained.
    pub frozen: Vec<FrozenParam>,
    pub micro_steps: usize,
    /// The global gradient norm (of the averaged gradient, before clipping), when computed;
    /// not finite when an update was skipped for an overflow under loss scaling.
    pub grad_norm: Option<TensorId>,
    /// The loss-scale input (a scalar), when the step scales its loss.
    pub loss_scale: Option<TensorId>,
    /// Nodes `0..forward_nodes` are the forward pass.
    pub forward_nodes: usize,
}

impl StepGraph {
    /// Differentiates `loss` with respect to every parameter of `graph` and appends `optimizer`.
    pub fn build(graph: Graph, loss: TensorId, optimizer: OptimizerSpec) -> Result<StepGraph> {
        Self::build_with(graph, loss, &StepOptions::new(optimizer))
    }

    /// As [`StepGraph::build`], with accumulation, clipping and the gradient norm as asked.
    pub fn build_with(graph: Graph, loss: TensorId, opts: &StepOptions) -> Result<StepGraph> {
        Self::build_sharded(graph, loss, opts, &Sharding::SINGLE, &|_| false)
    }

    /// As [`StepGraph::build_with`], training only the parameters whose names `frozen` does
    /// not accept: autodiff never reaches the others, so they get no gradient, optimizer state
    /// or accumulator, and the plan holds none.
    pub fn build_frozen(
        graph: Graph,
        loss: TensorId,
        opts: &StepOptions,
        frozen: &dyn Fn(&str) -> bool,
    ) -> Result<StepGraph> {
        Self::build_sharded(graph, loss, opts, &Sharding::SINGLE, frozen)
    }

    /// As [`StepGraph::build_frozen`], for one rank of `sharding`: gradients averaged over the
    /// ranks by bucketed collectives, and under ZeRO stages 1 and 2 the optimizer state (and
    /// with 2 the accumulators) held as this rank's shards. Under stage 3 `graph` must already
    /// read its parameters through gathers ([`crate::zero::gather_parameters`]).
    pub fn build_sharded(
        mut graph: Graph,
        loss: TensorId,
        opts: &StepOptions,
        sharding: &Sharding,
        frozen: &dyn Fn(&str) -> bool,
    ) -> Result<StepGraph> {
        sharding.check()?;
        let optimizer = opts.optimizer;
        let dist = sharding.is_distributed();
        let stage = if dist { sharding.stage } else { 0 };
        if matches!(optimizer, OptimizerSpec::AdamW8bit(_)) && matches!(stage, 1 | 2) {
            return Err(GraphError::Invalid {
                op: "step",
                detail: format!(
                    "ZeRO stage {stage} shards f32 optimizer state; 8-bit AdamW's quantized \
                     blocks are not sharded: use stage 0 or 3, or adamw"
                ),
            });
        }
        if matches!(optimizer, OptimizerSpec::Sgd(_)) && matches!(stage, 1 | 2) {
            return Err(GraphError::Invalid {
                op: "step",
                detail: format!(
                    "ZeRO stage {stage} shards optimizer state, and SGD keeps none: use stage 0 \
                     or 3"
                ),
            });
        }
        if opts.micro_steps == 0 {
            return Err(GraphError::Invalid {
                op: "step",
                detail: "micro_steps must be at least 1".into(),
            });
        }
        if let Some(c) = opts.clip_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(GraphError::Invalid {
                    op: "step",
                    detail: format!("clip_grad_norm must be a positive number, got {c}"),
                });
            }
        }
        let local_clip = opts.clip_grad_norm.is_some() && opts.clip_mode != ClipMode::Global;
        if local_clip && (opts.micro_steps > 1 || opts.loss_scale || dist) {
            return Err(GraphError::Invalid {
                op: "step",
                detail: format!(
                    "clipping by the {} norm is built for one micro-batch, no loss scaling and \
                     one device (clip by the global norm, --clip-mode global, otherwise)",
                    match opts.clip_mode {
                        ClipMode::Tensor => "per-tensor",
                        _ => "previous step's",
                    }
                ),
            });
        }
        if opts.fused_update {
            let why = if opts.micro_steps > 1 {
                Some(
                    "gradient accumulation keeps every gradient in its accumulator across \
                     micro-batches, so fusing the update frees nothing: use one micro-batch",
                )
            } else if opts.clip_grad_norm.is_some() && opts.clip_mode == ClipMode::Global {
                Some(
                    "global-norm clipping needs every gradient before the first update: clip \
                     per tensor or by the previous step's norm, or not at all",
                )
            } else if opts.loss_scale {
                Some(
                    "loss scaling skips the whole update when any gradient overflows, known \
                     only once all are complete: train in bf16 or f32",
                )
            } else if dist {
                Some("gradients are averaged across devices in buckets: train on one device")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(GraphError::Invalid {
                    op: "fused_update",
                    detail: why.into(),
                });
            }
        }
        let (frozen_ids, params): (Vec<TensorId>, Vec<TensorId>) = (0..graph.tensors().len()
            as u32)
            .map(TensorId)
            .filter(|&t| {
                graph.tensor(t).role == Role::Parameter && graph.tensor(t).view_of.is_none()
            })
            .partition(|&t| frozen(&graph.tensor(t).name));
        let frozen_params: Vec<FrozenParam> = frozen_ids
            .iter()
            .map(|&t| FrozenParam {
                name: graph.tensor(t).name.clone(),
                param: t,
            })
            .collect();
        if params.is_empty() {
            return Err(GraphError::Invalid {
                op: "step",
                detail: "the graph has no parameters to train".into(),
            });
        }
        let inputs: Vec<TensorId> = (0..graph.tensors().len() as u32)
            .map(TensorId)
            .filter(|&t| graph.tensor(t).role == Role::Input)
            .collect();
        graph.mark_output(loss);
        let forward_nodes = graph.nodes().len();
        let loss_scale = if opts.loss_scale {
            let shape = graph.tensor(loss).shape.clone();
            Some(graph.add_leaf("loss_scale", &shape, DType::F32, Role::Input)?)
        } else {
            None
        };
        let raw_grads = backward_seeded(&mut graph, loss, &params, loss_scale)?;
        graph.set_scope("optimizer");
        // Stage 2 scatters each gradient as the backward completes it, every micro-batch.
        let raw_grads = if stage == 2 {
            let op = ReduceScatter {
                ranks: sharding.ranks,
                once_per_step: false,
            };
            bucketed(&mut graph, &raw_grads, sharding.bucket_bytes, op.into())?
        } else {
            raw_grads
        };
        let accumulate = opts.micro_steps > 1;
        let mut grads = Vec::with_capacity(params.len());
        let mut accumulators = Vec::with_capacity(params.len());
        for (&p, &g) in params.iter().zip(&raw_grads) {
            if accumulate {
                let meta = graph.tensor(p).clone();
                let acc = graph.add_leaf(
                    format!("{}.grad_acc", meta.name),
                    &graph.tensor(g).shape.clone(),
                    graph.tensor(g).dtype,
                    Role::GradAccumulator,
                )?;
                grads.push(graph.apply1(AccumulateGrad, &[acc, g])?);
                accumulators.push(Some(acc));
            } else {
                grads.push(g);
                accumulators.push(None);
            }
        }
        // The summed gradients averaged over the ranks: whole under stage 0, scattered into
        // shards under stage 1 (stages 2 and 3 scattered them during the backward).
        let grads = match stage {
            0 if dist => {
                let op = AllReduce {
                    ranks: sharding.ranks,
                    mean: true,
                    once_per_step: true,
                };
                bucketed(&mut graph, &grads, sharding.bucket_bytes, op.into())?
            }
            1 => {
                let op = ReduceScatter {
                    ranks: sharding.ranks,
                    once_per_step: true,
                };
                bucketed(&mut graph, &grads, sharding.bucket_bytes, op.into())?
            }
            _ => grads,
        };
        let global_clip = opts
            .clip_grad_norm
            .filter(|_| opts.clip_mode == ClipMode::Global);
        let scale_needed = accumulate || global_clip.is_some() || opts.loss_scale;
        // Each update's own gradient scale, when clipping is not global.
        let mut local_coef: Vec<Option<TensorId>> = vec![None; grads.len()];
        let (coef, grad_norm) = if scale_needed || opts.grad_norm || local_clip {
            let per_grad = grads
                .iter()
                .map(|&g| graph.apply1(SumSquares, &[g]))
                .collect::<Result<Vec<_>>>()?;
            let mut squares = per_grad.clone();
            if stage > 0 {
                // Each rank squared its shards only: the norm needs every rank's sum.
                let op = AllReduce {
                    ranks: sharding.ranks,
                    mean: false,
                    once_per_step: true,
                };
                squares = graph.apply(op, &squares)?;
            }
            squares.extend(loss_scale);
            let norm_op = GradNorm {
                max_norm: global_clip.unwrap_or(f32::INFINITY),
                scale: 1.0 / opts.micro_steps as f32,
                unscale: opts.loss_scale,
            };
            let outs = graph.apply(norm_op, &squares)?;
            graph.rename(outs[1], "grad_norm");
            graph.mark_output(outs[1]);
            // A clip coefficient from one sum of squares: min(1, max / (norm + 1e-6)).
            let clip_of = |graph: &mut Graph, max_norm: f32, sum: TensorId| {
                let op = GradNorm {
                    max_norm,
                    scale: 1.0,
                    unscale: false,
                };
                Ok::<_, GraphError>(graph.apply(op, &[sum])?[0])
            };
            match (opts.clip_grad_norm, opts.clip_mode) {
                (Some(c), ClipMode::Tensor) => {
                    for (slot, &sq) in local_coef.iter_mut().zip(&per_grad) {
                        *slot = Some(clip_of(&mut graph, c, sq)?);
                    }
                }
                (Some(c), ClipMode::Previous) => {
                    let state = graph.add_leaf(
                        PREVIOUS_SUM_SQUARES,
                        &[1],
                        DType::F32,
                        Role::OptimizerState,
                    )?;
                    let k = clip_of(&mut graph, c, state)?;
                    local_coef.iter_mut().for_each(|slot| *slot = Some(k));
                    let mut inputs = vec![state];
                    inputs.extend(&per_grad);
                    graph.apply(StoreSumSquares, &inputs)?;
                }
                _ => {}
            }
            (scale_needed.then_some(outs[0]), Some(outs[1]))
        } else {
            (None, None)
        };
        let mut slots = Vec::with_capacity(params.len());
        let unsharded = UnshardedShapes::of(&graph);
        for (((&p, &g), accumulator), local) in
            params.iter().zip(&grads).zip(accumulators).zip(local_coef)
        {
            let coef = coef.or(local);
            let meta = graph.tensor(p).clone();
            // Weight decay follows the weight's own rank, and 8-bit moments its own size, not
            // its shard's.
            let whole = unsharded.shape(&graph, p);
            let (rank, whole_numel) = (whole.len(), whole.iter().product::<usize>());
            let mut moment_scales = None;
            let moments = match optimizer {
                OptimizerSpec::AdamW8bit(adamw) if whole_numel >= adamw8bit::MIN_8BIT_SIZE => {
                    let shape = graph.tensor(g).shape.clone();
                    let nb = adamw8bit::blocks(shape.iter().product());
                    let mut state = |suffix: &str, shape: &[usize], dtype| {
                        graph.add_leaf(
                            format!("{}.{suffix}", meta.name),
                            shape,
                            dtype,
                            Role::OptimizerState,
                        )
                    };
                    let m = state("adam8_m", &shape, DType::U8)?;
                    let v = state("adam8_v", &shape, DType::U8)?;
                    let ma = state("adam8_m_absmax", &[nb], DType::F32)?;
                    let va = state("adam8_v_absmax", &[nb], DType::F32)?;
                    let adamw = AdamW {
                        weight_decay: if rank >= 2 { adamw.weight_decay } else { 0.0 },
                        ..adamw
                    };
                    let mut inputs = vec![p, g, m, v, ma, va];
                    inputs.extend(coef);
                    graph.apply(AdamW8bit { adamw }, &inputs)?;
                    moment_scales = Some((ma, va));
                    Some((m, v))
                }
                OptimizerSpec::AdamW(adamw) | OptimizerSpec::AdamW8bit(adamw) => {
                    // Moments are shaped as the gradient: whole, or this rank's shard.
                    let shape = graph.tensor(g).shape.clone();
                    let m = graph.add_leaf(
                        format!("{}.adam_m", meta.name),
                        &shape,
                        DType::F32,
                        Role::OptimizerState,
                    )?;
                    let v = graph.add_leaf(
                        format!("{}.adam_v", meta.name),
                        &shape,
                        DType::F32,
                        Role::OptimizerState,
                    )?;
                    let adamw = AdamW {
                        weight_decay: if rank >= 2 { adamw.weight_decay } else { 0.0 },
                        ..adamw
                    };
                    let mut inputs = vec![p, g, m, v];
                    inputs.extend(coef);
                    if matches!(stage, 1 | 2) {
                        let op = ShardedAdamW {
                            adamw,
                            ranks: sharding.ranks,
                        };
                        let shard = graph.apply1(op, &inputs)?;
                        let gather = AllGather {
                            ranks: sharding.ranks,
                            shape: meta.shape.clone(),
                            into: true,
                            once_per_step: true,
                        };
                        graph.apply(gather, &[shard, p])?;
                    } else {
                        graph.apply(adamw, &inputs)?;
                    }
                    Some((m, v))
                }
                OptimizerSpec::Sgd(sgd) => {
                    let sgd = Sgd {
                        weight_decay: if rank >= 2 { sgd.weight_decay } else { 0.0 },
                    };
                    let mut inputs = vec![p, g];
                    inputs.extend(coef);
                    graph.apply(sgd, &inputs)?;
                    None
                }
                OptimizerSpec::None => {
                    graph.mark_output(g);
                    None
                }
            };
            slots.push(ParamSlot {
                name: meta.name,
                param: p,
                grad: g,
                moments,
                moment_scales,
                accumulator,
            });
        }
        graph.set_scope("");
        Ok(StepGraph {
            graph,
            loss,
            inputs,
            params: slots,
            frozen: frozen_params,
            micro_steps: opts.micro_steps,
            grad_norm,
            loss_scale,
            forward_nodes,
        })
    }

    /// The same step after a pass over its graph (the pass's map gives the new ids).
    pub fn rewritten(
        &self,
        r: crate::passes::Rewritten,
        forward_nodes: usize,
    ) -> Result<StepGraph> {
        let params = self
            .params
            .iter()
            .map(|p| {
                Ok(ParamSlot {
                    name: p.name.clone(),
                    param: r.map(p.param)?,
                    grad: r.map(p.grad)?,
                    moments: match p.moments {
                        Some((m, v)) => Some((r.map(m)?, r.map(v)?)),
                        None => None,
                    },
                    moment_scales: match p.moment_scales {
                        Some((m, v)) => Some((r.map(m)?, r.map(v)?)),
                        None => None,
                    },
                    accumulator: p.accumulator.map(|a| r.map(a)).transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StepGraph {
            loss: r.map(self.loss)?,
            inputs: self
                .inputs
                .iter()
                .map(|&t| r.map(t))
                .collect::<Result<_>>()?,
            params,
            frozen: self
                .frozen
                .iter()
                .map(|f| {
                    Ok(FrozenParam {
                        name: f.name.clone(),
                        param: r.map(f.param)?,
                    })
                })
                .collect::<Result<_>>()?,
            micro_steps: self.micro_steps,
            grad_norm: self.grad_norm.map(|t| r.map(t)).transpose()?,
            loss_scale: self.loss_scale.map(|t| r.map(t)).transpose()?,
            forward_nodes,
            graph: r.graph,
        })
    }

    /// Bytes of every persistent tensor (parameters, optimizer state, accumulators).
    pub fn persistent_bytes(&self) -> usize {
        self.graph
            .tensors()
            .iter()
            .filter(|t| t.role.is_persistent() && t.view_of.is_none())
            .map(|t| t.size_bytes())
            .sum()
    }

    /// Elements of the trained parameters (frozen ones not counted).
    pub fn parameter_count(&self) -> usize {
        self.params
            .iter()
            .map(|p| self.graph.tensor(p.param).numel())
            .sum()
    }
}

/// `op` (a bucketable collective) over `tensors`, in buckets of about `bucket_bytes` taken
/// from the last tensor back, the order the backward completes gradients in; returns the
/// outputs in the order of `tensors`. Each bucket is a [`CollectiveStart`] and a
/// [`CollectiveWait`]: the schedule starts it as soon as its last gradient exists and waits
/// for it as late as its readers allow, so the backward runs while the bucket travels.
fn bucketed(
    graph: &mut Graph,
    tensors: &[TensorId],
    bucket_bytes: usize,
    op: Bucketed,
) -> Result<Vec<TensorId>> {
    let mut out = vec![None; tensors.len()];
    let mut bucket: Vec<usize> = Vec::new();
    let mut bytes = 0;
    for i in (0..tensors.len()).rev() {
        bucket.push(i);
        bytes += graph.tensor(tensors[i]).size_bytes();
        if bytes >= bucket_bytes || i == 0 {
            let inputs: Vec<TensorId> = bucket.iter().map(|&k| tensors[k]).collect();
            let in_flight = graph.apply1(CollectiveStart { op }, &inputs)?;
            graph.set_role(in_flight, Role::Gradient);
            let shapes = inputs
                .iter()
                .map(|&t| graph.tensor(t).shape.clone())
                .collect();
            let outs = graph.apply(CollectiveWait { op, shapes }, &[in_flight])?;
            for (&k, o) in bucket.iter().zip(outs) {
                graph.set_role(o, Role::Gradient);
                out[k] = Some(o);
            }
            bucket.clear();
            bytes = 0;
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, o)| {
            o.ok_or_else(|| GraphError::Invalid {
                op: "step",
                detail: format!("gradient {i} was left out of every bucket"),
            })
        })
        .collect()
}

impl AsRef<Graph> for StepGraph {
    fn as_ref(&self) -> &Graph {
        &self.graph
    }
}
