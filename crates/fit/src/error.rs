use snug_graph::GraphError;
use snug_nn::NnError;
use snug_plan::memory_plan::human_bytes;
use snug_plan::{BudgetError, PlanError};

#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error("no rematerialization fits the budget of {} ({budget} bytes): recomputing everything still peaks at {} ({smallest} bytes) (raise the budget, or lower the batch or block size)", human_bytes(*budget), human_bytes(*smallest))]
    RematBudget { budget: usize, smallest: usize },
    /// Nothing in the search space fits; `smallest` is the lowest planned peak of any candidate.
    #[error("nothing fits in {} ({budget} bytes): the smallest configuration tried ({config}) peaks at {} ({smallest} bytes)", human_bytes(*budget), human_bytes(*smallest))]
    NothingFits {
        budget: usize,
        smallest: usize,
        config: String,
    },
    #[error("`{field}` {detail}")]
    Invalid { field: &'static str, detail: String },
    #[error("the budgeted rewrite lost the step's inputs")]
    LostInputs,
    #[error(transparent)]
    Model(#[from] NnError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Plan(#[from] PlanError),
}

impl From<BudgetError> for FitError {
    fn from(e: BudgetError) -> FitError {
        match e {
            BudgetError::DoesNotFit { budget, smallest } => {
                FitError::RematBudget { budget, smallest }
            }
            BudgetError::Graph(e) => e.into(),
            BudgetError::Plan(e) => e.into(),
        }
    }
}
