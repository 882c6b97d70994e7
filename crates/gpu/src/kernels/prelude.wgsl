// Shared by every kernel file (prepended to each).

// The linear index of a workgroup in a grid laid out by `grid_1d` (x first, then y).
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// Neither infinite nor NaN, by the exponent bits: comparisons may be optimised away.
fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// One value per thread of a 256-thread workgroup, reduced in a fixed tree order (the same
// bits every run). Call from uniform control flow; every thread gets the result.
var<workgroup> scratch: array<f32, 256>;

fn reduce_sum(v: f32, li: u32) -> f32 {
    scratch[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            scratch[li] += scratch[li + s];
        }
        workgroupBarrier();
    }
    let r = scratch[0];
    workgroupBarrier();
    return r;
}

fn reduce_max(v: f32, li: u32) -> f32 {
    scratch[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            scratch[li] = max(scratch[li], scratch[li + s]);
        }
        workgroupBarrier();
    }
    let r = scratch[0];
    workgroupBarrier();
    return r;
}
