//! `snug-graph`'s `Softmax`, `LogSoftmax` and their gradients, over the last axis.

use super::{grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "softmax.wgsl",
    code: include_str!("softmax.wgsl"),
};

fn params(device: &GpuDevice, rows: usize, n: usize) -> Result<Params> {
    let u = |v| u32_of(device, "softmax", v);
    Ok(Params::new().u(u(rows)?).u(u(n)?))
}

/// Records `y = softmax(x)` (or `log_softmax(x)` with `log`) over `rows` rows of `n`.
pub fn softmax(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    log: bool,
    (rows, n): (usize, usize),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need(device, "softmax x", &x, rows * n)?;
    need(device, "softmax y", &y, rows * n)?;
    Dispatch {
        source: SOURCE,
        entry: "softmax",
        constants: format!("const LOG: bool = {log};"),
        params: params(device, rows, n)?,
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, rows),
    }
    .record(device, encoder)
}

/// Records the gradient `dx` from the forward's output `y` and `dy`.
pub fn softmax_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    log: bool,
    (rows, n): (usize, usize),
    [y, dy]: [DeviceSlice<'a>; 2],
    dx: DeviceSlice<'a>,
) -> Result<()> {
    for (what, t) in [("y", &y), ("dy", &dy), ("dx", &dx)] {
        need(device, &format!("softmax_backward {what}"), t, rows * n)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "softmax_backward",
        constants: format!("const LOG: bool = {log};"),
        params: params(device, rows, n)?,
        tensors: vec![(2, y), (3, dy), (4, dx)],
        grid: grid_items(device, rows),
    }
    .record(device, encoder)
}
