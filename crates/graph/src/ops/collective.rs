//! Collectives across the ranks of a data-parallel run, as graph ops: the planner schedules them
//! and plans their buffers like every other node, and each backend's kernel is the transport
//! (MPI on the CPU). One graph serves every rank: which slice a rank owns is its rank, known
//! when the kernel runs, never a shape.
//!
//! Shards are equal: a tensor of `n` elements splits into `ranks` shards of
//! [`shard_len`]`(n, ranks)` elements, the last padded with zeros, because a reduce-scatter
//! over MPI takes equal blocks. The padding is planned: in the shards themselves and in the
//! workspaces that hold a padded whole.

use super::{expect_arity, shape_err, AdamW, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Elements of each of `ranks` equal shards of `numel` elements (the last one padded).
pub fn shard_len(numel: usize, ranks: usize) -> usize {
    numel.div_ceil(ranks.max(1))
}

/// f32 elements of workspace that hold `bytes` bytes.
fn words(bytes: usize) -> usize {
    bytes.div_ceil(4)
}

fn check_ranks(op: &'static str, ranks: usize) -> Result<()> {
    if ranks == 0 {
        return Err(GraphError::Invalid {
            op,
            detail: "a collective needs at least one rank".into(),
        });
    }
    Ok(())
}

/// Inputs of one dtype (a bucket is packed into one buffer).
fn one_dtype(op: &'static str, inputs: &[&TensorMeta]) -> Result<()> {
    if inputs.is_empty() {
        return Err(shape_err(op, "expects one or more tensors"));
    }
    super::float_dtype(op, inputs).map(|_| ())
}

/// Every rank's inputs summed (or averaged, with `mean`); one output per input, shaped like it.
/// A bucket of several tensors travels as one message, packed into the workspace. With
/// `once_per_step` it runs on the last micro-batch only (it reads summed gradients).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllReduce {
    pub ranks: usize,
    pub mean: bool,
    pub once_per_step: bool,
}

impl OpRule for AllReduce {
    fn name(&self) -> &'static str {
        "all_reduce"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        check_ranks(self.name(), self.ranks)?;
        one_dtype(self.name(), inputs)?;
        Ok(inputs
            .iter()
            .map(|t| OutSpec::f32(t.shape.clone()).with_dtype(t.dtype))
            .collect())
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient(self.name()))
    }

    /// One tensor is reduced from its input into its output; a bucket is packed first.
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        if inputs.len() == 1 {
            0
        } else {
            words(inputs.iter().map(|t| t.size_bytes()).sum())
        }
    }

    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// Every rank's inputs averaged, each rank keeping its own shard of each: one output of
/// [`shard_len`] elements per input. Padding is zero, so it adds nothing to a norm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReduceScatter {
    pub ranks: usize,
    pub once_per_step: bool,
}

impl ReduceScatter {
    /// Shard elements of each input, in order.
    fn shards(&self, inputs: &[&TensorMeta]) -> Vec<usize> {
        inputs
            .iter()
            .map(|t| shard_len(t.numel(), self.ranks))
            .collect()
    }
}

impl OpRule for ReduceScatter {
    fn name(&self) -> &'static str {
        "reduce_scatter"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        check_ranks(self.name(), self.ranks)?;
        one_dtype(self.name(), inputs)?;
        Ok(inputs
            .iter()
            .zip(self.shards(inputs))
            .map(|(t, s)| OutSpec::f32(vec![s]).with_dtype(t.dtype))
            .collect())
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient(self.name()))
    }

    /// The send buffer (every rank's block, rank-major, padded) unless one unpadded tensor is
    /// sent as it is; the receive buffer when a bucket's shards are unpacked from it.
    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        let Some(first) = inputs.first() else {
            return 0;
        };
        let elem = first.dtype.size_bytes();
        let shards: usize = self.shards(inputs).iter().sum();
        let direct = inputs.len() == 1 && first.numel() == shards * self.ranks;
        let send = if direct { 0 } else { shards * self.ranks };
        let recv = if inputs.len() == 1 { 0 } else { shards };
        words((send + recv) * elem)
    }

    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// Every rank's shard of a tensor of `shape`, gathered whole. Input `[shard]` gives the whole
/// as a new output (ZeRO-3's gathered weight); inputs `[shard, dest]` write it over the
/// persistent `dest` (ZeRO-1/2's updated parameter) and output nothing. The padded whole is
/// received into the workspace when padding exists.
#[derive(Debug, Clone, PartialEq)]
pub struct AllGather {
    pub ranks: usize,
    pub shape: Vec<usize>,
    pub into: bool,
    pub once_per_step: bool,
}

impl AllGather {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl OpRule for AllGather {
    fn name(&self) -> &'static str {
        "all_gather"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        check_ranks(self.name(), self.ranks)?;
        expect_arity(self.name(), inputs, if self.into { 2 } else { 1 })?;
        let s = shard_len(self.numel(), self.ranks);
        if inputs[0].shape != [s] {
            return Err(shape_err(
                self.name(),
                format!(
                    "shard {:?}: a tensor of {:?} over {} ranks has shards of [{s}]",
                    inputs[0].shape, self.shape, self.ranks
                ),
            ));
        }
        if !self.into {
            return Ok(vec![
                OutSpec::f32(self.shape.clone()).with_dtype(inputs[0].dtype)
            ]);
        }
        let dest = inputs[1];
        if dest.shape != self.shape || dest.dtype != inputs[0].dtype {
            return Err(shape_err(
                self.name(),
                format!(
                    "destination `{}` is {:?} {}, gathering {:?} {}",
                    dest.name, dest.shape, dest.dtype, self.shape, inputs[0].dtype
                ),
            ));
        }
        if !dest.role.is_persistent() {
            return Err(GraphError::Invalid {
                op: "all_gather",
                detail: format!("`{}` is written in place and must be persistent", dest.name),
            });
        }
        Ok(vec![])
    }

    /// The gradient of a gathered weight is every rank's gradient averaged, scattered back
    /// into shards: the loss is the mean of the ranks' losses. The scatter is split into a
    /// start and a wait, so the backward runs on while it travels.
    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        if self.into {
            return Err(no_gradient(self.name()));
        }
        if let (Some(g), true) = (ctx.grad_out(0), ctx.wants(0)) {
            let op = Bucketed::ReduceScatter(ReduceScatter {
                ranks: self.ranks,
                once_per_step: false,
            });
            let in_flight = ctx.apply1(CollectiveStart { op }, &[g])?;
            let wait = CollectiveWait {
                op,
                shapes: vec![self.shape.clone()],
            };
            let shard = ctx.apply1(wait, &[in_flight])?;
            ctx.set_grad(0, shard);
        }
        Ok(())
    }

    fn workspace_elems(&self, inputs: &[&TensorMeta], _target: &crate::Target) -> usize {
        let padded = shard_len(self.numel(), self.ranks) * self.ranks;
        match inputs.first() {
            Some(t) if padded != self.numel() => words(padded * t.dtype.size_bytes()),
            _ => 0,
        }
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        if self.into {
            &[1]
        } else {
            &[]
        }
    }

    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// AdamW on this rank's shard (ZeRO-1/2): inputs `[param, grad_shard, m, v]` and optionally
/// the scalar gradient scale; `param` is the whole persistent weight, the rest are shards of
/// it. Writes the moments in place and outputs the updated shard of the parameter, which an
/// [`AllGather`] writes back over `param` on every rank. Runs on the last micro-batch only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardedAdamW {
    pub adamw: AdamW,
    pub ranks: usize,
}

impl OpRule for ShardedAdamW {
    fn name(&self) -> &'static str {
        "sharded_adamw"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        check_ranks(self.name(), self.ranks)?;
        if inputs.len() != 5 {
            expect_arity(self.name(), inputs, 4)?;
        }
        super::check_grad_scale(self.name(), inputs, 4)?;
        let s = shard_len(inputs[0].numel(), self.ranks);
        for (i, t) in inputs.iter().enumerate().take(4).skip(1) {
            if t.shape != [s] {
                return Err(shape_err(
                    self.name(),
                    format!(
                        "input {i} has shape {:?}; the shard of {:?} over {} ranks is [{s}]",
                        t.shape, inputs[0].shape, self.ranks
                    ),
                ));
            }
        }
        for i in [0, 2, 3] {
            if !inputs[i].role.is_persistent() {
                return Err(GraphError::Invalid {
                    op: "sharded_adamw",
                    detail: format!("`{}` persists across steps and must be", inputs[i].name),
                });
            }
        }
        Ok(vec![OutSpec::f32(vec![s]).with_dtype(inputs[0].dtype)])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient(self.name()))
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[2, 3]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        12 * inputs[1].numel() as u64
    }
}

fn no_gradient(op: &'static str) -> GraphError {
    GraphError::Invalid {
        op,
        detail: "a collective on gradients or updates has no gradient".into(),
    }
}

/// A gradient collective that is split into a start and a wait, so the backward runs on while
/// its bytes travel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bucketed {
    AllReduce(AllReduce),
    ReduceScatter(ReduceScatter),
}

impl Bucketed {
    pub fn ranks(&self) -> usize {
        match self {
            Bucketed::AllReduce(c) => c.ranks,
            Bucketed::ReduceScatter(c) => c.ranks,
        }
    }

    pub fn once_per_step(&self) -> bool {
        match self {
            Bucketed::AllReduce(c) => c.once_per_step,
            Bucketed::ReduceScatter(c) => c.once_per_step,
        }
    }

    /// Elements of the in-flight buffer of a bucket of `numels`: for an all-reduce the packed
    /// bucket and the sum it receives; for a reduce-scatter every rank's padded block, then
    /// this rank's received shards. MPI's in-place flag is not reachable through the `mpi`
    /// crate's bindings, so what is sent and what is received are separate bytes.
    pub fn in_flight_len(&self, numels: &[usize]) -> usize {
        match self {
            Bucketed::AllReduce(_) => 2 * numels.iter().sum::<usize>(),
            Bucketed::ReduceScatter(c) => {
                let shards: usize = numels.iter().map(|&n| shard_len(n, c.ranks)).sum();
                shards * (c.ranks + 1)
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Bucketed::AllReduce(_) => "all_reduce",
            Bucketed::ReduceScatter(_) => "reduce_scatter",
        }
    }
}

impl From<AllReduce> for Bucketed {
    fn from(c: AllReduce) -> Bucketed {
        Bucketed::AllReduce(c)
    }
}

impl From<ReduceScatter> for Bucketed {
    fn from(c: ReduceScatter) -> Bucketed {
        Bucketed::ReduceScatter(c)
    }
}

/// Packs a bucket into its in-flight buffer (the one output, see [`Bucketed::in_flight_len`])
/// and starts the collective on it without waiting (`MPI_Iallreduce`,
/// `MPI_Ireduce_scatter_block`). The schedule runs it as soon as the backward has made the
/// bucket's last gradient; its [`CollectiveWait`] completes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveStart {
    pub op: Bucketed,
}

impl OpRule for CollectiveStart {
    fn name(&self) -> &'static str {
        match self.op {
            Bucketed::AllReduce(_) => "all_reduce_start",
            Bucketed::ReduceScatter(_) => "reduce_scatter_start",
        }
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        check_ranks(self.name(), self.op.ranks())?;
        one_dtype(self.name(), inputs)?;
        let numels: Vec<usize> = inputs.iter().map(|t| t.numel()).collect();
        Ok(vec![OutSpec::f32(vec![self.op.in_flight_len(&numels)])
            .with_dtype(inputs[0].dtype)
            .named("in_flight")])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient(self.name()))
    }

    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}

/// Completes the collective its [`CollectiveStart`] began on the in-flight buffer (its one
/// input), averages, and unpacks one output per tensor of the bucket (`numels` elements
/// each, in the start's input order): shaped as `shapes` for an all-reduce, this rank's
/// [`shard_len`] for a reduce-scatter. Placed by the schedule as late as its readers allow.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectiveWait {
    pub op: Bucketed,
    /// The shapes of the bucket's tensors.
    pub shapes: Vec<Vec<usize>>,
}

impl CollectiveWait {
    pub fn numels(&self) -> Vec<usize> {
        self.shapes.iter().map(|s| s.iter().product()).collect()
    }
}

impl OpRule for CollectiveWait {
    fn name(&self) -> &'static str {
        match self.op {
            Bucketed::AllReduce(_) => "all_reduce_wait",
            Bucketed::ReduceScatter(_) => "reduce_scatter_wait",
        }
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        check_ranks(self.name(), self.op.ranks())?;
        expect_arity(self.name(), inputs, 1)?;
        one_dtype(self.name(), inputs)?;
        let len = self.op.in_flight_len(&self.numels());
        if inputs[0].shape != [len] || self.shapes.is_empty() {
            return Err(shape_err(
                self.name(),
                format!(
                    "in-flight buffer {:?}: a {} of {:?} over {} ranks has one of [{len}]",
                    inputs[0].shape,
                    self.op.name(),
                    self.shapes,
                    self.op.ranks()
                ),
            ));
        }
        let dtype = inputs[0].dtype;
        Ok(match self.op {
            Bucketed::AllReduce(_) => self
                .shapes
                .iter()
                .map(|s| OutSpec::f32(s.clone()).with_dtype(dtype))
                .collect(),
            Bucketed::ReduceScatter(c) => self
                .numels()
                .iter()
                .map(|&n| OutSpec::f32(vec![shard_len(n, c.ranks)]).with_dtype(dtype))
                .collect(),
        })
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(no_gradient(self.name()))
    }

    fn flops(&self, _inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        0
    }
}
