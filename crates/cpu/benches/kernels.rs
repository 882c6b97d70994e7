//! Criterion benches of the hot kernels at char-small's shapes (batch 16 × block 256 = 4,096
//! tokens, width 384, 6 heads, MLP 1,536), and attention at GPT-2 small's too: `cargo bench -p
//! snug-cpu --bench kernels`.
//! Each builds a one-op graph, plans it and times `CpuSession::run` on physical-core threads;
//! criterion's "elements" throughput is the op's FLOPs.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use snug_cpu::{physical_cores, CpuSession};
use snug_graph::ops::{
    AdamW, Cast, CausalAttention, CausalAttentionBackward, Gelu, GeluBackward, GeluLinear,
    GeluLinearBackward, LayerNorm, LayerNormBackward, LayerNormLinear, LayerNormLinearBackward,
    MatMul, Op,
};
use snug_graph::{DType, Graph, Role, TensorId};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

const TOKENS: usize = 16 * 256;
const C: usize = 384;
const HIDDEN: usize = 4 * C;

/// A session running one op on fresh inputs of the given shapes, with its FLOPs.
fn one_op(op: impl Into<Op>, shapes: &[&[usize]]) -> (CpuSession, u64) {
    let threads = physical_cores();
    let mut g = Graph::new().with_threads(threads);
    let inputs: Vec<TensorId> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| g.add_leaf(format!("in{i}"), s, DType::F32, Role::Parameter))
        .collect::<Result<_, _>>()
        .expect("valid shapes");
    let outs = g.apply(op, &inputs).expect("the op accepts these shapes");
    for &o in &outs {
        g.mark_output(o);
    }
    let flops = g.flops();
    let p = plan(&g, &PlanOptions::default()).expect("plans");
    let mut s = CpuSession::new(g, p, Allocator::default(), threads).expect("allocates");
    for (i, (&t, shape)) in inputs.iter().zip(shapes).enumerate() {
        let n: usize = shape.iter().product();
        // Small positive values: every op here is defined on them (rstd, lse, variances).
        let v: Vec<f32> = (0..n)
            .map(|j| 0.5 + ((j * 7 + i) % 13) as f32 * 0.01)
            .collect();
        s.write_f32(t, &v).expect("writes");
    }
    (s, flops)
}

fn bench(c: &mut Criterion, name: &str, op: impl Into<Op>, shapes: &[&[usize]]) {
    let (mut s, flops) = one_op(op, shapes);
    let mut group = c.benchmark_group(name);
    group.sample_size(20);
    if flops > 0 {
        group.throughput(Throughput::Elements(flops));
    }
    group.bench_function("run", |b| {
        b.iter(|| s.run(ExecCtx::default()).expect("runs"))
    });
    group.finish();
}

fn kernels(c: &mut Criterion) {
    let mm = |ta, tb| MatMul {
        ta,
        tb,
        bias: false,
    };
    bench(
        c,
        "matmul [4096,384]x[384,1536]",
        mm(false, false),
        &[&[TOKENS, C], &[C, HIDDEN]],
    );
    bench(
        c,
        "matmul [4096,1536]x[384,1536]^T",
        mm(false, true),
        &[&[TOKENS, HIDDEN], &[C, HIDDEN]],
    );
    bench(
        c,
        "matmul [4096,1536]^T x[4096,384]",
        mm(true, false),
        &[&[TOKENS, HIDDEN], &[TOKENS, C]],
    );
    let qkv: &[usize] = &[16, 256, 3 * C];
    bench(c, "causal_attention", CausalAttention { n_head: 6 }, &[qkv]);
    bench(
        c,
        "causal_attention_backward",
        CausalAttentionBackward { n_head: 6 },
        &[qkv, &[16, 256, C], &[16, 6, 256], &[16, 256, C]],
    );
    // GPT-2 small's heads (4 × 1,024 tokens, 12 heads of 64), where a head's rows are
    // 2,304 floats apart and its products hundreds of rows deep.
    let qkv_gpt2: &[usize] = &[4, 1024, 3 * 768];
    bench(
        c,
        "causal_attention t1024",
        CausalAttention { n_head: 12 },
        &[qkv_gpt2],
    );
    bench(
        c,
        "causal_attention_backward t1024",
        CausalAttentionBackward { n_head: 12 },
        &[qkv_gpt2, &[4, 1024, 768], &[4, 12, 1024], &[4, 1024, 768]],
    );
    bench(
        c,
        "layer_norm",
        LayerNorm::default(),
        &[&[TOKENS, C], &[C], &[C]],
    );
    bench(
        c,
        "layer_norm_backward",
        LayerNormBackward,
        &[&[TOKENS, C], &[TOKENS, C], &[C], &[TOKENS], &[TOKENS]],
    );
    bench(c, "gelu", Gelu::default(), &[&[TOKENS, HIDDEN]]);
    bench(
        c,
        "gelu_backward",
        GeluBackward::default(),
        &[&[TOKENS, HIDDEN], &[TOKENS, HIDDEN]],
    );
    bench(
        c,
        "gelu_linear",
        GeluLinear::default(),
        &[&[TOKENS, HIDDEN], &[HIDDEN, C], &[C]],
    );
    bench(
        c,
        "gelu_linear_backward",
        GeluLinearBackward::default(),
        &[&[TOKENS, HIDDEN], &[HIDDEN, C], &[TOKENS, C]],
    );
    bench(
        c,
        "layer_norm_linear",
        LayerNormLinear::default(),
        &[&[TOKENS, C], &[C], &[C], &[C, HIDDEN], &[HIDDEN]],
    );
    bench(
        c,
        "layer_norm_linear_backward",
        LayerNormLinearBackward,
        &[
            &[TOKENS, C],
            &[C],
            &[C],
            &[TOKENS],
            &[TOKENS],
            &[C, HIDDEN],
            &[TOKENS, HIDDEN],
        ],
    );
    bench(
        c,
        "cast f32->bf16",
        Cast { to: DType::BF16 },
        &[&[TOKENS, HIDDEN]],
    );
    let params: &[usize] = &[10_770_816];
    bench(
        c,
        "adamw",
        AdamW::default(),
        &[params, params, params, params],
    );
}

criterion_group!(benches, kernels);
criterion_main!(benches);
