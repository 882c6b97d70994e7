//! `snug-graph`'s `RopeAt`: [`rope`](super::rope::rope) starting at a position held in an
//! i32 tensor on the device (sampling's next position, which changes every decode step while
//! the recorded dispatch does not).

use super::rope::{rope_from, RopeSpec};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

/// Records `y = rope(x)` for `x [b, t, n_head · head_dim]`, row `t` at position `pos[0] + t`;
/// `y` may be `x`'s range.
pub fn rope_at<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    spec: RopeSpec,
    (b, t): (usize, usize),
    [x, pos]: [DeviceSlice<'a>; 2],
    y: DeviceSlice<'a>,
) -> Result<()> {
    rope_from(device, encoder, spec, (b, t), [x, pos], y)
}
