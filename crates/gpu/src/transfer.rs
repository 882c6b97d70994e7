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

/// How many staging buffers the ring holds: the host fills one while the step recorded from
/// the other may still run.
pub const RING_DEPTH: usize = 2;

/// One staging buffer of the ring and the copies recorded out of it for the next launch.
struct RingSlot {
    buffer: wgpu::Buffer,
    /// Set by the map callback: the buffer is mapped and the GPU is done reading it.
    mapped: std::sync::Arc<MapSignal>,
    /// Bytes written since it was last submitted.
    used: u64,
    /// (offset in the slot, destination buffer, destination offset, bytes).
    copies: Vec<(u64, wgpu::Buffer, u64, u64)>,
}

/// A step's inputs, staged through a ring of [`RING_DEPTH`] mapped staging buffers made once:
/// writing an input copies it into the current buffer while the GPU may still be running the
/// step before, and records its copy to the device for the next launch, which takes it into
/// its own command buffer (one submit per step, no wait per input). After that submit the
/// buffer is mapped again, ready when the GPU has read it, and the ring moves on.
///
/// The ring's buffers are host-visible staging memory, counted apart from the device's
/// arena and persistent buffers: [`StagingRing::bytes`].
#[derive(Default)]
pub struct StagingRing {
    slots: Vec<RingSlot>,
    next: usize,
    slot_bytes: u64,
    created: u64,
}

impl std::fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingRing")
            .field("slot_bytes", &self.slot_bytes)
            .field("created", &self.created)
            .finish()
    }
}

impl StagingRing {
    /// Makes the ring's buffers hold `bytes` of inputs each (the caller rounds each input up
    /// to [`wgpu::MAP_ALIGNMENT`], where mapped ranges start), where they hold less: buffers
    /// are made only when a step's inputs outgrow them.
    pub fn reserve(&mut self, device: &GpuDevice, bytes: u64) {
        let bytes = bytes.next_multiple_of(wgpu::MAP_ALIGNMENT);
        if bytes == 0 || (bytes <= self.slot_bytes && !self.slots.is_empty()) {
            return;
        }
        self.slots = (0..RING_DEPTH)
            .map(|_| RingSlot {
                buffer: device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
                    label: Some("snug staging ring"),
                    size: bytes,
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                }),
                mapped: std::sync::Arc::new(MapSignal::new(MapState::Mapped)),
                used: 0,
                copies: Vec::new(),
            })
            .collect();
        self.created += RING_DEPTH as u64;
        self.slot_bytes = bytes;
        self.next = 0;
    }

    /// Staging buffers made so far (a step reuses them: this stays at [`RING_DEPTH`] while
    /// the inputs' size does not grow).
    pub fn buffers_created(&self) -> u64 {
        self.created
    }

    /// Host-visible bytes the ring holds now.
    pub fn bytes(&self) -> u64 {
        self.slot_bytes * self.slots.len() as u64
    }

    /// Whether copies wait for the next launch.
    pub fn pending(&self) -> bool {
        self.slots
            .get(self.next)
            .is_some_and(|s| !s.copies.is_empty())
    }

    /// Writes `data` into the current staging buffer and records its copy into `dst` for the
    /// next launch. `Ok(false)` where it does not fit what is left of the buffer (the caller
    /// uploads it another way, after [`StagingRing::record`]ing what is pending).
    pub fn stage(
        &mut self,
        device: &GpuDevice,
        dst: &DeviceSlice<'_>,
        data: &[u8],
    ) -> Result<bool> {
        check_fits(device, dst, data.len())?;
        let len = data.len() as u64;
        let Some(slot) = self.slots.get_mut(self.next) else {
            return Ok(false);
        };
        if len == 0 {
            return Ok(true);
        }
        // A mapped range starts at a multiple of MAP_ALIGNMENT.
        let at = slot.used.next_multiple_of(wgpu::MAP_ALIGNMENT);
        if at + len > self.slot_bytes {
            return Ok(false);
        }
        if !slot.mapped.is_mapped() {
            // The step that last read this buffer, RING_DEPTH launches ago, is still running.
            device.wait()?;
            slot.mapped
                .wait(MAP_WAIT, || device.poll())
                .map_err(|detail| GpuError::Map {
                    device: device.name().to_string(),
                    detail: format!("a staging buffer did not map again after its step: {detail}"),
                })?;
        }
        slot.buffer
            .get_mapped_range_mut(at..at + len)
            .map_err(|e| GpuError::Map {
                device: device.name().to_string(),
                detail: e.to_string(),
            })?
            .copy_from_slice(data);
        slot.copies
            .push((at, dst.buffer().clone(), dst.offset(), len));
        slot.used = at + len;
        Ok(true)
    }

    /// Drops the copies staged for the next launch; the space they took is reused.
    pub fn discard(&mut self) {
        if let Some(slot) = self.slots.get_mut(self.next) {
            slot.copies.clear();
            slot.used = 0;
        }
    }

    /// Records the pending copies at the start of `encoder`. Returns the staging buffer to
    /// hand to [`StagingRing::submitted`] once `encoder` is submitted (`None`: nothing was
    /// pending).
    pub fn record(&mut self, encoder: &mut wgpu::CommandEncoder) -> Option<usize> {
        let slot = self.slots.get_mut(self.next)?;
        if slot.copies.is_empty() {
            return None;
        }
        slot.buffer.unmap();
        slot.mapped.set(MapState::Pending);
        for (src, dst, at, len) in slot.copies.drain(..) {
            encoder.copy_buffer_to_buffer(&slot.buffer, src, &dst, at, len);
        }
        slot.used = 0;
        let used = self.next;
        self.next = (self.next + 1) % self.slots.len();
        Some(used)
    }

    /// Maps staging buffer `slot` again after the submit that reads it: the map completes
    /// once the GPU has run that submit.
    pub fn submitted(&mut self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            let mapped = std::sync::Arc::clone(&s.mapped);
            s.buffer.map_async(wgpu::MapMode::Write, .., move |r| {
                mapped.set(match r {
                    Ok(()) => MapState::Mapped,
                    Err(e) => MapState::Failed(e.to_string()),
                });
            });
        }
    }
}

/// How long a staging buffer may take to map once the device has run every submit: its map
/// callback is then due at once, so reaching this means the callback was lost.
pub const MAP_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Where a staging buffer's map request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapState {
    Pending,
    Mapped,
    /// wgpu's reason.
    Failed(String),
}

/// A map callback's outcome, shared with the thread that runs it. wgpu runs a map callback on
/// whichever thread polls (or submits to) the device first after the GPU work is done: when a
/// device is shared between threads, that may be another one, still running it after this
/// thread's own wait has returned. So a waiter blocks on the outcome, not on its own poll.
#[derive(Debug)]
pub struct MapSignal {
    state: std::sync::Mutex<MapState>,
    changed: std::sync::Condvar,
}

impl MapSignal {
    pub fn new(state: MapState) -> MapSignal {
        MapSignal {
            state: std::sync::Mutex::new(state),
            changed: std::sync::Condvar::new(),
        }
    }

    pub fn set(&self, state: MapState) {
        // A poisoned lock still holds a state: a panicking waiter must not lose the outcome.
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = state;
        self.changed.notify_all();
    }

    pub fn is_mapped(&self) -> bool {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) == MapState::Mapped
    }

    /// Blocks until the buffer is mapped, calling `poll` (a non-blocking device poll, which
    /// runs callbacks no thread has collected yet) between short waits. Errs with wgpu's
    /// reason where the map failed, or where `limit` passes with no outcome.
    pub fn wait(
        &self,
        limit: std::time::Duration,
        mut poll: impl FnMut() -> Result<()>,
    ) -> std::result::Result<(), String> {
        let start = std::time::Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match &*state {
                MapState::Mapped => return Ok(()),
                MapState::Failed(reason) => return Err(reason.clone()),
                MapState::Pending => {}
            }
            let waited = start.elapsed();
            if waited >= limit {
                return Err(format!("no map callback within {} s", limit.as_secs_f64()));
            }
            let slice = (limit - waited).min(std::time::Duration::from_millis(10));
            state = self
                .changed
                .wait_timeout(state, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if *state == MapState::Pending {
                // The callback runs on the polling thread: never poll while holding the lock.
                drop(state);
                poll().map_err(|e| e.to_string())?;
                state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// The callback lands on another thread after the waiter's own poll found nothing: the
    /// waiter blocks for it instead of calling the buffer lost.
    #[test]
    fn a_map_completed_on_another_thread_is_waited_for() {
        let signal = Arc::new(MapSignal::new(MapState::Pending));
        let other = Arc::clone(&signal);
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            other.set(MapState::Mapped);
        });
        let mut polls = 0;
        let waited = signal.wait(Duration::from_secs(10), || {
            polls += 1;
            Ok(())
        });
        late.join().expect("the setter runs");
        assert_eq!(waited, Ok(()));
        assert!(signal.is_mapped());
        assert!(polls >= 1, "the waiter polls while it waits");
    }

    #[test]
    fn a_failed_map_reports_wgpus_reason() {
        let signal = MapSignal::new(MapState::Pending);
        signal.set(MapState::Failed("the buffer was destroyed".into()));
        assert_eq!(
            signal.wait(Duration::from_secs(10), || Ok(())),
            Err("the buffer was destroyed".into())
        );
    }

    #[test]
    fn a_map_that_never_lands_is_an_error_after_the_limit() {
        let signal = MapSignal::new(MapState::Pending);
        let err = signal
            .wait(Duration::from_millis(50), || Ok(()))
            .expect_err("no callback ever runs");
        assert!(err.contains("no map callback"), "{err}");
    }

    /// A poll that reports the device lost ends the wait with that error.
    #[test]
    fn a_lost_device_ends_the_wait() {
        let signal = MapSignal::new(MapState::Pending);
        let err = signal
            .wait(Duration::from_secs(10), || {
                Err(GpuError::DeviceLost {
                    device: "test".into(),
                    reason: "gone".into(),
                })
            })
            .expect_err("the poll fails");
        assert!(err.contains("gone"), "{err}");
    }
}
