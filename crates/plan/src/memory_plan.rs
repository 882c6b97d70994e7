//! The memory plan: plain data (a table of tensors, offsets, sizes and lifetimes) that knows its
//! own peak, its lower bound, and what the peak is made of.

use std::fmt;

use serde::{Deserialize, Serialize};
use snug_graph::{Graph, NodeId, Role, TensorId};

use crate::lifetime::{lifetimes, Lifetime};
use crate::placement::{align_up, max_live, place_best_in_chunks, Interval, Strategy};
use crate::schedule::{schedule, ScheduleKind};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("plan options: alignment {0} is not a power of two")]
    Alignment(usize),
    #[error(
        "tensor `{name}` is {bytes} bytes, more than the {limit} bytes one kernel may bind on \
         this device (its largest storage binding)"
    )]
    LargerThanBinding {
        name: String,
        bytes: usize,
        limit: usize,
    },
    #[error(
        "the step's {what} needs {bytes} bytes in one buffer, more than this device's largest \
         buffer of {limit} bytes"
    )]
    LargerThanBuffer {
        what: String,
        bytes: usize,
        limit: usize,
    },
    #[error("the arena for this step would need more than 2^64 bytes")]
    Overflow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Every arena offset is a multiple of this (bytes; a power of two), or of the target's
    /// alignment where that is larger. 64 = one cache line, enough for any SIMD load.
    pub alignment: usize,
    /// `MemoryAware` also plans the program order and keeps whichever peaks lower.
    pub schedule: ScheduleKind,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            alignment: 64,
            schedule: ScheduleKind::MemoryAware,
        }
    }
}

/// What is live when the arena is fullest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakInfo {
    /// Schedule position and the op running there.
    pub position: usize,
    pub op: String,
    /// The first output of that op (names carry the model scope, e.g. `h.3.mlp.gelu#212`).
    pub output: String,
    /// The largest tensors live at that moment: (name, role, bytes).
    pub largest_live: Vec<(String, Role, usize)>,
}

/// One tensor's place in the arena.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Allocation {
    pub tensor: TensorId,
    pub name: String,
    pub role: Role,
    pub offset: usize,
    /// Bytes reserved (the tensor's size rounded up to the alignment).
    pub size: usize,
    /// First and last schedule positions at which the tensor is live.
    pub first: usize,
    pub last: usize,
}

/// A parameter or optimizer-state tensor, held in its own buffer across steps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PersistentBuffer {
    pub tensor: TensorId,
    pub name: String,
    pub role: Role,
    pub size: usize,
}

/// The predicted peak split by role; the parts add up to [`MemoryPlan::peak_bytes`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breakdown {
    pub parameters: usize,
    pub gradients: usize,
    pub optimizer_state: usize,
    pub grad_accumulators: usize,
    pub activations: usize,
    pub temporaries: usize,
    pub inputs: usize,
    /// An inference graph's key/value caches (persistent); absent from the JSON of a plan
    /// that has none, as before caches existed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kv_cache: usize,
    /// Arena bytes above the lower bound: the price of fixed offsets.
    pub fragmentation: usize,
}

impl Breakdown {
    fn add(&mut self, role: Role, bytes: usize) {
        let slot = match role {
            Role::Parameter => &mut self.parameters,
            Role::Gradient => &mut self.gradients,
            Role::OptimizerState => &mut self.optimizer_state,
            Role::GradAccumulator => &mut self.grad_accumulators,
            Role::Activation => &mut self.activations,
            Role::Temporary => &mut self.temporaries,
            Role::Input => &mut self.inputs,
            Role::KvCache => &mut self.kv_cache,
        };
        *slot += bytes;
    }

    pub fn total(&self) -> usize {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.grad_accumulators
            + self.activations
            + self.temporaries
            + self.inputs
            + self.kv_cache
            + self.fragmentation
    }

    /// Each part by name; the key/value caches only where the plan has them.
    pub fn rows(&self) -> Vec<(&'static str, usize)> {
        let mut rows = vec![
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("gradient accumulators", self.grad_accumulators),
            ("activations", self.activations),
            ("temporaries", self.temporaries),
            ("inputs", self.inputs),
        ];
        if self.kv_cache > 0 {
            rows.push(("key/value caches", self.kv_cache));
        }
        rows.push(("fragmentation", self.fragmentation));
        rows
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPlan {
    pub schedule: Vec<NodeId>,
    pub allocations: Vec<Allocation>,
    pub persistent: Vec<PersistentBuffer>,
    pub arena_bytes: usize,
    pub lower_bound_bytes: usize,
    pub persistent_bytes: usize,
    /// Schedule position where the most arena bytes are live.
    pub peak_position: usize,
    pub breakdown: Breakdown,
    pub alignment: usize,
    /// The schedule this plan uses, and the peak the program order would have had.
    pub schedule_kind: ScheduleKind,
    pub program_order_peak_bytes: usize,
    /// The placement kept, and every strategy's arena.
    pub strategy: Strategy,
    pub strategy_arenas: Vec<(Strategy, usize)>,
    /// Bytes held (persistent + live arena tensors) while each op of the schedule runs.
    pub timeline: Vec<usize>,
    pub peak: PeakInfo,
    /// The arena's chunks in bytes, in order: one buffer each, every one but the last
    /// `chunk_bytes` long, together `arena_bytes`. One chunk wherever the arena fits the
    /// device's largest buffer (always on the CPU), and then absent from the JSON.
    #[serde(skip_serializing_if = "one_chunk")]
    pub arena_chunks: Vec<usize>,
    #[serde(skip)]
    offsets: Vec<Option<usize>>,
    /// The stride of the chunks: chunk `i` holds arena bytes `i·chunk_bytes..`.
    #[serde(skip)]
    chunk_bytes: usize,
}

impl MemoryPlan {
    /// What the runtime will hold at its peak: persistent buffers plus the arena.
    pub fn peak_bytes(&self) -> usize {
        self.persistent_bytes + self.arena_bytes
    }

    pub fn lower_bound_bytes(&self) -> usize {
        self.lower_bound_bytes
    }

    /// Arena bytes over the lower bound, as a fraction of the lower bound.
    pub fn fragmentation(&self) -> f64 {
        if self.lower_bound_bytes == 0 {
            0.0
        } else {
            self.arena_bytes as f64 / self.lower_bound_bytes as f64 - 1.0
        }
    }

    pub fn breakdown(&self) -> &Breakdown {
        &self.breakdown
    }

    /// Bytes held (persistent + live arena tensors) while each op of the schedule runs.
    pub fn timeline(&self) -> &[usize] {
        &self.timeline
    }

    /// Arena offset of a storage root, or `None` for persistent tensors.
    pub fn arena_offset(&self, root: TensorId) -> Option<usize> {
        self.offsets.get(root.index()).copied().flatten()
    }

    /// Where a storage root lives in the arena's chunks: (chunk, byte offset inside it), or
    /// `None` for persistent tensors. No tensor straddles two chunks.
    pub fn arena_slot(&self, root: TensorId) -> Option<(usize, usize)> {
        let offset = self.arena_offset(root)?;
        let chunk = offset / self.chunk_bytes.max(1);
        Some((chunk, offset - chunk * self.chunk_bytes))
    }

    /// The arena's chunk sizes (see [`MemoryPlan::arena_chunks`]).
    pub fn chunks(&self) -> &[usize] {
        &self.arena_chunks
    }

    /// The allocation table, one line per arena tensor, in offset order.
    pub fn table(&self) -> String {
        let mut rows: Vec<&Allocation> = self.allocations.iter().collect();
        rows.sort_by_key(|a| (a.offset, a.first));
        let mut s = format!(
            "{:>12} {:>12} {:>6} {:>6}  {:<16} {}\n",
            "offset", "bytes", "first", "last", "role", "tensor"
        );
        for a in rows {
            s += &format!(
                "{:>12} {:>12} {:>6} {:>6}  {:<16} {}\n",
                a.offset,
                a.size,
                a.first,
                a.last,
                a.role.name(),
                a.name
            );
        }
        s
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "predicted peak      {:>14} bytes ({})",
            self.peak_bytes(),
            human_bytes(self.peak_bytes())
        )?;
        writeln!(f, "  persistent        {:>14} bytes", self.persistent_bytes)?;
        writeln!(f, "  arena             {:>14} bytes", self.arena_bytes)?;
        writeln!(
            f,
            "  arena lower bound {:>14} bytes (arena/bound = {:.4})",
            self.lower_bound_bytes,
            1.0 + self.fragmentation()
        )?;
        writeln!(
            f,
            "  schedule          {:?} (program order would peak at {} bytes); placement {}",
            self.schedule_kind,
            self.program_order_peak_bytes,
            self.strategy.name()
        )?;
        writeln!(
            f,
            "peak at op {} of {}: {} `{}`",
            self.peak.position,
            self.schedule.len(),
            self.peak.op,
            self.peak.output
        )?;
        writeln!(f, "breakdown at peak:")?;
        for (name, bytes) in self.breakdown.rows() {
            writeln!(f, "  {name:<17} {bytes:>14} bytes ({})", human_bytes(bytes))?;
        }
        writeln!(f, "largest tensors live at peak:")?;
        for (name, role, bytes) in &self.peak.largest_live {
            writeln!(f, "  {bytes:>14} bytes  {:<16} {name}", role.name())?;
        }
        Ok(())
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn one_chunk(chunks: &[usize]) -> bool {
    chunks.len() <= 1
}

/// `1234567` → `1.18 MiB`.
pub fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

fn aligned_intervals(lives: &[Lifetime], align: usize) -> Result<Vec<Interval>, PlanError> {
    let mut intervals = Vec::with_capacity(lives.len());
    let mut total = 0usize;
    for l in lives {
        let size = l
            .size_bytes
            .checked_add(align - 1)
            .ok_or(PlanError::Overflow)?
            / align
            * align;
        let size = size.max(align);
        // Sums below cannot wrap if the total of all sizes does not.
        total = total.checked_add(size).ok_or(PlanError::Overflow)?;
        intervals.push(Interval {
            size,
            first: l.first,
            last: l.last,
        });
    }
    Ok(intervals)
}

/// Plans a graph (a `Graph` or a `StepGraph`): schedule, lifetimes, offsets, peak, breakdown
/// and timeline. Allocates no tensor data.
pub fn plan<G: AsRef<Graph>>(graph: &G, options: &PlanOptions) -> Result<MemoryPlan, PlanError> {
    let graph = graph.as_ref();
    let layout = graph.target().memory;
    let align = options.alignment.max(layout.alignment);
    if align == 0 || !align.is_power_of_two() {
        return Err(PlanError::Alignment(align));
    }
    // Refused before anything is placed: no kernel of this device could bind such a tensor.
    if let Some(t) = graph
        .tensors()
        .iter()
        .find(|t| t.size_bytes() > layout.max_binding_bytes)
    {
        return Err(PlanError::LargerThanBinding {
            name: t.name.clone(),
            bytes: t.size_bytes(),
            limit: layout.max_binding_bytes,
        });
    }
    // The arena is cut into chunks no larger than the device's largest buffer, each a whole
    // number of alignments so every chunk-relative offset stays aligned.
    let chunk_bytes = layout.max_buffer_bytes / align * align;
    let program = schedule(graph, ScheduleKind::Program);
    let program_lives = lifetimes(graph, &program);
    let program_intervals = aligned_intervals(&program_lives, align)?;
    if let Some((l, iv)) = program_lives
        .iter()
        .zip(&program_intervals)
        .find(|(_, iv)| iv.size > chunk_bytes)
    {
        return Err(PlanError::LargerThanBuffer {
            what: format!("tensor `{}`", graph.tensor(l.tensor).name),
            bytes: iv.size,
            limit: layout.max_buffer_bytes,
        });
    }
    let program_bound = max_live(&program_intervals).0;
    let placed = |intervals: &[Interval]| place_best_in_chunks(intervals, chunk_bytes);
    let (schedule_kind, order, lives, intervals, (placement, strategy, strategy_arenas)) =
        match options.schedule {
            ScheduleKind::Program => {
                let p = placed(&program_intervals);
                (
                    ScheduleKind::Program,
                    program,
                    program_lives,
                    program_intervals,
                    p,
                )
            }
            ScheduleKind::MemoryAware => {
                let order = schedule(graph, ScheduleKind::MemoryAware);
                let lives = lifetimes(graph, &order);
                let intervals = aligned_intervals(&lives, align)?;
                // Both orders overlap split collectives with the backward (program order with
                // its starts moved up and its waits down). The memory-aware order is placed
                // where fewer bytes are ever live at once in it, and kept where its arena then
                // comes out no larger than program order's: a lower bound can still place
                // worse (a late, large gradient finding no hole its size).
                let program_placed = placed(&program_intervals);
                let aware_placed = (max_live(&intervals).0 < program_bound)
                    .then(|| placed(&intervals))
                    .filter(|p| p.0.arena_bytes <= program_placed.0.arena_bytes);
                match aware_placed {
                    Some(p) => (ScheduleKind::MemoryAware, order, lives, intervals, p),
                    None => (
                        ScheduleKind::Program,
                        program,
                        program_lives,
                        program_intervals,
                        program_placed,
                    ),
                }
            }
        };

    let mut offsets = vec![None; graph.tensors().len()];
    let mut allocations = Vec::with_capacity(lives.len());
    let mut breakdown = Breakdown::default();
    let mut largest_live = Vec::new();
    for ((l, iv), &offset) in lives.iter().zip(&intervals).zip(&placement.offsets) {
        let meta = graph.tensor(l.tensor);
        offsets[l.tensor.index()] = Some(offset);
        if iv.first <= placement.peak_position && placement.peak_position <= iv.last {
            breakdown.add(meta.role, iv.size);
            largest_live.push((meta.name.clone(), meta.role, iv.size));
        }
        allocations.push(Allocation {
            tensor: l.tensor,
            name: meta.name.clone(),
            role: meta.role,
            offset,
            size: iv.size,
            first: l.first,
            last: l.last,
        });
    }
    largest_live.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
    largest_live.truncate(8);

    let mut persistent = Vec::new();
    let mut persistent_bytes = 0usize;
    for (i, t) in graph.tensors().iter().enumerate() {
        if t.role.is_persistent() && t.view_of.is_none() {
            let size = align_up(t.size_bytes(), align);
            if size > layout.max_buffer_bytes {
                return Err(PlanError::LargerThanBuffer {
                    what: format!("tensor `{}`", t.name),
                    bytes: size,
                    limit: layout.max_buffer_bytes,
                });
            }
            persistent_bytes = persistent_bytes
                .checked_add(size)
                .ok_or(PlanError::Overflow)?;
            breakdown.add(t.role, size);
            persistent.push(PersistentBuffer {
                tensor: TensorId(i as u32),
                name: t.name.clone(),
                role: t.role,
                size,
            });
        }
    }
    breakdown.fragmentation = placement.arena_bytes - placement.lower_bound_bytes;
    let mut arena_chunks = Vec::new();
    let mut left = placement.arena_bytes;
    loop {
        let c = left.min(chunk_bytes);
        arena_chunks.push(c);
        left -= c;
        if left == 0 {
            break;
        }
    }
    persistent_bytes
        .checked_add(placement.arena_bytes)
        .ok_or(PlanError::Overflow)?;

    // Live bytes per position: +size where a tensor starts, −size after it ends.
    let mut diff = vec![0i128; order.len() + 1];
    for iv in &intervals {
        diff[iv.first] += iv.size as i128;
        diff[iv.last + 1] -= iv.size as i128;
    }
    let mut live = 0i128;
    let timeline: Vec<usize> = diff[..order.len()]
        .iter()
        .map(|d| {
            live += d;
            persistent_bytes + live as usize
        })
        .collect();
    let peak = match order.get(placement.peak_position) {
        Some(&nid) => {
            let node = graph.node(nid);
            PeakInfo {
                position: placement.peak_position,
                op: node.op.name().to_string(),
                output: node
                    .outputs
                    .first()
                    .map_or(String::new(), |&o| graph.tensor(o).name.clone()),
                largest_live,
            }
        }
        None => PeakInfo {
            position: 0,
            op: String::new(),
            output: String::new(),
            largest_live,
        },
    };
    Ok(MemoryPlan {
        schedule: order,
        allocations,
        persistent,
        arena_bytes: placement.arena_bytes,
        lower_bound_bytes: placement.lower_bound_bytes,
        persistent_bytes,
        peak_position: placement.peak_position,
        breakdown,
        alignment: align,
        schedule_kind,
        program_order_peak_bytes: persistent_bytes + program_bound,
        strategy,
        strategy_arenas,
        timeline,
        peak,
        arena_chunks,
        offsets,
        chunk_bytes,
    })
}
