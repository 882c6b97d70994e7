// C = op(A)·op(B) (+ bias) for a batch of products, tiled through workgroup memory.
// Specialised by TA, TB (operands stored transposed), BIAS, ACC (C += the product) and SPLIT.
// With SPLIT (one product, its depth cut into slices of k_per): workgroup z sums slice z into
// ws[z·m·n ..] as a dense [M, N], and `matmul_reduce` then adds the `splits` slices in order
// (then the bias, then C with ACC) into C.
// A is [M, K] ([K, M] with TA), B is [K, N] ([N, K] with TB), C is [M, N], each row-major
// from its offset with rows lda, ldb, ldc apart; batch z starts at z·stride of each (B's
// stride is 0 when B is shared).
//
// Each thread holds a 4 × 4 block of C as four vec4 rows, indexed only by constants: a
// driver keeps an array in registers only where no index is computed at run time, and an H200
// ran this kernel with the accumulators in a looped array at 0.2–0.35 TFLOP/s, against
// 4–10 written out. (A 128 × 128 tile, 8 × 8 a thread, was slower there at every GPT-2 and
// char-small shape.)

struct Params {
    m: u32,
    n: u32,
    k: u32,
    a_stride: u32,
    b_stride: u32,
    c_stride: u32,
    a_off: u32,
    b_off: u32,
    c_off: u32,
    lda: u32,
    ldb: u32,
    ldc: u32,
    k_per: u32,
    splits: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> ws: array<f32>;

const TILE: u32 = 64u;   // output tile side
const DEPTH: u32 = 16u;  // depth of one step through K
// A depth row of a tile: TILE / 4 quads and one of padding, so the stores of threads 16
// apart in depth fall in different banks.
const QUADS: u32 = 17u;

var<workgroup> tile_a: array<vec4<f32>, 272>; // [DEPTH][QUADS]: quad q holds rows 4q .. 4q + 4
var<workgroup> tile_b: array<vec4<f32>, 272>; // [DEPTH][QUADS]: quad q holds columns 4q ..

fn load_a(base: u32, row: u32, kk: u32, k_end: u32) -> f32 {
    if (row >= p.m || kk >= k_end) {
        return 0.0;
    }
    if (TA) {
        return a[base + kk * p.lda + row];
    }
    return a[base + row * p.lda + kk];
}

fn load_b(base: u32, kk: u32, col: u32, k_end: u32) -> f32 {
    if (kk >= k_end || col >= p.n) {
        return 0.0;
    }
    if (TB) {
        return b[base + col * p.ldb + kk];
    }
    return b[base + kk * p.ldb + col];
}

// Row `row` of C from column `col`: four outputs, each stored where it is in bounds (with
// SPLIT, into slice `z` of the workspace, without the bias or C).
fn store4(base: u32, z: u32, row: u32, col: u32, v: vec4<f32>) {
    if (row >= p.m) {
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        let cj = col + j;
        if (cj < p.n) {
            var x = v[j];
            if (SPLIT) {
                ws[(z * p.m + row) * p.n + cj] = x;
                continue;
            }
            if (BIAS) {
                x += bias[cj];
            }
            let at = base + row * p.ldc + cj;
            if (ACC) {
                x += c[at];
            }
            c[at] = x;
        }
    }
}

@compute @workgroup_size(16, 16, 1)
fn matmul(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    // z is the batch, or with SPLIT the depth slice of the one product.
    let batch = select(wid.z, 0u, SPLIT);
    let a_base = p.a_off + batch * p.a_stride;
    let b_base = p.b_off + batch * p.b_stride;
    var k_start = 0u;
    var k_end = p.k;
    if (SPLIT) {
        k_start = min(p.k, wid.z * p.k_per);
        k_end = min(p.k, k_start + p.k_per);
    }
    // Rows 4·lid.y .. + 4 of the tile, columns 4·lid.x .. + 4.
    var acc0 = vec4<f32>();
    var acc1 = vec4<f32>();
    var acc2 = vec4<f32>();
    var acc3 = vec4<f32>();
    for (var k0 = k_start; k0 < k_end; k0 += DEPTH) {
        // 256 threads stage 1024 elements of each operand, 4 each; consecutive threads read
        // consecutive elements of whichever axis is contiguous.
        for (var e = 0u; e < 4u; e++) {
            let idx = li + e * 256u;
            var r: u32;
            var kk: u32;
            if (TA) {
                r = idx % TILE;
                kk = idx / TILE;
            } else {
                kk = idx % DEPTH;
                r = idx / DEPTH;
            }
            tile_a[kk * QUADS + r / 4u][r % 4u] = load_a(a_base, row0 + r, k0 + kk, k_end);
            var cc: u32;
            var kb: u32;
            if (TB) {
                kb = idx % DEPTH;
                cc = idx / DEPTH;
            } else {
                cc = idx % TILE;
                kb = idx / TILE;
            }
            tile_b[kb * QUADS + cc / 4u][cc % 4u] = load_b(b_base, k0 + kb, col0 + cc, k_end);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < DEPTH; kk++) {
            let av = tile_a[kk * QUADS + lid.y];
            let bv = tile_b[kk * QUADS + lid.x];
            acc0 += av.x * bv;
            acc1 += av.y * bv;
            acc2 += av.z * bv;
            acc3 += av.w * bv;
        }
        workgroupBarrier();
    }
    let c_base = p.c_off + batch * p.c_stride;
    let r0 = row0 + 4u * lid.y;
    let c0 = col0 + 4u * lid.x;
    store4(c_base, wid.z, r0, c0, acc0);
    store4(c_base, wid.z, r0 + 1u, c0, acc1);
    store4(c_base, wid.z, r0 + 2u, c0, acc2);
    store4(c_base, wid.z, r0 + 3u, c0, acc3);
}

// A split product's slices added in order into C: one thread an element of C.
@compute @workgroup_size(256)
fn matmul_reduce(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    let size = p.m * p.n;
    if (i >= size) {
        return;
    }
    let col = i % p.n;
    var x = ws[i];
    for (var z = 1u; z < p.splits; z++) {
        x += ws[z * size + i];
    }
    if (BIAS) {
        x += bias[col];
    }
    let at = p.c_off + (i / p.n) * p.ldc + col;
    if (ACC) {
        x += c[at];
    }
    c[at] = x;
}
