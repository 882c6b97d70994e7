//! snug's memory optimizer: given a model and a memory budget, compile many candidate
//! configurations (pure computation over shapes, nothing allocated), plan each for its exact
//! peak, predict each one's step time from kernel timings measured on this machine, and keep
//! the fastest that fits. The same search picks the configuration to carry on with when a run
//! hits out-of-memory.
//!
//! - [`cost_model`]: predicted seconds per node and per step from a [`MachineProfile`].
//! - [`search`]: [`Search`]: the fastest configuration that fits, or the one to carry on with
//!   after an out-of-memory, and the [`FitReport`] table.
//! - [`floor`]: [`state_floor`]: the bytes every plan of a step holds (its parameters and
//!   optimizer state), which lets the search and the advice refuse a space unplanned.
//! - [`distributed`]: [`suggest_config`]: the ZeRO stage and step one rank of a
//!   data-parallel run needs to fit each device, for a model or a parameter count.
//! - [`levers`]: [`Levers`]: changes to what is trained (LoRA) that the search uses only when
//!   allowed and nothing else fits, and what each costs.
//! - [`advice`]: when nothing fits, [`Search::advice`] (and [`what_would_fit`]): the changes
//!   to the run that would, each at the figure `fit` with that change reports.

pub mod advice;
pub mod cost_model;
pub mod distributed;
mod error;
pub mod floor;
pub mod levers;
pub mod search;

pub use advice::{largest_micro_batch, what_would_fit, Advice, Skipped, Suggestion};
pub use cost_model::{
    node_work, MachineProfile, NodeWork, ProfileError, Sample, StepWork, PROFILE_VERSION,
};
pub use distributed::{llama_of_size, suggest_config, DeviceConfig};
pub use error::FitError;
pub use floor::state_floor;
pub use levers::{Lever, LeverCost, Levers, UnknownLever};
pub use search::{
    Candidate, FitConfig, FitModel, FitReport, MemoryFailure, Runnable, Search, Verdict,
};
