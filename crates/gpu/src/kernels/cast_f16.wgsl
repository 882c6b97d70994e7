// f16 storage read with the device's own f16 (`SHADER_F16`; the launcher prepends
// `enable f16;`), two to a 32-bit word, the first in the low half, as `cast.wgsl` packs them.
// Only reading: f16 to f32 is exact, while WGSL leaves the rounding of an inexact f32 to f16
// conversion to the device and a value past f16's range unspecified, so writing f16 always
// takes `cast.wgsl`'s integer path (the CPU's bits, overflow to infinity for loss scaling).

struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read_write> xu: array<vec2<f16>>;
@group(0) @binding(4) var<storage, read_write> yf: array<f32>;

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
    yf[i] = f32(xu[i / 2u][i % 2u]);
}
