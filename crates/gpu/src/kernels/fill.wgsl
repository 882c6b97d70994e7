// A constant tensor: y = value.

struct Params {
    n: u32,
    value: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn fill(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i < p.n) {
        y[i] = p.value;
    }
}
