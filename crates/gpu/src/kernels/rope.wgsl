// Rotary position embedding, "rotate half" layout: in each head of width 2·half, elements i
// and i + half rotate by t·f_i at position t. Angles are reduced exactly: f_i/2π comes as a
// 64-bit fixed-point fraction of a turn, t times it is taken modulo one turn in integers, and
// only the remaining quarter turn goes through float polynomials. So every position gets the
// angle to about 1e-7 rad on any GPU (a float t·f_i loses that at long contexts, and GPUs'
// sin and cos are only specified on [−π, π]).

struct Params {
    rows: u32,
    t: u32,
    heads: u32,
    half: u32,
    sign: f32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    // (hi, lo) words of f_i/2π · 2⁶⁴, two frequencies per vector.
    turns: array<vec4<u32>, 64>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
// `rope_at`'s first position (sampling's run-time position).
@group(0) @binding(3) var<storage, read_write> first: array<i32>;

// (low, high) words of a·b.
fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (p00 & 0xffffu) | (mid << 16u);
    let hi = a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(lo, hi);
}

// (sin, cos) of pos·f_i.
fn angle(pos: u32, i: u32) -> vec2<f32> {
    let v = p.turns[i / 2u];
    let hi = select(v.x, v.z, i % 2u == 1u);
    let lo = select(v.y, v.w, i % 2u == 1u);
    // The turn's fraction, pos·(hi·2³² + lo) mod 2⁶⁴, as (f_hi, f_lo).
    let a = mul_wide(pos, lo);
    let b = mul_wide(pos, hi);
    let f_hi = a.y + b.x;
    let f_lo = a.x;
    // Quadrant from the top two bits, the rest as a fraction of a quarter turn in [−½, ½].
    var q = f_hi >> 30u;
    var r = (f32(f_hi & 0x3fffffffu) + f32(f_lo) * 2.3283064e-10) * 9.3132257e-10;
    if (r > 0.5) {
        r -= 1.0;
        q = (q + 1u) & 3u;
    }
    let th = r * 1.5707963267948966;
    let t2 = th * th;
    // Taylor series on |θ| ≤ π/4: truncation below 2e-9.
    let s = th * (1.0 + t2 * (-1.0 / 6.0 + t2 * (1.0 / 120.0 + t2 * (-1.0 / 5040.0
        + t2 * (1.0 / 362880.0)))));
    let c = 1.0 + t2 * (-0.5 + t2 * (1.0 / 24.0 + t2 * (-1.0 / 720.0 + t2 * (1.0 / 40320.0
        + t2 * (-1.0 / 3628800.0)))));
    switch q {
        case 0u: { return vec2<f32>(s, c); }
        case 1u: { return vec2<f32>(c, -s); }
        case 2u: { return vec2<f32>(-s, -c); }
        default: { return vec2<f32>(-c, s); }
    }
}

// Rotates pair k (row, head, i), the row at position `first + row % t`. It reads both
// elements before writing them, so y may be x.
fn rotate(k: u32, first: u32) {
    if (k >= p.rows * p.heads * p.half) {
        return;
    }
    let i = k % p.half;
    let head = (k / p.half) % p.heads;
    let row = k / (p.half * p.heads);
    let sc = angle(first + row % p.t, i);
    let sn = sc.x * p.sign;
    let base = (row * p.heads + head) * 2u * p.half + i;
    let x1 = x[base];
    let x2 = x[base + p.half];
    y[base] = x1 * sc.y - x2 * sn;
    y[base + p.half] = x2 * sc.y + x1 * sn;
}

// One thread per rotated pair.
@compute @workgroup_size(256)
fn rope(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    rotate(group_index(wid, nwg) * 256u + li, 0u);
}

@compute @workgroup_size(256)
fn rope_at(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    rotate(group_index(wid, nwg) * 256u + li, u32(max(first[0], 0)));
}
