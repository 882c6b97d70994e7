// The subgroups a reducing workgroup runs as: its first thread writes the size and the count.

struct Params {
    unused: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(256)
fn subgroup_layout(lanes: Lanes) {
    if (lanes.li == 0u) {
        out[0] = lanes.size;
        out[1] = lanes.count;
    }
}
