//! `snug prepare`: tokenize a text corpus, or JSONL examples with their loss masks, once into
//! `train.bin` and `val.bin`, which `snug train --data DIR` then memory-maps instead of
//! tokenizing on every run. Token files already there are replaced only with `--force`, and a
//! run directory is never written into.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;
use snug_train::data::{TRAIN_FILE, VAL_FILE};
use snug_train::output::{self, DirContents};
use snug_train::token_file::TokenDtype;
use snug_train::user_file::{read_text, MAX_TEXT_BYTES};
use snug_train::{CharTokenizer, HfTokenizer, StagedTokenFile, TokenFile, Tokenizer, TrainError};

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// UTF-8 text file to tokenize.
    #[arg(long)]
    input: PathBuf,
    /// gpt2 (GPT-2's BPE, 50,257 tokens), char (one token per distinct character of the text),
    /// or a Hugging Face tokenizer: its model directory or its tokenizer.json.
    #[arg(long)]
    tokenizer: String,
    /// text: the file is one corpus. jsonl: one example a line, {"text"}, {"prompt",
    /// "completion"} or {"messages": [...]} (the tokenizer's chat template), packed with EOS
    /// between them; only completions and assistant turns count in the loss.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Directory to write train.bin and val.bin into (created if missing; other files in it
    /// are left). Existing token files there are refused unless --force; a run directory
    /// always.
    #[arg(long)]
    out: PathBuf,
    /// Replace train.bin and val.bin where they already exist (each atomically). Never in a
    /// run directory.
    #[arg(long)]
    force: bool,
    /// Share of the tokens, taken from the end, kept for validation.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Jsonl,
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
    /// JSONL only: examples read, and the tokens whose prediction counts in the loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    examples: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    loss_tokens: Option<usize>,
    /// What prepare wrote but `train` will refuse or make little of (also on stderr).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
}

/// `--tokenizer`'s Hugging Face tokenizer, if it names one.
pub(crate) fn hf_tokenizer(arg: &str) -> Result<Option<HfTokenizer>> {
    let path = Path::new(arg);
    if matches!(arg, "gpt2" | "char") {
        return Ok(None);
    }
    if !path.exists() {
        bail!("--tokenizer: unknown tokenizer `{arg}` (expected gpt2, char, or a Hugging Face tokenizer directory or tokenizer.json)");
    }
    let t = if path.is_dir() {
        HfTokenizer::from_dir(path)?
    } else {
        HfTokenizer::from_file(path)?
    };
    Ok(Some(t))
}

/// Refuses an `--input` that is one of the files prepare writes into `out` (given by that
/// name, through a symlink, or as a hard link to it): `--force` would replace the corpus with
/// its own tokens. A `train.bin` that is itself a symlink to the input is not refused: the
/// rename replaces the link and leaves the corpus whole.
fn refuse_overwriting_input(input: &Path, out: &Path) -> Result<()> {
    for name in [TRAIN_FILE, VAL_FILE] {
        let target = out.join(name);
        if snug_train::output::same_file(input, &target) {
            bail!(
                "--input {} is the file prepare would write as {}: it would overwrite the \
                 corpus with its tokens, even with --force; give another --out or move the input",
                input.display(),
                target.display()
            );
        }
    }
    Ok(())
}

/// Refuses, before the corpus is read, a Hugging Face tokenizer with no end-of-sequence token
/// for JSONL, naming the `tokenizer_config.json` that would give it by its full path (the
/// error deeper down names the file alone, not which directory's). `special_tokens_map.json`
/// may give it too, where transformers reads that file.
fn check_eos(arg: &str, tokenizer: &HfTokenizer) -> Result<()> {
    if tokenizer.special_tokens().eos.is_some() {
        return Ok(());
    }
    let given = Path::new(arg);
    let dir = if given.is_dir() {
        given
    } else {
        given.parent().unwrap_or(Path::new(""))
    };
    let config = dir.join(snug_train::hf_tokenizer::CONFIG_FILE);
    let problem = if config.exists() {
        "has no `eos_token`"
    } else {
        "is missing, so there is no `eos_token`"
    };
    bail!(
        "--tokenizer {arg}: {} {problem} (nor does a {} that transformers reads): JSONL \
         examples are packed with an end-of-sequence token between them (vocabulary of {})",
        config.display(),
        snug_train::hf_tokenizer::SPECIAL_TOKENS_MAP_FILE,
        tokenizer.vocab_size()
    );
}

pub fn run(args: PrepareArgs) -> Result<()> {
    let start = Instant::now();
    // Check the cheap arguments before reading a corpus that may be large.
    let hf = hf_tokenizer(&args.tokenizer)?;
    if args.format == Format::Jsonl && args.tokenizer == "char" {
        bail!("--tokenizer: char has no end-of-sequence token to separate JSONL examples with; use gpt2 or a Hugging Face tokenizer");
    }
    if let (Format::Jsonl, Some(t)) = (args.format, &hf) {
        check_eos(&args.tokenizer, t)?;
    }
    let frac = args.val_fraction;
    if !(frac.is_finite() && frac > 0.0 && frac < 1.0) {
        bail!("--val-fraction: must be between 0 and 1 (exclusive), got {frac}");
    }
    // Before check_dir: its advice (`--force`) would be the wrong fix here.
    refuse_overwriting_input(&args.input, &args.out)?;
    output::check_dir(
        &args.out,
        &[TRAIN_FILE, VAL_FILE],
        DirContents::AnythingElse,
        args.force,
    )?;
    let text = read_text(&args.input, MAX_TEXT_BYTES, "text data")?;
    if text.is_empty() {
        return Err(TrainError::EmptyData { path: args.input }.into());
    }
    let tokenizer = match (hf, args.tokenizer.as_str()) {
        (Some(t), _) => Tokenizer::Hf(t),
        (None, "char") => Tokenizer::Char(CharTokenizer::from_text(&text)),
        (None, _) => Tokenizer::gpt2(),
    };
    let encode_start = Instant::now();
    // Token ids and, for JSONL, masks and example counts of the two splits.
    type Split = (Vec<u32>, Option<Vec<bool>>);
    let (train, val, examples): (Split, Split, Option<usize>) = match args.format {
        Format::Text => {
            let mut ids = tokenizer.encode(&text)?;
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
            ((ids, None), (val, None), None)
        }
        Format::Jsonl => {
            let packed = snug_train::examples::tokenize_jsonl(&args.input, &text, &tokenizer)?;
            let count = packed.starts.len();
            // Split between examples, so none is cut in two.
            let Some((train, val)) = packed.split(frac) else {
                bail!(
                    "{}: {count} example(s) cannot be split into non-empty training and validation sets",
                    args.input.display()
                );
            };
            (
                (train.ids, Some(train.mask)),
                (val.ids, Some(val.mask)),
                Some(count),
            )
        }
    };
    let encode_seconds = encode_start.elapsed().as_secs_f64();
    let (train_tokens, val_tokens) = (train.0.len(), val.0.len());
    let tokens = train_tokens + val_tokens;
    let counted =
        |mask: &Option<Vec<bool>>| mask.as_ref().map(|m| m.iter().filter(|&&b| b).count());
    let loss_tokens =
        examples.map(|_| counted(&train.1).unwrap_or(0) + counted(&val.1).unwrap_or(0));
    // A split in which nothing counts: `train` refuses it (a loss of 0, or a validation loss
    // that always reads 0), which is better heard now than after the data is moved.
    let mut warnings = Vec::new();
    for (split, mask, file) in [
        ("training", &train.1, TRAIN_FILE),
        ("validation", &val.1, VAL_FILE),
    ] {
        if counted(mask) == Some(0) {
            warnings.push(format!(
                "no token of the {split} split ({}) counts in the loss: none of its examples \
                 has a completion or an assistant turn to learn (conversations of user turns \
                 only?), and `snug train` refuses such data",
                args.out.join(file).display()
            ));
        }
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    std::fs::create_dir_all(&args.out).map_err(|source| TrainError::Io {
        path: args.out.clone(),
        source,
    })?;
    // Both splits are written before either replaces an earlier pair, so a failure or an
    // interruption leaves the old pair whole rather than a new train.bin beside an old val.bin.
    // One mark in both files: a pair that does not share it is refused when read.
    let prepared = snug_train::token_file::prepare_mark(&[
        (&train.0, train.1.as_deref()),
        (&val.0, val.1.as_deref()),
    ]);
    let stage = |name: &str, (ids, mask): &Split| {
        TokenFile::stage(
            &args.out.join(name),
            &tokenizer,
            ids,
            mask.as_deref(),
            Some(&prepared),
        )
    };
    let (train_file, val_file) = (stage(TRAIN_FILE, &train)?, stage(VAL_FILE, &val)?);
    let sizes = StagedTokenFile::commit_together(vec![train_file, val_file])?;
    let (train_bytes, val_bytes) = (sizes[0], sizes[1]);
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
        examples,
        loss_tokens,
        warnings,
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
        if let (Some(n), Some(l)) = (report.examples, report.loss_tokens) {
            println!("{n} examples; {l} of the tokens count in the loss");
        }
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
