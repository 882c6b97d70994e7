// SiLU, x·σ(x), and its gradient σ(x)·(1 + x·(1 − σ(x))).

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;

@compute @workgroup_size(256)
fn silu(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        let v = x[i];
        y[i] = v * sigmoid(v);
    }
}

@compute @workgroup_size(256)
fn silu_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        let v = x[i];
        let s = sigmoid(v);
        dx[i] = dy[i] * s * (1.0 + v * (1.0 - s));
    }
}
