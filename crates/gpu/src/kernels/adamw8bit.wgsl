// 8-bit AdamW, one workgroup per quantization block of BLOCK (2048) elements, 8 a thread, as
// the CPU kernel computes it: each moment dequantized (code book entry times the block's
// absmax), AdamW's f32 update of the moments and the weight, the block's new absmaxes (a max,
// exact in any order), and each moment requantized to its nearest code-book entry (ties to
// the lower). Codes are bytes of little-endian words; each thread owns two whole words, so no
// two threads write one word. With SCALE the gradient is multiplied by scale[0], and a scale
// that is not finite (an overflow under loss scaling) leaves everything as it was.

struct Params {
    n: u32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    decay: f32,
    // The word each moment's codes start at in its binding.
    m_word: u32,
    v_word: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read_write> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> mq: array<u32>;
@group(0) @binding(4) var<storage, read_write> vq: array<u32>;
@group(0) @binding(5) var<storage, read_write> m_absmax: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_absmax: array<f32>;
@group(0) @binding(7) var<storage, read_write> scale: array<f32>;

// The signed book (first moment) at 0, the unsigned (second moment) at 256.
var<workgroup> books: array<f32, 512>;

// The index in the book at `base` of the entry nearest `x`: the count of entries below `x`
// by binary lifting, then the closer of the entries either side.
fn nearest(base: u32, x: f32) -> u32 {
    var pos = 0u;
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (books[base + pos + s - 1u] < x) {
            pos += s;
        }
    }
    if (books[base + pos] < x) {
        pos += 1u;
    }
    if (pos == 0u) {
        return 0u;
    }
    if (pos == 256u) {
        return 255u;
    }
    let lo = pos - 1u;
    if (x - books[base + lo] <= books[base + pos] - x) {
        return lo;
    }
    return pos;
}

fn byte_of(word: u32, t: u32) -> u32 {
    return (word >> (8u * t)) & 0xffu;
}

@compute @workgroup_size(256)
fn adamw8bit(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    var signed_book = BOOK_SIGNED;
    var unsigned_book = BOOK_UNSIGNED;
    books[li] = signed_book[li];
    books[256u + li] = unsigned_book[li];
    workgroupBarrier();
    let b = group_index(wid, nwg);
    let start = b * BLOCK;
    if (start >= p.n) {
        return;
    }
    var skip = false;
    var gscale = 1.0;
    if (SCALE) {
        gscale = scale[0];
        skip = !is_finite(gscale);
    }
    let count = min(BLOCK, p.n - start);
    let m_scale = m_absmax[b];
    let v_scale = v_absmax[b];
    // This thread's elements `8 li ..`, in words `w .. w + 2` of the block's codes.
    let first = 8u * li;
    let w = start / 4u + 2u * li;
    var mw = array<u32, 2>(0u, 0u);
    var vw = array<u32, 2>(0u, 0u);
    for (var h = 0u; h < 2u; h++) {
        if (first + 4u * h < count) {
            mw[h] = mq[p.m_word + w + h];
            vw[h] = vq[p.v_word + w + h];
        }
    }
    var m: array<f32, 8>;
    var v: array<f32, 8>;
    var m_max = 0.0;
    var v_max = 0.0;
    for (var k = 0u; k < 8u; k++) {
        let j = first + k;
        if (j < count) {
            let i = start + j;
            var gi = grad[i];
            if (SCALE) {
                gi = gi * gscale;
            }
            let mc = books[byte_of(mw[k / 4u], k % 4u)];
            let vc = books[256u + byte_of(vw[k / 4u], k % 4u)];
            let mi = p.beta1 * (mc * m_scale) + (1.0 - p.beta1) * gi;
            let vi = p.beta2 * (vc * v_scale) + (1.0 - p.beta2) * gi * gi;
            let denom = sqrt(vi) / p.bc2_sqrt + p.eps;
            if (!skip) {
                param[i] = param[i] * p.decay - p.step_size * mi / denom;
            }
            m_max = max(m_max, abs(mi));
            v_max = max(v_max, vi);
            m[k] = mi;
            v[k] = vi;
        }
    }
    m_max = reduce_max(m_max, lanes);
    v_max = reduce_max(v_max, lanes);
    if (skip) {
        return;
    }
    if (li == 0u) {
        m_absmax[b] = m_max;
        v_absmax[b] = v_max;
    }
    var inv_m = 0.0;
    if (m_max > 0.0) {
        inv_m = 1.0 / m_max;
    }
    var inv_v = 0.0;
    if (v_max > 0.0) {
        inv_v = 1.0 / v_max;
    }
    for (var h = 0u; h < 2u; h++) {
        if (first + 4u * h >= count) {
            continue;
        }
        var mword = mw[h];
        var vword = vw[h];
        for (var t = 0u; t < 4u; t++) {
            let k = 4u * h + t;
            if (first + k < count) {
                let keep = ~(0xffu << (8u * t));
                mword = (mword & keep) | (nearest(0u, m[k] * inv_m) << (8u * t));
                vword = (vword & keep) | (nearest(256u, v[k] * inv_v) << (8u * t));
            }
        }
        mq[p.m_word + w + h] = mword;
        vq[p.v_word + w + h] = vword;
    }
}
