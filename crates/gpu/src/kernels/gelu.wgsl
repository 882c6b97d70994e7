// GELU and its gradient; TANH picks GPT-2's tanh form, otherwise the exact (erf) form.

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;

const SQRT_2_OVER_PI: f32 = 0.7978845608;
const COEF: f32 = 0.044715;
const FRAC_1_SQRT_2: f32 = 0.7071067812;
const INV_SQRT_2PI: f32 = 0.3989422804;

// erfc with fractional error below 1.2e-7 everywhere (Numerical Recipes' Chebyshev fit).
// WGSL has no erf, and 1 + erf(x) cancels for negative x where erfc does not.
fn erfc(v: f32) -> f32 {
    let z = abs(v);
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
        + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
        + t * (-0.82215223 + t * 0.17087277))))))));
    let r = t * exp(-z * z + poly);
    return select(2.0 - r, r, v >= 0.0);
}

// Φ(v), the standard normal CDF.
fn cdf(v: f32) -> f32 {
    return 0.5 * erfc(-v * FRAC_1_SQRT_2);
}

// 0.5·(1 + tanh(u)) = σ(2u), with u = √(2/π)(x + 0.044715x³).
fn tanh_gate(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-2.0 * SQRT_2_OVER_PI * (v + COEF * v * v * v)));
}

fn gelu_of(v: f32) -> f32 {
    if (TANH) {
        return v * tanh_gate(v);
    }
    return v * cdf(v);
}

fn gelu_grad(v: f32) -> f32 {
    if (TANH) {
        let s = tanh_gate(v);
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * v * v);
        return s + 2.0 * v * s * (1.0 - s) * du;
    }
    return cdf(v) + v * INV_SQRT_2PI * exp(-0.5 * v * v);
}

@compute @workgroup_size(256)
fn gelu(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        y[i] = gelu_of(x[i]);
    }
}

// dx = dy · gelu'(x); dx may be the range of dy or of x.
@compute @workgroup_size(256)
fn gelu_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        dx[i] = dy[i] * gelu_grad(x[i]);
    }
}
