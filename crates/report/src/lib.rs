//! snug's report: what a training step's memory looks like, drawn. Inputs are plain data — a
//! plan (from [`snug_plan::MemoryPlan`] or `snug plan --json`), fit's candidate table
//! (`snug fit --json`), a run's `metrics.jsonl` and a device's memory size — and the output is
//! one HTML page that fetches nothing, or a Chrome trace.
//!
//! - [`timeline`]: bytes held at each schedule position, by role, and the step's phases.
//! - [`plan_doc`]: [`PlanDocument`], the plan as `snug plan --json` writes it (versioned).
//! - [`fit_doc`]: [`FitDocument`], fit's candidates as `snug fit --json` writes them.
//! - [`metrics`]: [`RunMetrics`], a run's `metrics.jsonl`, tolerating a truncated last line.
//! - [`device`]: [`DeviceTable`], each component's share of a device's memory.
//! - [`charts`]: the SVG charts, drawn with `plotters`.
//! - [`page`]: [`Report`] → [`Figures`] (the numbers drawn) and the HTML page.
//! - [`trace`]: Chrome trace-event JSON (Perfetto, `chrome://tracing`) of a profiled step.

pub mod charts;
pub mod device;
mod error;
pub mod fit_doc;
pub mod metrics;
pub mod page;
pub mod plan_doc;
pub mod timeline;
pub mod trace;

pub use device::{DeviceRow, DeviceTable};
pub use error::ReportError;
pub use fit_doc::{FitCandidate, FitDocument};
pub use metrics::{EvalLine, RecoveryLine, RunMetrics, SkippedLine, StepLine};
pub use page::{is_page_of_run, Figures, Report, FIGURES_VERSION};
pub use plan_doc::{PassSaving, PlanDocument, PLAN_FORMAT_VERSION};
pub use timeline::{LiveTensor, Phase, PhaseSpan, RoleSeries, TimelineDetail};
pub use trace::{Trace, TraceEvent};
