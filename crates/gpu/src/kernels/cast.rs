//! `snug-graph`'s `Cast` between f32 and 16-bit storage (bf16, f16). f16 is read with the
//! device's own f16 where it has `SHADER_F16` and by integer arithmetic on the bits where it
//! has not; it is always written by the integer path, whose bits are the CPU's (WGSL leaves
//! the rounding and overflow of a native f32 to f16 conversion to the device).

use super::{grid_items, u32_of, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "cast.wgsl",
    code: include_str!("cast.wgsl"),
};

const NATIVE_F16: Source = Source {
    file: "cast_f16.wgsl",
    code: include_str!("cast_f16.wgsl"),
};

/// A 16-bit storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    Bf16,
    F16,
}

/// The file, entry and constants of the cast `to` (or from) `half` on `device`.
fn kernel(device: &GpuDevice, half: Half, to: bool) -> (Source, &'static str, String) {
    let entry = match (half, to) {
        (Half::Bf16, true) => "to_bf16",
        (Half::Bf16, false) => "from_bf16",
        (Half::F16, true) => "to_f16",
        (Half::F16, false) => "from_f16",
    };
    if half == Half::F16 && !to && device.has_f16() {
        (NATIVE_F16, entry, "enable f16;".into())
    } else {
        (SOURCE, entry, String::new())
    }
}

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

/// Records `y = half(x)` over `n` elements (`y` holds two to a word).
pub fn to_half(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    half: Half,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need_bytes(device, "cast x", &x, 4 * n)?;
    need_bytes(device, "cast y", &y, 2 * n)?;
    let (source, entry, constants) = kernel(device, half, true);
    Dispatch {
        source,
        entry,
        constants,
        params: Params::new().u(u32_of(device, "cast", n)?),
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, n.div_ceil(2)),
    }
    .record(device, encoder)
}

/// Records `y = f32(x)` over `n` 16-bit elements of type `half`.
pub fn from_half(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    half: Half,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need_bytes(device, "cast x", &x, 2 * n)?;
    need_bytes(device, "cast y", &y, 4 * n)?;
    let (source, entry, constants) = kernel(device, half, false);
    Dispatch {
        source,
        entry,
        constants,
        params: Params::new().u(u32_of(device, "cast", n)?),
        tensors: vec![(3, x), (4, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
