//! The kernel of [`KvAttention`]: the new keys and values copied into the caches, then one
//! work item per (batch row, query head, new position) scoring the cache rows it may see in a
//! per-thread row of the workspace.

use snug_graph::ops::KvAttention;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for KvAttention {
    fn run(&self, k: &Kernel<'_>) {
        let shapes: Vec<&[usize]> = (0..k.in_count()).map(|i| k.in_shape(i)).collect();
        let Ok(s) = self.dims(&shapes) else {
            unreachable!("shape rule checked at build time")
        };
        let c = self.cache_input();
        // The runtime range-checks the position when it is written; never negative here.
        let pos = usize::try_from(k.in_i32(c + 2)[0]).unwrap_or(0);
        let (hd, kv) = (s.h * s.d, s.kh * s.d);
        // Where each new row's q, k and v sit: (tensor, row stride, offset in the row).
        let (q, k_new, v_new) = if self.packed {
            let qkv = k.in_f32(0);
            ((qkv, 3 * hd, 0), (qkv, 3 * hd, hd), (qkv, 3 * hd, 2 * hd))
        } else {
            (
                (k.in_f32(0), hd, 0),
                (k.in_f32(1), kv, 0),
                (k.in_f32(2), kv, 0),
            )
        };
        let (k_cache, v_cache) = (k.in_mut_f32(c), k.in_mut_f32(c + 1));
        for b in 0..s.b {
            // Rows past the cache are dropped rather than written out of bounds.
            for i in 0..s.t.min(s.s.saturating_sub(pos)) {
                let dst = (b * s.s + pos + i) * kv;
                for (cache, (new, stride, off)) in [(&mut *k_cache, k_new), (&mut *v_cache, v_new)]
                {
                    let from = (b * s.t + i) * stride + off;
                    cache[dst..dst + kv].copy_from_slice(&new[from..from + kv]);
                }
            }
        }
        let (k_cache, v_cache): (&[f32], &[f32]) = (k_cache, v_cache);
        let y = crate::par::SendPtr(k.out_f32(0).as_mut_ptr());
        let (d, group) = (s.d, s.h / s.kh);
        let scale = 1.0 / (d as f32).sqrt();
        crate::par::for_each_item(
            k.workspace(),
            s.s,
            s.b * s.h * s.t,
            #[inline(always)]
            |item, scores| {
                let (b, rest) = (item / (s.h * s.t), item % (s.h * s.t));
                let (h, i) = (rest / s.t, rest % s.t);
                let seen = (pos + i + 1).min(s.s);
                let qr = &q.0[(b * s.t + i) * q.1 + q.2 + h * d..][..d];
                let kv_off = (h / group) * d;
                let at = |j: usize| (b * s.s + j) * kv + kv_off;
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in scores[..seen].iter_mut().enumerate() {
                    let dot: f32 = qr
                        .iter()
                        .zip(&k_cache[at(j)..at(j) + d])
                        .map(|(a, b)| a * b)
                        .sum();
                    *sc = dot * scale;
                    max = max.max(*sc);
                }
                let mut total = 0.0f32;
                for sc in &mut scores[..seen] {
                    *sc = (*sc - max).exp();
                    total += *sc;
                }
                // SAFETY: head h of row (b, i) of y is written by this item only, inside y.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(y.get().add((b * s.t + i) * hd + h * d), d)
                };
                out.fill(0.0);
                for (j, &p) in scores[..seen].iter().enumerate() {
                    let w = p / total;
                    for (o, v) in out.iter_mut().zip(&v_cache[at(j)..at(j) + d]) {
                        *o += w * v;
                    }
                }
            },
        );
    }
}
