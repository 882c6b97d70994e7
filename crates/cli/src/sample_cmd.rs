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
use snug_train::sample::MAX_NEW_TOKENS;
use snug_train::{KvStats, Placement, SampleMode, SampleOptions, Sampler, Tokenizer};

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A run directory (its newest checkpoint), a checkpoint file, or a Hugging Face model
    /// directory (config.json, model.safetensors or shards, tokenizer.json). Default: the
    /// newest run under ./runs (the one whose newest checkpoint was written last), where
    /// `snug train` saves.
    #[arg(long, value_name = "PATH")]
    checkpoint: Option<PathBuf>,
    /// Text to continue (with --chat: the user's message). Default: for a model of the
    /// built-in data, a held-out addition problem (`48+39=`); otherwise empty (start from
    /// token 0).
    #[arg(long)]
    prompt: Option<String>,
    /// Answer as a chat model: the conversation (--prompt as one user message, or
    /// --messages) is rendered through the tokenizer's chat template with the generation
    /// prompt, and generation stops at the end of the model's turn (the tokenizer's eos token
    /// or the template's end-of-turn token).
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
    /// Softmax temperature; 0 picks the most likely token every time. Default 0.8, and 0 for
    /// the default addition problem (its answer is exact).
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
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
    /// The generated ids, the end-of-turn token included when one stopped a chat answer.
    ids: Vec<u32>,
    tokens: usize,
    /// With --chat: whether the model ended its turn (rather than running out of --tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    end_of_turn: Option<bool>,
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
    // A model of the built-in data shows what it learned: a sum it never saw, answered greedily.
    let addition_data =
        matches!(&source, Source::Run(_, c) if c.config.data == DataSourceConfig::Addition);
    let problem = (args.prompt.is_none() && addition_data)
        .then(|| addition::held_out_problems(1, args.seed).first().copied())
        .flatten();
    let (prompt_text, temperature) = match (&args.prompt, problem) {
        (Some(p), _) => (p.clone(), args.temperature.unwrap_or(0.8)),
        // After a newline: the start of a line, as every sum in training begins.
        (None, Some(p)) if !args.chat => (
            format!("\n{}", p.question()),
            args.temperature.unwrap_or(0.0),
        ),
        _ => (String::new(), args.temperature.unwrap_or(0.8)),
    };
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
    let (prompt_text, prompt, stop) = if args.chat {
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
        (chat.text, chat.ids, chat.stop)
    } else {
        let ids = tokenizer.encode(&prompt_text).map_err(|e| {
            let context = format!("encoding {what} with {tokenizer_name}");
            match tokenizer.unencodable_char(&prompt_text) {
                Some(why) => anyhow::anyhow!("{context}: {why}"),
                None => anyhow::Error::new(e).context(context),
            }
        })?;
        (prompt_text, ids, Vec::new())
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
    let opts = SampleOptions {
        temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let start = Instant::now();
    let ids = sampler.generate_until(&prompt, args.tokens, opts, &stop)?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let end_of_turn = args
        .chat
        .then(|| ids.last().is_some_and(|t| stop.contains(t)));
    // The answer's text leaves out the token that ended the turn.
    let shown = match end_of_turn {
        Some(true) => &ids[..ids.len() - 1],
        _ => &ids[..],
    };
    let text = tokenizer.decode(shown);
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
        eprintln!(
            "({} tokens in {:.0} ms, {:.1} tok/s{} of {} positions{} on {}; {} at step {}; inference plan peak {}, measured {})",
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
        let (path, ckpt) = checkpoint::load(from)?;
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
