//! CPU-only checks beside the conformance suite (`conformance.rs`): graphs planned for other
//! CPU targets, and shape rules that need no backend.

use snug_conformance::forward::Inputs;
use snug_cpu::CpuSession;
use snug_graph::ops::{GeluApprox, GeluLinearBackward, GqaAttention};
use snug_graph::{DType, Graph};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

#[test]
fn gqa_attention_rejects_bad_shapes() {
    let mut g = Graph::new();
    let q = g.input("q", &[1, 3, 12], DType::F32).unwrap();
    let k = g.input("k", &[1, 3, 6], DType::F32).unwrap();
    let v = g.input("v", &[1, 3, 6], DType::F32).unwrap();
    let k_wide = g.input("k_wide", &[1, 3, 8], DType::F32).unwrap();
    let v_short = g.input("v_short", &[1, 2, 6], DType::F32).unwrap();
    let gqa = |n_head, n_kv_head| GqaAttention { n_head, n_kv_head };
    // Query heads of width 3 over 2 kv heads of width 3: fine.
    assert!(g.apply(gqa(4, 2), &[q, k, v]).is_ok());
    // 4 query heads cannot be grouped over 3 kv heads; zero heads make no sense.
    assert!(g.apply(gqa(4, 3), &[q, k, v]).is_err());
    assert!(g.apply(gqa(4, 0), &[q, k, v]).is_err());
    assert!(g.apply(gqa(0, 0), &[q, k, v]).is_err());
    // 12 is not divisible by 5 heads; k's width is not 2 heads of width 3; v's length differs.
    assert!(g.apply(gqa(5, 1), &[q, k, v]).is_err());
    assert!(g.apply(gqa(4, 2), &[q, k_wide, v]).is_err());
    assert!(g.apply(gqa(4, 2), &[q, k, v_short]).is_err());
    assert!(g.apply(gqa(4, 2), &[q, k]).is_err());
}

/// A graph planned for another CPU target runs here: the GELU + linear backward takes its row
/// tile from the workspace the plan gave it (sized for that target's GEMM), so every target's
/// plan gives the same numbers (the weight gradient's tile sums in another order: close, not
/// bitwise).
#[test]
fn gelu_linear_backward_runs_any_targets_plan() {
    use snug_graph::{CpuGemm, Target};
    // Rows the targets tile differently (2^20 elements per tile at most: 682 rows, or 512 in
    // whole depth blocks of 512): two tiles of 682, or three of 455.
    let (rows, k, n) = (1364, 1536, 24);
    let run = |gemm: CpuGemm| -> (usize, Vec<Vec<f32>>) {
        let mut g = Graph::new().with_target(Target::cpu(2, gemm));
        let mut feed = Inputs::default();
        let h = feed.f32(&mut g, &[rows, k]);
        let (w, dy) = (feed.f32(&mut g, &[k, n]), feed.f32(&mut g, &[rows, n]));
        let outs = g
            .apply(
                GeluLinearBackward {
                    approx: GeluApprox::Tanh,
                },
                &[h, w, dy],
            )
            .unwrap();
        for &o in &outs {
            g.mark_output(o);
        }
        let ws = g.nodes().last().and_then(|nd| nd.workspace).unwrap();
        let ws_bytes = g.tensor(ws).size_bytes();
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
        for (t, v) in &feed.f32s {
            s.write_f32(*t, v).unwrap();
        }
        s.run(ExecCtx::default()).unwrap();
        let values = outs
            .iter()
            .map(|&o| s.read_f32(o).unwrap().to_vec())
            .collect();
        (ws_bytes, values)
    };
    let (ws512, a) = run(CpuGemm::Avx512);
    let (_, b) = run(CpuGemm::Avx2);
    let (ws_portable, c) = run(CpuGemm::Portable);
    assert_ne!(ws512, ws_portable, "the targets should tile differently");
    for other in [&b, &c] {
        for (x, y) in a.iter().zip(other.iter()) {
            for (p, q) in x.iter().zip(y) {
                assert!((p - q).abs() <= 1e-4 * (1.0 + p.abs()), "{p} vs {q}");
            }
        }
    }
}
