//! The loss mask of cross-entropy and of the fused LM-head loss: the loss is `Σ mask·ce /
//! divisor`, against values computed here in f64; targets the mask drops contribute nothing
//! to the loss or to any gradient, whatever their rows hold; nothing counted is a loss of 0
//! with zero gradients, not NaN; and an all-ones mask over the row count gives the unmasked
//! op's numbers bit for bit. (Gradients against finite differences: `op_gradients.rs`.)

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_cpu::CpuSession;
use snug_graph::ops::{CrossEntropy, LmHeadLoss, MatMul};
use snug_graph::{DType, Graph, OptimizerSpec, StepGraph};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

/// Tokens, width and vocabulary of every case.
const N: usize = 7;
const C: usize = 5;
const V: usize = 6;

/// How the loss is computed from `x [N, C]` and the head `w [C, V]`.
#[derive(Debug, Clone, Copy)]
enum Loss {
    /// `cross_entropy(matmul(x, w), targets)`.
    Plain,
    /// `lm_head_loss(x, w, targets)` in tiles of `rows × cols` on `threads` threads.
    Fused {
        rows: usize,
        cols: usize,
        threads: usize,
    },
}

const LOSSES: [Loss; 4] = [
    Loss::Plain,
    Loss::Fused {
        rows: 100,
        cols: 100,
        threads: 1,
    },
    Loss::Fused {
        rows: 2,
        cols: 4,
        threads: 2,
    },
    Loss::Fused {
        rows: 3,
        cols: 6,
        threads: 1,
    },
];

#[derive(Debug, Clone)]
struct Case {
    x: Vec<f32>,
    w: Vec<f32>,
    targets: Vec<i32>,
}

fn case(seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut uniform =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (x, w) = (uniform(N * C), uniform(C * V));
    let targets = (0..N as i32).map(|r| (r * 5 + 2) % V as i32).collect();
    Case { x, w, targets }
}

/// The loss and the gradients of `x` and `w`, under `mask` (weights and divisor) if given.
fn run(loss: Loss, case: &Case, mask: Option<(&[f32], f32)>) -> (f32, Vec<f32>, Vec<f32>) {
    let threads = match loss {
        Loss::Plain => 1,
        Loss::Fused { threads, .. } => threads,
    };
    let mut g = Graph::new().with_threads(threads);
    let x = g.parameter("x", &[N, C]).unwrap();
    let w = g.parameter("w", &[C, V]).unwrap();
    let targets = g.input("targets", &[N], DType::I32).unwrap();
    let mut ins = vec![x, w, targets];
    let mask_inputs = mask.map(|_| {
        [
            g.input("mask", &[N], DType::F32).unwrap(),
            g.input("divisor", &[], DType::F32).unwrap(),
        ]
    });
    ins.extend(mask_inputs.iter().flatten());
    let out = match loss {
        Loss::Plain => {
            let logits = g.apply1(MatMul::default(), &[x, w]).unwrap();
            let mut ce = vec![logits, targets];
            ce.extend(mask_inputs.iter().flatten());
            g.apply1(CrossEntropy, &ce).unwrap()
        }
        Loss::Fused { rows, cols, .. } => {
            let op = LmHeadLoss {
                tb: false,
                rows,
                cols,
                bf16: false,
            };
            g.apply(op, &ins).unwrap()[0]
        }
    };
    let step = StepGraph::build(g, out, OptimizerSpec::None).unwrap();
    let grad = |p| step.params.iter().find(|s| s.param == p).unwrap().grad;
    let (gx, gw) = (grad(x), grad(w));
    let memory = plan(&step.graph, &PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(step.graph, memory, Allocator::default(), threads).unwrap();
    s.write_f32(x, &case.x).unwrap();
    s.write_f32(w, &case.w).unwrap();
    s.write_i32(targets, &case.targets, V).unwrap();
    if let (Some([m, d]), Some((weights, divisor))) = (mask_inputs, mask) {
        s.write_f32(m, weights).unwrap();
        s.write_f32(d, &[divisor]).unwrap();
    }
    s.run(ExecCtx::default()).unwrap();
    let loss = s.read_f32(step.loss).unwrap()[0];
    let gx = s.read_f32(gx).unwrap().to_vec();
    let gw = s.read_f32(gw).unwrap().to_vec();
    (loss, gx, gw)
}

/// Each row's cross-entropy, in f64.
fn row_losses(case: &Case) -> Vec<f64> {
    (0..N)
        .map(|r| {
            let logits: Vec<f64> = (0..V)
                .map(|j| {
                    (0..C)
                        .map(|k| case.x[r * C + k] as f64 * case.w[k * V + j] as f64)
                        .sum()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            lse - logits[case.targets[r] as usize]
        })
        .collect()
}

const MASK: [f32; N] = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];

#[test]
fn the_masked_loss_is_the_mean_over_the_counted_targets() {
    let c = case(1);
    let ce = row_losses(&c);
    // 4 targets counted; a divisor of 4 is their mean, 2 one of two micro-batches' share.
    let sum: f64 = ce.iter().zip(MASK).map(|(l, m)| l * m as f64).sum();
    for loss in LOSSES {
        for divisor in [4.0f32, 2.0] {
            let (got, _, _) = run(loss, &c, Some((&MASK, divisor)));
            let want = sum / divisor as f64;
            assert!(
                (got as f64 - want).abs() <= 1e-6 * want.abs(),
                "{loss:?} / {divisor}: {got} vs {want}"
            );
        }
        // Unmasked, the plain mean; the hand computation is the same for both.
        let (got, _, _) = run(loss, &c, None);
        let want = ce.iter().sum::<f64>() / N as f64;
        assert!(
            (got as f64 - want).abs() <= 1e-6 * want,
            "{loss:?}: {got} vs {want}"
        );
    }
}

#[test]
fn dropped_targets_contribute_nothing_to_the_loss_or_the_gradients() {
    let a = case(2);
    // The same counted rows; the dropped rows' inputs and targets are anything else.
    let mut b = a.clone();
    for r in (0..N).filter(|&r| MASK[r] == 0.0) {
        for k in 0..C {
            b.x[r * C + k] = 40.0 * (k as f32 - 2.0);
        }
        b.targets[r] = (b.targets[r] + 1) % V as i32;
    }
    for loss in LOSSES {
        let (la, gxa, gwa) = run(loss, &a, Some((&MASK, 4.0)));
        let (lb, gxb, gwb) = run(loss, &b, Some((&MASK, 4.0)));
        assert_eq!(la.to_bits(), lb.to_bits(), "{loss:?}: the loss moved");
        assert_eq!(gwa, gwb, "{loss:?}: the head's gradient moved");
        assert_eq!(gxa, gxb, "{loss:?}: the inputs' gradient moved");
        for r in (0..N).filter(|&r| MASK[r] == 0.0) {
            assert!(
                gxa[r * C..(r + 1) * C].iter().all(|&g| g == 0.0),
                "{loss:?}: row {r} is dropped but has a gradient"
            );
        }
        assert!(
            gxa.iter().any(|&g| g != 0.0),
            "{loss:?}: no gradient at all"
        );
    }
}

#[test]
fn nothing_counted_is_a_zero_loss_with_zero_gradients() {
    let c = case(3);
    let none = [0.0f32; N];
    for loss in LOSSES {
        // A whole step with nothing counted (divisor 0), and a micro-batch with nothing
        // counted in a step whose others did (divisor not 0).
        for divisor in [0.0f32, 3.0] {
            let (l, gx, gw) = run(loss, &c, Some((&none, divisor)));
            assert_eq!(l, 0.0, "{loss:?} / {divisor}");
            assert!(
                gx.iter().chain(&gw).all(|&g| g == 0.0),
                "{loss:?} / {divisor}"
            );
        }
        // Counted targets over a divisor of 0 are still no loss, not infinity.
        let (l, gx, gw) = run(loss, &c, Some((&MASK, 0.0)));
        assert_eq!(l, 0.0, "{loss:?}");
        assert!(gx.iter().chain(&gw).all(|&g| g == 0.0), "{loss:?}");
    }
}

#[test]
fn an_all_ones_mask_is_the_unmasked_loss_bit_for_bit() {
    let c = case(4);
    let ones = [1.0f32; N];
    for loss in LOSSES {
        let (l0, gx0, gw0) = run(loss, &c, None);
        let (l1, gx1, gw1) = run(loss, &c, Some((&ones, N as f32)));
        assert_eq!(l0.to_bits(), l1.to_bits(), "{loss:?}");
        assert_eq!(gx0, gx1, "{loss:?}");
        assert_eq!(gw0, gw1, "{loss:?}");
    }
}

#[test]
fn a_mask_of_the_wrong_shape_is_refused() {
    let mut g = Graph::new();
    let logits = g.parameter("logits", &[N, V]).unwrap();
    let targets = g.input("targets", &[N], DType::I32).unwrap();
    let short = g.input("mask", &[N - 1], DType::F32).unwrap();
    let divisor = g.input("divisor", &[], DType::F32).unwrap();
    let ids = g.input("ids", &[N], DType::I32).unwrap();
    let err = |r: snug_graph::Result<_>| r.expect_err("refused");
    assert!(matches!(
        err(g.apply1(CrossEntropy, &[logits, targets, short, divisor])),
        snug_graph::GraphError::Shape { .. }
    ));
    assert!(matches!(
        err(g.apply1(CrossEntropy, &[logits, targets, ids, divisor])),
        snug_graph::GraphError::DType { index: 2, .. }
    ));
    assert!(matches!(
        err(g.apply1(CrossEntropy, &[logits, targets, divisor])),
        snug_graph::GraphError::Arity { .. }
    ));
}
