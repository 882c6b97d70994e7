// f32 to and from bf16 storage, two bf16 values to a 32-bit word (the first in the low half),
// rounding to nearest even with NaNs kept quiet, as the CPU backend (the `half` crate) does.

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
