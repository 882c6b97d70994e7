//! `snug-graph`'s `RmsNorm` (outputs `y`, `rstd`) and `RmsNormBackward` (outputs `dx`, `dw`).

use super::{grid_1d, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "rmsnorm.wgsl",
    code: include_str!("rmsnorm.wgsl"),
};

fn params(device: &GpuDevice, rows: usize, c: usize, eps: f32) -> Result<Params> {
    Ok(Params::new()
        .u(u32_of(device, "rmsnorm", rows)?)
        .u(u32_of(device, "rmsnorm", c)?)
        .f(eps))
}

/// Records the forward over `rows` rows of `c`: `x`, `y` are `[rows, c]`, `w` is `[c]`, `rstd`
/// is `[rows]`.
pub fn rms_norm<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (rows, c, eps): (usize, usize, f32),
    [x, w]: [DeviceSlice<'a>; 2],
    [y, rstd]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    for (what, t, n) in [
        ("x", &x, rows * c),
        ("w", &w, c),
        ("y", &y, rows * c),
        ("rstd", &rstd, rows),
    ] {
        need(device, &format!("rms_norm {what}"), t, n)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "rms_norm",
        constants: String::new(),
        params: params(device, rows, c, eps)?,
        tensors: vec![(1, x), (2, w), (3, y), (4, rstd)],
        grid: grid_1d(device, rows as u64),
    }
    .record(device, encoder)
}

/// Records the backward from `[dy, x, w, rstd]` into `[dx, dw]`; `dw` is summed first, so
/// `dx` may then overwrite `dy`'s or `x`'s range.
pub fn rms_norm_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (rows, c): (usize, usize),
    [dy, x, w, rstd]: [DeviceSlice<'a>; 4],
    [dx, dw]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    for (what, t, n) in [
        ("dy", &dy, rows * c),
        ("x", &x, rows * c),
        ("w", &w, c),
        ("rstd", &rstd, rows),
        ("dx", &dx, rows * c),
        ("dw", &dw, c),
    ] {
        need(device, &format!("rms_norm_backward {what}"), t, n)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "rms_norm_backward_dw",
        constants: String::new(),
        params: params(device, rows, c, 0.0)?,
        tensors: vec![(1, x), (4, rstd), (5, dy), (7, dw)],
        grid: grid_1d(device, c.div_ceil(32) as u64),
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: "rms_norm_backward_dx",
        constants: String::new(),
        params: params(device, rows, c, 0.0)?,
        tensors: vec![(1, x), (2, w), (4, rstd), (5, dy), (6, dx)],
        grid: grid_1d(device, rows as u64),
    }
    .record(device, encoder)
}
