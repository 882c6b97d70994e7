use snug_gpu::kernels::matmul::{matmul, splits, Gemm};
use snug_gpu::GpuDevice;

use crate::common::{assert_close, gpu, uniform, Init, Tensors};

/// `(c, Σ|terms|)` of `op(a)·op(b) (+ bias)` in f64.
fn reference(g: Gemm, a: &[f32], b: &[f32], bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>) {
    let (mut c, mut mag) = (Vec::new(), Vec::new());
    for z in 0..g.batch {
        let a = &a[z * g.m * g.k..];
        let b = if g.shared_b { b } else { &b[z * g.k * g.n..] };
        for i in 0..g.m {
            for j in 0..g.n {
                let (mut s, mut m) = (0.0f64, 0.0f64);
                if let Some(bias) = bias {
                    s += f64::from(bias[j]);
                    m += f64::from(bias[j]).abs();
                }
                for p in 0..g.k {
                    let av = if g.ta { a[p * g.m + i] } else { a[i * g.k + p] };
                    let bv = if g.tb { b[j * g.k + p] } else { b[p * g.n + j] };
                    let t = f64::from(av) * f64::from(bv);
                    s += t;
                    m += t.abs();
                }
                c.push(s);
                mag.push(m);
            }
        }
    }
    (c, mag)
}

fn check(device: &'static GpuDevice, g: Gemm, with_bias: bool, seed: u64) {
    let b_count = if g.shared_b { 1 } else { g.batch };
    let a = uniform(seed, g.batch * g.m * g.k, -1.0, 1.0);
    let b = uniform(seed + 1, b_count * g.k * g.n, -1.0, 1.0);
    let bias = uniform(seed + 2, g.n, -1.0, 1.0);
    // A product split along its depth sums its slices in a workspace (NaN until written).
    let split = splits(&g);
    let t = Tensors::new(
        device,
        &[
            Init::F32(a.clone()),
            Init::F32(b.clone()),
            Init::F32(bias.clone()),
            Init::Out(g.batch * g.m * g.n),
            Init::Out(if split > 1 { split * g.m * g.n } else { 1 }),
        ],
    );
    t.run(|e, t| {
        let bias = with_bias.then(|| t.get(2));
        let ws = (split > 1).then(|| t.get(4));
        matmul(device, e, g, t.get(0), t.get(1), bias, t.get(3), ws)
    });
    let (want, mag) = reference(g, &a, &b, with_bias.then_some(&bias[..]));
    // f32 sums of k products: error below k·2⁻²⁴ of the terms' magnitudes (8e-6 at 130).
    let tol = (g.k as f64 * 2f64.powi(-24)).max(1e-5);
    assert_close(
        &format!("{g:?} bias={with_bias}"),
        &t.read(3),
        &want,
        tol,
        &mag,
    );
}

/// Weight-gradient shapes (few output tiles, a long depth) are cut into depth slices summed
/// apart and then in order: every layout, with and without a bias, the last slice short.
#[test]
fn deep_products_are_split_along_their_depth() {
    let Some(device) = gpu() else { return };
    let mut seed = 100;
    for (m, n, k, want_splits) in [(70, 70, 1000, 3), (33, 130, 600, 2), (17, 17, 4100, 16)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let g = Gemm {
                batch: 1,
                m,
                n,
                k,
                ta,
                tb,
                shared_b: true,
            };
            assert_eq!(splits(&g), want_splits, "{g:?}");
            for bias in [false, true] {
                seed += 3;
                check(device, g, bias, seed);
            }
        }
    }
    // Batches, and products whose tiles already fill a GPU, are not split.
    let batched = Gemm {
        batch: 2,
        m: 17,
        n: 17,
        k: 4100,
        ta: false,
        tb: false,
        shared_b: false,
    };
    assert_eq!(splits(&batched), 1);
    let wide = Gemm {
        batch: 1,
        m: 64 * 16,
        n: 64 * 16,
        ..batched
    };
    assert_eq!(splits(&wide), 1);
}

/// A product the plan split needs the workspace it was planned with.
#[test]
fn a_split_product_without_its_workspace_is_an_error() {
    let Some(device) = gpu() else { return };
    let g = Gemm {
        batch: 1,
        m: 17,
        n: 17,
        k: 600,
        ta: false,
        tb: false,
        shared_b: true,
    };
    assert!(splits(&g) > 1);
    let t = Tensors::new(
        device,
        &[
            Init::F32(vec![0.0; 17 * 600]),
            Init::F32(vec![0.0; 600 * 17]),
            Init::Out(17 * 17),
        ],
    );
    let mut e = device.encoder("test");
    let err = matmul(device, &mut e, g, t.get(0), t.get(1), None, t.get(2), None).unwrap_err();
    assert!(
        matches!(err, snug_gpu::GpuError::Unsupported { .. })
            && err.to_string().contains("workspace"),
        "{err}"
    );
}

#[test]
fn every_layout_and_size_across_tile_edges() {
    let Some(device) = gpu() else { return };
    let mut seed = 0;
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for (m, n, k) in [
            (1, 1, 1),
            (17, 17, 17),
            (65, 65, 65),
            (130, 65, 17),
            (17, 130, 65),
        ] {
            for bias in [false, true] {
                seed += 3;
                let g = Gemm {
                    batch: 1,
                    m,
                    n,
                    k,
                    ta,
                    tb,
                    shared_b: false,
                };
                check(device, g, bias, seed);
            }
        }
    }
}

#[test]
fn batches_with_their_own_or_a_shared_right_operand() {
    let Some(device) = gpu() else { return };
    for (shared_b, ta, tb) in [
        (false, false, false),
        (false, true, true),
        (true, false, true),
    ] {
        let g = Gemm {
            batch: 3,
            m: 33,
            n: 70,
            k: 130,
            ta,
            tb,
            shared_b,
        };
        check(device, g, shared_b, 7);
    }
}

#[test]
fn a_short_operand_is_a_binding_error() {
    let Some(device) = gpu() else { return };
    let t = Tensors::new(device, &[Init::Out(4), Init::Out(4), Init::Out(4)]);
    let g = Gemm {
        batch: 1,
        m: 2,
        n: 2,
        k: 3,
        ta: false,
        tb: false,
        shared_b: false,
    };
    let mut e = device.encoder("short");
    let err = matmul(device, &mut e, g, t.get(0), t.get(1), None, t.get(2), None).unwrap_err();
    assert!(matches!(err, snug_gpu::GpuError::Binding { .. }), "{err}");
}
