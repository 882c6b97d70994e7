use snug_compile::CompileError;
use snug_plan::memory_plan::human_bytes;
use snug_plan::PlanError;

#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// Nothing in the search space fits; `smallest` is the lowest planned peak of any candidate.
    #[error("nothing fits in {} ({budget} bytes): the smallest configuration tried ({config}) peaks at {} ({smallest} bytes)", human_bytes(*budget), human_bytes(*smallest))]
    NothingFits {
        budget: usize,
        smallest: usize,
        config: String,
    },
    #[error("nothing fits {} per device on {devices} devices ({budget} bytes): the smallest configuration tried (micro-batch 1) peaks at {} per device ({smallest} bytes)", human_bytes(*budget), human_bytes(*smallest))]
    NothingFitsDevices {
        devices: usize,
        budget: usize,
        smallest: usize,
    },
    #[error("no Llama-shaped model of {parameters} parameters")]
    NoLlamaShape { parameters: usize },
    #[error("`{field}` {detail}")]
    Invalid { field: &'static str, detail: String },
    #[error(transparent)]
    Compile(#[from] CompileError),
    #[error(transparent)]
    Plan(#[from] PlanError),
}
