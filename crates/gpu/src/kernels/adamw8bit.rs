//! `snug-graph`'s `AdamW8bit`: AdamW on block-wise quantized moments, one workgroup per block
//! of `BLOCK` elements, in the CPU kernel's f32 operations and order. The codes and absmaxes
//! are the CPU's bit for bit wherever the device's f32 `sqrt` and `/` are correctly rounded
//! (lavapipe); WGSL allows a few ULP there, by which the weights may then differ, and a moment
//! that lands within them of the midpoint between two code-book entries may take the other.

use snug_graph::ops::adamw8bit::{blocks, dynamic_code, BLOCK};

use super::adamw::AdamWStep;
use super::{grid_1d, need, u32_of, unsupported, wgsl_table, ByteSlice, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "adamw8bit.wgsl",
    code: include_str!("adamw8bit.wgsl"),
};

/// The moments' codes (written back in place) and their per-block absmaxes.
#[derive(Debug, Clone, Copy)]
pub struct Moments8bit<'a> {
    pub m: ByteSlice<'a>,
    pub v: ByteSlice<'a>,
    pub m_absmax: DeviceSlice<'a>,
    pub v_absmax: DeviceSlice<'a>,
}

/// Records one 8-bit AdamW step over `n` elements: `param` and the moments are updated in place
/// from `grad`, multiplied by `scale[0]` where given (nothing changes if it is not finite).
pub fn adamw8bit<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    s: AdamWStep,
    n: usize,
    [param, grad]: [DeviceSlice<'a>; 2],
    moments: Moments8bit<'a>,
    scale: Option<DeviceSlice<'a>>,
) -> Result<()> {
    need(device, "adamw8bit param", &param, n)?;
    need(device, "adamw8bit grad", &grad, n)?;
    let nb = blocks(n);
    need(device, "adamw8bit m absmax", &moments.m_absmax, nb)?;
    need(device, "adamw8bit v absmax", &moments.v_absmax, nb)?;
    let mut words = [0u32; 2];
    for (word, (what, codes)) in words
        .iter_mut()
        .zip([("adamw8bit m", &moments.m), ("adamw8bit v", &moments.v)])
    {
        codes.need(device, what, n.next_multiple_of(4))?;
        // Each thread rewrites whole words of its own block: a block must start one.
        if !codes.offset.is_multiple_of(4) {
            return Err(unsupported(
                device,
                SOURCE.file,
                format!(
                    "{what}'s codes start at byte {} of their binding, not at a word",
                    codes.offset
                ),
            ));
        }
        *word = u32_of(device, SOURCE.file, (codes.offset / 4) as usize)?;
    }
    if let Some(scale) = &scale {
        need(device, "adamw8bit scale", scale, 1)?;
    }
    let t = i32::try_from(s.step.max(1)).unwrap_or(i32::MAX);
    let bc1 = 1.0 - s.beta1.powi(t);
    let bc2 = 1.0 - s.beta2.powi(t);
    Dispatch {
        source: SOURCE,
        entry: "adamw8bit",
        constants: format!(
            "const SCALE: bool = {};\nconst BLOCK: u32 = {BLOCK}u;\n{}\n{}",
            scale.is_some(),
            wgsl_table("BOOK_SIGNED", &dynamic_code(true)),
            wgsl_table("BOOK_UNSIGNED", &dynamic_code(false)),
        ),
        params: Params::new()
            .u(u32_of(device, SOURCE.file, n)?)
            .f(s.beta1)
            .f(s.beta2)
            .f(s.eps)
            .f(s.lr / bc1)
            .f(bc2.sqrt())
            .f(1.0 - s.lr * s.weight_decay)
            .u(words[0])
            .u(words[1]),
        // Without a scale, `grad` fills its binding: the kernel never reads it.
        tensors: vec![
            (1, param),
            (2, grad),
            (3, moments.m.words),
            (4, moments.v.words),
            (5, moments.m_absmax),
            (6, moments.v_absmax),
            (7, scale.unwrap_or(grad)),
        ],
        grid: grid_1d(device, nb as u64),
    }
    .record(device, encoder)
}
