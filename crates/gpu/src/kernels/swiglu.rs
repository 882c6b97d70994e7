//! `snug-graph`'s `SwiGlu` and `SwiGluBackward`.

use super::{per_element, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "swiglu.wgsl",
    code: include_str!("swiglu.wgsl"),
};

/// Records `y = silu(gate)·up` over `n` elements (`y` may be either input's range).
pub fn swiglu(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    gate: DeviceSlice<'_>,
    up: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    per_element(
        device,
        encoder,
        (SOURCE, "swiglu", String::new()),
        n,
        vec![
            ("swiglu gate", 1, gate),
            ("swiglu up", 2, up),
            ("swiglu y", 3, y),
        ],
    )
}

/// Records `dgate = dy·up·silu'(gate)` and `dup = dy·silu(gate)` over `n` elements.
pub fn swiglu_backward<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    n: usize,
    [gate, up, dy]: [DeviceSlice<'a>; 3],
    [dgate, dup]: [DeviceSlice<'a>; 2],
) -> Result<()> {
    per_element(
        device,
        encoder,
        (SOURCE, "swiglu_backward", String::new()),
        n,
        vec![
            ("swiglu gate", 1, gate),
            ("swiglu up", 2, up),
            ("swiglu dy", 4, dy),
            ("swiglu dgate", 5, dgate),
            ("swiglu dup", 6, dup),
        ],
    )
}
