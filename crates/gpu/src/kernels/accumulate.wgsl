// Gradient accumulation across micro-batches (MODE from the launch): 0 starts the sum
// (acc = g), 1 adds to it (acc += g), 2 is the last micro-batch (out = acc + g, acc untouched).

struct Params {
    n: u32,
    mode: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> acc: array<f32>;
@group(0) @binding(2) var<storage, read_write> g: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn accumulate(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    switch p.mode {
        case 0u: { acc[i] = g[i]; }
        case 1u: { acc[i] = acc[i] + g[i]; }
        default: { out[i] = acc[i] + g[i]; }
    }
}
