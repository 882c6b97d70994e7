// SwiGLU's gate, silu(gate)·up, and its gradients
// dgate = dy·up·silu'(gate), dup = dy·silu(gate).

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> gate: array<f32>;
@group(0) @binding(2) var<storage, read_write> up: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read_write> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> dgate: array<f32>;
@group(0) @binding(6) var<storage, read_write> dup: array<f32>;

@compute @workgroup_size(256)
fn swiglu(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        let g = gate[i];
        y[i] = g * sigmoid(g) * up[i];
    }
}

@compute @workgroup_size(256)
fn swiglu_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        let g = gate[i];
        let u = up[i];
        let d = dy[i];
        let s = sigmoid(g);
        dgate[i] = d * u * s * (1.0 + g * (1.0 - s));
        dup[i] = d * g * s;
    }
}
