//! AdamW (decoupled weight decay, as `torch.optim.AdamW`), updating a parameter and its two
//! moments in place.

use super::{expect_arity, shape_err, OpRule, OutSpec};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::{GraphError, Result};

/// Inputs `[param, grad, m, v]` and optionally a scalar `[scale]` the gradient is multiplied by
/// (clipping, micro-batch averaging); writes `param`, `m` and `v`. The learning rate and step
/// count come from the runtime each step, so one compiled graph serves a whole schedule. With
/// gradient accumulation it runs on the last micro-batch only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl OpRule for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        if inputs.len() != 5 {
            expect_arity(self.name(), inputs, 4)?;
        }
        super::check_grad_scale(self.name(), inputs, 4)?;
        let p = &inputs[0].shape;
        for (i, t) in inputs.iter().enumerate().take(4).skip(1) {
            if &t.shape != p {
                return Err(shape_err(
                    self.name(),
                    format!("input {i} has shape {:?}, parameter {p:?}", t.shape),
                ));
            }
        }
        for i in [0, 2, 3] {
            if !inputs[i].role.is_persistent() {
                return Err(GraphError::Invalid {
                    op: "adamw",
                    detail: format!(
                        "`{}` is updated in place and must be persistent",
                        inputs[i].name
                    ),
                });
            }
        }
        Ok(vec![])
    }

    fn backward(&self, _ctx: &mut GradCtx<'_>) -> Result<()> {
        Err(GraphError::Invalid {
            op: "adamw",
            detail: "an optimizer update has no gradient".into(),
        })
    }

    fn mutates_inputs(&self) -> &'static [usize] {
        &[0, 2, 3]
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        12 * inputs[0].numel() as u64
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        use rayon::prelude::*;
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
        let AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = *self;
        let (lr, t) = (k.ctx.lr, k.ctx.step.max(1) as i32);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let decay = 1.0 - lr * weight_decay;
        let chunk = super::par::MIN_PAR_ELEMS;
        p.par_chunks_mut(chunk)
            .zip(m.par_chunks_mut(chunk))
            .zip(v.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(c, ((p, m), v))| {
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
            });
    }
}
