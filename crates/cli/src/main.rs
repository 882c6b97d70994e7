//! `snug`: plan a training step's memory before anything runs, and train.

mod bench_cmd;
mod export_cmd;
mod fit_cmd;
mod plan_cmd;
mod prepare_cmd;
mod profile_cmd;
mod report_cmd;
mod sample_cmd;
mod train_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use snug_train::{ModelSection, TrainSection};

#[derive(Parser)]
#[command(
    name = "snug",
    version,
    about = "Train neural networks on the memory you have"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no arguments: a small GPT on built-in generated addition data).
    Train(Box<train_cmd::TrainArgs>),
    /// Print a training step's predicted peak memory and its breakdown, allocating no tensor.
    Plan(plan_cmd::PlanArgs),
    /// The fastest configuration that fits a memory budget, and every candidate considered.
    Fit(fit_cmd::FitArgs),
    /// Time one training step op by op.
    Profile(profile_cmd::ProfileArgs),
    /// Tokenize a text file into train.bin and val.bin for `--data DIR`.
    Prepare(prepare_cmd::PrepareArgs),
    /// Generate text from a checkpoint.
    Sample(sample_cmd::SampleArgs),
    /// Write a checkpoint's GPT-2 weights as a Hugging Face model directory.
    Export(export_cmd::ExportArgs),
    /// Time named training-step benchmarks (step time, tokens/s, model FLOP/s, MFU, memory).
    Bench(bench_cmd::BenchArgs),
    /// Write one offline HTML page: the step's memory timeline, pass savings, fit's
    /// candidates, a run's curves and the device table.
    Report(report_cmd::ReportArgs),
}

/// Flags shared by every command that builds a model; each has a TOML key of the same name.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model preset: tiny, char-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-tiny,
    /// llama-7b, llama-13b, llama-70b.
    #[arg(long)]
    preset: Option<String>,
    /// TOML file with [model] and [train] sections (flags override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Text file, or directory prepared by `snug prepare`, to train on (default: built-in
    /// generated addition data).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per step, or `auto` with --memory (fit and train): the largest batch whose
    /// micro-batch fits the budget without accumulation.
    #[arg(long, value_name = "N|auto")]
    batch: Option<BatchArg>,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long)]
    block: Option<usize>,
    /// Override the model's vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// A Hugging Face config.json (GPT-2 or Llama family) instead of a preset.
    #[arg(long, value_name = "CONFIG_JSON")]
    hf_config: Option<PathBuf>,
    /// Mixed precision: f32 (default), bf16 or f16. Activations and their gradients are
    /// rounded to and stored in 16 bits; weights and optimizer state stay f32; f16 scales the
    /// loss dynamically.
    #[arg(long)]
    precision: Option<String>,
    /// Optimizer: adamw (default) or sgd.
    #[arg(long)]
    optimizer: Option<String>,
    /// Sequence length (same as --block).
    #[arg(long, conflicts_with = "block")]
    seq: Option<usize>,
    /// Worker threads (default: physical cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Micro-batches per step (gradient accumulation); --batch is the whole step's batch.
    #[arg(long)]
    accumulation: Option<usize>,
    /// Clip the global gradient norm to this value (0: off; default 1). Clipping needs every
    /// gradient before the first update, so they are all alive at once.
    #[arg(long, allow_negative_numbers = true)]
    grad_clip: Option<f32>,
    /// Graph passes, comma-separated: fused-ce (LM head + cross-entropy in tiles, no logits
    /// tensor), cse (common subexpressions), dce (dead code), inplace (ops write over an input
    /// that dies at them), none (no pass); remat=MODE and precision=TYPE set those options.
    /// Default: fused-ce,inplace.
    #[arg(long, value_name = "LIST")]
    passes: Option<String>,
    /// Activation checkpointing: none, block (every block), block:K (every K blocks),
    /// selective (keep matmul and attention outputs, recompute the rest), budget:SIZE (the
    /// least recomputation whose planned peak fits SIZE, e.g. budget:3GiB).
    #[arg(long, value_name = "MODE")]
    remat: Option<String>,
}

/// `--batch N` or `--batch auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchArg {
    Sequences(usize),
    Auto,
}

impl std::str::FromStr for BatchArg {
    type Err = String;

    fn from_str(s: &str) -> Result<BatchArg, String> {
        match s.trim() {
            "auto" => Ok(BatchArg::Auto),
            n => n
                .parse()
                .map(BatchArg::Sequences)
                .map_err(|_| format!("`{s}` is not a number of sequences or `auto`")),
        }
    }
}

impl ModelArgs {
    /// Whether `--batch auto` was given.
    fn batch_auto(&self) -> bool {
        self.batch == Some(BatchArg::Auto)
    }

    fn sections(&self) -> (ModelSection, TrainSection) {
        (
            ModelSection {
                preset: self.preset.clone(),
                vocab_size: self.vocab,
                hf_config: self.hf_config.clone(),
                ..Default::default()
            },
            TrainSection {
                data: self.data.clone(),
                batch: match self.batch {
                    Some(BatchArg::Sequences(n)) => Some(n),
                    _ => None,
                },
                block: self.block.or(self.seq),
                threads: self.threads,
                precision: self.precision.clone(),
                optimizer: self.optimizer.clone(),
                accumulation: self.accumulation,
                grad_clip: self.grad_clip,
                passes: self.passes.clone(),
                remat: self.remat.clone(),
                ..Default::default()
            },
        )
    }
}

fn main() -> ExitCode {
    // Like other Unix tools, stop quietly when the reader of our output goes away (`| head`)
    // instead of failing on every later print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Diagnostics (checkpoints saved, runs resumed, warnings) go to stderr through `tracing`;
    // `SNUG_LOG=debug` (or any filter) changes the level.
    let filter = tracing_subscriber::EnvFilter::try_from_env("SNUG_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
    // `--steps -1` should be refused as a bad value of `--steps`, not as an unknown flag `-1`.
    // A flag given twice takes its last value, so a suggested change can be appended to a
    // command as it is.
    let cmd = Cli::command().mut_subcommands(|sub| {
        sub.args_override_self(true).mut_args(|a| {
            if a.get_action().takes_values() {
                a.allow_negative_numbers(true)
            } else {
                a
            }
        })
    });
    let cli = match Cli::from_arg_matches(&cmd.get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Train(args) => train_cmd::run(*args),
        Command::Plan(args) => plan_cmd::run(args),
        Command::Fit(args) => fit_cmd::run(args),
        Command::Profile(args) => profile_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Prepare(args) => prepare_cmd::run(args),
        Command::Sample(args) => sample_cmd::run(args),
        Command::Export(args) => export_cmd::run(args),
        Command::Report(args) => report_cmd::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
