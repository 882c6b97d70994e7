//! `snug-graph`'s `CausalAttention` (packed `qkv [B, T, 3C]`) and `GqaAttention` (separate
//! `q`, `k`, `v`), forward and backward, from one kernel that reads heads through row strides.
//! Outputs `y [B, T, H·D]` and `lse [B, H, T]`; the backward recomputes the probabilities from
//! `lse` and writes `dq`, `dk`, `dv` laid out as `q`, `k`, `v` (for the packed form, one
//! `dqkv`).

use super::{need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "attention.wgsl",
    code: include_str!("attention.wgsl"),
};

/// Rows a workgroup owns (the kernel's `ROWS`).
const ROWS: usize = 64;
/// The widest head: each thread keeps a few rows of it in private memory.
const MAX_HEAD_DIM: usize = 256;
/// Floats of the two staged tiles together, within WebGPU's guaranteed 16 KiB of workgroup
/// memory beside the backward's per-row statistics.
const TILE_FLOATS: usize = 3968;

/// Sizes of one attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    /// Heads of keys and values; `heads` is a multiple of it.
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Where a head's rows lie in a `[B, T, …]` tensor: the distance between rows and where head 0
/// starts in a row, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub stride: usize,
    pub offset: usize,
}

/// Where queries, keys and values (and so their gradients) are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionLayout {
    pub q: Rows,
    pub k: Rows,
    pub v: Rows,
}

impl AttentionLayout {
    /// GPT's packed `qkv [B, T, 3C]`: queries, keys, values side by side in each row.
    pub fn packed(s: &AttentionShape) -> AttentionLayout {
        let c = s.heads * s.head_dim;
        let at = |offset| Rows {
            stride: 3 * c,
            offset,
        };
        AttentionLayout {
            q: at(0),
            k: at(c),
            v: at(2 * c),
        }
    }

    /// Separate `q [B, T, H·D]`, `k` and `v [B, T, KH·D]`.
    pub fn separate(s: &AttentionShape) -> AttentionLayout {
        let kv = Rows {
            stride: s.kv_heads * s.head_dim,
            offset: 0,
        };
        AttentionLayout {
            q: Rows {
                stride: s.heads * s.head_dim,
                offset: 0,
            },
            k: kv,
            v: kv,
        }
    }
}

fn check(device: &GpuDevice, s: &AttentionShape) -> Result<()> {
    if s.head_dim == 0 || s.head_dim > MAX_HEAD_DIM {
        return Err(unsupported(
            device,
            "attention",
            format!("head_dim {} (1 to {MAX_HEAD_DIM})", s.head_dim),
        ));
    }
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return Err(unsupported(
            device,
            "attention",
            format!("{} heads over {} kv heads", s.heads, s.kv_heads),
        ));
    }
    Ok(())
}

fn constants(s: &AttentionShape) -> String {
    let tile = (TILE_FLOATS / 2 / s.head_dim).clamp(1, ROWS);
    format!(
        "const HEAD_DIM: u32 = {}u;\nconst TILE: u32 = {tile}u;",
        s.head_dim
    )
}

/// The kernel's arguments; the gradients' rows are laid out as their inputs'.
fn params(device: &GpuDevice, s: &AttentionShape, l: &AttentionLayout) -> Result<Params> {
    let u = |n| u32_of(device, "attention", n);
    let mut p = Params::new()
        .u(u(s.seq)?)
        .u(u(s.heads)?)
        .u(u(s.kv_heads)?)
        .f(1.0 / (s.head_dim as f32).sqrt());
    for r in [l.q, l.k, l.v] {
        p = p.u(u(r.stride)?).u(u(r.offset)?);
    }
    p = p.u(u(s.heads * s.head_dim)?);
    for r in [l.q, l.k, l.v] {
        p = p.u(u(r.stride)?).u(u(r.offset)?);
    }
    Ok(p)
}

fn need_all(
    device: &GpuDevice,
    s: &AttentionShape,
    l: &AttentionLayout,
    named: &[(&str, &DeviceSlice<'_>)],
) -> Result<()> {
    let rows = s.batch * s.seq;
    for (what, t) in named {
        let elems = match *what {
            "q" | "dq" => rows * l.q.stride,
            "k" | "dk" => rows * l.k.stride,
            "v" | "dv" => rows * l.v.stride,
            "lse" => s.batch * s.heads * s.seq,
            _ => rows * s.heads * s.head_dim,
        };
        need(device, &format!("attention {what}"), t, elems)?;
    }
    Ok(())
}

/// Records `y = softmax(QKᵀ/√D, causal)·V` and each row's log-sum-exp.
pub fn attention_forward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (s, l): (AttentionShape, AttentionLayout),
    [q, k, v]: [DeviceSlice<'a>; 3],
    [y, lse]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    check(device, &s)?;
    need_all(
        device,
        &s,
        &l,
        &[("q", &q), ("k", &k), ("v", &v), ("y", &y), ("lse", &lse)],
    )?;
    Dispatch {
        source: SOURCE,
        entry: "attention_forward",
        constants: constants(&s),
        params: params(device, &s, &l)?,
        tensors: vec![(1, q), (2, k), (3, v), (4, y), (5, lse)],
        grid: [
            u32_of(device, "attention", s.seq.div_ceil(ROWS))?,
            u32_of(device, "attention", s.batch * s.heads)?,
            1,
        ],
    }
    .record(device, encoder)
}

/// Records the gradients `dq`, `dk`, `dv` from the forward's inputs, its `y` and `lse`, and
/// `dy`. Each is written whole; for the packed form all three are one `dqkv`.
pub fn attention_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (s, l): (AttentionShape, AttentionLayout),
    [q, k, v, y, lse, dy]: [DeviceSlice<'a>; 6],
    [dq, dk, dv]: [DeviceSlice<'a>; 3],
) -> Result<()> {
    check(device, &s)?;
    need_all(
        device,
        &s,
        &l,
        &[
            ("q", &q),
            ("k", &k),
            ("v", &v),
            ("y", &y),
            ("lse", &lse),
            ("dy", &dy),
            ("dq", &dq),
            ("dk", &dk),
            ("dv", &dv),
        ],
    )?;
    let blocks = u32_of(device, "attention", s.seq.div_ceil(ROWS))?;
    Dispatch {
        source: SOURCE,
        entry: "attention_backward_dq",
        constants: constants(&s),
        params: params(device, &s, &l)?,
        tensors: vec![(1, q), (2, k), (3, v), (4, y), (5, lse), (6, dy), (7, dq)],
        grid: [blocks, u32_of(device, "attention", s.batch * s.heads)?, 1],
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: "attention_backward_dkdv",
        constants: constants(&s),
        params: params(device, &s, &l)?,
        tensors: vec![
            (1, q),
            (2, k),
            (3, v),
            (4, y),
            (5, lse),
            (6, dy),
            (8, dk),
            (9, dv),
        ],
        grid: [
            blocks,
            u32_of(device, "attention", s.batch * s.kv_heads)?,
            1,
        ],
    }
    .record(device, encoder)
}
