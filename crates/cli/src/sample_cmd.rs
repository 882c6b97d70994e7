//! `snug sample`: generate text from a checkpoint, on the planner's inference plan (no
//! gradients, no optimizer state).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;
use snug_runtime::Allocator;
use snug_train::addition;
use snug_train::checkpoint::{self, CheckpointDir};
use snug_train::config::DataSourceConfig;
use snug_train::sample::{GenerationConfig, SamplingFlags, MAX_NEW_TOKENS};
use snug_train::{KvStats, Placement, SampleMode, SampleOptions, Sampler, Tokenizer};

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A run directory (its newest checkpoint), a checkpoint file, or a Hugging Face model
    /// directory (config.json, model.safetensors or shards, tokenizer.json). Default: the
    /// newest run under ./runs (the one whose newest checkpoint was written last), where
    /// `snug train` saves.
    #[arg(long, value_name = "PATH")]
    checkpoint: Option<PathBuf>,
    /// Text to continue (with --chat: the user's message). A Hugging Face tokenizer encodes it
    /// with its special tokens, as transformers' `tokenizer(prompt)` does (Llama's
    /// `<|begin_of_text|>` or `<s>` first; one typed at the prompt's start is not doubled).
    /// Default: for a model of the built-in data, a held-out addition problem (`48+39=`);
    /// otherwise empty. An empty prompt starts from the beginning-of-sequence token (the
    /// model's `bos_token_id`, else the tokenizer's `bos_token`; GPT-2's `<|endoftext|>`), is
    /// refused where there is none, and for a character vocabulary starts from token 0.
    #[arg(long)]
    prompt: Option<String>,
    /// Answer as a chat model: the conversation (--prompt as one user message, or
    /// --messages) is rendered through the tokenizer's chat template with the generation
    /// prompt, and generation stops at the end of the model's turn: an end-of-sequence token
    /// (see --ignore-eos) or the template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`,
    /// `<|end|>`, `<end_of_turn>`).
    #[arg(long)]
    chat: bool,
    /// With --chat: a JSON file holding the conversation, a list of {"role", "content"}
    /// objects (or an object with such a list under "messages"). Each content is a string or
    /// a list of {"type": "text", "text"} parts, which are joined.
    #[arg(
        long,
        value_name = "FILE.json",
        requires = "chat",
        conflicts_with = "prompt"
    )]
    messages: Option<PathBuf>,
    /// Run the whole window for every token instead of prefilling once and decoding with a
    /// key/value cache (the reference the cache is tested against).
    #[arg(long)]
    full_window: bool,
    /// Store the weight matrices quantized for sampling: int8 (per output channel), nf4
    /// (NormalFloat4, blocks of 64) or bf16; each is dequantized just before the op that
    /// reads it. Norms and biases stay f32. Default: f32.
    #[arg(long, value_name = "TYPE")]
    quantize: Option<String>,
    /// For a Hugging Face model directory: the tokenizer to encode the prompt and decode the
    /// answer with, instead of its tokenizer.json (which it may lack): gpt2, or a Hugging
    /// Face tokenizer's directory or tokenizer.json. It must cover the model's vocabulary. A
    /// snug run samples with the tokenizer it trained with.
    #[arg(long, value_name = "gpt2|PATH")]
    tokenizer: Option<String>,
    /// Tokens to generate (at most 1,000,000).
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Positions the model attends to at once, the key/value caches' length (at most the
    /// model's context). Default: the prompt and --tokens together, at most the model's context,
    /// so a short request on a long-context model (a Llama's 131,072 positions) holds only the
    /// caches it uses. Past it the cache slides, keeping the most recent half.
    #[arg(long, value_name = "N")]
    context: Option<usize>,
    /// Softmax temperature; 0 picks the most likely token every time, above 0 samples.
    /// Default: a Hugging Face model's generation_config.json (its `temperature` where
    /// `do_sample` is true, else 0: greedy, as transformers' `generate`); a Hugging Face model
    /// directory without one, 0 (greedy, as `generate`) unless --top-k or --top-p is given;
    /// otherwise 0.8, and 0 for the default addition problem (its answer is exact).
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only; 0 keeps every token. Default: with a
    /// generation_config.json, its `top_k` (transformers' 50 where it names none); otherwise
    /// every token.
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling: after --top-k, sample among the most likely tokens whose
    /// probabilities together first reach P, in (0, 1] (1 keeps every token). Default: a
    /// generation_config.json's `top_p`; otherwise 1.
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Do not stop at end-of-sequence or end-of-turn tokens: generate all --tokens, a raw
    /// continuation. By default generation stops at the first of the model's
    /// generation_config.json `eos_token_id` (one id or a list; config.json's where there is
    /// no generation_config.json), the tokenizer's `eos_token`, and with --chat the
    /// template's end-of-turn token.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Worker threads (default: physical cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Device: cpu (default), gpu (the first GPU) or gpu:N (`snug devices` lists them). On a
    /// GPU the prefill and decode graphs run in device memory, the weights uploaded once.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    device: snug_train::DeviceSpec,
    /// One JSON object with the text and figures.
    #[arg(long)]
    json: bool,
}

/// `--context`, checked against the model's `max_seq` positions (`sample` and
/// `plan --inference` alike), or `default`.
pub(crate) fn context_flag(
    context: Option<usize>,
    max_seq: usize,
    default: usize,
) -> Result<usize> {
    match context {
        Some(n) if n == 0 || n > max_seq => {
            bail!("--context {n}: must be between 1 and the model's context of {max_seq} positions")
        }
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

/// The conversation in `file`: a JSON list of messages, or an object holding one under
/// "messages"; each message an object with a string "role" and "content" (see
/// `check_messages`, which joins a list of text parts).
fn read_messages(file: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("--messages: reading {}", file.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--messages: {} is not JSON", file.display()))?;
    let mut list = match value {
        serde_json::Value::Array(list) => list,
        serde_json::Value::Object(mut o) => match o.remove("messages") {
            Some(serde_json::Value::Array(list)) => list,
            _ => bail!(
                "--messages: {} holds an object without a \"messages\" list",
                file.display()
            ),
        },
        _ => bail!(
            "--messages: {} holds neither a list nor an object",
            file.display()
        ),
    };
    if list.is_empty() {
        bail!("--messages: {} holds no message", file.display());
    }
    snug_train::examples::check_messages(&mut list)
        .map_err(|detail| anyhow::anyhow!("--messages: {}: {detail}", file.display()))?;
    Ok(list)
}

/// Where `snug train` saves runs by default, under the current directory.
const RUNS_DIR: &str = "runs";

#[derive(Serialize)]
struct SampleReport {
    /// `cpu`, or the adapter's label.
    device: String,
    checkpoint: PathBuf,
    step: u64,
    /// The prompt's text (with --chat, as the template rendered it).
    prompt: String,
    prompt_ids: Vec<u32>,
    text: String,
    /// The generated ids, the stop token included when one ended the generation.
    ids: Vec<u32>,
    tokens: usize,
    /// With --chat: whether the model ended its turn (rather than running out of --tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    end_of_turn: Option<bool>,
    /// `stop`: a stop token ended the generation (`stop_token_id`); `length`: --tokens ran out.
    finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_token_id: Option<u32>,
    /// The stop token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_token: Option<String>,
    /// The ids generation stops at (none with --ignore-eos).
    stop_ids: Vec<u32>,
    /// The prompt's first tokens left out because the prompt is longer than `context`.
    prompt_tokens_dropped: usize,
    /// How tokens were drawn: `temperature` 0 is greedy; `top_k` and `top_p` null when
    /// unused.
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    /// The model's generation_config.json, when it gave a default (a flag not given).
    #[serde(skip_serializing_if = "Option::is_none")]
    generation_config: Option<PathBuf>,
    /// True where a Hugging Face model directory without generation_config.json sampled
    /// greedily by default, as transformers' `generate` does (do_sample false).
    greedy_without_generation_config: bool,
    mode: SampleMode,
    /// Positions the sampler held (the caches' length).
    context: usize,
    /// How the weight matrices were stored, when not in f32.
    #[serde(skip_serializing_if = "Option::is_none")]
    quantize: Option<snug_graph::ops::QuantizeBase>,
    ms: f64,
    tokens_per_s: f64,
    /// The largest plan the sampler held (with the cache: the larger of its phases).
    planned_peak_bytes: usize,
    measured_peak_bytes: usize,
    /// With the cache: each phase's runs, plan and measured peak.
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_cache: Option<KvStats>,
}

pub fn run(args: SampleArgs) -> Result<()> {
    // Before loading anything: a request this large is a mistake, not a long run.
    if args.tokens > MAX_NEW_TOKENS {
        bail!(
            "--tokens: {} is more than the {MAX_NEW_TOKENS} tokens snug sample generates in one run",
            args.tokens
        );
    }
    crate::check_threads_flag(args.threads)?;
    if let Some(p) = args.top_p {
        if snug_train::sample::check_top_p(Some(p)).is_err() {
            bail!("--top-p {p}: must be a probability in (0, 1] (1 keeps every token)");
        }
    }
    let from = match &args.checkpoint {
        Some(p) => p.clone(),
        None => {
            let dir = newest_run(Path::new(RUNS_DIR))?;
            eprintln!(
                "sampling from {} (the newest run under ./{RUNS_DIR})",
                dir.display()
            );
            dir
        }
    };
    let source = Source::open(&from)?;
    let (path, step, model) = (source.path(), source.step(), source.model()?);
    let tokenizer = match (&args.tokenizer, &source) {
        (None, _) => source.tokenizer()?,
        (Some(_), Source::Run(..)) => bail!(
            "--tokenizer: {} is a snug run, which samples with the tokenizer it trained with",
            path.display()
        ),
        (Some(arg), Source::Hf(_)) => {
            let tokenizer = match crate::prepare_cmd::hf_tokenizer(arg)? {
                Some(t) => Tokenizer::Hf(t),
                None if arg == "gpt2" => Tokenizer::gpt2(),
                None => bail!(
                    "--tokenizer: char is made from a corpus; give gpt2, or a Hugging Face \
                     tokenizer's directory or tokenizer.json"
                ),
            };
            tokenizer
                .check_model_vocab(model.vocab_size())
                .with_context(|| format!("--tokenizer {arg}"))?;
            tokenizer
        }
    };
    // What the model's generation_config.json (or config.json) says: its stop ids, its
    // beginning-of-sequence id, and the sampling defaults of a flag not given.
    let generation = match &source {
        Source::Hf(c) => GenerationConfig::read(c.dir())?,
        Source::Run(_, c) => match &c.config.model.hf_config_text {
            // A run from pretrained weights keeps the config.json it started from.
            Some(text) => GenerationConfig::parse(None, Some((Path::new("config.json"), text)))
                .with_context(|| format!("the model config kept in {}", path.display()))?,
            None => GenerationConfig::default(),
        },
    };
    // A model of the built-in data shows what it learned: a sum it never saw, answered greedily.
    let addition_data =
        matches!(&source, Source::Run(_, c) if c.config.data == DataSourceConfig::Addition);
    let problem = (args.prompt.is_none() && addition_data)
        .then(|| addition::held_out_problems(1, args.seed).first().copied())
        .flatten();
    let (prompt_text, default_temperature) = match (&args.prompt, problem) {
        (Some(p), _) => (p.clone(), 0.8),
        // After a newline: the start of a line, as every sum in training begins.
        (None, Some(p)) if !args.chat => (format!("\n{}", p.question()), 0.0),
        _ => (String::new(), 0.8),
    };
    let flags = SamplingFlags {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    // A Hugging Face directory without generation_config.json: transformers' `generate`
    // takes do_sample=False then, so greedy, as it would be. A sampling flag given asks to
    // sample (snug's 0.8 unless --temperature says); a snug run keeps snug's defaults.
    let greedy_without_generation_config = matches!(source, Source::Hf(_))
        && generation.file.is_none()
        && flags == SamplingFlags::default();
    let default_temperature = match greedy_without_generation_config {
        true => 0.0,
        false => default_temperature,
    };
    let sampling = generation.sampling(flags, default_temperature);
    if sampling.temperature == 0.0 {
        let unused: Vec<&str> = [args.top_k.map(|_| "--top-k"), args.top_p.map(|_| "--top-p")]
            .into_iter()
            .flatten()
            .collect();
        if !unused.is_empty() {
            let why = match (&args.temperature, &generation.file) {
                (None, Some(file)) => format!(
                    "sampling is greedy, as {} says (do_sample is not true)",
                    file.display()
                ),
                _ => "sampling is greedy at temperature 0".to_string(),
            };
            eprintln!(
                "warning: {} has no effect: {why}; give --temperature T (above 0) to sample",
                unused.join(" and ")
            );
        }
    }
    // Encoding errors name the text, the tokenizer and the character it cannot encode.
    let tokenizer_name = match (&args.tokenizer, &source) {
        (Some(arg), _) => format!("--tokenizer {arg}"),
        (None, Source::Hf(c)) => {
            let file = c.dir().join(snug_train::hf_tokenizer::TOKENIZER_FILE);
            if file.exists() {
                file.display().to_string()
            } else {
                "GPT-2's tokenizer".to_string()
            }
        }
        (None, Source::Run(..)) => "the checkpoint's tokenizer".to_string(),
    };
    let what = match (&args.messages, &args.prompt) {
        (Some(file), _) => format!("--messages {}", file.display()),
        (None, Some(_)) => "--prompt".to_string(),
        (None, None) => "the prompt".to_string(),
    };
    // Refused once the model has loaded, so that what is wrong with the model is said first.
    let mut no_start = None;
    let (prompt_text, prompt) = if args.chat {
        let messages = match &args.messages {
            Some(file) => read_messages(file)?,
            None => vec![serde_json::json!({"role": "user", "content": prompt_text})],
        };
        let chat = snug_train::chat_prompt(&tokenizer, &messages).map_err(|e| {
            // The rendering encoded again, a character at a time, to find the one at fault.
            let rendered = match &tokenizer {
                Tokenizer::Hf(t) => t.render_chat(&messages, true).ok(),
                _ => None,
            };
            match rendered.and_then(|text| tokenizer.unencodable_char(&text)) {
                Some(why) => anyhow::anyhow!(
                    "--chat: encoding {what}, as the chat template renders it, with \
                     {tokenizer_name}: {why}"
                ),
                None => anyhow::Error::new(e).context(format!("--chat with {}", path.display())),
            }
        })?;
        (chat.text, chat.ids)
    } else {
        let encoded = encode_prompt(&tokenizer, &prompt_text).map_err(|e| {
            let context = format!("encoding {what} with {tokenizer_name}");
            match tokenizer.unencodable_char(&prompt_text) {
                Some(why) => anyhow::anyhow!("{context}: {why}"),
                None => anyhow::Error::new(e).context(context),
            }
        })?;
        if let Some(bos) = &encoded.kept_once {
            eprintln!(
                "note: {what} begins with {bos}, which the tokenizer adds at the start of a \
                 text itself: it is kept once"
            );
        }
        let mut ids = encoded.ids;
        if ids.is_empty() && !matches!(tokenizer, Tokenizer::Char(_)) {
            // As transformers' `generate` without input: from the beginning of a sequence.
            let bos = match &tokenizer {
                Tokenizer::Hf(t) => {
                    generation
                        .bos
                        .or(t.special_tokens().bos.as_ref().map(|b| b.id))
                }
                _ => generation.bos.or(tokenizer.eos_id()),
            };
            match bos {
                Some(bos) => ids.push(bos),
                None => {
                    let give = match args.prompt {
                        Some(_) => "give a prompt that is not empty",
                        None => "give --prompt TEXT",
                    };
                    no_start = Some(format!(
                        "{}: neither {} nor {tokenizer_name} names a beginning-of-sequence \
                         token (`bos_token_id`, `bos_token`) for generation to start from; \
                         {give}",
                        match args.prompt {
                            Some(_) => "--prompt is empty",
                            None => "no --prompt",
                        },
                        path.display()
                    ));
                }
            }
        }
        (prompt_text, ids)
    };
    let stop = if args.ignore_eos {
        Vec::new()
    } else {
        snug_train::sample::stop_ids(&tokenizer, &generation.eos, args.chat)
    };
    let allocator = Allocator::default();
    let threads = args.threads.unwrap_or_else(snug_cpu::physical_cores);
    let mode = if args.full_window {
        SampleMode::FullWindow
    } else {
        SampleMode::KvCache
    };
    let quantize = args
        .quantize
        .as_deref()
        .map(str::parse::<snug_graph::ops::QuantizeBase>)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--quantize: {e}"))?;
    let max_seq = model.max_seq();
    let total = prompt.len().max(1).saturating_add(args.tokens);
    let context = context_flag(args.context, max_seq, total.min(max_seq))?;
    // The sampler reads the prompt's most recent `context` tokens: a longer prompt loses its
    // start, said here rather than silently.
    let dropped = prompt.len().saturating_sub(context);
    if dropped > 0 {
        let limit = match args.context {
            Some(n) if n < max_seq => {
                format!("--context {n} (the model's context is {max_seq} positions)")
            }
            _ => format!("the model's context of {max_seq} positions"),
        };
        eprintln!(
            "warning: the prompt is {} tokens, more than {limit}: its first {dropped} tokens \
             are dropped (the first new token sees the last {context}; the window then slides \
             as usual)",
            prompt.len()
        );
    }
    let placement = Placement {
        device: args.device,
        quantize,
        context: Some(context),
    };
    // Before anything is allocated: a plan beyond this machine's memory is refused by name
    // (untouched pages are never committed, so mapping it would seem to succeed).
    if !args.device.is_gpu() {
        let peak = snug_train::sample::planned_peak(
            &model,
            mode,
            placement,
            threads,
            (prompt.len(), total),
        )
        .with_context(|| format!("planning to sample from {}", path.display()))?;
        if let Some(available) = snug_runtime::process::available_memory() {
            if peak > available {
                bail!(
                    "sampling from {} with a context of {context} positions plans a peak of {}, \
                     more than this machine has available ({}): lower --context, or store the \
                     weights smaller with --quantize int8 or nf4",
                    path.display(),
                    human_bytes(peak),
                    human_bytes(available)
                );
            }
        }
    }
    let sampler = match &source {
        Source::Run(_, ckpt) => Sampler::placed(
            &model,
            &ckpt.parameters(),
            mode,
            placement,
            threads,
            allocator.clone(),
        ),
        Source::Hf(ckpt) => {
            Sampler::from_hf_placed(&model, ckpt, mode, placement, threads, allocator.clone())
        }
    };
    let mut sampler = sampler.with_context(|| format!("loading {}", path.display()))?;
    if let Some(why) = no_start {
        bail!(why);
    }
    let opts = SampleOptions {
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        seed: args.seed,
    };
    let start = Instant::now();
    let ids = sampler.generate_with(&prompt, args.tokens, opts, sampling.top_p, &stop)?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let stop_token_id = ids.last().copied().filter(|t| stop.contains(t));
    let end_of_turn = args.chat.then_some(stop_token_id.is_some());
    // The text leaves out the token that ended the generation.
    let shown = match stop_token_id {
        Some(_) => &ids[..ids.len() - 1],
        None => &ids[..],
    };
    let text = tokenizer.decode(shown);
    let stop_token = stop_token_id.map(|t| tokenizer.decode(&[t]));
    let kv_cache = sampler.kv_stats();
    let (planned, measured) = match kv_cache {
        Some(k) => (
            k.prefill
                .planned_peak_bytes
                .max(k.decode.planned_peak_bytes),
            k.prefill
                .measured_peak_bytes
                .max(k.decode.measured_peak_bytes),
        ),
        // A GPU's session has an allocator of its own over device memory.
        None => (
            sampler.plan().peak_bytes(),
            sampler.session().allocator().peak_bytes(),
        ),
    };
    let report = SampleReport {
        device: sampler.session().device_name(),
        checkpoint: path,
        step,
        prompt: prompt_text,
        prompt_ids: prompt,
        text,
        tokens: ids.len(),
        tokens_per_s: ids.len() as f64 / (ms / 1e3).max(1e-9),
        ids,
        end_of_turn,
        finish_reason: if stop_token_id.is_some() {
            "stop"
        } else {
            "length"
        },
        stop_token_id,
        stop_token,
        stop_ids: stop,
        prompt_tokens_dropped: dropped,
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        generation_config: generation
            .file
            .clone()
            .filter(|_| sampling.from_generation_config),
        greedy_without_generation_config,
        mode,
        context,
        quantize,
        ms,
        planned_peak_bytes: planned,
        measured_peak_bytes: measured,
        kv_cache,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        if args.chat {
            // The answer alone: the rendered template is the model's business.
            println!("{}", report.text);
        } else {
            // The default prompt's leading newline only marks a line start for the model.
            println!("{}{}", report.prompt.trim_start_matches('\n'), report.text);
        }
        let drawn = match (report.temperature, report.top_k, report.top_p) {
            (0.0, _, _) => "greedy".to_string(),
            (t, k, p) => format!(
                "temperature {t}{}{}",
                k.map_or(String::new(), |k| format!(", top-k {k}")),
                p.map_or(String::new(), |p| format!(", top-p {p}"))
            ),
        };
        let drawn = match &report.generation_config {
            Some(_) => format!("{drawn}, from generation_config.json"),
            None if report.greedy_without_generation_config => {
                format!("{drawn}: no generation_config.json, as transformers")
            }
            None => drawn,
        };
        let ended = match (&report.stop_token, report.stop_token_id) {
            (Some(text), Some(id)) => format!("stopped at {text:?} ({id})"),
            _ if report.stop_ids.is_empty() => "no stop token".to_string(),
            _ => "no stop token made".to_string(),
        };
        eprintln!(
            "({} tokens in {:.0} ms, {:.1} tok/s, {drawn}, {ended}{} of {} positions{} on {}; {} at step {}; inference plan peak {}, measured {})",
            report.tokens,
            report.ms,
            report.tokens_per_s,
            match report.mode {
                SampleMode::KvCache => ", key/value cache",
                SampleMode::FullWindow => ", a window per token",
            },
            report.context,
            report
                .quantize
                .map_or(String::new(), |q| format!(", {q} weights")),
            report.device,
            report.checkpoint.display(),
            report.step,
            human_bytes(report.planned_peak_bytes),
            human_bytes(report.measured_peak_bytes)
        );
    }
    Ok(())
}

/// A plain prompt's ids.
struct EncodedPrompt {
    ids: Vec<u32>,
    /// The special token the prompt began with that the tokenizer adds itself, kept once.
    kept_once: Option<String>,
}

/// `text`'s ids: a Hugging Face tokenizer adds its special tokens (a post-processor's BOS), as
/// transformers' `tokenizer(text)` does, except that one the text already begins with is not
/// added again (transformers would hold it twice, which no model trained on); GPT-2's and a
/// character vocabulary add none.
fn encode_prompt(
    tokenizer: &Tokenizer,
    text: &str,
) -> Result<EncodedPrompt, snug_train::TrainError> {
    let Tokenizer::Hf(t) = tokenizer else {
        return Ok(EncodedPrompt {
            ids: tokenizer.encode(text)?,
            kept_once: None,
        });
    };
    let with = t.encode(text, true)?;
    let plain = t.encode(text, false)?;
    // Where the text's own ids sit among those with the special tokens added.
    let added = (with.len() >= plain.len())
        .then(|| (0..=with.len() - plain.len()).find(|&k| with[k..].starts_with(&plain)))
        .flatten();
    match added {
        Some(k) if k > 0 && !plain.is_empty() && plain.starts_with(&with[..k]) => {
            Ok(EncodedPrompt {
                kept_once: Some(tokenizer.decode(&with[..k])),
                ids: with[k..].to_vec(),
            })
        }
        _ => Ok(EncodedPrompt {
            ids: with,
            kept_once: None,
        }),
    }
}

/// What a model is sampled (or exported) from: a snug run's checkpoint, or a Hugging Face
/// model directory.
pub enum Source {
    Run(PathBuf, Box<checkpoint::Checkpoint>),
    Hf(snug_nn::HfCheckpoint),
}

impl Source {
    /// A Hugging Face model directory (config.json inside), else a run directory or checkpoint
    /// file.
    pub fn open(from: &Path) -> Result<Source> {
        if snug_nn::is_hf_dir(from) {
            // Either reading would silently pass over the other: the pretrained weights, or
            // what a run trained from them.
            if checkpoint::holds_checkpoints(from) {
                bail!(
                    "{}: holds both a Hugging Face model (config.json and its weights) and a \
                     run's checkpoints: name the run's checkpoint file, or move the model or the \
                     run into a directory of its own",
                    from.display()
                );
            }
            return Ok(Source::Hf(snug_nn::HfCheckpoint::open(from)?));
        }
        if let Some(why) = snug_nn::config_missing_beside_weights(from) {
            bail!(why);
        }
        // Sampling and exporting read the weights alone: the optimizer's state (twice the
        // weights under AdamW) is checked, never held.
        let (path, ckpt) = checkpoint::load_keeping(from, checkpoint::Keep::Weights)?;
        Ok(Source::Run(path, Box::new(ckpt)))
    }

    pub fn path(&self) -> PathBuf {
        match self {
            Source::Run(p, _) => p.clone(),
            Source::Hf(c) => c.dir().to_path_buf(),
        }
    }

    /// Optimizer steps behind the weights (0 for a Hugging Face directory: none of snug's).
    pub fn step(&self) -> u64 {
        match self {
            Source::Run(_, c) => c.step,
            Source::Hf(_) => 0,
        }
    }

    pub fn model(&self) -> Result<snug_nn::ModelConfig> {
        Ok(match self {
            Source::Run(_, c) => c.model()?,
            Source::Hf(c) => c.config().clone(),
        })
    }

    /// The run's tokenizer, or the directory's `tokenizer.json` (GPT-2's own for a GPT-2 of
    /// its vocabulary without one), checked against the model's vocabulary.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match self {
            Source::Run(_, c) => Ok(Tokenizer::from_spec(&c.tokenizer)?),
            Source::Hf(c) => {
                let file = c.dir().join(snug_train::hf_tokenizer::TOKENIZER_FILE);
                let vocab = c.config().vocab_size();
                let tokenizer = if file.exists() {
                    Tokenizer::Hf(snug_train::HfTokenizer::from_file(&file)?)
                } else if matches!(c.config(), snug_nn::ModelConfig::Gpt(_))
                    && vocab == snug_train::tokenizer::GPT2_VOCAB_SIZE
                {
                    Tokenizer::gpt2()
                } else {
                    bail!(
                        "{}: no {} to encode text with: copy the model's there, or give \
                         sample --tokenizer",
                        c.dir().display(),
                        snug_train::hf_tokenizer::TOKENIZER_FILE
                    );
                };
                tokenizer
                    .check_model_vocab(vocab)
                    .with_context(|| format!("{}", file.display()))?;
                Ok(tokenizer)
            }
        }
    }
}

/// The run directory under `runs` whose newest checkpoint was modified last.
fn newest_run(runs: &Path) -> Result<PathBuf> {
    let none = || {
        anyhow::anyhow!(
            "no run under ./{RUNS_DIR}: train one with `snug train`, or give --checkpoint"
        )
    };
    let Ok(entries) = std::fs::read_dir(runs) else {
        return Err(none());
    };
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for dir in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        let Ok(list) = CheckpointDir::open(&dir).and_then(|d| d.list()) else {
            continue;
        };
        let modified = list
            .iter()
            .filter_map(|(_, p)| p.metadata().and_then(|m| m.modified()).ok())
            .max();
        if let Some(t) = modified {
            if newest.as_ref().is_none_or(|(best, _)| t > *best) {
                newest = Some((t, dir));
            }
        }
    }
    newest.map(|(_, dir)| dir).ok_or_else(none)
}
