//! The kernels of grouped-query attention: [`super::attention`]'s head functions on separate
//! `q`, `k`, `v` tensors, query head `h` reading kv head `h / group`; under
//! [`snug_graph::ops::HalfIo`], bf16 heads widened into (and bf16 gradients rounded from) each
//! work item's scratch.

use snug_graph::ops::{
    attention::{backward_scratch, forward_scratch},
    gqa_attention::{dims, Dims},
    GqaAttention, GqaAttentionBackward, OpRule,
};

use crate::kernel::{CpuKernel, Kernel};
use crate::par::SendPtr;

use super::attention::{head_backward, head_forward, stage_head, unstage_head, HeadGrads, Rows};

impl CpuKernel for GqaAttention {
    fn run(&self, k: &Kernel<'_>) {
        forward_io(self, k, [false; 3], false);
    }
}

/// Each input of a head read in place (f32) or from bf16 bits.
fn source<'a>(k: &Kernel<'a>, i: usize, half: bool) -> (SendPtr, &'a [u16]) {
    if half {
        (SendPtr(std::ptr::null_mut()), k.in_u16(i))
    } else {
        (SendPtr(k.in_f32(i).as_ptr() as *mut f32), &[][..])
    }
}

/// An output written in place (f32) or, its pointer carried as an f32 one, as bf16 bits.
fn sink(k: &Kernel<'_>, i: usize, half: bool) -> SendPtr {
    if half {
        SendPtr(k.out_u16(i).as_mut_ptr() as *mut f32)
    } else {
        SendPtr(k.out_f32(i).as_mut_ptr())
    }
}

/// A head operand's rows: staged (`d` apart), or in the f32 tensor at `f32_at`.
fn rows(staged: &mut [f32], f32_at: *mut f32, stride: usize, d: usize) -> Rows {
    Rows::staged_or(staged, (f32_at, stride), d)
}

/// The attention's sizes (the shape rule checked them when the graph was built).
fn sizes(op: &'static str, (n_head, n_kv_head): (usize, usize), k: &Kernel<'_>) -> Dims {
    let (q, kk, v) = (k.in_shape(0), k.in_shape(1), k.in_shape(2));
    let Ok(s) = dims(op, n_head, n_kv_head, q, kk, v) else {
        unreachable!("shape rule checked at build time")
    };
    s
}

/// [`GqaAttention`], under [`snug_graph::ops::HalfIo`] with `q`, `k`, `v` (`reads`) widened
/// from bf16 into each head's scratch first, and with `half_y` its output made there and
/// rounded into `y` after; with no flag, every head read and written in place.
pub(super) fn forward_io(op: &GqaAttention, k: &Kernel<'_>, reads: [bool; 3], half_y: bool) {
    let s = sizes(op.name(), (op.n_head, op.n_kv_head), k);
    let (t, d, h, group) = (s.t, s.d, s.h, s.group());
    let (cq, ckv) = (s.h * d, s.kh * d);
    let [(q, q16), (kk, k16), (v, v16)] = [0, 1, 2].map(|i| source(k, i, reads[i]));
    let y = sink(k, 0, half_y);
    let lse = SendPtr(k.out_f32(1).as_mut_ptr());
    let scale = 1.0 / (d as f32).sqrt();
    let own = forward_scratch(t, d);
    let wide = |half: bool| if half { t * d } else { 0 };
    let staging = reads.map(wide).iter().sum::<usize>() + wide(half_y);
    // Products on bf16 inputs compute in bf16 arithmetic where the CPU has it.
    let bf16 = reads[0].then(crate::gemm::HeadBf16::host).flatten();
    crate::par::for_each_item(
        k.workspace(),
        own + staging,
        s.b * h,
        #[inline(always)]
        |item, sc| {
            let (bi, hi) = (item / h, item % h);
            let kvh = hi / group;
            let (sc, rest) = sc.split_at_mut(own);
            let (s_q, rest) = rest.split_at_mut(wide(reads[0]));
            let (s_k, rest) = rest.split_at_mut(wide(reads[1]));
            let (s_v, s_y) = rest.split_at_mut(wide(reads[2]));
            let (at_q, at_kv) = (bi * t * cq + hi * d, bi * t * ckv + kvh * d);
            for (half, bits, (at, stride), staged) in [
                (reads[0], q16, (at_q, cq), &mut *s_q),
                (reads[1], k16, (at_kv, ckv), &mut *s_k),
                (reads[2], v16, (at_kv, ckv), &mut *s_v),
            ] {
                if half {
                    stage_head(bits, (at, stride), (0, 1), d, staged);
                }
            }
            // SAFETY: every pointer below stays inside its tensor or its staged copy; each (b, h)
            // writes only its own columns of y (or its own staged output) and its own row of lse.
            unsafe {
                let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                head_forward(
                    (t, d, scale),
                    [
                        rows(s_q, q.get().wrapping_add(at_q), cq, d),
                        rows(s_k, kk.get().wrapping_add(at_kv), ckv, d),
                        rows(s_v, v.get().wrapping_add(at_kv), ckv, d),
                    ],
                    rows(s_y, y.get().wrapping_add(at_q), cq, d),
                    sc,
                    lse_row,
                    bf16,
                );
                if half_y {
                    unstage_head(s_y, (y.get() as *mut u16).add(at_q), (cq, (0, 1)), d);
                }
            }
        },
    );
}

impl CpuKernel for GqaAttentionBackward {
    fn run(&self, k: &Kernel<'_>) {
        backward_io(self, k, [false; 5], [false; 3]);
    }
}

/// [`GqaAttentionBackward`]: one work item per (batch, kv head), running that kv head's query
/// heads one after the other, the first writing `dk`/`dv` and the rest accumulating into them,
/// so no two threads ever write the same gradient element. Under
/// [`snug_graph::ops::HalfIo`], the inputs `[q, k, v, y, dy]` flagged in `reads` are widened
/// from bf16 into the item's scratch first, and the gradients flagged in `writes` (`[dq, dk,
/// dv]`) made there in f32 and rounded after (`dk`, `dv` once their last query head has
/// added to them, so each is rounded from the sum the f32 kernel stores).
pub(super) fn backward_io(
    op: &GqaAttentionBackward,
    k: &Kernel<'_>,
    reads: [bool; 5],
    writes: [bool; 3],
) {
    let s = sizes(op.name(), (op.n_head, op.n_kv_head), k);
    let (t, d, h, kh, group) = (s.t, s.d, s.h, s.kh, s.group());
    let (cq, ckv) = (h * d, kh * d);
    let [(q, q16), (kk, k16), (v, v16), (y, y16), (dy, dy16)] =
        [0, 1, 2, 3, 5].map(|i| source(k, i, reads[if i == 5 { 4 } else { i }]));
    let lse = k.in_f32(4);
    let [dq, dk, dv] = [0, 1, 2].map(|i| sink(k, i, writes[i]));
    let scale = 1.0 / (d as f32).sqrt();
    let own = backward_scratch(t, d);
    let wide = |half: bool| if half { t * d } else { 0 };
    let staging = reads.map(wide).iter().sum::<usize>() + writes.map(wide).iter().sum::<usize>();
    let bf16 = reads[0].then(crate::gemm::HeadBf16::host).flatten();
    crate::par::for_each_item(
        k.workspace(),
        own + staging,
        s.b * kh,
        #[inline(always)]
        |item, ws| {
            let (bi, kvh) = (item / kh, item % kh);
            let (ws, rest) = ws.split_at_mut(own);
            let (s_q, rest) = rest.split_at_mut(wide(reads[0]));
            let (s_k, rest) = rest.split_at_mut(wide(reads[1]));
            let (s_v, rest) = rest.split_at_mut(wide(reads[2]));
            let (s_y, rest) = rest.split_at_mut(wide(reads[3]));
            let (s_dy, rest) = rest.split_at_mut(wide(reads[4]));
            let (s_dq, rest) = rest.split_at_mut(wide(writes[0]));
            let (s_dk, s_dv) = rest.split_at_mut(wide(writes[1]));
            let kv_off = bi * t * ckv + kvh * d;
            if reads[1] {
                stage_head(k16, (kv_off, ckv), (0, 1), d, s_k);
            }
            if reads[2] {
                stage_head(v16, (kv_off, ckv), (0, 1), d, s_v);
            }
            for j in 0..group {
                let hi = kvh * group + j;
                let off = bi * t * cq + hi * d;
                for (half, bits, staged) in [
                    (reads[0], q16, &mut *s_q),
                    (reads[3], y16, &mut *s_y),
                    (reads[4], dy16, &mut *s_dy),
                ] {
                    if half {
                        stage_head(bits, (off, cq), (0, 1), d, staged);
                    }
                }
                // SAFETY: every pointer stays inside its tensor or its staged copy; this (b, kv
                // head) item alone writes its kv head's columns of dk and dv, and its query heads'
                // columns of dq (or its own staged gradients).
                unsafe {
                    let head = HeadGrads {
                        q: rows(s_q, q.get().wrapping_add(off), cq, d),
                        k: rows(s_k, kk.get().wrapping_add(kv_off), ckv, d),
                        v: rows(s_v, v.get().wrapping_add(kv_off), ckv, d),
                        y: rows(s_y, y.get().wrapping_add(off), cq, d),
                        dy: rows(s_dy, dy.get().wrapping_add(off), cq, d),
                        dq: rows(s_dq, dq.get().wrapping_add(off), cq, d),
                        dk: rows(s_dk, dk.get().wrapping_add(kv_off), ckv, d),
                        dv: rows(s_dv, dv.get().wrapping_add(kv_off), ckv, d),
                    };
                    let lse_row = &lse[(bi * h + hi) * t..(bi * h + hi + 1) * t];
                    // The first query head of the group writes dk/dv, the rest add to them.
                    head_backward((t, d, scale), &head, lse_row, ws, j > 0, bf16);
                    if writes[0] {
                        unstage_head(s_dq, (dq.get() as *mut u16).add(off), (cq, (0, 1)), d);
                    }
                }
            }
            // SAFETY: this item alone writes its kv head's columns of dk and dv.
            unsafe {
                if writes[1] {
                    unstage_head(s_dk, (dk.get() as *mut u16).add(kv_off), (ckv, (0, 1)), d);
                }
                if writes[2] {
                    unstage_head(s_dv, (dv.get() as *mut u16).add(kv_off), (ckv, (0, 1)), d);
                }
            }
        },
    );
}
