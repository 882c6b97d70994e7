//! The device a graph is built and planned for, as plain data: what sizes each kernel's
//! scratch. Planning asks the target, never the host, so planning for another machine (the
//! CPU backend's bytes for an AVX2 server, from a laptop with AVX-512) gives that machine's
//! bytes anywhere.

use serde::{Deserialize, Serialize};

/// Which GEMM runs a CPU's large products: its depth block decides how some fused ops tile
/// their rows, hence their scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuGemm {
    /// snug's blocked kernel with the 8 × 48 AVX-512 register tile.
    Avx512,
    /// snug's blocked kernel with the 6 × 16 AVX2 + FMA register tile.
    Avx2,
    /// The portable path (the gemm crate).
    Portable,
}

impl CpuGemm {
    /// The depth the kernel sums in one pass over its output (its `KC`), or 0 where products
    /// are not blocked by us. Must equal the register tiles' own `KC`.
    pub const fn depth_block(self) -> usize {
        match self {
            CpuGemm::Avx512 => 384,
            CpuGemm::Avx2 => 512,
            CpuGemm::Portable => 0,
        }
    }

    /// The kernel this machine runs (the portable one where the CPU kernels are not built).
    pub fn host() -> CpuGemm {
        #[cfg(all(feature = "cpu", target_arch = "x86_64"))]
        {
            if is_x86_feature_detected!("avx512f") {
                return CpuGemm::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return CpuGemm::Avx2;
            }
        }
        CpuGemm::Portable
    }

    pub fn name(self) -> &'static str {
        match self {
            CpuGemm::Avx512 => "avx512",
            CpuGemm::Avx2 => "avx2",
            CpuGemm::Portable => "portable",
        }
    }
}

impl std::str::FromStr for CpuGemm {
    type Err = String;

    fn from_str(s: &str) -> Result<CpuGemm, String> {
        [CpuGemm::Avx512, CpuGemm::Avx2, CpuGemm::Portable]
            .into_iter()
            .find(|g| g.name() == s.trim())
            .ok_or_else(|| format!("`{s}` is not one of avx512, avx2, portable"))
    }
}

/// A CPU target: worker threads (each has its own scratch) and its GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Target {
    pub threads: usize,
    pub gemm: CpuGemm,
}

impl Target {
    /// This machine with `threads` workers.
    pub fn host(threads: usize) -> Target {
        Target {
            threads: threads.max(1),
            gemm: CpuGemm::host(),
        }
    }
}

impl Default for Target {
    /// This machine, one thread.
    fn default() -> Target {
        Target::host(1)
    }
}

impl From<usize> for Target {
    /// `threads` workers on this machine.
    fn from(threads: usize) -> Target {
        Target::host(threads)
    }
}
