// The shape changes that copy: Pad (the input at rows start.. of a zero tensor) and Transpose
// (two axes swapped, up to eight axes). Reshape and Narrow are views and have no kernel.

struct Params {
    n: u32,
    rank: u32,
    // Pad: where the input starts and how long it is, in elements of the output.
    start: u32,
    len: u32,
    // Transpose: the output's shape, and the input stride each output axis steps by.
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn pad(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    var v = 0.0;
    if (i >= p.start && i - p.start < p.len) {
        v = x[i - p.start];
    }
    y[i] = v;
}

@compute @workgroup_size(256)
fn transpose(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    var rest = i;
    var src = 0u;
    for (var d = p.rank; d > 0u; d--) {
        let axis = d - 1u;
        let size = p.shape[axis / 4u][axis % 4u];
        src += (rest % size) * p.strides[axis / 4u][axis % 4u];
        rest = rest / size;
    }
    y[i] = x[src];
}
