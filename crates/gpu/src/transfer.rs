//! Host ↔ device copies. Uploads go through a staging buffer written while mapped, then a copy
//! recorded into an encoder (the caller's, so uploads join a step's commands); downloads copy
//! into a mappable buffer, submit, map and wait: the only place the backend blocks on the GPU.

use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::memory::DeviceSlice;

fn check_fits(device: &GpuDevice, dst: &DeviceSlice<'_>, bytes: usize) -> Result<()> {
    let len = bytes as u64;
    if !len.is_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT) || len > dst.bytes() {
        return Err(GpuError::Binding {
            device: device.name().to_string(),
            what: format!("a copy of {len} bytes"),
            detail: format!(
                "copies move whole 4-byte words into a range of {} bytes",
                dst.bytes()
            ),
        });
    }
    Ok(())
}

/// Records a copy of `data` into the start of `dst` on `encoder`, through a fresh staging
/// buffer that lives until the commands have run.
pub fn upload_in(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    dst: &DeviceSlice<'_>,
    data: &[u8],
) -> Result<()> {
    check_fits(device, dst, data.len())?;
    if data.is_empty() {
        return Ok(());
    }
    let staging = device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("snug staging"),
        size: data.len() as u64,
        usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    });
    staging
        .get_mapped_range_mut(..)
        .map_err(|e| GpuError::Map {
            device: device.name().to_string(),
            detail: e.to_string(),
        })?
        .copy_from_slice(data);
    staging.unmap();
    encoder.copy_buffer_to_buffer(&staging, 0, dst.buffer(), dst.offset(), data.len() as u64);
    Ok(())
}

/// Copies `data` into the start of `dst` now (recorded and submitted on its own).
pub fn upload(device: &GpuDevice, dst: &DeviceSlice<'_>, data: &[u8]) -> Result<()> {
    let mut encoder = device.encoder("snug upload");
    upload_in(device, &mut encoder, dst, data)?;
    device.submit(encoder)?;
    Ok(())
}

/// `upload` of f32 values.
pub fn upload_f32(device: &GpuDevice, dst: &DeviceSlice<'_>, data: &[f32]) -> Result<()> {
    upload(device, dst, bytemuck::cast_slice(data))
}

/// `upload` of i32 values (token ids).
pub fn upload_i32(device: &GpuDevice, dst: &DeviceSlice<'_>, data: &[i32]) -> Result<()> {
    upload(device, dst, bytemuck::cast_slice(data))
}

/// The bytes of `src`, after everything submitted before has run.
pub fn download(device: &GpuDevice, src: &DeviceSlice<'_>) -> Result<Vec<u8>> {
    let len = src.bytes();
    if len == 0 {
        return Ok(Vec::new());
    }
    let map_err = |detail: String| GpuError::Map {
        device: device.name().to_string(),
        detail,
    };
    let readback = device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("snug readback"),
        size: len,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut encoder = device.encoder("snug download");
    encoder.copy_buffer_to_buffer(src.buffer(), src.offset(), &readback, 0, len);
    device.submit(encoder)?;
    let (tx, rx) = std::sync::mpsc::channel();
    readback.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    device.wait()?;
    match rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(map_err(e.to_string())),
        Err(_) => return Err(map_err("the map callback never ran".into())),
    }
    let bytes = readback
        .get_mapped_range(..)
        .map_err(|e| map_err(e.to_string()))?
        .to_vec();
    readback.unmap();
    Ok(bytes)
}

/// `download` as f32 values.
pub fn download_f32(device: &GpuDevice, src: &DeviceSlice<'_>) -> Result<Vec<f32>> {
    Ok(bytemuck::pod_collect_to_vec(&download(device, src)?))
}
