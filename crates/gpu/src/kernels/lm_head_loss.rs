//! `snug-graph`'s `LmHeadLoss` and `LmHeadLossBackward`: the LM head and its cross-entropy a
//! tile of `rows` tokens × `cols` vocabulary entries at a time, in the op's workspace, laid
//! out as the CPU backend lays it out (so the plan's bytes are the same on both): the tile,
//! then per tile row a running sum and the target's logit, then one loss per token. The
//! products run on the matmul kernel, placed inside their bindings; the backward recomputes
//! each tile's logits from the saved log-sum-exp.

use super::cross_entropy::{check_mask, masked_constant, LossMask};
use super::matmul::{matmul_in, Gemm, Place};
use super::{grid_1d, grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "lm_head_loss.wgsl",
    code: include_str!("lm_head_loss.wgsl"),
};

/// Sizes of one fused head: `n` tokens of width `c`, a vocabulary of `v`, the head stored
/// `[v, c]` when `tb` (tied to the embedding) and `[c, v]` otherwise, and the tile (already
/// clamped to `n` and `v`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    pub n: usize,
    pub c: usize,
    pub v: usize,
    pub tb: bool,
    pub rows: usize,
    pub cols: usize,
}

impl HeadShape {
    /// Floats of the forward's workspace.
    pub fn forward_workspace(&self) -> usize {
        self.rows * self.cols + 2 * self.rows + self.n
    }

    /// Floats of the backward's workspace: the tile, and a tile of `dx` where a row's
    /// gradient takes more than one tile of the vocabulary.
    pub fn backward_workspace(&self) -> usize {
        self.rows * self.cols
            + if self.cols < self.v {
                self.rows * self.c
            } else {
                0
            }
    }

    /// Tiles as `(r0, m, c0, vb)`: rows `r0..r0 + m` against entries `c0..c0 + vb`.
    fn tiles(&self) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        (0..self.n).step_by(self.rows.max(1)).flat_map(move |r0| {
            (0..self.v).step_by(self.cols.max(1)).map(move |c0| {
                (
                    r0,
                    self.rows.min(self.n - r0),
                    c0,
                    self.cols.min(self.v - c0),
                )
            })
        })
    }
}

/// The scalar arguments shared by the file's entry points.
struct Args {
    r0: usize,
    m: usize,
    c0: usize,
    vb: usize,
    first: bool,
    len: usize,
    dst: usize,
}

fn params(device: &GpuDevice, s: &HeadShape, a: Args) -> Result<Params> {
    let u = |v| u32_of(device, "lm_head_loss", v);
    let tile = s.rows * s.cols;
    Ok(Params::new()
        .u(u(a.r0)?)
        .u(u(a.m)?)
        .u(u(a.c0)?)
        .u(u(a.vb)?)
        .u(u(s.v)?)
        .u(u(s.n)?)
        .u(u32::from(a.first))
        .u(u(tile)?)
        .u(u(tile + s.rows)?)
        .u(u(tile + 2 * s.rows)?)
        .u(u(a.len)?)
        .u(u(a.dst)?))
}

/// Records `logits = x[r0..r0 + m] · head block c0..c0 + vb` into the start of `ws`.
fn tile_logits<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    s: &HeadShape,
    (r0, m, c0, vb): (usize, usize, usize, usize),
    [x, head, ws]: [DeviceSlice<'a>; 3],
) -> Result<()> {
    let head_place = if s.tb {
        Place {
            offset: c0 * s.c,
            ld: s.c,
        }
    } else {
        Place {
            offset: c0,
            ld: s.v,
        }
    };
    matmul_in(
        device,
        encoder,
        Gemm {
            batch: 1,
            m,
            n: vb,
            k: s.c,
            ta: false,
            tb: s.tb,
            shared_b: true,
        },
        [
            (
                x,
                Place {
                    offset: r0 * s.c,
                    ld: s.c,
                },
            ),
            (head, head_place),
            (ws, Place { offset: 0, ld: vb }),
        ],
        false,
    )
}

fn check_inputs(
    device: &GpuDevice,
    s: &HeadShape,
    [x, head, targets]: [&DeviceSlice<'_>; 3],
) -> Result<()> {
    need(device, "lm_head_loss x", x, s.n * s.c)?;
    need(device, "lm_head_loss head", head, s.v * s.c)?;
    need(device, "lm_head_loss targets", targets, s.n)
}

/// Records `loss[0]` (the mean cross-entropy of `x · head` against `targets`, or under a
/// loss mask `Σ mask·ce / divisor`) and each row's log-sum-exp `lse`.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_loss<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    s: HeadShape,
    [x, head, targets]: [DeviceSlice<'a>; 3],
    mask: Option<LossMask<'a>>,
    ws: DeviceSlice<'a>,
    [loss, lse]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    check_inputs(device, &s, [&x, &head, &targets])?;
    need(device, "lm_head_loss workspace", &ws, s.forward_workspace())?;
    need(device, "lm_head_loss loss", &loss, 1)?;
    need(device, "lm_head_loss lse", &lse, s.n)?;
    check_mask(device, "lm_head_loss", mask.as_ref(), s.n)?;
    // Unmasked, `loss` fills the mask's bindings: the kernel never reads them.
    let [weights, divisor] = mask.unwrap_or([loss, loss]);
    let dispatch = |entry, a: Args, grid, tensors| -> Result<Dispatch<'a>> {
        Ok(Dispatch {
            source: SOURCE,
            entry,
            constants: masked_constant(mask.as_ref()),
            params: params(device, &s, a)?,
            tensors,
            grid,
        })
    };
    let args = |r0, m, c0, vb, first| Args {
        r0,
        m,
        c0,
        vb,
        first,
        len: 0,
        dst: 0,
    };
    for (r0, m, c0, vb) in s.tiles() {
        tile_logits(device, encoder, &s, (r0, m, c0, vb), [x, head, ws])?;
        dispatch(
            "lse_block",
            args(r0, m, c0, vb, c0 == 0),
            grid_1d(device, m as u64),
            vec![(1, ws), (2, targets), (3, lse)],
        )?
        .record(device, encoder)?;
        if c0 + vb == s.v {
            dispatch(
                "lse_finish",
                args(r0, m, c0, vb, false),
                grid_items(device, m),
                vec![(1, ws), (3, lse)],
            )?
            .record(device, encoder)?;
        }
    }
    dispatch(
        "loss_mean",
        args(0, 0, 0, 0, false),
        [1, 1, 1],
        vec![(1, ws), (4, loss), (7, weights), (8, divisor)],
    )?
    .record(device, encoder)
}

/// Records the gradients `dx` (which may be `x`'s range: a tile's rows of `x` are read before
/// its rows of `dx` are written) and `dhead` (written whole) from the forward's `lse` and
/// `dloss`, under the forward's loss mask if it had one.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_loss_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    s: HeadShape,
    [x, head, targets, lse, dloss]: [DeviceSlice<'a>; 5],
    mask: Option<LossMask<'a>>,
    ws: DeviceSlice<'a>,
    [dx, dhead]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    check_inputs(device, &s, [&x, &head, &targets])?;
    need(device, "lm_head_loss_backward lse", &lse, s.n)?;
    need(device, "lm_head_loss_backward dloss", &dloss, 1)?;
    need(
        device,
        "lm_head_loss_backward workspace",
        &ws,
        s.backward_workspace(),
    )?;
    need(device, "lm_head_loss_backward dx", &dx, s.n * s.c)?;
    need(device, "lm_head_loss_backward dhead", &dhead, s.v * s.c)?;
    check_mask(device, "lm_head_loss_backward", mask.as_ref(), s.n)?;
    let [weights, divisor] = mask.unwrap_or([dloss, dloss]);
    let split = s.cols < s.v;
    let dx_tile = s.rows * s.cols;
    for (r0, m, c0, vb) in s.tiles() {
        tile_logits(device, encoder, &s, (r0, m, c0, vb), [x, head, ws])?;
        let args = Args {
            r0,
            m,
            c0,
            vb,
            first: false,
            len: 0,
            dst: 0,
        };
        Dispatch {
            source: SOURCE,
            entry: "softmax_grad",
            constants: masked_constant(mask.as_ref()),
            params: params(device, &s, args)?,
            tensors: vec![
                (1, ws),
                (2, targets),
                (3, lse),
                (5, dloss),
                (7, weights),
                (8, divisor),
            ],
            grid: grid_items(device, m * vb),
        }
        .record(device, encoder)?;
        let g = (ws, Place { offset: 0, ld: vb });
        let x_rows = Place {
            offset: r0 * s.c,
            ld: s.c,
        };
        // The head's gradient first: it reads this tile's rows of x, which dx may overwrite.
        let (dhead_gemm, dhead_operands) = if s.tb {
            // dhead[c0.., :] = gᵀ · x
            (
                Gemm {
                    batch: 1,
                    m: vb,
                    n: s.c,
                    k: m,
                    ta: true,
                    tb: false,
                    shared_b: true,
                },
                [
                    g,
                    (x, x_rows),
                    (
                        dhead,
                        Place {
                            offset: c0 * s.c,
                            ld: s.c,
                        },
                    ),
                ],
            )
        } else {
            // dhead[:, c0..] = xᵀ · g
            (
                Gemm {
                    batch: 1,
                    m: s.c,
                    n: vb,
                    k: m,
                    ta: true,
                    tb: false,
                    shared_b: true,
                },
                [
                    (x, x_rows),
                    g,
                    (
                        dhead,
                        Place {
                            offset: c0,
                            ld: s.v,
                        },
                    ),
                ],
            )
        };
        matmul_in(device, encoder, dhead_gemm, dhead_operands, r0 > 0)?;
        // dx rows = g · (head block)ᵀ, summed over the vocabulary's tiles.
        let head_t = if s.tb {
            Place {
                offset: c0 * s.c,
                ld: s.c,
            }
        } else {
            Place {
                offset: c0,
                ld: s.v,
            }
        };
        let dst = if split {
            (
                ws,
                Place {
                    offset: dx_tile,
                    ld: s.c,
                },
            )
        } else {
            (dx, x_rows)
        };
        matmul_in(
            device,
            encoder,
            Gemm {
                batch: 1,
                m,
                n: s.c,
                k: vb,
                ta: false,
                tb: !s.tb,
                shared_b: true,
            },
            [g, (head, head_t), dst],
            split && c0 > 0,
        )?;
        if split && c0 + vb == s.v {
            let args = Args {
                r0,
                m,
                c0,
                vb,
                first: false,
                len: m * s.c,
                dst: r0 * s.c,
            };
            // copy_rows reads from `sums`, which is where the dx tile starts.
            Dispatch {
                source: SOURCE,
                entry: "copy_rows",
                constants: masked_constant(mask.as_ref()),
                params: params(device, &s, args)?,
                tensors: vec![(1, ws), (6, dx)],
                grid: grid_items(device, m * s.c),
            }
            .record(device, encoder)?;
        }
    }
    Ok(())
}
