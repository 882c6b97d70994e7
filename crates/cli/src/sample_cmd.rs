//! `snug sample`: generate text from a checkpoint, on the planner's inference plan (no
//! gradients, no optimizer state).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;
use snug_runtime::Allocator;
use snug_train::checkpoint;
use snug_train::sample::MAX_NEW_TOKENS;
use snug_train::{SampleOptions, Sampler, Tokenizer};

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A run directory (its newest checkpoint) or a checkpoint file.
    #[arg(long, value_name = "PATH")]
    checkpoint: PathBuf,
    /// Text to continue (empty: start from token 0).
    #[arg(long, default_value = "")]
    prompt: String,
    /// Tokens to generate (at most 1,000,000).
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Softmax temperature; 0 picks the most likely token every time.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the K most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Worker threads (default: physical cores).
    #[arg(long)]
    threads: Option<usize>,
    /// One JSON object with the text and figures.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct SampleReport {
    checkpoint: PathBuf,
    step: u64,
    prompt: String,
    text: String,
    tokens: usize,
    ms: f64,
    tokens_per_s: f64,
    planned_peak_bytes: usize,
    measured_peak_bytes: usize,
}

pub fn run(args: SampleArgs) -> Result<()> {
    // Before loading anything: a request this large is a mistake, not a long run.
    if args.tokens > MAX_NEW_TOKENS {
        bail!(
            "--tokens: {} is more than the {MAX_NEW_TOKENS} tokens snug sample generates in one run",
            args.tokens
        );
    }
    let (path, ckpt) = checkpoint::load(&args.checkpoint)?;
    let tokenizer = Tokenizer::from_spec(&ckpt.tokenizer)?;
    let model = ckpt.model()?;
    let prompt = tokenizer
        .encode(&args.prompt)
        .context("encoding --prompt with the checkpoint's tokenizer")?;
    let allocator = Allocator::default();
    let threads = args.threads.unwrap_or_else(snug_runtime::physical_cores);
    let mut sampler = Sampler::new(&model, &ckpt.parameters(), threads, allocator.clone())
        .with_context(|| format!("loading {}", path.display()))?;
    let opts = SampleOptions {
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let start = Instant::now();
    let ids = sampler.generate(&prompt, args.tokens, opts)?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let text = tokenizer.decode(&ids);
    let report = SampleReport {
        checkpoint: path,
        step: ckpt.step,
        prompt: args.prompt,
        text,
        tokens: ids.len(),
        ms,
        tokens_per_s: ids.len() as f64 / (ms / 1e3).max(1e-9),
        planned_peak_bytes: sampler.plan().peak_bytes(),
        measured_peak_bytes: allocator.peak_bytes(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}{}", report.prompt, report.text);
        eprintln!(
            "({} tokens in {:.0} ms, {:.1} tok/s; {} at step {}; inference plan peak {}, measured {})",
            report.tokens,
            report.ms,
            report.tokens_per_s,
            report.checkpoint.display(),
            report.step,
            human_bytes(report.planned_peak_bytes),
            human_bytes(report.measured_peak_bytes)
        );
    }
    Ok(())
}
