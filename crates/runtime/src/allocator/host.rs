//! Host memory: the CPU's memory source. Large blocks are mapped directly and advised as huge
//! pages; wiring is `mlock`.

use std::alloc::Layout;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

use super::{Block, Device, MemorySource, ALIGNMENT};

/// The process's heap (and anonymous mappings for large blocks).
#[derive(Debug, Default)]
pub struct HostMemory;

impl MemorySource for HostMemory {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn is_host(&self) -> bool {
        true
    }

    fn allocate(&self, capacity: usize) -> Option<Block> {
        let ptr = system_alloc(capacity)?;
        Some(Block {
            handle: NonZeroUsize::new(ptr.as_ptr() as usize)?,
            capacity,
        })
    }

    fn release(&self, block: Block) {
        let ptr = block.handle.get() as *mut u8;
        #[cfg(target_os = "linux")]
        if block.capacity >= HUGE_PAGE_MIN {
            // SAFETY: blocks this large were mapped by `huge_alloc` with this length.
            unsafe { libc::munmap(ptr as *mut libc::c_void, block.capacity) };
            return;
        }
        if let Some(layout) = layout(block.capacity) {
            // SAFETY: every other block was allocated by `system_alloc` with this capacity.
            unsafe { std::alloc::dealloc(ptr, layout) };
        }
    }

    fn zero(&self, block: &Block, bytes: usize) {
        // SAFETY: the block holds `capacity ≥ bytes` bytes and belongs to no live buffer.
        unsafe { std::ptr::write_bytes(block.handle.get() as *mut u8, 0, bytes) };
    }

    fn wire_limit(&self) -> Option<usize> {
        os_mlock_limit()
    }

    fn wire(&self, block: &Block) -> bool {
        mlock(block.handle.get() as *mut u8, block.capacity)
    }

    fn unwire(&self, block: &Block) {
        munlock(block.handle.get() as *mut u8, block.capacity)
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

/// Blocks at least this large are mapped directly and backed by transparent huge pages where
/// the kernel allows: the step's large activations are read in strided panels by the GEMM's
/// packing, and 4 KiB pages put nearly every row of a panel on its own TLB entry.
#[cfg(target_os = "linux")]
pub(super) const HUGE_PAGE_MIN: usize = 4 << 20;

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
fn mlock(ptr: *mut u8, len: usize) -> bool {
    // SAFETY: the range is one live allocation.
    unsafe { libc::mlock(ptr as *const libc::c_void, len) == 0 }
}

#[cfg(unix)]
fn munlock(ptr: *mut u8, len: usize) {
    // SAFETY: as in `mlock`; failure only means the pages were not locked.
    unsafe { libc::munlock(ptr as *const libc::c_void, len) };
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
fn mlock(_: *mut u8, _: usize) -> bool {
    false
}
#[cfg(not(unix))]
fn munlock(_: *mut u8, _: usize) {}
#[cfg(not(unix))]
fn os_mlock_limit() -> Option<usize> {
    Some(0)
}
