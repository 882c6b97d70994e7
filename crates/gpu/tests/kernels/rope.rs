use snug_gpu::kernels::rope::{rope, RopeSpec};
use snug_graph::ops::RopeScaling;

use crate::common::{assert_close, gpu, uniform, Init, Tensors};

fn reference(spec: RopeSpec, (b, t): (usize, usize), x: &[f32]) -> Vec<f64> {
    let (hd, half) = (spec.head_dim, spec.head_dim / 2);
    let c = spec.n_head * hd;
    let sign = if spec.inverse { -1.0 } else { 1.0 };
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for pos in 0..t {
            for h in 0..spec.n_head {
                let base = (bi * t + pos) * c + h * hd;
                for i in 0..half {
                    let inv_freq = spec.inv_freq(i);
                    let (s, co) = (pos as f64 * inv_freq).sin_cos();
                    let s = sign * s;
                    let (x1, x2) = (f64::from(x[base + i]), f64::from(x[base + i + half]));
                    y[base + i] = x1 * co - x2 * s;
                    y[base + i + half] = x2 * co + x1 * s;
                }
            }
        }
    }
    y
}

#[test]
fn rotations_forward_and_inverse_at_short_and_long_positions() {
    let Some(device) = gpu() else { return };
    // The last case reaches position 5000, where a float angle would be off by ~1e-4 rad.
    // Llama 3's scaling with a small original context puts frequencies in all three bands.
    let llama3 = Some(RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 16,
    });
    for (b, t, n_head, head_dim, inverse, scaling) in [
        (1, 1, 1, 2, false, None),
        (2, 17, 3, 8, false, None),
        (1, 65, 2, 64, true, None),
        (1, 5000, 1, 4, false, None),
        (2, 40, 2, 32, false, llama3),
        (1, 40, 2, 32, true, llama3),
    ] {
        let spec = RopeSpec {
            inverse,
            scaling,
            ..RopeSpec::new(n_head, head_dim, 10_000.0)
        };
        let n = b * t * n_head * head_dim;
        let x = uniform(n as u64, n, -1.0, 1.0);
        let t_ = Tensors::new(device, &[Init::F32(x.clone()), Init::Out(n)]);
        t_.run(|e, tt| rope(device, e, spec, (b, t), tt.get(0), tt.get(1)));
        let want = reference(spec, (b, t), &x);
        // A rotation of a pair: each output is relative to the pair's magnitude.
        let half = head_dim / 2;
        let mag: Vec<f64> = (0..n)
            .map(|k| {
                let i = k % head_dim;
                let (a, bb) = if i < half {
                    (k, k + half)
                } else {
                    (k - half, k)
                };
                f64::from(x[a]).abs() + f64::from(x[bb]).abs()
            })
            .collect();
        assert_close(
            &format!("rope {b}×{t}×{n_head}×{head_dim}"),
            &t_.read(1),
            &want,
            1e-5,
            &mag,
        );
    }
}

#[test]
fn the_inverse_undoes_the_forward_in_place() {
    let Some(device) = gpu() else { return };
    let (b, t, n_head, head_dim) = (2, 33, 2, 16);
    let n = b * t * n_head * head_dim;
    let x = uniform(77, n, -1.0, 1.0);
    let tt = Tensors::new(device, &[Init::F32(x.clone())]);
    let spec = RopeSpec::new(n_head, head_dim, 500_000.0);
    tt.run(|e, tt| {
        rope(device, e, spec, (b, t), tt.get(0), tt.get(0))?;
        let back = RopeSpec {
            inverse: true,
            ..spec
        };
        rope(device, e, back, (b, t), tt.get(0), tt.get(0))
    });
    let want: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    assert_close("rope⁻¹(rope(x))", &tt.read(0), &want, 1e-5, &vec![1.0; n]);
}
