// Embedding lookup (a gather of table rows by id) and its gradient, a scatter-add done as a
// gather: each element of the table's gradient sums the rows of dy whose id is its row, in
// token order. No float atomics, so the sum is the same bits every run (and the CPU's).

struct Params {
    tokens: u32,
    c: u32,
    vocab: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> table: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<i32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read_write> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> dtable: array<f32>;

// A stray id (outside the vocabulary) reads zeros, as on the CPU.
@compute @workgroup_size(256)
fn embedding(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.tokens * p.c) {
        return;
    }
    let id = ids[i / p.c];
    var v = 0.0;
    if (id >= 0 && u32(id) < p.vocab) {
        v = table[u32(id) * p.c + i % p.c];
    }
    y[i] = v;
}

// One thread per element of the table's gradient.
@compute @workgroup_size(256)
fn embedding_backward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.vocab * p.c) {
        return;
    }
    let row = i32(i / p.c);
    let col = i % p.c;
    var s = 0.0;
    for (var t = 0u; t < p.tokens; t++) {
        if (ids[t] == row) {
            s += dy[t * p.c + col];
        }
    }
    dtable[i] = s;
}
