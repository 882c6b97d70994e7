// Mean cross-entropy of logits [N, V] against targets [N] (clamped into the vocabulary), and
// its gradient (softmax − onehot)·dloss/N. With MASKED, the loss is Σ mask·ce / divisor and
// the gradient (softmax − onehot)·dloss·mask/divisor, as the CPU backend computes them: rows
// weighted 0 stay out (a non-finite loss there included), and a divisor of 0 counts nothing.

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
@group(0) @binding(7) var<storage, read_write> mask: array<f32>;
@group(0) @binding(8) var<storage, read_write> divisor: array<f32>;

// The gradient scale of each row before its weight: dloss/N, or dloss/divisor (0 for a
// divisor of 0) under a mask.
fn grad_scale() -> f32 {
    if (MASKED) {
        let d = divisor[0];
        if (d == 0.0) {
            return 0.0;
        }
        return dloss[0] / d;
    }
    return dloss[0] / f32(p.n);
}

fn target_of(row: u32) -> u32 {
    return u32(clamp(targets[row], 0, i32(p.v) - 1));
}

// Each row's loss, max + log Σ exp(x − max) − x[target], one workgroup per row.
@compute @workgroup_size(256)
fn cross_entropy_rows(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    let row = group_index(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let base = row * p.v;
    var mx = -3.402823e38;
    for (var j = li; j < p.v; j += 256u) {
        mx = max(mx, logits[base + j]);
    }
    mx = reduce_max(mx, lanes);
    var s = 0.0;
    for (var j = li; j < p.v; j += 256u) {
        s += exp(logits[base + j] - mx);
    }
    s = reduce_sum(s, lanes);
    if (li == 0u) {
        row_loss[row] = mx + log(s) - logits[base + target_of(row)];
    }
}

// The mean of the rows' losses (or their masked sum over the divisor), by one workgroup in
// a fixed order.
@compute @workgroup_size(256)
fn cross_entropy_mean(lanes: Lanes) {
    let li = lanes.li;
    var s = 0.0;
    for (var r = li; r < p.n; r += 256u) {
        if (MASKED) {
            let w = mask[r];
            if (w != 0.0) {
                s += w * row_loss[r];
            }
        } else {
            s += row_loss[r];
        }
    }
    s = reduce_sum(s, lanes);
    if (li == 0u) {
        if (MASKED) {
            let d = divisor[0];
            loss[0] = select(s / d, 0.0, d == 0.0);
        } else {
            loss[0] = s / f32(p.n);
        }
    }
}

// dlogits = (softmax − onehot)·dloss/N, one workgroup per row.
@compute @workgroup_size(256)
fn cross_entropy_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    let row = group_index(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let base = row * p.v;
    var g = grad_scale();
    if (MASKED) {
        g *= mask[row];
    }
    var mx = -3.402823e38;
    for (var j = li; j < p.v; j += 256u) {
        mx = max(mx, logits[base + j]);
    }
    mx = reduce_max(mx, lanes);
    var s = 0.0;
    for (var j = li; j < p.v; j += 256u) {
        s += exp(logits[base + j] - mx);
    }
    s = reduce_sum(s, lanes);
    let scale = g / s;
    let t = target_of(row);
    // A row the mask drops is zero whatever its logits (the reductions above ran anyway:
    // they hold barriers, which need the whole workgroup).
    if (MASKED && g == 0.0) {
        for (var j = li; j < p.v; j += 256u) {
            dlogits[base + j] = 0.0;
        }
        return;
    }
    for (var j = li; j < p.v; j += 256u) {
        var d = exp(logits[base + j] - mx) * scale;
        if (j == t) {
            d -= g;
        }
        dlogits[base + j] = d;
    }
}
