//! `c = op(a)·op(b) (+ bias)` for a batch of products, as `snug-graph`'s `MatMul`: `op`
//! transposes the last two axes of an operand stored transposed, `b` may be one matrix shared
//! by the batch (a linear layer's weight), and a bias of `n` is added to every row.

use super::{need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "matmul.wgsl",
    code: include_str!("matmul.wgsl"),
};

/// Output tile side of the kernel.
const TILE: usize = 64;

/// The shape of one launch: `batch` products `[m, k]·[k, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `a` is stored `[k, m]`.
    pub ta: bool,
    /// `b` is stored `[n, k]`.
    pub tb: bool,
    /// One `b` for the whole batch.
    pub shared_b: bool,
}

/// Records `c = op(a)·op(b) (+ bias)`.
pub fn matmul(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    g: Gemm,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    bias: Option<DeviceSlice<'_>>,
    c: DeviceSlice<'_>,
) -> Result<()> {
    let kernel = "matmul";
    let b_batch = if g.shared_b { 1 } else { g.batch };
    need(device, "matmul a", &a, g.batch * g.m * g.k)?;
    need(device, "matmul b", &b, b_batch * g.k * g.n)?;
    need(device, "matmul c", &c, g.batch * g.m * g.n)?;
    if let Some(bias) = &bias {
        need(device, "matmul bias", bias, g.n)?;
    }
    if g.batch * g.m * g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        return Err(unsupported(device, kernel, "a product of depth 0".into()));
    }
    let u = |n| u32_of(device, kernel, n);
    let b_stride = if g.shared_b { 0 } else { g.k * g.n };
    Dispatch {
        source: SOURCE,
        entry: kernel,
        constants: format!(
            "const TA: bool = {};\nconst TB: bool = {};\nconst BIAS: bool = {};",
            g.ta,
            g.tb,
            bias.is_some()
        ),
        params: Params::new()
            .u(u(g.m)?)
            .u(u(g.n)?)
            .u(u(g.k)?)
            .u(u(g.m * g.k)?)
            .u(u(b_stride)?)
            .u(u(g.m * g.n)?),
        // Without a bias, `c` fills its binding: the kernel never reads it.
        tensors: vec![(1, a), (2, b), (3, c), (4, bias.unwrap_or(c))],
        grid: [u(g.n.div_ceil(TILE))?, u(g.m.div_ceil(TILE))?, u(g.batch)?],
    }
    .record(device, encoder)
}
