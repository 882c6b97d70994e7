use snug_graph::GraphError;
use snug_nn::NnError;
use snug_plan::memory_plan::human_bytes;
use snug_plan::PlanError;

use crate::BudgetError;

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("no rematerialization fits the budget of {} ({budget} bytes): the least peak any recomputation reaches is {} ({smallest} bytes) (raise the budget, or lower the batch or block size)", human_bytes(*budget), human_bytes(*smallest))]
    RematBudget { budget: usize, smallest: usize },
    #[error("the budgeted rewrite lost the step's inputs")]
    LostInputs,
    #[error("--batch {batch} does not split over {devices} devices: each rank draws batch / devices sequences, so the batch must be a multiple of {devices}")]
    BatchNotDivisible { batch: usize, devices: usize },
    #[error("each of the {devices} ranks draws {per_rank} sequences, which does not split into {accumulation} micro-batches (accumulation must divide batch / devices)")]
    AccumulationNotDivisible {
        per_rank: usize,
        devices: usize,
        accumulation: usize,
    },
    #[error("quantize_base {base}: {detail}")]
    QuantizeBase {
        base: snug_graph::ops::QuantizeBase,
        detail: String,
    },
    #[error(transparent)]
    Model(#[from] NnError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Plan(#[from] PlanError),
}

impl From<BudgetError> for CompileError {
    fn from(e: BudgetError) -> CompileError {
        match e {
            BudgetError::DoesNotFit { budget, smallest } => {
                CompileError::RematBudget { budget, smallest }
            }
            BudgetError::Graph(e) => e.into(),
            BudgetError::Plan(e) => e.into(),
        }
    }
}
