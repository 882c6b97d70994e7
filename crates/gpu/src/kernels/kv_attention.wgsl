// Causal attention over a key/value cache, for sampling. `kv_write` copies the T new rows of
// keys and values into the caches at rows pos .. pos + T (rows past the cache are dropped, as
// on the CPU); `kv_attention` then gives each (batch row, query head, new position) one
// workgroup, which scores the cache rows that position may see WG at a time and keeps an
// online softmax over the tiles (no row of scores in memory), thread d owning output dim d.
// The position is read on the device: it changes every decode step, the recorded work not.

struct Params {
    batch: u32,
    t: u32,
    s: u32,
    heads: u32,
    kv_heads: u32,
    d: u32,
    scale: f32,
    q_row: u32,
    q_off: u32,
    k_row: u32,
    k_off: u32,
    v_row: u32,
    v_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> k: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> pos: array<i32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

const WG: u32 = 256u;

// One thread per element of the new rows [B, T, KH·D].
@compute @workgroup_size(256)
fn kv_write(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let e = group_index(wid, nwg) * WG + li;
    let kv = p.kv_heads * p.d;
    if (e >= p.batch * p.t * kv) {
        return;
    }
    let c = e % kv;
    let row = e / kv;
    let at = u32(max(pos[0], 0)) + row % p.t;
    if (at >= p.s) {
        return;
    }
    let dst = ((row / p.t) * p.s + at) * kv + c;
    k_cache[dst] = k[row * p.k_row + p.k_off + c];
    v_cache[dst] = v[row * p.v_row + p.v_off + c];
}

var<workgroup> qs: array<f32, 256>;
var<workgroup> probs: array<f32, 256>;
var<workgroup> first: u32;

@compute @workgroup_size(256)
fn kv_attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    let item = group_index(wid, nwg);
    if (item >= p.batch * p.heads * p.t) {
        return;
    }
    let i = item % p.t;
    let h = (item / p.t) % p.heads;
    let b = item / (p.t * p.heads);
    let row = b * p.t + i;
    let kv = p.kv_heads * p.d;
    let head = (h / (p.heads / p.kv_heads)) * p.d;
    if (li < p.d) {
        qs[li] = q[row * p.q_row + p.q_off + h * p.d + li];
    }
    if (li == 0u) {
        first = u32(max(pos[0], 0));
    }
    // The loop below holds barriers, so its bound must be uniform across the workgroup.
    let seen = min(workgroupUniformLoad(&first) + i + 1u, p.s);
    // A finite stand-in for −∞: the first tile always holds row 0, so it never survives.
    var m = -3.0e38;
    var l = 0.0;
    var acc = 0.0;
    for (var j0 = 0u; j0 < seen; j0 += WG) {
        let j = j0 + li;
        var sc = -3.0e38;
        if (j < seen) {
            let base = (b * p.s + j) * kv + head;
            var dot = 0.0;
            for (var c = 0u; c < p.d; c++) {
                dot += qs[c] * k_cache[base + c];
            }
            sc = dot * p.scale;
        }
        let m_new = max(m, reduce_max(sc, lanes));
        let e = select(0.0, exp(sc - m_new), j < seen);
        let alpha = exp(m - m_new);
        probs[li] = e;
        // Its barriers also publish `probs`.
        l = l * alpha + reduce_sum(e, lanes);
        if (li < p.d) {
            var a = acc * alpha;
            let n = min(WG, seen - j0);
            for (var jj = 0u; jj < n; jj++) {
                a += probs[jj] * v_cache[(b * p.s + j0 + jj) * kv + head + li];
            }
            acc = a;
        }
        m = m_new;
        workgroupBarrier();
    }
    if (li < p.d) {
        y[row * p.heads * p.d + h * p.d + li] = acc / l;
    }
}
