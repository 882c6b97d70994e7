//! The dequantize kernel against the host's dequantization of the same codes, bit for bit:
//! int8 and NF4, sizes spanning several of the kernel's parallel chunks with a partial last
//! chunk, a partial NF4 block and an odd count (a half-used last byte); and a product read
//! through it equals the product of the dequantized weight written in f32.

use snug_cpu::CpuSession;
use snug_graph::ops::{Dequantize, MatMul, QuantizeBase};
use snug_graph::{DType, Graph, Role};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

use snug_testkit::heavy_tailed_values as values;

/// `x [2, k] · dequantize(w [k, n])` and the dequantized weight, on `threads` threads.
fn run(base: QuantizeBase, k: usize, n: usize, threads: usize) -> (Vec<f32>, Vec<f32>) {
    let scheme = base.scheme().unwrap();
    let w = values(k * n, 3);
    let x = values(2 * k, 11);
    let (codes, absmax) = base.quantize(&w, &[k, n]);
    let mut g = Graph::new();
    let c = g
        .add_leaf(
            "w",
            &scheme.codes_shape(&[k, n]),
            DType::U8,
            Role::Parameter,
        )
        .unwrap();
    let a = g
        .add_leaf(
            "w.absmax",
            &scheme.absmax_shape(&[k, n]),
            DType::F32,
            Role::Parameter,
        )
        .unwrap();
    let xi = g.add_leaf("x", &[2, k], DType::F32, Role::Input).unwrap();
    let op = Dequantize {
        scheme,
        shape: vec![k, n],
    };
    let wd = g.apply1(op, &[c, a]).unwrap();
    let y = g.apply1(MatMul::default(), &[xi, wd]).unwrap();
    g.mark_output(wd);
    g.mark_output(y);
    let memory = plan(&g, &PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(g, memory, Allocator::default(), threads).unwrap();
    s.write_bytes(c, &codes).unwrap();
    s.write_f32(a, &absmax).unwrap();
    s.write_f32(xi, &x).unwrap();
    s.run(ExecCtx::default()).unwrap();
    let wd_values = s.read_f32(wd).unwrap().to_vec();
    assert_eq!(
        wd_values.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        base.dequantize(&codes, &absmax, &[k, n])
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        "{base} {k}x{n}: the kernel's values are the host's"
    );
    (wd_values, s.read_f32(y).unwrap().to_vec())
}

/// The same product with the dequantized weight written as an f32 input.
fn f32_product(k: usize, n: usize, w: &[f32]) -> Vec<f32> {
    let mut g = Graph::new();
    let wi = g
        .add_leaf("w", &[k, n], DType::F32, Role::Parameter)
        .unwrap();
    let xi = g.add_leaf("x", &[2, k], DType::F32, Role::Input).unwrap();
    let y = g.apply1(MatMul::default(), &[xi, wi]).unwrap();
    g.mark_output(y);
    let memory = plan(&g, &PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
    s.write_f32(wi, w).unwrap();
    s.write_f32(xi, &values(2 * k, 11)).unwrap();
    s.run(ExecCtx::default()).unwrap();
    s.read_f32(y).unwrap().to_vec()
}

#[test]
fn dequantize_kernel_equals_the_host_dequantization_and_feeds_the_gemm_exactly() {
    // 33 × 2049 = 67617 values: two full chunks of 32768 and a partial one, a partial NF4
    // block (67617 = 1056·64 + 33) and an odd count.
    for (k, n) in [(33, 2049), (7, 5), (64, 64)] {
        for base in [QuantizeBase::Int8, QuantizeBase::Nf4] {
            for threads in [1, 2] {
                let (wd, y) = run(base, k, n, threads);
                let want = f32_product(k, n, &wd);
                assert_eq!(
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{base} {k}x{n} on {threads} threads"
                );
            }
        }
    }
}
