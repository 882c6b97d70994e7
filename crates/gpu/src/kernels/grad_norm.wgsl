// The sum of squares of a tensor (each gradient's share of the global norm), and the global
// norm and clipping coefficient from those sums. Sums run in a fixed order: the same bits
// every run.

struct Params {
    n: u32,
    groups: u32,
    count: u32,
    first: u32,
    max_norm: f32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> partial: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// (hi, lo): a sum carried as two floats, near f64's precision.
@group(0) @binding(4) var<storage, read_write> acc: array<f32>;
@group(0) @binding(5) var<storage, read_write> s0: array<f32>;
@group(0) @binding(6) var<storage, read_write> s1: array<f32>;
@group(0) @binding(7) var<storage, read_write> s2: array<f32>;
@group(0) @binding(8) var<storage, read_write> s3: array<f32>;
@group(0) @binding(9) var<storage, read_write> loss_scale: array<f32>;
@group(0) @binding(10) var<storage, read_write> coef: array<f32>;
@group(0) @binding(11) var<storage, read_write> norm: array<f32>;

// Stage 1: `groups` workgroups each sum the squares of a strided share of x (compensated, so
// a long share loses nothing) into partial[group].
@compute @workgroup_size(256)
fn sum_squares_partial(
    @builtin(workgroup_id) wid: vec3<u32>,
    lanes: Lanes,
) {
    let li = lanes.li;
    var s = 0.0;
    var carry = 0.0;
    for (var i = wid.x * 256u + li; i < p.n; i += p.groups * 256u) {
        let v = x[i];
        let y = v * v - carry;
        let t = s + y;
        carry = (t - s) - y;
        s = t;
    }
    s = reduce_sum(s, lanes);
    if (li == 0u) {
        partial[wid.x] = s;
    }
}

// Stage 2: one workgroup adds the partial sums.
@compute @workgroup_size(256)
fn sum_squares_final(lanes: Lanes) {
    let li = lanes.li;
    var s = 0.0;
    if (li < p.groups) {
        s = partial[li];
    }
    s = reduce_sum(s, lanes);
    if (li == 0u) {
        out[0] = s;
    }
}

// Knuth's two-sum: hi + lo = a + b exactly.
fn add_two(hi: f32, lo: f32, b: f32) -> vec2<f32> {
    let s = hi + b;
    let bb = s - hi;
    let err = (hi - (s - bb)) + (b - bb);
    return vec2<f32>(s, lo + err);
}

// acc += s0[0] + … (the first `count` of s0..s3), in order; `first` starts from zero.
@compute @workgroup_size(1)
fn grad_norm_accumulate() {
    var a = vec2<f32>(0.0, 0.0);
    if (p.first == 0u) {
        a = vec2<f32>(acc[0], acc[1]);
    }
    a = add_two(a.x, a.y, s0[0]);
    if (p.count > 1u) {
        a = add_two(a.x, a.y, s1[0]);
    }
    if (p.count > 2u) {
        a = add_two(a.x, a.y, s2[0]);
    }
    if (p.count > 3u) {
        a = add_two(a.x, a.y, s3[0]);
    }
    acc[0] = a.x;
    acc[1] = a.y;
}

// norm = √Σ · scale (scale divided by the loss scale with UNSCALE), coef = scale ·
// min(1, max_norm / (norm + 1e-6)) with CLIP; with UNSCALE a norm that is not finite makes
// coef NaN, which tells the optimizers to skip the step.
@compute @workgroup_size(1)
fn grad_norm_finish() {
    var scale = p.scale;
    if (UNSCALE) {
        scale = p.scale / loss_scale[0];
    }
    let total = acc[0] + acc[1];
    let nrm = sqrt(total) * scale;
    var clip = 1.0;
    if (CLIP) {
        clip = min(p.max_norm / (nrm + 1e-6), 1.0);
    }
    var c = scale * clip;
    if (UNSCALE && !is_finite(nrm)) {
        c = bitcast<f32>(0x7fc00000u);
    }
    coef[0] = c;
    norm[0] = nrm;
}
