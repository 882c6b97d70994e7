//! `snug prepare`: tokenize a text corpus once into `train.bin` and `val.bin`, which
//! `snug train --data DIR` then memory-maps instead of tokenizing on every run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;
use snug_train::data::{TRAIN_FILE, VAL_FILE};
use snug_train::token_file::TokenDtype;
use snug_train::user_file::{read_text, MAX_TEXT_BYTES};
use snug_train::{CharTokenizer, TokenFile, Tokenizer, TrainError};

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// UTF-8 text file to tokenize.
    #[arg(long)]
    input: PathBuf,
    /// gpt2 (GPT-2's BPE, 50,257 tokens) or char (one token per distinct character of the text).
    #[arg(long)]
    tokenizer: String,
    /// Directory to write train.bin and val.bin into (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Share of the tokens, taken from the end, kept for validation.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    input: PathBuf,
    out: PathBuf,
    tokenizer: &'static str,
    vocab_size: usize,
    dtype: &'static str,
    input_bytes: usize,
    tokens: usize,
    train_tokens: usize,
    val_tokens: usize,
    train_bytes: u64,
    val_bytes: u64,
    encode_seconds: f64,
    seconds: f64,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    let start = Instant::now();
    // Check the cheap arguments before reading a corpus that may be large.
    if !matches!(args.tokenizer.as_str(), "gpt2" | "char") {
        bail!(
            "--tokenizer: unknown tokenizer `{}` (expected gpt2 or char)",
            args.tokenizer
        );
    }
    let frac = args.val_fraction;
    if !(frac.is_finite() && frac > 0.0 && frac < 1.0) {
        bail!("--val-fraction: must be between 0 and 1 (exclusive), got {frac}");
    }
    let text = read_text(&args.input, MAX_TEXT_BYTES, "text data")?;
    if text.is_empty() {
        return Err(TrainError::EmptyData { path: args.input }.into());
    }
    let tokenizer = match args.tokenizer.as_str() {
        "char" => Tokenizer::Char(CharTokenizer::from_text(&text)),
        _ => Tokenizer::gpt2(),
    };
    let encode_start = Instant::now();
    let mut ids = tokenizer.encode(&text)?;
    let encode_seconds = encode_start.elapsed().as_secs_f64();
    let tokens = ids.len();
    let val_tokens = ((tokens as f64 * frac).round() as usize).min(tokens);
    let train_tokens = tokens - val_tokens;
    if val_tokens == 0 || train_tokens == 0 {
        bail!(
            "{}: {tokens} tokens cannot be split into non-empty training and validation sets with --val-fraction {frac}",
            args.input.display()
        );
    }
    let val = ids.split_off(train_tokens);
    std::fs::create_dir_all(&args.out).map_err(|source| TrainError::Io {
        path: args.out.clone(),
        source,
    })?;
    let train_bytes = TokenFile::write(&args.out.join(TRAIN_FILE), &tokenizer, &ids)?;
    let val_bytes = TokenFile::write(&args.out.join(VAL_FILE), &tokenizer, &val)?;
    let report = Report {
        vocab_size: tokenizer.vocab_size(),
        dtype: match TokenDtype::for_vocab(tokenizer.vocab_size()) {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        },
        tokenizer: tokenizer.name(),
        input_bytes: text.len(),
        tokens,
        train_tokens,
        val_tokens,
        train_bytes,
        val_bytes,
        encode_seconds,
        seconds: start.elapsed().as_secs_f64(),
        input: args.input,
        out: args.out,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: {} of text -> {} tokens ({} train / {} val), {} tokenizer, vocab {}, stored as {}",
            report.input.display(),
            human_bytes(report.input_bytes),
            report.tokens,
            report.train_tokens,
            report.val_tokens,
            report.tokenizer,
            report.vocab_size,
            report.dtype
        );
        println!(
            "wrote {} ({} B) and {} ({} B) in {:.2} s (encoding {:.2} s, {:.1} MB/s)",
            report.out.join(TRAIN_FILE).display(),
            report.train_bytes,
            report.out.join(VAL_FILE).display(),
            report.val_bytes,
            report.seconds,
            report.encode_seconds,
            report.input_bytes as f64 / report.encode_seconds.max(1e-9) / 1e6
        );
    }
    Ok(())
}
