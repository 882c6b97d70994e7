//! `snug-graph`'s `Embedding` and `EmbeddingBackward`.
//!
//! The backward reads every id once per element of the table's gradient: deterministic and
//! simple, at `vocab · c · tokens` comparisons. A sort of the ids by value would bring that
//! down to the tokens' own work; it is left for when a profile asks for it.

use super::{grid_1d, grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "embedding.wgsl",
    code: include_str!("embedding.wgsl"),
};

fn params(device: &GpuDevice, tokens: usize, c: usize, vocab: usize) -> Result<Params> {
    let u = |n| u32_of(device, "embedding", n);
    Ok(Params::new().u(u(tokens)?).u(u(c)?).u(u(vocab)?))
}

/// Records `y[t] = table[ids[t]]` for `tokens` ids into a `[vocab, c]` table.
pub fn embedding<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (tokens, vocab, c): (usize, usize, usize),
    [table, ids]: [DeviceSlice<'a>; 2],
    y: DeviceSlice<'a>,
) -> Result<()> {
    need(device, "embedding table", &table, vocab * c)?;
    need(device, "embedding ids", &ids, tokens)?;
    need(device, "embedding y", &y, tokens * c)?;
    Dispatch {
        source: SOURCE,
        entry: "embedding",
        constants: String::new(),
        params: params(device, tokens, c, vocab)?,
        tensors: vec![(1, table), (2, ids), (3, y)],
        grid: grid_items(device, tokens * c),
    }
    .record(device, encoder)
}

/// Records `dtable = Σ_t onehot(ids[t]) ⊗ dy[t]` (written whole, not added to).
pub fn embedding_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (tokens, vocab, c): (usize, usize, usize),
    [ids, dy]: [DeviceSlice<'a>; 2],
    dtable: DeviceSlice<'a>,
) -> Result<()> {
    need(device, "embedding_backward ids", &ids, tokens)?;
    need(device, "embedding_backward dy", &dy, tokens * c)?;
    need(device, "embedding_backward dtable", &dtable, vocab * c)?;
    Dispatch {
        source: SOURCE,
        entry: "embedding_backward",
        constants: String::new(),
        params: params(device, tokens, c, vocab)?,
        tensors: vec![(2, ids), (4, dy), (5, dtable)],
        grid: grid_1d(device, vocab as u64),
    }
    .record(device, encoder)
}
