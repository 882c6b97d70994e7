//! `snug-graph`'s `AccumulateGrad`: a micro-batch's gradient summed into its accumulator, and
//! the total written out on the last micro-batch.

use super::{grid_items, need, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "accumulate.wgsl",
    code: include_str!("accumulate.wgsl"),
};

/// What one micro-batch does with its gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulate {
    /// The first micro-batch: `acc = g`.
    Start,
    /// A middle one: `acc += g`.
    Add,
    /// The last one: `out = acc + g`, the accumulator left as it is.
    Finish,
}

impl Accumulate {
    /// The step of micro-batch `micro` of `micro_steps` (0-based).
    pub fn of(micro: u32, micro_steps: u32) -> Accumulate {
        if micro + 1 >= micro_steps {
            Accumulate::Finish
        } else if micro == 0 {
            Accumulate::Start
        } else {
            Accumulate::Add
        }
    }
}

/// Records one micro-batch's accumulation over `n` elements.
pub fn accumulate<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    mode: Accumulate,
    n: usize,
    [acc, g, out]: [DeviceSlice<'a>; 3],
) -> Result<()> {
    need(device, "accumulate acc", &acc, n)?;
    need(device, "accumulate grad", &g, n)?;
    need(device, "accumulate out", &out, n)?;
    let mode = match mode {
        Accumulate::Start => 0,
        Accumulate::Add => 1,
        Accumulate::Finish => 2,
    };
    Dispatch {
        source: SOURCE,
        entry: "accumulate",
        constants: String::new(),
        params: Params::new().u(u32_of(device, "accumulate", n)?).u(mode),
        tensors: vec![(1, acc), (2, g), (3, out)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
