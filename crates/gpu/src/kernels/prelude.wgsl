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
