//! snug's step compiler: a model and a step configuration in, a training step graph out, ready
//! for the planner. Pure computation over shapes, so `snug plan` and fit's search compile steps
//! without allocating a tensor.
//!
//! - [`config`]: [`StepConfig`], what a step is made of besides the model and its batch shape.
//! - [`step`]: [`compile_step`]: the forward graph, its passes, autodiff with the optimizer,
//!   the step passes and rematerialization.
//! - [`remat_budget`]: [`remat_for_budget`], the least recomputation whose plan fits a byte
//!   budget (`--remat budget:SIZE`).

pub mod config;
mod error;
pub mod remat_budget;
pub mod step;

pub use config::{OptimizerKind, Pass, Remat, StepConfig};
pub use error::CompileError;
pub use remat_budget::{remat_for_budget, BudgetError, BudgetedRemat};
pub use step::{
    compile_exactly, compile_exactly_sharded, compile_sharded, compile_step, CompiledStep,
    RematDropped, StepShape,
};
