// LayerNorm over rows of C: y = (x − mean)·rstd·w + b, saving mean and rstd; and its
// backward, dx per row and dw, db per column (summed over rows in a fixed order).

struct Params {
    rows: u32,
    c: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> mean: array<f32>;
@group(0) @binding(6) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(7) var<storage, read_write> dy: array<f32>;
@group(0) @binding(8) var<storage, read_write> dx: array<f32>;
@group(0) @binding(9) var<storage, read_write> dw: array<f32>;
@group(0) @binding(10) var<storage, read_write> db: array<f32>;

// One workgroup per row.
@compute @workgroup_size(256)
fn layer_norm(
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
    let c = f32(p.c);
    var s = 0.0;
    for (var j = li; j < p.c; j += 256u) {
        s += x[base + j];
    }
    let m = reduce_sum(s, lanes) / c;
    var v = 0.0;
    for (var j = li; j < p.c; j += 256u) {
        let d = x[base + j] - m;
        v += d * d;
    }
    let r = 1.0 / sqrt(reduce_sum(v, lanes) / c + p.eps);
    for (var j = li; j < p.c; j += 256u) {
        y[base + j] = (x[base + j] - m) * r * w[j] + b[j];
    }
    if (li == 0u) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w, one workgroup per row. Each thread
// reads and writes only its own elements, so dx may be dy's or x's range.
@compute @workgroup_size(256)
fn layer_norm_backward_dx(
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
    let c = f32(p.c);
    let m = mean[row];
    let r = rstd[row];
    var sg = 0.0;
    var sgx = 0.0;
    for (var j = li; j < p.c; j += 256u) {
        let g = dy[base + j] * w[j];
        sg += g;
        sgx += g * (x[base + j] - m) * r;
    }
    let mg = reduce_sum(sg, lanes) / c;
    let mgx = reduce_sum(sgx, lanes) / c;
    for (var j = li; j < p.c; j += 256u) {
        let xhat = (x[base + j] - m) * r;
        dx[base + j] = r * (dy[base + j] * w[j] - mg - xhat * mgx);
    }
}

var<workgroup> part_db: array<f32, 256>;

// dw = Σ dy·x̂, db = Σ dy over rows: 32 columns a workgroup, its 8 lanes of 32 threads
// taking every 8th row, the lanes' sums added in order.
@compute @workgroup_size(256)
fn layer_norm_backward_dwdb(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let col = group_index(wid, nwg) * 32u + li % 32u;
    let lane = li / 32u;
    var sw = 0.0;
    var sb = 0.0;
    if (col < p.c) {
        for (var row = lane; row < p.rows; row += 8u) {
            let d = dy[row * p.c + col];
            sw += d * (x[row * p.c + col] - mean[row]) * rstd[row];
            sb += d;
        }
    }
    scratch[li] = sw;
    part_db[li] = sb;
    workgroupBarrier();
    if (lane == 0u && col < p.c) {
        var tw = 0.0;
        var tb = 0.0;
        for (var l = 0u; l < 8u; l++) {
            tw += scratch[l * 32u + li];
            tb += part_db[l * 32u + li];
        }
        dw[col] = tw;
        db[col] = tb;
    }
}
