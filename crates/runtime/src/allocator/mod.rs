//! The device allocator: a cache of freed buffers plus the limits and counters as plain fields,
//! in the spirit of MLX's allocator. Every byte snug holds on a device goes through it, so
//! `active_bytes` is the whole truth.
//!
//! Policies, each a few lines in [`Allocator::alloc`] and [`Buffer`]'s `Drop`:
//! - **Reuse.** A request is served from the cache when a freed block of at least its size and
//!   at most twice its size exists (the most recently freed one, still warm in cache).
//! - **Memory limit** (on active + cached bytes). Cached blocks are released, oldest first,
//!   before a fresh allocation would cross it. If the request still does not fit beside what is
//!   active, a *strict* limit fails with [`OutOfMemory`] and changes nothing; a *relaxed* one
//!   releases the whole cache, allocates anyway and counts the overrun.
//! - **Cache limit.** Freed blocks go to the cache, which is trimmed oldest-first to its limit
//!   (a limit of 0 disables caching).
//! - **Wired limit** (CPU: `mlock`). New buffers are locked in RAM while the wired total stays
//!   under the limit; a buffer is unlocked when it is freed.
//!
//! The policies are the same on every device; where the bytes come from is the device's
//! [`MemorySource`] ([`HostMemory`] for the CPU; a GPU backend brings its own).

mod buffer_cache;
mod host;

use snug_plan::memory_plan::human_bytes;
use std::fmt;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use buffer_cache::BufferCache;
pub use host::HostMemory;

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Device {
    Cpu,
    /// The adapter `gpu:N` (in the order the GPU backend lists them).
    Gpu(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(i) => write!(f, "gpu:{i}"),
        }
    }
}

/// An allocation that a strict memory limit, or the system, refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of memory on {device}: requested {} with {} active and {} cached, {}",
    human_bytes(*requested),
    human_bytes(*active),
    human_bytes(*cached),
    if *limit == usize::MAX {
        format!("refused by the {}", if *device == Device::Cpu { "system" } else { "device" })
    } else {
        format!("limit {}", human_bytes(*limit))
    }
)]
pub struct OutOfMemory {
    pub requested: usize,
    /// The limit that refused it; `usize::MAX` where the system (the device, for a GPU
    /// source) refused a request under the limit, or with none set.
    pub limit: usize,
    pub active: usize,
    pub cached: usize,
    pub device: Device,
}

/// The operating system would not lock memory in RAM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WiredLimitError {
    #[error("wired limit of {requested} bytes exceeds the system's locked-memory limit of {os_limit} bytes (RLIMIT_MEMLOCK)")]
    ExceedsOsLimit { requested: usize, os_limit: usize },
}

/// A memory leak found by [`Allocator::check_leaks`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{leaked} bytes still active after the checked code returned ({initial} before, {final_} after)")]
pub struct Leak {
    pub leaked: usize,
    pub initial: usize,
    pub final_: usize,
}

/// What a measured piece of code did to active memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemoryReport {
    pub initial: usize,
    pub peak: usize,
    pub final_: usize,
}

impl MemoryReport {
    /// Bytes still active that were not before (0 if the code freed more than it kept).
    pub fn leaked(&self) -> usize {
        self.final_.saturating_sub(self.initial)
    }
}

/// Every buffer is aligned to a cache line, which covers any SIMD load.
pub const ALIGNMENT: usize = 64;

/// A block of device memory as its source hands it out: an opaque handle (on the host, the
/// address of its first byte) and the bytes it holds.
#[derive(Debug)]
pub struct Block {
    pub handle: NonZeroUsize,
    pub capacity: usize,
}

/// Where one device's bytes come from. The allocator above it does the counting, caching and
/// limits; a source only allocates and releases (and, where the device can, wires).
pub trait MemorySource: Send + Sync + fmt::Debug {
    fn device(&self) -> Device;

    /// Whether a block's handle is a host address the CPU may read and write.
    fn is_host(&self) -> bool {
        false
    }

    /// A zeroed block of exactly `capacity` bytes (a multiple of [`ALIGNMENT`]), or `None` if
    /// the device refused.
    fn allocate(&self, capacity: usize) -> Option<Block>;

    /// Gives a block back to the device.
    fn release(&self, block: Block);

    /// Zeroes the first `bytes` bytes of a block being reused.
    fn zero(&self, block: &Block, bytes: usize);

    /// The most bytes the device lets this process wire (`None`: no limit).
    fn wire_limit(&self) -> Option<usize> {
        Some(0)
    }

    /// Keeps a block resident (never paged out); false if the device would not.
    fn wire(&self, _block: &Block) -> bool {
        false
    }

    fn unwire(&self, _block: &Block) {}
}

/// A device no backend has opened: it has no memory to give.
#[derive(Debug)]
struct Unopened(Device);

impl MemorySource for Unopened {
    fn device(&self) -> Device {
        self.0
    }

    fn allocate(&self, _capacity: usize) -> Option<Block> {
        None
    }

    fn release(&self, _block: Block) {}

    fn zero(&self, _block: &Block, _bytes: usize) {}
}

#[derive(Debug)]
struct State {
    source: Arc<dyn MemorySource>,
    active: usize,
    peak: usize,
    memory_limit: usize,
    relaxed: bool,
    cache: BufferCache,
    cache_limit: usize,
    wired_limit: usize,
    wired: usize,
    /// Fresh system allocations (cache misses).
    allocations: u64,
    cache_hits: u64,
    limit_overruns: u64,
}

/// A handle to one device's allocator; clones share the same state.
#[derive(Debug, Clone)]
pub struct Allocator {
    device: Device,
    host: bool,
    state: Arc<Mutex<State>>,
}

impl Default for Allocator {
    fn default() -> Self {
        Allocator::new(Device::Cpu)
    }
}

/// Counters at one moment, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    pub active_bytes: usize,
    pub peak_bytes: usize,
    pub cache_bytes: usize,
    pub wired_bytes: usize,
    pub allocations: u64,
    pub cache_hits: u64,
    pub limit_overruns: u64,
}

impl Allocator {
    /// A new allocator with its own counters: no limits, unbounded cache. A GPU's memory
    /// comes from an opened device, which its backend's allocator holds
    /// ([`Allocator::with_source`]): for [`Device::Gpu`] this one refuses every allocation
    /// (a typed out-of-memory naming the device).
    pub fn new(device: Device) -> Self {
        match device {
            Device::Cpu => Allocator::with_source(Arc::new(HostMemory)),
            Device::Gpu(_) => Allocator::with_source(Arc::new(Unopened(device))),
        }
    }

    /// A new allocator over `source`, with its own counters: no limits, unbounded cache.
    pub fn with_source(source: Arc<dyn MemorySource>) -> Self {
        Allocator {
            device: source.device(),
            host: source.is_host(),
            state: Arc::new(Mutex::new(State {
                source,
                active: 0,
                peak: 0,
                memory_limit: usize::MAX,
                relaxed: true,
                cache: BufferCache::default(),
                cache_limit: usize::MAX,
                wired_limit: 0,
                wired: 0,
                allocations: 0,
                cache_hits: 0,
                limit_overruns: 0,
            })),
        }
    }

    /// The process-wide allocator of the CPU, shared by everything that does not ask for its own.
    pub fn cpu() -> Allocator {
        static CPU: OnceLock<Allocator> = OnceLock::new();
        CPU.get_or_init(|| Allocator::new(Device::Cpu)).clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is updated under the lock with no code that can panic midway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether this allocator's buffers are host memory ([`Buffer::as_ptr`] is an address).
    pub fn is_host(&self) -> bool {
        self.host
    }

    /// Bytes held in live buffers (their full capacity, including a reused block's slack).
    pub fn active_bytes(&self) -> usize {
        self.lock().active
    }

    /// Most bytes active at once since creation or the last [`Allocator::reset_peak`].
    pub fn peak_bytes(&self) -> usize {
        self.lock().peak
    }

    pub fn reset_peak(&self) {
        let mut s = self.lock();
        s.peak = s.active;
    }

    /// Bytes held in freed buffers kept for reuse.
    pub fn cache_bytes(&self) -> usize {
        self.lock().cache.bytes()
    }

    /// Returns every cached block to the system.
    pub fn clear_cache(&self) {
        let mut s = self.lock();
        while let Some(b) = s.cache.pop_oldest() {
            s.source.release(b);
        }
    }

    pub fn stats(&self) -> MemoryStats {
        let s = self.lock();
        MemoryStats {
            active_bytes: s.active,
            peak_bytes: s.peak,
            cache_bytes: s.cache.bytes(),
            wired_bytes: s.wired,
            allocations: s.allocations,
            cache_hits: s.cache_hits,
            limit_overruns: s.limit_overruns,
        }
    }

    /// Fresh system allocations so far (a hot loop that allocates shows up here).
    pub fn allocation_count(&self) -> u64 {
        self.lock().allocations
    }

    /// Caps active + cached bytes and returns the previous cap. `usize::MAX` removes the cap;
    /// 0 makes every strict allocation fail. A cap below what is already active is allowed:
    /// it applies to the next allocation. See the module docs for strict vs relaxed.
    pub fn set_memory_limit(&self, bytes: usize, relaxed: bool) -> usize {
        let mut s = self.lock();
        s.relaxed = relaxed;
        std::mem::replace(&mut s.memory_limit, bytes)
    }

    /// (limit, relaxed)
    pub fn memory_limit(&self) -> (usize, bool) {
        let s = self.lock();
        (s.memory_limit, s.relaxed)
    }

    /// Caps the cache and trims it (oldest first) to fit; returns the previous cap.
    pub fn set_cache_limit(&self, bytes: usize) -> usize {
        let mut s = self.lock();
        let prev = std::mem::replace(&mut s.cache_limit, bytes);
        trim_cache(&mut s);
        prev
    }

    /// Locks up to `bytes` of newly allocated buffers in RAM (`mlock`), so the OS never pages
    /// them out; returns the previous limit. Fails if the OS's locked-memory limit is lower and
    /// the process may not exceed it.
    pub fn set_wired_limit(&self, bytes: usize) -> Result<usize, WiredLimitError> {
        if let Some(os_limit) = self.lock().source.wire_limit() {
            if bytes > os_limit {
                return Err(WiredLimitError::ExceedsOsLimit {
                    requested: bytes,
                    os_limit,
                });
            }
        }
        Ok(std::mem::replace(&mut self.lock().wired_limit, bytes))
    }

    pub fn wired_bytes(&self) -> usize {
        self.lock().wired
    }

    /// A zeroed buffer of `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer, OutOfMemory> {
        self.alloc_inner(bytes, true)
    }

    /// A buffer of `bytes` bytes whose contents are unspecified when it comes from the cache
    /// (fresh memory is zeroed by the system anyway): for storage that is always written before
    /// it is read, such as a step's arena re-acquired every step.
    pub fn alloc_uninit(&self, bytes: usize) -> Result<Buffer, OutOfMemory> {
        self.alloc_inner(bytes, false)
    }

    fn alloc_inner(&self, bytes: usize, zeroed: bool) -> Result<Buffer, OutOfMemory> {
        let mut s = self.lock();
        let capacity = bytes
            .max(1)
            .checked_next_multiple_of(ALIGNMENT)
            .ok_or_else(|| self.oom(&s, bytes))?;
        let over = |s: &State| s.active.saturating_add(capacity) > s.memory_limit;
        if over(&s) && !s.relaxed {
            // Releasing the cache cannot make room beside what is active: fail, change nothing.
            return Err(self.oom(&s, bytes));
        }
        if let Some(block) = s.cache.take(capacity) {
            // A reused block counts with its whole capacity: under a strict limit, one too
            // large to fit goes back to the system and a fresh exact-size block is tried.
            if !s.relaxed && s.active.saturating_add(block.capacity) > s.memory_limit {
                s.source.release(block);
            } else {
                s.cache_hits += 1;
                if over(&s) {
                    s.limit_overruns += 1;
                }
                if zeroed {
                    s.source.zero(&block, bytes);
                }
                return Ok(self.hand_out(&mut s, block, bytes));
            }
        }
        // Keep the footprint (active + cached) under the limit: release the oldest blocks first.
        while s
            .active
            .saturating_add(s.cache.bytes())
            .saturating_add(capacity)
            > s.memory_limit
        {
            match s.cache.pop_oldest() {
                Some(b) => s.source.release(b),
                None => break,
            }
        }
        if over(&s) {
            s.limit_overruns += 1;
        }
        let block = match s.source.allocate(capacity) {
            Some(b) => b,
            None => {
                // The device refused: give back what the cache holds and try once more.
                while let Some(b) = s.cache.pop_oldest() {
                    s.source.release(b);
                }
                s.source.allocate(capacity).ok_or_else(|| {
                    let oom = self.oom(&s, bytes);
                    // Under the limit, the system's refusal, not the limit's. Over a relaxed
                    // one, the limit stays named: recovery must get under it too.
                    if over(&s) {
                        oom
                    } else {
                        OutOfMemory {
                            limit: usize::MAX,
                            ..oom
                        }
                    }
                })?
            }
        };
        s.allocations += 1;
        Ok(self.hand_out(&mut s, block, bytes))
    }

    fn hand_out(&self, s: &mut State, block: Block, bytes: usize) -> Buffer {
        let capacity = block.capacity;
        s.active += capacity;
        s.peak = s.peak.max(s.active);
        let wired = s.wired + capacity <= s.wired_limit && s.source.wire(&block);
        if wired {
            s.wired += capacity;
        }
        Buffer {
            handle: block.handle,
            bytes,
            capacity,
            wired,
            owner: self.clone(),
        }
    }

    fn oom(&self, s: &State, requested: usize) -> OutOfMemory {
        OutOfMemory {
            requested,
            limit: s.memory_limit,
            active: s.active,
            cached: s.cache.bytes(),
            device: self.device,
        }
    }

    fn give_back(&self, handle: NonZeroUsize, capacity: usize, wired: bool) {
        let mut s = self.lock();
        let block = Block { handle, capacity };
        s.active -= capacity;
        if wired {
            s.source.unwire(&block);
            s.wired -= capacity;
        }
        s.cache.insert(block);
        trim_cache(&mut s);
    }

    /// Resets the peak, runs `f`, and reports active bytes before, at the peak, and after.
    pub fn measure<R>(&self, f: impl FnOnce() -> R) -> (R, MemoryReport) {
        self.reset_peak();
        let initial = self.active_bytes();
        let r = f();
        let report = MemoryReport {
            initial,
            peak: self.peak_bytes(),
            final_: self.active_bytes(),
        };
        (r, report)
    }

    /// Runs `f` and fails if it left more bytes active than it found.
    pub fn check_leaks<R>(&self, f: impl FnOnce() -> R) -> Result<R, Leak> {
        let (r, report) = self.measure(f);
        match report.leaked() {
            0 => Ok(r),
            leaked => Err(Leak {
                leaked,
                initial: report.initial,
                final_: report.final_,
            }),
        }
    }
}

impl Drop for State {
    /// The last handle is gone (every buffer holds one, so none is live): the cached blocks go
    /// back to the system.
    fn drop(&mut self) {
        while let Some(b) = self.cache.pop_oldest() {
            self.source.release(b);
        }
    }
}

fn trim_cache(s: &mut State) {
    while s.cache.bytes() > s.cache_limit {
        match s.cache.pop_oldest() {
            Some(b) => s.source.release(b),
            None => break,
        }
    }
}

/// Memory owned through an [`Allocator`]; returned to it (its cache) when dropped.
pub struct Buffer {
    handle: NonZeroUsize,
    bytes: usize,
    capacity: usize,
    wired: bool,
    owner: Allocator,
}

impl Buffer {
    /// Bytes requested.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes held (the request rounded up, or a larger reused block).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The handle its memory source gave the block (on the host, its address).
    pub fn handle(&self) -> usize {
        self.handle.get()
    }

    /// The address of the first byte. Host memory only: a device buffer's handle is not an
    /// address (its backend resolves it), so asking for one is a bug in the caller.
    pub fn as_ptr(&self) -> *mut u8 {
        assert!(self.owner.is_host(), "{self:?} is not host memory");
        self.handle.get() as *mut u8
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buffer({} of {} bytes on {})",
            self.bytes, self.capacity, self.owner.device
        )
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.owner.give_back(self.handle, self.capacity, self.wired);
    }
}

#[cfg(test)]
mod tests;
