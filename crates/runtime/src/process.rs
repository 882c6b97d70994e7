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

/// Hands the C heap's free pages back to the OS (glibc's `malloc_trim`): setting up a run
/// (tokenizing, making the initial weights one tensor at a time) frees megabytes that glibc
/// would otherwise keep resident beside the step's arena. Elsewhere it does nothing.
pub fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` releases only memory no allocation holds.
    unsafe {
        libc::malloc_trim(0);
    }
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

/// The machine's memory (`MemTotal`), in bytes.
pub fn total_memory() -> Option<usize> {
    kib_field(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemTotal:")
}

/// Whole-machine CPU time from `/proc/stat`'s aggregate line, in clock ticks: all of it, and
/// the part a hypervisor gave to other guests while this one was ready to run (`steal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTicks {
    pub total: u64,
    pub steal: u64,
}

impl CpuTicks {
    /// The machine's CPU ticks now, where the OS reports them.
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// Parses the `cpu` line of `/proc/stat` text (user nice system idle iowait irq softirq
    /// steal ...; guest time is already counted in user and nice, so it is left out).
    pub fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        let steal = *fields.get(7)?;
        Some(Self {
            total: fields.iter().take(8).sum(),
            steal,
        })
    }

    /// The share of the CPU time since `earlier` that was stolen, or `None` if no time passed.
    pub fn steal_since(&self, earlier: &Self) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let steal = self.steal.checked_sub(earlier.steal)?;
        (total > 0).then(|| steal as f64 / total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_share_is_read_from_the_aggregate_cpu_line() {
        let before = "cpu  100 5 50 800 10 0 5 30 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        let after = "cpu  160 5 70 850 10 0 5 110 9 0\ncpu0 9 9 9 9 9 9 9 9 9 9\n";
        let (b, a) = (
            CpuTicks::parse(before).unwrap(),
            CpuTicks::parse(after).unwrap(),
        );
        // Guest ticks (7 → 9) are not added: 100+5+50+800+10+0+5+30.
        assert_eq!(
            b,
            CpuTicks {
                total: 1000,
                steal: 30
            }
        );
        // 60 user + 20 system + 50 idle + 80 steal = 210 ticks, 80 stolen.
        assert_eq!(a.steal_since(&b), Some(80.0 / 210.0));
        assert_eq!(b.steal_since(&b), None);
        assert_eq!(b.steal_since(&a), None);
        assert_eq!(CpuTicks::parse("cpu  1 2 3\n"), None);
        assert_eq!(CpuTicks::parse("cpu  1 2 3 4 5 6 x 8\n"), None);
        assert_eq!(CpuTicks::parse("intr 5\n"), None);
    }
}
