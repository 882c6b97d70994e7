//! GELU (both forms), SiLU and SwiGLU, forward and backward.

use snug_gpu::kernels::gelu::{gelu, gelu_backward, GeluForm};
use snug_gpu::kernels::silu::{silu, silu_backward};
use snug_gpu::kernels::swiglu::{swiglu, swiglu_backward};

use crate::common::{assert_close, gpu, uniform, Init, Tensors};

const N: usize = 1037;

fn erf(x: f64) -> f64 {
    // Abramowitz–Stegun 7.1.26 is too coarse for a reference; integrate Φ's density instead.
    // erf(x) = 2/√π ∫₀ˣ e^{−t²} dt by composite Simpson with 2000 panels (error < 1e-13 here).
    let n = 2000;
    let h = x / n as f64;
    let f = |t: f64| (-t * t).exp();
    let mut s = f(0.0) + f(x);
    for i in 1..n {
        s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
    }
    s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
}

/// `(gelu(x), gelu'(x))` in f64.
fn gelu_ref(form: GeluForm, x: f64) -> (f64, f64) {
    match form {
        GeluForm::Tanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let u = k * (x + 0.044715 * x * x * x);
            let th = u.tanh();
            let du = k * (1.0 + 3.0 * 0.044715 * x * x);
            (
                0.5 * x * (1.0 + th),
                0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du,
            )
        }
        GeluForm::Exact => {
            // Φ(x) = erfc(−x/√2)/2, from erf on |x| so that the tail keeps its digits.
            let z = x / std::f64::consts::SQRT_2;
            let cdf = if z < 0.0 {
                0.5 * erfc_pos(-z)
            } else {
                1.0 - 0.5 * erfc_pos(z)
            };
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (x * cdf, cdf + x * pdf)
        }
    }
}

/// erfc(z) for z ≥ 0: 1 − erf(z) near 0, and the continued fraction in the tail.
fn erfc_pos(z: f64) -> f64 {
    if z < 2.0 {
        return 1.0 - erf(z);
    }
    // Lentz's continued fraction for erfc: e^{−z²}/√π · 1/(z + 1/2/(z + 1/(z + 3/2/(z + …)))).
    let mut f = z;
    for k in (1..60).rev() {
        f = z + (k as f64 / 2.0) / f;
    }
    (-z * z).exp() / std::f64::consts::PI.sqrt() / f
}

#[test]
fn gelu_both_forms_and_their_gradients() {
    let Some(device) = gpu() else { return };
    let x = uniform(11, N, -7.0, 7.0);
    let dy = uniform(12, N, -1.0, 1.0);
    for form in [GeluForm::Tanh, GeluForm::Exact] {
        let t = Tensors::new(
            device,
            &[
                Init::F32(x.clone()),
                Init::F32(dy.clone()),
                Init::Out(N),
                Init::Out(N),
            ],
        );
        t.run(|e, t| {
            gelu(device, e, form, N, t.get(0), t.get(2))?;
            gelu_backward(device, e, form, N, t.get(0), t.get(1), t.get(3))
        });
        let (y, g): (Vec<f64>, Vec<f64>) = x
            .iter()
            .zip(&dy)
            .map(|(&v, &d)| {
                let (y, s) = gelu_ref(form, f64::from(v));
                (y, s * f64::from(d))
            })
            .unzip();
        // Relative 1e-5 with a floor of 1e-7·|x|: where gelu(x) vanishes in the far negative
        // tail (|y| < 1e-6) f32's exp and the erfc fit are good to ~1e-7 absolute, not relative.
        let floor: Vec<f64> = x.iter().map(|v| 1e-2 * f64::from(*v).abs()).collect();
        assert_close(&format!("gelu {form:?}"), &t.read(2), &y, 1e-5, &floor);
        assert_close(&format!("gelu' {form:?}"), &t.read(3), &g, 1e-5, &floor);
    }
}

#[test]
fn gelu_backward_in_place_over_dy() {
    let Some(device) = gpu() else { return };
    let x = uniform(13, 100, -3.0, 3.0);
    let dy = uniform(14, 100, -1.0, 1.0);
    let t = Tensors::new(device, &[Init::F32(x.clone()), Init::F32(dy.clone())]);
    t.run(|e, t| gelu_backward(device, e, GeluForm::Tanh, 100, t.get(0), t.get(1), t.get(1)));
    let want: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &d)| gelu_ref(GeluForm::Tanh, f64::from(v)).1 * f64::from(d))
        .collect();
    assert_close("gelu' in place", &t.read(1), &want, 1e-5, &[]);
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn silu_and_its_gradient() {
    let Some(device) = gpu() else { return };
    let x = uniform(15, N, -20.0, 20.0);
    let dy = uniform(16, N, -1.0, 1.0);
    let t = Tensors::new(
        device,
        &[
            Init::F32(x.clone()),
            Init::F32(dy.clone()),
            Init::Out(N),
            Init::Out(N),
        ],
    );
    t.run(|e, t| {
        silu(device, e, N, t.get(0), t.get(2))?;
        silu_backward(device, e, N, t.get(0), t.get(1), t.get(3))
    });
    let (y, g): (Vec<f64>, Vec<f64>) = x
        .iter()
        .zip(&dy)
        .map(|(&v, &d)| {
            let (v, s) = (f64::from(v), sigmoid(f64::from(v)));
            (v * s, f64::from(d) * s * (1.0 + v * (1.0 - s)))
        })
        .unzip();
    // The far negative tail (x·σ(x) ≈ x·e^x ≈ 1e-8 at x = −20) is checked to 1e-7·|x|.
    let floor: Vec<f64> = x.iter().map(|v| 1e-2 * f64::from(*v).abs()).collect();
    assert_close("silu", &t.read(2), &y, 1e-5, &floor);
    assert_close("silu'", &t.read(3), &g, 1e-5, &floor);
}

#[test]
fn swiglu_and_its_gradients() {
    let Some(device) = gpu() else { return };
    let gate = uniform(17, N, -6.0, 6.0);
    let up = uniform(18, N, -2.0, 2.0);
    let dy = uniform(19, N, -1.0, 1.0);
    let t = Tensors::new(
        device,
        &[
            Init::F32(gate.clone()),
            Init::F32(up.clone()),
            Init::F32(dy.clone()),
            Init::Out(N),
            Init::Out(N),
            Init::Out(N),
        ],
    );
    t.run(|e, t| {
        swiglu(device, e, N, t.get(0), t.get(1), t.get(3))?;
        swiglu_backward(
            device,
            e,
            N,
            [t.get(0), t.get(1), t.get(2)],
            [t.get(4), t.get(5)],
        )
    });
    let mut want = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..N {
        let (g, u, d) = (f64::from(gate[i]), f64::from(up[i]), f64::from(dy[i]));
        let s = sigmoid(g);
        want.0.push(g * s * u);
        want.1.push(d * u * s * (1.0 + g * (1.0 - s)));
        want.2.push(d * g * s);
    }
    let floor: Vec<f64> = gate.iter().map(|v| 1e-3 * f64::from(*v).abs()).collect();
    assert_close("swiglu", &t.read(3), &want.0, 1e-5, &floor);
    assert_close("swiglu dgate", &t.read(4), &want.1, 1e-5, &floor);
    assert_close("swiglu dup", &t.read(5), &want.2, 1e-5, &floor);
}
