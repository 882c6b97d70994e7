//! Device memory: buffers from a [`MemorySource`] that counts them, the arena as one or more
//! chunks no larger than the device's largest buffer, and a tensor as a [`Slot`] in it — (chunk,
//! byte offset, byte length) — checked against the device's binding rules when it is resolved
//! to a [`DeviceSlice`] that kernels bind.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::GpuDevice;
use crate::error::{GpuError, Result};

/// Every buffer can be bound by kernels and copied both ways (uploads, downloads, copies).
pub const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// The label of every buffer a [`MemorySource`] makes: how the device's own allocator report
/// ([`allocator_report`]) tells snug's buffers from the rest.
pub const BUFFER_LABEL: &str = "snug device buffer";

/// What the device's own allocator (wgpu's `Device::generate_allocator_report`, which Vulkan
/// and DX12 give through gpu-allocator) holds: a cross-check of [`MemorySource`]'s counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorReport {
    /// Bytes of the live allocations labelled [`BUFFER_LABEL`] (rounded up to the driver's
    /// own granularity), and how many there are.
    pub snug_bytes: u64,
    pub snug_buffers: usize,
    /// Bytes of every live allocation (staging and uniform buffers included).
    pub allocated_bytes: u64,
    /// Bytes of the memory blocks the allocations are carved from.
    pub reserved_bytes: u64,
}

/// The device's own allocator report, where its backend gives one (`None`: Metal, GL, or a
/// backend not sub-allocating).
pub fn allocator_report(device: &GpuDevice) -> Option<AllocatorReport> {
    let r = device.wgpu_device().generate_allocator_report()?;
    let ours = r.allocations.iter().filter(|a| a.name == BUFFER_LABEL);
    Some(AllocatorReport {
        snug_bytes: ours.clone().map(|a| a.size).sum(),
        snug_buffers: ours.count(),
        allocated_bytes: r.total_allocated_bytes,
        reserved_bytes: r.total_reserved_bytes,
    })
}

/// One device buffer and its size in bytes.
#[derive(Debug)]
pub struct DeviceBuffer {
    buffer: wgpu::Buffer,
    bytes: u64,
}

impl DeviceBuffer {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// The whole buffer as one slice.
    pub fn whole(&self) -> DeviceSlice<'_> {
        DeviceSlice {
            buffer: &self.buffer,
            offset: 0,
            bytes: self.bytes,
        }
    }
}

/// Allocates and releases device buffers by size, counting the bytes it has out (active) and
/// the most it ever had (peak), as the runtime's allocator expects of a memory source.
#[derive(Debug)]
pub struct MemorySource {
    device: GpuDevice,
    active: AtomicU64,
    peak: AtomicU64,
}

impl MemorySource {
    pub fn new(device: &GpuDevice) -> MemorySource {
        MemorySource {
            device: device.clone(),
            active: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    pub fn device(&self) -> &GpuDevice {
        &self.device
    }

    /// A buffer of `bytes` (rounded up to 4, as copies need). Refused past the device's
    /// largest buffer; a failed allocation is [`GpuError::OutOfMemory`] naming the device.
    pub fn allocate(&self, bytes: u64) -> Result<DeviceBuffer> {
        let max = self.device.limits().max_buffer_size;
        let rounded = bytes.max(4).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
        if rounded > max {
            return Err(GpuError::BufferTooLarge {
                device: self.device.name().to_string(),
                bytes,
                max,
            });
        }
        self.device.check()?;
        let wgpu_device = self.device.wgpu_device();
        let (buffer, error) = self.device.scoped(wgpu::ErrorFilter::OutOfMemory, || {
            wgpu_device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(BUFFER_LABEL),
                size: rounded,
                usage: USAGE,
                mapped_at_creation: false,
            })
        });
        if error.is_some() {
            buffer.destroy();
            return Err(GpuError::OutOfMemory {
                device: self.device.name().to_string(),
                bytes: rounded,
            });
        }
        let active = self.active.fetch_add(rounded, Ordering::Relaxed) + rounded;
        self.peak.fetch_max(active, Ordering::Relaxed);
        Ok(DeviceBuffer {
            buffer,
            bytes: rounded,
        })
    }

    /// Gives `buffer`'s memory back to the device now (not when the last handle drops).
    pub fn release(&self, buffer: DeviceBuffer) {
        buffer.buffer.destroy();
        self.active.fetch_sub(buffer.bytes, Ordering::Relaxed);
    }

    /// Bytes allocated and not yet released.
    pub fn active_bytes(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    /// The most bytes ever out at once.
    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

/// Where a tensor lives in an arena: chunk, byte offset inside it, byte length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    pub chunk: usize,
    pub offset: u64,
    pub bytes: u64,
}

impl Slot {
    pub fn new(chunk: usize, offset: u64, bytes: u64) -> Slot {
        Slot {
            chunk,
            offset,
            bytes,
        }
    }
}

/// A byte range of a device buffer, as a kernel binds it.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSlice<'a> {
    buffer: &'a wgpu::Buffer,
    offset: u64,
    bytes: u64,
}

impl<'a> DeviceSlice<'a> {
    /// `bytes` of `buffer` from `offset`, as the caller checked them against the device.
    pub(crate) fn of(buffer: &'a wgpu::Buffer, offset: u64, bytes: u64) -> DeviceSlice<'a> {
        DeviceSlice {
            buffer,
            offset,
            bytes,
        }
    }

    pub fn buffer(&self) -> &'a wgpu::Buffer {
        self.buffer
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn binding(&self) -> wgpu::BindingResource<'a> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: self.buffer,
            offset: self.offset,
            size: wgpu::BufferSize::new(self.bytes),
        })
    }
}

/// The arena of a plan on the device: chunks, each one buffer no larger than the device's
/// largest, and the device's binding rules to check slots against.
#[derive(Debug)]
pub struct Arena {
    device: GpuDevice,
    chunks: Vec<DeviceBuffer>,
}

impl Arena {
    /// Allocates one chunk per entry of `chunk_bytes` from `source`. On failure the chunks
    /// already allocated are released.
    pub fn allocate(source: &MemorySource, chunk_bytes: &[u64]) -> Result<Arena> {
        let mut chunks = Vec::with_capacity(chunk_bytes.len());
        for &bytes in chunk_bytes {
            match source.allocate(bytes) {
                Ok(b) => chunks.push(b),
                Err(e) => {
                    chunks.into_iter().for_each(|c| source.release(c));
                    return Err(e);
                }
            }
        }
        Ok(Arena {
            device: source.device().clone(),
            chunks,
        })
    }

    /// Gives every chunk back to `source`.
    pub fn release(self, source: &MemorySource) {
        self.chunks.into_iter().for_each(|c| source.release(c));
    }

    pub fn chunks(&self) -> &[DeviceBuffer] {
        &self.chunks
    }

    /// The device range of `slot`, after checking it against the device: inside its chunk,
    /// its offset a multiple of `min_storage_buffer_offset_alignment`, its length a multiple
    /// of 4 and at most `max_storage_buffer_binding_size`.
    pub fn slice(&self, slot: Slot) -> Result<DeviceSlice<'_>> {
        let limits = self.device.limits();
        let fail = |detail: String| GpuError::Binding {
            device: self.device.name().to_string(),
            what: format!(
                "{} bytes at offset {} of chunk {}",
                slot.bytes, slot.offset, slot.chunk
            ),
            detail,
        };
        let Some(chunk) = self.chunks.get(slot.chunk) else {
            return Err(fail(format!("the arena has {} chunks", self.chunks.len())));
        };
        let align = u64::from(limits.min_storage_buffer_offset_alignment);
        if !slot.offset.is_multiple_of(align) {
            return Err(fail(format!("the offset is not a multiple of {align}")));
        }
        if !slot.bytes.is_multiple_of(4) {
            return Err(fail("the length is not a multiple of 4".into()));
        }
        if slot.bytes > limits.max_storage_buffer_binding_size {
            return Err(fail(format!(
                "longer than the largest binding, {} bytes",
                limits.max_storage_buffer_binding_size
            )));
        }
        if slot
            .offset
            .checked_add(slot.bytes)
            .is_none_or(|end| end > chunk.bytes)
        {
            return Err(fail(format!("the chunk holds {} bytes", chunk.bytes)));
        }
        Ok(DeviceSlice {
            buffer: &chunk.buffer,
            offset: slot.offset,
            bytes: slot.bytes,
        })
    }
}
