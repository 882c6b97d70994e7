//! The operating system's view of this process's memory, reported beside the allocator's.

/// Current and peak resident set size in bytes (`VmRSS`, `VmHWM`), where the OS reports them.
pub fn resident_set() -> Option<(usize, usize)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |key: &str| -> Option<usize> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kib: usize = line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Memory the OS could give this process without swapping (`MemAvailable`), in bytes.
pub fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line["MemAvailable:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}
