// Binary arithmetic with NumPy broadcasting (OP: 0 add, 1 sub, 2 mul, 3 div), and scaling.
// With SAME the operands have the output's shape; otherwise each is read through strides
// over the output's shape (0 where it broadcasts), up to eight axes.

struct Params {
    n: u32,
    rank: u32,
    factor: f32,
    pad: u32,
    shape: array<vec4<u32>, 2>,
    a_strides: array<vec4<u32>, 2>,
    b_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

fn apply(x: f32, y: f32) -> f32 {
    switch OP {
        case 0u: { return x + y; }
        case 1u: { return x - y; }
        case 2u: { return x * y; }
        default: { return x / y; }
    }
}

@compute @workgroup_size(256)
fn binary(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    if (SAME) {
        c[i] = apply(a[i], b[i]);
        return;
    }
    var rest = i;
    var ia = 0u;
    var ib = 0u;
    for (var d = p.rank; d > 0u; d--) {
        let axis = d - 1u;
        let size = p.shape[axis / 4u][axis % 4u];
        let coord = rest % size;
        rest = rest / size;
        ia += coord * p.a_strides[axis / 4u][axis % 4u];
        ib += coord * p.b_strides[axis / 4u][axis % 4u];
    }
    c[i] = apply(a[ia], b[ib]);
}

// c = a · factor.
@compute @workgroup_size(256)
fn scale(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        c[i] = a[i] * p.factor;
    }
}
