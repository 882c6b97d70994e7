//! Data parallelism and ZeRO sharding as graph rewrites: the step one rank runs, with its
//! collectives as nodes, so the planner plans every gathered and reduced buffer and a rank's
//! planned peak is exact.
//!
//! - stage 0: every rank holds everything; gradients are averaged by bucketed all-reduces.
//! - stage 1: optimizer state is sharded; gradients are reduce-scattered once per step, each
//!   rank updates its shard and the parameters are all-gathered back.
//! - stage 2: as 1, and gradients are reduce-scattered as the backward completes each bucket,
//!   every micro-batch, so accumulators and the update hold shards only.
//! - stage 3: as 2, and parameters are sharded too: each weight is all-gathered before the
//!   forward reads it and again before the backward does ([`gather_parameters`], then the
//!   compiler drops the forward copies for the backward to re-gather).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::ops::{shard_len, AllGather, AllReduce, Bucketed, CollectiveStart, Op, ReduceScatter};
use crate::passes::{copy_node, Rewritten};
use crate::{Graph, GraphError, Result, Role, TensorId};

/// Gradient bytes one bucketed collective carries (as PyTorch DDP's default bucket).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// How a step is spread over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sharding {
    pub ranks: usize,
    /// ZeRO stage, 0 to 3.
    pub stage: u8,
    /// Gradient bytes per bucketed collective.
    pub bucket_bytes: usize,
}

impl Sharding {
    /// One process holding everything: no collective in the graph.
    pub const SINGLE: Sharding = Sharding {
        ranks: 1,
        stage: 0,
        bucket_bytes: DEFAULT_BUCKET_BYTES,
    };

    pub fn new(ranks: usize, stage: u8) -> Result<Sharding> {
        let s = Sharding {
            ranks,
            stage,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        };
        s.check()?;
        Ok(s)
    }

    pub fn check(&self) -> Result<()> {
        if self.ranks == 0 {
            return Err(GraphError::Invalid {
                op: "sharding",
                detail: "a run needs at least one rank".into(),
            });
        }
        if self.stage > 3 {
            return Err(GraphError::Invalid {
                op: "sharding",
                detail: format!("ZeRO stage {} does not exist: 0, 1, 2 or 3", self.stage),
            });
        }
        if self.bucket_bytes == 0 {
            return Err(GraphError::Invalid {
                op: "sharding",
                detail: "the gradient bucket must hold at least one byte".into(),
            });
        }
        Ok(())
    }

    /// Whether the step has collectives at all.
    pub fn is_distributed(&self) -> bool {
        self.ranks > 1 || self.stage > 0
    }
}

/// What a parameter's name becomes under stage 3, where it is this rank's shard.
pub const SHARD_SUFFIX: &str = ".shard";

/// A parameter's name without [`SHARD_SUFFIX`]: the model's name for it, sharded or not.
pub fn unsharded_name(name: &str) -> &str {
    name.strip_suffix(SHARD_SUFFIX).unwrap_or(name)
}

/// The forward graph with every parameter replaced by its shard (a persistent leaf of
/// [`crate::ops::shard_len`] elements named `NAME.shard`) and an [`AllGather`] of it just
/// before the first node that reads the parameter, in that node's block. The gradient rule of
/// the gather scatters each weight's gradient back into a shard.
pub fn gather_parameters(old: &Graph, ranks: usize) -> Result<Rewritten> {
    let n = old.tensors().len();
    let mut new = Graph::new().with_target(old.target());
    let mut map: Vec<Option<TensorId>> = vec![None; n];
    let is_param = |t: TensorId| {
        let m = old.tensor(t);
        old.producer(t).is_none() && m.role == Role::Parameter && m.view_of.is_none()
    };
    let shard_leaf = |new: &mut Graph, t: TensorId| -> Result<TensorId> {
        let m = old.tensor(t);
        let s = crate::ops::shard_len(m.numel(), ranks);
        new.add_leaf(
            format!("{}{SHARD_SUFFIX}", m.name),
            &[s],
            m.dtype,
            Role::Parameter,
        )
    };
    for node in old.nodes() {
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &t in &node.inputs {
            if map[t.index()].is_none() && old.producer(t).is_none() {
                let m = old.tensor(t);
                let id = if is_param(t) {
                    let shard = shard_leaf(&mut new, t)?;
                    let gather = AllGather {
                        ranks,
                        shape: m.shape.clone(),
                        into: false,
                        once_per_step: false,
                    };
                    let prev = new.set_block(node.block);
                    let full = new.apply1(gather, &[shard]);
                    new.set_block(prev);
                    let full = full?;
                    new.rename(full, format!("{}.gathered", m.name));
                    full
                } else {
                    new.add_leaf(m.name.clone(), &m.shape, m.dtype, m.role)?
                };
                map[t.index()] = Some(id);
            }
            inputs.push(mapped(&map, t)?);
        }
        let control = node
            .control
            .iter()
            .map(|&c| mapped(&map, c))
            .collect::<Result<Vec<_>>>()?;
        let outs = copy_node(&mut new, old, node, &inputs, &control)?;
        for (&o, &id) in node.outputs.iter().zip(&outs) {
            map[o.index()] = Some(id);
            // A view of a gathered weight lives where the gathered weight does (the arena).
            if new.tensor(id).view_of.is_some() {
                let root_role = new.tensor(new.storage_root(id)).role;
                new.set_role(id, root_role);
            }
        }
    }
    // Parameters no node reads still belong to the model: as shards.
    for t in (0..n as u32).map(TensorId) {
        if map[t.index()].is_none() && old.producer(t).is_none() && old.tensor(t).view_of.is_none()
        {
            let m = old.tensor(t);
            let id = if is_param(t) {
                shard_leaf(&mut new, t)?
            } else {
                new.add_leaf(m.name.clone(), &m.shape, m.dtype, m.role)?
            };
            map[t.index()] = Some(id);
        }
    }
    for &o in old.outputs() {
        new.mark_output(mapped(&map, o)?);
    }
    Ok(Rewritten {
        graph: new,
        map,
        kept: vec![true; old.nodes().len()],
    })
}

fn mapped(map: &[Option<TensorId>], t: TensorId) -> Result<TensorId> {
    map.get(t.index())
        .copied()
        .flatten()
        .ok_or_else(|| GraphError::Invalid {
            op: "gather_parameters",
            detail: format!("tensor {t:?} is read before it is written"),
        })
}

/// The shapes parameters had before sharding: under stage 3 the shape each one's gather
/// brings it back to. Built in one pass over the nodes, for callers that ask of every
/// parameter (asked one by one, each a scan of the nodes, building a 405B step was quadratic
/// in its depth).
#[derive(Debug, Clone, Default)]
pub struct UnshardedShapes(HashMap<TensorId, Vec<usize>>);

impl UnshardedShapes {
    pub fn of(graph: &Graph) -> UnshardedShapes {
        let mut shapes = HashMap::new();
        for node in graph.nodes() {
            if let (Op::AllGather(g), Some(&param)) = (&node.op, node.inputs.first()) {
                if !g.into {
                    shapes.entry(param).or_insert_with(|| g.shape.clone());
                }
            }
        }
        UnshardedShapes(shapes)
    }

    /// `param`'s shape before sharding: its gather's under stage 3, its own otherwise.
    pub fn shape<'g>(&'g self, graph: &'g Graph, param: TensorId) -> &'g [usize] {
        self.0.get(&param).map_or(&graph.tensor(param).shape, |s| s)
    }
}

/// The shape a parameter of the step had before sharding (one parameter; see
/// [`UnshardedShapes`] for many).
pub fn unsharded_shape(graph: &Graph, param: TensorId) -> Vec<usize> {
    UnshardedShapes::of(graph).shape(graph, param).to_vec()
}

/// Bytes one rank sends and receives in one optimizer step, with ring algorithms (what Open
/// MPI and NCCL use for large messages): an all-reduce of `B` bytes over `N` ranks sends
/// `2(N-1)·B/N`, a reduce-scatter or an all-gather of a padded whole `(N-1)` shards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommVolume {
    pub sent_bytes: u64,
    pub received_bytes: u64,
    /// Collective calls per optimizer step.
    pub collectives: u64,
}

impl CommVolume {
    /// Seconds the step spends communicating over a link of `gb_per_s` GB/s each way (the
    /// larger direction, nothing overlapped).
    pub fn seconds(&self, gb_per_s: f64) -> f64 {
        self.sent_bytes.max(self.received_bytes) as f64 / (gb_per_s * 1e9)
    }
}

/// The communication of one optimizer step of `graph` (run `micro_steps` times, its
/// once-per-step collectives once).
pub fn comm_per_rank(graph: &Graph, micro_steps: usize) -> CommVolume {
    let mut v = CommVolume::default();
    for node in graph.nodes() {
        let bytes = |t: &TensorId| graph.tensor(*t).size_bytes() as u64;
        let (ranks, once, per_run) = match &node.op {
            Op::AllReduce(AllReduce {
                ranks,
                once_per_step,
                ..
            }) => {
                let b = node.inputs.iter().map(bytes).fold(0, u64::saturating_add);
                (*ranks, *once_per_step, all_reduce_bytes(*ranks, b))
            }
            Op::ReduceScatter(ReduceScatter {
                ranks,
                once_per_step,
            }) => {
                let shards = node.outputs.iter().map(bytes).fold(0, u64::saturating_add);
                (
                    *ranks,
                    *once_per_step,
                    others(*ranks).saturating_mul(shards),
                )
            }
            Op::AllGather(g) => {
                let shard = bytes(&node.inputs[0]);
                (
                    g.ranks,
                    g.once_per_step,
                    others(g.ranks).saturating_mul(shard),
                )
            }
            // A split collective moves its bytes once, counted at its start.
            Op::CollectiveStart(CollectiveStart { op }) => {
                let per_run = match op {
                    Bucketed::AllReduce(_) => {
                        let b = node.inputs.iter().map(bytes).fold(0, u64::saturating_add);
                        all_reduce_bytes(op.ranks(), b)
                    }
                    Bucketed::ReduceScatter(_) => {
                        let shards: u64 = node
                            .inputs
                            .iter()
                            .map(|t| {
                                let m = graph.tensor(*t);
                                (shard_len(m.numel(), op.ranks()) as u64)
                                    .saturating_mul(m.dtype.size_bytes() as u64)
                            })
                            .fold(0, u64::saturating_add);
                        others(op.ranks()).saturating_mul(shards)
                    }
                };
                (op.ranks(), op.once_per_step(), per_run)
            }
            _ => continue,
        };
        if ranks <= 1 {
            continue;
        }
        let runs = if once { 1 } else { micro_steps.max(1) as u64 };
        // Saturating, as the planner's counts: a plan for another machine may name up to
        // MAX_DEVICES ranks, where a wrapped volume would read as a cheap link.
        let moved = per_run.saturating_mul(runs);
        v.sent_bytes = v.sent_bytes.saturating_add(moved);
        v.received_bytes = v.received_bytes.saturating_add(moved);
        v.collectives = v.collectives.saturating_add(runs);
    }
    v
}

/// The ranks each one exchanges with.
fn others(ranks: usize) -> u64 {
    ranks.saturating_sub(1) as u64
}

/// Bytes one rank sends (and receives) in a ring all-reduce of `bytes` over `ranks`:
/// 2 (r - 1) / r of them, saturating.
fn all_reduce_bytes(ranks: usize, bytes: u64) -> u64 {
    let r = ranks.max(1) as u128;
    let v = (2 * (r - 1) * u128::from(bytes)).div_ceil(r);
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_volumes_are_hand_counted_and_saturate() {
        // A ring all-reduce sends 2 (r - 1) / r of the bytes, rounded up.
        assert_eq!(all_reduce_bytes(1, 100), 0);
        assert_eq!(all_reduce_bytes(2, 100), 100);
        assert_eq!(all_reduce_bytes(3, 100), 134);
        assert_eq!(all_reduce_bytes(4, 100), 150);
        assert_eq!(all_reduce_bytes(1 << 20, u64::MAX), u64::MAX);
        assert_eq!(others(0), 0);
        assert_eq!(others(8), 7);
    }
}
