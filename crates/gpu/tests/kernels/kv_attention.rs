//! Attention over a key/value cache (sampling), packed (GPT) and grouped-query (Llama)
//! layouts, against a direct softmax in f64; and RoPE at a run-time position against the
//! whole-window rotation.

use snug_gpu::kernels::attention::{AttentionLayout, AttentionShape};
use snug_gpu::kernels::kv_attention::{kv_attention, KvShape};
use snug_gpu::kernels::rope::{rope, RopeSpec};
use snug_gpu::kernels::rope_at::rope_at;

use crate::common::{assert_close, both_paths, gpu, uniform, Init, SameBits, Tensors};

/// The caches after the new rows are written, and `y`, with each output's magnitude (the sum
/// of its terms' absolute values).
#[allow(clippy::type_complexity)]
fn reference(
    s: KvShape,
    l: AttentionLayout,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (k_cache, v_cache): (&[f32], &[f32]),
    pos: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f64>, Vec<f64>) {
    let (kv, hd) = (s.kh * s.d, s.h * s.d);
    let (mut kc, mut vc) = (k_cache.to_vec(), v_cache.to_vec());
    for b in 0..s.b {
        for i in 0..s.t {
            if pos + i >= s.s {
                continue;
            }
            let dst = (b * s.s + pos + i) * kv;
            let row = b * s.t + i;
            for c in 0..kv {
                kc[dst + c] = k[row * l.k.stride + l.k.offset + c];
                vc[dst + c] = v[row * l.v.stride + l.v.offset + c];
            }
        }
    }
    let mut y = vec![0.0; s.b * s.t * hd];
    let mut mag = vec![0.0; s.b * s.t * hd];
    let group = s.h / s.kh;
    let scale = 1.0 / (s.d as f64).sqrt();
    for b in 0..s.b {
        for h in 0..s.h {
            let head = (h / group) * s.d;
            for i in 0..s.t {
                let row = b * s.t + i;
                let qr = &q[row * l.q.stride + l.q.offset + h * s.d..][..s.d];
                let seen = (pos + i + 1).min(s.s);
                let scores: Vec<f64> = (0..seen)
                    .map(|j| {
                        let kr = &kc[(b * s.s + j) * kv + head..][..s.d];
                        scale
                            * qr.iter()
                                .zip(kr)
                                .map(|(&a, &c)| f64::from(a) * f64::from(c))
                                .sum::<f64>()
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|x| (x - mx).exp()).sum();
                for (j, sc) in scores.iter().enumerate() {
                    let w = (sc - mx).exp() / total;
                    let vr = &vc[(b * s.s + j) * kv + head..][..s.d];
                    for (c, &vv) in vr.iter().enumerate() {
                        y[row * hd + h * s.d + c] += w * f64::from(vv);
                        mag[row * hd + h * s.d + c] += (w * f64::from(vv)).abs();
                    }
                }
            }
        }
    }
    (kc, vc, y, mag)
}

fn check(s: KvShape, packed: bool, pos: usize) {
    let mut same = SameBits::default();
    for device in both_paths() {
        let a = AttentionShape {
            batch: s.b,
            seq: s.t,
            heads: s.h,
            kv_heads: s.kh,
            head_dim: s.d,
        };
        let l = if packed {
            AttentionLayout::packed(&a)
        } else {
            AttentionLayout::separate(&a)
        };
        let (rows, kv, hd) = (s.b * s.t, s.kh * s.d, s.h * s.d);
        let seed = (s.s * 31 + s.t * 7 + s.d + pos) as u64;
        let cache_len = s.b * s.s * kv;
        let k_cache = uniform(seed + 3, cache_len, -1.0, 1.0);
        let v_cache = uniform(seed + 4, cache_len, -1.0, 1.0);
        let what = format!("kv_attention {s:?} packed {packed} pos {pos}");
        let (inits, q, k, v) = if packed {
            let qkv = uniform(seed, rows * 3 * hd, -1.0, 1.0);
            let inits = vec![
                Init::F32(qkv.clone()),
                Init::F32(k_cache.clone()),
                Init::F32(v_cache.clone()),
                Init::I32(vec![pos as i32]),
                Init::Out(rows * hd),
            ];
            (inits, qkv.clone(), qkv.clone(), qkv)
        } else {
            let q = uniform(seed, rows * hd, -1.0, 1.0);
            let k = uniform(seed + 1, rows * kv, -1.0, 1.0);
            let v = uniform(seed + 2, rows * kv, -1.0, 1.0);
            let inits = vec![
                Init::F32(q.clone()),
                Init::F32(k.clone()),
                Init::F32(v.clone()),
                Init::F32(k_cache.clone()),
                Init::F32(v_cache.clone()),
                Init::I32(vec![pos as i32]),
                Init::Out(rows * hd),
            ];
            (inits, q, k, v)
        };
        let tt = Tensors::new(device, &inits);
        let c = if packed { 1 } else { 3 };
        tt.run(|e, tt| {
            let (q, k, v) = if packed {
                (tt.get(0), tt.get(0), tt.get(0))
            } else {
                (tt.get(0), tt.get(1), tt.get(2))
            };
            kv_attention(
                device,
                e,
                (s, l),
                [q, k, v, tt.get(c), tt.get(c + 1), tt.get(c + 2)],
                tt.get(c + 3),
            )
        });
        let (kc, vc, y, mag) = reference(s, l, (&q, &k, &v), (&k_cache, &v_cache), pos);
        // The caches are copies: exact.
        assert_eq!(tt.read(c), kc, "{what}: k_cache");
        assert_eq!(tt.read(c + 1), vc, "{what}: v_cache");
        // f32 sums of up to a few hundred terms, relative to their magnitudes.
        same.assert_close(&format!("{what}: y"), &tt.read(c + 3), &y, 1e-5, &mag);
    }
}

fn dims(b: usize, t: usize, s: usize, h: usize, kh: usize, d: usize) -> KvShape {
    KvShape { b, t, s, h, kh, d }
}

#[test]
fn a_decode_step_against_the_cache_across_the_kernels_tile() {
    // One new row at positions before, at and past the 256-row tile, heads 1, 7 and 64 wide.
    check(dims(1, 1, 300, 2, 2, 7), true, 0);
    check(dims(1, 1, 300, 2, 2, 7), true, 255);
    check(dims(1, 1, 300, 2, 2, 7), true, 256);
    check(dims(2, 1, 300, 4, 2, 64), false, 299);
    check(dims(1, 1, 40, 3, 1, 1), false, 17);
}

#[test]
fn a_prefill_of_many_rows_and_rows_past_the_cache_dropped() {
    check(dims(1, 37, 64, 2, 2, 16), true, 0);
    check(dims(2, 20, 520, 6, 3, 8), false, 490);
    // Rows 4.. would land past the cache: dropped, as on the CPU, and none of them attends.
    check(dims(1, 6, 10, 2, 1, 4), false, 6);
}

fn rope_reference(spec: RopeSpec, (b, t): (usize, usize), x: &[f32], first: usize) -> Vec<f64> {
    let (hd, half) = (spec.head_dim, spec.head_dim / 2);
    let c = spec.n_head * hd;
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for r in 0..t {
            for h in 0..spec.n_head {
                let base = (bi * t + r) * c + h * hd;
                for i in 0..half {
                    let (s, co) = ((first + r) as f64 * spec.inv_freq(i)).sin_cos();
                    let (x1, x2) = (f64::from(x[base + i]), f64::from(x[base + i + half]));
                    y[base + i] = x1 * co - x2 * s;
                    y[base + i + half] = x2 * co + x1 * s;
                }
            }
        }
    }
    y
}

#[test]
fn rope_at_a_run_time_position_matches_the_whole_window_bit_for_bit() {
    let Some(device) = gpu() else { return };
    let spec = RopeSpec::new(3, 16, 10_000.0);
    let (c, window) = (3 * 16, 700);
    let full = uniform(5, window * c, -1.0, 1.0);
    let tt = Tensors::new(device, &[Init::F32(full.clone()), Init::Out(window * c)]);
    tt.run(|e, tt| rope(device, e, spec, (1, window), tt.get(0), tt.get(1)));
    let whole = tt.read(1);
    for (first, t) in [(0, 1), (5, 9), (600, 1), (640, 60)] {
        let x = full[first * c..(first + t) * c].to_vec();
        let one = Tensors::new(
            device,
            &[
                Init::F32(x.clone()),
                Init::I32(vec![first as i32]),
                Init::Out(t * c),
            ],
        );
        one.run(|e, tt| rope_at(device, e, spec, (1, t), [tt.get(0), tt.get(1)], tt.get(2)));
        let got = one.read(2);
        assert_eq!(
            got,
            whole[first * c..(first + t) * c],
            "rope_at {first}+{t} against the window's rows"
        );
        let want = rope_reference(spec, (1, t), &x, first);
        let mag: Vec<f64> = vec![2.0; t * c];
        assert_close(&format!("rope_at {first}+{t}"), &got, &want, 1e-5, &mag);
    }
}
