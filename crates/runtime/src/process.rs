//! The operating system's view of this process's memory, reported beside the allocator's.

/// A `Key:   123 kB` line of a /proc file, in bytes.
fn kib_field(text: &str, key: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Current and peak resident set size in bytes (`VmRSS`, `VmHWM`), where the OS reports them.
pub fn resident_set() -> Option<(usize, usize)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    Some((kib_field(&status, "VmRSS:")?, kib_field(&status, "VmHWM:")?))
}

/// Memory the OS could give this process without swapping (`MemAvailable`), in bytes.
pub fn available_memory() -> Option<usize> {
    kib_field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable:",
    )
}
