//! The memory plan: plain data (a table of tensors, offsets, sizes and lifetimes) that knows its
//! own peak, its lower bound, and what the peak is made of.

use std::fmt;

use serde::Serialize;
use snug_graph::{Graph, NodeId, Role, TensorId};

use crate::lifetime::lifetimes;
use crate::placement::{align_up, place, Interval};
use crate::schedule::program_order;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("plan options: alignment {0} is not a power of two")]
    Alignment(usize),
    #[error("the arena for this step would need more than 2^64 bytes")]
    Overflow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Every arena offset is a multiple of this (bytes; a power of two). 64 = one cache line,
    /// enough for any SIMD load.
    pub alignment: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { alignment: 64 }
    }
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    pub parameters: usize,
    pub gradients: usize,
    pub optimizer_state: usize,
    pub activations: usize,
    pub temporaries: usize,
    pub inputs: usize,
    /// Arena bytes above the lower bound: the price of fixed offsets.
    pub fragmentation: usize,
}

impl Breakdown {
    fn add(&mut self, role: Role, bytes: usize) {
        let slot = match role {
            Role::Parameter => &mut self.parameters,
            Role::Gradient => &mut self.gradients,
            Role::OptimizerState => &mut self.optimizer_state,
            Role::Activation => &mut self.activations,
            Role::Temporary => &mut self.temporaries,
            Role::Input => &mut self.inputs,
        };
        *slot += bytes;
    }

    pub fn total(&self) -> usize {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.temporaries
            + self.inputs
            + self.fragmentation
    }

    pub fn rows(&self) -> [(&'static str, usize); 7] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("activations", self.activations),
            ("temporaries", self.temporaries),
            ("inputs", self.inputs),
            ("fragmentation", self.fragmentation),
        ]
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
    #[serde(skip)]
    offsets: Vec<Option<usize>>,
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

    /// Arena offset of a storage root, or `None` for persistent tensors.
    pub fn arena_offset(&self, root: TensorId) -> Option<usize> {
        self.offsets.get(root.index()).copied().flatten()
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
        writeln!(f, "breakdown at peak:")?;
        for (name, bytes) in self.breakdown.rows() {
            writeln!(f, "  {name:<17} {bytes:>14} bytes ({})", human_bytes(bytes))?;
        }
        Ok(())
    }
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

/// Plans a graph: schedule, lifetimes, offsets, peak and breakdown. Allocates no tensor data.
pub fn plan(graph: &Graph, options: &PlanOptions) -> Result<MemoryPlan, PlanError> {
    let align = options.alignment;
    if align == 0 || !align.is_power_of_two() {
        return Err(PlanError::Alignment(align));
    }
    let schedule = program_order(graph);
    let lives = lifetimes(graph, &schedule);
    let mut intervals = Vec::with_capacity(lives.len());
    for l in &lives {
        let size = l
            .size_bytes
            .checked_add(align - 1)
            .ok_or(PlanError::Overflow)?
            / align
            * align;
        intervals.push(Interval {
            size: size.max(align),
            first: l.first,
            last: l.last,
        });
    }
    // Sums below cannot wrap if the total of all sizes does not.
    intervals
        .iter()
        .try_fold(0usize, |acc, iv| acc.checked_add(iv.size))
        .ok_or(PlanError::Overflow)?;
    let placement = place(&intervals);

    let mut offsets = vec![None; graph.tensors().len()];
    let mut allocations = Vec::with_capacity(lives.len());
    let mut breakdown = Breakdown::default();
    for ((l, iv), &offset) in lives.iter().zip(&intervals).zip(&placement.offsets) {
        let meta = graph.tensor(l.tensor);
        offsets[l.tensor.index()] = Some(offset);
        if iv.first <= placement.peak_position && placement.peak_position <= iv.last {
            breakdown.add(meta.role, iv.size);
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
    let mut persistent = Vec::new();
    let mut persistent_bytes = 0usize;
    for (i, t) in graph.tensors().iter().enumerate() {
        if t.role.is_persistent() && t.view_of.is_none() {
            let size = align_up(t.size_bytes(), align);
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
    persistent_bytes
        .checked_add(placement.arena_bytes)
        .ok_or(PlanError::Overflow)?;
    Ok(MemoryPlan {
        schedule,
        allocations,
        persistent,
        arena_bytes: placement.arena_bytes,
        lower_bound_bytes: placement.lower_bound_bytes,
        persistent_bytes,
        peak_position: placement.peak_position,
        breakdown,
        alignment: align,
        offsets,
    })
}
