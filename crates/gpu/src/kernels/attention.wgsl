// Causal attention with online softmax: no T×T tensor, each query row's log-sum-exp saved for
// the backward, which recomputes the probabilities from it (as FlashAttention does).
//
// Queries, keys and values are read in place through row strides and offsets, so one kernel
// serves the packed qkv [B, T, 3C] of GPT and the separate q [B, T, H·D], k, v [B, T, KH·D] of
// grouped-query attention (query head h reads kv head h / (H / KH)).
//
// One thread owns one row (a query in the forward and dQ, a key in dK/dV) and keeps it and
// its accumulators in private arrays of HEAD_DIM; the other side's rows stream through
// workgroup memory TILE at a time.

struct Params {
    t: u32,
    heads: u32,
    kv_heads: u32,
    scale: f32,
    q_row: u32,
    q_off: u32,
    k_row: u32,
    k_off: u32,
    v_row: u32,
    v_off: u32,
    y_row: u32,
    dq_row: u32,
    dq_off: u32,
    dk_row: u32,
    dk_off: u32,
    dv_row: u32,
    dv_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> k: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
@group(0) @binding(6) var<storage, read_write> dy: array<f32>;
@group(0) @binding(7) var<storage, read_write> dq: array<f32>;
@group(0) @binding(8) var<storage, read_write> dk: array<f32>;
@group(0) @binding(9) var<storage, read_write> dv: array<f32>;

const ROWS: u32 = 64u; // rows a workgroup owns, one a thread

var<workgroup> tile0: array<f32, TILE * HEAD_DIM>;
var<workgroup> tile1: array<f32, TILE * HEAD_DIM>;
var<workgroup> tile_lse: array<f32, TILE>;
var<workgroup> tile_d: array<f32, TILE>;

// Element offsets of row `i` of batch `bi`, head `h`, in a tensor of row stride `row` whose
// heads start at `off`.
fn at(bi: u32, i: u32, h: u32, row: u32, off: u32) -> u32 {
    return (bi * p.t + i) * row + off + h * HEAD_DIM;
}

// Stages rows j0.. of k and v (head kh) into tile0 and tile1, zeros past the end.
fn stage_kv(bi: u32, kh: u32, j0: u32, li: u32) {
    for (var e = li; e < TILE * HEAD_DIM; e += ROWS) {
        let r = e / HEAD_DIM;
        let c = e % HEAD_DIM;
        var kv = 0.0;
        var vv = 0.0;
        if (j0 + r < p.t) {
            kv = k[at(bi, j0 + r, kh, p.k_row, p.k_off) + c];
            vv = v[at(bi, j0 + r, kh, p.v_row, p.v_off) + c];
        }
        tile0[e] = kv;
        tile1[e] = vv;
    }
}

// y = softmax(scale·QKᵀ, causal)·V and lse, for ROWS queries of one (batch, head).
@compute @workgroup_size(64)
fn attention_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let bi = wid.y / p.heads;
    let h = wid.y % p.heads;
    let kh = h / (p.heads / p.kv_heads);
    let i0 = wid.x * ROWS;
    let i = i0 + li;
    let live = i < p.t;
    var qi: array<f32, HEAD_DIM>;
    var o: array<f32, HEAD_DIM>;
    if (live) {
        let base = at(bi, i, h, p.q_row, p.q_off);
        for (var c = 0u; c < HEAD_DIM; c++) {
            qi[c] = q[base + c];
        }
    }
    var m = -3.402823e38;
    var l = 0.0;
    let last = min(i0 + ROWS, p.t);
    for (var j0 = 0u; j0 < last; j0 += TILE) {
        stage_kv(bi, kh, j0, li);
        workgroupBarrier();
        for (var r = 0u; r < TILE; r++) {
            let j = j0 + r;
            if (live && j <= i) {
                var s = 0.0;
                for (var c = 0u; c < HEAD_DIM; c++) {
                    s += qi[c] * tile0[r * HEAD_DIM + c];
                }
                s *= p.scale;
                let m_new = max(m, s);
                let corr = exp(m - m_new);
                let e = exp(s - m_new);
                l = l * corr + e;
                for (var c = 0u; c < HEAD_DIM; c++) {
                    o[c] = o[c] * corr + e * tile1[r * HEAD_DIM + c];
                }
                m = m_new;
            }
        }
        workgroupBarrier();
    }
    if (live) {
        let base = at(bi, i, h, p.y_row, 0u);
        let inv = 1.0 / l;
        for (var c = 0u; c < HEAD_DIM; c++) {
            y[base + c] = o[c] * inv;
        }
        lse[(bi * p.heads + h) * p.t + i] = m + log(l);
    }
}

// dQ = scale · Σ_j P_ij (dP_ij − D_i) K_j with P from lse, dP_ij = dY_i·V_j, D_i = dY_i·Y_i.
@compute @workgroup_size(64)
fn attention_backward_dq(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let bi = wid.y / p.heads;
    let h = wid.y % p.heads;
    let kh = h / (p.heads / p.kv_heads);
    let i0 = wid.x * ROWS;
    let i = i0 + li;
    let live = i < p.t;
    var qi: array<f32, HEAD_DIM>;
    var gi: array<f32, HEAD_DIM>;
    var acc: array<f32, HEAD_DIM>;
    var di = 0.0;
    var li_lse = 0.0;
    if (live) {
        let qb = at(bi, i, h, p.q_row, p.q_off);
        let yb = at(bi, i, h, p.y_row, 0u);
        for (var c = 0u; c < HEAD_DIM; c++) {
            qi[c] = q[qb + c];
            gi[c] = dy[yb + c];
            di += gi[c] * y[yb + c];
        }
        li_lse = lse[(bi * p.heads + h) * p.t + i];
    }
    let last = min(i0 + ROWS, p.t);
    for (var j0 = 0u; j0 < last; j0 += TILE) {
        stage_kv(bi, kh, j0, li);
        workgroupBarrier();
        for (var r = 0u; r < TILE; r++) {
            let j = j0 + r;
            if (live && j <= i) {
                var s = 0.0;
                var dp = 0.0;
                for (var c = 0u; c < HEAD_DIM; c++) {
                    s += qi[c] * tile0[r * HEAD_DIM + c];
                    dp += gi[c] * tile1[r * HEAD_DIM + c];
                }
                let ds = exp(s * p.scale - li_lse) * (dp - di);
                for (var c = 0u; c < HEAD_DIM; c++) {
                    acc[c] += ds * tile0[r * HEAD_DIM + c];
                }
            }
        }
        workgroupBarrier();
    }
    if (live) {
        let base = at(bi, i, h, p.dq_row, p.dq_off);
        for (var c = 0u; c < HEAD_DIM; c++) {
            dq[base + c] = acc[c] * p.scale;
        }
    }
}

// dV_j = Σ_i P_ij dY_i and dK_j = scale · Σ_i P_ij (dP_ij − D_i) Q_i over queries i ≥ j of
// every query head sharing kv head `kh` (in head order), for ROWS keys.
@compute @workgroup_size(64)
fn attention_backward_dkdv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let bi = wid.y / p.kv_heads;
    let kh = wid.y % p.kv_heads;
    let group = p.heads / p.kv_heads;
    let j0 = wid.x * ROWS;
    let j = j0 + li;
    let live = j < p.t;
    var kj: array<f32, HEAD_DIM>;
    var vj: array<f32, HEAD_DIM>;
    var gk: array<f32, HEAD_DIM>;
    var gv: array<f32, HEAD_DIM>;
    if (live) {
        let kb = at(bi, j, kh, p.k_row, p.k_off);
        let vb = at(bi, j, kh, p.v_row, p.v_off);
        for (var c = 0u; c < HEAD_DIM; c++) {
            kj[c] = k[kb + c];
            vj[c] = v[vb + c];
        }
    }
    for (var h = kh * group; h < (kh + 1u) * group; h++) {
        // Queries before this workgroup's first key see none of its keys.
        for (var i0 = (j0 / TILE) * TILE; i0 < p.t; i0 += TILE) {
            for (var e = li; e < TILE * HEAD_DIM; e += ROWS) {
                let r = e / HEAD_DIM;
                let c = e % HEAD_DIM;
                var qv = 0.0;
                var gv_ = 0.0;
                if (i0 + r < p.t) {
                    qv = q[at(bi, i0 + r, h, p.q_row, p.q_off) + c];
                    gv_ = dy[at(bi, i0 + r, h, p.y_row, 0u) + c];
                }
                tile0[e] = qv;
                tile1[e] = gv_;
            }
            if (li < TILE) {
                let i = i0 + li;
                var d = 0.0;
                var l = 0.0;
                if (i < p.t) {
                    let yb = at(bi, i, h, p.y_row, 0u);
                    for (var c = 0u; c < HEAD_DIM; c++) {
                        d += dy[yb + c] * y[yb + c];
                    }
                    l = lse[(bi * p.heads + h) * p.t + i];
                }
                tile_d[li] = d;
                tile_lse[li] = l;
            }
            workgroupBarrier();
            for (var r = 0u; r < TILE; r++) {
                let i = i0 + r;
                if (live && i >= j && i < p.t) {
                    var s = 0.0;
                    var dp = 0.0;
                    for (var c = 0u; c < HEAD_DIM; c++) {
                        s += tile0[r * HEAD_DIM + c] * kj[c];
                        dp += tile1[r * HEAD_DIM + c] * vj[c];
                    }
                    let pij = exp(s * p.scale - tile_lse[r]);
                    let ds = pij * (dp - tile_d[r]);
                    for (var c = 0u; c < HEAD_DIM; c++) {
                        gv[c] += pij * tile1[r * HEAD_DIM + c];
                        gk[c] += ds * tile0[r * HEAD_DIM + c];
                    }
                }
            }
            workgroupBarrier();
        }
    }
    if (live) {
        let kb = at(bi, j, kh, p.dk_row, p.dk_off);
        let vb = at(bi, j, kh, p.dv_row, p.dv_off);
        for (var c = 0u; c < HEAD_DIM; c++) {
            dk[kb + c] = gk[c] * p.scale;
            dv[vb + c] = gv[c];
        }
    }
}
