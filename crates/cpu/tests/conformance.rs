//! The conformance suite (`snug-conformance`) on the CPU backend: every check, one test each.

snug_conformance::conformance_tests!(snug_conformance::CpuHarness);
