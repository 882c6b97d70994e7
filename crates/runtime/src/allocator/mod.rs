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

mod buffer_cache;

use snug_plan::memory_plan::human_bytes;
use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use buffer_cache::{BufferCache, CachedBlock};

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

/// An allocation that a strict memory limit, or the system, refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of memory on {device}: requested {} with {} active and {} cached, {}",
    human_bytes(*requested),
    human_bytes(*active),
    human_bytes(*cached),
    if *limit == usize::MAX {
        "no limit set: the system refused".to_string()
    } else {
        format!("limit {}", human_bytes(*limit))
    }
)]
pub struct OutOfMemory {
    pub requested: usize,
    /// `usize::MAX` when no limit was set (the system refused).
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

#[derive(Debug)]
struct State {
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
    /// A new allocator with its own counters: no limits, unbounded cache.
    pub fn new(device: Device) -> Self {
        Allocator {
            device,
            state: Arc::new(Mutex::new(State {
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
            release(b);
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
        if let Some(os_limit) = os_mlock_limit() {
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
                release(block);
            } else {
                s.cache_hits += 1;
                if over(&s) {
                    s.limit_overruns += 1;
                }
                if zeroed {
                    // SAFETY: the block holds `block.capacity ≥ bytes` bytes.
                    unsafe { std::ptr::write_bytes(block.ptr.as_ptr(), 0, bytes) };
                }
                return Ok(self.hand_out(&mut s, block.ptr, bytes, block.capacity));
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
                Some(b) => release(b),
                None => break,
            }
        }
        if over(&s) {
            s.limit_overruns += 1;
        }
        let ptr = match system_alloc(capacity) {
            Some(p) => p,
            None => {
                // The system refused: give back what the cache holds and try once more.
                while let Some(b) = s.cache.pop_oldest() {
                    release(b);
                }
                system_alloc(capacity).ok_or_else(|| self.oom(&s, bytes))?
            }
        };
        s.allocations += 1;
        Ok(self.hand_out(&mut s, ptr, bytes, capacity))
    }

    fn hand_out(&self, s: &mut State, ptr: NonNull<u8>, bytes: usize, capacity: usize) -> Buffer {
        s.active += capacity;
        s.peak = s.peak.max(s.active);
        let wired = s.wired + capacity <= s.wired_limit && mlock(ptr, capacity);
        if wired {
            s.wired += capacity;
        }
        Buffer {
            ptr,
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

    fn give_back(&self, ptr: NonNull<u8>, capacity: usize, wired: bool) {
        let mut s = self.lock();
        s.active -= capacity;
        if wired {
            munlock(ptr, capacity);
            s.wired -= capacity;
        }
        s.cache.insert(CachedBlock { ptr, capacity });
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
            release(b);
        }
    }
}

fn trim_cache(s: &mut State) {
    while s.cache.bytes() > s.cache_limit {
        match s.cache.pop_oldest() {
            Some(b) => release(b),
            None => break,
        }
    }
}

fn layout(capacity: usize) -> Option<Layout> {
    Layout::from_size_align(capacity, ALIGNMENT).ok()
}

fn system_alloc(capacity: usize) -> Option<NonNull<u8>> {
    #[cfg(target_os = "linux")]
    if capacity >= HUGE_PAGE_MIN {
        return huge_alloc(capacity);
    }
    let layout = layout(capacity)?;
    // SAFETY: capacity ≥ ALIGNMENT > 0.
    NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
}

fn release(block: CachedBlock) {
    #[cfg(target_os = "linux")]
    if block.capacity >= HUGE_PAGE_MIN {
        // SAFETY: blocks this large were mapped by `huge_alloc` with this length.
        unsafe { libc::munmap(block.ptr.as_ptr() as *mut libc::c_void, block.capacity) };
        return;
    }
    if let Some(layout) = layout(block.capacity) {
        // SAFETY: every other block was allocated by `system_alloc` with this capacity.
        unsafe { std::alloc::dealloc(block.ptr.as_ptr(), layout) };
    }
}

/// Blocks at least this large are mapped directly and backed by transparent huge pages where
/// the kernel allows: the step's large activations are read in strided panels by the GEMM's
/// packing, and 4 KiB pages put nearly every row of a panel on its own TLB entry.
#[cfg(target_os = "linux")]
const HUGE_PAGE_MIN: usize = 4 << 20;

/// A fresh anonymous mapping (zeroed by the kernel, page-aligned), advised as huge-page memory
/// before any page is touched, so the first touch of each 2 MiB faults in one huge page.
#[cfg(target_os = "linux")]
fn huge_alloc(capacity: usize) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping with no address hint; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            capacity,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the range is the mapping just made; the advice only changes how its pages are
    // backed, and a refusal (huge pages off) leaves ordinary pages.
    unsafe { libc::madvise(ptr, capacity, libc::MADV_HUGEPAGE) };
    NonNull::new(ptr as *mut u8)
}

#[cfg(unix)]
fn mlock(ptr: NonNull<u8>, len: usize) -> bool {
    // SAFETY: the range is one live allocation.
    unsafe { libc::mlock(ptr.as_ptr() as *const libc::c_void, len) == 0 }
}

#[cfg(unix)]
fn munlock(ptr: NonNull<u8>, len: usize) {
    // SAFETY: as in `mlock`; failure only means the pages were not locked.
    unsafe { libc::munlock(ptr.as_ptr() as *const libc::c_void, len) };
}

/// The locked-memory limit that binds this process, or `None` if it may lock any amount
/// (unlimited rlimit, or root, which holds CAP_IPC_LOCK).
#[cfg(unix)]
fn os_mlock_limit() -> Option<usize> {
    // SAFETY: plain libc queries with a valid out-pointer.
    unsafe {
        if libc::geteuid() == 0 {
            return None;
        }
        let mut r = std::mem::zeroed::<libc::rlimit>();
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) != 0 || r.rlim_cur == libc::RLIM_INFINITY {
            return None;
        }
        Some(usize::try_from(r.rlim_cur).unwrap_or(usize::MAX))
    }
}

#[cfg(not(unix))]
fn mlock(_: NonNull<u8>, _: usize) -> bool {
    false
}
#[cfg(not(unix))]
fn munlock(_: NonNull<u8>, _: usize) {}
#[cfg(not(unix))]
fn os_mlock_limit() -> Option<usize> {
    Some(0)
}

/// Memory owned through an [`Allocator`]; returned to it (its cache) when dropped.
pub struct Buffer {
    ptr: NonNull<u8>,
    bytes: usize,
    capacity: usize,
    wired: bool,
    owner: Allocator,
}

// SAFETY: a Buffer owns its memory exclusively, like a Box<[u8]>.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Bytes requested.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes held (the request rounded up, or a larger reused block).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
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
        self.owner.give_back(self.ptr, self.capacity, self.wired);
    }
}

#[cfg(test)]
mod tests;
