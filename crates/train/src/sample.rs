//! Text generation: the model's forward-only graph (logits, no loss), planned like a training
//! step but holding no gradients or optimizer state, run once per new token.
//!
//! The graph has a fixed window of `max_seq` positions. The context sits left-aligned in it,
//! padded with token 0: attention is causal, so positions after the last real token cannot
//! change its logits, which are read there. Once the context outgrows the window, the window
//! holds its most recent `max_seq` tokens. There is no key/value cache: each token costs one
//! forward pass over the whole window.

use std::borrow::Cow;
use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_cpu::CpuSession;
use snug_graph::TensorId;
use snug_nn::{InferenceGraph, ModelConfig};
use snug_plan::{plan, MemoryPlan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

use crate::TrainError;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleOptions {
    /// Softmax temperature; 0 is greedy (argmax, the lowest id on ties). Finite, ≥ 0.
    pub temperature: f32,
    /// Sample among the `k` most likely tokens only (≥ 1; `k` ≥ vocabulary keeps all).
    pub top_k: Option<usize>,
    /// Seed of the ChaCha8 generator: the same seed, model and prompt give the same tokens.
    pub seed: u64,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            temperature: 1.0,
            top_k: None,
            seed: 0,
        }
    }
}

impl SampleOptions {
    pub fn validate(&self) -> Result<(), TrainError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(TrainError::Config {
                field: "temperature",
                detail: format!("must be a finite number ≥ 0, not {}", self.temperature),
            });
        }
        if self.top_k == Some(0) {
            return Err(TrainError::Config {
                field: "top_k",
                detail: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// The most tokens one call to [`Sampler::generate`] makes. Each costs a forward pass over the
/// window and four bytes of the result, so a larger request is a mistake, refused before any
/// work rather than a run that never ends or an allocation that cannot succeed.
pub const MAX_NEW_TOKENS: usize = 1_000_000;

/// The graph a [`Sampler`] for `model` runs (batch 1 over the model's whole window, f32, no
/// gradients or optimizer state) and its memory plan. `snug plan --inference` plans sampling
/// through this same function, so its prediction is the plan the sampler then holds.
pub fn plan_inference(
    model: &ModelConfig,
    threads: usize,
) -> Result<(InferenceGraph, MemoryPlan), TrainError> {
    let g = model.build_inference(1, model.max_seq(), threads.max(1))?;
    let memory_plan = plan(&g.graph, &PlanOptions::default())?;
    Ok((g, memory_plan))
}

/// A model loaded for generation: its planned inference graph in a [`CpuSession`].
pub struct Sampler {
    session: CpuSession,
    tokens: TensorId,
    logits: TensorId,
    vocab: usize,
    window: usize,
}

impl Sampler {
    /// Builds `model`'s inference graph (batch 1, `max_seq` positions), plans it, allocates it
    /// through `allocator` and writes `params` (every parameter by Hugging Face name, once).
    pub fn new(
        model: &ModelConfig,
        params: &[(String, Vec<f32>)],
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
        let threads = threads.max(1);
        let window = model.max_seq();
        // Planning allocates nothing, so the weights are still checked before any allocation.
        let (g, memory_plan) = plan_inference(model, threads)?;
        // Check the weights before allocating anything for them.
        let mut values: HashMap<&str, &[f32]> = HashMap::with_capacity(params.len());
        for (name, v) in params {
            if values.insert(name, v).is_some() {
                return Err(TrainError::Config {
                    field: "parameters",
                    detail: format!("`{name}` is given twice"),
                });
            }
        }
        let mut ordered = Vec::with_capacity(g.params.len());
        for (name, id) in &g.params {
            let v = values
                .remove(name.as_str())
                .ok_or_else(|| TrainError::Config {
                    field: "parameters",
                    detail: format!("no value for the model's parameter `{name}`"),
                })?;
            ordered.push((*id, v));
        }
        if let Some((name, _)) = params.iter().find(|(n, _)| values.contains_key(n.as_str())) {
            return Err(TrainError::Config {
                field: "parameters",
                detail: format!("`{name}` is not a parameter of this model"),
            });
        }
        let mut session = CpuSession::new(g.graph, memory_plan, allocator, threads)?;
        for (id, v) in ordered {
            // A wrong length is a typed error naming the tensor.
            session.write_f32(id, v)?;
        }
        Ok(Sampler {
            session,
            tokens: g.tokens,
            logits: g.logits,
            vocab: model.vocab_size(),
            window,
        })
    }

    /// [`Sampler::new`] for the weights of a Hugging Face model directory, decoded straight
    /// from its mapped files one parameter at a time (no copy of the whole model beside the
    /// session). `model` must have the checkpoint's parameters.
    pub fn from_hf(
        model: &ModelConfig,
        ckpt: &snug_nn::HfCheckpoint,
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
        let threads = threads.max(1);
        let (g, memory_plan) = plan_inference(model, threads)?;
        ckpt.check_model(model)?;
        let mut session = CpuSession::new(g.graph, memory_plan, allocator, threads)?;
        for (name, id) in &g.params {
            session.write_f32(*id, &ckpt.read(name)?)?;
        }
        Ok(Sampler {
            session,
            tokens: g.tokens,
            logits: g.logits,
            vocab: model.vocab_size(),
            window: model.max_seq(),
        })
    }

    /// The inference plan: its peak is what this sampler holds (weights plus the arena).
    pub fn plan(&self) -> &MemoryPlan {
        self.session.plan()
    }

    pub fn session(&self) -> &CpuSession {
        &self.session
    }

    /// Positions the model sees at once (its `max_seq`).
    pub fn window(&self) -> usize {
        self.window
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Logits of the token after `context` (of its last `window` tokens when longer).
    pub fn next_token_logits(&mut self, context: &[u32]) -> Result<Cow<'_, [f32]>, TrainError> {
        if context.is_empty() {
            return Err(TrainError::Config {
                field: "prompt",
                detail: "the context must hold at least one token".into(),
            });
        }
        self.check_ids(context)?;
        self.forward(context)
    }

    /// Generates up to `max_new_tokens` (at most [`MAX_NEW_TOKENS`]) tokens after `prompt` and
    /// returns them (without the prompt). An empty prompt starts from token 0, as if the prompt
    /// were `[0]`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        opts: SampleOptions,
    ) -> Result<Vec<u32>, TrainError> {
        opts.validate()?;
        if max_new_tokens > MAX_NEW_TOKENS {
            return Err(TrainError::Config {
                field: "tokens",
                detail: format!(
                    "{max_new_tokens} is more than the {MAX_NEW_TOKENS} tokens one call generates"
                ),
            });
        }
        self.check_ids(prompt)?;
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
        let mut context = if prompt.is_empty() {
            vec![0]
        } else {
            prompt.to_vec()
        };
        let start = context.len();
        // No reservation for the whole request: the context grows as tokens are made.
        let mut candidates = Vec::with_capacity(self.vocab);
        for _ in 0..max_new_tokens {
            let logits = self.forward(&context)?;
            context.push(choose(&logits, &opts, &mut rng, &mut candidates));
        }
        Ok(context.split_off(start))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), TrainError> {
        match ids.iter().position(|&t| t as usize >= self.vocab) {
            None => Ok(()),
            Some(i) => Err(TrainError::Config {
                field: "prompt",
                detail: format!(
                    "token id {} at position {i} is not below the vocabulary size {}",
                    ids[i], self.vocab
                ),
            }),
        }
    }

    /// Runs the window on the last `window` tokens of a non-empty, checked `context` and
    /// returns the logits at its last real position.
    fn forward(&mut self, context: &[u32]) -> Result<Cow<'_, [f32]>, TrainError> {
        let n = context.len().min(self.window);
        let recent = &context[context.len() - n..];
        self.session.fill_i32(self.tokens, self.vocab, |out| {
            for (o, &t) in out.iter_mut().zip(recent) {
                // Below the vocabulary size, which fits in i32 (checked by the model config).
                *o = t as i32;
            }
            out[n..].fill(0);
        })?;
        self.session.run(ExecCtx::default())?;
        let last = (n - 1) * self.vocab..n * self.vocab;
        let row = match self.session.read_f32(self.logits)? {
            Cow::Borrowed(all) => Cow::Borrowed(&all[last]),
            Cow::Owned(all) => Cow::Owned(all[last].to_vec()),
        };
        if row.iter().any(|v| !v.is_finite()) {
            return Err(TrainError::NonFiniteLogits { position: n - 1 });
        }
        Ok(row)
    }
}

/// Index of the largest logit (the first on ties).
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// Picks the next token from finite, non-empty `logits`.
fn choose(
    logits: &[f32],
    opts: &SampleOptions,
    rng: &mut ChaCha8Rng,
    candidates: &mut Vec<(usize, f64)>,
) -> u32 {
    if opts.temperature == 0.0 {
        return argmax(logits) as u32;
    }
    candidates.clear();
    candidates.extend(logits.iter().map(|&l| l as f64).enumerate());
    if let Some(k) = opts.top_k.filter(|&k| k < candidates.len()) {
        // A total order (logit, then id) keeps exactly k, the same k on every run.
        candidates.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        candidates.truncate(k);
    }
    let max = candidates
        .iter()
        .map(|c| c.1)
        .fold(f64::NEG_INFINITY, f64::max);
    // Subtracting the max before dividing keeps every exponent ≤ 0 even at tiny temperatures,
    // so weights never overflow and the largest is exactly 1.
    let t = f64::from(opts.temperature);
    let mut total = 0.0;
    for c in candidates.iter_mut() {
        c.1 = ((c.1 - max) / t).exp();
        total += c.1;
    }
    let mut u = rng.random::<f64>() * total;
    for &(i, w) in candidates.iter() {
        if u < w {
            return i as u32;
        }
        u -= w;
    }
    // Rounding can leave `u` just past the last weight.
    candidates
        .iter()
        .rev()
        .find(|c| c.1 > 0.0)
        .map_or(0, |c| c.0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use snug_graph::{OptimizerSpec, StepGraph};
    use snug_nn::{GptConfig, LlamaConfig, NnError};

    fn gpt() -> ModelConfig {
        ModelConfig::Gpt(GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            block_size: 16,
            vocab_size: 13,
        })
    }

    fn llama() -> ModelConfig {
        ModelConfig::Llama(LlamaConfig {
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            hidden: 32,
            intermediate: 48,
            vocab_size: 17,
            max_seq: 24,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            ..LlamaConfig::preset("llama-tiny").unwrap()
        })
    }

    /// Every value uniform in ±0.5 (gains and biases too): logits far from uniform, so greedy
    /// choices have clear margins and seeds visibly matter.
    fn random_params(model: &ModelConfig, seed: u64) -> Vec<(String, Vec<f32>)> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        model
            .init_parameters(0)
            .into_iter()
            .map(|(name, v)| {
                let v = v.iter().map(|_| rng.random_range(-0.5..0.5)).collect();
                (name, v)
            })
            .collect()
    }

    fn sampler(model: &ModelConfig, seed: u64) -> Sampler {
        Sampler::new(model, &random_params(model, seed), 1, Allocator::default()).unwrap()
    }

    fn greedy() -> SampleOptions {
        SampleOptions {
            temperature: 0.0,
            top_k: None,
            seed: 0,
        }
    }

    /// All logits `[window, vocab]` of one run on `tokens` (exactly `window` ids).
    fn window_logits(s: &mut Sampler, tokens: &[i32]) -> Vec<f32> {
        s.session
            .fill_i32(s.tokens, s.vocab, |out| out.copy_from_slice(tokens))
            .unwrap();
        s.session.run(ExecCtx::default()).unwrap();
        s.session.read_f32(s.logits).unwrap().to_vec()
    }

    fn random_ids(rng: &mut ChaCha8Rng, n: usize, vocab: usize) -> Vec<i32> {
        (0..n).map(|_| rng.random_range(0..vocab as i32)).collect()
    }

    #[test]
    fn logits_at_a_position_ignore_every_later_token() {
        for model in [gpt(), llama()] {
            let mut s = sampler(&model, 1);
            let (w, v) = (s.window(), s.vocab_size());
            let mut rng = ChaCha8Rng::seed_from_u64(2);
            for n in [1, 5, w - 1] {
                let mut a = random_ids(&mut rng, w, v);
                a[n..].fill(0);
                let mut b = a.clone();
                // Never 0, so the tail differs from the padding.
                for t in &mut b[n..] {
                    *t = rng.random_range(1..v as i32);
                }
                let la = window_logits(&mut s, &a);
                let lb = window_logits(&mut s, &b);
                // Bit-identical on the real positions, and the tail really differs.
                assert_eq!(la[..n * v], lb[..n * v], "{} n={n}", model.summary());
                assert_ne!(la[n * v..], lb[n * v..]);
            }
        }
    }

    /// Greedy tokens are the argmax of logits computed by a separate session on a different
    /// graph shape (batch 2, another sequence in the first row), within the window and after
    /// it slides.
    #[test]
    fn greedy_generation_is_the_argmax_of_an_independent_forward() {
        for model in [gpt(), llama()] {
            let params = random_params(&model, 3);
            let mut s = Sampler::new(&model, &params, 1, Allocator::default()).unwrap();
            let (w, v) = (s.window(), s.vocab_size());
            let prompt = [3u32, 1, 4];
            let new = s.generate(&prompt, 2 * w, greedy()).unwrap();
            assert_eq!(new.len(), 2 * w);
            let all: Vec<u32> = prompt.iter().chain(&new).copied().collect();

            let g = model.build_inference(2, w, 1).unwrap();
            let p = plan(&g.graph, &PlanOptions::default()).unwrap();
            let mut other = CpuSession::new(g.graph, p, Allocator::default(), 1).unwrap();
            for ((name, id), (pname, values)) in g.params.iter().zip(&params) {
                assert_eq!(name, pname);
                other.write_f32(*id, values).unwrap();
            }
            let mut rng = ChaCha8Rng::seed_from_u64(4);
            for (j, &token) in new.iter().enumerate() {
                let context = &all[..prompt.len() + j];
                let n = context.len().min(w);
                let mut row1: Vec<i32> = context[context.len() - n..]
                    .iter()
                    .map(|&t| t as i32)
                    .collect();
                row1.resize(w, 0);
                let mut ids = random_ids(&mut rng, w, v);
                ids.extend(&row1);
                other.write_i32(g.tokens, &ids, v).unwrap();
                other.run(ExecCtx::default()).unwrap();
                let logits = other.read_f32(g.logits).unwrap();
                let at = (w + n - 1) * v;
                assert_eq!(
                    argmax(&logits[at..at + v]) as u32,
                    token,
                    "{} token {j}",
                    model.summary()
                );
            }
        }
    }

    #[test]
    fn seeds_decide_samples_and_top_k_limits_them() {
        let model = gpt();
        let mut s = sampler(&model, 5);
        let prompt = [1u32, 2, 3];
        let opts = |seed, top_k| SampleOptions {
            temperature: 1.0,
            top_k,
            seed,
        };
        let a = s.generate(&prompt, 40, opts(7, None)).unwrap();
        assert_eq!(a, s.generate(&prompt, 40, opts(7, None)).unwrap());
        assert_ne!(a, s.generate(&prompt, 40, opts(8, None)).unwrap());
        assert!(a.iter().all(|&t| (t as usize) < s.vocab_size()));

        let greedy_tokens = s.generate(&prompt, 20, greedy()).unwrap();
        assert_eq!(
            s.generate(&prompt, 20, opts(9, Some(1))).unwrap(),
            greedy_tokens
        );
        let cold = SampleOptions {
            temperature: 1e-30,
            ..opts(9, None)
        };
        assert_eq!(s.generate(&prompt, 20, cold).unwrap(), greedy_tokens);

        // With top-3, every token is one of the three most likely after its context.
        let sampled = s.generate(&prompt, 30, opts(10, Some(3))).unwrap();
        let mut context = prompt.to_vec();
        let mut outside_top1 = 0;
        for &t in &sampled {
            let logits = s.next_token_logits(&context).unwrap();
            let above = logits.iter().filter(|&&l| l > logits[t as usize]).count();
            assert!(above < 3, "token {t} has {above} more likely tokens");
            outside_top1 += usize::from(above > 0);
            context.push(t);
        }
        assert!(outside_top1 > 0, "top-3 sampling never left the argmax");

        // An empty prompt starts from token 0.
        assert_eq!(
            s.generate(&[], 10, greedy()).unwrap(),
            s.generate(&[0], 10, greedy()).unwrap()
        );
        assert!(s.generate(&prompt, 0, greedy()).unwrap().is_empty());
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        let model = gpt();
        let mut s = sampler(&model, 6);
        let field = |r: Result<Vec<u32>, TrainError>| match r {
            Err(TrainError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        };
        for t in [-1.0, f32::NAN, f32::INFINITY] {
            let opts = SampleOptions {
                temperature: t,
                ..greedy()
            };
            assert_eq!(field(s.generate(&[1], 3, opts)), "temperature");
        }
        let opts = SampleOptions {
            top_k: Some(0),
            ..greedy()
        };
        assert_eq!(field(s.generate(&[1], 3, opts)), "top_k");
        for n in [MAX_NEW_TOKENS + 1, 1_000_000_000_000, usize::MAX] {
            assert_eq!(field(s.generate(&[1], n, greedy())), "tokens");
        }
        assert_eq!(field(s.generate(&[1, 13], 3, greedy())), "prompt");
        assert_eq!(field(s.generate(&[u32::MAX], 3, greedy())), "prompt");
        assert!(matches!(
            s.next_token_logits(&[]),
            Err(TrainError::Config {
                field: "prompt",
                ..
            })
        ));

        let params = random_params(&model, 6);
        let new = |p: &[(String, Vec<f32>)]| Sampler::new(&model, p, 1, Allocator::default());
        let mut missing = params.clone();
        missing.remove(3);
        assert!(matches!(
            new(&missing),
            Err(TrainError::Config {
                field: "parameters",
                ..
            })
        ));
        let mut extra = params.clone();
        extra.push(("lm_head.weight".into(), vec![0.0; 13 * 16]));
        assert!(matches!(
            new(&extra),
            Err(TrainError::Config {
                field: "parameters",
                ..
            })
        ));
        let mut twice = params.clone();
        twice.push(params[0].clone());
        assert!(matches!(
            new(&twice),
            Err(TrainError::Config {
                field: "parameters",
                ..
            })
        ));
        let mut short = params.clone();
        short[1].1.pop();
        assert!(matches!(
            new(&short),
            Err(TrainError::Runtime(
                snug_runtime::RuntimeError::SizeMismatch { .. }
            ))
        ));
        let mut bad_model = model.clone();
        bad_model.override_shape(None, Some(3), None, None);
        assert!(matches!(
            Sampler::new(&bad_model, &params, 1, Allocator::default()),
            Err(TrainError::Model(NnError::Config {
                field: "n_head",
                ..
            }))
        ));

        let mut nan = params.clone();
        nan[0].1.fill(f32::NAN);
        let mut s = new(&nan).unwrap();
        assert!(matches!(
            s.generate(&[1, 2], 1, greedy()),
            Err(TrainError::NonFiniteLogits { position: 1 })
        ));
    }

    /// The sampler holds exactly its plan: weights and an arena, no gradients or optimizer
    /// state, far below the training step's peak.
    #[test]
    fn holds_exactly_the_inference_plan() {
        let model = gpt();
        let allocator = Allocator::default();
        let mut s = Sampler::new(&model, &random_params(&model, 8), 1, allocator.clone()).unwrap();
        let before = allocator.allocation_count();
        s.generate(&[1, 2, 3], 20, SampleOptions::default())
            .unwrap();
        let p = s.plan();
        assert_eq!(allocator.peak_bytes(), p.peak_bytes());
        assert_eq!(allocator.active_bytes(), p.peak_bytes());
        assert_eq!(allocator.allocation_count(), before, "generation allocated");
        assert_eq!(p.breakdown().gradients, 0);
        assert_eq!(p.breakdown().optimizer_state, 0);
        assert_eq!(p.persistent_bytes, p.breakdown().parameters);

        let g = model
            .build(1, model.max_seq(), 1, snug_graph::DType::F32)
            .unwrap();
        let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::None).unwrap();
        let training = plan(&step.graph, &PlanOptions::default()).unwrap();
        assert!(
            p.peak_bytes() < training.peak_bytes(),
            "inference {} vs training {}",
            p.peak_bytes(),
            training.peak_bytes()
        );
    }
}
