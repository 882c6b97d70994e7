// AdamW (decoupled weight decay), updating param, m and v in place. With SCALE the gradient is
// multiplied by scale[0] first, and a scale that is not finite (an overflow under loss
// scaling) skips the update.

struct Params {
    n: u32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    decay: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read_write> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> scale: array<f32>;

@compute @workgroup_size(256)
fn adamw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    var g = grad[i];
    if (SCALE) {
        let s = scale[0];
        if (!is_finite(s)) {
            return;
        }
        g *= s;
    }
    let mi = p.beta1 * m[i] + (1.0 - p.beta1) * g;
    let vi = p.beta2 * v[i] + (1.0 - p.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    let denom = sqrt(vi) / p.bc2_sqrt + p.eps;
    param[i] = param[i] * p.decay - p.step_size * mi / denom;
}
