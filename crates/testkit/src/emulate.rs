//! Running one of this process's functions on an emulated CPU, for kernels written for
//! instructions the test machine lacks (AVX512-BF16 on an AVX2-only host).
//!
//! [`call`] starts `emu/call.py` (bochscpu-python: Bochs's CPU models as a library), which maps
//! this process's pages into an emulated core of the chosen model, runs `f(arg)` there, and
//! writes the bytes it changed back into this process before it exits; this thread waits for it.
//! The function therefore sees and writes this process's memory as it would natively. It must
//! make no system call (no I/O, no thread spawning): the emulated core has no kernel behind it,
//! so that stops the run as a fault. Nor may it allocate or free at all: this process's other
//! threads go on allocating meanwhile, and the allocator's bookkeeping the emulated code
//! changed would be written back over theirs.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// The Python interpreter with `bochscpu-python` installed (`python3` when unset).
pub const PYTHON_VAR: &str = "SNUG_EMU_PYTHON";

/// The package and version `.ci/run` installs.
pub const PACKAGE: &str = "bochscpu-python==0.4.0";

/// A CPU model Bochs emulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// AVX-512 F/BW/DQ/VL, no BF16.
    TigerLake,
    /// AVX-512 with AVX512-BF16.
    SapphireRapids,
}

impl Model {
    fn bochs_name(self) -> &'static str {
        match self {
            Model::TigerLake => "tigerlake",
            Model::SapphireRapids => "sapphire_rapids",
        }
    }
}

/// Why a call did not run to its return.
#[derive(Debug)]
pub enum EmuError {
    /// The emulator is not installed here: a reason for [`crate::skip_or_fail`].
    Unavailable(String),
    /// It ran and faulted (an instruction the model lacks, a system call, a bad address), or
    /// the driver failed.
    Failed(String),
}

impl std::fmt::Display for EmuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EmuError::Unavailable(why) | EmuError::Failed(why) => f.write_str(why),
        }
    }
}

fn emu_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("emu")
}

/// The interpreter to run, checked once: it imports bochscpu with [`glibc_shim`] preloaded.
fn python() -> Result<&'static (String, PathBuf), EmuError> {
    static PYTHON: OnceLock<Result<(String, PathBuf), String>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let python = std::env::var(PYTHON_VAR).unwrap_or_else(|_| "python3".into());
            let shim = glibc_shim()?;
            let probe = Command::new(&python)
                .args(["-c", "import bochscpu"])
                .env("LD_PRELOAD", &shim)
                .output()
                .map_err(|e| format!("cannot run {python} ({PYTHON_VAR}): {e}"))?;
            if !probe.status.success() {
                let stderr = String::from_utf8_lossy(&probe.stderr);
                return Err(format!(
                    "needs {PACKAGE} for {python} (set {PYTHON_VAR} to an interpreter that has \
                     it): {}",
                    stderr.trim().lines().last().unwrap_or_default()
                ));
            }
            Ok((python, shim))
        })
        .as_ref()
        .map_err(|why| EmuError::Unavailable(why.clone()))
}

/// `emu/isoc23.c` built into a shared library, for the wheel's glibc 2.38 symbols.
fn glibc_shim() -> Result<PathBuf, String> {
    let out = std::env::temp_dir().join(format!("snug-emu-{}", std::process::id()));
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let lib = out.join("libisoc23.so");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(emu_dir().join("isoc23.c"))
        .output()
        .map_err(|e| format!("needs a C compiler (cc) for the emulator's glibc shim: {e}"))?;
    if !built.status.success() {
        return Err(format!(
            "building the emulator's glibc shim failed: {}",
            String::from_utf8_lossy(&built.stderr).trim()
        ));
    }
    Ok(lib)
}

/// This thread's `fs` base (its thread-local storage), which the emulated core is given.
fn fs_base() -> u64 {
    const ARCH_GET_FS: libc::c_long = 0x1003;
    let mut base = 0u64;
    // SAFETY: arch_prctl(ARCH_GET_FS) writes one u64 through the pointer.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_FS, &mut base as *mut u64) };
    assert_eq!(r, 0, "arch_prctl: {}", std::io::Error::last_os_error());
    base
}

/// Runs `f(arg)` on an emulated `model` core over this process's memory, and returns once what
/// it wrote is in place here. Takes seconds: keep the work to small shapes.
///
/// # Safety
/// `f(arg)` must be sound to call here and now, and make no system call. Nothing else may
/// write the memory it writes while it runs.
pub unsafe fn call(
    model: Model,
    f: unsafe extern "C" fn(*mut c_void),
    arg: *mut c_void,
) -> Result<(), EmuError> {
    let (python, shim) = python()?;
    // The standard library caches the CPU's features on first asking: were that in the emulated
    // call, the emulated model's would be written back, and native code would later run
    // instructions this CPU lacks.
    std::hint::black_box(std::arch::is_x86_feature_detected!("avx2"));
    // The emulated call's stack: ours, so its pages are this process's like everything else.
    let mut stack = vec![0u8; 1 << 20];
    let top = stack.as_mut_ptr() as u64 + stack.len() as u64;
    let mut cmd = Command::new(python);
    cmd.arg(emu_dir().join("call.py"))
        .arg(std::process::id().to_string())
        .arg(format!("{:#x}", f as usize))
        .arg(format!("{:#x}", arg as usize))
        .arg(format!("{:#x}", fs_base()))
        .arg(format!("{top:#x}"))
        .arg(model.bochs_name())
        .env("LD_PRELOAD", shim);
    let ended = crate::bounded::run(
        cmd,
        crate::bounded::Limits {
            timeout: Duration::from_secs(600),
            kill_above_rss: 8 << 30,
        },
    );
    std::hint::black_box(&mut stack);
    if ended.code == Some(0) && !ended.killed {
        Ok(())
    } else {
        Err(EmuError::Failed(format!(
            "the emulated call did not return (exit {:?}, signal {:?}, killed {}): {}",
            ended.code,
            ended.signal,
            ended.killed,
            ended.stderr.trim()
        )))
    }
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    use super::*;

    #[repr(C)]
    struct Job {
        x: [u32; 16],
        sum: u64,
        leaf7_1_eax: u32,
    }

    /// Sums `x` and reads CPUID leaf 7, sub-leaf 1 (whose EAX bit 5 is AVX512-BF16).
    unsafe extern "C" fn sum_job(arg: *mut c_void) {
        // SAFETY: the test passes a `Job`.
        let job = unsafe { &mut *(arg as *mut Job) };
        job.sum = job.x.iter().map(|&v| u64::from(v)).sum();
        job.leaf7_1_eax = std::arch::x86_64::__cpuid_count(7, 1).eax;
    }

    /// The emulated call reads and writes this process's memory, and runs on the model asked
    /// for: Sapphire Rapids reports AVX512-BF16, Tiger Lake does not.
    #[test]
    fn a_call_runs_on_the_model_and_writes_back() {
        for (model, bf16) in [(Model::SapphireRapids, true), (Model::TigerLake, false)] {
            let mut job = Job {
                x: std::array::from_fn(|i| 1000 * i as u32 + 7),
                sum: 0,
                leaf7_1_eax: 0,
            };
            // SAFETY: `job` makes no system call and only touches `Job`.
            match unsafe { call(model, sum_job, &mut job as *mut Job as *mut c_void) } {
                Err(EmuError::Unavailable(why)) => return crate::skip_or_fail(&why),
                Err(e) => panic!("{model:?}: {e}"),
                Ok(()) => {}
            }
            assert_eq!(job.sum, (0..16).map(|i| 1000 * i + 7).sum::<u64>());
            assert_eq!(job.leaf7_1_eax & (1 << 5) != 0, bf16, "{model:?}");
        }
    }

    extern "C" fn syscall_job(_: *mut c_void) {
        // SAFETY: getpid has no preconditions.
        unsafe { libc::getpid() };
    }

    /// A system call does not reach the real kernel: the run stops and says it faulted.
    #[test]
    fn a_system_call_is_a_fault() {
        // SAFETY: the call is emulated; its system call faults there.
        match unsafe { call(Model::TigerLake, syscall_job, std::ptr::null_mut()) } {
            Err(EmuError::Unavailable(why)) => crate::skip_or_fail(&why),
            Err(EmuError::Failed(why)) => assert!(why.contains("faulted"), "{why}"),
            Ok(()) => panic!("a system call returned under emulation"),
        }
    }
}
