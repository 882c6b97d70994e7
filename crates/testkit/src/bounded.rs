//! Running a child process within bounds: killed past a time limit or past a resident-memory
//! limit (rather than left to exhaust the machine), and reaped with `wait4` so its peak RSS is
//! the kernel's own account of it. For tests that an input is refused quickly and small.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// When to give up on a child.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub timeout: Duration,
    /// Resident bytes past which the child is killed.
    pub kill_above_rss: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(30),
            kill_above_rss: 400 << 20,
        }
    }
}

/// How a bounded run ended.
#[derive(Debug)]
pub struct Ended {
    /// Exit status, or `None` when a signal ended it.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// Peak resident set size in bytes.
    pub max_rss_bytes: u64,
    pub seconds: f64,
    /// It was killed for outliving [`Limits::timeout`] or outgrowing [`Limits::kill_above_rss`].
    pub killed: bool,
}

/// Resident bytes of a running process (`VmRSS`), 0 where unknown.
fn rss_now(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Runs `cmd` (stdin closed, output captured) within `limits`.
#[allow(clippy::zombie_processes)] // reaped by `wait4`, which `Child::wait` cannot replace
pub fn run(mut cmd: Command, limits: Limits) -> Ended {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the child starts");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let err = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain C structs filled in by the kernel; `pid` is our unreaped child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let (mut killed, mut seen_rss) = (false, 0);
    loop {
        // SAFETY: as above.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(r >= 0, "wait4: {}", std::io::Error::last_os_error());
        if r == pid {
            break;
        }
        seen_rss = seen_rss.max(rss_now(pid));
        if !killed && (start.elapsed() > limits.timeout || seen_rss > limits.kill_above_rss) {
            killed = true;
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ended {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        // Kilobytes on Linux, bytes on macOS.
        max_rss_bytes: (usage.ru_maxrss as u64 * if cfg!(target_os = "macos") { 1 } else { 1024 })
            .max(seen_rss),
        seconds: start.elapsed().as_secs_f64(),
        killed,
    }
}

/// Runs `cmd` to its end within `timeout` (memory unbounded); the test fails if it had to be
/// killed, naming `what`.
pub fn run_to_end(cmd: Command, timeout: Duration, what: &str) -> Ended {
    let ended = run(
        cmd,
        Limits {
            timeout,
            kill_above_rss: u64::MAX,
        },
    );
    assert!(
        !ended.killed,
        "{what} still ran after {timeout:?}; stderr: {}",
        ended.stderr
    );
    ended
}

/// Asserts `ended` is a refusal: exit 1 (no panic, no signal, not killed) in under
/// `max_rss_bytes`, its stderr holding each of `needles`. `what` names the run in messages.
pub fn assert_refused(ended: &Ended, what: &str, needles: &[&str], max_rss_bytes: u64) {
    let err = &ended.stderr;
    assert!(
        !ended.killed,
        "{what}: killed after {:.1} s at {} MB: {err}",
        ended.seconds,
        ended.max_rss_bytes >> 20
    );
    assert_eq!(
        (ended.code, ended.signal),
        (Some(1), None),
        "{what}: stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{what} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{what}: `{n}` missing from: {err}");
    }
    assert!(
        ended.max_rss_bytes < max_rss_bytes,
        "{what}: peak RSS {} MB",
        ended.max_rss_bytes >> 20
    );
}

/// Makes a FIFO (named pipe) at `path`: a file whose `open` blocks until a writer comes.
pub fn mkfifo(path: &std::path::Path) {
    let c =
        std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("a path without NUL");
    // SAFETY: a valid NUL-terminated path.
    let r = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(r, 0, "mkfifo: {}", std::io::Error::last_os_error());
}
