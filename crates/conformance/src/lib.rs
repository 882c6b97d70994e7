//! snug's conformance suite: the checks every backend passes, written once against
//! [`snug_runtime::Backend`] so the CPU and the GPU run the same tests with the same numbers
//! and tolerances.
//!
//! - [`gradcheck`]: [`GradCheck`], one op's (or a small network's) gradient rule against central
//!   finite differences of the backend's own kernels.
//! - [`ops`]: every op's gradient, case by case, at small shapes.
//! - [`large`]: the same at tens of thousands of elements, through kernels' parallel paths.
//! - [`forward`]: kernels against plain computations, fused ops against their unfused parts,
//!   and in-place kernels against themselves out of place.
//! - [`memory`]: the allocator's measured peak equals the plan's, for whole training steps.
//! - [`model`]: whole GPT and Llama steps against finite differences and the CPU.
//!
//! A backend's test file implements [`Harness`] and calls [`conformance_tests!`], which makes
//! one `#[test]` per check. A check that the backend cannot run is never passed silently:
//! where the backend lacks an op's kernel ([`Harness::lacks`]) the case is skipped through
//! [`snug_testkit::skip_or_fail`] (a failure in CI); where the target does not offer a fusion,
//! or the harness leaves out large shapes, the case does not apply and says so on stderr.

pub mod forward;
pub mod gradcheck;
pub mod large;
pub mod memory;
pub mod model;
pub mod ops;

use std::io::Write;

use snug_cpu::CpuBackend;
use snug_graph::ops::Op;
use snug_graph::{Graph, Target};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, Backend, Session};

pub use gradcheck::GradCheck;

/// What a backend's tests tell the suite.
pub trait Harness {
    type B: Backend;

    /// Names the backend in messages.
    fn name(&self) -> &str;

    /// `Err(reason)` where this machine cannot run the backend at all (no adapter): every
    /// check is then skipped through [`snug_testkit::skip_or_fail`].
    fn available(&self) -> Result<(), String> {
        Ok(())
    }

    /// The target graphs are built and planned for, with `threads` workers where the device
    /// splits its work that way. Its fusions decide which fused-op checks apply.
    fn target(&self, threads: usize) -> Target;

    /// A new backend with `threads` workers and an allocator of its own, so that its peak counts
    /// only the session about to be made. Panics where the device cannot be opened.
    fn backend(&self, threads: usize) -> Self::B;

    /// Whether the checks of tens of thousands of elements run.
    fn large_shapes(&self) -> bool {
        true
    }

    /// Whether the backend has no kernel for `op` yet: checks that need it are skipped.
    fn lacks(&self, _op: &Op) -> bool {
        false
    }

    /// Whether this is the CPU backend, the reference other backends' whole-model values are
    /// compared with.
    fn is_cpu(&self) -> bool {
        false
    }
}

/// The CPU backend on this machine's GEMM.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuHarness;

impl Harness for CpuHarness {
    type B = CpuBackend;

    fn name(&self) -> &str {
        "cpu"
    }

    fn target(&self, threads: usize) -> Target {
        Target::host(threads)
    }

    fn backend(&self, threads: usize) -> CpuBackend {
        CpuBackend::new(Allocator::default(), threads).expect("starts the CPU's worker threads")
    }

    fn is_cpu(&self) -> bool {
        true
    }
}

/// Runs one check against `harness`, or skips it where the backend cannot run here.
pub fn run<H: Harness>(harness: &H, check: fn(&H)) {
    match harness.available() {
        Ok(()) => check(harness),
        Err(reason) => snug_testkit::skip_or_fail(&format!("{}: {reason}", harness.name())),
    }
}

/// Says on stderr that a case does not apply to this backend (libtest does not capture it).
pub fn not_applicable(reason: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("<unnamed test>");
    // Nothing useful to do if stderr is gone.
    let _ = writeln!(std::io::stderr().lock(), "not applicable: {test}: {reason}");
}

/// The fusion `op` needs that `target` does not offer, by name.
fn missing_fusion(op: &Op, target: &Target) -> Option<&'static str> {
    let fusions = target.fusions;
    match op {
        Op::LayerNormLinear(_) | Op::LayerNormLinearBackward(_) if !fusions.layernorm_linear => {
            Some("layernorm_linear")
        }
        Op::GeluLinear(_) | Op::GeluLinearBackward(_) if !fusions.gelu_linear => {
            Some("gelu_linear")
        }
        _ => None,
    }
}

/// Whether the harness's target offers the fusion `op` needs (if any); if not, says so.
fn offers<H: Harness>(harness: &H, op: &Op) -> bool {
    let Some(fusion) = missing_fusion(op, &harness.target(1)) else {
        return true;
    };
    not_applicable(&format!(
        "the {} target does not offer the {fusion} fusion ({})",
        harness.name(),
        op.name()
    ));
    false
}

/// Whether `graph` can run on the harness's backend; if not, says why (a skip where the
/// backend lacks a kernel, a note where the target does not offer a fused op) and the caller
/// returns.
pub fn runnable<H: Harness>(harness: &H, graph: &Graph) -> bool {
    for node in graph.nodes() {
        if let Some(fusion) = missing_fusion(&node.op, &graph.target()) {
            not_applicable(&format!(
                "the {} target does not offer the {fusion} fusion ({})",
                harness.name(),
                node.op.name()
            ));
            return false;
        }
        if harness.lacks(&node.op) {
            snug_testkit::skip_or_fail(&format!(
                "the {} backend has no kernel for {}",
                harness.name(),
                node.op.name()
            ));
            return false;
        }
    }
    true
}

/// Whether the harness runs large shapes; if not, says so.
fn large_shapes<H: Harness>(harness: &H) -> bool {
    if !harness.large_shapes() {
        not_applicable(&format!(
            "the {} harness leaves large shapes out",
            harness.name()
        ));
    }
    harness.large_shapes()
}

/// `graph` planned with the default options and loaded on a new backend of `threads` workers,
/// or `None` (said why) where the backend cannot run it.
pub fn session<H: Harness>(harness: &H, graph: Graph, threads: usize) -> Option<Session<H::B>> {
    if !runnable(harness, &graph) {
        return None;
    }
    let memory = plan(&graph, &PlanOptions::default()).expect("the graph plans");
    Some(Session::new(graph, memory, harness.backend(threads)).expect("the session loads"))
}

/// Makes one `#[test]` per check of the suite, each running it against `$harness` (an
/// expression evaluated in every test):
///
/// ```text
/// snug_conformance::conformance_tests!(snug_conformance::CpuHarness);
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr) => {
        $crate::__conformance_tests!($harness;
            ops::checker_rejects_sign_and_scale_errors,
            ops::matmul_2d_every_transpose_with_and_without_bias,
            ops::matmul_shared_weight_over_batched_left_operand,
            ops::matmul_fully_batched_every_transpose,
            ops::binary_add_with_broadcasting,
            ops::binary_sub_with_broadcasting,
            ops::binary_mul_with_broadcasting,
            ops::binary_div_with_broadcasting,
            ops::binary_with_one_tensor_on_both_sides,
            ops::scale,
            ops::reduce_sum,
            ops::reduce_mean,
            ops::reduce_max,
            ops::sum_to,
            ops::broadcast_to,
            ops::softmax,
            ops::log_softmax,
            ops::layer_norm_input_weight_and_bias,
            ops::layer_norm_linear_all_five_inputs,
            ops::gelu_exact_and_tanh,
            ops::gelu_linear_input_weight_and_bias,
            ops::embedding_table,
            ops::reshape,
            ops::narrow,
            ops::pad,
            ops::transpose,
            ops::causal_attention_two_heads,
            ops::cross_entropy,
            ops::lm_head_loss,
            ops::small_network_end_to_end,
            ops::rms_norm_input_and_weight,
            ops::rope_two_heads,
            ops::silu,
            ops::swiglu_gate_and_up,
            ops::gqa_attention_grouped_and_ungrouped,
            large::large_tensors_through_the_parallel_kernel_paths,
            large::large_llama_ops_through_the_parallel_kernel_paths,
            forward::gelu_linear_equals_gelu_then_matmul,
            forward::layer_norm_linear_equals_layer_norm_then_matmul,
            forward::fused_backwards_in_place_keep_the_bits,
            forward::causal_attention_matches_a_plain_computation,
            forward::rope_matches_rotate_half_and_inverse_undoes_it,
            forward::gqa_attention_with_all_heads_equals_causal_attention,
            memory::gpt_step_measured_peak_equals_planned_peak,
            memory::llama_step_measured_peak_equals_planned_peak,
            model::gpt_step_gradients_match_finite_differences,
            model::llama_step_gradients_match_finite_differences,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($harness:expr; $($module:ident :: $check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::run(&$harness, $crate::$module::$check);
            }
        )*
    };
}

#[cfg(test)]
mod tests {
    use snug_graph::ops::{GeluLinear, Scale, Silu};
    use snug_graph::{DType, Fusions};

    use super::*;

    /// The CPU posing as a backend without SiLU and without fusions.
    struct NoSilu;

    impl Harness for NoSilu {
        type B = CpuBackend;

        fn name(&self) -> &str {
            "no-silu"
        }

        fn target(&self, threads: usize) -> Target {
            Target::host(threads).with_fusions(Fusions::NONE)
        }

        fn backend(&self, threads: usize) -> CpuBackend {
            CpuHarness.backend(threads)
        }

        fn lacks(&self, op: &Op) -> bool {
            matches!(op, Op::Silu(_))
        }
    }

    fn graph_of(op: impl Into<Op>, shapes: &[&[usize]]) -> Graph {
        let mut g = Graph::new().with_target(NoSilu.target(1));
        let ins: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| g.input(format!("x{i}"), s, DType::F32).unwrap())
            .collect();
        g.apply(op, &ins).unwrap();
        g
    }

    #[test]
    fn a_missing_kernel_is_a_skip_and_a_missing_fusion_does_not_apply() {
        let silu = graph_of(Silu, &[&[4]]);
        let fused = graph_of(GeluLinear::default(), &[&[2, 3], &[3, 4], &[4]]);
        let plain = graph_of(Scale { factor: 2.0 }, &[&[4]]);
        assert!(runnable(&NoSilu, &plain));
        // A target without the fusion: nothing to run, and nothing missing either.
        assert!(!runnable(&NoSilu, &fused));
        // A kernel the backend lacks: skipped, which CI (SNUG_REQUIRE_ALL_TESTS) makes a failure.
        let ci = std::env::var(snug_testkit::REQUIRE_ALL_TESTS).ok();
        let lacking = std::panic::catch_unwind(|| runnable(&NoSilu, &silu));
        if snug_testkit::requires_all(ci.as_deref()) {
            assert!(lacking.is_err(), "a missing kernel passed in CI");
        } else {
            assert_eq!(lacking.ok(), Some(false));
        }
    }
}
