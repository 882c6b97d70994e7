//! Whole training steps: every parameter gradient of a tiny GPT and a tiny Llama step (f32)
//! against central differences of the loss on the same session, and, on a backend other than
//! the CPU, the loss and every gradient against the CPU backend's.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use snug_cpu::CpuBackend;
use snug_graph::{DType, Fusions, OptimizerSpec, StepGraph, Target};
use snug_nn::ModelConfig;
use snug_runtime::{ExecCtx, Session};

use crate::memory::{tiny_gpt, tiny_llama};
use crate::{CpuHarness, Harness};

/// Every parameter gradient of a whole GPT step (embeddings, attention, MLP, norms, tied head)
/// against central differences of the loss.
pub fn gpt_step_gradients_match_finite_differences<H: Harness>(harness: &H) {
    // seq < block exercises the position-embedding slice
    whole_model_gradients_match(harness, &tiny_gpt());
}

/// The same for a Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, untied
/// head), then for one with every projection biased, the head tied to the embedding and Llama
/// 3's rope scaling (a small original context, so all three frequency bands occur).
pub fn llama_step_gradients_match_finite_differences<H: Harness>(harness: &H) {
    let plain = tiny_llama();
    whole_model_gradients_match(harness, &plain);
    let ModelConfig::Llama(cfg) = plain else {
        unreachable!("tiny_llama is a Llama")
    };
    let variant = snug_nn::LlamaConfig {
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        tie_word_embeddings: true,
        rope_scaling: Some(snug_nn::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8,
        }),
        ..cfg
    };
    whole_model_gradients_match(harness, &ModelConfig::Llama(variant));
}

const BATCH: usize = 2;
const SEQ: usize = 5;
const VOCAB: usize = 11;

/// A step of `cfg` (no optimizer) loaded on the harness's backend with its parameters and a
/// batch written, or `None` (said why) where the backend cannot run it.
struct Loaded<B: snug_runtime::Backend> {
    step: StepGraph,
    session: Session<B>,
    values: Vec<Vec<f32>>,
}

impl<B: snug_runtime::Backend> Loaded<B> {
    fn new<H: Harness<B = B>>(harness: &H, cfg: &ModelConfig) -> Option<Self> {
        let g = cfg
            .build(BATCH, SEQ, harness.target(2), DType::F32)
            .unwrap();
        let (tokens, targets) = (g.tokens, g.targets);
        let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::None).unwrap();
        let mut session = crate::session(harness, step.graph.clone(), 2)?;

        // Larger-than-default weights make every gradient large enough to difference in f32.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let normal = Normal::new(0.0f32, 0.3).unwrap();
        let mut values = Vec::new();
        for slot in &step.params {
            let n = step.graph.tensor(slot.param).numel();
            let base = if slot.name.contains("ln_") && slot.name.ends_with("weight") {
                1.0
            } else {
                0.0
            };
            let v: Vec<f32> = (0..n).map(|_| base + normal.sample(&mut rng)).collect();
            session.write_f32(slot.param, &v).unwrap();
            values.push(v);
        }
        let ids: Vec<i32> = (0..BATCH * SEQ)
            .map(|i| ((i * 7 + 3) % VOCAB) as i32)
            .collect();
        let next: Vec<i32> = (0..BATCH * SEQ)
            .map(|i| ((i * 5 + 1) % VOCAB) as i32)
            .collect();
        session.write_i32(tokens, &ids, VOCAB).unwrap();
        session.write_i32(targets, &next, VOCAB).unwrap();
        Some(Loaded {
            step,
            session,
            values,
        })
    }

    /// Runs the step; returns its loss and every gradient, in the step's parameter order.
    fn loss_and_grads(&mut self) -> (f32, Vec<Vec<f32>>) {
        self.session.run(ExecCtx::default()).unwrap();
        let loss = self.session.read_f32(self.step.loss).unwrap()[0];
        let grads = self
            .step
            .params
            .iter()
            .map(|p| self.session.read_f32(p.grad).unwrap().to_vec())
            .collect();
        (loss, grads)
    }
}

/// The CPU with another target's fusions, so that it runs the graph other backends run.
struct CpuReference(Fusions);

impl Harness for CpuReference {
    type B = CpuBackend;

    fn name(&self) -> &str {
        "cpu (reference)"
    }

    fn target(&self, threads: usize) -> Target {
        CpuHarness.target(threads).with_fusions(self.0)
    }

    fn backend(&self, threads: usize) -> CpuBackend {
        CpuHarness.backend(threads)
    }

    fn is_cpu(&self) -> bool {
        true
    }
}

fn whole_model_gradients_match<H: Harness>(harness: &H, cfg: &ModelConfig) {
    let Some(mut m) = Loaded::new(harness, cfg) else {
        return;
    };
    let (loss, grads) = m.loss_and_grads();

    if !harness.is_cpu() {
        let fusions = harness.target(2).fusions;
        let mut cpu = Loaded::new(&CpuReference(fusions), cfg).expect("the CPU runs every op");
        let (want_loss, want_grads) = cpu.loss_and_grads();
        let name = harness.name();
        assert!(
            (loss - want_loss).abs() <= 1e-4 * want_loss.abs(),
            "{name}: loss {loss}, the CPU's {want_loss}"
        );
        for (k, slot) in m.step.params.iter().enumerate() {
            let (got, want) = (&grads[k], &want_grads[k]);
            // Relative to the tensor's largest gradient: single elements may be near zero.
            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let worst = snug_testkit::worst(got.iter().zip(want).map(|(a, b)| (a - b).abs()));
            assert!(
                worst <= 1e-4 * f64::from(scale),
                "{name}: gradient of {} differs from the CPU's by {worst} (largest {scale})",
                slot.name
            );
        }
    }

    let eps = 1e-2f32;
    let mut checked = 0;
    let Loaded {
        step,
        session: s,
        values,
    } = &mut m;
    for (k, slot) in step.params.iter().enumerate() {
        let n = values[k].len();
        // A spread of elements of every parameter, first and last included.
        for &i in &[0, n / 3, n / 2, n - 1] {
            let mut loss_at = |delta: f32| {
                let mut v = values[k].clone();
                v[i] += delta;
                s.write_f32(slot.param, &v).unwrap();
                s.run(ExecCtx::default()).unwrap();
                s.read_f32(step.loss).unwrap()[0] as f64
            };
            let (up, down) = (loss_at(eps), loss_at(-eps));
            s.write_f32(slot.param, &values[k]).unwrap();
            let numeric = (up - down) / (2.0 * eps as f64);
            let analytic = grads[k][i] as f64;
            // f32 loss of ~2.5 differenced over 2e-2: noise ~1e-5; curvature error ~eps².
            let tol = 5e-4 + 2e-2 * numeric.abs();
            assert!(
                (numeric - analytic).abs() <= tol,
                "{}[{i}]: analytic {analytic:.6}, numeric {numeric:.6}",
                slot.name
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * step.params.len());
}
