//! A plan as the report reads it: the document `snug plan --json` writes, or the same figures
//! taken from a [`MemoryPlan`] in memory. The document carries a format version; another
//! version is refused by name rather than half-read.

use serde::{Deserialize, Serialize};
use snug_graph::Graph;
use snug_plan::{Breakdown, MemoryPlan, PeakInfo};

use crate::timeline::TimelineDetail;
use crate::ReportError;

/// The version of `snug plan --json`'s layout that this crate reads (its `format_version`).
pub const PLAN_FORMAT_VERSION: u32 = 1;

/// What one graph pass (or precision, or remat mode) changed at the planned peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassSaving {
    pub pass: String,
    pub peak_before_bytes: usize,
    pub peak_after_bytes: usize,
    pub saved_bytes: i64,
}

/// A plan's figures, as `snug plan --json` writes them (fields the report does not draw are
/// ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanDocument {
    pub format_version: u32,
    /// The model preset, or empty.
    #[serde(default)]
    pub preset: String,
    #[serde(default)]
    pub parameters: Option<usize>,
    #[serde(default)]
    pub batch: Option<usize>,
    #[serde(default)]
    pub block: Option<usize>,
    #[serde(default)]
    pub remat: Option<String>,
    pub peak_bytes: usize,
    pub persistent_bytes: usize,
    pub arena_bytes: usize,
    pub lower_bound_bytes: usize,
    pub breakdown: Breakdown,
    pub peak: PeakInfo,
    /// Bytes held while each op of the schedule runs.
    pub timeline: Vec<usize>,
    pub timeline_detail: TimelineDetail,
    #[serde(default)]
    pub passes: Vec<PassSaving>,
    #[serde(default)]
    pub predicted_step_ms: Option<f64>,
}

impl PlanDocument {
    /// Reads a `snug plan --json` document, refusing another format version by name.
    pub fn from_json(text: &str) -> Result<PlanDocument, ReportError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(ReportError::PlanJson)?;
        let found = value.get("format_version").and_then(|v| v.as_u64());
        if found != Some(u64::from(PLAN_FORMAT_VERSION)) {
            return Err(ReportError::PlanVersion {
                found,
                expected: PLAN_FORMAT_VERSION,
            });
        }
        let doc: PlanDocument = serde_json::from_value(value).map_err(ReportError::PlanJson)?;
        doc.check()?;
        Ok(doc)
    }

    /// The figures of `plan`, a plan of `graph` whose first `forward_nodes` nodes are the
    /// forward pass. Pass savings are not known here: they come with `snug plan --json`.
    pub fn from_plan(plan: &MemoryPlan, graph: &Graph, forward_nodes: usize) -> PlanDocument {
        PlanDocument {
            format_version: PLAN_FORMAT_VERSION,
            preset: String::new(),
            parameters: None,
            batch: None,
            block: None,
            remat: None,
            peak_bytes: plan.peak_bytes(),
            persistent_bytes: plan.persistent_bytes,
            arena_bytes: plan.arena_bytes,
            lower_bound_bytes: plan.lower_bound_bytes,
            breakdown: plan.breakdown.clone(),
            peak: plan.peak.clone(),
            timeline: plan.timeline.clone(),
            timeline_detail: TimelineDetail::of(plan, graph, forward_nodes),
            passes: Vec::new(),
            predicted_step_ms: None,
        }
    }

    /// A document whose parts disagree (a hand-edited file, say) would draw a wrong chart.
    fn check(&self) -> Result<(), ReportError> {
        let d = &self.timeline_detail;
        let n = self.timeline.len();
        if d.ops.len() != n || d.outputs.len() != n || d.by_role.iter().any(|s| s.bytes.len() != n)
        {
            return Err(ReportError::PlanInconsistent(format!(
                "`timeline` has {n} positions but `timeline_detail` does not"
            )));
        }
        if let Some(pos) = (0..n).find(|&p| d.total_at(p) != self.timeline[p]) {
            return Err(ReportError::PlanInconsistent(format!(
                "at position {pos} the roles hold {} bytes but `timeline` says {}",
                d.total_at(pos),
                self.timeline[pos]
            )));
        }
        if n > 0 && self.peak.position >= n {
            return Err(ReportError::PlanInconsistent(format!(
                "the peak position {} is past the schedule's {n} positions",
                self.peak.position
            )));
        }
        Ok(())
    }
}
