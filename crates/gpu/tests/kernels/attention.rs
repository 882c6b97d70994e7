//! Causal attention, packed (GPT) and grouped-query (Llama) layouts, forward and backward,
//! against a direct softmax in f64.

use snug_gpu::kernels::attention::{
    attention_backward, attention_forward, AttentionLayout, AttentionShape,
};

use snug_gpu::GpuDevice;

use crate::common::{assert_close, gpu, uniform, Init, Tensors};

/// Reads row `i`, head `h` of a tensor laid out by `(stride, offset)`.
fn head(x: &[f32], (stride, offset): (usize, usize), bt: usize, h: usize, d: usize) -> Vec<f64> {
    let base = bt * stride + offset + h * d;
    x[base..base + d].iter().map(|&v| f64::from(v)).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

struct Grads {
    y: Vec<f64>,
    y_mag: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// Magnitudes the gradients are relative to (sums of their terms' absolute values).
    dq_mag: Vec<f64>,
    dk_mag: Vec<f64>,
    dv_mag: Vec<f64>,
}

/// Direct attention in f64, with gradients for `dy`. `q`, `k`, `v` and their gradients are laid
/// out by `l`; `dq`, `dk`, `dv` come back in those layouts (zeros elsewhere).
#[allow(clippy::needless_range_loop)]
fn reference(
    s: AttentionShape,
    l: AttentionLayout,
    (q, k, v): (&[f32], &[f32], &[f32]),
    dy: &[f32],
    lens: (usize, usize, usize),
) -> Grads {
    let (t, d, hh) = (s.seq, s.head_dim, s.heads);
    let c = hh * d;
    let group = hh / s.kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    let (ql, kl, vl) = (
        (l.q.stride, l.q.offset),
        (l.k.stride, l.k.offset),
        (l.v.stride, l.v.offset),
    );
    let mut g = Grads {
        y: vec![0.0; s.batch * t * c],
        y_mag: vec![0.0; s.batch * t * c],
        lse: vec![0.0; s.batch * hh * t],
        dq: vec![0.0; lens.0],
        dk: vec![0.0; lens.1],
        dv: vec![0.0; lens.2],
        dq_mag: vec![0.0; lens.0],
        dk_mag: vec![0.0; lens.1],
        dv_mag: vec![0.0; lens.2],
    };
    for b in 0..s.batch {
        for h in 0..hh {
            let kh = h / group;
            for i in 0..t {
                let qi = head(q, ql, b * t + i, h, d);
                let scores: Vec<f64> = (0..=i)
                    .map(|j| scale * dot(&qi, &head(k, kl, b * t + j, kh, d)))
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - mx).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|x| (x - mx).exp() / sum).collect();
                g.lse[(b * hh + h) * t + i] = mx + sum.ln();
                let yrow = (b * t + i) * c + h * d;
                let dyi = head(dy, (c, 0), b * t + i, h, d);
                let mut yi = vec![0.0; d];
                for j in 0..=i {
                    let vj = head(v, vl, b * t + j, kh, d);
                    for e in 0..d {
                        yi[e] += p[j] * vj[e];
                        g.y_mag[yrow + e] += p[j] * vj[e].abs();
                    }
                }
                g.y[yrow..yrow + d].copy_from_slice(&yi);
                let di = dot(&dyi, &yi);
                for j in 0..=i {
                    let kj = head(k, kl, b * t + j, kh, d);
                    let vj = head(v, vl, b * t + j, kh, d);
                    let dp = dot(&dyi, &vj);
                    let ds = p[j] * (dp - di);
                    let ds_mag = p[j]
                        * (dot(
                            &dyi.iter().map(|x| x.abs()).collect::<Vec<_>>(),
                            &vj.iter().map(|x| x.abs()).collect::<Vec<_>>(),
                        ) + di.abs());
                    let (qb, kb, vb) = (
                        (b * t + i) * ql.0 + ql.1 + h * d,
                        (b * t + j) * kl.0 + kl.1 + kh * d,
                        (b * t + j) * vl.0 + vl.1 + kh * d,
                    );
                    for e in 0..d {
                        g.dq[qb + e] += scale * ds * kj[e];
                        g.dq_mag[qb + e] += scale * ds_mag * kj[e].abs();
                        g.dk[kb + e] += scale * ds * qi[e];
                        g.dk_mag[kb + e] += scale * ds_mag * qi[e].abs();
                        g.dv[vb + e] += p[j] * dyi[e];
                        g.dv_mag[vb + e] += p[j] * dyi[e].abs();
                    }
                }
            }
        }
    }
    g
}

fn check(device: &'static GpuDevice, s: AttentionShape, packed: bool, seed: u64) {
    let l = if packed {
        AttentionLayout::packed(&s)
    } else {
        AttentionLayout::separate(&s)
    };
    let bt = s.batch * s.seq;
    let c = s.heads * s.head_dim;
    let (nq, nk, nv) = (bt * l.q.stride, bt * l.k.stride, bt * l.v.stride);
    let dy = uniform(seed + 9, bt * c, -1.0, 1.0);
    let what = format!("{s:?} packed={packed}");
    // Packed: tensors 0 = qkv, 1 = dqkv; separate: 0, 1, 2 = q, k, v and 3, 4, 5 = grads.
    let inputs: Vec<Vec<f32>> = if packed {
        vec![uniform(seed, nq, -1.0, 1.0)]
    } else {
        vec![
            uniform(seed, nq, -1.0, 1.0),
            uniform(seed + 1, nk, -1.0, 1.0),
            uniform(seed + 2, nv, -1.0, 1.0),
        ]
    };
    let mut inits: Vec<Init> = inputs.iter().map(|x| Init::F32(x.clone())).collect();
    let grads_at = inits.len();
    if packed {
        inits.push(Init::Out(nq));
    } else {
        inits.extend([Init::Out(nq), Init::Out(nk), Init::Out(nv)]);
    }
    let rest = inits.len();
    inits.extend([
        Init::Out(bt * c),
        Init::Out(s.batch * s.heads * s.seq),
        Init::F32(dy.clone()),
    ]);
    let t = Tensors::new(device, &inits);
    t.run(|e, t| {
        let (q, k, v) = if packed {
            (t.get(0), t.get(0), t.get(0))
        } else {
            (t.get(0), t.get(1), t.get(2))
        };
        let (dq, dk, dv) = if packed {
            (t.get(grads_at), t.get(grads_at), t.get(grads_at))
        } else {
            (t.get(grads_at), t.get(grads_at + 1), t.get(grads_at + 2))
        };
        let (y, lse, dy) = (t.get(rest), t.get(rest + 1), t.get(rest + 2));
        attention_forward(device, e, (s, l), [q, k, v], [y, lse])?;
        attention_backward(device, e, (s, l), [q, k, v, y, lse, dy], [dq, dk, dv])
    });
    let (q, k, v) = if packed {
        (&inputs[0][..], &inputs[0][..], &inputs[0][..])
    } else {
        (&inputs[0][..], &inputs[1][..], &inputs[2][..])
    };
    let r = reference(s, l, (q, k, v), &dy, (nq, nk, nv));
    // Sums over at most T·D products: relative to their terms' magnitudes, like the GEMM.
    assert_close(&format!("{what} y"), &t.read(rest), &r.y, 1e-5, &r.y_mag);
    let lse_mag: Vec<f64> = r.lse.iter().map(|x| x.abs() + 1.0).collect();
    assert_close(
        &format!("{what} lse"),
        &t.read(rest + 1),
        &r.lse,
        1e-5,
        &lse_mag,
    );
    if packed {
        // dq, dk and dv fill disjoint columns of the one dqkv.
        let sum = |a: &[f64], b: &[f64], c: &[f64]| -> Vec<f64> {
            a.iter()
                .zip(b)
                .zip(c)
                .map(|((x, y), z)| x + y + z)
                .collect()
        };
        let want = sum(&r.dq, &r.dk, &r.dv);
        let mag = sum(&r.dq_mag, &r.dk_mag, &r.dv_mag);
        assert_close(
            &format!("{what} dqkv"),
            &t.read(grads_at),
            &want,
            1e-5,
            &mag,
        );
    } else {
        assert_close(
            &format!("{what} dq"),
            &t.read(grads_at),
            &r.dq,
            1e-5,
            &r.dq_mag,
        );
        assert_close(
            &format!("{what} dk"),
            &t.read(grads_at + 1),
            &r.dk,
            1e-5,
            &r.dk_mag,
        );
        assert_close(
            &format!("{what} dv"),
            &t.read(grads_at + 2),
            &r.dv,
            1e-5,
            &r.dv_mag,
        );
    }
}

#[test]
fn packed_causal_attention_across_tile_edges() {
    let Some(device) = gpu() else { return };
    for (i, (batch, seq, heads, head_dim)) in
        [(1, 1, 1, 1), (2, 17, 2, 8), (1, 65, 1, 64), (1, 130, 2, 16)]
            .into_iter()
            .enumerate()
    {
        let s = AttentionShape {
            batch,
            seq,
            heads,
            kv_heads: heads,
            head_dim,
        };
        check(device, s, true, 500 + 10 * i as u64);
    }
}

#[test]
fn grouped_query_attention_sums_kv_gradients_over_the_group() {
    let Some(device) = gpu() else { return };
    for (i, (heads, kv_heads)) in [(4, 2), (3, 1), (2, 2)].into_iter().enumerate() {
        let s = AttentionShape {
            batch: 2,
            seq: 40,
            heads,
            kv_heads,
            head_dim: 8,
        };
        check(device, s, false, 600 + 10 * i as u64);
    }
}
