// Mean cross-entropy of logits [N, V] against targets [N] (clamped into the vocabulary), and
// its gradient (softmax − onehot)·dloss/N.

struct Params {
    n: u32,
    v: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> targets: array<i32>;
@group(0) @binding(3) var<storage, read_write> row_loss: array<f32>;
@group(0) @binding(4) var<storage, read_write> loss: array<f32>;
@group(0) @binding(5) var<storage, read_write> dloss: array<f32>;
@group(0) @binding(6) var<storage, read_write> dlogits: array<f32>;

fn target_of(row: u32) -> u32 {
    return u32(clamp(targets[row], 0, i32(p.v) - 1));
}

// Each row's loss, max + log Σ exp(x − max) − x[target], one workgroup per row.
@compute @workgroup_size(256)
fn cross_entropy_rows(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_index(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let base = row * p.v;
    var mx = -3.402823e38;
    for (var j = li; j < p.v; j += 256u) {
        mx = max(mx, logits[base + j]);
    }
    mx = reduce_max(mx, li);
    var s = 0.0;
    for (var j = li; j < p.v; j += 256u) {
        s += exp(logits[base + j] - mx);
    }
    s = reduce_sum(s, li);
    if (li == 0u) {
        row_loss[row] = mx + log(s) - logits[base + target_of(row)];
    }
}

// The mean of the rows' losses, by one workgroup in a fixed order.
@compute @workgroup_size(256)
fn cross_entropy_mean(@builtin(local_invocation_index) li: u32) {
    var s = 0.0;
    for (var r = li; r < p.n; r += 256u) {
        s += row_loss[r];
    }
    s = reduce_sum(s, li);
    if (li == 0u) {
        loss[0] = s / f32(p.n);
    }
}

// dlogits = (softmax − onehot)·dloss/N, one workgroup per row.
@compute @workgroup_size(256)
fn cross_entropy_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = group_index(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let base = row * p.v;
    var mx = -3.402823e38;
    for (var j = li; j < p.v; j += 256u) {
        mx = max(mx, logits[base + j]);
    }
    mx = reduce_max(mx, li);
    var s = 0.0;
    for (var j = li; j < p.v; j += 256u) {
        s += exp(logits[base + j] - mx);
    }
    s = reduce_sum(s, li);
    let g = dloss[0] / f32(p.n);
    let scale = g / s;
    let t = target_of(row);
    for (var j = li; j < p.v; j += 256u) {
        var d = exp(logits[base + j] - mx) * scale;
        if (j == t) {
            d -= g;
        }
        dlogits[base + j] = d;
    }
}
