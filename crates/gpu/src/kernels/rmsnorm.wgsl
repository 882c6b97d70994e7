// RMSNorm over rows of C: y = x·rstd·w with rstd = 1/√(mean(x²) + eps), saving rstd; and its
// backward, dx per row and dw per column (summed over rows in a fixed order).

struct Params {
    rows: u32,
    c: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(5) var<storage, read_write> dy: array<f32>;
@group(0) @binding(6) var<storage, read_write> dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> dw: array<f32>;

// One workgroup per row.
@compute @workgroup_size(256)
fn rms_norm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    let row = group_index(wid, nwg);
    if (row >= p.rows) {
        return;
    }
    let base = row * p.c;
    var s = 0.0;
    for (var j = li; j < p.c; j += 256u) {
        let v = x[base + j];
        s += v * v;
    }
    let r = 1.0 / sqrt(reduce_sum(s, lanes) / f32(p.c) + p.eps);
    for (var j = li; j < p.c; j += 256u) {
        y[base + j] = x[base + j] * r * w[j];
    }
    if (li == 0u) {
        rstd[row] = r;
    }
}

// dx = rstd·(g − x̂·mean(g·x̂)) with g = dy·w and x̂ = x·rstd, one workgroup per row.
@compute @workgroup_size(256)
fn rms_norm_backward_dx(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    let row = group_index(wid, nwg);
    if (row >= p.rows) {
        return;
    }
    let base = row * p.c;
    let r = rstd[row];
    var sgx = 0.0;
    for (var j = li; j < p.c; j += 256u) {
        sgx += dy[base + j] * w[j] * x[base + j] * r;
    }
    let mgx = reduce_sum(sgx, lanes) / f32(p.c);
    for (var j = li; j < p.c; j += 256u) {
        let xhat = x[base + j] * r;
        dx[base + j] = r * (dy[base + j] * w[j] - xhat * mgx);
    }
}

// dw = Σ dy·x̂ over rows: 32 columns a workgroup, 8 lanes taking every 8th row, added in order.
@compute @workgroup_size(256)
fn rms_norm_backward_dw(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let col = group_index(wid, nwg) * 32u + li % 32u;
    let lane = li / 32u;
    var sw = 0.0;
    if (col < p.c) {
        for (var row = lane; row < p.rows; row += 8u) {
            sw += dy[row * p.c + col] * x[row * p.c + col] * rstd[row];
        }
    }
    scratch[li] = sw;
    workgroupBarrier();
    if (lane == 0u && col < p.c) {
        var t = 0.0;
        for (var l = 0u; l < 8u; l++) {
            t += scratch[l * 32u + li];
        }
        dw[col] = t;
    }
}
