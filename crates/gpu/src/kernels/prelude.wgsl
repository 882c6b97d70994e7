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

// One value per thread of a 256-thread workgroup, folded in a fixed tree order: at stride s
// (128 down to 1) element i takes element i + s, the lower index first. Both reduction paths
// (`reduce_plain.wgsl`, `reduce_subgroup.wgsl`) give exactly this tree's bits, every run.
var<workgroup> scratch: array<f32, 256>;

fn combine(a: f32, b: f32, is_max: bool) -> f32 {
    if (is_max) {
        return max(a, b);
    }
    return a + b;
}

// The tree over `scratch`, which every thread has written and passed a barrier since. Call
// from uniform control flow; every thread gets the result.
fn fold_scratch(li: u32, is_max: bool) -> f32 {
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            scratch[li] = combine(scratch[li], scratch[li + s], is_max);
        }
        workgroupBarrier();
    }
    let r = scratch[0];
    workgroupBarrier();
    return r;
}
