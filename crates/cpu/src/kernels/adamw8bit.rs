//! The kernel of [`AdamW8bit`]: block by block, the moments are dequantized, updated with the
//! weight as AdamW updates them, and requantized with the block's new absmax.

use std::sync::OnceLock;

use snug_graph::ops::adamw8bit::{dynamic_code, CodeIndex, BLOCK};
use snug_graph::ops::{AdamW, AdamW8bit};

use crate::kernel::{CpuKernel, Kernel};

/// The signed (first moment) and unsigned (second moment) code books, and their indexes.
fn codes() -> &'static ([[f32; 256]; 2], [CodeIndex; 2]) {
    static CODES: OnceLock<([[f32; 256]; 2], [CodeIndex; 2])> = OnceLock::new();
    CODES.get_or_init(|| {
        let books = [dynamic_code(true), dynamic_code(false)];
        let index = [CodeIndex::new(&books[0]), CodeIndex::new(&books[1])];
        (books, index)
    })
}

impl CpuKernel for AdamW8bit {
    fn run(&self, k: &Kernel<'_>) {
        if !k.ctx.is_last_micro() {
            return;
        }
        let scale = super::grad_scale(k, 6);
        if scale.is_some_and(|s| !s.is_finite()) {
            return; // an overflow under loss scaling: the step is skipped
        }
        let state = State {
            m: k.in_mut_u8(2),
            v: k.in_mut_u8(3),
            m_absmax: k.in_mut_f32(4),
            v_absmax: k.in_mut_f32(5),
        };
        update(
            &self.adamw,
            &k.ctx,
            scale,
            k.in_mut_f32(0),
            k.in_f32(1),
            state,
        );
    }
}

/// 8-bit AdamW's state of one parameter: codes and per-block absmaxes of both moments.
pub(crate) struct State<'a> {
    m: &'a mut [u8],
    v: &'a mut [u8],
    m_absmax: &'a mut [f32],
    v_absmax: &'a mut [f32],
}

/// One 8-bit AdamW step over `p` and its quantized moments, with the gradient `g` times
/// `scale`: the f32 arithmetic of AdamW's kernel on the dequantized moments.
pub(crate) fn update(
    adamw: &AdamW,
    ctx: &snug_runtime::ExecCtx,
    scale: Option<f32>,
    p: &mut [f32],
    g: &[f32],
    s: State<'_>,
) {
    use rayon::prelude::*;
    let AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = *adamw;
    let (lr, t) = (ctx.lr, ctx.step.max(1) as i32);
    let step_size = lr / (1.0 - beta1.powi(t));
    let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt();
    let decay = 1.0 - lr * weight_decay;
    let ([signed, unsigned], [signed_index, unsigned_index]) = codes();
    // Whole blocks per task, enough of them to amortise the task.
    let per_task = (crate::par::MIN_PAR_ELEMS / BLOCK).max(1);
    let chunk = per_task * BLOCK;
    p.par_chunks_mut(chunk)
        .zip(s.m.par_chunks_mut(chunk))
        .zip(s.v.par_chunks_mut(chunk))
        .zip(s.m_absmax.par_chunks_mut(per_task))
        .zip(s.v_absmax.par_chunks_mut(per_task))
        .enumerate()
        .for_each(|(c, ((((p, mq), vq), ma), va))| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    let g = &g[c * chunk..c * chunk + p.len()];
                    let mut m = [0f32; BLOCK];
                    let mut v = [0f32; BLOCK];
                    for (b, p) in p.chunks_mut(BLOCK).enumerate() {
                        let n = p.len();
                        let range = b * BLOCK..b * BLOCK + n;
                        let (mq, vq, g) =
                            (&mut mq[range.clone()], &mut vq[range.clone()], &g[range]);
                        let (m, v) = (&mut m[..n], &mut v[..n]);
                        let (mut m_max, mut v_max) = (0f32, 0f32);
                        for i in 0..n {
                            let gi = match scale {
                                Some(s) => g[i] * s,
                                None => g[i],
                            };
                            let mi = beta1 * (signed[mq[i] as usize] * ma[b]) + (1.0 - beta1) * gi;
                            let vi = beta2 * (unsigned[vq[i] as usize] * va[b])
                                + (1.0 - beta2) * gi * gi;
                            let denom = vi.sqrt() / bc2_sqrt + eps;
                            p[i] = p[i] * decay - step_size * mi / denom;
                            m_max = m_max.max(mi.abs());
                            v_max = v_max.max(vi);
                            m[i] = mi;
                            v[i] = vi;
                        }
                        ma[b] = m_max;
                        va[b] = v_max;
                        let inv_m = if m_max > 0.0 { 1.0 / m_max } else { 0.0 };
                        let inv_v = if v_max > 0.0 { 1.0 / v_max } else { 0.0 };
                        for i in 0..n {
                            mq[i] = signed_index.nearest(m[i] * inv_m);
                            vq[i] = unsigned_index.nearest(v[i] * inv_v);
                        }
                    }
                },
            )
        });
}
