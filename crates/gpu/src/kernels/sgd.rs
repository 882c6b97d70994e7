//! `snug-graph`'s `Sgd`: one step on a parameter, in place.

use super::{grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "sgd.wgsl",
    code: include_str!("sgd.wgsl"),
};

/// Records `param ← param·(1 − lr·weight_decay) − lr·scale·grad` over `n` elements, `scale`
/// being `scale[0]` where given (the update is skipped if it is not finite) and 1 otherwise.
pub fn sgd<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (lr, weight_decay): (f32, f32),
    n: usize,
    [param, grad]: [DeviceSlice<'a>; 2],
    scale: Option<DeviceSlice<'a>>,
) -> Result<()> {
    need(device, "sgd param", &param, n)?;
    need(device, "sgd grad", &grad, n)?;
    if let Some(scale) = &scale {
        need(device, "sgd scale", scale, 1)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "sgd",
        constants: format!("const SCALE: bool = {};", scale.is_some()),
        params: Params::new()
            .u(u32_of(device, "sgd", n)?)
            .f(1.0 - lr * weight_decay)
            .f(lr),
        tensors: vec![(1, param), (2, grad), (3, scale.unwrap_or(grad))],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
