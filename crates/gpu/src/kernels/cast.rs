//! `snug-graph`'s `Cast` between f32 and bf16 storage (f16 has no GPU kernel yet).

use super::{grid_items, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "cast.wgsl",
    code: include_str!("cast.wgsl"),
};

fn need_bytes(device: &GpuDevice, what: &str, slice: &DeviceSlice<'_>, bytes: usize) -> Result<()> {
    let want = (bytes as u64).next_multiple_of(4);
    if slice.bytes() < want {
        return Err(GpuError::Binding {
            device: device.name().to_string(),
            what: what.to_string(),
            detail: format!("{} bytes bound, {want} needed", slice.bytes()),
        });
    }
    Ok(())
}

/// Records `y = bf16(x)` over `n` elements (`y` holds two to a word).
pub fn to_bf16(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need_bytes(device, "cast x", &x, 4 * n)?;
    need_bytes(device, "cast y", &y, 2 * n)?;
    Dispatch {
        source: SOURCE,
        entry: "to_bf16",
        constants: String::new(),
        params: Params::new().u(u32_of(device, "cast", n)?),
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, n.div_ceil(2)),
    }
    .record(device, encoder)
}

/// Records `y = f32(x)` over `n` bf16 elements.
pub fn from_bf16(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need_bytes(device, "cast x", &x, 2 * n)?;
    need_bytes(device, "cast y", &y, 4 * n)?;
    Dispatch {
        source: SOURCE,
        entry: "from_bf16",
        constants: String::new(),
        params: Params::new().u(u32_of(device, "cast", n)?),
        tensors: vec![(3, x), (4, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
