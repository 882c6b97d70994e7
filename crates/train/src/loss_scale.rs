//! Dynamic loss scaling for f16 training, as PyTorch's `GradScaler` does it: the loss is
//! multiplied by a scale so that small gradients survive f16's narrow range; a step whose
//! gradients overflow (a non-finite gradient norm) is skipped and the scale halved; after
//! `growth_interval` good steps in a row the scale doubles.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f32,
    pub growth_interval: u32,
    /// Good steps since the last change of scale.
    pub good_steps: u32,
    /// Steps skipped so far; the optimizer's own step count is the trainer's less these.
    pub skipped: u64,
}

/// The scale bounds: halving below 1 would amplify nothing, and doubling past 2^64 is
/// overflow whatever the model.
const MIN_SCALE: f32 = 1.0;
const MAX_SCALE: f32 = 1.8446744e19;

impl LossScaler {
    pub fn new(scale: f32, growth_interval: u32) -> Self {
        LossScaler {
            scale,
            growth_interval: growth_interval.max(1),
            good_steps: 0,
            skipped: 0,
        }
    }

    /// Records a finished step whose unscaled gradient norm was `grad_norm`; returns whether
    /// the update was skipped (the optimizers skip it themselves when the norm is not finite).
    pub fn update(&mut self, grad_norm: f32) -> bool {
        if grad_norm.is_finite() {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(MAX_SCALE);
                self.good_steps = 0;
            }
            false
        } else {
            self.scale = (self.scale * 0.5).max(MIN_SCALE);
            self.good_steps = 0;
            self.skipped += 1;
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_overflow_and_doubles_after_the_interval() {
        let mut s = LossScaler::new(1024.0, 3);
        assert!(!s.update(1.0));
        assert!(!s.update(2.0));
        assert_eq!(s.scale, 1024.0);
        assert!(!s.update(0.5));
        assert_eq!((s.scale, s.good_steps), (2048.0, 0));
        assert!(s.update(f32::INFINITY));
        assert!(s.update(f32::NAN));
        assert_eq!((s.scale, s.skipped), (512.0, 2));
        // An overflow resets the run of good steps.
        assert!(!s.update(1.0));
        assert!(!s.update(1.0));
        assert!(s.update(f32::INFINITY));
        assert!(!s.update(1.0));
        assert!(!s.update(1.0));
        assert_eq!(s.scale, 256.0);
        assert!(!s.update(1.0));
        assert_eq!(s.scale, 512.0);
    }
}
