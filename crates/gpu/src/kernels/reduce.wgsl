// SumTo: each output element the sum of `count` input elements, from `o · o_step` at intervals
// of `stride`, in order (the same bits every run).

struct Params {
    n: u32,
    count: u32,
    o_step: u32,
    stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn sum_to(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let o = group_index(wid, nwg) * 256u + li;
    if (o >= p.n) {
        return;
    }
    let base = o * p.o_step;
    var s = 0.0;
    for (var r = 0u; r < p.count; r++) {
        s += x[base + r * p.stride];
    }
    y[o] = s;
}
