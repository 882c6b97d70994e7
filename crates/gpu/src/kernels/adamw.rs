//! `snug-graph`'s `AdamW`: one step on a parameter and its moments, in place.

use super::{grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "adamw.wgsl",
    code: include_str!("adamw.wgsl"),
};

/// The optimizer's constants and this step's learning rate and step number (from 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub lr: f32,
    pub step: u64,
}

/// Records one AdamW step over `n` elements: `param`, `m`, `v` are updated in place from
/// `grad`, multiplied by `scale[0]` where given (the update is skipped if it is not finite).
pub fn adamw<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    s: AdamWStep,
    n: usize,
    [param, grad, m, v]: [DeviceSlice<'a>; 4],
    scale: Option<DeviceSlice<'a>>,
) -> Result<()> {
    for (what, t) in [("param", &param), ("grad", &grad), ("m", &m), ("v", &v)] {
        need(device, &format!("adamw {what}"), t, n)?;
    }
    if let Some(scale) = &scale {
        need(device, "adamw scale", scale, 1)?;
    }
    // The bias corrections as the CPU backend computes them, in f32 from the step count.
    let t = i32::try_from(s.step.max(1)).unwrap_or(i32::MAX);
    let bc1 = 1.0 - s.beta1.powi(t);
    let bc2 = 1.0 - s.beta2.powi(t);
    Dispatch {
        source: SOURCE,
        entry: "adamw",
        constants: format!("const SCALE: bool = {};", scale.is_some()),
        params: Params::new()
            .u(u32_of(device, "adamw", n)?)
            .f(s.beta1)
            .f(s.beta2)
            .f(s.eps)
            .f(s.lr / bc1)
            .f(bc2.sqrt())
            .f(1.0 - s.lr * s.weight_decay),
        // Without a scale, `grad` fills its binding: the kernel never reads it.
        tensors: vec![
            (1, param),
            (2, grad),
            (3, m),
            (4, v),
            (5, scale.unwrap_or(grad)),
        ],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
