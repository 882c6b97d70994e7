//! `snug`: plan a training step's memory before anything runs, and train.

mod bench_cmd;
mod dashboard;
mod devices_cmd;
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
use snug_train::{ModelSection, RunFlags, StepFlags, TrainConfig, TrainSection};

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
    /// Train a model (with no arguments: a small Llama, `llama-tiny`, on built-in generated addition data).
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
    /// Write a checkpoint as a Hugging Face model directory (GPT-2, Llama, Mistral, Qwen2).
    Export(export_cmd::ExportArgs),
    /// Time named training-step benchmarks (step time, tokens/s, model FLOP/s, MFU, memory).
    Bench(bench_cmd::BenchArgs),
    /// List the devices `--device` can name: the CPU and every GPU adapter, with its limits.
    Devices(devices_cmd::DevicesArgs),
    /// Write one offline HTML page: the step's memory timeline, pass savings, fit's
    /// candidates, a run's curves and the device table.
    Report(report_cmd::ReportArgs),
}

/// Flags shared by every command that builds a model. The model's and the step's are declared
/// with their TOML keys in snug-train ([`ModelSection`], [`StepFlags`]); these are the command
/// line's own.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    #[command(flatten)]
    model: ModelSection,
    /// TOML file with [model] and [train] sections (flags override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Sequences per step, or `auto` with --memory (fit and train): the largest batch whose
    /// micro-batch fits the budget without accumulation.
    #[arg(long, value_name = "N|auto")]
    batch: Option<BatchArg>,
    /// Sequence length (same as --block).
    #[arg(long, conflicts_with = "block")]
    seq: Option<usize>,
    #[command(flatten)]
    step: StepFlags,
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

    /// The `[model]` and `[train]` overrides these flags give, with `run`'s (`snug train`'s
    /// own flags) beside them.
    fn sections(&self, run: RunFlags) -> (ModelSection, TrainSection) {
        let mut train = TrainSection::from_flags(self.step.clone(), run);
        train.batch = match self.batch {
            Some(BatchArg::Sequences(n)) => Some(n),
            _ => None,
        };
        train.block = train.block.or(self.seq);
        (self.model.clone(), train)
    }

    /// The run `--config` and the flags describe ([`TrainConfig::resolve`]), refusing a model
    /// they describe ambiguously: a file naming both a preset and a config.json, and a flag
    /// naming the model beside a file's shape keys, which were written for the file's model
    /// and which the flag's would drop (a model named by a flag starts from that model alone).
    fn resolve(&self, model: &ModelSection, train: &TrainSection) -> anyhow::Result<TrainConfig> {
        let file = self.config.as_deref();
        let cfg = TrainConfig::resolve(file, model, train)?;
        let Some(file) = file else {
            return Ok(cfg);
        };
        // Both come from the file: the flags conflict, and one names the model alone.
        if let (Some(preset), Some(hf)) = (&cfg.model.preset, &cfg.model.hf_config) {
            anyhow::bail!(
                "{}: [model] names both preset `{preset}` and hf_config {}: give one",
                file.display(),
                hf.display()
            );
        }
        let flag = match (&model.preset, &model.hf_config) {
            (Some(p), _) => format!("--preset {p}"),
            (None, Some(p)) => format!("--hf-config {}", p.display()),
            (None, None) => return Ok(cfg),
        };
        // The file's [model] as it resolves without the flag. Where that fails (a file whose
        // model validates only with the flag's), nothing is known to be dropped.
        let unnamed = ModelSection {
            preset: None,
            hf_config: None,
            ..model.clone()
        };
        let Ok(alone) = TrainConfig::resolve(Some(file), &unnamed, train) else {
            return Ok(cfg);
        };
        let (a, c) = (&alone.model, &cfg.model);
        let mut keys = vec![
            ("n_layer", a.n_layer, c.n_layer),
            ("n_head", a.n_head, c.n_head),
            ("n_embd", a.n_embd, c.n_embd),
            ("block_size", a.block_size, c.block_size),
        ];
        // Pretrained weights set the vocabulary themselves, where the file gave none.
        if cfg.hf_init_dir().is_none() {
            keys.push(("vocab_size", a.vocab_size, c.vocab_size));
        }
        let dropped: Vec<String> = keys
            .into_iter()
            .filter_map(|(key, in_file, used)| match in_file {
                Some(v) if used != in_file => Some(format!("{key} = {v}")),
                _ => None,
            })
            .collect();
        if !dropped.is_empty() {
            anyhow::bail!(
                "{flag} names the model, and {}'s [model] sets {}, written for the model the file \
                 names: a flag's model starts from that model alone and would drop them; name \
                 the model in the file (preset or hf_config) or take those keys out",
                file.display(),
                dropped.join(", ")
            );
        }
        Ok(cfg)
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
    // Mesa's device-select Vulkan layer, loaded into every Vulkan process, orders the GPUs by
    // the display it finds, and on a machine without one prints "error: XDG_RUNTIME_DIR is
    // invalid" at every enumeration. Without it `gpu:N` counts alike with a display or
    // without; a user's own setting is kept. Set before any thread starts.
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
    // Diagnostics (checkpoints saved, runs resumed, warnings) go to stderr through `tracing`;
    // `SNUG_LOG=debug` (or any filter) changes the level.
    // Of the ranks of a run over MPI, rank 0 alone reports; the others say only errors.
    let quiet_rank = snug_mpi::launched_rank().is_some_and(|r| r != 0);
    let filter = tracing_subscriber::EnvFilter::try_from_env("SNUG_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if quiet_rank { "error" } else { "info" })
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
    let cmd = command();
    let cli = match Cli::from_arg_matches(&cmd.get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Train(args) => return train_over_ranks(*args),
        Command::Plan(args) => plan_cmd::run(args),
        Command::Fit(args) => fit_cmd::run(args),
        Command::Profile(args) => profile_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Prepare(args) => prepare_cmd::run(args),
        Command::Sample(args) => sample_cmd::run(args),
        Command::Export(args) => export_cmd::run(args),
        Command::Report(args) => report_cmd::run(args),
        Command::Devices(args) => devices_cmd::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            print_error(format_args!("error: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// Writes one line to standard error in one `write`. `eprintln!` writes a message piece by
/// piece (anyhow's chain of causes, each a write of its own), and under `mpirun` the ranks'
/// pieces reach the terminal through one pipe, so two ranks' errors came out interleaved
/// mid-sentence. A pipe keeps a write of up to 4 KiB whole.
fn print_error(message: std::fmt::Arguments<'_>) {
    let _ = write_line_whole(&mut std::io::stderr().lock(), message);
}

fn write_line_whole(
    out: &mut impl std::io::Write,
    message: std::fmt::Arguments<'_>,
) -> std::io::Result<()> {
    out.write_all(format!("{message}\n").as_bytes())
}

/// `snug train`, as one rank of a run `mpirun` (or `srun`) started, or alone. An error on one
/// rank ends every rank (`MPI_Abort`), so none waits in a collective for a rank that left.
fn train_over_ranks(args: train_cmd::TrainArgs) -> ExitCode {
    let mpi = match snug_mpi::init() {
        Ok(m) => m,
        Err(e) => {
            print_error(format_args!("error: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let (rank, ranks) = snug_cpu::kernels::collective::world();
    if rank != 0 {
        silence_stdout();
    }
    match train_cmd::run(args) {
        Ok(code) => code,
        Err(e) if ranks > 1 => {
            print_error(format_args!("error: rank {rank} of {ranks}: {e:#}"));
            mpi.abort(1)
        }
        Err(e) => {
            print_error(format_args!("error: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// Refuses a `--threads` flag this machine cannot run: zero, or more than its CPUs (each is an
/// OS thread; 100,000 of them hung a run). Checked before anything loads.
fn check_threads_flag(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            anyhow::bail!("--threads: must be at least 1");
        }
        snug_train::config::check_threads_here(n)?;
    }
    Ok(())
}

/// Sends standard output to /dev/null: ranks other than 0 print nothing.
fn silence_stdout() {
    #[cfg(unix)]
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        use std::os::fd::AsRawFd;
        // SAFETY: duplicating an open descriptor over stdout's, before any thread writes it.
        unsafe {
            libc::dup2(null.as_raw_fd(), libc::STDOUT_FILENO);
        }
    }
}

/// The command line as parsed: `--steps -1` should be refused as a bad value of `--steps`, not
/// as an unknown flag `-1`. A flag given twice takes its last value, so a suggested change can
/// be appended to a command as it is.
fn command() -> clap::Command {
    Cli::command().mut_subcommands(|sub| {
        // A preset and a config.json both name the model; given both, one was ignored unsaid.
        let names_model = |id: &str| sub.get_arguments().any(|a| a.get_id() == id);
        let sub = if names_model("preset") && names_model("hf_config") {
            sub.mut_arg("preset", |a| a.conflicts_with("hf_config"))
        } else {
            sub
        };
        sub.args_override_self(true).mut_args(|a| {
            // A switch declared as `num_args = 0` takes no value, and clap (in debug builds)
            // refuses negative numbers on it.
            let takes_value = a.get_num_args().is_none_or(|n| n.max_values() > 0);
            if !(a.get_action().takes_values() && takes_value) {
                return a;
            }
            // `-1GiB` is no number, so clap would take it for the flag `-1`; a size flag takes
            // any value and its own parser names the flag. (Its cost: `--memory --json` reads
            // `--json` as the size, which is refused by name too.)
            let size = a
                .get_value_names()
                .is_some_and(|names| names.iter().any(|n| n.contains("SIZE")));
            a.allow_negative_numbers(true).allow_hyphen_values(size)
        })
    })
}

#[cfg(test)]
mod tests {
    /// clap checks a command's consistency (with debug assertions on, as under `cargo test`)
    /// only for the subcommand being parsed; this checks every subcommand.
    #[test]
    fn the_command_line_is_consistent() {
        super::command().debug_assert();
    }

    /// Each `write` it is given, as a pipe would pass it on.
    struct Writes(Vec<String>);

    impl std::io::Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(String::from_utf8_lossy(buf).into_owned());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A rank's error, an anyhow chain of causes, reaches the terminal in one write, which a
    /// pipe keeps whole among other ranks' (`eprintln!` writes the pieces one by one:
    /// `cli/tests/mpi.rs` sees that as a race, this sees it every time).
    #[test]
    fn an_error_with_its_causes_is_one_write() {
        let e = anyhow::anyhow!("the cause").context("setting up training");
        let mut out = Writes(Vec::new());
        super::write_line_whole(&mut out, format_args!("error: rank 1 of 2: {e:#}")).unwrap();
        assert_eq!(
            out.0,
            ["error: rank 1 of 2: setting up training: the cause\n"]
        );
        // What eprintln! does, for contrast: the same line in several writes.
        let mut pieces = Writes(Vec::new());
        std::io::Write::write_fmt(&mut pieces, format_args!("error: rank 1 of 2: {e:#}\n"))
            .unwrap();
        assert!(pieces.0.len() > 1, "{:?}", pieces.0);
    }
}
