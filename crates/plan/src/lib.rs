//! snug's memory planner. Pure computation over shapes: nothing here allocates tensor data.
//!
//! - [`schedule`]: the order nodes run in.
//! - [`lifetime`]: when each arena tensor is first written and last read.
//! - [`placement`]: byte offsets inside one arena (cut into chunks where a device's buffers
//!   are smaller than it), with the lower bound beside them.
//! - [`size`]: byte counts as people write them (`2GiB`, `512MB`).
//! - [`memory_plan`]: [`MemoryPlan`], the table a runtime executes and a user reads.

pub mod lifetime;
pub mod memory_plan;
pub mod placement;
pub mod schedule;
pub mod size;

pub use lifetime::{lifetimes, Lifetime};
pub use memory_plan::{
    plan, Allocation, Breakdown, MemoryPlan, PeakInfo, PersistentBuffer, PlanError, PlanOptions,
};
pub use placement::{
    place, place_best, place_best_in_chunks, place_in_chunks, place_with, Interval, Placement,
    Strategy,
};
pub use schedule::{overlap, schedule, CollectiveSpan, Overlap, ScheduleKind};
pub use size::{parse_bytes, SizeError};
