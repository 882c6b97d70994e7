// The fused LM head + cross-entropy's steps between its products (which run on the matmul
// kernel): a tile of logits for rows r0.. (m of them) and vocabulary entries c0.. (vb of
// them) sits at the start of the workspace `ws`, row after row.
//
// Forward: lse_block folds a tile into each row's running max (kept in `lse` until the last
// tile) and sum (ws[sums + i]), and picks the target's logit (ws[picked + i]); lse_finish
// turns them into the row's log-sum-exp and loss (ws[losses + row]); loss_mean averages the
// losses in a fixed order. Backward: softmax_grad turns a tile of logits into its gradient
// in place, and copy_rows moves a tile of dx from the workspace to its rows. With MASKED
// (loss_mean and softmax_grad), the loss is Σ mask·ce / divisor and each row's gradient is
// weighted by mask/divisor, as the CPU backend computes them: rows weighted 0 stay out, and
// a divisor of 0 counts nothing.

struct Params {
    r0: u32,
    m: u32,
    c0: u32,
    vb: u32,
    v: u32,
    n: u32,
    first: u32,
    sums: u32,
    picked: u32,
    losses: u32,
    // copy_rows: elements to move, and where they go in dx.
    len: u32,
    dst: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> ws: array<f32>;
@group(0) @binding(2) var<storage, read_write> targets: array<i32>;
@group(0) @binding(3) var<storage, read_write> lse: array<f32>;
@group(0) @binding(4) var<storage, read_write> loss: array<f32>;
@group(0) @binding(5) var<storage, read_write> dloss: array<f32>;
@group(0) @binding(6) var<storage, read_write> dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> mask: array<f32>;
@group(0) @binding(8) var<storage, read_write> divisor: array<f32>;

// Below any logit: exp of it minus a real max is 0.
const LOWEST: f32 = -3.402823e38;

fn target_of(row: u32) -> u32 {
    return u32(clamp(targets[row], 0, i32(p.v) - 1));
}

// One workgroup per row of the tile.
@compute @workgroup_size(256)
fn lse_block(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    let i = group_index(wid, nwg);
    if (i >= p.m) {
        return;
    }
    let row = p.r0 + i;
    let base = i * p.vb;
    var mx = LOWEST;
    for (var j = li; j < p.vb; j += 256u) {
        mx = max(mx, ws[base + j]);
    }
    mx = reduce_max(mx, lanes);
    var old_max = LOWEST;
    var old_sum = 0.0;
    if (p.first == 0u) {
        old_max = lse[row];
        old_sum = ws[p.sums + i];
    }
    let new_max = max(old_max, mx);
    var s = 0.0;
    for (var j = li; j < p.vb; j += 256u) {
        s += exp(ws[base + j] - new_max);
    }
    s = reduce_sum(s, lanes);
    if (li == 0u) {
        ws[p.sums + i] = old_sum * exp(old_max - new_max) + s;
        lse[row] = new_max;
        let t = target_of(row);
        if (t >= p.c0 && t < p.c0 + p.vb) {
            ws[p.picked + i] = ws[base + t - p.c0];
        }
    }
}

// One thread per row of the tile.
@compute @workgroup_size(256)
fn lse_finish(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.m) {
        return;
    }
    let row = p.r0 + i;
    let l = lse[row] + log(ws[p.sums + i]);
    lse[row] = l;
    ws[p.losses + row] = l - ws[p.picked + i];
}

// The mean of the rows' losses (or their masked sum over the divisor), by one workgroup in
// a fixed order.
@compute @workgroup_size(256)
fn loss_mean(lanes: Lanes) {
    let li = lanes.li;
    var s = 0.0;
    for (var r = li; r < p.n; r += 256u) {
        if (MASKED) {
            let w = mask[r];
            if (w != 0.0) {
                s += w * ws[p.losses + r];
            }
        } else {
            s += ws[p.losses + r];
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

// A tile of logits becomes (softmax − onehot)·dloss/N, one thread per element.
@compute @workgroup_size(256)
fn softmax_grad(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let e = group_index(wid, nwg) * 256u + li;
    if (e >= p.m * p.vb) {
        return;
    }
    let i = e / p.vb;
    let row = p.r0 + i;
    let col = p.c0 + e % p.vb;
    if (MASKED) {
        let d = divisor[0];
        var w = 0.0;
        if (d != 0.0) {
            w = dloss[0] / d * mask[row];
        }
        // A row the mask drops is zero whatever its logits.
        if (w == 0.0) {
            ws[e] = 0.0;
            return;
        }
        var g = exp(ws[e] - lse[row]) * w;
        if (col == target_of(row)) {
            g -= w;
        }
        ws[e] = g;
        return;
    }
    var g = exp(ws[e] - lse[row]);
    if (col == target_of(row)) {
        g -= 1.0;
    }
    ws[e] = g * dloss[0] / f32(p.n);
}

// dx[dst + e] = ws[sums + e] for e < len: a tile of dx summed in the workspace, which in the
// backward starts where the forward's sums do, after the tile of logits.
@compute @workgroup_size(256)
fn copy_rows(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let e = group_index(wid, nwg) * 256u + li;
    if (e < p.len) {
        dx[p.dst + e] = ws[p.sums + e];
    }
}
