//! Every op's gradient rule against central finite differences of the backend's kernels, case
//! by case at small shapes (see [`GradCheck`] for how and with what tolerance).

use snug_graph::ops::{
    Binary, BinaryKind, BroadcastTo, CausalAttention, CrossEntropy, Embedding, Gelu, GeluApprox,
    GeluLinear, GqaAttention, LayerNorm, LayerNormLinear, LmHeadLoss, LogSoftmax, MatMul, Narrow,
    Pad, ReduceKind, Reshape, RmsNorm, Rope, Scale, Silu, Softmax, SumTo, SwiGlu, Transpose,
};

use crate::gradcheck::{assert_agree, reduce, Probe, REL_STEP};
use crate::{GradCheck, Harness};

// ---------------------------------------------------------------------------------------------
// The checker itself

pub fn checker_rejects_sign_and_scale_errors<H: Harness>(harness: &H) {
    let mut c = GradCheck::new(harness, "self-test");
    let x = c.param(&[3, 4]);
    let w = c.param_in(&[4], 0.5, 1.5);
    let b = c.param(&[4]);
    let y = c.op(LayerNorm::default(), &[x, w, b]);
    let Some((label, probes)) = c.probes(y) else {
        return;
    };
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

pub fn matmul_2d_every_transpose_with_and_without_bias<H: Harness>(harness: &H) {
    let (m, k, n) = (3, 4, 5);
    for ta in [false, true] {
        for tb in [false, true] {
            for bias in [false, true] {
                let mut c =
                    GradCheck::new(harness, format!("matmul 2-D ta={ta} tb={tb} bias={bias}"));
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

pub fn matmul_shared_weight_over_batched_left_operand<H: Harness>(harness: &H) {
    let (k, n) = (4, 5);
    for a_shape in [vec![2, 3, k], vec![2, 2, 3, k]] {
        for tb in [false, true] {
            for bias in [false, true] {
                let mut c = GradCheck::new(
                    harness,
                    format!("matmul shared a={a_shape:?} tb={tb} bias={bias}"),
                );
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

pub fn matmul_fully_batched_every_transpose<H: Harness>(harness: &H) {
    let (m, k, n) = (3, 4, 5);
    // Two threads with a batch of 2 takes the kernel's batch-parallel path.
    for threads in [1, 2] {
        for batch in [vec![2], vec![2, 2]] {
            for ta in [false, true] {
                for tb in [false, true] {
                    let bias = ta != tb;
                    let mut c = GradCheck::with_threads(
                        harness,
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

fn check_binary<H: Harness>(harness: &H, kind: BinaryKind) {
    for (sa, sb) in broadcast_pairs() {
        let mut c = GradCheck::new(harness, format!("{kind:?} {sa:?} with {sb:?}"));
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

pub fn binary_add_with_broadcasting<H: Harness>(harness: &H) {
    check_binary(harness, BinaryKind::Add);
}

pub fn binary_sub_with_broadcasting<H: Harness>(harness: &H) {
    check_binary(harness, BinaryKind::Sub);
}

pub fn binary_mul_with_broadcasting<H: Harness>(harness: &H) {
    check_binary(harness, BinaryKind::Mul);
}

pub fn binary_div_with_broadcasting<H: Harness>(harness: &H) {
    check_binary(harness, BinaryKind::Div);
}

pub fn binary_with_one_tensor_on_both_sides<H: Harness>(harness: &H) {
    // x ⊙ x, x + x and (x − x) + x: the contributions to x's gradient must be summed (fan-out).
    for kind in [BinaryKind::Mul, BinaryKind::Sub, BinaryKind::Add] {
        let mut c = GradCheck::new(harness, format!("{kind:?} x with x"));
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

pub fn scale<H: Harness>(harness: &H) {
    for factor in [-1.7, 0.25] {
        let mut c = GradCheck::new(harness, format!("scale {factor}"));
        let x = c.param(&[2, 3, 4]);
        let y = c.op(Scale { factor }, &[x]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Reductions and broadcasts

fn check_reduce<H: Harness>(harness: &H, kind: ReduceKind) {
    for axis in 0..3 {
        for keepdim in [true, false] {
            let mut c = GradCheck::new(harness, format!("{kind:?} axis={axis} keepdim={keepdim}"));
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

pub fn reduce_sum<H: Harness>(harness: &H) {
    check_reduce(harness, ReduceKind::Sum);
}

pub fn reduce_mean<H: Harness>(harness: &H) {
    check_reduce(harness, ReduceKind::Mean);
}

pub fn reduce_max<H: Harness>(harness: &H) {
    check_reduce(harness, ReduceKind::Max);
}

pub fn sum_to<H: Harness>(harness: &H) {
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
        let mut c = GradCheck::new(harness, format!("sum_to {shape:?}"));
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

pub fn broadcast_to<H: Harness>(harness: &H) {
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
        let mut c = GradCheck::new(harness, format!("broadcast_to {from:?} -> {to:?}"));
        let x = c.param(from);
        let y = c.op(BroadcastTo { shape: to.to_vec() }, &[x]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax, normalisation, activations

pub fn softmax<H: Harness>(harness: &H) {
    for shape in [vec![2, 3, 5], vec![1, 7]] {
        let mut c = GradCheck::new(harness, format!("softmax {shape:?}"));
        let x = c.param_in(&shape, -2.0, 2.0);
        let y = c.op(Softmax, &[x]);
        c.check(y);
    }
}

pub fn log_softmax<H: Harness>(harness: &H) {
    for shape in [vec![2, 3, 5], vec![1, 7]] {
        let mut c = GradCheck::new(harness, format!("log_softmax {shape:?}"));
        let x = c.param_in(&shape, -2.0, 2.0);
        let y = c.op(LogSoftmax, &[x]);
        c.check(y);
    }
}

pub fn layer_norm_input_weight_and_bias<H: Harness>(harness: &H) {
    // Two threads split the rows between two partial dw/db sums (evenly for 6 rows, not for 3).
    for (shape, threads) in [
        (vec![2, 3, 8], 1),
        (vec![2, 3, 8], 2),
        (vec![3, 8], 2),
        (vec![1, 5], 2),
    ] {
        let c_dim = *shape.last().unwrap();
        let mut c = GradCheck::with_threads(
            harness,
            format!("layer_norm {shape:?} threads={threads}"),
            threads,
        );
        let x = c.param(&shape);
        let w = c.param_in(&[c_dim], 0.5, 1.5);
        let b = c.param_in(&[c_dim], -0.5, 0.5);
        let y = c.op(LayerNorm::default(), &[x, w, b]);
        c.check(y);
    }
}

pub fn layer_norm_linear_all_five_inputs<H: Harness>(harness: &H) {
    // Two threads split each tile's rows between two partial norm-gradient sums (unevenly
    // for 3 rows).
    for (shape, threads) in [(vec![2, 3, 8], 1), (vec![2, 3, 8], 2), (vec![3, 8], 2)] {
        let k = *shape.last().unwrap();
        let name = format!("layer_norm_linear {shape:?} threads={threads}");
        let mut c = GradCheck::with_threads(harness, name, threads);
        let x = c.param(&shape);
        let lw = c.param_in(&[k], 0.5, 1.5);
        let lb = c.param_in(&[k], -0.5, 0.5);
        let w = c.param(&[k, 5]);
        let b = c.param(&[5]);
        let y = c.op(LayerNormLinear::default(), &[x, lw, lb, w, b]);
        c.check(y);
    }
}

pub fn gelu_exact_and_tanh<H: Harness>(harness: &H) {
    for approx in [GeluApprox::Exact, GeluApprox::Tanh] {
        let mut c = GradCheck::new(harness, format!("gelu {approx:?}"));
        let x = c.param_in(&[4, 6], -3.0, 3.0);
        let y = c.op(Gelu { approx }, &[x]);
        c.check(y);
    }
}

pub fn gelu_linear_input_weight_and_bias<H: Harness>(harness: &H) {
    for approx in [GeluApprox::Exact, GeluApprox::Tanh] {
        let mut c =
            GradCheck::new(harness, format!("gelu_linear {approx:?}")).linear_in_each_element();
        // Small steps for `h`, where GELU is curved: the larger step suits only `w` and `b`.
        c.rel_step = REL_STEP;
        let h = c.param_in(&[2, 3, 5], -3.0, 3.0);
        let w = c.param(&[5, 4]);
        let b = c.param(&[4]);
        let y = c.op(GeluLinear { approx }, &[h, w, b]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding, views and layout

pub fn embedding_table<H: Harness>(harness: &H) {
    let (vocab, dim) = (7, 4);
    // Repeated ids: their rows' gradients must add up. Id 6 is never used: its row gets zero.
    let fixed = vec![0, 3, 3, 5, 0, 1, 3, 2, 4, 5];
    let mut c = GradCheck::new(harness, "embedding [2, 5] ids");
    let table = c.param(&[vocab, dim]);
    let ids = c.ids_with(&[2, 5], fixed, vocab);
    let y = c.op(Embedding, &[table, ids]);
    c.check(y);

    let mut c = GradCheck::new(harness, "embedding [6] random ids");
    let table = c.param(&[vocab, dim]);
    let ids = c.ids(&[6], vocab);
    let y = c.op(Embedding, &[table, ids]);
    c.check(y);
}

pub fn reshape<H: Harness>(harness: &H) {
    // On a parameter (the output is a view of persistent storage) and on an activation.
    for to in [vec![6, 4], vec![24], vec![4, 3, 2]] {
        let mut c = GradCheck::new(harness, format!("reshape param -> {to:?}"));
        let x = c.param(&[2, 3, 4]);
        let y = c.op(Reshape { shape: to.clone() }, &[x]);
        c.check(y);

        let mut c = GradCheck::new(harness, format!("reshape activation -> {to:?}"));
        let x = c.param(&[2, 3, 4]);
        let s = c.op(Scale { factor: 1.5 }, &[x]);
        let y = c.op(Reshape { shape: to }, &[s]);
        c.check(y);
    }
}

pub fn narrow<H: Harness>(harness: &H) {
    let cases: [(&[usize], Narrow); 4] = [
        (&[5, 3], Narrow { start: 1, len: 3 }),
        (&[5, 3], Narrow { start: 0, len: 5 }),
        (&[4, 2, 3], Narrow { start: 2, len: 2 }),
        (&[6], Narrow { start: 4, len: 1 }),
    ];
    for (shape, op) in cases {
        let mut c = GradCheck::new(harness, format!("narrow param {shape:?} {op:?}"));
        let x = c.param(shape);
        let y = c.op(op, &[x]);
        c.check(y);

        let mut c = GradCheck::new(harness, format!("narrow activation {shape:?} {op:?}"));
        let x = c.param(shape);
        let s = c.op(Scale { factor: -0.5 }, &[x]);
        let y = c.op(op, &[s]);
        c.check(y);
    }
}

pub fn pad<H: Harness>(harness: &H) {
    let cases: [(&[usize], Pad); 4] = [
        (&[2, 3], Pad { start: 1, total: 5 }),
        (&[2, 2, 3], Pad { start: 0, total: 4 }),
        (&[2, 2, 3], Pad { start: 2, total: 4 }),
        (&[3], Pad { start: 0, total: 3 }),
    ];
    for (shape, op) in cases {
        let mut c = GradCheck::new(harness, format!("pad {shape:?} {op:?}"));
        let x = c.param(shape);
        let y = c.op(op, &[x]);
        c.check(y);
    }
}

pub fn transpose<H: Harness>(harness: &H) {
    let cases: [(&[usize], usize, usize); 6] = [
        (&[3, 5], 0, 1),
        (&[2, 3, 4], 0, 1),
        (&[2, 3, 4], 1, 2),
        (&[2, 3, 4], 0, 2),
        (&[2, 3, 4], 2, 0),
        (&[2, 3, 4, 2], 1, 3),
    ];
    for (shape, dim0, dim1) in cases {
        let mut c = GradCheck::new(harness, format!("transpose {shape:?} ({dim0}, {dim1})"));
        let x = c.param(shape);
        let y = c.op(Transpose { dim0, dim1 }, &[x]);
        c.check(y);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention and loss

pub fn causal_attention_two_heads<H: Harness>(harness: &H) {
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
                harness,
                format!("causal_attention {shape:?} 2 heads threads={threads}"),
                threads,
            );
            let qkv = c.param(&shape);
            let y = c.op(CausalAttention { n_head: 2 }, &[qkv]);
            c.check(y);
        }
    }
}

pub fn cross_entropy<H: Harness>(harness: &H) {
    for (n, v) in [(4, 6), (1, 3)] {
        let mut c = GradCheck::new(harness, format!("cross_entropy [{n}, {v}]"));
        let logits = c.param_in(&[n, v], -2.0, 2.0);
        let targets = c.ids(&[n], v);
        let y = c.op(CrossEntropy, &[logits, targets]);
        c.check(y);
    }
}

/// Under a loss mask, masked rows included (their gradient must be zero, as their finite
/// difference is).
pub fn cross_entropy_masked<H: Harness>(harness: &H) {
    for (n, v) in [(5, 6), (4, 3)] {
        let mut c = GradCheck::new(harness, format!("cross_entropy masked [{n}, {v}]"));
        let logits = c.param_in(&[n, v], -2.0, 2.0);
        let targets = c.ids(&[n], v);
        let [mask, divisor] = c.loss_mask(n);
        let y = c.op(CrossEntropy, &[logits, targets, mask, divisor]);
        c.check(y);
    }
}

/// The fused LM-head loss under a loss mask, through row tiles and vocabulary blocks.
pub fn lm_head_loss_masked<H: Harness>(harness: &H) {
    let (n, ch, v) = (7, 5, 6);
    for (tb, rows, cols, threads) in [(false, 2, 6, 1), (true, 3, 4, 2), (true, 100, 100, 1)] {
        let label = format!("lm_head_loss masked tb={tb} tile={rows}x{cols} threads={threads}");
        let mut c = GradCheck::with_threads(harness, label, threads);
        let x = c.param_in(&[n, ch], -1.0, 1.0);
        let w = if tb {
            c.param(&[v, ch])
        } else {
            c.param(&[ch, v])
        };
        let targets = c.ids(&[n], v);
        let [mask, divisor] = c.loss_mask(n);
        let y = c.op(
            LmHeadLoss {
                tb,
                rows,
                cols,
                bf16: false,
            },
            &[x, w, targets, mask, divisor],
        );
        c.check(y);
    }
}

/// The fused, tiled LM head + cross-entropy: several row tiles (the head's gradient
/// accumulates across them), several vocabulary blocks (the online log-sum-exp and `dx`
/// accumulate across them), one tile, a tied `[V, C]` head and an untied `[C, V]` one, 1 and 2
/// threads.
pub fn lm_head_loss<H: Harness>(harness: &H) {
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
        let mut c = GradCheck::with_threads(harness, label, threads);
        let x = c.param_in(&[n, ch], -1.0, 1.0);
        let w = if tb {
            c.param(&[v, ch])
        } else {
            c.param(&[ch, v])
        };
        let targets = c.ids(&[n], v);
        let head = LmHeadLoss {
            tb,
            rows,
            cols,
            bf16: false,
        };
        let y = c.op(head, &[x, w, targets]);
        c.check(y);
    }
}

pub fn small_network_end_to_end<H: Harness>(harness: &H) {
    // Embedding → LayerNorm → linear+bias → GELU → attention input → attention → linear →
    // cross-entropy: gradients flow through every rule in sequence, with a residual fan-out.
    let (vocab, b, t, ch) = (5, 2, 3, 4);
    for threads in [1, 2] {
        let mut c =
            GradCheck::with_threads(harness, format!("small network threads={threads}"), threads);
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
// Llama-family ops: RMSNorm, RoPE, SiLU, SwiGLU, grouped-query attention

pub fn rms_norm_input_and_weight<H: Harness>(harness: &H) {
    // Two threads split the rows between two partial dw sums (evenly for 6 rows, not for 3).
    for (shape, threads) in [
        (vec![2, 3, 8], 1),
        (vec![2, 3, 8], 2),
        (vec![3, 8], 2),
        (vec![1, 5], 2),
    ] {
        let c_dim = *shape.last().unwrap();
        let mut c = GradCheck::with_threads(
            harness,
            format!("rms_norm {shape:?} threads={threads}"),
            threads,
        );
        let x = c.param(&shape);
        let w = c.param_in(&[c_dim], 0.5, 1.5);
        let y = c.op(RmsNorm::default(), &[x, w]);
        c.check(y);
    }
}

pub fn rope_two_heads<H: Harness>(harness: &H) {
    // Head widths 4 and 6 (pairs (0,2),(1,3) and (0,3),(1,4),(2,5)), both directions, Llama's
    // θ and a small one (fast-turning pairs at every index), one and two threads.
    for (shape, head_dim) in [(vec![2, 5, 8], 4), (vec![1, 7, 12], 6)] {
        for theta in [10_000.0, 3.0] {
            for inverse in [false, true] {
                for threads in [1, 2] {
                    let mut c = GradCheck::with_threads(
                        harness,
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

pub fn silu<H: Harness>(harness: &H) {
    for shape in [vec![4, 6], vec![1, 3]] {
        let mut c = GradCheck::new(harness, format!("silu {shape:?}"));
        let x = c.param_in(&shape, -4.0, 4.0);
        let y = c.op(Silu, &[x]);
        c.check(y);
    }
}

pub fn swiglu_gate_and_up<H: Harness>(harness: &H) {
    for shape in [vec![3, 8], vec![2, 2, 5]] {
        let mut c = GradCheck::new(harness, format!("swiglu {shape:?}"));
        let gate = c.param_in(&shape, -3.0, 3.0);
        let up = c.param(&shape);
        let y = c.op(SwiGlu, &[gate, up]);
        c.check(y);
    }
    // One tensor as both gate and up: the two contributions must be summed.
    let mut c = GradCheck::new(harness, "swiglu x with x");
    let x = c.param_in(&[3, 4], -3.0, 3.0);
    let y = c.op(SwiGlu, &[x, x]);
    c.check(y);
}

pub fn gqa_attention_grouped_and_ungrouped<H: Harness>(harness: &H) {
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
                harness,
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
