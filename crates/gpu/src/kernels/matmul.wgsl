// C = op(A)·op(B) (+ bias) for a batch of products, tiled through workgroup memory.
// Specialised by TA, TB (operands stored transposed), BIAS, and ACC (C += the product).
// A is [M, K] ([K, M] with TA), B is [K, N] ([N, K] with TB), C is [M, N], each row-major
// from its offset with rows lda, ldb, ldc apart; batch z starts at z·stride of each (B's
// stride is 0 when B is shared).

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
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;

const TILE: u32 = 64u;   // output tile side
const DEPTH: u32 = 16u;  // depth of one step through K
const SIDE: u32 = 16u;   // threads per tile side; each computes 4 × 4 outputs

var<workgroup> tile_a: array<f32, 1024>; // [DEPTH][TILE]
var<workgroup> tile_b: array<f32, 1024>; // [DEPTH][TILE]

fn load_a(base: u32, row: u32, kk: u32) -> f32 {
    if (row >= p.m || kk >= p.k) {
        return 0.0;
    }
    if (TA) {
        return a[base + kk * p.lda + row];
    }
    return a[base + row * p.lda + kk];
}

fn load_b(base: u32, kk: u32, col: u32) -> f32 {
    if (kk >= p.k || col >= p.n) {
        return 0.0;
    }
    if (TB) {
        return b[base + col * p.ldb + kk];
    }
    return b[base + kk * p.ldb + col];
}

@compute @workgroup_size(16, 16, 1)
fn matmul(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    let a_base = p.a_off + wid.z * p.a_stride;
    let b_base = p.b_off + wid.z * p.b_stride;
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < p.k; k0 += DEPTH) {
        // 256 threads load 1024 elements of each tile, 4 each.
        for (var e = 0u; e < 4u; e++) {
            let idx = li + e * 256u;
            // A: consecutive threads take consecutive k (rows of A) or rows (A transposed).
            var r: u32;
            var kk: u32;
            if (TA) {
                r = idx % TILE;
                kk = idx / TILE;
            } else {
                kk = idx % DEPTH;
                r = idx / DEPTH;
            }
            tile_a[kk * TILE + r] = load_a(a_base, row0 + r, k0 + kk);
            var cc: u32;
            var kb: u32;
            if (TB) {
                kb = idx % DEPTH;
                cc = idx / DEPTH;
            } else {
                cc = idx % TILE;
                kb = idx / TILE;
            }
            tile_b[kb * TILE + cc] = load_b(b_base, k0 + kb, col0 + cc);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < DEPTH; kk++) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = tile_a[kk * TILE + lid.y + i * SIDE];
                bv[i] = tile_b[kk * TILE + lid.x + i * SIDE];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] += av[i] * bv[j];
                }
            }
        }
        workgroupBarrier();
    }
    let c_base = p.c_off + wid.z * p.c_stride;
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y + i * SIDE;
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x + j * SIDE;
            if (row < p.m && col < p.n) {
                var v = acc[i * 4u + j];
                if (BIAS) {
                    v += bias[col];
                }
                let at = c_base + row * p.ldc + col;
                if (ACC) {
                    v += c[at];
                }
                c[at] = v;
            }
        }
    }
}
