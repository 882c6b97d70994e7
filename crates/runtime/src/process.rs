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

/// Memory the OS could give this process without swapping, in bytes: the machine's
/// `MemAvailable`, lowered to the room left under the tightest control-group memory limit
/// over the process (see [`cgroup_room`]), which `MemAvailable` does not see.
pub fn available_memory() -> Option<usize> {
    let machine = machine_available()?;
    Some(cgroup_room().map_or(machine, |room| room.bytes.min(machine)))
}

/// The budget `--memory auto` plans for out of `available` bytes: all but a tenth (at least
/// 512 MiB), kept for the OS and what lives outside the plan.
pub fn auto_budget(available: usize) -> usize {
    available.saturating_sub((available / 10).max(512 << 20))
}

/// The machine's `MemAvailable` alone, in bytes: what every process on its kernel shares.
pub fn machine_available() -> Option<usize> {
    kib_field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable:",
    )
}

/// The room left under a control group's memory limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoom {
    /// The limit less what the group holds, its inactive file cache (which the kernel reclaims
    /// before it kills) not counted as held.
    pub bytes: usize,
    /// The group's directory, and its inode there: processes under one limit share its room.
    pub dir: std::path::PathBuf,
    pub inode: u64,
}

/// The room under the tightest memory limit of the control groups this process runs in and
/// their ancestors: a container's, a batch job's (Slurm confines a job's memory this way), a
/// systemd slice's. None where no group has a limit, or none can be read.
pub fn cgroup_room() -> Option<CgroupRoom> {
    cgroup_limits().into_iter().min_by_key(|room| room.bytes)
}

/// Every control group over this process with a memory limit, innermost first (see
/// [`cgroup_limits_in`]).
pub fn cgroup_limits() -> Vec<CgroupRoom> {
    // Tests give a made-up hierarchy (its `cgroup` file standing for /proc/self/cgroup).
    #[cfg(feature = "test-hooks")]
    if let Some(root) = std::env::var_os("SNUG_TEST_CGROUP_ROOT") {
        let root = std::path::PathBuf::from(root);
        return std::fs::read_to_string(root.join("cgroup"))
            .map(|own| cgroup_limits_in(&root, &own))
            .unwrap_or_default();
    }
    std::fs::read_to_string("/proc/self/cgroup")
        .map(|own| cgroup_limits_in(std::path::Path::new("/sys/fs/cgroup"), &own))
        .unwrap_or_default()
}

/// The room under each memory limit of the control groups over a process, for the
/// hierarchies mounted under `root`, given `/proc/self/cgroup`'s text: cgroup v2 (`0::/path`,
/// files `memory.max`, `memory.current`) at `root`, v1's memory controller (`N:memory:/path`,
/// files `memory.limit_in_bytes`, `memory.usage_in_bytes`) at `root/memory`. Each group from
/// the process's own up to the hierarchy's root is read, innermost first (in a container, the
/// root is its own group).
pub fn cgroup_limits_in(root: &std::path::Path, own: &str) -> Vec<CgroupRoom> {
    let mut limits = Vec::new();
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (mount, files) = if controllers.is_empty() {
            (root.to_path_buf(), V2)
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), V1)
        } else {
            continue;
        };
        let relative = std::path::Path::new(path.trim().trim_start_matches('/'));
        let mut dir = mount.join(relative);
        let inside = relative
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside || !dir.is_dir() {
            // Another namespace's view (a group outside this one's root shows as `/..`):
            // read the hierarchy's root only.
            dir = mount.clone();
        }
        loop {
            limits.extend(group_room(&dir, files));
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
    }
    limits
}

/// A hierarchy's file names: limit, usage, and the `memory.stat` key of inactive file cache.
#[derive(Clone, Copy)]
struct GroupFiles {
    limit: &'static str,
    usage: &'static str,
    inactive_file: &'static str,
}

const V2: GroupFiles = GroupFiles {
    limit: "memory.max",
    usage: "memory.current",
    inactive_file: "inactive_file",
};

const V1: GroupFiles = GroupFiles {
    limit: "memory.limit_in_bytes",
    usage: "memory.usage_in_bytes",
    inactive_file: "total_inactive_file",
};

/// One group's room, where it has a limit.
fn group_room(dir: &std::path::Path, files: GroupFiles) -> Option<CgroupRoom> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    // v2 writes "max" for none; v1 a page-rounded i64::MAX, larger than any machine.
    let limit: usize = read(files.limit)?.trim().parse().ok()?;
    if limit as u64 >= 1 << 60 {
        return None;
    }
    let usage: usize = read(files.usage)?.trim().parse().ok()?;
    let inactive = read("memory.stat")
        .and_then(|stat| {
            stat.lines().find_map(|l| {
                let (key, value) = l.split_once(' ')?;
                (key == files.inactive_file).then(|| value.trim().parse::<usize>().ok())?
            })
        })
        .unwrap_or(0);
    let held = usage.saturating_sub(inactive);
    Some(CgroupRoom {
        bytes: limit.saturating_sub(held),
        dir: dir.to_path_buf(),
        inode: inode(dir),
    })
}

#[cfg(unix)]
fn inode(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).map_or(0, |m| m.ino())
}

#[cfg(not(unix))]
fn inode(_dir: &std::path::Path) -> u64 {
    0
}

/// An identity for the machine (its kernel): the boot id every container on it shares, or
/// where that cannot be read its host name. Processes with the same one share its memory.
pub fn machine_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let name = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/hostname"))
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_default();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.trim().hash(&mut h);
    h.finish()
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

    /// The tightest of [`cgroup_limits_in`], as [`cgroup_room`] takes it.
    fn cgroup_room_in(root: &std::path::Path, own: &str) -> Option<CgroupRoom> {
        cgroup_limits_in(root, own)
            .into_iter()
            .min_by_key(|room| room.bytes)
    }

    /// A control group under `root` (a v1 hierarchy's memory controller lives in `memory/`).
    fn group(root: &std::path::Path, path: &str, files: &[(&str, &str)]) {
        let dir = root.join(path);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    fn a_control_groups_limit_is_read_at_its_tightest_level() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // v2: a job's group limited to 8 GiB above the process's own, unlimited, group.
        group(r, "", &[("memory.max", "max\n"), ("memory.current", "1\n")]);
        group(
            r,
            "job_7",
            &[
                ("memory.max", "8589934592\n"),
                ("memory.current", "3221225472\n"),
                (
                    "memory.stat",
                    "anon 1\ninactive_file 1073741824\nactive_file 5\n",
                ),
            ],
        );
        group(
            r,
            "job_7/step_0",
            &[("memory.max", "max\n"), ("memory.current", "1\n")],
        );
        let room = cgroup_room_in(r, "0::/job_7/step_0\n").expect("a limit");
        // 8 GiB less the 3 GiB held, of which 1 GiB is reclaimable cache.
        assert_eq!(room.bytes, (8 << 30) - (2 << 30));
        assert_eq!(room.dir, r.join("job_7"));
        // A group above the limit's, or a process outside it, sees none.
        assert_eq!(cgroup_room_in(r, "0::/\n"), None);
        // A tighter limit lower down wins.
        group(
            r,
            "job_7/step_0",
            &[("memory.max", "1073741824\n"), ("memory.current", "0\n")],
        );
        let room = cgroup_room_in(r, "0::/job_7/step_0\n").expect("a limit");
        assert_eq!((room.bytes, room.dir), (1 << 30, r.join("job_7/step_0")));
        // Both limits, innermost first.
        let limits = cgroup_limits_in(r, "0::/job_7/step_0\n");
        let dirs: Vec<_> = limits.iter().map(|l| l.dir.clone()).collect();
        assert_eq!(dirs, [r.join("job_7/step_0"), r.join("job_7")]);
        // A group outside the namespace's root (`/..`) never reads above the mount.
        let above = cgroup_limits_in(&r.join("job_7"), "0::/..\n");
        assert_eq!(above.len(), 1);
        assert_eq!(above[0].dir, r.join("job_7"));
        // A path from another namespace's view reads the hierarchy's root.
        group(
            r,
            "",
            &[("memory.max", "4294967296\n"), ("memory.current", "0\n")],
        );
        let room = cgroup_room_in(r, "0::/not/here\n").expect("the root's limit");
        assert_eq!((room.bytes, room.dir), (4 << 30, r.to_path_buf()));
    }

    #[test]
    fn a_v1_memory_controller_is_read_beside_other_controllers() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        group(
            r,
            "memory",
            &[
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory.usage_in_bytes", "5\n"),
            ],
        );
        group(
            r,
            "memory/docker/abc",
            &[
                ("memory.limit_in_bytes", "2147483648\n"),
                ("memory.usage_in_bytes", "1073741824\n"),
                (
                    "memory.stat",
                    "cache 9\ninactive_file 7\ntotal_inactive_file 536870912\n",
                ),
            ],
        );
        let own = "12:pids:/docker/abc\n4:cpu,memory:/docker/abc\n0::/\n";
        let room = cgroup_room_in(r, own).expect("a limit");
        assert_eq!(room.bytes, (2 << 30) - (512 << 20));
        assert_eq!(room.dir, r.join("memory/docker/abc"));
        // Unlimited everywhere (v1's page-rounded i64::MAX), or nothing readable: none.
        assert_eq!(cgroup_room_in(r, "4:memory:/\n"), None);
        assert_eq!(cgroup_room_in(r, "garbage\n3:cpu:/x\n"), None);
        // Usage above the limit (possible for a moment) leaves no room, not a wrapped count.
        group(
            r,
            "memory/full",
            &[
                ("memory.limit_in_bytes", "100\n"),
                ("memory.usage_in_bytes", "200\n"),
            ],
        );
        assert_eq!(
            cgroup_room_in(r, "4:memory:/full\n").map(|g| g.bytes),
            Some(0)
        );
    }
}
