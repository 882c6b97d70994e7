//! `snug-graph`'s `Silu` and `SiluBackward`.

use super::{per_element, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "silu.wgsl",
    code: include_str!("silu.wgsl"),
};

/// Records `y = x·σ(x)` over `n` elements (`y` may be `x`'s range).
pub fn silu(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    per_element(
        device,
        encoder,
        (SOURCE, "silu", String::new()),
        n,
        vec![("silu x", 1, x), ("silu y", 2, y)],
    )
}

/// Records `dx = dy · silu'(x)` over `n` elements (`dx` may be `dy`'s or `x`'s range).
pub fn silu_backward(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    x: DeviceSlice<'_>,
    dy: DeviceSlice<'_>,
    dx: DeviceSlice<'_>,
) -> Result<()> {
    per_element(
        device,
        encoder,
        (SOURCE, "silu_backward", String::new()),
        n,
        vec![("silu x", 1, x), ("silu dy", 3, dy), ("silu dx", 4, dx)],
    )
}
