//! The device a graph is built and planned for, as plain data: which kernels run it (and so what
//! scratch each op needs), how the device lays out memory, and which fusions its kernels offer.
//! Planning asks the target, never the host, so planning for another machine (the CPU backend's
//! bytes for an AVX2 server, from a laptop with AVX-512) gives that machine's bytes anywhere.

use serde::{Deserialize, Serialize};

/// The most threads a target may name (a plan for another machine included): the op's scratch
/// sizes are vouched for up to it (`ops::attention::check_scratch`), and no machine runs one
/// step on more.
pub const MAX_THREADS: usize = 1 << 12;

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
    pub const ALL: [CpuGemm; 3] = [CpuGemm::Avx512, CpuGemm::Avx2, CpuGemm::Portable];

    /// The depth the kernel sums in one pass over its output (its `KC`), or 0 where products
    /// are not blocked by us. Must equal the register tiles' own `KC` (the CPU backend checks).
    pub const fn depth_block(self) -> usize {
        match self {
            CpuGemm::Avx512 => 512,
            CpuGemm::Avx2 => 512,
            CpuGemm::Portable => 0,
        }
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
        CpuGemm::ALL
            .into_iter()
            .find(|g| g.name() == s.trim())
            .ok_or_else(|| format!("`{s}` is not one of avx512, avx2, portable"))
    }
}

/// The kind of device and what its kernels depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// `threads` workers (each op that splits its work keeps scratch per worker) and the GEMM.
    Cpu { threads: usize, gemm: CpuGemm },
    /// A GPU running snug's WGSL kernels: their scratch depends on the shapes alone (each
    /// kernel sizes its grid from them), never on the adapter, so the kind carries no data.
    Gpu,
}

/// How a device lays out memory: what the planner must respect when it places tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryLayout {
    /// Every tensor starts at a multiple of this many bytes (a power of two).
    pub alignment: usize,
    /// The largest single buffer the device allocates: an arena larger than this is split into
    /// chunks, and no tensor straddles two.
    pub max_buffer_bytes: usize,
    /// The largest tensor one kernel may bind.
    pub max_binding_bytes: usize,
}

impl MemoryLayout {
    /// Host memory: cache-line alignment (covers every SIMD load), no buffer or binding limit.
    pub const CPU: MemoryLayout = MemoryLayout {
        alignment: 64,
        max_buffer_bytes: usize::MAX,
        max_binding_bytes: usize::MAX,
    };
}

/// The fused kernels a device offers. Models emit plain ops; the target's fusion passes
/// rewrite the ones it has kernels for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fusions {
    /// LayerNorm feeding a linear layer, normalized inside the GEMM's packing.
    pub layernorm_linear: bool,
    /// GELU feeding a linear layer, applied inside the GEMM's packing.
    pub gelu_linear: bool,
    /// Frozen weights stored quantized read from their codes (decoded as the GEMM packs them,
    /// the embedding's rows as it gathers them) rather than through a whole f32 copy.
    #[serde(default)]
    pub quantized_reads: bool,
    /// Kernels read bf16 activations and gradients from their 16-bit storage (a product
    /// widening them as the GEMM packs them) and write some in bf16, rather than through whole
    /// f32 copies made by casts.
    #[serde(default, alias = "half_reads")]
    pub half_io: bool,
}

impl Fusions {
    pub const NONE: Fusions = Fusions {
        layernorm_linear: false,
        gelu_linear: false,
        quantized_reads: false,
        half_io: false,
    };
    pub const ALL: Fusions = Fusions {
        layernorm_linear: true,
        gelu_linear: true,
        quantized_reads: true,
        half_io: true,
    };
}

/// A device to plan for: its kind, memory layout and fusions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Target {
    pub device: DeviceKind,
    pub memory: MemoryLayout,
    pub fusions: Fusions,
}

impl Target {
    /// A CPU with `threads` workers and `gemm`, and every CPU fusion.
    pub fn cpu(threads: usize, gemm: CpuGemm) -> Target {
        Target {
            device: DeviceKind::Cpu {
                threads: threads.max(1),
                gemm,
            },
            memory: MemoryLayout::CPU,
            fusions: Fusions::ALL,
        }
    }

    /// A GPU whose memory is laid out as `memory` says (its storage offset alignment, largest
    /// buffer and binding), with no fusions: its kernels take plain ops.
    pub fn gpu(memory: MemoryLayout) -> Target {
        Target {
            device: DeviceKind::Gpu,
            memory,
            fusions: Fusions::NONE,
        }
    }

    /// Workers that each hold their own scratch (1 where the device is not split that way).
    pub fn threads(&self) -> usize {
        match self.device {
            DeviceKind::Cpu { threads, .. } => threads,
            DeviceKind::Gpu => 1,
        }
    }

    pub fn is_gpu(&self) -> bool {
        matches!(self.device, DeviceKind::Gpu)
    }

    /// The CPU GEMM, on a CPU target.
    pub fn cpu_gemm(&self) -> Option<CpuGemm> {
        match self.device {
            DeviceKind::Cpu { gemm, .. } => Some(gemm),
            DeviceKind::Gpu => None,
        }
    }

    /// The same device with `threads` workers (a GPU's kernels are not split into workers:
    /// unchanged).
    pub fn with_threads(mut self, threads: usize) -> Target {
        match &mut self.device {
            DeviceKind::Cpu { threads: t, .. } => *t = threads.max(1),
            DeviceKind::Gpu => {}
        }
        self
    }

    pub fn with_fusions(mut self, fusions: Fusions) -> Target {
        self.fusions = fusions;
        self
    }

    /// The depth block of the target's GEMM (0 where it has none of ours).
    pub fn depth_block(&self) -> usize {
        self.cpu_gemm().map_or(0, CpuGemm::depth_block)
    }
}

impl Default for Target {
    /// One thread on the portable CPU GEMM: a target that does not depend on the host. Callers
    /// that run what they plan ask the backend for its target instead.
    fn default() -> Target {
        Target::cpu(1, CpuGemm::Portable)
    }
}

// Host detection belongs to the CPU backend; it stays here for now (plain std, no kernel).
impl CpuGemm {
    /// The kernel this machine runs (the CPU backend checks its dispatch agrees).
    pub fn host() -> CpuGemm {
        #[cfg(target_arch = "x86_64")]
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
}

impl Target {
    /// This machine with `threads` workers.
    pub fn host(threads: usize) -> Target {
        Target::cpu(threads, CpuGemm::host())
    }
}

impl From<usize> for Target {
    /// `threads` workers on this machine.
    fn from(threads: usize) -> Target {
        Target::host(threads)
    }
}

#[cfg(test)]
mod tests {
    use super::{CpuGemm, MemoryLayout, Target};
    use crate::ops::{gpu_partial_sums, GradNorm, LayerNormBackward, MatMul, Rope, SumSquares};
    use crate::{DType, Graph, Role};

    /// Workspace elements of `op`'s node on `target`, over f32 leaves of `shapes`.
    fn workspace(target: Target, op: impl Into<crate::ops::Op>, shapes: &[&[usize]]) -> usize {
        let mut g = Graph::new().with_target(target);
        let inputs: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| g.add_leaf(format!("x{i}"), s, DType::F32, Role::Activation))
            .collect::<crate::Result<_>>()
            .expect("leaves");
        g.apply(op, &inputs).expect("the op applies");
        let node = g.nodes().last().expect("a node");
        node.workspace.map_or(0, |w| g.tensor(w).numel())
    }

    /// A GPU's kernels need only what their shapes say: partial sums for a sum of squares, a
    /// (high, low) pair for the norm, nothing per worker; the CPU's answers stay per thread.
    #[test]
    fn gpu_workspaces_follow_the_shapes_and_cpu_ones_the_threads() {
        let gpu = Target::gpu(MemoryLayout {
            alignment: 256,
            max_buffer_bytes: 1 << 31,
            max_binding_bytes: 1 << 27,
        });
        let cpu = Target::cpu(4, CpuGemm::Avx2);
        assert!(gpu.is_gpu() && !cpu.is_gpu());
        assert_eq!(gpu.threads(), 1);
        assert_eq!(gpu.with_threads(8), gpu);
        assert_eq!(gpu.depth_block(), 0);

        let n = 300_000;
        assert_eq!(gpu_partial_sums(n), 256);
        assert_eq!(gpu_partial_sums(5000), 5);
        assert_eq!(gpu_partial_sums(1), 1);
        assert_eq!(workspace(gpu, SumSquares, &[&[n]]), 256);
        assert_eq!(workspace(cpu, SumSquares, &[&[n]]), 0);
        let norm = GradNorm {
            max_norm: 1.0,
            scale: 1.0,
            unscale: false,
        };
        assert_eq!(workspace(gpu, norm, &[&[1], &[1]]), 2);
        assert_eq!(workspace(cpu, norm, &[&[1], &[1]]), 0);

        let ln = [&[8, 16][..], &[8, 16], &[16], &[8], &[8]];
        assert_eq!(workspace(gpu, LayerNormBackward, &ln), 0);
        assert_eq!(workspace(cpu, LayerNormBackward, &ln), 2 * 4 * 16);
        let rope = Rope::new(2, 8, 10_000.0);
        assert_eq!(workspace(gpu, rope, &[&[1, 4, 16]]), 0);
        assert_eq!(workspace(cpu, rope, &[&[1, 4, 16]]), 4 * 8);

        // A weight's gradient (384 × 384 over 4096 rows: 36 tiles) sums 8 depth slices apart;
        // a product of many tiles, and any on the CPU, needs none.
        let grad = MatMul {
            ta: true,
            tb: false,
            bias: false,
        };
        assert_eq!(
            workspace(gpu, grad, &[&[4096, 384], &[4096, 384]]),
            8 * 384 * 384
        );
        assert_eq!(workspace(cpu, grad, &[&[4096, 384], &[4096, 384]]), 0);
        let forward = MatMul::default();
        assert_eq!(workspace(gpu, forward, &[&[4096, 384], &[384, 1536]]), 0);
    }
}
