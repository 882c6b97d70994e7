//! `snug-graph`'s `CrossEntropy` (the mean loss of logits `[n, v]` against i32 targets, or
//! under a loss mask `Σ mask·ce / divisor`) and `CrossEntropyBackward`.

use super::{grid_1d, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "cross_entropy.wgsl",
    code: include_str!("cross_entropy.wgsl"),
};

/// A loss mask `[n]` and its divisor `[1]` (f32), as the graph's masked losses take them.
pub type LossMask<'a> = [DeviceSlice<'a>; 2];

/// The specialisation constant the loss kernels branch on (every entry point of their files
/// needs it: a module is compiled whole).
pub(crate) fn masked_constant(mask: Option<&LossMask<'_>>) -> String {
    format!("const MASKED: bool = {};", mask.is_some())
}

/// Checks a loss mask's sizes for `n` rows, naming the kernel `what`.
pub(crate) fn check_mask(
    device: &GpuDevice,
    what: &str,
    mask: Option<&LossMask<'_>>,
    n: usize,
) -> Result<()> {
    if let Some([weights, divisor]) = mask {
        need(device, &format!("{what} mask"), weights, n)?;
        need(device, &format!("{what} divisor"), divisor, 1)?;
    }
    Ok(())
}

fn params(device: &GpuDevice, n: usize, v: usize) -> Result<Params> {
    Ok(Params::new()
        .u(u32_of(device, "cross_entropy", n)?)
        .u(u32_of(device, "cross_entropy", v)?))
}

/// Records `loss[0] = mean over rows of (logsumexp(row) − row[target])`, or under a loss
/// mask `Σ mask·row / divisor` (rows weighted 0 left out, a divisor of 0 a loss of 0).
/// `row_loss` is the op's workspace of `n` floats: the rows' losses, summed in a fixed order.
pub fn cross_entropy<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (n, v): (usize, usize),
    [logits, targets]: [DeviceSlice<'a>; 2],
    mask: Option<LossMask<'a>>,
    row_loss: DeviceSlice<'a>,
    loss: DeviceSlice<'a>,
) -> Result<()> {
    need(device, "cross_entropy logits", &logits, n * v)?;
    need(device, "cross_entropy targets", &targets, n)?;
    need(device, "cross_entropy workspace", &row_loss, n)?;
    need(device, "cross_entropy loss", &loss, 1)?;
    check_mask(device, "cross_entropy", mask.as_ref(), n)?;
    // Unmasked, `row_loss` fills the mask's bindings: the kernel never reads them.
    let [weights, divisor] = mask.unwrap_or([row_loss, row_loss]);
    Dispatch {
        source: SOURCE,
        entry: "cross_entropy_rows",
        constants: masked_constant(mask.as_ref()),
        params: params(device, n, v)?,
        tensors: vec![(1, logits), (2, targets), (3, row_loss)],
        grid: grid_1d(device, n as u64),
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: "cross_entropy_mean",
        constants: masked_constant(mask.as_ref()),
        params: params(device, n, v)?,
        tensors: vec![(3, row_loss), (4, loss), (7, weights), (8, divisor)],
        grid: [1, 1, 1],
    }
    .record(device, encoder)
}

/// Records `dlogits = (softmax(logits) − onehot(targets)) · dloss[0] / n`, or under a loss
/// mask `· dloss[0] · mask[row] / divisor` (rows weighted 0, and every row when the divisor
/// is 0, zero).
pub fn cross_entropy_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (n, v): (usize, usize),
    [logits, targets, dloss]: [DeviceSlice<'a>; 3],
    mask: Option<LossMask<'a>>,
    dlogits: DeviceSlice<'a>,
) -> Result<()> {
    need(device, "cross_entropy_backward logits", &logits, n * v)?;
    need(device, "cross_entropy_backward targets", &targets, n)?;
    need(device, "cross_entropy_backward dloss", &dloss, 1)?;
    need(device, "cross_entropy_backward dlogits", &dlogits, n * v)?;
    check_mask(device, "cross_entropy_backward", mask.as_ref(), n)?;
    let [weights, divisor] = mask.unwrap_or([dloss, dloss]);
    Dispatch {
        source: SOURCE,
        entry: "cross_entropy_backward",
        constants: masked_constant(mask.as_ref()),
        params: params(device, n, v)?,
        tensors: vec![
            (1, logits),
            (2, targets),
            (5, dloss),
            (6, dlogits),
            (7, weights),
            (8, divisor),
        ],
        grid: grid_1d(device, n as u64),
    }
    .record(device, encoder)
}
