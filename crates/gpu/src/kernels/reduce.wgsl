// Reductions, one thread per output element, summing in order (the same bits every run),
// but SumTo's contiguous case, eight threads an output.
// SumTo: output o is the sum of `count` input elements from `o · o_step`, `stride` apart.
// Reduce (KIND 0 sum, 1 mean, 2 max) and MaxBackward: over the middle axis of
// [outer, count, inner], output o = (outer index) · inner + (inner index).
// BroadcastTo: output i reads the input through strides over the output's shape.
// SumTo otherwise (sum_strided): output o's coordinates over `shape` (the kept axes, 1 where
// summed) and summand r's over `sums` (the summed axes, 1 where kept), through the input's
// strides.

struct Params {
    n: u32,
    count: u32,
    o_step: u32,
    stride: u32,
    inner: u32,
    rank: u32,
    pad0: u32,
    pad1: u32,
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
    sums: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;

// 32 outputs a workgroup, each summed by 8 threads over consecutive slices of its elements,
// then the 8 partial sums added in slice order: the same bits every run, and 8 times the
// threads of one a sum (a bias gradient has a few hundred outputs over thousands of rows).
var<workgroup> slices: array<f32, 256>;

@compute @workgroup_size(256)
fn sum_to(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let o = group_index(wid, nwg) * 32u + li % 32u;
    let slice = li / 32u;
    let per = (p.count + 7u) / 8u;
    var s = 0.0;
    if (o < p.n) {
        let base = o * p.o_step;
        let end = min(p.count, (slice + 1u) * per);
        for (var r = slice * per; r < end; r++) {
            s += x[base + r * p.stride];
        }
    }
    slices[li] = s;
    workgroupBarrier();
    if (slice == 0u && o < p.n) {
        var t = slices[li];
        for (var k = 1u; k < 8u; k++) {
            t += slices[k * 32u + li];
        }
        y[o] = t;
    }
}

// The first element of reduction o, and the distance between its elements.
fn axis_base(o: u32) -> u32 {
    return (o / p.inner) * p.count * p.inner + o % p.inner;
}

@compute @workgroup_size(256)
fn reduce_axis(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let o = group_index(wid, nwg) * 256u + li;
    if (o >= p.n) {
        return;
    }
    let base = axis_base(o);
    var acc = 0.0;
    if (KIND == 2u) {
        acc = -3.402823e38;
    }
    for (var j = 0u; j < p.count; j++) {
        let v = x[base + j * p.inner];
        if (KIND == 2u) {
            acc = max(acc, v);
        } else {
            acc += v;
        }
    }
    if (KIND == 1u) {
        acc = acc / f32(p.count);
    }
    y[o] = acc;
}

// dy[o] flows to the first maximal element of reduction o; the rest get 0.
@compute @workgroup_size(256)
fn max_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let o = group_index(wid, nwg) * 256u + li;
    if (o >= p.n) {
        return;
    }
    let base = axis_base(o);
    var best = 0u;
    for (var j = 1u; j < p.count; j++) {
        if (x[base + j * p.inner] > x[base + best * p.inner]) {
            best = j;
        }
    }
    for (var j = 0u; j < p.count; j++) {
        dx[base + j * p.inner] = select(0.0, dy[o], j == best);
    }
}

@compute @workgroup_size(256)
fn broadcast_to(
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

@compute @workgroup_size(256)
fn sum_strided(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let o = group_index(wid, nwg) * 256u + li;
    if (o >= p.n) {
        return;
    }
    var rest = o;
    var base = 0u;
    for (var d = p.rank; d > 0u; d--) {
        let axis = d - 1u;
        let size = p.shape[axis / 4u][axis % 4u];
        base += (rest % size) * p.strides[axis / 4u][axis % 4u];
        rest = rest / size;
    }
    var s = 0.0;
    for (var r = 0u; r < p.count; r++) {
        var left = r;
        var at = base;
        for (var d = p.rank; d > 0u; d--) {
            let axis = d - 1u;
            let size = p.sums[axis / 4u][axis % 4u];
            at += (left % size) * p.strides[axis / 4u][axis % 4u];
            left = left / size;
        }
        s += x[at];
    }
    y[o] = s;
}
