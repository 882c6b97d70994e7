//! `snug-graph`'s `SumSquares` and `GradNorm`.

use super::{need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "grad_norm.wgsl",
    code: include_str!("grad_norm.wgsl"),
};

/// The norm's constants, unused by the sums of squares but declared for the file to compile.
const NO_NORM: &str = "const UNSCALE: bool = false;\nconst CLIP: bool = false;";

/// Floats of workspace [`sum_squares`] needs for `n` elements (one per workgroup of the first
/// stage): the plan's rule for a GPU target, enough workgroups to fill a GPU and few enough
/// (at most 256) for one to add them up.
pub fn sum_squares_workspace(n: usize) -> usize {
    snug_graph::ops::gpu_partial_sums(n)
}

/// Records `out[0] = Σ x²` over `n` elements; `partial` holds
/// [`sum_squares_workspace`]`(n)` floats.
pub fn sum_squares<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    x: DeviceSlice<'a>,
    partial: DeviceSlice<'a>,
    out: DeviceSlice<'a>,
) -> Result<()> {
    let groups = sum_squares_workspace(n);
    need(device, "sum_squares x", &x, n)?;
    need(device, "sum_squares workspace", &partial, groups)?;
    need(device, "sum_squares out", &out, 1)?;
    let params = || -> Result<Params> {
        Ok(Params::new()
            .u(u32_of(device, "grad_norm", n)?)
            .u(groups as u32))
    };
    Dispatch {
        source: SOURCE,
        entry: "sum_squares_partial",
        constants: NO_NORM.into(),
        params: params()?,
        tensors: vec![(1, x), (2, partial)],
        grid: [groups as u32, 1, 1],
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: "sum_squares_final",
        constants: NO_NORM.into(),
        params: params()?,
        tensors: vec![(2, partial), (3, out)],
        grid: [1, 1, 1],
    }
    .record(device, encoder)
}

/// The clipping rule: `max_norm` (infinite for none) and the factor every gradient carries
/// (`1/micro-batches`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNormRule {
    pub max_norm: f32,
    pub scale: f32,
}

/// Records `norm = √(Σ sums) · scale'` and `coef = scale' · min(1, max_norm / (norm + 1e-6))`
/// where `scale' = scale / loss_scale[0]` if a loss scale is given (then a norm that is not
/// finite makes `coef` NaN). Each of `sums` is one float; `acc` is a workspace of 2.
pub fn grad_norm<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    rule: GradNormRule,
    sums: &[DeviceSlice<'a>],
    loss_scale: Option<DeviceSlice<'a>>,
    acc: DeviceSlice<'a>,
    [coef, norm]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    let Some(&first) = sums.first() else {
        return Err(super::unsupported(
            device,
            "grad_norm",
            "no sums of squares".into(),
        ));
    };
    for s in sums {
        need(device, "grad_norm sum", s, 1)?;
    }
    need(device, "grad_norm workspace", &acc, 2)?;
    need(device, "grad_norm coef", &coef, 1)?;
    need(device, "grad_norm norm", &norm, 1)?;
    if let Some(s) = &loss_scale {
        need(device, "grad_norm loss scale", s, 1)?;
    }
    let clip = rule.max_norm.is_finite();
    let constants = format!(
        "const UNSCALE: bool = {};\nconst CLIP: bool = {clip};",
        loss_scale.is_some()
    );
    let params = |count: usize, first: bool| {
        Params::new()
            .u(0)
            .u(0)
            .u(count as u32)
            .u(u32::from(first))
            .f(if clip { rule.max_norm } else { 0.0 })
            .f(rule.scale)
    };
    // Four sums a dispatch, added in their order to the running (hi, lo) pair.
    for (i, group) in sums.chunks(4).enumerate() {
        let slot = |k: usize| group.get(k).copied().unwrap_or(first);
        Dispatch {
            source: SOURCE,
            entry: "grad_norm_accumulate",
            constants: constants.clone(),
            params: params(group.len(), i == 0),
            tensors: vec![
                (4, acc),
                (5, slot(0)),
                (6, slot(1)),
                (7, slot(2)),
                (8, slot(3)),
            ],
            grid: [1, 1, 1],
        }
        .record(device, encoder)?;
    }
    Dispatch {
        source: SOURCE,
        entry: "grad_norm_finish",
        constants,
        params: params(0, false),
        tensors: vec![
            (4, acc),
            (9, loss_scale.unwrap_or(acc)),
            (10, coef),
            (11, norm),
        ],
        grid: [1, 1, 1],
    }
    .record(device, encoder)
}
