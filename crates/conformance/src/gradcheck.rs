//! Gradient rules checked against central finite differences of the backend's own kernels.
//!
//! A case builds `loss = Σ op(params…) ⊙ R` for a fixed random `R` (an `Input`, so it gets no
//! gradient), lets [`StepGraph`] append the backward pass, reads the analytic gradient of every
//! parameter, then re-runs the same session with one parameter element moved by `±h` and
//! compares `(loss(p + h) − loss(p − h)) / 2h` with it. The random `R` weights every output
//! element differently, so a rule that is wrong for any one output element shows up.

use rand::seq::{index, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_graph::ops::{Binary, Op, Reduce, ReduceKind, Reshape};
use snug_graph::{DType, Graph, OptimizerSpec, StepGraph, TensorId};
use snug_runtime::{ExecCtx, Session};

use crate::Harness;

/// Step of the central difference, relative to the element: `h = REL_STEP · max(1, |x|)`.
pub(crate) const REL_STEP: f32 = 1e-2;

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
pub const ATOL: f64 = 1e-3;
pub const RTOL: f64 = 5e-3;

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
pub struct Probe {
    /// `p0`, `p1`, ...: the case's parameters in the order they were made.
    pub param: String,
    pub index: usize,
    pub analytic: f64,
    pub numeric: f64,
}

impl Probe {
    pub fn agrees(&self) -> bool {
        (self.analytic - self.numeric).abs() <= ATOL + RTOL * self.numeric.abs()
    }
}

/// Builder for one gradient-check case: builds its graph for the harness's target and runs it
/// in a session of the harness's backend.
pub struct GradCheck<'h, H: Harness> {
    harness: &'h H,
    label: String,
    graph: Graph,
    pub(crate) rng: ChaCha8Rng,
    params: Vec<(TensorId, Vec<f32>)>,
    feeds: Vec<(TensorId, Feed)>,
    /// Evaluate the perturbed losses on the host (see [`GradCheck::large`]).
    host_loss: bool,
    /// Elements probed besides the random sample of big parameters.
    extra: Vec<(TensorId, Vec<usize>)>,
    /// Parameters the output does not depend on (see [`GradCheck::expect_zero_grad`]).
    zero_grad: Vec<TensorId>,
    pub(crate) rel_step: f32,
}

/// FNV-1a, so that every case gets its own fixed seed from its label.
pub fn seed_of(label: &str) -> u64 {
    label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl<'h, H: Harness> GradCheck<'h, H> {
    pub fn new(harness: &'h H, label: impl Into<String>) -> Self {
        Self::with_threads(harness, label, 1)
    }

    /// A case whose graph is planned for, and run by, `threads` workers.
    pub fn with_threads(harness: &'h H, label: impl Into<String>, threads: usize) -> Self {
        let label = label.into();
        GradCheck {
            harness,
            rng: ChaCha8Rng::seed_from_u64(seed_of(&label)),
            label,
            graph: Graph::new().with_target(harness.target(threads)),
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
    pub fn linear_in_each_element(mut self) -> Self {
        self.rel_step = 10.0 * REL_STEP;
        self
    }

    /// `param`'s gradient is zero everywhere (the output does not depend on it, as attention's
    /// queries and keys at a single position): its analytic gradient must agree with that, and
    /// the case does not require a signal from it.
    pub fn expect_zero_grad(&mut self, param: TensorId) {
        self.zero_grad.push(param);
    }

    /// Probes these elements of `param` too, whatever its size.
    pub fn probe_also(&mut self, param: TensorId, indices: Vec<usize>) {
        self.extra.push((param, indices));
    }

    /// For outputs of tens of thousands of elements (which take the kernels' multi-chunk
    /// parallel paths): the f32 sum inside the graph would put ~1e-3 of rounding noise into
    /// each loss, far above `ATOL · 2h`. The backward pass still starts from that graph loss,
    /// but the finite differences use `Σ out ⊙ R` summed in f64 on the host, where the output
    /// elements a perturbation does not touch cancel exactly.
    pub fn large(mut self) -> Self {
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
    pub fn param_with(&mut self, shape: &[usize], values: Vec<f32>) -> TensorId {
        let name = format!("p{}", self.params.len());
        let id = self.graph.parameter(name, shape).unwrap();
        assert_eq!(values.len(), self.graph.tensor(id).numel());
        self.params.push((id, values));
        id
    }

    /// A parameter uniform in `[lo, hi)`.
    pub fn param_in(&mut self, shape: &[usize], lo: f32, hi: f32) -> TensorId {
        let v = self.uniform(shape.iter().product(), lo, hi);
        self.param_with(shape, v)
    }

    /// A parameter uniform in `[-1, 1)`.
    pub fn param(&mut self, shape: &[usize]) -> TensorId {
        self.param_in(shape, -1.0, 1.0)
    }

    /// A parameter with magnitudes in `[lo, hi)` and random signs (a safe denominator).
    pub fn param_away_from_zero(&mut self, shape: &[usize], lo: f32, hi: f32) -> TensorId {
        let v = self.signed(shape.iter().product(), lo, hi);
        self.param_with(shape, v)
    }

    /// A parameter whose elements are distinct and at least 0.1 apart (no ties for max, even
    /// after a `±h` perturbation).
    pub fn param_distinct(&mut self, shape: &[usize]) -> TensorId {
        let n: usize = shape.iter().product();
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 0.1).collect();
        v.shuffle(&mut self.rng);
        self.param_with(shape, v)
    }

    /// An i32 input of ids in `0..bound`.
    pub fn ids(&mut self, shape: &[usize], bound: usize) -> TensorId {
        let n: usize = shape.iter().product();
        let data: Vec<i32> = (0..n)
            .map(|_| self.rng.random_range(0..bound as i32))
            .collect();
        self.ids_with(shape, data, bound)
    }

    pub fn ids_with(&mut self, shape: &[usize], data: Vec<i32>, bound: usize) -> TensorId {
        let name = format!("ids{}", self.feeds.len());
        let id = self.graph.input(name, shape, DType::I32).unwrap();
        self.feeds.push((id, Feed::I32 { data, bound }));
        id
    }

    /// An f32 input (it gets no gradient) holding `values`.
    pub fn input_with(&mut self, shape: &[usize], values: Vec<f32>) -> TensorId {
        let name = format!("in{}", self.feeds.len());
        let id = self.graph.input(name, shape, DType::F32).unwrap();
        self.feeds.push((id, Feed::F32(values)));
        id
    }

    /// A loss mask over `n` rows dropping every third row, and a divisor (as a trainer feeds
    /// for one of several micro-batches: not the count itself).
    pub fn loss_mask(&mut self, n: usize) -> [TensorId; 2] {
        let mask: Vec<f32> = (0..n).map(|r| if r % 3 == 1 { 0.0 } else { 1.0 }).collect();
        let divisor = mask.iter().sum::<f32>() * 0.75;
        [
            self.input_with(&[n], mask),
            self.input_with(&[], vec![divisor]),
        ]
    }

    /// Applies `op` and returns its first output.
    pub fn op(&mut self, op: impl Into<Op>, inputs: &[TensorId]) -> TensorId {
        self.graph.apply(op, inputs).unwrap()[0]
    }

    /// Builds the loss on `out`, runs forward and backward, and probes every parameter; `None`
    /// (said why) where the backend cannot run the case.
    pub fn probes(mut self, out: TensorId) -> Option<(String, Vec<Probe>)> {
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
        let mut session = crate::session(self.harness, step.graph, threads)?;
        let feeds = &self.feeds;
        let (host_loss, label) = (self.host_loss, &self.label);
        // Inputs live in the arena and may be overwritten once read: feed them before every run.
        let loss_at = |session: &mut Session<H::B>| -> f64 {
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
        Some((self.label, probes))
    }

    /// Runs the case and panics with every disagreeing element.
    pub fn check(self, out: TensorId) {
        let zero: Vec<bool> = self
            .params
            .iter()
            .map(|(p, _)| self.zero_grad.contains(p))
            .collect();
        let Some((label, probes)) = self.probes(out) else {
            return;
        };
        assert_agree(&label, &probes);
        for (k, &zero) in zero.iter().enumerate() {
            let name = format!("p{k}");
            let signal = probes
                .iter()
                .filter(|p| p.param == name)
                .map(|p| p.numeric.abs())
                .fold(0.0, nan_max);
            if zero {
                let analytic = probes
                    .iter()
                    .filter(|p| p.param == name)
                    .map(|p| p.analytic.abs())
                    .fold(0.0, nan_max);
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
        .fold(0.0, nan_max)
}

/// The larger of two, a NaN winning: a NaN gradient must not read as small.
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// Panics with every element of `probes` that disagrees.
pub fn assert_agree(label: &str, probes: &[Probe]) {
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

pub(crate) fn reduce(kind: ReduceKind, axis: usize, keepdim: bool) -> Reduce {
    Reduce {
        kind,
        axis,
        keepdim,
    }
}
