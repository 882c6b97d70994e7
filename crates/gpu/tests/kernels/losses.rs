//! Softmax cross-entropy and the embedding, forward and backward.

use snug_gpu::kernels::cross_entropy::{cross_entropy, cross_entropy_backward};
use snug_gpu::kernels::embedding::{embedding, embedding_backward};

use crate::common::{assert_close, both_paths, gpu, ids, uniform, Init, SameBits, Tensors};

#[test]
fn cross_entropy_loss_and_gradient() {
    let mut same = SameBits::default();
    for device in both_paths() {
        for (k, (n, v)) in [(1, 1), (3, 17), (17, 300), (65, 65)]
            .into_iter()
            .enumerate()
        {
            let seed = 300 + 10 * k as u64;
            let logits = uniform(seed, n * v, -4.0, 4.0);
            let mut targets = ids(seed + 1, n, v as i32);
            // Out-of-range targets are clamped into the vocabulary, as on the CPU.
            targets[0] = if k % 2 == 0 { -3 } else { v as i32 + 5 };
            let dloss = 0.7f32;
            let t = Tensors::new(
                device,
                &[
                    Init::F32(logits.clone()),
                    Init::I32(targets.clone()),
                    Init::F32(vec![dloss]),
                    Init::Out(n),
                    Init::Out(1),
                    Init::Out(n * v),
                ],
            );
            t.run(|e, t| {
                cross_entropy(
                    device,
                    e,
                    (n, v),
                    [t.get(0), t.get(1)],
                    None,
                    t.get(3),
                    t.get(4),
                )?;
                cross_entropy_backward(
                    device,
                    e,
                    (n, v),
                    [t.get(0), t.get(1), t.get(2)],
                    None,
                    t.get(5),
                )
            });
            let (mut total, mut mag) = (0.0, 0.0);
            let mut grad = Vec::new();
            for r in 0..n {
                let row: Vec<f64> = logits[r * v..(r + 1) * v]
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect();
                let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = row.iter().map(|x| (x - mx).exp()).sum();
                let tgt = targets[r].clamp(0, v as i32 - 1) as usize;
                total += mx + sum.ln() - row[tgt];
                mag += mx.abs() + sum.ln().abs() + row[tgt].abs();
                let g = f64::from(dloss) / n as f64;
                for (j, x) in row.iter().enumerate() {
                    grad.push((x - mx).exp() / sum * g - if j == tgt { g } else { 0.0 });
                }
            }
            // The loss is a difference of terms of a few units: relative to their magnitudes.
            same.assert_close(
                &format!("loss [{n}, {v}]"),
                &t.read(4),
                &[total / n as f64],
                1e-5,
                &[mag / n as f64],
            );
            // Each gradient element is p·g (− g at the target): relative to g.
            let g_mag = vec![f64::from(dloss) / n as f64; n * v];
            same.assert_close(
                &format!("dlogits [{n}, {v}]"),
                &t.read(5),
                &grad,
                1e-5,
                &g_mag,
            );
        }
    }
}

#[test]
fn embedding_gathers_rows_and_scatters_gradients_deterministically() {
    let Some(device) = gpu() else { return };
    for (k, (tokens, vocab, c)) in [(1, 1, 1), (17, 5, 17), (130, 65, 33), (200, 7, 100)]
        .into_iter()
        .enumerate()
    {
        let seed = 400 + 10 * k as u64;
        let table = uniform(seed, vocab * c, -1.0, 1.0);
        let mut id = ids(seed + 1, tokens, vocab as i32);
        if tokens > 2 {
            // Stray ids read zeros and receive no gradient.
            id[1] = -1;
            id[2] = vocab as i32;
        }
        let dy = uniform(seed + 2, tokens * c, -1.0, 1.0);
        let t = Tensors::new(
            device,
            &[
                Init::F32(table.clone()),
                Init::I32(id.clone()),
                Init::F32(dy.clone()),
                Init::Out(tokens * c),
                Init::Out(vocab * c),
            ],
        );
        t.run(|e, t| {
            embedding(
                device,
                e,
                (tokens, vocab, c),
                [t.get(0), t.get(1)],
                t.get(3),
            )?;
            embedding_backward(
                device,
                e,
                (tokens, vocab, c),
                [t.get(1), t.get(2)],
                t.get(4),
            )
        });
        let mut y = vec![0.0; tokens * c];
        // Summed in token order in f32, as both backends do: the same bits.
        let mut dt = vec![0.0f32; vocab * c];
        for (ti, &i) in id.iter().enumerate() {
            if let Some(i) = usize::try_from(i).ok().filter(|&i| i < vocab) {
                for j in 0..c {
                    y[ti * c + j] = f64::from(table[i * c + j]);
                    dt[i * c + j] += dy[ti * c + j];
                }
            }
        }
        assert_close(&format!("embedding {tokens}"), &t.read(3), &y, 0.0, &[]);
        let dt: Vec<f64> = dt.iter().map(|&v| f64::from(v)).collect();
        assert_close(
            &format!("embedding grad {tokens}"),
            &t.read(4),
            &dt,
            0.0,
            &[],
        );
    }
}

/// The fused LM head + loss against f64 loops, tied and untied, with tiles that split both the
/// tokens and the vocabulary (and one tile of everything), `dx` written over `x` or apart.
#[test]
fn fused_lm_head_loss_and_gradients() {
    use snug_gpu::kernels::lm_head_loss::{lm_head_loss, lm_head_loss_backward, HeadShape};
    let mut same = SameBits::default();
    for device in both_paths() {
        let (n, c, v) = (70, 40, 150);
        for (k, (tb, rows, cols, inplace)) in [
            (true, 32, 64, false),
            (false, 32, 64, true),
            (false, 70, 150, false),
            (true, 70, 150, true),
            (true, 70, 64, true),
        ]
        .into_iter()
        .enumerate()
        {
            let s = HeadShape {
                n,
                c,
                v,
                tb,
                rows,
                cols,
            };
            let seed = 900 + 10 * k as u64;
            let x = uniform(seed, n * c, -1.0, 1.0);
            let head = uniform(seed + 1, v * c, -0.5, 0.5);
            let targets = ids(seed + 2, n, v as i32);
            let dloss = 0.8f32;
            let t = Tensors::new(
                device,
                &[
                    Init::F32(x.clone()),
                    Init::F32(head.clone()),
                    Init::I32(targets.clone()),
                    Init::F32(vec![dloss]),
                    Init::Out(s.forward_workspace().max(s.backward_workspace())),
                    Init::Out(1),
                    Init::Out(n),
                    Init::Out(n * c),
                    Init::Out(v * c),
                ],
            );
            t.run(|e, t| {
                let ws = t.get(4);
                lm_head_loss(
                    device,
                    e,
                    s,
                    [t.get(0), t.get(1), t.get(2)],
                    None,
                    ws,
                    [t.get(5), t.get(6)],
                )?;
                let dx = if inplace { t.get(0) } else { t.get(7) };
                lm_head_loss_backward(
                    device,
                    e,
                    s,
                    [t.get(0), t.get(1), t.get(2), t.get(6), t.get(3)],
                    None,
                    ws,
                    [dx, t.get(8)],
                )
            });
            let w = |vi: usize, ci: usize| {
                f64::from(if tb {
                    head[vi * c + ci]
                } else {
                    head[ci * v + vi]
                })
            };
            let (mut total, mut mag) = (0.0, 0.0);
            let (mut lse, mut dx, mut dhead) = (vec![], vec![0.0; n * c], vec![0.0; v * c]);
            let (mut dx_mag, mut dhead_mag) = (vec![0.0; n * c], vec![0.0; v * c]);
            let g = f64::from(dloss) / n as f64;
            for r in 0..n {
                let logits: Vec<f64> = (0..v)
                    .map(|vi| (0..c).map(|ci| f64::from(x[r * c + ci]) * w(vi, ci)).sum())
                    .collect();
                let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let l = mx + logits.iter().map(|z| (z - mx).exp()).sum::<f64>().ln();
                let tgt = targets[r] as usize;
                lse.push(l);
                total += l - logits[tgt];
                mag += l.abs() + logits[tgt].abs();
                for (vi, z) in logits.iter().enumerate() {
                    let d = ((z - l).exp() - if vi == tgt { 1.0 } else { 0.0 }) * g;
                    for ci in 0..c {
                        let (xi, wi) = (f64::from(x[r * c + ci]), w(vi, ci));
                        dx[r * c + ci] += d * wi;
                        dx_mag[r * c + ci] += (d * wi).abs();
                        let at = if tb { vi * c + ci } else { ci * v + vi };
                        dhead[at] += d * xi;
                        dhead_mag[at] += (d * xi).abs();
                    }
                }
            }
            let what = format!("lm head tb={tb} tile {rows}x{cols}");
            same.assert_close(
                &format!("{what} loss"),
                &t.read(5),
                &[total / n as f64],
                1e-5,
                &[mag / n as f64],
            );
            let lse_mag: Vec<f64> = lse.iter().map(|l| l.abs() + 1.0).collect();
            same.assert_close(&format!("{what} lse"), &t.read(6), &lse, 1e-5, &lse_mag);
            let got_dx = t.read(if inplace { 0 } else { 7 });
            same.assert_close(&format!("{what} dx"), &got_dx, &dx, 1e-4, &dx_mag);
            same.assert_close(
                &format!("{what} dhead"),
                &t.read(8),
                &dhead,
                1e-4,
                &dhead_mag,
            );
        }
    }
}
