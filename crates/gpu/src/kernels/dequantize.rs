//! `snug-graph`'s `Dequantize`: a frozen weight stored as int8 or NF4 codes, as the f32 values
//! the CPU kernel gives. Both decodes are a table or integer lookup times an f32 scale, so the
//! bits are the CPU's wherever the device rounds f32 `*` and `/` correctly (WGSL requires it of
//! `*`; int8's `absmax / 127` may differ by WGSL's 2.5 ULP division bound elsewhere).

use snug_graph::ops::dequantize::{QuantScheme, NF4, NF4_BLOCK};

use super::{grid_items, need, u32_of, wgsl_table, ByteSlice, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "dequantize.wgsl",
    code: include_str!("dequantize.wgsl"),
};

/// Records `y = dequantize(codes, absmax)` for a weight of `n` values in rows of `cols`
/// (int8's channels are its columns; NF4 ignores `cols`).
pub fn dequantize<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    scheme: QuantScheme,
    (n, cols): (usize, usize),
    codes: ByteSlice<'a>,
    absmax: DeviceSlice<'a>,
    y: DeviceSlice<'a>,
) -> Result<()> {
    let cols = cols.max(1);
    let (entry, code_bytes, scales) = match scheme {
        QuantScheme::Int8 => ("int8", n, cols),
        QuantScheme::Nf4 => ("nf4", n.div_ceil(2), n.div_ceil(NF4_BLOCK)),
        QuantScheme::Nf4Dq => {
            return Err(super::unsupported(
                device,
                "dequantize",
                crate::launch::NF4_DQ.into(),
            ))
        }
    };
    codes.need(device, "dequantize codes", code_bytes)?;
    need(device, "dequantize absmax", &absmax, scales)?;
    need(device, "dequantize y", &y, n)?;
    Dispatch {
        source: SOURCE,
        entry,
        constants: format!(
            "{}\nconst NF4_BLOCK: u32 = {NF4_BLOCK}u;",
            wgsl_table("NF4", &NF4)
        ),
        params: Params::new()
            .u(u32_of(device, "dequantize", n)?)
            .u(u32_of(device, "dequantize", cols)?)
            .u(u32_of(device, "dequantize", codes.offset as usize)?),
        tensors: vec![(1, codes.words), (2, absmax), (3, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
