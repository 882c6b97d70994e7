use super::*;

const K: usize = ALIGNMENT; // capacities are multiples of the alignment

#[test]
fn counters_follow_a_hand_computed_sequence() {
    let a = Allocator::default();
    let x = a.alloc(1000).unwrap(); // capacity 1024
    let y = a.alloc(24).unwrap(); // capacity 64
    assert_eq!(
        (a.active_bytes(), a.peak_bytes(), a.cache_bytes()),
        (1088, 1088, 0)
    );
    drop(x);
    assert_eq!(
        (a.active_bytes(), a.peak_bytes(), a.cache_bytes()),
        (64, 1088, 1024)
    );
    a.reset_peak();
    assert_eq!(a.peak_bytes(), 64);
    let z = a.alloc(100).unwrap(); // capacity 128: the cached 1024 is more than twice that
    assert_eq!((a.active_bytes(), a.peak_bytes()), (192, 192));
    drop((y, z));
    assert_eq!((a.active_bytes(), a.cache_bytes()), (0, 1216));
    let s = a.stats();
    assert_eq!((s.allocations, s.cache_hits), (3, 0));
}

#[test]
fn same_size_is_served_from_cache_zeroed() {
    let a = Allocator::default();
    let x = a.alloc(4096).unwrap();
    let ptr = x.as_ptr();
    // SAFETY: the buffer holds 4096 bytes.
    unsafe { std::ptr::write_bytes(ptr, 0xAB, 4096) };
    drop(x);
    assert_eq!(a.cache_bytes(), 4096);
    let y = a.alloc(3000).unwrap();
    assert_eq!(y.as_ptr(), ptr, "the cached block is reused");
    assert_eq!(y.capacity(), 4096);
    // SAFETY: the buffer holds 3000 requested bytes.
    let bytes = unsafe { std::slice::from_raw_parts(y.as_ptr(), 3000) };
    assert!(bytes.iter().all(|&b| b == 0), "reused memory is zeroed");
    let s = a.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.active_bytes, s.cache_bytes),
        (1, 1, 4096, 0)
    );
}

#[test]
fn cache_limit_evicts_least_recently_freed_first() {
    let a = Allocator::default();
    let bufs: Vec<Buffer> = [1, 2, 3, 4]
        .iter()
        .map(|&n| a.alloc(n * K).unwrap())
        .collect();
    drop(bufs); // freed in order 1K, 2K, 3K, 4K
    assert_eq!(a.cache_bytes(), 10 * K);
    a.set_cache_limit(8 * K); // evicts 1K (oldest): 9K left, still over; then 2K: 7K
    assert_eq!(a.cache_bytes(), 7 * K);
    let hits = |a: &Allocator| a.stats().cache_hits;
    let before = hits(&a);
    drop(a.alloc(3 * K).unwrap());
    assert_eq!(hits(&a), before + 1, "3K survived");
    let misses = a.allocation_count();
    let one = a.alloc(K).unwrap(); // 1K was evicted, and 3K/4K are more than twice its size
    assert_eq!(a.allocation_count(), misses + 1);
    drop(one);
    // The 3K block was just freed again, so it is now newer than 4K: a tight limit keeps it.
    a.set_cache_limit(4 * K);
    assert_eq!(a.cache_bytes(), 4 * K, "kept the newest blocks: 1K and 3K");
    a.set_cache_limit(0);
    assert_eq!(a.cache_bytes(), 0);
    drop(a.alloc(K).unwrap());
    assert_eq!(a.cache_bytes(), 0, "a zero cache limit disables caching");
}

#[test]
fn strict_limit_is_a_typed_error_that_changes_nothing() {
    let a = Allocator::default();
    let _x = a.alloc(6 * K).unwrap();
    drop(a.alloc(2 * K).unwrap()); // 2K cached
    a.set_memory_limit(10 * K, false);
    let before = a.stats();
    let err = a.alloc(5 * K).unwrap_err();
    assert_eq!(
        err,
        OutOfMemory {
            requested: 5 * K,
            limit: 10 * K,
            active: 6 * K,
            cached: 2 * K,
            device: Device::Cpu
        }
    );
    assert_eq!(a.stats(), before, "counters and cache unchanged");
    assert!(
        a.alloc(4 * K).is_ok(),
        "a request that fits beside the active bytes succeeds"
    );
}

#[test]
fn limits_release_the_cache_first() {
    let a = Allocator::default();
    let _x = a.alloc(4 * K).unwrap();
    drop(a.alloc(K).unwrap());
    drop(a.alloc(3 * K).unwrap());
    assert_eq!(a.cache_bytes(), 4 * K); // 1K (older) and 3K
                                        // Strict: 4K active + 4K cached + 1.5K... the new 5K fits beside the active bytes only if
                                        // cached blocks go: the oldest (1K) is not enough, the 3K goes too.
    a.set_memory_limit(9 * K, false);
    let y = a.alloc(5 * K).unwrap();
    assert_eq!((a.active_bytes(), a.cache_bytes()), (9 * K, 0));
    assert_eq!(a.stats().limit_overruns, 0);
    drop(y);
    // Relaxed and over the limit even without a cache: allowed, counted, cache emptied.
    a.set_memory_limit(6 * K, true);
    let z = a.alloc(5 * K).unwrap();
    let s = a.stats();
    assert_eq!(
        (s.active_bytes, s.cache_bytes, s.limit_overruns),
        (9 * K, 0, 1)
    );
    drop(z);
}

#[test]
fn zero_absurd_and_below_active_limits_are_defined() {
    let a = Allocator::default();
    let held = a.alloc(2 * K).unwrap();
    a.set_memory_limit(K, false); // below what is active: the next allocation fails
    assert!(a.alloc(1).is_err());
    assert_eq!(a.active_bytes(), 2 * K);
    a.set_memory_limit(0, false);
    assert!(a.alloc(1).is_err());
    a.set_memory_limit(0, true);
    assert!(a.alloc(1).is_ok(), "relaxed: allowed and counted");
    a.set_memory_limit(usize::MAX, false);
    assert!(
        a.alloc(usize::MAX).is_err(),
        "an impossible size is an error, not an abort"
    );
    assert!(a.alloc(usize::MAX / 2).is_err());
    drop(held);
}

#[test]
fn clear_cache_returns_memory() {
    let a = Allocator::default();
    drop(a.alloc(16 * K).unwrap());
    assert_eq!(a.cache_bytes(), 16 * K);
    a.clear_cache();
    assert_eq!((a.cache_bytes(), a.active_bytes()), (0, 0));
    let before = a.allocation_count();
    drop(a.alloc(16 * K).unwrap());
    assert_eq!(a.allocation_count(), before + 1, "nothing left to reuse");
}

#[test]
fn wired_buffers_are_counted_and_unlocked_on_free() {
    let a = Allocator::default();
    if a.set_wired_limit(64 * K).is_err() {
        // The OS caps locked memory below 4 KiB for this user: the typed error is the behaviour.
        return;
    }
    let x = a.alloc(16 * K).unwrap();
    let locked = a.wired_bytes();
    assert!(
        locked == 16 * K || locked == 0,
        "mlock either succeeded or was refused quietly"
    );
    let y = a.alloc(64 * K).unwrap(); // would exceed the wired limit: not locked
    assert_eq!(a.wired_bytes(), locked);
    drop((x, y));
    assert_eq!(a.wired_bytes(), 0);
}

#[test]
fn measure_and_leak_check() {
    let a = Allocator::default();
    let (_, report) = a.measure(|| drop(a.alloc(8 * K).unwrap()));
    assert_eq!(
        report,
        MemoryReport {
            initial: 0,
            peak: 8 * K,
            final_: 0
        }
    );
    assert!(a.check_leaks(|| drop(a.alloc(K).unwrap())).is_ok());
    let leak = a.check_leaks(|| a.alloc(2 * K).unwrap()).unwrap_err();
    assert_eq!(
        leak,
        Leak {
            leaked: 2 * K,
            initial: 0,
            final_: 2 * K
        }
    );
}

/// The `VmFlags` line of the mapping of `/proc/self/smaps` that holds `addr`.
#[cfg(target_os = "linux")]
fn vm_flags_at(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'));
        if let Some((lo, hi)) = range {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.to_string());
            }
        }
    }
    None
}

#[cfg(target_os = "linux")]
#[test]
fn large_blocks_are_huge_page_mappings_that_come_back_zeroed() {
    let a = Allocator::default();
    let bytes = host::HUGE_PAGE_MIN + 3 * K;
    let x = a.alloc(bytes).unwrap();
    let ptr = x.as_ptr();
    assert_eq!(ptr as usize % 4096, 0, "a mapping starts on a page");
    // SAFETY: the buffer holds `bytes` bytes.
    let fresh = unsafe { std::slice::from_raw_parts_mut(ptr, bytes) };
    assert!(fresh.iter().all(|&b| b == 0), "fresh memory is zeroed");
    fresh.fill(0xCD);
    if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
        let flags = vm_flags_at(ptr as usize).expect("the block is a mapping of its own");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "advised for huge pages: {flags}"
        );
    }
    drop(x);
    let y = a.alloc(bytes).unwrap();
    assert_eq!(y.as_ptr(), ptr, "the cached mapping is reused");
    // SAFETY: as above.
    let reused = unsafe { std::slice::from_raw_parts(y.as_ptr(), bytes) };
    assert!(reused.iter().all(|&b| b == 0), "reused memory is zeroed");
}

/// The message says what the figures are in human units, and never prints `usize::MAX` as a
/// limit where the system refused.
#[test]
fn out_of_memory_reads_in_human_units() {
    let oom = |limit| OutOfMemory {
        requested: 3 << 20,
        limit,
        active: 1 << 30,
        cached: 0,
        device: Device::Cpu,
    };
    assert_eq!(
        oom(2 << 30).to_string(),
        "out of memory on cpu: requested 3.00 MiB with 1.00 GiB active and 0 B cached, limit 2.00 GiB"
    );
    let none = oom(usize::MAX).to_string();
    assert!(
        none.ends_with("0 B cached, refused by the system"),
        "{none}"
    );
    assert!(!none.contains(&usize::MAX.to_string()), "{none}");
}

/// A device whose blocks are numbered handles, not addresses, and which records what the
/// allocator asks of it.
#[derive(Debug, Default)]
struct CountingDevice {
    calls: Mutex<Vec<(&'static str, usize, usize)>>,
    next: std::sync::atomic::AtomicUsize,
}

impl MemorySource for CountingDevice {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn allocate(&self, capacity: usize) -> Option<Block> {
        let n = 1 + self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.calls.lock().unwrap().push(("allocate", n, capacity));
        Some(Block {
            handle: NonZeroUsize::new(n)?,
            capacity,
        })
    }
    fn release(&self, block: Block) {
        let call = ("release", block.handle.get(), block.capacity);
        self.calls.lock().unwrap().push(call);
    }
    fn zero(&self, block: &Block, bytes: usize) {
        self.calls
            .lock()
            .unwrap()
            .push(("zero", block.handle.get(), bytes));
    }
}

/// The counters, cache and limits are the allocator's, whatever the source: a device source
/// sees exactly the allocations the cache could not serve and the releases the limits forced.
#[test]
fn policies_hold_over_a_device_memory_source() {
    let dev = Arc::new(CountingDevice::default());
    let a = Allocator::with_source(dev.clone());
    assert!(!a.is_host());
    let x = a.alloc(1000).unwrap(); // handle 1, capacity 1024
    assert_eq!(x.handle(), 1);
    drop(x);
    let y = a.alloc(1000).unwrap(); // from the cache, zeroed by the device
    assert_eq!(
        (y.handle(), a.active_bytes(), a.cache_bytes()),
        (1, 1024, 0)
    );
    a.set_memory_limit(1024 + 2 * K, false);
    assert!(a.alloc(3 * K).is_err(), "strict limit");
    drop(y);
    a.clear_cache();
    assert_eq!(
        *dev.calls.lock().unwrap(),
        vec![
            ("allocate", 1, 1024),
            ("zero", 1, 1000),
            ("release", 1, 1024)
        ]
    );
    assert_eq!(a.stats().allocations, 1);
}

#[test]
#[should_panic(expected = "is not host memory")]
fn a_device_buffer_has_no_host_address() {
    let a = Allocator::with_source(Arc::new(CountingDevice::default()));
    let b = a.alloc(8).unwrap();
    let _ = b.as_ptr();
}

/// A device that refuses every allocation, as a GPU whose memory is full does.
#[derive(Debug)]
struct FullDevice;

impl MemorySource for FullDevice {
    fn device(&self) -> Device {
        Device::Gpu(0)
    }
    fn allocate(&self, _: usize) -> Option<Block> {
        None
    }
    fn release(&self, _: Block) {}
    fn zero(&self, _: &Block, _: usize) {}
}

/// A request under the limit that the device (or the system) refuses is the device's refusal,
/// not the limit's: an error naming the limit would send the user to raise it.
#[test]
fn a_refusal_under_the_limit_is_the_systems_not_the_limits() {
    let a = Allocator::with_source(Arc::new(FullDevice));
    for limit in [None, Some(20 * K)] {
        if let Some(l) = limit {
            a.set_memory_limit(l, false);
        }
        let err = a.alloc(K).unwrap_err();
        assert_eq!((err.requested, err.limit), (K, usize::MAX), "{limit:?}");
        assert!(err.to_string().ends_with("refused by the device"), "{err}");
    }
    // Over the limit, the limit refuses, and says so; over a relaxed one the system refused,
    // and the limit is named too, since a recovery must get under it as well.
    let err = a.alloc(30 * K).unwrap_err();
    assert_eq!(err.limit, 20 * K);
    a.set_memory_limit(20 * K, true);
    let err = a.alloc(30 * K).unwrap_err();
    assert_eq!(err.limit, 20 * K);
}
