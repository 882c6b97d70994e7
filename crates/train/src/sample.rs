//! Text generation on planned forward-only graphs (logits, no loss), holding no gradients or
//! optimizer state.
//!
//! By default ([`SampleMode::KvCache`]) a prompt is run once through a *prefill* graph of its
//! length, which leaves every layer's keys and values in persistent caches of the model's
//! window, and each new token then costs one *decode* step: a graph of one token that attends
//! to the caches and appends its own keys and values. The session switches between the two
//! graphs ([`snug_runtime::Session::replan`]), keeping weights and caches in place and holding
//! one arena at a time: the running graph's plan is exactly what it holds.
//!
//! When the cache is full (the context reaches the window), the sampler slides: it re-prefills
//! the most recent half window (rounded up) and decodes on from there, so past the window each
//! token sees between half a window and a whole window of context, and a prefill is paid once
//! per half window of new tokens.
//!
//! [`SampleMode::FullWindow`] runs the whole window for every token instead (no cache): the
//! context sits left-aligned in a graph of `max_seq` positions, padded with token 0 (attention
//! is causal, so later positions cannot change the logits read at the last real one), and
//! past the window it holds the most recent `max_seq` tokens. It is the reference the cached
//! path is tested against, and what `snug plan --inference` plans without `--kv-cache`.

use std::borrow::Cow;
use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use snug_graph::ops::QuantizeBase;
use snug_graph::{Target, TensorId};
use snug_nn::{InferenceGraph, KvGraph, ModelConfig};
use snug_plan::{plan, MemoryPlan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

use crate::device::{DeviceSpec, StepSession};
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
    plan_inference_for(model, Target::host(threads.max(1)))
}

/// [`plan_inference`] for the device `target` describes (a GPU's: see [`DeviceSpec::target`]).
pub fn plan_inference_for(
    model: &ModelConfig,
    target: Target,
) -> Result<(InferenceGraph, MemoryPlan), TrainError> {
    plan_inference_on(model, model.max_seq(), target, None)
}

/// [`plan_inference`] with the 2-D weights stored as `quantize` says (`snug sample
/// --quantize`), each dequantized just before the op that reads it.
pub fn plan_inference_quantized(
    model: &ModelConfig,
    threads: usize,
    quantize: Option<QuantizeBase>,
) -> Result<(InferenceGraph, MemoryPlan), TrainError> {
    plan_inference_on(
        model,
        model.max_seq(),
        Target::host(threads.max(1)),
        quantize,
    )
}

/// [`plan_inference`] over `window` positions (at most the model's `max_seq`) for `target`,
/// with the 2-D weights stored as `quantize` says.
pub fn plan_inference_on(
    model: &ModelConfig,
    window: usize,
    target: Target,
    quantize: Option<QuantizeBase>,
) -> Result<(InferenceGraph, MemoryPlan), TrainError> {
    let mut g = model.build_inference(1, window, target)?;
    if let Some(base) = quantize {
        let (r, params) = quantize_params(&g.graph, &g.params, base)?;
        g = InferenceGraph {
            tokens: r.map(g.tokens)?,
            logits: r.map(g.logits)?,
            params,
            graph: r.graph,
        };
    }
    let memory_plan = plan(&g.graph, &PlanOptions::default())?;
    Ok((g, memory_plan))
}

/// `graph` with its 2-D weights among `params` stored as `base` says, and `params` mapped.
fn quantize_params(
    graph: &snug_graph::Graph,
    params: &[(String, TensorId)],
    base: QuantizeBase,
) -> Result<(snug_graph::passes::Rewritten, Vec<(String, TensorId)>), TrainError> {
    let ids: Vec<TensorId> = params.iter().map(|p| p.1).collect();
    let all = graph.nodes().len();
    let (r, _, _) = snug_graph::passes::quantize_weights(graph, &ids, base, all)?;
    let params = params
        .iter()
        .map(|(n, t)| Ok((n.clone(), r.map(*t)?)))
        .collect::<Result<Vec<_>, TrainError>>()?;
    Ok((r, params))
}

/// The key/value-cache graph of `new_tokens` tokens (a prefill of that length, or with 1 a
/// decode step) for `model` and its memory plan. `snug plan --inference --kv-cache` plans
/// through this same function.
pub fn plan_kv(
    model: &ModelConfig,
    new_tokens: usize,
    threads: usize,
) -> Result<(KvGraph, MemoryPlan), TrainError> {
    plan_kv_for(model, new_tokens, Target::host(threads.max(1)))
}

/// [`plan_kv`] for the device `target` describes (a GPU's: see [`DeviceSpec::target`]).
pub fn plan_kv_for(
    model: &ModelConfig,
    new_tokens: usize,
    target: Target,
) -> Result<(KvGraph, MemoryPlan), TrainError> {
    plan_kv_on(model, new_tokens, model.max_seq(), target, None)
}

/// [`plan_kv`] with the 2-D weights stored as `quantize` says.
pub fn plan_kv_quantized(
    model: &ModelConfig,
    new_tokens: usize,
    threads: usize,
    quantize: Option<QuantizeBase>,
) -> Result<(KvGraph, MemoryPlan), TrainError> {
    plan_kv_on(
        model,
        new_tokens,
        model.max_seq(),
        Target::host(threads.max(1)),
        quantize,
    )
}

/// [`plan_kv`] with caches of `window` positions (at most the model's `max_seq`) for
/// `target`, with the 2-D weights stored as `quantize` says.
pub fn plan_kv_on(
    model: &ModelConfig,
    new_tokens: usize,
    window: usize,
    target: Target,
    quantize: Option<QuantizeBase>,
) -> Result<(KvGraph, MemoryPlan), TrainError> {
    let mut g = model.build_kv_window(new_tokens, window, target)?;
    if let Some(base) = quantize {
        let (r, params) = quantize_params(&g.graph, &g.params, base)?;
        g = KvGraph {
            tokens: r.map(g.tokens)?,
            pos: r.map(g.pos)?,
            positions: g.positions.map(|p| r.map(p)).transpose()?,
            logits: r.map(g.logits)?,
            caches: g
                .caches
                .iter()
                .map(|&c| r.map(c))
                .collect::<Result<Vec<_>, _>>()?,
            params,
            graph: r.graph,
        };
    }
    let memory_plan = plan(&g.graph, &PlanOptions::default())?;
    Ok((g, memory_plan))
}

/// The most a [`Sampler`] loaded with `mode` and `placement` holds while it continues a prompt
/// of `prompt` tokens to `total` tokens: its largest plan's peak (in key/value mode the largest
/// of the decode step's, the prompt's prefill and, when `total` passes the window, the half
/// window each slide prefills). A caller checks this against the machine before loading.
pub fn planned_peak(
    model: &ModelConfig,
    mode: SampleMode,
    placement: Placement,
    threads: usize,
    (prompt, total): (usize, usize),
) -> Result<usize, TrainError> {
    let target = placement.device.target(threads.max(1))?;
    let window = placement.context.unwrap_or(model.max_seq());
    let quantize = placement.quantize;
    if mode == SampleMode::FullWindow {
        return Ok(plan_inference_on(model, window, target, quantize)?
            .1
            .peak_bytes());
    }
    let mut lengths = vec![1, prompt.clamp(1, window)];
    if total > window {
        lengths.push(window.div_ceil(2));
    }
    lengths.dedup();
    let mut peak = 0;
    for n in lengths {
        peak = peak.max(
            plan_kv_on(model, n, window, target, quantize)?
                .1
                .peak_bytes(),
        );
    }
    Ok(peak)
}

/// How a [`Sampler`] runs the model for each new token (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleMode {
    /// Prefill once, then one decode step per token against the key/value caches.
    #[default]
    KvCache,
    /// The whole window for every token.
    FullWindow,
}

/// One kind of run's largest plan and the allocator's largest peak while it ran: equal when
/// the sampler holds exactly its plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PhaseMemory {
    pub runs: usize,
    pub planned_peak_bytes: usize,
    pub measured_peak_bytes: usize,
}

impl PhaseMemory {
    fn record(&mut self, planned: usize, measured: usize) {
        self.runs += 1;
        self.planned_peak_bytes = self.planned_peak_bytes.max(planned);
        self.measured_peak_bytes = self.measured_peak_bytes.max(measured);
    }
}

/// What a key/value-cache sampler ran, and its memory by phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KvStats {
    pub prefill: PhaseMemory,
    pub decode: PhaseMemory,
    /// Prefills that slid a full cache (re-prefilling its most recent half).
    pub slides: usize,
}

/// A conversation rendered by a chat template for the model to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    /// The template's text, generation prompt included.
    pub text: String,
    pub ids: Vec<u32>,
    /// Tokens that end the model's turn: the tokenizer's `eos_token` and whichever of the
    /// common end-of-turn tokens ([`END_OF_TURN`]) its vocabulary has as one token.
    pub stop: Vec<u32>,
}

/// End-of-turn tokens of common chat templates (ChatML's, Llama 3's, Phi's, Gemma's), which a
/// model may end its turn with when its `eos_token` is another.
pub const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// Renders `messages` (objects with a `role` and a `content`) through the tokenizer's chat
/// template with the generation prompt, as transformers' `apply_chat_template(...,
/// add_generation_prompt=True)` does, and encodes it without adding special tokens.
pub fn chat_prompt(
    tokenizer: &crate::Tokenizer,
    messages: &[serde_json::Value],
) -> Result<ChatPrompt, TrainError> {
    let t = match tokenizer {
        crate::Tokenizer::Hf(t) if t.has_chat_template() => t,
        crate::Tokenizer::Hf(_) => {
            return Err(TrainError::NoChatTemplate {
                tokenizer: "this Hugging Face tokenizer (tokenizer_config.json has no \
                            `chat_template`)"
                    .into(),
            })
        }
        other => {
            return Err(TrainError::NoChatTemplate {
                tokenizer: format!("the {} tokenizer", other.name()),
            })
        }
    };
    let text = t.render_chat(messages, true)?;
    let ids = t.encode(&text, false)?;
    let stop = stop_ids(tokenizer, &[], true);
    Ok(ChatPrompt { text, ids, stop })
}

/// Where a [`Sampler`] runs, how its weights are stored and how much context it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub device: DeviceSpec,
    /// The 2-D weights quantized once as they are written, each dequantized just before the
    /// op that reads it (None: f32).
    pub quantize: Option<QuantizeBase>,
    /// Positions the sampler's graphs span, the key/value caches' length (1 to the model's
    /// `max_seq`; None: all of them). A Llama's 131,072 positions are gigabytes of caches
    /// that a short request never reads.
    pub context: Option<usize>,
}

impl Placement {
    /// The CPU, weights in f32, the model's whole window.
    pub const CPU: Placement = Placement {
        device: DeviceSpec::Cpu,
        quantize: None,
        context: None,
    };
}

/// A model loaded for generation: its planned inference graph(s) in a session on the CPU or
/// a GPU ([`StepSession`]).
pub struct Sampler {
    session: StepSession,
    vocab: usize,
    window: usize,
    engine: Engine,
}

enum Engine {
    Full { tokens: TensorId, logits: TensorId },
    Kv(Box<KvEngine>),
}

/// The key/value-cache path's graphs and what its caches hold.
struct KvEngine {
    model: ModelConfig,
    /// The device the graphs are built and planned for.
    target: Target,
    /// How the 2-D weights are stored (None: f32).
    quantize: Option<QuantizeBase>,
    /// The caches' length in positions.
    window: usize,
    decode: (KvGraph, MemoryPlan),
    /// The last prefill built (rebuilt when the prompt's length changes).
    prefill: Option<(KvGraph, MemoryPlan)>,
    /// Which graph the session holds: `None` the decode step's, `Some(n)` a prefill of `n`.
    holds: Option<usize>,
    /// The tokens whose keys and values fill the caches' first rows, position 0 onwards.
    cached: Vec<u32>,
    stats: KvStats,
}

impl Sampler {
    /// Loads `model` for sampling with a key/value cache ([`SampleMode::KvCache`]), writing
    /// `params` (every parameter by Hugging Face name, once).
    pub fn new(
        model: &ModelConfig,
        params: &[(String, Vec<f32>)],
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
        Self::with_mode(model, params, SampleMode::KvCache, threads, allocator)
    }

    /// [`Sampler::new`] in either mode.
    pub fn with_mode(
        model: &ModelConfig,
        params: &[(String, Vec<f32>)],
        mode: SampleMode,
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
        Self::placed(model, params, mode, Placement::CPU, threads, allocator)
    }

    /// [`Sampler::with_mode`] on the device and with the weights' storage `placement` names:
    /// a GPU runs the same graphs (built and planned for its target) with its own allocator
    /// over device memory, which takes `allocator`'s memory limit; `threads` is the CPU's.
    pub fn placed(
        model: &ModelConfig,
        params: &[(String, Vec<f32>)],
        mode: SampleMode,
        placement: Placement,
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
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
        // Before planning: a config that disagrees with its weights (a checkpoint's
        // `block_size` against its `wpe`) would otherwise size the session by the config.
        model.validate()?;
        for (name, shape) in model.parameter_shapes() {
            let Some(v) = values.get(name.as_str()) else {
                continue;
            };
            let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            if n != Some(v.len()) {
                return Err(TrainError::Config {
                    field: "parameters",
                    detail: format!(
                        "`{name}` has {} values, but the model's config gives it shape {shape:?}: \
                         the config does not match the weights",
                        v.len()
                    ),
                });
            }
        }
        let (sampler, _) = Self::load(
            model,
            (mode, placement),
            threads,
            allocator,
            |graph_params| {
                let mut ordered = Vec::with_capacity(graph_params.len());
                for (name, id) in graph_params {
                    let v = values
                        .remove(name.as_str())
                        .ok_or_else(|| TrainError::Config {
                            field: "parameters",
                            detail: format!("no value for the model's parameter `{name}`"),
                        })?;
                    ordered.push((*id, v));
                }
                if let Some((name, _)) =
                    params.iter().find(|(n, _)| values.contains_key(n.as_str()))
                {
                    return Err(TrainError::Config {
                        field: "parameters",
                        detail: format!("`{name}` is not a parameter of this model"),
                    });
                }
                Ok(ordered)
            },
        )?;
        Ok(sampler)
    }

    /// [`Sampler::with_mode`] for the weights of a Hugging Face model directory, decoded
    /// straight from its mapped files one parameter at a time (no copy of the whole model
    /// beside the session). `model` must have the checkpoint's parameters.
    pub fn from_hf(
        model: &ModelConfig,
        ckpt: &snug_nn::HfCheckpoint,
        mode: SampleMode,
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
        Self::from_hf_placed(model, ckpt, mode, Placement::CPU, threads, allocator)
    }

    /// [`Sampler::from_hf`] on the device and with the weights' storage `placement` names.
    pub fn from_hf_placed(
        model: &ModelConfig,
        ckpt: &snug_nn::HfCheckpoint,
        mode: SampleMode,
        placement: Placement,
        threads: usize,
        allocator: Allocator,
    ) -> Result<Sampler, TrainError> {
        ckpt.check_model(model)?;
        // A LoRA run exported without merging is its base model with a PEFT adapter beside it
        // (`snug export`): the adapter is folded into each weight as it is read. Read first,
        // so a damaged adapter is refused before anything is allocated.
        let mut folds = if snug_nn::lora::is_adapter_dir(ckpt.dir()) {
            let adapter = snug_nn::lora::load_peft_adapter(ckpt.dir(), model)?;
            Some(snug_nn::lora::AdapterFolds::new(model, adapter)?)
        } else {
            None
        };
        let quantize = placement.quantize;
        let (mut sampler, params) =
            Self::load(model, (mode, placement), threads, allocator, |_| {
                Ok(Vec::new())
            })?;
        for (name, id) in params {
            let mut v = ckpt.read(&name)?;
            if let Some(f) = folds.as_mut() {
                f.fold(&name, &mut v)?;
            }
            crate::quantized::write_param(&mut sampler.session, quantize, id, &v)?;
        }
        if let Some(f) = folds {
            f.finish()?;
        }
        Ok(sampler)
    }

    /// Plans `model` for `mode`, has `order` check the weights against the graph's parameters
    /// (returning them in its order) before allocating, then makes the session and writes
    /// them. Returns the sampler and the parameters' ids in the graph it holds.
    fn load<'v>(
        model: &ModelConfig,
        (mode, placement): (SampleMode, Placement),
        threads: usize,
        allocator: Allocator,
        order: impl FnOnce(&[(String, TensorId)]) -> Result<Vec<(TensorId, &'v [f32])>, TrainError>,
    ) -> Result<(Sampler, Vec<(String, TensorId)>), TrainError> {
        let threads = threads.max(1);
        let Placement {
            device,
            quantize,
            context,
        } = placement;
        let target = device.target(threads)?;
        let window = context.unwrap_or(model.max_seq());
        // Planning allocates nothing, so the weights are still checked before any allocation.
        let (graph, memory_plan, params, engine) = match mode {
            SampleMode::FullWindow => {
                let (g, p) = plan_inference_on(model, window, target, quantize)?;
                let engine = Engine::Full {
                    tokens: g.tokens,
                    logits: g.logits,
                };
                (g.graph, p, g.params, engine)
            }
            SampleMode::KvCache => {
                // The session starts on the decode step's graph: the smaller arena.
                let (g, p) = plan_kv_on(model, 1, window, target, quantize)?;
                let (graph, params) = (g.graph.clone(), g.params.clone());
                let engine = Engine::Kv(Box::new(KvEngine {
                    model: model.clone(),
                    target,
                    quantize,
                    window,
                    decode: (g, p.clone()),
                    prefill: None,
                    holds: None,
                    cached: Vec::new(),
                    stats: KvStats::default(),
                }));
                (graph, p, params, engine)
            }
        };
        let ordered = order(&params)?;
        let mut session = StepSession::new(device, graph, memory_plan, allocator, threads)?;
        for (id, v) in ordered {
            // A wrong length is a typed error naming the tensor.
            crate::quantized::write_param(&mut session, quantize, id, v)?;
        }
        let sampler = Sampler {
            session,
            vocab: model.vocab_size(),
            window,
            engine,
        };
        Ok((sampler, params))
    }

    /// The plan of the graph the session holds now: its peak is what this sampler holds
    /// (weights, caches and that graph's arena).
    pub fn plan(&self) -> &MemoryPlan {
        self.session.plan()
    }

    pub fn mode(&self) -> SampleMode {
        match self.engine {
            Engine::Full { .. } => SampleMode::FullWindow,
            Engine::Kv(_) => SampleMode::KvCache,
        }
    }

    /// The key/value-cache path's runs and memory by phase (`None` in full-window mode).
    pub fn kv_stats(&self) -> Option<KvStats> {
        match &self.engine {
            Engine::Full { .. } => None,
            Engine::Kv(kv) => Some(kv.stats),
        }
    }

    /// How many of the context's most recent tokens the next token is computed from, when the
    /// sampler has just produced the logits after `context` (the caches' length in key/value
    /// mode; the window, or less, in full-window mode).
    pub fn context_used(&self, context_len: usize) -> usize {
        match &self.engine {
            Engine::Full { .. } => context_len.min(self.window),
            Engine::Kv(kv) => kv.cached.len(),
        }
    }

    /// The session, on the device the sampler was loaded on.
    pub fn session(&self) -> &StepSession {
        &self.session
    }

    /// Positions the model sees at once (its `max_seq`, or the context asked for).
    pub fn window(&self) -> usize {
        self.window
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Logits of the token after `context`: of its last `window` tokens when longer in
    /// full-window mode; in key/value-cache mode of the whole context while it fits the window,
    /// and past it of the most recent tokens the sliding cache holds (half a window to a
    /// window). A context that extends the previous call's by one token costs one decode step;
    /// any other, a prefill.
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
        self.generate_until(prompt, max_new_tokens, opts, &[])
    }

    /// [`Sampler::generate`], stopping after the first token of `stop` it makes (which ends
    /// the result): a chat model's end of turn.
    pub fn generate_until(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        opts: SampleOptions,
        stop: &[u32],
    ) -> Result<Vec<u32>, TrainError> {
        self.generate_with(prompt, max_new_tokens, opts, None, stop)
    }

    /// [`Sampler::generate_until`] with nucleus sampling: at a temperature above 0, after
    /// `opts.top_k`, only the most likely tokens whose probabilities together first reach
    /// `top_p` (in (0, 1], see [`check_top_p`]) are drawn from, as transformers'
    /// `TopPLogitsWarper` keeps them. `None` or 1 keeps every token, drawing exactly as
    /// [`Sampler::generate_until`] does.
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        opts: SampleOptions,
        top_p: Option<f32>,
        stop: &[u32],
    ) -> Result<Vec<u32>, TrainError> {
        opts.validate()?;
        check_top_p(top_p)?;
        let top_p = top_p.filter(|&p| p < 1.0).map(f64::from);
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
            let next = choose(&logits, &opts, top_p, &mut rng, &mut candidates);
            context.push(next);
            if stop.contains(&next) {
                break;
            }
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

    /// The logits after a non-empty, checked `context`, by the sampler's mode.
    fn forward(&mut self, context: &[u32]) -> Result<Cow<'_, [f32]>, TrainError> {
        let (logits, position) = match &mut self.engine {
            Engine::Full { tokens, logits } => {
                let (tokens, logits) = (*tokens, *logits);
                let n = context.len().min(self.window);
                full_window(
                    &mut self.session,
                    tokens,
                    self.vocab,
                    &context[context.len() - n..],
                )?;
                let last = (n - 1) * self.vocab..n * self.vocab;
                let row = match self.session.read_f32(logits)? {
                    Cow::Borrowed(all) => Cow::Borrowed(&all[last]),
                    Cow::Owned(all) => Cow::Owned(all[last].to_vec()),
                };
                (row, n - 1)
            }
            Engine::Kv(kv) => {
                let logits = kv.next(&mut self.session, self.vocab, self.window, context)?;
                let position = kv.cached.len() - 1;
                (self.session.read_f32(logits)?, position)
            }
        };
        if logits.iter().any(|v| !v.is_finite()) {
            return Err(TrainError::NonFiniteLogits { position });
        }
        Ok(logits)
    }
}

/// Runs the full-window graph on `recent` (at most the window), padded with token 0.
fn full_window(
    session: &mut StepSession,
    tokens: TensorId,
    vocab: usize,
    recent: &[u32],
) -> Result<(), TrainError> {
    let n = recent.len();
    session.fill_i32(tokens, vocab, |out| {
        for (o, &t) in out.iter_mut().zip(recent) {
            // Below the vocabulary size, which fits in i32 (checked by the model config).
            *o = t as i32;
        }
        out[n..].fill(0);
    })?;
    session.run(ExecCtx::default())?;
    Ok(())
}

impl KvEngine {
    /// Runs whichever graph gives the logits after `context` (a decode step when `context`
    /// extends the cached tokens by one and the cache has room, a prefill otherwise) and
    /// returns the logits' tensor.
    fn next(
        &mut self,
        session: &mut StepSession,
        vocab: usize,
        window: usize,
        context: &[u32],
    ) -> Result<TensorId, TrainError> {
        let n = context.len();
        let m = self.cached.len();
        let continues = m > 0 && m < n && context[n - 1 - m..n - 1] == self.cached[..];
        if continues && m < window {
            let new = context[n - 1];
            self.hold(session, None)?;
            let g = &self.decode.0;
            let (tokens, pos, positions, logits) = (g.tokens, g.pos, g.positions, g.logits);
            write_step(session, (tokens, pos, positions), vocab, window, m, &[new])?;
            self.cached.push(new);
            self.run(session, false)?;
            return Ok(logits);
        }
        // A full cache slides to its most recent half; anything else starts over from the
        // context's last window.
        let keep = if continues {
            self.stats.slides += 1;
            window.div_ceil(2)
        } else {
            n.min(window)
        };
        let recent = &context[n - keep..];
        // Forgotten first: should the prefill fail, nothing claims the caches hold a context.
        self.cached.clear();
        self.hold(session, Some(keep))?;
        let Some((g, _)) = &self.prefill else {
            unreachable!("`hold` built the prefill")
        };
        let (tokens, pos, positions, logits) = (g.tokens, g.pos, g.positions, g.logits);
        write_step(session, (tokens, pos, positions), vocab, window, 0, recent)?;
        self.cached.extend_from_slice(recent);
        self.run(session, true)?;
        Ok(logits)
    }

    /// Switches the session to the decode graph (`None`) or a prefill of `n` tokens, giving
    /// the other graph's arena back to the system so the session holds exactly this plan.
    fn hold(
        &mut self,
        session: &mut StepSession,
        prefill: Option<usize>,
    ) -> Result<(), TrainError> {
        if self.holds == prefill {
            return Ok(());
        }
        let (graph, memory_plan) = match prefill {
            None => (self.decode.0.graph.clone(), self.decode.1.clone()),
            Some(n) => {
                let built = self
                    .prefill
                    .as_ref()
                    .map(|(g, _)| g.graph.tensor(g.tokens).shape[1]);
                if built != Some(n) {
                    self.prefill = Some(plan_kv_on(
                        &self.model,
                        n,
                        self.window,
                        self.target,
                        self.quantize,
                    )?);
                }
                let Some((g, p)) = &self.prefill else {
                    unreachable!("built above")
                };
                (g.graph.clone(), p.clone())
            }
        };
        // On failure the session keeps the graph it held.
        session.replan(graph, memory_plan)?;
        session.allocator().clear_cache();
        self.holds = prefill;
        Ok(())
    }

    /// Runs the held graph, recording its plan and the allocator's peak.
    fn run(&mut self, session: &mut StepSession, prefill: bool) -> Result<(), TrainError> {
        session.allocator().reset_peak();
        session.run(ExecCtx::default())?;
        let (planned, measured) = (
            session.plan().peak_bytes(),
            session.allocator().peak_bytes(),
        );
        let phase = if prefill {
            &mut self.stats.prefill
        } else {
            &mut self.stats.decode
        };
        phase.record(planned, measured);
        Ok(())
    }
}

/// Writes a key/value-cache graph's inputs: `new` tokens at positions `pos ..`.
fn write_step(
    session: &mut StepSession,
    (tokens, pos_id, positions): (TensorId, TensorId, Option<TensorId>),
    vocab: usize,
    window: usize,
    pos: usize,
    new: &[u32],
) -> Result<(), TrainError> {
    // Token ids are below the vocabulary size and positions below the window, both of which
    // fit in i32 (checked by the model config).
    let ids: Vec<i32> = new.iter().map(|&t| t as i32).collect();
    session.write_i32(tokens, &ids, vocab)?;
    // The runtime checks the new rows fit the caches: `pos + T ≤ window`.
    session.write_i32(pos_id, &[pos as i32], window - new.len() + 1)?;
    if let Some(p) = positions {
        let at: Vec<i32> = (pos..pos + new.len()).map(|p| p as i32).collect();
        session.write_i32(p, &at, window)?;
    }
    Ok(())
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

/// Picks the next token from finite, non-empty `logits`; `top_p` (below 1) keeps the nucleus.
fn choose(
    logits: &[f32],
    opts: &SampleOptions,
    top_p: Option<f64>,
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
    if let Some(p) = top_p {
        total = keep_nucleus(candidates, total, p);
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

/// Keeps the nucleus of `candidates` (unnormalized weights summing to `total`): in order of
/// weight (then id), each token while the weights before it sum to less than `p` of the whole,
/// which is what transformers' `TopPLogitsWarper` keeps (it drops the least likely tokens whose
/// probabilities sum to at most 1 - `p`), and always the most likely one. Returns the kept
/// weights' sum.
fn keep_nucleus(candidates: &mut Vec<(usize, f64)>, total: f64, p: f64) -> f64 {
    candidates.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let limit = p * total;
    let mut before = 0.0;
    let mut keep = 0;
    for c in candidates.iter() {
        if keep > 0 && before >= limit {
            break;
        }
        before += c.1;
        keep += 1;
    }
    candidates.truncate(keep);
    before
}

/// `top_p` for nucleus sampling: in (0, 1] (1 keeps every token), else a [`TrainError::Config`]
/// naming `top_p`.
pub fn check_top_p(top_p: Option<f32>) -> Result<(), TrainError> {
    match top_p {
        Some(p) if !(p > 0.0 && p <= 1.0) => Err(TrainError::Config {
            field: "top_p",
            detail: format!("must be a probability in (0, 1] (1 keeps every token), not {p}"),
        }),
        _ => Ok(()),
    }
}

/// transformers' generation settings, beside a model's `config.json`.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The most of a `generation_config.json` or `config.json` read into memory.
const MAX_MODEL_JSON_BYTES: u64 = 16 << 20;

/// What a Hugging Face model directory says about generating: `generation_config.json`'s
/// sampling settings, and the end- and beginning-of-sequence ids it names (or `config.json`
/// names, where it names none), as transformers' `generate` reads them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// The `generation_config.json` read (None: the model has none, and only `config.json`'s
    /// ids are known).
    pub file: Option<std::path::PathBuf>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    /// transformers' `top_k`: 0 keeps every token.
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// `eos_token_id`, one id or a list (Llama 3's `<|end_of_text|>`, `<|eom_id|>`,
    /// `<|eot_id|>`), in the file's order.
    pub eos: Vec<u32>,
    pub bos: Option<u32>,
}

/// The sampling flags a user gave (None: not given).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingFlags {
    pub temperature: Option<f32>,
    /// 0: every token, as in transformers.
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
}

/// How tokens are drawn once flags and a model's `generation_config.json` are combined.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Only while sampling (above temperature 0).
    pub top_k: Option<usize>,
    /// Only while sampling, and below 1.
    pub top_p: Option<f32>,
    /// Whether a default came from `generation_config.json` (a flag not given).
    pub from_generation_config: bool,
}

impl GenerationConfig {
    /// transformers' defaults for what a `generation_config.json` leaves unset
    /// (`GenerationConfig._get_default_generation_params`).
    pub const HF_TEMPERATURE: f32 = 1.0;
    pub const HF_TOP_K: usize = 50;

    /// `dir`'s `generation_config.json` where it has one, and `config.json`'s
    /// `eos_token_id` and `bos_token_id` where the former names none. A file that cannot be
    /// read or holds a setting of the wrong type is an error naming it and the key.
    pub fn read(dir: &std::path::Path) -> Result<GenerationConfig, TrainError> {
        let read = |name: &str| -> Result<Option<(std::path::PathBuf, String)>, TrainError> {
            let path = dir.join(name);
            match std::fs::metadata(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                _ => {
                    let text = crate::user_file::read_text(
                        &path,
                        MAX_MODEL_JSON_BYTES,
                        "a model's settings",
                    )?;
                    Ok(Some((path, text)))
                }
            }
        };
        let generation = read(GENERATION_CONFIG_FILE)?;
        let config = read("config.json")?;
        GenerationConfig::parse(
            generation.as_ref().map(|(p, t)| (p.as_path(), t.as_str())),
            config.as_ref().map(|(p, t)| (p.as_path(), t.as_str())),
        )
    }

    /// [`GenerationConfig::read`] of texts already read: `generation` a
    /// `generation_config.json`, `config` a `config.json` (each with its path, for errors).
    pub fn parse(
        generation: Option<(&std::path::Path, &str)>,
        config: Option<(&std::path::Path, &str)>,
    ) -> Result<GenerationConfig, TrainError> {
        fn object<'a>(
            (path, text): (&'a std::path::Path, &str),
        ) -> Result<
            (
                &'a std::path::Path,
                serde_json::Map<String, serde_json::Value>,
            ),
            TrainError,
        > {
            match serde_json::from_str::<serde_json::Value>(text) {
                Ok(serde_json::Value::Object(o)) => Ok((path, o)),
                Ok(_) => Err(TrainError::ConfigFile {
                    path: path.to_path_buf(),
                    message: "is not a JSON object".into(),
                }),
                Err(e) => Err(TrainError::ConfigFile {
                    path: path.to_path_buf(),
                    message: format!("is not JSON: {e}"),
                }),
            }
        }
        let generation = generation.map(object).transpose()?;
        let config = config.map(object).transpose()?;
        let mut out = GenerationConfig::default();
        if let Some((path, g)) = &generation {
            out.file = Some(path.to_path_buf());
            out.do_sample = setting(path, g, "do_sample", |v| v.as_bool(), "true or false")?;
            out.temperature = setting(
                path,
                g,
                "temperature",
                |v| {
                    v.as_f64()
                        .map(|t| t as f32)
                        .filter(|t| t.is_finite() && *t >= 0.0)
                },
                "a finite number ≥ 0",
            )?;
            out.top_k = setting(
                path,
                g,
                "top_k",
                |v| v.as_u64().and_then(|k| usize::try_from(k).ok()),
                "a whole number ≥ 0",
            )?;
            out.top_p = setting(
                path,
                g,
                "top_p",
                |v| {
                    v.as_f64()
                        .map(|p| p as f32)
                        .filter(|p| *p > 0.0 && *p <= 1.0)
                },
                "a probability in (0, 1]",
            )?;
        }
        // Key by key: generation_config.json's where it names one, else config.json's.
        for (key, ids) in [("eos_token_id", true), ("bos_token_id", false)] {
            let mut found = None;
            for (path, o) in generation.iter().chain(&config) {
                if let Some(v) = token_ids(path, o, key)? {
                    found = Some(v);
                    break;
                }
            }
            let found = found.unwrap_or_default();
            if ids {
                out.eos = found;
            } else {
                out.bos = found.first().copied();
            }
        }
        Ok(out)
    }

    /// The sampling `flags` give, each unset one from this `generation_config.json` as
    /// transformers' `generate` would read it (`do_sample` false, its default, is greedy; while
    /// sampling, an unset `temperature` is 1, `top_k` 50, `top_p` 1): a flag overrides its
    /// setting, and `--temperature` above 0 samples whatever `do_sample` says. Without a
    /// `generation_config.json`, `default_temperature` and no top-k or top-p.
    pub fn sampling(&self, flags: SamplingFlags, default_temperature: f32) -> Sampling {
        let has_file = self.file.is_some();
        let temperature = match (flags.temperature, has_file) {
            (Some(t), _) => t,
            (None, false) => default_temperature,
            (None, true) if self.do_sample == Some(true) => {
                self.temperature.unwrap_or(Self::HF_TEMPERATURE)
            }
            (None, true) => 0.0,
        };
        let top_k = match (flags.top_k, has_file) {
            (Some(k), _) => Some(k),
            (None, true) => Some(self.top_k.unwrap_or(Self::HF_TOP_K)),
            (None, false) => None,
        };
        let top_p = flags.top_p.or(if has_file { self.top_p } else { None });
        let sampling = temperature > 0.0;
        Sampling {
            temperature,
            top_k: top_k.filter(|&k| sampling && k > 0),
            top_p: top_p.filter(|&p| sampling && p < 1.0),
            from_generation_config: has_file
                && (flags.temperature.is_none()
                    || (sampling && (flags.top_k.is_none() || flags.top_p.is_none()))),
        }
    }
}

/// `key` of the JSON object `o` read from `path` as `get` reads it; absent or null is None,
/// anything else `get` refuses an error naming the file, the key and `expected`.
fn setting<T>(
    path: &std::path::Path,
    o: &serde_json::Map<String, serde_json::Value>,
    key: &str,
    get: impl Fn(&serde_json::Value) -> Option<T>,
    expected: &str,
) -> Result<Option<T>, TrainError> {
    match o.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => get(v).map(Some).ok_or_else(|| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: format!("`{key}` is {v}, not {expected}"),
        }),
    }
}

/// A token-id setting (`eos_token_id`): one id or a list of ids; absent, null or an empty list
/// is None.
fn token_ids(
    path: &std::path::Path,
    o: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<Option<Vec<u32>>, TrainError> {
    let id = |v: &serde_json::Value| v.as_u64().and_then(|i| u32::try_from(i).ok());
    let ids = setting(
        path,
        o,
        key,
        |v| match v {
            serde_json::Value::Array(list) => list.iter().map(id).collect(),
            one => id(one).map(|i| vec![i]),
        },
        "a token id or a list of token ids",
    )?;
    Ok(ids.filter(|ids| !ids.is_empty()))
}

/// The ids generation stops at: `generation`'s end-of-sequence ids (the model's
/// `generation_config.json`, or `config.json`), the tokenizer's `eos_token`, and with `chat`
/// the end-of-turn tokens of common templates ([`END_OF_TURN`]) its vocabulary holds as one
/// token; each once, in that order.
pub fn stop_ids(tokenizer: &crate::Tokenizer, generation: &[u32], chat: bool) -> Vec<u32> {
    let mut stop: Vec<u32> = Vec::new();
    let turn = match (chat, tokenizer) {
        (true, crate::Tokenizer::Hf(t)) => end_of_turn_ids(t),
        _ => Vec::new(),
    };
    for id in generation
        .iter()
        .copied()
        .chain(tokenizer.eos_id())
        .chain(turn)
    {
        if !stop.contains(&id) {
            stop.push(id);
        }
    }
    stop
}

/// Whichever of [`END_OF_TURN`] `t`'s vocabulary holds as one token.
fn end_of_turn_ids(t: &crate::HfTokenizer) -> Vec<u32> {
    let mut ids = Vec::new();
    for token in END_OF_TURN {
        // A marker this tokenizer cannot encode at all (no unknown token) is not one of its own.
        let Ok(encoded) = t.encode(token, false) else {
            continue;
        };
        if let [id] = encoded[..] {
            if t.id_to_token(id).as_deref() == Some(token) && !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
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
        sampler_in(model, seed, SampleMode::FullWindow)
    }

    fn sampler_in(model: &ModelConfig, seed: u64, mode: SampleMode) -> Sampler {
        let params = random_params(model, seed);
        Sampler::with_mode(model, &params, mode, 1, Allocator::default()).unwrap()
    }

    const MODES: [SampleMode; 2] = [SampleMode::KvCache, SampleMode::FullWindow];

    fn greedy() -> SampleOptions {
        SampleOptions {
            temperature: 0.0,
            top_k: None,
            seed: 0,
        }
    }

    /// All logits `[window, vocab]` of one run on `tokens` (exactly `window` ids).
    fn window_logits(s: &mut Sampler, tokens: &[i32]) -> Vec<f32> {
        let Engine::Full {
            tokens: ids,
            logits,
        } = s.engine
        else {
            panic!("a full-window sampler")
        };
        s.session
            .fill_i32(ids, s.vocab, |out| out.copy_from_slice(tokens))
            .unwrap();
        s.session.run(ExecCtx::default()).unwrap();
        s.session.read_f32(logits).unwrap().to_vec()
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
            let mode = SampleMode::FullWindow;
            let mut s = Sampler::with_mode(&model, &params, mode, 1, Allocator::default()).unwrap();
            let (w, v) = (s.window(), s.vocab_size());
            let prompt = [3u32, 1, 4];
            let new = s.generate(&prompt, 2 * w, greedy()).unwrap();
            assert_eq!(new.len(), 2 * w);
            let all: Vec<u32> = prompt.iter().chain(&new).copied().collect();

            let g = model.build_inference(2, w, 1).unwrap();
            let p = plan(&g.graph, &PlanOptions::default()).unwrap();
            let mut other = snug_cpu::CpuSession::new(g.graph, p, Allocator::default(), 1).unwrap();
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
        for mode in MODES {
            seeds_decide_samples_in(mode);
        }
    }

    fn seeds_decide_samples_in(mode: SampleMode) {
        let model = gpt();
        let mut s = sampler_in(&model, 5, mode);
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
        for mode in MODES {
            bad_arguments_in(mode);
        }
    }

    fn bad_arguments_in(mode: SampleMode) {
        let model = gpt();
        let mut s = sampler_in(&model, 6, mode);
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
        let new =
            |p: &[(String, Vec<f32>)]| Sampler::with_mode(&model, p, mode, 1, Allocator::default());
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
            Err(TrainError::Config {
                field: "parameters",
                ..
            })
        ));
        // A config that disagrees with its weights (a context of 2^30 over a `wpe` of 16
        // rows) is refused by shape before its session (gigabytes of caches) is planned.
        let mut long = model.clone();
        long.override_shape(None, None, None, Some(1 << 30));
        let refused = Sampler::with_mode(&long, &params, mode, 1, Allocator::default());
        match refused {
            Err(TrainError::Config {
                field: "parameters",
                detail,
            }) => assert!(detail.contains("wpe.weight"), "{detail}"),
            Err(other) => panic!("expected a shape refusal, got {other:?}"),
            Ok(_) => panic!("a config that disagrees with its weights loaded"),
        }
        let mut bad_model = model.clone();
        bad_model.override_shape(None, Some(3), None, None);
        assert!(matches!(
            Sampler::with_mode(&bad_model, &params, mode, 1, Allocator::default()),
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
        let params = random_params(&model, 8);
        let mode = SampleMode::FullWindow;
        let mut s = Sampler::with_mode(&model, &params, mode, 1, allocator.clone()).unwrap();
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

    /// The Llama variants a key/value cache must get right: grouped-query heads, full
    /// multi-head, a tied head, and Llama 3's rescaled rotary frequencies.
    fn llama_variants() -> Vec<ModelConfig> {
        let ModelConfig::Llama(base) = llama() else {
            unreachable!()
        };
        vec![
            llama(),
            ModelConfig::Llama(LlamaConfig {
                n_kv_head: 4,
                ..base.clone()
            }),
            ModelConfig::Llama(LlamaConfig {
                n_kv_head: 1,
                tie_word_embeddings: true,
                ..base.clone()
            }),
            ModelConfig::Llama(LlamaConfig {
                rope_scaling: Some(snug_nn::RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position: 8,
                }),
                rope_theta: 500.0,
                ..base
            }),
        ]
    }

    /// How many of the context's most recent tokens the cached path computes the token after
    /// a context of `n` from, `m` being that count for the previous, one shorter context (0
    /// before the first): the documented sliding rule, written out independently.
    fn kv_context(m: usize, n: usize, w: usize) -> usize {
        match m {
            0 => n.min(w),
            m if m < w => m + 1,
            _ => w.div_ceil(2),
        }
    }

    /// Greedy tokens with the cache equal the full window's token for token while the context
    /// fits, and past it equal the full window run on the suffix the documented slide keeps.
    #[test]
    fn kv_cache_sampling_equals_full_window_token_for_token() {
        for model in std::iter::once(gpt()).chain(llama_variants()) {
            let params = random_params(&model, 11);
            let load = |mode| Sampler::with_mode(&model, &params, mode, 1, Allocator::default());
            let mut kv = load(SampleMode::KvCache).unwrap();
            let mut full = load(SampleMode::FullWindow).unwrap();
            let w = kv.window();
            let prompt = [3u32, 1, 4, 1, 5];
            let inside = w - prompt.len();
            let a = kv.generate(&prompt, inside, greedy()).unwrap();
            let b = full.generate(&prompt, inside, greedy()).unwrap();
            assert_eq!(a, b, "{}", model.summary());
            let stats = kv.kv_stats().unwrap();
            assert_eq!((stats.prefill.runs, stats.decode.runs), (1, inside - 1));

            // Past the window: three slides.
            let new = kv.generate(&prompt, 2 * w + 3, greedy()).unwrap();
            let all: Vec<u32> = prompt.iter().chain(&new).copied().collect();
            let mut m = 0;
            for (j, &token) in new.iter().enumerate() {
                let n = prompt.len() + j;
                m = kv_context(m, n, w);
                let logits = full.next_token_logits(&all[n - m..n]).unwrap();
                assert_eq!(
                    argmax(&logits) as u32,
                    token,
                    "{} token {j}",
                    model.summary()
                );
            }
            assert!(kv.kv_stats().unwrap().slides >= 3);
        }
    }

    /// A sampler of a shorter context holds less (its caches or window are that long) and,
    /// while the context fits it, makes the whole window's tokens; out of range it is refused.
    #[test]
    fn a_shorter_context_holds_less_and_samples_alike() {
        for model in std::iter::once(gpt()).chain(llama_variants()) {
            let params = random_params(&model, 13);
            let max_seq = model.max_seq();
            let prompt = [3u32, 1, 4];
            let context = prompt.len() + 4;
            assert!(context < max_seq);
            for mode in MODES {
                let load = |context| {
                    let placement = Placement {
                        context,
                        ..Placement::CPU
                    };
                    Sampler::placed(&model, &params, mode, placement, 1, Allocator::default())
                };
                let mut whole = load(None).unwrap();
                let mut short = load(Some(context)).unwrap();
                assert_eq!(short.window(), context);
                let a = whole.generate(&prompt, 4, greedy()).unwrap();
                let b = short.generate(&prompt, 4, greedy()).unwrap();
                assert_eq!(a, b, "{} {mode:?}", model.summary());
                let peak = |s: &Sampler| match s.kv_stats() {
                    Some(k) => k
                        .prefill
                        .planned_peak_bytes
                        .max(k.decode.planned_peak_bytes),
                    None => s.plan().peak_bytes(),
                };
                assert!(peak(&short) < peak(&whole), "{} {mode:?}", model.summary());
                // What the caller checks before loading is what the sampler then held.
                let planned = planned_peak(
                    &model,
                    mode,
                    Placement {
                        context: Some(context),
                        ..Placement::CPU
                    },
                    1,
                    (prompt.len(), prompt.len() + 4),
                )
                .unwrap();
                assert_eq!(planned, peak(&short), "{} {mode:?}", model.summary());
                for bad in [0, max_seq + 1] {
                    assert!(
                        matches!(
                            load(Some(bad)),
                            Err(TrainError::Model(NnError::Config {
                                field: "context",
                                ..
                            })) | Err(TrainError::Model(NnError::Config { field: "block", .. }))
                        ),
                        "context {bad}"
                    );
                }
            }
        }
    }

    /// Small weights keep logits near 1, so 1e-5 is a tight bound on every position's
    /// difference from the full window, through the prefill and each decode step.
    #[test]
    fn decode_logits_match_the_full_forward() {
        for model in std::iter::once(gpt()).chain(llama_variants()) {
            let params: Vec<_> = random_params(&model, 12)
                .into_iter()
                .map(|(n, v)| (n, v.iter().map(|x| x * 0.4).collect::<Vec<f32>>()))
                .collect();
            let load = |mode| Sampler::with_mode(&model, &params, mode, 1, Allocator::default());
            let mut kv = load(SampleMode::KvCache).unwrap();
            let mut full = load(SampleMode::FullWindow).unwrap();
            let (w, v) = (kv.window(), kv.vocab_size());
            let mut rng = ChaCha8Rng::seed_from_u64(13);
            let context: Vec<u32> = (0..w).map(|_| rng.random_range(0..v as u32)).collect();
            for n in 4..=w {
                let a = kv.next_token_logits(&context[..n]).unwrap().to_vec();
                let b = full.next_token_logits(&context[..n]).unwrap();
                let diff = a
                    .iter()
                    .zip(b.iter())
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                assert!(diff <= 1e-5, "{} at {n}: {diff}", model.summary());
            }
            // One prefill (of 4), then decode steps only.
            let stats = kv.kv_stats().unwrap();
            assert_eq!((stats.prefill.runs, stats.decode.runs), (1, w - 4));
        }
    }

    /// Each phase holds exactly its plan: weights and caches persist, one arena at a time, and
    /// the caches are their own part of the breakdown.
    #[test]
    fn kv_cache_phases_hold_exactly_their_plans() {
        for model in [gpt(), llama()] {
            let allocator = Allocator::default();
            let params = random_params(&model, 14);
            let mode = SampleMode::KvCache;
            let mut s = Sampler::with_mode(&model, &params, mode, 1, allocator.clone()).unwrap();
            let w = s.window();
            s.generate(&[1, 2, 3], 2 * w, SampleOptions::default())
                .unwrap();
            let stats = s.kv_stats().unwrap();
            assert!(stats.prefill.runs >= 3 && stats.decode.runs > w);
            for phase in [stats.prefill, stats.decode] {
                assert_eq!(phase.planned_peak_bytes, phase.measured_peak_bytes);
            }
            assert!(stats.decode.planned_peak_bytes < stats.prefill.planned_peak_bytes);
            // The decode step holds its plan now, and nothing else.
            assert_eq!(allocator.active_bytes(), s.plan().peak_bytes());
            assert_eq!(allocator.cache_bytes(), 0);
            let b = s.plan().breakdown();
            let (layers, kv_width) = match &model {
                ModelConfig::Gpt(c) => (c.n_layer, c.n_embd),
                ModelConfig::Llama(c) => (c.n_layer, c.n_kv_head * c.head_dim()),
            };
            assert_eq!(b.kv_cache, 2 * layers * w * kv_width * 4);
            assert_eq!(b.gradients + b.optimizer_state, 0);
            assert_eq!(s.plan().persistent_bytes, b.parameters + b.kv_cache);
        }
    }

    /// Generation stops right after the first stop token it makes, in both modes.
    #[test]
    fn generation_stops_after_a_stop_token() {
        for mode in MODES {
            let model = llama();
            let mut s = sampler_in(&model, 15, mode);
            let prompt = [2u32, 7];
            let free = s.generate(&prompt, 30, greedy()).unwrap();
            let stop = free[6];
            let first = free.iter().position(|&t| t == stop).unwrap();
            let until = s.generate_until(&prompt, 30, greedy(), &[stop]).unwrap();
            assert_eq!(until, free[..=first]);
            // A stop token never made changes nothing.
            let absent: Vec<u32> = (0..17).filter(|t| !free.contains(t)).collect();
            assert_eq!(
                s.generate_until(&prompt, 30, greedy(), &absent).unwrap(),
                free
            );
        }
    }

    /// Nucleus sampling keeps exactly transformers' set, samples greedily at a tiny `top_p`,
    /// draws exactly as without it at 1, and refuses a `top_p` outside (0, 1] by name.
    #[test]
    fn top_p_keeps_the_nucleus() {
        // Weights 4, 3, 2, 1 of 10: 0.6 needs the first two (4 < 6, 4 + 3 ≥ 6).
        let weights = |ids: &[(usize, f64)]| ids.iter().map(|c| c.0).collect::<Vec<_>>();
        for (p, kept) in [
            (0.6, vec![2, 0]),
            (0.4, vec![2]),
            (0.41, vec![2, 0]),
            (1.0, vec![2, 0, 3, 1]),
        ] {
            let mut c = vec![(0, 3.0), (1, 1.0), (2, 4.0), (3, 2.0)];
            let total = keep_nucleus(&mut c, 10.0, p);
            assert_eq!(weights(&c), kept, "top_p {p}");
            assert_eq!(total, c.iter().map(|c| c.1).sum::<f64>());
        }
        for mode in MODES {
            let model = llama();
            let mut s = sampler_in(&model, 16, mode);
            let prompt = [2u32, 7];
            let warm = SampleOptions {
                temperature: 1.0,
                top_k: None,
                seed: 5,
            };
            let free = s.generate(&prompt, 12, warm).unwrap();
            let whole = s.generate_with(&prompt, 12, warm, Some(1.0), &[]).unwrap();
            assert_eq!(free, whole, "top_p 1 draws as without it");
            let narrow = s.generate_with(&prompt, 12, warm, Some(1e-6), &[]).unwrap();
            assert_eq!(narrow, s.generate(&prompt, 12, greedy()).unwrap());
            assert_ne!(free, narrow, "the seed samples away from greedy here");
            for bad in [0.0, -0.1, 1.5, f32::NAN, f32::INFINITY] {
                match s.generate_with(&prompt, 3, warm, Some(bad), &[]) {
                    Err(TrainError::Config { field: "top_p", .. }) => {}
                    other => panic!("top_p {bad}: {other:?}"),
                }
            }
        }
    }

    fn generation(g: &str, c: &str) -> Result<GenerationConfig, TrainError> {
        let (gp, cp) = (
            std::path::Path::new(GENERATION_CONFIG_FILE),
            std::path::Path::new("config.json"),
        );
        GenerationConfig::parse(
            (!g.is_empty()).then_some((gp, g)),
            (!c.is_empty()).then_some((cp, c)),
        )
    }

    /// `eos_token_id` is one id or a list, from generation_config.json, else config.json; the
    /// sampling settings are read with their types checked by key.
    #[test]
    fn generation_config_reads_eos_lists_and_settings() {
        let g = generation(
            r#"{"bos_token_id": 700, "eos_token_id": [701, 705, 704], "do_sample": true,
                "temperature": 0.6, "top_p": 0.9, "top_k": null}"#,
            r#"{"eos_token_id": 9, "bos_token_id": 8}"#,
        )
        .unwrap();
        assert_eq!(g.eos, [701, 705, 704]);
        assert_eq!(g.bos, Some(700));
        assert_eq!(
            (g.do_sample, g.temperature, g.top_k, g.top_p),
            (Some(true), Some(0.6), None, Some(0.9))
        );
        assert!(g.file.is_some());
        // Without a generation_config.json: config.json's ids, no file, no settings.
        let c = generation(
            "",
            r#"{"eos_token_id": 2, "bos_token_id": 1, "temperature": 5}"#,
        )
        .unwrap();
        assert_eq!(
            (c.eos.clone(), c.bos, c.file.clone()),
            (vec![2], Some(1), None)
        );
        assert_eq!(c.temperature, None);
        // A generation_config.json without ids: config.json's.
        let both = generation(r#"{"do_sample": false}"#, r#"{"eos_token_id": [3, 4]}"#).unwrap();
        assert_eq!(both.eos, [3, 4]);
        assert_eq!(generation("", "").unwrap(), GenerationConfig::default());
        for (g, needle) in [
            (r#"{"eos_token_id": "x"}"#, "`eos_token_id`"),
            (r#"{"eos_token_id": [1, -2]}"#, "`eos_token_id`"),
            (r#"{"temperature": -1}"#, "`temperature`"),
            (r#"{"top_p": 0}"#, "`top_p`"),
            (r#"{"top_k": 2.5}"#, "`top_k`"),
            (r#"{"do_sample": "yes"}"#, "`do_sample`"),
            ("[]", "not a JSON object"),
            ("{", "not JSON"),
        ] {
            let e = generation(g, "").unwrap_err().to_string();
            assert!(
                e.contains(needle) && e.contains(GENERATION_CONFIG_FILE),
                "{g}: {e}"
            );
        }
    }

    /// transformers' precedence: a flag, else generation_config.json (do_sample false or
    /// absent is greedy; while sampling an unset top_k is 50), else snug's defaults.
    #[test]
    fn sampling_defaults_follow_generation_config() {
        let none = SamplingFlags::default();
        let file = |g: &str| generation(g, "").unwrap();
        let s = |t: f32, k: Option<usize>, p: Option<f32>, from: bool| Sampling {
            temperature: t,
            top_k: k,
            top_p: p,
            from_generation_config: from,
        };
        // No generation_config.json: snug's defaults, flags as given (top-k 0: every token).
        let bare = GenerationConfig::default();
        assert_eq!(bare.sampling(none, 0.8), s(0.8, None, None, false));
        let flags = SamplingFlags {
            temperature: Some(0.5),
            top_k: Some(0),
            top_p: Some(0.9),
        };
        assert_eq!(bare.sampling(flags, 0.8), s(0.5, None, Some(0.9), false));
        // do_sample absent or false: greedy.
        for g in [
            "{}",
            r#"{"do_sample": false, "temperature": 0.7, "top_k": 3}"#,
        ] {
            assert_eq!(file(g).sampling(none, 0.8), s(0.0, None, None, true), "{g}");
        }
        let llama = file(r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9}"#);
        assert_eq!(llama.sampling(none, 0.8), s(0.6, Some(50), Some(0.9), true));
        let all = SamplingFlags {
            temperature: Some(1.2),
            top_k: Some(7),
            top_p: Some(1.0),
        };
        assert_eq!(llama.sampling(all, 0.8), s(1.2, Some(7), None, false));
        let greedy_flag = SamplingFlags {
            temperature: Some(0.0),
            ..none
        };
        assert_eq!(llama.sampling(greedy_flag, 0.8), s(0.0, None, None, false));
        // --temperature above 0 samples whatever do_sample says, with the file's top-k.
        let warm = SamplingFlags {
            temperature: Some(0.7),
            ..none
        };
        let greedy_file = file(r#"{"do_sample": false, "top_k": 3}"#);
        assert_eq!(greedy_file.sampling(warm, 0.8), s(0.7, Some(3), None, true));
        let sampled = file(r#"{"do_sample": true}"#);
        assert_eq!(sampled.sampling(none, 0.0), s(1.0, Some(50), None, true));
    }

    /// Stop ids: the model's eos ids, then the tokenizer's eos, each once; a character
    /// vocabulary adds none.
    #[test]
    fn stop_ids_are_the_union_in_order() {
        let gpt2 = crate::Tokenizer::gpt2();
        assert_eq!(stop_ids(&gpt2, &[5, 50256, 7], false), [5, 50256, 7]);
        assert_eq!(stop_ids(&gpt2, &[], true), [50256]);
        let chars = crate::Tokenizer::Char(crate::tokenizer::CharTokenizer::from_text("ab"));
        assert!(stop_ids(&chars, &[], false).is_empty());
        assert_eq!(stop_ids(&chars, &[1], true), [1]);
    }
}
