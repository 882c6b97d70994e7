//! The conformance suite (`snug-conformance`) on the CPU backend: every check, one test each.

snug_conformance::conformance_tests!(snug_conformance::CpuHarness);

/// The CPU planned as a device without fused kernels, as the GPU's target is: the suite on the
/// plain-op graphs such a backend runs, the fused-op checks reported as not applicable, and the
/// whole-model steps compared with the CPU reference as another backend's are.
mod without_fusions {
    use snug_conformance::{CpuHarness, Harness};
    use snug_cpu::CpuBackend;
    use snug_graph::{Fusions, Target};

    struct Unfused;

    impl Harness for Unfused {
        type B = CpuBackend;

        fn name(&self) -> &str {
            "cpu without fusions"
        }

        fn target(&self, threads: usize) -> Target {
            CpuHarness.target(threads).with_fusions(Fusions::NONE)
        }

        fn backend(&self, threads: usize) -> CpuBackend {
            CpuHarness.backend(threads)
        }
    }

    snug_conformance::conformance_tests!(Unfused);
}
