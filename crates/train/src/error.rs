use std::path::PathBuf;

use snug_graph::GraphError;
use snug_nn::NnError;
use snug_plan::memory_plan::human_bytes;
use snug_plan::PlanError;
use snug_runtime::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    // The cause is the error's source; `{:#}` (anyhow) prints it after the path.
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: is {kind}, not a regular file (snug reads only regular files)")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("{path}: larger than {} ({limit} bytes), the most snug reads into memory as {what}", snug_plan::memory_plan::human_bytes(usize::try_from(*.limit).unwrap_or(usize::MAX)))]
    TooLarge {
        path: PathBuf,
        what: &'static str,
        limit: u64,
    },
    #[error("{path}: a text file is read and tokenized in memory, outside the plan: its {} of text take up to {} while they load (the text, its ids while encoded, the two splits' copies) and {} is the whole --memory budget; prepare it once (`snug prepare --input {path} --tokenizer char --out DIR`) and train on DIR, whose token files are memory-mapped", snug_plan::memory_plan::human_bytes(usize::try_from(*.text_bytes).unwrap_or(usize::MAX)), snug_plan::memory_plan::human_bytes(usize::try_from(*.load_bytes).unwrap_or(usize::MAX)), snug_plan::memory_plan::human_bytes(usize::try_from(*.budget).unwrap_or(usize::MAX)))]
    TextDataOverBudget {
        path: PathBuf,
        text_bytes: u64,
        load_bytes: u64,
        budget: u64,
    },
    #[error("{path}: the data file is empty")]
    EmptyData { path: PathBuf },
    #[error("{what}: the {split} split holds {tokens} tokens, too few for one sequence of block + 1 = {needed} tokens")]
    DataTooSmall {
        what: String,
        /// `"training"` or `"validation"`: the split that is too small.
        split: &'static str,
        /// That split's own token count.
        tokens: usize,
        needed: usize,
    },
    #[error("checkpoint {path}: {detail}")]
    Checkpoint { path: PathBuf, detail: String },
    /// Written by a newer snug: not damaged, and never moved aside or passed over for an
    /// older checkpoint (that would fork the run's history).
    #[error("checkpoint {path} was written by a newer snug (format version {version}; this snug reads versions up to {newest}): continue the run with that snug or a newer one; the file is left as it is")]
    CheckpointTooNew {
        path: PathBuf,
        version: u32,
        newest: u32,
    },
    /// A checkpoint, read whole, whose tensors do not fit the run restoring it (the caller,
    /// which knows the file, names it).
    #[error("the checkpoint does not fit this run: {detail}")]
    CheckpointMismatch { detail: String },
    #[error("run directory {dir} is in use by another snug process (it holds the directory's lock); wait for it to finish or give another `--out`")]
    RunDirBusy { dir: PathBuf },
    #[error("run directory {dir}: {detail}")]
    RunDirTaken { dir: PathBuf, detail: String },
    /// A path a command was told to write that already holds something; `--force` replaces it.
    #[error("{path}: {detail}")]
    OutputExists { path: PathBuf, detail: String },
    /// A path a command never writes, even with `--force`: a run directory or its files, a
    /// checkpoint, a directory where a file goes, a device.
    #[error("{path}: {detail}")]
    OutputRefused { path: PathBuf, detail: String },
    /// Caught at load: resumed, it would surface steps later as a NaN loss.
    #[error("checkpoint {path}: tensor `{name}` holds {value} at index {index}: a checkpoint's values must be finite")]
    NonFiniteCheckpoint {
        path: PathBuf,
        name: String,
        index: usize,
        value: f32,
    },
    #[error("no loadable checkpoint in {dir}: {detail}")]
    NoCheckpoint { dir: PathBuf, detail: String },
    #[error("character {ch:?} is not in the tokenizer's vocabulary of {vocab} symbols")]
    UnknownChar { ch: char, vocab: usize },
    /// A resumed run's data is not the data it trained on.
    #[error("the run's data ({data}) is not what it trained on: its tokens' CRC-32 is {now:08x}, the checkpoint recorded {saved:08x}, so a resume on it would not continue the run exactly; give `--data` (this path or another) to train on it anyway")]
    DataChanged { data: String, saved: u32, now: u32 },
    /// Text data the run's tokenizer cannot encode.
    #[error("{path}: the {tokenizer} tokenizer cannot encode this text: {detail}")]
    DataEncoding {
        path: PathBuf,
        tokenizer: String,
        detail: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A Hugging Face tokenizer file (`tokenizer.json`, `tokenizer_config.json`, the chat
    /// template) that is not what it should be; `field` is the JSON field at fault, if one is.
    #[error("{path}: {}{detail}", field.as_ref().map(|f| format!("`{f}` ")).unwrap_or_default())]
    HfTokenizerFile {
        path: PathBuf,
        field: Option<String>,
        detail: String,
    },
    /// The chat template of `path` failed to render; `message` is the template's own where it
    /// raised one (`raise_exception`).
    #[error("{path}: `chat_template` failed to render: {message}")]
    ChatTemplate { path: PathBuf, message: String },
    /// Chat sampling asked of a model whose tokenizer has no chat template.
    #[error("{tokenizer} has no chat template to render a conversation with")]
    NoChatTemplate { tokenizer: String },
    #[error("the tokenizer's ids run up to {} but the model's vocabulary (`vocab_size`) holds {model}: the tokenizer is not the model's", .tokenizer.saturating_sub(1))]
    VocabMismatch {
        /// One more than the tokenizer's largest id.
        tokenizer: usize,
        model: usize,
    },
    /// A line of a JSONL data file that is not an example.
    #[error("{path}: line {line}: {detail}")]
    JsonlLine {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    /// A well-formed JSONL example that could not be tokenized (a chat template that refused
    /// it, a tokenizer without an end-of-sequence token).
    #[error("{path}: line {line}: {problem}")]
    JsonlExample {
        path: PathBuf,
        line: usize,
        problem: Box<TrainError>,
    },
    /// The problem is part of the message, not a `source`, so error chains print it once.
    #[error("{path}: {problem}")]
    TokenFile {
        path: PathBuf,
        problem: crate::token_file::TokenFileProblem,
    },
    #[error("the data prefetch thread stopped: {0}")]
    Prefetch(String),
    #[error("a step's batch of {count} sequences × {block} tokens is too large to prepare: its token buffers (four batches in flight, 9 bytes a token) need {}, more than this machine has available ({}): lower --batch", bytes.map_or("over 16 EiB".into(), human_bytes), available.map_or("unknown".into(), human_bytes))]
    BatchTooLarge {
        count: usize,
        block: usize,
        bytes: Option<usize>,
        available: Option<usize>,
    },
    #[error("{path}: {message}")]
    ConfigFile { path: PathBuf, message: String },
    #[error("config: `{field}` {detail}")]
    Config { field: &'static str, detail: String },
    #[error("the ranks of this run were started with different settings: {detail} (start every rank with the same flags, configuration and data)")]
    RanksDisagree { detail: String },
    #[error(
        "the training step needs {} ({needed} bytes, its planned peak) but {}: lower the batch or block size, or let `snug fit --memory SIZE` find a configuration that fits",
        human_bytes(*needed),
        match limit {
            Some(l) => format!("the memory limit is {} ({l} bytes)", human_bytes(*l)),
            None => "the system (or the GPU's driver) refused it, below any memory limit set".into(),
        }
    )]
    DoesNotFit {
        needed: usize,
        /// The limit that refused it; `None` when the system itself did, under the limit.
        limit: Option<usize>,
    },
    #[error(
        "out of memory in the evaluation after step {step}: {detail} (over several ranks an \
         evaluation does not switch to a smaller configuration as a step does)"
    )]
    EvaluationOutOfMemory { step: u64, detail: String },
    #[error(
        "out of memory at step {step} ({failure}) and no smaller configuration fits: {detail}"
    )]
    Unrecoverable {
        step: u64,
        failure: snug_runtime::OutOfMemory,
        detail: String,
    },
    /// A batch given to [`crate::Trainer::step_on`] whose `field` (`tokens`, `targets` or
    /// `mask`) does not hold one entry per position of the trainer's batch.
    #[error("batch: `{field}` holds {found} entries, the step takes batch × block = {batch} × {block} = {expected}")]
    BatchLength {
        field: &'static str,
        expected: usize,
        found: usize,
        batch: usize,
        block: usize,
    },
    /// A token id or target of a given batch outside the model's vocabulary.
    #[error("batch: `{field}`[{index}] is {value}, outside the model's vocabulary of {vocab}")]
    BatchToken {
        field: &'static str,
        index: usize,
        value: i32,
        vocab: usize,
    },
    /// A given batch carries a loss mask, but the trainer's step was compiled without one.
    #[error("batch: it has a loss mask but the trainer's step takes none (set `loss_mask` in the configuration, or train on data with a mask)")]
    BatchMask,
    #[error("loss is {loss} at step {step}: training diverged (lower the learning rate)")]
    NonFinite { step: u64, loss: f32 },
    #[error("the model's logits at position {position} are not finite: its weights hold NaN or infinity")]
    NonFiniteLogits { position: usize },
    #[error(transparent)]
    Compile(#[from] snug_compile::CompileError),
    #[error(transparent)]
    Fit(#[from] snug_fit::FitError),
    #[error(transparent)]
    Model(#[from] NnError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The GPU could not be opened (no adapter, a `gpu:N` past the last one, no device).
    #[error(transparent)]
    Gpu(#[from] snug_gpu::GpuError),
}
