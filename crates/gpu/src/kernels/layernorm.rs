//! `snug-graph`'s `LayerNorm` (outputs `y`, `mean`, `rstd`) and `LayerNormBackward`
//! (outputs `dx`, `dw`, `db`; `dx` may be written over `dy` or `x`).

use super::{grid_1d, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "layernorm.wgsl",
    code: include_str!("layernorm.wgsl"),
};

fn params(device: &GpuDevice, rows: usize, c: usize, eps: f32) -> Result<Params> {
    Ok(Params::new()
        .u(u32_of(device, "layernorm", rows)?)
        .u(u32_of(device, "layernorm", c)?)
        .f(eps))
}

/// Records the forward over `rows` rows of `c`: `x`, `y` are `[rows, c]`, `w`, `b` are `[c]`,
/// `mean`, `rstd` are `[rows]`.
pub fn layer_norm<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (rows, c, eps): (usize, usize, f32),
    [x, w, b]: [DeviceSlice<'a>; 3],
    [y, mean, rstd]: [DeviceSlice<'a>; 3],
) -> Result<()> {
    for (what, t, n) in [
        ("x", &x, rows * c),
        ("w", &w, c),
        ("b", &b, c),
        ("y", &y, rows * c),
        ("mean", &mean, rows),
        ("rstd", &rstd, rows),
    ] {
        need(device, &format!("layer_norm {what}"), t, n)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "layer_norm",
        constants: String::new(),
        params: params(device, rows, c, eps)?,
        tensors: vec![(1, x), (2, w), (3, b), (4, y), (5, mean), (6, rstd)],
        grid: grid_1d(device, rows as u64),
    }
    .record(device, encoder)
}

/// Records the backward from `[dy, x, w, mean, rstd]` into `[dx, dw, db]`. `dw` and `db` are summed first, so `dx` may then overwrite `dy`'s
/// or `x`'s range.
pub fn layer_norm_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (rows, c): (usize, usize),
    [dy, x, w, mean, rstd]: [DeviceSlice<'a>; 5],
    [dx, dw, db]: [DeviceSlice<'a>; 3],
) -> Result<()> {
    for (what, t, n) in [
        ("dy", &dy, rows * c),
        ("x", &x, rows * c),
        ("w", &w, c),
        ("mean", &mean, rows),
        ("rstd", &rstd, rows),
        ("dx", &dx, rows * c),
        ("dw", &dw, c),
        ("db", &db, c),
    ] {
        need(device, &format!("layer_norm_backward {what}"), t, n)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "layer_norm_backward_dwdb",
        constants: String::new(),
        params: params(device, rows, c, 0.0)?,
        tensors: vec![(1, x), (5, mean), (6, rstd), (7, dy), (9, dw), (10, db)],
        grid: grid_1d(device, c.div_ceil(32) as u64),
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: "layer_norm_backward_dx",
        constants: String::new(),
        params: params(device, rows, c, 0.0)?,
        tensors: vec![(1, x), (2, w), (5, mean), (6, rstd), (7, dy), (8, dx)],
        grid: grid_1d(device, rows as u64),
    }
    .record(device, encoder)
}
