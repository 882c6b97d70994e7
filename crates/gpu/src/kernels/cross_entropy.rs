//! `snug-graph`'s `CrossEntropy` (the mean loss of logits `[n, v]` against i32 targets) and
//! `CrossEntropyBackward`.

use super::{grid_1d, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "cross_entropy.wgsl",
    code: include_str!("cross_entropy.wgsl"),
};

fn params(device: &GpuDevice, n: usize, v: usize) -> Result<Params> {
    Ok(Params::new()
        .u(u32_of(device, "cross_entropy", n)?)
        .u(u32_of(device, "cross_entropy", v)?))
}

/// Records `loss[0] = mean over rows of (logsumexp(row) − row[target])`. `row_loss` is the
/// op's workspace of `n` floats: the rows' losses, summed in a fixed order.
pub fn cross_entropy<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (n, v): (usize, usize),
    [logits, targets]: [DeviceSlice<'a>; 2],
    row_loss: DeviceSlice<'a>,
    loss: DeviceSlice<'a>,
) -> Result<()> {
    need(device, "cross_entropy logits", &logits, n * v)?;
    need(device, "cross_entropy targets", &targets, n)?;
    need(device, "cross_entropy workspace", &row_loss, n)?;
    need(device, "cross_entropy loss", &loss, 1)?;
    Dispatch {
        source: SOURCE,
        entry: "cross_entropy_rows",
        constants: String::new(),
        params: params(device, n, v)?,
        tensors: vec![(1, logits), (2, targets), (3, row_loss)],
        grid: grid_1d(device, n as u64),
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: "cross_entropy_mean",
        constants: String::new(),
        params: params(device, n, v)?,
        tensors: vec![(3, row_loss), (4, loss)],
        grid: [1, 1, 1],
    }
    .record(device, encoder)
}

/// Records `dlogits = (softmax(logits) − onehot(targets)) · dloss[0] / n`.
pub fn cross_entropy_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (n, v): (usize, usize),
    [logits, targets, dloss]: [DeviceSlice<'a>; 3],
    dlogits: DeviceSlice<'a>,
) -> Result<()> {
    need(device, "cross_entropy_backward logits", &logits, n * v)?;
    need(device, "cross_entropy_backward targets", &targets, n)?;
    need(device, "cross_entropy_backward dloss", &dloss, 1)?;
    need(device, "cross_entropy_backward dlogits", &dlogits, n * v)?;
    Dispatch {
        source: SOURCE,
        entry: "cross_entropy_backward",
        constants: String::new(),
        params: params(device, n, v)?,
        tensors: vec![(1, logits), (2, targets), (5, dloss), (6, dlogits)],
        grid: grid_1d(device, n as u64),
    }
    .record(device, encoder)
}
