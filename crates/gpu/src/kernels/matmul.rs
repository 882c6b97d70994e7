//! `c = op(a)·op(b) (+ bias)` for a batch of products, as `snug-graph`'s `MatMul`: `op`
//! transposes the last two axes of an operand stored transposed, `b` may be one matrix shared
//! by the batch (a linear layer's weight), and a bias of `n` is added to every row.

use super::{grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
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

/// Records `c = op(a)·op(b) (+ bias)`. A product [`splits`] cuts along its depth sums its
/// slices in `workspace` (`splits × m × n` elements), which it then needs; any other ignores it.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    g: Gemm,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    bias: Option<DeviceSlice<'_>>,
    c: DeviceSlice<'_>,
    workspace: Option<DeviceSlice<'_>>,
) -> Result<()> {
    let dense = |ld| Place { offset: 0, ld };
    let places = [
        dense(if g.ta { g.m } else { g.k }),
        dense(if g.tb { g.k } else { g.n }),
        dense(g.n),
    ];
    let split = match splits(&g) {
        1 => None,
        s => {
            let Some(ws) = workspace else {
                return Err(unsupported(
                    device,
                    "matmul",
                    format!("a product split {s} ways along its depth, without its workspace"),
                ));
            };
            need(device, "matmul workspace", &ws, s * g.m * g.n)?;
            Some((s, ws))
        }
    };
    record(device, encoder, g, [a, b, c], places, bias, false, split)
}

/// Slices the product `g` is cut into along its depth, as the plan's workspace for it
/// assumes ([`snug_graph::ops::gpu_depth_splits`]).
pub fn splits(g: &Gemm) -> usize {
    snug_graph::ops::gpu_depth_splits(&snug_graph::ops::MatMulDims {
        batch: g.batch,
        m: g.m,
        k: g.k,
        n: g.n,
        shared_b: g.shared_b,
    })
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
        None,
    )
}

/// Elements a matrix of `rows` stored rows of `cols` needs in its binding at `place`.
fn extent(place: Place, (rows, cols): (usize, usize)) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    place.offset + (rows - 1) * place.ld + cols
}

#[allow(clippy::too_many_arguments)]
fn record(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    g: Gemm,
    [a, b, c]: [DeviceSlice<'_>; 3],
    [pa, pb, pc]: [Place; 3],
    bias: Option<DeviceSlice<'_>>,
    accumulate: bool,
    split: Option<(usize, DeviceSlice<'_>)>,
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
    let (splits, k_per) = match split {
        // Whole depth blocks a slice, so only the last slice ends inside one.
        Some((s, _)) => (s, g.k.div_ceil(s).next_multiple_of(16)),
        None => (1, g.k),
    };
    let constants = |split: bool| {
        format!(
            "const TA: bool = {};\nconst TB: bool = {};\nconst BIAS: bool = {};\nconst ACC: bool = {accumulate};\nconst SPLIT: bool = {split};",
            g.ta,
            g.tb,
            bias.is_some()
        )
    };
    let params = Params::new()
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
        .u(u(pc.ld)?)
        .u(u(k_per)?)
        .u(u(splits)?);
    // Without a bias, `c` fills its binding, as it does the workspace's unsplit: the kernel
    // never reads either then.
    let ws = split.map_or(c, |(_, ws)| ws);
    let tensors = vec![(1, a), (2, b), (3, c), (4, bias.unwrap_or(c)), (5, ws)];
    let batches = if split.is_some() { splits } else { g.batch };
    let reduce = split.map(|_| (params.clone(), tensors.clone()));
    Dispatch {
        source: SOURCE,
        entry: kernel,
        constants: constants(split.is_some()),
        params,
        tensors,
        grid: [u(g.n.div_ceil(TILE))?, u(g.m.div_ceil(TILE))?, u(batches)?],
    }
    .record(device, encoder)?;
    let Some((params, tensors)) = reduce else {
        return Ok(());
    };
    Dispatch {
        source: SOURCE,
        entry: "matmul_reduce",
        constants: constants(true),
        params,
        tensors,
        grid: grid_items(device, g.m * g.n),
    }
    .record(device, encoder)
}
