//! 8-bit AdamW's kernel against an f64 reference computed here: dequantize the moments,
//! run AdamW, requantize with the new block absmax. Two whole blocks and a partial one.

use snug_cpu::CpuSession;
use snug_graph::ops::adamw8bit::{blocks, dequantize, dynamic_code, quantize, BLOCK};
use snug_graph::ops::{AdamW, AdamW8bit};
use snug_graph::{DType, Graph, Role};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let doubled = snug_testkit::hashed_values(n, seed).into_iter();
    doubled.map(|v| 2.0 * v).collect()
}

#[test]
fn one_step_equals_the_f64_reference() {
    let n = 2 * BLOCK + 300;
    let nb = blocks(n);
    let adamw = AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let (lr, step, scale) = (1e-2f32, 3u64, 0.5f32);
    let (signed, unsigned) = (dynamic_code(true), dynamic_code(false));

    // State after some steps: moments of a few magnitudes (one block of larger ones).
    let p0 = values(n, 1);
    let g: Vec<f32> = values(n, 2).iter().map(|v| v * 0.3).collect();
    let m_true: Vec<f32> = values(n, 3)
        .iter()
        .enumerate()
        .map(|(i, v)| v * if i < BLOCK { 0.05 } else { 0.002 })
        .collect();
    let v_true: Vec<f32> = values(n, 4).iter().map(|v| v * v * 1e-3).collect();
    let (mut mq0, mut vq0) = (vec![0u8; n], vec![0u8; n]);
    let (mut ma0, mut va0) = (vec![0f32; nb], vec![0f32; nb]);
    quantize(&signed, &m_true, &mut mq0, &mut ma0);
    quantize(&unsigned, &v_true, &mut vq0, &mut va0);

    let mut gr = Graph::new();
    let leaf = |gr: &mut Graph, name: &str, shape: &[usize], dtype, role| {
        gr.add_leaf(name, shape, dtype, role).unwrap()
    };
    let p = leaf(&mut gr, "w", &[n], DType::F32, Role::Parameter);
    let gt = leaf(&mut gr, "g", &[n], DType::F32, Role::Input);
    let m = leaf(&mut gr, "w.adam8_m", &[n], DType::U8, Role::OptimizerState);
    let v = leaf(&mut gr, "w.adam8_v", &[n], DType::U8, Role::OptimizerState);
    let ma = leaf(
        &mut gr,
        "w.m_absmax",
        &[nb],
        DType::F32,
        Role::OptimizerState,
    );
    let va = leaf(
        &mut gr,
        "w.v_absmax",
        &[nb],
        DType::F32,
        Role::OptimizerState,
    );
    let s = leaf(&mut gr, "scale", &[1], DType::F32, Role::Input);
    gr.apply(AdamW8bit { adamw }, &[p, gt, m, v, ma, va, s])
        .unwrap();
    let memory = plan(&gr, &PlanOptions::default()).unwrap();
    let mut sess = CpuSession::new(gr, memory, Allocator::default(), 2).unwrap();
    sess.write_f32(p, &p0).unwrap();
    sess.write_f32(gt, &g).unwrap();
    sess.write_u8(m, &mq0).unwrap();
    sess.write_u8(v, &vq0).unwrap();
    sess.write_f32(ma, &ma0).unwrap();
    sess.write_f32(va, &va0).unwrap();
    sess.write_f32(s, &[scale]).unwrap();
    sess.run(ExecCtx::step(lr, step)).unwrap();

    // The reference, in f64.
    let (b1, b2) = (adamw.beta1 as f64, adamw.beta2 as f64);
    let t = step as i32;
    let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    let lr64 = lr as f64;
    let (mut m_new, mut v_new, mut p_new) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
    for i in 0..n {
        let b = i / BLOCK;
        let gi = g[i] as f64 * scale as f64;
        let m_old = signed[mq0[i] as usize] as f64 * ma0[b] as f64;
        let v_old = unsigned[vq0[i] as usize] as f64 * va0[b] as f64;
        m_new[i] = b1 * m_old + (1.0 - b1) * gi;
        v_new[i] = b2 * v_old + (1.0 - b2) * gi * gi;
        let denom = (v_new[i] / bc2).sqrt() + adamw.eps as f64;
        p_new[i] =
            p0[i] as f64 * (1.0 - lr64 * adamw.weight_decay as f64) - lr64 / bc1 * m_new[i] / denom;
    }
    let got_p = sess.read_f32(p).unwrap().to_vec();
    for i in 0..n {
        let err = (got_p[i] as f64 - p_new[i]).abs();
        assert!(
            err <= 1e-6 * (1.0 + p_new[i].abs()),
            "w[{i}]: {} vs {}",
            got_p[i],
            p_new[i]
        );
    }
    // The new absmaxes are the blocks' largest magnitudes.
    let (got_ma, got_va) = (
        sess.read_f32(ma).unwrap().to_vec(),
        sess.read_f32(va).unwrap().to_vec(),
    );
    for b in 0..nb {
        let range = b * BLOCK..(b * BLOCK + BLOCK).min(n);
        let want_m = m_new[range.clone()]
            .iter()
            .fold(0f64, |a, x| a.max(x.abs()));
        let want_v = v_new[range].iter().fold(0f64, |a, x| a.max(*x));
        assert!(
            (got_ma[b] as f64 - want_m).abs() <= 1e-6 * want_m,
            "m absmax {b}"
        );
        assert!(
            (got_va[b] as f64 - want_v).abs() <= 1e-6 * want_v,
            "v absmax {b}"
        );
    }
    // The codes are the nearest entries to the new moments over their absmax: each decodes
    // within half a gap of the reference (plus f32 rounding), and the code next to it in the
    // direction of the value would be no nearer.
    let (got_m, got_v) = (
        sess.read_u8(m).unwrap().to_vec(),
        sess.read_u8(v).unwrap().to_vec(),
    );
    for (code, q, absmax, want) in [
        (&signed, &got_m, &got_ma, &m_new),
        (&unsigned, &got_v, &got_va, &v_new),
    ] {
        let mut back = vec![0f32; n];
        dequantize(code, q, absmax, &mut back);
        for i in 0..n {
            let a = absmax[i / BLOCK] as f64;
            let x = want[i] / a;
            let k = q[i] as usize;
            let err = (code[k] as f64 - x).abs();
            for other in [k.saturating_sub(1), (k + 1).min(255)] {
                let e2 = (code[other] as f64 - x).abs();
                assert!(err <= e2 + 1e-6, "{i}: code {k} for {x}, {other} is nearer");
            }
            assert!((back[i] as f64 - code[k] as f64 * a).abs() <= 1e-7 * a.max(1e-30));
        }
    }
}
