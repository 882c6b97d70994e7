//! One WGSL kernel per op, in files named as the op's file in `snug-graph` (`matmul.wgsl` and
//! its launcher `matmul.rs`).
//!
//! Every launcher records its dispatches into the caller's `wgpu::CommandEncoder` and never
//! reads back, so a whole step can be recorded and submitted once. Tensors come in as
//! [`DeviceSlice`]s (a chunk's range); every storage binding is declared `read_write`, because
//! tensors of one arena chunk are bound together and wgpu forbids binding one buffer both
//! read-only and writable in a dispatch. Scalar arguments travel in a small uniform buffer per
//! launch. The workgroup reductions (`reduce_sum`, `reduce_max`: the norms, the losses, the
//! gradient norm, cached attention) use subgroup shuffles where the device has `SUBGROUP`, a
//! tree in workgroup memory elsewhere, with the same bits either way; no subgroup size is
//! assumed.

pub mod accumulate;
pub mod adamw;
pub mod adamw8bit;
pub mod attention;
pub mod cast;
pub mod cross_entropy;
pub mod dequantize;
pub mod elementwise;
pub mod embedding;
pub mod fill;
pub mod gelu;
pub mod grad_norm;
pub mod kv_attention;
pub mod layernorm;
pub mod lm_head_loss;
pub mod matmul;
pub mod reduce;
pub mod rmsnorm;
pub mod rope;
pub mod rope_at;
pub mod sgd;
pub mod silu;
pub mod softmax;
pub mod subgroup;
pub mod swiglu;
pub mod view;

use wgpu::util::DeviceExt;

use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::memory::DeviceSlice;

/// Helpers every kernel file may use, prepended to each: the shared ones, then the
/// reductions of the device's path.
const PRELUDE_PLAIN: &str = concat!(
    include_str!("prelude.wgsl"),
    "\n",
    include_str!("reduce_plain.wgsl")
);
const PRELUDE_SUBGROUP: &str = concat!(
    include_str!("prelude.wgsl"),
    "\n",
    include_str!("reduce_subgroup.wgsl")
);

/// The prelude for a device that uses subgroup operations (`subgroups`) or not.
pub(crate) fn prelude(subgroups: bool) -> &'static str {
    if subgroups {
        PRELUDE_SUBGROUP
    } else {
        PRELUDE_PLAIN
    }
}

/// A u8 tensor as kernels bind it: the words of `words`, its first byte `offset` bytes into
/// them (four codes to a little-endian word; a view may start at any byte).
#[derive(Debug, Clone, Copy)]
pub struct ByteSlice<'a> {
    pub words: DeviceSlice<'a>,
    pub offset: u64,
}

impl<'a> ByteSlice<'a> {
    /// A tensor that starts at the binding's first byte.
    pub fn at_start(words: DeviceSlice<'a>) -> ByteSlice<'a> {
        ByteSlice { words, offset: 0 }
    }

    /// Checks that `n` bytes from `offset` lie in the binding, naming the tensor `what`.
    pub(crate) fn need(&self, device: &GpuDevice, what: &str, n: usize) -> Result<()> {
        let want = self.offset + n as u64;
        if self.words.bytes() < want {
            return Err(GpuError::Binding {
                device: device.name().to_string(),
                what: what.to_string(),
                detail: format!(
                    "{} bytes bound, {want} needed ({n} codes from byte {})",
                    self.words.bytes(),
                    self.offset
                ),
            });
        }
        Ok(())
    }
}

/// `x` as a WGSL f32 literal of exactly its bits (a hexadecimal float; finite `x`).
pub(crate) fn wgsl_f32(x: f32) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0f"
        } else {
            "0.0f"
        }
        .into();
    }
    let bits = x.to_bits();
    let sign = if bits >> 31 == 1 { "-" } else { "" };
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: 0.m × 2^-126.
        format!("{sign}0x0.{:06x}p-126f", mant << 1)
    } else {
        format!("{sign}0x1.{:06x}p{}f", mant << 1, exp - 127)
    }
}

/// `name` as a WGSL `const` array of `values`, each exactly its bits.
pub(crate) fn wgsl_table(name: &str, values: &[f32]) -> String {
    let items: Vec<String> = values.iter().map(|&v| wgsl_f32(v)).collect();
    format!(
        "const {name} = array<f32, {}>({});",
        values.len(),
        items.join(", ")
    )
}

/// Threads of the one-dimensional kernels' workgroups (WebGPU's guaranteed minimum).
pub(crate) const WG: u32 = 256;

/// Words every argument block is padded to: more than any kernel's struct but RoPE's.
const MIN_PARAM_WORDS: usize = 32;

/// The scalar arguments of a launch, as the 32-bit words of a WGSL uniform struct whose fields
/// are all `u32` / `f32` / `i32`, in order.
#[derive(Debug, Default, Clone)]
pub(crate) struct Params(Vec<u32>);

impl Params {
    pub fn new() -> Params {
        Params(Vec::new())
    }
    pub fn u(mut self, v: u32) -> Self {
        self.0.push(v);
        self
    }
    pub fn f(mut self, v: f32) -> Self {
        self.0.push(v.to_bits());
        self
    }
}

/// A WGSL file and its name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source {
    pub file: &'static str,
    pub code: &'static str,
}

/// One dispatch of `entry`: its specialisation constants, scalar arguments (binding 0) and
/// tensors (`(binding, slice)`), over `grid` workgroups.
pub(crate) struct Dispatch<'a> {
    pub source: Source,
    pub entry: &'static str,
    pub constants: String,
    pub params: Params,
    pub tensors: Vec<(u32, DeviceSlice<'a>)>,
    pub grid: [u32; 3],
}

impl Dispatch<'_> {
    /// Records the dispatch into `encoder`.
    pub fn record(self, device: &GpuDevice, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        if self.grid.contains(&0) {
            return Ok(());
        }
        let max = device.limits().max_compute_workgroups_per_dimension;
        if self.grid.iter().any(|&g| g > max) {
            return Err(unsupported(
                device,
                self.source.file,
                format!(
                    "a grid of {:?} workgroups (at most {max} a side)",
                    self.grid
                ),
            ));
        }
        for (_, t) in &self.tensors {
            if t.bytes() == 0 {
                return Ok(());
            }
        }
        let storage = self.tensors.iter().map(|(b, _)| *b).collect();
        let pipeline = device.pipeline(
            self.source.file,
            self.source.code,
            self.entry,
            self.constants,
            storage,
        )?;
        let wgpu_device = device.wgpu_device();
        let mut words = self.params.0;
        // Zero-padded: an entry point that leaves trailing fields of its file's struct unset
        // reads zeros there, and wgpu checks the binding covers the whole struct.
        words.resize(words.len().max(MIN_PARAM_WORDS).next_multiple_of(4), 0);
        let uniform = wgpu_device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(self.entry),
            contents: bytemuck::cast_slice(&words),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        entries.extend(self.tensors.iter().map(|(b, t)| wgpu::BindGroupEntry {
            binding: *b,
            resource: t.binding(),
        }));
        let bind_group = wgpu_device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(self.entry),
            layout: &pipeline.layout,
            entries: &entries,
        });
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(self.entry),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(self.grid[0], self.grid[1], self.grid[2]);
        Ok(())
    }
}

pub(crate) fn unsupported(device: &GpuDevice, kernel: &'static str, detail: String) -> GpuError {
    GpuError::Unsupported {
        device: device.name().to_string(),
        kernel,
        detail,
    }
}

/// A grid of `groups` workgroups laid out in x then y (the prelude's `group_index` undoes it),
/// since one side holds at most `max_compute_workgroups_per_dimension`.
pub(crate) fn grid_1d(device: &GpuDevice, groups: u64) -> [u32; 3] {
    let max = u64::from(device.limits().max_compute_workgroups_per_dimension.max(1));
    let x = groups.min(max);
    let y = groups.div_ceil(x.max(1));
    [x as u32, y.min(u64::from(u32::MAX)) as u32, 1]
}

/// Workgroups of [`WG`] threads covering `n` items, one item a thread.
pub(crate) fn grid_items(device: &GpuDevice, n: usize) -> [u32; 3] {
    grid_1d(device, (n as u64).div_ceil(u64::from(WG)))
}

/// Checks that `slice` holds at least `elems` 4-byte elements, naming it `what`.
pub(crate) fn need(
    device: &GpuDevice,
    what: &str,
    slice: &DeviceSlice<'_>,
    elems: usize,
) -> Result<()> {
    let want = elems as u64 * 4;
    if slice.bytes() < want {
        return Err(GpuError::Binding {
            device: device.name().to_string(),
            what: what.to_string(),
            detail: format!("{} bytes bound, {want} needed", slice.bytes()),
        });
    }
    Ok(())
}

/// `u32` for a size the kernels index with 32-bit integers.
pub(crate) fn u32_of(device: &GpuDevice, kernel: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        unsupported(
            device,
            kernel,
            format!("{n} elements exceed 32-bit indexing"),
        )
    })
}

/// One thread per element of `n`, for the kernels whose only argument is `n`.
pub(crate) fn per_element<'a>(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (source, entry, constants): (Source, &'static str, String),
    n: usize,
    tensors: Vec<(&'static str, u32, DeviceSlice<'a>)>,
) -> Result<()> {
    for (what, _, t) in &tensors {
        need(device, what, t, n)?;
    }
    Dispatch {
        source,
        entry,
        constants,
        params: Params::new().u(u32_of(device, source.file, n)?),
        tensors: tensors.into_iter().map(|(_, b, t)| (b, t)).collect(),
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}
