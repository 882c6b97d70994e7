//! `snug-graph`'s `KvAttention`: causal attention of `T` new positions over key/value caches
//! `[B, S, KH·D]` they are first appended to at the run-time position `pos` (an i32 tensor on
//! the device), for sampling. Queries, keys and values are read through row strides, so one
//! kernel serves GPT's packed `qkv` and Llama's separate `q`, `k`, `v`.

use super::attention::AttentionLayout;
use super::{grid_1d, grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "kv_attention.wgsl",
    code: include_str!("kv_attention.wgsl"),
};

/// The widest head: one thread of the workgroup per output element.
const MAX_HEAD_DIM: usize = 256;

/// Sizes of one cached attention (the graph op's own).
pub use snug_graph::ops::kv_attention::Dims as KvShape;

/// Records the caches' update and `y [B, T, H·D]`, from `[q, k, v, k_cache, v_cache, pos]`
/// laid out by `l` (`q`, `k`, `v` may be one packed range).
pub fn kv_attention<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (s, l): (KvShape, AttentionLayout),
    [q, k, v, k_cache, v_cache, pos]: [DeviceSlice<'a>; 6],
    y: DeviceSlice<'a>,
) -> Result<()> {
    let kernel = "kv_attention";
    if s.d == 0 || s.d > MAX_HEAD_DIM || s.kh == 0 || !s.h.is_multiple_of(s.kh) || s.t > s.s {
        return Err(unsupported(
            device,
            kernel,
            format!(
                "{} heads of {} over {} kv heads, {} new rows in a cache of {} (heads 1 to \
                 {MAX_HEAD_DIM} wide, grouped evenly)",
                s.h, s.d, s.kh, s.t, s.s
            ),
        ));
    }
    let rows = s.b * s.t;
    let kv = s.kh * s.d;
    let end = |r: super::attention::Rows, width: usize| {
        rows.saturating_sub(1) * r.stride + r.offset + width
    };
    need(device, "kv_attention q", &q, end(l.q, s.h * s.d))?;
    need(device, "kv_attention k", &k, end(l.k, kv))?;
    need(device, "kv_attention v", &v, end(l.v, kv))?;
    need(device, "kv_attention k_cache", &k_cache, s.b * s.s * kv)?;
    need(device, "kv_attention v_cache", &v_cache, s.b * s.s * kv)?;
    need(device, "kv_attention pos", &pos, 1)?;
    need(device, "kv_attention y", &y, rows * s.h * s.d)?;
    let u = |n| u32_of(device, kernel, n);
    let mut params = Params::new()
        .u(u(s.b)?)
        .u(u(s.t)?)
        .u(u(s.s)?)
        .u(u(s.h)?)
        .u(u(s.kh)?)
        .u(u(s.d)?)
        .f(1.0 / (s.d as f32).sqrt());
    for r in [l.q, l.k, l.v] {
        params = params.u(u(r.stride)?).u(u(r.offset)?);
    }
    u(s.b * s.s * kv)?;
    Dispatch {
        source: SOURCE,
        entry: "kv_write",
        constants: String::new(),
        params: params.clone(),
        tensors: vec![(2, k), (3, v), (4, k_cache), (5, v_cache), (6, pos)],
        grid: grid_items(device, rows * kv),
    }
    .record(device, encoder)?;
    Dispatch {
        source: SOURCE,
        entry: kernel,
        constants: String::new(),
        params,
        tensors: vec![(1, q), (4, k_cache), (5, v_cache), (6, pos), (7, y)],
        grid: grid_1d(device, (s.b * s.h * s.t) as u64),
    }
    .record(device, encoder)
}
