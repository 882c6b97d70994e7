//! The conformance suite (`snug-conformance`) on the GPU backend, on the first adapter: every
//! check, one test each. Without an adapter each check is skipped (a failure in CI).

use std::sync::OnceLock;

use snug_conformance::Harness;
use snug_gpu::{GpuBackend, GpuDevice, Selector};
use snug_graph::Target;

struct Gpu;

/// The first adapter, opened once for the binary; each check's backend shares it with an
/// allocator of its own.
fn device() -> Result<&'static GpuDevice, String> {
    static DEVICE: OnceLock<Result<GpuDevice, String>> = OnceLock::new();
    DEVICE
        .get_or_init(|| GpuDevice::open(Selector::FirstGpu).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(Clone::clone)
}

impl Harness for Gpu {
    type B = GpuBackend;

    fn name(&self) -> &str {
        "gpu"
    }

    fn available(&self) -> Result<(), String> {
        device().map(|_| ())
    }

    /// The adapter's target; a GPU's kernels are not split into workers.
    fn target(&self, _threads: usize) -> Target {
        device().map_or_else(|_| Target::default(), GpuDevice::target)
    }

    fn backend(&self, _threads: usize) -> GpuBackend {
        GpuBackend::new(device().expect("the first adapter opens").clone())
    }

    /// Shapes of tens of thousands of elements take a CPU Vulkan driver a while; the GPU's
    /// kernels have no separate large-shape paths to reach.
    fn large_shapes(&self) -> bool {
        false
    }
}

snug_conformance::conformance_tests!(Gpu);
