// Softmax and log-softmax over the last axis (rows of `n`), and their gradients; one thread a
// row. LOG picks log-softmax.

struct Params {
    rows: u32,
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;

@compute @workgroup_size(256)
fn softmax(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let r = group_index(wid, nwg) * 256u + li;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.n;
    var mx = -3.402823e38;
    for (var j = 0u; j < p.n; j++) {
        mx = max(mx, x[base + j]);
    }
    var s = 0.0;
    for (var j = 0u; j < p.n; j++) {
        s += exp(x[base + j] - mx);
    }
    if (LOG) {
        let lse = mx + log(s);
        for (var j = 0u; j < p.n; j++) {
            y[base + j] = x[base + j] - lse;
        }
    } else {
        let inv = 1.0 / s;
        for (var j = 0u; j < p.n; j++) {
            y[base + j] = exp(x[base + j] - mx) * inv;
        }
    }
}

// Softmax: dx = y ⊙ (dy − Σ dy ⊙ y); log-softmax: dx = dy − exp(y) · Σ dy.
@compute @workgroup_size(256)
fn softmax_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let r = group_index(wid, nwg) * 256u + li;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.n;
    var s = 0.0;
    for (var j = 0u; j < p.n; j++) {
        if (LOG) {
            s += dy[base + j];
        } else {
            s += dy[base + j] * y[base + j];
        }
    }
    for (var j = 0u; j < p.n; j++) {
        let yv = y[base + j];
        if (LOG) {
            dx[base + j] = dy[base + j] - exp(yv) * s;
        } else {
            dx[base + j] = yv * (dy[base + j] - s);
        }
    }
}
