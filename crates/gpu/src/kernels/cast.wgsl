// f32 to and from bf16 and f16 storage, two 16-bit values to a 32-bit word (the first in the
// low half), rounding to nearest even with NaNs kept quiet, as the CPU backend (the `half`
// crate) does. f16 here is integer arithmetic on the bits, so it needs no `SHADER_F16` and
// gives the CPU's bits exactly; `cast_f16.wgsl` converts natively where the device has f16.

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> xf: array<f32>;
@group(0) @binding(2) var<storage, read_write> yu: array<u32>;
@group(0) @binding(3) var<storage, read_write> xu: array<u32>;
@group(0) @binding(4) var<storage, read_write> yf: array<f32>;

fn bf16_of(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (x >> 16u) | 0x40u;
    }
    let round_bit = 0x8000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (x >> 16u) + 1u;
    }
    return x >> 16u;
}

// One thread per output word.
@compute @workgroup_size(256)
fn to_bf16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let w = group_index(wid, nwg) * 256u + li;
    let i = 2u * w;
    if (i >= p.n) {
        return;
    }
    var hi = 0u;
    if (i + 1u < p.n) {
        hi = bf16_of(xf[i + 1u]);
    }
    yu[w] = (bf16_of(xf[i]) & 0xffffu) | (hi << 16u);
}

@compute @workgroup_size(256)
fn from_bf16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    let word = xu[i / 2u];
    let bits = select(word >> 16u, word & 0xffffu, i % 2u == 0u);
    yf[i] = bitcast<f32>(bits << 16u);
}

// f32 bits to f16 bits: round to nearest even, overflow to infinity, subnormals kept.
fn f16_of(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    let sign = (x >> 16u) & 0x8000u;
    let a = x & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u | ((a >> 13u) & 0x3ffu);
    }
    if (a >= 0x477ff000u) {
        // At or past 65520, halfway above the largest finite f16: infinity.
        return sign | 0x7c00u;
    }
    let e = i32(a >> 23u) - 127;
    if (e >= -14) {
        // Normal: drop 13 bits, rounding to nearest even (a carry may bump the exponent).
        let m = a & 0x7fffffu;
        var h = (u32(e + 15) << 10u) | (m >> 13u);
        let rest = m & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u) == 1u)) {
            h += 1u;
        }
        return sign | h;
    }
    if (e < -25) {
        // Below half the smallest subnormal: zero.
        return sign;
    }
    // Subnormal: the significand with its leading one, shifted to units of 2^-24.
    let m = (a & 0x7fffffu) | 0x800000u;
    let shift = u32(-1 - e);
    var h = m >> shift;
    let rest = m & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u) == 1u)) {
        h += 1u;
    }
    return sign | h;
}

// f16 bits to the f32 of the same value (exact).
fn f32_of_f16(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0x1fu) {
        // Infinity, or a NaN made quiet.
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u) | select(0u, 0x400000u, m != 0u));
    }
    if (e == 0u) {
        // Subnormal or zero: m · 2^-24, exact in f32.
        let v = f32(m) * 5.9604645e-8;
        return select(v, -v, sign != 0u);
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

@compute @workgroup_size(256)
fn to_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let w = group_index(wid, nwg) * 256u + li;
    let i = 2u * w;
    if (i >= p.n) {
        return;
    }
    var hi = 0u;
    if (i + 1u < p.n) {
        hi = f16_of(xf[i + 1u]);
    }
    yu[w] = f16_of(xf[i]) | (hi << 16u);
}

@compute @workgroup_size(256)
fn from_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    let word = xu[i / 2u];
    yf[i] = f32_of_f16(select(word >> 16u, word & 0xffffu, i % 2u == 0u));
}
