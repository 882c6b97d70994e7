use snug_compile::CompileError;
use snug_plan::memory_plan::human_bytes;
use snug_plan::PlanError;

#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// Nothing in the search space fits; `smallest` is the least any candidate needs: its
    /// planned peak, or where `planned` is false, the parameters and optimizer state that
    /// alone put it over the budget (nothing of it was planned).
    #[error("nothing fits in {} ({budget} bytes): the smallest configuration tried ({config}) {}", human_bytes(*budget), needs(*smallest, *planned))]
    NothingFits {
        budget: usize,
        smallest: usize,
        config: String,
        planned: bool,
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
    /// The device the search is for cannot run the candidate's step (a missing kernel).
    #[error("the device cannot run it: {0}")]
    Unrunnable(String),
    #[error(transparent)]
    Compile(#[from] CompileError),
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// What the smallest candidate of [`FitError::NothingFits`] needs, as the message says it.
fn needs(bytes: usize, planned: bool) -> String {
    if planned {
        format!("peaks at {} ({bytes} bytes)", human_bytes(bytes))
    } else {
        format!(
            "holds {} ({bytes} bytes) of parameters and optimizer state alone, whatever its \
             micro-batch, remat or precision: none was planned",
            human_bytes(bytes)
        )
    }
}
