//! The device allocator. It owns the counters (active, peak) and the memory limit as plain
//! fields, so that `active_bytes` is the whole truth of what snug holds on a device.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Device {
    Cpu,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
        }
    }
}

/// An allocation that would break the memory limit, or that the system refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of memory on {device}: requested {requested} bytes with {active} active and a limit of {limit} bytes")]
pub struct OutOfMemory {
    pub requested: usize,
    pub limit: usize,
    pub active: usize,
    pub device: Device,
}

/// Every buffer is aligned to a cache line, which covers any SIMD load.
pub const ALIGNMENT: usize = 64;

#[derive(Debug)]
struct Counters {
    active: usize,
    peak: usize,
    limit: Option<usize>,
    allocations: u64,
}

/// A handle to one device's allocator; clones share the same counters.
#[derive(Debug, Clone)]
pub struct Allocator {
    device: Device,
    counters: Arc<Mutex<Counters>>,
}

impl Default for Allocator {
    fn default() -> Self {
        Allocator::new(Device::Cpu)
    }
}

impl Allocator {
    pub fn new(device: Device) -> Self {
        Allocator {
            device,
            counters: Arc::new(Mutex::new(Counters {
                active: 0,
                peak: 0,
                limit: None,
                allocations: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Counters> {
        // A panic elsewhere cannot leave the counters half-updated: recover them.
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes held in live buffers.
    pub fn active_bytes(&self) -> usize {
        self.lock().active
    }

    /// Most bytes held at once since creation or the last [`Allocator::reset_peak`].
    pub fn peak_bytes(&self) -> usize {
        self.lock().peak
    }

    pub fn reset_peak(&self) {
        let mut c = self.lock();
        c.peak = c.active;
    }

    /// Number of buffers handed out so far (a hot loop that allocates shows up here).
    pub fn allocation_count(&self) -> u64 {
        self.lock().allocations
    }

    /// Caps `active_bytes`; `None` removes the cap. A limit below what is already active is
    /// allowed: it makes every further allocation fail until enough is freed.
    pub fn set_memory_limit(&self, limit: Option<usize>) {
        self.lock().limit = limit;
    }

    pub fn memory_limit(&self) -> Option<usize> {
        self.lock().limit
    }

    /// A zeroed buffer of `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer, OutOfMemory> {
        let mut c = self.lock();
        let oom = |c: &Counters| OutOfMemory {
            requested: bytes,
            limit: c.limit.unwrap_or(usize::MAX),
            active: c.active,
            device: self.device,
        };
        let new_active = c.active.checked_add(bytes).ok_or_else(|| oom(&c))?;
        if c.limit.is_some_and(|l| new_active > l) {
            return Err(oom(&c));
        }
        let layout = Layout::from_size_align(bytes.max(1), ALIGNMENT).map_err(|_| oom(&c))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| oom(&c))?;
        c.active = new_active;
        c.peak = c.peak.max(new_active);
        c.allocations += 1;
        Ok(Buffer {
            ptr,
            bytes,
            layout,
            owner: self.clone(),
        })
    }

    fn release(&self, bytes: usize) {
        self.lock().active -= bytes;
    }
}

/// Memory owned through an [`Allocator`]; returned to it when dropped.
pub struct Buffer {
    ptr: NonNull<u8>,
    bytes: usize,
    layout: Layout,
    owner: Allocator,
}

// SAFETY: a Buffer owns its memory exclusively, like a Box<[u8]>.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer({} bytes on {})", self.bytes, self.owner.device)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `Allocator::alloc` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        self.owner.release(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_follow_a_hand_computed_sequence() {
        let a = Allocator::default();
        let x = a.alloc(1000).unwrap();
        let y = a.alloc(24).unwrap();
        assert_eq!((a.active_bytes(), a.peak_bytes()), (1024, 1024));
        drop(x);
        assert_eq!((a.active_bytes(), a.peak_bytes()), (24, 1024));
        a.reset_peak();
        assert_eq!(a.peak_bytes(), 24);
        let z = a.alloc(100).unwrap();
        assert_eq!(a.peak_bytes(), 124);
        drop((y, z));
        assert_eq!(a.active_bytes(), 0);
        assert_eq!(a.allocation_count(), 3);
    }

    #[test]
    fn limit_gives_a_typed_error_and_leaves_counters_alone() {
        let a = Allocator::default();
        let _x = a.alloc(600).unwrap();
        a.set_memory_limit(Some(1000));
        let err = a.alloc(500).unwrap_err();
        assert_eq!(
            err,
            OutOfMemory {
                requested: 500,
                limit: 1000,
                active: 600,
                device: Device::Cpu
            }
        );
        assert_eq!((a.active_bytes(), a.peak_bytes()), (600, 600));
        assert!(a.alloc(400).is_ok());
        // An absurd request is an error, not an abort.
        a.set_memory_limit(None);
        assert!(a.alloc(usize::MAX - 10).is_err());
    }
}
