//! `snug-graph`'s shape changes that copy: `Pad` and `Transpose` (`Reshape` and `Narrow` are
//! views: nothing to run).

use super::{grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "view.wgsl",
    code: include_str!("view.wgsl"),
};

/// Axes the transpose kernel indexes.
const MAX_RANK: usize = 8;

/// Records `y = x` placed at rows `start..` of zeros: `x` is `[rows, ..]`, `y` is `[total, ..]`,
/// rows of `row` elements.
pub fn pad(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (start, rows, total, row): (usize, usize, usize, usize),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let u = |v| u32_of(device, "pad", v);
    need(device, "pad x", &x, rows * row)?;
    need(device, "pad y", &y, total * row)?;
    Dispatch {
        source: SOURCE,
        entry: "pad",
        constants: String::new(),
        params: Params::new()
            .u(u(total * row)?)
            .u(0)
            .u(u(start * row)?)
            .u(u(rows * row)?),
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, total * row),
    }
    .record(device, encoder)
}

/// Records `y = x` with axes `dim0` and `dim1` swapped (`shape` is `x`'s).
pub fn transpose(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    shape: &[usize],
    (dim0, dim1): (usize, usize),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let rank = shape.len();
    if rank > MAX_RANK || dim0 >= rank || dim1 >= rank {
        return Err(unsupported(
            device,
            "transpose",
            format!("axes {dim0} and {dim1} of {shape:?} (at most {MAX_RANK} axes)"),
        ));
    }
    let n: usize = shape.iter().product();
    need(device, "transpose x", &x, n)?;
    need(device, "transpose y", &y, n)?;
    let mut in_strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        in_strides[i] = in_strides[i + 1] * shape[i + 1];
    }
    // Output axis d is input axis perm[d].
    let mut perm: Vec<usize> = (0..rank).collect();
    perm.swap(dim0, dim1);
    let mut out_shape: Vec<usize> = perm.iter().map(|&a| shape[a]).collect();
    let mut strides: Vec<usize> = perm.iter().map(|&a| in_strides[a]).collect();
    out_shape.resize(MAX_RANK, 1);
    strides.resize(MAX_RANK, 0);
    let u = |v| u32_of(device, "transpose", v);
    let mut params = Params::new().u(u(n)?).u(rank as u32).u(0).u(0);
    for v in out_shape.into_iter().chain(strides) {
        params = params.u(u(v)?);
    }
    Dispatch {
        source: SOURCE,
        entry: "transpose",
        constants: String::new(),
        params,
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
