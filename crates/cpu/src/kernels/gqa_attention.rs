//! The kernels of grouped-query attention: [`super::attention`]'s head functions on separate
//! `q`, `k`, `v` tensors, query head `h` reading kv head `h / group`.

use snug_graph::ops::{
    attention::{backward_scratch, forward_scratch},
    gqa_attention::dims,
    GqaAttention, GqaAttentionBackward, OpRule,
};

use crate::kernel::{CpuKernel, Kernel};

use super::attention::{head_backward, head_forward, HeadGrads, Rows};

impl CpuKernel for GqaAttention {
    fn run(&self, k: &Kernel<'_>) {
        use crate::par::SendPtr;
        let shapes = (k.in_shape(0), k.in_shape(1), k.in_shape(2));
        let Ok(s) = dims(
            self.name(),
            self.n_head,
            self.n_kv_head,
            shapes.0,
            shapes.1,
            shapes.2,
        ) else {
            unreachable!("shape rule checked at build time")
        };
        let (t, d, h, group) = (s.t, s.d, s.h, s.group());
        let (cq, ckv) = (s.h * d, s.kh * d);
        let q = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let kk = SendPtr(k.in_f32(1).as_ptr() as *mut f32);
        let v = SendPtr(k.in_f32(2).as_ptr() as *mut f32);
        let y = SendPtr(k.out_f32(0).as_mut_ptr());
        let lse = SendPtr(k.out_f32(1).as_mut_ptr());
        let scale = 1.0 / (d as f32).sqrt();
        crate::par::for_each_item(k.workspace(), forward_scratch(t, d), s.b * h, |item, sc| {
            let (bi, hi) = (item / h, item % h);
            let kvh = hi / group;
            // SAFETY: every pointer below stays inside its tensor; each (b, h) writes only its
            // own columns of y and its own row of lse.
            unsafe {
                let rows = |ptr, stride| Rows { ptr, stride };
                let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                head_forward(
                    (t, d, scale),
                    [
                        rows(q.get().add(bi * t * cq + hi * d), cq),
                        rows(kk.get().add(bi * t * ckv + kvh * d), ckv),
                        rows(v.get().add(bi * t * ckv + kvh * d), ckv),
                    ],
                    rows(y.get().add(bi * t * cq + hi * d), cq),
                    sc,
                    lse_row,
                );
            }
        });
    }
}

impl CpuKernel for GqaAttentionBackward {
    /// One work item per (batch, kv head): it runs that kv head's query heads one after the
    /// other, the first writing `dk`/`dv` and the rest accumulating into them, so no two
    /// threads ever write the same gradient element.
    fn run(&self, k: &Kernel<'_>) {
        use crate::par::SendPtr;
        let shapes = (k.in_shape(0), k.in_shape(1), k.in_shape(2));
        let Ok(s) = dims(
            self.name(),
            self.n_head,
            self.n_kv_head,
            shapes.0,
            shapes.1,
            shapes.2,
        ) else {
            unreachable!("shape rule checked at build time")
        };
        let (t, d, h, kh, group) = (s.t, s.d, s.h, s.kh, s.group());
        let (cq, ckv) = (h * d, kh * d);
        let q = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let kk = SendPtr(k.in_f32(1).as_ptr() as *mut f32);
        let v = SendPtr(k.in_f32(2).as_ptr() as *mut f32);
        let y = SendPtr(k.in_f32(3).as_ptr() as *mut f32);
        let lse = k.in_f32(4);
        let dy = SendPtr(k.in_f32(5).as_ptr() as *mut f32);
        let dq = SendPtr(k.out_f32(0).as_mut_ptr());
        let dk = SendPtr(k.out_f32(1).as_mut_ptr());
        let dv = SendPtr(k.out_f32(2).as_mut_ptr());
        let scale = 1.0 / (d as f32).sqrt();
        crate::par::for_each_item(
            k.workspace(),
            backward_scratch(t, d),
            s.b * kh,
            |item, ws| {
                let (bi, kvh) = (item / kh, item % kh);
                // SAFETY: every pointer stays inside its tensor; this (b, kv head) item alone writes
                // its kv head's columns of dk and dv, and its query heads' columns of dq.
                unsafe {
                    let kv_off = bi * t * ckv + kvh * d;
                    let (rq, rkv) = (
                        |ptr| Rows { ptr, stride: cq },
                        |ptr| Rows { ptr, stride: ckv },
                    );
                    for j in 0..group {
                        let hi = kvh * group + j;
                        let off = bi * t * cq + hi * d;
                        let head = HeadGrads {
                            q: rq(q.get().add(off)),
                            k: rkv(kk.get().add(kv_off)),
                            v: rkv(v.get().add(kv_off)),
                            y: rq(y.get().add(off)),
                            dy: rq(dy.get().add(off)),
                            dq: rq(dq.get().add(off)),
                            dk: rkv(dk.get().add(kv_off)),
                            dv: rkv(dv.get().add(kv_off)),
                        };
                        let lse_row = &lse[(bi * h + hi) * t..(bi * h + hi + 1) * t];
                        // The first query head of the group writes dk/dv, the rest add to them.
                        head_backward((t, d, scale), &head, lse_row, ws, j > 0);
                    }
                }
            },
        );
    }
}
