//! Bytes held at each schedule position, split by role, computed from the plan's table: every
//! arena allocation counts from its first to its last position, every persistent buffer
//! throughout. The sum over roles at a position is [`MemoryPlan::timeline`]'s figure there.
//!
//! Phases come from the step graph: nodes before [`snug_graph::StepGraph::forward_nodes`] are
//! the forward pass; after it, the optimizer's ops (gradient accumulation, the gradient norm,
//! the AdamW or SGD update) are the update and everything else (gradients, and forward values
//! rematerialized for them) the backward. The memory-aware schedule runs each update as soon as
//! its gradient is complete, so backward and update alternate in short runs.

use serde::{Deserialize, Serialize};
use snug_graph::{Graph, NodeId, Role};
use snug_plan::MemoryPlan;

/// The ops of the update phase, by [`snug_graph::ops::Op::name`].
const UPDATE_OPS: [&str; 5] = [
    "accumulate_grad",
    "sum_squares",
    "grad_norm",
    "adamw",
    "sgd",
];

/// How many tensors live at the peak are described.
const PEAK_TENSORS: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
    Update,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Update => "update",
        }
    }
}

/// Positions `first..=last` of the schedule, all in one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseSpan {
    pub phase: Phase,
    pub first: usize,
    pub last: usize,
}

/// The bytes one role holds at each schedule position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleSeries {
    pub role: Role,
    pub bytes: Vec<usize>,
}

/// An arena tensor live at the peak, with the ops that write it first and read it last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveTensor {
    pub name: String,
    pub role: Role,
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
    /// The op at `first` (its producer, or its first user for an input).
    pub producer: String,
    /// The op at `last`.
    pub last_reader: String,
}

/// What the report draws beyond a plan's total timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineDetail {
    /// The op run at each schedule position.
    pub ops: Vec<String>,
    /// The first output of each position's op.
    pub outputs: Vec<String>,
    /// Consecutive positions of one phase, in order, covering the schedule.
    pub phases: Vec<PhaseSpan>,
    /// Bytes held by role at each position, in [`Role::ALL`] order; roles that hold nothing
    /// anywhere are left out.
    pub by_role: Vec<RoleSeries>,
    /// The largest arena tensors live at the peak position, largest first.
    pub peak_live: Vec<LiveTensor>,
}

impl TimelineDetail {
    /// The detail of `plan`, a plan of `graph` whose first `forward_nodes` nodes are the
    /// forward pass (all of them for an inference graph).
    pub fn of(plan: &MemoryPlan, graph: &Graph, forward_nodes: usize) -> TimelineDetail {
        let n = plan.schedule.len();
        let node_at = |nid: NodeId| graph.node(nid);
        let ops: Vec<String> = plan
            .schedule
            .iter()
            .map(|&nid| node_at(nid).op.name().to_string())
            .collect();
        let outputs = plan
            .schedule
            .iter()
            .map(|&nid| {
                node_at(nid)
                    .outputs
                    .first()
                    .map_or(String::new(), |&t| graph.tensor(t).name.clone())
            })
            .collect();
        let phase_of = |pos: usize| -> Phase {
            let nid = plan.schedule[pos];
            if nid.index() < forward_nodes {
                Phase::Forward
            } else if UPDATE_OPS.contains(&ops[pos].as_str()) {
                Phase::Update
            } else {
                Phase::Backward
            }
        };
        let mut phases: Vec<PhaseSpan> = Vec::new();
        for pos in 0..n {
            let phase = phase_of(pos);
            match phases.last_mut() {
                Some(span) if span.phase == phase => span.last = pos,
                _ => phases.push(PhaseSpan {
                    phase,
                    first: pos,
                    last: pos,
                }),
            }
        }
        // Per role: +size where an allocation starts, −size after it ends.
        let mut diffs = vec![vec![0i128; n + 1]; Role::ALL.len()];
        let slot = |role: Role| Role::ALL.iter().position(|&r| r == role).unwrap_or(0);
        for a in &plan.allocations {
            let d = &mut diffs[slot(a.role)];
            d[a.first.min(n)] += a.size as i128;
            d[(a.last + 1).min(n)] -= a.size as i128;
        }
        let mut constant = [0usize; Role::ALL.len()];
        for p in &plan.persistent {
            constant[slot(p.role)] += p.size;
        }
        let by_role = Role::ALL
            .iter()
            .enumerate()
            .filter_map(|(i, &role)| {
                let mut live = 0i128;
                let bytes: Vec<usize> = diffs[i][..n]
                    .iter()
                    .map(|d| {
                        live += d;
                        constant[i] + live as usize
                    })
                    .collect();
                bytes
                    .iter()
                    .any(|&b| b > 0)
                    .then_some(RoleSeries { role, bytes })
            })
            .collect();
        let mut peak_live: Vec<LiveTensor> = plan
            .allocations
            .iter()
            .filter(|a| a.first <= plan.peak_position && plan.peak_position <= a.last)
            .map(|a| LiveTensor {
                name: a.name.clone(),
                role: a.role,
                bytes: a.size,
                first: a.first,
                last: a.last,
                producer: ops.get(a.first).cloned().unwrap_or_default(),
                last_reader: ops.get(a.last).cloned().unwrap_or_default(),
            })
            .collect();
        peak_live.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.name.cmp(&b.name)));
        peak_live.truncate(PEAK_TENSORS);
        TimelineDetail {
            ops,
            outputs,
            phases,
            by_role,
            peak_live,
        }
    }

    /// Positions in the schedule.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Bytes held at `pos`, all roles together.
    pub fn total_at(&self, pos: usize) -> usize {
        self.by_role
            .iter()
            .map(|s| s.bytes.get(pos).copied().unwrap_or(0))
            .sum()
    }

    /// The phase of position `pos`.
    pub fn phase_at(&self, pos: usize) -> Option<Phase> {
        self.phases
            .iter()
            .find(|s| s.first <= pos && pos <= s.last)
            .map(|s| s.phase)
    }
}
