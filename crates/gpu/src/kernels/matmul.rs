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

/// Where one operand's matrix lies in its binding: its first element, and the distance
/// between its rows as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub offset: usize,
    pub ld: usize,
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
    let dense = |ld| Place { offset: 0, ld };
    let places = [
        dense(if g.ta { g.m } else { g.k }),
        dense(if g.tb { g.k } else { g.n }),
        dense(g.n),
    ];
    record(device, encoder, g, [a, b, c], places, bias, false)
}

/// Records one product (`g.batch` is 1) between matrices placed inside their bindings (a tile
/// of rows, a block of a weight's columns): `c = op(a)·op(b)`, or `c += op(a)·op(b)` with
/// `accumulate`.
pub fn matmul_in(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    g: Gemm,
    [a, b, c]: [(DeviceSlice<'_>, Place); 3],
    accumulate: bool,
) -> Result<()> {
    if g.batch != 1 {
        return Err(unsupported(
            device,
            "matmul",
            format!("{} placed products (one at most)", g.batch),
        ));
    }
    record(
        device,
        encoder,
        g,
        [a.0, b.0, c.0],
        [a.1, b.1, c.1],
        None,
        accumulate,
    )
}

/// Elements a matrix of `rows` stored rows of `cols` needs in its binding at `place`.
fn extent(place: Place, (rows, cols): (usize, usize)) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    place.offset + (rows - 1) * place.ld + cols
}

fn record(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    g: Gemm,
    [a, b, c]: [DeviceSlice<'_>; 3],
    [pa, pb, pc]: [Place; 3],
    bias: Option<DeviceSlice<'_>>,
    accumulate: bool,
) -> Result<()> {
    let kernel = "matmul";
    let b_batch = if g.shared_b { 1 } else { g.batch };
    let stored_a = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let stored_b = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    let last = |batches: usize, per: usize, e: usize| (batches.max(1) - 1) * per + e;
    need(
        device,
        "matmul a",
        &a,
        last(g.batch, g.m * g.k, extent(pa, stored_a)),
    )?;
    need(
        device,
        "matmul b",
        &b,
        last(b_batch, g.k * g.n, extent(pb, stored_b)),
    )?;
    need(
        device,
        "matmul c",
        &c,
        last(g.batch, g.m * g.n, extent(pc, (g.m, g.n))),
    )?;
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
            "const TA: bool = {};\nconst TB: bool = {};\nconst BIAS: bool = {};\nconst ACC: bool = {accumulate};",
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
            .u(u(g.m * g.n)?)
            .u(u(pa.offset)?)
            .u(u(pb.offset)?)
            .u(u(pc.offset)?)
            .u(u(pa.ld)?)
            .u(u(pb.ld)?)
            .u(u(pc.ld)?),
        // Without a bias, `c` fills its binding: the kernel never reads it.
        tensors: vec![(1, a), (2, b), (3, c), (4, bias.unwrap_or(c))],
        grid: [u(g.n.div_ceil(TILE))?, u(g.m.div_ceil(TILE))?, u(g.batch)?],
    }
    .record(device, encoder)
}
