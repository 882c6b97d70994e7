//! `snug-graph`'s `Fill`: a constant tensor (the loss gradient's seed).

use super::{grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "fill.wgsl",
    code: include_str!("fill.wgsl"),
};

/// Records `y = value` over `n` elements.
pub fn fill(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    value: f32,
    n: usize,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need(device, "fill y", &y, n)?;
    Dispatch {
        source: SOURCE,
        entry: "fill",
        constants: String::new(),
        params: Params::new().u(u32_of(device, "fill", n)?).f(value),
        tensors: vec![(1, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
