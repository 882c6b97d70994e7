//! Graph passes keep the numbers and save the memory they claim, measured by planning.

use snug_cpu::CpuSession;
use snug_graph::ops::AdamW;
use snug_graph::passes::fuse_lm_head_loss;
use snug_graph::{Fusions, OptimizerSpec, StepGraph, Target};
use snug_nn::{GptConfig, ModelGraph};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

fn gpt(vocab: usize) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: 16,
        vocab_size: vocab,
    }
}

/// A session of `step` with initial weights and `tokens` fixed token ids and targets written,
/// after one run; the allocator's peak is checked against the plan's.
fn run_once(cfg: &GptConfig, step: &StepGraph, tokens: usize) -> (CpuSession, usize) {
    let p = plan(step, &PlanOptions::default()).unwrap();
    let peak = p.peak_bytes();
    let alloc = Allocator::default();
    let mut s = CpuSession::new(step.graph.clone(), p, alloc.clone(), 2).unwrap();
    for (slot, (_, v)) in step.params.iter().zip(cfg.init_parameters(4)) {
        s.write_f32(slot.param, &v).unwrap();
    }
    let v = cfg.vocab_size;
    let ids = |a: usize, b: usize| {
        (0..tokens)
            .map(|i| ((i * a + b) % v) as i32)
            .collect::<Vec<_>>()
    };
    s.write_i32(step.inputs[0], &ids(31, 7), v).unwrap();
    s.write_i32(step.inputs[1], &ids(17, 3), v).unwrap();
    s.run(ExecCtx::step(1e-2, 1)).unwrap();
    assert_eq!(alloc.peak_bytes(), peak, "measured peak equals the plan's");
    (s, peak)
}

/// Loss and every gradient of one step, for the model graph as given.
fn loss_and_grads(cfg: &GptConfig, g: ModelGraph, batch: usize) -> (f32, Vec<Vec<f32>>, usize) {
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::None).unwrap();
    let (s, peak) = run_once(cfg, &step, batch * 16);
    let loss = s.read_f32(step.loss).unwrap()[0];
    let grads = step
        .params
        .iter()
        .map(|slot| s.read_f32(slot.grad).unwrap().to_vec())
        .collect();
    (loss, grads, peak)
}

/// The fused LM head + cross-entropy gives the unfused step's loss and gradients (to f32
/// rounding: the sums run in another order, so not bitwise), and its planned peak is lower by
/// about the logits and their gradient.
#[test]
fn fused_lm_head_loss_keeps_the_numbers_and_saves_the_logits() {
    let cfg = gpt(500);
    let batch = 4;
    let plain = cfg.build(batch, 16, 2).unwrap();
    // Chunks of 8 rows: the 64 rows take 8 chunks.
    let (rewritten, fused) = fuse_lm_head_loss(&plain.graph, 8 * 500 * 4).unwrap();
    assert_eq!(fused, 1);
    let fused_graph = plain.clone().rewritten(rewritten).unwrap();
    assert!(fused_graph
        .graph
        .nodes()
        .iter()
        .all(|n| n.op.name() != "cross_entropy"));

    let (l0, g0, peak0) = loss_and_grads(&cfg, plain, batch);
    let (l1, g1, peak1) = loss_and_grads(&cfg, fused_graph, batch);
    assert!((l0 - l1).abs() <= 1e-6 * l0.abs(), "{l0} vs {l1}");
    for (a, b) in g0.iter().zip(&g1) {
        for (&x, &y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 + 1e-4 * x.abs(), "{x} vs {y}");
        }
    }
    let logits_bytes = batch * 16 * 500 * 4;
    assert!(
        peak0 - peak1 >= logits_bytes,
        "saved {} of at least {logits_bytes}",
        peak0 - peak1
    );
}

/// A target without the CPU's fused kernels runs the plain LayerNorm, GELU and linear layers
/// the builder emits: the same loss and gradients to f32 rounding (the fused kernels normalise
/// and activate inside the GEMM's packing, summing in another order), at a higher planned peak
/// (the normalised rows and the GELU output are stored).
#[test]
fn the_step_without_fusions_gives_the_fused_numbers() {
    let cfg = gpt(64);
    let batch = 4;
    let count = |g: &ModelGraph, op: &str| {
        let nodes = g.graph.nodes().iter();
        nodes.filter(|n| n.op.name() == op).count()
    };
    let run = |fusions: Fusions| {
        let g = cfg
            .build(batch, 16, Target::host(2).with_fusions(fusions))
            .unwrap();
        let ops =
            ["layer_norm_linear", "gelu_linear", "layer_norm", "gelu"].map(|op| count(&g, op));
        let (loss, grads, peak) = loss_and_grads(&cfg, g, batch);
        (ops, loss, grads, peak)
    };
    let (fused_ops, l0, g0, fused_peak) = run(Fusions::ALL);
    let (plain_ops, l1, g1, plain_peak) = run(Fusions::NONE);
    // Two norms and one GELU per layer fused; the final norm has no linear layer to join.
    assert_eq!(fused_ops, [4, 2, 1, 0]);
    assert_eq!(plain_ops, [0, 0, 5, 2]);
    assert!((l0 - l1).abs() <= 1e-5 * l0.abs(), "{l0} vs {l1}");
    assert_eq!(g0.len(), g1.len());
    for (a, b) in g0.iter().zip(&g1) {
        let norm = |v: &[f32]| v.iter().map(|x| (x * x) as f64).sum::<f64>().sqrt();
        let diff: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let rel = norm(&diff) / norm(a).max(f64::MIN_POSITIVE);
        assert!(rel <= 1e-5, "relative gradient difference {rel}");
    }
    assert!(plain_peak > fused_peak, "{plain_peak} vs {fused_peak}");
}

/// The rewritten graph keeps every parameter and builds into a full AdamW step that plans and
/// loads.
#[test]
fn fused_pass_applies_to_a_whole_training_step() {
    let cfg = gpt(64);
    let g = cfg.build(2, 16, 1).unwrap();
    let (r, _) = fuse_lm_head_loss(&g.graph, 1 << 20).unwrap();
    let g = g.rewritten(r).unwrap();
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::AdamW(AdamW::default())).unwrap();
    assert_eq!(step.params.len(), cfg.parameter_shapes().len());
    let p = plan(&step, &PlanOptions::default()).unwrap();
    assert!(CpuSession::new(step.graph.clone(), p, Allocator::default(), 1).is_ok());
}

/// Loss, gradients, updated weights and planned peak of one AdamW step of `step`.
fn run_step(cfg: &GptConfig, step: &StepGraph, batch: usize, seq: usize) -> (Vec<f32>, usize) {
    let (s, peak) = run_once(cfg, step, batch * seq);
    let mut out = vec![s.read_f32(step.loss).unwrap()[0]];
    for slot in &step.params {
        out.extend_from_slice(&s.read_f32(slot.param).unwrap());
    }
    (out, peak)
}

const BATCH: usize = 8;
const SEQ: usize = 64;

/// A GPT of `n_layer` 32-wide layers and its AdamW step at `BATCH × SEQ`.
fn adamw_step(n_layer: usize) -> (GptConfig, StepGraph) {
    let cfg = GptConfig {
        n_layer,
        n_head: 2,
        n_embd: 32,
        block_size: SEQ,
        vocab_size: 50,
    };
    let g = cfg.build(BATCH, SEQ, 2).unwrap();
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::AdamW(AdamW::default())).unwrap();
    (cfg, step)
}

/// Per-block and selective rematerialization give the same loss and the same updated weights,
/// bit for bit, at a lower planned peak (and the runtime holds exactly that peak).
#[test]
fn remat_keeps_the_numbers_bitwise_and_lowers_the_peak() {
    use snug_graph::passes::{rematerialize, RematPolicy};
    let (cfg, step) = adamw_step(4);
    let (batch, seq) = (BATCH, SEQ);
    let (plain, plain_peak) = run_step(&cfg, &step, batch, seq);
    let mut peaks = Vec::new();
    for policy in [
        RematPolicy::Uniform {
            blocks_per_segment: 1,
        },
        RematPolicy::Uniform {
            blocks_per_segment: 2,
        },
        RematPolicy::Selective,
    ] {
        let (r, recomputed) = rematerialize(&step, policy).unwrap();
        assert!(recomputed > 0, "{policy:?}");
        let remat = step.rewritten(r, step.forward_nodes).unwrap();
        let (values, peak) = run_step(&cfg, &remat, batch, seq);
        assert!(
            plain == values,
            "{policy:?}: loss {} vs {}",
            plain[0],
            values[0]
        );
        if policy == RematPolicy::Selective {
            // GPT keeps only matmul and attention outputs and the residual stream (norms and
            // GELU are fused into their GEMMs): nothing selective remat drops lowers the peak.
            assert!(peak <= plain_peak, "{policy:?}: {peak} vs {plain_peak}");
        } else {
            assert!(peak < plain_peak, "{policy:?}: {peak} vs {plain_peak}");
        }
        peaks.push(peak);
    }
    // Checkpointing every block keeps less than keeping the matmul outputs.
    assert!(peaks[0] < peaks[2], "{peaks:?}");
}

/// CSE merges a duplicated node and DCE drops an unread chain; loss and gradients stay bitwise
/// the same, and the dead tensor's bytes leave the plan.
#[test]
fn cse_and_dce_remove_duplicates_and_dead_nodes_bitwise() {
    use snug_graph::ops::{Binary, BinaryKind, Gelu, GeluApprox, Reduce, ReduceKind, Scale};
    use snug_graph::passes::{eliminate_common_subexpressions, eliminate_dead_code};
    use snug_graph::Graph;

    let mut g = Graph::new();
    let x = g.parameter("x", &[64, 64]).unwrap();
    let gelu = Gelu {
        approx: GeluApprox::Tanh,
    };
    let a = g.apply1(gelu, &[x]).unwrap();
    let b = g.apply1(gelu, &[x]).unwrap(); // duplicate of `a`
    let c = g
        .apply1(
            Binary {
                kind: BinaryKind::Mul,
            },
            &[a, b],
        )
        .unwrap();
    let dead = g.apply1(Scale { factor: 2.0 }, &[c]).unwrap();
    let _dead2 = g.apply1(Scale { factor: 3.0 }, &[dead]).unwrap();
    let sum = |axis| Reduce {
        kind: ReduceKind::Sum,
        axis,
        keepdim: false,
    };
    let rows = g.apply1(sum(1), &[c]).unwrap();
    let loss = g.apply1(sum(0), &[rows]).unwrap();
    let step = StepGraph::build(g, loss, OptimizerSpec::None).unwrap();

    let run = |step: &StepGraph| {
        let p = plan(step, &PlanOptions::default()).unwrap();
        let peak = p.peak_bytes();
        let mut s = CpuSession::new(step.graph.clone(), p, Allocator::default(), 1).unwrap();
        let v: Vec<f32> = (0..64 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        s.write_f32(step.params[0].param, &v).unwrap();
        s.run(ExecCtx::default()).unwrap();
        let loss = s.read_f32(step.loss).unwrap()[0];
        let grad = s.read_f32(step.params[0].grad).unwrap().to_vec();
        (loss, grad, peak, step.graph.nodes().len())
    };
    let before = run(&step);

    let (r, merged) = eliminate_common_subexpressions(&step.graph).unwrap();
    assert!(
        merged >= 1,
        "the duplicated gelu (and its duplicated gradient work)"
    );
    let forward = r.surviving(step.forward_nodes);
    let step2 = step.rewritten(r, forward).unwrap();
    let (r, dropped) = eliminate_dead_code(&step2.graph).unwrap();
    assert_eq!(dropped, 2, "the two unread scales");
    let forward = r.surviving(step2.forward_nodes);
    let step3 = step2.rewritten(r, forward).unwrap();
    assert_eq!(step3.forward_nodes, step.forward_nodes - 3);

    let after = run(&step3);
    assert_eq!((before.0, &before.1), (after.0, &after.1), "bitwise");
    assert!(after.2 < before.2, "peak {} -> {}", before.2, after.2);
    assert_eq!(after.3, before.3 - merged - 2);
}

/// A byte budget between the plain step's peak and per-block checkpointing's: the chosen plan
/// fits it, recomputes less than per-block checkpointing, and keeps the numbers bitwise.
#[test]
fn budgeted_remat_fits_the_budget_with_less_recompute() {
    use snug_graph::passes::{rematerialize, RematPolicy};
    let (cfg, step) = adamw_step(4);
    let (batch, seq) = (BATCH, SEQ);
    let opts = PlanOptions::default();
    let plain_peak = plan(&step, &opts).unwrap().peak_bytes();
    let (r, _) = rematerialize(
        &step,
        RematPolicy::Uniform {
            blocks_per_segment: 1,
        },
    )
    .unwrap();
    let block = step.rewritten(r, step.forward_nodes).unwrap();
    let block_peak = plan(&block, &opts).unwrap().peak_bytes();
    let block_flops = block.graph.flops() - step.graph.flops();

    let budget = (plain_peak + block_peak) / 2;
    let chosen = snug_compile::remat_for_budget(&step, budget, &opts, |_| Ok(())).unwrap();
    assert!(chosen.plan.peak_bytes() <= budget);
    assert_ne!(chosen.choice, "none");
    assert!(chosen.dropped < chosen.candidates);
    assert!(chosen.recompute_flops < block_flops);
    let (plain, _) = run_step(&cfg, &step, batch, seq);
    let (values, peak) = run_step(&cfg, &chosen.step, batch, seq);
    assert_eq!(peak, chosen.plan.peak_bytes());
    assert!(plain == values, "bitwise");

    // A roomy budget changes nothing; an impossible one names the smallest reachable peak.
    let roomy = snug_compile::remat_for_budget(&step, plain_peak, &opts, |_| Ok(())).unwrap();
    assert_eq!(roomy.dropped, 0);
    match snug_compile::remat_for_budget(&step, 1000, &opts, |_| Ok(())) {
        Err(snug_compile::BudgetError::DoesNotFit { budget, smallest }) => {
            assert_eq!(budget, 1000);
            assert!(smallest > 1000 && smallest < plain_peak);
        }
        other => panic!("expected DoesNotFit, got {:?}", other.map(|c| c.dropped)),
    }
}

/// Writing ops over inputs that die at them keeps a GPT step's loss and updated weights
/// bitwise, with and without rematerialization, and lowers its planned peak, which the
/// runtime then holds exactly (`run_once` checks it).
#[test]
fn in_place_keeps_the_numbers_bitwise() {
    use snug_graph::passes::{rematerialize, write_in_place, RematPolicy};
    let (cfg, plain) = adamw_step(3);
    let (batch, seq) = (BATCH, SEQ);
    let (r, _) = rematerialize(&plain, RematPolicy::Selective).unwrap();
    let selective = plain.rewritten(r, plain.forward_nodes).unwrap();
    for step in [plain, selective] {
        let (before, before_peak) = run_step(&cfg, &step, batch, seq);
        let (graph, marked) = write_in_place(&step.graph).unwrap();
        assert!(marked >= 3 * cfg.n_layer, "{marked} nodes in place");
        let names: Vec<&str> = graph
            .nodes()
            .iter()
            .filter(|n| n.inplace.is_some())
            .map(|n| n.op.name())
            .collect();
        assert!(names.contains(&"layer_norm_backward"), "{names:?}");
        // Its dh over h, which the forward read before it.
        assert!(names.contains(&"gelu_linear_backward"), "{names:?}");
        // Its dx over the residual stream, which the block's forward read before it.
        assert!(names.contains(&"layer_norm_linear_backward"), "{names:?}");
        assert!(names.contains(&"add"), "{names:?}");
        let in_place = StepGraph { graph, ..step };
        let (after, after_peak) = run_step(&cfg, &in_place, batch, seq);
        assert!(before == after, "loss {} vs {}", before[0], after[0]);
        // The peak sits in the last MLP's backward, where dh now takes h's place.
        assert!(after_peak < before_peak, "{before_peak} -> {after_peak}");
    }
}

/// Where elementwise gradients die at the op that follows them, in-place lowers the planned
/// peak and the runtime holds it, with the same gradient bit for bit.
#[test]
fn in_place_lowers_the_peak_of_an_elementwise_chain() {
    use snug_graph::ops::{Gelu, Reduce, ReduceKind};
    use snug_graph::passes::write_in_place;
    use snug_graph::{DType, Graph, Role};
    let n = 1 << 16;
    let mut g = Graph::new().with_threads(2);
    let x = g.add_leaf("x", &[n], DType::F32, Role::Parameter).unwrap();
    let mut y = x;
    for _ in 0..3 {
        y = g.apply1(Gelu::default(), &[y]).unwrap();
    }
    let sum = Reduce {
        kind: ReduceKind::Sum,
        axis: 0,
        keepdim: false,
    };
    let loss = g.apply1(sum, &[y]).unwrap();
    let step = StepGraph::build(g, loss, OptimizerSpec::None).unwrap();
    let values: Vec<f32> = (0..n).map(|i| (i % 97) as f32 / 32.0 - 1.5).collect();
    let grad_and_peak = |step: &StepGraph| {
        let p = plan(step, &PlanOptions::default()).unwrap();
        let peak = p.peak_bytes();
        let alloc = Allocator::default();
        let mut s = CpuSession::new(step.graph.clone(), p, alloc.clone(), 2).unwrap();
        s.write_f32(step.params[0].param, &values).unwrap();
        s.run(ExecCtx::default()).unwrap();
        assert_eq!(alloc.peak_bytes(), peak);
        (s.read_f32(step.params[0].grad).unwrap().to_vec(), peak)
    };
    let (before, before_peak) = grad_and_peak(&step);
    let (graph, marked) = write_in_place(&step.graph).unwrap();
    assert!(marked >= 2, "{marked} nodes in place");
    let (after, after_peak) = grad_and_peak(&StepGraph { graph, ..step });
    assert!(before == after);
    // At least one n-element gradient fewer at once.
    assert!(
        after_peak + 4 * n <= before_peak,
        "{before_peak} -> {after_peak}"
    );
}
