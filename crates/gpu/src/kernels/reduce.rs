//! `snug-graph`'s reductions: `Reduce` (sum, mean, max over one axis) and `MaxBackward`,
//! `SumTo` (a contiguous pattern where the kept axes are leading or trailing — a bias gradient
//! sums rows, a `[.., 1]` column sums within rows — and strides otherwise), and `BroadcastTo`.

use super::{grid_1d, grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "reduce.wgsl",
    code: include_str!("reduce.wgsl"),
};

/// How the input elements summed into output element `o` lie: `count` of them, from
/// `o · o_step`, `stride` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumLayout {
    pub outputs: usize,
    pub count: usize,
    pub o_step: usize,
    pub stride: usize,
}

/// The layout of summing `input` down to `out` (which broadcasts to it), or `None` where the
/// kept axes are neither a trailing nor a leading block.
pub fn sum_layout(input: &[usize], out: &[usize]) -> Option<SumLayout> {
    let n_in: usize = input.iter().product();
    let n_out: usize = out.iter().product();
    if n_out == 0 || !n_in.is_multiple_of(n_out) || out.len() > input.len() {
        return None;
    }
    let count = n_in / n_out;
    if count == 1 {
        return Some(SumLayout {
            outputs: n_out,
            count: 1,
            o_step: 1,
            stride: 1,
        });
    }
    let rank = input.len();
    let padded: Vec<usize> = std::iter::repeat_n(1, rank - out.len())
        .chain(out.iter().copied())
        .collect();
    // Kept axes trailing (ones before them): rows of `n_out` summed.
    let first = padded.iter().position(|&d| d != 1).unwrap_or(rank);
    if padded[first..] == input[first..] {
        return Some(SumLayout {
            outputs: n_out,
            count,
            o_step: 1,
            stride: n_out,
        });
    }
    // Kept axes leading (ones after them): runs of `count` summed.
    let last = padded.iter().rposition(|&d| d != 1).map_or(0, |p| p + 1);
    if padded[..last] == input[..last] {
        return Some(SumLayout {
            outputs: n_out,
            count,
            o_step: count,
            stride: 1,
        });
    }
    None
}

/// Records `y = x` summed from shape `input` down to shape `out`.
pub fn sum_to(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (input, out): (&[usize], &[usize]),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let Some(l) = sum_layout(input, out) else {
        return sum_strided(device, encoder, (input, out), x, y);
    };
    need(device, "sum_to x", &x, l.outputs * l.count)?;
    need(device, "sum_to y", &y, l.outputs)?;
    let u = |v| u32_of(device, "sum_to", v);
    Dispatch {
        source: SOURCE,
        entry: "sum_to",
        constants: NO_KIND.into(),
        params: Params::new()
            .u(u(l.outputs)?)
            .u(u(l.count)?)
            .u(u(l.o_step)?)
            .u(u(l.stride)?),
        tensors: vec![(1, x), (2, y)],
        grid: grid_1d(device, l.outputs.div_ceil(32) as u64),
    }
    .record(device, encoder)
}

/// `sum_to` where the kept axes are interleaved with summed ones.
fn sum_strided(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (input, out): (&[usize], &[usize]),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let rank = input.len();
    if rank > MAX_RANK || out.len() > rank {
        return Err(unsupported(
            device,
            "sum_to",
            format!("{input:?} to {out:?} (at most {MAX_RANK} axes)"),
        ));
    }
    let padded: Vec<usize> = std::iter::repeat_n(1, rank - out.len())
        .chain(out.iter().copied())
        .collect();
    let mut strides = vec![1usize; rank];
    for d in (0..rank.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * input[d + 1];
    }
    let (mut kept, mut sums) = (vec![1usize; MAX_RANK], vec![1usize; MAX_RANK]);
    for d in 0..rank {
        if padded[d] == input[d] {
            kept[d] = input[d];
        } else if padded[d] == 1 {
            sums[d] = input[d];
        } else {
            return Err(unsupported(
                device,
                "sum_to",
                format!("{out:?} does not broadcast to {input:?}"),
            ));
        }
    }
    strides.resize(MAX_RANK, 0);
    let n: usize = out.iter().product();
    let count: usize = sums.iter().product();
    need(device, "sum_to x", &x, n * count)?;
    need(device, "sum_to y", &y, n)?;
    let u = |v| u32_of(device, "sum_to", v);
    let mut params = Params::new()
        .u(u(n)?)
        .u(u(count)?)
        .u(0)
        .u(0)
        .u(1)
        .u(rank as u32)
        .u(0)
        .u(0);
    for v in kept.into_iter().chain(strides).chain(sums) {
        params = params.u(u(v)?);
    }
    Dispatch {
        source: SOURCE,
        entry: "sum_strided",
        constants: NO_KIND.into(),
        params,
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}

/// The constant the reductions over an axis take, for the entry points that ignore it.
const NO_KIND: &str = "const KIND: u32 = 0u;";

/// What [`reduce`] computes along its axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
}

/// Axes the broadcasting kernel indexes.
const MAX_RANK: usize = 8;

fn axis_params(device: &GpuDevice, (outer, count, inner): (usize, usize, usize)) -> Result<Params> {
    let u = |v| u32_of(device, "reduce", v);
    Ok(Params::new()
        .u(u(outer * inner)?)
        .u(u(count)?)
        .u(0)
        .u(0)
        .u(u(inner)?))
}

/// Records `y` = `x [outer, count, inner]` reduced over its middle axis.
pub fn reduce(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    kind: ReduceKind,
    dims: (usize, usize, usize),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let (outer, count, inner) = dims;
    need(device, "reduce x", &x, outer * count * inner)?;
    need(device, "reduce y", &y, outer * inner)?;
    let k = match kind {
        ReduceKind::Sum => 0,
        ReduceKind::Mean => 1,
        ReduceKind::Max => 2,
    };
    Dispatch {
        source: SOURCE,
        entry: "reduce_axis",
        constants: format!("const KIND: u32 = {k}u;"),
        params: axis_params(device, dims)?,
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, outer * inner),
    }
    .record(device, encoder)
}

/// Records the gradient of a max over the middle axis of `x [outer, count, inner]`: `dy` to
/// each reduction's first maximal element, 0 elsewhere.
pub fn max_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    dims: (usize, usize, usize),
    [x, dy]: [DeviceSlice<'a>; 2],
    dx: DeviceSlice<'a>,
) -> Result<()> {
    let (outer, count, inner) = dims;
    need(device, "max_backward x", &x, outer * count * inner)?;
    need(device, "max_backward dy", &dy, outer * inner)?;
    need(device, "max_backward dx", &dx, outer * count * inner)?;
    Dispatch {
        source: SOURCE,
        entry: "max_backward",
        constants: NO_KIND.into(),
        params: axis_params(device, dims)?,
        tensors: vec![(1, x), (3, dy), (4, dx)],
        grid: grid_items(device, outer * inner),
    }
    .record(device, encoder)
}

/// Records `y` = `x` of shape `input` repeated to shape `out` (NumPy broadcasting).
pub fn broadcast_to(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (input, out): (&[usize], &[usize]),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let Some(mut strides) = super::elementwise::broadcast_strides(input, out) else {
        return Err(unsupported(
            device,
            "broadcast_to",
            format!("{input:?} does not broadcast to {out:?}"),
        ));
    };
    if out.len() > MAX_RANK {
        return Err(unsupported(
            device,
            "broadcast_to",
            format!("{} axes (at most {MAX_RANK})", out.len()),
        ));
    }
    let n: usize = out.iter().product();
    need(device, "broadcast_to x", &x, input.iter().product())?;
    need(device, "broadcast_to y", &y, n)?;
    let u = |v| u32_of(device, "broadcast_to", v);
    let mut shape = out.to_vec();
    shape.resize(MAX_RANK, 1);
    strides.resize(MAX_RANK, 0);
    let mut params = Params::new()
        .u(u(n)?)
        .u(0)
        .u(0)
        .u(0)
        .u(1)
        .u(out.len() as u32)
        .u(0)
        .u(0);
    for v in shape.into_iter().chain(strides) {
        params = params.u(u(v)?);
    }
    Dispatch {
        source: SOURCE,
        entry: "broadcast_to",
        constants: NO_KIND.into(),
        params,
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}

#[cfg(test)]
mod tests {
    use super::{sum_layout, SumLayout};

    #[test]
    fn bias_gradients_sum_rows_and_columns_sum_within_rows() {
        let l = |outputs, count, o_step, stride| {
            Some(SumLayout {
                outputs,
                count,
                o_step,
                stride,
            })
        };
        assert_eq!(sum_layout(&[4, 3, 5], &[5]), l(5, 12, 1, 5));
        assert_eq!(sum_layout(&[4, 3, 5], &[1, 3, 5]), l(15, 4, 1, 15));
        assert_eq!(sum_layout(&[4, 3, 5], &[4, 3, 1]), l(12, 5, 5, 1));
        assert_eq!(sum_layout(&[4, 3], &[4, 3]), l(12, 1, 1, 1));
        assert_eq!(sum_layout(&[4, 3, 5], &[4, 1, 5]), None);
    }
}
