//! The kernel of [`AdamW`]: one pass over a parameter and its two moments, updated in place.

use snug_graph::ops::AdamW;

use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for AdamW {
    fn run(&self, k: &Kernel<'_>) {
        if !k.ctx.is_last_micro() {
            return;
        }
        let scale = super::grad_scale(k, 4);
        if scale.is_some_and(|s| !s.is_finite()) {
            return; // an overflow under loss scaling: the step is skipped
        }
        let (p, g, m, v) = (
            k.in_mut_f32(0),
            k.in_f32(1),
            k.in_mut_f32(2),
            k.in_mut_f32(3),
        );
        update(self, &k.ctx, scale, p, g, m, v);
    }
}

/// One AdamW step over `p` and its moments, with the gradient `g` times `scale`.
pub(super) fn update(
    adamw: &AdamW,
    ctx: &snug_runtime::ExecCtx,
    scale: Option<f32>,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    use rayon::prelude::*;
    let AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = *adamw;
    let (lr, t) = (ctx.lr, ctx.step.max(1) as i32);
    let bc1 = 1.0 - beta1.powi(t);
    let bc2 = 1.0 - beta2.powi(t);
    let step_size = lr / bc1;
    let bc2_sqrt = bc2.sqrt();
    let decay = 1.0 - lr * weight_decay;
    let chunk = crate::par::MIN_PAR_ELEMS;
    p.par_chunks_mut(chunk)
        .zip(m.par_chunks_mut(chunk))
        .zip(v.par_chunks_mut(chunk))
        .enumerate()
        .for_each(|(c, ((p, m), v))| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    let g = &g[c * chunk..c * chunk + p.len()];
                    for i in 0..p.len() {
                        let gi = match scale {
                            Some(s) => g[i] * s,
                            None => g[i],
                        };
                        m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
                        v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
                        let denom = v[i].sqrt() / bc2_sqrt + eps;
                        p[i] = p[i] * decay - step_size * m[i] / denom;
                    }
                },
            )
        });
}
