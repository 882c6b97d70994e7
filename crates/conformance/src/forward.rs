//! Kernels against plain computations, fused ops against the ops they fuse, and in-place
//! kernels against themselves out of place.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_graph::ops::{
    CausalAttention, Gelu, GeluApprox, GeluLinear, GeluLinearBackward, GqaAttention, LayerNorm,
    LayerNormBackward, LayerNormLinear, LayerNormLinearBackward, LmHeadLoss, LmHeadLossBackward,
    MatMul, Reshape, Rope, Scale,
};
use snug_graph::{DType, Graph, TensorId};
use snug_runtime::ExecCtx;

use crate::gradcheck::seed_of;
use crate::{offers, session, Harness};

/// The fused op computes what `gelu` then a biased `matmul` compute: over several row tiles
/// (an output too narrow for our GEMM kernel), and through that kernel where the CPU has it
/// (GELU made as the kernel packs `h`, the bias added as it stores `y`).
pub fn gelu_linear_equals_gelu_then_matmul<H: Harness>(harness: &H) {
    if !offers(harness, &GeluLinear::default().into()) {
        return;
    }
    // At most 2^21 elements per tile: at width 64, 33000 rows take two tiles.
    gelu_linear_against_unfused(harness, 33000, 64, 3);
    gelu_linear_against_unfused(harness, 3000, 64, 40);
}

fn gelu_linear_against_unfused<H: Harness>(harness: &H, rows: usize, k: usize, n: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut values =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-3.0..3.0f32)).collect() };
    let (hv, wv, bv) = (values(rows * k), values(k * n), values(n));
    let run = |fused: bool| -> Option<Vec<f32>> {
        let mut g = Graph::new().with_target(harness.target(2));
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
        let mut s = session(harness, g, 2)?;
        s.write_f32(h, &hv).unwrap();
        s.write_f32(w, &wv).unwrap();
        s.write_f32(b, &bv).unwrap();
        s.run(ExecCtx::default()).unwrap();
        Some(s.read_f32(y).unwrap().to_vec())
    };
    let (Some(fused), Some(plain)) = (run(true), run(false)) else {
        return;
    };
    let worst = snug_testkit::worst(
        fused
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs() / (1.0 + b.abs())),
    );
    assert!(
        worst < 1e-5,
        "[{rows}, {k}] x [{k}, {n}]: fused and unfused differ by {worst}"
    );
}

/// The fused op computes what `layer_norm` then a biased `matmul` compute, forward and
/// backward: over several row tiles (an output too narrow for our GEMM kernel), and through
/// that kernel where the CPU has it (rows normalised as the kernel packs them, in both
/// orientations).
pub fn layer_norm_linear_equals_layer_norm_then_matmul<H: Harness>(harness: &H) {
    if !offers(harness, &LayerNormLinear::default().into()) {
        return;
    }
    // At most 2^21 elements per forward tile and 2^19 per backward one: at width 64, 70000
    // rows take three and nine.
    layer_norm_linear_against_unfused(harness, 70000, 64, 3);
    layer_norm_linear_against_unfused(harness, 3000, 64, 40);
}

fn layer_norm_linear_against_unfused<H: Harness>(harness: &H, rows: usize, k: usize, n: usize) {
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
    let run = |fused: bool| -> Option<Vec<Vec<f32>>> {
        let mut g = Graph::new().with_target(harness.target(2));
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
        let mut s = session(harness, g, 2)?;
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
        Some(
            outs.iter()
                .map(|&o| s.read_f32(o).unwrap().to_vec())
                .collect(),
        )
    };
    let (Some(fused), Some(plain)) = (run(true), run(false)) else {
        return;
    };
    for (what, (f, p)) in ["y", "dx", "d_ln_w", "d_ln_b", "dw"]
        .iter()
        .zip(fused.iter().zip(&plain))
    {
        // The weight gradients sum 33000 rows: errors are measured against each tensor's
        // largest value (at least 1).
        let scale = p.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let worst =
            snug_testkit::worst(f.iter().zip(p).map(|(a, b)| (a - b).abs())) / f64::from(scale);
        assert!(
            worst < 1e-5,
            "[{rows}, {k}] x [{k}, {n}] {what}: fused and unfused differ by {worst}"
        );
    }
}

/// The fused backwards that may write `dx` over `x` (LayerNorm + linear, GELU + linear, the LM
/// head + loss) give the same bits in place as beside it. `x` is made by an op (a graph input
/// is never written over); the LM head's goes through a reshape, a view of a whole storage.
pub fn fused_backwards_in_place_keep_the_bits<H: Harness>(harness: &H) {
    // Row tiles of at most 2^19 (LayerNorm) and 2^20 (GELU) elements: 9000 × 64 takes two and
    // one, 20000 × 64 three and two.
    for (rows, k, n) in [(9000, 64, 40), (20000, 64, 3)] {
        in_place_same_bits(harness, "layer_norm_linear_backward", |g, feed| {
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
        in_place_same_bits(harness, "gelu_linear_backward", |g, feed| {
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
        in_place_same_bits(harness, "lm_head_loss_backward", |g, feed| {
            let x3 = made(g, feed, &[2, n / 2, c]);
            let x = g.apply1(Reshape { shape: vec![n, c] }, &[x3]).unwrap();
            let shape = if tb { [v, c] } else { [c, v] };
            let w = feed.f32(g, &shape);
            let t = feed.ids(g, n, v);
            let dloss = feed.f32(g, &[]);
            let bf16 = false;
            let lse = g
                .apply(
                    LmHeadLoss {
                        tb,
                        rows,
                        cols,
                        bf16,
                    },
                    &[x, w, t],
                )
                .unwrap()[1];
            let back = LmHeadLossBackward {
                tb,
                rows,
                cols,
                bf16,
            };
            g.apply(back, &[x, w, t, lse, dloss]).unwrap()
        });
    }
}

/// Random values for a graph's inputs, written once the session exists.
#[derive(Default)]
pub struct Inputs {
    pub f32s: Vec<(TensorId, Vec<f32>)>,
    pub i32s: Vec<(TensorId, Vec<i32>, usize)>,
}

impl Inputs {
    /// An f32 input of `shape`, uniform in `[-2, 2)`.
    pub fn f32(&mut self, g: &mut Graph, shape: &[usize]) -> TensorId {
        let mut rng = ChaCha8Rng::seed_from_u64(100 + self.f32s.len() as u64);
        let id = g
            .input(format!("in{}", self.f32s.len()), shape, DType::F32)
            .unwrap();
        let len = shape.iter().product();
        let v = (0..len).map(|_| rng.random_range(-2.0..2.0f32)).collect();
        self.f32s.push((id, v));
        id
    }

    /// An i32 input of `len` ids in `0..bound`.
    pub fn ids(&mut self, g: &mut Graph, len: usize, bound: usize) -> TensorId {
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
/// Nothing runs where the backend cannot run the graph (said why).
fn in_place_same_bits<H: Harness>(
    harness: &H,
    op: &str,
    build: impl Fn(&mut Graph, &mut Inputs) -> Vec<TensorId>,
) {
    let mut g = Graph::new().with_target(harness.target(2));
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
    if !crate::runnable(harness, &g) {
        return;
    }
    let run = |g: Graph| -> Vec<Vec<f32>> {
        let mut s = session(harness, g, 2).expect("runnable, as checked above");
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
pub fn causal_attention_matches_a_plain_computation<H: Harness>(harness: &H) {
    use snug_graph::ops::CausalAttentionBackward;
    for (t, d) in [(200, 64), (130, 80)] {
        let (heads, c) = (2, 2 * d);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut values =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect() };
        let (qkv_v, dy_v) = (values(t * 3 * c), values(t * c));
        let mut g = Graph::new().with_target(harness.target(2));
        let qkv = g.input("qkv", &[1, t, 3 * c], DType::F32).unwrap();
        let dy = g.input("dy", &[1, t, c], DType::F32).unwrap();
        let fwd = g.apply(CausalAttention { n_head: heads }, &[qkv]).unwrap();
        let back = CausalAttentionBackward { n_head: heads };
        let dqkv = g.apply1(back, &[qkv, fwd[0], fwd[1], dy]).unwrap();
        g.mark_output(fwd[0]);
        g.mark_output(dqkv);
        let Some(mut s) = session(harness, g, 2) else {
            return;
        };
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

/// Runs a forward-only graph once with f32 `feeds` and returns the values of `outs`.
/// `None` (said why) where the backend cannot run it.
fn run_forward<H: Harness>(
    harness: &H,
    mut graph: Graph,
    feeds: &[(TensorId, Vec<f32>)],
    outs: &[TensorId],
) -> Option<Vec<Vec<f32>>> {
    for &o in outs {
        graph.mark_output(o);
    }
    let threads = graph.threads();
    let mut session = session(harness, graph, threads)?;
    for (id, v) in feeds {
        session.write_f32(*id, v).unwrap();
    }
    session.run(ExecCtx::default()).unwrap();
    Some(
        outs.iter()
            .map(|&o| session.read_f32(o).unwrap().to_vec())
            .collect(),
    )
}

fn random_values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0f32)).collect()
}

pub fn rope_matches_rotate_half_and_inverse_undoes_it<H: Harness>(harness: &H) {
    let (b, t, n_head, head_dim) = (2, 9, 2, 8);
    let width = n_head * head_dim;
    for theta in [10_000.0f32, 500_000.0, 2.0] {
        for threads in [1, 2] {
            let mut rng = ChaCha8Rng::seed_from_u64(seed_of("rope round trip"));
            let xv = random_values(&mut rng, b * t * width);
            let mut g = Graph::new().with_target(harness.target(threads));
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
            let Some(out) = run_forward(harness, g, &[(x, xv.clone())], &[y, back]) else {
                return;
            };
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
            let round_trip =
                snug_testkit::worst(back_v.iter().zip(&xv).map(|(a, b)| (a - b).abs()));
            assert!(
                round_trip < 1e-6,
                "theta={theta} threads={threads}: inverse rope leaves an error of {round_trip}"
            );
        }
    }
}

pub fn gqa_attention_with_all_heads_equals_causal_attention<H: Harness>(harness: &H) {
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
            let mut g = Graph::new().with_target(harness.target(threads));
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
            let Some(out) = run_forward(
                harness,
                g,
                &[(q, qv), (k, kv), (v, vv), (qkv, packed)],
                &[gqa[0], gqa[1], mha[0], mha[1]],
            ) else {
                return;
            };
            for (what, ours, theirs) in [("y", &out[0], &out[2]), ("lse", &out[1], &out[3])] {
                assert_eq!(ours.len(), theirs.len());
                let diff =
                    snug_testkit::worst(ours.iter().zip(theirs.iter()).map(|(x, y)| (x - y).abs()));
                assert!(
                    diff < 1e-5,
                    "B={b} T={t} heads={n_head} threads={threads}: {what} differs by {diff}"
                );
            }
        }
    }
}
