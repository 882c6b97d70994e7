//! snug's memory optimizer: given a model and a memory budget, compile many candidate
//! configurations (pure computation over shapes, nothing allocated), plan each for its exact
//! peak, predict each one's step time from kernel timings measured on this machine, and keep
//! the fastest that fits. The same search picks the configuration to carry on with when a run
//! hits out-of-memory.
//!
//! - [`compile`]: model + step configuration → step graph (passes, autodiff, remat).
//! - [`cost_model`]: predicted seconds per node and per step from a [`MachineProfile`].
//! - [`search`]: [`suggest_config`], [`suggest_recovery_config`] and the [`FitReport`] table.
//! - [`advice`]: when nothing fits, [`what_would_fit`]: the changes to the run that would.

pub mod advice;
pub mod compile;
pub mod cost_model;
mod error;
pub mod search;

pub use advice::{largest_micro_batch, what_would_fit, Suggestion};
pub use compile::{
    compile_exactly, compile_step, CompiledStep, OptimizerKind, Pass, Remat, RematDropped,
    StepConfig,
};
pub use cost_model::{node_work, MachineProfile, NodeWork, Sample, PROFILE_VERSION};
pub use error::FitError;
pub use search::{
    search, suggest_config, suggest_recovery_config, Candidate, Device, FitConfig, FitModel,
    FitReport, MemoryFailure, Verdict,
};
