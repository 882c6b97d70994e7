//! Large tensors: above `MIN_PAR_ELEMS` (32768) elements the CPU's kernels split their outputs
//! into chunks run on several threads, and each chunk must find its own rows; other devices
//! spread such tensors over many workgroups.

use rand::seq::SliceRandom;
use rand::Rng;
use snug_graph::ops::{
    Binary, BroadcastTo, CrossEntropy, Embedding, Gelu, GeluApprox, GeluLinear, LayerNorm,
    LayerNormLinear, LogSoftmax, MatMul, ReduceKind, RmsNorm, Rope, Scale, Silu, Softmax, SumTo,
    SwiGlu, Transpose,
};

use crate::gradcheck::reduce;
use crate::{large_shapes, GradCheck, Harness};

pub fn large_tensors_through_the_parallel_kernel_paths<H: Harness>(harness: &H) {
    if !large_shapes(harness) {
        return;
    }
    let t = 2;
    let big = |label: &str| GradCheck::with_threads(harness, format!("large {label}"), t).large();

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

pub fn large_llama_ops_through_the_parallel_kernel_paths<H: Harness>(harness: &H) {
    if !large_shapes(harness) {
        return;
    }
    let big = |label: &str| GradCheck::with_threads(harness, format!("large {label}"), 2).large();

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
