//! What one run of a step graph needs beside its tensors, on any backend.

/// Per-run values kernels read: the learning rate, the optimizer's step count, and which
/// micro-batch of the step this run is.
#[derive(Debug, Clone, Copy)]
pub struct ExecCtx {
    pub lr: f32,
    /// 1-based optimizer step, for Adam's bias correction.
    pub step: u64,
    /// 0-based micro-batch within the step; the optimizer runs on the last one only.
    pub micro: u32,
    pub micro_steps: u32,
}

impl ExecCtx {
    /// A run that is a whole step (no gradient accumulation).
    pub fn step(lr: f32, step: u64) -> Self {
        ExecCtx {
            lr,
            step,
            micro: 0,
            micro_steps: 1,
        }
    }

    pub fn is_last_micro(&self) -> bool {
        self.micro + 1 >= self.micro_steps
    }
}

impl Default for ExecCtx {
    fn default() -> Self {
        ExecCtx::step(1e-3, 1)
    }
}
