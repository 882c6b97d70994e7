//! `snug-graph`'s `Gelu` and `GeluBackward`, tanh or exact form.

use super::{per_element, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "gelu.wgsl",
    code: include_str!("gelu.wgsl"),
};

/// Which GELU: GPT-2's tanh approximation or the exact one with the error function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluForm {
    Tanh,
    Exact,
}

fn constants(form: GeluForm) -> String {
    format!("const TANH: bool = {};", form == GeluForm::Tanh)
}

/// Records `y = gelu(x)` over `n` elements (`y` may be `x`'s range).
pub fn gelu(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    form: GeluForm,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    per_element(
        device,
        encoder,
        (SOURCE, "gelu", constants(form)),
        n,
        vec![("gelu x", 1, x), ("gelu y", 2, y)],
    )
}

/// Records `dx = dy · gelu'(x)` over `n` elements (`dx` may be `dy`'s or `x`'s range).
pub fn gelu_backward(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    form: GeluForm,
    n: usize,
    x: DeviceSlice<'_>,
    dy: DeviceSlice<'_>,
    dx: DeviceSlice<'_>,
) -> Result<()> {
    per_element(
        device,
        encoder,
        (SOURCE, "gelu_backward", constants(form)),
        n,
        vec![("gelu x", 1, x), ("gelu dy", 3, dy), ("gelu dx", 4, dx)],
    )
}
