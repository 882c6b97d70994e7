//! Every op's gradient rule checked against central finite differences of its own CPU kernel.
//!
//! A case builds `loss = Σ op(params…) ⊙ R` for a fixed random `R` (an `Input`, so it gets no
//! gradient), lets [`StepGraph`] append the backward pass, reads the analytic gradient of every
//! parameter, then re-runs the same session with one parameter element moved by `±h` and
//! compares `(loss(p + h) − loss(p − h)) / 2h` with it. The random `R` weights every output
//! element differently, so a rule that is wrong for any one output element shows up.

use rand::seq::{index, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_cpu::CpuSession;
use snug_graph::ops::{
    Binary, BinaryKind, BroadcastTo, CausalAttention, CrossEntropy, Embedding, Gelu, GeluApprox,
    GeluLinear, GeluLinearBackward, GqaAttention, LayerNorm, LayerNormBackward, LayerNormLinear,
    LayerNormLinearBackward, LmHeadLoss, LmHeadLossBackward, LogSoftmax, MatMul, Narrow, Op, Pad,
    Reduce, ReduceKind, Reshape, RmsNorm, Rope, Scale, Silu, Softmax, SumTo, SwiGlu, Transpose,
};
use snug_graph::{DType, Graph, OptimizerSpec, StepGraph, TensorId};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

/// Step of the central difference, relative to the element: `h = REL_STEP · max(1, |x|)`.
const REL_STEP: f32 = 1e-2;

/// Tolerance: `|analytic − numeric| ≤ ATOL + RTOL · |numeric|`.
///
/// Why these values, for f32 kernels: every loss here is a sum of at most a few hundred terms of
/// magnitude ≲ 1, so one loss evaluation carries a rounding error of about 1e-7..1e-6; the
/// central difference divides it by `2h = 2e-2`, giving ≲ 1e-4 of noise. Its truncation error
/// is `h²/6 · |f'''| ≈ 2e-5 · |f'''|`, and the inputs below are kept where `f'''` is O(1)
/// (denominators away from zero, no ties for max, moderate logits). `ATOL = 1e-3` is about 10×
/// that noise, and `RTOL = 5e-3` absorbs the terms that grow with the gradient (sums over
/// broadcast axes, longer dot products). Measured on x86-64, no element of the suite comes
/// within 5× of this tolerance (`--nocapture` prints each case's worst error / tolerance).
/// A sign error (`|a − n| = 2|n|`) or a wrong factor of 1.5 fails for any element with
/// `|n| ≥ MIN_SIGNAL`, and every case requires each parameter to have such an element;
/// `checker_rejects_sign_and_scale_errors` checks that it does fail.
const ATOL: f64 = 1e-3;
const RTOL: f64 = 5e-3;

/// Each parameter needs one probed element whose numeric gradient exceeds this, or the case
/// would prove nothing (the loss might not depend on the parameter at all). Above it, a sign
/// error or a 1.5× factor is at least twice the tolerance.
const MIN_SIGNAL: f64 = 4.0 * ATOL;

/// Parameters up to this many elements are probed exhaustively; bigger ones at `SAMPLE` random
/// elements.
const EXHAUSTIVE: usize = 256;
const SAMPLE: usize = 30;

enum Feed {
    F32(Vec<f32>),
    I32 { data: Vec<i32>, bound: usize },
}

/// One compared gradient element.
#[derive(Debug, Clone)]
struct Probe {
    param: String,
    index: usize,
    analytic: f64,
    numeric: f64,
}

impl Probe {
    fn agrees(&self) -> bool {
        (self.analytic - self.numeric).abs() <= ATOL + RTOL * self.numeric.abs()
    }
}

/// Builder for one gradient-check case.
struct GradCheck {
    label: String,
    graph: Graph,
    rng: ChaCha8Rng,
    params: Vec<(TensorId, Vec<f32>)>,
    feeds: Vec<(TensorId, Feed)>,
    /// Evaluate the perturbed losses on the host (see [`GradCheck::large`]).
    host_loss: bool,
    /// Elements probed besides the random sample of big parameters.
    extra: Vec<(TensorId, Vec<usize>)>,
    /// Parameters the output does not depend on (see [`GradCheck::expect_zero_grad`]).
    zero_grad: Vec<TensorId>,
    rel_step: f32,
}

/// FNV-1a, so that every case gets its own fixed seed from its label.
fn seed_of(label: &str) -> u64 {
    label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl GradCheck {
    fn new(label: impl Into<String>) -> Self {
        Self::with_threads(label, 1)
    }

    fn with_threads(label: impl Into<String>, threads: usize) -> Self {
        let label = label.into();
        GradCheck {
            rng: ChaCha8Rng::seed_from_u64(seed_of(&label)),
            label,
            graph: Graph::new().with_threads(threads),
            params: Vec::new(),
            feeds: Vec::new(),
            host_loss: false,
            extra: Vec::new(),
            zero_grad: Vec::new(),
            rel_step: REL_STEP,
        }
    }

    /// A bigger finite-difference step, for ops that are linear in each single parameter
    /// element (matmul is bilinear): the central difference is then exact at any step, and a
    /// bigger step shrinks the f32 rounding noise of the outputs it moves.
    fn linear_in_each_element(mut self) -> Self {
        self.rel_step = 10.0 * REL_STEP;
        self
    }

    /// `param`'s gradient is zero everywhere (the output does not depend on it, as attention's
    /// queries and keys at a single position): its analytic gradient must agree with that, and
    /// the case does not require a signal from it.
    fn expect_zero_grad(&mut self, param: TensorId) {
        self.zero_grad.push(param);
    }

    /// Probes these elements of `param` too, whatever its size.
    fn probe_also(&mut self, param: TensorId, indices: Vec<usize>) {
        self.extra.push((param, indices));
    }

    /// For outputs of tens of thousands of elements (which take the kernels' multi-chunk
    /// parallel paths): the f32 sum inside the graph would put ~1e-3 of rounding noise into
    /// each loss, far above `ATOL · 2h`. The backward pass still starts from that graph loss,
    /// but the finite differences use `Σ out ⊙ R` summed in f64 on the host, where the output
    /// elements a perturbation does not touch cancel exactly.
    fn large(mut self) -> Self {
        self.host_loss = true;
        self
    }

    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }

    /// Magnitudes uniform in `[lo, hi)` with random signs.
    fn signed(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let m = self.rng.random_range(lo..hi);
                if self.rng.random::<bool>() {
                    m
                } else {
                    -m
                }
            })
            .collect()
    }

    /// A parameter with the given values.
    fn param_with(&mut self, shape: &[usize], values: Vec<f32>) -> TensorId {
        let name = format!("p{}", self.params.len());
        let id = self.graph.parameter(name, shape).unwrap();
        assert_eq!(values.len(), self.graph.tensor(id).numel());
        self.params.push((id, values));
        id
    }

    /// A parameter uniform in `[lo, hi)`.
    fn param_in(&mut self, shape: &[usize], lo: f32, hi: f32) -> TensorId {
        let v = self.uniform(shape.iter().product(), lo, hi);
        self.param_with(shape, v)
    }

    /// A parameter uniform in `[-1, 1)`.
    fn param(&mut self, shape: &[usize]) -> TensorId {
        self.param_in(shape, -1.0, 1.0)
    }

    /// A parameter with magnitudes in `[lo, hi)` and random signs (a safe denominator).
    fn param_away_from_zero(&mut self, shape: &[usize], lo: f32, hi: f32) -> TensorId {
        let v = self.signed(shape.iter().product(), lo, hi);
        self.param_with(shape, v)
    }

    /// A parameter whose elements are distinct and at least 0.1 apart (no ties for max, even
    /// after a `±h` perturbation).
    fn param_distinct(&mut self, shape: &[usize]) -> TensorId {
        let n: usize = shape.iter().product();
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 0.1).collect();
        v.shuffle(&mut self.rng);
        self.param_with(shape, v)
    }

    /// An i32 input of ids in `0..bound`.
    fn ids(&mut self, shape: &[usize], bound: usize) -> TensorId {
        let n: usize = shape.iter().product();
        let data: Vec<i32> = (0..n)
            .map(|_| self.rng.random_range(0..bound as i32))
            .collect();
        self.ids_with(shape, data, bound)
    }

    fn ids_with(&mut self, shape: &[usize], data: Vec<i32>, bound: usize) -> TensorId {
        let name = format!("ids{}", self.feeds.len());
        let id = self.graph.input(name, shape, DType::I32).unwrap();
        self.feeds.push((id, Feed::I32 { data, bound }));
        id
    }

    /// An f32 input (it gets no gradient) holding `values`.
    fn input_with(&mut self, shape: &[usize], values: Vec<f32>) -> TensorId {
        let name = format!("in{}", self.feeds.len());
        let id = self.graph.input(name, shape, DType::F32).unwrap();
        self.feeds.push((id, Feed::F32(values)));
        id
    }

    /// A loss mask over `n` rows dropping every third row, and a divisor (as a trainer feeds
    /// for one of several micro-batches: not the count itself).
    fn loss_mask(&mut self, n: usize) -> [TensorId; 2] {
        let mask: Vec<f32> = (0..n).map(|r| if r % 3 == 1 { 0.0 } else { 1.0 }).collect();
        let divisor = mask.iter().sum::<f32>() * 0.75;
        [
            self.input_with(&[n], mask),
            self.input_with(&[], vec![divisor]),
        ]
    }

    /// Applies `op` and returns its first output.
    fn op(&mut self, op: impl Into<Op>, inputs: &[TensorId]) -> TensorId {
        self.graph.apply(op, inputs).unwrap()[0]
    }

    /// Builds the loss on `out`, runs forward and backward, and probes every parameter.
    fn probes(mut self, out: TensorId) -> (String, Vec<Probe>) {
        let shape = self.graph.tensor(out).shape.clone();
        let n: usize = shape.iter().product();
        let r = self.graph.input("r", &shape, DType::F32).unwrap();
        // Magnitudes away from zero, so that a single output (a loss) is weighted visibly too.
        let r_values = self.signed(n, 0.5, 1.5);
        self.feeds.push((r, Feed::F32(r_values.clone())));
        if self.host_loss {
            self.graph.mark_output(out);
        }
        let weighted = self.op(Binary::mul(), &[out, r]);
        let flat = self.op(Reshape { shape: vec![n] }, &[weighted]);
        let loss = self.op(
            Reduce {
                kind: ReduceKind::Sum,
                axis: 0,
                keepdim: false,
            },
            &[flat],
        );

        let threads = self.graph.threads();
        let step = StepGraph::build(self.graph, loss, OptimizerSpec::None).unwrap();
        let grads: Vec<TensorId> = self
            .params
            .iter()
            .map(|(p, _)| {
                step.params
                    .iter()
                    .find(|s| s.param == *p)
                    .expect("every parameter has a slot")
                    .grad
            })
            .collect();
        let memory = plan(&step.graph, &PlanOptions::default()).unwrap();
        let mut session =
            CpuSession::new(step.graph, memory, Allocator::default(), threads).unwrap();
        assert_eq!(session.threads(), threads);
        let feeds = &self.feeds;
        let (host_loss, label) = (self.host_loss, &self.label);
        // Inputs live in the arena and may be overwritten once read: feed them before every run.
        let loss_at = |session: &mut CpuSession| -> f64 {
            for (id, feed) in feeds {
                match feed {
                    Feed::F32(v) => session.write_f32(*id, v).unwrap(),
                    Feed::I32 { data, bound } => session.write_i32(*id, data, *bound).unwrap(),
                }
            }
            session.run(ExecCtx::default()).unwrap();
            let graph_loss = session.read_f32(step.loss).unwrap()[0] as f64;
            if !host_loss {
                return graph_loss;
            }
            let y = session.read_f32(out).unwrap();
            let host: f64 = y
                .iter()
                .zip(&r_values)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let scale: f64 = y
                .iter()
                .zip(&r_values)
                .map(|(&a, &b)| (a * b).abs() as f64)
                .sum();
            // The graph's own loss is the same sum, up to f32 rounding.
            assert!(
                (graph_loss - host).abs() <= 1e-5 * scale + 1e-6,
                "{label}: graph loss {graph_loss} differs from Σ out ⊙ R = {host}"
            );
            host
        };

        for (p, values) in &self.params {
            session.write_f32(*p, values).unwrap();
        }
        let base = loss_at(&mut session);
        assert!(base.is_finite(), "{}: loss is {base}", self.label);
        let analytic: Vec<Vec<f32>> = grads
            .iter()
            .map(|&g| session.read_f32(g).unwrap().to_vec())
            .collect();

        let mut probes = Vec::new();
        for (k, (p, values)) in self.params.iter().enumerate() {
            let len = values.len();
            let mut indices: Vec<usize> = if len <= EXHAUSTIVE {
                (0..len).collect()
            } else {
                index::sample(&mut self.rng, len, SAMPLE).into_vec()
            };
            for (_, extra) in self.extra.iter().filter(|(q, _)| q == p) {
                for &i in extra {
                    if !indices.contains(&i) {
                        indices.push(i);
                    }
                }
            }
            let mut moved = values.clone();
            for i in indices {
                let x = values[i];
                let h = self.rel_step * x.abs().max(1.0);
                let (xp, xm) = (x + h, x - h);
                moved[i] = xp;
                session.write_f32(*p, &moved).unwrap();
                let lp = loss_at(&mut session);
                moved[i] = xm;
                session.write_f32(*p, &moved).unwrap();
                let lm = loss_at(&mut session);
                moved[i] = x;
                // The step actually taken, after rounding `x ± h` to f32.
                let numeric = (lp - lm) / (xp as f64 - xm as f64);
                probes.push(Probe {
                    param: format!("p{k}"),
                    index: i,
                    analytic: analytic[k][i] as f64,
                    numeric,
                });
            }
            session.write_f32(*p, values).unwrap();
        }
        (self.label, probes)
    }

    /// Runs the case and panics with every disagreeing element.
    fn check(self, out: TensorId) {
        let zero: Vec<bool> = self
            .params
            .iter()
            .map(|(p, _)| self.zero_grad.contains(p))
            .collect();
        let (label, probes) = self.probes(out);
        assert_agree(&label, &probes);
        for (k, &zero) in zero.iter().enumerate() {
            let name = format!("p{k}");
            let signal = probes
                .iter()
                .filter(|p| p.param == name)
                .map(|p| p.numeric.abs())
                .fold(0.0, f64::max);
            if zero {
                let analytic = probes
                    .iter()
                    .filter(|p| p.param == name)
                    .map(|p| p.analytic.abs())
                    .fold(0.0, f64::max);
                assert!(
                    signal <= ATOL && analytic <= ATOL,
                    "{label}: gradient of {name} should be zero, got analytic {analytic:e}, \
                     numeric {signal:e}"
                );
                continue;
            }
            assert!(
                signal > MIN_SIGNAL,
                "{label}: gradient of {name} is ~0 everywhere ({signal:e}); the case proves nothing"
            );
        }
    }
}

fn worst(probes: &[Probe]) -> f64 {
    probes
        .iter()
        .map(|p| (p.analytic - p.numeric).abs() / (ATOL + RTOL * p.numeric.abs()))
        .fold(0.0, f64::max)
}

fn assert_agree(label: &str, probes: &[Probe]) {
    // Shown with --nocapture: how close each case comes to its tolerance (1.0 = at the limit).
    println!(
        "{label}: {} elements, worst error / tolerance = {:.3}",
        probes.len(),
        worst(probes)
    );
    // GRADCHECK_DUMP=1 (with --nocapture) lists every compared element.
    if std::env::var("GRADCHECK_DUMP").is_ok() {
        for p in probes {
            println!(
                "  {}[{}]: analytic {:+.6} numeric {:+.6}",
                p.param, p.index, p.analytic, p.numeric
            );
        }
    }
    let bad: Vec<String> = probes
        .iter()
        .filter(|p| !p.agrees())
        .map(|p| {
            format!(
                "  {}[{}]: analytic {:+.6} numeric {:+.6}",
                p.param, p.index, p.analytic, p.numeric
            )
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{label}: {} of {} gradient elements disagree with finite differences:\n{}",
        bad.len(),
        probes.len(),
        bad.join("\n")
    );
}

fn reduce(kind: ReduceKind, axis: usize, keepdim: bool) -> Reduce {
    Reduce {
        kind,
        axis,
        keepdim,
    }
}

// ---------------------------------------------------------------------------------------------
// The checker itself

#[test]
fn checker_rejects_sign_and_scale_errors() {
    let mut c = GradCheck::new("self-test");
    let x = c.param(&[3, 4]);
    let w = c.param_in(&[4], 0.5, 1.5);
    let b = c.param(&[4]);
    let y = c.op(LayerNorm::default(), &[x, w, b]);
    let (label, probes) = c.probes(y);
    assert_agree(&label, &probes);

    let flipped: Vec<Probe> = probes
        .iter()
        .map(|p| Probe {
            analytic: -p.analytic,
            ..p.clone()
        })
        .collect();
    let scaled: Vec<Probe> = probes
        .iter()
        .map(|p| Probe {
            analytic: 1.5 * p.analytic,
            ..p.clone()
        })
        .collect();
    for (what, wrong) in [("sign", flipped), ("factor 1.5", scaled)] {
        for param in ["p0", "p1", "p2"] {
            assert!(
                wrong.iter().any(|p| p.param == param && !p.agrees()),
                "a {what} error in the gradient of {param} would go unnoticed"
            );
        }
        assert!(
            std::panic::catch_unwind(|| assert_agree("wrong", &wrong)).is_err(),
            "a {what} error would pass"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// MatMul

#[test]
fn matmul_2d_every_transpose_with_and_without_bias() {
    let (m, k, n) = (3, 4, 5);
    for ta in [false, true] {
        for tb in [false, true] {
            for bias in [false, true] {
                let mut c = GradCheck::new(format!("matmul 2-D ta={ta} tb={tb} bias={bias}"));
                let a = c.param(&if ta { [k, m] } else { [m, k] });
                let b = c.param(&if tb { [n, k] } else { [k, n] });
                let mut ins = vec![a, b];
                if bias {
                    ins.push(c.param(&[n]));
                }
                let y = c.op(MatMul { ta, tb, bias }, &ins);
                c.check(y);
            }
        }
    }
}

#[test]
fn matmul_shared_weight_over_batched_left_operand() {
    let (k, n) = (4, 5);
    for a_shape in [vec![2, 3, k], vec![2, 2, 3, k]] {
        for tb in [false, true] {
            for bias in [false, true] {
                let mut c =
                    GradCheck::new(format!("matmul shared a={a_shape:?} tb={tb} bias={bias}"));
                let a = c.param(&a_shape);
                let b = c.param(&if tb { [n, k] } else { [k, n] });
                let mut ins = vec![a, b];
                if bias {
                    ins.push(c.param(&[n]));
                }
                let y = c.op(
                    MatMul {
                        ta: false,
                        tb,
                        bias,
                    },
                    &ins,
                );
                c.check(y);
            }
        }
    }
}

#[test]
fn matmul_fully_batched_every_transpose() {
    let (m, k, n) = (3, 4, 5);
    // Two threads with a batch of 2 takes the kernel's batch-parallel path.
    for threads in [1, 2] {
        for batch in [vec![2], vec![2, 2]] {
            for ta in [false, true] {
                for tb in [false, true] {
                    let bias = ta != tb;
                    let mut c = GradCheck::with_threads(
                        format!(
                            "matmul batched {batch:?} ta={ta} tb={tb} bias={bias} threads={threads}"
                        ),
                        threads,
                    );
                    let a_last: [usize; 2] = if ta { [k, m] } else { [m, k] };
                    let b_last: [usize; 2] = if tb { [n, k] } else { [k, n] };
                    let a = c.param(&[batch.as_slice(), &a_last].concat());
                    let b = c.param(&[batch.as_slice(), &b_last].concat());
                    let mut ins = vec![a, b];
                    if bias {
                        ins.push(c.param(&[n]));
                    }
                    let y = c.op(MatMul { ta, tb, bias }, &ins);
                    c.check(y);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Binary and Scale

/// Shape pairs covering every broadcast mapping of the kernels: same shape, a trailing block
/// (`[4]`, `[1,3,4]`), a leading block (`[2,3,1]`), strided (`[2,1,4]` with `[3,1]`), and a
/// single element, each with the broadcast operand on either side.
fn broadcast_pairs() -> Vec<(Vec<usize>, Vec<usize>)> {
    vec![
        (vec![2, 3, 4], vec![2, 3, 4]),
        (vec![2, 3, 4], vec![4]),
        (vec![4], vec![2, 3, 4]),
        (vec![2, 1, 4], vec![3, 1]),
        (vec![3, 1], vec![2, 1, 4]),
        (vec![2, 3], vec![1]),
        (vec![1], vec![2, 3]),
        (vec![2, 3, 1], vec![2, 3, 4]),
        (vec![2, 3, 4], vec![1, 3, 4]),
        (vec![2, 3, 4], vec![2, 3, 1]),
    ]
}

fn check_binary(kind: BinaryKind) {
    for (sa, sb) in broadcast_pairs() {
        let mut c = GradCheck::new(format!("{kind:?} {sa:?} with {sb:?}"));
        let a = c.param(&sa);
        let b = if kind == BinaryKind::Div {
            c.param_away_from_zero(&sb, 0.8, 1.6)
        } else {
            c.param(&sb)
        };
        let y = c.op(Binary { kind }, &[a, b]);
        c.check(y);
    }
}

#[test]
fn binary_add_with_broadcasting() {
    check_binary(BinaryKind::Add);
}

#[test]
fn binary_sub_with_broadcasting() {
    check_binary(BinaryKind::Sub);
}

#[test]
fn binary_mul_with_broadcasting() {
    check_binary(BinaryKind::Mul);
}

#[test]
fn binary_div_with_broadcasting() {
    check_binary(BinaryKind::Div);
}

#[test]
fn binary_with_one_tensor_on_both_sides() {
    // x ⊙ x, x + x and (x − x) + x: the contributions to x's gradient must be summed (fan-out).
    for kind in [BinaryKind::Mul, BinaryKind::Sub, BinaryKind::Add] {
        let mut c = GradCheck::new(format!("{kind:?} x with x"));
        let x = c.param(&[3, 4]);
        let y = c.op(Binary { kind }, &[x, x]);
        if kind == BinaryKind::Sub {
            // x − x is constant: check through a second use instead, (x − x) + x.
            let z = c.op(Binary::add(), &[y, x]);
            c.check(z);
        } else {
            c.check(y);
        }
    }
}

#[test]
fn scale() {
    for factor in [-1.7, 0.25] {
        let mut c = GradCheck::new(format!("scale {factor}"));
        let x = c.param(&[2, 3, 4]);
        let y = c.op(Scale { factor }, &[x]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Reductions and broadcasts

fn check_reduce(kind: ReduceKind) {
    for axis in 0..3 {
        for keepdim in [true, false] {
            let mut c = GradCheck::new(format!("{kind:?} axis={axis} keepdim={keepdim}"));
            let x = if kind == ReduceKind::Max {
                c.param_distinct(&[2, 3, 4])
            } else {
                c.param(&[2, 3, 4])
            };
            let y = c.op(reduce(kind, axis, keepdim), &[x]);
            c.check(y);
        }
    }
}

#[test]
fn reduce_sum() {
    check_reduce(ReduceKind::Sum);
}

#[test]
fn reduce_mean() {
    check_reduce(ReduceKind::Mean);
}

#[test]
fn reduce_max() {
    check_reduce(ReduceKind::Max);
}

#[test]
fn sum_to() {
    let targets: [&[usize]; 9] = [
        &[4],
        &[3, 1],
        &[1, 3, 4],
        &[2, 1, 4],
        &[2, 3, 1],
        &[1],
        &[3, 4],
        &[1, 1, 1],
        &[2, 3, 4],
    ];
    for shape in targets {
        let mut c = GradCheck::new(format!("sum_to {shape:?}"));
        let x = c.param(&[2, 3, 4]);
        let y = c.op(
            SumTo {
                shape: shape.to_vec(),
            },
            &[x],
        );
        c.check(y);
    }
}

#[test]
fn broadcast_to() {
    let cases: [(&[usize], &[usize]); 7] = [
        (&[4], &[2, 3, 4]),
        (&[3, 1], &[2, 3, 4]),
        (&[2, 1, 4], &[2, 3, 4]),
        (&[2, 3, 1], &[2, 3, 4]),
        (&[1, 3, 4], &[2, 3, 4]),
        (&[1], &[2, 3]),
        (&[2, 3], &[2, 3]),
    ];
    for (from, to) in cases {
        let mut c = GradCheck::new(format!("broadcast_to {from:?} -> {to:?}"));
        let x = c.param(from);
        let y = c.op(BroadcastTo { shape: to.to_vec() }, &[x]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax, normalisation, activations

#[test]
fn softmax() {
    for shape in [vec![2, 3, 5], vec![1, 7]] {
        let mut c = GradCheck::new(format!("softmax {shape:?}"));
        let x = c.param_in(&shape, -2.0, 2.0);
        let y = c.op(Softmax, &[x]);
        c.check(y);
    }
}

#[test]
fn log_softmax() {
    for shape in [vec![2, 3, 5], vec![1, 7]] {
        let mut c = GradCheck::new(format!("log_softmax {shape:?}"));
        let x = c.param_in(&shape, -2.0, 2.0);
        let y = c.op(LogSoftmax, &[x]);
        c.check(y);
    }
}

#[test]
fn layer_norm_input_weight_and_bias() {
    // Two threads split the rows between two partial dw/db sums (evenly for 6 rows, not for 3).
    for (shape, threads) in [
        (vec![2, 3, 8], 1),
        (vec![2, 3, 8], 2),
        (vec![3, 8], 2),
        (vec![1, 5], 2),
    ] {
        let c_dim = *shape.last().unwrap();
        let mut c =
            GradCheck::with_threads(format!("layer_norm {shape:?} threads={threads}"), threads);
        let x = c.param(&shape);
        let w = c.param_in(&[c_dim], 0.5, 1.5);
        let b = c.param_in(&[c_dim], -0.5, 0.5);
        let y = c.op(LayerNorm::default(), &[x, w, b]);
        c.check(y);
    }
}

#[test]
fn layer_norm_linear_all_five_inputs() {
    // Two threads split each tile's rows between two partial norm-gradient sums (unevenly
    // for 3 rows).
    for (shape, threads) in [(vec![2, 3, 8], 1), (vec![2, 3, 8], 2), (vec![3, 8], 2)] {
        let k = *shape.last().unwrap();
        let name = format!("layer_norm_linear {shape:?} threads={threads}");
        let mut c = GradCheck::with_threads(name, threads);
        let x = c.param(&shape);
        let lw = c.param_in(&[k], 0.5, 1.5);
        let lb = c.param_in(&[k], -0.5, 0.5);
        let w = c.param(&[k, 5]);
        let b = c.param(&[5]);
        let y = c.op(LayerNormLinear::default(), &[x, lw, lb, w, b]);
        c.check(y);
    }
}

#[test]
fn gelu_exact_and_tanh() {
    for approx in [GeluApprox::Exact, GeluApprox::Tanh] {
        let mut c = GradCheck::new(format!("gelu {approx:?}"));
        let x = c.param_in(&[4, 6], -3.0, 3.0);
        let y = c.op(Gelu { approx }, &[x]);
        c.check(y);
    }
}

#[test]
fn gelu_linear_input_weight_and_bias() {
    for approx in [GeluApprox::Exact, GeluApprox::Tanh] {
        let mut c = GradCheck::new(format!("gelu_linear {approx:?}")).linear_in_each_element();
        // Small steps for `h`, where GELU is curved: the larger step suits only `w` and `b`.
        c.rel_step = REL_STEP;
        let h = c.param_in(&[2, 3, 5], -3.0, 3.0);
        let w = c.param(&[5, 4]);
        let b = c.param(&[4]);
        let y = c.op(GeluLinear { approx }, &[h, w, b]);
        c.check(y);
    }
}

/// The fused op computes what `gelu` then a biased `matmul` compute: over several row tiles
/// (an output too narrow for our GEMM kernel), and through that kernel where the CPU has it
/// (GELU made as the kernel packs `h`, the bias added as it stores `y`).
#[test]
fn gelu_linear_equals_gelu_then_matmul() {
    // At most 2^21 elements per tile: at width 64, 33000 rows take two tiles.
    gelu_linear_against_unfused(33000, 64, 3);
    gelu_linear_against_unfused(3000, 64, 40);
}

fn gelu_linear_against_unfused(rows: usize, k: usize, n: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut values =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-3.0..3.0f32)).collect() };
    let (hv, wv, bv) = (values(rows * k), values(k * n), values(n));
    let run = |fused: bool| -> Vec<f32> {
        let mut g = Graph::new().with_threads(2);
        let h = g.input("h", &[rows, k], DType::F32).unwrap();
        let w = g.input("w", &[k, n], DType::F32).unwrap();
        let b = g.input("b", &[n], DType::F32).unwrap();
        let approx = GeluApprox::Tanh;
        let y = if fused {
            g.apply1(GeluLinear { approx }, &[h, w, b]).unwrap()
        } else {
            let a = g.apply1(Gelu { approx }, &[h]).unwrap();
            let linear = MatMul {
                ta: false,
                tb: false,
                bias: true,
            };
            g.apply1(linear, &[a, w, b]).unwrap()
        };
        g.mark_output(y);
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
        s.write_f32(h, &hv).unwrap();
        s.write_f32(w, &wv).unwrap();
        s.write_f32(b, &bv).unwrap();
        s.run(ExecCtx::default()).unwrap();
        s.read_f32(y).unwrap().to_vec()
    };
    let (fused, plain) = (run(true), run(false));
    let worst = fused
        .iter()
        .zip(&plain)
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0.0f32, f32::max);
    assert!(
        worst < 1e-5,
        "[{rows}, {k}] x [{k}, {n}]: fused and unfused differ by {worst}"
    );
}

/// The fused op computes what `layer_norm` then a biased `matmul` compute, forward and
/// backward: over several row tiles (an output too narrow for our GEMM kernel), and through
/// that kernel where the CPU has it (rows normalised as the kernel packs them, in both
/// orientations).
#[test]
fn layer_norm_linear_equals_layer_norm_then_matmul() {
    // At most 2^21 elements per forward tile and 2^19 per backward one: at width 64, 70000
    // rows take three and nine.
    layer_norm_linear_against_unfused(70000, 64, 3);
    layer_norm_linear_against_unfused(3000, 64, 40);
}

fn layer_norm_linear_against_unfused(rows: usize, k: usize, n: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut values = |len: usize, lo: f32, hi: f32| -> Vec<f32> {
        (0..len).map(|_| rng.random_range(lo..hi)).collect()
    };
    let xv = values(rows * k, -3.0, 3.0);
    let (lwv, lbv) = (values(k, 0.5, 1.5), values(k, -0.5, 0.5));
    let (wv, bv, dyv) = (
        values(k * n, -1.0, 1.0),
        values(n, -1.0, 1.0),
        values(rows * n, -1.0, 1.0),
    );
    let run = |fused: bool| -> Vec<Vec<f32>> {
        let mut g = Graph::new().with_threads(2);
        let x = g.input("x", &[rows, k], DType::F32).unwrap();
        let lw = g.input("lw", &[k], DType::F32).unwrap();
        let lb = g.input("lb", &[k], DType::F32).unwrap();
        let w = g.input("w", &[k, n], DType::F32).unwrap();
        let b = g.input("b", &[n], DType::F32).unwrap();
        let dy = g.input("dy", &[rows, n], DType::F32).unwrap();
        let outs = if fused {
            let y = g
                .apply(LayerNormLinear::default(), &[x, lw, lb, w, b])
                .unwrap();
            let (mean, rstd) = (y[1], y[2]);
            let back = g
                .apply(LayerNormLinearBackward, &[x, lw, lb, mean, rstd, w, dy])
                .unwrap();
            vec![y[0], back[0], back[1], back[2], back[3]]
        } else {
            let ln = g.apply(LayerNorm::default(), &[x, lw, lb]).unwrap();
            let linear = MatMul {
                ta: false,
                tb: false,
                bias: true,
            };
            let y = g.apply1(linear, &[ln[0], w, b]).unwrap();
            let t = MatMul {
                ta: false,
                tb: true,
                bias: false,
            };
            let dln = g.apply1(t, &[dy, w]).unwrap();
            let dw_rule = MatMul {
                ta: true,
                tb: false,
                bias: false,
            };
            let dw = g.apply1(dw_rule, &[ln[0], dy]).unwrap();
            let back = g
                .apply(LayerNormBackward, &[dln, x, lw, ln[1], ln[2]])
                .unwrap();
            vec![y, back[0], back[1], back[2], dw]
        };
        for &o in &outs {
            g.mark_output(o);
        }
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
        for (t, v) in [
            (x, &xv),
            (lw, &lwv),
            (lb, &lbv),
            (w, &wv),
            (b, &bv),
            (dy, &dyv),
        ] {
            s.write_f32(t, v).unwrap();
        }
        s.run(ExecCtx::default()).unwrap();
        outs.iter()
            .map(|&o| s.read_f32(o).unwrap().to_vec())
            .collect()
    };
    let (fused, plain) = (run(true), run(false));
    for (what, (f, p)) in ["y", "dx", "d_ln_w", "d_ln_b", "dw"]
        .iter()
        .zip(fused.iter().zip(&plain))
    {
        // The weight gradients sum 33000 rows: errors are measured against each tensor's
        // largest value (at least 1).
        let scale = p.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let worst = f
            .iter()
            .zip(p)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max)
            / scale;
        assert!(
            worst < 1e-5,
            "[{rows}, {k}] x [{k}, {n}] {what}: fused and unfused differ by {worst}"
        );
    }
}

/// The fused backwards that may write `dx` over `x` (LayerNorm + linear, GELU + linear, the LM
/// head + loss) give the same bits in place as beside it. `x` is made by an op (a graph input
/// is never written over); the LM head's goes through a reshape, a view of a whole storage.
#[test]
fn fused_backwards_in_place_keep_the_bits() {
    // Row tiles of at most 2^19 (LayerNorm) and 2^20 (GELU) elements: 9000 × 64 takes two and
    // one, 20000 × 64 three and two.
    for (rows, k, n) in [(9000, 64, 40), (20000, 64, 3)] {
        in_place_same_bits("layer_norm_linear_backward", |g, feed| {
            let x = made(g, feed, &[rows, k]);
            let (lw, lb) = (feed.f32(g, &[k]), feed.f32(g, &[k]));
            let (w, b, dy) = (
                feed.f32(g, &[k, n]),
                feed.f32(g, &[n]),
                feed.f32(g, &[rows, n]),
            );
            let y = g
                .apply(LayerNormLinear::default(), &[x, lw, lb, w, b])
                .unwrap();
            g.apply(LayerNormLinearBackward, &[x, lw, lb, y[1], y[2], w, dy])
                .unwrap()
        });
        in_place_same_bits("gelu_linear_backward", |g, feed| {
            let h = made(g, feed, &[rows, k]);
            let (w, dy) = (feed.f32(g, &[k, n]), feed.f32(g, &[rows, n]));
            let approx = GeluApprox::Tanh;
            g.apply(GeluLinearBackward { approx }, &[h, w, dy]).unwrap()
        });
    }
    // One tile; row tiles; vocabulary blocks (dx summed apart, then written); both.
    let (n, c, v) = (60, 24, 35);
    for (tb, rows, cols) in [
        (true, 60, 35),
        (false, 16, 35),
        (true, 60, 8),
        (false, 7, 10),
    ] {
        in_place_same_bits("lm_head_loss_backward", |g, feed| {
            let x3 = made(g, feed, &[2, n / 2, c]);
            let x = g.apply1(Reshape { shape: vec![n, c] }, &[x3]).unwrap();
            let shape = if tb { [v, c] } else { [c, v] };
            let w = feed.f32(g, &shape);
            let t = feed.ids(g, n, v);
            let dloss = feed.f32(g, &[]);
            let lse = g.apply(LmHeadLoss { tb, rows, cols }, &[x, w, t]).unwrap()[1];
            let back = LmHeadLossBackward { tb, rows, cols };
            g.apply(back, &[x, w, t, lse, dloss]).unwrap()
        });
    }
}

/// Random values for a graph's inputs, written once the session exists.
#[derive(Default)]
struct Inputs {
    f32s: Vec<(TensorId, Vec<f32>)>,
    i32s: Vec<(TensorId, Vec<i32>, usize)>,
}

impl Inputs {
    fn f32(&mut self, g: &mut Graph, shape: &[usize]) -> TensorId {
        let mut rng = ChaCha8Rng::seed_from_u64(100 + self.f32s.len() as u64);
        let id = g
            .input(format!("in{}", self.f32s.len()), shape, DType::F32)
            .unwrap();
        let len = shape.iter().product();
        let v = (0..len).map(|_| rng.random_range(-2.0..2.0f32)).collect();
        self.f32s.push((id, v));
        id
    }

    fn ids(&mut self, g: &mut Graph, len: usize, bound: usize) -> TensorId {
        let mut rng = ChaCha8Rng::seed_from_u64(200 + self.i32s.len() as u64);
        let id = g
            .input(format!("ids{}", self.i32s.len()), &[len], DType::I32)
            .unwrap();
        let v = (0..len)
            .map(|_| rng.random_range(0..bound as i32))
            .collect();
        self.i32s.push((id, v, bound));
        id
    }
}

/// A tensor an op makes (twice a random input), which can therefore be written over.
fn made(g: &mut Graph, feed: &mut Inputs, shape: &[usize]) -> TensorId {
    let x = feed.f32(g, shape);
    g.apply1(Scale { factor: 2.0 }, &[x]).unwrap()
}

/// Runs the graph `build` makes (its returned tensors are the outputs) as it is and after
/// `write_in_place`, which must mark `op`'s node to write its output 0 over its input 0, and
/// checks that every output has the same bits.
fn in_place_same_bits(op: &str, build: impl Fn(&mut Graph, &mut Inputs) -> Vec<TensorId>) {
    let mut g = Graph::new().with_threads(2);
    let mut feed = Inputs::default();
    let outs = build(&mut g, &mut feed);
    for &o in &outs {
        g.mark_output(o);
    }
    let (in_place, _) = snug_graph::passes::write_in_place(&g).unwrap();
    let node = in_place
        .nodes()
        .iter()
        .find(|nd| nd.op.name() == op)
        .unwrap();
    assert_eq!(node.inplace, Some(0), "{op} is not written in place");
    let run = |g: Graph| -> Vec<Vec<f32>> {
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
        for (t, v) in &feed.f32s {
            s.write_f32(*t, v).unwrap();
        }
        for (t, v, bound) in &feed.i32s {
            s.write_i32(*t, v, *bound).unwrap();
        }
        s.run(ExecCtx::default()).unwrap();
        outs.iter()
            .map(|&o| s.read_f32(o).unwrap().to_vec())
            .collect()
    };
    let (beside, over) = (run(g.clone()), run(in_place));
    for (i, (a, b)) in beside.iter().zip(&over).enumerate() {
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{op}: output {i} differs in place");
    }
}

/// Attention forward and backward against a plain f64 computation, at widths where the
/// kernels' 64-column strips are full (64), and split with a partial one (80), and a length that
/// leaves a partial row block and key strip (200).
#[test]
fn causal_attention_matches_a_plain_computation() {
    use snug_graph::ops::CausalAttentionBackward;
    for (t, d) in [(200, 64), (130, 80)] {
        let (heads, c) = (2, 2 * d);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut values =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect() };
        let (qkv_v, dy_v) = (values(t * 3 * c), values(t * c));
        let mut g = Graph::new().with_threads(2);
        let qkv = g.input("qkv", &[1, t, 3 * c], DType::F32).unwrap();
        let dy = g.input("dy", &[1, t, c], DType::F32).unwrap();
        let fwd = g.apply(CausalAttention { n_head: heads }, &[qkv]).unwrap();
        let back = CausalAttentionBackward { n_head: heads };
        let dqkv = g.apply1(back, &[qkv, fwd[0], fwd[1], dy]).unwrap();
        g.mark_output(fwd[0]);
        g.mark_output(dqkv);
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
        s.write_f32(qkv, &qkv_v).unwrap();
        s.write_f32(dy, &dy_v).unwrap();
        // Twice: the second run finds the first's results in every buffer, so an output that
        // is added to rather than written would show.
        s.run(ExecCtx::default()).unwrap();
        s.run(ExecCtx::default()).unwrap();
        let (y, dqkv) = (
            s.read_f32(fwd[0]).unwrap().to_vec(),
            s.read_f32(dqkv).unwrap().to_vec(),
        );
        let scale = 1.0 / (d as f64).sqrt();
        let at = |x: &[f32], stride: usize, r: usize, col: usize| f64::from(x[r * stride + col]);
        for h in 0..heads {
            let (q0, k0, v0, y0) = (h * d, c + h * d, 2 * c + h * d, h * d);
            let mut want_dqkv = vec![0.0f64; t * 3 * c];
            for i in 0..t {
                let s_row: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|p| at(&qkv_v, 3 * c, i, q0 + p) * at(&qkv_v, 3 * c, j, k0 + p))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = s_row.iter().copied().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s_row.iter().map(|v| (v - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let prob: Vec<f64> = e.iter().map(|v| v / sum).collect();
                let dp: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|p| at(&dy_v, c, i, y0 + p) * at(&qkv_v, 3 * c, j, v0 + p))
                            .sum()
                    })
                    .collect();
                let dot: f64 = prob.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for p in 0..d {
                    let want: f64 = (0..=i)
                        .map(|j| prob[j] * at(&qkv_v, 3 * c, j, v0 + p))
                        .sum();
                    let got = at(&y, c, i, y0 + p);
                    assert!((got - want).abs() < 1e-5, "t={t} d={d} y[{i}, {p}]");
                }
                for j in 0..=i {
                    let ds = prob[j] * (dp[j] - dot) * scale;
                    for p in 0..d {
                        want_dqkv[i * 3 * c + q0 + p] += ds * at(&qkv_v, 3 * c, j, k0 + p);
                        want_dqkv[j * 3 * c + k0 + p] += ds * at(&qkv_v, 3 * c, i, q0 + p);
                        want_dqkv[j * 3 * c + v0 + p] += prob[j] * at(&dy_v, c, i, y0 + p);
                    }
                }
            }
            for r in 0..t {
                for col in [q0, k0, v0].into_iter().flat_map(|o| o..o + d) {
                    let (got, want) = (at(&dqkv, 3 * c, r, col), want_dqkv[r * 3 * c + col]);
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "t={t} d={d} dqkv[{r}, {col}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding, views and layout

#[test]
fn embedding_table() {
    let (vocab, dim) = (7, 4);
    // Repeated ids: their rows' gradients must add up. Id 6 is never used: its row gets zero.
    let fixed = vec![0, 3, 3, 5, 0, 1, 3, 2, 4, 5];
    let mut c = GradCheck::new("embedding [2, 5] ids");
    let table = c.param(&[vocab, dim]);
    let ids = c.ids_with(&[2, 5], fixed, vocab);
    let y = c.op(Embedding, &[table, ids]);
    c.check(y);

    let mut c = GradCheck::new("embedding [6] random ids");
    let table = c.param(&[vocab, dim]);
    let ids = c.ids(&[6], vocab);
    let y = c.op(Embedding, &[table, ids]);
    c.check(y);
}

#[test]
fn reshape() {
    // On a parameter (the output is a view of persistent storage) and on an activation.
    for to in [vec![6, 4], vec![24], vec![4, 3, 2]] {
        let mut c = GradCheck::new(format!("reshape param -> {to:?}"));
        let x = c.param(&[2, 3, 4]);
        let y = c.op(Reshape { shape: to.clone() }, &[x]);
        c.check(y);

        let mut c = GradCheck::new(format!("reshape activation -> {to:?}"));
        let x = c.param(&[2, 3, 4]);
        let s = c.op(Scale { factor: 1.5 }, &[x]);
        let y = c.op(Reshape { shape: to }, &[s]);
        c.check(y);
    }
}

#[test]
fn narrow() {
    let cases: [(&[usize], Narrow); 4] = [
        (&[5, 3], Narrow { start: 1, len: 3 }),
        (&[5, 3], Narrow { start: 0, len: 5 }),
        (&[4, 2, 3], Narrow { start: 2, len: 2 }),
        (&[6], Narrow { start: 4, len: 1 }),
    ];
    for (shape, op) in cases {
        let mut c = GradCheck::new(format!("narrow param {shape:?} {op:?}"));
        let x = c.param(shape);
        let y = c.op(op, &[x]);
        c.check(y);

        let mut c = GradCheck::new(format!("narrow activation {shape:?} {op:?}"));
        let x = c.param(shape);
        let s = c.op(Scale { factor: -0.5 }, &[x]);
        let y = c.op(op, &[s]);
        c.check(y);
    }
}

#[test]
fn pad() {
    let cases: [(&[usize], Pad); 4] = [
        (&[2, 3], Pad { start: 1, total: 5 }),
        (&[2, 2, 3], Pad { start: 0, total: 4 }),
        (&[2, 2, 3], Pad { start: 2, total: 4 }),
        (&[3], Pad { start: 0, total: 3 }),
    ];
    for (shape, op) in cases {
        let mut c = GradCheck::new(format!("pad {shape:?} {op:?}"));
        let x = c.param(shape);
        let y = c.op(op, &[x]);
        c.check(y);
    }
}

#[test]
fn transpose() {
    let cases: [(&[usize], usize, usize); 6] = [
        (&[3, 5], 0, 1),
        (&[2, 3, 4], 0, 1),
        (&[2, 3, 4], 1, 2),
        (&[2, 3, 4], 0, 2),
        (&[2, 3, 4], 2, 0),
        (&[2, 3, 4, 2], 1, 3),
    ];
    for (shape, dim0, dim1) in cases {
        let mut c = GradCheck::new(format!("transpose {shape:?} ({dim0}, {dim1})"));
        let x = c.param(shape);
        let y = c.op(Transpose { dim0, dim1 }, &[x]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention and loss

#[test]
fn causal_attention_two_heads() {
    // [B, T, 3C] with C = 4 (head width 2), one longer sequence with C = 8 (head width 4), and
    // a single position (each query sees only itself), and sequences longer than one 64-row
    // block of the kernel (later row blocks read earlier keys, and add into their gradients).
    for shape in [
        vec![2, 5, 12],
        vec![1, 7, 24],
        vec![1, 1, 12],
        vec![1, 70, 12],
        vec![1, 130, 12],
    ] {
        for threads in [1, 2] {
            let mut c = GradCheck::with_threads(
                format!("causal_attention {shape:?} 2 heads threads={threads}"),
                threads,
            );
            let qkv = c.param(&shape);
            let y = c.op(CausalAttention { n_head: 2 }, &[qkv]);
            c.check(y);
        }
    }
}

#[test]
fn cross_entropy() {
    for (n, v) in [(4, 6), (1, 3)] {
        let mut c = GradCheck::new(format!("cross_entropy [{n}, {v}]"));
        let logits = c.param_in(&[n, v], -2.0, 2.0);
        let targets = c.ids(&[n], v);
        let y = c.op(CrossEntropy, &[logits, targets]);
        c.check(y);
    }
}

/// Under a loss mask, masked rows included (their gradient must be zero, as their finite
/// difference is).
#[test]
fn cross_entropy_masked() {
    for (n, v) in [(5, 6), (4, 3)] {
        let mut c = GradCheck::new(format!("cross_entropy masked [{n}, {v}]"));
        let logits = c.param_in(&[n, v], -2.0, 2.0);
        let targets = c.ids(&[n], v);
        let [mask, divisor] = c.loss_mask(n);
        let y = c.op(CrossEntropy, &[logits, targets, mask, divisor]);
        c.check(y);
    }
}

/// The fused LM-head loss under a loss mask, through row tiles and vocabulary blocks.
#[test]
fn lm_head_loss_masked() {
    let (n, ch, v) = (7, 5, 6);
    for (tb, rows, cols, threads) in [(false, 2, 6, 1), (true, 3, 4, 2), (true, 100, 100, 1)] {
        let label = format!("lm_head_loss masked tb={tb} tile={rows}x{cols} threads={threads}");
        let mut c = GradCheck::with_threads(label, threads);
        let x = c.param_in(&[n, ch], -1.0, 1.0);
        let w = if tb {
            c.param(&[v, ch])
        } else {
            c.param(&[ch, v])
        };
        let targets = c.ids(&[n], v);
        let [mask, divisor] = c.loss_mask(n);
        let y = c.op(
            LmHeadLoss { tb, rows, cols },
            &[x, w, targets, mask, divisor],
        );
        c.check(y);
    }
}

/// The fused, tiled LM head + cross-entropy: several row tiles (the head's gradient
/// accumulates across them), several vocabulary blocks (the online log-sum-exp and `dx`
/// accumulate across them), one tile, a tied `[V, C]` head and an untied `[C, V]` one, 1 and 2
/// threads.
#[test]
fn lm_head_loss() {
    let (n, ch, v) = (7, 5, 6);
    for (tb, rows, cols, threads) in [
        (false, 2, 6, 1),
        (true, 3, 4, 2),
        (true, 100, 100, 1),
        (false, 1, 1, 2),
        (true, 7, 2, 1),
        (false, 4, 5, 2),
    ] {
        let label = format!("lm_head_loss tb={tb} tile={rows}x{cols} threads={threads}");
        let mut c = GradCheck::with_threads(label, threads);
        let x = c.param_in(&[n, ch], -1.0, 1.0);
        let w = if tb {
            c.param(&[v, ch])
        } else {
            c.param(&[ch, v])
        };
        let targets = c.ids(&[n], v);
        let y = c.op(LmHeadLoss { tb, rows, cols }, &[x, w, targets]);
        c.check(y);
    }
}

#[test]
fn small_network_end_to_end() {
    // Embedding → LayerNorm → linear+bias → GELU → attention input → attention → linear →
    // cross-entropy: gradients flow through every rule in sequence, with a residual fan-out.
    let (vocab, b, t, ch) = (5, 2, 3, 4);
    for threads in [1, 2] {
        let mut c = GradCheck::with_threads(format!("small network threads={threads}"), threads);
        let table = c.param(&[vocab, ch]);
        let ids = c.ids(&[b, t], vocab);
        let ln_w = c.param_in(&[ch], 0.5, 1.5);
        let ln_b = c.param_in(&[ch], -0.5, 0.5);
        let w_qkv = c.param(&[ch, 3 * ch]);
        let b_qkv = c.param(&[3 * ch]);
        let w_out = c.param(&[ch, vocab]);
        let x = c.op(Embedding, &[table, ids]);
        let h = c.op(LayerNorm::default(), &[x, ln_w, ln_b]);
        let qkv = c.op(
            MatMul {
                ta: false,
                tb: false,
                bias: true,
            },
            &[h, w_qkv, b_qkv],
        );
        let qkv = c.op(Gelu::default(), &[qkv]);
        let a = c.op(CausalAttention { n_head: 2 }, &[qkv]);
        let r = c.op(Binary::add(), &[a, x]);
        let logits = c.op(MatMul::default(), &[r, w_out]);
        let logits = c.op(
            Reshape {
                shape: vec![b * t, vocab],
            },
            &[logits],
        );
        let targets = c.ids(&[b * t], vocab);
        let loss = c.op(CrossEntropy, &[logits, targets]);
        c.check(loss);
    }
}

// ---------------------------------------------------------------------------------------------
// Large tensors: above `par::MIN_PAR_ELEMS` (32768) elements kernels split their outputs into
// chunks run on several threads, and each chunk must find its own rows.

#[test]
fn large_tensors_through_the_parallel_kernel_paths() {
    let t = 2;
    let big = |label: &str| GradCheck::with_threads(format!("large {label}"), t).large();

    let mut c = big("add [260, 130] + [130]");
    let a = c.param(&[260, 130]);
    let b = c.param(&[130]);
    let y = c.op(Binary::add(), &[a, b]);
    c.check(y);

    let mut c = big("mul [260, 130] * [260, 1]");
    let a = c.param(&[260, 130]);
    let b = c.param(&[260, 1]);
    let y = c.op(Binary::mul(), &[a, b]);
    c.check(y);

    let mut c = big("div [260, 130] / [260, 130]");
    let a = c.param(&[260, 130]);
    let b = c.param_away_from_zero(&[260, 130], 0.8, 1.6);
    let y = c.op(Binary::div(), &[a, b]);
    c.check(y);

    let mut c = big("scale [40000]");
    let x = c.param(&[40000]);
    let y = c.op(Scale { factor: 0.75 }, &[x]);
    c.check(y);

    for (from, to) in [
        (vec![2, 33000], vec![33000]),
        (vec![33000, 2], vec![33000, 1]),
        // A bias gradient: rows split between the workers' partial sums.
        (vec![300, 130], vec![130]),
    ] {
        let mut c = big(&format!("sum_to {from:?} -> {to:?}"));
        let x = c.param(&from);
        let y = c.op(SumTo { shape: to }, &[x]);
        c.check(y);
    }

    let mut c = big("broadcast_to [130] -> [260, 130]");
    let x = c.param(&[130]);
    let y = c.op(
        BroadcastTo {
            shape: vec![260, 130],
        },
        &[x],
    );
    c.check(y);

    for kind in [ReduceKind::Sum, ReduceKind::Mean] {
        for (shape, axis) in [(vec![2, 3, 20000], 1), (vec![40000, 3], 1)] {
            let mut c = big(&format!("{kind:?} {shape:?} axis={axis}"));
            let x = c.param(&shape);
            let y = c.op(reduce(kind, axis, false), &[x]);
            c.check(y);
        }
    }
    let mut c = big("Max [2, 3, 20000] axis=1");
    let n = 2 * 3 * 20000;
    // Spaced 0.1 apart along the reduced axis of each column, in a random order.
    let mut values = vec![0.0f32; n];
    for o in 0..2 {
        for i in 0..20000 {
            let mut col = [-0.1f32, 0.0, 0.1];
            col.shuffle(&mut c.rng);
            let shift = c.rng.random_range(-1.0..1.0f32);
            for (j, v) in col.iter().enumerate() {
                values[(o * 3 + j) * 20000 + i] = v + shift;
            }
        }
    }
    let x = c.param_with(&[2, 3, 20000], values);
    let y = c.op(reduce(ReduceKind::Max, 1, false), &[x]);
    c.check(y);

    let mut c = big("softmax [400, 100]");
    let x = c.param_in(&[400, 100], -2.0, 2.0);
    let y = c.op(Softmax, &[x]);
    c.check(y);

    let mut c = big("log_softmax [400, 100]");
    let x = c.param_in(&[400, 100], -2.0, 2.0);
    let y = c.op(LogSoftmax, &[x]);
    c.check(y);

    let mut c = big("layer_norm [400, 100]");
    let x = c.param(&[400, 100]);
    let w = c.param_in(&[100], 0.5, 1.5);
    let b = c.param_in(&[100], -0.5, 0.5);
    let y = c.op(LayerNorm::default(), &[x, w, b]);
    c.check(y);

    for approx in [GeluApprox::Exact, GeluApprox::Tanh] {
        let mut c = big(&format!("gelu {approx:?} [40000]"));
        let x = c.param_in(&[40000], -3.0, 3.0);
        let y = c.op(Gelu { approx }, &[x]);
        c.check(y);
    }

    // Two row tiles (at most 2^21 elements each), so the weight gradient sums over both.
    let mut c = big("gelu_linear [33000, 64] x [64, 2]");
    let h = c.param_in(&[33000, 64], -3.0, 3.0);
    let w = c.param(&[64, 2]);
    let b = c.param(&[2]);
    let y = c.op(GeluLinear::default(), &[h, w, b]);
    c.check(y);

    // Several row tiles: the weight and norm-weight gradients sum over all of them.
    let mut c = big("layer_norm_linear [33000, 64] x [64, 2]");
    let x = c.param_in(&[33000, 64], -3.0, 3.0);
    let lw = c.param_in(&[64], 0.5, 1.5);
    let lb = c.param_in(&[64], -0.5, 0.5);
    let w = c.param(&[64, 2]);
    let b = c.param(&[2]);
    let y = c.op(LayerNormLinear::default(), &[x, lw, lb, w, b]);
    c.check(y);

    // Big enough for the threaded GEMM, which splits the output into slabs per worker:
    // columns for the product and dA, rows for dB (A read transposed).
    let mut c = big("matmul [300, 70] x [70, 90] + bias").linear_in_each_element();
    let a = c.param(&[300, 70]);
    let b = c.param(&[70, 90]);
    let bias = c.param(&[90]);
    let linear = MatMul {
        ta: false,
        tb: false,
        bias: true,
    };
    let y = c.op(linear, &[a, b, bias]);
    c.check(y);

    let mut c = big("transpose [200, 170]");
    let x = c.param(&[200, 170]);
    let y = c.op(Transpose { dim0: 0, dim1: 1 }, &[x]);
    c.check(y);

    let mut c = big("embedding [50, 700] x 60 ids");
    let table = c.param(&[50, 700]);
    let ids = c.ids(&[60], 50);
    let y = c.op(Embedding, &[table, ids]);
    c.check(y);

    // The loss is one f32 scalar, so finite differences resolve only gradients ≳ 1e-4: few rows
    // (the mean divides by them) of a wide vocabulary, which still makes two chunks of rows.
    // Random elements of such rows have gradients ~1e-4; each row's target element (-1/N) is
    // probed too, and is where a row offset bug would show.
    let (n, v) = (5, 8000);
    let mut c = big(&format!("cross_entropy [{n}, {v}]"));
    let logits = c.param_in(&[n, v], -2.0, 2.0);
    let target_ids = vec![17, 4000, 7999, 0, 5123];
    let hot: Vec<usize> = (0..n).map(|r| r * v + target_ids[r] as usize).collect();
    let targets = c.ids_with(&[n], target_ids, v);
    c.probe_also(logits, hot);
    let y = c.op(CrossEntropy, &[logits, targets]);
    c.check(y);

    // Large enough for gemm's own threading (m·n·k ≥ 64³) and a chunked bias fill.
    for tb in [false, true] {
        let mut c =
            big(&format!("matmul [600, 64] x [64, 64] tb={tb} bias")).linear_in_each_element();
        let a = c.param(&[600, 64]);
        let b = c.param(&[64, 64]);
        let bias = c.param(&[64]);
        let y = c.op(
            MatMul {
                ta: false,
                tb,
                bias: true,
            },
            &[a, b, bias],
        );
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Llama-family ops: RMSNorm, RoPE, SiLU, SwiGLU, grouped-query attention

#[test]
fn rms_norm_input_and_weight() {
    // Two threads split the rows between two partial dw sums (evenly for 6 rows, not for 3).
    for (shape, threads) in [
        (vec![2, 3, 8], 1),
        (vec![2, 3, 8], 2),
        (vec![3, 8], 2),
        (vec![1, 5], 2),
    ] {
        let c_dim = *shape.last().unwrap();
        let mut c =
            GradCheck::with_threads(format!("rms_norm {shape:?} threads={threads}"), threads);
        let x = c.param(&shape);
        let w = c.param_in(&[c_dim], 0.5, 1.5);
        let y = c.op(RmsNorm::default(), &[x, w]);
        c.check(y);
    }
}

#[test]
fn rope_two_heads() {
    // Head widths 4 and 6 (pairs (0,2),(1,3) and (0,3),(1,4),(2,5)), both directions, Llama's
    // θ and a small one (fast-turning pairs at every index), one and two threads.
    for (shape, head_dim) in [(vec![2, 5, 8], 4), (vec![1, 7, 12], 6)] {
        for theta in [10_000.0, 3.0] {
            for inverse in [false, true] {
                for threads in [1, 2] {
                    let mut c = GradCheck::with_threads(
                        format!(
                            "rope {shape:?} head_dim={head_dim} theta={theta} inverse={inverse} \
                             threads={threads}"
                        ),
                        threads,
                    )
                    .linear_in_each_element();
                    let x = c.param(&shape);
                    let op = Rope {
                        inverse,
                        ..Rope::new(2, head_dim, theta)
                    };
                    let y = c.op(op, &[x]);
                    c.check(y);
                }
            }
        }
    }
}

#[test]
fn silu() {
    for shape in [vec![4, 6], vec![1, 3]] {
        let mut c = GradCheck::new(format!("silu {shape:?}"));
        let x = c.param_in(&shape, -4.0, 4.0);
        let y = c.op(Silu, &[x]);
        c.check(y);
    }
}

#[test]
fn swiglu_gate_and_up() {
    for shape in [vec![3, 8], vec![2, 2, 5]] {
        let mut c = GradCheck::new(format!("swiglu {shape:?}"));
        let gate = c.param_in(&shape, -3.0, 3.0);
        let up = c.param(&shape);
        let y = c.op(SwiGlu, &[gate, up]);
        c.check(y);
    }
    // One tensor as both gate and up: the two contributions must be summed.
    let mut c = GradCheck::new("swiglu x with x");
    let x = c.param_in(&[3, 4], -3.0, 3.0);
    let y = c.op(SwiGlu, &[x, x]);
    c.check(y);
}

#[test]
fn gqa_attention_grouped_and_ungrouped() {
    // (B, T, n_head, n_kv_head, head width): two query heads per kv head, ungrouped heads
    // (n_kv_head == n_head), one kv head for all (multi-query), and a single position.
    let cases = [
        (2, 5, 4, 2, 2),
        (1, 7, 4, 2, 4),
        (1, 1, 4, 2, 2),
        (2, 5, 2, 2, 2),
        (1, 6, 4, 4, 2),
        (1, 1, 2, 2, 3),
        (2, 4, 4, 1, 2),
        // Longer than one 64-row block of the kernel.
        (1, 70, 4, 2, 2),
    ];
    for (b, t, h, kh, d) in cases {
        for threads in [1, 2] {
            let mut c = GradCheck::with_threads(
                format!("gqa_attention B={b} T={t} heads={h}/{kh} D={d} threads={threads}"),
                threads,
            );
            let q = c.param(&[b, t, h * d]);
            let k = c.param(&[b, t, kh * d]);
            let v = c.param(&[b, t, kh * d]);
            if t == 1 {
                // Each query sees only its own key: the output is v, whatever q and k are.
                c.expect_zero_grad(q);
                c.expect_zero_grad(k);
            }
            let y = c.op(
                GqaAttention {
                    n_head: h,
                    n_kv_head: kh,
                },
                &[q, k, v],
            );
            c.check(y);
        }
    }
}

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

/// Runs a forward-only graph once with f32 `feeds` and returns the values of `outs`.
fn run_forward(
    mut graph: Graph,
    feeds: &[(TensorId, Vec<f32>)],
    outs: &[TensorId],
) -> Vec<Vec<f32>> {
    for &o in outs {
        graph.mark_output(o);
    }
    let threads = graph.threads();
    let memory = plan(&graph, &PlanOptions::default()).unwrap();
    let mut session = CpuSession::new(graph, memory, Allocator::default(), threads).unwrap();
    for (id, v) in feeds {
        session.write_f32(*id, v).unwrap();
    }
    session.run(ExecCtx::default()).unwrap();
    outs.iter()
        .map(|&o| session.read_f32(o).unwrap().to_vec())
        .collect()
}

fn random_values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0f32)).collect()
}

#[test]
fn rope_matches_rotate_half_and_inverse_undoes_it() {
    let (b, t, n_head, head_dim) = (2, 9, 2, 8);
    let width = n_head * head_dim;
    for theta in [10_000.0f32, 500_000.0, 2.0] {
        for threads in [1, 2] {
            let mut rng = ChaCha8Rng::seed_from_u64(seed_of("rope round trip"));
            let xv = random_values(&mut rng, b * t * width);
            let mut g = Graph::new().with_threads(threads);
            let x = g.input("x", &[b, t, width], DType::F32).unwrap();
            let fwd = Rope::new(n_head, head_dim, theta);
            let y = g.apply1(fwd, &[x]).unwrap();
            let back = g
                .apply1(
                    Rope {
                        inverse: true,
                        ..fwd
                    },
                    &[y],
                )
                .unwrap();
            let out = run_forward(g, &[(x, xv.clone())], &[y, back]);
            let (yv, back_v) = (&out[0], &out[1]);

            // Reference in f64: pair (i, i + D/2) of each head turned by t · θ^(−2i/D).
            let half = head_dim / 2;
            let mut max_err = 0.0f64;
            for bi in 0..b {
                for pos in 0..t {
                    for h in 0..n_head {
                        let base = (bi * t + pos) * width + h * head_dim;
                        for i in 0..half {
                            let inv = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
                            let (s, co) = (pos as f64 * inv).sin_cos();
                            let (x1, x2) = (xv[base + i] as f64, xv[base + i + half] as f64);
                            let e1 = x1 * co - x2 * s;
                            let e2 = x2 * co + x1 * s;
                            max_err = max_err
                                .max((yv[base + i] as f64 - e1).abs())
                                .max((yv[base + i + half] as f64 - e2).abs());
                        }
                    }
                }
            }
            assert!(
                max_err < 1e-6,
                "theta={theta}: rope differs from rotate_half by {max_err}"
            );
            // Position 0 is not rotated; later positions are.
            assert_eq!(&yv[..width], &xv[..width]);
            assert!(yv.iter().zip(&xv).any(|(a, b)| (a - b).abs() > 0.1));
            let round_trip = back_v
                .iter()
                .zip(&xv)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                round_trip < 1e-6,
                "theta={theta} threads={threads}: inverse rope leaves an error of {round_trip}"
            );
        }
    }
}

#[test]
fn gqa_attention_with_all_heads_equals_causal_attention() {
    for (b, t, n_head, d) in [(2, 6, 2, 4), (1, 1, 3, 2), (3, 5, 4, 3), (1, 140, 2, 4)] {
        for threads in [1, 2] {
            let c = n_head * d;
            let mut rng = ChaCha8Rng::seed_from_u64(seed_of("gqa vs causal"));
            let qv = random_values(&mut rng, b * t * c);
            let kv = random_values(&mut rng, b * t * c);
            let vv = random_values(&mut rng, b * t * c);
            // q, k and v side by side in each row of a packed [B, T, 3C] tensor.
            let mut packed = Vec::with_capacity(3 * b * t * c);
            for row in 0..b * t {
                for src in [&qv, &kv, &vv] {
                    packed.extend_from_slice(&src[row * c..(row + 1) * c]);
                }
            }
            let mut g = Graph::new().with_threads(threads);
            let q = g.input("q", &[b, t, c], DType::F32).unwrap();
            let k = g.input("k", &[b, t, c], DType::F32).unwrap();
            let v = g.input("v", &[b, t, c], DType::F32).unwrap();
            let qkv = g.input("qkv", &[b, t, 3 * c], DType::F32).unwrap();
            let gqa = g
                .apply(
                    GqaAttention {
                        n_head,
                        n_kv_head: n_head,
                    },
                    &[q, k, v],
                )
                .unwrap();
            let mha = g.apply(CausalAttention { n_head }, &[qkv]).unwrap();
            let out = run_forward(
                g,
                &[(q, qv), (k, kv), (v, vv), (qkv, packed)],
                &[gqa[0], gqa[1], mha[0], mha[1]],
            );
            for (what, ours, theirs) in [("y", &out[0], &out[2]), ("lse", &out[1], &out[3])] {
                assert_eq!(ours.len(), theirs.len());
                let diff = ours
                    .iter()
                    .zip(theirs.iter())
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    diff < 1e-5,
                    "B={b} T={t} heads={n_head} threads={threads}: {what} differs by {diff}"
                );
            }
        }
    }
}

#[test]
fn large_llama_ops_through_the_parallel_kernel_paths() {
    let big = |label: &str| GradCheck::with_threads(format!("large {label}"), 2).large();

    let mut c = big("rms_norm [400, 100]");
    let x = c.param(&[400, 100]);
    let w = c.param_in(&[100], 0.5, 1.5);
    let y = c.op(RmsNorm::default(), &[x, w]);
    c.check(y);

    let mut c = big("silu [40000]");
    let x = c.param_in(&[40000], -4.0, 4.0);
    let y = c.op(Silu, &[x]);
    c.check(y);

    let mut c = big("swiglu [40000]");
    let gate = c.param_in(&[40000], -3.0, 3.0);
    let up = c.param(&[40000]);
    let y = c.op(SwiGlu, &[gate, up]);
    c.check(y);

    let mut c = big("rope [3, 40, 320]").linear_in_each_element();
    let x = c.param(&[3, 40, 320]);
    let y = c.op(Rope::new(5, 64, 10_000.0), &[x]);
    c.check(y);
}

/// A graph planned for another CPU target runs here: the GELU + linear backward takes its row
/// tile from the workspace the plan gave it (sized for that target's GEMM), so every target's
/// plan gives the same numbers (the weight gradient's tile sums in another order: close, not
/// bitwise).
#[test]
fn gelu_linear_backward_runs_any_targets_plan() {
    use snug_graph::{CpuGemm, Target};
    // Enough rows that the targets tile them differently (2^20 elements per tile at most).
    let (rows, k, n) = (2048, 1536, 24);
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
    let (ws2, b) = run(CpuGemm::Avx2);
    let (_, c) = run(CpuGemm::Portable);
    assert_ne!(ws512, ws2, "the targets should tile differently");
    for other in [&b, &c] {
        for (x, y) in a.iter().zip(other.iter()) {
            for (p, q) in x.iter().zip(y) {
                assert!((p - q).abs() <= 1e-4 * (1.0 + p.abs()), "{p} vs {q}");
            }
        }
    }
}
