// A frozen weight's f32 values from its u8 codes and f32 absmax scales, one thread per value,
// as the CPU kernel computes them: int8 `i8(code) · (absmax[channel] / 127)`, NF4
// `NF4[nibble] · absmax[block]` (two codes a byte, the first in the high nibble). Codes are
// read as bytes of little-endian words from byte `off` of their binding, so a tensor may start
// at any byte. The code book (NF4) and block size come in as constants.

struct Params {
    n: u32,
    cols: u32,
    off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> codes: array<u32>;
@group(0) @binding(2) var<storage, read_write> absmax: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn code_byte(i: u32) -> u32 {
    let b = p.off + i;
    return (codes[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

@compute @workgroup_size(256)
fn int8(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    // Sign-extended by an arithmetic shift.
    let c = bitcast<i32>(code_byte(i) << 24u) >> 24u;
    y[i] = f32(c) * (absmax[i % p.cols] / 127.0);
}

@compute @workgroup_size(256)
fn nf4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    let byte = code_byte(i >> 1u);
    let c = select(byte & 0xfu, byte >> 4u, (i & 1u) == 0u);
    var book = NF4;
    y[i] = book[c] * absmax[i / NF4_BLOCK];
}
