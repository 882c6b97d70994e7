// SGD with decoupled weight decay: param ← param·(1 − lr·wd) − lr·scale·grad. With SCALE, a
// scale that is not finite skips the update.

struct Params {
    n: u32,
    decay: f32,
    lr: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read_write> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> scale: array<f32>;

@compute @workgroup_size(256)
fn sgd(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_index(wid, nwg) * 256u + li;
    if (i >= p.n) {
        return;
    }
    var lr = p.lr;
    if (SCALE) {
        let s = scale[0];
        if (!is_finite(s)) {
            return;
        }
        lr *= s;
    }
    param[i] = param[i] * p.decay - lr * grad[i];
}
