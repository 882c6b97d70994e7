//! LayerNorm and RMSNorm, forward (with the saved statistics) and backward.

use snug_gpu::kernels::layernorm::{layer_norm, layer_norm_backward};
use snug_gpu::kernels::rmsnorm::{rms_norm, rms_norm_backward};

use crate::common::{both_paths, uniform, Init, SameBits, Tensors};

/// Row widths that cross the 256-thread stride, and the 32-column blocks of the weight grads.
const SHAPES: [(usize, usize); 4] = [(1, 1), (17, 17), (9, 300), (70, 65)];
const EPS: f32 = 1e-5;

struct LnRef {
    y: Vec<f64>,
    mean: Vec<f64>,
    rstd: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
    /// Σ|terms| of each dw and db (the weight grads are sums over rows).
    dw_mag: Vec<f64>,
    db_mag: Vec<f64>,
    /// Magnitude each dx is relative to: rstd·(|g| + mean|g| + |x̂|·mean|g·x̂|).
    dx_mag: Vec<f64>,
}

fn ln_ref(rows: usize, c: usize, x: &[f32], w: &[f32], b: &[f32], dy: &[f32]) -> LnRef {
    let f = |v: f32| f64::from(v);
    let mut r = LnRef {
        y: vec![],
        mean: vec![],
        rstd: vec![],
        dx: vec![],
        dw: vec![0.0; c],
        db: vec![0.0; c],
        dw_mag: vec![0.0; c],
        db_mag: vec![0.0; c],
        dx_mag: vec![],
    };
    for i in 0..rows {
        let xr: Vec<f64> = x[i * c..(i + 1) * c].iter().map(|&v| f(v)).collect();
        let dyr = &dy[i * c..(i + 1) * c];
        let m = xr.iter().sum::<f64>() / c as f64;
        let var = xr.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
        let s = 1.0 / (var + f64::from(EPS)).sqrt();
        r.mean.push(m);
        r.rstd.push(s);
        let xhat: Vec<f64> = xr.iter().map(|v| (v - m) * s).collect();
        let g: Vec<f64> = (0..c).map(|j| f(dyr[j]) * f(w[j])).collect();
        let mg = g.iter().sum::<f64>() / c as f64;
        let mgx = (0..c).map(|j| g[j] * xhat[j]).sum::<f64>() / c as f64;
        let mag_g = g.iter().map(|v| v.abs()).sum::<f64>() / c as f64;
        let mag_gx = (0..c).map(|j| (g[j] * xhat[j]).abs()).sum::<f64>() / c as f64;
        for j in 0..c {
            r.y.push(xhat[j] * f(w[j]) + f(b[j]));
            r.dx.push(s * (g[j] - mg - xhat[j] * mgx));
            r.dx_mag
                .push(s * (g[j].abs() + mag_g + xhat[j].abs() * mag_gx));
            r.dw[j] += f(dyr[j]) * xhat[j];
            r.db[j] += f(dyr[j]);
            r.dw_mag[j] += (f(dyr[j]) * xhat[j]).abs();
            r.db_mag[j] += f(dyr[j]).abs();
        }
    }
    r
}

#[test]
fn layer_norm_forward_and_backward() {
    let mut same = SameBits::default();
    for device in both_paths() {
        for (k, (rows, c)) in SHAPES.into_iter().enumerate() {
            let seed = 100 + 10 * k as u64;
            let x = uniform(seed, rows * c, -2.0, 3.0);
            let w = uniform(seed + 1, c, 0.5, 1.5);
            let b = uniform(seed + 2, c, -0.5, 0.5);
            let dy = uniform(seed + 3, rows * c, -1.0, 1.0);
            let t = Tensors::new(
                device,
                &[
                    Init::F32(x.clone()),
                    Init::F32(w.clone()),
                    Init::F32(b.clone()),
                    Init::F32(dy.clone()),
                    Init::Out(rows * c),
                    Init::Out(rows),
                    Init::Out(rows),
                    Init::Out(rows * c),
                    Init::Out(c),
                    Init::Out(c),
                ],
            );
            t.run(|e, t| {
                layer_norm(
                    device,
                    e,
                    (rows, c, EPS),
                    [t.get(0), t.get(1), t.get(2)],
                    [t.get(4), t.get(5), t.get(6)],
                )?;
                layer_norm_backward(
                    device,
                    e,
                    (rows, c),
                    [t.get(3), t.get(0), t.get(1), t.get(5), t.get(6)],
                    [t.get(7), t.get(8), t.get(9)],
                )
            });
            let r = ln_ref(rows, c, &x, &w, &b, &dy);
            let what = |s: &str| format!("{s} [{rows}, {c}]");
            // Row statistics are sums of c ≤ 300 terms, so their f32 error stays within 1e-5 of
            // the terms' magnitudes; outputs are compared against the magnitudes they are built
            // from (|x̂·w| + |b| for y).
            let y_mag: Vec<f64> = (0..rows * c)
                .map(|i| r.y[i].abs() + f64::from(b[i % c]).abs() + 1e-3)
                .collect();
            same.assert_close(&what("y"), &t.read(4), &r.y, 1e-5, &y_mag);
            let mean_mag: Vec<f64> = (0..rows)
                .map(|i| {
                    x[i * c..(i + 1) * c]
                        .iter()
                        .map(|v| f64::from(v.abs()))
                        .sum::<f64>()
                        / c as f64
                })
                .collect();
            same.assert_close(&what("mean"), &t.read(5), &r.mean, 1e-5, &mean_mag);
            same.assert_close(&what("rstd"), &t.read(6), &r.rstd, 1e-5, &[]);
            same.assert_close(&what("dx"), &t.read(7), &r.dx, 1e-5, &r.dx_mag);
            same.assert_close(&what("dw"), &t.read(8), &r.dw, 1e-5, &r.dw_mag);
            same.assert_close(&what("db"), &t.read(9), &r.db, 1e-5, &r.db_mag);
        }
    }
}

#[test]
fn layer_norm_backward_in_place_over_dy() {
    let mut same = SameBits::default();
    for device in both_paths() {
        let (rows, c) = (5, 70);
        let x = uniform(7, rows * c, -1.0, 1.0);
        let w = uniform(8, c, 0.5, 1.5);
        let b = vec![0.0; c];
        let dy = uniform(9, rows * c, -1.0, 1.0);
        let t = Tensors::new(
            device,
            &[
                Init::F32(x.clone()),
                Init::F32(w.clone()),
                Init::F32(b.clone()),
                Init::F32(dy.clone()),
                Init::Out(rows * c),
                Init::Out(rows),
                Init::Out(rows),
                Init::Out(c),
                Init::Out(c),
            ],
        );
        t.run(|e, t| {
            layer_norm(
                device,
                e,
                (rows, c, EPS),
                [t.get(0), t.get(1), t.get(2)],
                [t.get(4), t.get(5), t.get(6)],
            )?;
            layer_norm_backward(
                device,
                e,
                (rows, c),
                [t.get(3), t.get(0), t.get(1), t.get(5), t.get(6)],
                [t.get(3), t.get(7), t.get(8)],
            )
        });
        let r = ln_ref(rows, c, &x, &w, &b, &dy);
        same.assert_close("dx over dy", &t.read(3), &r.dx, 1e-5, &r.dx_mag);
        same.assert_close("dw (dy read before dx)", &t.read(7), &r.dw, 1e-5, &r.dw_mag);
    }
}

#[test]
fn rms_norm_forward_and_backward() {
    let mut same = SameBits::default();
    for device in both_paths() {
        for (k, (rows, c)) in SHAPES.into_iter().enumerate() {
            let seed = 200 + 10 * k as u64;
            let x = uniform(seed, rows * c, -2.0, 2.0);
            let w = uniform(seed + 1, c, 0.5, 1.5);
            let dy = uniform(seed + 2, rows * c, -1.0, 1.0);
            let t = Tensors::new(
                device,
                &[
                    Init::F32(x.clone()),
                    Init::F32(w.clone()),
                    Init::F32(dy.clone()),
                    Init::Out(rows * c),
                    Init::Out(rows),
                    Init::Out(rows * c),
                    Init::Out(c),
                ],
            );
            t.run(|e, t| {
                rms_norm(
                    device,
                    e,
                    (rows, c, EPS),
                    [t.get(0), t.get(1)],
                    [t.get(3), t.get(4)],
                )?;
                rms_norm_backward(
                    device,
                    e,
                    (rows, c),
                    [t.get(2), t.get(0), t.get(1), t.get(4)],
                    [t.get(5), t.get(6)],
                )
            });
            let f = |v: f32| f64::from(v);
            let (mut y, mut rstd, mut dx, mut dx_mag) = (vec![], vec![], vec![], vec![]);
            let (mut dw, mut dw_mag) = (vec![0.0; c], vec![0.0; c]);
            for i in 0..rows {
                let xr = &x[i * c..(i + 1) * c];
                let dyr = &dy[i * c..(i + 1) * c];
                let ms = xr.iter().map(|&v| f(v) * f(v)).sum::<f64>() / c as f64;
                let s = 1.0 / (ms + f64::from(EPS)).sqrt();
                rstd.push(s);
                let mgx = (0..c)
                    .map(|j| f(dyr[j]) * f(w[j]) * f(xr[j]) * s)
                    .sum::<f64>()
                    / c as f64;
                let mag = (0..c)
                    .map(|j| (f(dyr[j]) * f(w[j]) * f(xr[j]) * s).abs())
                    .sum::<f64>()
                    / c as f64;
                for j in 0..c {
                    let xhat = f(xr[j]) * s;
                    y.push(xhat * f(w[j]));
                    dx.push(s * (f(dyr[j]) * f(w[j]) - xhat * mgx));
                    dx_mag.push(s * ((f(dyr[j]) * f(w[j])).abs() + xhat.abs() * mag));
                    dw[j] += f(dyr[j]) * xhat;
                    dw_mag[j] += (f(dyr[j]) * xhat).abs();
                }
            }
            let what = |s: &str| format!("rms {s} [{rows}, {c}]");
            same.assert_close(&what("y"), &t.read(3), &y, 1e-5, &[]);
            same.assert_close(&what("rstd"), &t.read(4), &rstd, 1e-5, &[]);
            same.assert_close(&what("dx"), &t.read(5), &dx, 1e-5, &dx_mag);
            same.assert_close(&what("dw"), &t.read(6), &dw, 1e-5, &dw_mag);
        }
    }
}
