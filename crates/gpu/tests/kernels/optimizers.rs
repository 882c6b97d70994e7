//! AdamW and SGD updates, with and without a gradient scale, and the gradient norm.

use snug_gpu::kernels::adamw::{adamw, AdamWStep};
use snug_gpu::kernels::grad_norm::{grad_norm, sum_squares, sum_squares_workspace, GradNormRule};
use snug_gpu::kernels::sgd::sgd;

use crate::common::{assert_close, both_paths, gpu, uniform, Init, SameBits, Tensors};

const N: usize = 1000;

#[test]
fn adamw_updates_param_and_moments_and_skips_on_overflow() {
    let Some(device) = gpu() else { return };
    let s = AdamWStep {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        lr: 3e-3,
        step: 7,
    };
    for scale in [None, Some(0.5f32), Some(f32::INFINITY), Some(f32::NAN)] {
        let p = uniform(1, N, -1.0, 1.0);
        let g = uniform(2, N, -1.0, 1.0);
        let m = uniform(3, N, -0.1, 0.1);
        let v = uniform(4, N, 0.0, 0.01);
        let t = Tensors::new(
            device,
            &[
                Init::F32(p.clone()),
                Init::F32(g.clone()),
                Init::F32(m.clone()),
                Init::F32(v.clone()),
                Init::F32(vec![scale.unwrap_or(1.0)]),
            ],
        );
        t.run(|e, t| {
            let sc = scale.map(|_| t.get(4));
            adamw(
                device,
                e,
                s,
                N,
                [t.get(0), t.get(1), t.get(2), t.get(3)],
                sc,
            )
        });
        let f = |x: f32| f64::from(x);
        let skip = scale.is_some_and(|x| !x.is_finite());
        let (b1, b2) = (f(s.beta1), f(s.beta2));
        let bc1 = 1.0 - b1.powi(7);
        let bc2 = 1.0 - b2.powi(7);
        let (mut wp, mut wm, mut wv) = (vec![], vec![], vec![]);
        for i in 0..N {
            if skip {
                wp.push(f(p[i]));
                wm.push(f(m[i]));
                wv.push(f(v[i]));
                continue;
            }
            let gi = f(g[i]) * f(scale.unwrap_or(1.0));
            let mi = b1 * f(m[i]) + (1.0 - b1) * gi;
            let vi = b2 * f(v[i]) + (1.0 - b2) * gi * gi;
            let lr = f(s.lr);
            let step = lr / bc1 * mi / (vi.sqrt() / bc2.sqrt() + f(s.eps));
            wp.push(f(p[i]) * (1.0 - lr * f(s.weight_decay)) - step);
            wm.push(mi);
            wv.push(vi);
        }
        // The step is lr-sized: the new parameter is relative to |p| + lr.
        let p_mag: Vec<f64> = p.iter().map(|&x| f(x).abs() + f(s.lr)).collect();
        let m_mag: Vec<f64> = (0..N).map(|i| f(m[i]).abs() + f(g[i]).abs()).collect();
        let v_mag: Vec<f64> = (0..N).map(|i| f(v[i]) + f(g[i]) * f(g[i])).collect();
        let what = format!("adamw scale {scale:?}");
        assert_close(&what, &t.read(0), &wp, 1e-5, &p_mag);
        assert_close(&what, &t.read(2), &wm, 1e-5, &m_mag);
        assert_close(&what, &t.read(3), &wv, 1e-5, &v_mag);
    }
}

#[test]
fn sgd_updates_the_param_and_skips_on_overflow() {
    let Some(device) = gpu() else { return };
    for scale in [None, Some(0.25f32), Some(f32::NAN)] {
        let p = uniform(5, N, -1.0, 1.0);
        let g = uniform(6, N, -1.0, 1.0);
        let t = Tensors::new(
            device,
            &[
                Init::F32(p.clone()),
                Init::F32(g.clone()),
                Init::F32(vec![scale.unwrap_or(1.0)]),
            ],
        );
        let (lr, wd) = (0.05f32, 0.01f32);
        t.run(|e, t| {
            sgd(
                device,
                e,
                (lr, wd),
                N,
                [t.get(0), t.get(1)],
                scale.map(|_| t.get(2)),
            )
        });
        let skip = scale.is_some_and(|x| !x.is_finite());
        let f = |x: f32| f64::from(x);
        let want: Vec<f64> = (0..N)
            .map(|i| {
                if skip {
                    f(p[i])
                } else {
                    f(p[i]) * (1.0 - f(lr) * f(wd)) - f(lr) * f(scale.unwrap_or(1.0)) * f(g[i])
                }
            })
            .collect();
        let mag: Vec<f64> = (0..N)
            .map(|i| f(p[i]).abs() + f(lr) * f(g[i]).abs())
            .collect();
        assert_close(&format!("sgd {scale:?}"), &t.read(0), &want, 1e-5, &mag);
    }
}

#[test]
fn sums_of_squares_across_workgroups() {
    let mut same = SameBits::default();
    for device in both_paths() {
        for n in [1, 17, 1000, 300_000] {
            let x = uniform(n as u64, n, -1.0, 1.0);
            let ws = sum_squares_workspace(n);
            let t = Tensors::new(device, &[Init::F32(x.clone()), Init::Out(ws), Init::Out(1)]);
            t.run(|e, t| sum_squares(device, e, n, t.get(0), t.get(1), t.get(2)));
            let want: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            // Positive terms, compensated per thread, then a tree of ≤ 16 levels: ≤ 1e-5 relative.
            same.assert_close(&format!("Σx² of {n}"), &t.read(2), &[want], 1e-5, &[]);
        }
    }
}

#[test]
fn grad_norm_clips_and_unscales() {
    let Some(device) = gpu() else { return };
    let sums: Vec<f32> = (0..9).map(|i| 0.5 + i as f32 * 1.25).collect();
    let total: f64 = sums.iter().map(|&v| f64::from(v)).sum();
    let cases = [
        // (max_norm, scale, loss scale)
        (f32::INFINITY, 1.0, None),
        (1.0, 0.5, None),
        (100.0, 0.25, Some(1024.0f32)),
        (1.0, 1.0, Some(0.0)),
    ];
    for (max_norm, scale, loss_scale) in cases {
        let mut inits: Vec<Init> = sums.iter().map(|&s| Init::F32(vec![s])).collect();
        inits.push(Init::F32(vec![loss_scale.unwrap_or(1.0)]));
        inits.extend([Init::Out(2), Init::Out(1), Init::Out(1)]);
        let t = Tensors::new(device, &inits);
        let k = sums.len();
        t.run(|e, t| {
            let s: Vec<_> = (0..k).map(|i| t.get(i)).collect();
            grad_norm(
                device,
                e,
                GradNormRule { max_norm, scale },
                &s,
                loss_scale.map(|_| t.get(k)),
                t.get(k + 1),
                [t.get(k + 2), t.get(k + 3)],
            )
        });
        let sc = f64::from(scale) / f64::from(loss_scale.unwrap_or(1.0));
        let norm = total.sqrt() * sc;
        let clip = if max_norm.is_finite() {
            (f64::from(max_norm) / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        let (coef, got_norm) = (t.read(k + 2)[0], t.read(k + 3)[0]);
        let what = format!("max_norm {max_norm}, scale {scale}, loss scale {loss_scale:?}");
        if norm.is_finite() {
            assert_close(&what, &[got_norm], &[norm], 1e-6, &[]);
            assert_close(&what, &[coef], &[sc * clip], 1e-6, &[]);
        } else {
            assert!(
                got_norm.is_infinite() && coef.is_nan(),
                "{what}: {got_norm} {coef}"
            );
        }
    }
}
