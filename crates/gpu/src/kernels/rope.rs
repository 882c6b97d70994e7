//! `snug-graph`'s `Rope`: rotary position embedding of `x [B, T, n_head · head_dim]`, forward
//! or inverse (which is also the forward's gradient).

use super::{grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "rope.wgsl",
    code: include_str!("rope.wgsl"),
};

/// Frequencies the kernel's argument block holds: heads up to 256 wide.
const MAX_HALF: usize = 128;

/// The rotation is the graph's op itself (heads, head width, frequencies, direction): its
/// `inv_freq` is the one every backend takes its frequencies from.
pub use snug_graph::ops::Rope as RopeSpec;

/// A frequency (radians a position, f64 as [`RopeSpec::inv_freq`] gives it) as a 64-bit
/// fraction of a turn `(hi, lo)`, so the kernel's angle stays exact at long positions.
fn turn_words(inv_freq: f64) -> (u32, u32) {
    let turns = inv_freq / std::f64::consts::TAU;
    let scaled = turns * 4_294_967_296.0;
    let hi = scaled.floor();
    let lo = ((scaled - hi) * 4_294_967_296.0).floor();
    (hi as u32, lo as u32)
}

/// Records `y = rope(x)` for `x [b, t, n_head · head_dim]`; `y` may be `x`'s range.
pub fn rope<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    spec: RopeSpec,
    (b, t): (usize, usize),
    x: DeviceSlice<'a>,
    y: DeviceSlice<'a>,
) -> Result<()> {
    let (params, n) = rotation(device, spec, (b, t))?;
    need(device, "rope x", &x, n)?;
    need(device, "rope y", &y, n)?;
    Dispatch {
        source: SOURCE,
        entry: "rope",
        constants: String::new(),
        params,
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, n / 2),
    }
    .record(device, encoder)
}

/// [`rope`] with row `t` rotated as position `pos + t`, `pos` read on the device (`snug-graph`'s
/// `RopeAt`).
pub(crate) fn rope_from<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    spec: RopeSpec,
    (b, t): (usize, usize),
    [x, pos]: [DeviceSlice<'a>; 2],
    y: DeviceSlice<'a>,
) -> Result<()> {
    let (params, n) = rotation(device, spec, (b, t))?;
    need(device, "rope_at x", &x, n)?;
    need(device, "rope_at pos", &pos, 1)?;
    need(device, "rope_at y", &y, n)?;
    Dispatch {
        source: SOURCE,
        entry: "rope_at",
        constants: String::new(),
        params,
        tensors: vec![(1, x), (2, y), (3, pos)],
        grid: grid_items(device, n / 2),
    }
    .record(device, encoder)
}

/// The kernel's arguments for `spec` over `b × t` rows, and the elements it rotates.
fn rotation(device: &GpuDevice, spec: RopeSpec, (b, t): (usize, usize)) -> Result<(Params, usize)> {
    let kernel = "rope";
    let half = spec.head_dim / 2;
    if spec.head_dim == 0 || !spec.head_dim.is_multiple_of(2) || half > MAX_HALF {
        return Err(unsupported(
            device,
            kernel,
            format!(
                "head_dim {} (even, at most {})",
                spec.head_dim,
                2 * MAX_HALF
            ),
        ));
    }
    let n = b * t * spec.n_head * spec.head_dim;
    let u = |v| u32_of(device, kernel, v);
    u(n)?;
    let mut params = Params::new()
        .u(u(b * t)?)
        .u(u(t)?)
        .u(u(spec.n_head)?)
        .u(u(half)?)
        .f(if spec.inverse { -1.0 } else { 1.0 })
        .u(0)
        .u(0)
        .u(0);
    for i in 0..MAX_HALF {
        let (hi, lo) = if i < half {
            turn_words(spec.inv_freq(i))
        } else {
            (0, 0)
        };
        params = params.u(hi).u(lo);
    }
    Ok((params, n))
}

#[cfg(test)]
mod tests {
    use super::turn_words;

    #[test]
    fn the_first_frequency_is_one_radian_a_position() {
        let (hi, lo) = turn_words(super::RopeSpec::new(1, 64, 10_000.0).inv_freq(0));
        let turns = (f64::from(hi) + f64::from(lo) / 4_294_967_296.0) / 4_294_967_296.0;
        assert!((turns * std::f64::consts::TAU - 1.0).abs() < 1e-15);
    }
}
